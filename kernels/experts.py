"""The MoE expert layer on the Triton path: the sort-free decode kernels (gate/up, down; the shared expert in the
same launches), the slot-order combine, and the launchers of both paths: decode's, and prefill's over rows sorted by
expert (moe_route's dispatch, expert_gemm's GEMMs); moe_experts_triton picks one. The reference:
kernel.moe_experts_ref.
"""
import threading

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import common
from kernels.common import (FP8, PREFILL_ROWS, QBLOCK, _DOT, _NO_FMA, _PRECISE, _bf16_round, _cdiv, _check,
                            _check_tensor, _pdl_enter, _pow2, _to_e4m3)
from kernels.expert_gemm import grouped_gemm_triton
from kernels.linear import _skinny_tile
from kernels.moe_route import _block_scale, _swiglu_math, act_quant_triton, moe_dispatch_triton, swiglu_triton


# Decode: T*k <= DECODE_SLOTS (token, slot) pairs. No sort: each program finds its expert from the ids in registers.
# Grid axis 1 = rank u of a hit local expert (ascending id; at most min(T*k, E) of them, programs of ranks past the
# number hit exit at once) plus, first, the shared expert; axis 0 = N tiles of BLOCK_N columns, so one hit expert's
# weights are streamed by cdiv(N, BLOCK_N) programs (~50-100 at F = 1536, D = 4096) and read once for all its rows.
# moe_experts_triton sends it every batch of up to DECODE_SLOTS slots (160 us at T = 16 where the sorted path took 175).
DECODE_SLOTS = 128


@triton.jit
def _quant_rows(x):
    """bf16-valued fp32 [M, 128] -> (e4m3 tile, sx [M]) with act_quant_ref's arithmetic: the block is the K step,
    so quantising on load equals quantising the whole row first."""
    sx, inv = _block_scale(x)
    return _to_e4m3(x * inv[:, None]), sx


@triton.jit
def _decode_tile(x_ptr, x_rows, row_ok, x_stride, w_ptr, w3_ptr, cols, col_ok, K, kb0, kb1, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, K_UNROLL: tl.constexpr,
                 GATED: tl.constexpr):
    """BF16 experts: acc (and acc3 when GATED) [BLOCK_M, BLOCK_N] fp32 = X[x_rows] . W[cols]^T over the K blocks
    kb0 .. kb1-1 (bf16 products, fp32 accumulation), w_ptr/w3_ptr at the expert's [N, K] weights. K_UNROLL: K blocks
    per loop iteration, written out (it must divide kb1 - kb0; the blocks are still added one by one in K order, so
    every K_UNROLL gives the same bits)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_base = x_ptr + x_rows.to(tl.int64)[:, None] * x_stride
    w_base = w_ptr + cols.to(tl.int64)[:, None] * K
    w3_base = w3_ptr + cols.to(tl.int64)[:, None] * K
    for kb_u in range(kb0, kb1, K_UNROLL):
        for u_ in tl.static_range(K_UNROLL):
            kb = kb_u + u_
            ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < K  # ragged last block: masked columns are 0 on both sides
            x_ok = row_ok[:, None] & k_ok[None, :]
            a = tl.load(x_base + ks[None, :], mask=x_ok, other=0.0).to(tl.float32)
            b = tl.load(w_base + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            a = a.to(DOT_DTYPE)
            acc = tl.dot(a, tl.trans(b.to(tl.float32).to(DOT_DTYPE)), acc)
            if GATED:
                b3 = tl.load(w3_base + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                acc3 = tl.dot(a, tl.trans(b3.to(tl.float32).to(DOT_DTYPE)), acc3)
    return acc, acc3


@triton.jit
def _decode_tile_swapped(x_ptr, sx_ptr, x_rows, row_ok, x_stride, w_ptr, w3_ptr, sw_ptr, sw3_ptr, c0, N, K, kb0, kb1,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_UNROLL: tl.constexpr,
                         XQ: tl.constexpr, GATED: tl.constexpr, w_desc=None, w_row0=0, x_desc=None,
                         W_TMA: tl.constexpr = False, X_TMA: tl.constexpr = False):
    """FP8 experts: X[x_rows] . W[c0 .. c0+BLOCK_N-1]^T with the MMA's operands swapped: the weight rows are its M
    side, [R, 128] per K block with R = BLOCK_N, or 2 * BLOCK_N when GATED (these columns' gate rows, then their up
    rows), and the few token rows its N side: at R = 64 one fp8 wgmma (sm90) with both operands in shared memory,
    where 16 token rows as M would be an mma.sync with its e4m3 operands converted to f16 in registers. Per 128-wide
    K block acc + (fp32 dot) * sx * sw, as _grouped_gemm_kernel rounds it; XQ: X is e4m3 already with scales sx_ptr
    [row, kb] (act_quant_triton), else it is quantised per 1x128 block on load (act_quant_ref's arithmetic). Returns
    (acc, acc3) [BLOCK_M, BLOCK_N] like _decode_tile (acc3 = acc when not GATED).
    W_TMA: the weight block is one box of w_desc ([2 or 1, rows, K]: the two planes are W and W3) at row w_row0;
    rows past N are the next expert's (stored nowhere). X_TMA: x_desc's box at row 0 (zeros past the last token)."""
    R: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    r = tl.arange(0, R)
    w_rows = c0 + r % BLOCK_N  # [R] weight row (output column) of each MMA row
    w_ok = w_rows < N
    w_base = tl.where(r[:, None] < BLOCK_N, w_ptr, w3_ptr) + w_rows.to(tl.int64)[:, None] * K
    x_base = x_ptr + x_rows.to(tl.int64)[:, None] * x_stride
    acc = tl.zeros((R, BLOCK_M), dtype=tl.float32)
    for kb_u in range(kb0, kb1, K_UNROLL):
        for u_ in tl.static_range(K_UNROLL):
            kb = kb_u + u_
            ks = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = ks < K  # ragged last block: masked columns are 0 on both sides
            if X_TMA:
                a = x_desc.load([0, kb * BLOCK_K])
            else:
                a = tl.load(x_base + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if XQ:
                sa = tl.load(sx_ptr + x_rows * tl.cdiv(K, BLOCK_K) + kb, mask=row_ok, other=0.0)
            else:
                a, sa = _quant_rows(a.to(tl.float32))
            if W_TMA:
                b = tl.reshape(w_desc.load([0, w_row0, kb * BLOCK_K]), (R, BLOCK_K))
            else:
                b = tl.load(w_base + ks[None, :], mask=w_ok[:, None] & k_ok[None, :], other=0.0)
            # the row's own pointer, one load: a select of two loads compiled into a load and a predicated reload
            # of the same register, whose write-after-write wait added a memory round trip per iteration (sm90 SASS)
            sw = tl.load(tl.where(r < BLOCK_N, sw_ptr, sw3_ptr) + kb)  # [R]
            acc = acc + tl.dot(b, tl.trans(a)) * sa[None, :] * sw[:, None]
    if GATED:  # rows 0..BLOCK_N-1 gate, BLOCK_N..R-1 up: split them, back to [token, column]
        g, u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
        return tl.trans(g), tl.trans(u)
    else:
        return tl.trans(acc), tl.trans(acc)


@triton.jit
def _swiglu_tile_swapped(gu_ptr, tok, tok_ok, u_off, K, w_ptr, cols, col_ok, limit, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr, HAS_LIMIT: tl.constexpr,
                         PRECISE: tl.constexpr, ZERO_GUARD: tl.constexpr):
    """The shared expert's down tile: acc [BLOCK_M, BLOCK_N] fp32 = swiglu(G[tok], U[tok]) . W[cols]^T over K, G at
    gu_ptr ([*, K] rows), U u_off further (SwiGLU on load; ZERO_GUARD: _swiglu_math's), with the MMA's operands
    swapped: the weight rows are its M side (a bf16 wgmma at >= 64 rows, both operands in shared memory, accumulating
    over K in the MMA), so the down kernel holds no weight block in registers (3 CTAs per SM at batch 16)."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    g_base = gu_ptr + tok.to(tl.int64)[:, None] * K
    w_base = w_ptr + cols.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x_ok = tok_ok[:, None] & k_ok[None, :]
        g = tl.load(g_base + ks[None, :], mask=x_ok, other=0.0).to(tl.float32)
        u = tl.load(g_base + u_off + ks[None, :], mask=x_ok, other=0.0).to(tl.float32)
        a = _swiglu_math(g, u, limit, HAS_LIMIT=HAS_LIMIT, PRECISE=PRECISE, ZERO_GUARD=ZERO_GUARD).to(DOT_DTYPE)
        b = tl.load(w_base + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(b.to(tl.float32).to(DOT_DTYPE), tl.trans(a), acc)
    return tl.trans(acc)


@triton.jit
def _decode_expert(ids_ptr, u, first_expert, E, TK, BLOCK_TK: tl.constexpr, BLOCK_E: tl.constexpr):
    """The local expert of rank u among those hit (ascending id) -> (found, e, hit [BLOCK_TK]: the slots routed to
    e, before [BLOCK_TK]: how many earlier slots are routed to e). Slot s = t*k + j is local iff
    first_expert <= ids[s] < first_expert + E."""
    s = tl.arange(0, BLOCK_TK)
    loc = tl.load(ids_ptr + s, mask=s < TK, other=-1) - first_expert
    local = (loc >= 0) & (loc < E) & (s < TK)
    ex = tl.arange(0, BLOCK_E)
    present = tl.max(((loc[:, None] == ex[None, :]) & local[:, None]).to(tl.int32), axis=0)  # [BLOCK_E]
    rank = tl.cumsum(present, axis=0) - present
    e = tl.sum(tl.where((present > 0) & (rank == u), ex, 0), axis=0)
    hit = (local & (loc == e)).to(tl.int32)
    return u < tl.sum(present, axis=0), e, hit, tl.cumsum(hit, axis=0) - hit


@triton.jit
def _decode_rows(hit, before, m0, BLOCK_M: tl.constexpr, BLOCK_TK: tl.constexpr):
    """Rows m0 .. m0+BLOCK_M-1 of an expert: the slot of each (the row-th slot routed to it) and whether it exists."""
    sel = (hit[None, :] > 0) & (before[None, :] == m0 + tl.arange(0, BLOCK_M)[:, None])  # [BLOCK_M, BLOCK_TK]
    slot = tl.sum(tl.where(sel, tl.arange(0, BLOCK_TK)[None, :], 0), axis=1)
    return slot, tl.sum(sel.to(tl.int32), axis=1) > 0


@triton.jit
def _token_slots(ids_ptr, T, e, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, TOPK_P2: tl.constexpr):
    """Token rows 0..BLOCK_M-1 -> (the slot t*TOPK + j routed to (global) expert e, whether there is one: a token's
    k experts are distinct)."""
    t = tl.arange(0, BLOCK_M)[:, None]
    j = tl.arange(0, TOPK_P2)[None, :]
    s = t * TOPK + j
    hit = (t < T) & (j < TOPK) & (tl.load(ids_ptr + s, mask=(t < T) & (j < TOPK), other=-1) == e)
    return tl.sum(tl.where(hit, s, 0), axis=1), tl.sum(hit.to(tl.int32), axis=1) > 0


@triton.jit
def _store_gated(a_ptr, g, up, slot, row_ok, cols, col_ok, F, limit, HAS_LIMIT: tl.constexpr, PRECISE: tl.constexpr,
                 ZERO_GUARD: tl.constexpr):
    """a[slot, cols] = swiglu(bf(g), bf(up)) as bf16 for the rows that exist (MLP's rounding points)."""
    y = _swiglu_math(_bf16_round(g), _bf16_round(up), limit, HAS_LIMIT=HAS_LIMIT, PRECISE=PRECISE,
                     ZERO_GUARD=ZERO_GUARD)
    tl.store(a_ptr + slot.to(tl.int64)[:, None] * F + cols[None, :], y.to(tl.bfloat16),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _arrive(flag):
    """+1 on the int32 at flag (release, GPU scope) once every thread of the program has stored its results: the
    barrier orders their stores before the one thread's atomic, whose release covers them."""
    tl.debug_barrier()
    tl.atomic_add(flag, 1, sem="release", scope="gpu")


@triton.jit
def _await(flag, target):
    """Spin until the int32 at flag reaches target (acquire, GPU scope); the barrier then orders every thread's later
    loads after it."""
    while tl.atomic_add(flag, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit
def _enter_down(flag, target, needed, EARLY: tl.constexpr, PDL: tl.constexpr):
    """A down program's entry: EARLY releases the successor and, if it has work (needed), awaits its gate/up tiles'
    count at flag; otherwise _pdl_enter (the whole gate/up grid)."""
    if EARLY:
        if PDL:
            gdc_launch_dependents()
        if needed:
            _await(flag, target)
    else:
        _pdl_enter(PDL)


@triton.jit
def _moe_decode_up_kernel(
    x_ptr, sx_ptr, xb_ptr, ids_ptr, w1_ptr, w3_ptr, s1_ptr, s3_ptr, a_ptr, wg_ptr, wu_ptr, gu_ptr, w_desc, x_desc,
    cnt_ptr, T, D, F, FS, E, first_expert, limit, w_stride_e, sw_stride_e, sw_stride_n,
    TOPK: tl.constexpr, SHARED: tl.constexpr, FP8: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_TK: tl.constexpr,
    BLOCK_E: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISE: tl.constexpr,
    K_UNROLL: tl.constexpr, ZERO_GUARD: tl.constexpr, PDL: tl.constexpr,
    SHARED_PARTS: tl.constexpr, TMA: tl.constexpr, UP_FIRST: tl.constexpr, TOPK_P2: tl.constexpr,
    EARLY: tl.constexpr = False,
):
    """Gate/up of one N tile of one hit expert for all its rows: a[slot] = swiglu(bf(x.w1^T), bf(x.w3^T)) at the
    slot of each row; FP8: x comes quantised (x_ptr e4m3, sx_ptr scales [T, D/128]).
    Shared expert (SHARED, axis-1 program 0): tiles 0..nt-1 of its gate, then of its up, every token a row, stored
    separately as bf16 gu[0] = bf(x.wg^T), gu[1] = bf(x.wu^T) (MLP's rounding points): half the bytes per program of
    a gated tile, so the shared programs finish with the routed ones. Their K = D runs as SHARED_PARTS MMA chains
    (_skinny_tile). EARLY: each program that computed a tile then counts itself in at cnt[u] (_arrive), which the
    down kernel's programs of the same u await instead of the whole grid."""
    _pdl_enter(PDL)
    pid_n = tl.program_id(0)
    u = tl.program_id(1)
    if u < SHARED:
        nt = tl.cdiv(FS, BLOCK_N)
        if pid_n < 2 * nt:
            w = wg_ptr
            if pid_n >= nt:
                w = wu_ptr
            cols = (pid_n % nt) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < FS
            for m0 in range(0, T, BLOCK_M):
                tok = m0 + tl.arange(0, BLOCK_M)
                acc = _skinny_tile(xb_ptr, D, tok, tok < T, w, cols, col_ok, D, BLOCK_M, BLOCK_N, K_UNROLL * BLOCK_K,
                                   DOT_DTYPE, SHARED_PARTS)
                out = gu_ptr + ((pid_n // nt) * T + tok)[:, None] * FS + cols[None, :]
                tl.store(out, _bf16_round(acc).to(tl.bfloat16), mask=(tok < T)[:, None] & col_ok[None, :])
            if EARLY:
                _arrive(cnt_ptr + u)
    else:
        found, e, hit, before = _decode_expert(ids_ptr, u - SHARED, first_expert, E, T * TOPK, BLOCK_TK, BLOCK_E)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < F
        if found & (pid_n < tl.cdiv(F, BLOCK_N)):
            e64 = e.to(tl.int64)
            sw_off = e64 * sw_stride_e + (pid_n * BLOCK_N // BLOCK_K) * sw_stride_n  # BLOCK_N divides 128
            if TMA:  # T <= BLOCK_M: every token a row of the tile (x by TMA); the rows routed to e are stored
                tok = tl.arange(0, BLOCK_M)
                slot, row_ok = _token_slots(ids_ptr, T, e + first_expert, TOPK, BLOCK_M, TOPK_P2)
                s_first, s_second = s1_ptr + sw_off, s3_ptr + sw_off
                if UP_FIRST:  # the descriptor's first plane is W3 (the lower address)
                    s_first, s_second = s_second, s_first
                g, up = _decode_tile_swapped(x_ptr, sx_ptr, tok, tok < T, D, w1_ptr, w3_ptr, s_first, s_second,
                                             pid_n * BLOCK_N, F, D, 0, tl.cdiv(D, BLOCK_K), BLOCK_M, BLOCK_N, BLOCK_K,
                                             K_UNROLL, XQ=True, GATED=True, w_desc=w_desc,
                                             w_row0=e * F + pid_n * BLOCK_N, x_desc=x_desc, W_TMA=True, X_TMA=True)
                if UP_FIRST:
                    g, up = up, g
                _store_gated(a_ptr, g, up, slot, row_ok, cols, col_ok, F, limit, HAS_LIMIT=HAS_LIMIT, PRECISE=PRECISE,
                             ZERO_GUARD=ZERO_GUARD)
            else:
                for m0 in range(0, tl.sum(hit, axis=0), BLOCK_M):
                    slot, row_ok = _decode_rows(hit, before, m0, BLOCK_M, BLOCK_TK)
                    if FP8:
                        g, up = _decode_tile_swapped(x_ptr, sx_ptr, slot // TOPK, row_ok, D, w1_ptr + e64 * w_stride_e,
                                                     w3_ptr + e64 * w_stride_e, s1_ptr + sw_off, s3_ptr + sw_off,
                                                     pid_n * BLOCK_N, F, D, 0, tl.cdiv(D, BLOCK_K), BLOCK_M, BLOCK_N,
                                                     BLOCK_K, K_UNROLL, XQ=True, GATED=True)
                    else:
                        g, up = _decode_tile(x_ptr, slot // TOPK, row_ok, D, w1_ptr + e64 * w_stride_e,
                                             w3_ptr + e64 * w_stride_e, cols, col_ok, D, 0, tl.cdiv(D, BLOCK_K),
                                             BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, K_UNROLL, GATED=True)
                    _store_gated(a_ptr, g, up, slot, row_ok, cols, col_ok, F, limit, HAS_LIMIT=HAS_LIMIT,
                                 PRECISE=PRECISE, ZERO_GUARD=ZERO_GUARD)
            if EARLY:
                _arrive(cnt_ptr + u)


@triton.jit
def _moe_decode_down_kernel(
    a_ptr, ids_ptr, w2_ptr, s2_ptr, y_ptr, gu_ptr, wd_ptr, ys_ptr, w_desc, cnt_ptr,
    T, D, F, FS, E, first_expert, limit, limit_s, w_stride_e, sw_stride_e, sw_stride_n,
    TOPK: tl.constexpr, SHARED: tl.constexpr, FP8: tl.constexpr, HAS_LIMIT: tl.constexpr, HAS_LIMIT_S: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_TK: tl.constexpr,
    BLOCK_E: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISE: tl.constexpr,
    K_UNROLL: tl.constexpr, ZERO_GUARD: tl.constexpr, PDL: tl.constexpr, TMA: tl.constexpr,
    EARLY: tl.constexpr = False, UP_N: tl.constexpr = 64,
):
    """Down projection of one D tile of one hit expert: y[slot] = bf(a[slot] . w2^T), a quantised per 1x128 block on
    load (FP8).
    Shared expert (axis-1 program 0): ys[t] = bf(swiglu(gu[0, t], gu[1, t]) . wd^T), SwiGLU on load
    (_swiglu_tile_swapped).
    A routed program finds its expert before the PDL wait: ids were written by the router, which completed before
    the gate/up kernel (the predecessor, which writes only a) got past its own wait.
    EARLY: instead of the PDL wait (for the whole gate/up grid), a program awaits the gate/up tiles (UP_N columns
    each) of its own expert u: cnt[u] reaching their count (_await). Every gate/up program has started before this
    grid may (PDL launches it once all have passed their own wait), so none of them waits for an SM that a spinning
    program holds. The combine launch zeroes cnt again."""
    pid_n = tl.program_id(0)
    u = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < D
    if u < SHARED:
        _enter_down(cnt_ptr + u, 2 * tl.cdiv(FS, UP_N), True, EARLY=EARLY, PDL=PDL)
        for m0 in range(0, T, BLOCK_M):
            tok = m0 + tl.arange(0, BLOCK_M)
            acc = _swiglu_tile_swapped(gu_ptr, tok, tok < T, T * FS, FS, wd_ptr, cols, col_ok, limit_s, BLOCK_M,
                                       BLOCK_N, 64, DOT_DTYPE, HAS_LIMIT=HAS_LIMIT_S, PRECISE=PRECISE,
                                       ZERO_GUARD=ZERO_GUARD)
            tl.store(ys_ptr + tok.to(tl.int64)[:, None] * D + cols[None, :], _bf16_round(acc).to(tl.bfloat16),
                     mask=(tok < T)[:, None] & col_ok[None, :])
    else:
        found, e, hit, before = _decode_expert(ids_ptr, u - SHARED, first_expert, E, T * TOPK, BLOCK_TK, BLOCK_E)
        e64 = e.to(tl.int64)
        _enter_down(cnt_ptr + u, tl.cdiv(F, UP_N), found, EARLY=EARLY, PDL=PDL)
        if found:
            sw = s2_ptr + e64 * sw_stride_e + (pid_n * BLOCK_N // BLOCK_K) * sw_stride_n
            for m0 in range(0, tl.sum(hit, axis=0), BLOCK_M):
                slot, row_ok = _decode_rows(hit, before, m0, BLOCK_M, BLOCK_TK)
                if FP8:
                    acc, _ = _decode_tile_swapped(a_ptr, a_ptr, slot, row_ok, F, w2_ptr + e64 * w_stride_e, w2_ptr, sw,
                                                  sw, pid_n * BLOCK_N, D, F, 0, tl.cdiv(F, BLOCK_K), BLOCK_M, BLOCK_N,
                                                  BLOCK_K, K_UNROLL, XQ=False, GATED=False, w_desc=w_desc,
                                                  w_row0=e * D + pid_n * BLOCK_N, x_desc=None, W_TMA=TMA)
                else:
                    acc, _ = _decode_tile(a_ptr, slot, row_ok, F, w2_ptr + e64 * w_stride_e, w2_ptr, cols, col_ok, F, 0,
                                          tl.cdiv(F, BLOCK_K), BLOCK_M, BLOCK_N, BLOCK_K, DOT_DTYPE, K_UNROLL,
                                          GATED=False)
                tl.store(y_ptr + slot.to(tl.int64)[:, None] * D + cols[None, :], _bf16_round(acc).to(tl.bfloat16),
                         mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_combine_kernel(y_ptr, inv_ptr, ids_ptr, wts_ptr, ys_ptr, out_ptr, cnt_ptr, D, E, first_expert, NC,
                        TOPK: tl.constexpr, SHARED: tl.constexpr, SORTED: tl.constexpr, BLOCK_D: tl.constexpr,
                        PDL: tl.constexpr, BLOCK_C: tl.constexpr = 0):
    """out[t] = bf( sum over local slots j = 0..k-1 in order (one fp32 accumulator) of f32(y[row]) * w[t, j] ), a
    slot's row of y [*, D] being inv[t*k + j] (SORTED: prefill's rows sorted by expert) or t*k + j (decode); slot
    (t, j) is local iff first_expert <= ids[t, j] < first_expert + E. SHARED: out[t] = f32(that) + f32(ys[t]) in
    fp32 (the shared expert's output added at moe_experts_ref's rounding point). BLOCK_C > 0: program (0, 0) zeroes
    the NC arrival counters of the decode expert kernels (after the wait: the down grid, the last to read them, has
    completed)."""
    _pdl_enter(PDL)
    t = tl.program_id(0)
    if BLOCK_C > 0:
        if (t == 0) & (tl.program_id(1) == 0):
            c = tl.arange(0, BLOCK_C)
            tl.store(cnt_ptr + c, tl.zeros((BLOCK_C,), tl.int32), mask=c < NC)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        loc = tl.load(ids_ptr + t * TOPK + j) - first_expert
        local = (loc >= 0) & (loc < E)
        row = tl.load(inv_ptr + t * TOPK + j) if SORTED else t * TOPK + j
        y = tl.load(y_ptr + row.to(tl.int64) * D + cols, mask=col_ok & local, other=0.0).to(tl.float32)
        acc = acc + y * tl.load(wts_ptr + t * TOPK + j)
    r = _bf16_round(acc)
    out_row = out_ptr + t.to(tl.int64) * D
    if SHARED:
        ys = tl.load(ys_ptr + t.to(tl.int64) * D + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(out_row + cols, r + ys, mask=col_ok)
    else:
        tl.store(out_row + cols, r.to(tl.bfloat16), mask=col_ok)


def _moe_check(x, ids, weights, w1, w3, w2, s1, s3, s2):
    _check_tensor("x", x, torch.bfloat16, ndim=2)
    T, D = x.shape
    _check_tensor("ids", ids, torch.int64, ndim=2)
    _check_tensor("weights", weights, torch.float32, ndim=2)
    _check(ids.shape[0] == T and weights.shape == ids.shape,
           lambda: f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T={T}, k]")
    fp8 = s1 is not None
    E, F, _ = w1.shape
    _check(tuple(w1.shape) == (E, F, D) and tuple(w3.shape) == (E, F, D) and tuple(w2.shape) == (E, D, F),
           lambda: f"expert weights must be w1, w3 [E, F, D={D}] and w2 [E, D, F]; got {tuple(w1.shape)}, "
           f"{tuple(w3.shape)}, {tuple(w2.shape)}")
    _check((s3 is not None) == fp8 and (s2 is not None) == fp8, "s1, s3, s2 must be all set (FP8) or all None")
    return T, D, ids.shape[1], E, F, fp8


def _check_shared(shared, D):
    _check(isinstance(shared, tuple) and len(shared) == 4, "shared must be (wg, wu, wd, limit_s)")
    wg, wu, wd, _ = shared
    for name, t_ in (("shared wg", wg), ("shared wu", wu), ("shared wd", wd)):
        _check_tensor(name, t_, torch.bfloat16, ndim=2)
    Fs = wg.shape[0]
    _check(tuple(wg.shape) == (Fs, D) and tuple(wu.shape) == (Fs, D) and tuple(wd.shape) == (D, Fs),
           lambda: f"shared weights must be wg, wu [Fs, D={D}] and wd [D, Fs]; got {tuple(wg.shape)}, "
           f"{tuple(wu.shape)}, {tuple(wd.shape)}")
    return Fs


def _x_quant(x, xq):
    """act_quant_triton(x), or xq = (e4m3 [T, D], fp32 [T, D/128]) when the router already wrote it (route(quant))."""
    if xq is None:
        return act_quant_triton(x)
    q, sx = xq
    _check(q.dtype == FP8 and q.shape == x.shape and sx.dtype == torch.float32
           and tuple(sx.shape) == (x.shape[0], _cdiv(x.shape[1], QBLOCK)) and q.is_contiguous()
           and sx.is_contiguous(), lambda: f"xq must be (e4m3 {tuple(x.shape)}, fp32 [T, D/128]) as act_quant_triton's")
    return q, sx


def shared_expert(x, shared, act):
    """model.MLP's shared expert with torch GEMMs: bf(bf(act(bf(x.wg^T), bf(x.wu^T))) . wd^T); act: a swiglu
    (kernel.moe_experts_ref's swiglu_ref, the sorted path's swiglu_triton)."""
    wg, wu, wd, limit_s = shared
    lin = torch.nn.functional.linear
    return lin(act(lin(x, wg), lin(x, wu), limit_s), wd)


def moe_experts_sorted_triton(x, ids, weights, w1, w3, w2, s1, s3, s2, limit, first_expert=0, shared=None,
                              xq=None):
    """Triton moe_experts_ref for prefill: only routed rows are computed, one launch per GEMM for all local experts.

    Steps, all on the device with static shapes (no .item()): sort the T*k (token, slot) pairs by local expert
    (remote slots last) with per-expert row offsets (moe_dispatch_triton); quantise x once per token (FP8);
    gate+up GEMM reading token rows through the sort order, SwiGLU in its epilogue; quantise; down GEMM; slot-order
    combine.
    The shared expert (if given) runs as torch GEMMs and swiglu_triton; the combine adds its output in fp32.
    """
    T, D, k, E, F, fp8 = _moe_check(x, ids, weights, w1, w3, w2, s1, s3, s2)
    if shared is not None:
        _check_shared(shared, D)
    out = torch.empty(T, D, dtype=torch.bfloat16 if shared is None else torch.float32, device=x.device)
    if T == 0:
        return out
    row_off, tok, inv = moe_dispatch_triton(ids, first_expert, E)
    if fp8:
        xq, sx = _x_quant(x, xq)  # once per token, not per (token, expert)
        a = grouped_gemm_triton(xq, sx, w1, s1, row_off, row_idx=tok, w3=w3, sw3=s3, limit=limit)  # [T*k, F]
        aq, sa = act_quant_triton(a, end=row_off[E:])  # rows past row_off[E] (remote slots) stay unwritten
        y = grouped_gemm_triton(aq, sa, w2, s2, row_off)  # [T*k, D]
    else:
        a = grouped_gemm_triton(x, None, w1, None, row_off, row_idx=tok, w3=w3, limit=limit)
        y = grouped_gemm_triton(a, None, w2, None, row_off)
    ys = y if shared is None else shared_expert(x, shared, swiglu_triton)  # [T, D] bf16 (ys unread without it)
    BLOCK_D = 1024 if D >= 1024 else _pow2(D)
    _moe_combine_kernel[(T, _cdiv(D, BLOCK_D))](y, inv, ids, weights, ys, out, out, D, E, int(first_expert), 0,
                                                      TOPK=k, SHARED=shared is not None, SORTED=True, BLOCK_D=BLOCK_D,
                                                      num_warps=4, **_NO_FMA, **common._pdl())
    return out


_COUNTERS = {}


def _arrival_counters(device, n):
    """The decode expert kernels' arrival counters (moe_early_down): one zeroed int32 buffer per device and
    thread, shared by every MoE layer (each call's combine launch zeroes what its down launch read, before the next
    call's gate/up can start, so one thread's launches must follow each other on its stream: threads that launch
    side by side, as start-up's parallel kernel builds do, each take their own). Allocated at the first call (a
    warm-up), never inside a graph capture: a buffer from the graph's pool would be freed with the graph.
    n <= DECODE_SLOTS + 1 always (hit experts plus the shared one)."""
    key = device, threading.get_ident()
    c = _COUNTERS.get(key)
    if c is None:
        _check(device.type != "cuda" or not torch.cuda.is_current_stream_capturing(),
               "the decode expert kernels' counters are allocated by an eager call: run a step before capturing")
        c = _COUNTERS[key] = torch.zeros(DECODE_SLOTS + 1, dtype=torch.int32, device=device)
    _check(n <= c.numel(), lambda: f"{n} arrival counters needed, {c.numel()} allocated")
    return c


def _decode_descs(xq, w1, w3, w2, bn):
    """TMA descriptors of the decode expert tiles, each None where TMA cannot address its tensors: (gate/up weights as
    one [2, E*F, D] tensor, its first plane the lower of W1 and W3, whose distance is the plane stride (any two
    tensors: TMA reads only the boxes' rows); x [T, D] in 16-row boxes; W2 as [1, E*D, F]) and whether W3 is the
    first plane."""
    E, F, D = w1.shape
    lo, hi = (w1, w3) if w1.data_ptr() <= w3.data_ptr() else (w3, w1)
    gap = hi.data_ptr() - lo.data_ptr()  # bytes: e4m3
    fits = lambda *ts: all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in ts)  # noqa: E731
    gu = x = down = None
    if fits(lo, hi, xq) and 0 < gap < 2 ** 40 and gap % 16 == 0 and D % 16 == 0:
        gu = TensorDescriptor(lo, [2, E * F, D], [gap, D, 1], [2, bn[0], QBLOCK])
        x = TensorDescriptor.from_tensor(xq, [16, QBLOCK])
    if fits(w2) and F % 16 == 0:
        down = TensorDescriptor(w2, [1, E * D, F], [E * D * F, F, 1], [1, bn[1], QBLOCK])
    return (gu, x, down), lo is w3


def moe_experts_decode_triton(x, ids, weights, w1, w3, w2, s1, s3, s2, limit, first_expert=0, shared=None,
                              block_n=None, num_warps=None, num_stages=None, k_unroll=None, xq=None, tma=None,
                              moe_block_n=((32, 64), (64, 128)), moe_stages=((3, 3), (4, 3)),
                              moe_unroll=((4, 1), (1, 1)), moe_maxnreg=((0, 0), (168, 0)),
                              moe_tma=((False, True), (True, True)), moe_early_down=(False, True), shared_parts=(8, 4)):
    """Sort-free moe_experts_ref for decode (T*k <= DECODE_SLOTS): 3 launches for routed + shared experts + combine.

    0. FP8: x quantised once (act_quant_triton, or the router's xq; quantising in every gate/up program's K loop was
       15-30% slower).
    1. gate/up: one program per (hit expert, F tile) computes all rows routed to that expert, SwiGLU epilogue,
       a[slot] bf16 [T*k, F]; the shared expert's gate and up tiles run in the same launch.
    2. down: per (hit expert, D tile): y[slot] bf16 [T*k, D] (a quantised on load); the shared expert's down too.
    3. combine: slot-order fp32 sum per token, plus the shared output when given.
    Programs of ranks past the number of hit experts exit at once, so no host sync and no data-dependent grid.
    block_n / num_warps / num_stages / k_unroll: (gate/up, down) pairs overriding the tuned defaults
    (tools.bench_kernels sweep); k_unroll: K blocks per loop iteration of the routed tiles and the shared gate/up
    (same bits).
    FP8 routed tiles go through _decode_tile_swapped, the weight rows as the MMA's M side (fp8 wgmma at 64 rows). tma
    (FP8, T <= 16; default moe_tma): their weights (and the gate/up's x, all tokens as rows) through TMA descriptors
    (_decode_descs); the same bits.
    moe_*, shared_parts: the tuned launch choices, each a (T == 1, T > 1) pair of (gate/up, down) pairs where both
    kernels have one (kernel.TUNING's, which kernel.moe_experts passes; its comments name each)."""
    T, D, k, E, F, fp8 = _moe_check(x, ids, weights, w1, w3, w2, s1, s3, s2)
    Fs = _check_shared(shared, D) if shared is not None else 0
    _check(T * k <= DECODE_SLOTS, lambda: f"the decode path takes T*k <= {DECODE_SLOTS} slots, got {T}*{k}")
    out = torch.empty(T, D, dtype=torch.float32 if shared is not None else torch.bfloat16, device=x.device)
    if T == 0:
        return out
    a = torch.empty(T * k, F, dtype=torch.bfloat16, device=x.device)  # remote slots' rows stay unwritten
    y = torch.empty(T * k, D, dtype=torch.bfloat16, device=x.device)
    if shared is not None:
        wg, wu, wd, limit_s = shared
        gu = torch.empty(2, T, Fs, dtype=torch.bfloat16, device=x.device)
        ys = torch.empty(T, D, dtype=torch.bfloat16, device=x.device)
    else:
        wg = wu = wd = gu = ys = y  # never read: SHARED is off
        limit_s = None
    gpu, many = common._GPU_LAUNCH, T > 1  # the tuned entries are (T == 1, T > 1)
    bn = moe_block_n[many] if gpu else (64, 64)
    nw, ns = (4, 4), moe_stages[many] if gpu else (1, 1)
    bn, nw, ns = block_n or bn, num_warps or nw, num_stages or ns
    # k_unroll: FP8 only (BF16 tiles' 4 stages of 4 K blocks need 240 KB of shared memory; an H200 block has 227)
    nkb, nkf = _cdiv(D, QBLOCK), _cdiv(F, QBLOCK)
    tuned = moe_unroll[many] if fp8 and gpu else (1, 1)
    ku = k_unroll or tuple(u if n % u == 0 else 1 for u, n in zip(tuned, (nkb, nkf)))
    _check(nkb % ku[0] == 0 and nkf % ku[1] == 0,
           lambda: f"k_unroll {ku} must divide the K blocks of gate/up ({nkb}) and down ({nkf})")
    sh = int(shared is not None)
    ranks = min(T * k, E)  # distinct local experts the slots can hit
    regs = [{"maxnreg": r} if r and gpu else {} for r in moe_maxnreg[many]]
    dummy = y
    both = dict(TOPK=k, SHARED=sh, FP8=fp8, BLOCK_M=16, BLOCK_K=QBLOCK, ZERO_GUARD=T == 1,
                BLOCK_TK=max(16, _pow2(T * k)), BLOCK_E=_pow2(E),
                DOT_DTYPE=_DOT, PRECISE=_PRECISE)
    grid1 = (max(_cdiv(F, bn[0]), 2 * _cdiv(Fs, bn[0])), ranks + sh)
    xqt, sxt = _x_quant(x, xq) if fp8 else (x, dummy)
    tma = [fp8 and bool(u) and T <= 16 for u in (moe_tma[many] if tma is None else (tma, tma))]
    descs, up_first = (None, None, None), False
    if any(tma):
        descs, up_first = _decode_descs(xqt, w1, w3, w2, bn)
        tma = [tma[0] and descs[0] is not None, tma[1] and descs[2] is not None]
    early = moe_early_down[many]
    cnt = _arrival_counters(x.device, ranks + sh) if early else dummy
    _moe_decode_up_kernel[grid1](
        xqt, sxt, x, ids, w1, w3, s1 if fp8 else dummy, s3 if fp8 else dummy, a, wg, wu, gu, descs[0], descs[1], cnt,
        T, D, F, Fs, E, int(first_expert), float(limit) if limit is not None else 0.0, w1.stride(0),
        s1.stride(0) if fp8 else 0, s1.stride(1) if fp8 else 0, HAS_LIMIT=limit is not None, K_UNROLL=ku[0],
        BLOCK_N=bn[0], SHARED_PARTS=shared_parts[many], TMA=tma[0], UP_FIRST=up_first,
        TOPK_P2=_pow2(k), EARLY=early, num_warps=nw[0], num_stages=ns[0], **both, **regs[0],
        **common._pdl())
    _moe_decode_down_kernel[(_cdiv(D, bn[1]), ranks + sh)](
        a, ids, w2, s2 if fp8 else dummy, y, gu, wd, ys, descs[2], cnt,
        T, D, F, Fs, E, int(first_expert), float(limit) if limit is not None else 0.0,
        float(limit_s) if limit_s is not None else 0.0, w2.stride(0), s2.stride(0) if fp8 else 0,
        s2.stride(1) if fp8 else 0, HAS_LIMIT=limit is not None, HAS_LIMIT_S=limit_s is not None, K_UNROLL=ku[1],
        BLOCK_N=bn[1], TMA=tma[1], EARLY=early, UP_N=bn[0],
        num_warps=nw[1], num_stages=ns[1], **both, **regs[1], **common._pdl())
    BLOCK_D = 1024 if D >= 1024 else _pow2(D)
    _moe_combine_kernel[(T, _cdiv(D, BLOCK_D))](
        y, ids, ids, weights, ys, out, cnt, D, E, int(first_expert), ranks + sh, TOPK=k, SHARED=sh, SORTED=False,
        BLOCK_D=BLOCK_D, BLOCK_C=_pow2(ranks + sh) if early else 0, num_warps=4, **_NO_FMA, **common._pdl())
    return out


def moe_experts_triton(x, ids, weights, w1, w3, w2, s1, s3, s2, limit, first_expert=0, shared=None, xq=None,
                       **tuning):
    """Triton moe_experts_ref: the sort-free decode path for T*k <= DECODE_SLOTS (and decode's T, PREFILL_ROWS),
    else the sorted path. xq: x already quantised (route(..., quant=True)), FP8 experts only. tuning: the decode
    path's launch choices (moe_experts_decode_triton's moe_* and shared_parts; default its own)."""
    decode = ids.numel() <= DECODE_SLOTS and x.shape[0] <= PREFILL_ROWS
    if decode:
        return moe_experts_decode_triton(x, ids, weights, w1, w3, w2, s1, s3, s2, limit, first_expert, shared, xq=xq,
                                         **tuning)
    return moe_experts_sorted_triton(x, ids, weights, w1, w3, w2, s1, s3, s2, limit, first_expert, shared, xq=xq)
