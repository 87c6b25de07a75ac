"""DSA attention over the selected regions: the per-query sparse attention (split over programs and merged by
log-sum-exp for decode) and prefill's dense tiles over whole history regions, with their launchers. The references:
kernel.sparse_attention_ref, kernel.dense_prefix_ref.
"""
import torch
import triton
import triton.language as tl

from kernels import common
from kernels.common import (_DOT, _PRECISE, _bf16_round, _cdiv, _check, _check_tensor, _pdl_enter, _pow2,
                            _unspecialised)
from kernels.sliding import _gate_bf16, _heads_block, _lse_merge


@triton.jit
def _sparse_attn_kernel(
    q_ptr, k_ptr, v_ptr, ids_ptr, valid_ptr, pos_ptr, rows_ptr, out_ptr, po_ptr, pml_ptr, gate_ptr,
    T, G, HG, NKV, NSEL, SPLIT_LEN, scale,
    q_stride_s, q_stride_t, q_stride_g, q_stride_h, kv_stride_s, kv_stride_n, kv_stride_g,
    id_stride_s, id_stride_g, id_stride_t, va_stride_s, va_stride_g, va_stride_t, gate_stride,
    HEAD_DIM: tl.constexpr, BLK: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, PDL: tl.constexpr,
    ROWS: tl.constexpr = False, GATE: tl.constexpr = False, PRECISE: tl.constexpr = True,
):
    """Online-softmax attention of one (sequence, query, KV group) over its key slots, all Hg heads at once.

    Key slot j < NSEL*blk is token ids[j // blk]*blk + j % blk (live iff valid); slot NSEL*blk + i is token
    blk*floor(p/blk) + i of the current region (live iff <= p). Per tile of BLOCK_N slots: s = (q.k) * scale in
    fp32, dead slots -inf, running max m and sum l in fp32, p = exp(s - m) rounded to bf16 before P.V (fp32 acc).
    SPLITS == 1: writes bf(acc / l), and with GATE then the output gate (_attn_merge_kernel's GATE). Otherwise
    program_id(1) takes slots [split*SPLIT_LEN, +SPLIT_LEN) and writes its unnormalised acc, m and l for
    _attn_merge_kernel. ROWS: sequence s's keys are cache row rows[s].
    """
    _pdl_enter(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    g = row % G
    t = (row // G) % T
    s = row // (G * T)
    p = tl.load(pos_ptr + s * T + t)
    cur0 = p // BLK * BLK
    j_end = tl.minimum((split + 1) * SPLIT_LEN, NSEL * BLK + BLK)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    h_ok, d_ok = heads < HG, dims < HEAD_DIM
    q = tl.load(q_ptr + s * q_stride_s + t * q_stride_t + g * q_stride_g + heads[:, None] * q_stride_h
                + dims[None, :], mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32).to(DOT_DTYPE)
    kv_row = tl.load(rows_ptr + s).to(tl.int64) if ROWS else s.to(tl.int64)
    kv_base = kv_row * kv_stride_s + g * kv_stride_g
    id_base = ids_ptr + s * id_stride_s + g * id_stride_g + t * id_stride_t
    va_base = valid_ptr + s * va_stride_s + g * va_stride_g + t * va_stride_t
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for j0 in range(split * SPLIT_LEN, j_end, BLOCK_N):
        slot = j0 + tl.arange(0, BLOCK_N)
        reg, off = slot // BLK, slot % BLK
        hist = reg < NSEL
        live = slot < j_end
        rid = tl.load(id_base + reg, mask=hist & live, other=0)
        rva = tl.load(va_base + reg, mask=hist & live, other=0)
        tok = tl.where(hist, rid * BLK + off, cur0 + off)
        ok = live & tl.where(hist, rva != 0, tok <= p)
        tok = tl.minimum(tok, NKV - 1).to(tl.int64)
        kv_off = kv_base + tok[:, None] * kv_stride_n + dims[None, :]
        kv_mask = ok[:, None] & d_ok[None, :]
        kt = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32).to(DOT_DTYPE)
        sc = tl.dot(q, tl.trans(kt)) * scale
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully dead tile so far: avoid inf - inf
        alpha = tl.exp(m_i - m_use)
        pr = tl.exp(sc - m_use[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        vt = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32).to(DOT_DTYPE)
        acc = tl.dot(_bf16_round(pr).to(DOT_DTYPE), vt, acc * alpha[:, None])
        m_i = m_new
    if SPLITS == 1:
        o = _bf16_round(tl.math.div_rn(acc, tl.maximum(l_i, 1e-30)[:, None]))  # no live key -> zeros (acc is 0)
        if GATE:  # bf16 x bf16: the product is exact in fp32, rounded once
            logit = tl.load(gate_ptr + (s * T + t).to(tl.int64) * gate_stride + g * HG + heads, mask=h_ok,
                            other=0.0).to(tl.float32)
            o = _bf16_round(o * _gate_bf16(logit, PRECISE)[:, None])
        tl.store(out_ptr + s * q_stride_s + t * q_stride_t + g * q_stride_g + heads[:, None] * q_stride_h
                 + dims[None, :], o.to(tl.bfloat16), mask=h_ok[:, None] & d_ok[None, :])
    else:
        part = (row * SPLITS + split).to(tl.int64)
        tl.store(po_ptr + (part * BLOCK_H + heads[:, None]) * HEAD_DIM + dims[None, :], acc,
                 mask=h_ok[:, None] & d_ok[None, :])
        tl.store(pml_ptr + (part * 2) * BLOCK_H + heads, m_i)
        tl.store(pml_ptr + (part * 2 + 1) * BLOCK_H + heads, l_i)


@triton.jit
def _attn_merge_kernel(po_ptr, pml_ptr, out_ptr, gate_ptr, T, G, HG,
                       q_stride_s, q_stride_t, q_stride_g, q_stride_h, gate_stride,
                       HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, GATE: tl.constexpr, PRECISE: tl.constexpr,
                       PDL: tl.constexpr):
    """Log-sum-exp merge of the splits of one row and head: c_i = exp(m_i - max m);
    out = bf( sum_i c_i * acc_i / sum_i c_i * l_i ). GATE: then out = bf(out * bf(sigmoid(logit))) (gate_heads, with
    _sliding_merge_kernel's arithmetic), the logit read before the PDL wait (the packed projection wrote it, several
    launches back)."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    g = row % G
    t = (row // G) % T
    s = row // (G * T)
    if GATE:
        logit = tl.load(gate_ptr + (s * T + t).to(tl.int64) * gate_stride + g * HG + h).to(tl.float32)
    _pdl_enter(PDL)
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < SPLITS
    part = (row * SPLITS + sp).to(tl.int64)
    m = tl.load(pml_ptr + (part * 2) * BLOCK_H + h, mask=sp_ok, other=float("-inf"))
    l = tl.load(pml_ptr + (part * 2 + 1) * BLOCK_H + h, mask=sp_ok, other=0.0)
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < HEAD_DIM
    po = tl.load(po_ptr + (part[None, :] * BLOCK_H + h) * HEAD_DIM + dims[:, None],
                 mask=d_ok[:, None] & sp_ok[None, :], other=0.0)  # [BLOCK_D, BLOCK_S]
    o = _lse_merge(po, m, l, BLOCK_D, BLOCK_S, PRECISE=PRECISE)
    if GATE:
        o = _bf16_round(o * _gate_bf16(logit, PRECISE))
    tl.store(out_ptr + s * q_stride_s + t * q_stride_t + g * q_stride_g + h * q_stride_h + dims,
             o.to(tl.bfloat16), mask=d_ok)


_sparse_attn_prefill = _unspecialised(_sparse_attn_kernel, "T", "NKV", "NSEL", "q_stride_s", "id_stride_s",
                                      "id_stride_g", "id_stride_t", "va_stride_s", "va_stride_g", "va_stride_t",
                                      unaligned=("pos_ptr", "ids_ptr", "valid_ptr", "gate_ptr"))


def sparse_attention_triton(q, k, v, ids, valid, pos, blk, scale, splits=None, block_n=None, gate=None,
                            num_stages=2, rows=None, prefill=False, out=None, sparse_block_n=64):
    """Triton sparse_attention_ref for decode (T = 1) and prefill (T queries). `splits` (default: enough programs
    to fill the GPU) divides each query's key slots over programs merged by log-sum-exp (which applies the gate, as
    one split's program does itself); other split boundaries give tolerance-level differences. block_n: key slots
    per tile (default: sparse_block_n for decode, kernel.TUNING's, whose step chose it; 32 for prefill, 7% faster than
    64 at 4,096 queries of 8k-128k contexts: PERF_LOG "speculative rollback of the DSA pending rows, ...").
    num_stages: of the GPU launches (3 or 4: within 0.3% of the step).
    rows [S] int64: the cache row of each sequence (default: row s). prefill: one split and the unspecialised kernel,
    so no length of a prompt compiles a launch of its own (a prefill launch has hundreds of query rows). out: written
    in place (q's shape and strides; default new) and returned."""
    _check_tensor("q", q, torch.bfloat16, ndim=5)
    S, T, G, HG, hd = q.shape
    for name, t_ in (("k", k), ("v", v)):
        _check_tensor(name, t_, torch.bfloat16, ndim=4)
        _check((t_.shape[0] == S or rows is not None) and t_.shape[2] == G and t_.shape[3] == hd,
               lambda: f"{name} must be [S={S}, N, G={G}, hd={hd}], got {tuple(t_.shape)}")
    if rows is not None:
        _check_tensor("rows", rows, torch.int64, ndim=1)
        _check(rows.numel() == S, lambda: f"rows must be [S={S}], got {tuple(rows.shape)}")
    _check(k.shape == v.shape and k.stride() == v.stride(), "k and v must have the same shape and layout")
    _check(ids.dtype == torch.int64 and ids.dim() == 4 and ids.stride(-1) == 1,
           lambda: f"ids must be int64 [S, G, T, K] with unit last stride, got {ids.dtype} {tuple(ids.shape)}")
    _check(tuple(ids.shape[:3]) == (S, G, T), lambda: f"ids must be [S={S}, G={G}, T={T}, K], got {tuple(ids.shape)}")
    _check(valid.dtype == torch.bool and valid.shape == ids.shape and valid.stride(-1) == 1,
           lambda: f"valid must be bool like ids {tuple(ids.shape)} with unit last stride")
    _check_tensor("pos", pos, pos.dtype, ndim=2)
    _check(tuple(pos.shape) == (S, T) and not pos.is_floating_point(), lambda: f"pos must be integer [S={S}, T={T}]")
    if gate is not None:
        _check_tensor("gate", gate, torch.bfloat16, ndim=2, contiguous=False)
        _check(tuple(gate.shape) == (S * T, G * HG) and gate.stride(1) == 1,
               lambda: f"gate must be [S*T={S * T}, G*Hg={G * HG}] with unit column stride, got {tuple(gate.shape)}")
    if out is None:
        out = torch.empty_like(q)
    _check(out.dtype == torch.bfloat16 and out.shape == q.shape
           and all(a == b for a, b, n in zip(out.stride(), q.stride(), q.shape) if n > 1),
           lambda: f"out must be bf16 with q's shape {tuple(q.shape)} and strides, got {tuple(out.shape)}")
    NSEL = ids.shape[-1]
    J = NSEL * blk + blk
    BLOCK_N = block_n or (32 if prefill else sparse_block_n)
    BLOCK_H = _heads_block(HG)
    n_rows = S * T * G
    if n_rows == 0:
        return out
    if splits is None:  # about two programs per SM, down to one tile per split (batch 1, 4104 keys: 9.7 us at 65
        # splits, 18.6 at 17)
        splits = 1 if prefill else max(1, min(_cdiv(264, n_rows), _cdiv(J, BLOCK_N)))
    split_len = _cdiv(_cdiv(J, splits), BLOCK_N) * BLOCK_N
    splits = _cdiv(J, split_len)
    va = valid.view(torch.uint8)
    if splits > 1:
        po = torch.empty(n_rows * splits * BLOCK_H * hd, dtype=torch.float32, device=q.device)
        pml = torch.empty(n_rows * splits * 2 * BLOCK_H, dtype=torch.float32, device=q.device)
    else:
        po = pml = out
    gated = gate is not None and splits == 1  # else the merge applies it
    (_sparse_attn_prefill if prefill else _sparse_attn_kernel)[(n_rows, splits)](
        q, k, v, ids, va, pos, rows if rows is not None else out, out, po, pml, gate if gated else out, T, G, HG,
        k.shape[1], NSEL, split_len, float(scale),
        q.stride(0), q.stride(1), q.stride(2), q.stride(3), k.stride(0), k.stride(1), k.stride(2),
        ids.stride(0), ids.stride(1), ids.stride(2), va.stride(0), va.stride(1), va.stride(2),
        gate.stride(0) if gated else 0, HEAD_DIM=hd, BLK=blk, SPLITS=splits, BLOCK_H=BLOCK_H,
        BLOCK_D=_pow2(hd), BLOCK_N=BLOCK_N, DOT_DTYPE=_DOT, ROWS=rows is not None, GATE=gated,
        PRECISE=_PRECISE, num_warps=4, num_stages=num_stages if common._GPU_LAUNCH else 1, **common._pdl())
    if splits > 1:
        _attn_merge_kernel[(n_rows, HG)](po, pml, out, gate if gate is not None else out, T, G, HG, q.stride(0),
                                       q.stride(1), q.stride(2), q.stride(3), gate.stride(0) if gate is not None else 0,
                                       HEAD_DIM=hd, SPLITS=splits, BLOCK_S=_pow2(splits),
                                       BLOCK_H=BLOCK_H, BLOCK_D=_pow2(hd), GATE=gate is not None,
                                       PRECISE=_PRECISE, num_warps=4, **common._pdl())
    return out


@triton.jit
def _dense_tile(qa, qb, k_ptr, v_ptr, ks, k_ok, ok, g, skv_n, skv_g, scale, m_i, l_i, acc_a, acc_b, da, db, db_ok,
                DOT_DTYPE: tl.constexpr):
    """One key tile of _dense_prefix_kernel: _sparse_attn_kernel's online-softmax step (fp32 logits * scale, dead
    keys -inf, p = exp(s - m) rounded to bf16 before P.V, fp32 sums) on the keys ks (loaded where k_ok, live where
    ok [rows, keys])."""
    kv = ks.to(tl.int64)[:, None] * skv_n + g * skv_g
    ka = tl.load(k_ptr + kv + da[None, :], mask=k_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)
    kb = tl.load(k_ptr + kv + db[None, :], mask=k_ok[:, None] & db_ok[None, :], other=0.0).to(tl.float32).to(DOT_DTYPE)
    sc = tl.dot(qb, tl.trans(kb), tl.dot(qa, tl.trans(ka))) * scale
    sc = tl.where(ok, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully dead tile so far: avoid inf - inf
    alpha = tl.exp(m_i - m_use)
    e = tl.exp(sc - m_use[:, None])
    l_i = l_i * alpha + tl.sum(e, axis=1)
    pr = _bf16_round(e).to(DOT_DTYPE)
    va = tl.load(v_ptr + kv + da[None, :], mask=k_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)
    vb = tl.load(v_ptr + kv + db[None, :], mask=k_ok[:, None] & db_ok[None, :], other=0.0).to(tl.float32).to(DOT_DTYPE)
    return m_new, l_i, tl.dot(pr, va, acc_a * alpha[:, None]), tl.dot(pr, vb, acc_b * alpha[:, None])


@triton.jit(do_not_specialize=["T", "p0", "ssel_g", "ssel_t"], do_not_specialize_on_alignment=["g_ptr"])
def _dense_prefix_kernel(q_ptr, k_ptr, v_ptr, o_ptr, sel_ptr, g_ptr, T, p0, scale, sq_t, sq_g, sq_h, skv_n, skv_g, so_t,
                         so_g, so_h, ssel_g, ssel_t, sg_t, HG: tl.constexpr, HGP: tl.constexpr, D: tl.constexpr,
                         BLK: tl.constexpr, QB: tl.constexpr, CUR: tl.constexpr, BLOCK_N: tl.constexpr,
                         DA: tl.constexpr, BLOCK_DB: tl.constexpr, DOT_DTYPE: tl.constexpr, PDL: tl.constexpr,
                         SELECT: tl.constexpr = False, GATE: tl.constexpr = False, PRECISE: tl.constexpr = False):
    """_sparse_attn_kernel's arithmetic for queries that select every history region, QB queries (whole regions:
    they share their history) x HG heads of KV group g as the rows of one tile, so each key tile is loaded once for
    them all. Row r: query position first + r // HGP, head r % HGP. Keys in the per-query kernel's order and tiles:
    history keys 0 .. blk * floor(p / blk) - 1 in tiles of BLOCK_N from key 0 (each row's own history masked), then
    one tile of CUR keys holding the block's current regions (each row's keys blk * floor(p / blk) .. p). head_dim in
    two power-of-two pieces DA + BLOCK_DB (192 = 128 + 64). SELECT: a history key is live only where its region is
    selected: bit region % 32 of sel[g, t, region // 32] (a query's own selection; int32 [G, T, words]; a tile's
    BLOCK_N // BLK regions, a power of two up to 32, sit in one word). GATE: then the output gate,
    bf(o * bf(sigmoid(logit))), the logit of (t, head g * HG + h) at g_ptr + t * sg_t + g * HG + h (gate_heads; its
    rows' alignment varies with a span's first token)."""
    _pdl_enter(PDL)
    b = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest histories start first
    g = tl.program_id(1)
    first = (p0 // BLK + b * (QB // BLK)) * BLK  # the block's first position: a region's first
    r = tl.arange(0, QB * HGP)
    p = first + r // HGP
    t = p - p0
    h = r % HGP
    row_ok = (t >= 0) & (t < T) & (h < HG)
    hist = p // BLK * BLK  # keys before the row's current region
    da = tl.arange(0, DA)
    db = DA + tl.arange(0, BLOCK_DB)
    db_ok = db < D
    qrow = q_ptr + t.to(tl.int64)[:, None] * sq_t + g * sq_g + h[:, None] * sq_h
    qa = tl.load(qrow + da[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)
    qb = tl.load(qrow + db[None, :], mask=row_ok[:, None] & db_ok[None, :], other=0.0).to(tl.float32).to(DOT_DTYPE)
    m_i = tl.full((QB * HGP,), float("-inf"), tl.float32)
    l_i = tl.zeros((QB * HGP,), dtype=tl.float32)
    acc_a = tl.zeros((QB * HGP, DA), dtype=tl.float32)
    acc_b = tl.zeros((QB * HGP, BLOCK_DB), dtype=tl.float32)
    # the history of the block's last query (keys [0, last)); masked loads past it: 0 * garbage could be NaN
    last = tl.minimum(first + QB - BLK, (p0 + T - 1) // BLK * BLK)
    for k0 in range(0, last, BLOCK_N):
        ks = k0 + tl.arange(0, BLOCK_N)
        ok = (ks[None, :] < hist[:, None]) & row_ok[:, None]
        if SELECT:  # the tile's regions share one word of each row's selection bits: one load a row
            word = tl.load(sel_ptr + g * ssel_g + t.to(tl.int64) * ssel_t + k0 // BLK // 32, mask=row_ok, other=0)
            ok = ok & (((word[:, None] >> (ks // BLK % 32)[None, :]) & 1) != 0)
        m_i, l_i, acc_a, acc_b = _dense_tile(qa, qb, k_ptr, v_ptr, ks, ks < last, ok, g, skv_n, skv_g, scale,
                                             m_i, l_i, acc_a, acc_b, da, db, db_ok, DOT_DTYPE)
    ks = first + tl.arange(0, CUR)
    ok = (ks[None, :] >= hist[:, None]) & (ks[None, :] <= p[:, None]) & row_ok[:, None]
    m_i, l_i, acc_a, acc_b = _dense_tile(qa, qb, k_ptr, v_ptr, ks, ks < p0 + T, ok, g, skv_n, skv_g, scale, m_i, l_i,
                                         acc_a, acc_b, da, db, db_ok, DOT_DTYPE)
    den = tl.maximum(l_i, 1e-30)[:, None]
    orow = o_ptr + t.to(tl.int64)[:, None] * so_t + g * so_g + h[:, None] * so_h
    oa = _bf16_round(tl.math.div_rn(acc_a, den * tl.full(acc_a.shape, 1.0, tl.float32)))
    ob = _bf16_round(tl.math.div_rn(acc_b, den * tl.full(acc_b.shape, 1.0, tl.float32)))
    if GATE:  # bf16 x bf16: the product is exact in fp32, rounded once
        logit = tl.load(g_ptr + t.to(tl.int64) * sg_t + g * HG + h, mask=row_ok, other=0.0).to(tl.float32)
        gate = _gate_bf16(logit, PRECISE)[:, None]
        oa, ob = _bf16_round(oa * gate), _bf16_round(ob * gate)
    tl.store(orow + da[None, :], oa.to(tl.bfloat16), mask=row_ok[:, None])
    tl.store(orow + db[None, :], ob.to(tl.bfloat16), mask=row_ok[:, None] & db_ok[None, :])


def dense_prefix_triton(q, k, v, p0, blk, scale, ids=None, valid=None, gate=None, out=None, block_n=32,
                        num_warps=4):
    """Triton dense_prefix (_dense_prefix_kernel) for one sequence: q [1, T, G, Hg, hd] at positions p0 ..
    p0 + T - 1, k, v [1, N, G, hd] (N >= p0 + T), ids, valid [1, G, T, K] or None, gate [T, G*Hg] or None, out like q
    or None -> out. Within sparse_attention_triton's distance of the reference (tiles of block_n keys: on every
    region's keys, the per-query prefill kernel's own). 32 keys and 4 warps: 1.4x faster than 64 and 8 at 8k and 16k
    positions (H100, PERF_LOG "speculative rollback of the DSA pending rows, ...")."""
    _check_tensor("q", q, torch.bfloat16, ndim=5, contiguous=False)
    _check_tensor("k", k, torch.bfloat16, ndim=4, contiguous=False)
    _check_tensor("v", v, torch.bfloat16, ndim=4, contiguous=False)
    S, T, G, HG, D = q.shape
    _check(S == 1 and k.shape[0] == 1 and k.shape[2:] == (G, D) and v.shape == k.shape and k.stride() == v.stride()
           and k.shape[1] >= p0 + T and q.stride(-1) == k.stride(-1) == 1,
           lambda: f"dense prefix attention: q {tuple(q.shape)} at p0 {p0}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if out is None:
        out = torch.empty(1, T, G, HG, D, dtype=torch.bfloat16, device=q.device)
    _check_tensor("out", out, torch.bfloat16, ndim=5, contiguous=False)
    _check(out.shape == q.shape and out.stride(-1) == 1,
           lambda: f"dense prefix attention: out must be like q {tuple(q.shape)}, got {tuple(out.shape)}")
    if gate is not None:
        _check_tensor("gate", gate, torch.bfloat16, ndim=2, contiguous=False)
        _check(tuple(gate.shape) == (T, G * HG) and gate.stride(1) == 1,
               lambda: f"dense prefix attention: gate must be [T={T}, G*Hg={G * HG}] with unit column stride, got "
               f"{tuple(gate.shape)}")
    if T == 0:
        return out
    sel = out
    if ids is not None:
        _check(ids.dtype == torch.int64 and valid.dtype == torch.bool and ids.shape == valid.shape and ids.dim() == 4
               and tuple(ids.shape[:3]) == (1, G, T),
               lambda: f"dense prefix attention: ids and valid must be int64 and bool [1, G={G}, T={T}, K], got "
               f"{ids.dtype} {tuple(ids.shape)}, {valid.dtype} {tuple(valid.shape)}")
        # sel [G, T, words]: bit id % 32 of word id // 32 set for each selected region (distinct bits: their sum is
        # their OR); the invalid slots add 0 to a spare word
        words = ((p0 + T - 1) // blk + 31) // 32
        bits = torch.zeros(G * T, words + 1, dtype=torch.int64, device=q.device)
        bits.scatter_add_(1, torch.where(valid, ids // 32, words)[0].reshape(G * T, -1),
                          torch.where(valid, 1 << ids % 32, 0)[0].reshape(G * T, -1))
        sel = bits.to(torch.int32).view(G, T, words + 1)  # bit 31 wraps to the sign: the kernel reads bits
    HGP = _pow2(HG)
    QB = blk * max(1, 64 // (HGP * blk))  # whole regions, 64 rows a tile where the heads allow
    BLOCK_N = block_n
    _check(ids is None or (BLOCK_N % blk == 0 and 32 % (BLOCK_N // blk) == 0),
           lambda: f"dense prefix attention: a tile of {BLOCK_N} keys must hold a power of two of regions of {blk}, "
           "at most 32")
    DA = 1 << (D - 1).bit_length() - 1  # head_dim = DA + the rest (192 = 128 + 64)
    first = p0 // blk * blk
    _dense_prefix_kernel[(_cdiv(p0 + T - first, QB), G)](
        q[0], k[0], v[0], out[0], sel, gate if gate is not None else out, T, int(p0), float(scale), q.stride(1),
        q.stride(2), q.stride(3), k.stride(1), k.stride(2), out.stride(1), out.stride(2), out.stride(3),
        sel.stride(0), sel.stride(1), gate.stride(0) if gate is not None else 0, HG=HG, HGP=HGP, D=D, BLK=blk,
        QB=QB, CUR=max(16, _pow2(QB)), BLOCK_N=BLOCK_N, DA=DA,
        BLOCK_DB=max(1, _pow2(D - DA)), DOT_DTYPE=_DOT, SELECT=ids is not None,
        GATE=gate is not None, PRECISE=_PRECISE, num_warps=num_warps, num_stages=2 if common._GPU_LAUNCH else 1,
        **common._pdl())
    return out
