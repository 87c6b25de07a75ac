"""The choose step's logits processing: repetition, frequency and presence penalties, the grammar's bitmask and the
reasoning budget applied to a row in one pass over the vocabulary (_process_kernel), with its launcher. The
reference: kernel.process_logits_ref (the PyTorch form is ~60 launches over [N, V], each reading or writing a whole
row; this is one, which reads the row, its counts, its prompt marks and its mask words once).
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
