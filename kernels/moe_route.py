"""MoE routing: the sigmoid router (logits with the experts' FP8 input, then the top-k selection), SwiGLU,
activation quantisation and prefill's dispatch of the (token, slot) pairs by expert, with their launchers. The
references: kernel.route_ref, kernel.swiglu_ref, kernel.act_quant_ref, kernel.moe_dispatch_ref.
"""
import torch
import triton
import triton.language as tl

from kernels import common
from kernels.common import (FP8, PREFILL_ROWS, QBLOCK, _DOT, _NO_FMA, _PRECISE, _bf16_round, _cdiv, _check,
                            _check_tensor, _exp, _launch_rows, _pdl_enter, _pow2, _to_e4m3, _unspecialised)
from kernels.linear import _sum_parts


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, part_ptr, xq_ptr, sx_ptr, T, E, D, K_SPLIT_LEN,
                          BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, QUANT: tl.constexpr,
                          QUANT_T: tl.constexpr, DOT_DTYPE: tl.constexpr, PDL: tl.constexpr,
                          HOIST: tl.constexpr = False, PARTS: tl.constexpr = 1):
    """part[ks, t, e] = f32(x[t, K slice ks]) . f32(w[e, K slice ks]): bf16 products are exact in fp32, so the
    bf16 MMA with fp32 accumulation computes route_ref's fp32 GEMM (bf16 x and w widened to fp32); K is split so
    decode fills the GPU. QUANT: the programs of the first E tile also write act_quant_ref(x) of the rows and K
    slice they read (xq e4m3 bits [T, D], sx [T, D/128]; _act_quant_kernel's arithmetic) for the FP8 experts, so
    that quantisation costs no launch of its own. BLOCK_K is a multiple of 128.
    HOIST (BLOCK_K == K_SPLIT_LEN: one K step): the weight tile is loaded before the PDL wait, while the kernel that
    writes x still runs (the MMA adds K in the same order at any BLOCK_K: same bits). PARTS (HOIST only): the step's
    K cut into PARTS parts, each its own MMA chain, added pairwise (as _skinny_tile; the order depends on
    K_SPLIT_LEN alone): one chain of 32 dependent mma.sync per warp at 512 columns (sm90 SASS) becomes 4 of 8."""
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    es = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    ks0 = tl.program_id(2) * K_SPLIT_LEN
    SPLIT: tl.constexpr = HOIST and PARTS > 1
    if SPLIT:
        BKP: tl.constexpr = BLOCK_K // PARTS
        kw = (ks0 + tl.arange(0, PARTS)[:, None] * BKP + tl.arange(0, BKP)[None, :])[:, None, :]  # [PARTS, 1, BKP]
        w_pre = tl.load(w_ptr + es[None, :, None].to(tl.int64) * D + kw, mask=(es[None, :, None] < E) & (kw < D),
                        other=0.0)  # [PARTS, BLOCK_E, BKP]
    elif HOIST:
        kw = ks0 + tl.arange(0, BLOCK_K)
        w_pre = tl.load(w_ptr + es[:, None].to(tl.int64) * D + kw[None, :], mask=(es[:, None] < E) & (kw < D)[None, :],
                        other=0.0)
    _pdl_enter(PDL)
    if SPLIT:  # one K step
        x3 = tl.load(x_ptr + ts[None, :, None].to(tl.int64) * D + kw, mask=(ts[None, :, None] < T) & (kw < D),
                     other=0.0).to(tl.float32)
        acc3 = tl.dot(x3.to(DOT_DTYPE), tl.permute(w_pre.to(tl.float32).to(DOT_DTYPE), (0, 2, 1)))
        acc = _sum_parts(tl.permute(acc3, (1, 2, 0)), BLOCK_T, BLOCK_E, PARTS)
    else:
        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for k0 in range(ks0, tl.minimum(ks0 + K_SPLIT_LEN, D), BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < D
            x_ok = (ts[:, None] < T) & k_ok[None, :]
            xt = tl.load(x_ptr + ts[:, None].to(tl.int64) * D + ks[None, :], mask=x_ok, other=0.0).to(tl.float32)
            if HOIST:
                wt = w_pre.to(tl.float32).to(DOT_DTYPE)
            else:
                wt = tl.load(w_ptr + es[:, None].to(tl.int64) * D + ks[None, :],
                             mask=(es[:, None] < E) & k_ok[None, :], other=0.0).to(tl.float32).to(DOT_DTYPE)
            acc = tl.dot(xt.to(DOT_DTYPE), tl.trans(wt), acc)
    out = part_ptr + (tl.program_id(2) * T + ts[:, None]).to(tl.int64) * E + es[None, :]
    tl.store(out, acc, mask=(ts[:, None] < T) & (es[None, :] < E))
    # after the GEMM loop, x's slice again (cache hits): inside it, the branch kept the loop from being pipelined
    # (6.6 against 8.7 us a layer)
    # QUANT_T = BLOCK_T, or next_pow2(T) when T < BLOCK_T (one tile): the tile's first QUANT_T rows hold all of its
    # tokens, so at T = 1 one row is quantised, not 16 (16x fewer instructions)
    if QUANT:
        if tl.program_id(1) == 0:
            QB: tl.constexpr = 128  # the FP8 block (QBLOCK; a plain global is not a constexpr to the compiler)
            tq = tl.program_id(0) * BLOCK_T + tl.arange(0, QUANT_T)
            for k0 in range(ks0, tl.minimum(ks0 + K_SPLIT_LEN, D), QB):
                ks = k0 + tl.arange(0, QB)
                x_ok = (tq[:, None] < T) & (ks[None, :] < D)
                xt = tl.load(x_ptr + tq[:, None].to(tl.int64) * D + ks[None, :], mask=x_ok, other=0.0).to(tl.float32)
                sx, inv = _block_scale(xt)
                tl.store(xq_ptr + tq[:, None].to(tl.int64) * D + ks[None, :],
                         _to_e4m3(xt * inv[:, None]).to(tl.uint8, bitcast=True), mask=x_ok)
                tl.store(sx_ptr + tq.to(tl.int64) * tl.cdiv(D, QB) + k0 // QB, sx, mask=tq < T)


@triton.jit
def _router_select_kernel(part_ptr, bias_ptr, ids_ptr, wts_ptr, T, E, scale,
                          K_SPLITS: tl.constexpr, TOPK: tl.constexpr, RENORM: tl.constexpr,
                          BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr):
    """One token: z = sum of the K-split partials in order; sc = sigmoid(z) + b; take the TOPK largest (ties to the
    lower id, slot 0 first); w = sc[id] - b[id], renormalised by (sum + 1e-20), times scale. One reduction per slot.
    The bias (a parameter) is read before the PDL wait."""
    t = tl.program_id(0).to(tl.int64)
    es = tl.arange(0, BLOCK_E)
    e_ok = es < E
    bias = tl.load(bias_ptr + es, mask=e_ok, other=0.0)
    _pdl_enter(PDL)
    z = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for i in tl.static_range(K_SPLITS):
        z = z + tl.load(part_ptr + (i * T + t) * E + es, mask=e_ok, other=0.0)
    sig = tl.math.div_rn(tl.full(z.shape, 1.0, tl.float32), 1.0 + _exp(-z, PRECISE))
    sc = tl.where(e_ok, sig + bias + 0.0, float("-inf"))  # + 0.0: a -0 would order below +0 in the key
    # one int64 max per slot: the score's bits made monotone (negatives' magnitude bits flipped) above the inverted
    # id, so the maximum is the largest score and, among equal scores, the lowest id
    b = sc.to(tl.int32, bitcast=True)
    key = (tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.int64) << 32) | (BLOCK_E - 1 - es).to(tl.int64)
    slots = tl.arange(0, BLOCK_TOPK)
    ids = tl.zeros((BLOCK_TOPK,), dtype=tl.int64)
    top = tl.zeros((BLOCK_TOPK,), dtype=tl.int32)  # the chosen scores' monotone bits
    for j in tl.static_range(TOPK):
        best = tl.max(key, axis=0)
        ids = tl.where(slots == j, BLOCK_E - 1 - (best & 0xFFFFFFFF), ids)
        top = tl.where(slots == j, (best >> 32).to(tl.int32), top)
        key = tl.where(key == best, -(2 ** 63), key)
    ok = slots < TOPK
    top = tl.where(top >= 0, top, top ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    wts = tl.where(ok, top - tl.load(bias_ptr + ids, mask=ok, other=0.0), 0.0)
    if RENORM:
        wts = tl.math.div_rn(wts, tl.full(wts.shape, 1.0, tl.float32) * (tl.sum(wts, axis=0) + 1e-20))
    tl.store(ids_ptr + t * TOPK + slots, ids, mask=ok)
    tl.store(wts_ptr + t * TOPK + slots, wts * scale, mask=ok)


_router_logits_prefill = _unspecialised(_router_logits_kernel, "T")
_router_select_prefill = _unspecialised(_router_select_kernel, "T")


def route_triton(x, w, bias, k, scale, renorm=True, quant=False, hoist=None, router_block_e=32, router_parts=4,
                 router_prefill=(128, 128, 64, 8, 3)):
    """Triton route_ref; quant: also act_quant_ref(x) -> (ids, weights, (e4m3 [T, D], fp32 [T, D/128])), written by
    the logits kernel (the routed FP8 experts' input: one launch less per MoE layer). hoist: the logits kernel's HOIST
    (default: wherever its K split is one power-of-two step whose weight tile fits in registers; False: the K loop).
    router_block_e, router_parts, router_prefill: the logits launch's choices (kernel.TUNING's, which kernel.route
    passes): experts per decode program, MMA chains of the hoisted K step, prefill's tile (rows, experts, K block,
    warps, stages)."""
    _check_tensor("x", x, torch.bfloat16, ndim=2)
    _check_tensor("w", w, torch.bfloat16, ndim=2)
    _check_tensor("bias", bias, torch.float32, ndim=1)
    T, D = x.shape
    E = w.shape[0]
    _check(w.shape[1] == D and bias.numel() == E and 0 < k <= E,
           lambda: f"router shapes: x [T, {D}], w {tuple(w.shape)}, bias {tuple(bias.shape)}, k={k}")
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    wts = torch.empty(T, k, dtype=torch.float32, device=x.device)
    xq = torch.empty(T, D, dtype=torch.uint8, device=x.device) if quant else ids
    sx = torch.empty(T, _cdiv(D, QBLOCK), dtype=torch.float32, device=x.device) if quant else wts
    done = (ids, wts, (xq.view(FP8), sx)) if quant else (ids, wts)
    if T == 0:
        return done
    prefill = T > PREFILL_ROWS
    gpu = common._GPU_LAUNCH
    BLOCK_T, BLOCK_E, BLOCK_K = 16, (router_block_e if gpu else 128), (128 if gpu else 256)
    warps, stages = 4, (3 if gpu else 1)
    if prefill and gpu:  # decode's small tiles fill the GPU at T <= 16; prefill's reload x and w from L2
        BLOCK_T, BLOCK_E, BLOCK_K, warps, stages = router_prefill
    # split K until the GEMM has ~2 programs per SM; partial sums are added in a fixed order (deterministic); prefill
    # rows as the power of two above them (_launch_rows)
    tiles = _cdiv(_launch_rows(T), BLOCK_T) * _cdiv(E, BLOCK_E)
    k_splits = max(1, min(_cdiv(264, tiles), _cdiv(D, 4 * BLOCK_K), 16))
    split_len = _cdiv(_cdiv(D, k_splits), BLOCK_K) * BLOCK_K
    k_splits = _cdiv(D, split_len)
    part = torch.empty(k_splits, T, E, dtype=torch.float32, device=x.device)
    # one K step of split_len columns, its weight tile (<= 32 KB on a GPU) held in registers across the wait
    if hoist is None:
        hoist = split_len == _pow2(split_len) and (split_len * BLOCK_E <= 16384 or not gpu)
    (_router_logits_prefill if prefill else _router_logits_kernel)[(_cdiv(T, BLOCK_T), _cdiv(E, BLOCK_E),
                                                                    k_splits)](
        x, w, part, xq, sx, T, E, D, split_len, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E,
        BLOCK_K=split_len if hoist else BLOCK_K, QUANT=bool(quant), QUANT_T=min(BLOCK_T, _pow2(T)),
        DOT_DTYPE=_DOT, HOIST=hoist, PARTS=router_parts if hoist else 1, num_warps=warps,
        num_stages=stages, **common._pdl())
    (_router_select_prefill if prefill else _router_select_kernel)[(T,)](
        part, bias, ids, wts, T, E, float(scale), K_SPLITS=k_splits, TOPK=k, RENORM=renorm,
                                BLOCK_E=_pow2(E), BLOCK_TOPK=_pow2(k),
                                PRECISE=_PRECISE, num_warps=4, **_NO_FMA, **common._pdl())
    return done


@triton.jit
def _swiglu_math(g, u, limit, HAS_LIMIT: tl.constexpr, PRECISE: tl.constexpr, ZERO_GUARD: tl.constexpr = False):
    """bf16-valued fp32 g, u -> bf( min(silu(g), L) * clamp(u, -L, L) ) as fp32; silu(g) = g / (1 + exp(-g)).
    ZERO_GUARD: a zero g divides a 1 instead and keeps its own signed zero (g / 2's value): a zero dividend sends the
    sm90 division to its slow path, which every padded row of a decode tile took. On at T = 1 only (the batch-1 step
    -2.1%, batch 16 +4%: PERF_LOG "Per-kernel notes")."""
    if ZERO_GUARD:
        zero = g == 0.0
        a = tl.where(zero, g, tl.math.div_rn(tl.where(zero, 1.0, g), 1.0 + _exp(-g, PRECISE)))
    else:
        a = tl.math.div_rn(g, 1.0 + _exp(-g, PRECISE))
    if HAS_LIMIT:
        a = tl.minimum(a, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return _bf16_round(a * u)


@triton.jit
def _swiglu_kernel(g_ptr, u_ptr, out_ptr, n, limit, HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr,
                   PRECISE: tl.constexpr, PDL: tl.constexpr):
    """out = bf( min(silu(g), L) * clamp(u, -L, L) ), fp32 math, one rounding (swiglu_ref)."""
    _pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _swiglu_math(g, u, limit, HAS_LIMIT=HAS_LIMIT, PRECISE=PRECISE).to(tl.bfloat16), mask=m)


_swiglu_prefill = _unspecialised(_swiglu_kernel, "n")


def swiglu_triton(g, u, limit):
    _check_tensor("g", g, torch.bfloat16)
    _check_tensor("u", u, torch.bfloat16)
    _check(g.shape == u.shape, lambda: f"g {tuple(g.shape)} and u {tuple(u.shape)} must have the same shape")
    out = torch.empty_like(g)
    n = g.numel()
    BLOCK = 2048
    if n:
        (_swiglu_kernel if g.shape[0] <= PREFILL_ROWS else _swiglu_prefill)[(_cdiv(n, BLOCK),)](
            g, u, out, n, float(limit) if limit is not None else 0.0,
                                                 HAS_LIMIT=limit is not None, BLOCK=BLOCK, PRECISE=_PRECISE,
                                                 num_warps=4, **common._pdl())
    return out


@triton.jit
def _block_scale(x):
    """x [M, 128] fp32 (one FP8 block per row) -> (sx, 1 / sx) [M] with act_quant_ref's arithmetic:
    sx = max(amax, 1e-10) * (1/448); the reciprocal correctly rounded, like torch's 1 / sx."""
    sx = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) * (1.0 / 448.0)
    return sx, tl.math.div_rn(tl.full(sx.shape, 1.0, tl.float32), sx)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, end_ptr, M, K, x_stride, q_stride, s_stride,
                      BLOCK_M: tl.constexpr, QBLOCK: tl.constexpr, HAS_END: tl.constexpr, PDL: tl.constexpr):
    """Per row, per QBLOCK-wide K block: sx = max(amax, 1e-10) * (1/448); q = e4m3(clamp(x * (1/sx), -448, 448)).
    HAS_END: rows from end_ptr[0] on are skipped."""
    _pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    cols = kb * QBLOCK + tl.arange(0, QBLOCK)
    if HAS_END:
        M = tl.minimum(M, tl.load(end_ptr))
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sx, inv = _block_scale(x)
    tl.store(q_ptr + rows[:, None] * q_stride + cols[None, :],
             _to_e4m3(x * inv[:, None]).to(tl.uint8, bitcast=True), mask=mask)
    tl.store(s_ptr + rows * s_stride + kb, sx, mask=rows < M)


_act_quant_prefill = _unspecialised(_act_quant_kernel, "M")


def act_quant_triton(x, end=None):
    """Triton act_quant_ref for a 2-D bf16 x [M, K] -> (e4m3 [M, K], fp32 [M, ceil(K/128)]). end: None, or an int32
    device tensor whose first entry bounds the rows quantised (the rest stay unwritten; no host sync)."""
    _check_tensor("x", x, torch.bfloat16, ndim=2)
    M, K = x.shape
    kb = _cdiv(K, QBLOCK)
    q = torch.empty(M, K, dtype=torch.uint8, device=x.device)
    s = torch.empty(M, kb, dtype=torch.float32, device=x.device)
    BLOCK_M = 32
    if M > 0:
        (_act_quant_kernel if M <= PREFILL_ROWS else _act_quant_prefill)[(_cdiv(M, BLOCK_M), kb)](
            x, q, s, s if end is None else end, M, K, x.stride(0),
                                                         q.stride(0), s.stride(0), BLOCK_M=BLOCK_M, QBLOCK=QBLOCK,
                                                         HAS_END=end is not None, num_warps=4, **common._pdl())
    return q.view(FP8), s


# The dispatch as a counting sort in two launches (in place of ~14 torch ops around a sort): the slots are cut into
# SEGMENTS segments; program (e, s) of the first counts the slots of segment s whose key (local expert, or E for the
# other ranks' experts) is e; program (e, s) of the second finds its first row from those counts (every key below e,
# then key e in earlier segments) and numbers its slots in slot order. Both grids are fixed by E; N and the segment
# length are unspecialised, so every prefill length shares one compiled pair.
DISPATCH_SEGMENTS = 32


@triton.jit
def _dispatch_key(ids_ptr, s, ok, first_expert, E):
    """The key of slots s: the slot's local expert, or E for another rank's."""
    loc = tl.load(ids_ptr + s, mask=ok, other=0) - first_expert
    return tl.where((loc >= 0) & (loc < E), loc, E)


@triton.jit(do_not_specialize=["N", "SEG"])
def _moe_count_kernel(ids_ptr, cnt_ptr, N, SEG, first_expert, E, SEGMENTS: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    """cnt[e, s] = the slots of segment s (SEG slots from s * SEG) with key e."""
    _pdl_enter(PDL)
    e, seg = tl.program_id(0), tl.program_id(1)
    n = tl.zeros((BLOCK,), dtype=tl.int32)
    for s0 in range(seg * SEG, tl.minimum(seg * SEG + SEG, N), BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        ok = (s < N) & (s < seg * SEG + SEG)
        n += (ok & (_dispatch_key(ids_ptr, s, ok, first_expert, E) == e)).to(tl.int32)
    tl.store(cnt_ptr + e * SEGMENTS + seg, tl.sum(n, axis=0))


@triton.jit(do_not_specialize=["N", "SEG"])
def _moe_place_kernel(ids_ptr, cnt_ptr, row_off_ptr, tok_ptr, inv_ptr, N, SEG, first_expert, E, TOPK: tl.constexpr,
                      SEGMENTS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Rows of the slots of segment s with key e: from row_off[e] (program (e, 0) stores it) plus key e's slots in
    earlier segments, in slot order; tok[row] = the slot's token, inv[slot] = row."""
    _pdl_enter(PDL)
    e, seg = tl.program_id(0), tl.program_id(1)
    ke, ks = tl.arange(0, BLOCK_E)[:, None], tl.arange(0, SEGMENTS)[None, :]
    cnt = tl.load(cnt_ptr + ke * SEGMENTS + ks, mask=ke <= E, other=0)  # [BLOCK_E, SEGMENTS]
    first = tl.sum(tl.sum(tl.where(ke < e, cnt, 0), axis=1), axis=0)
    if seg == 0:
        tl.store(row_off_ptr + e, first)
    row = first + tl.sum(tl.sum(tl.where((ke == e) & (ks < seg), cnt, 0), axis=1), axis=0)
    for s0 in range(seg * SEG, tl.minimum(seg * SEG + SEG, N), BLOCK):
        s = s0 + tl.arange(0, BLOCK)
        ok = (s < N) & (s < seg * SEG + SEG)
        hit = ok & (_dispatch_key(ids_ptr, s, ok, first_expert, E) == e)
        rows = row + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(tok_ptr + rows, (s // TOPK).to(tl.int32), mask=hit)
        tl.store(inv_ptr + s, rows, mask=hit)
        row += tl.sum(hit.to(tl.int32), axis=0)


def moe_dispatch_triton(ids, first_expert, E):
    """Triton moe_dispatch_ref (_moe_count_kernel, _moe_place_kernel): the same three tensors, bit for bit."""
    _check_tensor("ids", ids, torch.int64, ndim=2)
    N, dev = ids.numel(), ids.device
    row_off = torch.empty(E + 1, dtype=torch.int32, device=dev)
    tok, inv = torch.empty(N, dtype=torch.int32, device=dev), torch.empty(N, dtype=torch.int32, device=dev)
    if not N:
        return row_off.zero_(), tok, inv
    cnt = torch.empty(E + 1, DISPATCH_SEGMENTS, dtype=torch.int32, device=dev)
    seg, grid = _cdiv(N, DISPATCH_SEGMENTS), (E + 1, DISPATCH_SEGMENTS)
    _moe_count_kernel[grid](ids, cnt, N, seg, int(first_expert), E, SEGMENTS=DISPATCH_SEGMENTS, BLOCK=1024,
                            num_warps=4, **common._pdl())
    _moe_place_kernel[grid](ids, cnt, row_off, tok, inv, N, seg, int(first_expert), E, TOPK=ids.shape[1],
                            SEGMENTS=DISPATCH_SEGMENTS, BLOCK_E=_pow2(E + 1), BLOCK=1024,
                            num_warps=4, **common._pdl())
    return row_off, tok, inv
