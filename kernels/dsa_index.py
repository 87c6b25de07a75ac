"""DSA, which regions a query reads: region summaries, the decode step's cache writes, the indexer scores and the exact
top-k region selection (a counting radix select plus one prefix-sum compaction), with their launchers. The
references: kernel.region_summary_ref, kernel.dsa_cache_write_ref, kernel.indexer_scores_ref,
kernel.select_regions_ref.
"""
import torch
import triton
import triton.language as tl

from kernels import common
from kernels.common import (FP8, _DOT, _NO_FMA, _PRECISE, _bf16_round, _cdiv, _check, _check_tensor, _exp,
                            _pdl_enter, _pow2, _to_e4m3, _unspecialised)


@triton.jit
def _summary_add(num, den, z, kv, m, PRECISE: tl.constexpr):
    """One token of a region summary: e = exp(z - m); num += e * k; den += e (callers compile without FMA)."""
    e = _exp(z - m, PRECISE)
    return num + e * kv, den + e


@triton.jit
def _summary_bytes(num, den):
    """S = num / max(den, 1e-20) (0 where den is 0) as e4m3 bytes: fp32 -> bf16 -> e4m3, both RNE."""
    s = tl.where(den > 0, tl.math.div_rn(num, tl.maximum(den, 1e-20)), 0.0)
    return _to_e4m3(_bf16_round(s)).to(tl.uint8, bitcast=True)


@triton.jit
def _region_summary_kernel(k_ptr, z_ptr, out_ptr, P, row_stride,
                           BLK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, PRECISE: tl.constexpr,
                           PDL: tl.constexpr):
    """One region per program: m = max f32(z) over the whole [blk, P] tile; e = exp(z - m);
    S_d = sum_t e*k / max(sum_t e, 1e-20) (0 where the sum is 0), summed over t in order; e4m3(bf(S)) bytes."""
    _pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_P)
    d_ok = d < P
    t = tl.arange(0, BLOCK_T)
    base = n * row_stride
    z_all = tl.load(z_ptr + base + t[:, None] * P + d[None, :], mask=(t[:, None] < BLK) & d_ok[None, :],
                    other=float("-inf")).to(tl.float32)
    m = tl.max(tl.max(z_all, axis=1), axis=0)
    num = tl.zeros((BLOCK_P,), dtype=tl.float32)
    den = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for i in tl.static_range(BLK):  # token order, one fp32 accumulator each, as the reference sums
        z = tl.load(z_ptr + base + i * P + d, mask=d_ok, other=0.0).to(tl.float32)
        kv = tl.load(k_ptr + base + i * P + d, mask=d_ok, other=0.0).to(tl.float32)
        num, den = _summary_add(num, den, z, kv, m, PRECISE=PRECISE)
    tl.store(out_ptr + n * P + d, _summary_bytes(num, den), mask=d_ok)


def region_summary_triton(k, z):
    _check_tensor("k", k, torch.bfloat16, ndim=3)
    _check_tensor("z", z, torch.bfloat16, ndim=3)
    _check(k.shape == z.shape, lambda: f"k {tuple(k.shape)} and z {tuple(z.shape)} must both be [N, blk, P]")
    N, blk, P = k.shape
    out = torch.empty(N, P, dtype=torch.uint8, device=k.device)
    if N:
        _region_summary_kernel[(N,)](k, z, out, P, blk * P, BLK=blk, BLOCK_T=_pow2(blk),
                                    BLOCK_P=_pow2(P), PRECISE=_PRECISE, num_warps=2, **_NO_FMA,
                                    **common._pdl())
    return out.view(FP8)


@triton.jit
def _dsa_cache_write_kernel(k_ptr, v_ptr, ki_ptr, zi_ptr, pos_ptr, rows_ptr, ck_ptr, cv_ptr, pk_ptr, pz_ptr,
                            summ_ptr,
                            k_stride, v_stride, ki_stride, zi_stride, pos_stride, cap, R, P,
                            GHD: tl.constexpr, BLK: tl.constexpr, BLOCK_GHD: tl.constexpr, BLOCK_P: tl.constexpr,
                            PRECISE: tl.constexpr, PDL: tl.constexpr):
    """One request per program (step row b, cache row rows[b]): the row writes, then, on the region's last token,
    _region_summary_kernel's arithmetic over the pending rows with the new row taken from registers (never re-read
    after this program's own store)."""
    _pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + b * pos_stride)
    row = tl.load(rows_ptr + b)
    slot = p % BLK
    c = tl.arange(0, BLOCK_GHD)
    c_ok = c < GHD
    tl.store(ck_ptr + (row * cap + p) * GHD + c, tl.load(k_ptr + b * k_stride + c, mask=c_ok), mask=c_ok)
    tl.store(cv_ptr + (row * cap + p) * GHD + c, tl.load(v_ptr + b * v_stride + c, mask=c_ok), mask=c_ok)
    d = tl.arange(0, BLOCK_P)
    d_ok = d < P
    kn = tl.load(ki_ptr + b * ki_stride + d, mask=d_ok, other=0.0)
    zn = tl.load(zi_ptr + b * zi_stride + d, mask=d_ok, other=0.0)
    base = row * BLK * P
    tl.store(pk_ptr + base + slot * P + d, kn, mask=d_ok)
    tl.store(pz_ptr + base + slot * P + d, zn, mask=d_ok)
    if slot == BLK - 1:
        m = tl.max(tl.where(d_ok, zn.to(tl.float32), float("-inf")), axis=0)
        for i in tl.static_range(BLK - 1):
            z = tl.load(pz_ptr + base + i * P + d, mask=d_ok, other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, tl.max(z, axis=0))
        num = tl.zeros((BLOCK_P,), dtype=tl.float32)
        den = tl.zeros((BLOCK_P,), dtype=tl.float32)
        for i in tl.static_range(BLK):  # token order, as the reference sums
            if i == BLK - 1:
                z, kv = zn.to(tl.float32), kn.to(tl.float32)
            else:
                z = tl.load(pz_ptr + base + i * P + d, mask=d_ok, other=0.0).to(tl.float32)
                kv = tl.load(pk_ptr + base + i * P + d, mask=d_ok, other=0.0).to(tl.float32)
            num, den = _summary_add(num, den, z, kv, m, PRECISE=PRECISE)
        tl.store(summ_ptr + (row * R + p // BLK) * P + d, _summary_bytes(num, den), mask=d_ok)


def dsa_cache_write_triton(k, v, ki, zi, pos, ck, cv, pk, pz, summ, rows=None):
    B, G, hd = k.shape
    rows = torch.arange(B, device=k.device) if rows is None else rows
    _check_tensor("rows", rows, torch.int64, ndim=1)
    _check(rows.numel() == B, lambda: f"rows must be [B={B}], got {tuple(rows.shape)}")
    for name, t in (("k", k), ("v", v)):
        _check_tensor(name, t, torch.bfloat16, ndim=3, contiguous=False)
        _check(tuple(t.shape) == (B, G, hd) and t.stride(2) == 1 and t.stride(1) == hd,
               lambda: f"{name} must be [B, G, hd] with contiguous rows, got {tuple(t.shape)} strides {t.stride()}")
    P = pk.shape[2]
    for name, t in (("ki", ki), ("zi", zi)):
        _check_tensor(name, t, torch.bfloat16, ndim=2, contiguous=False)
        _check(tuple(t.shape) == (B, P) and t.stride(1) == 1, lambda: f"{name} must be [B={B}, P={P}] with unit stride")
    _check_tensor("pos", pos, torch.int64, ndim=1, contiguous=False)  # a column of [B, Q] positions
    for name, t, dt in (("ck", ck, torch.bfloat16), ("cv", cv, torch.bfloat16), ("pk", pk, torch.bfloat16),
                        ("pz", pz, torch.bfloat16), ("summ", summ, torch.uint8)):
        _check_tensor(name, t, dt)
    _check(ck.shape == cv.shape and tuple(ck.shape[2:]) == (G, hd) and pk.shape == pz.shape
           and summ.shape[0] == pk.shape[0] == ck.shape[0] and summ.shape[2] == P,
           "cache shapes: ck, cv [B', cap, G, hd], pk, pz [B', blk, P], summ [B', R, P]")
    if B:
        _dsa_cache_write_kernel[(B,)](k, v, ki, zi, pos, rows, ck, cv, pk, pz, summ, k.stride(0), v.stride(0),
                                      ki.stride(0), zi.stride(0), pos.stride(0), ck.shape[1], summ.shape[1], P,
                                      GHD=G * hd,
                                      BLK=pk.shape[1], BLOCK_GHD=_pow2(G * hd),
                                      BLOCK_P=_pow2(P), PRECISE=_PRECISE, num_warps=2, **_NO_FMA,
                                      **common._pdl())


@triton.jit
def _indexer_scores_kernel(q_ptr, w_ptr, s_ptr, out_ptr, rows_ptr, nh_ptr, T, G, R, P, BLK, w_scale,
                           q_stride_s, q_stride_t, q_stride_g, w_stride_s, w_stride_t, s_stride_s, nh_stride,
                           HG: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                           BLOCK_PC: tl.constexpr, DOT_DTYPE: tl.constexpr, PDL: tl.constexpr,
                           Q_E4M3: tl.constexpr = False, ROWS: tl.constexpr = False, SKIP: tl.constexpr = False):
    """scores[s, g, t, r] = sum over heads h = 0..Hg-1 in order of relu(q_h . S_r) * w_h (one fp32 accumulator),
    w_h = f32(w) * w_scale.

    q is rounded to e4m3 here (_to_e4m3: torch's saturating cast, so no cast launch before the kernel) and S is
    e4m3; the dot runs in DOT_DTYPE (e4m3 -> bf16 is lossless) with fp32 accumulation, which avoids the
    reduced-precision accumulator of Hopper's fp8 MMA. BLOCK_PC < BLOCK_P: each head's dot as BLOCK_P / BLOCK_PC
    chained dots over P slices (smaller operand tiles in registers: the whole-P prefill tiles spill in the sm90
    build), the slices re-read per head. Q_E4M3: q holds e4m3 values already (norm_rope_jobs' e4m3), so its
    rounding is skipped (the same bits; the decode scores are issue-bound, and the rounding was about a third of
    their instructions). ROWS: summaries row rows[s] for q's row s. SKIP: a tile of regions that no query of the
    tile has in its history (region r is, for the query at position p, when r < p // BLK: nh_ptr holds the
    positions) is not computed, nor stored: select_regions never reads it, and a step's cost follows the context
    its rows hold, not the cache's capacity."""
    _pdl_enter(PDL)
    s = tl.program_id(0) // G
    g = tl.program_id(0) % G
    ts = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    rs = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    t_ok, r_ok = ts < T, rs < R
    if SKIP:
        nh = tl.load(nh_ptr + s * nh_stride + ts, mask=t_ok, other=0) // BLK
        if tl.program_id(2) * BLOCK_R >= tl.max(nh, axis=0):
            return
    srow = tl.load(rows_ptr + s).to(tl.int64) if ROWS else s
    if BLOCK_PC == BLOCK_P:  # one slice: S is read once for all heads
        d = tl.arange(0, BLOCK_P)
        summ = tl.load(s_ptr + srow * s_stride_s + rs[:, None] * P + d[None, :],
                       mask=r_ok[:, None] & (d < P)[None, :], other=0.0).to(tl.float32).to(DOT_DTYPE)
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for h in tl.static_range(HG):
        for c in tl.static_range(BLOCK_P // BLOCK_PC):
            d = c * BLOCK_PC + tl.arange(0, BLOCK_PC)
            d_ok = d < P
            if BLOCK_PC < BLOCK_P:
                summ = tl.load(s_ptr + srow * s_stride_s + rs[:, None] * P + d[None, :],
                               mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32).to(DOT_DTYPE)
            q = tl.load(q_ptr + s * q_stride_s + ts[:, None] * q_stride_t + g * q_stride_g + h * P + d[None, :],
                        mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            if Q_E4M3:
                q = q.to(DOT_DTYPE)
            else:
                q = _to_e4m3(q.to(tl.float32)).to(tl.float32).to(DOT_DTYPE)
            if c == 0:
                dot = tl.dot(q, tl.trans(summ))
            else:
                dot = tl.dot(q, tl.trans(summ), dot)
        wh = tl.load(w_ptr + s * w_stride_s + ts * w_stride_t + g * HG + h, mask=t_ok, other=0.0).to(tl.float32)
        wh = wh * w_scale
        acc = acc + tl.maximum(dot, 0.0) * wh[:, None]
    out = out_ptr + ((s * G + g) * T + ts[:, None]).to(tl.int64) * R + rs[None, :]
    tl.store(out, acc, mask=t_ok[:, None] & r_ok[None, :])


_indexer_scores_prefill = _unspecialised(_indexer_scores_kernel, "T", "R", "q_stride_s", "w_stride_s", "nh_stride",
                                         unaligned=("w_ptr", "nh_ptr"))


def indexer_scores_triton(q, w, summ, w_scale=1.0, block_t=None, block_r=None, num_warps=4, block_pc=None,
                          q_e4m3=False, rows=None, n_hist=None, blk=1, prefill=False):
    """Triton indexer_scores_ref. block_t / block_r / num_warps: tile overrides (tools.bench_kernels sweep_indexer; each
    score is one dot over P and a sum over heads in order whatever the tile; the sweep shows whether the GPU's MMA
    for another tile shape gives the same bits). block_pc: P slices of the chained dots (default: all of P in one
    dot; 64, with 64 x 128 tiles at 8 warps, builds for sm90 without spills, and no timing has chosen it).
    q_e4m3: q holds e4m3 values (_indexer_scores_kernel's Q_E4M3). rows [S] int64: the summaries' row of each of
    q's rows (default: row s); n_hist [S, T] int64 positions, blk their region size: SKIP. prefill: the tile rule
    and kernel of prefill launches, whatever T and R (_unspecialised)."""
    _check_tensor("q", q, torch.bfloat16, ndim=5)
    _check_tensor("w", w, w.dtype, ndim=4, contiguous=False)
    _check(w.dtype in (torch.bfloat16, torch.float32) and w.stride(3) == 1 and w.stride(2) == w.shape[3],
           lambda: f"w must be bf16/fp32 with contiguous heads per token (a column slice of the packed projection is "
           f"fine), got {w.dtype} strides {w.stride()}")
    _check_tensor("summ", summ, FP8, ndim=3)
    S, T, G, HG, P = q.shape
    R = summ.shape[1]
    _check(tuple(w.shape) == (S, T, G, HG),
           lambda: f"w must be [S, T, G, Hg] = {(S, T, G, HG)}, got {tuple(w.shape)}")
    _check((summ.shape[0] == S or rows is not None) and summ.shape[2] == P and summ.stride(2) == 1
           and summ.stride(1) == P, lambda: f"summ must be [S={S}, R, P={P}] with contiguous rows, got "
           f"{tuple(summ.shape)}")
    if rows is not None:
        _check_tensor("rows", rows, torch.int64, ndim=1)
        _check(rows.numel() == S, lambda: f"rows must be [S={S}], got {tuple(rows.shape)}")
    if n_hist is not None:
        _check_tensor("n_hist", n_hist, torch.int64, ndim=2, contiguous=False)
        _check(tuple(n_hist.shape) == (S, T) and n_hist.stride(1) == 1,
               lambda: f"n_hist must be [S={S}, T={T}] with unit stride, got {tuple(n_hist.shape)}")
    out = torch.empty(S, G, T, R, dtype=torch.float32, device=q.device)
    BLOCK_T = block_t or (16 if T <= 16 else 64)
    # prefill 64 x 128 tiles (a 1M-token chunk: 248 us, 414 at 64 x 64); decode 64-region tiles, or 128 once those
    # would be more than two programs per SM at a 32k-token history (16 requests x 4100 regions: 14.8 us against
    # 20.0); the same bits. Tiles past every history exit, so a cache's capacity past 32k tokens does not count.
    many = S * G * _cdiv(min(R, 4096), 64) > 2 * common._sms()
    BLOCK_R = block_r or ((128 if many else 64) if T <= 16 and common._GPU_LAUNCH and not prefill else 128)
    if out.numel():
        grid = (S * G, _cdiv(T, BLOCK_T), _cdiv(R, BLOCK_R))
        kern = _indexer_scores_prefill if prefill else _indexer_scores_kernel
        kern[grid](q, w, summ, out, rows if rows is not None else out, n_hist if n_hist is not None else out, T, G, R,
                   P, int(blk), float(w_scale), q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
                   summ.stride(0), n_hist.stride(0) if n_hist is not None else 0, HG=HG, BLOCK_T=BLOCK_T,
                   BLOCK_R=BLOCK_R, BLOCK_P=_pow2(P), BLOCK_PC=block_pc or _pow2(P),
                   DOT_DTYPE=_DOT, Q_E4M3=q_e4m3, ROWS=rows is not None, SKIP=n_hist is not None,
                   num_warps=num_warps, **_NO_FMA, **common._pdl())
    return out


@triton.jit
def _order_key(x):
    """fp32 -> uint32 with the reference's order: its int64 key's high half plus 2^31 (x + 0.0 first, so -0.0 keys
    as +0.0; negatives bit-inverted, non-negatives with the sign bit set; NaN above +inf)."""
    b = (x + 0.0).to(tl.uint32, bitcast=True)
    return tl.where(b >= 0x80000000, b ^ 0xFFFFFFFF, b | 0x80000000)  # (~ on uint32 fails in the interpreter)


@triton.jit
def _select_chunk(key, ok, K, ALL: tl.constexpr):
    """The exact top-K of the keys at lanes `ok` (key descending, ties to the lower lane) -> (sel, pos): the selected
    lanes and each one's place among them in lane order.

    thr = the K-th largest key, found MSB first, 2 bits per step: count the keys >= thr + j * 2^shift for j = 1..3
    (one packed reduction: a step costs its reduction's latency more than its compares) and keep the largest j
    whose count still reaches K. `above`, the count just above the current prefix's range, ends as c = #keys > thr;
    the search stops early once exactly K keys are >= thr (distinct scores: after ~20 of the 32 bits). The selection
    is every key > thr plus the lowest-lane K - c keys == thr; one prefix sum places them. ALL: K >= the lanes, so
    every lane is selected (thr = 0, c = 0)."""
    key = tl.where(ok, key, 0)  # lanes past the chunk: the least key, and never counted (thresholds are >= 1)
    thr = tl.full((), 0, tl.uint32)
    above = tl.full((), 0, tl.int32)
    at = tl.full((), K + 1, tl.int32)  # #keys >= thr (more than K until it is exactly K)
    if not ALL:
        for p in tl.static_range(16):
            shift = 30 - 2 * p  # a constexpr: p is unrolled
            if at != K:  # once exactly K keys are >= thr they are the selection: the lower bits do not matter
                # the three counts #keys >= thr + j * 2^shift (j = 1, 2, 3), 21 bits each, in one reduction
                v = ((key >= thr + (1 << shift)).to(tl.int64) + ((key >= thr + (2 << shift)).to(tl.int64) << 21)
                     + ((key >= thr + (3 << shift)).to(tl.int64) << 42))
                cnt = tl.sum(v, axis=0)
                c1, c2, c3 = ((cnt & 0x1FFFFF).to(tl.int32), ((cnt >> 21) & 0x1FFFFF).to(tl.int32),
                              (cnt >> 42).to(tl.int32))
                best = (c1 >= K).to(tl.uint32) + (c2 >= K).to(tl.uint32) + (c3 >= K).to(tl.uint32)  # counts fall
                above = tl.where(best == 0, c1, tl.where(best == 1, c2, tl.where(best == 2, c3, above)))
                at = tl.where(best == 1, c1, tl.where(best == 2, c2, tl.where(best == 3, c3, at)))
                thr = thr + (best << shift)
    need = K - above  # ties to take, lowest lanes first
    hi = ((key > thr) | ((key == thr) & (at == K))) & ok
    eq = (key == thr) & (at != K) & ok
    if key.shape[0] <= 32768:  # both running counts in one prefix sum: 16 bits each
        cs = tl.cumsum((hi.to(tl.int32) << 16) | eq.to(tl.int32), axis=0)
        n_hi, n_eq = cs >> 16, cs & 0xFFFF
    else:
        cs = tl.cumsum((hi.to(tl.int64) << 32) | eq.to(tl.int64), axis=0)
        n_hi, n_eq = (cs >> 32).to(tl.int32), (cs & 0xFFFFFFFF).to(tl.int32)
    sel = hi | (eq & (n_eq <= need))
    return sel, n_hi + tl.minimum(n_eq, need) - 1


@triton.jit
def _store_selection(ids_ptr, valid_ptr, row, K, R, rid, out, pos, BLOCK_K: tl.constexpr):
    """A row's final ids (the `out` lanes' region ids at `pos`, then R) and valid. Candidates (id < n_hist) are a
    prefix of the ids, so theirs are the first positions."""
    base = row.to(tl.int64) * K
    tl.store(ids_ptr + base + pos, rid.to(tl.int64), mask=out)
    n_out = tl.sum(out.to(tl.int32), axis=0)
    slot = tl.arange(0, BLOCK_K)
    tl.store(ids_ptr + base + slot, (slot * 0 + R).to(tl.int64), mask=(slot >= n_out) & (slot < K))
    tl.store(valid_ptr + base + slot, (slot < n_out).to(tl.uint8), mask=slot < K)


@triton.jit
def _select_regions_kernel(src_ptr, src_id_ptr, nh_ptr, key_out_ptr, id_out_ptr, ids_ptr, valid_ptr, G, T, R, N, K,
                           BLK, N0, PAIRS: tl.constexpr, FINAL: tl.constexpr, ALL: tl.constexpr,
                           BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, SHORT: tl.constexpr, PDL: tl.constexpr):
    """Exact top-K of one chunk of a row (program (row, chunk)), entries in ascending region id, held in registers
    (_select_chunk).

    Input: the row's N scores (key = _order_key, non-candidates id >= n_hist keyed as -inf), or with PAIRS the
    (key, id) pairs an earlier launch selected (ascending id). FINAL writes ids (candidates only, padded with R) and
    valid; otherwise the chunk's K (key, id) pairs.
    N0: the entries of the first launch's chunk 0. A row whose candidates all lie there (n_hist <= N0: a cache much
    longer than the row's history) is final after the first launch: its chunk 0 writes ids and valid, its other
    chunks and every later launch's programs exit at once (after the PDL wait, so the launch after them still
    follows chunk 0), and a step costs the levels the row's history needs, not the cache's capacity. SHORT (a
    decode first launch, else 0): chunk 0 of a row of n_hist <= SHORT selects from SHORT lanes instead of BLOCK.
    K = min(topk, R) is a runtime argument: as a constexpr every prefill chunk of a prompt of < topk regions compiled
    a kernel of its own (seconds per prompt). n_hist = nh_ptr's value // BLK, read before the PDL wait (positions:
    written by torch ops before the layer, never by the predecessor, which writes the scores).
    """
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    nchunk = tl.num_programs(1)
    nh = tl.load(nh_ptr + (row // (G * T)) * T + row % T) // BLK
    _pdl_enter(PDL)
    short = nh <= N0
    if PAIRS:
        if short:
            return
    if SHORT > 0:
        if nh <= SHORT:
            if chunk == 0:
                i = tl.arange(0, SHORT)
                key = _order_key(tl.load(src_ptr + row.to(tl.int64) * N + i, mask=i < nh, other=float("-inf")))
                sel, pos = _select_chunk(key, i < N, K, False)
                _store_selection(ids_ptr, valid_ptr, row, K, R, i, sel & (i < nh), pos, BLOCK_K)
            return
    fin = short & (chunk == 0)  # this program writes the row's ids and valid
    if FINAL:
        fin = True
    lo = chunk * N // nchunk  # balanced chunks: each holds at least K entries (the launcher's split rule)
    i = lo + tl.arange(0, BLOCK)
    ok = i < (chunk + 1) * N // nchunk
    if PAIRS:
        key = tl.load(src_ptr + row.to(tl.int64) * N + i, mask=ok, other=0).to(tl.uint32, bitcast=True)
        rid = tl.load(src_id_ptr + row.to(tl.int64) * N + i, mask=ok, other=0)
    else:  # non-candidates are not read: masked to -inf, as the reference keys them
        key = _order_key(tl.load(src_ptr + row.to(tl.int64) * N + i, mask=ok & (i < nh), other=float("-inf")))
        rid = i
    if tl.max((ok & (rid < nh)).to(tl.int32), axis=0) == 0:
        # no candidate in this chunk (a cache's regions past every query's history): what it selects is never
        # kept, so it writes the selection of nothing (FINAL) or K entries that rank below every candidate
        slot = tl.arange(0, BLOCK_K)
        if fin:
            base = row.to(tl.int64) * K
            tl.store(ids_ptr + base + slot, (slot * 0 + R).to(tl.int64), mask=slot < K)
            tl.store(valid_ptr + base + slot, (slot * 0).to(tl.uint8), mask=slot < K)
        elif nh > N0:
            base = (row.to(tl.int64) * nchunk + chunk) * K
            none = _order_key(tl.full((BLOCK_K,), float("-inf"), tl.float32))
            tl.store(key_out_ptr + base + slot, none.to(tl.int32, bitcast=True), mask=slot < K)
            tl.store(id_out_ptr + base + slot, slot * 0 + R, mask=slot < K)
        return
    sel, pos = _select_chunk(key, ok, K, ALL)
    if fin:
        _store_selection(ids_ptr, valid_ptr, row, K, R, rid, sel & (rid < nh), pos, BLOCK_K)
    else:
        base = (row.to(tl.int64) * nchunk + chunk) * K
        tl.store(key_out_ptr + base + pos, key.to(tl.int32, bitcast=True), mask=sel)
        tl.store(id_out_ptr + base + pos, rid, mask=sel)


# Decode rows of at most this many history regions (8k tokens) take the first launch's short path.
SHORT_LANES = 1024
_select_regions_prefill = _unspecialised(_select_regions_kernel, "T", "R", "N", "K", "N0", unaligned=("nh_ptr",))


def select_regions_triton(scores, n_hist, topk, blk=1, chunk=4096, prefill=False, short_lanes=None):
    """select_regions_ref in one kernel per row (bit-identical ids and valid), no sort.

    One program per row holds the row in registers. With fewer rows than SMs (decode), or rows of more than 16384
    entries, a row of more than `chunk` entries is first cut into balanced chunks of >= 2K entries, one program
    each; every chunk keeps its exact top-K (a global top-K entry is in its chunk's top-K), and the next launch
    selects among those C*K pairs (in chunk order, i.e. ascending id), until one chunk is left: a long row is
    spread over several SMs, and no program holds more than `chunk` entries. Launches and scratch sizes depend
    only on the shapes. A chunk without a candidate (regions past every query's history) exits at once. prefill:
    tiles of at least `chunk` entries and the top-K block of topk, through the unspecialised kernel, so any prompt
    length takes one of a few compiled launches (decode's are fixed by the cache). short_lanes (default SHORT_LANES):
    a decode row of at most this many history regions is selected by chunk 0 of the first launch from that many
    lanes, however long the cache (bit-identical)."""
    _check_tensor("scores", scores, torch.float32, ndim=4)
    _check_tensor("n_hist", n_hist, torch.int64, ndim=2)
    S, G, T, R = scores.shape
    _check(tuple(n_hist.shape) == (S, T), lambda: f"n_hist must be [S, T] = {(S, T)}, got {tuple(n_hist.shape)}")
    K = min(topk, R)
    ids = torch.empty(S, G, T, K, dtype=torch.int64, device=scores.device)
    valid = torch.empty(S, G, T, K, dtype=torch.bool, device=scores.device)
    rows = S * G * T
    if rows == 0 or K == 0:
        return ids, valid
    chunk = max(chunk, 4 * _pow2(topk if prefill else K))  # >= 2K entries: each level halves
    block_k = _pow2(topk if prefill else K)
    kern = _select_regions_prefill if prefill else _select_regions_kernel
    src, src_id, n, n0 = scores, scores, R, None
    while True:
        # few rows (decode): chunks of 4096 (a row of 16384: 16 us, 19 / 21 in chunks of 2048 / 8192, 36 whole); a row
        # per SM already (prefill): whole rows, as splitting only adds work; rows past 16384 always split (registers)
        C = _cdiv(n, chunk) if n > chunk and (rows < 128 or n > 16384) else 1
        BLOCK = _pow2(_cdiv(n, C))
        BLOCK = max(BLOCK, chunk) if prefill else BLOCK
        final = C == 1
        n0 = n // C if n0 is None else n0  # the first launch's chunk 0: [0, n // C)
        if not final:
            key_out = torch.empty(rows, C * K, dtype=torch.int32, device=scores.device)
            id_out = torch.empty(rows, C * K, dtype=torch.int32, device=scores.device)
        # a decode step's rows of short histories in a cache of many regions: chunk 0 selects from SHORT_LANES
        lanes = short_lanes or SHORT_LANES
        short = lanes if not prefill and src is scores and BLOCK > lanes else 0
        kern[(rows, C)](src, src_id, n_hist, ids if final else key_out, ids if final else id_out, ids,
                        valid.view(torch.uint8), G, T, R, n, K, int(blk), n0, PAIRS=src is not scores, FINAL=final,
                        ALL=final and K >= n, BLOCK=BLOCK, BLOCK_K=block_k, SHORT=short,
                        num_warps=max(4, min(16, BLOCK // 512)), **common._pdl())
        if final:
            return ids, valid
        src, src_id, n = key_out, id_out, C * K
