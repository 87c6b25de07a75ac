"""Every Triton kernel (kernels/) against its PyTorch reference (kernel.py), on identical inputs.

CPU CI: the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) at tiny shapes; there the interpreter computes
in fp32 with the integer rounding helpers, so most kernels are bit-exact and are asserted so. On a GPU
(`TRITON_INTERPRET=0 pytest tests/test_kernels.py`) the same tests run on CUDA with the GPU tolerances below, plus
the real-shape tests at the end (skipped without CUDA).
"""
import os
import subprocess
import sys

import pytest
import torch

import kernel as K
from kernels import (choose, common, draft, dsa_attention, dsa_index, expert_gemm, experts, linear, moe_route,
                     norm_rope, sliding)

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
        tl.store(q_ptr + offs, common._e4m3_bits(x), mask=offs < n)
        tl.store(b_ptr + offs, common._bf16_round(x).to(tl.bfloat16), mask=offs < n)

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
    q, s = moe_route.act_quant_triton(x)
    qr, sr = K.act_quant_ref(x)
    assert bytes_equal(q, qr)
    assert torch.equal(s, sr)


def test_act_quant_stops_at_a_device_end():
    """act_quant_triton(end=): the rows before end[0], an int32 device tensor (no host sync), as the full
    quantisation gives them."""
    x = randn(9, 256, seed=4, scale=3.0)
    q, s = moe_route.act_quant_triton(x)
    end = torch.tensor([4], dtype=torch.int32, device=DEV)
    qe, se = moe_route.act_quant_triton(x, end=end)
    assert bytes_equal(qe[:4], q[:4]) and torch.equal(se[:4], s[:4])


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
@pytest.mark.slow
def test_moe_experts_matches_dense_reference(fp8, T, D, F, E, k):
    args = _moe_case(T, D, F, E, k, fp8, seed=T)
    out = experts.moe_experts_triton(*args, 7.0)
    ref = K.moe_experts_ref(*args, 7.0)
    d = report(f"moe fp8={fp8}", out, ref)
    if INTERPRET:
        assert torch.equal(out, ref)
    else:  # different fp32 summation order inside the MMA (and fp8 MMA accumulation): a few bf16 steps at most
        assert d.max() <= 2e-2 * ref.float().abs().max()


@pytest.mark.parametrize("T,k,E,first", [(0, 2, 4, 0), (3, 2, 4, 0), (700, 3, 5, 2), (20, 4, 6, 100),
                                         (5000, 8, 2, 1)])
@pytest.mark.slow
def test_moe_dispatch_matches_reference(T, k, E, first):
    """The counting sort gives the stable sort's rows, offsets and inverse bit for bit: no slots, fewer slots than
    segments, slots of other ranks' experts (ids below and above this rank's range, sorted last), experts with no
    rows, a rank whose experts nobody picked, segments of more than one block (40000 slots)."""
    ids = torch.randint(0, 3 * E, (T, k), generator=_gen(T)).to(DEV)
    got, ref = moe_route.moe_dispatch_triton(ids, first, E), K.moe_dispatch_ref(ids, first, E)
    for name, a, b in zip(("row_off", "tok", "inv"), got, ref):
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), name


def test_weight_descriptor_is_kept_on_the_weight_and_freed_with_it():
    """The expert GEMM's weight descriptors are built once per weight tensor and block, rebuilt for another block, and
    do not keep a dropped weight alive (host side only: this runs on any machine)."""
    import gc
    import weakref
    w = torch.zeros(2, 256, 128, dtype=K.FP8)
    d = expert_gemm._weight_desc(w, 128)
    assert expert_gemm._weight_desc(w, 128) is d and d.base.data_ptr() == w.data_ptr()
    assert list(d.shape) == [512, 128] and list(d.strides) == [128, 1] and list(d.block_shape) == [128, 128]
    assert list(expert_gemm._weight_desc(w, 64).block_shape) == [64, 128]
    alive = weakref.ref(w)
    del w, d
    gc.collect()
    assert alive() is None


def test_grouped_gemm_fp8_ragged_k_and_partial_n():
    """One launch over experts with 0, 1 and many rows, K=192 (half a scale block), N=200 (not a multiple of 64)."""
    E, N, Kd = 3, 200, 192
    counts = [0, 1, 37]
    x = randn(sum(counts), Kd, seed=3, scale=2.0)
    w, sw = fp8_weights(E, N, Kd, seed=5)
    row_off = torch.tensor([0, 0, 1, 38], dtype=torch.int32, device=DEV)
    xq, sx = moe_route.act_quant_triton(x)
    out = expert_gemm.grouped_gemm_triton(xq, sx, w, sw, row_off)
    ref = torch.cat([K.fp8_gemm_ref(x[row_off[e]:row_off[e + 1]][None], w[e:e + 1], sw[e:e + 1])[0]
                     for e in range(E)])
    d = report("grouped fp8 gemm", out, ref)
    assert torch.equal(out, ref) if INTERPRET else d.max() <= 2e-2 * ref.float().abs().max()
    # tiles through tensor descriptors (TMA): the same bits, also where a tile runs into the next expert's rows (the
    # 1-row expert's 16-row tile) or columns (N = 200: the last 64-wide tile); gated with gathered rows: weights only
    w3, sw3 = fp8_weights(E, N, Kd, seed=6)
    tok = torch.tensor([5, 0, 3] + list(range(35)), dtype=torch.int32, device=DEV)
    for bn in (64, 128):
        assert torch.equal(expert_gemm.grouped_gemm_triton(xq, sx, w, sw, row_off, block_n=bn, tma=True),
                           expert_gemm.grouped_gemm_triton(xq, sx, w, sw, row_off, block_n=bn, tma=False))
    assert torch.equal(*[expert_gemm.grouped_gemm_triton(xq, sx, w, sw, row_off, row_idx=tok, w3=w3, sw3=sw3, limit=7.0,
                                               block_n=64, tma=t) for t in (True, False)])
    # the Gluon kernel; 256-column B tiles: the second box partly past N (200) and its scale block the last one
    if not INTERPRET and common._sm90():
        _assert_wgmma_same_bits(xq, sx, w, sw, row_off, tok, w3, sw3)


def _assert_wgmma_same_bits(xq, sx, w, sw, row_off, tok, w3, sw3):
    """grouped_gemm_wgmma (128-row tiles, two warpgroups of 64 rows; x by TMA, or gathered rows tok by cp.async) at
    both B tile widths, down-like and gated: the same bits as Triton's tiles of >= 64 rows (wgmma; the default 16-row
    tiles add each K block's products in another order: 1 ulp apart)."""
    for kw in (dict(), dict(row_idx=tok, w3=w3, sw3=sw3, limit=7.0)):
        want = expert_gemm.grouped_gemm_triton(xq, sx, w, sw, row_off, block_m=128, tma=False, **kw)
        for bn in (128, 256):
            got = expert_gemm.grouped_gemm_wgmma(xq, sx, w, sw, row_off, block_n=bn, **kw)
            assert torch.equal(got, want), (bn, sorted(kw))


@gpu
def test_gpu_grouped_gemm_wgmma_tma_store():
    """The Gluon kernel's output stores: TMA for a warpgroup's 64 rows when all belong to the expert (130 rows: the
    first tile whole, 64 rows: one half), masked stores for the rest (the 130-row expert's 2-row tile, the 7-row
    expert), and the TMA boxes clipped at N = 320 (a partial 256-column tile); the same bits as Triton's 128-row
    tiles, gated with gathered rows and not."""
    if not common._sm90():
        pytest.skip("sm90 only")
    E, N, Kd = 3, 320, 256
    row_off = torch.tensor([0, 130, 194, 201], dtype=torch.int32, device=DEV)
    x = randn(201, Kd, seed=7, scale=2.0)
    (w, sw), (w3, sw3) = fp8_weights(E, N, Kd, seed=8), fp8_weights(E, N, Kd, seed=9)
    xq, sx = moe_route.act_quant_triton(x)
    tok = torch.randperm(201, generator=torch.Generator().manual_seed(0)).to(torch.int32).to(DEV)
    _assert_wgmma_same_bits(xq, sx, w, sw, row_off, tok, w3, sw3)


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


# the sorted path's last GEMM tiles read rows past row_off[E], and the decode path's tiles their padding rows: rows
# that are uninitialised and never stored back; the interpreter's numpy warns when such garbage holds inf or huge
# values (inf * 0 or an overflow in the scaling)
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("T,k,E,first,shared,limit", [
    (1, 4, 4, 0, None, 7.0),     # one token, ids of rank 0 (remote ones above the range)
    (3, 3, 5, 10, 5.0, 7.0),     # global ids of a later rank, shared expert with its own clamp
    (3, 2, 4, 4, True, None),    # no clamp anywhere
    (17, 2, 3, 3, 5.0, 7.0),     # 17 rows on one expert: two 16-row chunks (routed and shared)
])
@pytest.mark.slow
def test_moe_decode_matches_reference(fp8, T, k, E, first, shared, limit):
    """The sort-free decode path, and the sorted path with the same arguments, against moe_experts_ref."""
    args, sh = _moe_decode_case(T, k, E, first, fp8, shared, seed=T + 3 * k)
    ref = K.moe_experts_ref(*args, limit, first, sh)
    assert ref.dtype == (torch.float32 if sh else torch.bfloat16)
    for path in (experts.moe_experts_decode_triton, experts.moe_experts_sorted_triton):
        out = path(*args, limit, first, sh)
        d = report(f"moe {path.__name__} fp8={fp8}", out, ref)
        assert out.dtype == ref.dtype
        assert torch.equal(out, ref) if INTERPRET else d.max() <= 2e-2 * ref.float().abs().max()
    # two K blocks per loop iteration (D = 192 and F = 160 are 2 blocks each): the same additions in the same order
    dec = experts.moe_experts_decode_triton(*args, limit, first, sh)
    assert torch.equal(experts.moe_experts_decode_triton(*args, limit, first, sh, k_unroll=(2, 2)), dec)
    with pytest.raises(ValueError, match="k_unroll"):
        experts.moe_experts_decode_triton(*args, limit, first, sh, k_unroll=(3, 1))
    # weight rows as the MMA's M side: the same products and scaling (bit-equal where the dot's order is numpy's),
    # another order inside each block's dot on a GPU (fp8 wgmma); ragged F = 160 and D = 192 tiles, 17 rows
    for ku in ((1, 1), (2, 2)):
        out = experts.moe_experts_decode_triton(*args, limit, first, sh, k_unroll=ku)
        d = report(f"moe decode swap fp8={fp8} k_unroll={ku}", out, ref)
        assert torch.equal(out, ref) if INTERPRET else d.max() <= 2e-2 * ref.float().abs().max()
    if fp8:  # TMA tiles (T <= 16; every token a row): the same bits as pointer tiles, also with W3 below W1
        x, ids, wts, w1, w3, w2, s1, s3, s2 = args
        pair = torch.stack([w3, w1])  # W3 at the lower address: the descriptor's first plane
        for g, u in ((w1, w3), (pair[1], pair[0])):
            run = lambda tma: experts.moe_experts_decode_triton(  # noqa: E731
                x, ids, wts, g, u, w2, s1, s3, s2, limit, first, sh, tma=tma)
            assert torch.equal(run(True), run(False))
    # down programs awaiting their own expert's gate/up tiles (moe_early_down) or the whole grid: the same bits, and
    # the combine leaves the arrival counters at zero for the next call (else a down program could read a stale a)
    for early in ((True, True), (False, False)):
        assert torch.equal(experts.moe_experts_decode_triton(*args, limit, first, sh, moe_early_down=early), dec), early
        assert not experts._arrival_counters(args[0].device, 1).any()


def test_moe_decode_local_ids():
    """Local ids with -1 for remote slots (first_expert 0, the pre-existing convention) through the dispatcher."""
    args = _moe_case(3, 128, 64, 3, 2, True, seed=4)
    out = experts.moe_experts_triton(*args, 7.0)
    ref = K.moe_experts_ref(*args, 7.0)
    d = report("moe decode local ids", out, ref)
    assert torch.equal(out, ref) if INTERPRET else d.max() <= 2e-2 * ref.float().abs().max()


def test_quant_rows_matches_act_quant():
    """The decode kernels' on-load 1x128 quantisation (the GPU's saturating RNE convert, or _e4m3_bits under the
    interpreter) gives act_quant_ref's bytes and scales, on ties, subnormals, saturation and an all-zero block."""
    import triton
    import triton.language as tl

    @triton.jit
    def quant_kernel(x_ptr, q_ptr, s_ptr):
        r, c = tl.arange(0, 16), tl.arange(0, 128)
        q, s = experts._quant_rows(tl.load(x_ptr + r[:, None] * 128 + c[None, :]).to(tl.float32))
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
    quant_kernel[(1,)](x, q, s)
    qr, sr = K.act_quant_ref(x)
    assert bytes_equal(q, qr) and torch.equal(s, sr[:, 0])


def test_to_e4m3_saturates():
    """_to_e4m3 (the GPU's saturating convert without a clamp, or _e4m3_bits) against torch's saturating cast on
    values past the e4m3 range (464 and up round past 448), the rounding ties around 448 and ordinary values."""
    import triton
    import triton.language as tl

    @triton.jit
    def cast_kernel(x_ptr, q_ptr):
        i = tl.arange(0, 64)
        tl.store(q_ptr + i, common._to_e4m3(tl.load(x_ptr + i)).to(tl.uint8, bitcast=True))

    big = torch.tensor([416.0, 432.0, 440.0, 447.0, 448.0, 455.0, 456.0, 463.9, 464.0, 470.0, 480.0, 500.0, 1e4, 3e38])
    x = torch.cat([big, -big, torch.randn(64 - 2 * len(big), generator=_gen(7)) * 100]).to(DEV)
    q = torch.empty(64, dtype=torch.uint8, device=DEV)
    cast_kernel[(1,)](x, q)
    assert bytes_equal(q, K.to_e4m3(x))


@pytest.mark.parametrize("M,N,Kd", [(1, 48, 256), (3, 40, 200), (16, 64, 512)])
def test_skinny_linear(M, N, Kd):
    """The few-row bf16 GEMM against F.linear: the fp32 sum runs in another order (4 parts of K, each in order, added
    pairwise), so at most one bf16 step on a few elements (a wrong column or K block would be O(1))."""
    x = randn(M, Kd + 8, seed=M)[:, 8:]  # a row-strided input, as column slices of the packed projection are
    w = randn(N, Kd, seed=N, scale=Kd ** -0.5)
    out = linear.skinny_linear_triton(x, w)
    ref = K.skinny_linear_ref(x, w)
    d = report("skinny linear", out, ref)
    assert (d > 0).float().mean() < 0.1 and d.max() <= 2 ** -7 * ref.float().abs().max()
    # each row alone: the same bits (the order depends on K only, not on M)
    assert torch.equal(linear.skinny_linear_triton(x[:1], w), out[:1])
    if not INTERPRET:  # tiles and warps: each of the 4 parts of K is summed in 16-wide steps in order whatever the tile
        for bn, bk, nw in ((16, 512, 4), (32, 256, 4), (64, 128, 4), (8, 256, 4), (16, 512, 8), (32, 256, 8)):
            got = linear.skinny_linear_triton(x, w, block_n=bn, block_k=bk, num_warps=nw)
            assert torch.equal(got, out), (bn, bk, nw)


def test_launchers_reject_bad_inputs():
    x = randn(4, 128, seed=0)
    with pytest.raises(ValueError, match="bfloat16"):
        moe_route.act_quant_triton(x.float())
    with pytest.raises(ValueError, match="contiguous"):
        moe_route.act_quant_triton(randn(128, 4, seed=0).t())
    w, sw = fp8_weights(2, 64, 128, seed=0)
    xq, sx = moe_route.act_quant_triton(x)
    with pytest.raises(ValueError, match="sw must be"):
        expert_gemm.grouped_gemm_triton(xq, sx, w, sw[:, :, :0], torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="ids"):
        experts.moe_experts_triton(x, torch.zeros(3, 2, dtype=torch.int64, device=DEV),
                             torch.zeros(3, 2, device=DEV), w, w, w, sw, sw, sw, 7.0)


@pytest.mark.parametrize("limit", [7.0, None])
def test_swiglu(limit):
    g, u = randn(3, 100, seed=1, scale=4.0), randn(3, 100, seed=2, scale=4.0)
    out = moe_route.swiglu_triton(g, u, limit)
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
    out = norm_rope.norm_rope_triton(x, w, cos, sin, 1e-5, b)
    ref = K.norm_rope_ref(x, w, cos, sin, 1e-5, b)
    d = report("norm_rope", out, ref)
    if INTERPRET:
        assert torch.equal(out, ref)
    else:  # fp32 sum order of mean(x^2) differs: rarely one bf16 step
        assert (d > 0).float().mean() < 0.02 and d.max() <= 2 ** -6 * ref.float().abs().max()
    # the same rows read from whole tables by position (decode and prefill pass the tables, not gathered rows)
    pos = torch.randperm(3 * T, generator=_gen(4))[:T].to(DEV)
    tab_c, tab_s = (torch.zeros(3 * T, half, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    tab_c[pos], tab_s[pos] = cos, sin
    assert torch.equal(norm_rope.norm_rope_triton(x, w, tab_c, tab_s, 1e-5, b, pos=pos), out)
    assert torch.equal(K.norm_rope_ref(x, w, tab_c, tab_s, 1e-5, b, pos=pos), ref)


def test_rotation_plain_fp32_is_the_spec_fma():
    """The rotation's plain fp32 a*s + b*c (norm_rope_ref, _rotate) equals fma(a, s, b*c) for bf16 inputs: exact
    products, one rounding (fma emulated in fp64: a*s exact, one add, one rounding to fp32 of an exact sum). bf16
    values of randn * 2^e, e in -60 .. 59 (norm outputs and table entries sit far inside that range)."""
    g = _gen(5)
    a, b, c, s = (torch.ldexp(torch.randn(200_000, generator=g), torch.randint(-60, 60, (200_000,), generator=g))
                  .bfloat16().float() for _ in range(4))
    fma = (a.double() * s.double() + (b * c).double()).float()
    assert torch.equal(a * s + b * c, fma)
    assert torch.equal((a * s).double(), a.double() * s.double())  # why: the products are exact in fp32


@pytest.mark.parametrize("T,D,src,out", [(1, 256, torch.float32, torch.bfloat16), (5, 200, torch.float32, torch.bfloat16),
                                          (3, 256, torch.bfloat16, torch.bfloat16), (2, 96, torch.float32, torch.float32)])
def test_rms_norm(T, D, src, out):
    x = randn(T, D, seed=T, scale=3.0, dtype=src)
    w = randn(D, seed=1, scale=0.2, dtype=torch.float32)
    got = norm_rope.rms_norm_triton(x, w, 1e-5, out)
    ref = K.rms_norm_ref(x, w, 1e-5, out)
    assert got.dtype == ref.dtype == out
    d = report("rms_norm", got, ref)
    # the fp32 sum of squares is reduced in another order than torch's mean: last fp32 bit, so at most one
    # rounding step of the output on a few elements
    step = 2 ** -7 if out == torch.bfloat16 else 2 ** -22
    assert (d > 0).float().mean() < 0.05 and d.max() <= step * ref.float().abs().max()


@pytest.mark.parametrize("T,D,W,dtype,norm", [(1, 256, 1, torch.bfloat16, True), (3, 200, 2, torch.bfloat16, True),
                                              (2, 256, 4, torch.float32, True), (2, 96, 3, torch.float32, False)])
def test_add_norm(T, D, W, dtype, norm):
    res = randn(T, D, seed=T, scale=3.0, dtype=torch.float32)
    parts = randn(W, T, D, seed=7, scale=0.5, dtype=dtype)
    w = randn(D, seed=1, scale=0.2, dtype=torch.float32) if norm else None
    got_res, got_h = linear.add_norm_triton(res, parts, w, 1e-5)
    ref_res, ref_h = K.add_norm_ref(res, parts, w, 1e-5)
    assert torch.equal(got_res, ref_res)  # the rank-ordered sum, its rounding and the add: elementwise, exact
    if not norm:
        assert got_h is None and ref_h is None
        return
    d = report("add_norm", got_h, ref_h)  # the norm's sum of squares: as test_rms_norm
    assert (d > 0).float().mean() < 0.05 and d.max() <= 2 ** -7 * ref_h.float().abs().max()


_PDL_PTX = """
import triton
from kernels import moe_route
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sig = dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", end_ptr="*i32", M="i32", K="i32", x_stride="i32",
           q_stride="i32", s_stride="i32", BLOCK_M="constexpr", QBLOCK="constexpr", HAS_END="constexpr",
           PDL="constexpr")
for pdl in (True, False):
    src = ASTSource(fn=moe_route._act_quant_kernel, signature=sig, constexprs=dict(BLOCK_M=4, QBLOCK=128, HAS_END=True,
                                                                           PDL=pdl))
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(launch_pdl=pdl)).asm["ptx"]
    print(pdl, *[ptx.find(i) for i in ("griddepcontrol.wait", "griddepcontrol.launch_dependents", "ld.global")])
"""


@pytest.mark.slow
def test_pdl_prologue_compiles_for_sm90():
    """kernels.common._pdl's prologue compiled ahead of time for an H200 (no GPU needed; in a fresh process, as the
    interpreter's kernels cannot be compiled): griddepcontrol.wait, then launch_dependents, before the kernel's
    first load; neither with PDL off."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _PDL_PTX], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stderr[-2000:]
    at = {line.split()[0]: [int(v) for v in line.split()[1:]] for line in run.stdout.splitlines()}
    assert 0 < at["True"][0] < at["True"][1] < at["True"][2]
    assert at["False"][0] == at["False"][1] == -1 and at["False"][2] > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_peer_add_norm_protocol_and_sum(dtype):
    """The one-shot reduction (opt-in) with W = 3 "ranks" in one process (this is rank 1; the others' buffers and signal pads
    are plain tensors whose flags for this call are already set): the same bits as add_norm_ref over the rows of
    slot 1, this rank's flags set in every pad (its own one taken back), every flag for it consumed."""
    W, rank, T, D = 3, 1, 2, 48
    res = randn(T, D, seed=1, dtype=torch.float32)
    w = randn(D, seed=2, scale=0.1, dtype=torch.float32)
    bufs = [randn(2, T, D, seed=10 + r, scale=3.0, dtype=dtype) for r in range(W)]  # [slot, T, D] per rank
    pads = [torch.zeros(40, dtype=torch.int32, device=DEV) for _ in range(W)]
    off = 4  # flags start at element 4 of each pad
    for row in range(T):
        for r in range(W):
            if r != rank:
                pads[rank][off + row * W + r] = 1  # rank r has already written its row
    addr = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=DEV)  # noqa: E731
    out, h = K.peer_add_norm_triton(res, addr(bufs), addr(pads), rank, dtype, w, 1e-5, slot_off=T * D, flag_off=off)
    want, want_h = K.add_norm_ref(res, torch.stack([b[1] for b in bufs]), w, 1e-5)
    assert bytes_equal(out, want) and bytes_equal(h, want_h)
    assert not pads[rank].any()  # every flag for this rank taken, its own included
    for r in range(W):
        if r != rank:
            flags = pads[r][off:off + T * W].view(T, W)
            assert flags[:, rank].eq(1).all() and flags.sum() == T  # this rank's flag, and nothing else


def test_norm_rope_token_strided_input():
    """q and k arrive as column slices of the packed QKV output: heads contiguous, tokens strided."""
    T, n, D, half = 4, 3, 48, 8
    packed = randn(T, (n + 2) * D, seed=9, scale=2.0)
    x = packed[:, D:(n + 1) * D].view(T, n, D)
    assert not x.is_contiguous()
    w = randn(D, seed=1, scale=0.2, dtype=torch.float32)
    ang = torch.rand(T, half, generator=_gen(3)) * 6
    cos, sin = ang.cos().bfloat16().to(DEV), ang.sin().bfloat16().to(DEV)
    out = norm_rope.norm_rope_triton(x, w, cos, sin, 1e-5)
    ref = K.norm_rope_ref(x.contiguous(), w, cos, sin, 1e-5)
    d = report("norm_rope strided", out, ref)
    if INTERPRET:
        assert torch.equal(out, ref)
    else:
        assert (d > 0).float().mean() < 0.02 and d.max() <= 2 ** -6 * ref.float().abs().max()


@pytest.mark.parametrize("jobs", [4, 3, 1])
def test_norm_rope_jobs(jobs):
    """A DSA layer's four norms in one launch (norm_rope_jobs): q [T, 4, 192] and k [T, 1, 192] (span 64, column
    slices of one packed projection), the indexer's q [T, 2, 48] (RMS, span 16, 17 rows: two programs) and k
    [T, 1, 48] (LayerNorm with bias) on a second table: each output has the bits of its own norm_rope launch, through
    the Triton launch and through the dispatcher (the references on a CPU); the first 1 or 3 jobs alone too."""
    T, P = 17, 48
    packed = randn(T, 6 * 192 + 3 * P, seed=11, scale=2.0)
    tabs = []
    for seed, half in ((12, 32), (13, 8)):
        ang = torch.rand(40, half, generator=_gen(seed)) * 6
        tabs.append((ang.cos().bfloat16().to(DEV), ang.sin().bfloat16().to(DEV)))
    w = [randn(d, seed=20 + i, scale=0.2, dtype=torch.float32) for i, d in enumerate((192, 192, P, P))]
    b = randn(P, seed=30, scale=0.1, dtype=torch.float32)
    spec = [(packed[:, :768].view(T, 4, 192), w[0], *tabs[0], None),
            (packed[:, 768:960].view(T, 1, 192), w[1], *tabs[0], None),
            (packed[:, 1152:1152 + 2 * P].view(T, 2, P), w[2], *tabs[1], None),
            (packed[:, 1152 + 2 * P:][:, None], w[3], *tabs[1], b)][:jobs]
    pos = torch.randperm(40, generator=_gen(14))[:T].to(DEV)
    want = [norm_rope.norm_rope_triton(x, w_, c, s_, 1e-5, b_, pos=pos) for x, w_, c, s_, b_ in spec]
    for run in (norm_rope.norm_rope_jobs_triton, K.norm_rope_jobs):
        got = run(spec, 1e-5, pos)
        assert len(got) == jobs and all(bytes_equal(g, w_) for g, w_ in zip(got, want))
        # e4m3: the chosen jobs' outputs rounded on to their e4m3 values, kept as bf16 (weights of 300: some values
        # saturate at 448)
        big = [(x, torch.full_like(w_, 300.0), c, s_, b_) for x, w_, c, s_, b_ in spec]
        plain = run(big, 1e-5, pos)
        got = run(big, 1e-5, pos, e4m3=(0, jobs - 1))
        assert all(bytes_equal(g, K.to_e4m3(p).to(p.dtype) if i in (0, jobs - 1) else p)
                   for i, (g, p) in enumerate(zip(got, plain)))
        assert plain[0].abs().max() > 448
    with pytest.raises(ValueError, match="1 to 4 jobs"):
        K.norm_rope_jobs(spec * 5, 1e-5, pos)


# ---------------------------------------------------------------------------------------------------------------
# fused sliding-window decode


def bf16_ulp(x):
    """Spacing of bf16 values at |x| (x > 0): 2^(floor(log2 x) - 7)."""
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.clamp_min(2 ** -126)).exponent - 8)


def _sliding_case(B, H, G, hd, half, W, R, pos, seed, n_pos=64, tables=None, Q=1):
    """Random packed projection rows (Q tokens per ring row, pos [B*Q]), a random (already filled) ring, norm
    weights and rope tables (random angles unless `tables` = (cos, sin) is given)."""
    qkvg = randn(B * Q, H * hd + 2 * G * hd + H, seed=seed, scale=2.0)
    ring_k = randn(B, G, R, hd, seed=seed + 1, scale=1.5)
    ring_v = randn(B, G, R, hd, seed=seed + 2)
    qw = randn(hd, seed=seed + 3, scale=0.2, dtype=torch.float32)
    kw = randn(hd, seed=seed + 4, scale=0.2, dtype=torch.float32)
    if tables is None:
        ang = torch.rand(n_pos, half, generator=_gen(seed + 5)) * 6
        tables = ang.cos().bfloat16().to(DEV), ang.sin().bfloat16().to(DEV)
    pos = torch.tensor(pos, dtype=torch.int64, device=DEV)
    return [qkvg, pos, ring_k, ring_v, qw, kw, *tables, 1e-5, hd ** -0.5, W, H, G]


def _check_sliding(args, H, hd, label, max_ulps, **kw):
    """Kernel and reference, each on its own copy of the ring: the rings must match afterwards and o agree within
    max_ulps bf16 steps at each (row, head)'s magnitude max|ref|. Returns the largest difference in those steps."""
    qkvg, pos, ring_k, ring_v = args[:4]
    k1, v1, k2, v2 = ring_k.clone(), ring_v.clone(), ring_k.clone(), ring_v.clone()
    out = sliding.sliding_decode_triton(qkvg, pos, k1, v1, *args[4:], **kw)
    ref = K.sliding_decode_ref(qkvg, pos, k2, v2, *args[4:], rows=kw.get("rows"))
    assert bytes_equal(v1, v2)
    dk = report(f"{label} ring k", k1, k2)
    if INTERPRET:
        assert bytes_equal(k1, k2)
    else:  # torch.rsqrt on CUDA is the approximate rsqrtf and torch sums x^2 in another order: rarely one step
        assert (dk > 0).float().mean() < 1e-3 and dk.max() <= 2 ** -6 * k2.float().abs().max()
    o, r = out.float().view(-1, H, hd), ref.float().view(-1, H, hd)
    ulps = ((o - r).abs() / bf16_ulp(r.abs().amax(-1, keepdim=True))).max().item()
    print(f"{label}: max {ulps:.2f} bf16 steps of the head's magnitude, {(o != r).float().mean().item():.1%} differ")
    assert ulps <= max_ulps
    return ulps


@pytest.mark.parametrize("hd,half", [(32, 8), (24, 12)], ids=["partial-rotary", "full-rotary"])
@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("R", [8, 11])
@pytest.mark.parametrize("B,pos", [(1, [3]), (2, [7, 8]), (3, [0, 29, 53])])
@pytest.mark.slow
def test_sliding_decode(B, pos, R, G, hd, half):
    """Positions below the window, at it, and wrapped several times; a ring without (R = W) and with spare slots;
    one split (default) and 3 splits merged by log-sum-exp (split_len=4).

    The kernel feeds P.V the fp32 probabilities (SDPA's math) where SDPA's CPU kernel rounds them to bf16 first and
    the CUDA one does so per key tile: SDPA's o may then round to the neighbouring bf16 value. With the gate at 1
    (logit 30) out is SDPA's o: within 1 step. A gate g < 1 carries that step into out = bf(o * g), whose magnitude
    can sit a binade lower: within 2 steps of out's magnitude. (Measured over 60 random cases: 1.0 and 2.0.)
    Rotary span: part of the head (the DSA layers' 64 of 192) or all of it (the sliding layers': no rest columns),
    with padded column blocks (12 of 16, 24 of 32)."""
    H, W = 4, 8
    args = _sliding_case(B, H, G, hd, half, W, R, pos, seed=B * 10 + R + G)
    for split_len in (32, 4):
        _check_sliding(args, H, hd, f"sliding decode B={B} R={R} G={G} split_len={split_len}", 2.0,
                       split_len=split_len)
    args[0] = args[0].clone()
    args[0][:, -H:] = 30.0  # sigmoid rounds to 1.0: out = SDPA's o
    _check_sliding(args, H, hd, f"sliding decode B={B} R={R} G={G} gate 1", 1.0, split_len=4)


@pytest.mark.parametrize("Q", [1, 3])
def test_sliding_decode_addresses_its_ring_rows(Q):
    """Step rows served by ring rows of their own (slots 2, 0, 3 of a 4-row ring): the kernel reads and writes those
    rows only, as the reference with the same rows."""
    H, G, hd, half, W, R = 4, 2, 32, 8, 8, 11
    pos = [p + j for p in (5, 30, 17) for j in range(Q)]
    args = _sliding_case(3, H, G, hd, half, W, R, pos, seed=40 + Q, Q=Q)
    args[2], args[3] = (torch.cat([r, randn(1, *r.shape[1:], seed=50)]) for r in args[2:4])
    before = args[2][1].clone()
    _check_sliding(args, H, hd, f"sliding decode rows Q={Q}", 2.0, rows=torch.tensor([2, 0, 3], device=DEV))
    assert bytes_equal(args[2][1], before)


@pytest.mark.parametrize("B,first,Q,R", [(B, first, Q, R) for B, first in ((1, [0]), (2, [5, 30]))
                                         for Q, R in ((3, 10), (4, 13))] + [(1, [30], 8, 15)])
@pytest.mark.slow
def test_sliding_decode_multi_token(B, first, Q, R):
    """Q tokens per ring row (a speculative verify step, or a next turn's extension step): the keys are written
    by their own launch, then each query sees the window of its own position; rows starting at 0, inside the first
    window and wrapped; a ring of exactly W + Q - 1 slots (R = 10 at Q = 3, 15 at Q = 8) and a larger one."""
    H, G, hd, half, W = 4, 2, 32, 8, 8
    pos = [p + j for p in first for j in range(Q)]
    args = _sliding_case(B, H, G, hd, half, W, R, pos, seed=B * 7 + Q + R, Q=Q)
    for split_len in (32, 4):
        _check_sliding(args, H, hd, f"sliding decode B={B} Q={Q} R={R} split_len={split_len}", 2.0,
                       split_len=split_len)
    gate1 = [args[0].clone(), *args[1:]]
    gate1[0][:, -H:] = 30.0  # sigmoid rounds to 1.0: out = SDPA's o, within 1 step
    _check_sliding(gate1, H, hd, f"sliding decode B={B} Q={Q} R={R} gate 1", 1.0, split_len=4)
    short = [ring[:, :, :W + Q - 2].contiguous() for ring in args[2:4]]
    with pytest.raises(ValueError, match="needs a ring"):
        sliding.sliding_decode_triton(*args[:2], *short, *args[4:])


@pytest.mark.parametrize("H,G,hd", [(4, 2, 24), (4, 1, 32), (3, 3, 16)] if INTERPRET else
                         [(4, 2, 48), (4, 1, 32), (8, 1, 64)])
@pytest.mark.parametrize("off,n,W", [(0, 13, 5), (4, 9, 5), (3, 21, 8), (0, 1, 4)])
@pytest.mark.slow
def test_banded_attention_matches_reference(H, G, hd, off, n, W):
    """The prefill chunk's banded attention (query i sees keys (off + i - W, off + i]) through the Triton kernel:
    chunks starting after cached keys (off > 0) or not, a window longer than the chunk, a padded second head_dim
    piece (24 = 16 + 8), HG of 1 to 8 heads per tile row group (GPUs: powers of two, pieces of >= 16 for tl.dot);
    within 2 bf16 steps of each row's magnitude (online softmax)."""
    q, k, v = randn(H, n, hd, seed=n), randn(G, off + n, hd, seed=n + 1), randn(G, off + n, hd, seed=n + 2)
    ref = K.banded_attention_ref(q, k, v, off, W, hd ** -0.5)
    for bn in (4, 16) if INTERPRET else (16, 32):
        out = sliding.banded_attention_triton(q, k, v, off, W, hd ** -0.5, block_n=bn)
        ulps = ((out.float() - ref.float()).abs() / bf16_ulp(ref.float().abs().amax(-1, keepdim=True))).max().item()
        assert ulps <= 2.0, (bn, ulps)
    # the output gate (logits a strided column slice, as in the packed projection) applied in the kernel and the
    # result written into a transposed view of a [n, H, hd] output: gate_heads of the ungated kernel's output
    packed = randn(n, H + 3, seed=5)
    gate, rows = packed[:, 2:2 + H], torch.zeros(n, H, hd, dtype=torch.bfloat16, device=DEV)
    got = sliding.banded_attention_triton(q, k, v, off, W, hd ** -0.5, gate=gate, out=rows.transpose(0, 1))
    want = K.gate_heads(sliding.banded_attention_triton(q, k, v, off, W, hd ** -0.5).transpose(0, 1), gate)
    assert got.data_ptr() == rows.data_ptr()
    assert torch.equal(rows, want) if INTERPRET else (rows.float() - want.float()).abs().max() <= (
        2 ** -7 * want.float().abs().max())
    if not K._triton(q):  # the dispatcher on the reference path: the reference, then the gate
        rows.zero_()
        K.banded_attention(q, k, v, off, W, hd ** -0.5, gate=gate, out=rows.transpose(0, 1))
        assert torch.equal(rows, K.gate_heads(ref.transpose(0, 1), gate))
    with pytest.raises(ValueError, match="banded attention"):
        sliding.banded_attention_triton(q, k[:, :-1], v[:, :-1], off, W, 1.0)
    with pytest.raises(ValueError, match="gate must be"):
        sliding.banded_attention_triton(q, k, v, off, W, 1.0, gate=gate.t())


def test_set_tuning_parses_values_and_names_bad_ones(monkeypatch):
    """--tune KEY=VALUE (tools.bench_decode, bench_prefill, bench_request, sass): Python literals converted to
    the default's type; an unknown key or a malformed value is named."""
    monkeypatch.setattr(K, "TUNING", dict(K.TUNING))
    K.set_tuning(["moe_block_n=(32, 64)", "router_parts=1"])
    assert (K.TUNING["moe_block_n"], K.TUNING["router_parts"]) == ((32, 64), 1)
    with pytest.raises(ValueError, match="nokey"):
        K.set_tuning(["nokey=1"])
    with pytest.raises(ValueError, match="moe_block_n"):
        K.set_tuning(["moe_block_n=wide"])


def test_launchers_default_to_the_tuned_values():
    """The dispatchers pass kernel.TUNING's entries to the launchers in kernels/ (which never read kernel.py): every
    launcher parameter named after a TUNING key defaults to its value, so a launcher called directly (tests,
    tools.bench_kernels) launches what its dispatcher does; every key but dense_tiles (kernel.dense_tiles_end's) is
    one."""
    import inspect
    tuned = set()
    for f in (sliding.sliding_decode_triton, dsa_attention.sparse_attention_triton, moe_route.route_triton,
              experts.moe_experts_decode_triton, linear.skinny_linear_triton):
        for name, p in inspect.signature(f).parameters.items():
            if name in K.TUNING:
                assert p.default == K.TUNING[name], (f.__name__, name, p.default, K.TUNING[name])
                tuned.add(name)
    assert tuned == set(K.TUNING) - {"dense_tiles"}


def test_candidates_are_timed_between_two_timings_of_the_defaults():
    """tools.bench_decode --candidates: a timer that speeds up by 1% per call (the drift seen on the H200) and a
    candidate 3% slower than the defaults: timed around it, the ratio is exactly 1.03 (timed after the defaults, it
    looked 2% slower). A failing candidate is reported and the tuning restored either way."""
    from tools import bench_decode
    tuning, calls = {"choice": "a", "other": 1}, []

    def timed():
        calls.append(tuning["choice"])
        if tuning["choice"] == "bad":
            raise RuntimeError("no capture")
        return (1.0 - 0.01 * len(calls)) * (1.03 if tuning["choice"] == "b" else 1.0)
    got = bench_decode.timed_around(timed, {"b": {"choice": "b"}, "bad": {"choice": "bad"}}, tuning)
    assert got["b"][0] / got["b"][1] == pytest.approx(1.03, abs=1e-12)
    assert isinstance(got["bad"], RuntimeError) and calls == ["a", "b", "a", "a", "bad"]
    assert tuning == {"choice": "a", "other": 1}


def test_checks_build_their_messages_only_when_they_fail():
    """_check's message may be a function (the launchers' shape f-strings cost the prefill's host ~2.5 us each when
    built ahead of time): not called when the check passes, its text raised when it fails."""
    common._check(True, lambda: pytest.fail("a passing check built its message"))
    with pytest.raises(ValueError, match=r"x must be contiguous \(shape \(3, 2\), strides \(1, 3\)\)"):
        common._check_tensor("x", torch.zeros(2, 3).t(), torch.float32, ndim=2)
    with pytest.raises(ValueError, match="plain text"):
        common._check(False, "plain text")


def test_sliding_decode_rejects_bad_inputs():
    args = _sliding_case(1, 4, 2, 32, 8, 8, 8, [3], seed=0)
    with pytest.raises(ValueError, match="multiple of n_groups"):
        sliding.sliding_decode_triton(*args[:-2], 4, 3)
    with pytest.raises(ValueError, match="qkvg must be"):
        sliding.sliding_decode_triton(args[0][:, :-1], *args[1:])
    with pytest.raises(ValueError, match="window"):
        sliding.sliding_decode_triton(*args[:-3], 9, 4, 2)



# ---------------------------------------------------------------------------------------------------------------
# DSA: summaries, scores, selection, attention


@pytest.mark.parametrize("N,blk,P", [(7, 8, 64), (3, 8, 48), (1, 4, 256)])
def test_region_summary_bytes(N, blk, P):
    k = randn(N, blk, P, seed=N)
    z = randn(N, blk, P, seed=N + 1, scale=3.0)
    out = dsa_index.region_summary_triton(k, z)
    ref = K.region_summary_ref(k, z)
    assert out.dtype == K.FP8 and bytes_equal(out, ref)


@pytest.mark.parametrize("G,hd,blk,P", [(1, 32, 8, 64), (2, 16, 4, 24)])
def test_dsa_cache_write(G, hd, blk, P):
    """Decode's cache writes: rows at each request's position, the pending indexer row, and the summary of a region
    that the row completes (rows 0 and 2 complete one, row 1 does not), byte for byte like the reference."""
    B, cap = 3, 4 * blk
    pos = torch.tensor([[blk - 1, 0], [blk + 1, 0], [3 * blk - 1, 0]], device=DEV)[:, 0]  # strided, as in the model
    packed = randn(B, 3 * G * hd, seed=1)  # v is a column slice of the packed projection, as in the model
    k, v = randn(B, G, hd, seed=2), packed[:, G * hd:2 * G * hd].view(B, G, hd)
    ki, zi = randn(B, P, seed=3), randn(B, 2 * P, seed=4, scale=3.0)[:, :P]
    caches = [randn(B, cap, G, hd, seed=5), randn(B, cap, G, hd, seed=6), randn(B, blk, P, seed=7),
              randn(B, blk, P, seed=8, scale=3.0), randn(B, cap // blk, P, seed=9).view(torch.uint8)[..., :P].contiguous()]
    ref, orig = [c.clone() for c in caches], caches[4].clone()
    dsa_index.dsa_cache_write_triton(k, v, ki, zi, pos, *caches)
    K.dsa_cache_write_ref(k, v, ki, zi, pos, *ref)
    for got, want in zip(caches, ref):
        assert bytes_equal(got, want)
    assert not bytes_equal(ref[4][0], orig[0]) and bytes_equal(ref[4][1], orig[1])  # completed regions only
    # step rows served by cache rows of their own (slots 2, 0, 3 of a 4-row cache): row 1 is never touched
    rows = torch.tensor([2, 0, 3], device=DEV)
    caches = [torch.cat([c, c[:1]]) for c in caches]
    ref, before = [c.clone() for c in caches], [c.clone() for c in caches]
    dsa_index.dsa_cache_write_triton(k, v, ki, zi, pos, *caches, rows=rows)
    K.dsa_cache_write_ref(k, v, ki, zi, pos, *ref, rows=rows)
    for got, want, old in zip(caches, ref, before):
        assert bytes_equal(got, want) and bytes_equal(got[1], old[1])


@pytest.mark.parametrize("S,T,G,Hg,P,R", [(2, 3, 2, 4, 64, 37), (1, 1, 1, 4, 256, 200)])
def test_indexer_scores(S, T, G, Hg, P, R):
    q = randn(S, T, G, Hg, P, seed=1)
    w = randn(S, T, G, Hg, seed=2, dtype=torch.float32)
    summ = K.to_e4m3(randn(S, R, P, seed=3, dtype=torch.float32))
    out = dsa_index.indexer_scores_triton(q, w, summ)
    ref = K.indexer_scores_ref(q, w, summ)
    d = report("indexer", out, ref)
    assert torch.equal(out, ref) if INTERPRET else d.max() <= 1e-5 * ref.abs().max()
    # other tiles, same additions
    tiled = dsa_index.indexer_scores_triton(q, w, summ, block_t=32, block_r=32, num_warps=2)
    d = report("indexer 32x32 tiles", tiled, out)  # on GPUs another MMA shape may order a dot's products otherwise
    assert torch.equal(tiled, out) if INTERPRET else d.max() <= 1e-5 * ref.abs().max()
    # the dot over P as chained slices of 32 (unsaturated e4m3 products: every partial sum is exact here too)
    sliced = dsa_index.indexer_scores_triton(q, w, summ, block_pc=32)
    d = report("indexer P slices of 32", sliced, out)
    assert torch.equal(sliced, out) if INTERPRET else d.max() <= 1e-5 * ref.abs().max()
    # as the model calls it: q with values past e4m3's 448 (saturated in the kernel), w a bf16 column slice of the
    # packed projection, scaled by 1/sqrt(Hg) in fp32
    q = q * 100
    packed = randn(S, T, G * Hg + 5, seed=4)
    w16 = packed[..., 5:].view(S, T, G, Hg)
    out = dsa_index.indexer_scores_triton(q, w16, summ, Hg ** -0.5)
    ref = K.indexer_scores_ref(q, w16, summ, Hg ** -0.5)
    assert torch.equal(ref, K.indexer_scores_ref(q, w16.float() * Hg ** -0.5, summ))
    d = report("indexer bf16 w", out, ref)  # saturated products: sums no longer exact, their order shows in last bits
    assert d.max() <= 1e-6 * ref.abs().max() if INTERPRET else d.max() <= 1e-5 * ref.abs().max()
    # q already holding its e4m3 values (norm_rope_jobs' e4m3), its rounding skipped: the same scores
    q8 = K.to_e4m3(q).to(q.dtype)
    assert torch.equal(dsa_index.indexer_scores_triton(q8, w16, summ, Hg ** -0.5, q_e4m3=True), out)
    # decode: q's rows read summaries rows of their own (a cache of S + 1 rows, reversed), and region tiles past every
    # query's history are skipped (left unwritten: select_regions never reads them); prefill's launch: the same
    big = torch.cat([summ, summ[:1]]).flip(0)
    rows = torch.arange(S, device=DEV).flip(0) + 1
    blk = 4
    pos = torch.randint(0, R * blk, (S, T), generator=_gen(5)).to(DEV)
    pos[0, 0] = 5  # a query with a short history: most of its row's tiles are past it
    want = K.indexer_scores_ref(q8, w16, big, Hg ** -0.5, rows=rows)
    for prefill in (False, True):
        got = dsa_index.indexer_scores_triton(q8, w16, big, Hg ** -0.5, q_e4m3=True, rows=rows, n_hist=pos, blk=blk,
                                      prefill=prefill)
        hist = torch.arange(R, device=DEV) < (pos // blk)[:, None, :, None]  # [S, 1, T, R]
        d = (got - want).abs().masked_fill(~hist, 0)
        assert d.max() <= (0 if INTERPRET else 1e-5) * want.abs().max(), prefill


def test_select_regions_tie_break():
    """Ties by ascending id, +0 == -0, ascending output, invalid slots = R."""
    scores = torch.tensor([[[[1.0, 0.0, -0.0, 2.0, 0.0, -1.0, 2.0]]]], device=DEV)
    ids, valid = K.select_regions(scores, torch.tensor([[6]], device=DEV), 4)
    # history 6 regions -> region 6 is not a candidate; order 3 (2.0), 0 (1.0), then zeros 1, 2 (+0 == -0)
    assert ids.flatten().tolist() == [0, 1, 2, 3] and valid.all()
    ids, valid = K.select_regions(scores, torch.tensor([[2]], device=DEV), 4)
    assert ids.flatten().tolist() == [0, 1, 7, 7] and valid.flatten().tolist() == [True, True, False, False]


def test_bench_prefill_local_selection_is_a_selection_with_locality():
    """tools.bench_prefill's synthetic selection: exactly what select_regions gives on scores that mark its regions
    (its layout and budgets: min(topk, history), ascending, invalid slots R), each query's latest regions in it, and
    neighbouring queries sharing far more than independent random selections do."""
    from tools.bench_prefill import local_selection, mean_union
    blk, topk, G, p0, T = 4, 8, 2, 16, 256
    pos = torch.arange(p0, p0 + T)  # histories of 4 .. 67 regions: below, at and far above topk
    R = (p0 + T) // blk
    ids, valid = local_selection(pos, G, topk, blk, R, share=8, recent=4)
    marked = torch.zeros(1, G, T, R + 1).scatter_(-1, ids, 1.0)[..., :R]  # slot R (invalid) dropped
    rids, rvalid = K.select_regions_ref(marked, pos[None], topk, blk)
    assert torch.equal(ids, rids) and torch.equal(valid, rvalid)
    n = (pos // blk).tolist()
    for t in range(T):
        row = set(ids[0, 0, t][valid[0, 0, t]].tolist())
        assert len(row) == min(topk, n[t]) and set(range(max(n[t] - 4, 0), n[t])) <= row
    rand = K.select_regions_ref(torch.rand(1, G, T, R, generator=_gen(0)), pos[None], topk, blk)
    assert mean_union(ids, valid) < 0.5 * mean_union(*rand)


def _select_case(S, G, T, R, seed, ties):
    """Scores with many exact ties (few levels, zero rows, -0.0 beside +0.0), -inf and NaN; or distinct random
    scores (the search then ends early, once exactly K keys lie above its prefix)."""
    g = _gen(seed)
    if not ties:
        return torch.randn(S, G, T, R, generator=g).to(DEV)
    sc = torch.randint(-3, 4, (S, G, T, R), generator=g).float() * 0.5
    sc[0, 0, 0] = 0.0  # an all-zero row
    sc[..., 1::5] = torch.where(sc[..., 1::5] == 0, -0.0, sc[..., 1::5])  # -0.0 must tie with +0.0
    sc[..., 2::7] = float("-inf")
    sc[-1, -1, -1, R // 2] = float("nan")  # above +inf
    sc[..., 3::11] = torch.randn(sc[..., 3::11].shape, generator=g)
    return sc.to(DEV)


@pytest.mark.parametrize("S,G,T,R,topk,n_hist,chunk,ties", [
    (2, 2, 3, 37, 8, [[0, 5, 8], [37, 20, 30]], 4096, True),   # n_hist 0 / < topk / == topk / == R / > topk
    (1, 1, 2, 5, 8, [[5, 3]], 4096, True),                      # R < topk: K = R, everything is taken
    (2, 1, 2, 37, 1, [[37, 9], [1, 36]], 4096, True),           # K = 1
    (1, 1, 3, 200, 16, [[200, 150, 40]], 4096, False),          # distinct scores
    (2, 1, 3, 300, 5, [[300, 100, 4], [299, 250, 0]], 32, True),  # chunked: 10 chunks -> 50 pairs -> 2 -> 10
    (1, 1, 2, 300, 3, [[300, 140]], 16, False),                 # 19 chunks -> 57 pairs -> 4 -> 12 -> final
    (1, 1, 3, 300, 3, [[15, 16, 14]], 16, True),  # chunk 0 holds 15: a history inside it ends after one launch
    (1, 1, 4, 300, 3, [[8, 2, 9, 200]], 32, True),  # decode's short path (8 lanes) beside a history past it
    (1, 1, 3, 37, 8, [[8, 5, 30]], 4096, True),  # the short path in a one-launch selection
])
@pytest.mark.slow
def test_select_regions_triton_bit_identical(S, G, T, R, topk, n_hist, chunk, ties):
    sc = _select_case(S, G, T, R, seed=R + topk, ties=ties)
    nh = torch.tensor(n_hist, device=DEV)
    ids, valid = dsa_index.select_regions_triton(sc, nh, topk, chunk=chunk, short_lanes=8)
    rids, rvalid = K.select_regions_ref(sc, nh, topk)
    assert torch.equal(ids, rids) and torch.equal(valid, rvalid)
    # positions and the region size in place of the region counts: the kernel divides (blk = 8, positions 8 n + 5)
    ids, valid = dsa_index.select_regions_triton(sc, nh * 8 + 5, topk, blk=8, chunk=chunk)
    assert torch.equal(ids, rids) and torch.equal(valid, rvalid)
    ids, valid = dsa_index.select_regions_triton(sc, nh, topk, chunk=chunk, prefill=True)  # prefill's tiles
    assert torch.equal(ids, rids) and torch.equal(valid, rvalid)
    assert all(torch.equal(a, b) for a, b in zip(K.select_regions_ref(sc, nh * 8 + 5, topk, blk=8), (rids, rvalid)))


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
    ref = K.sparse_attention_ref(*args)
    for block_n in (64, 32):  # 32: the tile that spills fewer registers on sm90 (measured no faster)
        out = dsa_attention.sparse_attention_triton(*args, splits=splits, block_n=block_n)
        d = report(f"sparse attention block_n={block_n}", out, ref)
        # online softmax rounds exp(s - running max) to bf16 where the reference uses the global max
        assert d.max() <= 1e-2 * ref.float().abs().max() + 2e-3
    # the output gate, applied by the merge (or after a single split): bf(bf(o) * bf(sigmoid)) of the kernel's o, the
    # logits a strided column slice as in the packed projection (the gate is exact arithmetic on o: equal bits)
    packed = randn(S * T, G * Hg + 5, seed=9)
    gate = packed[:, 3:3 + G * Hg]
    out = dsa_attention.sparse_attention_triton(*args, splits=splits)
    gated = dsa_attention.sparse_attention_triton(*args, splits=splits, gate=gate)
    want = K.gate_heads(out, gate)
    assert torch.equal(gated, want) if INTERPRET else (gated.float() - want.float()).abs().max() <= (
        2 ** -7 * want.float().abs().max())
    d = report("sparse attention gated", gated, K.sparse_attention_ref(*args, gate=gate))
    assert d.max() <= 1e-2 * ref.float().abs().max() + 2e-3
    # the cache rows of the sequences given (a cache of S + 1 rows, reversed), and prefill's one-split launch
    q, k, v, *rest = args
    big_k, big_v = torch.cat([k, k[:1]]).flip(0), torch.cat([v, v[:1]]).flip(0)
    rows = torch.arange(S, device=DEV).flip(0) + 1
    for prefill in (False, True):
        out = dsa_attention.sparse_attention_triton(q, big_k, big_v, *rest, gate=gate, rows=rows, prefill=prefill)
        d = report(f"sparse attention rows prefill={prefill}", out,
                   K.sparse_attention_ref(q, big_k, big_v, *rest, gate=gate, rows=rows))
        assert d.max() <= 1e-2 * ref.float().abs().max() + 2e-3
    if S == 1:  # prefill's one split applies the gate itself, written into rows of a larger output as in the model
        wide = torch.zeros(T + 2, G, Hg, hd, dtype=torch.bfloat16, device=DEV)
        dsa_attention.sparse_attention_triton(q, big_k, big_v, *rest, gate=gate, rows=rows, prefill=True,
                                              out=wide[None, 1:T + 1])
        assert torch.equal(wide[None, 1:T + 1], out) and not wide[0].any() and not wide[-1].any()
        with pytest.raises(ValueError, match="out must be"):
            dsa_attention.sparse_attention_triton(q, big_k, big_v, *rest, rows=rows, out=wide[None, :T].transpose(3, 4))


@pytest.mark.parametrize("G,Hg,hd,blk", [(2, 2, 48, 8), (1, 3, 32, 4)] if INTERPRET else
                         [(1, 8, 192, 8), (2, 4, 64, 8)])
@pytest.mark.parametrize("p0,T", [(0, 21), (13, 9), (40, 1), (5, 44)])
@pytest.mark.slow
def test_dense_prefix_is_sparse_attention_over_every_history_region(G, Hg, hd, blk, p0, T):
    """Prefill queries that select every history region (the dense-equivalence regime) through the tile of whole
    regions' queries: within the sparse kernel's distance of the reference, and close to the per-query sparse kernel
    on the full selection (the same key tiles); chunks that start inside a region, a single query, several tiles."""
    N = p0 + T + 3
    q, k, v = randn(1, T, G, Hg, hd, seed=p0 + T), randn(1, N, G, hd, seed=1), randn(1, N, G, hd, seed=2)
    ref = K.dense_prefix_ref(q, k, v, p0, blk, hd ** -0.5)
    pos = torch.arange(p0, p0 + T, device=DEV)[None]
    n = max(1, (p0 + T - 1) // blk)
    ids = torch.arange(n, device=DEV).expand(1, G, T, n)
    want = K.sparse_attention_ref(q, k, v, ids, ids < (pos // blk)[:, None, :, None], pos, blk, hd ** -0.5)
    assert torch.equal(ref, want)
    valid = (ids < (pos // blk)[:, None, :, None]).contiguous()
    for block_n in (16, 64):
        out = dsa_attention.dense_prefix_triton(q, k, v, p0, blk, hd ** -0.5, block_n=block_n)
        d = report(f"dense prefix block_n={block_n}", out, ref)
        assert d.max() <= 1e-2 * ref.float().abs().max() + 2e-3
    sparse = dsa_attention.sparse_attention_triton(q, k, v, ids.contiguous(), valid, pos, blk, hd ** -0.5, block_n=64,
                                                   prefill=True)
    assert (out.float() - sparse.float()).abs().max() <= 2 * bf16_ulp(ref.float().abs().max())  # out: block_n 64
    gate = randn(T, G * Hg, seed=7)
    if not K._triton(q):  # the dispatcher on the reference path: the reference, then the gate
        assert torch.equal(K.dense_prefix(q, k, v, p0, blk, hd ** -0.5, gate), K.gate_heads(ref, gate))
    with pytest.raises(ValueError, match="dense prefix"):
        dsa_attention.dense_prefix_triton(q, k[:, :p0 + T - 1], v[:, :p0 + T - 1], p0, blk, 1.0)


@pytest.mark.parametrize("G,Hg,hd,blk,topk", [(2, 2, 48, 8, 3), (1, 3, 32, 4, 5)] if INTERPRET else
                         [(1, 8, 192, 8, 4), (2, 4, 64, 8, 3)])
@pytest.mark.parametrize("p0,T", [(13, 60), (75, 9), (90, 1), (250, 20)])
@pytest.mark.slow
def test_dense_prefix_over_a_selection_is_sparse_attention(G, Hg, hd, blk, topk, p0, T):
    """Prefill queries past the dense regime through the dense tiles, each history key masked by its query's own
    selection (exact top-k of random scores, so queries of one tile select different regions): within the sparse
    kernel's distance of the reference, and the dispatcher on the reference path is the reference."""
    N = p0 + T + 5
    q, k, v = randn(1, T, G, Hg, hd, seed=p0 + T), randn(1, N, G, hd, seed=1), randn(1, N, G, hd, seed=2)
    pos = torch.arange(p0, p0 + T, device=DEV)[None]
    R = (p0 + T) // blk
    scores = torch.randn(1, G, T, R, generator=torch.Generator().manual_seed(T)).to(DEV)
    scores[..., 31::32] = 10.0  # regions 31, 63, ... selected: the sign bit of each word of selection bits
    ids, valid = K.select_regions_ref(scores, pos, topk, blk)
    assert (valid.sum(-1) < (pos // blk)[:, None]).any()  # queries that select part of their history
    ref = K.sparse_attention_ref(q, k, v, ids, valid, pos, blk, hd ** -0.5)
    assert torch.equal(K.dense_prefix_ref(q, k, v, p0, blk, hd ** -0.5, ids=ids, valid=valid), ref)
    for block_n in (16, 64):
        out = dsa_attention.dense_prefix_triton(q, k, v, p0, blk, hd ** -0.5, ids, valid, block_n=block_n)
        d = report(f"dense prefix over a selection block_n={block_n}", out, ref)
        assert d.max() <= 1e-2 * ref.float().abs().max() + 2e-3
    # a selection that differs from every region changes the result: the mask is read
    every = dsa_attention.dense_prefix_triton(q, k, v, p0, blk, hd ** -0.5)
    assert not torch.equal(out, every)
    # the output gate (logits a strided column slice, as in the packed projection) applied in the kernel, written
    # into a slice of a larger output: gate_heads of the ungated kernel's output
    gate = randn(T, G * Hg + 3, seed=7)[:, 1:1 + G * Hg]
    rows = torch.zeros(1, T + 2, G, Hg, hd, dtype=torch.bfloat16, device=DEV)
    dsa_attention.dense_prefix_triton(q, k, v, p0, blk, hd ** -0.5, ids, valid, gate=gate, out=rows[:, 1:T + 1],
                                      block_n=block_n)
    want = K.gate_heads(out, gate)
    assert torch.equal(rows[:, 1:T + 1], want) if INTERPRET else (rows[:, 1:T + 1].float() - want.float()).abs().max() \
        <= 2 ** -7 * want.float().abs().max()
    assert not rows[:, 0].any() and not rows[:, -1].any()
    if not K._triton(q):
        assert torch.equal(K.dense_prefix(q, k, v, p0, blk, hd ** -0.5, gate, ids, valid),
                           K.gate_heads(ref, gate))


# ---------------------------------------------------------------------------------------------------------------
# router


@pytest.mark.parametrize("T,D,E,k", [(1, 192, 12, 3), (3, 192, 12, 3), (20, 256, 40, 8), (80, 128, 24, 4)])
@pytest.mark.parametrize("parts", [1, 4])
@pytest.mark.slow
def test_route(T, D, E, k, parts):
    tuned = dict(router_parts=parts)  # the hoisted K step in 1 or 4 MMA chains
    x, w = randn(T, D, seed=1), randn(E, D, seed=2, scale=0.05)
    bias = randn(E, seed=3, scale=0.1, dtype=torch.float32)
    ids, wts = moe_route.route_triton(x, w, bias, k, 3.0, **tuned)
    rids, rwts = K.route_ref(x, w, bias, k, 3.0)
    assert torch.equal(ids, rids)  # random scores: no near-ties at this size
    assert (wts - rwts).abs().max() <= 1e-6 * 3
    # quant: the logits kernel also writes act_quant(x) for the FP8 experts (D = 192: a ragged last 128-block)
    qids, qwts, (xq, sx) = moe_route.route_triton(x, w, bias, k, 3.0, quant=True, **tuned)
    want_q, want_s = moe_route.act_quant_triton(x)
    assert torch.equal(qids, ids) and torch.equal(qwts, wts)
    assert bytes_equal(xq, want_q) and torch.equal(sx, want_s)
    # the K loop instead of the one K step read before the PDL wait (prefill's shapes): same bits in one MMA chain
    # (parts apply to the one-step form only)
    hids, hwts, (hxq, hsx) = moe_route.route_triton(x, w, bias, k, 3.0, quant=True, hoist=False, **tuned)
    assert torch.equal(hids, ids) and bytes_equal(hxq, xq) and torch.equal(hsx, sx)
    assert torch.equal(hwts, wts) if parts == 1 else (hwts - rwts).abs().max() <= 1e-6 * 3
    with pytest.raises(ValueError, match="xq must be"):
        experts._x_quant(x, (xq[:, :-1], sx))


def test_route_ties_to_the_lower_id():
    """x = 0: every sigmoid is 0.5, so the biased scores 0.5 + b tie wherever the biases do (12 distinct values over
    40 experts, some negative, a +0 and a -0): slot order = the stable sort of the scores, descending."""
    E, k = 40, 8
    bias = (torch.randint(-6, 6, (E,), generator=_gen(5)).float() / 8).to(DEV)
    bias[3], bias[11] = 0.0, -0.0
    ids, wts = moe_route.route_triton(torch.zeros(3, 64, dtype=torch.bfloat16, device=DEV), randn(E, 64, seed=2), bias,
                                      k, 2.0)
    want = torch.sort(-(0.5 + bias), stable=True).indices[:k]
    assert torch.equal(ids, want.expand(3, k))
    assert torch.equal(wts, torch.full_like(wts, 2.0 / k))  # every (0.5 + b) - b is 0.5 exactly, their sum 4


# ---------------------------------------------------------------------------------------------------------------
# the choose step's logits processing


@pytest.mark.parametrize("N,V", [(4, 5000), (1, 300)])
def test_process_logits(N, V):
    """One launch = process_logits_ref bit for bit (elementwise: exact on the GPU too, no FMA, division correctly
    rounded): signed zeros, infinities and NaN among the logits, penalties of either sign, a repetition penalty
    below and above 1, masked and unmasked rows, a reasoning budget spent, running and not, slots out of order."""
    g = _gen(N)
    B = 6
    x = torch.randn(N, V, generator=g) * 4
    x[:, :6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30])
    counts = torch.randint(0, 3, (N, V), generator=g, dtype=torch.int32) * (torch.rand(N, V, generator=g) < 0.2)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (N, -(-V // 32)), generator=g, dtype=torch.int32)
    slots = torch.tensor([3, 0, 5, 3][:N])
    thinking = torch.tensor([True, True, False, True][:N])
    left = torch.tensor([5, 0, -1, -2][:N])
    repetition = torch.tensor([1.0, 1.3, 0.7, 1.1, 1.0, 2.0])
    frequency = torch.tensor([0.0, 0.5, -0.25, 1.5, 0.0, 0.1])
    presence = torch.tensor([0.0, -0.5, 0.3, 0.75, 0.0, -2.0])
    prompt = torch.rand(B, V, generator=g) < 0.1
    masked = torch.tensor([False, True, False, True, False, True])
    think_end = torch.tensor([7, -1, 2, V - 1, -1, 0])
    args = [t.to(DEV) for t in (slots, counts.int(), mask, thinking, left, repetition, frequency, presence, prompt,
                                masked, think_end)]
    ref = K.process_logits_ref(x.to(DEV), *args)
    got = choose.process_logits_triton(x.to(DEV).clone(), *args)
    assert torch.equal(got.isnan(), ref.isnan())
    fin = ~ref.isnan()
    assert torch.equal(got[fin].view(torch.int32), ref[fin].view(torch.int32))
    assert ref.isneginf().any() and (ref == 0).any()  # the mask and the forced end took effect


@pytest.mark.parametrize("B,n", [(3, 5000), (1, 2)])
def test_uniform(B, n):
    """The draws' uniforms in one launch = uniform_ref bit for bit (integer arithmetic wrapping mod 2^64, then exact
    conversions): seeds up to 2^63 - 1, large counters, a column count off the block size; the known 1.0 (seed 2775,
    counter 0, column 502) among them."""
    seeds = torch.tensor([2775, 2 ** 63 - 1, 12345][:B])
    counters = torch.tensor([0, 2 ** 40 + 7, 4 * 999][:B])
    got = choose.uniform_triton(seeds.to(DEV), counters.to(DEV), n)
    ref = K.uniform_ref(seeds, counters, n)
    assert torch.equal(got.cpu().view(torch.int32), ref.view(torch.int32))
    if n > 502:
        assert got[0, 502] == 1.0


@pytest.mark.parametrize("P", [1, 3])
def test_advance(P):
    """The requests' state after their tokens in one launch = advance_ref: counts (a token twice in a row's tokens,
    -1 counted as token 0 as the reference clamps), the reasoning budget spent up to and including the end token and
    ended by it, tokens not emitted left out, a padding row (nothing emitted) writing nothing."""
    B, V = 5, 40
    g = _gen(P)
    counts = torch.randint(0, 3, (B, V), generator=g, dtype=torch.int32)
    thinking = torch.tensor([True, True, False, True, True])
    left = torch.tensor([10, 0, 3, 2 ** 62, 5])
    think_end = torch.tensor([7, 7, -1, 9, 7])
    slots = torch.tensor([3, 0, 2, 1])
    toks = torch.tensor([[5, 9, 5], [7, 2, 7], [-1, 3, 3], [4, 4, 4]])[:, :P]
    emitted = torch.tensor([[True, True, True], [True, True, False], [True, False, True], [False, False, False]])[:, :P]
    want = [t.clone() for t in (counts, thinking, left)]
    K.advance_ref(*want, think_end, slots, toks, emitted)
    got = [t.clone().to(DEV) for t in (counts, thinking, left)]
    choose.advance_triton(*got, think_end.to(DEV), slots.to(DEV), toks.to(DEV), emitted.to(DEV))
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)
    assert not torch.equal(want[0], counts) and not torch.equal(want[2], left)  # the state moved
    if P == 3:
        assert not want[1][3] and want[2][3] == 2 ** 62 - 2  # slot 3 (end 9): 5 and 9 spent, 9 ended it


@pytest.mark.parametrize("k", [1, 2, 3])
def test_draft_rows(k):
    """Each MTP depth's input rows in one launch = draft_rows_ref: tokens from the ring while final, then this step's
    drafts; the ring slots wrapping past S; a start clamped at 0 (a request whose last kept position is below k + j);
    the depth cache's lengths set on the slots only; the head's row of each request."""
    B, S = 5, 4 * k + 4
    g = _gen(k)
    ring_tok = torch.randint(0, 1000, (B, S), generator=g)
    slots = torch.tensor([3, 0, 4])
    last = torch.tensor([1, 37, S - 2])
    out = torch.randint(1000, 2000, (3, k), generator=g)
    for j in range(k):
        want_len, got_len = torch.full((B,), -7), torch.full((B,), -7).to(DEV)
        want = K.draft_rows_ref(slots, last, ring_tok, out, want_len, j, k)
        got = draft.draft_rows_triton(slots.to(DEV), last.to(DEV), ring_tok.to(DEV), out.to(DEV), got_len, j, k)
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b)
        assert torch.equal(got_len.cpu(), want_len)
        assert want_len[1] == -7 and want_len[3] == 0 and want_len[0] == 37 - k - j  # slot 3's start clamped
        assert (want[0] >= 1000).any() == (j > 0 or k > 1)  # a draft read past the final tokens
        q = k + 1 + j
        assert torch.equal(want[2], torch.arange(3) * q + last - (last - k - j).clamp(min=0))


# ---------------------------------------------------------------------------------------------------------------
# real shapes on a GPU (TP = 8 local sizes)


@gpu
@pytest.mark.parametrize("T", [17, 4096, 16384])
def test_gpu_moe_dispatch_real_shape(T):
    """One EP=8 rank's dispatch (44 of 352 experts, top-8) at prefill chunk lengths: the stable sort's bits."""
    ids = torch.stack([torch.randperm(352, generator=_gen(t))[:8] for t in range(T)]).to(DEV)
    for a, b in zip(moe_route.moe_dispatch_triton(ids, 88, 44), K.moe_dispatch_ref(ids, 88, 44)):
        assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize("T", [1, 16, 512, 8192])
def test_gpu_moe_fp8_real_shape(T):
    E, D, F, k = 44, 4096, 1536, 8
    g = _gen(T)
    ids = torch.stack([torch.randperm(352, generator=g)[:k] for _ in range(T)])
    ids = torch.where(ids < E, ids, -1).to(DEV)  # this rank owns global experts 0..43
    wts = torch.rand(T, k, generator=g).to(DEV)
    (w1, s1), (w3, s3), (w2, s2) = fp8_weights(E, F, D, 1), fp8_weights(E, F, D, 3), fp8_weights(E, D, F, 5)
    x = randn(T, D, seed=T)
    out = experts.moe_experts_triton(x, ids, wts, w1, w3, w2, s1, s3, s2, 7.0)
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
    out = experts.moe_experts_decode_triton(*args)
    ref = K.moe_experts_ref(*args)
    old = experts.moe_experts_sorted_triton(*args)
    assert out.dtype == torch.float32
    d = report(f"GPU moe decode T={T}", out, ref)
    assert d.max() <= 2e-2 * ref.float().abs().max()
    d = report(f"GPU moe decode vs sorted T={T}", out, old)
    assert d.max() <= 2e-2 * ref.float().abs().max()
    # 32 and 12 K blocks: the same additions in the same order (T = 1 defaults to 4); at 3 stages, as 4 K blocks an
    # iteration at T > 1's 4 stages exceed an H200 block's shared memory (240 KB)
    for ku in ((1, 1), (4, 4)):
        assert torch.equal(experts.moe_experts_decode_triton(*args, k_unroll=ku, num_stages=(3, 3)), out)
    # a register cap (T > 1) changes no arithmetic
    nocap = ((0, 0), (0, 0))
    cap = dict(moe_maxnreg=nocap if K.TUNING["moe_maxnreg"] != nocap else ((0, 0), (168, 168)))
    assert torch.equal(experts.moe_experts_decode_triton(*args, **cap), out)
    # TMA tiles or pointers: the same bits
    assert torch.equal(experts.moe_experts_decode_triton(*args, tma=True, **cap),
                       experts.moe_experts_decode_triton(*args, tma=False, **cap))


@gpu
def test_gpu_banded_attention_real_shape():
    """A sliding layer's prefill chunk at one TP=8 rank's shapes (8 query heads on 1 KV group, head_dim 192, window
    512, 2048 queries after 511 cached keys): the Triton kernel against the math path."""
    H, hd, W, n, m = 8, 192, 512, 2048, 511
    q, k, v = randn(H, n, hd, seed=1), randn(1, m + n, hd, seed=2), randn(1, m + n, hd, seed=3)
    out = K.banded_attention(q, k, v, m, W, hd ** -0.5)  # the Triton kernel on a GPU
    ref = K.banded_attention_ref(q, k, v, m, W, hd ** -0.5)
    ulps = ((out.float() - ref.float()).abs() / bf16_ulp(ref.float().abs().amax(-1, keepdim=True))).max().item()
    print(f"GPU banded attention: max {ulps:.2f} bf16 steps of the row's magnitude")
    assert ulps <= 2.0


@gpu
@pytest.mark.parametrize("ctx", [16384, 131072])
def test_gpu_sparse_decode_real_shape(ctx):
    S, G, Hg, hd, blk, topk = 2, 1, 8, 192, 8, 512
    args = _attn_case(S, 1, G, Hg, hd, blk, topk, ctx)
    ref = K.sparse_attention_ref(*args)
    for block_n in (64, 32):
        out = dsa_attention.sparse_attention_triton(*args, block_n=block_n)
        d = report(f"GPU sparse decode ctx={ctx} block_n={block_n}", out, ref)
        assert d.max() <= 1e-2 * ref.float().abs().max() + 2e-3
    gate = randn(S, G * Hg, seed=5)  # the output gate in the merge: torch's sigmoid within a bf16 step of its own
    want = K.gate_heads(out, gate)
    gated = dsa_attention.sparse_attention_triton(*args, block_n=32, gate=gate)
    d = report(f"GPU sparse decode ctx={ctx} gated", gated, want)
    assert d.max() <= 2 ** -7 * want.float().abs().max()


@gpu
@pytest.mark.parametrize("S,T,R", [(1, 1, 512), (4, 1, 4096), (1, 1, 131072), (32, 1, 16384), (1, 256, 16384),
                                   (1, 128, 32768)])
def test_gpu_select_regions_real_shape(S, T, R):
    """Decode (T = 1) at 4k / 32k / 1M / 128k context, prefill query chunks at 128k (whole rows) and 256k (rows
    split into chunks), topk = 512: random scores, ReLU-like exact zeros (ties), -0.0, NaN, -inf, causal n_hist;
    ids and valid identical to the reference."""
    g = torch.Generator(device=DEV).manual_seed(R + S)
    sc = torch.randn(S, 1, T, R, device=DEV, generator=g).clamp_min(0) * torch.rand(S, 1, T, 1, device=DEV,
                                                                                   generator=g)
    sc[0, 0, 0, ::3] = -0.0  # -0.0 among the zeros
    sc[0, 0, 0, 5], sc[-1, 0, -1, :100] = float("nan"), float("-inf")
    nh = (R - torch.arange(T, device=DEV) * (R // T) - torch.arange(S, device=DEV)[:, None] * 7).clamp_min(0)
    ids, valid = dsa_index.select_regions_triton(sc, nh, 512)
    rids, rvalid = K.select_regions_ref(sc, nh, 512)
    assert torch.equal(ids, rids) and torch.equal(valid, rvalid)
    if T == 1:  # short histories in the same cache (decode's short path up to SHORT_LANES regions, then chunk 0)
        lanes = dsa_index.SHORT_LANES
        nh = torch.tensor([100, lanes, lanes + 1, 3000], device=DEV)[torch.arange(S) % 4, None]
        ids, valid = dsa_index.select_regions_triton(sc, nh, 512)
        rids, rvalid = K.select_regions_ref(sc, nh, 512)
        assert torch.equal(ids, rids) and torch.equal(valid, rvalid)


@gpu
@pytest.mark.parametrize("span", [192, 64])
@pytest.mark.parametrize("B,R,p,Q", [(B, R, p, 1) for B in (1, 16) for R in (512, 515) for p in (100, 4096)]
                         + [(1, 515, 4096, 4), (16, 528, 100, 4)])
def test_gpu_sliding_decode_real_shape(B, R, p, Q, span):
    """A sliding layer's decode at TP = 8: H = 8 heads, one KV group, hd 192, W = 512; rotary span 192 (the sliding
    layers' table: partial_rotary_factor 1) or 64 (the DSA layers' 1/3); row b's Q tokens at positions p + 37 b + j (p = 4096: the ring has wrapped 8 times)."""
    import model
    H, G, hd, W = 8, 1, 192, 512
    tables = model.rope_table(span, 10000.0, None, p + 37 * B + Q, DEV)
    args = _sliding_case(B, H, G, hd, span // 2, W, R, [p + 37 * b + j for b in range(B) for j in range(Q)],
                         seed=B + R + p + Q, tables=tables, Q=Q)
    _check_sliding(args, H, hd, f"GPU sliding decode B={B} R={R} p={p} Q={Q} span={span}", 2.0)
    _check_sliding(args, H, hd, f"GPU sliding decode B={B} R={R} p={p} Q={Q} span={span} 4 warps", 2.0, num_warps=4)
    args[0] = args[0].clone()
    args[0][:, -H:] = 30.0
    _check_sliding(args, H, hd, f"GPU sliding decode B={B} R={R} p={p} Q={Q} span={span} gate 1", 1.0)
