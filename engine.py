"""The long-lived engine: one model, one cache of `max_batch` slots of `max_context` positions, and every compiled
kernel and CUDA graph, all made once at start-up. Requests take a free slot, stream their tokens and leave the slot
without copying any other request's cache.

    eng = Engine(model, EngineConfig(max_batch=4, max_context=8192))
    eng.start()                                   # warm-up: kernels compiled, one decode graph per batch bucket
    reqs = eng.run([Request(ids, max_new_tokens=64, stop_ids=frozenset({4}))])

Each engine step prefills (in chunks, on top of what a slot holds) the requests that wait for it, then runs one
decode step over the slots that decode: greedy or sampled per request (Sampling); with `speculative=K` a decode step
verifies K drafts of the checkpoint's MTP layers per request. A request whose prompt starts with tokens its slot
already holds (a conversation's next turn) prefills only the rest. The host reads a step's tokens after the next
step is queued, so the device never waits for it.

The decode step is one static-shape function of the slot of each row (padding rows of a batch bucket point at slots
that do not decode in the step and write only where their slot's next token would go), replayed as a CUDA graph on
GPUs. So is a fresh prompt's prefill, padded to a power of two in a staging row that its slot then adopts
(_prefill_graph), and a short next turn, as decode steps of several tokens for its slot (_extend_graph): an
eager pass of a few thousand tokens costs the host more than its kernels take.
"""
import contextlib
import hashlib
import inspect
import itertools
import numbers
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import torch
import triton

import kernel
import model as M

PREFILL_CHUNK = 16384  # prefill tokens per engine step (packed over requests); PERF_LOG 2026-12-02: 16k vs 8k / 32k
# Fresh prompts up to this many tokens prefill as a CUDA graph: an eager pass of <= 4k tokens is bound by the host's
# launches (~0.11-0.21 s a pass on the H200 machines, 0.047 s of kernels at 1k; PERF_LOG 2026-12-05)
GRAPH_PREFILL = 4096
# ... and so does a conversation's next turn of up to EXTEND_TURN new tokens, as decode steps of up to 64 tokens for
# its row (each padded to one of EXTEND; the sliding rings' spare slots bound a step: _extend_sizes). The bound of 4
# steps is chosen, not measured: a 64-token step reads most of a rank's experts, so many would cost more kernel time
# than one eager pass costs the host (bench_request.py --turn measures it).
EXTEND = (16, 32, 64)
EXTEND_TURN = 256
REWIND = 64  # positions a slot's prefix may be rewound by to reuse it (sliding rings carry that many spare slots)


# --------------------------------------------------------------------------------------------------
# token choice: identical on every rank, without a broadcast


def full_vocab(logits: torch.Tensor) -> torch.Tensor:
    """This rank's logits window [B, V/tp] -> the full-vocabulary logits [B, V], bit-identical on every rank (every
    rank gathers the same windows in rank order)."""
    return M.tp_gather(logits).permute(1, 0, 2).flatten(1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Global argmax over the rank-ordered vocabulary windows (the lowest id on ties): [B, V/tp] -> [B] int64, the
    same on every rank; -1 in a row whose maximum is not finite (a NaN anywhere in the row, or +inf). Gathers each
    rank's maximum and its id, not the vocabulary: the first maximal window wins, as an argmax of the concatenated
    windows picks."""
    v, i = logits.max(-1)  # [B]: the first maximum, i.e. the lowest id of this window (NaN propagates)
    if M.world_size == 1:
        return torch.where(torch.isfinite(v), i, -1)
    every = M.tp_gather(torch.stack([v.float(), (i + M.rank * logits.shape[-1]).float()]))  # [world, 2, B]
    vals = every[:, 0]  # ids < 2^24 are exact in fp32
    top = vals.amax(0)
    win = (vals == top).int().argmax(0)  # the first rank holding the maximum
    tok = every[:, 1].gather(0, win[None])[0].long()
    return torch.where(torch.isfinite(top), tok, -1)


def is_int(v) -> bool:
    """An integer, Python's or numpy's, and not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass(frozen=True)
class Sampling:
    """One request's token choice: greedy at temperature 0, else a draw from softmax(logits / temperature) within the
    top_k most likely tokens (0: all), then within the top_p nucleus (1: all). `seed` keys the request's own random
    stream: whatever else runs in the batch never changes its draws (on the same device type)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def problem(self, name=lambda field: field) -> str | None:
        """None, or what is wrong, naming the field as name(field) calls it (a flag, a request field)."""
        t, k, p = name("temperature"), name("top_k"), name("top_p")
        if not is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            return f"{t} {self.temperature} must be a finite number >= 0 (0 is greedy decoding)"
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            return f"{p} {self.top_p} must be in (0, 1] (1 keeps every token)"
        if not is_int(self.top_k) or not 0 <= self.top_k < 2 ** 63:
            return f"{k} {self.top_k} must be an integer in [0, 2**63) (0 keeps every token)"
        if self.temperature == 0 and (self.top_k != 0 or self.top_p != 1):
            return (f"{f'{k} {self.top_k}' if self.top_k else f'{p} {self.top_p}'} needs {t} > 0 ({t} 0 is greedy "
                    "decoding)")
        if not is_int(self.seed) or not 0 <= self.seed < 2 ** 63:
            return f"{name('seed')} {self.seed} must be an integer in [0, 2**63)"
        return None


# splitmix64's constants as signed int64 (torch's int64 arithmetic wraps like uint64)
_GOLDEN, _MIX1, _MIX2 = (c - (1 << 64) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _srl(z: torch.Tensor, k: int) -> torch.Tensor:
    return (z >> k) & ((1 << (64 - k)) - 1)  # a logical right shift of int64


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def uniform(seeds: torch.Tensor, counters: torch.Tensor, n: int) -> torch.Tensor:
    """Counter-based uniforms in (0, 1): [B] seeds, [B] counters -> [B, n] fp32, a pure function of (seed, counter,
    column): no generator state, so a request's draws do not depend on its batch, and the step is replayable as a
    CUDA graph. splitmix64 of (mix(seed) + counter) and of that plus each column."""
    base = _mix(_mix(seeds * _GOLDEN) + counters)  # [B]
    z = _mix(base[:, None] + (torch.arange(n, device=seeds.device) + 1) * _GOLDEN)
    return ((_srl(z, 40) & 0xFFFFFF).float() + 0.5) * 2.0 ** -24


@dataclass
class RowSampling:
    """Per-row sampling parameters of a batch as device tensors [B] (Sampling of each row)."""
    temperature: torch.Tensor  # fp32, 0 = greedy
    top_k: torch.Tensor  # int64, 0 = all
    top_p: torch.Tensor  # fp32
    seed: torch.Tensor  # int64

    @staticmethod
    def of(samplings: list, device) -> "RowSampling":
        return RowSampling(torch.tensor([s.temperature for s in samplings], dtype=torch.float32, device=device),
                           torch.tensor([s.top_k for s in samplings], dtype=torch.long, device=device),
                           torch.tensor([s.top_p for s in samplings], dtype=torch.float32, device=device),
                           torch.tensor([s.seed for s in samplings], dtype=torch.long, device=device))


def probabilities(full: torch.Tensor, rs: RowSampling) -> torch.Tensor:
    """Full-vocabulary logits [B, V] -> each row's sampling distribution [B, V] fp32: softmax(logits / temperature)
    restricted to its top_k most likely tokens, then to its top_p nucleus (the smallest set of most likely tokens
    whose mass reaches top_p), renormalised. Greedy rows (temperature 0) get a one-hot at the argmax."""
    x = full.float()
    greedy_row = rs.temperature == 0
    t = torch.where(greedy_row, 1.0, rs.temperature)[:, None]
    x = (x - x.amax(-1, keepdim=True)) / t  # largest 0: a tiny temperature gives -inf, never inf - inf
    # most likely first; stable, so tied logits keep the lowest id first (as greedy's argmax)
    xs, ids = x.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(x.shape[-1], device=x.device)
    keep = (rs.top_k[:, None] == 0) | (rank[None, :] < rs.top_k[:, None])
    ps = torch.where(keep, xs, float("-inf")).softmax(-1)
    # The mass of the more likely tokens (0 for the first), summed in 2^-48 fixed point: integer sums are exact in any
    # order, while a float cumsum on CUDA may round differently between runs and so move the nucleus boundary on one
    # rank. The bound is at least 1 so that the first token always stays (a top_p below 2^-48 keeps only it).
    q = (ps * 2.0 ** 48).long()
    ps = ps.masked_fill(q.cumsum(-1) - q >= (rs.top_p[:, None].double() * 2 ** 48).long().clamp_min(1), 0.0)
    ps = ps / ps.sum(-1, keepdim=True)
    ps = torch.where(greedy_row[:, None], (rank == 0).float()[None, :], ps)
    return torch.zeros_like(ps).scatter_(-1, ids, ps)


def draw(probs: torch.Tensor, rs: RowSampling, counters: torch.Tensor) -> torch.Tensor:
    """A token per row from probs [B, V] -> [B] int64, keyed by (seed, counter): the exponential race argmax_i p_i /
    E_i with E_i ~ Exp(1) picks i with probability p_i / sum(p), so a masked distribution needs no renormalising.
    A row whose probabilities are not finite gets -1."""
    e = -torch.log(uniform(rs.seed, counters * 4, probs.shape[-1]))  # stream 0 of the counter
    tok = (probs / e).argmax(-1)
    return torch.where(torch.isfinite(probs).all(-1), tok, -1)


def sample(logits: torch.Tensor, rs: RowSampling, counters: torch.Tensor) -> torch.Tensor:
    """This rank's logits window [B, V/tp] -> [B] int64 drawn per row by its own parameters and random stream (greedy
    rows: the argmax), the same on every rank: every rank holds the same full-vocabulary logits and draws alike."""
    return draw(probabilities(full_vocab(logits), rs), rs, counters)


# --------------------------------------------------------------------------------------------------
# graphs


class Graph:
    """fn(*inputs) as a CUDA graph, captured once (`capture`) and replayed (`__call__`): callers write the inputs
    into the graph's own input tensors. `state()` names tensors fn updates in place (cache lengths): the warm-up and
    capture runs restore them, so only replays advance the state. The warm-up also writes K/V, pending indexer rows
    and ring slots at the next position of the slots it is given, which the slots' next real step overwrites.
    Without `use_graph` (CPU, or --no-cuda-graph) fn runs eagerly."""

    def __init__(self, fn, inputs: list, use_graph: bool, state=lambda: (), pool=None):
        self.fn, self.inputs, self.use_graph, self.state, self.pool = fn, inputs, use_graph, state, pool
        self.graph = self.out = None

    @contextlib.contextmanager
    def _state_kept(self):
        """The state as it was before the block, put back after it (outside a capture: the copies are not recorded)."""
        saved = [s.clone() for s in self.state()]
        yield
        for s, v in zip(self.state(), saved):
            s.copy_(v)

    def warm(self):
        """fn once, eagerly on the current stream (its launches compile), the state put back."""
        with self._state_kept():
            self.fn(*self.inputs)

    def capture(self):
        """Warm-up and capture (without graphs: the warm-up alone, so start-up has run every step's launches)."""
        if not self.use_graph:
            self.warm()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compilation and library workspaces happen outside capture
            self.warm()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with self._state_kept(), torch.cuda.graph(self.graph, pool=self.pool):  # collectives captured with the rest
            self.out = self.fn(*self.inputs)

    def __call__(self):
        if not self.use_graph:
            return self.fn(*self.inputs)
        self.graph.replay()
        return self.out


def buckets(max_batch: int) -> list:
    """Decode batch sizes with a graph of their own: the powers of two below max_batch, and max_batch."""
    return [b for b in (1 << i for i in range(max_batch.bit_length())) if b < max_batch] + [max_batch]


# --------------------------------------------------------------------------------------------------
# requests


@dataclass(eq=False)
class Request:
    """One generation. ids: the prompt; features: its image feature rows [n, D] bf16, one per image placeholder of
    ids in order (model.image_features), or None."""
    ids: list
    max_new_tokens: int
    stop_ids: frozenset = frozenset()
    sampling: Sampling = field(default_factory=Sampling)
    features: torch.Tensor | None = None
    # set by the engine
    rid: int = -1
    out: list = field(default_factory=list)  # emitted ids (a stop id included)
    finish: str | None = None  # "stop" (a stop id was emitted), "length" (max_new_tokens), "cancelled", "error" (a
    # step raised: Engine.abandon)
    slot: int = -1
    cached: int = 0  # prompt tokens reused from the slot's cache
    prefilled: int = 0  # prompt tokens in the cache so far
    t_first: float | None = None  # perf_counter of the first token
    key: list = field(default_factory=list)  # the prompt as prefix reuse compares it (reuse_key)

    def embeds(self, model, a: int, b: int):
        """Input rows of prompt tokens a..b-1 [b - a, D] bf16 with the image features at their placeholders, or None
        for a text request (the model embeds the ids itself)."""
        if self.features is None:
            return None
        tok_id = model.vl.image_token_id
        k0 = sum(t == tok_id for t in self.ids[:a])
        k1 = k0 + sum(t == tok_id for t in self.ids[a:b])
        dev = model.lm_head.weight.device
        return model.input_embeds(torch.tensor(self.ids[a:b], device=dev), self.features[k0:k1] if k1 > k0 else None)


def reuse_key(model, req: Request) -> list:
    """The prompt as prefix reuse compares it: its ids, each image placeholder replaced by a fingerprint of its feature
    row (a negative number), so a slot's cache is reused for the same image only: another image of the same size has
    the same placeholder ids."""
    if req.features is None:
        return list(req.ids)
    rows = req.features.contiguous().view(torch.int16).long()  # [n, D]: the bf16 bits
    w = torch.randint(-(1 << 62), 1 << 62, (rows.shape[-1],), generator=torch.Generator().manual_seed(0))
    fp = iter((rows * w.to(rows.device)).sum(-1).tolist())  # a host read: once per request
    tok = model.vl.image_token_id
    return [-1 - (next(fp) & ((1 << 62) - 1)) if t == tok else t for t in req.ids]


@dataclass(eq=False)
class Slot:
    held: list = field(default_factory=list)  # reuse_key of the ids whose K/V this cache row holds, in position order
    owner: Request | None = None
    used: int = 0  # engine step of the last use (the least recently used free slot is taken first)
    stale: bool = False  # a speculative padding row wrote below its owner's length: forget the prefix at release


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# --------------------------------------------------------------------------------------------------
# memory plan


GIB = 1 << 30


@dataclass
class MemoryPlan:
    """Device memory of an engine, in bytes: what is loaded, what the plan allocates, what is left."""
    weights: int
    caches: int
    prefill: int
    graphs: int
    headroom: int
    free: int  # what the device had free after loading (CPU: not checked)

    def fits(self) -> bool:
        return self.free < 0 or self.caches + self.prefill + self.graphs + self.headroom <= self.free

    def line(self) -> str:
        parts = [f"weights {self.weights / GIB:.1f}", f"caches {self.caches / GIB:.2f}",
                 f"prefill workspace {self.prefill / GIB:.2f}", f"graphs {self.graphs / GIB:.2f}",
                 f"headroom {self.headroom / GIB:.1f}"]
        left = "" if self.free < 0 else f"; free {self.free / GIB:.1f}"
        return "memory plan (GiB): " + ", ".join(parts) + left


def prefill_workspace(cfg, chunk: int) -> int:
    """Activation bytes of one prefill pass of `chunk` tokens: ~64 B per token and hidden unit (an H200 measurement of
    one TP=8 rank's layer, bench_prefill.py: 4.4 GiB at 16384 tokens, 0.8 GiB of it weights), plus the DSA scores'
    128 MiB bound."""
    return chunk * cfg.hidden_size * 64 + (128 << 20)


# --------------------------------------------------------------------------------------------------
# the engine


@dataclass
class EngineConfig:
    max_batch: int = 1
    max_context: int | None = None  # None: what fits (capped at the config's max_position_embeddings)
    prefill_chunk: int = PREFILL_CHUNK
    speculative: int = 0  # MTP drafts per decode step (0: plain decoding)
    cuda_graph: bool = True
    build_threads: int | None = None  # start-up's parallel kernel builds (None: the rank's share of the CPU cores, at
    # most 16; 0 or 1: the warm-up passes in order)
    graph_prefill: int | None = None  # prefill graphs up to this padded length, and with them the extension graphs
    # (_prefill_graphs_for; None: GRAPH_PREFILL where the decode graphs run, else 0; 0: none; on the CPU the padded
    # passes run eagerly, for tests)


@dataclass
class StepOutput:
    """What one engine step produced: (request, new ids) pairs in order, and the requests that finished."""
    tokens: list = field(default_factory=list)
    finished: list = field(default_factory=list)


class EngineError(RuntimeError):
    """A request's computation went wrong (non-finite logits): the message names the request and the step."""


@contextlib.contextmanager
def one_build_per_variant():
    """Within: a Triton kernel variant that several threads launch before it is built is compiled by the first of
    them, and the others wait for it and take its build. Triton's JIT looks a variant up in its in-memory cache
    before compiling and stores it after, so threads that want it meanwhile compile it again each (a cold start
    from threads made 411 builds where one in order makes 124, PERF_LOG 2026-12-05 (afternoon)). Wraps
    JITFunction._do_compile(self, key, signature, device, ...) where it has that form; elsewhere nothing changes."""
    from triton.runtime.jit import JITFunction
    build = getattr(JITFunction, "_do_compile", None)
    if build is None or list(inspect.signature(build).parameters)[:4] != ["self", "key", "signature", "device"]:
        yield
        return
    locks, guard = {}, threading.Lock()

    def once(fn, key, signature, device, *rest, **kw):
        with guard:
            lock = locks.setdefault((id(fn), device, key), threading.Lock())
        with lock:
            built = fn.device_caches[device][0].get(key)  # what a thread that held the lock before built
            return built if built is not None else build(fn, key, signature, device, *rest, **kw)
    JITFunction._do_compile = once
    try:
        yield
    finally:
        JITFunction._do_compile = build


class Engine:
    def __init__(self, model: M.Step5ForCausalLM, config: EngineConfig, say=lambda *a: None):
        c, cfg = config, model.cfg
        for name in ("max_batch", "max_context", "prefill_chunk", "speculative", "build_threads", "graph_prefill"):
            v = getattr(c, name)
            if v is not None and not is_int(v):
                raise ValueError(f"{name} {v!r} must be an integer")
        if c.max_batch < 1:
            raise ValueError(f"max_batch {c.max_batch} must be >= 1")
        if c.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk {c.prefill_chunk} must be >= 1")
        if c.speculative and not 1 <= c.speculative <= cfg.mtp_layers_kept:
            raise ValueError(f"speculative decoding with {c.speculative} drafts needs {c.speculative} MTP layers; "
                             f"the shards keep {cfg.mtp_layers_kept} (convert.py --keep-mtp)")
        if c.speculative and cfg.sparse and c.speculative + 1 > cfg.sparse.block:  # Model.keep_pending's bound
            raise ValueError(f"speculative decoding with {c.speculative} drafts writes more than a DSA region of "
                             f"{cfg.sparse.block} tokens per step")
        self.model, self.config, self.say = model, c, say
        self.dev = model.lm_head.weight.device
        self.k = c.speculative
        self.use_graph = c.cuda_graph and self.dev.type == "cuda"
        # spare ring slots: a rewind for prefix reuse, and the rows a speculative step writes past what it keeps
        self.slack = REWIND + 2 * self.k + 2
        self._said = None  # the plan's line as last said
        self._replan()
        B = c.max_batch
        self.cache, self.cap, self.mtps = None, 0, []  # allocated by start(), after its parallel kernel builds
        self.slots = [Slot() for _ in range(B)]
        self.next_tok = torch.zeros(B, dtype=torch.long, device=self.dev)  # each slot's next token to feed
        self.count = torch.zeros(B, dtype=torch.long, device=self.dev)  # tokens each slot's request emitted
        self.waiting, self.running = [], []  # requests queued for a slot; requests holding one
        self.steps, self.rids = 0, itertools.count()
        self.inflight = None  # (requests, host copy) of the decode step whose tokens the host has not read yet
        self.spec = Speculator(self) if self.k else None
        self.graphs = {}
        self.prefill_graphs, self.staging = {}, None  # padded length -> Graph (_prefill_graph), and their cache row
        self.extend_graphs = {}  # padded length -> Graph (_extend_graph)
        self.timing = {}
        # progress(first token, tokens, longest prompt, layer, layers, start) during prefills; start: where the first
        # piece's prefill began (after its reused prefix)
        self.progress = None

    # ---- start-up
    def _replan(self, agree: bool = False):
        """The memory plan and context on what the device has free now, said; refused (naming the flags) when it does
        not fit. agree (start-up, on every rank): the ranks take the least context any of them fits, so each refuses or
        keeps a request as every other does."""
        self.plan, self.max_context = self._plan(self.config)
        if agree and M.world_size > 1 and self.config.max_context is None:
            least = int(M.tp_gather(torch.tensor([self.max_context], device=self.dev)).min())
            if least != self.max_context:
                self.plan, self.max_context = self._plan(replace(self.config, max_context=least))
        if self.plan.line() != self._said:  # said once, and again only if it changed
            self._said = self.plan.line()
            self.say(self._said)
        if not self.plan.fits():
            raise MemoryError(f"the engine does not fit: {self.plan.line()}; lower --max-context "
                              f"({self.max_context}) or --max-batch ({self.config.max_batch})")

    def _plan(self, c: EngineConfig) -> tuple[MemoryPlan, int]:
        """The memory plan and the context length: c.max_context, or what fits (a multiple of 128, capped at
        max_position_embeddings)."""
        m, cfg = self.model, self.model.cfg
        limit = cfg.max_position_embeddings
        # caches: a fixed part (sliding rings, pending rows) and bytes per position of every slot
        per_token = (self._cache_bytes(2048) - self._cache_bytes(1024)) / 1024
        fixed = self._cache_bytes(1024) - 1024 * per_token
        if self.dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.dev)
            free += torch.cuda.memory_reserved(self.dev) - torch.cuda.memory_allocated(self.dev)
            weights = torch.cuda.memory_allocated(self.dev)
        else:
            free, weights = -1, sum(t.numel() * t.element_size() for t in m.state_dict().values())
        prefill = prefill_workspace(cfg, c.prefill_chunk)
        graphs = (256 << 20) * len(buckets(c.max_batch)) if self.use_graph else 0
        sizes = self._prefill_sizes(c)
        if sizes:  # the padded passes' staging row and their graphs' workspace; the extensions' graphs
            graphs += self._staging_bytes(sizes[-1]) + (prefill_workspace(cfg, sizes[-1]) if self.use_graph else 0)
            graphs += (256 << 20) * len(EXTEND) if self.use_graph else 0
            graphs += 2 * sizes[-1] * cfg.hidden_size * 4 if self.k else 0  # their residual rows kept as outputs
        headroom = 2 * GIB if self.dev.type == "cuda" else 0
        ctx = c.max_context
        if ctx is None:
            ctx = limit
            if free >= 0:
                fit = int((free - prefill - graphs - headroom - fixed) / per_token) - self.slack
                ctx = min(limit, fit // 128 * 128)
            if ctx < 16:
                raise MemoryError(f"no room for a KV cache after the weights ({weights / GIB:.1f} GiB, "
                                  f"{max(free, 0) / GIB:.1f} GiB free): lower --max-batch ({c.max_batch}) or "
                                  f"--prefill-chunk ({c.prefill_chunk})")
        if not 1 <= ctx <= limit:
            raise ValueError(f"max_context {ctx} must be in [1, max_position_embeddings={limit}]")
        return MemoryPlan(weights, self._cache_bytes(ctx), prefill, graphs, headroom, free), ctx

    def _prefill_sizes(self, c: EngineConfig) -> list:
        """The padded lengths of the prefill graphs: powers of two from 32 up to the first that holds
        c.graph_prefill tokens, within the prefill chunk and the context."""
        top = c.graph_prefill if c.graph_prefill is not None else GRAPH_PREFILL if self.use_graph else 0
        ctx = c.max_context or self.model.cfg.max_position_embeddings
        top = min(top, c.prefill_chunk, ctx)
        if top < 1:
            return []
        sizes = [32]
        while sizes[-1] < top:
            sizes.append(2 * sizes[-1])
        return [n for n in sizes if n <= ctx]

    def _staging_bytes(self, n: int) -> int:
        return sum(t.numel() * t.element_size() for lc in self._staging(n, "meta").layers for t in vars(lc).values())

    def _staging(self, n: int, device=None) -> M.Cache:
        """The padded passes' cache: one row of n positions whose sliding rings hold all n (ring slot = position), so
        that the real tokens' last keys can be picked from it (_adopt)."""
        return self.model.new_cache(1, n, slack=n, device=device)

    def _cache_bytes(self, ctx: int, B: int | None = None) -> int:
        """Bytes of the caches for B (default max_batch) slots of ctx positions (built on the meta device: nothing
        allocated)."""
        m, B = self.model, B or self.config.max_batch
        caches = [m.new_cache(B, ctx, slack=self.slack, device="meta", verify=bool(self.k))]
        if self.k:
            caches += m.new_mtp_caches(B, ctx, slack=self.slack, device="meta")
        tensors = [t for c in caches for lc in c.layers for t in vars(lc).values()] + [t for c in caches
                                                                                   for t in c.held or ()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def start(self):
        """Every kernel variant a request can reach compiled (warm-up prefills, and per batch bucket the decode
        step), the caches allocated, every decode graph captured; times reported."""
        sync = torch.cuda.synchronize if self.dev.type == "cuda" else (lambda: None)
        m, B, t0 = self.model, self.config.max_batch, time.perf_counter()
        threads = self.config.build_threads
        if threads is None:  # the CPU cores this process may use, shared with the node's other ranks
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            threads = min(16, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if self.dev.type == "cuda" else 0
        passes = m.warm_lengths(self.max_context, self.config.prefill_chunk)
        # the warm-up passes from threads, before the caches exist (their launches are the passes' own), unless a
        # start-up has built them into Triton's disk cache: then the builds only read it and the threads only contend
        # for the GIL, slower than the warm-up in order. Every rank takes one answer (the warm-up in order runs
        # collectives): from threads if any rank lacks the marker.
        marker = self._built_marker(passes) if threads > 1 and passes else None
        ahead = marker is not None and not os.path.exists(marker)
        if M.world_size > 1:
            ahead = bool(M.tp_gather(torch.tensor([int(ahead)], device=self.dev)).max())
        if ahead:
            self._build_ahead(passes, threads)
        self._replan(agree=True)  # on what the builds left free (library workspaces and loaded kernels stay behind)
        sizes = self._prefill_sizes(replace(self.config, max_context=self.max_context))
        # the agreed context's passes; a prefill graph's capture runs its own pass (the same launches) first, so of
        # a pass of a graph's length only the MTP layers' absorb of its rows is left to warm up
        in_order = [] if ahead else [(p0, n, not (p0 == 0 and n in sizes))
                                     for p0, n in m.warm_lengths(self.max_context, self.config.prefill_chunk)]
        in_order = [(p0, n, main) for p0, n, main in in_order if main or self.k]
        tb = time.perf_counter()
        self.cache = m.new_cache(B, self.max_context, slack=self.slack, verify=bool(self.k))
        self.cap = self.cache.cap
        self.mtps = m.new_mtp_caches(B, self.max_context, slack=self.slack) if self.k else []
        self.staging = self._staging(sizes[-1]) if sizes else None  # before any capture: it may extend RoPE's tables
        with torch.inference_mode():
            for p0, n, main in in_order:
                self._warm(p0, n, main=main)
            sync()
            t1 = time.perf_counter()
            pool = torch.cuda.graph_pool_handle() if self.use_graph else None
            for b in buckets(B):
                self.graphs[b] = self.spec.graphs(b, pool) if self.spec else self._plain_graph(b, pool)
            self.extend_graphs = {q: self._extend_graph(q, pool) for q in self._extend_sizes(sizes)}
            if ahead:
                self._warm_graphs_ahead(threads)
            for gs in self.graphs.values():
                for g in gs:
                    g.capture()
            self._capture_prefill_graphs(sizes)
            sync()
        t2 = time.perf_counter()
        self.cache.lengths.zero_()  # the warm-ups wrote garbage at the first positions of slots: nothing is held
        for c in self.mtps:
            c.lengths.zero_()
        self.timing = {"build_s": tb - t0, "warmup_s": t1 - tb, "capture_s": t2 - t1}
        if marker is not None and not os.path.exists(marker):
            try:  # best effort: a read-only cache (copied from another node) only means the next start builds again
                os.makedirs(os.path.dirname(marker), exist_ok=True)
                with open(f"{marker}.{os.getpid()}.tmp", "w") as f:
                    f.write("a start-up built every kernel of its warm-up passes into this cache\n")
                os.replace(f"{marker}.{os.getpid()}.tmp", marker)
            except OSError as e:
                self.say(f"start-up: could not mark Triton's cache as built ({e}); the next start-up builds from "
                         "threads again")
        self.say("start-up: " + (f"kernels built ahead from {threads} threads in {tb - t0:.1f} s, " if ahead
                                  else f"warm-up {t1 - tb:.1f} s, ")
                 + (f"{sum(map(len, (*self.graphs.values(), self.prefill_graphs, self.extend_graphs)))} CUDA graphs "
                    f"captured in {t2 - t1:.1f} s" if self.use_graph else "decode steps run eagerly")
                 + f" (batch buckets {list(self.graphs)}"
                 + (f"; prefills padded to {list(self.prefill_graphs)}, turns in steps of {list(self.extend_graphs)}"
                    if self.prefill_graphs else "") + ")")

    def _capture_prefill_graphs(self, sizes: list):
        """The extension graphs, and a prefill graph per padded length. One that cannot be captured (a host read on
        the prefill path) leaves prompts to the eager prefill, said once."""
        pool = torch.cuda.graph_pool_handle() if self.use_graph else None
        try:
            for g in self.extend_graphs.values():
                g.capture()
            for n in sizes:
                self.prefill_graphs[n] = g = self._prefill_graph(n, pool)
                g.capture()
        except RuntimeError as e:
            if not self.use_graph:
                raise
            self.prefill_graphs, self.extend_graphs = {}, {}
            self.say(f"start-up: a prefill graph could not be captured ({str(e).splitlines()[0]}); prompts prefill "
                     "eagerly")

    def _extend_sizes(self, sizes: list) -> list:
        """The extension graphs' token counts (with the prefill graphs): at most what the sliding rings' spare slots
        let one decode step write before its queries read (a ring of R slots and window W takes W + Q - 1 <= R)."""
        if not sizes:
            return []
        W = self.model.cfg.sliding_window
        spare = min((lc.k.shape[2] - W + 1 for lc in self.cache.layers if getattr(lc, "summ", None) is None),
                    default=max(EXTEND))
        return [q for q in EXTEND if q <= min(spare, self.max_context)]

    def _extend_graph(self, q: int, pool) -> Graph:
        """A next turn's prefill of up to q tokens on top of what its slot holds, as one decode step of q tokens for
        that row (the positions, the slot and the real count are device inputs: any turn of up to q tokens replays
        it). Inputs: the ids [1, q] (padded with token 0), the real tokens [1], the slot [1]; -> this rank's logits
        [1, V/tp] of the last real token (with speculative decoding, and the residual rows [q, D] for the MTP
        layers). The padding's writes past the real tokens are rewritten by later steps before anything reads them, but
        for the pending DSA rows it overwrites past a region boundary, which the layers put back (Placement.real); the
        slot's length advances by the real count."""
        m, cache = self.model, self.cache
        ids = torch.zeros(1, q, dtype=torch.long, device=self.dev)
        real = torch.full((1,), q, dtype=torch.long, device=self.dev)
        slot = torch.zeros(1, dtype=torch.long, device=self.dev)

        def extend(ids, real, slot):
            res = m.forward_rows(ids, cache, rows=slot, real=real)  # [q, D]; the slot's length advances by real
            lg = m.logits(res.index_select(0, real - 1))
            return (lg, res) if self.spec else lg
        return Graph(extend, [ids, real, slot], self.use_graph, state=lambda: (cache.lengths,), pool=pool)

    def _prefill_graph(self, n: int, pool) -> Graph:
        """A fresh prompt's prefill padded to n tokens in the staging row, then adopted by its slot. Inputs: the ids
        [n] (padded with token 0), the real tokens [1], the slot [1]; -> this rank's logits [1, V/tp] of the last real
        token (with speculative decoding, and the residual rows [n, D] for the MTP layers). Padding follows the real
        tokens, so no real token attends to it (causal) or shares a decision with it (routing and region selection are
        per token); the real rows are an n-token pass's but for the GEMMs' row counts (their accumulation order may
        differ in last bits, as between prefill chunkings)."""
        m, st = self.model, self.staging
        ids = torch.zeros(n, dtype=torch.long, device=self.dev)
        real = torch.full((1,), n, dtype=torch.long, device=self.dev)
        slot = torch.zeros(1, dtype=torch.long, device=self.dev)

        def prefill(ids, real, slot):
            st.requests.copy_(self.cache.requests.index_select(0, slot))  # the request, for installed Pins
            res = m.forward_rows(ids, st, [n], rows=[0], held=[0], real=real)  # [n, D]
            self._adopt(slot, real, n)
            lg = m.logits(res.index_select(0, real - 1))
            return (lg, res) if self.spec else lg
        return Graph(prefill, [ids, real, slot], self.use_graph, state=lambda: (self.cache.lengths,), pool=pool)

    def _adopt(self, slot, real, n: int):
        """The staging row after a padded pass of n tokens into cache row slot [1], by index tensors (no host read):
        DSA K/V of the n positions, the summaries of the regions they complete and the pending rows; ring slot j of a
        sliding layer <- the last real position in slot j (mod R), which the staging ring holds at slot = position
        (padding's writes past `real` are overwritten by later steps before they are read, as a decode step's)."""
        src = {}
        for lc, sc in zip(self.cache.layers, self.staging.layers):
            if getattr(lc, "summ", None) is not None:
                done = n // sc.pk.shape[1]
                for name in ("k", "v"):
                    getattr(lc, name)[:, :n].index_copy_(0, slot, getattr(sc, name)[:, :n])
                lc.summ[:, :done].index_copy_(0, slot, sc.summ[:, :done])
                lc.pk.index_copy_(0, slot, sc.pk)
                lc.pz.index_copy_(0, slot, sc.pz)
                continue
            R = lc.k.shape[2]
            if R not in src:  # [R]: the staging slot (= position) each ring slot takes; 0 where no real position is
                src[R] = ((real - 1) - (real - 1 - torch.arange(R, device=real.device)) % R).clamp(min=0)
            for name in ("k", "v"):
                getattr(lc, name).index_copy_(0, slot, getattr(sc, name).index_select(2, src[R]))
        self.cache.lengths.index_copy_(0, slot, real)

    def _build_ahead(self, passes: list, threads: int):
        """The warm-up prefill passes from a pool of threads, before the caches exist: each pass in a cache of its own
        (one slot, as long as the pass needs: its launches are those of the engine's cache, whose strides take the
        same integer classes; tests/test_engine.py compares the two), on a stream of its own, with this rank's
        collectives left out (model.alone: threads take turns in another order on every rank). Triton's compilation
        leaves the GIL for most of its time, so the passes' kernels compile side by side. Passes wait for device
        memory: their caches and workspaces stay within what the plan leaves beside the caches it has yet to
        allocate. The results are discarded."""
        m = self.model
        m._capacity(self.max_context + self.slack)  # RoPE tables for every pass, built before any thread reads them
        total = self.plan.caches + self.plan.prefill + self.plan.graphs if self.plan.free >= 0 else 1 << 62
        room, ready = [total], threading.Condition()

        def one(p0: int, n: int):
            # its cache and workspace; a pass larger than the whole room runs alone
            need = min(self._cache_bytes(p0 + n, 1) + prefill_workspace(m.cfg, n), total)
            with ready:
                ready.wait_for(lambda: room[0] >= need)
                room[0] -= need
            try:
                self._warm_alone(p0, n)
            finally:
                with ready:
                    room[0] += need
                    ready.notify_all()
        self._from_threads(threads, one, sorted(passes, key=lambda pn: -pn[1]))

    def _warm_graphs_ahead(self, threads: int):
        """Each batch bucket's decode step(s) and each extension step once, eagerly, from a pool of threads (one a
        thread), so their kernels compile side by side and the captures after only capture. The steps write at the
        first slots' next positions, as a capture's warm-up does; the threads' steps overlap on the same slots, so what
        they write is garbage the slots' first real steps overwrite (start-up forgets the slots)."""
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)  # the caches' zeroing done before the threads' streams read them

        def one(graphs: list):
            with self._alone():
                for g in graphs:
                    g.warm()
        self._from_threads(threads, one, [(gs,) for gs in self.graphs.values()]
                           + [([g],) for g in self.extend_graphs.values()])

    def _from_threads(self, threads: int, fn, calls: list):
        """fn(*args) for each args of calls from a pool of threads (a kernel variant wanted by several at once is
        compiled once: one_build_per_variant), then the threads' leftovers given back: their cuBLAS workspaces (one
        per thread's stream) and the blocks cached for their streams."""
        with one_build_per_variant(), ThreadPoolExecutor(min(threads, len(calls)), thread_name_prefix="build") as pool:
            for f in [pool.submit(fn, *args) for args in calls]:
                f.result()
        if self.dev.type == "cuda":
            torch.cuda.synchronize(self.dev)
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def _alone(self):
        """This thread's launches on a stream of its own, with this rank's collectives left out (model.alone):
        start-up's parallel builds, whose threads take turns in another order on every rank. Waits for the stream at
        the end."""
        cuda = self.dev.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.dev)
        stream = torch.cuda.Stream(self.dev) if cuda else None
        with torch.inference_mode(), M.alone(), torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            yield
            if cuda:
                stream.synchronize()

    def _warm_alone(self, p0: int, n: int):
        """A warm-up pass in a cache of its own (one slot, as long as the pass needs), in this thread's own stream
        without collectives (_alone); its results are discarded."""
        with self._alone():
            cache = self.model.new_cache(1, p0 + n, slack=self.slack)
            mtps = self.model.new_mtp_caches(1, p0 + n, slack=self.slack) if self.k else []
            self._warm(p0, n, cache, mtps)

    def _built_marker(self, passes: list) -> str:
        """A file in Triton's cache directory that says a start-up of this rank built every kernel of these warm-up
        passes: named by a hash of the code that makes the launches (kernel.py, model.py, engine.py), the passes, the
        model's config and TP size, Triton's version and the device."""
        h = hashlib.sha256()
        for f in (kernel.__file__, M.__file__, __file__):
            with open(f, "rb") as src:
                h.update(src.read())
        dev = torch.cuda.get_device_name(self.dev) if self.dev.type == "cuda" else "cpu"
        h.update(repr((passes, self.model.cfg, M.world_size, triton.__version__, dev)).encode())
        return os.path.join(triton.knobs.cache.dir, f"step5-built-{h.hexdigest()[:24]}")

    def _warm(self, p0: int, n: int, cache=None, mtps=None, main: bool = True):
        """A prefill pass of n tokens at position p0 of slot 0 (whatever its cache holds), and of every MTP layer
        (without `main`: theirs alone, on zero residuals): its launches compile whatever they need; the slot is
        forgotten after start-up."""
        cache, mtps = (self.cache, self.mtps) if cache is None else (cache, mtps)
        ids = torch.zeros(n, dtype=torch.long, device=self.dev)
        cache.lengths[0] = p0
        if not self.k:
            self.model.forward(ids, cache, [n], rows=[0])
            return
        h = (self.model.forward_rows(ids, cache, [n], rows=[0]) if main
             else torch.zeros(n, self.model.cfg.hidden_size, device=self.dev))
        for j, c in enumerate(mtps):
            c.lengths[0] = p0
            h, _ = self.model.mtp(j, h, ids, c, [n], rows=[0], head=False)

    def _plain_graph(self, b: int, pool) -> list:
        rows = torch.arange(b, device=self.dev)
        live = torch.ones(b, dtype=torch.long, device=self.dev)
        cache, m = self.cache, self.model

        def step(rows, live):  # -> this rank's logits [b, V/tp], the greedy tokens [b] (-1: non-finite logits)
            logits = m.forward(self.next_tok[rows], cache, rows=rows, live=live)
            tok = greedy(logits)
            self.next_tok[rows] = tok.clamp(min=0)
            return logits, tok
        return [Graph(step, [rows, live], self.use_graph, state=lambda: (cache.lengths,), pool=pool)]

    # ---- requests
    def check(self, req: Request):
        """ValueError naming the field if the request cannot run as given; else its ids and stop ids normalised to
        lists / sets of Python ints. Everything a step would otherwise fail on (or silently misread) is checked here,
        before the request takes a slot."""
        if req.rid != -1:
            raise ValueError(f"request {req.rid} was submitted before: submit a new Request")
        if not isinstance(req.ids, (list, tuple)) or not req.ids:
            raise ValueError(f"ids must be a non-empty list of token ids, got {type(req.ids).__name__}")
        V = self.model.cfg.vocab_size
        plain = all(type(t) is int for t in req.ids)  # the usual case, at C speed (a 128k prompt: a few ms)
        if not (plain or all(is_int(t) for t in req.ids)) or min(req.ids) < 0 or max(req.ids) >= V:
            bad = next(i for i, t in enumerate(req.ids) if not is_int(t) or not 0 <= t < V)
            raise ValueError(f"ids[{bad}] = {req.ids[bad]!r} is not a token id in [0, {V})")
        if not is_int(req.max_new_tokens) or req.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens {req.max_new_tokens!r} must be an integer >= 0")
        if not isinstance(req.stop_ids, (set, frozenset, list, tuple)) or not all(is_int(t) for t in req.stop_ids):
            raise ValueError(f"stop_ids must be a set of token ids, got {req.stop_ids!r}")
        image = self.model.vl.image_token_id if getattr(self.model, "vl", None) else None
        n = req.ids.count(image) if image is not None else 0
        f, D = req.features, self.model.cfg.hidden_size
        if f is None and n:
            raise ValueError(f"ids hold {n} image placeholder(s) (id {image}) but the request has no features")
        if f is not None and not (isinstance(f, torch.Tensor) and f.dtype == torch.bfloat16
                                  and tuple(f.shape) == (n, D) and f.device == self.dev):
            what = (f"{tuple(f.shape)} {f.dtype} on {f.device}" if isinstance(f, torch.Tensor) else type(f).__name__)
            raise ValueError(f"features must be [{n}, {D}] bfloat16 on {self.dev} (one row per image placeholder of "
                             f"ids), got {what}")
        need = len(req.ids) + req.max_new_tokens + (self.k + 1 if self.k else 0)
        if need > self.max_context:
            raise ValueError(f"{len(req.ids)} prompt tokens + {req.max_new_tokens} new tokens exceed the engine's "
                             f"max_context={self.max_context}")
        p = req.sampling.problem() if isinstance(req.sampling, Sampling) else "sampling must be a Sampling"
        if p:
            raise ValueError(p)
        req.ids = req.ids if plain and type(req.ids) is list else [int(t) for t in req.ids]
        req.stop_ids = frozenset(int(t) for t in req.stop_ids)

    def submit(self, req: Request) -> Request:
        """Queue a request (checked first: Engine.check)."""
        self.check(req)
        return self._queue(req)

    def _queue(self, req: Request) -> Request:
        req.rid = next(self.rids)
        req.key = reuse_key(self.model, req)
        self.waiting.append(req)
        return req

    def cancel(self, req: Request):
        """End a request of this engine now (its slot is freed at the next step); its tokens so far stay in req.out."""
        if req.finish is None and any(r is req for r in self.waiting + self.running):
            req.finish = "cancelled"

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self, reqs: list, on_step=None) -> list:
        """Submit the requests (all checked before any is queued) and step until all are done; on_step(StepOutput)
        after each step. If a step raises, every request in the engine ends ("error") and the engine takes new ones."""
        if len({id(r) for r in reqs}) != len(reqs):
            raise ValueError("the same Request appears twice: each needs its own")
        for r in reqs:
            self.check(r)
        for r in reqs:
            self._queue(r)
        try:
            while self.busy():
                o = self.step()
                if on_step is not None:
                    on_step(o)
        except BaseException:
            self.abandon()
            raise
        self.inflight = None  # a step still in flight served only requests that have ended
        return reqs

    def abandon(self):
        """End every request now ("error") and free every slot without another step, forgetting the slots' cache
        (a step that raised may have written part of it)."""
        for r in self.waiting + self.running:
            r.finish = r.finish if r.finish is not None else "error"
        for s in self.slots:
            s.owner, s.held, s.stale = None, [], False
        self.waiting.clear()
        self.running.clear()
        self.inflight = None

    def _reuse(self, req: Request, slot: Slot) -> int:
        """Prompt tokens of `req` whose cache the slot holds and that a rewind can keep: the common prefix, one token
        short of the prompt (its last token must be fed), at a DSA region boundary (the region in progress is
        recomputed), within the rings' spare slots. Speculative decoding also recomputes the rows its MTP layers read
        past the common prefix, and the ones a draft step reads (2K + 2 from the prompt's end)."""
        n = min(common_prefix(req.key, slot.held), len(req.ids) - 1)
        if self.k:
            n = min(n - self.k - 2, len(req.ids) - 2 * self.k - 2)
        blk = self.model.cfg.sparse.block if self.model.cfg.sparse else 1
        n = n // blk * blk
        return n if n > 0 and len(slot.held) - n <= REWIND else 0

    def _admit(self, out: StepOutput):
        for req in list(self.waiting):
            if req.finish is not None or req.max_new_tokens == 0:  # cancelled while waiting, or nothing to do
                req.finish = req.finish or "length"
                self.waiting.remove(req)
                out.finished.append(req)
                continue
            free = [i for i, s in enumerate(self.slots) if s.owner is None]
            if not free:
                break
            best = max(free, key=lambda i: (self._reuse(req, self.slots[i]), -self.slots[i].used))
            s = self.slots[best]
            n = self._reuse(req, s)
            s.owner, s.held, s.used = req, s.held[:n], self.steps
            self.cache.lengths[best] = n
            self.cache.requests[best] = req.rid
            self.count[best] = 0
            for c in self.mtps:
                c.lengths[best] = n
            req.slot, req.cached, req.prefilled = best, n, n
            self.waiting.remove(req)
            self.running.append(req)

    def _release(self, req: Request, out: StepOutput):
        s = self.slots[req.slot]
        s.owner, s.used = None, self.steps
        n = int(self.cache.lengths[req.slot])  # host read: once per request
        s.held, s.stale = [] if s.stale else (req.key + req.out)[:n], False
        if n + self.slack + 2 * self.k + 2 > self.cap:  # no room for a padding row's writes: forget the prefix
            s.held = []
            self.cache.lengths[req.slot] = 0
        self.running.remove(req)
        out.finished.append(req)

    # ---- one engine step
    @torch.inference_mode()
    def step(self) -> StepOutput:
        """Release finished requests, admit waiting ones, run up to prefill_chunk prefill tokens, run one decode
        step (its tokens are read at the next step), and report what the host read."""
        out = StepOutput()
        self.steps += 1
        for r in [r for r in self.running if r.finish is not None]:
            self._release(r, out)
        self._admit(out)
        pre = [r for r in self.running if r.prefilled < len(r.ids)]
        if pre:
            self._prefill(pre, out)
        dec = [r for r in self.running if r.prefilled == len(r.ids) and r.finish is None and r.out]
        prev = self.inflight
        busy = set() if prev is None else set(map(id, prev[0]))
        live = [r for r in dec if len(r.out) + (id(r) in busy) < r.max_new_tokens]
        self.inflight = (self.spec.decode if self.spec else self._decode)(live) if live else None
        self._emit(prev, out)
        for r in [r for r in self.running if r.finish is not None]:
            self._release(r, out)
        return out

    def _prefill(self, reqs: list, out: StepOutput):
        """Up to prefill_chunk prompt tokens, packed over the requests in order; those whose prompt completes get
        their first token."""
        budget, pieces = self.config.prefill_chunk, []
        for r in reqs:
            n = min(len(r.ids) - r.prefilled, budget)
            if n <= 0:
                break
            pieces.append((r, r.prefilled, n))
            budget -= n
        plan = self._prefill_graphs_for(pieces)
        if plan:  # each piece's replays in order; its last one's output read before the next replay
            logits = torch.cat([[self._replay_prefill(g, r, a, n) for g, a, n in steps][-1].clone()
                                for steps, (r, _, _) in zip(plan, pieces)])
        else:
            logits = self._eager_prefill(pieces)
        for r, a, n in pieces:
            r.prefilled = a + n
            self.slots[r.slot].held = r.key[:r.prefilled]
        first = [(r, lg) for (r, a, n), lg in zip(pieces, logits) if r.prefilled == len(r.ids)]
        if not first:
            return
        rs = [r for r, _ in first]
        slots = torch.tensor([r.slot for r in rs], device=self.dev)
        tok = self._choose(torch.stack([x for _, x in first]), rs, slots)
        self.next_tok[slots] = tok.clamp(min=0)
        self.count[slots] = 1
        for r, t in zip(rs, tok.tolist()):  # a host read: the prompt's first token is reported at once
            self._take(r, [t], out, "its prefill")
        if self.spec:  # queued after that read, which would otherwise wait for the drafts too
            self.spec.first_drafts(rs, slots)

    def _prefill_graphs_for(self, pieces: list) -> list | None:
        """Per piece, its graph replays [(graph, first token, tokens)], when every piece is the whole rest of a text
        prompt: a fresh prompt of up to the largest prefill graph's length, the prefill graph of its padded length; up
        to EXTEND_TURN tokens on top of a cached prefix, extension steps of up to 64 tokens each. And only when their
        padded lengths add up to at most the largest prefill graph's (their replays then cost about one such pass of
        kernels, no more than an eager pass of that size costs the host); else None: one eager pass."""
        if not self.prefill_graphs:
            return None
        plan, total = [], 0
        for r, a, n in pieces:
            if a + n < len(r.ids) or r.features is not None or (a and (not self.extend_graphs or n > EXTEND_TURN)):
                return None
            sizes, step = (self.extend_graphs, max(self.extend_graphs)) if a else (self.prefill_graphs, n)
            steps = []
            for o in range(0, n, step):
                p = next((p for p in sizes if p >= min(step, n - o)), None)
                if p is None:
                    return None
                steps.append((sizes[p], a + o, min(step, n - o)))
                total += p
            plan.append(steps)
        return plan if total <= max(self.prefill_graphs) else None

    def _eager_prefill(self, pieces: list) -> torch.Tensor:
        """One pass over the pieces (request, first position, tokens), packed -> the logits [pieces, V/tp] of each
        piece's last token."""
        ids = torch.tensor([t for r, a, n in pieces for t in r.ids[a:a + n]], dtype=torch.long, device=self.dev)
        rows = [r.slot for r, _, _ in pieces]
        lens = [n for _, _, n in pieces]
        embeds = None
        if any(r.features is not None for r, _, _ in pieces):
            embeds = torch.cat([r.embeds(self.model, a, a + n) if r.features is not None else
                                self.model.embed(ids[o:o + n]) for (r, a, n), o in zip(pieces, itertools.accumulate(
                                    [0] + lens))])
        hook = None
        if self.progress is not None:
            first, start, longest = pieces[0][1], pieces[0][0].cached, max(len(r.ids) for r, _, _ in pieces)
            hook = (lambda i, layers: self.progress(first, sum(lens), longest, i, layers, start))
        if self.spec:
            return self.spec.prefill(pieces, ids, embeds, hook)
        return self.model.forward(ids, self.cache, lens, embeds, hook, rows=rows, held=[a for _, a, _ in pieces])

    def _replay_prefill(self, g: Graph, r: Request, a: int, n: int) -> torch.Tensor:
        """Prompt tokens a..a+n-1 of r (the rest of its prompt) by a prefill or extension graph (inputs: the ids,
        padded; the real count; the slot) -> this rank's logits [1, V/tp] of its last token. With speculative
        decoding the MTP layers then absorb the graph's real rows."""
        pinned = self.dev.type == "cuda"
        ids = torch.zeros(g.inputs[0].numel(), dtype=torch.long, pin_memory=pinned)
        ids[:n] = torch.tensor(r.ids[a:a + n])
        g.inputs[0].copy_(ids.view(g.inputs[0].shape), non_blocking=pinned)
        g.inputs[1].copy_(torch.tensor([n], pin_memory=pinned), non_blocking=pinned)
        g.inputs[2].copy_(torch.tensor([r.slot], pin_memory=pinned), non_blocking=pinned)
        if not self.spec:
            return g()
        lg, res = g()
        self.spec.absorb([(r, a, n)], g.inputs[0].view(-1)[:n], res[:n])
        return lg

    def _choose(self, logits, reqs, slots) -> torch.Tensor:
        """Tokens [B] for logits rows [B, V/tp] of requests (greedy, or each row's sampling at its slot's count)."""
        if all(r.sampling.temperature == 0 for r in reqs):
            return greedy(logits)
        return sample(logits, RowSampling.of([r.sampling for r in reqs], self.dev), self.count[slots])

    def _pads(self, reqs: list) -> list:
        """Slots a padding row of a decode step over `reqs` may point at, free ones first. A padding row writes only at
        its slot's next position, which that slot's next real write covers, so a slot whose request does not decode
        in this step pads too (all slots may be held while some requests prefill or end): one that prefills, or one
        that has ended (its last token in flight, or max_new_tokens reached). A speculative step also writes MTP rows
        and ring entries below that position, so it pads only with free and ended slots."""
        mine = {r.slot for r in reqs}
        free = [i for i, s in enumerate(self.slots) if s.owner is None]
        held = [i for i, s in enumerate(self.slots) if s.owner is not None and i not in mine
                and (not self.k or s.owner.prefilled == len(s.owner.ids))]
        return free + held

    def _inputs(self, g: Graph, reqs: list, b: int, pads: list | None = None):
        """A bucket graph's slot and live inputs for the requests, padded (with _pads; pinned host copies)."""
        n = len(reqs)
        pad = (self._pads(reqs) if pads is None else pads)[:b - n]
        slots = [r.slot for r in reqs] + pad
        pinned = self.dev.type == "cuda"
        g.inputs[0].copy_(torch.tensor(slots, pin_memory=pinned), non_blocking=pinned)
        g.inputs[1].copy_(torch.tensor([1] * n + [0] * (b - n), pin_memory=pinned), non_blocking=pinned)
        return pad

    def _decode(self, reqs: list):
        """Queue one plain decode step over the requests -> (requests, the host copy of their tokens)."""
        n = len(reqs)
        b = next(x for x in self.graphs if x >= n)
        g = self.graphs[b][0]
        self._inputs(g, reqs, b)
        logits, tok = g()
        slots = g.inputs[0][:n]
        if any(r.sampling.temperature > 0 for r in reqs):
            tok = sample(logits[:n], RowSampling.of([r.sampling for r in reqs], self.dev), self.count[slots])
            self.next_tok[slots] = tok.clamp(min=0)
        self.count[slots] += 1
        return reqs, self._to_host(tok[:n])

    def _to_host(self, t: torch.Tensor):
        if t.device.type != "cuda":
            return t.clone(), None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return host, ev

    def _emit(self, step, out: StepOutput):
        """The host reads a queued step's tokens (waiting for that step only) and hands them to their requests."""
        if step is None:
            return
        reqs, (host, ev) = step
        if ev is not None:
            ev.synchronize()
        rows = host.tolist()
        for r, t in zip(reqs, self.spec.unpack(rows) if self.spec else [[t] for t in rows]):
            self._take(r, t, out, "a decode step")

    def _take(self, r: Request, toks: list, out: StepOutput, where: str):
        """Append a step's tokens to a request, stopping at a stop id or at max_new_tokens."""
        if r.finish is not None:
            return
        if r.t_first is None:
            r.t_first = time.perf_counter()
        new = []
        for t in toks:
            if t < 0:
                raise EngineError(f"request {r.rid}: non-finite logits at new token {len(r.out)} ({where}): the "
                                  "weights or inputs hold NaN or Inf")
            r.out.append(t)
            new.append(t)
            if t in r.stop_ids:
                r.finish = "stop"
                break
            if len(r.out) >= r.max_new_tokens:
                r.finish = "length"
                break
        if new:
            out.tokens.append((r, new))


# --------------------------------------------------------------------------------------------------
# speculative decoding with the checkpoint's MTP layers


class Speculator:
    """Decode steps that verify K drafts of the MTP layers per request (a step kind of the engine).

    A verify step feeds each request's pending token and its K drafts as one decode step of K + 1 tokens per row of
    the main model. Greedy rows accept the longest prefix of drafts equal to the main model's argmax, plus the main
    model's next token, so every emitted token is the greedy choice at its position; sampled rows follow the
    speculative-sampling rule for greedy drafts: draft x is accepted with probability p(x), and at the first rejection
    a token is drawn from p with x removed (renormalised); after K acceptances one more is drawn from p. Rejected rows
    are rolled back by resetting the cache lengths: the sliding rings carry spare slots, so a rejected row never
    overwrote a key that a kept row still needs; K/V, pending indexer rows and region summaries at rejected positions
    are rewritten before any kept query reads them. Acceptance, rollback and drafting run on the device, so a step is
    queued without the host reading the last one.

    Drafting: MTP depth j's row at position p reads depth j-1's residual at p (depth -1: the main model's) and the
    token at p + j + 1; depth j's draft is its row at the last kept position L. Rows past L - j read drafts, so they
    are provisional; each step therefore recomputes, at depth j, the K + 1 + j positions L - K - j .. L (clamped at 0)
    as one static-shape decode step of the MTP layer: every provisional row of the last step is among them, and final
    rows come out the same. Residuals and tokens of recent positions live in per-slot device rings (position p in
    ring slot p mod S). Prefill chunks are absorbed by every depth as they come (the rows whose next tokens are
    prompt tokens, up to where drafting recomputes); the prompt's last rows are drafted as after a verify step. At
    image positions an MTP row reads the placeholder token's embedding as its next token (a choice: the release drops
    the MTP layers, and the main model's rows there already carry the image features in their residuals).
    """

    def __init__(self, eng: Engine):
        self.e, k = eng, eng.k
        B, dev, D = eng.config.max_batch, eng.dev, eng.model.cfg.hidden_size
        self.S = 4 * k + 4
        self.h = torch.zeros(k + 1, B, self.S, D, device=dev)  # ring 0: the main model's residuals; j + 1: depth j's
        self.tok = torch.zeros(B, self.S, dtype=torch.long, device=dev)  # ring: the token at each position
        self.drafts = torch.zeros(B, k, dtype=torch.long, device=dev)
        self.stats = {"verify_steps": 0, "verify_rows": 0, "proposed": [0] * k, "accepted": [0] * k}

    def _put(self, ring, slot: int, first: int, rows):
        """rows [n, ...] of one slot at positions first .. first + n - 1 into a ring (the last S of them)."""
        keep = min(self.S, rows.shape[0])
        at = torch.arange(first + rows.shape[0] - keep, first + rows.shape[0], device=rows.device) % self.S
        ring[slot, at] = rows[-keep:]

    def prefill(self, pieces, ids, embeds, hook):
        """A prefill pass of the main model (every row kept), absorbed by the MTP layers -> the last row's logits of
        each piece."""
        m = self.e.model
        lens, rows = [n for _, _, n in pieces], [r.slot for r, _, _ in pieces]
        hidden = m.forward_rows(ids, self.e.cache, lens, embeds, rows=rows, progress=hook,
                                held=[a for _, a, _ in pieces])  # [T, D]
        self.absorb(pieces, ids, hidden)
        starts = list(itertools.accumulate([0] + lens))
        ends = torch.tensor([s + n - 1 for (_, _, n), s in zip(pieces, starts)], device=self.e.dev)
        return m.logits(hidden[ends])

    def absorb(self, pieces, ids, hidden):
        """The main model's rows of a prefill pass (hidden [T, D], ids [T]: the pieces' tokens, packed) into the
        rings, then each depth absorbs those whose next tokens are prompt tokens and that drafting will not recompute
        (depth j: positions p < len - 1 - K - j)."""
        e, k, m = self.e, self.e.k, self.e.model
        starts = list(itertools.accumulate([0] + [n for _, _, n in pieces]))
        src = {}  # piece -> (first position, rows) of the previous depth computed in this pass
        for i, ((r, a, n), s) in enumerate(zip(pieces, starts)):
            self._put(self.h[0], r.slot, a, hidden[s:s + n])
            self._put(self.tok, r.slot, a, ids[s:s + n])
            src[i] = (a, hidden[s:s + n])
        for j in range(k):
            parts = []
            for i, (r, a, n) in enumerate(pieces):
                have = int(e.mtps[j].lengths[r.slot])  # host read: prefill only
                stop = min(a + n, len(r.ids) - 1 - k - j)
                if i in src and stop > have:
                    p0, x = src[i]
                    parts.append((i, r, have, stop, x[have - p0:stop - p0]))
            if not parts:
                break
            nxt = torch.tensor([r.ids[p + j + 1] for _, r, have, stop, _ in parts for p in range(have, stop)],
                               device=e.dev)
            res, _ = m.mtp(j, torch.cat([x for *_, x in parts]), nxt, e.mtps[j],
                           [stop - have for _, _, have, stop, _ in parts], rows=[r.slot for _, r, *_ in parts],
                           head=False)
            src, o = {}, 0
            for i, r, have, stop, _ in parts:
                src[i] = (have, res[o:o + stop - have])
                self._put(self.h[j + 1], r.slot, have, src[i][1])
                o += stop - have

    def first_drafts(self, reqs, slots):
        """After a prompt's last chunk and its first token (next_tok): the drafts of every depth, as after a verify
        step that kept position len - 1."""
        L = torch.tensor([len(r.ids) - 1 for r in reqs], device=self.e.dev)
        self.tok[slots, (L + 1) % self.S] = self.e.next_tok[slots]
        self.drafts[slots] = self._draft(slots, L)

    def _draft(self, slots, L):
        """Each depth's K + 1 + j rows L - K - j .. L of the slots [R] -> drafts [R, K]. Static shapes: rows past L
        (a clamped start) are never read as final, and later steps overwrite them before any kept row needs them."""
        e, k, m, S = self.e, self.e.k, self.e.model, self.S
        R, D = slots.shape[0], m.cfg.hidden_size
        s_, r_ = slots[:, None], torch.arange(R, device=e.dev)
        out = torch.zeros(R, k, dtype=torch.long, device=e.dev)
        for j in range(k):
            q = k + 1 + j
            first = (L - k - j).clamp(min=0)
            pos = first[:, None] + torch.arange(q, device=e.dev)  # [R, q]
            t = pos + j + 1  # the token each row reads: final up to L + 1, then this step's drafts
            i = (t - L[:, None] - 2).clamp(0, k - 1)
            tok = torch.where(t <= L[:, None] + 1, self.tok[s_, t % S], out[r_[:, None], i])
            e.mtps[j].lengths[slots] = first
            res, lg = m.mtp(j, self.h[j][s_, pos % S].view(R * q, D), tok.flatten(), e.mtps[j], None, q, rows=slots)
            self.h[j + 1][s_, pos % S] = res.view(R, q, D)
            out[:, j] = greedy(lg.view(R, q, -1)[r_, L - first]).clamp(min=0)
        return out

    def graphs(self, b: int, pool) -> list:
        """A verify graph and a draft graph for batch bucket b."""
        e, k, m, S = self.e, self.e.k, self.e.model, self.S
        dev, D = e.dev, m.cfg.hidden_size
        slots = torch.arange(b, device=dev)
        live = torch.ones(b, dtype=torch.long, device=dev)

        def verify(slots, live):  # -> residuals [b*(k+1), D], logits [b*(k+1), V/tp], greedy ids [b, k+1]
            fed = torch.cat([e.next_tok[slots][:, None], self.drafts[slots]], 1)  # [b, k+1]
            m.hold_pending(e.cache, slots)  # the DSA pending rows, for keep_pending after acceptance
            h = m.forward_rows(fed, e.cache, rows=slots, live=live)
            lg = m.logits(h)
            return h, lg, greedy(lg).view(b, k + 1)

        def draft(slots, kept, start, h, toks):
            """The DSA pending rows of the kept tokens put back, the verify rows into the rings (toks[j]: the token
            after position start + j), then the drafts."""
            m.keep_pending(e.cache, slots, start, kept - start + 1)
            steps = start[:, None] + torch.arange(k + 1, device=dev)  # [b, k+1]: positions of the verify rows
            self.h[0][slots[:, None], steps % S] = h.view(b, k + 1, D)
            self.tok[slots[:, None], (steps + 1) % S] = toks
            self.drafts[slots] = self._draft(slots, kept)
        zeros = torch.zeros(b, dtype=torch.long, device=dev)
        g_verify = Graph(verify, [slots, live], e.use_graph, state=lambda: (e.cache.lengths,), pool=pool)
        g_draft = Graph(draft, [slots, zeros, zeros.clone(), torch.zeros(b * (k + 1), D, device=dev),
                                torch.zeros(b, k + 1, dtype=torch.long, device=dev)], e.use_graph,
                        state=lambda: [c.lengths for c in e.mtps], pool=pool)
        return [g_verify, g_draft]

    def decode(self, reqs: list):
        """Queue one verify + draft step over the requests -> (requests, the host copy of [accepted, tokens...])."""
        e = self.e
        n = len(reqs)
        b = next(x for x in e.graphs if x >= n)
        pads = e._pads(reqs)  # before any turn is skipped: a request that waits a step never pads
        if b - n > len(pads):  # prefilling slots cannot pad: decode a bucket without padding, in turns
            r = e.steps % n
            n = max(x for x in e.graphs if x <= n)
            reqs, b = (reqs[r:] + reqs[:r])[:n], n
        g_verify, g_draft = e.graphs[b]
        for i in e._inputs(g_verify, reqs, b, pads):  # a padding row rewrites its slot's recent rows: forget the slot
            e.slots[i].held = []
            e.slots[i].stale = e.slots[i].owner is not None
        slots, live = g_verify.inputs
        start = e.cache.lengths[slots]  # the positions of the pending tokens
        h, lg, main = g_verify()
        a, toks = self._accept(lg, main, reqs, b)  # [b] accepted drafts, [b, k+1] the step's tokens
        kept = start + a  # the last kept position: the new pending token's predecessor
        e.cache.lengths[slots] = torch.where(live > 0, kept + 1, start)  # roll back the rejected rows
        e.next_tok[slots] = toks.gather(1, a[:, None])[:, 0].clamp(min=0)
        e.count[slots] += (a + 1) * live
        for dst, src in zip(g_draft.inputs, (slots, kept, start, h, toks)):
            if dst is not src:
                dst.copy_(src)
        g_draft()
        self.stats["verify_steps"] += 1
        self.stats["verify_rows"] += n
        return reqs, e._to_host(torch.cat([a[:n, None], toks[:n]], 1))

    def unpack(self, rows: list) -> list:
        """Host rows [accepted, tokens...] -> each request's emitted tokens (and the acceptance counts)."""
        out = []
        for row in rows:
            a = row[0]
            for j in range(self.e.k):
                self.stats["proposed"][j] += 1
                self.stats["accepted"][j] += j < a
            out.append(row[1:a + 2])
        return out

    def _accept(self, lg, main, reqs, b):
        """-> (accepted drafts a [b], the step's tokens [b, k+1]: the accepted drafts, then the next token). Greedy
        rows: drafts equal to the main model's argmax; sampled rows: the speculative-sampling rule."""
        e, k = self.e, self.e.k
        slots = e.graphs[b][0].inputs[0]
        drafts = self.drafts[slots]  # [b, k]
        a = (drafts == main[:, :k]).long().cumprod(1).sum(1)  # [b]
        if all(r.sampling.temperature == 0 for r in reqs):
            return a, main
        n = len(reqs)
        rs = RowSampling.of([r.sampling for r in reqs] + [Sampling()] * (b - n), e.dev)
        probs = probabilities(full_vocab(lg), _repeat(rs, k + 1)).view(b, k + 1, -1)
        base = e.count[slots]  # the index of the step's first token in its request
        u = uniform(rs.seed, base * 4 + 1, k)  # counter stream 1: acceptance
        px = probs[:, :k].gather(2, drafts[:, :, None])[:, :, 0]  # [b, k]
        acc = (u < px).long().cumprod(1).sum(1)
        # the token after the accepted drafts: p at position acc, with the rejected draft removed (acc < k)
        pa = probs[torch.arange(b, device=e.dev), acc]  # [b, V]
        rej = drafts.gather(1, acc.clamp(max=k - 1)[:, None])
        pa = torch.where((acc < k)[:, None], pa.scatter(1, rej, 0.0), pa)
        nxt = draw(pa, rs, base + acc)  # keyed by the emitted token's index
        toks = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, acc[:, None], nxt[:, None])
        sampled = rs.temperature > 0
        return torch.where(sampled, acc, a), torch.where(sampled[:, None], toks, main)


def _repeat(rs: RowSampling, n: int) -> RowSampling:
    return RowSampling(*(t.repeat_interleave(n) for t in (rs.temperature, rs.top_k, rs.top_p, rs.seed)))


# --------------------------------------------------------------------------------------------------
# one batch, the Python API


def generate(model, prompts: list, max_new_tokens: int, eos_ids=(), images: list | None = None,
             cuda_graph: bool = True, prefill_chunk: int = PREFILL_CHUNK, sampling: Sampling = Sampling(),
             speculative: int = 0) -> tuple[list, dict]:
    """Generation of a batch on an engine made for it -> (each request's generated ids, EOS included when emitted;
    stats). images: per request None or its image inputs (pixel_values [+ patch_pixel_values, num_patches] or
    image_embeds). Every request gets the same sampling (its own random stream, seeded alike)."""
    feats = request_features(model, prompts, images)
    eng = Engine(model, EngineConfig(max_batch=max(len(prompts), 1), prefill_chunk=prefill_chunk,
                                     max_context=max([len(p) for p in prompts] + [1]) + max_new_tokens
                                     + (speculative + 1 if speculative else 0),
                                     speculative=speculative, cuda_graph=cuda_graph))
    eng.start()
    reqs = [Request(list(p), max_new_tokens, frozenset(int(e) for e in eos_ids), sampling, f)
            for p, f in zip(prompts, feats)]
    t0 = time.perf_counter()
    with torch.inference_mode():
        eng.run(reqs)
    out = [r.out for r in reqs]
    check_same_on_all_ranks(out, eng.dev)
    stats = {"prompt_tokens": sum(len(p) for p in prompts), "new_tokens": sum(len(o) for o in out),
             "s": time.perf_counter() - t0}
    if eng.spec:
        stats.update(eng.spec.stats)
    return out, stats


def request_features(model, prompts: list, images: list | None) -> list:
    """Per request: its image feature rows (model.image_features), checked against its placeholders, or None.
    ValueError names the request."""
    out = []
    for i, (ids, img) in enumerate(zip(prompts, images or [None] * len(prompts))):
        try:
            feats = model.image_features(**img) if img else None
            n = sum(t == model.vl.image_token_id for t in ids) if hasattr(model, "vl") else 0
            rows = 0 if feats is None else feats.shape[0]
            if feats is not None and not hasattr(model, "vl"):
                raise ValueError("image features given to a text-only model")
            if n != rows:
                raise ValueError(f"the prompt holds {n} image placeholder(s) (id {model.vl.image_token_id}) but its "
                                 f"image inputs give {rows} feature row(s)")
            out.append(feats)
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
    return out


def check_same_on_all_ranks(out: list, device):
    """Every rank must have produced the same tokens: checked once at the end, not assumed."""
    if M.world_size == 1:
        return
    flat = torch.tensor([len(o) for o in out] + [t for o in out for t in o], dtype=torch.long, device=device)
    n = torch.tensor([flat.numel()], dtype=torch.long, device=device)
    if not bool((M.tp_gather(n) == n).all()):
        raise RuntimeError("ranks generated different numbers of tokens")
    if not bool((M.tp_gather(flat) == flat).all()):
        raise RuntimeError("ranks generated different tokens")


def prefill(model, cache, prompts: list, features: list | None = None, progress=None,
            chunk: int | None = None) -> torch.Tensor:
    """Packed prefill of every prompt on top of what the cache holds (request b in cache row b) -> this rank's logits
    of each prompt's last token [B, V/tp]; at most `chunk` tokens of each prompt per pass. A helper for tests and
    benchmarks that drive the model without an engine."""
    dev = model.lm_head.weight.device
    reqs = [Request(list(p), 0, features=f) for p, f in zip(prompts, features or [None] * len(prompts))]
    lens = [len(p) for p in prompts]
    step = chunk or max(lens)
    final = [None] * len(prompts)
    for o in range(0, max(lens), step):
        n = [min(max(L - o, 0), step) for L in lens]
        ids = torch.tensor([t for p, k in zip(prompts, n) for t in p[o:o + k]], dtype=torch.long, device=dev)
        rows = None
        if any(f is not None for f in (features or [])):
            rows = torch.cat([r.embeds(model, o, o + k) if r.features is not None else model.embed(
                torch.tensor(r.ids[o:o + k], dtype=torch.long, device=dev)) for r, k in zip(reqs, n)])
        hook = None if progress is None else (lambda i, layers, o=o: progress(o, i, layers))
        out = model.forward(ids, cache, n, rows, hook)  # [prompts with tokens in this pass, V/tp]
        for r, b in enumerate(b for b, k in enumerate(n) if k):
            if o + n[b] == lens[b]:
                final[b] = out[r]
    return torch.stack(final)
