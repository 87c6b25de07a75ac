"""Prefill's grouped expert GEMMs over rows sorted by expert: the Triton kernel (FP8 or BF16, optionally gated with
SwiGLU in its epilogue) and the same FP8 GEMM in Gluon (TMA, mbarriers, wgmma, warp specialisation; sm90 only), with
their launchers. The reference: kernel.fp8_gemm_ref, through kernel.moe_experts_ref.
"""
import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as gcp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma as gtma,
                                                            warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import common
from kernels.common import (FP8, QBLOCK, _DOT, _PRECISE, _bf16_round, _cdiv, _check, _check_tensor, _launch_rows,
                            _pdl_enter, _pow2, _unspecialised)
from kernels.moe_route import _swiglu_math


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, sx_ptr, row_idx_ptr, w_ptr, sw_ptr, w3_ptr, sw3_ptr, out_ptr, row_off_ptr, x_desc, w_desc, w3_desc,
    N, K, E, limit,
    x_stride, sx_stride, w_stride_e, w_stride_n, sw_stride_e, sw_stride_n, out_stride,
    FP8: tl.constexpr, GATED: tl.constexpr, GATHER: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISE: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] output tile of one expert of a grouped GEMM, Y[rows of e] = X[rows of e] . W[e]^T.

    Rows are sorted by expert: expert e owns rows row_off[e] .. row_off[e+1]-1 (an exclusive prefix sum on the
    device) and ceil(rows_e / BLOCK_M) M tiles, numbered expert after expert. The grid covers the worst-case tile
    count; each program rebuilds the tile prefix sum from row_off (E values), finds its expert by counting the
    experts whose tiles end at or before its tile id, and programs past the last tile exit. GATHER: row r reads
    activation row row_idx[r] (the token), so X is never gathered in memory.
    FP8: X and W e4m3 with scales sx [row, kb] and sw [e, nb, kb]; per K block of 128,
         acc = acc + (fp32 dot) * sx * sw (act_quant_ref / fp8_gemm_ref); else bf16 operands, fp32 accumulation.
    GATED: also runs W3 on the same rows and stores swiglu(bf(X.W^T), bf(X.W3^T)) instead of bf(X.W^T).
    The 1-D grid's consecutive programs are the N tiles of one M tile, so the programs in flight share a few experts'
    rows and weights in L2 (a 2-D grid, M tiles fastest, read each row block from HBM once per N tile: -15%).
    TMA: the weight tiles (and X's, when not GATHER) come through tensor descriptors (w_desc over W as [E*N, K],
    x_desc over X [M, K]): one copy instruction per tile instead of a pointer per 16 bytes. A tile that runs past its
    expert's last row or column reads the next expert's (or the zeros past the tensor's end); those outputs are
    never stored. Same products, same order: same bits."""
    _pdl_enter(PDL)
    pid_m = tl.program_id(0) // tl.cdiv(N, BLOCK_N)
    pid_n = tl.program_id(0) % tl.cdiv(N, BLOCK_N)
    experts = tl.arange(0, BLOCK_E)
    r0 = tl.load(row_off_ptr + experts, mask=experts < E, other=0)
    r1 = tl.load(row_off_ptr + 1 + experts, mask=experts < E, other=0)
    tiles = (r1 - r0 + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)  # padding experts have 0 tiles, so they only count past the last tile
    e = tl.sum((tile_end <= pid_m).to(tl.int32), axis=0)
    if e >= E:  # beyond the last real tile
        return
    tile0 = tl.sum(tl.where(experts == e, tile_end - tiles, 0), axis=0)
    row0 = tl.load(row_off_ptr + e)
    row1 = tl.load(row_off_ptr + e + 1)
    rows = row0 + (pid_m - tile0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < row1
    if GATHER:
        src = tl.load(row_idx_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    e64 = e.to(tl.int64)
    w_base = w_ptr + e64 * w_stride_e + cols[:, None] * w_stride_n
    w3_base = w3_ptr + e64 * w_stride_e + cols[:, None] * w_stride_n
    sw_base = sw_ptr + e64 * sw_stride_e + (pid_n * BLOCK_N // BLOCK_K) * sw_stride_n  # BLOCK_N divides 128
    sw3_base = sw3_ptr + e64 * sw_stride_e + (pid_n * BLOCK_N // BLOCK_K) * sw_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < K  # ragged last block: masked columns are 0 on both sides
        if TMA and not GATHER:
            a = x_desc.load([row0 + (pid_m - tile0) * BLOCK_M, kb * BLOCK_K])
        else:
            a = tl.load(x_ptr + src[:, None] * x_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
        if TMA:
            b = w_desc.load([e * N + pid_n * BLOCK_N, kb * BLOCK_K])
        else:
            b = tl.load(w_base + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if FP8:
            sa = tl.load(sx_ptr + src * sx_stride + kb, mask=row_ok, other=0.0)
            # e4m3 x e4m3 -> fp32 on tensor cores; both scales applied in fp32 after each block (never folded in)
            acc = acc + tl.dot(a, tl.trans(b)) * sa[:, None] * tl.load(sw_base + kb)
            if GATED:
                if TMA:
                    b3 = w3_desc.load([e * N + pid_n * BLOCK_N, kb * BLOCK_K])
                else:
                    b3 = tl.load(w3_base + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                acc3 = acc3 + tl.dot(a, tl.trans(b3)) * sa[:, None] * tl.load(sw3_base + kb)
        else:
            a = a.to(DOT_DTYPE)
            acc = tl.dot(a, tl.trans(b.to(DOT_DTYPE)), acc)
            if GATED:
                b3 = tl.load(w3_base + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                acc3 = tl.dot(a, tl.trans(b3.to(DOT_DTYPE)), acc3)
    if GATED:
        y = _swiglu_math(_bf16_round(acc), _bf16_round(acc3), limit, HAS_LIMIT=HAS_LIMIT, PRECISE=PRECISE)
    else:
        y = _bf16_round(acc)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], y.to(tl.bfloat16),
             mask=row_ok[:, None] & col_ok[None, :])


def _gemm_block_m(rows_per_expert: float) -> int:
    # decode (a few rows per expert): the smallest MMA tile, the weight read dominates; prefill: bigger tiles
    return 16 if rows_per_expert <= 16 else (64 if rows_per_expert <= 96 else 128)


def grouped_gemm_triton(x, sx, w, sw, row_off, row_idx=None, w3=None, sw3=None, limit=None, block_m=None,
                        block_n=None, num_stages=None, num_warps=None, tma=None, wgmma=None):
    """Grouped expert GEMM over rows sorted by expert; one launch for all experts.

    x [Mx, K] (e4m3 with sx [Mx, ceil(K/128)] fp32, or bf16 with sx None); row_off [E+1] int32 on the device
    (expert e owns output rows row_off[e] .. row_off[e+1]-1); row_idx [M] int32 (output row r reads x[row_idx[r]])
    or None (M = Mx, identity); w [E, N, K] e4m3 with sw [E, ceil(N/128), ceil(K/128)] fp32, or bf16 with sw None.
    Returns [M, N] bf16: rows past row_off[E] are left unwritten. With w3 (and sw3): swiglu(X.W^T, X.W3^T, limit).
    tma: _grouped_gemm_kernel's TMA (same bits) where the strides allow it; None: FP8 on sm90 GPUs.
    wgmma: grouped_gemm_wgmma instead (same bits; TMA-able FP8 on sm90 only); None: at 128-row tiles and no tile
    arguments, where it is faster (PERF_LOG, the prefill expert GEMM)."""
    fp8 = sw is not None
    E, N, K = w.shape
    _check_tensor("w", w, FP8 if fp8 else torch.bfloat16, ndim=3)
    _check_tensor("x", x, FP8 if fp8 else torch.bfloat16, ndim=2)
    _check(x.shape[1] == K, lambda: f"x has K={x.shape[1]} but w has K={K}")
    _check_tensor("row_off", row_off, torch.int32, ndim=1)
    _check(row_off.numel() == E + 1, lambda: f"row_off must have E+1={E + 1} entries, got {row_off.numel()}")
    if fp8:
        _check_tensor("sw", sw, torch.float32, ndim=3)
        _check(tuple(sw.shape) == (E, _cdiv(N, QBLOCK), _cdiv(K, QBLOCK)),
               lambda: f"sw must be [E, ceil(N/128), ceil(K/128)] = "
               f"{(E, _cdiv(N, QBLOCK), _cdiv(K, QBLOCK))}, got {tuple(sw.shape)}")
        _check_tensor("sx", sx, torch.float32, ndim=2)
        _check(tuple(sx.shape) == (x.shape[0], _cdiv(K, QBLOCK)), lambda: f"sx shape {tuple(sx.shape)} != "
               f"{(x.shape[0], _cdiv(K, QBLOCK))}")
    if w3 is not None:
        _check(w3.shape == w.shape and w3.dtype == w.dtype and w3.is_contiguous(), "w3 must match w")
        if fp8:
            _check(sw3 is not None and sw3.shape == sw.shape and sw3.is_contiguous(), "sw3 must match sw")
    if row_idx is not None:
        _check_tensor("row_idx", row_idx, torch.int32, ndim=1)
    M = x.shape[0] if row_idx is None else row_idx.numel()
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if M == 0 or E == 0:
        return out
    BLOCK_M = block_m or _gemm_block_m(_launch_rows(M) / E)
    if tma is None:
        tma = fp8 and common._GPU_LAUNCH and common._sm90()
    # descriptors need 16-byte aligned bases and row strides
    tma = (tma and w.is_contiguous() and (K * w.element_size()) % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0
           and all(t.data_ptr() % 16 == 0 for t in (x, w, w3) if t is not None))
    if wgmma is None:
        wgmma = BLOCK_M == 128 and all(a is None for a in (block_m, block_n, num_stages, num_warps))
    if tma and wgmma and _wgmma_misfit(N, K, row_idx) is None:
        return grouped_gemm_wgmma(x, sx, w, sw, row_off, row_idx, w3, sw3, limit)
    if tma and BLOCK_M == 128 and block_m is None:
        # 4 warps, 3 stages: 3 CTAs share an SM, so one's scaling overlaps another's wgmmas (+10-18% over the 128 x 128
        # tiles of pointer loads, PERF_LOG "Per-kernel notes")
        BLOCK_M, bn = (128 if row_idx is not None else 64, 64) if w3 is not None else (64, 128)
        block_n, num_warps, num_stages = block_n or bn, num_warps or 4, num_stages or 3
    # the ungated GEMM: 128-wide N tiles, or 32 when so few tiles have rows (at most min(M, E) experts are active)
    # that 128-wide ones leave SMs idle; the gated kernel (two fp32 accumulators) and 64-row tiles: 64
    if block_n is None and common._GPU_LAUNCH:
        if w3 is not None or BLOCK_M == 64:
            block_n = 64
        else:
            block_n = 32 if min(M, E) * _cdiv(N, 128) < 264 else 128
    BLOCK_N = block_n or 64
    BLOCK_K = QBLOCK  # one FP8 scale block per K step
    # worst case over any split of M rows into E experts (no host sync: the true tile count stays on the device)
    grid = (min(_cdiv(M, BLOCK_M) + E, M) * _cdiv(N, BLOCK_N),)
    descs = [None] * 3  # x, w, w3: TMA copies whole tiles (zeros past the tensor's end) into shared memory
    if tma:
        descs = [None if row_idx is not None else TensorDescriptor.from_tensor(x, [BLOCK_M, QBLOCK])] + [
            TensorDescriptor.from_tensor(t.view(E * N, K), [BLOCK_N, QBLOCK]) if t is not None else None
            for t in (w, w3)]
    dummy = out  # never read when the matching constexpr is off
    _grouped_gemm_kernel[grid](
        x, sx if fp8 else dummy, row_idx if row_idx is not None else dummy, w, sw if fp8 else dummy,
        w3 if w3 is not None else w, (sw3 if w3 is not None else sw) if fp8 else dummy, out, row_off, *descs,
        N, K, E, float(limit) if limit is not None else 0.0,
        x.stride(0), sx.stride(0) if fp8 else 0, w.stride(0), w.stride(1),
        sw.stride(0) if fp8 else 0, sw.stride(1) if fp8 else 0, out.stride(0),
        FP8=fp8, GATED=w3 is not None, GATHER=row_idx is not None, HAS_LIMIT=limit is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_E=_pow2(E),
        DOT_DTYPE=_DOT, PRECISE=_PRECISE, TMA=bool(tma),
        num_warps=num_warps or (8 if BLOCK_M >= 128 else 4),  # bf16 tiles: twice the shared memory of e4m3
        num_stages=(num_stages or (4 if fp8 else 2)) if common._GPU_LAUNCH else 1, **common._pdl())
    return out


# The grouped FP8 GEMM again, in Gluon (explicit TMA, mbarriers, wgmma and warp specialisation; sm90 only, never under
# the interpreter: the CPU runs grouped_gemm_triton). Triton's sm90 build of _grouped_gemm_kernel keeps every warpgroup
# of a CTA in lockstep, so a CTA's tensor cores idle while it scales. Here a 128 x 256 tile (or 128 x 128) is split
# between two math warpgroups (64 rows each) that never wait for each other, fed by a loader (one TMA warp; for
# gathered rows a warpgroup adding x's rows by cp.async) through `stages` ready / empty mbarrier pairs.


@gluon.jit
def _add_i32(a, b):
    return a + b


@gluon.jit
def _wg_tile(t, row_off_ptr, N, E, BLOCK_M: gl.constexpr, OUT_N: gl.constexpr, BLOCK_E: gl.constexpr):
    """Tile t of the grouped GEMM (M tiles expert after expert, N tiles fastest) -> (expert, first row, end of the
    expert's rows, first column); expert >= E past the last tile."""
    n_tiles = gl.cdiv(N, OUT_N)
    pid_m = t // n_tiles
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    experts = gl.arange(0, BLOCK_E, layout=lay)
    r0 = gl.load(row_off_ptr + experts, mask=experts < E, other=0)
    r1 = gl.load(row_off_ptr + 1 + experts, mask=experts < E, other=0)
    tiles = (r1 - r0 + BLOCK_M - 1) // BLOCK_M
    tile_end = gl.associative_scan(tiles, 0, _add_i32)
    e = gl.sum((tile_end <= pid_m).to(gl.int32), axis=0)
    tile0 = gl.sum(gl.where(experts == e, tile_end - tiles, 0), axis=0)
    row0 = gl.sum(gl.where(experts == e, r0, 0), axis=0)
    row1 = gl.sum(gl.where(experts == e, r1, 0), axis=0)
    return e, row0 + (pid_m - tile0) * BLOCK_M, row1, (t % n_tiles) * OUT_N


@gluon.jit
def _wg_loader(x_desc, x_ptr, row_idx_ptr, x_stride, w_desc, w3_desc, a_s, b_s, ready, empty, row_off_ptr, N, K, E,
               total, GATED: gl.constexpr, GATHER: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               BLOCK_E: gl.constexpr, STAGES: gl.constexpr):
    """The loader: K block after K block of this CTA's tiles into stage i % STAGES (i counts the CTA's blocks), each
    once both math warpgroups have released it. The B tile is two boxes of BLOCK_N / 2 weight rows by TMA: GATED,
    W's and W3's rows of the same output columns (one tile computes gate and up); else W's next rows (w3_desc is W's
    then). x's block: by TMA (one warp), or GATHER (a warpgroup) rows row_idx[r] by cp.async, 16 bytes a thread and
    row, each thread arriving on the stage's barrier once its copies have landed (TMA reads whole row blocks only)."""
    H2: gl.constexpr = BLOCK_N // 2
    OUT_N: gl.constexpr = H2 if GATED else BLOCK_N
    SECOND: gl.constexpr = 0 if GATED else H2  # the second box: W3's rows of the same columns, or W's next rows
    lay: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [gl.num_warps(), 1], [1, 0])  # GATHER: x's block
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, lay))
    KB = gl.cdiv(K, 128)
    i = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e, m0, row1, n0 = _wg_tile(t, row_off_ptr, N, E, BLOCK_M, OUT_N, BLOCK_E)
        if e < E:
            if GATHER:
                rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, lay))
                ok = rows < row1
                src = x_ptr + gl.load(row_idx_ptr + rows, mask=ok, other=0).to(gl.int64)[:, None] * x_stride
            for kb in range(KB):
                s = i % STAGES  # a fresh barrier counts as released: the first pass waits for parity 1
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                if GATHER:
                    mbarrier.expect(bar, BLOCK_N * 128)
                else:
                    mbarrier.expect(bar, x_desc.block_type.nbytes + BLOCK_N * 128)
                    gtma.async_copy_global_to_shared(x_desc, [m0, kb * 128], bar, a_s.index(s))
                gtma.async_copy_global_to_shared(w_desc, [e * N + n0, kb * 128], bar, b_s.index(s).slice(0, H2))
                gtma.async_copy_global_to_shared(w3_desc, [e * N + n0 + SECOND, kb * 128], bar,
                                                 b_s.index(s).slice(H2, H2))
                if GATHER:  # (K // 16 * 16: 16-byte copies need the mask constant over 16 columns; K % 16 == 0)
                    k = kb * 128 + cols
                    gcp.async_copy_global_to_shared(a_s.index(s), src + k[None, :],
                                                    mask=ok[:, None] & (k < K // 16 * 16)[None, :])
                    gcp.mbarrier_arrive(bar, increment_count=False)
                i += 1


@gluon.jit
def _store_chunks(c_s, k0: gl.constexpr, x, W: gl.constexpr, CH: gl.constexpr):
    """x [R, W] -> c_s[k0 + k] = x[:, k * CH:(k + 1) * CH] for k < W / CH, halves split off in registers."""
    if W == CH:
        c_s.index(k0).store(x)
    else:
        lo, hi = x.reshape([x.shape[0], 2, W // 2]).permute((0, 2, 1)).split()
        _store_chunks(c_s, k0, lo, W // 2, CH)
        _store_chunks(c_s, k0 + W // 2 // CH, hi, W // 2, CH)


@gluon.jit
def _wg_math(half, a_s, b_s, ready, empty, c_s, out_desc, sx_ptr, row_idx_ptr, sw_ptr, sw3_ptr, out_ptr,
             row_off_ptr, N, K, E, total, limit, sx_stride, sw_stride_e, sw_stride_n, out_stride,
             GATED: gl.constexpr, GATHER: gl.constexpr, HAS_LIMIT: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, BLOCK_E: gl.constexpr, STAGES: gl.constexpr, PRECISE: gl.constexpr):
    """Math warpgroup `half`: rows [half * BLOCK_M / 2, +BLOCK_M / 2) of each tile, as two accumulators of
    BLOCK_N / 2 columns, one per B box (GATED: gate and up). Per K block and box: wgmma into fresh registers, wait,
    then acc + d * sx * sw as _grouped_gemm_kernel rounds it (same bits); the stage is released after the second.
    The other warpgroup's wgmmas run meanwhile. (A second register tile in flight during the scaling is what ptxas
    refuses: it serialises every wgmma when registers of one in flight are read, C7514.) The epilogue (GATED: SwiGLU
    of the two accumulators) writes bf16 64-column chunks to c_s[half * NC ...] and stores them by TMA."""
    H2: gl.constexpr = BLOCK_N // 2
    OUT_N: gl.constexpr = H2 if GATED else BLOCK_N
    SECOND: gl.constexpr = 0 if GATED else H2  # the second box's first column past n0 (as _wg_loader)
    HM: gl.constexpr = BLOCK_M // 2
    NC: gl.constexpr = OUT_N // 64  # c_s chunks per warpgroup
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, H2, 32])
    out_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    KB = gl.cdiv(K, 128)
    i = 0
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        e, m0, row1, n0 = _wg_tile(t, row_off_ptr, N, E, BLOCK_M, OUT_N, BLOCK_E)
        if e < E:
            rows = m0 + half * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, mma))
            row_ok = rows < row1
            if GATHER:  # x's rows (and their scales) row_idx[r]
                rows = gl.load(row_idx_ptr + rows, mask=row_ok, other=0)
            # each box lies in one 128-column scale block (H2 divides 128)
            sw0 = sw_ptr + e.to(gl.int64) * sw_stride_e + (n0 // 128) * sw_stride_n
            sw1 = sw3_ptr + e.to(gl.int64) * sw_stride_e + ((n0 + SECOND) // 128) * sw_stride_n
            acc0 = gl.zeros([HM, H2], gl.float32, mma)
            acc1 = gl.zeros([HM, H2], gl.float32, mma)
            for kb in range(KB):
                s = i % STAGES
                mbarrier.wait(ready.index(s), (i // STAGES) & 1)
                if GATHER:
                    fence_async_shared()  # x's block came by cp.async (the generic proxy), wgmma reads the async one
                a = a_s.index(s).slice(half * HM, HM)
                d = warpgroup_mma(a, b_s.index(s).slice(0, H2).permute((1, 0)), acc0, use_acc=False, is_async=True)
                sa = gl.load(sx_ptr + rows * sx_stride + kb, mask=row_ok, other=0.0)[:, None]
                g0 = gl.load(sw0 + kb)
                g1 = gl.load(sw1 + kb, mask=n0 + SECOND < N, other=0.0)
                d = warpgroup_mma_wait(num_outstanding=0, deps=(d,))
                # through a (no-op) wait: else LLVM sinks this scaling below the next wgmma, holding two register
                # tiles at once (256 registers: spills)
                acc0 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0 + d * sa * g0,))
                d = warpgroup_mma(a, b_s.index(s).slice(H2, H2).permute((1, 0)), acc1, use_acc=False, is_async=True)
                d = warpgroup_mma_wait(num_outstanding=0, deps=(d,))
                mbarrier.arrive(empty.index(s), count=1)
                acc1 = acc1 + d * sa * g1
                i += 1
            # the output through c_s (64-column chunks) and TMA stores, which the warpgroup does not wait for: the
            # next tile's K loop starts at once (down +11%, gate+up +1%: PERF_LOG "Per-kernel notes"); a
            # warpgroup whose rows reach past the expert's (TMA would write the next expert's) stores them masked
            gtma.store_wait(0)  # the last tile's stores have read c_s
            if GATED:
                y = _swiglu_math(_bf16_round(acc0), _bf16_round(acc1), limit, HAS_LIMIT=HAS_LIMIT, PRECISE=PRECISE)
                _store_chunks(c_s, half * NC, y.to(gl.bfloat16), OUT_N, 64)
            else:
                _store_chunks(c_s, half * NC, _bf16_round(acc0).to(gl.bfloat16), H2, 64)
                _store_chunks(c_s, half * NC + H2 // 64, _bf16_round(acc1).to(gl.bfloat16), H2, 64)
            fence_async_shared()
            r0 = m0 + half * HM
            if r0 + HM <= row1:
                for k in gl.static_range(NC):
                    gtma.async_copy_shared_to_global(out_desc, [r0, n0 + 64 * k], c_s.index(half * NC + k))
            else:
                orow = r0 + gl.arange(0, HM, layout=gl.SliceLayout(1, out_l))
                for k in gl.static_range(NC):
                    ocol = n0 + 64 * k + gl.arange(0, 64, layout=gl.SliceLayout(0, out_l))
                    gl.store(out_ptr + orow.to(gl.int64)[:, None] * out_stride + ocol[None, :],
                             c_s.index(half * NC + k).load(out_l), mask=(orow < row1)[:, None] & (ocol < N)[None, :])
    gtma.store_wait(0)


@gluon.jit
def _grouped_wgmma_kernel(
    x_desc, x_ptr, row_idx_ptr, x_stride, w_desc, w3_desc, out_desc, sx_ptr, sw_ptr, sw3_ptr, out_ptr, row_off_ptr,
    N, K, E, total, limit, sx_stride, sw_stride_e, sw_stride_n, out_stride,
    GATED: gl.constexpr, GATHER: gl.constexpr, HAS_LIMIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_E: gl.constexpr, STAGES: gl.constexpr, PRECISE: gl.constexpr, MATH_REGS: gl.constexpr,
):
    """Persistent: CTA p takes tiles p, p + grid, ... of `total` (the worst-case count; tiles past the last real
    one are skipped). Partitions: math warpgroups 0 (the default, 4 warps) and 1, the loader (TMA: one warp of 40
    registers; GATHER: a warpgroup of 48, the default math warpgroup then gets 224)."""
    a_s = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, 128], x_desc.layout)
    b_s = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, 128], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    OUT_N: gl.constexpr = BLOCK_N // 2 if GATED else BLOCK_N
    c_s = gl.allocate_shared_memory(gl.bfloat16, [2 * OUT_N // 64, BLOCK_M // 2, 64], out_desc.layout)
    LOAD_WARPS: gl.constexpr = 4 if GATHER else 1
    for s in gl.static_range(STAGES):
        # the expect-tx arrival, and GATHER each loader thread's cp.async arrival
        mbarrier.init(ready.index(s), count=1 + 32 * LOAD_WARPS if GATHER else 1)
        mbarrier.init(empty.index(s), count=2)
    gl.warp_specialize([
        (_wg_math, (0, a_s, b_s, ready, empty, c_s, out_desc, sx_ptr, row_idx_ptr, sw_ptr, sw3_ptr, out_ptr,
                    row_off_ptr, N, K, E, total, limit, sx_stride, sw_stride_e, sw_stride_n, out_stride, GATED,
                    GATHER, HAS_LIMIT, BLOCK_M, BLOCK_N, BLOCK_E, STAGES, PRECISE)),
        (_wg_math, (1, a_s, b_s, ready, empty, c_s, out_desc, sx_ptr, row_idx_ptr, sw_ptr, sw3_ptr, out_ptr,
                    row_off_ptr, N, K, E, total, limit, sx_stride, sw_stride_e, sw_stride_n, out_stride, GATED,
                    GATHER, HAS_LIMIT, BLOCK_M, BLOCK_N, BLOCK_E, STAGES, PRECISE)),
        (_wg_loader, (x_desc, x_ptr, row_idx_ptr, x_stride, w_desc, w3_desc, a_s, b_s, ready, empty, row_off_ptr, N,
                      K, E, total, GATED, GATHER, BLOCK_M, BLOCK_N, BLOCK_E, STAGES))],
                       [4, LOAD_WARPS], [MATH_REGS, 48 if GATHER else 40])


def _wgmma_misfit(N, K, row_idx):
    """Why grouped_gemm_wgmma cannot take these shapes (None if it can): the output is stored by TMA (16-byte rows),
    gathered rows are copied 16 bytes at a time."""
    if N % 8:
        return f"N={N} is not a multiple of 8 (the output's TMA row stride)"
    if row_idx is not None and K % 16:
        return f"K={K} is not a multiple of 16 (row_idx)"
    return None


_grouped_wgmma_prefill = _unspecialised(_grouped_wgmma_kernel, "total", jit=gluon.jit)


# A prefill pass makes two expert GEMM calls per MoE layer; building their layouts and descriptors anew cost ~50 us of
# host time a call (17 us with these caches on a CPU, PERF_LOG "prefill's MoE host path"): layouts are built once per
# shape, weight descriptors once per tensor.
@functools.cache
def _fp8_box_layout(rows: int):
    """The shared-memory layout of an e4m3 TMA box [rows, 128]."""
    return gl.NVMMASharedLayout.get_default_for([rows, QBLOCK], gl.float8e4nv)


_OUT_BOX_LAYOUT = gl.NVMMASharedLayout(128, 16)  # the bf16 output's [64, 64] boxes


def _weight_desc(w, rows):
    """The TMA descriptor of expert weights w [E, N, K] e4m3 as [E*N, K] in [rows, 128] boxes, kept on the tensor
    (the model passes the same weight tensors every call; rebuilt if w's storage or shape changed). Its base is a
    view of w.detach(): a view of w itself would keep w alive through this attribute after the model drops it."""
    E, N, K = w.shape
    d = getattr(w, "_wgmma_desc", None)
    if (d is None or list(d.block_shape) != [rows, QBLOCK] or tuple(d.shape) != (E * N, K)
            or d.base.data_ptr() != w.data_ptr()):
        d = GluonDescriptor.from_tensor(w.detach().view(E * N, K), [rows, QBLOCK], _fp8_box_layout(rows))
        w._wgmma_desc = d
    return d


def grouped_gemm_wgmma(x, sx, w, sw, row_off, row_idx=None, w3=None, sw3=None, limit=None, stages=3, block_n=256):
    """grouped_gemm_triton for FP8 on sm90 through _grouped_wgmma_kernel (Gluon): same arguments, and the same bits as
    its tiles of >= 64 rows (wgmma too; its 16-row tiles add a K block's products in another order).

    row_idx: x's rows row_idx[r] are read by the loader warpgroup's cp.async (TMA on sm90 reads whole row blocks only;
    the rows of no expert, past row_off[E], are never read). Persistent: one CTA per SM walks the tiles (N fastest, so
    the CTAs in flight share an M tile's rows and an expert's weights in L2) while the loader keeps `stages` K blocks in
    flight across tile boundaries. block_n: B tile rows (128 or 256; gated: half W's, half W3's); 256 halves the
    shared-memory bytes per FLOP (768 against 670 TFLOP/s at 1024 rows per expert, PERF_LOG "Per-kernel notes"). What
    holds it near 60% of the FP8 peak is each warpgroup's chain wgmma -> wait -> scale (the spec's (sum * sx) * Sw is
    an FMUL and an FFMA per element) with two warpgroups to interleave: PERF_LOG has the measurements and the variants
    tried."""
    E, N, K = w.shape
    _check(sw is not None and w.dtype == FP8 and x.dtype == FP8, "grouped_gemm_wgmma is for e4m3 x and w")
    misfit = _wgmma_misfit(N, K, row_idx)
    _check(misfit is None, lambda: f"grouped_gemm_wgmma: {misfit}")
    M = x.shape[0] if row_idx is None else row_idx.numel()
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if M == 0 or E == 0:
        return out
    BLOCK_M = 128
    _check(block_n in (128, 256), lambda: f"grouped_gemm_wgmma: block_n {block_n} is not 128 or 256")
    gated = w3 is not None
    out_n = block_n // 2 if gated else block_n
    x_desc = GluonDescriptor.from_tensor(x, [BLOCK_M, QBLOCK], _fp8_box_layout(BLOCK_M))
    w_desc, w3_desc = (_weight_desc(t, block_n // 2) for t in (w, w3 if gated else w))
    out_desc = GluonDescriptor.from_tensor(out, [BLOCK_M // 2, 64], _OUT_BOX_LAYOUT)
    total = (_cdiv(M, BLOCK_M) + E) * _cdiv(N, out_n)  # worst case over any split of M rows into E experts
    _grouped_wgmma_prefill[(min(total, common._sms()),)](
        x_desc, x, row_off if row_idx is None else row_idx, x.stride(0), w_desc, w3_desc, out_desc, sx, sw,
        sw3 if gated else sw, out, row_off, N, K, E, total,
        float(limit) if limit is not None else 0.0, sx.stride(0), sw.stride(0), sw.stride(1), out.stride(0),
        GATED=gated, GATHER=row_idx is not None, HAS_LIMIT=limit is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_E=_pow2(E), STAGES=stages, PRECISE=_PRECISE, MATH_REGS=232, num_warps=4)
    return out
