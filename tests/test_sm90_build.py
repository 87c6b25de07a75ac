"""Every Triton kernel the model launches, compiled ahead of time for an H200 (sm90) on this CPU machine.

The interpreter runs a kernel's Python and accepts code the GPU compiler rejects (e.g. a plain Python global read
inside a jit function: kernel.py's QBLOCK once compiled under the interpreter and failed for the GPU). GPU time is
scarce, so this test records every launch of a small model run under the interpreter (kernel, argument types,
constexprs, options) with the GPU's launch shapes (kernel._GPU_LAUNCH: tiles, stages, unrolling), and compiles each
distinct one for sm90 in a fresh process (no GPU needed), with the GPU's values of the interpreter-only constexprs
(DOT_DTYPE bf16, PRECISE) and PDL on; a build that needs more shared memory than an H200 block has fails.
"""
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
import triton.language as tl

import kernel

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_VALUES = {"DOT_DTYPE": tl.bfloat16, "PRECISE": True, "PDL": True}
PTR = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float16: "*fp16", torch.float8_e4m3fn: "*fp8e4nv",
       torch.uint8: "*u8", torch.int8: "*i8", torch.int32: "*i32", torch.int64: "*i64", torch.bool: "*i1"}

COMPILE = """
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kernel
failed = []
for r in json.load(open(sys.argv[1])):
    cons = {k: tl.dtype(v["dtype"]) if isinstance(v, dict) else v for k, v in r["constexprs"].items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i in r["div16"]}
    src = ASTSource(fn=getattr(kernel, r["name"]), signature=r["signature"], constexprs=cons, attrs=attrs)
    try:
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=r["options"])
        if k.metadata.shared > 232448:  # an H200 block's shared memory limit (227 KB): launching it would fail
            failed.append(f"{r['name']} {cons} {r['options']}: {k.metadata.shared} bytes of shared memory")
    except Exception as e:
        failed.append(f"{r['name']} {cons}: {type(e).__name__}: {str(e)[:600]}")
print(json.dumps(failed))
"""


def _record(fn, args, kwargs):
    """(name, signature, constexprs, options, div16) of one launch, JSON-ready. div16: the arguments that the GPU
    launcher marks 16-divisible (pointers at 16-byte addresses, integers that are multiples of 16); without that
    hint the compiler neither vectorises nor pipelines their loads (an up to 20x smaller shared-memory footprint)."""
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
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        else:
            assert isinstance(v, float), (fn.__name__, name, type(v))
            sig[name] = "fp32"
    opts = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages", "enable_fp_fusion")}
    opts["launch_pdl"] = True
    return {"name": fn.__name__, "signature": sig, "constexprs": cons, "options": opts, "div16": div16}


@pytest.mark.skipif(not INTERPRET, reason="records the interpreter's launches (CPU CI)")
@torch.inference_mode()
def test_every_launched_kernel_compiles_for_sm90(tp1_models, monkeypatch, tmp_path):
    from triton.runtime.interpreter import InterpretedFunction
    seen = {}
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        if getattr(self.fn, "__module__", "") == "kernel":
            r = _record(self.fn, args, kwargs)
            seen.setdefault(json.dumps(r, sort_keys=True), r)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    monkeypatch.setattr(kernel, "_triton", lambda x: True)
    monkeypatch.setattr(kernel, "_GPU_LAUNCH", True)
    monkeypatch.setattr(kernel, "_sms", lambda: 132)  # the H200's
    lm = tp1_models("fp8_text")
    cache = lm.new_cache(2, 28, slack=2)
    lm.forward(torch.tensor(list(range(40, 59)) + list(range(70, 81))), cache, [19, 11])  # prefill (2 requests)
    lm.forward(torch.tensor([5, 6]), cache)  # a decode step: the fused and sort-free paths
    lm.forward(torch.tensor([[7, 8, 9], [10, 11, 12]]), cache)  # 3 tokens per row
    monkeypatch.setattr(kernel, "_sms", lambda: 1)  # the launch shapes of a grid that fills the GPU (sliding_warps)
    lm.forward(torch.tensor([13, 14]), cache)
    # the launch choices that the model does not take by default
    x, ids = torch.randn(3, 192).bfloat16(), torch.tensor([[0, 1], [1, 2], [2, 0]])
    w1, w2 = kernel.to_e4m3(torch.randn(3, 160, 192)), kernel.to_e4m3(torch.randn(3, 192, 160))
    s1, s2 = torch.rand(3, 2, 2) + 0.5, torch.rand(3, 2, 2) + 0.5
    kernel.moe_experts_decode_triton(x, ids, torch.rand(3, 2), w1, w1, w2, s1, s1, s2, 7.0, swap=False)
    # BF16 experts at one token with 4 K blocks (the FP8 path unrolls 4 of them there: 240 KB for BF16 tiles)
    xb, wb = torch.randn(1, 512).bfloat16(), torch.randn(2, 128, 512).bfloat16()
    wd = torch.randn(2, 512, 128).bfloat16()
    kernel.moe_experts_decode_triton(xb, torch.tensor([[0, 1]]), torch.rand(1, 2), wb, wb, wd, None, None, None, 7.0)
    sb, sd = torch.rand(2, 1, 4) + 0.5, torch.rand(2, 4, 1) + 0.5  # and FP8 ones (moe_unroll)
    kernel.moe_experts_decode_triton(xb, torch.tensor([[0, 1]]), torch.rand(1, 2), kernel.to_e4m3(wb),
                                     kernel.to_e4m3(wb), kernel.to_e4m3(wd), sb, sb, sd, 7.0)
    kernel.moe_experts_sorted_triton(x, ids, torch.rand(3, 2), w1, w1, w2, s1, s1, s2, 7.0)  # prefill's path
    xq, sx = kernel.act_quant_triton(x)
    kernel.grouped_gemm_triton(xq, sx, w1, s1, torch.tensor([0, 1, 1, 3], dtype=torch.int32), n_fastest=False)
    names = {r["name"] for r in seen.values()}
    assert {"_sliding_attn_kernel", "_moe_decode_up_kernel", "_router_logits_kernel", "_select_regions_kernel",
            "_grouped_gemm_kernel", "_add_norm_kernel"} <= names, names
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(list(seen.values())))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", COMPILE, str(path)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{len(seen)} launches of {len(names)} kernels compiled for sm90")
    assert not failed, "\n".join(failed)


@pytest.mark.skipif(not INTERPRET, reason="a CPU build")
def test_sass_tool_reports_the_router_loops():
    """sass.py (the offline SASS report) records, builds and summarises a snippet's launches."""
    snippet = ("x = torch.randn(1, 256).bfloat16(); w = torch.randn(40, 256).bfloat16()\n"
               "K.route_triton(x, w, torch.zeros(40), 4, 3.0, quant=True)")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "sass.py"), snippet, "--only", "logits"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "_router_logits_kernel" in out.stdout and "_router_select_kernel" not in out.stdout
    assert "HMMA" in out.stdout and " loop 0x" in out.stdout  # the logits GEMM's K loop on the tensor cores
