"""GEMM and the TP reduction: the few-row bf16 projections of decode (skinny_linear_triton), the rank-ordered sum of
the partials fused with the residual add and the next norm (add_norm_triton), and its one-shot form over peer
memory (peer_add_norm_triton), with their launchers. The references: kernel.skinny_linear_ref, kernel.add_norm_ref.
"""
import torch
import triton
import triton.language as tl

from kernels import common
from kernels.common import (PREFILL_ROWS, _DOT, _bf16_round, _cdiv, _check, _check_tensor, _pdl_enter, _pow2,
                            _unspecialised)


@triton.jit
def _skinny_tile(x_ptr, x_stride, rows, row_ok, w_ptr, cols, col_ok, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, PARTS: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 = x[rows] . w[cols]^T for bf16 x [*, K] (row stride x_stride) and w [*, K]. K is cut
    into PARTS (1, 2, 4 or 8) contiguous parts of KP = cdiv(K, 16 * PARTS) * 16 columns, each summed in order by its
    own MMA chain (a batch of the 3-D dot: one warp each at 4 warps), and added pairwise: (p0 + p1) + (p2 + p3), where
    one chain over K is 256 dependent mma.sync at K = 4096. The order depends on K alone (not on M, N or the tiles).
    BLOCK_K: columns per loop step, all parts together."""
    tl.static_assert((PARTS == 1) | (PARTS == 2) | (PARTS == 4) | (PARTS == 8))
    KP = tl.cdiv(K, 16 * PARTS) * 16
    BKP: tl.constexpr = BLOCK_K // PARTS
    part = tl.arange(0, PARTS)
    w_rows = w_ptr + cols.to(tl.int64)[None, :, None] * K  # [1, BLOCK_N, 1]
    x_rows = x_ptr + rows[None, :, None] * x_stride  # [1, BLOCK_M, 1]
    acc = tl.zeros((PARTS, BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, KP, BKP):
        kk = k0 + tl.arange(0, BKP)
        ks = (part[:, None] * KP + kk[None, :])[:, None, :]  # [PARTS, 1, BKP]
        k_ok = ((kk[None, :] < KP)[:, None, :]) & (ks < K)
        a = tl.load(x_rows + ks, mask=row_ok[None, :, None] & k_ok, other=0.0)  # [PARTS, BLOCK_M, BKP]
        b = tl.load(w_rows + ks, mask=col_ok[None, :, None] & k_ok, other=0.0)  # [PARTS, BLOCK_N, BKP]
        acc = tl.dot(a.to(tl.float32).to(DOT_DTYPE), tl.permute(b.to(tl.float32).to(DOT_DTYPE), (0, 2, 1)), acc)
    return _sum_parts(tl.permute(acc, (1, 2, 0)), BLOCK_M, BLOCK_N, PARTS)


@triton.jit
def _sum_parts(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PARTS: tl.constexpr):
    """[M, N, PARTS] -> [M, N], added in pairs: (p0 + p1) + (p2 + p3) at PARTS = 4."""
    if PARTS >= 8:
        lo, hi = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 4, 2)))
        acc = lo + hi
    if PARTS >= 4:
        lo, hi = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2, 2)))
        acc = lo + hi
    if PARTS >= 2:
        lo, hi = tl.split(acc)
        acc = lo + hi
    return tl.reshape(acc, (BLOCK_M, BLOCK_N))


@triton.jit
def _skinny_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, x_stride, out_stride,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          DOT_DTYPE: tl.constexpr, PARTS: tl.constexpr, PDL: tl.constexpr):
    """Columns [pid * BLOCK_N, +BLOCK_N) of the output for all M <= BLOCK_M rows (_skinny_tile). Many programs of few
    columns keep enough loads in flight to stream W at batch 1."""
    _pdl_enter(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    col_ok, row_ok = cols < N, rows < M
    acc = _skinny_tile(x_ptr, x_stride, rows, row_ok, w_ptr, cols, col_ok, K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE,
                       PARTS)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], _bf16_round(acc).to(tl.bfloat16),
             mask=row_ok[:, None] & col_ok[None, :])


def skinny_linear_triton(x, w, block_n=None, block_k=None, num_stages=None, num_warps=None,
                         skinny_tiles=((32, 256), (16, 512)), skinny_stages=6, skinny_parts=4, skinny_warps=4):
    """Triton skinny_linear_ref for M <= 16 rows. Tiles: the widest of 64 / 32 / 16 columns that still gives >= 100
    programs (skinny_tiles: (columns, K block) at 3200 <= N < 6400 and at N < 3200, with skinny_stages; 64 x 128 at 6
    stages from 6400 columns: lm_head at cuBLAS's speed). Every tile and warp count gives the same bits: each part of
    K is summed in 16-wide MMA steps in order whatever the tile. skinny_parts: MMA chains over K (_skinny_tile).
    skinny_*: kernel.TUNING's, which kernel.skinny_linear passes."""
    _check_tensor("x", x, torch.bfloat16, ndim=2, contiguous=False)
    _check(x.stride(1) == 1, lambda: f"x must have contiguous rows, got strides {x.stride()}")
    _check_tensor("w", w, torch.bfloat16, ndim=2)
    M, K = x.shape
    N = w.shape[0]
    _check(w.shape[1] == K and M <= 16, lambda: f"x [M <= 16, K] and w [N, K]: got {tuple(x.shape)}, {tuple(w.shape)}")
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    st = skinny_stages
    mid, small = skinny_tiles
    bn, bk, ns = (64, 128, 6) if N >= 6400 else (*mid, st) if N >= 3200 else (*small, st)
    block_n, block_k, num_stages = block_n or bn, block_k or bk, num_stages or ns
    if M and N:
        _skinny_linear_kernel[(_cdiv(N, block_n),)](
            x, w, out, M, N, K, x.stride(0), out.stride(0), BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_DTYPE=_DOT, PARTS=skinny_parts, num_warps=num_warps or skinny_warps,
            num_stages=num_stages if common._GPU_LAUNCH else 1, **common._pdl())
    return out


@triton.jit
def _norm_weight(w_ptr, D, BLOCK_D: tl.constexpr, NORM: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    return tl.load(w_ptr + d, mask=d < D, other=0.0) if NORM else tl.zeros((BLOCK_D,), tl.float32)


@triton.jit
def _residual_norm(acc, res_ptr, w, res_out_ptr, h_ptr, row, D, eps, BLOCK_D: tl.constexpr, PARTS_BF16: tl.constexpr,
                   NORM: tl.constexpr):
    """The tail of both add_norm kernels: the rank-ordered sum acc [BLOCK_D] fp32 of row `row` (int64), rounded to
    the partials' dtype, added to the fp32 residual; then _rms_norm_kernel's arithmetic on the new residual. w: the
    norm weight [BLOCK_D], loaded by the kernel before its PDL wait (a parameter: no kernel writes it)."""
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    if PARTS_BF16:
        acc = _bf16_round(acc)
    x = tl.load(res_ptr + row * D + d, mask=ok, other=0.0) + acc
    tl.store(res_out_ptr + row * D + d, x, mask=ok)
    if NORM:
        r_ = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps))
        y = x * r_ * (w + 1.0)
        tl.store(h_ptr + row * D + d, _bf16_round(y).to(tl.bfloat16), mask=ok)


@triton.jit
def _add_norm_kernel(res_ptr, parts_ptr, w_ptr, res_out_ptr, h_ptr, W, T, D, eps,
                     PARTS_BF16: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One row per program: the rank-ordered fp32 sum of the W partials, rounded to their dtype, added to the fp32
    residual; then _rms_norm_kernel's arithmetic on the new residual. Replaces the cast, add and norm launches
    (and, at W > 1, the elementwise rank-order sum) between two GEMMs of a decode layer."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    w = _norm_weight(w_ptr, D, BLOCK_D, NORM=NORM)
    _pdl_enter(PDL)
    acc = tl.load(parts_ptr + row * D + d, mask=ok, other=0.0).to(tl.float32)
    for r in range(1, W):
        acc = acc + tl.load(parts_ptr + (r * T + row) * D + d, mask=ok, other=0.0).to(tl.float32)
    _residual_norm(acc, res_ptr, w, res_out_ptr, h_ptr, row, D, eps, BLOCK_D, PARTS_BF16=PARTS_BF16, NORM=NORM)


_add_norm_prefill = _unspecialised(_add_norm_kernel, "T")


def _add_norm_outputs(res, w):
    """The add_norm launchers' norm weight check and outputs: (res' like res [T, D] fp32, h [T, D] bf16 or None)."""
    T, D = res.shape
    if w is not None:
        _check_tensor("w", w, torch.float32, ndim=1)
        _check(w.numel() == D, lambda: f"w must be [{D}], got {tuple(w.shape)}")
    return torch.empty_like(res), (torch.empty(T, D, dtype=torch.bfloat16, device=res.device) if w is not None
                                   else None)


def add_norm_triton(res, parts, w, eps):
    _check_tensor("res", res, torch.float32, ndim=2)
    T, D = res.shape
    _check_tensor("parts", parts, parts.dtype, ndim=3)
    _check(parts.dtype in (torch.bfloat16, torch.float32) and tuple(parts.shape[1:]) == (T, D),
           lambda: f"parts must be bf16/fp32 [W, T={T}, D={D}], got {parts.dtype} {tuple(parts.shape)}")
    out, h = _add_norm_outputs(res, w)
    if T:
        (_add_norm_kernel if T <= PREFILL_ROWS else _add_norm_prefill)[(T,)](
            res, parts, w if w is not None else res, out, h if h is not None else out,
                               parts.shape[0], T, D, float(eps), PARTS_BF16=parts.dtype == torch.bfloat16,
                               NORM=w is not None, BLOCK_D=_pow2(D), num_warps=8 if D >= 2048 else 4,
                               **common._pdl())
    return out, h


@triton.jit
def _peer_add_norm_kernel(res_ptr, bufs_ptr, pads_ptr, w_ptr, res_out_ptr, h_ptr, rank, D, slot_off, flag_off, eps,
                          W: tl.constexpr, PARTS_BF16: tl.constexpr, NORM: tl.constexpr, BLOCK_D: tl.constexpr,
                          PDL: tl.constexpr):
    """_add_norm_kernel over partials that stay in the W ranks' symmetric buffers (peer memory over NVLink): a
    one-shot TP reduction fused with the residual add and the next norm, one row per program.

    bufs_ptr [W] int64: rank r's buffer base address (its row `row` at element slot_off + row * D); pads_ptr [W]
    int64: rank r's int32 signal pad. The program first tells every rank that this rank's row is in place (flag
    flag_off + row * W + rank of that rank's pad, 0 -> 1, release, system scope; it spins while the flag of the
    previous call is still set), then takes every rank's flag from its own pad (1 -> 0, acquire), then reads the W
    rows in rank order. A rank's next write into the same slot waits for every rank's next flag, i.e. for every
    rank having finished this call: callers alternate two slots (slot_off) between consecutive calls."""
    w = _norm_weight(w_ptr, D, BLOCK_D, NORM=NORM)
    _pdl_enter(PDL)
    row = tl.program_id(0)
    for r in tl.static_range(W):
        pad = tl.load(pads_ptr + r).to(tl.pointer_type(tl.int32))
        while tl.atomic_cas(pad + flag_off + row * W + rank, 0, 1, sem="release", scope="sys") != 0:
            pass
    own = tl.load(pads_ptr + rank).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(W):
        while tl.atomic_cas(own + flag_off + row * W + r, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    part_t = tl.pointer_type(tl.bfloat16) if PARTS_BF16 else tl.pointer_type(tl.float32)
    at = slot_off + row.to(tl.int64) * D + d
    acc = tl.load(tl.load(bufs_ptr).to(part_t) + at, mask=ok, other=0.0, volatile=True).to(tl.float32)
    for r in tl.static_range(1, W):  # rank order, one fp32 accumulator, as _add_norm_kernel adds
        base = tl.load(bufs_ptr + r).to(part_t)
        acc = acc + tl.load(base + at, mask=ok, other=0.0, volatile=True).to(tl.float32)
    _residual_norm(acc, res_ptr, w, res_out_ptr, h_ptr, row.to(tl.int64), D, eps, BLOCK_D, PARTS_BF16=PARTS_BF16,
                   NORM=NORM)


def peer_add_norm_triton(res, bufs, pads, rank, parts_dtype, w, eps, slot_off=0, flag_off=0):
    """add_norm_ref(res, [every rank's partial row], w, eps), the partials read from the W ranks' symmetric-memory
    buffers: the one-shot TP reduction, an opt-in path (model.OneShotReduce; tools.bench_reduce checks and times it,
    tools.bench_decode --one-shot times the step with it). bufs, pads: int64 [W] device tensors of every rank's buffer
    and int32 signal-pad addresses (a torch.distributed._symmetric_memory handle's buffer_ptrs / signal_pad_ptrs);
    rank r's row t of this call is at element slot_off + t * D of its buffer, in parts_dtype; the flags at flag_off ..
    flag_off + T * W - 1."""
    _check_tensor("res", res, torch.float32, ndim=2)
    T, D = res.shape
    for name, t_ in (("bufs", bufs), ("pads", pads)):
        _check_tensor(name, t_, torch.int64, ndim=1)
    W = bufs.numel()
    _check(pads.numel() == W and 0 <= rank < W and parts_dtype in (torch.bfloat16, torch.float32),
           lambda: f"bufs, pads must both hold W={W} addresses, 0 <= rank={rank} < W, parts bf16/fp32 "
           f"(got {parts_dtype})")
    out, h = _add_norm_outputs(res, w)
    if T:
        _peer_add_norm_kernel[(T,)](res, bufs, pads, w if w is not None else res, out, h if h is not None else out,
                                    rank, D, slot_off, flag_off, float(eps), W=W,
                                    PARTS_BF16=parts_dtype == torch.bfloat16, NORM=w is not None,
                                    BLOCK_D=_pow2(D), num_warps=8 if D >= 2048 else 4, **common._pdl())
    return out, h
