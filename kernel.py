"""Compute kernels of the Step-5 decoder, each beside its pure-PyTorch reference.

model.py calls only the public functions below. Triton kernels run for CUDA tensors unless set_backend(False)
chose the references; CPU tensors always take the `*_ref` PyTorch reference. The references are the numerical
contract: they round to bf16 / e4m3 exactly where the deployed kernels do (those points decide the last bits and,
through DSA region selection and greedy argmax, eventually the tokens), and every kernel is tested against them
(tests/test_kernels.py; speed and real-shape checks: bench_kernels.py).
Each Triton kernel `_name_kernel` sits beside its reference with a `name_triton` launcher that checks shapes,
dtypes and contiguity, allocates, builds the grid and launches; the sections follow the model (norms and RoPE,
sliding-window attention, DSA, router and MoE, GEMMs, the TP reduction). Region selection is exact too: a counting radix
select of the K-th largest key plus one prefix-sum compaction, bit-identical to the reference's sorts. Decode
launches many small kernels: capture the decode step in a CUDA graph to see the kernel times rather than Triton's
Python launch overhead (~50-100 us per launcher call on the H200 machine).

Shape legend: T tokens, S sequences, G KV/provider groups, Hg heads per group, P indexer proxy dim,
R regions, K selected regions, E experts, F expert width, D hidden, M rows, N out features.
"""
import ast
import functools
import os
import threading

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma as gtma,
                                                            warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.language.nvidia.ampere import async_copy as gcp
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
QBLOCK = 128  # FP8 block: activations 1x128 along K, weights 128x128

_backend = {"triton": True}


def set_backend(use_triton: bool):
    """Triton kernels (True, the default) or the `*_ref` references (False) for CUDA tensors; CPU tensors always
    take the references."""
    _backend["triton"] = bool(use_triton)


def _triton(x: torch.Tensor) -> bool:
    return _backend["triton"] and x.is_cuda


# Launch choices: the decode step's each the winner of whole steps timed on the H200 (bench_decode.py --whole-rank
# --candidates re-times the step with the other values), prefill's dense_tiles set from its two kernels' rates
# (bench_prefill.py --tune sweeps it); an argument passed to a launcher overrides them. The numbers behind each
# value: PERF_LOG.md, "kernel.TUNING, key by key". A tuple's axis is named on its line; the decode experts' entries
# are (T == 1, T > 1) of the decode step's T tokens, each a (gate/up kernel, down kernel) pair where both have one.
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
    bad key or value. The benchmarks' and sass.py's --tune."""
    for item in items:
        key, _, value = item.partition("=")
        if key not in TUNING:
            raise ValueError(f"--tune {item}: no such choice; kernel.TUNING has {', '.join(TUNING)}")
        try:
            TUNING[key] = type(TUNING[key])(ast.literal_eval(value))
        except (ValueError, SyntaxError, TypeError) as e:
            raise ValueError(f"--tune {item}: {value!r} is not a {type(TUNING[key]).__name__} ({e})") from None


# --------------------------------------------------------------------------------------------------
# Triton plumbing shared by every kernel


#
# Under TRITON_INTERPRET=1 (the CPU tests) the triton 3.7 interpreter multiplies raw bits in bf16 arithmetic and
# bf16 tl.dot, truncates fp32->bf16 casts, mis-rounds fp32->fp8 casts and cannot call libdevice
# (triton-lang/triton#11584). So every kernel (a) loads bf16/e4m3 and widens to fp32 before arithmetic, (b) feeds
# tl.dot in DOT_DTYPE: fp32 under the interpreter (exact: bf16 and e4m3 products fit fp32) and bf16 on GPUs (tensor
# cores, fp32 accumulation, same products), (c) rounds to bf16 / e4m3 with the GPU's converts and, under the
# interpreter, with the integer helpers below (correct on both), and (d) uses libdevice's expf on GPUs (the function
# torch's CUDA exp calls) and tl.exp otherwise.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_HW_CONVERT = tl.constexpr(not _INTERPRET)  # a global the kernels read: a constexpr
_DOT = tl.float32 if _INTERPRET else tl.bfloat16
_PRECISE = not _INTERPRET
# Kernels whose reference spells out separately rounded products are compiled without FMA contraction.
_NO_FMA = {} if _INTERPRET else {"enable_fp_fusion": False}
# Launch shapes (tiles, pipeline stages, unrolling) as tuned on the H200; the interpreter's fewer, larger programs run
# faster on the CPU. tests/test_sm90_build.py turns it on under the interpreter to record the GPU's launches.
_GPU_LAUNCH = not _INTERPRET


@functools.cache
def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@functools.cache
def _sms() -> int:
    if not torch.cuda.is_available():
        return 1
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host ints. Launchers use this and _pow2, not triton.cdiv / triton.next_power_of_2: those are
    ConstexprFunctions (~3 us a call on the host) and a prefill pass makes thousands of such calls."""
    return -(-a // b)


def _pow2(n: int) -> int:
    """The least power of two >= n (0 for n = 0), as triton.next_power_of_2."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _unspecialised(kernel, *names, unaligned=(), jit=triton.jit):
    """The same kernel with its length-like arguments `names` unspecialised. Triton compiles a kernel once per set of
    constexprs and integer classes (== 1, divisible by 16, other) and pointer alignments, so a prefill whose lengths
    vary would compile anew for new lengths; its launches go through this one (a few extra instructions for the lost
    divisibility), and the specialised kernel keeps serving the decode step's fixed shapes, compiled at start-up.
    unaligned: pointers whose 16-byte alignment varies with a slice's first token. jit: gluon.jit for a Gluon
    kernel."""
    return jit(kernel.fn, do_not_specialize=names, do_not_specialize_on_alignment=unaligned)


# Launches of more rows than this are prefill's (a decode step has at most 16 rows a kernel, or 16 x (K + 1) in a
# speculative verify step, which start-up compiles too): they take the unspecialised kernels, and their launch
# choices depend on the power of two above their rows only (_launch_rows), so the lengths prefill_warm_lengths
# lists reach every variant.
PREFILL_ROWS = 16


def _launch_rows(n: int) -> int:
    return n if n <= PREFILL_ROWS else _pow2(n)


def prefill_warm_lengths(max_context: int, chunk: int, blk: int, topk: int) -> list:
    """(first position, tokens) of the prefill passes into one cache row that reach every launch variant of a prefill
    of up to max_context positions in chunks of up to `chunk` tokens: 1, 2, 4, 8 and 16 tokens (the specialised
    kernels' integer classes and the decode experts' slot blocks), each power of two above (the launch choices of
    _launch_rows), the chunk; then 16, 64 and 256 queries at contexts in each size class of the region selection
    (prefill's tiles of the scores and the selection: indexer_scores_triton, select_regions_triton; the first passes'
    queries select every region and those below dense_tiles_end take dense_prefix's tiles, the rest the per-query
    sparse attention)."""
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


def _pdl() -> dict:
    """Programmatic dependent launch wherever it exists (sm90 GPUs): a launch may begin while its predecessor still
    runs, hiding launch latency and CTA setup (the decode step 6% faster); _pdl_enter keeps every access ordered."""
    return {"PDL": True, "launch_pdl": True} if not _INTERPRET and _sm90() else {"PDL": False}


@triton.jit
def _pdl_enter(PDL: tl.constexpr):
    """Every kernel's first statement (_pdl): wait for the predecessor grid, then release the successor."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def _check(cond, msg):
    """ValueError(msg) unless cond. msg may be a function that builds the message, called only then: a prefill
    chunk runs dozens of checks on the host, and formatting shapes into an f-string ahead of time cost ~2.5 us each."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def _check_tensor(name, t, dtype, ndim=None, contiguous=True):
    """ValueError naming `name` unless t is a dtype tensor (of ndim dims; contiguous). One test on the way through and
    the message built only on failure: a prefill pass makes thousands of these checks."""
    if (isinstance(t, torch.Tensor) and t.dtype == dtype and (ndim is None or t.dim() == ndim)
            and (not contiguous or t.is_contiguous())):
        return
    _check(isinstance(t, torch.Tensor), lambda: f"{name} must be a tensor, got {type(t).__name__}")
    _check(t.dtype == dtype, lambda: f"{name} must be {dtype}, got {t.dtype}")
    _check(ndim is None or t.dim() == ndim, lambda: f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    _check(False, lambda: f"{name} must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")


@triton.jit
def _bf16_round(x):
    """fp32 -> nearest-even bf16 value, returned as fp32 (a later .to(bf16) is then exact on every backend). GPUs:
    the convert (cvt.rn, one instruction per two values; the integer form below is ~5 per value)."""
    if _HW_CONVERT:
        return x.to(tl.bfloat16).to(tl.float32)
    b = x.to(tl.int32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)  # round half to even on the 16 dropped bits (finite inputs)
    b = (b >> 16) << 16
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_bits(x):
    """fp32 -> float8_e4m3fn bit pattern (uint8): clamp to +-448, round to nearest even, integer ops only.

    Normal range (|x| >= 2^-6): round the fp32 mantissa to 3 bits on the bit pattern (a carry bumps the exponent),
    then rebias 127 -> 7. Subnormal range: m = rne(|x| * 2^9), m in 0..8 (8 is the smallest normal, code 0x08).
    """
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    b = x.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    e = a >> 23
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    mant = (a & 0x7FFFFF) | 0x800000
    sh = tl.minimum(tl.maximum(141 - e, 21), 31)  # |x| = mant * 2^(e-150); m = mant >> (141 - e), rounded
    q = mant >> sh
    rem = mant - (q << sh)
    half = (rem * 0 + 1) << (sh - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    mag = tl.minimum(tl.where(e >= 121, normal, q), 0x7E)
    return (sign | mag).to(tl.uint8)


@triton.jit
def _to_e4m3(x):
    """fp32 -> float8_e4m3fn with torch's saturating round-to-nearest-even cast (to_e4m3). GPUs: the convert, which
    saturates itself (cvt.rn.satfinite: what would round past 448 becomes 448, as after a clamp, so no clamp is
    spent); the interpreter: _e4m3_bits (tests/test_kernels.py checks both against torch)."""
    if _HW_CONVERT:
        return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        return _e4m3_bits(x).to(tl.float8e4nv, bitcast=True)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32/bf16 -> float8_e4m3fn, round-to-nearest-even, saturating at +-448.

    Overflow is our choice (the deployed code casts without clamping, so its overflow depends on the device):
    saturate. The CUDA cast turns |x| >= 464 into NaN while the CPU cast saturates; clamping first gives one
    answer on both devices and matches Hopper's saturating in-register conversion. Post-norm indexer values sit
    far below 448, so this never fires on sane inputs.
    """
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


# --------------------------------------------------------------------------------------------------
# Norms and RoPE: RMSNorm; per-head norm + partial NEOX RoPE


def rms_norm_ref(x, w, eps, out_dtype=None):
    """Zero-centred RMSNorm over the last dim in fp32: x * rsqrt(mean(x^2) + eps) * (1 + w), one rounding to
    out_dtype (default: x's dtype). x [T, D] fp32 residual or bf16; w [D] fp32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (w + 1.0)
    return y.to(out_dtype or x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, x_stride, out_stride, eps, OUT_BF16: tl.constexpr,
                     BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One row per program: y = x * (1 / sqrt(sum(x^2) / D + eps)) * (w + 1), rounded once to the output dtype (one
    launch where the PyTorch form takes ~7)."""
    _pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    ok = d < D
    x = tl.load(x_ptr + row * x_stride + d, mask=ok, other=0.0).to(tl.float32)
    r = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps))
    w = tl.load(w_ptr + d, mask=ok, other=0.0)
    y = x * r * (w + 1.0)
    if OUT_BF16:
        tl.store(out_ptr + row * out_stride + d, _bf16_round(y).to(tl.bfloat16), mask=ok)
    else:
        tl.store(out_ptr + row * out_stride + d, y, mask=ok)


def rms_norm_triton(x, w, eps, out_dtype=None):
    _check_tensor("x", x, x.dtype, ndim=2, contiguous=False)
    _check(x.dtype in (torch.float32, torch.bfloat16) and x.stride(1) == 1,
           lambda: f"x must be fp32/bf16 with contiguous rows, got {x.dtype} strides {x.stride()}")
    T, D = x.shape
    _check_tensor("w", w, torch.float32, ndim=1)
    _check(w.numel() == D, lambda: f"w must be [{D}], got {tuple(w.shape)}")
    out_dtype = out_dtype or x.dtype
    _check(out_dtype in (torch.float32, torch.bfloat16), lambda: f"out_dtype must be fp32 or bf16, got {out_dtype}")
    out = torch.empty((T, D), dtype=out_dtype, device=x.device)
    if T:
        _rms_norm_kernel[(T,)](x, w, out, D, x.stride(0), out.stride(0), float(eps),
                               OUT_BF16=out_dtype == torch.bfloat16, BLOCK_D=_pow2(D),
                               num_warps=8 if D >= 2048 else 4, **_pdl())
    return out


def rms_norm(x, w, eps, out_dtype=None):
    if _triton(x):
        return rms_norm_triton(x, w, eps, out_dtype)
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


@triton.jit
def _rotate(a, b, c, s):
    """NEOX rotation of bf16-valued fp32 pairs (norm_rope_ref): products of bf16 values are exact in fp32, so
    a*c - b*s and a*s + b*c are each rounded once, = the spec's fma(a, s, b*c) in plain fp32."""
    return a * c - b * s, a * s + b * c


@triton.jit
def _norm_params(w_ptr, b_ptr, cols, D: tl.constexpr, LAYERNORM: tl.constexpr):
    """The norm's weight (and LAYERNORM bias) at cols, [1, n] fp32: loaded apart from x so that a kernel can read them
    before its PDL wait (they are parameters: no kernel writes them)."""
    c_ok = cols < D
    w = tl.load(w_ptr + cols, mask=c_ok, other=0.0)[None, :]
    return w, tl.load(b_ptr + cols, mask=c_ok, other=0.0)[None, :] if LAYERNORM else w


@triton.jit
def _norm_slice(x_ptr, base, cols, r_ok, D: tl.constexpr, mu, r, wb, LAYERNORM: tl.constexpr):
    """bf(norm) of x's columns cols, wb = _norm_params at those columns."""
    x = tl.load(x_ptr + base + cols[None, :], mask=r_ok[:, None] & (cols < D)[None, :], other=0.0).to(tl.float32)
    if LAYERNORM:
        n = (x - mu[:, None]) * r[:, None] * wb[0] + wb[1]
    else:
        n = (x * r[:, None]) * (wb[0] + 1.0)
    return _bf16_round(n)


@triton.jit
def _round_out(x, E4M3: tl.constexpr):
    """bf(x) as bf16; E4M3: rounded on to e4m3 (torch's saturating cast of the bf16 value), kept as bf16 (exact)."""
    y = _bf16_round(x)
    if E4M3:
        y = _to_e4m3(y).to(tl.float32)
    return y.to(tl.bfloat16)


@triton.jit
def _norm_rope_rows(pid, x_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, ROWS, NH, stride_xt, eps,
                    D: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, LAYERNORM: tl.constexpr, GATHER: tl.constexpr,
                    PDL: tl.constexpr, E4M3: tl.constexpr = False):
    """BLOCK_R head rows (token t = row // NH) of program pid: norm, round to bf16, NEOX-rotate the first 2*HALF dims;
    E4M3: each output then rounded on to its e4m3 value (exact in bf16; the indexer's scores read q so: norm_rope_jobs).

    RMS: n = bf((x * r) * (w + 1)), r = 1/sqrt(mean(x^2) + eps); LayerNorm: n = bf(((x - mu) * r) * w + b),
    r = 1/sqrt(E[x^2] - mu^2 + eps). Rotation on the bf16 values a = n[j], b = n[j + HALF]:
    first = bf(a*c - b*s) (products rounded separately: compiled without FMA contraction),
    second = bf(fma(a, s, b*c)) (_rotate: exact products, so plain fp32 adds, as the reference).
    Each norm value is elementwise, so recomputing it per slice equals storing and re-reading the bf16 row.
    The weights, bias, positions and table rows are read before the PDL wait: the positions are written before any
    layer's kernels (by torch ops, which trigger no early launch), never by the predecessor, which writes x.
    """
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < ROWS
    tok = rows // NH
    j = tl.arange(0, BLOCK_HALF)
    j_ok = r_ok[:, None] & (j[None, :] < HALF)
    trow = tl.load(pos_ptr + tok, mask=r_ok, other=0) if GATHER else tok  # the table row of each token
    c = tl.load(cos_ptr + trow[:, None] * HALF + j[None, :], mask=j_ok, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + trow[:, None] * HALF + j[None, :], mask=j_ok, other=0.0).to(tl.float32)
    wb_a = _norm_params(w_ptr, b_ptr, j, D, LAYERNORM=LAYERNORM)
    wb_b = _norm_params(w_ptr, b_ptr, HALF + j, D, LAYERNORM=LAYERNORM)
    if BLOCK_REST > 0:
        cols = 2 * HALF + tl.arange(0, BLOCK_REST)
        wb_r = _norm_params(w_ptr, b_ptr, cols, D, LAYERNORM=LAYERNORM)
    _pdl_enter(PDL)
    # x rows may be strided per token (q/k are column slices of the packed QKV output); out is contiguous
    xbase = tok.to(tl.int64)[:, None] * stride_xt + (rows % NH).to(tl.int64)[:, None] * D
    base = rows.to(tl.int64)[:, None] * D
    d = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + xbase + d[None, :], mask=r_ok[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
    one = tl.full((BLOCK_R,), 1.0, tl.float32)
    if LAYERNORM:
        mu = tl.sum(x, axis=1) / D
        var = tl.sum(x * x, axis=1) / D - mu * mu
        r = tl.math.div_rn(one, tl.sqrt_rn(var + eps))
    else:
        mu = tl.zeros((BLOCK_R,), dtype=tl.float32)
        r = tl.math.div_rn(one, tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps))
    a = _norm_slice(x_ptr, xbase, j, r_ok, D, mu, r, wb_a, LAYERNORM=LAYERNORM)
    b = _norm_slice(x_ptr, xbase, HALF + j, r_ok, D, mu, r, wb_b, LAYERNORM=LAYERNORM)
    first, second = _rotate(a, b, c, s)
    tl.store(out_ptr + base + j[None, :], _round_out(first, E4M3), mask=j_ok)
    tl.store(out_ptr + base + HALF + j[None, :], _round_out(second, E4M3), mask=j_ok)
    if BLOCK_REST > 0:  # dims past the rotary span keep the norm value
        n = _norm_slice(x_ptr, xbase, cols, r_ok, D, mu, r, wb_r, LAYERNORM=LAYERNORM)
        tl.store(out_ptr + base + cols[None, :], _round_out(n, E4M3), mask=r_ok[:, None] & (cols[None, :] < D))


@triton.jit(do_not_specialize=["e0", "e1", "e2", "rows0", "rows1", "rows2", "rows3"])  # bounds, whatever the rows
def _norm_rope_jobs_kernel(pos_ptr, eps, e0, e1, e2,
                           x0, w0, b0, c0, s0, o0, rows0, nh0, sx0, x1, w1, b1, c1, s1, o1, rows1, nh1, sx1,
                           x2, w2, b2, c2, s2, o2, rows2, nh2, sx2, x3, w3, b3, c3, s3, o3, rows3, nh3, sx3,
                           D0: tl.constexpr, H0: tl.constexpr, L0: tl.constexpr, BD0: tl.constexpr,
                           BH0: tl.constexpr, BR0: tl.constexpr, D1: tl.constexpr, H1: tl.constexpr,
                           L1: tl.constexpr, BD1: tl.constexpr, BH1: tl.constexpr, BR1: tl.constexpr,
                           D2: tl.constexpr, H2: tl.constexpr, L2: tl.constexpr, BD2: tl.constexpr,
                           BH2: tl.constexpr, BR2: tl.constexpr, D3: tl.constexpr, H3: tl.constexpr,
                           L3: tl.constexpr, BD3: tl.constexpr, BH3: tl.constexpr, BR3: tl.constexpr,
                           JOBS: tl.constexpr, GATHER: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr,
                           E0: tl.constexpr = False, E1: tl.constexpr = False, E2: tl.constexpr = False,
                           E3: tl.constexpr = False):
    """Up to 4 norm_rope_ref problems in one launch (norm_rope_jobs): job i takes programs e(i-1) .. e(i)-1, with its
    own shapes (D, HALF, LAYERNORM, BLOCK_D, BLOCK_HALF, BLOCK_REST) and Ei (its outputs rounded on to e4m3 values:
    _norm_rope_rows' E4M3); every job has the bits it has alone. GATHER: the table rows are pos[t]'s."""
    pid = tl.program_id(0)
    if pid < e0:
        _norm_rope_rows(pid, x0, w0, b0, c0, s0, pos_ptr, o0, rows0, nh0, sx0, eps, D0, H0, BLOCK_R, BD0, BH0, BR0,
                        LAYERNORM=L0, GATHER=GATHER, PDL=PDL, E4M3=E0)
    elif JOBS > 1:
        if pid < e1:
            _norm_rope_rows(pid - e0, x1, w1, b1, c1, s1, pos_ptr, o1, rows1, nh1, sx1, eps, D1, H1, BLOCK_R, BD1, BH1,
                            BR1, LAYERNORM=L1, GATHER=GATHER, PDL=PDL, E4M3=E1)
        elif JOBS > 2:
            if pid < e2:
                _norm_rope_rows(pid - e1, x2, w2, b2, c2, s2, pos_ptr, o2, rows2, nh2, sx2, eps, D2, H2, BLOCK_R, BD2,
                                BH2, BR2, LAYERNORM=L2, GATHER=GATHER, PDL=PDL, E4M3=E2)
            elif JOBS > 3:
                _norm_rope_rows(pid - e2, x3, w3, b3, c3, s3, pos_ptr, o3, rows3, nh3, sx3, eps, D3, H3, BLOCK_R, BD3,
                                BH3, BR3, LAYERNORM=L3, GATHER=GATHER, PDL=PDL, E4M3=E3)


_norm_rope_jobs_prefill = _unspecialised(_norm_rope_jobs_kernel, "e0", "e1", "e2", "rows0", "rows1", "rows2",
                                         "rows3", "sx0", "sx1", "sx2", "sx3")


def _norm_rope_launch(x, weight, cos, sin, bias, pos):
    """A norm_rope job's checks -> (its arguments, out the sixth; its shapes' constexprs)."""
    _check_tensor("x", x, torch.bfloat16, ndim=3, contiguous=False)
    T, NH, D = x.shape
    _check(x.stride(2) == 1 and x.stride(1) == D, lambda: f"x must have contiguous heads (strides {x.stride()})")
    _check_tensor("weight", weight, torch.float32, ndim=1)
    _check(weight.numel() == D, lambda: f"weight must be [{D}], got {tuple(weight.shape)}")
    if bias is not None:
        _check_tensor("bias", bias, torch.float32, ndim=1)
        _check(bias.numel() == D, lambda: f"bias must be [{D}], got {tuple(bias.shape)}")
    _check_tensor("cos", cos, torch.bfloat16, ndim=2)
    _check_tensor("sin", sin, torch.bfloat16, ndim=2)
    half = cos.shape[1]
    if pos is not None:
        _check_tensor("pos", pos, torch.int64, ndim=1)
        _check(pos.numel() == T, lambda: f"pos must be [T={T}], got {tuple(pos.shape)}")
    _check(cos.shape == sin.shape and (pos is not None or cos.shape[0] == T) and 2 * half <= D,
           lambda: f"cos/sin must be [T={T} (or the whole table with pos), half <= {D // 2}], got {tuple(cos.shape)}, "
           f"{tuple(sin.shape)}")
    out = torch.empty((T, NH, D), dtype=x.dtype, device=x.device)
    args = (x, weight, bias if bias is not None else weight, cos, sin, out, T * NH, NH, x.stride(0))
    shapes = (D, half, bias is not None, _pow2(D), _pow2(max(half, 1)),
              _pow2(D - 2 * half) if D > 2 * half else 0)
    return args, shapes


_NORM_ROPE_ROWS = 16  # head rows per program


def norm_rope_triton(x, weight, cos, sin, eps, bias=None, pos=None):
    """Triton norm_rope_ref (a launch of one job)."""
    return norm_rope_jobs_triton([(x, weight, cos, sin, bias)], eps, pos)[0]


def norm_rope_jobs_triton(jobs, eps, pos, e4m3=()):
    """norm_rope_jobs in one launch (_norm_rope_jobs_kernel); pos None: cos and sin are the tokens' rows."""
    _check(1 <= len(jobs) <= 4, lambda: f"norm_rope_jobs takes 1 to 4 jobs, got {len(jobs)}")
    if pos is not None:
        _check_tensor("pos", pos, torch.int64, ndim=1)
    launches = [_norm_rope_launch(x, w, c, s_, b, pos) for x, w, c, s_, b in jobs]
    ends, args, shapes = [], [], []
    for a, sh in launches:
        ends.append((ends[-1] if ends else 0) + _cdiv(a[6], _NORM_ROPE_ROWS))
        args += a
        shapes += sh
    pad = 4 - len(jobs)  # unused slots: the first job's arguments, no programs
    args += launches[0][0] * pad
    shapes += launches[0][1] * pad
    ends += [ends[-1]] * pad
    const = {f"{k}{i}": v for i in range(4) for k, v in zip(("D", "H", "L", "BD", "BH", "BR"), shapes[6 * i:6 * i + 6])}
    if ends[-1]:
        kern = _norm_rope_jobs_kernel if jobs[0][0].shape[0] <= PREFILL_ROWS else _norm_rope_jobs_prefill
        kern[(ends[-1],)](pos if pos is not None else args[5], float(eps), *ends[:3], *args, **const,
                                            JOBS=len(jobs), GATHER=pos is not None,
                                            BLOCK_R=_NORM_ROPE_ROWS, **{f"E{i}": i in e4m3 for i in range(4)},
                                            num_warps=4, **_NO_FMA, **_pdl())
    return [a[5] for a, _ in launches]


def norm_rope_jobs(jobs, eps, pos, e4m3=()):
    """[norm_rope_ref(x, weight, cos, sin, eps, bias, pos) for (x, weight, cos, sin, bias) in jobs] (1 to 4 of them,
    all at the positions pos): one launch on the Triton path (a DSA layer's q, k, indexer q and indexer k; the step
    -2.4% against four launches, PERF_LOG 2026-12-02). e4m3: the indices of jobs whose outputs are then rounded to
    their e4m3 values (as to_e4m3; kept in bf16, which holds them exactly): the indexer's q, which the scores read
    only so (indexer_scores' q_e4m3)."""
    _check(1 <= len(jobs) <= 4, lambda: f"norm_rope_jobs takes 1 to 4 jobs, got {len(jobs)}")
    if _triton(jobs[0][0]):
        return norm_rope_jobs_triton(jobs, eps, pos, e4m3)
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
    faster than 64 / 32 / 4 at 4k and 16k tokens (H100, PERF_LOG 2026-12-05 (night)). GPU: block_n and head_dim's
    pieces of at least 16 (tl.dot's smallest)."""
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
    _check(HG & (HG - 1) == 0 or not _GPU_LAUNCH,
           lambda: f"banded attention: {HG} query heads per KV group (GPU: a power of 2)")
    BLOCK_Q = max(1, rows // HG) if _GPU_LAUNCH else _pow2(max(1, 16 // HG))
    # head_dim = DA + the rest, each piece a power of two (192 = 128 + 64; 128 = 64 + 64: tl.dot's K is at least 16)
    DA = 1 << (D - 1).bit_length() - 1
    if n:
        _banded_attn_prefill[(_cdiv(n, BLOCK_Q), G)](
            q, k, v, out, gate if gate is not None else out, n, L, int(off), int(window), float(scale), q.stride(0),
            q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            gate.stride(0) if gate is not None else 0, HG=HG, D=D, BLOCK_Q=BLOCK_Q, BLOCK_N=block_n, DA=DA,
            BLOCK_DB=max(1, _pow2(D - DA)), DOT_DTYPE=_DOT, PRECISE=_PRECISE, GATE=gate is not None,
            num_warps=num_warps, num_stages=num_stages if _GPU_LAUNCH else 1, **_pdl())
    return out


def banded_attention(q, k, v, off, window, scale, gate=None, out=None):
    """banded_attention_ref's attention (q [H, n, hd]), then with gate [n, H] (the bf16 logits) the output gate
    (gate_heads), written into out [H, n, hd] (e.g. a transposed view of the layer's [T, H, hd] output; default new).
    The Triton kernel on the Triton path (8k tokens 0.21 ms against SDPA's math path's 5.78, PERF_LOG 2026-12-01),
    else the reference in chunks of 2048 queries, so that its [queries, keys] mask and logits stay small."""
    if _triton(q):
        return banded_attention_triton(q, k, v, off, window, scale, gate, out)
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
                          n_groups, split_len=32, num_warps=None, rows=None):
    """Triton sliding_decode_ref: 2 launches (3 for Q > 1 tokens per row: the keys are written first). rows [B] int64:
    the ring row of each of the step's rows (default: every ring row, in order). split_len:
    ring slots per program; it depends only on R (never on the batch or Q), so a token's reduction order and result
    do not depend on the batch size (32: 16 / 64 / 128 were slower at batch 1 or 16, PERF_LOG 2026-12-01).
    num_warps of the attention launch: default TUNING["sliding_warps"]."""
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
    warps = TUNING["sliding_warps"][T * G * splits >= _sms()]
    block_n = max(16, min(64, _pow2(split_len)))
    if Q > 1:
        _sliding_write_kernel[(T * G,)](qkvg, pos, rows, ring_k, ring_v, k_norm_w, cos, sin, G, R, Q, H,
                                        qkvg.stride(0), float(eps), **blocks, **_pdl())
    _sliding_attn_kernel[(T * G, splits)](
        qkvg, pos, rows, ring_k, ring_v, q_norm_w, k_norm_w, cos, sin, po, pml, G, R, window, Q, qkvg.stride(0), float(eps),
        float(scale), NEW_IN_REGS=Q == 1, HG=HG, SPLITS=splits, SPLIT_LEN=split_len,
        BLOCK_H=_heads_block(HG), BLOCK_N=block_n,
        DOT_DTYPE=_DOT, PRECISE=_PRECISE, HOIST=Q == 1 and split_len <= block_n,
        **dict(blocks, num_warps=num_warps or warps), **_pdl())
    _sliding_merge_kernel[(T * G, HG)](po, pml, qkvg, out, G, qkvg.stride(0), HG=HG, D=hd, SPLITS=splits,
                                       BLOCK_S=_pow2(splits), BLOCK_D=blocks["BLOCK_D"],
                                       PRECISE=_PRECISE, num_warps=4, **_pdl())
    return out


def sliding_decode(qkvg, pos, ring_k, ring_v, q_norm_w, k_norm_w, cos, sin, eps, scale, window, n_heads, n_groups,
                   rows=None):
    if _triton(qkvg):
        return sliding_decode_triton(qkvg, pos, ring_k, ring_v, q_norm_w, k_norm_w, cos, sin, eps, scale, window,
                                     n_heads, n_groups, rows=rows)
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
                                    **_pdl())
    return out.view(FP8)


def region_summary(k, z):
    if _triton(k):
        return region_summary_triton(k, z)
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
                                      **_pdl())


def dsa_cache_write(k, v, ki, zi, pos, ck, cv, pk, pz, summ, rows=None):
    if _triton(k):
        return dsa_cache_write_triton(k, v, ki, zi, pos, ck, cv, pk, pz, summ, rows=rows)
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
    """Triton indexer_scores_ref. block_t / block_r / num_warps: tile overrides (bench_kernels.py sweep_indexer; each
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
    many = S * G * _cdiv(min(R, 4096), 64) > 2 * _sms()
    BLOCK_R = block_r or ((128 if many else 64) if T <= 16 and _GPU_LAUNCH and not prefill else 128)
    if out.numel():
        grid = (S * G, _cdiv(T, BLOCK_T), _cdiv(R, BLOCK_R))
        kern = _indexer_scores_prefill if prefill else _indexer_scores_kernel
        kern[grid](q, w, summ, out, rows if rows is not None else out, n_hist if n_hist is not None else out, T, G, R,
                   P, int(blk), float(w_scale), q.stride(0), q.stride(1), q.stride(2), w.stride(0), w.stride(1),
                   summ.stride(0), n_hist.stride(0) if n_hist is not None else 0, HG=HG, BLOCK_T=BLOCK_T,
                   BLOCK_R=BLOCK_R, BLOCK_P=_pow2(P), BLOCK_PC=block_pc or _pow2(P),
                   DOT_DTYPE=_DOT, Q_E4M3=q_e4m3, ROWS=rows is not None, SKIP=n_hist is not None,
                   num_warps=num_warps, **_NO_FMA, **_pdl())
    return out


def indexer_scores(q, w, summ, w_scale=1.0, q_e4m3=False, rows=None, n_hist=None, blk=1, prefill=False):
    """q_e4m3: q holds e4m3 values (norm_rope_jobs' e4m3): the Triton kernel skips their rounding (the reference's
    to_e4m3 leaves them as they are). n_hist [S, T] (positions, with blk their region size, as select_regions takes
    them): the kernel skips region tiles past every query of the tile's history, which select_regions never reads
    (the reference computes them all). prefill: indexer_scores_triton's."""
    if _triton(q):
        return indexer_scores_triton(q, w, summ, w_scale, q_e4m3=q_e4m3, rows=rows, n_hist=n_hist, blk=blk,
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
                        num_warps=max(4, min(16, BLOCK // 512)), **_pdl())
        if final:
            return ids, valid
        src, src_id, n = key_out, id_out, C * K


def select_regions(scores, n_hist, topk, blk=1, prefill=False):
    if _triton(scores):
        return select_regions_triton(scores, n_hist, topk, blk, prefill=prefill)
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
                            num_stages=2, rows=None, prefill=False, out=None):
    """Triton sparse_attention_ref for decode (T = 1) and prefill (T queries). `splits` (default: enough programs
    to fill the GPU) divides each query's key slots over programs merged by log-sum-exp (which applies the gate, as
    one split's program does itself); other split boundaries give tolerance-level differences. block_n: key slots
    per tile (default: TUNING["sparse_block_n"] for decode, whose step chose it; 32 for prefill, 7% faster than 64 at
    4,096 queries of 8k-128k contexts: PERF_LOG 2026-12-05 (night)). num_stages: of the GPU launches (3 or 4:
    within 0.3% of the step).
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
    BLOCK_N = block_n or (32 if prefill else TUNING["sparse_block_n"])
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
        PRECISE=_PRECISE, num_warps=4, num_stages=num_stages if _GPU_LAUNCH else 1, **_pdl())
    if splits > 1:
        _attn_merge_kernel[(n_rows, HG)](po, pml, out, gate if gate is not None else out, T, G, HG, q.stride(0),
                                       q.stride(1), q.stride(2), q.stride(3), gate.stride(0) if gate is not None else 0,
                                       HEAD_DIM=hd, SPLITS=splits, BLOCK_S=_pow2(splits),
                                       BLOCK_H=BLOCK_H, BLOCK_D=_pow2(hd), GATE=gate is not None,
                                       PRECISE=_PRECISE, num_warps=4, **_pdl())
    return out


def sparse_attention(q, k, v, ids, valid, pos, blk, scale, gate=None, rows=None, prefill=False, out=None):
    """sparse_attention_ref (then the gate), written into out (q's shape and strides) when given."""
    if _triton(q):
        return sparse_attention_triton(q, k, v, ids, valid, pos, blk, scale, gate=gate, rows=rows, prefill=prefill,
                                       out=out)
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
    positions (H100, PERF_LOG 2026-12-05 (night))."""
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
        GATE=gate is not None, PRECISE=_PRECISE, num_warps=num_warps, num_stages=2 if _GPU_LAUNCH else 1, **_pdl())
    return out


def dense_prefix(q, k, v, p0, blk, scale, gate=None, ids=None, valid=None, out=None):
    """Attention of prefill queries q [1, T, G, Hg, hd] at positions p0 .. p0 + T - 1 over every history region (ids
    None) or their selection (see dense_prefix_ref), then the output gate (gate [T, G*Hg] logits: gate_heads),
    written into out (like q; default new). The reference in chunks of 256 queries (it gathers every query's keys)."""
    if _triton(q):
        return dense_prefix_triton(q, k, v, p0, blk, scale, ids, valid, gate, out)
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
    keys. TUNING["dense_tiles"] such spans (the two kernels' measured rates: PERF_LOG 2026-12-05 (night))."""
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


def route_triton(x, w, bias, k, scale, renorm=True, quant=False, hoist=None):
    """Triton route_ref; quant: also act_quant_ref(x) -> (ids, weights, (e4m3 [T, D], fp32 [T, D/128])), written by
    the logits kernel (the routed FP8 experts' input: one launch less per MoE layer). hoist: the logits kernel's HOIST
    (default: wherever its K split is one power-of-two step whose weight tile fits in registers; False: the K loop)."""
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
    BLOCK_T, BLOCK_E, BLOCK_K = 16, (TUNING["router_block_e"] if _GPU_LAUNCH else 128), (128 if _GPU_LAUNCH else 256)
    warps, stages = 4, (3 if _GPU_LAUNCH else 1)
    if prefill and _GPU_LAUNCH:  # decode's small tiles fill the GPU at T <= 16; prefill's reload x and w from L2
        BLOCK_T, BLOCK_E, BLOCK_K, warps, stages = TUNING["router_prefill"]
    # split K until the GEMM has ~2 programs per SM; partial sums are added in a fixed order (deterministic); prefill
    # rows as the power of two above them (_launch_rows)
    tiles = _cdiv(_launch_rows(T), BLOCK_T) * _cdiv(E, BLOCK_E)
    k_splits = max(1, min(_cdiv(264, tiles), _cdiv(D, 4 * BLOCK_K), 16))
    split_len = _cdiv(_cdiv(D, k_splits), BLOCK_K) * BLOCK_K
    k_splits = _cdiv(D, split_len)
    part = torch.empty(k_splits, T, E, dtype=torch.float32, device=x.device)
    # one K step of split_len columns, its weight tile (<= 32 KB on a GPU) held in registers across the wait
    if hoist is None:
        hoist = split_len == _pow2(split_len) and (split_len * BLOCK_E <= 16384 or not _GPU_LAUNCH)
    (_router_logits_prefill if prefill else _router_logits_kernel)[(_cdiv(T, BLOCK_T), _cdiv(E, BLOCK_E),
                                                                    k_splits)](
        x, w, part, xq, sx, T, E, D, split_len, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E,
        BLOCK_K=split_len if hoist else BLOCK_K, QUANT=bool(quant), QUANT_T=min(BLOCK_T, _pow2(T)),
        DOT_DTYPE=_DOT, HOIST=hoist, PARTS=TUNING["router_parts"] if hoist else 1, num_warps=warps,
        num_stages=stages, **_pdl())
    (_router_select_prefill if prefill else _router_select_kernel)[(T,)](
        part, bias, ids, wts, T, E, float(scale), K_SPLITS=k_splits, TOPK=k, RENORM=renorm,
                                BLOCK_E=_pow2(E), BLOCK_TOPK=_pow2(k),
                                PRECISE=_PRECISE, num_warps=4, **_NO_FMA, **_pdl())
    return done


def route(x, w, bias, k, scale, renorm=True, quant=False):
    """-> (ids, weights, xq): xq = act_quant_ref(x) when quant on the Triton path, else None (moe_experts then
    quantises x itself)."""
    if not _triton(x):
        return (*route_ref(x, w, bias, k, scale, renorm), None)
    if quant:
        return route_triton(x, w, bias, k, scale, renorm, quant=True)
    return (*route_triton(x, w, bias, k, scale, renorm), None)


def swiglu_ref(g, u, limit):
    """Clamped SwiGLU: bf( min(silu(g), L) * clamp(u, -L, L) ) in fp32 with one rounding; limit None = no clamp."""
    gf, uf = g.float(), u.float()
    a = torch.nn.functional.silu(gf)
    if limit is not None:
        a, uf = a.clamp(max=limit), uf.clamp(-limit, limit)
    return (a * uf).to(torch.bfloat16)


@triton.jit
def _swiglu_math(g, u, limit, HAS_LIMIT: tl.constexpr, PRECISE: tl.constexpr, ZERO_GUARD: tl.constexpr = False):
    """bf16-valued fp32 g, u -> bf( min(silu(g), L) * clamp(u, -L, L) ) as fp32; silu(g) = g / (1 + exp(-g)).
    ZERO_GUARD: a zero g divides a 1 instead and keeps its own signed zero (g / 2's value): a zero dividend sends the
    sm90 division to its slow path, which every padded row of a decode tile took. On at T = 1 only (the batch-1 step
    -2.1%, batch 16 +4%: PERF_LOG 2026-12-01)."""
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
                                                 num_warps=4, **_pdl())
    return out


def swiglu(g, u, limit):
    if _triton(g):
        return swiglu_triton(g, u, limit)
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
                                                         HAS_END=end is not None, num_warps=4, **_pdl())
    return q.view(FP8), s


# The routed experts (and the shared one): the reference, then prefill's grouped GEMMs over rows sorted by expert,
# the sort-free decode kernels, the combines and the launchers.


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
    return out if shared is None else out.float() + _shared_expert(x, shared, swiglu_ref).float()


def _expert_linear_ref(x, w, s):
    """x [E, M, K] bf16 through each expert's weight w [E, N, K] (e4m3 with scales s, or bf16 when s is None)."""
    if s is not None:
        return fp8_gemm_ref(x, w, s)
    return torch.bmm(x, w.transpose(1, 2))  # bf16 operands, fp32 accumulation, one bf16 rounding


def _shared_expert(x, shared, act):
    """model.MLP's shared expert with torch GEMMs: bf(bf(act(bf(x.wg^T), bf(x.wu^T))) . wd^T); act: a swiglu."""
    wg, wu, wd, limit_s = shared
    lin = torch.nn.functional.linear
    return lin(act(lin(x, wg), lin(x, wu), limit_s), wd)


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
        tma = fp8 and _GPU_LAUNCH and _sm90()
    # descriptors need 16-byte aligned bases and row strides
    tma = (tma and w.is_contiguous() and (K * w.element_size()) % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0
           and all(t.data_ptr() % 16 == 0 for t in (x, w, w3) if t is not None))
    if wgmma is None:
        wgmma = BLOCK_M == 128 and all(a is None for a in (block_m, block_n, num_stages, num_warps))
    if tma and wgmma and _wgmma_misfit(N, K, row_idx) is None:
        return grouped_gemm_wgmma(x, sx, w, sw, row_off, row_idx, w3, sw3, limit)
    if tma and BLOCK_M == 128 and block_m is None:
        # 4 warps, 3 stages: 3 CTAs share an SM, so one's scaling overlaps another's wgmmas (+10-18% over the 128 x 128
        # tiles of pointer loads, PERF_LOG 2026-12-01)
        BLOCK_M, bn = (128 if row_idx is not None else 64, 64) if w3 is not None else (64, 128)
        block_n, num_warps, num_stages = block_n or bn, num_warps or 4, num_stages or 3
    # the ungated GEMM: 128-wide N tiles, or 32 when so few tiles have rows (at most min(M, E) experts are active)
    # that 128-wide ones leave SMs idle; the gated kernel (two fp32 accumulators) and 64-row tiles: 64
    if block_n is None and _GPU_LAUNCH:
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
        num_stages=(num_stages or (4 if fp8 else 2)) if _GPU_LAUNCH else 1, **_pdl())
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
            # next tile's K loop starts at once (down +11%, gate+up +1%: PERF_LOG 2026-12-03); a
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
# host time a call (17 us with these caches on a CPU, PERF_LOG 2026-12-04): layouts are built once per shape, weight
# descriptors once per tensor.
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
    shared-memory bytes per FLOP (768 against 670 TFLOP/s at 1024 rows per expert, PERF_LOG 2026-12-02). What holds it
    near 60% of the FP8 peak is each warpgroup's chain wgmma -> wait -> scale (the spec's (sum * sx) * Sw is an FMUL
    and an FFMA per element) with two warpgroups to interleave: PERF_LOG has the measurements and the variants tried."""
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
    _grouped_wgmma_prefill[(min(total, _sms()),)](
        x_desc, x, row_off if row_idx is None else row_idx, x.stride(0), w_desc, w3_desc, out_desc, sx, sw,
        sw3 if gated else sw, out, row_off, N, K, E, total,
        float(limit) if limit is not None else 0.0, sx.stride(0), sw.stride(0), sw.stride(1), out.stride(0),
        GATED=gated, GATHER=row_idx is not None, HAS_LIMIT=limit is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_E=_pow2(E), STAGES=stages, PRECISE=_PRECISE, MATH_REGS=232, num_warps=4)
    return out


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
                            num_warps=4, **_pdl())
    _moe_place_kernel[grid](ids, cnt, row_off, tok, inv, N, seg, int(first_expert), E, TOPK=ids.shape[1],
                            SEGMENTS=DISPATCH_SEGMENTS, BLOCK_E=_pow2(E + 1), BLOCK=1024,
                            num_warps=4, **_pdl())
    return row_off, tok, inv


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
    ys = y if shared is None else _shared_expert(x, shared, swiglu_triton)  # [T, D] bf16 (ys unread without it)
    BLOCK_D = 1024 if D >= 1024 else _pow2(D)
    _moe_combine_kernel[(T, _cdiv(D, BLOCK_D))](y, inv, ids, weights, ys, out, out, D, E, int(first_expert), 0,
                                                      TOPK=k, SHARED=shared is not None, SORTED=True, BLOCK_D=BLOCK_D,
                                                      num_warps=4, **_NO_FMA, **_pdl())
    return out


_COUNTERS = {}


def _arrival_counters(device, n):
    """The decode expert kernels' arrival counters (TUNING["moe_early_down"]): one zeroed int32 buffer per device and
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
                              block_n=None, num_warps=None, num_stages=None, k_unroll=None, xq=None, tma=None):
    """Sort-free moe_experts_ref for decode (T*k <= DECODE_SLOTS): 3 launches for routed + shared experts + combine.

    0. FP8: x quantised once (act_quant_triton, or the router's xq; quantising in every gate/up program's K loop was
       15-30% slower).
    1. gate/up: one program per (hit expert, F tile) computes all rows routed to that expert, SwiGLU epilogue,
       a[slot] bf16 [T*k, F]; the shared expert's gate and up tiles run in the same launch.
    2. down: per (hit expert, D tile): y[slot] bf16 [T*k, D] (a quantised on load); the shared expert's down too.
    3. combine: slot-order fp32 sum per token, plus the shared output when given.
    Programs of ranks past the number of hit experts exit at once, so no host sync and no data-dependent grid.
    block_n / num_warps / num_stages / k_unroll: (gate/up, down) pairs overriding the tuned defaults (bench_kernels.py
    sweep); k_unroll: K blocks per loop iteration of the routed tiles and the shared gate/up (same bits).
    FP8 routed tiles go through _decode_tile_swapped, the weight rows as the MMA's M side (fp8 wgmma at 64 rows). tma
    (FP8, T <= 16; default TUNING["moe_tma"]): their weights (and the gate/up's x, all tokens as rows) through TMA
    descriptors (_decode_descs); the same bits."""
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
    gpu, many = _GPU_LAUNCH, T > 1  # TUNING's MoE entries are (T == 1, T > 1)
    bn = TUNING["moe_block_n"][many] if gpu else (64, 64)
    nw, ns = (4, 4), TUNING["moe_stages"][many] if gpu else (1, 1)
    bn, nw, ns = block_n or bn, num_warps or nw, num_stages or ns
    # k_unroll: FP8 only (BF16 tiles' 4 stages of 4 K blocks need 240 KB of shared memory; an H200 block has 227)
    nkb, nkf = _cdiv(D, QBLOCK), _cdiv(F, QBLOCK)
    tuned = TUNING["moe_unroll"][many] if fp8 and gpu else (1, 1)
    ku = k_unroll or tuple(u if n % u == 0 else 1 for u, n in zip(tuned, (nkb, nkf)))
    _check(nkb % ku[0] == 0 and nkf % ku[1] == 0,
           lambda: f"k_unroll {ku} must divide the K blocks of gate/up ({nkb}) and down ({nkf})")
    sh = int(shared is not None)
    ranks = min(T * k, E)  # distinct local experts the slots can hit
    regs = [{"maxnreg": r} if r and gpu else {} for r in TUNING["moe_maxnreg"][many]]
    dummy = y
    common = dict(TOPK=k, SHARED=sh, FP8=fp8, BLOCK_M=16, BLOCK_K=QBLOCK, ZERO_GUARD=T == 1,
                  BLOCK_TK=max(16, _pow2(T * k)), BLOCK_E=_pow2(E),
                  DOT_DTYPE=_DOT, PRECISE=_PRECISE)
    grid1 = (max(_cdiv(F, bn[0]), 2 * _cdiv(Fs, bn[0])), ranks + sh)
    xqt, sxt = _x_quant(x, xq) if fp8 else (x, dummy)
    tma = [fp8 and bool(u) and T <= 16 for u in (TUNING["moe_tma"][many] if tma is None else (tma, tma))]
    descs, up_first = (None, None, None), False
    if any(tma):
        descs, up_first = _decode_descs(xqt, w1, w3, w2, bn)
        tma = [tma[0] and descs[0] is not None, tma[1] and descs[2] is not None]
    early = TUNING["moe_early_down"][many]
    cnt = _arrival_counters(x.device, ranks + sh) if early else dummy
    _moe_decode_up_kernel[grid1](
        xqt, sxt, x, ids, w1, w3, s1 if fp8 else dummy, s3 if fp8 else dummy, a, wg, wu, gu, descs[0], descs[1], cnt,
        T, D, F, Fs, E, int(first_expert), float(limit) if limit is not None else 0.0, w1.stride(0),
        s1.stride(0) if fp8 else 0, s1.stride(1) if fp8 else 0, HAS_LIMIT=limit is not None, K_UNROLL=ku[0],
        BLOCK_N=bn[0], SHARED_PARTS=TUNING["shared_parts"][many], TMA=tma[0], UP_FIRST=up_first,
        TOPK_P2=_pow2(k), EARLY=early, num_warps=nw[0], num_stages=ns[0], **common, **regs[0],
        **_pdl())
    _moe_decode_down_kernel[(_cdiv(D, bn[1]), ranks + sh)](
        a, ids, w2, s2 if fp8 else dummy, y, gu, wd, ys, descs[2], cnt,
        T, D, F, Fs, E, int(first_expert), float(limit) if limit is not None else 0.0,
        float(limit_s) if limit_s is not None else 0.0, w2.stride(0), s2.stride(0) if fp8 else 0,
        s2.stride(1) if fp8 else 0, HAS_LIMIT=limit is not None, HAS_LIMIT_S=limit_s is not None, K_UNROLL=ku[1],
        BLOCK_N=bn[1], TMA=tma[1], EARLY=early, UP_N=bn[0],
        num_warps=nw[1], num_stages=ns[1], **common, **regs[1], **_pdl())
    BLOCK_D = 1024 if D >= 1024 else _pow2(D)
    _moe_combine_kernel[(T, _cdiv(D, BLOCK_D))](
        y, ids, ids, weights, ys, out, cnt, D, E, int(first_expert), ranks + sh, TOPK=k, SHARED=sh, SORTED=False,
        BLOCK_D=BLOCK_D, BLOCK_C=_pow2(ranks + sh) if early else 0, num_warps=4, **_NO_FMA, **_pdl())
    return out


def moe_experts_triton(x, ids, weights, w1, w3, w2, s1, s3, s2, limit, first_expert=0, shared=None, xq=None):
    """Triton moe_experts_ref: the sort-free decode path for T*k <= DECODE_SLOTS (and decode's T, PREFILL_ROWS),
    else the sorted path. xq: x already quantised (route(..., quant=True)), FP8 experts only."""
    decode = ids.numel() <= DECODE_SLOTS and x.shape[0] <= PREFILL_ROWS
    path = moe_experts_decode_triton if decode else moe_experts_sorted_triton
    return path(x, ids, weights, w1, w3, w2, s1, s3, s2, limit, first_expert, shared, xq=xq)


def moe_experts(x, ids, weights, w1, w3, w2, s1, s3, s2, limit, first_expert=0, shared=None, xq=None):
    if _triton(x):
        return moe_experts_triton(x, ids, weights, w1, w3, w2, s1, s3, s2, limit, first_expert, shared, xq)
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


def skinny_linear_triton(x, w, block_n=None, block_k=None, num_stages=None, num_warps=None):
    """Triton skinny_linear_ref for M <= 16 rows. Tiles: the widest of 64 / 32 / 16 columns that still gives >= 100
    programs (TUNING["skinny_tiles"]; 64 x 128 at 6 stages from 6400 columns: lm_head at cuBLAS's speed). Every tile
    and warp count gives the same bits: each part of K is summed in 16-wide MMA steps in order whatever the tile."""
    _check_tensor("x", x, torch.bfloat16, ndim=2, contiguous=False)
    _check(x.stride(1) == 1, lambda: f"x must have contiguous rows, got strides {x.stride()}")
    _check_tensor("w", w, torch.bfloat16, ndim=2)
    M, K = x.shape
    N = w.shape[0]
    _check(w.shape[1] == K and M <= 16, lambda: f"x [M <= 16, K] and w [N, K]: got {tuple(x.shape)}, {tuple(w.shape)}")
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    st = TUNING["skinny_stages"]
    mid, small = TUNING["skinny_tiles"]
    bn, bk, ns = (64, 128, 6) if N >= 6400 else (*mid, st) if N >= 3200 else (*small, st)
    block_n, block_k, num_stages = block_n or bn, block_k or bk, num_stages or ns
    if M and N:
        _skinny_linear_kernel[(_cdiv(N, block_n),)](
            x, w, out, M, N, K, x.stride(0), out.stride(0), BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
            DOT_DTYPE=_DOT, PARTS=TUNING["skinny_parts"], num_warps=num_warps or TUNING["skinny_warps"],
            num_stages=num_stages if _GPU_LAUNCH else 1, **_pdl())
    return out


def skinny_linear(x, w):
    """x . w^T at <= 16 rows through the Triton kernel, else F.linear: every decode projection (model.linear; the
    whole step -1.1% / -2.3% at batch 1 / 16 against cuBLAS, PERF_LOG 2026-12-01)."""
    if _triton(x) and x.shape[0] <= 16:
        return skinny_linear_triton(x, w)
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
                               **_pdl())
    return out, h


def add_norm(res, parts, w, eps):
    if _triton(res):
        return add_norm_triton(res, parts, w, eps)
    return add_norm_ref(res, parts, w, eps)


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
    buffers: the one-shot TP reduction, an opt-in path (model.OneShotReduce; bench_reduce.py checks and times it,
    bench_decode.py --one-shot times the step with it). bufs, pads: int64 [W] device tensors of every rank's buffer
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
                                    BLOCK_D=_pow2(D), num_warps=8 if D >= 2048 else 4, **_pdl())
    return out, h
