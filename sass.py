"""The sm90 (H200) SASS of the Triton kernels that a Python snippet launches, built on this CPU: no GPU needed.

Runs the snippet under the Triton interpreter with the GPU's launch shapes (kernel._GPU_LAUNCH, 132 SMs), records
each distinct launch (tests/test_sm90_build.py's _record), compiles it for sm90 in a process without the interpreter
(the Triton wheel ships ptxas and cuobjdump) and prints, per launch: SASS instructions, local-memory spills, shared
memory, and every loop's length with its commonest opcodes. A decode kernel that is issue-bound pays its loop's
instructions per K block; but counts only guide: a shorter loop has measured slower (kernel.TUNING's notes).

    python sass.py "x = torch.randn(1, 4096).bfloat16(); w = torch.randn(352, 4096).bfloat16()
    K.route_triton(x, w, torch.zeros(352), 8, 3.0, quant=True)" [--tune KEY=VALUE] [--only NAME] [--dump DIR]
"""
import argparse
import ast
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.abspath(__file__))
BUILD = """
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernel
for i, r in enumerate(json.load(open(sys.argv[1]))):
    cons = {k: tl.dtype(v["dtype"]) if isinstance(v, dict) else v for k, v in r["constexprs"].items()}
    src = ASTSource(fn=getattr(kernel, r["name"]), signature=r["signature"], constexprs=cons,
                    attrs={(j,): [["tt.divisibility", 16]] for j in r["div16"]})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=r["options"])
    open(f"{sys.argv[2]}/{i}.cubin", "wb").write(k.asm["cubin"])
    print(json.dumps({"shared": k.metadata.shared}))
"""
LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def record(snippet: str, tune: dict) -> list:
    """The distinct launches of kernel.py's Triton functions while the snippet runs under the interpreter."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import kernel
    from test_sm90_build import _record
    seen, run = {}, InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if getattr(self.fn, "__module__", "") == "kernel":
            r = _record(self.fn, args, kwargs)
            seen.setdefault(json.dumps(r, sort_keys=True), r)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    kernel._GPU_LAUNCH, kernel._sms = True, lambda: 132
    unknown = set(tune) - set(kernel.TUNING)
    if unknown:
        sys.exit(f"sass.py: --tune {sorted(unknown)}: not keys of kernel.TUNING ({', '.join(kernel.TUNING)})")
    kernel.TUNING.update(tune)
    with torch.inference_mode():
        exec(snippet, {"torch": torch, "K": kernel, "kernel": kernel})
    return list(seen.values())


def summary(sass: str) -> str:
    """Instruction count, spills and each loop (a backward branch: its target .. itself) with its top opcodes."""
    ops = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(LINE.match, sass.splitlines()) if m]
    out = [f"{len(ops)} instructions, STL {sum(o == 'STL' for _, o, _ in ops)}, "
           f"BAR.SYNC {sum(o.startswith('BAR.SYNC') for _, o, _ in ops)}"]
    for addr, op, rest in ops:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            body = collections.Counter(o for a, o, _ in ops if int(target.group(1), 16) <= a <= addr)
            out.append(f"  loop {int(target.group(1), 16):#x}-{addr:#x}: {sum(body.values())} instructions, "
                       + ", ".join(f"{o} {n}" for o, n in body.most_common(8)))
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snippet", help="Python run with torch and K (= kernel) in scope, on CPU tensors")
    ap.add_argument("--tune", action="append", default=[], metavar="KEY=VALUE",
                    help="set kernel.TUNING[KEY] to a Python literal first (repeatable)")
    ap.add_argument("--only", help="report only the kernels whose name contains this")
    ap.add_argument("--dump", help="also write each launch's SASS to DIR/<i>_<kernel>.sass")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":  # the interpreter must be on before triton is imported
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, TRITON_INTERPRET="1"))
    tune = {}
    for item in a.tune:
        key, _, value = item.partition("=")
        try:
            tune[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            sys.exit(f"sass.py: --tune {item!r}: the value must be a Python literal (e.g. moe_stages=3,3)")
    launches = [r for r in record(a.snippet, tune) if not a.only or a.only in r["name"]]
    if not launches:
        sys.exit("sass.py: the snippet launched no kernel of kernel.py" + (f" matching {a.only!r}" if a.only else ""))
    import triton  # its wheel carries the CUDA binary tools
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        json.dump(launches, open(os.path.join(tmp, "launches.json"), "w"))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        built = subprocess.run([sys.executable, "-c", BUILD, os.path.join(tmp, "launches.json"), tmp], env=env,
                               cwd=ROOT, capture_output=True, text=True)
        if built.returncode:
            sys.exit(f"sass.py: the sm90 build failed:\n{built.stderr[-3000:]}")
        meta = [json.loads(line) for line in built.stdout.splitlines() if line.startswith("{")]
        for i, (r, m) in enumerate(zip(launches, meta)):
            sass = subprocess.run([cuobjdump, "-sass", os.path.join(tmp, f"{i}.cubin")], capture_output=True,
                                  text=True, check=True).stdout
            if a.dump:
                os.makedirs(a.dump, exist_ok=True)
                open(os.path.join(a.dump, f"{i}_{r['name']}.sass"), "w").write(sass)
            cons = {k: v for k, v in r["constexprs"].items() if not isinstance(v, dict)}  # dtypes left out
            print(f"[{i}] {r['name']} {r['options']} shared {m['shared']} B\n    constexprs {cons}\n    "
                  + summary(sass).replace("\n", "\n    "))


if __name__ == "__main__":
    main()
