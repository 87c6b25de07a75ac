"""Step-5 text decoder (DSA sparse attention, 352-expert MoE) with co-located TP/EP, and its VL wrapper.

Dimension legend used in shape comments:
  T = tokens in a packed batch, B = requests, D = hidden, H = local query heads, G = local KV groups,
  hd = head dim, E = local experts, k = experts per token, P = indexer proxy dim, R = regions, V = local vocab.
Every number of the architecture comes from the checkpoint's config; nothing here is a literal of the real model.
"""
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import kernel
from config import LAYOUT_VERSION, Step5Config, Step5VLConfig

# --------------------------------------------------------------------------------------------------
# distributed: every collective of the model is one of these two functions (grep "dist\.")

world_size, rank = 1, 0
_REDUCE_BYTES = 1 << 30  # bound on the gathered partials of one tp_reduce call
# torch >= 2.13 renamed all_gather_into_tensor (the GPU machine runs 2.11)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def set_parallel(ws: int, r: int):
    """Set this process's TP/EP world size and rank, once, before building the model."""
    global world_size, rank
    world_size, rank = ws, r


def tp_gather(x: torch.Tensor) -> torch.Tensor:
    """All ranks' copies of x stacked in rank order: [world, *x.shape]."""
    if world_size == 1:
        return x[None]
    out = torch.empty((world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x.contiguous())  # gloo wants the ranks concatenated along dim 0
    return out.view(world_size, *x.shape)


def tp_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of the ranks' partials, added in rank order 0, 1, ... with one fp32 accumulator, rounded once to x.dtype.

    P3.6: unlike a backend all-reduce, the summation order is fixed, so results do not depend on the collective
    algorithm or topology, and every rank holds bit-identical sums (which the replicated router relies on).
    """
    if world_size == 1:
        return x
    # Long prefills reduce in row chunks so the gathered partials stay bounded (128k tokens at TP=8 would
    # otherwise gather 16 GiB of fp32 per MoE layer); decode batches take the single-chunk path.
    rows = max(1, _REDUCE_BYTES // (world_size * x[0].numel() * x.element_size()))
    if x.shape[0] > rows:
        return torch.cat([tp_reduce(c) for c in x.split(rows)])
    parts = tp_gather(x)
    acc = parts[0].float()
    for r in range(1, world_size):
        acc = acc + parts[r].float()
    return acc.to(x.dtype)


# --------------------------------------------------------------------------------------------------
# building blocks


class Norm(nn.Module):
    """Holds a norm's fp32 weight (and bias) under the checkpoint's names."""

    def __init__(self, dim: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(dim, dtype=torch.float32), requires_grad=False) if bias else None


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 GEMM (fp32 accumulation, bf16 result)."""
    return F.linear(x, w)


def _lin(out_f: int, in_f: int, dtype=torch.bfloat16) -> nn.Linear:
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

    for i in range(c.num_hidden_layers):
        t = {"main": table(c.rope_span(i), i)}
        if c.is_dsa(i):
            t["indexer"] = table(c.sparse.rope_dim, i)
        layers.append(t)
    return layers


class LayerCache:
    """Per-layer decode state. Sliding: ring K/V [B, G, W, hd] (token p in slot p mod W). DSA: K/V [B, cap, G, hd],
    region summaries [B, R, P] e4m3, pending indexer key/z of the unfinished region [B, blk, P] bf16."""

    def __init__(self, **bufs):
        self.__dict__.update(bufs)

    def keep(self, rows: torch.Tensor):
        for k, v in self.__dict__.items():
            self.__dict__[k] = v.index_select(0, rows)


class Cache:
    """Static-shape caches for B requests of at most `cap` tokens; `lengths` [B] is shared by all layers."""

    def __init__(self, layers: list, B: int, cap: int, device):
        self.layers, self.cap = layers, cap
        self.lengths = torch.zeros(B, dtype=torch.long, device=device)

    def keep(self, rows: torch.Tensor):
        """Compaction: keep only the cache rows `rows` (requests that finished leave the batch)."""
        self.lengths = self.lengths.index_select(0, rows)
        for c in self.layers:
            c.keep(rows)


# --------------------------------------------------------------------------------------------------
# attention


class Attention(nn.Module):
    """GQA attention with q/k norm + partial RoPE and a head-wise sigmoid output gate; sliding-window (SDPA with a
    ring cache) or, on DSA layers, indexer + region top-k sparse attention."""

    def __init__(self, cfg: Step5Config, layer_id: int):
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        D, hd = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_groups = cfg.n_local_heads, cfg.n_local_groups
        self.q_proj = _lin(self.n_heads * hd, D)
        self.k_proj = _lin(self.n_groups * hd, D)
        self.v_proj = _lin(self.n_groups * hd, D)
        self.o_proj = _lin(D, self.n_heads * hd)
        self.g_proj = _lin(self.n_heads, D)
        self.q_norm, self.k_norm = Norm(hd), Norm(hd)
        self.dsa = cfg.is_dsa(layer_id)
        if self.dsa:
            sp = cfg.sparse
            self.idx_heads = sp.n_heads // sp.n_provider_groups  # indexer heads per group (TP-invariant)
            P = sp.proxy_dim
            self.sparse_indexer_q = _lin(self.n_groups * self.idx_heads * P, D)
            self.sparse_indexer_q_norm = Norm(P)
            self.sparse_indexer_k = _lin(P, D)
            self.sparse_indexer_k_norm = Norm(P, bias=True)
            self.sparse_indexer_z = _lin(P, D)
            self.sparse_indexer_w = _lin(self.n_groups * self.idx_heads, D, dtype=torch.float32)
            self.ssmax_s = nn.Parameter(torch.empty(cfg.num_attention_heads, dtype=torch.float32),
                                        requires_grad=False)  # loaded for a clean key set; unused (spec §4.11)
        self.scale = hd ** -0.5

    def finalize(self):
        """After loading: one packed QKV weight (a single GEMM is what the deployed projection rounds like), and
        the indexer's bf16-rounded norm weights / head weights."""
        self.wqkv = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        del self.q_proj, self.k_proj, self.v_proj
        if self.dsa:
            self.idx_q_norm_w = self.sparse_indexer_q_norm.weight.bfloat16().float()
            self.idx_k_norm_w = self.sparse_indexer_k_norm.weight.bfloat16().float()
            self.idx_k_norm_b = self.sparse_indexer_k_norm.bias.bfloat16().float()
            self.idx_w = self.sparse_indexer_w.weight.bfloat16()

    def new_cache(self, B: int, cap: int, device) -> LayerCache:
        G, hd = self.n_groups, self.cfg.head_dim
        if not self.dsa:
            W = self.cfg.sliding_window
            return LayerCache(k=torch.zeros(B, G, W, hd, dtype=torch.bfloat16, device=device),
                              v=torch.zeros(B, G, W, hd, dtype=torch.bfloat16, device=device))
        sp = self.cfg.sparse
        return LayerCache(k=torch.zeros(B, cap, G, hd, dtype=torch.bfloat16, device=device),
                          v=torch.zeros(B, cap, G, hd, dtype=torch.bfloat16, device=device),
                          # e4m3 bytes kept as uint8: index_put / where are not implemented for float8 on every backend
                          summ=torch.zeros(B, cap // sp.block, sp.proxy_dim, dtype=torch.uint8, device=device),
                          pk=torch.zeros(B, sp.block, sp.proxy_dim, dtype=torch.bfloat16, device=device),
                          pz=torch.zeros(B, sp.block, sp.proxy_dim, dtype=torch.bfloat16, device=device))

    def forward(self, h, pos, rope, spans, cache: LayerCache):
        """h [T, D] bf16 -> [T, D] bf16 (TP-reduced). pos [T] absolute positions; spans: list of (start, n) request
        token spans for prefill, or None for decode (one token per cache row)."""
        T = h.shape[0]
        H, G, hd = self.n_heads, self.n_groups, self.cfg.head_dim
        qkv = linear(h, self.wqkv)
        q, k, v = qkv.split([H * hd, G * hd, G * hd], dim=-1)
        cos, sin = rope["main"][0][pos], rope["main"][1][pos]
        eps = self.cfg.rms_norm_eps
        q = kernel.norm_rope(q.view(T, H, hd), self.q_norm.weight, cos, sin, eps)
        k = kernel.norm_rope(k.view(T, G, hd), self.k_norm.weight, cos, sin, eps)
        v = v.view(T, G, hd)
        if self.dsa:
            o = self._dsa(h, q, k, v, pos, rope["indexer"], spans, cache)
        elif spans is None:
            o = self._sliding_decode(q, k, v, pos, cache)
        else:
            o = self._sliding_prefill(q, k, v, spans, cache)
        gate = torch.sigmoid(linear(h, self.g_proj.weight))  # [T, H] bf16
        o = o * gate[..., None]  # one rounding: the bf16 x bf16 product is exact in fp32
        return tp_reduce(linear(o.reshape(T, H * hd), self.o_proj.weight))

    # ---- sliding window
    def _sliding_prefill(self, q, k, v, spans, cache):
        W, out = self.cfg.sliding_window, torch.empty_like(q)
        for b, (s, n) in enumerate(spans):
            qb, kb, vb = (t[s:s + n].transpose(0, 1) for t in (q, k, v))  # [H|G, n, hd]
            for c0 in range(0, n, 2048):  # query chunks; each sees keys [c0 - W + 1, c1)
                c1, k0 = min(n, c0 + 2048), max(0, c0 - W + 1)
                dq = torch.arange(c0, c1, device=q.device)[:, None] - torch.arange(k0, c1, device=q.device)
                mask = (dq >= 0) & (dq < W)
                o = F.scaled_dot_product_attention(qb[:, c0:c1], kb[:, k0:c1], vb[:, k0:c1], attn_mask=mask,
                                                   scale=self.scale, enable_gqa=True)
                out[s + c0:s + c1] = o.transpose(0, 1)
            keep = torch.arange(max(0, n - W), n, device=q.device)
            cache.k[b, :, keep % W] = kb[:, keep]
            cache.v[b, :, keep % W] = vb[:, keep]
        return out

    def _sliding_decode(self, q, k, v, pos, cache):
        B, W = q.shape[0], self.cfg.sliding_window
        rows = torch.arange(B, device=q.device)
        cache.k[rows, :, pos % W] = k  # the new token first, then attend over the valid slots
        cache.v[rows, :, pos % W] = v
        valid = torch.arange(W, device=q.device) <= pos[:, None]  # slots < min(p + 1, W)
        o = F.scaled_dot_product_attention(q[:, :, None], cache.k, cache.v, attn_mask=valid[:, None, None, :],
                                           scale=self.scale, enable_gqa=True)  # [B, H, 1, hd]
        return o[:, :, 0]

    # ---- DSA
    def _indexer(self, h, pos, rope):
        """Indexer projections: q [T, G, Hg, P] and k [T, P] normalised + rotated (bf16), z [T, P] raw, w [T, G, Hg]."""
        T, sp = h.shape[0], self.cfg.sparse
        P, eps = sp.proxy_dim, self.cfg.rms_norm_eps
        cos, sin = rope[0][pos], rope[1][pos]
        qi = linear(h, self.sparse_indexer_q.weight).view(T, self.n_groups * self.idx_heads, P)
        qi = kernel.norm_rope(qi, self.idx_q_norm_w, cos, sin, eps).view(T, self.n_groups, self.idx_heads, P)
        ki = kernel.norm_rope(linear(h, self.sparse_indexer_k.weight)[:, None], self.idx_k_norm_w, cos, sin, eps,
                              bias=self.idx_k_norm_b)[:, 0]
        zi = linear(h, self.sparse_indexer_z.weight)
        wi = linear(h, self.idx_w).float() * self.idx_heads ** -0.5  # W_Iw rounded to bf16, result widened
        return qi, ki, zi, wi.view(T, self.n_groups, self.idx_heads)

    def _dsa(self, h, q, k, v, pos, rope, spans, cache):
        sp = self.cfg.sparse
        blk, P = sp.block, sp.proxy_dim
        qi, ki, zi, wi = self._indexer(h, pos, rope)
        T, H, hd = q.shape
        G = self.n_groups
        q = q.view(T, G, H // G, hd)
        if spans is None:  # decode: one token per row at position pos[b]; static shapes, no host sync
            B = T
            rows = torch.arange(B, device=h.device)
            cache.k[rows, pos], cache.v[rows, pos] = k, v
            cache.pk[rows, pos % blk], cache.pz[rows, pos % blk] = ki, zi
            # a region completes when its last token arrives: summarise the pending tokens, store only then
            done = (pos % blk == blk - 1)[:, None]
            r = pos // blk
            new = kernel.region_summary(cache.pk, cache.pz).view(torch.uint8)
            cache.summ[rows, r] = torch.where(done, new, cache.summ[rows, r])
            scores = kernel.indexer_scores(qi[:, None], wi[:, None], cache.summ.view(kernel.FP8))  # [B, G, 1, R]
            ids, valid = kernel.select_regions(scores, r[:, None], sp.topk)
            o = kernel.sparse_attention(q[:, None], cache.k, cache.v, ids, valid, pos[:, None], blk, self.scale)
            return o[:, 0].reshape(T, H, hd)
        out = torch.empty_like(q)
        for b, (s, n) in enumerate(spans):  # prefill on an empty cache: positions 0..n-1
            cache.k[b, :n], cache.v[b, :n] = k[s:s + n], v[s:s + n]
            nr = n // blk
            if nr:
                cache.summ[b, :nr] = kernel.region_summary(ki[s:s + nr * blk].view(nr, blk, P),
                                                           zi[s:s + nr * blk].view(nr, blk, P)).view(torch.uint8)
            cache.pk[b, :n - nr * blk], cache.pz[b, :n - nr * blk] = ki[s + nr * blk:s + n], zi[s + nr * blk:s + n]
            for c0 in range(0, n, 256):  # query chunks bound the reference's gathered keys
                c1 = min(n, c0 + 256)
                pb = pos[s + c0:s + c1][None]
                scores = kernel.indexer_scores(qi[None, s + c0:s + c1], wi[None, s + c0:s + c1],
                                               cache.summ[b:b + 1, :nr].view(kernel.FP8))
                ids, valid = kernel.select_regions(scores, pb // blk, sp.topk)
                out[s + c0:s + c1] = kernel.sparse_attention(q[None, s + c0:s + c1], cache.k[b:b + 1, :n],
                                                             cache.v[b:b + 1, :n], ids, valid, pb, blk, self.scale)[0]
        return out.view(T, H, hd)


# --------------------------------------------------------------------------------------------------
# feed-forward


class MLP(nn.Module):
    """Dense SwiGLU MLP / shared expert, TP-sharded along the intermediate dim. Returns the bf16 partial sum."""

    def __init__(self, dim: int, inter: int, limit: float | None):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = _lin(inter, dim), _lin(inter, dim), _lin(dim, inter)
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
        self.gate = _lin(E, D)
        self.router_bias = nn.Parameter(torch.empty(E, dtype=torch.float32), requires_grad=False)
        self.gate_proj = Experts(self.n_local, Fi, D, fp8)
        self.up_proj = Experts(self.n_local, Fi, D, fp8)
        self.down_proj = Experts(self.n_local, D, Fi, fp8)
        self.limit = cfg.clamp(layer_id)

    def forward(self, x):
        """x [T, D] bf16 -> this rank's routed partial [T, D] bf16 (slots of other ranks' experts contribute 0)."""
        c = self.cfg
        ids, w = kernel.route(x, self.gate.weight, self.router_bias, c.moe_top_k, c.moe_router_scaling_factor,
                              c.norm_expert_weight)  # [T, k]
        local = ids - rank * self.n_local
        local = torch.where((local >= 0) & (local < self.n_local), local, -1)
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        return kernel.moe_experts(x, local, w, g.weight, u.weight, d.weight, g.weight_scale_inv,
                                  u.weight_scale_inv, d.weight_scale_inv, self.limit)


class Block(nn.Module):
    def __init__(self, cfg: Step5Config, layer_id: int, fp8: bool):
        super().__init__()
        D = cfg.hidden_size
        self.input_layernorm, self.post_attention_layernorm = Norm(D), Norm(D)
        self.self_attn = Attention(cfg, layer_id)
        self.is_moe = cfg.is_moe(layer_id)
        if self.is_moe:
            self.moe = MoE(cfg, layer_id, fp8)
            self.share_expert = MLP(D, cfg.share_expert_dim // cfg.tp_size, cfg.clamp(layer_id, shared=True))
        else:
            self.mlp = MLP(D, cfg.intermediate_size // cfg.tp_size, cfg.clamp(layer_id))
        self.eps = cfg.rms_norm_eps

    def forward(self, res, pos, rope, spans, cache):
        """res [T, D] fp32 residual stream -> updated residual."""
        h = kernel.rms_norm(res, self.input_layernorm.weight, self.eps, torch.bfloat16)  # fp32 norm, one rounding
        res = res + self.self_attn(h, pos, rope, spans, cache).float()
        h = kernel.rms_norm(res, self.post_attention_layernorm.weight, self.eps, torch.bfloat16)
        if self.is_moe:  # routed + shared partials combined in fp32, then ONE fp32 reduction
            y = tp_reduce(self.moe(h).float() + self.share_expert(h).float())
        else:
            y = tp_reduce(self.mlp(h)).float()
        return res + y


# --------------------------------------------------------------------------------------------------
# the model, strict loading, greedy generation

_ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3", torch.float16: "F16",
              torch.uint8: "U8", torch.int64: "I64"}


class ShardError(ValueError):
    """A shard does not match its config: the message names the file and the key(s)."""


class Step5Model(nn.Module):
    def __init__(self, cfg: Step5Config, fp8_layers: set):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(cfg, i, i in fp8_layers) for i in range(cfg.num_hidden_layers))
        self.norm = Norm(cfg.hidden_size)


class Step5ForCausalLM(nn.Module):
    """Step-5 text decoder on one TP/EP rank. Weights come pre-sharded from convert.py (one file per rank)."""

    def __init__(self, cfg: Step5Config, fp8_layers: set = frozenset()):
        super().__init__()
        self.cfg = cfg
        self.model = Step5Model(cfg, set(fp8_layers))
        self.lm_head = _lin(cfg.vocab_size // cfg.tp_size, cfg.hidden_size)  # this rank's vocabulary window
        self.rope = {}
        self.use_cuda_graph = True  # decode steps on CUDA replay a captured graph (eager launches cost ~10x more)

    # ---- loading
    @classmethod
    def from_shard(cls, path: str, cfg: Step5Config, device="cpu", vl: "Step5VLConfig | None" = None):
        """Strict load of one rank's shard: key set, shapes, dtypes and TP/EP/rank metadata are checked from the
        header before any weight data is read; nothing falls back to random initialisation."""
        from safetensors import safe_open
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
                m = Step5ForConditionalGeneration(vl, fp8_layers) if vl is not None else Step5ForCausalLM(cfg, fp8_layers)
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
        m.load_state_dict(sd, strict=True, assign=True)
        m.finalize()
        return m

    def finalize(self):
        for layer in self.model.layers:
            layer.self_attn.finalize()
        self.requires_grad_(False)
        self.eval()

    # ---- forward
    def _rope_tables(self, n_pos: int, device):
        """The per-layer tables, rebuilt only when a cache needs more positions than built so far."""
        if self.rope.get("n_pos", 0) < n_pos:
            self.rope = {"n_pos": n_pos, "layers": rope_tables(self.cfg, n_pos, device)}
        return self.rope["layers"]

    def new_cache(self, B: int, max_tokens: int) -> Cache:
        blk = self.cfg.sparse.block if self.cfg.sparse else 1
        cap = -(-max_tokens // 16) * 16
        cap = -(-cap // blk) * blk
        dev = self.lm_head.weight.device
        self._rope_tables(cap, dev)
        return Cache([layer.self_attn.new_cache(B, cap, dev) for layer in self.model.layers], B, cap, dev)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens.weight[ids]  # plain lookup in the replicated table

    def forward(self, ids, cache: Cache, seq_lens: list | None = None, embeds=None):
        """Prefill (seq_lens given: ids [T] packed requests on an empty cache) or decode (ids [B], one token per
        cache row). Returns this rank's logits window of each request's last token: [B, V/tp] fp32."""
        dev = ids.device
        if seq_lens is not None:
            if len(seq_lens) != cache.lengths.shape[0]:
                raise ValueError(f"{len(seq_lens)} prompts for a cache of {cache.lengths.shape[0]} rows")
            if bool(cache.lengths.any()):  # a host read, but prefill only
                raise ValueError("prefill needs an empty cache (prefill on top of cached tokens is not supported)")
            starts = [0]
            for n in seq_lens:
                starts.append(starts[-1] + n)
            spans = list(zip(starts[:-1], seq_lens))
            lens = torch.tensor(seq_lens, device=dev)
            pos = torch.arange(ids.shape[0], device=dev) - torch.repeat_interleave(
                torch.tensor(starts[:-1], device=dev), lens)
            cache.lengths.copy_(lens)
            last = torch.tensor(starts[1:], device=dev) - 1
        else:
            spans, pos = None, cache.lengths.clone()
            cache.lengths.add_(1)  # in place: the decode step is replayable as a CUDA graph
            last = None
        x = self.embed(ids) if embeds is None else embeds
        res = x.float()
        rope = self.rope["layers"]
        for layer, lc, rp in zip(self.model.layers, cache.layers, rope):
            res = layer(res, pos, rp, spans, lc)
        if last is not None:
            res = res[last]
        h = kernel.rms_norm(res.bfloat16(), self.model.norm.weight, self.cfg.rms_norm_eps)  # narrow first, then norm
        return linear(h, self.lm_head.weight).float()

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Global argmax over the rank-ordered vocabulary windows (lowest id on ties): [B] int64, same on all ranks."""
        full = tp_gather(logits)  # [world, B, V/tp]
        return full.permute(1, 0, 2).flatten(1).argmax(-1)

    @torch.inference_mode()
    def generate_greedy(self, prompts: list, max_new_tokens: int, eos_ids, embeds_fn=None) -> list:
        """Greedy decoding of a packed batch. Returns each request's generated ids (EOS included when emitted).

        A request that emits EOS leaves the batch: its cache rows are compacted away before the next step. The host
        reads each step's tokens only after the next step has been queued, so the device never waits on it.
        """
        B = len(prompts)
        if B == 0:
            return []
        lens = [len(p) for p in prompts]
        dev = self.lm_head.weight.device
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        cache = self.new_cache(B, max(lens) + max_new_tokens)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
        embeds = embeds_fn(ids) if embeds_fn is not None else None
        logits = self.forward(ids, cache, lens, embeds)
        sync()
        t1 = time.perf_counter()
        out = [[] for _ in range(B)]
        live = list(range(B))  # request index of each cache row
        eos = set(int(e) for e in eos_ids)
        tok = self.greedy(logits) if max_new_tokens > 0 else None
        step_fn = None  # the decode step, as a CUDA graph for the current batch rows (re-captured on compaction)
        for step in range(max_new_tokens):
            last = step == max_new_tokens - 1
            if not last:
                if step_fn is None:
                    step_fn = self._decode_graph(cache, tok) if self.use_cuda_graph and dev.type == "cuda" else (
                        lambda t: self.forward(t, cache))
                logits = step_fn(tok)
            finished = []
            for row, t in enumerate(tok.tolist()):
                out[live[row]].append(t)
                if t in eos:
                    finished.append(row)
            if last or len(finished) == len(live):
                break
            if finished:
                keep = [r for r in range(len(live)) if r not in finished]
                rows = torch.tensor(keep, device=dev)
                cache.keep(rows)
                logits, live = logits.index_select(0, rows), [live[r] for r in keep]
                step_fn = None
            tok = self.greedy(logits)
        sync()
        n_dec = sum(max(len(o) - 1, 0) for o in out)  # the first token of each request comes from the prefill
        self.stats = {"prefill_tokens": sum(lens), "prefill_s": t1 - t0, "decode_tokens": n_dec,
                      "decode_s": time.perf_counter() - t1}
        check_same_on_all_ranks(out, dev)
        return out


    def _decode_graph(self, cache: Cache, tok: torch.Tensor):
        """Capture one decode step (all layers, static shapes, no host sync) as a CUDA graph; returns step(tok).

        The warm-up step writes K/V, pending indexer rows and ring slots at the next position, which the real step
        overwrites, so restoring the lengths makes it invisible. Collectives are captured with the rest.
        """
        static_tok = tok.clone()
        saved = cache.lengths.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compilation and library workspaces happen outside capture
            self.forward(static_tok, cache)
        torch.cuda.current_stream().wait_stream(side)
        cache.lengths.copy_(saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = self.forward(static_tok, cache)
        cache.lengths.copy_(saved)  # capture records without running; keep the state exact anyway

        def step(t):
            static_tok.copy_(t)
            graph.replay()
            return static_logits
        return step


def check_same_on_all_ranks(out: list, device):
    """P3.5: every rank must have produced the same tokens; checked once at the end, not assumed."""
    if world_size == 1:
        return
    flat = torch.tensor([len(o) for o in out] + [t for o in out for t in o], dtype=torch.long, device=device)
    n = torch.tensor([flat.numel()], dtype=torch.long, device=device)
    if not bool((tp_gather(n) == n).all()):
        raise RuntimeError("ranks generated different numbers of tokens")
    if not bool((tp_gather(flat) == flat).all()):
        raise RuntimeError("ranks generated different tokens")


class Step5ForConditionalGeneration(Step5ForCausalLM):
    """Step-5 VL: the text decoder plus the perception encoder and projector, replicated on every rank.

    Image features enter the packed prefill at the image-token placeholders (overwrite, no scaling); decode steps
    never see images. Inputs cover the whole packed batch, images in prompt order across requests.
    """

    def __init__(self, vl: Step5VLConfig, fp8_layers: set = frozenset()):
        super().__init__(vl.text, fp8_layers)
        from vision_encoder import VisionModel
        self.vl = vl
        vm = VisionModel(vl.vision, vl.text.hidden_size)
        # registered under the checkpoint's top-level names: vision_model.*, vit_large_projector.weight
        self.vision_model, self.vit_large_projector = vm.vision_model, vm.vit_large_projector
        self._vision = [vm]  # a plain list: the container's modules are registered once, above

    @torch.inference_mode()
    def image_embeds(self, pixel_values=None, patch_pixel_values=None, num_patches=None, image_embeds=None):
        """Feature rows [n, D] bf16 for the whole batch, or None without image inputs."""
        if image_embeds is not None:
            if pixel_values is not None or patch_pixel_values is not None or num_patches is not None:
                raise ValueError("image_embeds is exclusive with pixel_values / patch_pixel_values / num_patches")
            e = torch.as_tensor(image_embeds)
            if e.shape[-1] != self.cfg.hidden_size:
                raise ValueError(f"image_embeds has width {e.shape[-1]}, expected the text hidden size "
                                 f"{self.cfg.hidden_size}")
            return e.reshape(-1, self.cfg.hidden_size).to(torch.bfloat16, copy=False)
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

    def _embeds_fn(self, feats):
        def fn(ids):
            x = self.embed(ids)
            slots = ids == self.vl.image_token_id
            n = int(slots.sum())  # prefill only: a host read here costs nothing per decode step
            rows = 0 if feats is None else feats.shape[0]
            if n != rows:
                raise ValueError(f"the prompt(s) hold {n} image placeholder(s) (id {self.vl.image_token_id}) but the "
                                 f"image inputs give {rows} feature row(s)")
            if rows:
                x = x.masked_scatter(slots[:, None], feats.to(x.device))
            return x
        return fn

    @torch.inference_mode()
    def generate_greedy(self, prompts, max_new_tokens, eos_ids, pixel_values=None, patch_pixel_values=None,
                        num_patches=None, image_embeds=None):
        feats = self.image_embeds(pixel_values, patch_pixel_values, num_patches, image_embeds)
        return super().generate_greedy(prompts, max_new_tokens, eos_ids, embeds_fn=self._embeds_fn(feats))

    def forward(self, ids, cache, seq_lens=None, embeds=None, pixel_values=None, patch_pixel_values=None,
                num_patches=None, image_embeds=None):
        if seq_lens is not None and embeds is None:
            embeds = self._embeds_fn(self.image_embeds(pixel_values, patch_pixel_values, num_patches, image_embeds))(ids)
        return super().forward(ids, cache, seq_lens, embeds)
