"""Norms and RoPE: the zero-centred RMSNorm (_rms_norm_kernel) and the per-head norm + partial NEOX RoPE of up to four
problems in one launch (_norm_rope_jobs_kernel), with their launchers. The references: kernel.rms_norm_ref,
kernel.norm_rope_ref.
"""
import torch
import triton
import triton.language as tl

from kernels import common
from kernels.common import (PREFILL_ROWS, _NO_FMA, _bf16_round, _cdiv, _check, _check_tensor, _pdl_enter, _pow2,
                            _to_e4m3, _unspecialised)


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
                               num_warps=8 if D >= 2048 else 4, **common._pdl())
    return out


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
                                            num_warps=4, **_NO_FMA, **common._pdl())
    return [a[5] for a, _ in launches]
