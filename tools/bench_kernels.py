"""Correctness at real shapes and speed of the Triton kernels (kernels/) on one GPU (TP = 8 local sizes).

    python -m tools.bench_kernels                      # checks against the references (exit 1 if any is out of
                                                       # its tolerance), then every benchmark
    python -m tools.bench_kernels --only gemm moe      # groups: check gemm sweep sweep_prefill moe attn
                                                       # norm route floors

Ceilings (tools.rank's, measured with PyTorch on the H200 machine): HBM 4.28 TB/s (a copy, read + write), fp8
_scaled_mm 1263 TFLOP/s, bf16 GEMM 767 TFLOP/s (both 8192^3); fp8 _scaled_mm with 1x128 / 128x128 block scales
(cuBLAS, blockwise_scaled_mm) 1099 TFLOP/s at 22528 x 3072 x 4096, 974 at 22528 x 4096 x 1536. Times are medians
of CUDA-graph replays (triton.testing.do_bench_cudagraph: device time, as a graph-captured decode step sees it);
"eager" is triton.testing.do_bench of plain Python calls, which for the small decode cases measures the host's launch
overhead (Triton's Python launcher), not the GPU.
"""
import argparse
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import kernel as K
from kernels import common, dsa_attention, dsa_index, expert_gemm, experts, linear, moe_route, norm_rope, sliding
from tools.rank import FP8_FLOPS, HBM_BPS

DEV = "cuda"


def bench(fn):
    """CUDA-graph replay time in seconds (eager time when the function cannot be captured)."""
    fn()
    # do_bench_cudagraph runs fn on a fresh side stream that does not wait for this one: without the sync its first
    # calls can read inputs (row offsets, ids) that this stream has not written yet, i.e. garbage from freed blocks
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3
    except Exception as e:  # raised by the side-stream warm-up as well as by the capture itself
        print(f"    (CUDA-graph timing failed: {type(e).__name__}: {str(e)[:120]}; eager time)")
        return eager(fn)


def eager(fn):
    fn()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-3


@triton.jit
def _chain_kernel(src_ptr, dst_ptr, PDL: tl.constexpr):
    """A launch that does nothing but wait for its predecessor and pass one value per program on (bench_chain)."""
    common._pdl_enter(PDL)
    i = tl.program_id(0)
    tl.store(dst_ptr + i, tl.load(src_ptr + i) + 1)


def bench_chain(n=1134, programs=132):
    """The floor of a decode step made of n dependent launches (the batch-16 whole-rank step has 1134): n launches of
    _chain_kernel, each reading what the previous one wrote, in one CUDA graph, with and without PDL."""
    a, b = torch.zeros(2, programs, device=DEV).unbind(0)
    res = []
    for pdl in (True, False):
        def chain():
            for j in range(n):
                src, dst = (a, b) if j % 2 == 0 else (b, a)
                _chain_kernel[(programs,)](src, dst, PDL=pdl, **({"launch_pdl": True} if pdl else {}))
        t = bench(chain)
        res.append(f"{'PDL' if pdl else 'no PDL'} {t * 1e6:.0f} us ({t / n * 1e6:.2f} us a launch)")
    print(f"  chain of {n} dependent launches, {programs} programs each: " + "; ".join(res), flush=True)


@triton.jit
def _read_kernel(src_ptr, out_ptr, n_words, ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
    """Program p reads blocks p, p + grid, ... of src (int32 words, L2 only: .cg) ROUNDS times over and stores one
    word derived from all of them (so that no read can be dropped)."""
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for _ in range(ROUNDS):
        for b in range(tl.program_id(0) * BLOCK, n_words, tl.num_programs(0) * BLOCK):
            acc ^= tl.load(src_ptr + b + tl.arange(0, BLOCK), cache_modifier=".cg")
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def bench_read(mb=24, rounds=16):
    """Read bandwidth from L2 (a buffer of `mb` MiB, within the H200's 50 MB L2, read `rounds` times by every SM) or
    from HBM (a larger buffer): the ceiling of the bytes per second that a GEMM's tiles can be fed into shared memory
    with from L2 (the FP8 expert GEMM at 768 TFLOP/s with 128 x 256 tiles draws ~4.4 TB/s)."""
    n = mb * 2 ** 20 // 4
    src = torch.randint(0, 2 ** 30, (n,), dtype=torch.int32, device=DEV)
    r = rounds if mb <= 32 else 1
    out = torch.empty(4 * common._sms(), dtype=torch.int32, device=DEV)
    t = bench(lambda: _read_kernel[(4 * common._sms(),)](src, out, n, ROUNDS=r, BLOCK=4096, num_warps=8))
    print(f"  read {mb} MiB x {r}: {t * 1e6:.1f} us, {n * 4 * r / t / 1e12:.2f} TB/s", flush=True)


def fp8_weights(E, N, Kd, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = torch.randn(E, N, Kd, device=DEV, generator=g) * 0.05
    s = torch.rand(E, -(-N // 128), -(-Kd // 128), device=DEV, generator=g) * 1e-3 + 1e-4
    full = s.repeat_interleave(128, 1)[:, :N].repeat_interleave(128, 2)[:, :, :Kd]
    wq = K.to_e4m3(w / full)
    del w, full
    return wq, s


RESULTS = []  # (check name, passed) of every check run by checks()


def check(name, out, ref, exact=False, rel=0.0, atol=0.0, frac=1.0):
    """Print the difference and record whether it is within tolerance: exact -> identical bytes; otherwise
    max|diff| <= rel * max|ref| + atol and at most `frac` of the elements differ."""
    d = (out.float() - ref.float()).abs()
    dmax, rmax, differ = d.max().item(), ref.float().abs().max().item(), (d > 0).float().mean().item()
    same_bytes = torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    ok = same_bytes if exact else (dmax <= rel * rmax + atol and differ <= frac)
    tol = "bit-exact" if exact else f"<= {rel:.3g} * ref max + {atol:.3g}"
    tol += f", <= {frac:g} of elems differ" if frac < 1 else ""
    RESULTS.append((name, ok))
    print(f"  {name:44s} max|diff| {dmax:.3g}  (ref max {rmax:.3g}, {differ * 100:.3f}% elems differ) "
          f"bit-exact={same_bytes}  {'ok' if ok else 'FAIL'} (tolerance {tol})", flush=True)


def routed(T, E_local, k=8, E_total=352, seed=0, first=None):
    """Uniform top-k ids: local ids with -1 for other ranks' experts, or (first set) global ids."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E_total, generator=g)[:k] for _ in range(T)])
    if first is None:
        ids = torch.where(ids < E_local, ids, -1)
    return ids.to(DEV), torch.rand(T, k, generator=g).to(DEV)


def shared_weights(D, Fs=192, limit=7.0):
    """One rank's bf16 shared expert (wg, wu, wd, limit_s) at TP = 8."""
    shapes = ((Fs, D), (Fs, D), (D, Fs))
    return tuple((torch.randn(*shape, device=DEV) * 0.02).bfloat16() for shape in shapes) + (limit,)


# Tolerances of the checks (bit-exact unless stated): the kernels compute each reference's formula with the same
# rounding points, so what may differ is only fp32 summation order and what it carries through a later rounding.
# "measured" = this check on the H200 (torch 2.11, triton 3.6). BF16_STEP: the largest bf16 spacing at max|ref|'s
# magnitude, relative to it (a step there is 2^-8..2^-7 of max|ref|).
BF16_STEP = 2 ** -7
# MoE: the kernel sums the dots in another fp32 order and Hopper's fp8 MMA accumulates each 128-wide K block at
# reduced precision, so a gate/up/down output can round to the neighbouring bf16 value; with FP8 experts the
# activation's re-quantisation to e4m3 then moves a whole 128-wide block. Measured: FP8 2 bf16 steps at T=1024 (35%
# of the outputs differ by a step), allowed 3; BF16 experts (no re-quantisation) bit-exact, allowed 2.
MOE_FP8_REL, MOE_BF16_REL = 3 * BF16_STEP, 2 * BF16_STEP
# norm+RoPE: tl.sum and torch's mean reduce x^2 in different orders, so 1/rms can differ in its last fp32 bit and a
# normalised value then rounds to the neighbouring bf16 value, which the rotation carries into at most 2 bf16 steps.
# Measured: one step on 1e-5 of the elements; a wrong eps, pairing or weight offset moves far more of them.
NORM_ROPE_REL, NORM_ROPE_FRAC = 2 * BF16_STEP, 1e-3
# region summaries: a summary sitting at a bf16 or e4m3 rounding midpoint rounds to the neighbouring e4m3 value
# when the GPU reference's exp or sum differs from the kernel's in the last fp32 bit. Measured: 2 bytes of 4.2M one
# step apart (none apart from the CPU reference); allowed: one e4m3 step (at most 2^-3 of max|ref|) on 1e-5 of them.
SUMMARY_REL, SUMMARY_FRAC = 2 ** -3, 1e-5
# indexer scores: the e4m3 x e4m3 products are exact in fp32 and nearly every partial sum is exactly representable,
# so the dot order only matters on rare large sums. Measured: 6.5e-8 * max|ref|; allowed 1e-5 (tests/test_kernels.py).
INDEXER_REL = 1e-5
# sparse attention: the kernel rounds exp(s - running max) to bf16 where the reference rounds exp(s - final max), so
# a probability can land on the neighbouring bf16 value (2^-8 relative) before P.V, and the output adds its own bf16
# rounding. Measured: 0.5% of max|ref|; allowed 1% plus 2e-3 absolute for outputs near 0 (tests/test_kernels.py).
ATTN_REL, ATTN_ABS = 1e-2, 2e-3
# router: the kernel's fp32 logits sum K splits in another order than route_ref's fp64 GEMM rounded once, which over
# D = 4096 moves a logit by ~1e-6 (sigmoid's slope <= 1/4 shrinks it). Two experts may swap only when their exact
# scores are within ROUTE_TIE; rows that agree on ids must agree on weights within 1e-6 * scale (measured 2.2e-7).
ROUTE_TIE, ROUTE_W_REL = 1e-5, 1e-6


def checks():
    print("== correctness at real shapes (Triton vs reference on the GPU)", flush=True)
    torch.manual_seed(0)
    E, D, Fw = 44, 4096, 1536
    (w1, s1), (w3, s3), (w2, s2) = fp8_weights(E, Fw, D, 1), fp8_weights(E, Fw, D, 2), fp8_weights(E, D, Fw, 3)
    for T in (1, 16, 1024):
        x = torch.randn(T, D, device=DEV).bfloat16()
        ids, wts = routed(T, E, seed=T)
        check(f"moe_experts fp8 T={T}", experts.moe_experts_triton(x, ids, wts, w1, w3, w2, s1, s3, s2, 7.0),
              K.moe_experts_ref(x, ids, wts, w1, w3, w2, s1, s3, s2, 7.0), rel=MOE_FP8_REL)
    sh = shared_weights(D)
    for T in (1, 4, 16):  # the sort-free decode path, global ids of rank 2, shared expert: fp32 output
        x = torch.randn(T, D, device=DEV).bfloat16()
        ids, wts = routed(T, E, seed=T + 7, first=2 * E)
        args = (x, ids, wts, w1, w3, w2, s1, s3, s2, 7.0, 2 * E, sh)
        out = experts.moe_experts_decode_triton(*args)
        check(f"moe decode fp8+shared T={T}", out, K.moe_experts_ref(*args), rel=MOE_FP8_REL)
        check(f"moe decode vs sorted path T={T}", out, experts.moe_experts_sorted_triton(*args), rel=MOE_FP8_REL)
    xq = torch.randn(1024, D, device=DEV).bfloat16()
    q, s = moe_route.act_quant_triton(xq)
    qr, sr = K.act_quant_ref(xq)
    check("act_quant e4m3 bytes [1024, 4096]", q, qr, exact=True)
    check("act_quant scales", s, sr, exact=True)
    b1, b3, b2 = ((torch.randn(E, Fw, D, device=DEV) * 0.02).bfloat16(), (torch.randn(E, Fw, D, device=DEV) * 0.02)
                  .bfloat16(), (torch.randn(E, D, Fw, device=DEV) * 0.02).bfloat16())
    for T in (1, 256):
        x = torch.randn(T, D, device=DEV).bfloat16()
        ids, wts = routed(T, E, seed=T + 1)
        check(f"moe_experts bf16 T={T}", experts.moe_experts_triton(x, ids, wts, b1, b3, b2, None, None, None, 7.0),
              K.moe_experts_ref(x, ids, wts, b1, b3, b2, None, None, None, 7.0), rel=MOE_BF16_REL)
    del b1, b3, b2
    g, u = torch.randn(2, 4096, 1536, device=DEV).mul(3).bfloat16().unbind(0)
    check("swiglu [4096, 1536]", moe_route.swiglu_triton(g, u, 7.0), K.swiglu_ref(g, u, 7.0), exact=True)
    for (n, d, half, ln) in ((8, 192, 32, False), (8, 192, 96, False), (4, 256, 16, False), (1, 256, 16, True)):
        x = torch.randn(2048, n, d, device=DEV).mul(2).bfloat16()
        w = torch.randn(d, device=DEV) * 0.1
        b = torch.randn(d, device=DEV) * 0.1 if ln else None
        ang = torch.rand(2048, half, device=DEV) * 6
        check(f"norm_rope T=2048 n={n} d={d} half={half} ln={ln}",
              norm_rope.norm_rope_triton(x, w, ang.cos().bfloat16(), ang.sin().bfloat16(), 1e-5, b),
              K.norm_rope_ref(x, w, ang.cos().bfloat16(), ang.sin().bfloat16(), 1e-5, b),
              rel=NORM_ROPE_REL, frac=NORM_ROPE_FRAC)
    kk, zz = torch.randn(2, 16384, 8, 256, device=DEV).bfloat16().unbind(0)
    summ = dsa_index.region_summary_triton(kk, zz * 3)
    ref_gpu = K.region_summary_ref(kk, zz * 3)
    check("region_summary [16384, 8, 256] vs GPU ref", summ, ref_gpu, rel=SUMMARY_REL, frac=SUMMARY_FRAC)
    ref_cpu = K.region_summary_ref(kk.cpu(), (zz * 3).cpu())  # the same reference on the CPU, for information
    print(f"    bytes differing: vs GPU ref {(summ.view(torch.uint8) != ref_gpu.view(torch.uint8)).sum().item()}"
          f", vs CPU ref {(summ.cpu().view(torch.uint8) != ref_cpu.view(torch.uint8)).sum().item()} of {summ.numel()}")
    for T, R in ((1, 16384), (512, 4096)):
        q = torch.randn(1, T, 1, 4, 256, device=DEV).bfloat16()
        w = torch.randn(1, T, 1, 4, device=DEV)
        summ = K.to_e4m3(torch.randn(1, R, 256, device=DEV))
        check(f"indexer_scores T={T} R={R}", dsa_index.indexer_scores_triton(q, w, summ),
              K.indexer_scores_ref(q, w, summ), rel=INDEXER_REL)
    for S, T, ctx in ((4, 1, 16384), (1, 1, 131072), (1, 64, 8192)):
        N = ctx + 8
        q = torch.randn(S, T, 1, 8, 192, device=DEV).bfloat16()
        k, v = torch.randn(2, S, N, 1, 192, device=DEV).bfloat16().unbind(0)
        pos = torch.arange(ctx - T, ctx, device=DEV).expand(S, T).contiguous()
        sc = torch.randn(S, 1, T, N // 8 + 1, device=DEV)
        ids, valid = K.select_regions_ref(sc, pos // 8, 512)
        check(f"sparse_attention S={S} T={T} ctx={ctx}",
              dsa_attention.sparse_attention_triton(q, k, v, ids, valid, pos, 8, 192 ** -0.5),
              K.sparse_attention_ref(q, k, v, ids, valid, pos, 8, 192 ** -0.5), rel=ATTN_REL, atol=ATTN_ABS)
    for S, T, R in ((1, 1, 4096), (1, 1, 131072), (1, 256, 16384)):
        sc, nh = select_case(S, T, R)
        (ids, valid), (rids, rvalid) = dsa_index.select_regions_triton(sc, nh, 512), K.select_regions_ref(sc, nh, 512)
        check(f"select_regions ids S={S} T={T} R={R}", ids, rids, exact=True)
        check(f"select_regions valid S={S} T={T} R={R}", valid, rvalid, exact=True)
    for T in (1, 64, 4096):
        x = torch.randn(T, 4096, device=DEV).bfloat16()
        w = (torch.randn(352, 4096, device=DEV) * 0.02).bfloat16()
        bias = torch.randn(352, device=DEV) * 0.05
        ids, wts = moe_route.route_triton(x, w, bias, 8, 3.0)
        rids, rwts = K.route_ref(x, w, bias, 8, 3.0)
        sc = torch.sigmoid(x.double() @ w.double().t()) + bias.double()  # [T, 352] scores, fp64
        gap = (sc.gather(1, ids) - sc.gather(1, rids)).abs().max().item()  # 0 unless a slot disagrees
        same = (ids == rids).all(-1)  # rows whose weights are comparable
        wdiff = (wts - rwts).abs()[same].max().item() if same.any() else 0.0
        ok = gap <= ROUTE_TIE and wdiff <= ROUTE_W_REL * 3.0
        RESULTS.append((f"route T={T}", ok))
        print(f"  {'route T=' + str(T):44s} ids equal: {(ids == rids).float().mean().item() * 100:.2f}% of slots "
              f"(largest score gap of a swap {gap:.3g}), max|w diff| where equal {wdiff:.3g}  "
              f"{'ok' if ok else 'FAIL'} (tolerance: swaps within {ROUTE_TIE:g}, w <= {ROUTE_W_REL * 3.0:g})",
              flush=True)


def run_safely(fn, *a) -> bool:
    try:
        fn(*a)
        return True
    except Exception as e:  # keep benchmarking the other kernels; the failure is printed in the table
        print(f"  FAILED {fn.__name__}{a}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return False


def bench_gemm(label, rows_per_expert, E=44):
    """Grouped FP8 GEMM over E experts (each with rows_per_expert rows) beside one dense per-tensor _scaled_mm
    of the same total FLOPs (M = E * rows, one weight) and a per-expert _scaled_mm loop."""
    for (N, Kd, what) in ((1536, 4096, "gate"), (4096, 1536, "down")):
        bench_gemm_shape(label, rows_per_expert, E, N, Kd, what)


def bench_gemm_shape(label, rows_per_expert, E, N, Kd, what):
    # one call per shape: the timed lambdas close over this call's tensors, which live until every timing
    # (each ends with a device synchronize) is done, and are freed together on return
    M = E * rows_per_expert
    w, sw = fp8_weights(E, N, Kd)
    x = torch.randn(M, Kd, device=DEV).bfloat16()
    xq, sx = moe_route.act_quant_triton(x)
    row_off = torch.arange(0, M + 1, rows_per_expert, device=DEV, dtype=torch.int32)
    t = bench(lambda: expert_gemm.grouped_gemm_triton(xq, sx, w, sw, row_off))
    flops, wbytes = 2 * M * N * Kd, E * N * Kd
    io = wbytes + M * Kd + M * N * 2
    one = torch.tensor(1.0, device=DEV)
    wt = w[0].t()
    Mp = -(-M // 16) * 16  # _scaled_mm wants multiples of 16
    xs = torch.cat([xq, xq[:Mp - M]]) if Mp > M else xq
    t_ref = eager(lambda: torch._scaled_mm(xs, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    xe = xs[:-(-rows_per_expert // 16) * 16]  # one expert's rows, padded up to a multiple of 16
    t_loop = eager(lambda: [torch._scaled_mm(xe, w[e].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
                            for e in range(E)]) if rows_per_expert <= 512 else float("nan")
    print(f"  fp8 grouped {what:4s} {label:8s} M={M:6d} N={N} K={Kd}: {t * 1e6:8.1f} us "
          f"{flops / t / 1e12:7.1f} TFLOP/s ({flops / t / FP8_FLOPS * 100:5.1f}% of fp8 peak) "
          f"{io / t / 1e9:7.0f} GB/s ({io / t / HBM_BPS * 100:5.1f}% HBM) | dense _scaled_mm same FLOPs "
          f"{t_ref * 1e6:7.1f} us {flops / t_ref / 1e12:6.1f} TFLOP/s | per-expert _scaled_mm loop "
          f"{t_loop * 1e6:7.1f} us", flush=True)


def choice(name, fn, want, flops=None) -> str:
    """One entry of a sweep: 'name: time [TFLOP/s] =' ('=' when fn's output has the defaults' bits, else DIFFERS),
    or the type of the error it raised (e.g. OutOfResources)."""
    try:
        same = "=" if torch.equal(fn(), want) else "DIFFERS"
        t = bench(fn)
    except Exception as e:
        return f"{name}: {type(e).__name__}"
    return f"{name}: {t * 1e6:.1f}us" + (f" {flops / t / 1e12:.0f} TFLOP/s" if flops else "") + f" {same}"


def sweep_gemm(rows_per_expert, E=44):
    """Tile/pipeline choices of the grouped FP8 GEMM at decode sizes (gate shape), to pick the defaults."""
    N, Kd = 1536, 4096
    M = E * rows_per_expert
    w, sw = fp8_weights(E, N, Kd)
    xq, sx = moe_route.act_quant_triton(torch.randn(M, Kd, device=DEV).bfloat16())
    row_off = torch.arange(0, M + 1, rows_per_expert, device=DEV, dtype=torch.int32)
    res = []
    for bn in (32, 64, 128):
        for st in (3, 4, 6, 8):
            try:
                t = bench(lambda: expert_gemm.grouped_gemm_triton(xq, sx, w, sw, row_off, block_n=bn, num_stages=st))
                res.append(f"BN={bn} st={st}: {t * 1e6:.1f}us ({E * N * Kd / t / 1e9:.0f} GB/s)")
            except Exception as e:
                res.append(f"BN={bn} st={st}: {type(e).__name__}")
    print(f"  sweep rows/expert={rows_per_expert}: " + "; ".join(res), flush=True)


def sweep_gemm_prefill(rows_per_expert, E=44):
    """Tile/warp/stage choices of the grouped FP8 GEMM at prefill sizes, with pointer loads (p) or TMA (t): ungated
    gate shape, gated gate/up (two accumulators, SwiGLU epilogue; FLOPs of both; "gathered": rows read through
    row_idx, as the model's gate/up, so only the weights come by TMA) and the down shape. (BLOCK_N stays <= 128: a
    tile must sit in one 128-wide weight-scale block.) 4-warp tiles of 64 x 128 with 3 stages fit 3 CTAs per SM
    (sm90 build: 159 registers, 72 KB of shared memory), so one CTA's scaling can overlap another's wgmmas."""
    M = E * rows_per_expert
    row_off = torch.arange(0, M + 1, rows_per_expert, device=DEV, dtype=torch.int32)
    ident = torch.arange(M, device=DEV, dtype=torch.int32)
    for what, N, Kd, gated in (("gate", 1536, 4096, False), ("gate+up", 1536, 4096, True),
                               ("gate+up gathered", 1536, 4096, True), ("down", 4096, 1536, False)):
        w, sw = fp8_weights(E, N, Kd)
        w3, sw3 = fp8_weights(E, N, Kd, seed=1) if gated else (None, None)
        xq, sx = moe_route.act_quant_triton(torch.randn(M, Kd, device=DEV).bfloat16())
        flops = 2 * M * N * Kd * (2 if gated else 1)
        res = []
        run = lambda **kw: expert_gemm.grouped_gemm_triton(  # noqa: E731
            xq, sx, w, sw, row_off, w3=w3, sw3=sw3, limit=7.0 if gated else None,
            row_idx=ident if "gathered" in what else None, **kw)
        want = run(tma=False)  # every config must give the same bits (same K order per element)
        tiles = (((128, 64, 8, 4), (64, 64, 4, 4), (64, 64, 4, 3), (128, 64, 4, 3)) if gated else
                 ((128, 128, 8, 4), (128, 128, 8, 3), (64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 3),
                  (64, 64, 4, 4)))
        for bm, bn, nw, st in tiles:
            for tma in (False, True):
                kw = dict(block_m=bm, block_n=bn, num_stages=st, num_warps=nw, tma=tma)
                res.append(choice(f"{bm}x{bn} w{nw} s{st} {'t' if tma else 'p'}", lambda: run(**kw), want, flops))
        print(f"  sweep prefill {what} rows/expert={rows_per_expert}: " + "; ".join(res), flush=True)


def blockwise_scaled_mm(xq, sx, N, seed=2):
    """cuBLAS's block-scaled FP8 GEMM (torch._scaled_mm; sm90, M % 16 == 0) of xq [M, K] by one dense random [N, K]
    weight: the ceiling for the grouped kernels' FLOPs (its weight stays in L2, and it folds sx * Sw into one FFMA per
    element and K block, not the spec's (sum * sx) * Sw: other bits). Scales: x's [M, K/128] M-major, the weight's
    [K/128, N/128] with strides (1, K/128)."""
    w, sw = fp8_weights(1, N, xq.shape[1], seed=seed)
    sa, sb = sx.t().contiguous().t(), sw[0].t()
    return lambda: torch._scaled_mm(xq, w[0].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)


def sweep_gemm_wgmma(rows_per_expert, E=44, choices=((128, 4), (256, 3), (256, 4))):
    """The Gluon grouped GEMM (expert_gemm.grouped_gemm_wgmma: 128-row tiles, two math warpgroups and a TMA warp,
    persistent) at its (block_n, stages) choices beside grouped_gemm_triton's own kernel (wgmma=False); same bits
    asserted. Last, cuBLAS's block-scaled GEMM of the same FLOPs on one dense weight (blockwise_scaled_mm)."""
    M = E * rows_per_expert
    row_off = torch.arange(0, M + 1, rows_per_expert, device=DEV, dtype=torch.int32)
    perm = torch.randperm(M, device=DEV, generator=torch.Generator(device=DEV).manual_seed(0)).to(torch.int32)
    for what, N, Kd, gated in (("gate+up gathered", 1536, 4096, True), ("down", 4096, 1536, False)):
        w, sw = fp8_weights(E, N, Kd)
        w3, sw3 = fp8_weights(E, N, Kd, seed=1) if gated else (None, None)
        xq, sx = moe_route.act_quant_triton(torch.randn(M, Kd, device=DEV).bfloat16())
        kw = dict(w3=w3, sw3=sw3, limit=7.0 if gated else None, row_idx=perm if gated else None)
        flops = 2 * M * N * Kd * (2 if gated else 1)
        want = expert_gemm.grouped_gemm_triton(xq, sx, w, sw, row_off, wgmma=False, **kw)
        res = [choice("triton", lambda: expert_gemm.grouped_gemm_triton(xq, sx, w, sw, row_off, wgmma=False, **kw),
                      want, flops)]
        for bn, st in choices:
            res.append(choice(f"wgmma {bn} s{st}", lambda: expert_gemm.grouped_gemm_wgmma(
                xq, sx, w, sw, row_off, stages=st, block_n=bn, **kw), want, flops))
        t = bench(blockwise_scaled_mm(xq, sx, N * (2 if gated else 1)))
        res.append(f"cuBLAS block-scaled dense: {t * 1e6:.1f}us {flops / t / 1e12:.0f} TFLOP/s")
        print(f"  sweep wgmma {what} rows/expert={rows_per_expert}: " + "; ".join(res), flush=True)


def sweep_banded(T=8192, chunks=(512, 2048, 8192)):
    """A sliding layer's prefill attention (one TP=8 rank: 8 query heads, 1 KV group, head_dim 192, window 512) over
    T tokens in prefill chunks: kernel.banded_attention's reference ("math": SDPA's math path) and Triton kernel:
    time and the largest difference in bf16 steps of the math path's row magnitude."""
    H, hd, W = 8, 192, 512
    q, k, v = (torch.randn(h, T, hd, device=DEV).bfloat16() for h in (H, 1, 1))

    def run(chunk, how):
        K.set_backend(how == "triton")
        try:
            out = torch.empty_like(q)
            for c0 in range(0, T, chunk):
                c1, k0 = min(T, c0 + chunk), max(0, c0 - W + 1)
                out[:, c0:c1] = K.banded_attention(q[:, c0:c1], k[:, k0:c1], v[:, k0:c1], c0 - k0, W, hd ** -0.5)
            return out
        finally:
            K.set_backend(True)
    ref = run(T, "math")
    mag = ref.float().abs().amax(-1, keepdim=True).clamp_min(2 ** -126)
    ulp = torch.ldexp(torch.ones_like(mag), torch.frexp(mag).exponent - 8)
    res = []
    for how in ("math", "triton"):
        for chunk in chunks:
            u = ((run(chunk, how).float() - ref.float()).abs() / ulp).max().item()
            res.append(f"{how} {chunk}: {bench(lambda: run(chunk, how)) * 1e3:.3f} ms, {u:.1f} steps")
    print(f"  sweep banded attention T={T}: " + "; ".join(res), flush=True)


def bench_moe(T, E=44):
    D, Fw = 4096, 1536
    (w1, s1), (w3, s3), (w2, s2) = fp8_weights(E, Fw, D, 1), fp8_weights(E, Fw, D, 2), fp8_weights(E, D, Fw, 3)
    x = torch.randn(T, D, device=DEV).bfloat16()
    ids, wts = routed(T, E, seed=T)
    f = lambda: experts.moe_experts_triton(x, ids, wts, w1, w3, w2, s1, s3, s2, 7.0)  # noqa: E731
    t, te = bench(f), eager(f)
    rows = int((ids >= 0).sum())
    used = int(torch.unique(ids[ids >= 0]).numel())
    wbytes = used * 3 * Fw * D
    flops = 2 * rows * 3 * Fw * D
    print(f"  moe_experts fp8 T={T:5d} ({rows} local rows, {used} experts): {t * 1e6:8.1f} us, weights "
          f"{wbytes / t / 1e9:6.0f} GB/s ({wbytes / t / HBM_BPS * 100:5.1f}% HBM), {flops / t / 1e12:6.1f} TFLOP/s "
          f"| eager {te * 1e6:7.1f} us", flush=True)


def select_case(S, T, R):
    """Indexer-like scores (ReLU zeros: many exact ties) and causal n_hist (the last query of a prefill chunk
    sees fewer than topk regions)."""
    sc = torch.randn(S, 1, T, R, device=DEV).clamp_min(0) * torch.rand(S, 1, T, 1, device=DEV)
    nh = (R - torch.arange(T, device=DEV) * (R // T) - torch.arange(S, device=DEV)[:, None] * 7).clamp_min(0)
    return sc, nh


def bench_select(S, T, R):
    sc, nh = select_case(S, T, R)
    f = lambda: dsa_index.select_regions_triton(sc, nh, 512)  # noqa: E731
    t, te = bench(f), eager(f)
    t_ref = bench(lambda: K.select_regions_ref(sc, nh, 512))
    byts = sc.numel() * 4
    print(f"  select_regions S={S:2d} T={T:3d} R={R:6d} topk=512: {t * 1e6:7.1f} us, scores {byts / t / 1e9:6.0f} GB/s "
          f"({byts / t / HBM_BPS * 100:4.1f}% HBM) | torch reference {t_ref * 1e6:7.1f} us | eager {te * 1e6:6.1f} us",
          flush=True)


def sweep_select(S=1, T=256, R=131072):
    """Chunk lengths of select_regions_triton at a 1M-token prefill query chunk (256 queries x 131072 regions; 16.8 ms
    of the 38 ms chunk on the H200); the ids must equal the default's (the selection is exact)."""
    sc, nh = select_case(S, T, R)
    want = dsa_index.select_regions_triton(sc, nh, 512)[0]  # ids (invalid slots hold R: valid follows from them)
    res = []
    for chunk in (2048, 4096, 8192, 16384):
        res.append(choice(f"chunk {chunk}", lambda: dsa_index.select_regions_triton(sc, nh, 512, chunk=chunk)[0], want))
    print(f"  sweep select S={S} T={T} R={R}: " + "; ".join(res), flush=True)


def sweep_indexer(T=256, R=131072, S=1):
    """Tiles of the indexer scores at a prefill query chunk (T queries of one request, 4 heads x 256, R regions: 1M
    tokens at R = 131072), or a decode step (S requests of T = 1); '=' when the scores' bits equal the defaults'.
    TFLOP/s of the bf16 dots."""
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(S, T, 1, 4, 256, device=DEV, generator=g).bfloat16()
    w = torch.randn(S, T, 1, 4, device=DEV, generator=g).bfloat16()
    summ = K.to_e4m3(torch.randn(S, R, 256, device=DEV, generator=g))
    want = dsa_index.indexer_scores_triton(q, w, summ, 0.5)
    flops = 2 * S * T * R * 4 * 256
    if T == 1:  # decode: 16-row tiles (one real row), the region axis and warps swept
        res = [choice(f"16x{br} w{nw} pc{pc}", lambda: dsa_index.indexer_scores_triton(
            q, w, summ, 0.5, block_t=16, block_r=br, num_warps=nw, block_pc=pc), want, flops)
            for br, nw, pc in ((64, 4, 256), (32, 4, 256), (128, 4, 256), (128, 8, 256), (256, 8, 256),
                               (64, 2, 256), (64, 4, 128), (128, 4, 128), (128, 8, 64), (256, 8, 64))]
        q8 = K.to_e4m3(q).to(q.dtype)  # as norm_rope_jobs' e4m3 writes it: the kernel skips the rounding
        res += [choice(f"16x{br} w{nw} q8", lambda: dsa_index.indexer_scores_triton(
            q8, w, summ, 0.5, block_t=16, block_r=br, num_warps=nw, q_e4m3=True), want, flops)
            for br, nw in ((128, 4), (64, 4), (64, 2), (128, 8))]
        print(f"  sweep indexer scores decode S={S} R={R}: " + "; ".join(res), flush=True)
        return
    res = []  # H200: 64x64 w4 414 us, 64x128 w4 248 (now the prefill default), 128x64 w8 410, 128x128 w8 338,
    # 64x256 w8 280, 256x64 w8 1206; all bit-equal
    # pc: the dot over P as chained 64-wide slices (whole-P tiles spill in the sm90 build; 64x128 w8 pc64 does not)
    for bt, br, nw, pc in ((64, 64, 4, 256), (64, 128, 4, 256), (128, 64, 8, 256), (128, 128, 8, 256),
                           (64, 256, 8, 256), (64, 128, 8, 256), (32, 128, 4, 256), (64, 128, 8, 64),
                           (64, 128, 4, 64), (128, 128, 8, 64), (64, 256, 8, 64)):
        res.append(choice(f"{bt}x{br} w{nw} pc{pc}", lambda: dsa_index.indexer_scores_triton(
            q, w, summ, 0.5, block_t=bt, block_r=br, num_warps=nw, block_pc=pc), want, flops))
    print(f"  sweep indexer scores T={T} R={R}: " + "; ".join(res), flush=True)


def bench_moe_decode(T, E=44):
    """The sort-free decode path: routed + shared expert + combine in 3 launches, against the sorted path (whose
    shared expert runs as torch GEMMs). GB/s counts the weight bytes read: the hit experts' e4m3 and the bf16 shared."""
    D, Fw = 4096, 1536
    (w1, s1), (w3, s3), (w2, s2) = fp8_weights(E, Fw, D, 1), fp8_weights(E, Fw, D, 2), fp8_weights(E, D, Fw, 3)
    sh = shared_weights(D)
    x = torch.randn(T, D, device=DEV).bfloat16()
    ids, wts = routed(T, E, seed=T)
    args = (x, ids, wts, w1, w3, w2, s1, s3, s2, 7.0)
    f = lambda: experts.moe_experts_decode_triton(*args, 0, sh)  # noqa: E731
    t, te = bench(f), eager(f)
    t_routed = bench(lambda: experts.moe_experts_decode_triton(*args))
    t_sorted = bench(lambda: experts.moe_experts_sorted_triton(*args, 0, sh))
    used = int(torch.unique(ids[ids >= 0]).numel())
    routed_bytes, shared_bytes = used * 3 * Fw * D, 3 * sh[0].numel() * 2
    wbytes = routed_bytes + shared_bytes
    print(f"  moe decode fp8+shared T={T:2d} ({int((ids >= 0).sum())} local rows, {used} experts): {t * 1e6:6.1f} us, "
          f"weights {wbytes / t / 1e9:5.0f} GB/s ({wbytes / t / HBM_BPS * 100:4.1f}% HBM) | routed only "
          f"{t_routed * 1e6:6.1f} us {routed_bytes / t_routed / 1e9:5.0f} GB/s | sorted path + torch shared "
          f"{t_sorted * 1e6:6.1f} us | eager {te * 1e6:6.1f} us", flush=True)


def sweep_moe_decode(T, E=44):
    """Tile/warp/stage choices of the decode MoE kernels ((gate/up, down) pairs), routed + shared expert; '=' when the
    output's bits equal the defaults' (the tiles do not change any element's K order)."""
    D, Fw = 4096, 1536
    (w1, s1), (w3, s3), (w2, s2) = fp8_weights(E, Fw, D, 1), fp8_weights(E, Fw, D, 2), fp8_weights(E, D, Fw, 3)
    sh = shared_weights(D)
    x = torch.randn(T, D, device=DEV).bfloat16()
    ids, wts = routed(T, E, seed=T)
    run = lambda **kw: experts.moe_experts_decode_triton(  # noqa: E731
        x, ids, wts, w1, w3, w2, s1, s3, s2, 7.0, 0, sh, **kw)
    want = run()
    res = []  # measured before: 2 warps slower everywhere; split-K gate/up 2-4x slower; stages 3-8 within ~10%
    # measured on the H200 (T = 1 / 16): (32, 64) w4 st4 32.4 / 160 us; w8 42.9 / 293; (64, 64) w8 36.7 / 236;
    # (64, 128) w8 37.1 / 175; (16, 32) w4 st6 39.5 / 302; (32, 32) w8 st6 45.8 / 420; (128, 128) w8 st3 43.0 / 153
    # k_unroll (K blocks per loop iteration, same bits), T = 1 / 16: 1 32.2 / 162, 2 31.9 / 163, 4 30.0 / 238 us;
    # the block dots on the CUDA cores instead of MMAs (removed): 132-351 / 994-1269 us (all before the FP8 tiles
    # had the weight rows as the MMA's M side)
    for bn, nw, st, ku in (((32, 64), 4, 4, 1), ((32, 64), 4, 4, 2), ((32, 64), 4, 3, 4), ((32, 64), 4, 6, 1),
                           ((32, 64), 4, 8, 1), ((32, 64), 4, 6, 2), ((64, 64), 4, 4, 1), ((32, 128), 4, 4, 1)):
        kw = dict(block_n=bn, num_warps=(nw, nw), num_stages=(st, st), k_unroll=(ku, ku))
        res.append(choice(f"BN={bn} w{nw} st={st} k_unroll={ku}", lambda: run(**kw), want))
    for tma in (False, True):  # the tuned tiles, weights (and x at T <= 16) by TMA or by pointers
        res.append(choice(f"defaults tma={tma}", lambda: run(tma=tma), want))
    print(f"  sweep moe decode T={T}: " + "; ".join(res), flush=True)


def bench_skinny_linear(M, N, Kd, what):
    """A decode projection at one TP=8 rank's shape: cuBLAS (F.linear) against the few-row Triton GEMM (model.linear's
    path), weight GB/s of each, graph-replayed, and the largest difference."""
    x = torch.randn(M, Kd, device=DEV).bfloat16()
    w = (torch.randn(N, Kd, device=DEV) * Kd ** -0.5).bfloat16()
    wbytes = N * Kd * 2
    t_ref = bench(lambda: K.skinny_linear_ref(x, w))
    res = []
    for bn, bk in ((16, 256), (16, 512), (32, 256)):
        t = bench(lambda: linear.skinny_linear_triton(x, w, block_n=bn, block_k=bk))
        res.append(f"BN={bn} BK={bk} {t * 1e6:6.1f} us {wbytes / t / 1e9:5.0f} GB/s")
    d = (linear.skinny_linear_triton(x, w).float() - K.skinny_linear_ref(x, w).float()).abs().max().item()
    print(f"  linear {what} M={M:2d} {Kd}->{N}: cuBLAS {t_ref * 1e6:6.1f} us {wbytes / t_ref / 1e9:5.0f} GB/s | "
          + " | ".join(res) + f" | max diff {d:.3g}", flush=True)


def sweep_skinny(M):
    """Tiles, K steps, stages and warps of the few-row bf16 GEMM at one TP=8 rank's decode projections. Each timed
    call runs over enough weight copies (>= 128 MB) that they come from HBM, as in a decode step, not from L2."""
    for N, Kd, what in ((1928, 4096, "packed qkvg"), (3468, 4096, "packed DSA"), (4096, 1536, "o_proj"),
                        (16112, 4096, "lm_head")):
        x = torch.randn(M, Kd, device=DEV).bfloat16()
        copies = -(-128 * 2 ** 20 // (N * Kd * 2))
        ws = [(torch.randn(N, Kd, device=DEV) * Kd ** -0.5).bfloat16() for _ in range(copies)]
        want = linear.skinny_linear_triton(x, ws[0])
        res = []
        for bn, bk, st, nw in ((32, 256, 4, 4), (16, 256, 4, 4), (16, 256, 6, 4), (16, 512, 3, 4), (16, 512, 4, 4),
                               (16, 128, 8, 4), (32, 256, 6, 4), (32, 512, 4, 8), (64, 256, 4, 4), (64, 128, 6, 4)):
            kw = dict(block_n=bn, block_k=bk, num_stages=st, num_warps=nw)
            try:
                same = "=" if torch.equal(linear.skinny_linear_triton(x, ws[0], **kw), want) else "DIFFERS"
                t = bench(lambda: [linear.skinny_linear_triton(x, w, **kw) for w in ws]) / copies
                res.append(f"{bn}x{bk} s{st} w{nw}: {t * 1e6:.1f}us {N * Kd * 2 / t / 1e9:.0f} GB/s {same}")
            except Exception as e:
                res.append(f"{bn}x{bk} s{st} w{nw}: {type(e).__name__}")
        t = bench(lambda: [K.skinny_linear_ref(x, w) for w in ws]) / copies
        print(f"  sweep skinny {what} M={M} {Kd}->{N} (cuBLAS {t * 1e6:.1f}us {N * Kd * 2 / t / 1e9:.0f} GB/s): "
              + "; ".join(res), flush=True)


def bench_attention(ctx, S=1):
    Hg, hd = 8, 192
    N = ctx
    q = torch.randn(S, 1, 1, Hg, hd, device=DEV).bfloat16()
    k, v = torch.randn(2, S, N, 1, hd, device=DEV).bfloat16().unbind(0)
    pos = torch.full((S, 1), ctx - 1, device=DEV, dtype=torch.int64)
    sc = torch.randn(S, 1, 1, N // 8, device=DEV)
    ids, valid = K.select_regions_ref(sc, pos // 8, 512)
    f = lambda: dsa_attention.sparse_attention_triton(q, k, v, ids, valid, pos, 8, hd ** -0.5)  # noqa: E731
    t, te = bench(f), eager(f)
    keys = ids.shape[-1] * 8 + 8
    byts = S * keys * hd * 2 * 2
    qd = q.view(S, 1, Hg, hd).transpose(1, 2)  # [S, Hg, 1, hd]
    kd, vd = k.view(S, N, 1, hd).transpose(1, 2), v.view(S, N, 1, hd).transpose(1, 2)
    t_sdpa = eager(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True))
    dense = S * N * hd * 2 * 2
    print(f"  sparse decode S={S} ctx={ctx:7d} ({keys} keys): {t * 1e6:7.1f} us, {byts / t / 1e9:6.0f} GB/s "
          f"({byts / t / HBM_BPS * 100:4.1f}% HBM) | dense SDPA same cache {t_sdpa * 1e6:8.1f} us "
          f"({dense / t_sdpa / 1e9:5.0f} GB/s) | speed-up {t_sdpa / t:5.1f}x | eager {te * 1e6:6.1f} us", flush=True)


def sweep_attention(ctx=131072, S=1):
    """Split counts of the sparse decode kernel (the default aims at ~2 programs per SM)."""
    q = torch.randn(S, 1, 1, 8, 192, device=DEV).bfloat16()
    k, v = torch.randn(2, S, ctx, 1, 192, device=DEV).bfloat16().unbind(0)
    pos = torch.full((S, 1), ctx - 1, device=DEV, dtype=torch.int64)
    ids, valid = K.select_regions_ref(torch.randn(S, 1, 1, ctx // 8, device=DEV), pos // 8, 512)
    res = []  # block_n 32: no spills in the sm90 build (64: ~180 registers), no faster in a whole decode step
    for sp, bn, st in ((1, 64, 2), (4, 64, 2), (8, 64, 2), (17, 64, 2), (33, 64, 2), (65, 64, 2), (17, 32, 2),
                       (33, 32, 2), (65, 32, 2), (129, 32, 2), (None, 64, 2), (None, 64, 3), (None, 64, 4),
                       (None, 32, 3), (None, 32, 4), (None, 32, 6)):
        t = bench(lambda: dsa_attention.sparse_attention_triton(q, k, v, ids, valid, pos, 8, 192 ** -0.5, splits=sp,
                                                                block_n=bn, num_stages=st))
        res.append(f"splits={sp} block_n={bn} stages={st}: {t * 1e6:.1f}us")
    print(f"  sweep sparse decode S={S} ctx={ctx}: " + "; ".join(res), flush=True)


def bench_sliding(B, R=512, split_len=32, Q=1, num_warps=None):
    """Fused sliding-window decode (norm + RoPE of q/k, ring write, attention, gate) of one TP = 8 layer
    (8 heads, 1 KV group, hd 192, W = 512, full rotary: the sliding layers' partial_rotary_factor is 1), Q tokens per
    row, beside the unfused torch path (sliding_decode_ref)."""
    H, G, hd, W = 8, 1, 192, 512
    qkvg = torch.randn(B * Q, H * hd + 2 * G * hd + H, device=DEV).mul(2).bfloat16()
    pos = torch.arange(4096, 4096 + B * Q, device=DEV)
    rk, rv = torch.randn(2, B, G, R, hd, device=DEV).bfloat16().unbind(0)
    qw, kw = torch.randn(2, hd, device=DEV).mul(0.2).unbind(0)
    ang = torch.rand(4096 + B * Q, hd // 2, device=DEV) * 6
    c, s = ang.cos().bfloat16(), ang.sin().bfloat16()
    a = (qkvg, pos, rk, rv, qw, kw, c, s, 1e-5, hd ** -0.5, W, H, G)
    t = bench(lambda: sliding.sliding_decode_triton(*a, split_len=split_len, num_warps=num_warps))
    t_ref = bench(lambda: K.sliding_decode_ref(*a))
    byts = 2 * rk.numel() * 2 + qkvg.numel() * 2
    print(f"  sliding decode B={B:2d} Q={Q} R={R} split_len={split_len} warps={num_warps or 'tuned'}: "
          f"{t * 1e6:6.2f} us {byts / t / 1e9:6.0f} GB/s ({byts / t / HBM_BPS * 100:4.1f}% HBM) | torch path (graph) "
          f"{t_ref * 1e6:6.1f} us", flush=True)


def bench_norm_rope(T, n, d, half):
    x = torch.randn(T, n, d, device=DEV).bfloat16()
    w = torch.randn(d, device=DEV) * 0.1
    ang = torch.rand(T, half, device=DEV)
    c, s = ang.cos().bfloat16(), ang.sin().bfloat16()
    f = lambda: norm_rope.norm_rope_triton(x, w, c, s, 1e-5)  # noqa: E731
    t, te = bench(f), eager(f)
    byts = 2 * x.numel() * 2 + 2 * c.numel() * 2
    t_ref = eager(lambda: K.norm_rope_ref(x, w, c, s, 1e-5))
    print(f"  norm_rope T={T} n={n} d={d} half={half}: {t * 1e6:7.1f} us {byts / t / 1e9:6.0f} GB/s "
          f"({byts / t / HBM_BPS * 100:4.1f}% HBM) | torch reference {t_ref * 1e6:7.1f} us | eager {te * 1e6:6.1f} us",
          flush=True)


def bench_route(T):
    x = torch.randn(T, 4096, device=DEV).bfloat16()
    w = (torch.randn(352, 4096, device=DEV) * 0.02).bfloat16()
    bias = torch.randn(352, device=DEV) * 0.05
    f = lambda: moe_route.route_triton(x, w, bias, 8, 3.0)  # noqa: E731
    t, te = bench(f), eager(f)
    t_ref = eager(lambda: K.route_ref(x, w, bias, 8, 3.0))
    byts = w.numel() * 2 + x.numel() * 2 + T * 8 * 16
    print(f"  route T={T:5d} E=352: {t * 1e6:7.1f} us {byts / t / 1e9:6.0f} GB/s ({byts / t / HBM_BPS * 100:4.1f}% HBM)"
          f" | torch reference {t_ref * 1e6:7.1f} us | eager {te * 1e6:6.1f} us", flush=True)


GROUPS = ("check", "gemm", "sweep", "sweep_prefill", "moe", "attn", "norm", "route", "floors")


def main(only=GROUPS):
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    if "check" in only:
        if not run_safely(checks):
            RESULTS.append(("checks() raised", False))
        failed = [name for name, ok in RESULTS if not ok]
        if failed:
            print(f"== {len(failed)} checks failed: {', '.join(failed)}", flush=True)
            sys.exit(1)
        print(f"== all {len(RESULTS)} checks passed", flush=True)
    print("== benchmark (reference ops: eager; Triton functions: CUDA-graph replay)", flush=True)
    if "gemm" in only:
        for label, r in (("decode", 1), ("decode", 4), ("decode", 16), ("prefill", 128), ("prefill", 1024)):
            run_safely(bench_gemm, label, r)
        for M in (1, 16):  # TP=8 rank shapes: sliding / DSA packed projection, o_proj, lm_head window
            for N, Kd, what in ((1928, 4096, "packed qkvg"), (3468, 4096, "packed DSA"), (4096, 1536, "o_proj"),
                                (16112, 4096, "lm_head")):
                run_safely(bench_skinny_linear, M, N, Kd, what)
    if "sweep" in only:
        for r in (1, 16):
            run_safely(sweep_gemm, r)
        for T in (1, 16):
            run_safely(sweep_moe_decode, T)
        for M in (1, 16):
            run_safely(sweep_skinny, M)
    if "sweep_prefill" in only:
        for r in (128, 512, 1024):
            run_safely(sweep_gemm_prefill, r)
            run_safely(sweep_gemm_wgmma, r)
        run_safely(sweep_banded)
    if "moe" in only:
        for T in (1, 16, 4096):
            run_safely(bench_moe, T)
        for T in (1, 4, 16):
            run_safely(bench_moe_decode, T)
    if "attn" in only:
        for args in ((1, 1, 4096), (1, 1, 16384), (1, 1, 131072), (32, 1, 16384), (1, 256, 16384)):
            run_safely(bench_select, *args)
        for ctx in (16384, 131072, 524288):
            run_safely(bench_attention, ctx)
        run_safely(bench_attention, 131072, 16)
        run_safely(sweep_attention)
        run_safely(sweep_attention, 131072, 8)
        run_safely(sweep_indexer)
        run_safely(sweep_select)
        for B in (1, 16, 32):
            run_safely(bench_sliding, B)
            run_safely(bench_sliding, B, 512, 32, 1, 4)  # the earlier default (spills registers: sm90 AOT, ncu)
        for R, Q in ((515, 1), (528, 1), (528, 4)):  # rings with spare slots (speculative decoding)
            run_safely(bench_sliding, 1, R, 32, Q)
    if "norm" in only:
        for args in ((1, 8, 192, 32), (4096, 8, 192, 32), (4096, 8, 192, 96), (4096, 4, 256, 16)):
            run_safely(bench_norm_rope, *args)
    if "route" in only:
        for T in (1, 64, 4096):
            run_safely(bench_route, T)
    if "floors" in only:
        for programs in (16, 132, 264):
            run_safely(bench_chain, 1134, programs)
        for mb in (8, 24, 4096):
            run_safely(bench_read, mb)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.bench_kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="+", choices=GROUPS, default=GROUPS,
                    help="run only these groups (one process per group keeps a CUDA fault from ending the rest)")
    main(only=ap.parse_args().only)
