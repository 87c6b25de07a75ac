"""Every Triton kernel the model launches, compiled ahead of time for an H200 (sm90) on this CPU machine.

The interpreter runs a kernel's Python and accepts code the GPU compiler rejects (e.g. a plain Python global read
inside a jit function: kernel.py's QBLOCK once compiled under the interpreter and failed for the GPU). GPU time is
scarce, so this test records every launch of a small model run under the interpreter (kernel, argument types,
constexprs, options) with the GPU's launch shapes (kernels.common._GPU_LAUNCH: tiles, stages, unrolling), and
compiles each distinct one for sm90 in a fresh process (tools.sass's launch_record and build; no GPU needed), with the
GPU's values of the interpreter-only constexprs (DOT_DTYPE bf16, PRECISE) and PDL on; a build that needs more shared
memory than an H200 block has fails.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import kernel
from kernels import choose, common, draft, expert_gemm, experts, moe_route
from tools.sass import build, launch_records

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not INTERPRET, reason="records the interpreter's launches (CPU CI)")
@torch.inference_mode()
@pytest.mark.slow
def test_every_launched_kernel_compiles_for_sm90(interpreted_model_run, monkeypatch, tmp_path):
    seen = dict(interpreted_model_run[2])  # the model's launches (conftest), then the ones it does not reach
    monkeypatch.setattr(kernel, "_triton", lambda x: True)
    monkeypatch.setattr(common, "_GPU_LAUNCH", True)
    monkeypatch.setattr(common, "_sms", lambda: 132)  # the H200's
    # the launches that this model run does not reach
    with launch_records(seen):
        x, ids = torch.randn(3, 192).bfloat16(), torch.tensor([[0, 1], [1, 2], [2, 0]])
        w1, w2 = kernel.to_e4m3(torch.randn(3, 160, 192)), kernel.to_e4m3(torch.randn(3, 192, 160))
        s1, s2 = torch.rand(3, 2, 2) + 0.5, torch.rand(3, 2, 2) + 0.5
        # BF16 experts at one token with 4 K blocks (the FP8 path unrolls 4 of them there: 240 KB for BF16 tiles)
        xb, wb = torch.randn(1, 512).bfloat16(), torch.randn(2, 128, 512).bfloat16()
        wd = torch.randn(2, 512, 128).bfloat16()
        experts.moe_experts_decode_triton(xb, torch.tensor([[0, 1]]), torch.rand(1, 2), wb, wb, wd, None, None, None,
                                          7.0)
        sb, sd = torch.rand(2, 1, 4) + 0.5, torch.rand(2, 4, 1) + 0.5  # and FP8 ones (moe_unroll)
        experts.moe_experts_decode_triton(xb, torch.tensor([[0, 1]]), torch.rand(1, 2), kernel.to_e4m3(wb),
                                          kernel.to_e4m3(wb), kernel.to_e4m3(wd), sb, sb, sd, 7.0)
        experts.moe_experts_sorted_triton(x, ids, torch.rand(3, 2), w1, w1, w2, s1, s1, s2, 7.0)  # prefill's path
        xq, sx = moe_route.act_quant_triton(x)
        expert_gemm.grouped_gemm_triton(xq, sx, w1, s1, torch.tensor([0, 1, 1, 3], dtype=torch.int32))
        V, N = 300, 2  # the choose step's kernels (the engine's, not the model's)
        choose.process_logits_triton(torch.randn(N, V), torch.tensor([0, 1]), torch.zeros(N, V, dtype=torch.int32),
                                     torch.zeros(N, 10, dtype=torch.int32), torch.zeros(N, dtype=torch.bool),
                                     torch.zeros(N, dtype=torch.long), torch.ones(N), torch.zeros(N), torch.zeros(N),
                                     torch.zeros(N, V, dtype=torch.bool), torch.zeros(N, dtype=torch.bool),
                                     torch.zeros(N, dtype=torch.long))
        choose.uniform_triton(torch.tensor([1, 2]), torch.tensor([0, 5]), V)
        choose.advance_triton(torch.zeros(N, V, dtype=torch.int32), torch.zeros(N, dtype=torch.bool),
                              torch.zeros(N, dtype=torch.long), torch.zeros(N, dtype=torch.long), torch.tensor([0, 1]),
                              torch.tensor([[1, 2], [3, 4]]), torch.ones(N, 2, dtype=torch.bool))
        for j in range(2):  # a draft's depths (the speculative engine's)
            draft.draft_rows_triton(torch.tensor([0, 1]), torch.tensor([5, 9]), torch.zeros(N, 12, dtype=torch.long),
                                    torch.zeros(N, 2, dtype=torch.long), torch.zeros(N, dtype=torch.long), j, 2)
    names = {r["name"] for r in seen.values()}
    assert {"_sliding_attn_kernel", "_moe_decode_up_kernel", "_router_logits_kernel", "_select_regions_kernel",
            "_grouped_gemm_kernel", "_add_norm_kernel", "_banded_attn_kernel", "_dense_prefix_kernel",
            "_indexer_scores_kernel", "_sparse_attn_kernel", "_process_kernel",
            "_uniform_kernel", "_advance_kernel", "_draft_rows_kernel"} <= names, names
    launches = list(seen.values())
    failed = [f"{r['name']} {r['constexprs']} {r['options']}: " + (b.get("error") or f"{b['shared']} bytes of shared "
              "memory") for r, b in zip(launches, build(launches, str(tmp_path)))
              if "error" in b or b["shared"] > 232448]  # an H200 block's shared memory limit (227 KB)
    print(f"{len(seen)} launches of {len(names)} kernels compiled for sm90")
    assert not failed, "\n".join(failed)


@pytest.mark.skipif(not INTERPRET, reason="a CPU build")
@pytest.mark.slow
def test_sass_tool_reports_the_router_loops():
    """tools.sass (the offline SASS report) records, builds and summarises a snippet's launches."""
    snippet = ("x = torch.randn(1, 256).bfloat16(); w = torch.randn(40, 256).bfloat16()\n"
               "K.route(x, w, torch.zeros(40), 4, 3.0, quant=True)")
    # --tune: one MMA chain keeps the GEMM in its K loop (4 parts make it one 3-D dot outside any loop)
    out = subprocess.run([sys.executable, "-m", "tools.sass", snippet, "--only", "logits",
                          "--tune", "router_parts=1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "_router_logits_kernel" in out.stdout and "_router_select_kernel" not in out.stdout
    assert "HMMA" in out.stdout and " loop 0x" in out.stdout  # the logits GEMM's K loop on the tensor cores
    assert "'PARTS': 1" in out.stdout


def test_sass_summary_counts_mma_chains_and_wgmma_waits():
    """sass.summary on hand-written sm90 SASS: three mma.sync adding into one accumulator (R44; the one into R40 starts
    a chain of its own from zero), and a wgmma group waited for inside the loop."""
    from tools import sass
    lines = ["MOV R44, RZ", "HMMA.16816.F32.BF16 R44, R28.reuse, R36, R44", "HMMA.16816.F32.BF16 R40, R28, R38, RZ",
             "HMMA.16816.F32.BF16 R44, R30, R36, R44", "HMMA.16816.F32.BF16 R44, R32, R36, R44",
             "WARPGROUP.DEPBAR.LE gsb0, 0x0", "@!P0 BRA 0x10"]
    out = sass.summary("\n".join(f"        /*{16 * i:04x}*/                   {s} ;" for i, s in enumerate(lines)))
    assert "mma.sync chain 3" in out.splitlines()[0]
    assert "loop 0x10-0x60: 6 instructions (mma.sync chain 3, wgmma waits 1)" in out, out


def test_sass_compare_pairs_launches_and_tells_offsets_from_code(tmp_path):
    """sass.compare on two hand-written --save directories: a kernel renamed and given a new constexpr pairs with its
    old launch; the same instructions with other argument offsets pass, a changed instruction or an unpaired launch
    fails."""
    from tools import sass

    def saved(d, launches):
        os.makedirs(d)
        index = []
        for i, (name, cons, lines) in enumerate(launches):
            open(os.path.join(d, f"{i}.sass"), "w").write("".join(
                f"        /*{16 * j:04x}*/                   {s} ;   /* 0x{j:016x} */\n" for j, s in enumerate(lines)))
            index.append({"record": {"name": name, "constexprs": cons, "signature": {}, "options": {}},
                          "file": f"{i}.sass"})
        json.dump(index, open(os.path.join(d, "index.json"), "w"))
        return d
    a = saved(tmp_path / "a", [("_old", {"B": 1}, ["LDC R1, c[0x0][0x210]", "EXIT"]),
                               ("_k", {"B": 2}, ["MOV R1, RZ", "EXIT"])])
    b = saved(tmp_path / "b", [("_k", {"B": 2}, ["MOV R1, RZ", "EXIT"]),
                               ("_new", {"B": 1, "SORTED": False}, ["LDC R1, c[0x0][0x218]", "EXIT"])])
    assert sass.compare(a, b, {"_old": "_new"})
    c = saved(tmp_path / "c", [("_k", {"B": 2}, ["MOV R2, RZ", "EXIT"]),
                               ("_new", {"B": 1, "SORTED": False}, ["LDC R1, c[0x0][0x218]", "EXIT"])])
    assert not sass.compare(a, c, {"_old": "_new"})  # a changed register
    assert not sass.compare(a, b, {})  # _old has no partner


GLUON_BUILD = """
import json, subprocess, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from kernels import expert_gemm
for gated, block_n, gather in ((False, 128, False), (True, 128, True), (False, 256, False), (True, 256, False),
                              (True, 256, True)):
    wn = block_n // 2
    xl, wl = (gl.NVMMASharedLayout.get_default_for([n, 128], gl.float8e4nv) for n in (128, wn))
    ol = gl.NVMMASharedLayout(128, 16)
    sig = {"x_desc": f"tensordesc<fp8e4nv[128, 128],{xl}>", "x_ptr": "*fp8e4nv", "row_idx_ptr": "*i32",
           "x_stride": "i32", "w_desc": f"tensordesc<fp8e4nv[{wn}, 128],{wl}>",
           "w3_desc": f"tensordesc<fp8e4nv[{wn}, 128],{wl}>", "out_desc": f"tensordesc<bf16[64, 64],{ol}>",
           "sx_ptr": "*fp32", "sw_ptr": "*fp32",
           "sw3_ptr": "*fp32", "out_ptr": "*bf16", "row_off_ptr": "*i32", "N": "i32", "K": "i32", "E": "i32",
           "total": "i32", "limit": "fp32", "sx_stride": "i32", "sw_stride_e": "i32", "sw_stride_n": "i32",
           "out_stride": "i32"}
    cons = dict(GATED=gated, GATHER=gather, HAS_LIMIT=True, BLOCK_M=128, BLOCK_N=block_n, BLOCK_E=64,
                STAGES=3 if block_n == 256 else 4, PRECISE=True, MATH_REGS=232)
    sig.update({k: "constexpr" for k in cons})
    src = GluonASTSource(fn=expert_gemm._grouped_wgmma_kernel, signature=sig, constexprs=cons,
                         attrs={(j,): [["tt.divisibility", 16]] for j in (1, 2, 3, 7, 8, 9, 10, 11, 20)})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    open(sys.argv[1], "w").write(k.asm["ptx"])
    ptxas = subprocess.run([sys.argv[2], "-arch=sm_90a", "-v", sys.argv[1], "-o", sys.argv[1] + ".cubin"],
                           capture_output=True, text=True)
    print(json.dumps({"gated": gated, "block_n": block_n, "gather": gather, "shared": k.metadata.shared,
                      "ptxas": ptxas.stderr}))
"""


@pytest.mark.skipif(not INTERPRET, reason="a CPU build")
@pytest.mark.slow
def test_gluon_grouped_gemm_compiles_for_sm90(tmp_path):
    """expert_gemm._grouped_wgmma_kernel (Gluon, run on sm90 GPUs only) built for an H200: its variants (gated or
    not, 128 or 256 B tile rows, x's rows by TMA or gathered by cp.async) fit its shared memory, spill (almost)
    nothing, and ptxas keeps the wgmmas asynchronous (its C7514 note: serialised)."""
    import triton
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", GLUON_BUILD, str(tmp_path / "k.ptx"), ptxas], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    builds = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(b["gated"], b["block_n"], b["gather"]) for b in builds] == [
        (False, 128, False), (True, 128, True), (False, 256, False), (True, 256, False), (True, 256, True)]
    for b in builds:
        assert b["shared"] <= 232448 and "C7514" not in b["ptxas"], b
        # 256 columns (two 64 x 128 fp32 accumulators + a wgmma's): a few scalars spilled around the tile setup and
        # the SwiGLU epilogue; the K loop has no local memory access (SASS, Triton 3.6 and 3.7); gather: the loader
        # warpgroup's 48 registers and the default math warpgroup's 224 spill a few scalars around the tile setup
        spilled = int(re.findall(r"(\d+) bytes spill stores", b["ptxas"])[0])
        assert spilled <= (128 if b["block_n"] == 256 or b["gather"] else 0) and "Used " in b["ptxas"], b
