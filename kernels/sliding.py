"""Sliding-window attention: the prefill chunk's banded attention (_banded_attn_kernel) and the fused decode step
(ring writes, split attention, log-sum-exp merge and output gate), with their launchers. The references:
kernel.banded_attention_ref, kernel.sliding_decode_ref. The merge helpers (_gate_bf16, _lse_merge) and the head tile
(_heads_block) serve the DSA attention too.
"""
import torch
import triton
import triton.language as tl

from kernels import common
from kernels.common import (_DOT, _NO_FMA, _PRECISE, _bf16_round, _cdiv, _check, _check_tensor, _exp, _pdl_enter,
                            _pow2, _unspecialised)
from kernels.norm_rope import _norm_params, _norm_slice, _rotate


@triton.jit
def _banded_attn_kernel(q_ptr, k_ptr, v_ptr, o_ptr, g_ptr, n, L, off, W, scale, sq_h, sq_t, sk_g, sk_t, sv_g, sv_t,
                        so_h, so_t, sg_t, HG: tl.constexpr, D: tl.constexpr, BLOCK_Q: tl.constexpr,
                        BLOCK_N: tl.constexpr, DA: tl.constexpr, BLOCK_DB: tl.constexpr, DOT_DTYPE: tl.constexpr,
                        PRECISE: tl.constexpr, PDL: tl.constexpr, GATE: tl.constexpr = False):
    """Queries [q0, q0 + BLOCK_Q) of KV group g with all its HG heads as the rows of one tile (row r: query
    q0 + r // HG, head g * HG + r % HG), so each key block is loaded once for HG heads; only the key blocks of the
    band are visited. head_dim in two power-of-two pieces, DA + BLOCK_DB (192 = 128 + 64: no padding to 256). The
    arithmetic of _sliding_attn_kernel: online softmax of fp32 logits (q.k) * scale, P.V with the fp32
    probabilities (on GPUs as bf16 hi + lo halves), one bf16 rounding of acc / l. GATE: then the output gate,
    bf(o * bf(sigmoid(logit))) with the logit of (query, head) at g_ptr + query * sg_t + head (gate_heads)."""
    _pdl_enter(PDL)
    q0 = tl.program_id(0) * BLOCK_Q
    g = tl.program_id(1)
    r = tl.arange(0, BLOCK_Q * HG)
    qi = q0 + r // HG
    head = g * HG + r % HG
    row_ok = qi < n
    da = tl.arange(0, DA)
    db = DA + tl.arange(0, BLOCK_DB)
    db_ok = db < D
    qrow = q_ptr + head.to(tl.int64)[:, None] * sq_h + qi.to(tl.int64)[:, None] * sq_t
    qa = tl.load(qrow + da[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)
    qb = tl.load(qrow + db[None, :], mask=row_ok[:, None] & db_ok[None, :], other=0.0).to(tl.float32).to(DOT_DTYPE)
    own = off + qi  # each row's own key
    m_i = tl.full((BLOCK_Q * HG,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q * HG,), dtype=tl.float32)
    acc_a = tl.zeros((BLOCK_Q * HG, DA), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_Q * HG, BLOCK_DB), dtype=tl.float32)
    for k0 in range(tl.maximum(off + q0 - W + 1, 0), tl.minimum(off + q0 + BLOCK_Q, L), BLOCK_N):
        ks = k0 + tl.arange(0, BLOCK_N)
        k_ok = ks < L
        krow = ks.to(tl.int64)[:, None] * sk_t + g.to(tl.int64) * sk_g
        vrow = ks.to(tl.int64)[:, None] * sv_t + g.to(tl.int64) * sv_g
        ka = tl.load(k_ptr + krow + da[None, :], mask=k_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)
        kb = tl.load(k_ptr + krow + db[None, :], mask=k_ok[:, None] & db_ok[None, :],
                     other=0.0).to(tl.float32).to(DOT_DTYPE)
        dist = own[:, None] - ks[None, :]
        ok = (dist >= 0) & (dist < W) & k_ok[None, :] & row_ok[:, None]
        sc = tl.dot(qb, tl.trans(kb), tl.dot(qa, tl.trans(ka)))
        sc = tl.where(ok, sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key so far: avoid inf - inf
        alpha = _exp(m_i - m_use, PRECISE)
        pr = _exp(sc - m_use[:, None], PRECISE)
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        va = tl.load(v_ptr + vrow + da[None, :], mask=k_ok[:, None], other=0.0).to(tl.float32).to(DOT_DTYPE)
        vb = tl.load(v_ptr + vrow + db[None, :], mask=k_ok[:, None] & db_ok[None, :],
                     other=0.0).to(tl.float32).to(DOT_DTYPE)
        acc_a = acc_a * alpha[:, None]
        acc_b = acc_b * alpha[:, None]
        if PRECISE:  # GPU: fp32 P as hi + lo bf16 halves on the tensor cores
            hi = _bf16_round(pr)
            lo = _bf16_round(pr - hi).to(DOT_DTYPE)
            hi = hi.to(DOT_DTYPE)
            acc_a = tl.dot(lo, va, tl.dot(hi, va, acc_a))
            acc_b = tl.dot(lo, vb, tl.dot(hi, vb, acc_b))
        else:  # interpreter: DOT_DTYPE is fp32
            acc_a = tl.dot(pr, va, acc_a)
            acc_b = tl.dot(pr, vb, acc_b)
        m_i = m_new
    inv = tl.where(row_ok, l_i, 1.0)[:, None]
    orow = o_ptr + head.to(tl.int64)[:, None] * so_h + qi.to(tl.int64)[:, None] * so_t
    oa = _bf16_round(tl.math.div_rn(acc_a, inv * tl.full(acc_a.shape, 1.0, tl.float32)))
    ob = _bf16_round(tl.math.div_rn(acc_b, inv * tl.full(acc_b.shape, 1.0, tl.float32)))
    if GATE:  # bf16 x bf16: the product is exact in fp32, rounded once
        logit = tl.load(g_ptr + qi.to(tl.int64) * sg_t + head, mask=row_ok, other=0.0).to(tl.float32)
        gate = _gate_bf16(logit, PRECISE)[:, None]
        oa, ob = _bf16_round(oa * gate), _bf16_round(ob * gate)
    tl.store(orow + da[None, :], oa.to(tl.bfloat16), mask=row_ok[:, None])
    tl.store(orow + db[None, :], ob.to(tl.bfloat16), mask=row_ok[:, None] & db_ok[None, :])


# g_ptr: a column slice of the packed projection, whose rows' alignment varies with a span's first token
_banded_attn_prefill = _unspecialised(_banded_attn_kernel, "n", "L", "off", "sk_g", "sv_g", "so_h",
                                      unaligned=("g_ptr",))


def banded_attention_triton(q, k, v, off, window, scale, gate=None, out=None, block_n=64, num_warps=8, rows=128,
                            num_stages=2):
    """Triton banded_attention (_banded_attn_kernel): within 2 bf16 steps of the reference (online softmax; CPU
    tests). rows: the tile's query rows (queries x heads of a group); 128 rows, 64-key blocks, 8 warps: 1.2-1.3x
    faster than 64 / 32 / 4 at 4k and 16k tokens (H100, PERF_LOG "speculative rollback of the DSA pending rows,
    ..."). GPU: block_n and head_dim's pieces of at least 16 (tl.dot's smallest)."""
    _check_tensor("q", q, torch.bfloat16, ndim=3, contiguous=False)
    _check_tensor("k", k, torch.bfloat16, ndim=3, contiguous=False)
    _check_tensor("v", v, torch.bfloat16, ndim=3, contiguous=False)
    H, n, D = q.shape
    G, L = k.shape[:2]
    _check(v.shape == k.shape and k.shape[2] == D and H % G == 0 and 0 <= off and off + n <= L,
           lambda: f"banded attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, off {off}")
    _check(q.stride(2) == k.stride(2) == v.stride(2) == 1, "banded attention: rows of q, k, v must be contiguous")
    if out is None:
        out = torch.empty(H, n, D, dtype=torch.bfloat16, device=q.device)
    _check_tensor("out", out, torch.bfloat16, ndim=3, contiguous=False)
    _check(out.shape == q.shape and out.stride(2) == 1,
           lambda: f"banded attention: out must be [{H}, {n}, {D}] with contiguous rows, got {tuple(out.shape)}")
    if gate is not None:
        _check_tensor("gate", gate, torch.bfloat16, ndim=2, contiguous=False)
        _check(tuple(gate.shape) == (n, H) and gate.stride(1) == 1,
               lambda: f"banded attention: gate must be [n={n}, H={H}] with unit head stride, got {tuple(gate.shape)}")
    HG = H // G
    _check(HG & (HG - 1) == 0 or not common._GPU_LAUNCH,
           lambda: f"banded attention: {HG} query heads per KV group (GPU: a power of 2)")
    BLOCK_Q = max(1, rows // HG) if common._GPU_LAUNCH else _pow2(max(1, 16 // HG))
    # head_dim = DA + the rest, each piece a power of two (192 = 128 + 64; 128 = 64 + 64: tl.dot's K is at least 16)
    DA = 1 << (D - 1).bit_length() - 1
    if n:
        _banded_attn_prefill[(_cdiv(n, BLOCK_Q), G)](
            q, k, v, out, gate if gate is not None else out, n, L, int(off), int(window), float(scale), q.stride(0),
            q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            gate.stride(0) if gate is not None else 0, HG=HG, D=D, BLOCK_Q=BLOCK_Q, BLOCK_N=block_n, DA=DA,
            BLOCK_DB=max(1, _pow2(D - DA)), DOT_DTYPE=_DOT, PRECISE=_PRECISE, GATE=gate is not None,
            num_warps=num_warps, num_stages=num_stages if common._GPU_LAUNCH else 1, **common._pdl())
    return out


@triton.jit
def _rope_row(cos_row, sin_row, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """A position's cos and sin table rows [1, BLOCK_HALF] fp32 (0 past HALF: pads stay 0)."""
    j = tl.arange(0, BLOCK_HALF)
    return (tl.load(cos_row + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :],
            tl.load(sin_row + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :])


@triton.jit
def _head_params(w_ptr, D: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """_head_norm_rope's RMS-norm weight pieces (first, second, rest; _norm_params)."""
    j = tl.arange(0, BLOCK_HALF)
    first = _norm_params(w_ptr, w_ptr, j, D, LAYERNORM=False)
    second = _norm_params(w_ptr, w_ptr, HALF + j, D, LAYERNORM=False)
    rest = (_norm_params(w_ptr, w_ptr, 2 * HALF + tl.arange(0, BLOCK_REST), D, LAYERNORM=False) if BLOCK_REST > 0
            else first)
    return first, second, rest


@triton.jit
def _head_norm_rope(x_ptr, base, r_ok, cs, wts, eps, D: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """RMS-norm + NEOX RoPE of head rows at x_ptr + base ([BLOCK_R, 1] offsets) with _norm_rope_rows' arithmetic
    (same rounding points, so the cached k matches norm_rope's): returns fp32 holding bf16 values, as three column
    pieces: first [BLOCK_R, BLOCK_HALF] (dims j < HALF), second (dims HALF + j), rest (dims 2*HALF + c < D);
    padding columns are 0. cs: the position's (cos, sin) (_rope_row), wts: the weight (_head_params)."""
    d = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + base + d[None, :], mask=r_ok[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
    r = tl.math.div_rn(tl.full((x.shape[0],), 1.0, tl.float32), tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps))
    mu = tl.zeros(r.shape, dtype=tl.float32)
    j = tl.arange(0, BLOCK_HALF)
    a = _norm_slice(x_ptr, base, j, r_ok, D, mu, r, wts[0], LAYERNORM=False)
    b = _norm_slice(x_ptr, base, HALF + j, r_ok, D, mu, r, wts[1], LAYERNORM=False)
    first, second = _rotate(a, b, cs[0], cs[1])
    first, second = _bf16_round(first), _bf16_round(second)
    if BLOCK_REST > 0:
        rest = _norm_slice(x_ptr, base, 2 * HALF + tl.arange(0, BLOCK_REST), r_ok, D, mu, r, wts[2], LAYERNORM=False)
    else:
        rest = first  # unused
    return first, second, rest


@triton.jit
def _new_kv(qkvg_ptr, xrow, g, H, G, cs, kwts, eps, D: tl.constexpr, HALF: tl.constexpr,
            BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """The new token's k of group g (norm + RoPE, as three [1, *] pieces) and v ([1, BLOCK_D]) from its packed row;
    cs, kwts: _head_norm_rope's."""
    one = tl.full((1,), 1, tl.int1)
    kf, ks, kr = _head_norm_rope(qkvg_ptr, xrow + (H + g) * D + tl.zeros((1, 1), tl.int64), one, cs, kwts, eps, D,
                                 HALF, BLOCK_D, BLOCK_HALF, BLOCK_REST)
    dims = tl.arange(0, BLOCK_D)
    vn = tl.load(qkvg_ptr + xrow + (H + G + g) * D + dims, mask=dims < D, other=0.0).to(tl.float32)[None, :]
    return kf, ks, kr, vn


@triton.jit
def _store_kv(k_ptr, v_ptr, new, kf, ks, kr, vn, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """Write a k row (pieces of _new_kv, values bf16 already) and a v row at element offset `new` of the rings."""
    j = tl.arange(0, BLOCK_HALF)
    tl.store(k_ptr + new + j[None, :], kf.to(tl.bfloat16), mask=(j < HALF)[None, :])
    tl.store(k_ptr + new + HALF + j[None, :], ks.to(tl.bfloat16), mask=(j < HALF)[None, :])
    if BLOCK_REST > 0:
        cr = 2 * HALF + tl.arange(0, BLOCK_REST)
        tl.store(k_ptr + new + cr[None, :], kr.to(tl.bfloat16), mask=cr[None, :] < D)
    dims = tl.arange(0, BLOCK_D)
    tl.store(v_ptr + new + dims[None, :], vn.to(tl.bfloat16), mask=(dims < D)[None, :])


@triton.jit
def _ring_tile(k_ptr, v_ptr, ring, slot, pm, p, R, W, s_end, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, NEW_IN_REGS: tl.constexpr):
    """Ring slots `slot` [BLOCK_N] of the (b, g) row at element offset ring: (ok [BLOCK_N]: slot in the query's
    window, the keys' three column pieces (first, second, rest; as _head_norm_rope's) and the values, raw bf16, 0
    where not ok). NEW_IN_REGS: slot pm is not read (the new token comes from registers)."""
    dist = (pm - slot + R) % R
    ok = (slot < s_end) & (dist < W) & (dist <= p)
    ld = (ok & (slot != pm))[:, None] if NEW_IN_REGS else ok[:, None]
    off = ring + slot.to(tl.int64)[:, None] * D
    j = tl.arange(0, BLOCK_HALF)
    first = tl.load(k_ptr + off + j[None, :], mask=ld & (j < HALF)[None, :], other=0.0)
    second = tl.load(k_ptr + off + HALF + j[None, :], mask=ld & (j < HALF)[None, :], other=0.0)
    if BLOCK_REST > 0:
        cr = 2 * HALF + tl.arange(0, BLOCK_REST)
        rest = tl.load(k_ptr + off + cr[None, :], mask=ld & (cr < D)[None, :], other=0.0)
    else:
        rest = first  # unused
    dims = tl.arange(0, BLOCK_D)
    return ok, first, second, rest, tl.load(v_ptr + off + dims[None, :], mask=ld & (dims < D)[None, :], other=0.0)


@triton.jit
def _sliding_write_kernel(qkvg_ptr, pos_ptr, rows_ptr, k_ptr, v_ptr, kw_ptr, cos_ptr, sin_ptr, G, R, Q, H, stride_t,
                          eps, D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          BLOCK_REST: tl.constexpr, PDL: tl.constexpr):
    """A step of Q > 1 tokens per ring row: token t's k (norm + RoPE) and v of group g into slot pos[t] % R of ring
    row (rows[t // Q], g), before any query of the step reads the ring (R >= W + Q - 1: no query's window loses a
    key). The position, its ring row, its table rows and the norm weight are read before the PDL wait (as
    _norm_rope_rows)."""
    t = tl.program_id(0) // G
    g = tl.program_id(0) % G
    p = tl.load(pos_ptr + t)
    b = tl.load(rows_ptr + t // Q)
    cs = _rope_row(cos_ptr + p * HALF, sin_ptr + p * HALF, HALF, BLOCK_HALF)
    kwts = _head_params(kw_ptr, D, HALF, BLOCK_HALF, BLOCK_REST)
    _pdl_enter(PDL)
    kf, ks, kr, vn = _new_kv(qkvg_ptr, t.to(tl.int64) * stride_t, g, H, G, cs, kwts, eps, D, HALF, BLOCK_D,
                             BLOCK_HALF, BLOCK_REST)
    _store_kv(k_ptr, v_ptr, ((b * G + g).to(tl.int64) * R + p % R) * D, kf, ks, kr, vn, D, HALF, BLOCK_D,
              BLOCK_HALF, BLOCK_REST)


@triton.jit
def _sliding_attn_kernel(
    qkvg_ptr, pos_ptr, rows_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, po_ptr, pml_ptr,
    G, R, W, Q, stride_t, eps, scale,
    NEW_IN_REGS: tl.constexpr, HG: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, SPLITS: tl.constexpr,
    SPLIT_LEN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_REST: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr,
    HOIST: tl.constexpr = False,
):
    """One (token t, KV group g) and one split of ring row (rows[t // Q], g)'s slots [split*SPLIT_LEN, +SPLIT_LEN),
    all Hg heads at once.

    Every program normalises and rotates its q heads itself (cheap; no launch in between). NEW_IN_REGS (Q == 1): the
    program also computes the new k; slot pm = p % R takes the new k/v from registers, never from memory: the
    program owning that slot also writes them to the ring (at its end), and no other program reads the slot. Else
    _sliding_write_kernel has written the step's Q keys before this launch. Slot s is valid iff d = (p - s) mod R
    satisfies d < W and d <= p (model.py's rule; with R == W it reduces to s <= p; the step's later tokens sit at
    d >= R - Q + 1 >= W). Online softmax over fp32 logits (q.k) * scale;
    P.V takes the fp32 probabilities (SDPA's math): on GPUs as two bf16 MMAs, P = hi + lo with hi = bf(P),
    lo = bf(P - hi) (16 of P's 24 bits; the dropped part is < 2^-16 P), on the interpreter as one fp32 dot.
    Writes the unnormalised acc, the running max m and sum l for _sliding_merge_kernel.
    The position, its ring row, its table rows and the norm weights are read before the PDL wait (as
    _norm_rope_rows). HOIST
    (NEW_IN_REGS, one BLOCK_N chunk per split): so are the split's cached keys and values, while the packed
    projection (the predecessor, which writes only qkvg) still runs: no slot but pm was written by a kernel that
    may be running.
    """
    row = tl.program_id(0)  # t * G + g
    split = tl.program_id(1)
    t = row // G
    g = row % G
    H = G * HG
    p = tl.load(pos_ptr + t)
    pm = p % R
    cs = _rope_row(cos_ptr + p * HALF, sin_ptr + p * HALF, HALF, BLOCK_HALF)
    qwts = _head_params(qw_ptr, D, HALF, BLOCK_HALF, BLOCK_REST)
    if NEW_IN_REGS:
        kwts = _head_params(kw_ptr, D, HALF, BLOCK_HALF, BLOCK_REST)
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < D
    ring = (tl.load(rows_ptr + t // Q) * G + g).to(tl.int64) * R * D  # ring [B, G, R, D]: this (row, g)'s slots
    s_end = tl.minimum(split * SPLIT_LEN + SPLIT_LEN, R)
    if HOIST:
        tl.static_assert(NEW_IN_REGS and SPLIT_LEN <= BLOCK_N)
        pre = _ring_tile(k_ptr, v_ptr, ring, split * SPLIT_LEN + tl.arange(0, BLOCK_N), pm, p, R, W, s_end, D, HALF,
                         BLOCK_D, BLOCK_HALF, BLOCK_REST, NEW_IN_REGS=NEW_IN_REGS)
    _pdl_enter(PDL)
    xrow = t.to(tl.int64) * stride_t
    heads = tl.arange(0, BLOCK_H)
    h_ok = heads < HG
    qf, qs, qr = _head_norm_rope(qkvg_ptr, xrow + ((g * HG + heads) * D)[:, None], h_ok, cs, qwts, eps, D, HALF,
                                 BLOCK_D, BLOCK_HALF, BLOCK_REST)
    if NEW_IN_REGS:
        kf, ks, kr, vn = _new_kv(qkvg_ptr, xrow, g, H, G, cs, kwts, eps, D, HALF, BLOCK_D, BLOCK_HALF,
                                 BLOCK_REST)  # [1, *] each
    qf, qs = qf.to(DOT_DTYPE), qs.to(DOT_DTYPE)
    if BLOCK_REST > 0:
        qr = qr.to(DOT_DTYPE)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    for t in tl.static_range((SPLIT_LEN + BLOCK_N - 1) // BLOCK_N):
        slot = split * SPLIT_LEN + t * BLOCK_N + tl.arange(0, BLOCK_N)
        if HOIST:
            ok, k1, k2, k3, vt = pre
        else:
            ok, k1, k2, k3, vt = _ring_tile(k_ptr, v_ptr, ring, slot, pm, p, R, W, s_end, D, HALF, BLOCK_D, BLOCK_HALF,
                                            BLOCK_REST, NEW_IN_REGS=NEW_IN_REGS)
        is_new = (slot == pm)[:, None]
        kt = k1.to(tl.float32)
        if NEW_IN_REGS:
            kt = tl.where(is_new, kf, kt)
        sc = tl.dot(qf, tl.trans(kt.to(DOT_DTYPE)))
        kt = k2.to(tl.float32)
        if NEW_IN_REGS:
            kt = tl.where(is_new, ks, kt)
        sc = tl.dot(qs, tl.trans(kt.to(DOT_DTYPE)), sc)
        if BLOCK_REST > 0:
            kt = k3.to(tl.float32)
            if NEW_IN_REGS:
                kt = tl.where(is_new, kr, kt)
            sc = tl.dot(qr, tl.trans(kt.to(DOT_DTYPE)), sc)
        sc = tl.where(ok[None, :], sc * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid slot so far: avoid inf - inf
        alpha = _exp(m_i - m_use, PRECISE)
        pr = _exp(sc - m_use[:, None], PRECISE)
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        vt = vt.to(tl.float32)
        if NEW_IN_REGS:
            vt = tl.where(is_new, vn, vt)
        vt = vt.to(DOT_DTYPE)
        acc = acc * alpha[:, None]
        if PRECISE:  # GPU: fp32 P as hi + lo bf16 halves on the tensor cores
            hi = _bf16_round(pr)
            acc = tl.dot(hi.to(DOT_DTYPE), vt, acc)
            acc = tl.dot(_bf16_round(pr - hi).to(DOT_DTYPE), vt, acc)
        else:  # interpreter: DOT_DTYPE is fp32
            acc = tl.dot(pr, vt, acc)
        m_i = m_new
    part = (row * SPLITS + split).to(tl.int64)
    tl.store(po_ptr + (part * HG + heads[:, None]) * D + dims[None, :], acc, mask=h_ok[:, None] & d_ok[None, :])
    tl.store(pml_ptr + (part * 2) * HG + heads, m_i, mask=h_ok)
    tl.store(pml_ptr + (part * 2 + 1) * HG + heads, l_i, mask=h_ok)
    # the owner of the new token's slot writes it last: a store to the rings ahead of the loop would keep the
    # compiler from issuing the ring loads before it (they may alias), a dependent round trip at the chain's head
    if NEW_IN_REGS:
        if pm // SPLIT_LEN == split:
            _store_kv(k_ptr, v_ptr, ring + pm * D, kf, ks, kr, vn, D, HALF, BLOCK_D, BLOCK_HALF, BLOCK_REST)


@triton.jit
def _gate_bf16(logit, PRECISE: tl.constexpr):
    """bf(sigmoid(logit)) of an fp32 logit, as torch.sigmoid of a bf16 tensor: the attention output gate's factor
    (both merge kernels)."""
    return _bf16_round(tl.math.div_rn(1.0, 1.0 + _exp(-logit, PRECISE)))


@triton.jit
def _split_sum(x, C: tl.constexpr, S: tl.constexpr):
    """x [C, S] -> [C]: the sum over the splits' axis (S a power of 2) in one fixed order, adjacent pairs first,
    ((x0 + x1) + (x2 + x3)) + ..., whatever the layout."""
    for i in tl.static_range(S.bit_length() - 1):
        lo, hi = tl.split(tl.reshape(x, (C, S >> (i + 1), 2)))
        x = lo + hi
    return tl.reshape(x, (C,))


@triton.jit
def _lse_merge(po, m, l, C: tl.constexpr, S: tl.constexpr, PRECISE: tl.constexpr):
    """The log-sum-exp merge of a head's S splits (both decode attentions' merge kernels): po [C, S] (C of the head's
    dims: each split's unnormalised fp32 output), m, l [S] (its running max and sum of exps) -> [C] bf16 values
    o = bf(sum c po / sum c l) (SDPA's bf16 result), c = exp(m - max m) (0 for an empty split; a head without keys
    gives 0). Each column's splits sit in one thread and add in a fixed order (_split_sum): the result depends on S
    alone, not on a layout's reduction order."""
    c = tl.where(m == float("-inf"), 0.0, _exp(m - tl.max(m, axis=0), PRECISE))
    num = _split_sum(po * c[None, :], C, S)
    den = _split_sum((l * c)[None, :], 1, S)
    return _bf16_round(tl.math.div_rn(num, tl.full(num.shape, 1.0, tl.float32) * tl.maximum(den, 1e-30)))


@triton.jit
def _sliding_merge_kernel(po_ptr, pml_ptr, qkvg_ptr, out_ptr, G, stride_t,
                          HG: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_D: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    """One (row, head)'s attention output: _lse_merge of its splits, then the gate: out = bf(o * bf(1 / (1 +
    exp(-logit)))) (torch.sigmoid, then mul)."""
    _pdl_enter(PDL)
    row = tl.program_id(0)  # t * G + g
    h = tl.program_id(1)
    t = row // G
    head = (row % G) * HG + h
    sp = tl.arange(0, BLOCK_S)
    sp_ok = sp < SPLITS
    part = (row * SPLITS + sp).to(tl.int64)
    m = tl.load(pml_ptr + (part * 2) * HG + h, mask=sp_ok, other=float("-inf"))
    l = tl.load(pml_ptr + (part * 2 + 1) * HG + h, mask=sp_ok, other=0.0)
    dims = tl.arange(0, BLOCK_D)
    d_ok = dims < D
    logit = tl.load(qkvg_ptr + t.to(tl.int64) * stride_t + (G * HG + 2 * G) * D + head).to(tl.float32)
    gate = _gate_bf16(logit, PRECISE)
    po = tl.load(po_ptr + (part[None, :] * HG + h) * D + dims[:, None], mask=d_ok[:, None] & sp_ok[None, :],
                 other=0.0)  # [BLOCK_D, BLOCK_S]
    o = _lse_merge(po, m, l, BLOCK_D, BLOCK_S, PRECISE=PRECISE)
    tl.store(out_ptr + t.to(tl.int64) * (G * HG * D) + head * D + dims, _bf16_round(o * gate).to(tl.bfloat16),
             mask=d_ok)


def _heads_block(HG: int) -> int:
    """The head axis of the decode attention tiles (the M side of their dots): 8 at TP = 8's 8 heads per group, where
    16 padded every q norm, RoPE and softmax element twice (Triton pads an MMA's M on NVIDIA GPUs itself)."""
    return max(8, _pow2(HG))


def sliding_decode_triton(qkvg, pos, ring_k, ring_v, q_norm_w, k_norm_w, cos, sin, eps, scale, window, n_heads,
                          n_groups, split_len=32, num_warps=None, rows=None, sliding_warps=(8, 4)):
    """Triton sliding_decode_ref: 2 launches (3 for Q > 1 tokens per row: the keys are written first). rows [B] int64:
    the ring row of each of the step's rows (default: every ring row, in order). split_len:
    ring slots per program; it depends only on R (never on the batch or Q), so a token's reduction order and result
    do not depend on the batch size (32: 16 / 64 / 128 were slower at batch 1 or 16, PERF_LOG "Per-kernel notes").
    num_warps of the attention launch: default sliding_warps, (grid < SMs, grid >= SMs) (kernel.TUNING's, which
    kernel.sliding_decode passes)."""
    H, G = n_heads, n_groups
    _check(H > 0 and G > 0 and H % G == 0, lambda: f"n_heads={H} must be a positive multiple of n_groups={G}")
    for name, t_ in (("ring_k", ring_k), ("ring_v", ring_v)):
        _check_tensor(name, t_, torch.bfloat16, ndim=4)
    R, hd = ring_k.shape[2:]
    rows = torch.arange(ring_k.shape[0], device=qkvg.device) if rows is None else rows
    _check_tensor("rows", rows, torch.int64, ndim=1)
    B, T = rows.numel(), qkvg.shape[0]
    Q = T // B if B else 1
    _check(ring_v.shape == ring_k.shape and ring_k.shape[1] == G,
           lambda: f"ring_k, ring_v must both be [B, G={G}, R, hd], got {tuple(ring_k.shape)}, {tuple(ring_v.shape)}")
    _check_tensor("qkvg", qkvg, torch.bfloat16, ndim=2, contiguous=False)
    width = H * hd + 2 * G * hd + H
    _check(T == B * Q and qkvg.shape[1] == width and qkvg.stride(1) == 1,
           lambda: f"qkvg must be [B*Q (B={B}), H*hd + 2*G*hd + H = {width}] with unit column stride, got "
           f"{tuple(qkvg.shape)} strides {qkvg.stride()}")
    _check(0 < window and window + Q - 1 <= R,
           lambda: f"window={window} with {Q} tokens per row needs a ring of window + {Q - 1} slots, not R={R}")
    _check_tensor("pos", pos, torch.int64, ndim=1)
    _check(pos.numel() == T, lambda: f"pos must be [T={T}], got {tuple(pos.shape)}")
    for name, w_ in (("q_norm_w", q_norm_w), ("k_norm_w", k_norm_w)):
        _check_tensor(name, w_, torch.float32, ndim=1)
        _check(w_.numel() == hd, lambda: f"{name} must be [{hd}], got {tuple(w_.shape)}")
    _check_tensor("cos", cos, torch.bfloat16, ndim=2)
    _check_tensor("sin", sin, torch.bfloat16, ndim=2)
    half = cos.shape[1]
    _check(cos.shape == sin.shape and 0 < 2 * half <= hd,
           lambda: f"cos/sin must be [n_pos, half <= {hd // 2}], got {tuple(cos.shape)}, {tuple(sin.shape)}")
    out = torch.empty(T, H * hd, dtype=torch.bfloat16, device=qkvg.device)
    if T == 0:
        return out
    HG = H // G
    splits = _cdiv(R, split_len)
    po = torch.empty(T * G * splits * HG * hd, dtype=torch.float32, device=qkvg.device)
    pml = torch.empty(T * G * splits * 2 * HG, dtype=torch.float32, device=qkvg.device)
    rest = hd - 2 * half
    # no FMA: the norms' sums of squares and the softmax round their products separately, as the references do
    blocks = dict(D=hd, HALF=half, BLOCK_D=_pow2(hd),
                  BLOCK_HALF=max(16, _pow2(half)),
                  BLOCK_REST=max(16, _pow2(rest)) if rest else 0, num_warps=4, **_NO_FMA)
    warps = sliding_warps[T * G * splits >= common._sms()]
    block_n = max(16, min(64, _pow2(split_len)))
    if Q > 1:
        _sliding_write_kernel[(T * G,)](qkvg, pos, rows, ring_k, ring_v, k_norm_w, cos, sin, G, R, Q, H,
                                        qkvg.stride(0), float(eps), **blocks, **common._pdl())
    _sliding_attn_kernel[(T * G, splits)](
        qkvg, pos, rows, ring_k, ring_v, q_norm_w, k_norm_w, cos, sin, po, pml, G, R, window, Q, qkvg.stride(0), float(eps),
        float(scale), NEW_IN_REGS=Q == 1, HG=HG, SPLITS=splits, SPLIT_LEN=split_len,
        BLOCK_H=_heads_block(HG), BLOCK_N=block_n,
        DOT_DTYPE=_DOT, PRECISE=_PRECISE, HOIST=Q == 1 and split_len <= block_n,
        **dict(blocks, num_warps=num_warps or warps), **common._pdl())
    _sliding_merge_kernel[(T * G, HG)](po, pml, qkvg, out, G, qkvg.stride(0), HG=HG, D=hd, SPLITS=splits,
                                       BLOCK_S=_pow2(splits), BLOCK_D=blocks["BLOCK_D"],
                                       PRECISE=_PRECISE, num_warps=4, **common._pdl())
    return out
