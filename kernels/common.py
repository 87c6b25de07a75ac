"""Triton plumbing shared by every kernel family: the FP8 format, the interpreter's switches, launch helpers, argument
checks and the exact bf16 / e4m3 rounding helpers that the kernels call.

The switches that tests and tools flip (_GPU_LAUNCH, _sms, _pdl; kernel._triton is the backend switch) live here
only, and every family module reads them as common.NAME at call time: monkeypatching this module reaches every
launcher. The rest the families import by name.
"""
import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
QBLOCK = 128  # FP8 block: activations 1x128 along K, weights 128x128

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
# choices depend on the power of two above their rows only (_launch_rows), so the lengths
# kernel.prefill_warm_lengths lists reach every variant.
PREFILL_ROWS = 16


def _launch_rows(n: int) -> int:
    return n if n <= PREFILL_ROWS else _pow2(n)


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


@triton.jit
def _exp(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)
