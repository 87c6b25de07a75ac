"""The choose step's kernels, with their launchers: the logits processing (_process_kernel: repetition, frequency and
presence penalties, the grammar's bitmask and the reasoning budget applied to a row in one pass over the vocabulary;
the PyTorch form is ~60 launches over [N, V], each reading or writing a whole row), the draws' counter-based
uniforms (_uniform_kernel: splitmix64 per column in registers; the PyTorch form is ~30 int64 launches over [N, V])
and the requests' state after their tokens (_advance_kernel: a row's counts and reasoning state in one program; the
PyTorch form is ~14 small launches). The references: kernel.process_logits_ref, kernel.uniform_ref,
kernel.advance_ref.
"""
import torch
import triton
import triton.language as tl

from kernels import common
from kernels.common import _NO_FMA, _cdiv, _check, _check_tensor, _pdl_enter

BLOCK = 4096  # vocabulary ids per program


@triton.jit
def _process_kernel(x_ptr, slots_ptr, counts_ptr, mask_ptr, thinking_ptr, left_ptr, rep_ptr, freq_ptr, pres_ptr,
                    prompt_ptr, masked_ptr, end_ptr, V, W, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row n, block of BLOCK ids): x [N, V] fp32 processed in place, each step rounded as the reference
    spells it (no FMA contraction: the launcher compiles without it; division correctly rounded)."""
    _pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = v < V
    slot = tl.load(slots_ptr + n).to(tl.int64)
    x = tl.load(x_ptr + n * V + v, mask=ok, other=0.0)
    c = tl.load(counts_ptr + n * V + v, mask=ok, other=0)
    seen = c > 0
    penalised = seen | (tl.load(prompt_ptr + slot * V + v, mask=ok, other=0) != 0)
    r = tl.load(rep_ptr + slot)
    x = tl.where(penalised, tl.where(x > 0, tl.math.div_rn(x, r), x * r), x)
    x = x - tl.load(freq_ptr + slot) * c.to(tl.float32)
    x = x - tl.load(pres_ptr + slot) * seen.to(tl.float32)
    word = tl.load(mask_ptr + n * W + v // 32, mask=ok, other=-1)
    allowed = ((word >> (v % 32)) & 1) != 0
    x = tl.where(~allowed & (tl.load(masked_ptr + slot) != 0), float("-inf"), x)
    forced = (tl.load(thinking_ptr + n) != 0) & (tl.load(left_ptr + n) <= 0)
    x = tl.where(forced, tl.where(v == tl.load(end_ptr + slot), 0.0, float("-inf")), x)
    tl.store(x_ptr + n * V + v, x, mask=ok)


def process_logits_triton(x, slots, counts, mask, thinking, left, repetition, frequency, presence, prompt, masked,
                          think_end):
    """kernel.process_logits on the GPU: x [N, V] fp32 processed in place and returned."""
    _check_tensor("x", x, torch.float32, ndim=2)
    N, V = x.shape
    W = mask.shape[1] if mask.dim() == 2 else 0  # words per mask row: at least ceil(V / 32) (a wider row's tail unread)
    _check(W >= _cdiv(V, 32), lambda: f"mask must be [{N}, >= {_cdiv(V, 32)}], got {tuple(mask.shape)}")
    B = repetition.shape[0]
    for name, t, dtype, shape in (("slots", slots, torch.int64, (N,)), ("counts", counts, torch.int32, (N, V)),
                                  ("mask", mask, torch.int32, (N, W)), ("thinking", thinking, torch.bool, (N,)),
                                  ("left", left, torch.int64, (N,)), ("repetition", repetition, torch.float32, (B,)),
                                  ("frequency", frequency, torch.float32, (B,)),
                                  ("presence", presence, torch.float32, (B,)), ("prompt", prompt, torch.bool, (B, V)),
                                  ("masked", masked, torch.bool, (B,)), ("think_end", think_end, torch.int64, (B,))):
        _check_tensor(name, t, dtype)
        _check(tuple(t.shape) == shape, lambda: f"{name} must be {list(shape)}, got {tuple(t.shape)}")
    if N:
        _process_kernel[(N, _cdiv(V, BLOCK))](x, slots, counts, mask, thinking, left, repetition, frequency,
                                               presence, prompt, masked, think_end, V, W, BLOCK=BLOCK, num_warps=8,
                                               **_NO_FMA, **common._pdl())
    return x


# splitmix64's constants as signed int64 (two's complement: int64 arithmetic wraps like uint64)
_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15 - (1 << 64))
_MIX1 = tl.constexpr(0xBF58476D1CE4E5B9 - (1 << 64))
_MIX2 = tl.constexpr(0x94D049BB133111EB - (1 << 64))


@triton.jit
def _srl(z, K: tl.constexpr):
    return (z >> K) & ((1 << (64 - K)) - 1)  # a logical right shift of int64


@triton.jit
def _mix(z):
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


@triton.jit
def _uniform_kernel(seeds_ptr, counters_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (row b, block of BLOCK columns): out[b, j] = the uniform of (seed b, counter b, column j), as
    kernel.uniform_ref (integer arithmetic, then exact conversions: bit for bit)."""
    _pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    base = _mix(_mix(tl.load(seeds_ptr + b) * _GOLDEN) + tl.load(counters_ptr + b))
    z = _mix(base + (j.to(tl.int64) + 1) * _GOLDEN)
    u = ((_srl(z, 40) & 0xFFFFFF).to(tl.float32) + 0.5) * (2.0 ** -24)
    tl.store(out_ptr + b * n + j, u, mask=j < n)


def uniform_triton(seeds, counters, n: int):
    """kernel.uniform on the GPU: seeds [B], counters [B] int64 -> [B, n] fp32."""
    _check_tensor("seeds", seeds, torch.int64, ndim=1)
    _check_tensor("counters", counters, torch.int64, ndim=1)
    B = seeds.shape[0]
    _check(counters.shape[0] == B, lambda: f"counters must be [{B}], got {tuple(counters.shape)}")
    out = torch.empty(B, n, dtype=torch.float32, device=seeds.device)
    if B and n:
        _uniform_kernel[(B, _cdiv(n, BLOCK))](seeds, counters, out, n, BLOCK=BLOCK, num_warps=8, **common._pdl())
    return out


@triton.jit
def _advance_kernel(counts_ptr, thinking_ptr, left_ptr, end_ptr, slots_ptr, toks_ptr, emitted_ptr, V,
                    P: tl.constexpr, PDL: tl.constexpr):
    """Program (row n): its slot's output counts and reasoning state after its P tokens, in order (kernel.advance_ref).
    A row that emitted nothing (a padding row) writes nothing."""
    _pdl_enter(PDL)
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    end = tl.load(end_ptr + slot)
    thinking = tl.load(thinking_ptr + slot) != 0
    spent = tl.zeros((), dtype=tl.int64)
    ended = tl.zeros((), dtype=tl.int1)
    any_emitted = tl.zeros((), dtype=tl.int1)
    for j in tl.static_range(P):
        t = tl.maximum(tl.load(toks_ptr + n * P + j), 0)
        emitted = tl.load(emitted_ptr + n * P + j) != 0
        c = tl.load(counts_ptr + slot * V + t)
        tl.store(counts_ptr + slot * V + t, c + 1, mask=emitted)
        spent += (thinking & ~ended & emitted).to(tl.int64)  # reasoning before this token: it is spent on it
        ended = ended | ((t == end) & emitted)
        any_emitted = any_emitted | emitted
    tl.store(left_ptr + slot, tl.load(left_ptr + slot) - spent, mask=any_emitted)
    tl.store(thinking_ptr + slot, thinking & ~ended, mask=any_emitted)


def advance_triton(counts, thinking, left, think_end, slots, toks, emitted):
    """kernel.advance on the GPU: the slots' state updated in place."""
    _check_tensor("counts", counts, torch.int32, ndim=2)
    B, V = counts.shape
    slots, toks, emitted = slots.contiguous(), toks.contiguous(), emitted.contiguous()  # [N], [N, P]: views allowed
    N = slots.shape[0]
    for name, t, dtype, shape in (("thinking", thinking, torch.bool, (B,)), ("left", left, torch.int64, (B,)),
                                  ("think_end", think_end, torch.int64, (B,)), ("slots", slots, torch.int64, (N,)),
                                  ("toks", toks, torch.int64, None), ("emitted", emitted, torch.bool, None)):
        _check_tensor(name, t, dtype)
        _check(shape is None or tuple(t.shape) == shape, lambda: f"{name} must be {list(shape)}, got {tuple(t.shape)}")
    P = toks.shape[1] if toks.dim() == 2 else 0
    _check(toks.shape == (N, P) and emitted.shape == (N, P),
           lambda: f"toks and emitted must be [{N}, P], got {tuple(toks.shape)} and {tuple(emitted.shape)}")
    if N and P:
        _advance_kernel[(N,)](counts, thinking, left, think_end, slots, toks, emitted, V, P=P, num_warps=1,
                              **common._pdl())
