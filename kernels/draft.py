"""The draft step's kernel, with its launcher: each MTP depth's input rows in one launch (_draft_rows_kernel: the
rows' ring slots and input tokens, the depth cache's length, the head's row; the PyTorch form is ~19 launches of a
few elements each, in a graph where every launch costs ~2 us). The reference: kernel.draft_rows_ref.
"""
import torch
import triton
import triton.language as tl

from kernels import common
from kernels.common import _check, _check_tensor, _pdl_enter


@triton.jit
def _draft_rows_kernel(slots_ptr, last_ptr, ring_tok_ptr, out_ptr, lengths_ptr, tok_ptr, ring_ptr, row_ptr, R, S,
                       K: tl.constexpr, J: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program over the R x Q elements (request r, row c; Q = K + 1 + J), as kernel.draft_rows_ref."""
    _pdl_enter(PDL)
    Q: tl.constexpr = K + 1 + J
    e = tl.arange(0, BLOCK)
    ok = e < R * Q
    r = e // Q
    c = e % Q
    slot = tl.load(slots_ptr + r, mask=ok, other=0)
    last = tl.load(last_ptr + r, mask=ok, other=0)
    first = tl.maximum(last - K - J, 0)
    pos = first + c
    t = pos + J + 1  # the token the row reads: final up to last + 1, then this step's drafts
    final = t <= last + 1
    i = tl.minimum(tl.maximum(t - last - 2, 0), K - 1)
    a = tl.load(ring_tok_ptr + slot * S + t % S, mask=ok & final, other=0)
    b = tl.load(out_ptr + r * K + i, mask=ok & ~final, other=0)
    tl.store(tok_ptr + e, tl.where(final, a, b), mask=ok)
    tl.store(ring_ptr + e, pos % S, mask=ok)
    head = ok & (c == 0)
    tl.store(lengths_ptr + slot, first, mask=head)
    tl.store(row_ptr + r, r * Q + last - first, mask=head)


def draft_rows_triton(slots, last, ring_tok, out, lengths, j: int, k: int):
    """kernel.draft_rows on the GPU -> (tok [R, q], ring [R, q], row [R]); lengths written in place."""
    _check_tensor("ring_tok", ring_tok, torch.int64, ndim=2)
    B, S = ring_tok.shape
    for name, t in (("slots", slots), ("last", last), ("lengths", lengths)):
        _check_tensor(name, t, torch.int64, ndim=1)
    _check_tensor("out", out, torch.int64, ndim=2)
    R, q = slots.shape[0], k + 1 + j
    _check(last.shape[0] == R and tuple(out.shape) == (R, k) and lengths.shape[0] == B,
           lambda: f"last [{R}], out [{R}, {k}] and lengths [{B}] expected, got {tuple(last.shape)}, "
                   f"{tuple(out.shape)} and {tuple(lengths.shape)}")
    tok = torch.empty(R, q, dtype=torch.long, device=slots.device)
    ring = torch.empty(R, q, dtype=torch.long, device=slots.device)
    row = torch.empty(R, dtype=torch.long, device=slots.device)
    if R:
        _draft_rows_kernel[(1,)](slots, last, ring_tok, out, lengths, tok, ring, row, R, S,
                                 K=k, J=j, BLOCK=max(16, triton.next_power_of_2(R * q)), num_warps=1,
                                 **common._pdl())
    return tok, ring, row
