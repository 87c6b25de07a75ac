"""Compute kernels of the Step-5 decoder: the interface model.py calls, each op's pure-PyTorch reference beside it.

model.py calls only the public functions below. Triton kernels run for CUDA tensors unless set_backend(False)
chose the references; CPU tensors always take the `*_ref` PyTorch reference. The references are the numerical
contract: they round to bf16 / e4m3 exactly where the deployed kernels do (those points decide the last bits and,
through DSA region selection and greedy argmax, eventually the tokens), and every kernel is tested against them
(tests/test_kernels.py; speed and real-shape checks: tools.bench_kernels). This file reads top to bottom as that
contract, in model order (norms and RoPE, sliding-window attention, DSA, router and MoE, GEMMs, the TP reduction,
the choose step's logits processing, uniforms and state): each op's reference, then its public dispatcher.
The Triton kernels live in kernels/, one family per module (common: the plumbing and the switches tests flip;
norm_rope, sliding, dsa_index, dsa_attention, moe_route, expert_gemm, experts, linear, choose), each `_name_kernel`
with a `name_triton` launcher that checks shapes, dtypes and contiguity, allocates, builds the grid and launches;
kernels/ never imports this file. The dispatchers pass TUNING's entries to the launchers, whose parameters are named
after them. Region selection is exact too: a counting radix select of the K-th largest key plus one prefix-sum
compaction, bit-identical to the reference's sorts. Decode launches many small kernels: capture the decode step in a
CUDA graph to see the kernel times rather than Triton's Python launch overhead (~50-100 us per launcher call on the
H200 machine).

Shape legend: T tokens, S sequences, G KV/provider groups, Hg heads per group, P indexer proxy dim,
R regions, K selected regions, E experts, F expert width, D hidden, M rows, N out features.
"""
import ast
import glob
import os

import torch

from kernels import choose, common, draft, dsa_attention, dsa_index, experts, linear, moe_route, norm_rope, sliding
from kernels.common import FP8, FP8_MAX, QBLOCK

# This file and the kernels' modules: the sources a compiled kernel depends on (for engine.py's start-up marker).
SOURCE_FILES = (os.path.abspath(__file__),
                *sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels", "*.py"))))

_backend = {"triton": True}


def set_backend(use_triton: bool):
    """Triton kernels (True, the default) or the `*_ref` references (False) for CUDA tensors; CPU tensors always
    take the references."""
    _backend["triton"] = bool(use_triton)


def _triton(x: torch.Tensor) -> bool:
    return _backend["triton"] and x.is_cuda


# Launch choices: the decode step's each the winner of whole steps timed on the H200 (tools.bench_decode --whole-rank
# --candidates re-times the step with the other values), prefill's dense_tiles set from its two kernels' rates
# (tools.bench_prefill --tune sweeps it). The dispatchers below pass them to the launchers in kernels/, whose parameters
# of the same names default to these values (tests/test_kernels.py checks that they agree); an argument passed to a
# launcher overrides them. The numbers behind each value: PERF_LOG.md, "kernel.TUNING, key by key". A tuple's axis
# is named on its line; the decode experts' entries are (T == 1, T > 1) of the decode step's T tokens, each a
# (gate/up kernel, down kernel) pair where both have one.
TUNING = {
    "sliding_warps": (8, 4),  # warps of the sliding decode attention, (grid < SMs, grid >= SMs)
    "sparse_block_n": 64,  # key slots per sparse attention tile
    "dense_tiles": 6.0,  # prefill queries below this many (topk + 1) * blk positions take dense tiles (dense_tiles_end)
    "router_block_e": 32,  # experts per router-logits program
    "router_parts": 4,  # MMA chains over the router logits' one K step
    "router_prefill": (128, 128, 64, 8, 3),  # prefill router logits tile: (rows, experts, K block, warps, stages)
    "moe_block_n": ((32, 64), (64, 128)),  # decode expert tile columns, (T == 1, T > 1) of (gate/up, down)
    "moe_stages": ((3, 3), (4, 3)),  # decode expert pipeline stages, (T == 1, T > 1) of (gate/up, down)
    "moe_unroll": ((4, 1), (1, 1)),  # FP8 decode expert K blocks per iteration, (T == 1, T > 1) of (gate/up, down)
    "moe_maxnreg": ((0, 0), (168, 0)),  # decode expert register caps (0: none), (T == 1, T > 1) of (gate/up, down)
    "moe_tma": ((False, True), (True, True)),  # FP8 decode tiles by TMA (T <= 16), (T == 1, T > 1) of (gate/up, down)
    "moe_early_down": (False, True),  # down programs await only their expert's gate/up tiles, (T == 1, T > 1)
    "shared_parts": (8, 4),  # MMA chains over K of the shared expert's gate/up, (T == 1, T > 1)
    "skinny_tiles": ((32, 256), (16, 512)),  # skinny_linear (columns, K block), (3200 <= N < 6400, N < 3200)
    "skinny_stages": 6,  # skinny_linear pipeline stages at N < 6400
    "skinny_parts": 4,  # skinny_linear MMA chains over K
    "skinny_warps": 4,  # skinny_linear warps
}


def set_tuning(items) -> None:
    """Applies "KEY=VALUE" strings (a Python literal, converted to the default's type) to TUNING; ValueError names a
    bad key or value. The benchmarks' and tools.sass's --tune."""
    for item in items:
        key, _, value = item.partition("=")
        if key not in TUNING:
            raise ValueError(f"--tune {item}: no such choice; kernel.TUNING has {', '.join(TUNING)}")
        try:
            TUNING[key] = type(TUNING[key])(ast.literal_eval(value))
        except (ValueError, SyntaxError, TypeError) as e:
            raise ValueError(f"--tune {item}: {value!r} is not a {type(TUNING[key]).__name__} ({e})") from None


def _tuned(*keys) -> dict:
    """TUNING's entries `keys` as a launcher's keyword arguments (its parameters are named after them)."""
    return {k: TUNING[k] for k in keys}


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32/bf16 -> float8_e4m3fn, round-to-nearest-even, saturating at +-448.

    Overflow is our choice (the deployed code casts without clamping, so its overflow depends on the device):
    saturate. The CUDA cast turns |x| >= 464 into NaN while the CPU cast saturates; clamping first gives one
    answer on both devices and matches Hopper's saturating in-register conversion. Post-norm indexer values sit
    far below 448, so this never fires on sane inputs.
    """
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def prefill_warm_lengths(max_context: int, chunk: int, blk: int, topk: int) -> list:
    """(first position, tokens) of the prefill passes into one cache row that reach every launch variant of a prefill
    of up to max_context positions in chunks of up to `chunk` tokens: 1, 2, 4, 8 and 16 tokens (the specialised
    kernels' integer classes and the decode experts' slot blocks), each power of two above (the launch choices of
    kernels.common._launch_rows), the chunk; then 16, 64 and 256 queries at contexts in each size class of the region
    selection (prefill's tiles of the scores and the selection: dsa_index.indexer_scores_triton and
    select_regions_triton; the first passes' queries select every region and those below dense_tiles_end take
    dense_prefix's tiles, the rest the per-query sparse attention)."""
    top = min(chunk, max_context)
    ns = sorted({n for n in [1 << i for i in range(top.bit_length())] + [top] if n <= top})
    out = [(0, n) for n in ns]
    regions = max_context // blk

    def fits(r):
        return (r + 1) * blk + min(16, top) <= max_context and r < regions
    rs = {topk // 2, 2 * topk, 4096 + 2 * topk, 8192 + 2 * topk, 16384 + 2 * topk, 32768 + 8 * topk}
    end = dense_tiles_end(topk, blk) // blk
    for lo, hi in ((topk + 1, end), (end, regions)):  # the dense tiles over a selection, then the per-query kernel:
        if lo < hi and not any(lo <= r < hi and fits(r) for r in rs):  # a pass at its first history, if none does
            rs.add(lo)
    for r in sorted(rs):
        for n in sorted({min(16, top), min(64, top), min(256, top)}):
            if (r + 1) * blk + n <= max_context and r < regions:
                out.append((r * blk, n))
    return out


# --------------------------------------------------------------------------------------------------
# Norms and RoPE: RMSNorm; per-head norm + partial NEOX RoPE


def rms_norm_ref(x, w, eps, out_dtype=None):
    """Zero-centred RMSNorm over the last dim in fp32: x * rsqrt(mean(x^2) + eps) * (1 + w), one rounding to
    out_dtype (default: x's dtype). x [T, D] fp32 residual or bf16; w [D] fp32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (w + 1.0)
    return y.to(out_dtype or x.dtype)


def rms_norm(x, w, eps, out_dtype=None):
    if _triton(x):
        return norm_rope.rms_norm_triton(x, w, eps, out_dtype)
    return rms_norm_ref(x, w, eps, out_dtype)


def norm_rope_ref(x, weight, cos, sin, eps, bias=None, pos=None):
    """Per-head norm, rounded to bf16, then NEOX RoPE on the leading `2 * cos.shape[-1]` dims.

    x [T, n, d] bf16; weight (and bias) [d] fp32; cos, sin [T, half] bf16 (table rows of each token's position),
    or with pos [T] int64 the whole tables [n_pos, half] (row pos[t] for token t: no gather before the kernel).
    bias None: zero-centred RMSNorm  y = x * rsqrt(mean(x^2) + eps) * (1 + w)      (main q/k, indexer q)
    bias set : LayerNorm with one-pass variance E[x^2] - E[x]^2, y = (x - mu) * rsqrt(var + eps) * w + b  (indexer k)
    The norm output is rounded to bf16 and re-read before the rotation (the deployed kernel materialises it);
    rotation in fp32: first = a*c - b*s (products rounded separately), second = fma(a, s, b*c); each rounded to bf16.
    """
    if pos is not None:
        cos, sin = cos[pos], sin[pos]
    xf = x.float()
    if bias is None:
        ms = (xf * xf).mean(-1, keepdim=True)
        n = ((xf * torch.rsqrt(ms + eps)) * (weight.float() + 1.0)).to(torch.bfloat16)
    else:
        mu = xf.mean(-1, keepdim=True)
        var = (xf * xf).mean(-1, keepdim=True) - mu * mu
        n = ((xf - mu) * torch.rsqrt(var + eps) * weight.float() + bias.float()).to(torch.bfloat16)
    half = cos.shape[-1]
    a, b = n[..., :half].float(), n[..., half:2 * half].float()
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    # a, b, c, s hold bf16 values: each product (8 x 8 significand bits) is exact in fp32, so both sums are rounded
    # once: first = bf(a*c - b*s) with the products rounded separately and second = fma(a, s, b*c), the spec's forms
    # (FMA contraction cannot change either; the exception: a product under fp32's normal range, |a*s| < 1.2e-38)
    first = a * c - b * s
    second = a * s + b * c
    return torch.cat([first.to(torch.bfloat16), second.to(torch.bfloat16), n[..., 2 * half:]], dim=-1)


def norm_rope_jobs(jobs, eps, pos, e4m3=()):
    """[norm_rope_ref(x, weight, cos, sin, eps, bias, pos) for (x, weight, cos, sin, bias) in jobs] (1 to 4 of them,
    all at the positions pos): one launch on the Triton path (a DSA layer's q, k, indexer q and indexer k; the step
    -2.4% against four launches, PERF_LOG "kernel.TUNING, key by key"). e4m3: the indices of jobs whose outputs are
    then rounded to their e4m3 values (as to_e4m3; kept in bf16, which holds them exactly): the indexer's q, which the
    scores read only so (indexer_scores' q_e4m3)."""
    common._check(1 <= len(jobs) <= 4, lambda: f"norm_rope_jobs takes 1 to 4 jobs, got {len(jobs)}")
    if _triton(jobs[0][0]):
        return norm_rope.norm_rope_jobs_triton(jobs, eps, pos, e4m3)
    out = [norm_rope_ref(x, w, c, s_, eps, b, pos) for x, w, c, s_, b in jobs]
    return [to_e4m3(o).to(o.dtype) if i in e4m3 else o for i, o in enumerate(out)]


# --------------------------------------------------------------------------------------------------
# Sliding-window attention: the prefill chunk (banded) and the fused decode step


def banded_attention_ref(q, k, v, off, window, scale):
    """Prefill attention of a query chunk: q [H, n, hd], k, v [G, L, hd] bf16 (H / G query heads per group); query
    i's own key is key off + i and it sees keys (off + i - window, off + i] -> [H, n, hd] bf16. SDPA's math path:
    fp32 logits * scale, fp32 softmax and sum, one rounding."""
    dq = off + torch.arange(q.shape[1], device=q.device)[:, None] - torch.arange(k.shape[1], device=q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=(dq >= 0) & (dq < window), scale=scale,
                                                            enable_gqa=True)


def banded_attention(q, k, v, off, window, scale, gate=None, out=None):
    """banded_attention_ref's attention (q [H, n, hd]), then with gate [n, H] (the bf16 logits) the output gate
    (gate_heads), written into out [H, n, hd] (e.g. a transposed view of the layer's [T, H, hd] output; default new).
    The Triton kernel on the Triton path (8k tokens 0.21 ms against SDPA's math path's 5.78, PERF_LOG "kernel.TUNING,
    key by key"), else the reference in chunks of 2048 queries, so that its [queries, keys] mask and logits stay
    small."""
    if _triton(q):
        return sliding.banded_attention_triton(q, k, v, off, window, scale, gate, out)
    out = torch.empty_like(q) if out is None else out
    for c0 in range(0, q.shape[1], 2048):  # query c0 + i sees keys (off + c0 + i - window, off + c0 + i]
        c1, k0 = min(q.shape[1], c0 + 2048), max(0, off + c0 - window + 1)
        o = banded_attention_ref(q[:, c0:c1], k[:, k0:off + c1], v[:, k0:off + c1], off + c0 - k0, window, scale)
        out[:, c0:c1] = o if gate is None else gate_heads(o.transpose(0, 1), gate[c0:c1]).transpose(0, 1)
    return out


def ring_attention_ref(q, k, v, pos, ring_k, ring_v, window, scale, rows=None):
    """Sliding-window attention of Q = T / B new tokens per ring row (row-major [B, Q]): their keys/values are
    written first, then each query attends to the window of its own position.

    q [T, H, hd], k, v [T, G, hd] bf16; pos [T] int64; ring_k, ring_v [B, G, R, hd] bf16, position p in slot p % R,
    written in place -> [T, H, hd] bf16 (SDPA: fp32 logits * scale, bf16 result). Slot s holds position p - d,
    d = (p - s) mod R: in the window when d < W, written when d <= p. R >= W + Q - 1: a step's later keys never
    overwrite a key an earlier query of the step still sees (the R - W spare slots also hold rows a speculative
    step may roll back). rows [B'] (default: every ring row): the ring row of each of the step's rows."""
    R = ring_k.shape[2]
    rows = torch.arange(ring_k.shape[0], device=q.device) if rows is None else rows
    B = rows.shape[0]
    T, H, hd = q.shape
    Q = T // B
    if R < window + Q - 1:
        raise ValueError(f"a decode step of {Q} tokens per row needs a ring of {window + Q - 1} slots, not {R}")
    tok_rows = rows.repeat_interleave(Q)
    ring_k[tok_rows, :, pos % R] = k
    ring_v[tok_rows, :, pos % R] = v
    p = pos.view(B, Q, 1)
    d = (p - torch.arange(R, device=q.device)) % R
    valid = (d < window) & (d <= p)  # [B, Q, R]
    o = torch.nn.functional.scaled_dot_product_attention(q.view(B, Q, H, hd).transpose(1, 2), ring_k[rows],
                                                         ring_v[rows], attn_mask=valid[:, None], scale=scale,
                                                         enable_gqa=True)  # [B, H, Q, hd]
    return o.transpose(1, 2).reshape(T, H, hd)


def sliding_decode_ref(qkvg, pos, ring_k, ring_v, q_norm_w, k_norm_w, cos, sin, eps, scale, window, n_heads,
                       n_groups, rows=None):
    """A decode step of Q = T / B tokens per ring row (row-major [B, Q]; Q > 1: a speculative verify step) of a
    sliding-window layer, from the packed projection to the gated output.

    qkvg [T, H*hd + 2*G*hd + H] bf16 = [q | k | v | gate logits] (one packed GEMM); pos [T] int64 positions; ring_k,
    ring_v [B, G, R, hd] bf16 (position p in slot p % R, written in place; R >= W + Q - 1); q_norm_w, k_norm_w [hd]
    fp32; cos, sin [n_pos, half] bf16 whole tables (row pos[t] is used). -> o [T, H*hd] bf16, ready for o_proj.
    Exactly model.py's decode path: q, k = norm_rope (bf16), v raw; ring_attention_ref; gate = bf(sigmoid(logit))
    in fp32; o = bf(o * gate).
    """
    T, hd = qkvg.shape[0], ring_k.shape[3]
    H, G = n_heads, n_groups
    q, k, v, gl = qkvg.split([H * hd, G * hd, G * hd, H], dim=-1)
    q = norm_rope_ref(q.view(T, H, hd), q_norm_w, cos, sin, eps, pos=pos)
    k = norm_rope_ref(k.view(T, G, hd), k_norm_w, cos, sin, eps, pos=pos)
    o = ring_attention_ref(q, k, v.view(T, G, hd), pos, ring_k, ring_v, window, scale, rows)  # [T, H, hd]
    gate = torch.sigmoid(gl)  # [T, H] bf16
    return (o * gate[..., None]).reshape(T, H * hd)  # one rounding: the bf16 x bf16 product is exact in fp32


def sliding_decode(qkvg, pos, ring_k, ring_v, q_norm_w, k_norm_w, cos, sin, eps, scale, window, n_heads, n_groups,
                   rows=None):
    if _triton(qkvg):
        return sliding.sliding_decode_triton(qkvg, pos, ring_k, ring_v, q_norm_w, k_norm_w, cos, sin, eps, scale,
                                             window, n_heads, n_groups, rows=rows, **_tuned("sliding_warps"))
    return sliding_decode_ref(qkvg, pos, ring_k, ring_v, q_norm_w, k_norm_w, cos, sin, eps, scale, window,
                              n_heads, n_groups, rows)


# --------------------------------------------------------------------------------------------------
# DSA: region summaries, cache writes, indexer scores, exact top-k region selection, sparse attention


def region_summary_ref(k, z):
    """k, z [N, blk, P] bf16 (one completed region per row) -> e4m3 [N, P].

    Softmax over the region's tokens taken independently per dimension; the single per-region max shift m cancels
    mathematically but is reproduced for the last bits; fp32 -> bf16 -> e4m3 double rounding is required (a direct
    fp32 -> e4m3 cast flips values near e4m3 midpoints, and summaries must match the deployed ones byte for byte).
    """
    zf = z.float()
    m = zf.amax(dim=(1, 2), keepdim=True)  # [N, 1, 1]
    e = torch.exp(zf - m)
    den = e.sum(1)  # [N, P]
    num = (e * k.float()).sum(1)
    s = torch.where(den > 0, num / den.clamp_min(1e-20), torch.zeros_like(num))
    return to_e4m3(s.to(torch.bfloat16))


def region_summary(k, z):
    if _triton(k):
        return dsa_index.region_summary_triton(k, z)
    return region_summary_ref(k, z)


def dsa_cache_write_ref(k, v, ki, zi, pos, ck, cv, pk, pz, summ, rows=None):
    """A DSA decode step's cache writes, in place: token pos[b]'s key/value rows, its indexer key/z as pending row
    pos % blk, and, when that row completes its region, the region's summary (region_summary_ref of the pending
    rows) at region pos // blk; other summaries are untouched.

    k, v [B, G, hd] bf16; ki, zi [B, P] bf16; pos [B] int64; ck, cv [B, cap, G, hd] bf16; pk, pz [B, blk, P] bf16;
    summ [B, R, P] uint8 (e4m3 bytes). rows [B'] (default: every cache row): the cache row of each step row (k, v,
    ki, zi, pos are [B', ...])."""
    blk = pk.shape[1]
    rows = torch.arange(pos.shape[0], device=pos.device) if rows is None else rows
    ck[rows, pos], cv[rows, pos] = k, v
    pk[rows, pos % blk], pz[rows, pos % blk] = ki, zi
    done = (pos % blk == blk - 1)[:, None]
    r = pos // blk
    new = region_summary_ref(pk[rows], pz[rows]).view(torch.uint8)
    summ[rows, r] = torch.where(done, new, summ[rows, r])


def dsa_cache_write(k, v, ki, zi, pos, ck, cv, pk, pz, summ, rows=None):
    if _triton(k):
        return dsa_index.dsa_cache_write_triton(k, v, ki, zi, pos, ck, cv, pk, pz, summ, rows=rows)
    return dsa_cache_write_ref(k, v, ki, zi, pos, ck, cv, pk, pz, summ, rows)


def indexer_scores_ref(q, w, summ, w_scale=1.0, rows=None):
    """q [S, T, G, Hg, P] bf16, w [S, T, G, Hg] bf16 or fp32, summ [S', R, P] e4m3 -> scores [S, G, T, R] fp32;
    rows [S] (default: S' = S, row s): the summaries' row of each of q's rows.

    score = sum over the group's heads, in head order with one fp32 accumulator, of relu(q_h . S_r) * w_h,
    with q rounded to e4m3 (torch cast semantics) before the dot and w_h = f32(w) * w_scale (one fp32 product).
    """
    qf = to_e4m3(q).float()
    summ = summ if rows is None else summ[rows]
    dots = torch.einsum("stghp,srp->sgthr", qf, summ.float())  # [S, G, T, Hg, R]
    wt = (w.float() * w_scale).permute(0, 2, 1, 3)[..., None]  # [S, G, T, Hg, 1]
    acc = torch.zeros_like(dots[:, :, :, 0])
    for h in range(dots.shape[3]):  # sequential over heads, as the kernel accumulates
        acc = acc + dots[:, :, :, h].clamp_min(0) * wt[:, :, :, h]
    return acc


def indexer_scores(q, w, summ, w_scale=1.0, q_e4m3=False, rows=None, n_hist=None, blk=1, prefill=False):
    """q_e4m3: q holds e4m3 values (norm_rope_jobs' e4m3): the Triton kernel skips their rounding (the reference's
    to_e4m3 leaves them as they are). n_hist [S, T] (positions, with blk their region size, as select_regions takes
    them): the kernel skips region tiles past every query of the tile's history, which select_regions never reads
    (the reference computes them all). prefill: indexer_scores_triton's."""
    if _triton(q):
        return dsa_index.indexer_scores_triton(q, w, summ, w_scale, q_e4m3=q_e4m3, rows=rows, n_hist=n_hist, blk=blk,
                                               prefill=prefill)
    return indexer_scores_ref(q, w, summ, w_scale, rows)


def select_regions_ref(scores, n_hist, topk, blk=1):
    """Exact top-k of history regions with the deployed selector's tie-break: equal scores go to the lower region
    id. Ties are common, not a corner case: a score is exactly 0 whenever all of its heads' dots are <= 0 (ReLU).

    scores [S, G, T, R] fp32; n_hist [S, T] int: each query's position p, with blk its region size, so that it has
    floor(p / blk) history regions (blk = 1: n_hist holds those counts).
    Returns ids [S, G, T, K] int64 in ascending region id with invalid slots (budget min(topk, n_hist) exhausted)
    set to R, and valid [S, G, T, K] bool; K = min(topk, R). Order: score descending, ties by ascending id (a
    stable sort of the negated score); +0.0 and -0.0 compare equal (adding +0.0 maps -0.0 to +0.0).
    """
    S, G, T, R = scores.shape
    K = min(topk, R)
    n_hist = n_hist // blk
    # One int64 key per region makes every key distinct and encodes the whole order: high 32 bits = the score's
    # order-preserving integer (sign-magnitude -> two's complement; +0.0 added first so -0.0 == +0.0; NaN above
    # +inf), low 32 bits = ~id so that on equal scores the lower id ranks higher. An unordered top-K of distinct
    # keys then selects exactly the stable-sort prefix, at top-K cost instead of a full sort of R.
    ids = torch.arange(R, device=scores.device)
    cand = ids < n_hist[:, None, :, None]  # [S, 1, T, R]
    b = torch.where(cand, scores + 0.0, float("-inf")).view(torch.int32).long()
    ordered = torch.where(b < 0, -(b & 0x7FFFFFFF) - 1, b)  # monotone in the float value, in [-2^31, 2^31)
    key = ordered * 2 ** 32 + (2 ** 32 - 1 - ids)
    top = torch.topk(key, K, dim=-1, sorted=False).values
    sel = 2 ** 32 - 1 - (top & 0xFFFFFFFF)
    # candidates outrank every masked region, so the budget min(topk, n_hist) is met exactly by the candidates
    valid = sel < n_hist[:, None, :, None]
    return torch.sort(torch.where(valid, sel, R), dim=-1).values, torch.sort(~valid, dim=-1).values.logical_not()


def select_regions(scores, n_hist, topk, blk=1, prefill=False):
    if _triton(scores):
        return dsa_index.select_regions_triton(scores, n_hist, topk, blk, prefill=prefill)
    return select_regions_ref(scores, n_hist, topk, blk)


def dsa_query_chunk(x, groups, regions):
    """Queries per launch of a DSA prefill's scores, selection and sparse attention (model._dsa): 256 for the
    references (sparse_attention_ref gathers every query's selected keys), else as many (a multiple of 256) as keep
    the fp32 scores [groups, queries, regions] within 128 MiB: at 256, each launch's host time exceeded its GPU time."""
    if not _triton(x):
        return 256
    return max(256, (1 << 27) // (4 * groups * max(regions, 1)) // 256 * 256)


def gate_heads(o, gate):
    """The attention's output gate: o [..., heads, hd] bf16 times bf(sigmoid(gate)), gate the bf16 logits, one per
    head (o's heads flattened: [T, H] for o [T, H, hd] or [S*T, G*Hg] for [S, T, G, Hg, hd]); one rounding (the
    bf16 x bf16 product is exact in fp32)."""
    return o * torch.sigmoid(gate).view(*o.shape[:-1], 1)


def sparse_attention_ref(q, k, v, ids, valid, pos, blk, scale, gate=None, rows=None):
    """Attention over the selected history regions plus the current region (gate: then gate_heads).

    q [S, T, G, Hg, hd] bf16; k, v [S, N, G, hd] bf16 (token n of sequence s at row n); ids, valid [S, G, T, K]
    (ascending region ids, as select_regions returns); pos [S, T] absolute positions -> [S, T, G, Hg, hd] bf16.
    rows [S] (default: row s): the cache row of each of q's rows.
    Keys are visited as the kernel visits them: selected regions in ascending id, then the current region
    (tokens blk*floor(p/blk) .. p). Logits fp32 from bf16 q.k, times scale; probabilities exp(s - max) are rounded
    to bf16 before the P.V product (fp32 accumulation); the fp32 row sum divides at the end; result bf16.
    """
    S, T, G, Hg, hd = q.shape
    K = ids.shape[-1]
    off = torch.arange(blk, device=q.device)
    hist = (ids[..., None] * blk + off).flatten(-2)  # [S, G, T, K*blk]
    hist_ok = valid[..., None].expand(S, G, T, K, blk).flatten(-2)
    cur0 = (pos // blk * blk)[:, None, :, None]  # [S, 1, T, 1]
    cur = (cur0 + off).expand(S, G, T, blk)
    cur_ok = cur <= pos[:, None, :, None]
    tok = torch.cat([hist, cur], -1).clamp(max=k.shape[1] - 1)  # [S, G, T, J]
    ok = torch.cat([hist_ok, cur_ok], -1)
    J = tok.shape[-1]
    sidx = (torch.arange(S, device=q.device) if rows is None else rows)[:, None, None, None]
    gidx = torch.arange(G, device=q.device)[None, :, None, None]
    kk, vv = k[sidx, tok, gidx].float(), v[sidx, tok, gidx].float()  # [S, G, T, J, hd]
    qf = q.permute(0, 2, 1, 3, 4).float()  # [S, G, T, Hg, hd]
    s = torch.einsum("sgthd,sgtjd->sgthj", qf, kk) * scale
    s = s.masked_fill(~ok[:, :, :, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    o = torch.einsum("sgthj,sgtjd->sgthd", p.to(torch.bfloat16).float(), vv) / den
    assert J == K * blk + blk
    o = o.to(torch.bfloat16).permute(0, 2, 1, 3, 4)
    return o if gate is None else gate_heads(o, gate)


def sparse_attention(q, k, v, ids, valid, pos, blk, scale, gate=None, rows=None, prefill=False, out=None):
    """sparse_attention_ref (then the gate), written into out (q's shape and strides) when given."""
    if _triton(q):
        return dsa_attention.sparse_attention_triton(q, k, v, ids, valid, pos, blk, scale, gate=gate, rows=rows,
                                                     prefill=prefill, out=out, **_tuned("sparse_block_n"))
    o = sparse_attention_ref(q, k, v, ids, valid, pos, blk, scale, gate, rows)
    return o if out is None else out.copy_(o)


def every_region(pos, G, blk):
    """The selection of every history region for queries at positions pos [S, T], as select_regions_ref returns one:
    ids, valid [S, G, T, K] (ascending ids; K = the most regions any query has, at least 1)."""
    S, T = pos.shape
    n = max(1, int(pos.max()) // blk) if pos.numel() else 1
    ids = torch.arange(n, device=pos.device).expand(S, G, T, n)
    return ids, ids < (pos // blk)[:, None, :, None]


def dense_prefix_ref(q, k, v, p0, blk, scale, gate=None, ids=None, valid=None):
    """sparse_attention_ref of prefill queries q [S, T, G, Hg, hd] at positions p0 .. p0 + T - 1 over k, v [S, N, G,
    hd] -> [S, T, G, Hg, hd] bf16, for the kernel that reads their keys in dense tiles (dense_prefix_triton). ids,
    valid [S, G, T, K]: their selection (select_regions); None: every history region (p // blk <= topk: the spec's
    dense-equivalence regime, STEP5_TEXT 5.7, where no scores or selection are needed). The same keys in the same
    order: the selected history regions ascending, then the current region."""
    S, T, G = q.shape[:3]
    pos = torch.arange(p0, p0 + T, device=q.device).expand(S, T)
    if ids is None:
        ids, valid = every_region(pos, G, blk)
    return sparse_attention_ref(q, k, v, ids, valid, pos, blk, scale, gate)


def dense_prefix(q, k, v, p0, blk, scale, gate=None, ids=None, valid=None, out=None):
    """Attention of prefill queries q [1, T, G, Hg, hd] at positions p0 .. p0 + T - 1 over every history region (ids
    None) or their selection (see dense_prefix_ref), then the output gate (gate [T, G*Hg] logits: gate_heads),
    written into out (like q; default new). The reference in chunks of 256 queries (it gathers every query's keys)."""
    if _triton(q):
        return dsa_attention.dense_prefix_triton(q, k, v, p0, blk, scale, ids, valid, gate, out)
    T = q.shape[1]
    o = torch.cat([dense_prefix_ref(q[:, c:c + 256], k, v, p0 + c, blk, scale,
                                    None if gate is None else gate[c:c + 256],
                                    None if ids is None else ids[:, :, c:c + 256],
                                    None if valid is None else valid[:, :, c:c + 256]) for c in range(0, T, 256)], 1)
    return o if out is None else out.copy_(o)


def dense_tiles_end(topk: int, blk: int) -> int:
    """Prefill queries at positions below this read their selected keys through dense_prefix's tiles, the rest
    through the per-query sparse kernel: a tile of 8 queries x 8 heads loads each history key once for them all but
    computes every history key, so its work grows with the history where the per-query kernel's is (topk + 1) * blk
    keys. TUNING["dense_tiles"] such spans (the two kernels' measured rates: PERF_LOG "kernel.TUNING, key by key")."""
    return int(TUNING["dense_tiles"] * (topk + 1) * blk)


def selected_attention(q, k, v, p0, ids, valid, pos, blk, topk, scale, gate=None, out=None):
    """Prefill queries q [1, T, G, Hg, hd] at positions p0 .. p0 + T - 1 (pos [1, T]) over their selection (ids,
    valid [1, G, T, K] from select_regions) in the cache k, v [1, >= p0 + T, G, hd], then the output gate (gate [T,
    G*Hg] logits), written into out (like q; default new): the queries below dense_tiles_end through dense_prefix's
    tiles, the rest per query (sparse_attention). The split follows the positions only, so a chunked prefill splits
    as a one-shot one does."""
    T = q.shape[1]
    out = torch.empty_like(q) if out is None else out
    cm = min(max(dense_tiles_end(topk, blk) - p0, 0), T)  # queries 0 .. cm - 1: the dense tiles
    if cm:
        dense_prefix(q[:, :cm], k[:, :p0 + cm], v[:, :p0 + cm], p0, blk, scale,
                     gate=None if gate is None else gate[:cm], ids=ids[:, :, :cm], valid=valid[:, :, :cm],
                     out=out[:, :cm])
    if T > cm:
        sparse_attention(q[:, cm:], k, v, ids[:, :, cm:], valid[:, :, cm:], pos[:, cm:], blk, scale,
                         gate=None if gate is None else gate[cm:], prefill=True, out=out[:, cm:])
    return out


# --------------------------------------------------------------------------------------------------
# Router and MoE: routing, SwiGLU, activation quantisation, prefill expert GEMMs, decode experts, combine


def route_ref(x, w, bias, k, scale, renorm=True, ids=None):
    """Sigmoid router with a selection-only bias. x [T, D] bf16, w [E, D] bf16, bias [E] fp32 -> ids [T, k] int64
    (slot 0 = highest biased score), weights [T, k] fp32 = ((sigmoid + b) - b)[ids], renormalised (+1e-20), * scale.
    Given `ids` [T, k] (a pinned choice, see model.Pins), only the weights of those experts are computed."""
    # fp64 evaluation, rounded once to fp32: a row's routing must not depend on its batch or position (an fp32 BLAS
    # GEMM blocks its reduction by batch shape, and the CPU's vectorised fp32 sigmoid differs from its scalar path
    # in the last bit); fp64 then one rounding gives the correctly rounded fp32 value on any path
    z = (x.double() @ w.double().t()).float()
    sc = torch.sigmoid(z.double()).float() + bias
    if ids is None:
        top, ids = torch.topk(sc, k, dim=-1)
    else:
        top = sc.gather(-1, ids)
    wts = top - bias[ids]
    if renorm:
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
    return ids, wts * scale


def route(x, w, bias, k, scale, renorm=True, quant=False):
    """-> (ids, weights, xq): xq = act_quant_ref(x) when quant on the Triton path, else None (moe_experts then
    quantises x itself)."""
    if not _triton(x):
        return (*route_ref(x, w, bias, k, scale, renorm), None)
    tuned = _tuned("router_block_e", "router_parts", "router_prefill")
    if quant:
        return moe_route.route_triton(x, w, bias, k, scale, renorm, quant=True, **tuned)
    return (*moe_route.route_triton(x, w, bias, k, scale, renorm, **tuned), None)


def swiglu_ref(g, u, limit):
    """Clamped SwiGLU: bf( min(silu(g), L) * clamp(u, -L, L) ) in fp32 with one rounding; limit None = no clamp."""
    gf, uf = g.float(), u.float()
    a = torch.nn.functional.silu(gf)
    if limit is not None:
        a, uf = a.clamp(max=limit), uf.clamp(-limit, limit)
    return (a * uf).to(torch.bfloat16)


def swiglu(g, u, limit):
    if _triton(g):
        return moe_route.swiglu_triton(g, u, limit)
    return swiglu_ref(g, u, limit)


def act_quant_ref(x):
    """x [..., K] bf16 -> (e4m3 [..., K], scale fp32 [..., ceil(K/128)]): per row, per 128-wide K block.

    amax floored at 1e-10 (the deployed floor), scale = amax * (1/448), q = e4m3(clamp(x * (1/scale), -448, 448)).
    """
    K = x.shape[-1]
    kb = -(-K // QBLOCK)
    xf = torch.nn.functional.pad(x.float(), (0, kb * QBLOCK - K)).unflatten(-1, (kb, QBLOCK))
    amax = xf.abs().amax(-1).clamp_min(1e-10)
    sx = amax * (1.0 / FP8_MAX)
    q = (xf * (1.0 / sx)[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.flatten(-2)[..., :K], sx


def moe_dispatch_ref(ids, first_expert, E):
    """Prefill's MoE dispatch: the T*k (token, slot) pairs of ids [T, k] int64 sorted by local expert, stably (slot
    order within an expert), slots of other ranks' experts last -> (row_off [E+1] int32: expert e owns sorted rows
    row_off[e] .. row_off[e+1]-1, so row_off[E] rows are local; tok [T*k] int32: the token of each sorted row;
    inv [T*k] int32: the sorted row of each flat slot t*k + j)."""
    loc = ids.flatten() - first_expert
    key = torch.where((loc >= 0) & (loc < E), loc, E)
    order = torch.sort(key, stable=True)[1]  # sorted row -> flat slot
    row_off = torch.searchsorted(key[order], torch.arange(E + 1, device=ids.device), out_int32=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=ids.device)
    return row_off, (order // ids.shape[1]).to(torch.int32), inv.to(torch.int32)


# The routed experts (and the shared one): the reference and the dispatcher. The Triton path (kernels/experts.py)
# takes the sort-free decode kernels for decode's few (token, slot) pairs, else prefill's grouped GEMMs over rows
# sorted by expert (kernels/expert_gemm.py).


def moe_experts_ref(x, ids, weights, w1, w3, w2, s1, s3, s2, limit, first_expert=0, shared=None):
    """One rank's routed experts and their weighted combine, optionally plus the shared expert.

    x [T, D] bf16; ids [T, k] int64 expert ids: slot (t, j) is local iff first_expert <= ids[t, j] < first_expert + E
    (E = w1.shape[0]) and then runs local expert ids - first_expert (global ids with this rank's first expert, or
    local ids with -1 for remote and first_expert 0); weights [T, k] fp32;
    w1 (gate), w3 (up) [E, F, D], w2 (down) [E, D, F] (e4m3 with scale grids s*, or bf16 with s* None).
    Returns [T, D] bf16 = bf( sum over local slots 0..k-1 in order, one fp32 accumulator, of f32(expert_out) * w ).
    shared = (wg, wu, wd, limit_s), bf16 wg, wu [Fs, D], wd [D, Fs]: the shared expert s = model.MLP's
    bf(bf(swiglu(bf(x.wg^T), bf(x.wu^T))) . wd^T), and the result is fp32 [T, D] = f32(routed) + f32(s) (what
    model.Block adds before its fp32 TP reduction).
    Reference formulation: every local expert runs every token as one batched GEMM (static shapes, no host sync,
    no per-expert Python branching); the kernel computes only the routed rows.
    """
    E = w1.shape[0]
    xe = x.unsqueeze(0).expand(E, *x.shape)  # [E, T, D]
    a = swiglu_ref(_expert_linear_ref(xe, w1, s1), _expert_linear_ref(xe, w3, s3), limit)  # [E, T, F]
    y = _expert_linear_ref(a, w2, s2)  # [E, T, D]
    T = x.shape[0]
    loc = ids - first_expert
    local = (loc >= 0) & (loc < E)
    rows = y[loc.clamp(0, E - 1), torch.arange(T, device=x.device)[:, None]]  # [T, k, D]
    contrib = torch.where(local[..., None], rows.float(), 0.0)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(ids.shape[1]):  # slot order, sequential fp32 accumulation
        acc = acc + contrib[:, j] * weights[:, j, None]
    out = acc.to(torch.bfloat16)
    return out if shared is None else out.float() + experts.shared_expert(x, shared, swiglu_ref).float()


def _expert_linear_ref(x, w, s):
    """x [E, M, K] bf16 through each expert's weight w [E, N, K] (e4m3 with scales s, or bf16 when s is None)."""
    if s is not None:
        return fp8_gemm_ref(x, w, s)
    return torch.bmm(x, w.transpose(1, 2))  # bf16 operands, fp32 accumulation, one bf16 rounding


def moe_experts(x, ids, weights, w1, w3, w2, s1, s3, s2, limit, first_expert=0, shared=None, xq=None):
    if _triton(x):
        return experts.moe_experts_triton(x, ids, weights, w1, w3, w2, s1, s3, s2, limit, first_expert, shared, xq,
                                          **_tuned("moe_block_n", "moe_stages", "moe_unroll", "moe_maxnreg", "moe_tma",
                                                   "moe_early_down", "shared_parts"))
    return moe_experts_ref(x, ids, weights, w1, w3, w2, s1, s3, s2, limit, first_expert, shared)


# --------------------------------------------------------------------------------------------------
# GEMMs: the few-row bf16 projections (decode), the FP8 block-scaled GEMM's reference


def fp8_gemm_ref(x, w, sw):
    """Block-scaled FP8 GEMM, batched over a leading expert dim.

    x [E, M, K] bf16 (activations, quantised here), w [E, N, K] e4m3, sw [E, ceil(N/128), ceil(K/128)] fp32
    -> [E, M, N] bf16. acc = sum over K blocks, in block order, of (fp32 dot of the e4m3 block) * sx * sw.
    """
    E, M, K = x.shape
    N = w.shape[1]
    xq, sx = act_quant_ref(x)  # [E, M, K], [E, M, kb]
    swn = sw.repeat_interleave(QBLOCK, dim=1)[:, :N]  # [E, N, kb]
    acc = torch.zeros(E, M, N, dtype=torch.float32, device=x.device)
    for b in range(sx.shape[-1]):
        ks = slice(b * QBLOCK, min(K, (b + 1) * QBLOCK))
        dot = torch.bmm(xq[..., ks].float(), w[..., ks].float().transpose(1, 2))  # [E, M, N]
        acc = acc + dot * sx[..., b:b + 1] * swn[:, None, :, b]
    return acc.to(torch.bfloat16)


def skinny_linear_ref(x, w):
    """x [M, K] bf16, w [N, K] bf16 -> [M, N] bf16: bf16 products, fp32 accumulation, one rounding (F.linear)."""
    return torch.nn.functional.linear(x, w)


def skinny_linear(x, w):
    """x . w^T at <= 16 rows through the Triton kernel, else F.linear: every decode projection (model.linear; the
    whole step -1.1% / -2.3% at batch 1 / 16 against cuBLAS, PERF_LOG "kernel.TUNING, key by key")."""
    if _triton(x) and x.shape[0] <= 16:
        return linear.skinny_linear_triton(x, w, **_tuned("skinny_tiles", "skinny_stages", "skinny_parts",
                                                          "skinny_warps"))
    return skinny_linear_ref(x, w)


# --------------------------------------------------------------------------------------------------
# The TP reduction: rank-ordered sum, residual add and the next norm (and a one-shot form over peer memory)


def add_norm_ref(res, parts, w, eps):
    """The residual update of a layer, with the next norm: y = bf( rank-ordered fp32 sum of parts ) (the TP sum,
    rounded once to the partials' dtype), res' = res + f32(y), h = rms_norm_ref(res', w) in bf16.

    res [T, D] fp32; parts [W, T, D] bf16 or fp32 (this rank's and the other ranks' partials, rank order); w [D]
    fp32 or None (no norm). Returns (res' [T, D] fp32, h [T, D] bf16 or None)."""
    acc = parts[0].float()
    for r in range(1, parts.shape[0]):
        acc = acc + parts[r].float()
    res = res + acc.to(parts.dtype).float()
    return res, None if w is None else rms_norm_ref(res, w, eps, torch.bfloat16)


def add_norm(res, parts, w, eps):
    if _triton(res):
        return linear.add_norm_triton(res, parts, w, eps)
    return add_norm_ref(res, parts, w, eps)


def peer_add_norm_triton(res, bufs, pads, rank, parts_dtype, w, eps, slot_off=0, flag_off=0):
    """add_norm_ref(res, [every rank's partial row], w, eps) with the partials read from the W ranks' symmetric-memory
    buffers over NVLink: the one-shot TP reduction (model.OneShotReduce, opt-in), on the Triton path only (peer
    memory; linear.peer_add_norm_triton has the protocol)."""
    return linear.peer_add_norm_triton(res, bufs, pads, rank, parts_dtype, w, eps, slot_off, flag_off)


# --------------------------------------------------------------------------------------------------
# The choose step: a row's logits processed by its request's penalties, grammar mask and reasoning budget; the draws'
# counter-based uniforms; the requests' state advanced by their tokens


def unpack_mask(mask: torch.Tensor, V: int) -> torch.Tensor:
    """Bitmask rows [N, ceil(V/32)] int32 (bit j of word w: token 32 w + j) -> allowed [N, V] bool."""
    bits = (mask[:, :, None] >> torch.arange(32, dtype=torch.int32, device=mask.device)) & 1
    return bits.flatten(1)[:, :V].bool()


def process_logits_ref(x, slots, counts, mask, thinking, left, repetition, frequency, presence, prompt, masked,
                       think_end):
    """Logits [N, V] fp32 (the logit bias added) of rows on `slots` [N] -> processed [N, V] fp32, in order: the
    repetition penalty over the tokens seen (counts [N, V] int32 > 0) or in the prompt (prompt [B, V] bool by slot),
    frequency and presence penalties over the counts, the grammar's bitmask (mask [N, ceil(V/32)] int32, read where
    masked [B] bool by slot) to -inf, and a spent reasoning budget (thinking [N] bool and left [N] int64 tokens: left
    <= 0 while thinking) leaving only think_end [B] by slot. Per-slot parameters [B]: repetition, frequency,
    presence fp32."""
    seen = counts > 0
    r = repetition[slots][:, None]
    x = torch.where(seen | prompt[slots], torch.where(x > 0, x / r, x * r), x)
    x = x - frequency[slots][:, None] * counts - presence[slots][:, None] * seen
    x = x.masked_fill(~unpack_mask(mask, x.shape[1]) & masked[slots][:, None], float("-inf"))
    forced = thinking & (left <= 0)
    only = torch.arange(x.shape[1], device=x.device)[None, :] == think_end[slots][:, None]
    return torch.where(forced[:, None], torch.where(only, 0.0, float("-inf")), x)


def process_logits(x, slots, counts, mask, thinking, left, repetition, frequency, presence, prompt, masked,
                   think_end):
    """process_logits_ref in one launch for CUDA tensors (in place on x)."""
    if _triton(x):
        return choose.process_logits_triton(x, slots, counts, mask, thinking, left, repetition, frequency, presence,
                                            prompt, masked, think_end)
    return process_logits_ref(x, slots, counts, mask, thinking, left, repetition, frequency, presence, prompt,
                              masked, think_end)


# splitmix64's constants as signed int64 (torch's int64 arithmetic wraps like uint64)
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    return (z >> k) & ((1 << (64 - k)) - 1)  # a logical right shift of int64


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def uniform_ref(seeds: torch.Tensor, counters: torch.Tensor, n: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1): [B] seeds, [B] counters -> [B, n] fp32, a pure function of (seed, counter,
    column): no generator state, so a request's draws do not depend on its batch, and the step is replayable as a
    CUDA graph. splitmix64 of (mix(seed) + counter) and of that plus each column."""
    base = _mix(_mix(seeds * _GOLDEN) + counters)  # [B]
    z = _mix(base[:, None] + (torch.arange(n, device=seeds.device) + 1) * _GOLDEN)
    return ((_srl(z, 40) & 0xFFFFFF).float() + 0.5) * 2.0 ** -24


def uniform(seeds: torch.Tensor, counters: torch.Tensor, n: int) -> torch.Tensor:
    """uniform_ref in one launch for CUDA tensors."""
    if _triton(seeds):
        return choose.uniform_triton(seeds, counters, n)
    return uniform_ref(seeds, counters, n)


def advance_ref(counts, thinking, left, think_end, slots, toks, emitted):
    """In place: the per-slot state of rows on `slots` [N] after emitting toks [N, P] where emitted [N, P] bool (in
    order): the output counts [B, V] int32, and the reasoning state, thinking [B] bool and left [B] int64 (tokens
    spent while reasoning, the end of reasoning think_end [B] included; the end ends it)."""
    t = toks.clamp(min=0)
    counts.index_put_((slots[:, None].expand_as(t), t), emitted.int(), accumulate=True)  # N * P entries, not [N, V]
    ends = ((t == think_end[slots][:, None]) & emitted).long()  # [N, P]
    was = thinking[slots][:, None] & (ends.cumsum(1) - ends == 0)  # reasoning before token j
    left[slots] -= (was & emitted).sum(1)
    thinking[slots] &= ~ends.bool().any(1)


def advance(counts, thinking, left, think_end, slots, toks, emitted):
    """advance_ref in one launch for CUDA tensors."""
    if _triton(counts):
        return choose.advance_triton(counts, thinking, left, think_end, slots, toks, emitted)
    return advance_ref(counts, thinking, left, think_end, slots, toks, emitted)


# --------------------------------------------------------------------------------------------------
# The draft step: an MTP depth's input rows


def draft_rows_ref(slots, last, ring_tok, out, lengths, j: int, k: int):
    """Depth j of k drafts, for requests on `slots` [R] whose last kept position is last [R]: its q = k + 1 + j rows
    are positions first .. first + q - 1 (first = max(last - k - j, 0)), each reading the token after its position:
    the ring's ring_tok [B, S] while final (up to last + 1), else this step's drafts so far, out [R, k]. -> (those
    tokens [R, q], the rows' ring slots (position mod S) [R, q], the head's row of each request (position last, in
    the [R * q] rows) [R]); lengths [B] (the depth's cache) set to first on the slots."""
    S = ring_tok.shape[1]
    R, q = slots.shape[0], k + 1 + j
    first = (last - k - j).clamp(min=0)
    pos = first[:, None] + torch.arange(q, device=slots.device)  # [R, q]
    t = pos + j + 1
    i = (t - last[:, None] - 2).clamp(0, k - 1)
    r = torch.arange(R, device=slots.device)
    tok = torch.where(t <= last[:, None] + 1, ring_tok[slots[:, None], t % S], out[r[:, None], i])
    lengths[slots] = first
    return tok, pos % S, r * q + last - first


def draft_rows(slots, last, ring_tok, out, lengths, j: int, k: int):
    """draft_rows_ref in one launch for CUDA tensors."""
    if _triton(ring_tok):
        return draft.draft_rows_triton(slots, last, ring_tok, out, lengths, j, k)
    return draft_rows_ref(slots, last, ring_tok, out, lengths, j, k)
