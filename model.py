"""Step-5 text decoder (DSA sparse attention, 352-expert MoE) with co-located TP/EP, and its VL wrapper.

Dimension legend used in shape comments:
  T = tokens in a packed batch, B = requests, D = hidden, H = local query heads, G = local KV groups,
  hd = head dim, E = local experts, k = experts per token, P = indexer proxy dim, R = regions, V = local vocab.
Every number of the architecture comes from the checkpoint's config; nothing here is a literal of the real model.
"""
import contextlib
import itertools
import math
import os
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

import kernel
from config import LAYOUT_VERSION, Step5Config, Step5VLConfig, group_window

# --------------------------------------------------------------------------------------------------
# distributed: every collective of the model is one of these two functions (grep "dist\."), or the opt-in
# one-shot reduction below

world_size, rank = 1, 0
_REDUCE_BYTES = 1 << 30  # bound on the gathered partials of one tp_reduce_add call
# torch >= 2.13 renamed all_gather_into_tensor (the GPU machine runs 2.11)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def set_parallel(ws: int, r: int):
    """This process's TP/EP world size and rank. Step5ForCausalLM sets them from its config and rank when it is
    built (the one place); standalone blocks (benchmarks) are single-rank unless set here first."""
    global world_size, rank
    if not 0 <= r < ws:
        raise ValueError(f"rank {r} is outside a TP world of {ws}")
    world_size, rank = ws, r


_thread = threading.local()


@contextlib.contextmanager
def alone():
    """In this thread, tp_gather stands in for the collective with world_size copies of this rank's x (the same
    shapes, so the same kernel launches): for passes that run only for their launches (engine start-up's parallel
    kernel builds), whose threads reach their collectives in another order on every rank."""
    _thread.alone = True
    try:
        yield
    finally:
        _thread.alone = False


def tp_gather(x: torch.Tensor) -> torch.Tensor:
    """All ranks' copies of x stacked in rank order: [world, *x.shape]."""
    if world_size == 1:
        return x[None]
    if getattr(_thread, "alone", False):
        return x[None].expand(world_size, *x.shape).contiguous()
    out = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous())  # gloo wants the ranks concatenated along dim 0
    return out.view(world_size, *x.shape)


def tp_reduce_add(res: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None = None, eps: float = 0.0):
    """A layer's residual update: res [T, D] fp32 + the sum of the ranks' partials x [T, D] (bf16 or fp32), added in
    rank order 0, 1, ... with one fp32 accumulator and rounded once to x.dtype; with w, also the RMSNorm of the new
    residual (the next sub-layer's input). -> (res' fp32, h bf16 or None); one kernel after the gather.

    Unlike a backend all-reduce, the summation order is fixed, so results do not depend on the collective
    algorithm or topology, and every rank holds bit-identical sums (which the replicated router relies on).
    """
    # Long prefills reduce in row chunks so the gathered partials stay bounded (128k tokens at TP=8 would
    # otherwise gather 16 GiB of fp32 per MoE layer); decode batches take the single-chunk path.
    rows = max(1, _REDUCE_BYTES // (world_size * x[0].numel() * x.element_size()))
    if x.shape[0] > rows:
        out = [tp_reduce_add(r, c, w, eps) for r, c in zip(res.split(rows), x.split(rows))]
        return torch.cat([o[0] for o in out]), None if w is None else torch.cat([o[1] for o in out])
    if (_one_shot is not None and world_size > 1 and x.is_cuda and x.numel() <= _one_shot.slot
            and not getattr(_thread, "alone", False)):  # its peers wait for this rank's copy
        return _one_shot(res, x, w, eps)
    return kernel.add_norm(res, tp_gather(x), w, eps)


class OneShotReduce:
    """An opt-in tp_reduce_add for CUDA decode batches (set_one_shot; tools.bench_reduce and tools.bench_decode
    --one-shot time it against the gather path): the partial is copied into this rank's symmetric-memory buffer, then
    ONE kernel (kernel.peer_add_norm_triton) waits for every rank's copy and adds them in rank order with the residual
    and the norm, in the gather path's order (tools.bench_reduce checks the bits). Consecutive calls alternate two
    buffer slots, so a rank's write for call i+2 cannot overtake a peer still reading call i (it has waited for every
    rank's call-i+1 signal); Block.step reduces twice per layer, so every step, and every captured graph, starts in
    slot 0."""

    def __init__(self, rows: int, D: int, device):
        import torch.distributed._symmetric_memory as symm_mem
        self.slot = rows * D  # fp32 elements per slot; a bf16 partial fills the first half
        self.buf = symm_mem.empty(2 * self.slot, dtype=torch.float32, device=device)
        hdl = symm_mem.rendezvous(self.buf, dist.group.WORLD.group_name)
        self.rank, self.calls = hdl.rank, 0
        self.bufs = torch.tensor(hdl.buffer_ptrs, dtype=torch.int64, device=device)
        self.pads = torch.tensor(hdl.signal_pad_ptrs, dtype=torch.int64, device=device)
        hdl.get_signal_pad(hdl.rank, [rows * world_size], torch.int32).zero_()  # the kernel's flags start cleared
        torch.cuda.synchronize(device)
        dist.barrier()

    def __call__(self, res, x, w, eps):
        T, D = x.shape
        s, self.calls = self.calls % 2, self.calls + 1
        off = s * self.slot * (4 // x.element_size())  # in elements of x's dtype
        self.buf.view(x.dtype)[off:off + T * D].view(T, D).copy_(x)
        return kernel.peer_add_norm_triton(res, self.bufs, self.pads, self.rank, x.dtype, w, eps, slot_off=off)


_one_shot = None


def set_one_shot(rows: int, D: int = 0, device=None):
    """Route tp_reduce_add calls of up to `rows` tokens through OneShotReduce (rows = 0: back to the gather path).
    Collective: every rank calls it, after the process group exists."""
    global _one_shot
    _one_shot = OneShotReduce(rows, D, device) if rows else None


# --------------------------------------------------------------------------------------------------
# building blocks


class NormWeight(nn.Module):
    """Holds a norm's fp32 weight (and bias) under the checkpoint's names (kernel.rms_norm and the fused kernels read
    it)."""

    def __init__(self, dim: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False) if bias else None


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 GEMM (fp32 accumulation, bf16 result): kernel.skinny_linear (its Triton kernel at <= 16 rows on the
    Triton path, else F.linear)."""
    return kernel.skinny_linear(x, w)


def _weight(out_f: int, in_f: int, dtype=torch.bfloat16) -> nn.Linear:
    """A bias-free nn.Linear that only holds a checkpoint weight [out_f, in_f] (`linear` computes with it)."""
    m = nn.Linear(in_f, out_f, bias=False, dtype=dtype)
    m.weight.requires_grad_(False)
    return m


def rope_table(span: int, theta: float, scaling: dict | None, n_pos: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_pos, span/2] bf16 for NEOX RoPE over `span` dims; built in fp32 (a float64 build changes bf16
    entries from position 24 on), exponent denominator = the rotary span, optional llama3 frequency rescale."""
    # built on the CPU and moved: pow/cos/sin of large arguments differ in the last fp32 bit between devices,
    # which flips bf16 table entries; one build keeps CPU and GPU runs (and every rank) on identical tables
    inv = 1.0 / (theta ** (torch.arange(0, span, 2, dtype=torch.float32) / span))
    if scaling is not None:
        f = float(scaling["factor"])
        lo, hi = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        Lo = float(scaling["original_max_position_embeddings"])
        wl = 2 * math.pi / inv
        base = torch.where(wl > Lo / lo, inv / f, inv)
        smooth = (Lo / wl - lo) / (hi - lo)
        blend = (1 - smooth) * base / f + smooth * base
        inv = torch.where((wl >= Lo / hi) & (wl <= Lo / lo), blend, base)
    freqs = torch.outer(torch.arange(n_pos, dtype=torch.float32), inv)
    return freqs.cos().to(torch.bfloat16).to(device), freqs.sin().to(torch.bfloat16).to(device)


def rope_tables(c: Step5Config, n_pos: int, device) -> list:
    """Per layer {'main': (cos, sin), 'indexer': (cos, sin) on DSA layers}; layers of equal geometry share tables."""
    built, layers = {}, []

    def table(span, i):
        key = (span, float(c.rope_theta[i]), c.rope_scaled(i))
        if key not in built:
            built[key] = rope_table(span, key[1], c.rope_scaling if key[2] else None, n_pos, device)
        return built[key]

    for i in range(c.num_hidden_layers + c.mtp_layers_kept):
        t = {"main": table(c.rope_span(i), i)}
        if c.is_dsa(i):
            t["indexer"] = table(c.sparse.rope_dim, i)
        layers.append(t)
    return layers


def _kept_region(start, real, blk: int):
    """Rows from positions start [B], of which `real` ([1] or [B]) tokens are kept -> (the positions p [B, blk] of
    the DSA region holding each row's last kept token, pending row j holding p[:, j]; p < start, where the rows come
    from before the pass)."""
    p = (start + real - 1)[:, None] // blk * blk + torch.arange(blk, device=start.device)
    return p, p < start[:, None]


class LayerCache:
    """Per-layer decode state of B cache rows (slots). Sliding: ring K/V [B, G, R, hd] (token p in slot p mod R).
    DSA: K/V [B, cap, G, hd], region summaries [B, R, P] e4m3, pending indexer key/z of the unfinished region
    [B, blk, P] bf16 (views into the Cache's `pending`)."""

    def __init__(self, **bufs):
        self.__dict__.update(bufs)


class Cache:
    """Static-shape caches for B rows (slots) of at most `cap` positions; `lengths` [B] (positions each row holds)
    is shared by all layers. `requests` [B]: the request each row serves, for installed Pins only. `pending`: the DSA
    layers' pending indexer keys and z stacked ([n_dsa, B, blk, P] x 2; each DSA LayerCache's pk, pz is one layer's
    view), so that a speculative step keeps and restores them in a few launches for all layers (`held`: their copy
    from before a verify step, Model.hold_pending)."""

    def __init__(self, layers: list, B: int, cap: int, device, verify: bool = False):
        self.layers, self.cap = layers, cap
        self.lengths = torch.zeros(B, dtype=torch.long, device=device)
        self.requests = torch.arange(B, device=device)
        dsa = [lc for lc in layers if getattr(lc, "summ", None) is not None]
        self.pending = self.held = None
        if dsa:
            self.pending = tuple(torch.stack([getattr(lc, n) for lc in dsa]) for n in ("pk", "pz"))
            for i, lc in enumerate(dsa):
                lc.pk, lc.pz = self.pending[0][i], self.pending[1][i]
            self.held = tuple(torch.zeros_like(t) for t in self.pending) if verify else None


@dataclass
class Placement:
    """Where one forward call's tokens go. Prefill: spans (cache row, start in the packed tokens, n tokens, first
    position p0) per row that gets tokens. Decode: rows [B'] (the cache row of each batch row, a device tensor; no
    host read) and Q tokens per row. pos [T]: each token's absolute position. real: in a padded pass (a CUDA
    graph's static length: one prefill span at position 0, or a decode step of Q tokens per row) the device count of
    real tokens [1], the rest padding; the layers keep the real tokens' state where a later step reads it (the DSA
    pending rows, which padding past a region boundary would overwrite). requests [T]: each token's request
    (Cache.requests of its row), set only while a Pins test instrument is installed, which keys its decisions by it.
    snaps: a prefill's window snapshots (the prefix store, prefix_cache.py) [(cache row, X, i)]: each sliding layer
    writes the keys and values of that row's positions X-W+1 .. X-1 (its window at X, X in one of the row's spans)
    into snapshot i of its LayerCache's pools snap_k, snap_v [snaps, G, W-1, hd]."""
    pos: torch.Tensor
    spans: list | None = None
    rows: torch.Tensor | None = None
    Q: int = 1
    real: torch.Tensor | None = None
    requests: torch.Tensor | None = None
    snaps: list | None = None


@dataclass(eq=False)
class Trunk:
    """A pass over the main layers (Step5ForCausalLM.begin / run_layers): where its tokens go, the cache, the residual
    stream [T, D] fp32, the next layer's normed input (None before the first layer) and the layers run so far."""
    at: Placement
    cache: "Cache"
    res: torch.Tensor
    h: torch.Tensor | None = None
    done: int = 0


class Pins:
    """Test instrument: pins the two discrete top-k decisions (expert routing, DSA region selection) of one run into
    another. Two correct computations that differ in last bits (prefill vs decode, another TP size, batch shape or
    device) pick another expert or region where the k-th and (k+1)-th scores are one rounding apart, and that row's
    residual then differs by O(1); with the decisions pinned they agree to rounding, which is what tests demand.

    Recording (`Pins()`) stores every decision under (layer, request, position[, global KV group]); replaying
    (`Pins(recorded.data)`) substitutes the stored decision (the router weights of pinned experts are recomputed by
    the reference router). `requests` maps the replaying run's request indices to the recorded ones (e.g. one
    request alone replaying its row of a batch). A decision missing in a replay is an error, unless `strict=False`
    lets such rows keep their own (rows the compared run discards, e.g. rejected speculative drafts). Host reads
    here are fine: pins are never installed outside tests.
    """

    def __init__(self, recorded: dict | None = None, requests: list | None = None, strict: bool = True):
        self.replay = recorded is not None
        self.data = dict(recorded) if recorded is not None else {}
        self.requests, self.strict = requests, strict

    def _key(self, *k):
        kind, layer, req, *rest = k
        return (kind, layer, self.requests[req] if self.requests is not None else req, *rest)

    def _get(self, key, own):
        if key not in self.data:
            if not self.strict:
                return own
            raise KeyError(f"no pinned decision for {key}: the replayed run visits a token the recording did not")
        return self.data[key]

    def experts(self, layer: int, req, pos, ids):
        """req, pos [T]; ids [T, k] -> None (recording) or the pinned ids [T, k] (replay)."""
        keys = [self._key("moe", layer, r, p) for r, p in zip(req.tolist(), pos.tolist())]
        if not self.replay:
            self.data.update(zip(keys, ids.cpu()))
            return None
        return torch.stack([self._get(key, own) for key, own in zip(keys, ids.cpu())]).to(ids.device)

    def regions(self, layer: int, req, pos, group0: int, ids, valid, n_regions: int):
        """ids, valid [S, G, T, K] (ascending ids, invalid slots = n_regions); req [S]; pos [S, T] -> ids, valid."""
        S, G, T, K = ids.shape
        keys = [(s, g, t, self._key("dsa", layer, int(req[s]), int(pos[s, t]), group0 + g))
                for s in range(S) for g in range(G) for t in range(T)]
        if not self.replay:
            for s, g, t, key in keys:
                self.data[key] = ids[s, g, t][valid[s, g, t]].cpu()
            return ids, valid
        out = torch.full((S, G, T, K), n_regions, dtype=ids.dtype)
        for s, g, t, key in keys:
            sel = self._get(key, ids[s, g, t][valid[s, g, t]].cpu())
            out[s, g, t, :len(sel)] = sel
        out = out.to(ids.device)
        return out, out < n_regions


# --------------------------------------------------------------------------------------------------
# attention


def _ring_runs(p: int, L: int, R: int) -> list:
    """Positions p .. p+L-1 (L <= R) of a ring of R slots (position q in slot q mod R) as at most two runs of
    consecutive slots: (first slot, offset among the L positions, length). Slices, so no index tensors to build."""
    s = p % R
    first = min(L, R - s)
    return [(s, 0, first)] + ([(0, first, L - first)] if L > first else [])


class Attention(nn.Module):
    """GQA attention with q/k norm + partial RoPE and a head-wise sigmoid output gate; sliding-window (SDPA with a
    ring cache) or, on DSA layers, indexer + region top-k sparse attention."""

    def __init__(self, cfg: Step5Config, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        D, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_groups = cfg.n_local_heads, cfg.n_local_groups
        self.q_proj = _weight(self.n_heads * hd, D)
        self.k_proj = _weight(self.n_groups * hd, D)
        self.v_proj = _weight(self.n_groups * hd, D)
        self.o_proj = _weight(D, self.n_heads * hd)
        self.g_proj = _weight(self.n_heads, D)
        self.q_norm, self.k_norm = NormWeight(hd), NormWeight(hd)
        self.dsa = cfg.is_dsa(layer_id)
        if self.dsa:
            sp = cfg.sparse
            self.idx_heads = sp.n_heads // sp.n_provider_groups  # indexer heads per group (TP-invariant)
            self.w_scale = self.idx_heads ** -0.5  # the head weights' scale, applied in fp32 after W_Iw
            P = sp.proxy_dim
            self.sparse_indexer_q = _weight(self.n_groups * self.idx_heads * P, D)
            self.sparse_indexer_q_norm = NormWeight(P)
            self.sparse_indexer_k = _weight(P, D)
            self.sparse_indexer_k_norm = NormWeight(P, bias=True)
            self.sparse_indexer_z = _weight(P, D)
            self.sparse_indexer_w = _weight(self.n_groups * self.idx_heads, D, dtype=torch.float32)
            self.ssmax_s = nn.Parameter(torch.empty(cfg.num_attention_heads, dtype=torch.float32),
                                        requires_grad=False)  # loaded for a clean key set; no kernel reads it (one init constant)
        self.scale = hd ** -0.5
        self.group0 = group_window(cfg.num_attention_groups, cfg.tp_size, rank)[0]  # first global KV group held here
        self.pins = None

    def finalize(self):
        """After loading: every projection of the layer input packed into one weight `wpack`, rows
        [q | k | v | gate (| indexer q | k | z | w on DSA layers)], so a decode step reads the input once in one
        GEMM (each output is still one dot over D rounded once to bf16, as the separate projections round), and the
        indexer's bf16-rounded norm weights."""
        parts = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, self.g_proj.weight]
        del self.q_proj, self.k_proj, self.v_proj, self.g_proj
        if self.dsa:
            parts += [self.sparse_indexer_q.weight, self.sparse_indexer_k.weight, self.sparse_indexer_z.weight,
                      self.sparse_indexer_w.weight.bfloat16()]  # W_Iw rounded to bf16, like the deployed GEMM
            del self.sparse_indexer_q, self.sparse_indexer_k, self.sparse_indexer_z, self.sparse_indexer_w
            self.idx_q_norm_w = self.sparse_indexer_q_norm.weight.bfloat16().float()
            self.idx_k_norm_w = self.sparse_indexer_k_norm.weight.bfloat16().float()
            self.idx_k_norm_b = self.sparse_indexer_k_norm.bias.bfloat16().float()
        self.split = [p.shape[0] for p in parts]  # column widths of the packed output
        self.wpack = torch.cat(parts)

    def project(self, h: torch.Tensor) -> list:
        """h [T, D] bf16 -> the packed projections' column slices [q, k, v, gate (, indexer q, k, z, w)], bf16."""
        return (kernel.skinny_linear if self.dsa else linear)(h, self.wpack).split(self.split, dim=-1)

    def new_cache(self, B: int, cap: int, device, slack: int = 0) -> LayerCache:
        """slack: extra ring slots, so that rows written past the kept length (rejected speculative rows, rolled back
        by resetting the lengths) never overwrite a key that a kept row's window still needs."""
        G, hd = self.n_groups, self.cfg.head_dim
        if not self.dsa:
            # with spare slots, R rounded up to a multiple of 16: on the H200 the whole rank's 1-token step took
            # 14.6 ms with rings of 515 slots and 8.1 ms with 528 (tools.bench_decode --whole-rank --tokens-per-row 4);
            # the fused kernel alone is not slower at 515 (13.7 vs 13.3 us), so the cause is not isolated
            R = self.cfg.sliding_window + slack
            R = -(-R // 16) * 16 if slack else R
            return LayerCache(k=torch.zeros(B, G, R, hd, dtype=torch.bfloat16, device=device),
                              v=torch.zeros(B, G, R, hd, dtype=torch.bfloat16, device=device))
        sp = self.cfg.sparse
        return LayerCache(k=torch.zeros(B, cap, G, hd, dtype=torch.bfloat16, device=device),
                          v=torch.zeros(B, cap, G, hd, dtype=torch.bfloat16, device=device),
                          # e4m3 bytes kept as uint8: index_put / where are not implemented for float8 on every backend
                          summ=torch.zeros(B, cap // sp.block, sp.proxy_dim, dtype=torch.uint8, device=device),
                          pk=torch.zeros(B, sp.block, sp.proxy_dim, dtype=torch.bfloat16, device=device),
                          pz=torch.zeros(B, sp.block, sp.proxy_dim, dtype=torch.bfloat16, device=device))

    def forward(self, h, at: Placement, rope, cache: LayerCache):
        """h [T, D] bf16 -> this rank's partial [T, D] bf16, at the positions and cache rows `at` says (a prefill's
        spans, or a decode step of Q tokens per row)."""
        T = h.shape[0]
        H, G, hd = self.n_heads, self.n_groups, self.cfg.head_dim
        eps = self.cfg.rms_norm_eps
        if not self.dsa and at.spans is None:  # decode, Q tokens per row: the fused kernels (q/k norm + RoPE inside)
            o = kernel.sliding_decode(linear(h, self.wpack), at.pos, cache.k, cache.v, self.q_norm.weight,
                                      self.k_norm.weight, *rope["main"], eps, self.scale, self.cfg.sliding_window, H, G,
                                      rows=at.rows)
            return linear(o, self.o_proj.weight)  # this rank's bf16 partial: Block reduces it
        q, k, v, g, *idx = self.project(h)
        q, k, idx = self._norm_rope(q, k, idx, at.pos, rope)
        v = v.view(T, G, hd)
        if self.dsa:  # the output gate applied by the attention kernels
            o = self._dsa(idx, q, k, v, g, at, cache)
        else:
            o = self._sliding_prefill(q, k, v, g, at.spans, cache, at.snaps)
        return linear(o.reshape(T, H * hd), self.o_proj.weight)  # this rank's bf16 partial: Block reduces it

    # ---- sliding window
    def _sliding_prefill(self, q, k, v, g, spans, cache, snaps=None):
        """Each request's chunk of n tokens at positions p0.. sees the last W-1 cached keys and its own (causal, banded);
        the ring (R >= W slots, position p in slot p mod R) then keeps the chunk's last R keys; the windows `snaps`
        asks for (Placement.snaps) are copied out of the chunk's keys. q [T, H, hd], k/v [T, G, hd], g [T, H] the gate
        logits -> the gated output [T, H, hd]."""
        W, R, out = self.cfg.sliding_window, cache.k.shape[2], torch.empty_like(q)
        for b, s, n, p0 in spans:
            qb, kb, vb = (t[s:s + n].transpose(0, 1) for t in (q, k, v))  # [H|G, n, hd]
            m = min(p0, W - 1)  # cached keys in the window of the chunk's first query: positions p0-m .. p0-1
            if m:
                kb, vb = (torch.cat([ring[b][:, r0:r0 + ln] for r0, _, ln in _ring_runs(p0 - m, m, R)] + [t], 1)
                          for ring, t in ((cache.k, kb), (cache.v, vb)))
            # query i's own key is key m + i; the gated output straight into its rows of out
            kernel.banded_attention(qb, kb, vb, m, W, self.scale, gate=g[s:s + n], out=out[s:s + n].transpose(0, 1))
            for b_, X, i in snaps or ():  # kb holds positions p0-m .. p0+n-1, and p0-m <= X-W+1 (clamped at 0)
                if b_ == b and p0 < X <= p0 + n:
                    lo = max(0, X - W + 1)
                    cache.snap_k[i, :, lo - (X - W + 1):] = kb[:, m + lo - p0:m + X - p0]
                    cache.snap_v[i, :, lo - (X - W + 1):] = vb[:, m + lo - p0:m + X - p0]
            L = min(n, R)  # the ring keeps the chunk's last L positions, p0+n-L .. p0+n-1 (key m+n-L ..)
            for r0, o, ln in _ring_runs(p0 + n - L, L, R):
                cache.k[b, :, r0:r0 + ln] = kb[:, m + n - L + o:m + n - L + o + ln]
                cache.v[b, :, r0:r0 + ln] = vb[:, m + n - L + o:m + n - L + o + ln]
        return out

    def _norm_rope(self, q, k, idx, pos, rope):
        """q [T, H*hd], k [T, G*hd] -> [T, H, hd], [T, G, hd] normed and rotated at positions pos, and on DSA layers
        the indexer's projections idx (q, k, z, w) -> q [T, G, Hg, P] and k [T, P] normed and rotated (q then rounded
        to its e4m3 values, as the scores read it), z [T, P] and w [T, G, Hg] raw (indexer_scores applies w's
        1/sqrt(Hg) in fp32); all norms in one launch (a DSA layer's four were four launches, each ~2 us of the decode
        step)."""
        T, H, G, hd, eps = q.shape[0], self.n_heads, self.n_groups, self.cfg.head_dim, self.cfg.rms_norm_eps
        cos, sin = rope["main"]  # whole tables: the kernels read row pos[t]
        jobs = [(q.view(T, H, hd), self.q_norm.weight, cos, sin, None),
                (k.view(T, G, hd), self.k_norm.weight, cos, sin, None)]
        if self.dsa:
            P = self.cfg.sparse.proxy_dim
            icos, isin = rope["indexer"]
            jobs += [(idx[0].view(T, G * self.idx_heads, P), self.idx_q_norm_w, icos, isin, None),
                     (idx[1][:, None], self.idx_k_norm_w, icos, isin, self.idx_k_norm_b)]
        q, k, *qk = kernel.norm_rope_jobs(jobs, eps, pos, e4m3=(2,))  # the indexer's q as e4m3 values
        if self.dsa:
            idx = qk[0].view(T, G, self.idx_heads, P), qk[1][:, 0], idx[2], idx[3].view(T, G, self.idx_heads)
        return q, k, idx

    # ---- DSA
    def _dsa(self, idx, q, k, v, g, at: Placement, cache):
        """-> the gated attention output [T, H, hd] bf16 (o * bf(sigmoid(g)), g [T, H] the gate logits). idx: the
        indexer's q [T, G, Hg, P] and k [T, P] (normed and rotated), z [T, P] and w [T, G, Hg] (raw; indexer_scores
        applies w's 1/sqrt(Hg) in fp32)."""
        sp = self.cfg.sparse
        blk, P = sp.block, sp.proxy_dim
        qi, ki, zi, wi = idx
        T, H, hd = q.shape
        G = self.n_groups
        q = q.view(T, G, H // G, hd)
        if at.spans is None:  # decode: Q tokens per row ([B, Q] row-major); static shapes, no host sync
            Q, rows = at.Q, at.rows
            B = T // Q
            pq = at.pos.view(B, Q)
            if at.real is not None:  # padded: the pending rows as they were, for the real tokens' region (below)
                kept = cache.pk.index_select(0, rows), cache.pz.index_select(0, rows)  # [B, blk, P]
            for j in range(Q):  # token by token: a region completed by token j is summarised before later queries
                # K/V rows, the pending indexer row and, when it completes a region, the region's summary
                kernel.dsa_cache_write(k.view(B, Q, G, hd)[:, j], v.view(B, Q, G, hd)[:, j], ki.view(B, Q, P)[:, j],
                                       zi.view(B, Q, P)[:, j], pq[:, j], cache.k, cache.v, cache.pk, cache.pz,
                                       cache.summ, rows=rows)
            if at.real is not None:
                self.keep_pending(cache, rows, pq[:, 0], at.real, ki.view(B, Q, P), zi.view(B, Q, P), kept)
            # scores of regions past every query's history are skipped: the step's cost follows the rows' contexts
            scores = kernel.indexer_scores(qi.view(B, Q, *qi.shape[1:]), wi.view(B, Q, *wi.shape[1:]),
                                           cache.summ.view(kernel.FP8), self.w_scale, q_e4m3=True, rows=rows,
                                           n_hist=pq, blk=blk)  # [B, G, Q, R]
            ids, valid = kernel.select_regions(scores, pq, sp.topk, blk)
            if self.pins is not None:
                ids, valid = self.pins.regions(self.layer_id, at.requests.view(B, Q)[:, 0], pq, self.group0, ids,
                                               valid, scores.shape[-1])
            o = kernel.sparse_attention(q.view(B, Q, G, H // G, hd), cache.k, cache.v, ids, valid, pq, blk, self.scale,
                                        gate=g, rows=rows)
            return o.reshape(T, H, hd)
        out = torch.empty_like(q)
        for b, s, n, p0 in at.spans:  # prefill of positions p0 .. p0+n-1 on top of p0 cached tokens
            end = p0 + n
            cache.k[b, p0:end], cache.v[b, p0:end] = k[s:s + n], v[s:s + n]
            # the indexer rows of the unfinished region (q pending tokens) continue with the chunk's own
            r0, q0 = p0 // blk, p0 % blk
            kr = torch.cat([cache.pk[b, :q0], ki[s:s + n]])  # [q0 + n, P]: positions r0*blk .. end-1
            zr = torch.cat([cache.pz[b, :q0], zi[s:s + n]])
            done = (q0 + n) // blk  # regions completed by this chunk: r0 .. r0+done-1
            if done:
                cache.summ[b, r0:r0 + done] = kernel.region_summary(kr[:done * blk].view(done, blk, P),
                                                                    zr[:done * blk].view(done, blk, P)).view(torch.uint8)
            tail = q0 + n - done * blk
            cache.pk[b, :tail], cache.pz[b, :tail] = kr[done * blk:], zr[done * blk:]
            if at.real is not None:  # padded (p0 = 0): the pending rows of the real tokens' last region
                self.keep_pending(cache, at.pos.new_full((1,), b), at.pos.new_zeros(1), at.real, kr[None], zr[None],
                                  (cache.pk[b:b + 1], cache.pz[b:b + 1]))
            # queries at p < (topk + 1) * blk select every history region (the spec's dense-equivalence regime): no
            # scores or selection, and their attention in tiles of whole regions' queries
            nd = min(n, max(0, (sp.topk + 1) * blk - p0))
            if nd:
                if self.pins is not None:  # the decisions recorded as a selection would make them
                    self._pin_every_region(at.requests[s:s + 1], at.pos[s:s + nd][None], G)
                kernel.dense_prefix(q[None, s:s + nd], cache.k[b:b + 1, :p0 + nd], cache.v[b:b + 1, :p0 + nd], p0, blk,
                                    self.scale, gate=g[s:s + nd], out=out[None, s:s + nd])
            nr = end // blk  # every region completed so far; a query at p selects among regions < p // blk
            step = kernel.dsa_query_chunk(q, G, nr)
            for c0 in range(nd, n, step):  # query chunks bound the scores (and the reference's gathered keys)
                c1 = min(n, c0 + step)
                pb = at.pos[s + c0:s + c1][None]
                scores = kernel.indexer_scores(qi[None, s + c0:s + c1], wi[None, s + c0:s + c1],
                                               cache.summ[b:b + 1, :nr].view(kernel.FP8), self.w_scale,
                                               q_e4m3=True, n_hist=pb, blk=blk, prefill=True)
                ids, valid = kernel.select_regions(scores, pb, sp.topk, blk, prefill=True)
                del scores  # its room (dsa_query_chunk's bound) serves the attention's selection bookkeeping
                if self.pins is not None:
                    ids, valid = self.pins.regions(self.layer_id, at.requests[s:s + 1], pb, self.group0, ids, valid,
                                                   nr)
                kernel.selected_attention(q[None, s + c0:s + c1], cache.k[b:b + 1, :end], cache.v[b:b + 1, :end],
                                          p0 + c0, ids, valid, pb, blk, sp.topk, self.scale, gate=g[s + c0:s + c1],
                                          out=out[None, s + c0:s + c1])
        return out.view(T, H, hd)

    def keep_pending(self, cache, rows, start, real, ki, zi, kept):
        """After a padded pass (a decode step, or a prefill from position 0) of Q tokens per row of `rows` [B] from
        positions start [B], `real` [1] of them real, with indexer keys/z ki, zi [B, Q, P]: the pending rows of the
        region that holds the last real token get back what padding past a region boundary overwrote
        (Model.keep_pending does it for a speculative step's rejected drafts). Row j holds
        position p = that region's first + j: from before the pass (kept [B, blk, P] x 2) if p < start, else the
        pass's own row of p (rows past the real tokens are rewritten before the region completes). Regions completed
        by real tokens were summarised before anything past them was written; a region that padding completed is
        summarised again when a real token completes it, and no query reads it before."""
        blk, Q, P = cache.pk.shape[1], ki.shape[1], ki.shape[2]
        p, before = _kept_region(start, real, blk)
        j = (p - start[:, None]).clamp(0, Q - 1)[..., None].expand(-1, -1, P)
        before = before[..., None]
        cache.pk.index_copy_(0, rows, torch.where(before, kept[0], ki.gather(1, j)))
        cache.pz.index_copy_(0, rows, torch.where(before, kept[1], zi.gather(1, j)))

    def _pin_every_region(self, req, pos, G: int):
        """Installed Pins (tests): record the selection of every history region for queries pos [1, T] that skip the
        selection; a replay's pinned decisions for them are the same (any run selects every region there)."""
        ids, valid = kernel.every_region(pos, G, self.cfg.sparse.block)
        self.pins.regions(self.layer_id, req, pos, self.group0, ids, valid, ids.shape[-1])


# --------------------------------------------------------------------------------------------------
# feed-forward


class MLP(nn.Module):
    """Dense SwiGLU MLP / shared expert, TP-sharded along the intermediate dim. Returns the bf16 partial sum."""

    def __init__(self, dim: int, inter: int, limit: float | None):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _weight(inter, dim), _weight(inter, dim), _weight(dim, inter)
        self.limit = limit

    def forward(self, x):
        a = kernel.swiglu(linear(x, self.gate_proj.weight), linear(x, self.up_proj.weight), self.limit)
        return linear(a, self.down_proj.weight)


class Experts(nn.Module):
    """One stacked expert projection: weight [E, out, in] (e4m3 or bf16) and, for FP8, weight_scale_inv."""

    def __init__(self, E: int, out_f: int, in_f: int, fp8: bool):
        super().__init__()
        dt = kernel.FP8 if fp8 else torch.bfloat16
        self.weight = nn.Parameter(torch.empty(E, out_f, in_f, dtype=dt), requires_grad=False)
        blocks = (E, -(-out_f // kernel.QBLOCK), -(-in_f // kernel.QBLOCK))
        self.weight_scale_inv = nn.Parameter(torch.empty(blocks), requires_grad=False) if fp8 else None


class MoE(nn.Module):
    """Replicated sigmoid router + this rank's contiguous range of experts (EP) as stacked tensors."""

    def __init__(self, cfg: Step5Config, layer_id: int, fp8: bool):
        super().__init__()
        D, E, Fi = cfg.hidden_size, cfg.moe_num_experts, cfg.moe_intermediate_size
        self.cfg, self.n_local = cfg, cfg.n_local_experts
        self.gate = _weight(E, D)
        self.router_bias = nn.Parameter(torch.empty(E, dtype=torch.float32), requires_grad=False)
        self.gate_proj = Experts(self.n_local, Fi, D, fp8)
        self.up_proj = Experts(self.n_local, Fi, D, fp8)
        self.down_proj = Experts(self.n_local, D, Fi, fp8)
        self.limit = cfg.clamp(layer_id)
        self.layer_id, self.first_expert = layer_id, rank * self.n_local  # EP: this rank's contiguous expert range
        self.pins = None

    def forward(self, x, at: Placement, shared: "MLP | None" = None):
        """x [T, D] bf16 -> this rank's partial [T, D]: the routed experts' bf16 sum (slots of other ranks' experts
        contribute 0), or with the shared expert MLP, f32(routed) + f32(shared) in fp32 (the kernels run both). at:
        the tokens' positions and requests, which only installed Pins read."""
        c = self.cfg
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        # FP8 experts: the router's kernel also quantises x for them (xq None on the reference path)
        ids, w, xq = kernel.route(x, self.gate.weight, self.router_bias, c.moe_top_k, c.moe_router_scaling_factor,
                                  c.norm_expert_weight, quant=g.weight_scale_inv is not None)  # [T, k] x 2
        if self.pins is not None:
            pinned = self.pins.experts(self.layer_id, at.requests, at.pos, ids)
            if pinned is not None:
                ids, w = kernel.route_ref(x, self.gate.weight, self.router_bias, c.moe_top_k,
                                          c.moe_router_scaling_factor, c.norm_expert_weight, ids=pinned)
        sh = None if shared is None else (shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight,
                                          shared.limit)
        return kernel.moe_experts(x, ids, w, g.weight, u.weight, d.weight, g.weight_scale_inv, u.weight_scale_inv,
                                  d.weight_scale_inv, self.limit, self.first_expert, sh, xq)


class Block(nn.Module):
    def __init__(self, cfg: Step5Config, layer_id: int, fp8: bool):
        super().__init__()
        D = cfg.hidden_size
        self.input_layernorm, self.post_attention_layernorm = NormWeight(D), NormWeight(D)
        self.self_attn = Attention(cfg, layer_id)
        self.is_moe = cfg.is_moe(layer_id)
        if self.is_moe:
            self.moe = MoE(cfg, layer_id, fp8)
            self.share_expert = MLP(D, cfg.share_expert_dim // cfg.tp_size, cfg.clamp(layer_id, shared=True))
        else:
            self.mlp = MLP(D, cfg.intermediate_size // cfg.tp_size, cfg.clamp(layer_id))
        self.eps = cfg.rms_norm_eps

    def forward(self, res, at: Placement, rope, cache):
        """res [T, D] fp32 residual stream -> updated residual (see step)."""
        return self.step(res, None, at, rope, cache)[0]

    def step(self, res, h, at: Placement, rope, cache, next_norm=None):
        """res [T, D] fp32 residual stream -> (updated residual, the next layer's bf16 input or None). The block owns
        both TP reductions of the layer: its sub-modules return this rank's partial sums. h: this layer's normed
        input when the previous layer computed it (fused into its last reduction), else None; next_norm: the next
        layer's input norm weight, fused into this layer's last reduction (one kernel fewer per layer)."""
        if h is None:
            h = kernel.rms_norm(res, self.input_layernorm.weight, self.eps, torch.bfloat16)  # fp32 norm, one rounding
        res, h = tp_reduce_add(res, self.self_attn(h, at, rope, cache), self.post_attention_layernorm.weight, self.eps)
        if self.is_moe:  # routed + shared partials combined in fp32, then ONE fp32 reduction
            y = self.moe(h, at, shared=self.share_expert)
        else:
            y = self.mlp(h)
        return tp_reduce_add(res, y, next_norm, self.eps)


class MTPLayer(Block):
    """A multi-token-prediction layer of the checkpoint (index num_hidden_layers + k): a sliding-attention block
    with a dense MLP, plus the input projection of (next token, hidden) and its own head (Step5ForCausalLM.mtp)."""

    def __init__(self, cfg: Step5Config, layer_id: int):
        super().__init__(cfg, layer_id, fp8=False)
        D = cfg.hidden_size
        self.eh_proj = _weight(D, 2 * D)
        self.enorm, self.hnorm = NormWeight(D), NormWeight(D)
        self.transformer = nn.Module()  # the checkpoint's names: transformer.shared_head.{norm, output}
        self.transformer.shared_head = nn.Module()
        self.transformer.shared_head.norm = NormWeight(D)
        self.transformer.shared_head.output = _weight(cfg.vocab_size // cfg.tp_size, D)  # this rank's vocabulary rows


# --------------------------------------------------------------------------------------------------
# the model and its strict loading

_ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3", torch.float16: "F16",
              torch.uint8: "U8", torch.int64: "I64"}


def first_nonfinite(t: torch.Tensor, chunk: int = 1 << 26) -> int | None:
    """The flat index of t's first NaN or infinity, or None, read `chunk` elements at a time (the check's own memory
    stays small beside a large weight). FP8 has no isfinite: e4m3fn's one non-finite pattern is NaN (S.1111.111),
    e5m2's are those with exponent 11111."""
    if not t.is_floating_point():
        return None
    flat = t.reshape(-1)
    for a in range(0, flat.numel(), chunk):
        x = flat[a:a + chunk]
        if x.dtype == torch.float8_e4m3fn:
            bad = x.view(torch.uint8) & 0x7F == 0x7F
        elif x.dtype == torch.float8_e5m2:
            bad = x.view(torch.uint8) & 0x7C == 0x7C
        else:
            bad = ~torch.isfinite(x)
        if bool(bad.any()):
            return a + int(bad.nonzero()[0])
    return None


class ShardError(ValueError):
    """A shard does not match its config: the message names the file and the key(s)."""


class Step5Model(nn.Module):
    def __init__(self, cfg: Step5Config, fp8_layers: set):
        super().__init__()
        # the table alone (the checkpoint fills it): nn.Embedding's own random init would import torch._dynamo, ~2 s
        # of every rank's start
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16))
        self.embed_tokens.weight.requires_grad_(False)
        L = cfg.num_hidden_layers  # kept MTP layers follow the main stack, under their checkpoint indices
        self.layers = nn.ModuleList([Block(cfg, i, i in fp8_layers) for i in range(L)]
                                    + [MTPLayer(cfg, L + k) for k in range(cfg.mtp_layers_kept)])
        self.norm = NormWeight(cfg.hidden_size)


class Step5ForCausalLM(nn.Module):
    """Step-5 text decoder on one TP/EP rank. Weights come pre-sharded from convert.py (one file per rank).

    The model computes; generate.py decides (prefill, decode steps, CUDA graphs, token choice, stopping).
    """

    def __init__(self, cfg: Step5Config, fp8_layers: set = frozenset(), rank: int = 0):
        super().__init__()
        # The one place the parallel state is set: the config's TP size and this rank; a running process group
        # must agree with both (a shard set of another TP size would otherwise compute silently wrong sums).
        set_parallel(cfg.tp_size, rank)
        if dist.is_initialized() and (dist.get_world_size(), dist.get_rank()) != (cfg.tp_size, rank):
            raise ValueError(f"the process group has world size {dist.get_world_size()} and rank {dist.get_rank()}, "
                             f"but the model is built for tp_size={cfg.tp_size}, rank {rank}")
        self.cfg = cfg
        self.model = Step5Model(cfg, set(fp8_layers))
        self.lm_head = _weight(cfg.vocab_size // cfg.tp_size, cfg.hidden_size)  # this rank's vocabulary window
        self.rope = {}
        self.pins = None

    # ---- loading
    @classmethod
    def from_shard(cls, path: str, cfg: Step5Config, device="cpu", vl: "Step5VLConfig | None" = None,
                   rank: int | None = None):
        """Strict load of one rank's shard: key set, shapes, dtypes and TP/EP/rank metadata are checked from the
        header before any weight data is read; nothing falls back to random initialisation; a NaN or infinity in a
        weight is refused, naming the tensor. The rank defaults to the process group's (0 without one). A VL config
        gives the Step5ForConditionalGeneration."""
        from safetensors import safe_open
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
        if not os.path.isfile(path):
            raise ShardError(f"{path}: no such shard file")
        try:
            f = safe_open(path, "pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for truncated / foreign files
            raise ShardError(f"{path}: not a readable safetensors file ({e})") from None
        with f:
            meta = f.metadata() or {}
            want = {"step4_tp_layout": LAYOUT_VERSION, "tp_size": str(cfg.tp_size),
                    "expert_parallel_size": str(cfg.expert_parallel_size), "rank": str(rank)}
            fp = cfg.raw.get("source_fingerprint")
            if fp is not None:
                want["source_fingerprint"] = fp
            bad = [f"{k}={meta.get(k)!r} (expected {v!r})" for k, v in want.items() if meta.get(k) != v]
            if bad:
                raise ShardError(f"{path}: shard metadata does not match this run's config/rank: {'; '.join(bad)} "
                                 "(a shard of another conversion, TP size or rank?)")
            keys = set(f.keys())
            fp8_layers = {i for i in cfg.moe_layers if f"model.layers.{i}.moe.gate_proj.weight_scale_inv" in keys}
            declared = cfg.config_fp8_layers()
            if cfg.quantization_config and fp8_layers != declared:
                raise ShardError(f"{path}: FP8 expert layers {sorted(fp8_layers)} (by weight_scale_inv presence) "
                                 f"disagree with quantization_config {sorted(declared)}")
            with torch.device("meta"):
                m = (Step5ForConditionalGeneration(vl, fp8_layers, rank) if vl is not None
                     else Step5ForCausalLM(cfg, fp8_layers, rank))
            expect = {k: (tuple(t.shape), t.dtype) for k, t in m.state_dict().items()}
            expect["lm_head.weight"] = ((cfg.vocab_size, cfg.hidden_size), torch.bfloat16)  # stored whole
            missing, unexpected = sorted(expect.keys() - keys), sorted(keys - expect.keys())
            problems = []
            if missing:
                problems.append(f"missing {len(missing)} key(s): {', '.join(missing[:8])}")
            if unexpected:
                problems.append(f"unexpected {len(unexpected)} key(s): {', '.join(unexpected[:8])}")
            for k in sorted(expect.keys() & keys):
                sl = f.get_slice(k)
                shape, dt = tuple(sl.get_shape()), sl.get_dtype()
                if shape != expect[k][0] or dt != _ST_DTYPES[expect[k][1]]:
                    problems.append(f"{k}: {dt}{list(shape)} (expected {_ST_DTYPES[expect[k][1]]}{list(expect[k][0])})")
            if problems:
                raise ShardError(f"{path}: " + "; ".join(problems[:12]))
            sd = {}
            Vl = cfg.vocab_size // cfg.tp_size
            for k in expect:
                t = f.get_slice(k)[rank * Vl:(rank + 1) * Vl] if k == "lm_head.weight" else f.get_tensor(k)
                sd[k] = t.to(device)
                i = first_nonfinite(sd[k])  # on the device: the weights are read there at memory speed
                if i is not None:
                    raise ShardError(f"{path}: {k} holds a non-finite value (flat index {i}: "
                                     f"{sd[k].reshape(-1)[i].float().item()}); the shard is damaged (generate.py "
                                     "--verify checks its sha256)")
        m.load_state_dict(sd, strict=True, assign=True)
        m.finalize()
        return m

    def finalize(self):
        for layer in self.model.layers:
            layer.self_attn.finalize()
        self.requires_grad_(False)
        self.eval()

    def set_pins(self, pins: "Pins | None"):
        """Install (or remove, with None) a Pins test instrument in every MoE and attention layer."""
        self.pins = pins
        for layer in self.model.layers:
            layer.self_attn.pins = pins
            if layer.is_moe:
                layer.moe.pins = pins

    # ---- forward
    def _rope_tables(self, n_pos: int, device):
        """The per-layer tables, rebuilt only when a cache needs more positions than built so far."""
        if self.rope.get("n_pos", 0) < n_pos:
            self.rope = {"n_pos": n_pos, "layers": rope_tables(self.cfg, n_pos, device)}
        return self.rope["layers"]

    def _capacity(self, max_tokens: int) -> int:
        """Cache positions for max_tokens: a multiple of 16 and of the DSA region size; RoPE tables that long."""
        blk = self.cfg.sparse.block if self.cfg.sparse else 1
        cap = -(-max_tokens // 16) * 16
        cap = -(-cap // blk) * blk
        self._rope_tables(cap, self.lm_head.weight.device)
        return cap

    def new_cache(self, B: int, max_tokens: int, slack: int = 0, device=None, verify: bool = False) -> Cache:
        """Caches for B rows (slots) of at most max_tokens positions; slack: extra sliding-ring slots for rows that
        may be rolled back (a speculative step writes up to `slack` rows past what it keeps) or rewound (a reused
        prefix); verify: room for a speculative verify step's copy of the pending rows (Model.hold_pending). device
        "meta" sizes a cache without allocating it."""
        cap, dev = self._capacity(max_tokens + slack), device or self.lm_head.weight.device
        return Cache([layer.self_attn.new_cache(B, cap, dev, slack)
                      for layer in self.model.layers[:self.cfg.num_hidden_layers]], B, cap, dev, verify)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens.weight[ids]  # plain lookup in the replicated table

    def input_embeds(self, ids: torch.Tensor, feats: "torch.Tensor | None" = None) -> torch.Tensor:
        """A prompt's input rows [n, D] bf16. A text-only model has no image features to place."""
        if feats is not None:
            raise ValueError("image features given to a text-only model")
        return self.embed(ids)

    def _place(self, cache: Cache, seq_lens: list | None, rows, dev, Q: int = 1, live=None, held=None,
               real=None) -> Placement:
        """Where this call's tokens go, and the cache lengths advanced past them.

        Prefill (seq_lens): seq_lens[i] tokens for cache row rows[i] (default: row i of every row), packed, on top of
        what each row holds: held[i] positions when the caller keeps count, else a host read of the lengths; rows
        with 0 tokens are skipped. real: Placement's (the rows' lengths advance by it). Decode: Q
        tokens per row of `rows` [B'] (a device tensor; default every row), T = B' * Q row-major, the lengths
        advanced on the device (by Q, or by Q * live for rows with live [B'] 0/1), so the step replays as a CUDA
        graph."""
        if seq_lens is None:
            rows = torch.arange(cache.lengths.shape[0], device=dev) if rows is None else rows
            p0 = cache.lengths[rows]
            pos = (p0[:, None] + torch.arange(Q, device=dev)).flatten()
            cache.lengths[rows] = p0 + (Q if live is None else Q * live) if real is None else p0 + real
            return Placement(pos, rows=rows, Q=Q, real=real)
        rows = list(range(cache.lengths.shape[0])) if rows is None else list(rows)
        if len(seq_lens) != len(rows):
            raise ValueError(f"{len(seq_lens)} prompts for {len(rows)} cache rows")
        p0 = list(held) if held is not None else cache.lengths[torch.tensor(rows, device=dev)].tolist()
        if any(p + n > cache.cap for p, n in zip(p0, seq_lens)):
            raise ValueError(f"prefill of {seq_lens} tokens on {p0} cached ones exceeds the cache of {cache.cap}")
        starts = [e - n for e, n in zip(itertools.accumulate(seq_lens), seq_lens)]
        spans = [(r, s, n, p) for r, s, n, p in zip(rows, starts, seq_lens, p0) if n]
        if real is not None and [p for *_, p in spans] != [0]:
            raise ValueError(f"a padded prefill is one span at position 0, not {spans}")
        pos = torch.cat([torch.arange(p, p + n, device=dev) for _, _, n, p in spans])  # no host copy (CUDA graphs)
        for r, _, n, _ in spans:
            if real is None:
                cache.lengths[r] += n
            else:
                cache.lengths[r:r + 1] = real
        return Placement(pos, spans=spans, real=real)

    def _requests(self, cache: Cache, at: Placement):
        """Each token's request [T] (cache.requests of its row), for installed Pins only."""
        if at.spans is None:
            return cache.requests[at.rows].repeat_interleave(at.Q)
        return torch.cat([cache.requests[r].expand(n) for r, _, n, _ in at.spans])

    def begin(self, ids, cache: Cache, seq_lens: list | None = None, *, rows=None, embeds=None, live=None, held=None,
              real=None, snaps=None) -> "Trunk":
        """A pass over the main layers, placed (the cache lengths advanced past its tokens) with no layer run yet:
        run_layers runs them, in one call or over several (a prefill split between decode steps). Arguments:
        forward's."""
        Q = ids.shape[1] if seq_lens is None and ids.dim() == 2 else 1
        at = self._place(cache, seq_lens, rows, ids.device, Q, live, held, real)
        at.snaps = snaps
        if self.pins is not None:
            at.requests = self._requests(cache, at)
        return Trunk(at, cache, (self.embed(ids.flatten()) if embeds is None else embeds).float())

    def run_layers(self, t: "Trunk", n: int | None = None, progress=None) -> bool:
        """Up to n more of the pass's main layers (None: all that are left) -> whether the pass has run them all.
        progress(i, L) after each prefill layer i of L."""
        L = self.cfg.num_hidden_layers
        stop = L if n is None else min(L, t.done + n)
        for i in range(t.done, stop):
            nxt = self.model.layers[i + 1].input_layernorm.weight if i + 1 < L else None
            t.res, t.h = self.model.layers[i].step(t.res, t.h, t.at, self.rope["layers"][i], t.cache.layers[i], nxt)
            t.done = i + 1
            if progress is not None and t.at.spans is not None:
                progress(i + 1, L)
        return t.done == L

    def _trunk(self, ids, cache: Cache, seq_lens: list | None = None, *, rows=None, embeds=None, live=None, held=None,
               real=None, progress=None, snaps=None):
        """The main layers -> the residual stream [T, D] fp32 of every token (before the final norm). Decode: ids
        [B] (one token per row) or [B, Q] (Q tokens per row, e.g. a speculative verify step)."""
        t = self.begin(ids, cache, seq_lens, rows=rows, embeds=embeds, live=live, held=held, real=real, snaps=snaps)
        self.run_layers(t, progress=progress)
        return t.res

    def _head(self, res: torch.Tensor, norm: NormWeight, out: torch.Tensor) -> torch.Tensor:
        h = kernel.rms_norm(res.bfloat16(), norm.weight, self.cfg.rms_norm_eps)  # narrow first, then norm
        return linear(h, out).float()

    def forward(self, ids, cache: Cache, seq_lens: list | None = None, *, rows=None, embeds=None, live=None,
                held=None, progress=None, snaps=None):
        """Prefill (seq_lens given: ids [T], the next seq_lens[i] tokens of cache row rows[i] packed, on top of what
        the row holds: a whole prompt, or one chunk of it; 0 for rows without tokens in this call) or decode (ids
        [B'], one token per row of `rows` (default: every cache row), or [B', Q]: Q tokens per row; live: _place's).
        Returns this rank's logits window of the last token of each row that received tokens: [B', V/tp] fp32;
        [B', Q, V/tp] for ids [B', Q]. embeds: the input rows [T, D] in place of the ids' embeddings (images).
        held: each prefill row's cached positions as the caller counts them (_place). progress(i, n), if given, is
        called after each of the n layers of a prefill (long prompts report from it). snaps: Placement's."""
        res = self._trunk(ids, cache, seq_lens, rows=rows, embeds=embeds, live=live, held=held, progress=progress,
                          snaps=snaps)
        if seq_lens is not None:
            return self.last_logits(res, seq_lens)
        return self.logits(res).view(*ids.shape[:2], -1)

    def last_logits(self, res: torch.Tensor, seq_lens: list) -> torch.Tensor:
        """A prefill's residual rows [T, D] (seq_lens[i] tokens per row, packed) -> this rank's logits window of each
        row's last token [rows with tokens, V/tp] fp32."""
        ends = [e - 1 for e, n in zip(itertools.accumulate(seq_lens), seq_lens) if n]
        return self.logits(res[torch.tensor(ends, device=res.device)])

    def forward_rows(self, ids, cache: Cache, seq_lens: list | None = None, *, rows=None, embeds=None, live=None,
                     held=None, real=None, progress=None, snaps=None) -> torch.Tensor:
        """forward that keeps every row: the residual of every token [T, D] fp32 (before the final norm), for a
        prefill-style extend (seq_lens) or a decode step of ids [B', Q] (static shapes: a speculative verify step).
        Speculative decoding feeds it to the MTP layers and takes `logits` of the rows it needs (between
        hold_pending and keep_pending); a padded pass (real: _place's) the logits of its last real row."""
        return self._trunk(ids, cache, seq_lens, rows=rows, embeds=embeds, live=live, held=held, real=real,
                           progress=progress, snaps=snaps)

    def hold_pending(self, cache: Cache, rows):
        """Before a speculative verify step of rows [B]: their pending DSA indexer rows, every layer's, copied aside
        (cache.held) for keep_pending."""
        if cache.pending is not None:
            for cur, held in zip(cache.pending, cache.held):
                held.index_copy_(1, rows, cur.index_select(1, rows))

    def keep_pending(self, cache: Cache, rows, start, real):
        """After a speculative verify step of Q tokens per row of rows [B] from positions start [B], of which the
        first real [B] are kept: the pending rows of the region holding the last kept token as if only the kept
        tokens had been written. Row j holds position p = that region's first + j: from before the step (hold_pending)
        where p < start, which a rejected draft at p + blk may have overwritten; else the step's own row of p, which
        no later token of the step overwrote (Q <= blk: the engine checks). A region that a rejected draft completed
        is summarised again when a kept token completes it, and no query reads it before. A few launches for all
        layers at once (the stacked `pending`)."""
        if cache.pending is None:
            return
        before = _kept_region(start, real, cache.pending[0].shape[2])[1][None, :, :, None]  # [1, B, blk, 1]
        for cur, held in zip(cache.pending, cache.held):
            cur.index_copy_(1, rows, torch.where(before, held.index_select(1, rows), cur.index_select(1, rows)))

    def warm_lengths(self, max_context: int, chunk: int) -> list:
        """(first position, tokens) of prefill passes into one cache row that reach every launch variant the prefill
        kernels can take up to max_context positions in chunks of at most `chunk` tokens (kernel.prefill_warm_lengths):
        run at start-up, so no request compiles a kernel. Nothing to warm without the Triton kernels."""
        if not kernel._triton(self.lm_head.weight):
            return []
        return kernel.prefill_warm_lengths(max_context, chunk, self.cfg.sparse.block if self.cfg.sparse else 1,
                                           self.cfg.sparse.topk if self.cfg.sparse else 0)

    def logits(self, res: torch.Tensor) -> torch.Tensor:
        """Residual rows [N, D] fp32 -> this rank's logits window [N, V/tp] fp32."""
        return self._head(res, self.model.norm, self.lm_head.weight)

    # ---- multi-token prediction (layers num_hidden_layers .. + mtp_layers_kept - 1 of the checkpoint)
    def new_mtp_caches(self, B: int, max_tokens: int, slack: int = 0, device=None) -> list:
        """One cache per MTP layer, each with its own lengths (an MTP layer lags the main stack); slack: spare ring
        slots for decode steps of up to slack + 1 rows per request (kernel.sliding_decode) and rewinds."""
        L, cap = self.cfg.num_hidden_layers, self._capacity(max_tokens + slack)
        dev = device or self.lm_head.weight.device
        return [Cache([self.model.layers[L + k].self_attn.new_cache(B, cap, dev, slack)], B, cap, dev)
                for k in range(self.cfg.mtp_layers_kept)]

    def mtp(self, k: int, hidden, next_ids, cache: Cache, seq_lens: list | None, per_row: int = 1, rows=None,
            snaps=None):
        """MTP layer k over seq_lens[i] rows of cache row rows[i], extending its own cache (or, with seq_lens None, a
        decode step of per_row rows per cache row of `rows` at positions cache.lengths[row] + 0 .. per_row-1, static
        shapes, rows row-major): each row combines the residual of the previous depth at its position (hidden [T, D] fp32: the
        main stack's before the final norm, or MTP layer k-1's) with the embedding of the token that follows that
        position (next_ids [T]) as
        eh_proj(concat[enorm(embed(next)), hnorm(hidden)]) -- this order: the reverse predicts almost nothing --
        then a sliding-attention block with a dense MLP. -> the residual [T, D] fp32; its own head is mtp_logits,
        apart: a draft needs one row's logits of each request's q rows, a prompt's absorb none (a 16k-token chunk's
        logits would take 1.5 GB and a [16k, D] x [D, V/tp] GEMM per depth)."""
        layer = self.model.layers[self.cfg.num_hidden_layers + k]
        eps = self.cfg.rms_norm_eps
        at = self._place(cache, seq_lens, rows, next_ids.device, per_row)
        at.snaps = snaps  # a prefill's window snapshots (Placement's)
        e = kernel.rms_norm(self.embed(next_ids).float(), layer.enorm.weight, eps, torch.bfloat16)
        h = kernel.rms_norm(hidden, layer.hnorm.weight, eps, torch.bfloat16)
        x = linear(torch.cat([e, h], -1), layer.eh_proj.weight)  # [T, D] bf16
        return layer(x.float(), at, self.rope["layers"][self.cfg.num_hidden_layers + k], cache.layers[0])

    def mtp_logits(self, k: int, res: torch.Tensor) -> torch.Tensor:
        """MTP layer k's residual rows [N, D] fp32 -> its head's logits window [N, V/tp] fp32: the prediction of the
        token after next."""
        out = self.model.layers[self.cfg.num_hidden_layers + k].transformer.shared_head
        return self._head(res, out.norm, out.output.weight)


class Step5ForConditionalGeneration(Step5ForCausalLM):
    """Step-5 VL: the text decoder plus the perception encoder and projector, replicated on every rank.

    It only supplies input rows: image features overwrite the image-token placeholders of a prompt (no scaling);
    decode steps never see images. Each image contributes its crops first, then its overview.
    """

    def __init__(self, vl: Step5VLConfig, fp8_layers: set = frozenset(), rank: int = 0):
        super().__init__(vl.text, fp8_layers, rank)
        from vision_encoder import VisionModel
        self.vl = vl
        vm = VisionModel(vl.vision, vl.text.hidden_size)
        # registered under the checkpoint's top-level names: vision_model.*, vit_large_projector.weight
        self.vision_model, self.vit_large_projector = vm.vision_model, vm.vit_large_projector
        self._vision = [vm]  # a plain list: the container's modules are registered once, above

    @torch.inference_mode()
    def image_features(self, pixel_values=None, patch_pixel_values=None, num_patches=None, image_embeds=None):
        """Feature rows [n, D] bf16 of one request's images, or None without image inputs."""
        if image_embeds is not None:
            if pixel_values is not None or patch_pixel_values is not None or num_patches is not None:
                raise ValueError("image_embeds is exclusive with pixel_values / patch_pixel_values / num_patches")
            e = torch.as_tensor(image_embeds)
            if e.shape[-1] != self.cfg.hidden_size:
                raise ValueError(f"image_embeds has width {e.shape[-1]}, expected the text hidden size "
                                 f"{self.cfg.hidden_size}")
            return e.reshape(-1, self.cfg.hidden_size).to(self.lm_head.weight.device, torch.bfloat16)
        if pixel_values is None:
            if patch_pixel_values is not None or num_patches is not None:
                raise ValueError("patch_pixel_values / num_patches given without pixel_values")
            return None
        dev = self.lm_head.weight.device
        feats = self._vision[0].image_features(pixel_values.to(dev),
                                               None if patch_pixel_values is None else patch_pixel_values.to(dev),
                                               num_patches)
        # Every rank must hold bit-identical rows: they enter the replicated residual stream that the replicated
        # router reads, and library kernels (e.g. cuDNN convolution algorithms) may differ between processes.
        # Rank 0's copy is the one every rank keeps.
        return tp_gather(feats)[0]

    def input_embeds(self, ids: torch.Tensor, feats: "torch.Tensor | None" = None) -> torch.Tensor:
        """A prompt's input rows [n, D] bf16: token embeddings, image features at the placeholders (in order).
        The one check that a prompt's placeholders and its image features agree in number."""
        x = self.embed(ids)
        slots = ids == self.vl.image_token_id
        n, rows = int(slots.sum()), 0 if feats is None else feats.shape[0]  # host read: prefill only
        if n != rows:
            raise ValueError(f"the prompt holds {n} image placeholder(s) (id {self.vl.image_token_id}) but its image "
                             f"inputs give {rows} feature row(s)")
        return x.masked_scatter(slots[:, None], feats.to(x.device)) if rows else x
