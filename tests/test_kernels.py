"""Every Triton kernel of kernel.py against its PyTorch reference, on identical inputs.

CPU CI: the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) at tiny shapes; there the interpreter computes
in fp32 with the integer rounding helpers, so most kernels are bit-exact and are asserted so. On a GPU
(`TRITON_INTERPRET=0 pytest tests/test_kernels.py`) the same tests run on CUDA with the GPU tolerances below, plus
the real-shape tests at the end (skipped without CUDA).
"""
import os

import pytest
import torch

import kernel as K

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAVE_CUDA = torch.cuda.is_available()
if not INTERPRET and not HAVE_CUDA:
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)
DEV = "cpu" if INTERPRET else "cuda"
gpu = pytest.mark.skipif(INTERPRET or not HAVE_CUDA, reason="real-shape checks need a CUDA GPU (TRITON_INTERPRET=0)")


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(*shape, seed=0, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype).to(DEV)


def report(name, out, ref):
    d = (out.float() - ref.float()).abs()
    print(f"{name}: max diff {d.max().item():.3g}, mean {d.mean().item():.3g}, ref max {ref.float().abs().max():.3g}")
    return d


def bytes_equal(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def fp8_weights(E, N, Kd, seed):
    """Random e4m3 expert weights [E, N, Kd] with a random 128x128 scale grid."""
    w = torch.randn(E, N, Kd, generator=_gen(seed)) * 0.05
    s = torch.rand(E, -(-N // 128), -(-Kd // 128), generator=_gen(seed + 1)) * 1e-3 + 1e-4
    full = s.repeat_interleave(128, 1)[:, :N].repeat_interleave(128, 2)[:, :, :Kd]
    return K.to_e4m3(w / full).to(DEV), s.to(DEV)


# ---------------------------------------------------------------------------------------------------------------
# exact conversions


def test_e4m3_and_bf16_helpers_match_torch_casts():
    import triton
    import triton.language as tl

    @triton.jit
    def cast_kernel(x_ptr, q_ptr, b_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(q_ptr + offs, K._e4m3_bits(x), mask=offs < n)
        tl.store(b_ptr + offs, K._bf16_round(x).to(tl.bfloat16), mask=offs < n)

    codes = torch.arange(256, dtype=torch.uint8).view(K.FP8).float()
    codes = codes[~codes.isnan()].sort().values
    mids = (codes[1:] + codes[:-1]) / 2  # rounding ties, and their neighbours
    g = _gen(1)
    x = torch.cat([codes, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)),
                   torch.randn(50000, generator=g) * torch.exp2(torch.randint(-14, 12, (50000,), generator=g)),
                   torch.tensor([500.0, -1000.0, 448.5, 464.0, -0.0, 1e-30])]).to(DEV)
    q = torch.empty(x.shape, dtype=torch.uint8, device=DEV)
    b = torch.empty(x.shape, dtype=torch.bfloat16, device=DEV)
    cast_kernel[(triton.cdiv(x.numel(), 16384),)](x, q, b, x.numel(), BLOCK=16384)
    assert torch.equal(q, K.to_e4m3(x).view(torch.uint8))
    assert torch.equal(b.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("M,Kd", [(1, 128), (5, 192), (33, 300)])
def test_act_quant_bit_exact(M, Kd):
    x = randn(M, Kd, seed=M, scale=3.0)
    x[0, :7] = 0  # an all-small block start; a zero row block exercises the 1e-10 floor below
    if Kd > 256:
        x[1, 256:] = 0
    q, s = K.act_quant_triton(x)
    qr, sr = K.act_quant_ref(x)
    assert bytes_equal(q, qr)
    assert torch.equal(s, sr)


# ---------------------------------------------------------------------------------------------------------------
# routed experts


def _moe_case(T, D, F, E, k, fp8, seed):
    x = randn(T, D, seed=seed)
    g = _gen(seed + 7)
    ids = torch.stack([torch.randperm(E + 2, generator=g)[:k] for _ in range(T)])
    ids = torch.where(ids >= E, -1, ids)  # slots routed to other ranks
    ids = torch.where(ids == 1, -1, ids)  # expert 1 receives no rows
    wts = torch.rand(T, k, generator=g)
    if fp8:
        (w1, s1), (w3, s3), (w2, s2) = fp8_weights(E, F, D, seed), fp8_weights(E, F, D, seed + 2), \
            fp8_weights(E, D, F, seed + 4)
    else:
        w1, w3, w2 = (randn(E, F, D, seed=seed, scale=0.05), randn(E, F, D, seed=seed + 2, scale=0.05),
                      randn(E, D, F, seed=seed + 4, scale=0.05))
        s1 = s3 = s2 = None
    return x, ids.to(DEV), wts.to(DEV), w1, w3, w2, s1, s3, s2


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("T,D,F,E,k", [(1, 128, 64, 3, 2), (5, 192, 160, 4, 3), (24, 256, 96, 6, 4)])
def test_moe_experts_matches_dense_reference(fp8, T, D, F, E, k):
    args = _moe_case(T, D, F, E, k, fp8, seed=T)
    out = K.moe_experts_triton(*args, 7.0)
    ref = K.moe_experts_ref(*args, 7.0)
    d = report(f"moe fp8={fp8}", out, ref)
    if INTERPRET:
        assert torch.equal(out, ref)
    else:  # different fp32 summation order inside the MMA (and fp8 MMA accumulation): a few bf16 steps at most
        assert d.max() <= 2e-2 * ref.float().abs().max()


def test_grouped_gemm_fp8_ragged_k_and_partial_n():
    """One launch over experts with 0, 1 and many rows, K=192 (half a scale block), N=200 (not a multiple of 64)."""
    E, N, Kd = 3, 200, 192
    counts = [0, 1, 37]
    x = randn(sum(counts), Kd, seed=3, scale=2.0)
    w, sw = fp8_weights(E, N, Kd, seed=5)
    row_off = torch.tensor([0, 0, 1, 38], dtype=torch.int32, device=DEV)
    xq, sx = K.act_quant_triton(x)
    out = K.grouped_gemm_triton(xq, sx, w, sw, row_off)
    ref = torch.cat([K.fp8_gemm_ref(x[row_off[e]:row_off[e + 1]][None], w[e:e + 1], sw[e:e + 1])[0]
                     for e in range(E)])
    d = report("grouped fp8 gemm", out, ref)
    assert torch.equal(out, ref) if INTERPRET else d.max() <= 2e-2 * ref.float().abs().max()


def _moe_decode_case(T, k, E, first, fp8, shared, seed, D=192, F=160, Fs=48):
    """This rank owns global experts first .. first+E-1. Every token routes to local expert 0 (in slot t % k, so
    its rows come from varied slot positions), the other slots draw distinct ids from remote ids on both sides of
    the range and local experts 2.. (local expert 1 is hit by nobody). shared: None, or the shared expert's clamp
    (a float, or True for none) -> (wg, wu, wd, limit_s) bf16."""
    x, _, wts, w1, w3, w2, s1, s3, s2 = _moe_case(T, D, F, E, k, fp8, seed)
    g = _gen(seed + 11)
    pool = torch.arange(max(first - 3, 0), first + E + 3)
    pool = pool[(pool != first) & (pool != first + 1)]
    ids = torch.stack([pool[torch.randperm(pool.numel(), generator=g)[:k]] for _ in range(T)])
    ids[torch.arange(T), torch.arange(T) % k] = first
    sh = None
    if shared is not None:
        sh = (randn(Fs, D, seed=seed + 20, scale=0.05), randn(Fs, D, seed=seed + 21, scale=0.05),
              randn(D, Fs, seed=seed + 22, scale=0.05), None if shared is True else shared)
    return (x, ids.to(DEV), wts, w1, w3, w2, s1, s3, s2), sh


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("T,k,E,first,shared,limit", [
    (1, 4, 4, 0, None, 7.0),     # one token, ids of rank 0 (remote ones above the range)
    (3, 3, 5, 10, 5.0, 7.0),     # global ids of a later rank, shared expert with its own clamp
    (3, 2, 4, 4, True, None),    # no clamp anywhere
    (17, 2, 3, 3, 5.0, 7.0),     # 17 rows on one expert: two 16-row chunks (routed and shared)
])
def test_moe_decode_matches_reference(fp8, T, k, E, first, shared, limit):
    """The sort-free decode path, and the sorted path with the same arguments, against moe_experts_ref."""
    args, sh = _moe_decode_case(T, k, E, first, fp8, shared, seed=T + 3 * k)
    ref = K.moe_experts_ref(*args, limit, first, sh)
    assert ref.dtype == (torch.float32 if sh else torch.bfloat16)
    for path, kw in ((K.moe_experts_decode_triton, {}), (K.moe_experts_decode_triton, {"prequant": True}),
                     (K.moe_experts_sorted_triton, {})):
        out = path(*args, limit, first, sh, **kw)
        d = report(f"moe {path.__name__} {kw} fp8={fp8}", out, ref)
        assert out.dtype == ref.dtype
        assert torch.equal(out, ref) if INTERPRET else d.max() <= 2e-2 * ref.float().abs().max()


def test_moe_decode_local_ids():
    """Local ids with -1 for remote slots (first_expert 0, the pre-existing convention) through the dispatcher."""
    args = _moe_case(3, 128, 64, 3, 2, True, seed=4)
    out = K.moe_experts_triton(*args, 7.0)
    ref = K.moe_experts_ref(*args, 7.0)
    d = report("moe decode local ids", out, ref)
    assert torch.equal(out, ref) if INTERPRET else d.max() <= 2e-2 * ref.float().abs().max()


def test_quant_rows_matches_act_quant():
    """The decode kernels' on-load 1x128 quantisation (the GPU's saturating RNE convert, or _e4m3_bits under the
    interpreter) gives act_quant_ref's bytes and scales, on ties, subnormals, saturation and an all-zero block."""
    import triton
    import triton.language as tl

    @triton.jit
    def quant_kernel(x_ptr, q_ptr, s_ptr, HW_CAST: tl.constexpr):
        r, c = tl.arange(0, 16), tl.arange(0, 128)
        q, s = K._quant_rows(tl.load(x_ptr + r[:, None] * 128 + c[None, :]).to(tl.float32), HW_CAST)
        tl.store(q_ptr + r[:, None] * 128 + c[None, :], q.to(tl.uint8, bitcast=True))
        tl.store(s_ptr + r, s)

    codes = torch.arange(256, dtype=torch.uint8).view(K.FP8).float()
    codes = codes[~codes.isnan()].sort().values
    x = torch.randn(16, 128, generator=_gen(5)) * torch.exp2(torch.randint(-20, 10, (16, 1), generator=_gen(6)))
    x[0, :126] = codes[codes > 0]  # amax 448: scale 1, every positive code
    x[1, :127] = ((codes[1:] + codes[:-1]) / 2)[:127]  # e4m3 midpoints (rounding ties), scale 1
    x[1, 127] = 448.0
    x[2] = 0.0  # 1e-10 floor
    x = x.bfloat16().to(DEV)
    q = torch.empty(16, 128, dtype=torch.uint8, device=DEV)
    s = torch.empty(16, dtype=torch.float32, device=DEV)
    quant_kernel[(1,)](x, q, s, HW_CAST=not INTERPRET)
    qr, sr = K.act_quant_ref(x)
    assert bytes_equal(q, qr) and torch.equal(s, sr[:, 0])


def test_launchers_reject_bad_inputs():
    x = randn(4, 128, seed=0)
    with pytest.raises(ValueError, match="bfloat16"):
        K.act_quant_triton(x.float())
    with pytest.raises(ValueError, match="contiguous"):
        K.act_quant_triton(randn(128, 4, seed=0).t())
    w, sw = fp8_weights(2, 64, 128, seed=0)
    xq, sx = K.act_quant_triton(x)
    with pytest.raises(ValueError, match="sw must be"):
        K.grouped_gemm_triton(xq, sx, w, sw[:, :, :0], torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="ids"):
        K.moe_experts_triton(x, torch.zeros(3, 2, dtype=torch.int64, device=DEV),
                             torch.zeros(3, 2, device=DEV), w, w, w, sw, sw, sw, 7.0)


@pytest.mark.parametrize("limit", [7.0, None])
def test_swiglu(limit):
    g, u = randn(3, 100, seed=1, scale=4.0), randn(3, 100, seed=2, scale=4.0)
    out = K.swiglu_triton(g, u, limit)
    ref = K.swiglu_ref(g, u, limit)
    d = report("swiglu", out, ref)
    assert torch.equal(out, ref) if INTERPRET else d.max() <= 1e-2 * ref.float().abs().max()


# ---------------------------------------------------------------------------------------------------------------
# norm + RoPE


@pytest.mark.parametrize("T,n,D,half,layernorm", [
    (3, 4, 192, 32, False),   # full-attention q/k: span 64
    (2, 3, 192, 96, False),   # sliding q/k: span 192, nothing left unrotated
    (5, 1, 256, 16, True),    # indexer k: LayerNorm with bias, span 32
    (1, 2, 48, 8, False),     # T = 1, odd head dim
])
def test_norm_rope(T, n, D, half, layernorm):
    x = randn(T, n, D, seed=T, scale=3.0)
    w = randn(D, seed=1, scale=0.2, dtype=torch.float32)
    b = randn(D, seed=2, scale=0.1, dtype=torch.float32) if layernorm else None
    ang = torch.rand(T, half, generator=_gen(3)) * 6
    cos, sin = ang.cos().bfloat16().to(DEV), ang.sin().bfloat16().to(DEV)
    out = K.norm_rope_triton(x, w, cos, sin, 1e-5, b)
    ref = K.norm_rope_ref(x, w, cos, sin, 1e-5, b)
    d = report("norm_rope", out, ref)
    if INTERPRET:
        assert torch.equal(out, ref)
    else:  # fp32 sum order of mean(x^2) differs: rarely one bf16 step
        assert (d > 0).float().mean() < 0.02 and d.max() <= 2 ** -6 * ref.float().abs().max()


@pytest.mark.parametrize("T,D,src,out", [(1, 256, torch.float32, torch.bfloat16), (5, 200, torch.float32, torch.bfloat16),
                                          (3, 256, torch.bfloat16, torch.bfloat16), (2, 96, torch.float32, torch.float32)])
def test_rms_norm(T, D, src, out):
    x = randn(T, D, seed=T, scale=3.0, dtype=src)
    w = randn(D, seed=1, scale=0.2, dtype=torch.float32)
    got = K.rms_norm_triton(x, w, 1e-5, out)
    ref = K.rms_norm_ref(x, w, 1e-5, out)
    assert got.dtype == ref.dtype == out
    d = report("rms_norm", got, ref)
    # the fp32 sum of squares is reduced in another order than torch's mean: last fp32 bit, so at most one
    # rounding step of the output on a few elements
    step = 2 ** -7 if out == torch.bfloat16 else 2 ** -22
    assert (d > 0).float().mean() < 0.05 and d.max() <= step * ref.float().abs().max()


def test_norm_rope_token_strided_input():
    """q and k arrive as column slices of the packed QKV output: heads contiguous, tokens strided."""
    T, n, D, half = 4, 3, 48, 8
    packed = randn(T, (n + 2) * D, seed=9, scale=2.0)
    x = packed[:, D:(n + 1) * D].view(T, n, D)
    assert not x.is_contiguous()
    w = randn(D, seed=1, scale=0.2, dtype=torch.float32)
    ang = torch.rand(T, half, generator=_gen(3)) * 6
    cos, sin = ang.cos().bfloat16().to(DEV), ang.sin().bfloat16().to(DEV)
    out = K.norm_rope_triton(x, w, cos, sin, 1e-5)
    ref = K.norm_rope_ref(x.contiguous(), w, cos, sin, 1e-5)
    d = report("norm_rope strided", out, ref)
    if INTERPRET:
        assert torch.equal(out, ref)
    else:
        assert (d > 0).float().mean() < 0.02 and d.max() <= 2 ** -6 * ref.float().abs().max()


# ---------------------------------------------------------------------------------------------------------------
# DSA: summaries, scores, selection, attention


@pytest.mark.parametrize("N,blk,P", [(7, 8, 64), (3, 8, 48), (1, 4, 256)])
def test_region_summary_bytes(N, blk, P):
    k = randn(N, blk, P, seed=N)
    z = randn(N, blk, P, seed=N + 1, scale=3.0)
    out = K.region_summary_triton(k, z)
    ref = K.region_summary_ref(k, z)
    assert out.dtype == K.FP8 and bytes_equal(out, ref)


@pytest.mark.parametrize("S,T,G,Hg,P,R", [(2, 3, 2, 4, 64, 37), (1, 1, 1, 4, 256, 200)])
def test_indexer_scores(S, T, G, Hg, P, R):
    q = randn(S, T, G, Hg, P, seed=1)
    w = randn(S, T, G, Hg, seed=2, dtype=torch.float32)
    summ = K.to_e4m3(randn(S, R, P, seed=3, dtype=torch.float32))
    out = K.indexer_scores_triton(q, w, summ)
    ref = K.indexer_scores_ref(q, w, summ)
    d = report("indexer", out, ref)
    assert torch.equal(out, ref) if INTERPRET else d.max() <= 1e-5 * ref.abs().max()


def test_select_regions_tie_break():
    """Ties by ascending id, +0 == -0, ascending output, invalid slots = R (selection stays on torch.sort)."""
    scores = torch.tensor([[[[1.0, 0.0, -0.0, 2.0, 0.0, -1.0, 2.0]]]], device=DEV)
    ids, valid = K.select_regions(scores, torch.tensor([[6]], device=DEV), 4)
    # history 6 regions -> region 6 is not a candidate; order 3 (2.0), 0 (1.0), then zeros 1, 2 (+0 == -0)
    assert ids.flatten().tolist() == [0, 1, 2, 3] and valid.all()
    ids, valid = K.select_regions(scores, torch.tensor([[2]], device=DEV), 4)
    assert ids.flatten().tolist() == [0, 1, 7, 7] and valid.flatten().tolist() == [True, True, False, False]


def _attn_case(S, T, G, Hg, hd, blk, topk, L, seed=0):
    N = L + 3
    q, k, v = randn(S, T, G, Hg, hd, seed=seed), randn(S, N, G, hd, seed=seed + 1), randn(S, N, G, hd, seed=seed + 2)
    pos = torch.stack([torch.arange(L - T, L) - s for s in range(S)]).to(DEV)  # ragged ends across sequences
    sc = torch.randn(S, G, T, N // blk + 1, generator=_gen(seed + 3)).to(DEV)
    ids, valid = K.select_regions_ref(sc, pos // blk, topk)
    return q, k, v, ids, valid, pos, blk, hd ** -0.5


@pytest.mark.parametrize("S,T,G,Hg,hd,blk,topk,L,splits", [
    (1, 1, 1, 4, 48, 8, 6, 100, None),    # decode, odd head dim, sparse
    (1, 1, 1, 2, 64, 8, 4, 5, None),      # decode in the first region: only the current region
    (2, 1, 2, 3, 32, 8, 30, 400, 3),      # decode split over 3 programs, log-sum-exp merge
    (1, 5, 1, 2, 64, 4, 3, 30, None),     # prefill, region size 4
    (1, 3, 1, 4, 48, 8, 30, 400, 1),      # prefill, several tiles per query
])
def test_sparse_attention(S, T, G, Hg, hd, blk, topk, L, splits):
    args = _attn_case(S, T, G, Hg, hd, blk, topk, L)
    out = K.sparse_attention_triton(*args, splits=splits)
    ref = K.sparse_attention_ref(*args)
    d = report("sparse attention", out, ref)
    # online softmax rounds exp(s - running max) to bf16 where the reference uses the global max
    assert d.max() <= 1e-2 * ref.float().abs().max() + 2e-3


# ---------------------------------------------------------------------------------------------------------------
# router


@pytest.mark.parametrize("T,D,E,k", [(1, 192, 12, 3), (20, 256, 40, 8)])
def test_route(T, D, E, k):
    x, w = randn(T, D, seed=1), randn(E, D, seed=2, scale=0.05)
    bias = randn(E, seed=3, scale=0.1, dtype=torch.float32)
    ids, wts = K.route_triton(x, w, bias, k, 3.0)
    rids, rwts = K.route_ref(x, w, bias, k, 3.0)
    assert torch.equal(ids, rids)  # random scores: no near-ties at this size
    assert (wts - rwts).abs().max() <= 1e-6 * 3


# ---------------------------------------------------------------------------------------------------------------
# real shapes on a GPU (TP = 8 local sizes)


@gpu
@pytest.mark.parametrize("T", [1, 16, 512])
def test_gpu_moe_fp8_real_shape(T):
    E, D, F, k = 44, 4096, 1536, 8
    g = _gen(T)
    ids = torch.stack([torch.randperm(352, generator=g)[:k] for _ in range(T)])
    ids = torch.where(ids < E, ids, -1).to(DEV)  # this rank owns global experts 0..43
    wts = torch.rand(T, k, generator=g).to(DEV)
    (w1, s1), (w3, s3), (w2, s2) = fp8_weights(E, F, D, 1), fp8_weights(E, F, D, 3), fp8_weights(E, D, F, 5)
    x = randn(T, D, seed=T)
    out = K.moe_experts_triton(x, ids, wts, w1, w3, w2, s1, s3, s2, 7.0)
    ref = K.moe_experts_ref(x, ids, wts, w1, w3, w2, s1, s3, s2, 7.0)
    d = report(f"GPU moe fp8 T={T}", out, ref)
    assert d.max() <= 2e-2 * ref.float().abs().max()


@gpu
@pytest.mark.parametrize("T", [1, 4, 16])
def test_gpu_moe_decode_real_shape(T):
    """The decode path (global ids of rank 2, shared expert) against the reference and against the sorted path."""
    E, D, F, Fs, k, first = 44, 4096, 1536, 192, 8, 88
    g = _gen(T + 100)
    rows = []
    for t in range(T):  # every token hits one of this rank's experts; other slots anywhere in the 352
        own = first + (t * 7) % E
        rows.append([own] + [e for e in torch.randperm(352, generator=g).tolist() if e != own][:k - 1])
    ids = torch.tensor(rows, device=DEV)
    wts = torch.rand(T, k, generator=g).to(DEV)
    (w1, s1), (w3, s3), (w2, s2) = fp8_weights(E, F, D, 1), fp8_weights(E, F, D, 3), fp8_weights(E, D, F, 5)
    shared = (randn(Fs, D, seed=7, scale=0.02), randn(Fs, D, seed=8, scale=0.02), randn(D, Fs, seed=9, scale=0.02),
              7.0)
    x = randn(T, D, seed=T)
    args = (x, ids, wts, w1, w3, w2, s1, s3, s2, 7.0, first, shared)
    out = K.moe_experts_decode_triton(*args)
    ref = K.moe_experts_ref(*args)
    old = K.moe_experts_sorted_triton(*args)
    assert out.dtype == torch.float32
    d = report(f"GPU moe decode T={T}", out, ref)
    assert d.max() <= 2e-2 * ref.float().abs().max()
    d = report(f"GPU moe decode vs sorted T={T}", out, old)
    assert d.max() <= 2e-2 * ref.float().abs().max()


@gpu
@pytest.mark.parametrize("ctx", [16384, 131072])
def test_gpu_sparse_decode_real_shape(ctx):
    S, G, Hg, hd, blk, topk = 2, 1, 8, 192, 8, 512
    args = _attn_case(S, 1, G, Hg, hd, blk, topk, ctx)
    out = K.sparse_attention_triton(*args)
    ref = K.sparse_attention_ref(*args)
    d = report(f"GPU sparse decode ctx={ctx}", out, ref)
    assert d.max() <= 1e-2 * ref.float().abs().max() + 2e-3
