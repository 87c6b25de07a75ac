"""The sm90 (H200) SASS of the Triton kernels that a Python snippet launches, built on this CPU: no GPU needed.

Runs the snippet under the Triton interpreter with the GPU's launch shapes (kernels.common._GPU_LAUNCH, 132 SMs) and
kernel.py's dispatchers on the Triton path (kernel._triton), records each distinct launch (launch_record), compiles
it for sm90 in a process without the interpreter (build; the Triton wheel ships ptxas and cuobjdump) and prints, per
launch: SASS instructions, local-memory spills, shared memory, registers (with shared memory they set how many CTAs
share an SM), the longest chain of mma.sync adding into one accumulator, and every loop's length with its commonest
opcodes, its own chain and its wgmma waits.
tests/test_sm90_build.py builds every launch of a model run the same way. A decode kernel that is issue-bound pays
its loop's instructions per K block; but counts only guide: a shorter loop has measured slower (PERF_LOG.md).

    python -m tools.sass "x = torch.randn(1, 4096).bfloat16(); w = torch.randn(352, 4096).bfloat16()
    K.route(x, w, torch.zeros(352), 8, 3.0, quant=True)" [--tune KEY=VALUE] [--only NAME] [--dump DIR]

The snippet has torch, K (= kernel) and the kernels/ modules (moe_route.route_triton, ...) in scope; --tune sets
kernel.TUNING, which the dispatchers pass to the launchers.

A kernel change that should not change the machine code (a move, a merge behind a constexpr, a renamed argument) is
checked without a GPU: save the SASS of every launch of the interpreted model run (tests/interpreted_run.py, ~5
minutes) before and after, then compare (launches paired by kernel name, after --rename OLD=NEW, and by the
constexprs they share; instructions compared as text, then again without the constant-bank offsets of the
arguments):

    python -m tools.sass --save DIR_BEFORE; ...; python -m tools.sass --save DIR_AFTER
    python -m tools.sass --compare DIR_BEFORE DIR_AFTER [--rename OLD=NEW]
"""
import argparse
import collections
import contextlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton.language as tl  # kernels/ (whose @triton.jit needs TRITON_INTERPRET set first) is imported later
from triton.tools.tensor_descriptor import TensorDescriptor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's: kernel.py, kernels/, tests/
BUILD = """
import importlib, json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
for i, r in enumerate(json.load(open(sys.argv[1]))):
    cons = {k: tl.dtype(v["dtype"]) if isinstance(v, dict) else v for k, v in r["constexprs"].items()}
    fn = getattr(importlib.import_module(r["module"]), r["name"])
    src = ASTSource(fn=fn, signature=r["signature"], constexprs=cons,
                    attrs={(j,): [["tt.divisibility", 16]] for j in r["div16"]})
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=r["options"])
    except Exception as e:
        c = e  # a jit function called by the kernel fails as the cause of the kernel's error: report the innermost
        while c.__cause__ is not None:
            c = c.__cause__
        why = "" if c is e else f" | innermost cause: {type(c).__name__}: {str(c)[-400:]}"
        print(json.dumps({"error": f"{type(e).__name__}: {str(e)[:600]}{why}"}))
        continue
    open(f"{sys.argv[2]}/{i}.cubin", "wb").write(k.asm["cubin"])
    print(json.dumps({"shared": k.metadata.shared}))
"""
GPU_VALUES = {"DOT_DTYPE": tl.bfloat16, "PRECISE": True, "PDL": True}  # constexprs that differ under the interpreter
PTR = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float16: "*fp16", torch.float8_e4m3fn: "*fp8e4nv",
       torch.uint8: "*u8", torch.int8: "*i8", torch.int32: "*i32", torch.int64: "*i64", torch.bool: "*i1"}


def launch_record(fn, args, kwargs) -> dict:
    """(name, module, signature, constexprs, options, div16) of one interpreter launch of a kernels/ function,
    JSON-ready, with GPU_VALUES. div16: the arguments that the GPU launcher marks 16-divisible (pointers at 16-byte
    addresses, integers that are multiples of 16); without that hint the compiler neither vectorises nor pipelines
    their loads (an up to 20x smaller shared-memory footprint)."""
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args), **{k: v for k, v in kwargs.items() if k in params})
    sig, cons, div16 = {}, {}, []
    for i, (name, p) in enumerate(params.items()):
        v = bound.get(name, p.default)
        if (isinstance(v, torch.Tensor) and v.data_ptr() % 16 == 0 or isinstance(v, int) and not isinstance(v, bool)
                and v % 16 == 0) and p.annotation is not tl.constexpr:
            div16.append(i)
        if p.annotation is tl.constexpr:
            sig[name] = "constexpr"
            v = GPU_VALUES.get(name, v)
            cons[name] = {"dtype": v.name} if isinstance(v, tl.dtype) else v
        elif isinstance(v, torch.Tensor):
            sig[name] = PTR[v.dtype]
        elif isinstance(v, TensorDescriptor):
            sig[name] = f"tensordesc<{PTR[v.base.dtype][1:]}{list(v.block_shape)}>"
        elif v is None:  # an unused descriptor
            sig[name], cons[name] = "constexpr", None
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        else:
            assert isinstance(v, float), (fn.__name__, name, type(v))
            sig[name] = "fp32"
    opts = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg")}
    opts["launch_pdl"] = True
    return {"name": fn.__name__, "module": fn.__module__, "signature": sig, "constexprs": cons, "options": opts,
            "div16": div16}


def launch_key(fn, args, kwargs) -> tuple:
    """What Triton compiles a launch of an interpreted kernels/ function for: its name, its constexprs and the class
    of every other argument as the GPU launcher specialises it (an int: == 1, divisible by 16 or neither, i32 or
    i64, unless the kernel's do_not_specialize names it; a tensor: its dtype and 16-byte alignment), and the launch
    options. Two launches with one key share one compiled kernel."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    params = list(inspect.signature(fn.fn).parameters.values())
    bound = dict(zip([p.name for p in params], args), **{k: v for k, v in kwargs.items()})
    dns = set(fn.kwargs.get("do_not_specialize") or ())
    unaligned = set(fn.kwargs.get("do_not_specialize_on_alignment") or ())
    out = []
    for i, p in enumerate(params):
        v = bound.get(p.name, p.default)
        if p.annotation is tl.constexpr:
            out.append((p.name, v.name if isinstance(v, tl.dtype) else repr(v)))
        elif isinstance(v, TensorDescriptor):
            out.append((p.name, f"desc{list(v.block_shape)}"))
        else:
            spec = i not in dns and p.name not in dns
            align = i not in unaligned and p.name not in unaligned
            out.append((p.name, native_specialize_impl(BaseBackend, v, False, spec, align)))
    opts = tuple(sorted((k, v) for k, v in kwargs.items() if k in ("num_warps", "num_stages", "maxnreg",
                                                                   "enable_fp_fusion")))
    return fn.fn.__name__, tuple(out), opts


@contextlib.contextmanager
def _noting(note, execute: bool = True):
    """note(interpreted function, args, kwargs) for every launch of a kernels/ function made under the interpreter
    inside the block; with execute False the launches are only noted (their outputs stay as allocated)."""
    from triton.runtime.interpreter import InterpretedFunction
    run = InterpretedFunction.run

    def noting_run(self, *args, grid, warmup, **kwargs):
        if getattr(self.fn, "__module__", "").startswith("kernels."):
            note(self, args, kwargs)
            if not execute:
                return None
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    InterpretedFunction.run = noting_run
    try:
        yield
    finally:
        InterpretedFunction.run = run


@contextlib.contextmanager
def launch_keys(keys: set, execute: bool = True):
    """Adds the launch_key of every kernels/ launch made under the interpreter inside the block to `keys`; with
    execute False the launches are only recorded (their outputs stay as allocated)."""
    with _noting(lambda f, args, kwargs: keys.add(launch_key(f, args, kwargs)), execute):
        yield keys


@contextlib.contextmanager
def launch_records(seen: dict):
    """Adds the launch_record of every distinct kernels/ launch made under the interpreter inside the block to
    `seen` (keyed by its JSON); the launches run as usual."""
    def note(f, args, kwargs):
        r = launch_record(f.fn, args, kwargs)
        seen.setdefault(json.dumps(r, sort_keys=True), r)
    with _noting(note):
        yield seen


def build(launches: list, out_dir: str, timeout: int = 900) -> list:
    """Compiles each launch_record (its kernel from its module) for sm90 in a process without the interpreter; writes
    out_dir/<i>.cubin and
    returns per launch {"shared": bytes} or {"error": message}."""
    path = os.path.join(out_dir, "launches.json")
    with open(path, "w") as f:
        json.dump(launches, f)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", BUILD, path, out_dir], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"the sm90 build process failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def record(snippet: str, tune: list) -> list:
    """The distinct launches of the kernels/ Triton functions while the snippet runs under the interpreter."""
    import importlib
    import pkgutil

    import kernel
    import kernels
    from kernels import common
    common._GPU_LAUNCH, common._sms = True, lambda: 132
    kernel._triton = lambda x: True  # the dispatchers take the launchers on the snippet's CPU tensors
    try:
        kernel.set_tuning(tune)
    except ValueError as e:
        sys.exit(f"tools.sass: {e}")
    scope = {m.name: importlib.import_module(f"kernels.{m.name}") for m in pkgutil.iter_modules(kernels.__path__)}
    with torch.inference_mode(), launch_records({}) as seen:
        exec(snippet, {**scope, "torch": torch, "K": kernel, "kernel": kernel})
    return list(seen.values())


def mma_chain(ops) -> int:
    """The longest run of mma.sync (HMMA) in which each adds into the result of the one before (its accumulator
    operand is the previous one's destination register), in program order: a latency floor of the code, since each
    must wait for the last (one accumulator over K = 4096 in 16-wide steps: 256 of them). Other instructions' writes
    to those registers are not followed, so it is an upper bound."""
    depth, best = {}, 0
    for _, op, rest in ops:
        if op.startswith("HMMA"):
            regs = re.findall(r"\b(R\d+|RZ)\b", rest)
            depth[regs[0]] = depth.get(regs[3], 0) + 1 if len(regs) > 3 else 1
            best = max(best, depth[regs[0]])
    return best


def summary(sass: str) -> str:
    """Instruction count, spills, the longest mma.sync chain (mma_chain) and each loop (a backward branch: its target
    .. itself) with its top opcodes, its own chain and its wgmma waits (a wgmma group waited for before the next is
    issued: `WARPGROUP.DEPBAR.LE gsb0, 0x0`)."""
    ops = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(LINE.match, sass.splitlines()) if m]
    out = [f"{len(ops)} instructions, STL {sum(o == 'STL' for _, o, _ in ops)}, "
           f"BAR.SYNC {sum(o.startswith('BAR.SYNC') for _, o, _ in ops)}, mma.sync chain {mma_chain(ops)}"]
    for addr, op, rest in ops:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            body = [o for o in ops if int(target.group(1), 16) <= o[0] <= addr]
            count = collections.Counter(o for _, o, _ in body)
            waits = sum(o.startswith("WARPGROUP.DEPBAR") and "0x0" in r for _, o, r in body)
            out.append(f"  loop {int(target.group(1), 16):#x}-{addr:#x}: {len(body)} instructions (mma.sync chain "
                       f"{mma_chain(body)}, wgmma waits {waits}), "
                       + ", ".join(f"{o} {n}" for o, n in count.most_common(8)))
    return "\n".join(out)


def cuobjdump(*args) -> str:
    import triton  # its wheel carries the CUDA binary tools
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([tool, *args], capture_output=True, text=True, check=True).stdout


def save(out_dir: str):
    """The model run's launches built for sm90: out_dir/index.json (each launch's record and file) and
    out_dir/<i>.sass (its instructions, the function's name left out). The run is tests/interpreted_run.py's, in a
    process of its own as the test session runs it."""
    os.makedirs(out_dir, exist_ok=True)
    run = os.path.join(out_dir, "model_run.pt")
    subprocess.run([sys.executable, os.path.join(ROOT, "tests", "interpreted_run.py"), run], cwd=ROOT, check=True)
    launches = list(torch.load(run, weights_only=False)[2].values())
    index = []
    for i, (r, b) in enumerate(zip(launches, build(launches, out_dir))):
        entry = {"record": r, **b}
        if "error" not in b:
            cubin = os.path.join(out_dir, f"{i}.cubin")
            lines = [ln for ln in cuobjdump("-sass", cubin).splitlines() if LINE.match(ln)]
            open(os.path.join(out_dir, f"{i}.sass"), "w").write("\n".join(lines) + "\n")
            os.remove(cubin)
            entry["file"] = f"{i}.sass"
        index.append(entry)
    json.dump(index, open(os.path.join(out_dir, "index.json"), "w"), indent=1)
    print(f"tools.sass: {len(index)} launches of {len({e['record']['name'] for e in index})} kernels in {out_dir}")


def compare(before: str, after: str, renames: dict) -> bool:
    """Pairs each launch saved in `before` with one in `after` (same kernel name after renames, same options, and
    the after launch's constexprs including the before one's) and prints how their instructions compare; True when
    every launch is paired and identical but for argument offsets."""
    def load(d):
        return [(e, open(os.path.join(d, e["file"])).read() if "file" in e else None)
                for e in json.load(open(os.path.join(d, "index.json")))]
    olds, news = load(before), load(after)
    free, ok = list(range(len(news))), True

    def bare(sass):  # instructions without addresses, encodings and the constant-bank offsets of arguments
        return [re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[arg]", ln.split("*/", 1)[1].split(";")[0]).strip()
                for ln in sass.splitlines()]
    for e, sass in olds:
        r = e["record"]
        name = renames.get(r["name"], r["name"])
        match = [j for j in free if news[j][0]["record"]["name"] == name
                 and news[j][0]["record"]["options"] == r["options"]
                 and all(json.dumps(news[j][0]["record"]["constexprs"].get(k)) == json.dumps(v)  # True is not 1
                         for k, v in r["constexprs"].items())]
        exact = [j for j in match if news[j][0]["record"]["signature"] == r["signature"]]
        what = f"{r['name']} {json.dumps({k: v for k, v in r['constexprs'].items() if not isinstance(v, dict)})}"
        if not match:
            print(f"only before: {what}")
            ok = False
            continue
        j = (exact or match)[0]
        free.remove(j)
        new = news[j][1]
        if sass is None or new is None:
            verdict = "a build failed"
        elif new == sass:
            verdict = "identical"
        elif bare(new) == bare(sass):
            verdict = "identical but for argument offsets"
        else:
            verdict = f"DIFFERENT ({len(bare(sass))} -> {len(bare(new))} instructions)"
        ok &= verdict.startswith("identical")
        print(f"{verdict}: {what}")
    for j in free:
        print(f"only after: {news[j][0]['record']['name']}")
    return ok and not free


def main():
    ap = argparse.ArgumentParser(prog="python -m tools.sass", description=__doc__.splitlines()[0])
    ap.add_argument("snippet", nargs="?",
                    help="Python run with torch, K (= kernel) and the kernels/ modules in scope, on CPU tensors")
    ap.add_argument("--tune", action="append", default=[], metavar="KEY=VALUE",
                    help="set kernel.TUNING[KEY] to a Python literal first (repeatable)")
    ap.add_argument("--only", help="report only the kernels whose name contains this")
    ap.add_argument("--dump", help="also write each launch's SASS to DIR/<i>_<kernel>.sass")
    ap.add_argument("--save", metavar="DIR", help="save the SASS of every launch of the interpreted model run")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two --save directories")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                    help="--compare: a kernel of BEFORE is AFTER's NEW (repeatable)")
    a = ap.parse_args()
    if a.compare:
        same = compare(*a.compare, dict(r.split("=", 1) for r in a.rename))
        sys.exit(0 if same else 1)
    if (a.snippet is None) == (a.save is None):
        ap.error("give a snippet, or --save DIR, or --compare BEFORE AFTER")
    if os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter must be on before triton is imported
        os.execve(sys.executable, [sys.executable, "-m", "tools.sass", *sys.argv[1:]],
                  dict(os.environ, TRITON_INTERPRET="1"))
    if a.save:
        return save(a.save)
    launches = [r for r in record(a.snippet, a.tune) if not a.only or a.only in r["name"]]
    if not launches:
        sys.exit("tools.sass: the snippet launched no kernel of kernels/" + (f" matching {a.only!r}" if a.only else ""))
    with tempfile.TemporaryDirectory() as tmp:
        for i, (r, b) in enumerate(zip(launches, build(launches, tmp))):
            if "error" in b:
                print(f"[{i}] {r['name']}: the sm90 build failed: {b['error']}")
                continue
            sass = cuobjdump("-sass", os.path.join(tmp, f"{i}.cubin"))
            regs = re.search(r"REG:(\d+)", cuobjdump("--dump-resource-usage", os.path.join(tmp, f"{i}.cubin")))
            if a.dump:
                os.makedirs(a.dump, exist_ok=True)
                open(os.path.join(a.dump, f"{i}_{r['name']}.sass"), "w").write(sass)
            cons = {k: v for k, v in r["constexprs"].items() if not isinstance(v, dict)}  # dtypes left out
            print(f"[{i}] {r['name']} {r['options']} shared {b['shared']} B, {regs.group(1) if regs else '?'} "
                  f"registers\n    constexprs {cons}\n    "
                  + summary(sass).replace("\n", "\n    "))


if __name__ == "__main__":
    main()
