"""The long-lived engine: one model, one cache of `max_batch` slots of `max_context` positions, and every compiled
kernel and CUDA graph, all made once at start-up. Requests take a free slot, stream their tokens and leave the slot;
a prompt that starts like an earlier one copies that prefix from the prefix store (prefix_cache.py) into its slot.

    eng = Engine(model, EngineConfig(max_batch=4, max_context=8192))
    eng.start()                                   # kernels compiled, caches allocated, graphs captured
    reqs = eng.run([Request(ids, max_new_tokens=64, stop_ids=frozenset({4}))])

How it works, and where each part lives:
- Start-up (startup.py, Startup; its docstring says how): the constructor plans the device memory and settles the
  context that fits beside the weights (rank 0 says the plan; an engine that does not fit is refused, naming the
  flags); Engine.start compiles every kernel variant a request can reach (warm-up prefill passes, from threads while
  Triton's cache lacks them), allocates the caches and captures the CUDA graphs: one decode step per batch bucket
  (1, 2, 4, ... up to max_batch; a speculative engine's verify and draft steps have their own), the fresh prompts'
  prefill graphs and the next turns' extension graphs.
- Nothing compiles or captures after start-up. No launch argument that varies with a request (prompt, chunk or
  context length, batch size) is a specialised int or a constexpr; prefill launches go through unspecialised
  kernels; decode batches pad to their bucket.
- A step (Engine.step): release the slots of requests that ended; admit waiting requests into free slots (the one
  whose cache holds the longest prefix of the prompt, else the least recently used: a conversation's next turn
  prefills only what its slot does not hold, Engine._reuse); prefill up to `prefill_chunk` prompt tokens, packed over
  the requests as pieces (Piece), and choose the first token of each prompt that completes; queue one decode step
  over the slots that decode; then read the previous decode step's tokens and hand them to their requests, which end
  at a stop id or at max_new_tokens (Finish). The host reads a step's tokens after the next step is queued (its
  forward, when the step is constrained: below), so the device never waits for it.
- Prompts that arrive while streams decode (Split). An eager prefill pass takes 0.1-0.2 s of host launches on a
  whole rank whatever its tokens, and a 4,096-token graph replay ~0.1 s of kernels: run as one step, either froze
  every stream for that long. While streams decode, a pass may run prefill_layers_per_step layers per step (0: off)
  (model.begin / run_layers keep its residual between steps), and each step's decode step follows its part, so a
  stream waits for a part; its rows are the same decode step's, so its tokens are bit for bit those without the
  arrival. The pass's slots never pad the decode step (their unrun layers still read the history that a padding row's
  write at the slot's next position would replace); where the bucket needs them, the pass runs whole. Fresh prompts
  replay their prefill graphs then only up to GRAPH_BUSY padded tokens. Nothing new is compiled or captured: the
  parts launch the whole pass's kernels. A speculative engine and echo requests run whole passes.
- The prefix store (prefix_cache.py; its budget in the memory plan). A prefill stores its prompt's prefix at points
  (Engine._points: every prefix_cache.SNAP_EVERY positions, the end of the part a front end says other requests
  likely share (Request.share: a chat's system turn with its tools), the usable end) from the slot's caches right
  after the pass that reaches each point: the sliding layers' windows written by the eager pass itself into
  snapshots reserved for it, or (a prefill graph's pass, whose points all lie within the rings' spare slots of its
  end) copied from the rings; a request's release stores its conversation (prompt and answer). At admission a
  request copies its longest stored prefix under its cache_salt when it beats the slot's own reuse by
  prefix_cache_min tokens; one that shares more with a request still in prefill (a leader) waits a step for the
  leader to store it (Engine._wait_for_leader), so
  requests arriving together (the n choices of one prompt, agents with one system prompt) prefill it once.
- Prefill, short prompts as graphs. An eager prefill pass of up to a few thousand tokens is bound by the host's
  ~1,200 Python launches, not by its kernels. So a fresh prompt (no cached prefix, no image) of up to
  startup.GRAPH_PREFILL tokens replays the prefill graph of its length padded to a power of two (32 ... 4,096) in a
  one-row staging cache; its slot then adopts the staging row's keys, values, region summaries and pending indexer
  rows, and the ring slots of its real tokens. A conversation's next turn of up to EXTEND_TURN tokens on top of its
  slot's cache replays extension graphs: decode steps of up to 128 tokens for that slot (startup.EXTEND: 16, 32, 64,
  and 128 where the memory plan holds its graph; positions, slot and token count are device inputs). An engine step's
  prompts replay their graphs when their padded lengths add up to at most the largest prefill graph's (4,096 tokens).
  Padding follows the real tokens, so none of them attends to it or shares a routing or region decision with it; its
  writes past the real tokens are overwritten before anything reads them, but for the pending DSA indexer rows it
  overwrites past a region boundary, which the layers put back. With `speculative=K` the graphs also return the real
  rows, which the MTP layers absorb after each replay. The real rows differ from an unpadded pass only as two prefill
  chunkings do (the GEMMs' row counts). Anything else (chunks of long prompts, longer turns, larger bursts of
  requests, prompts with images, and every prompt without CUDA graphs) runs one eager pass over the packed pieces.
- Decode: one static-shape function of the slot of each row, replayed as a CUDA graph per batch bucket (padding rows
  of a bucket point at slots that do not decode in the step and write only where their slot's next token would go).
  The forward graph takes greedy's argmax, which feeds the next step. When a request of the step needs more
  (Request.chosen_fully: a draw, bias, penalties, logprobs, a grammar, a reasoning budget) a choose graph follows
  (choice.py: per-slot device rows of every request's parameters and state, so any mix replays one graph; draws by
  each request's own seed and count, the same on every rank without a broadcast). A grammar's mask for token t + 1
  depends on token t: with a constrained request the host reads the previous step's tokens after queuing the
  forward, advances each matcher and fills the bitmask (grammar.py) while the forward runs, then queues the choose
  graph that applies it; every rank runs its own matcher. Steps without one keep the overlap above: no host round
  trip. With `speculative=K` a decode step verifies K drafts of the checkpoint's MTP layers per request
  (speculative.py: verify, accept and draft graphs; each verify position gets its own mask).
- A step costs what the slots hold: the decode kernels skip the cache past every row's history, so a 4k-token
  conversation on a cache sized for 208k positions pays 0.3% more per step than on an 8k cache (4.946 against
  4.931 ms on an H200: PERF_LOG "the decode step on a long cache"), not the long context.
- A step that raises ends every request in the engine ("error") and frees the slots (Engine.abandon); the engine
  takes new requests.
"""
import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

import choice
import grammar
import model as M
import prefix_cache
import speculative
import startup
from choice import Reasoning
from sampling import Sampling, greedy, is_int

# Prefill tokens per engine step (packed over requests): 16k against 8k / 32k in PERF_LOG's table, row "prefill,
# chunks of 16384 on a growing cache".
PREFILL_CHUNK = 16384
# A conversation's next turn of up to this many new tokens prefills as extension steps (startup.EXTEND) when the
# prefill graphs run. The bound of 4 steps of 64 (2 of 128) is chosen, not measured: a 64-token step reads most of a
# rank's experts, so many would cost more kernel time than one eager pass costs the host (tools.bench_request --turn
# measures it).
EXTEND_TURN = 256
# While streams decode, a prefill pass may run at most this many of the model's layers per engine step, a decode step
# after each part, so a prompt's arrival stalls the running streams for a part, not a pass (0: whole passes). An eager
# pass is bound by its host's launches, about the same at 1k and 4k tokens: 0.11-0.21 s for 92 layers on the H200s
# measured (PERF_LOG "the CPU day's changes on a GPU"), 1.2-2.3 ms a layer, against 4,096 tokens' kernels at ~1.15 ms
# a layer, so the decode steps between parts may or may not hide in the host's time: off until tools/bench_serve.py
# has measured the inter-token p99 and the prefill rate under load with it (16 layers: ~19-37 ms, with the batch-16
# decode step within a 50 ms gap; PERF_LOG "prompts that arrive while streams decode, a prefill pass split by layers
# between decode steps").
PREFILL_LAYERS_PER_STEP = 0
# While streams decode, fresh prompts replay their prefill graphs only when their padded lengths add up to at most
# this; longer ones run as an eager pass split by layers (above). The 512-token graph's replay is ~35-40 ms (1 x 300's
# time to first token 0.040 s on an H100: PERF_LOG "prefill graphs through the engine"), the 1,024-token one ~50 ms.
GRAPH_BUSY = 512
REWIND = 64  # positions a slot's prefix may be rewound by to reuse it (sliding rings carry that many spare slots)
# A stored prefix is copied in only when it saves at least this many prompt tokens over the slot's own: the copy is
# ~4 launches per layer (~200 on the released geometry, ~2 ms of host time), about what ~40 tokens of an 8k prefill
# cost on an H100 (0.44 s); chosen from that estimate, not measured (tools/bench_prefix_cache.py measures a hit)
PREFIX_MIN = 64


# --------------------------------------------------------------------------------------------------
# requests


class Finish(str, enum.Enum):
    """Why a request ended. Each member equals, and formats as, its string ("stop", ...): the front ends compare and
    serialise finish reasons as strings."""
    STOP = "stop"  # a stop id was emitted
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"  # Engine.cancel
    ERROR = "error"  # a step raised: Engine.abandon
    __str__ = str.__str__


class Logprob(NamedTuple):
    """A token's log-probability under the model's own distribution (choice.py: before bias, penalties, masks and
    temperature), and the most likely tokens there [(id, logprob), ...], most likely first."""
    logprob: float
    top: list


@dataclass(eq=False)
class Request:
    """One generation. ids: the prompt; features: its image feature rows [n, D] bf16, one per image placeholder of
    ids in order (model.image_features), or None. The defaults of the rest are plain generation:
    - logprobs: report each emitted token's Logprob with this many top alternatives (0..choice.TOP) in
      token_logprobs; echo: also each prompt token's (prompt_logprobs, None for the first), max_new_tokens 0
      included; the prompt is then prefilled whole (no cache reuse).
    - constraint: the answer follows this grammar (grammar.Constraint; the engine needs Grammars); EOS (a stop id)
      only where the grammar may end; a dead end finishes the request as "error" (error names the field).
    - reasoning: the prompt opened a reasoning block (choice.Reasoning): the constraint applies after its end, and
      its budget forces the end.
    n choices of one prompt are n requests, choice j with sampling.derived(j)."""
    ids: list
    max_new_tokens: int
    stop_ids: frozenset = frozenset()
    sampling: Sampling = field(default_factory=Sampling)
    features: torch.Tensor | None = None
    logprobs: int | None = None
    echo: bool = False
    constraint: grammar.Constraint | None = None
    reasoning: Reasoning | None = None
    cache_salt: str | None = None  # prefixes are shared only between requests of the same salt (a tenant's)
    share: int = 0  # the prompt's leading ids other requests likely start with too (a chat's system turn with its
    # tools, as a front end renders it): its prefill stores that prefix as well (Engine._points)
    # set by the engine
    rid: int = -1
    out: list = field(default_factory=list)  # emitted ids (a stop id included)
    token_logprobs: list = field(default_factory=list)  # a Logprob per emitted id (with logprobs)
    prompt_logprobs: list = field(default_factory=list)  # a Logprob per prompt id, None for the first (with echo)
    finish: Finish | None = None
    error: str | None = None  # why it finished "error", when the engine knows (a grammar's dead end)
    slot: int = -1
    cached: int = 0  # prompt tokens reused: from the slot's cache or copied from the prefix store
    prefilled: int = 0  # prompt tokens in the cache so far
    t_first: float | None = None  # perf_counter of the first token
    key: list = field(default_factory=list)  # the prompt as prefix reuse compares it (reuse_key)
    compiled: grammar.Compiled | None = None  # the constraint compiled (Engine.check)
    matcher: grammar.Matcher | None = None  # its state on this rank (from admission)
    drafts: list = field(default_factory=list)  # the drafts its next verify step feeds, as the host read them
    points: set = field(default_factory=set)  # prompt positions whose prefix its prefill stores (Engine._points)

    @property
    def chosen_fully(self) -> bool:
        """Its tokens need the full-vocabulary choose step (choice.py), not greedy's argmax alone."""
        return (self.sampling.processed or self.logprobs is not None or self.constraint is not None
                or (self.reasoning is not None and self.reasoning.budget is not None))

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
    salt: str | None = None  # the cache_salt of the request whose prefix it holds


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Piece(NamedTuple):
    """Part of a prefill: prompt tokens start .. start + n - 1 of a request, in one engine step."""
    req: Request
    start: int
    n: int


class PassInputs(NamedTuple):
    """An eager prefill pass's inputs over its pieces, packed (model.forward's arguments)."""
    ids: torch.Tensor  # [T]
    lens: list  # tokens per piece
    rows: list  # each piece's slot
    embeds: torch.Tensor | None  # input rows [T, D] with image features at their placeholders; None: text only
    held: list  # each slot's cached positions


class Split(NamedTuple):
    """A prefill pass whose layers run over several engine steps, a decode step after each part (while streams decode:
    Engine._splits): its pieces, the pass (model.Trunk: its placement and the layers run so far) and the prefix
    store's snapshots its layers write {(slot, position): snapshot}."""
    pieces: list
    trunk: M.Trunk
    snaps: dict


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
    # (_prefill_graphs_for; None: startup.GRAPH_PREFILL where the decode graphs run, else 0; 0: none; on the CPU the
    # padded passes run eagerly, for tests)
    prefix_cache_gib: float | None = None  # the prefix store's budget (prefix_cache.py; None: one slot's cache at
    # the context, at most 1/8 of the caches and the store together; 0: no store)
    prefix_cache_min: int = PREFIX_MIN  # prompt tokens a stored prefix must save to be copied in (0: any region)
    prefill_layers_per_step: int = PREFILL_LAYERS_PER_STEP  # while streams decode, a prefill pass's layers per engine
    # step, a decode step between its parts (0: whole passes; speculative engines and echo requests run whole passes)


@dataclass
class StepOutput:
    """What one engine step produced: (request, new ids) pairs in order, and the requests that finished."""
    tokens: list = field(default_factory=list)
    finished: list = field(default_factory=list)


@dataclass
class Inflight:
    """A queued decode step whose tokens the host has not read: its requests, pinned host copies of its outputs
    (tokens, or speculative rows [accepted, tokens..., drafts...]; then the logprobs [n, P], top ids and top logprobs
    [n, P, choice.TOP] of a step chosen fully) and the event that marks them done (None on the CPU)."""
    reqs: list
    host: tuple
    ev: object
    read: bool = False


class EngineError(RuntimeError):
    """A request's computation went wrong (non-finite logits): the message names the request and the step."""


class Engine:
    def __init__(self, model: M.Step5ForCausalLM, config: EngineConfig, say=lambda *a: None,
                 grammars: grammar.Grammars | None = None):
        c, cfg = config, model.cfg
        for name in ("max_batch", "max_context", "prefill_chunk", "speculative", "build_threads", "graph_prefill",
                     "prefix_cache_min", "prefill_layers_per_step"):
            v = getattr(c, name)
            if v is not None and not is_int(v):
                raise ValueError(f"{name} {v!r} must be an integer")
        if c.max_batch < 1:
            raise ValueError(f"max_batch {c.max_batch} must be >= 1")
        if c.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk {c.prefill_chunk} must be >= 1")
        if c.prefix_cache_min < 0:
            raise ValueError(f"prefix_cache_min {c.prefix_cache_min} must be >= 0")
        if c.prefill_layers_per_step < 0:
            raise ValueError(f"prefill_layers_per_step {c.prefill_layers_per_step} must be >= 0 (0: whole passes)")
        if c.prefix_cache_gib is not None and (not isinstance(c.prefix_cache_gib, (int, float))
                                               or not 0 <= c.prefix_cache_gib < float("inf")):
            raise ValueError(f"prefix_cache_gib {c.prefix_cache_gib!r} must be a number of GiB >= 0")
        if c.speculative and not 1 <= c.speculative <= cfg.mtp_layers_kept:
            raise ValueError(f"speculative decoding with {c.speculative} drafts needs {c.speculative} MTP layers; "
                             f"the shards keep {cfg.mtp_layers_kept} (convert.py --keep-mtp)")
        if c.speculative and cfg.sparse and c.speculative + 1 > cfg.sparse.block:  # Model.keep_pending's bound
            raise ValueError(f"speculative decoding with {c.speculative} drafts writes more than a DSA region of "
                             f"{cfg.sparse.block} tokens per step")
        if grammars is not None and grammars.vocab_size != cfg.vocab_size:
            raise ValueError(f"the grammars' tokenizer view spans {grammars.vocab_size} ids; the model's vocabulary "
                             f"{cfg.vocab_size}")
        self.model, self.config, self.say = model, c, say
        self.dev = model.lm_head.weight.device
        self.k = c.speculative
        self.use_graph = c.cuda_graph and self.dev.type == "cuda"
        # spare ring slots: a rewind for prefix reuse and the rows a speculative step writes past what it keeps, or
        # the widest extension step's rows beyond the window
        self.slack = max(REWIND + 2 * self.k + 2, max(startup.EXTEND) - 1)
        # start-up's memory plan sets max_context now; start() builds, allocates the caches and captures the graphs
        # (the engine's files name the start-up's built marker)
        self.startup = startup.Startup(self, code=(__file__, speculative.__file__))
        self.startup.replan()
        B = c.max_batch
        self.cache, self.mtps = None, []  # allocated by start(), after its parallel kernel builds
        self.store = None  # the prefix store (prefix_cache.PrefixStore), allocated by start() when the plan has one
        self.prefill_tokens = 0  # prompt tokens prefilled (not copied) since start-up
        self.slots = [Slot() for _ in range(B)]
        self.next_tok = torch.zeros(B, dtype=torch.long, device=self.dev)  # each slot's next token to feed
        self.count = torch.zeros(B, dtype=torch.long, device=self.dev)  # tokens each slot's request emitted
        self.grammars = grammars  # compiles constrained requests' grammars (None: such requests are refused)
        # each slot's choice parameters and state, as wide as the gathered logits (the vocabulary, padded to the ranks)
        self.choice = choice.Slots(B, model.lm_head.weight.shape[0] * M.world_size, self.dev)
        # the grammar masks of a step's rows (a verify step: K + 1 per request): the host fills them, the choose step
        # reads them where a row's request is constrained
        shape = (B * (self.k + 1), (cfg.vocab_size + 31) // 32)
        self.mask = torch.full(shape, -1, dtype=torch.int32, device=self.dev)
        self.mask_host = torch.full(shape, -1, dtype=torch.int32, pin_memory=self.dev.type == "cuda")
        self.waiting, self.running = [], []  # requests queued for a slot; requests holding one
        self.steps, self.rids = 0, itertools.count()
        self.inflight = None  # the decode step whose tokens the host has not read yet (Inflight)
        self.split = None  # the prefill pass whose layers run over several steps while streams decode (Split)
        self.spec = speculative.Speculator(self) if self.k else None
        self.graphs = {}  # batch bucket -> its decode step's startup.Graph(s)
        self.prefill_graphs = {}  # padded length -> startup.Graph of a fresh prompt's prefill
        self.extend_graphs = {}  # padded length -> startup.Graph of a next turn's extension step
        # progress(first token, tokens, longest prompt, layer, layers, start) during prefills; start: where the first
        # piece's prefill began (after its reused prefix)
        self.progress = None

    def start(self):
        """Every kernel variant a request can reach compiled, the caches allocated, every graph captured; times
        reported (Startup.run)."""
        self.startup.run()

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
        bad = next((t for t in req.sampling.logit_bias or () if t >= V), None)
        if bad is not None:
            raise ValueError(f"logit_bias: {bad} is not a token id in [0, {V})")
        if req.logprobs is not None and (not is_int(req.logprobs) or not 0 <= req.logprobs <= choice.TOP):
            raise ValueError(f"logprobs {req.logprobs!r} must be an integer in [0, {choice.TOP}]")
        if not isinstance(req.echo, bool) or req.echo and req.logprobs is None:
            raise ValueError(f"echo {req.echo!r} must be a bool, and echo needs logprobs (0 for the tokens' own)")
        if req.cache_salt is not None and not isinstance(req.cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(req.cache_salt).__name__}")
        if not is_int(req.share) or not 0 <= req.share <= len(req.ids):
            raise ValueError(f"share {req.share!r} must be an integer in [0, {len(req.ids)}] (a count of prompt ids)")
        if req.reasoning is not None:
            p = (req.reasoning.problem(V) if isinstance(req.reasoning, Reasoning)
                 else "reasoning must be a choice.Reasoning")
            if p:
                raise ValueError(p)
        req.ids = req.ids if plain and type(req.ids) is list else [int(t) for t in req.ids]
        req.stop_ids = frozenset(int(t) for t in req.stop_ids)
        if req.constraint is not None:
            field_ = getattr(req.constraint, "field", "constraint")
            if self.grammars is None:
                raise ValueError(f"{field_}: this engine has no tokenizer view for constrained decoding")
            if not req.stop_ids:
                raise ValueError(f"{field_}: a constrained request needs a stop id (its grammar ends at one)")
            req.compiled = self.grammars.compiled(req.constraint)  # a cache hit when a front end compiled it

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
            req.finish = Finish.CANCELLED

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
            r.finish = r.finish if r.finish is not None else Finish.ERROR
        for s in self.slots:
            s.owner, s.held, s.stale, s.salt = None, [], False, None
        self.waiting.clear()
        self.running.clear()
        self.inflight = None
        if self.split is not None:
            self._free_snaps(self.split.snaps)
            self.split = None

    def _reuse(self, req: Request, slot: Slot) -> int:
        """Prompt tokens of `req` whose cache the slot holds and that a rewind can keep: the common prefix, one token
        short of the prompt (its last token must be fed), at a DSA region boundary (the region in progress is
        recomputed), within the rings' spare slots. Speculative decoding also recomputes the rows its MTP layers read
        past the common prefix, and the ones a draft step reads (2K + 2 from the prompt's end)."""
        if req.echo or slot.salt != req.cache_salt:  # echo: every prompt token's logprob comes from its own prefill
            return 0
        n = min(common_prefix(req.key, slot.held), len(req.ids) - 1)
        if self.k:
            n = min(n - self.k - 2, len(req.ids) - 2 * self.k - 2)
        blk = self.model.cfg.sparse.block if self.model.cfg.sparse else 1
        n = n // blk * blk
        return n if n > 0 and len(slot.held) - n <= REWIND else 0

    # ---- the prefix store (prefix_cache.py)
    def _usable(self, req: Request) -> int:
        """The longest prefix of req's prompt a copy may give it or take from it: as _reuse's bound, one token short
        of the prompt (and with speculative decoding 2K + 2 short: the rows drafting recomputes), at a region."""
        n = len(req.ids) - 1 - (2 * self.k + 1 if self.k else 0)
        return max(0, n) // self.store.blk * self.store.blk

    def _points(self, req: Request) -> set:
        """Where req's prefill stores its prefix: every SNAP_EVERY positions, at the end of the part other requests
        likely share (req.share) and at its usable end, past what it has and what is stored already."""
        U, S = self._usable(req), req.share // self.store.blk * self.store.blk
        want = set(range(prefix_cache.SNAP_EVERY, U, prefix_cache.SNAP_EVERY)) | ({U} if U else set())
        want |= {S} if 0 < S < U else set()
        return {x for x in want if x > req.prefilled} - self.store.stored(req.key, req.cache_salt, U)

    def _wait_for_leader(self, req: Request, have: int) -> bool:
        """True when a request in prefill (the leader) shares a prefix with req that is longer than `have` by at
        least prefix_cache_min tokens (and a region) and has not prefilled it yet: the leader then stores that
        prefix (a point of its prefill), and req waits to copy it instead of computing it too."""
        blk, U = self.store.blk, self._usable(req)
        for q in self.running:
            if q.prefilled >= len(q.ids) or q.cache_salt != req.cache_salt or q.echo:
                continue
            d = min(common_prefix(req.key, q.key), U, self._usable(q)) // blk * blk
            if d - have >= max(self.config.prefix_cache_min, blk) and q.prefilled < d:
                q.points.add(d)
                return True
        return False

    def _admit(self, out: StepOutput):
        for req in list(self.waiting):
            if req.finish is not None or req.max_new_tokens == 0 and not req.echo:  # cancelled, or nothing to do
                req.finish = req.finish or Finish.LENGTH
                self.waiting.remove(req)
                out.finished.append(req)
                continue
            free = [i for i, s in enumerate(self.slots) if s.owner is None]
            if not free:
                break
            best = max(free, key=lambda i: (self._reuse(req, self.slots[i]), -self.slots[i].used))
            s = self.slots[best]
            n = self._reuse(req, s)
            hit = None
            if self.store is not None and not req.echo:
                hit = self.store.lookup(req.key, req.cache_salt, self._usable(req))
                if self._wait_for_leader(req, max(n, hit.n if hit else 0)):
                    continue  # a request in prefill computes this prefix and stores it: copied in a later step
                if hit is not None and (hit.n <= n or hit.n - n < self.config.prefix_cache_min):
                    hit = None
                self.store.stats["hits" if hit else "misses"] += 1
            s.owner, s.held, s.used, s.salt = req, s.held[:n], self.steps, req.cache_salt
            if hit is not None:
                self.store.load(best, hit)
                n, s.held = hit.n, req.key[:hit.n]
            self.cache.lengths[best] = n
            self.cache.requests[best] = req.rid
            self.count[best] = 0
            self.choice.take(best, req)
            if req.compiled is not None:
                req.matcher = self.grammars.matcher(req.compiled, req.stop_ids,
                                                    req.reasoning.end_id if req.reasoning else None)
            for c in self.mtps:
                c.lengths[best] = n
            req.slot, req.cached, req.prefilled = best, n, n
            req.points = self._points(req) if self.store is not None and not req.echo else set()
            self.waiting.remove(req)
            self.running.append(req)

    def _release(self, req: Request, out: StepOutput):
        s = self.slots[req.slot]
        s.owner, s.used = None, self.steps
        n = int(self.cache.lengths[req.slot])  # host read: once per request
        if self.store is not None and not s.stale and not self.k and not req.echo:
            # the conversation so far, for its next turn in any slot (a speculative slot's MTP layers lag its length)
            x = n // self.store.blk * self.store.blk
            if x and n - x <= self.store.margin:
                self.store.put(req.slot, (req.key + req.out)[:x], req.cache_salt, x)
        s.held, s.stale = [] if s.stale else (req.key + req.out)[:n], False
        if n + self.slack + 2 * self.k + 2 > self.cache.cap:  # no room for a padding row's writes: forget the prefix
            s.held = []
            self.cache.lengths[req.slot] = 0
        self.running.remove(req)
        out.finished.append(req)

    # ---- one engine step
    @torch.inference_mode()
    def step(self) -> StepOutput:
        """Release finished requests, admit waiting ones, run up to prefill_chunk prefill tokens (while streams decode,
        prefill_layers_per_step layers of that pass: _prefill), run one decode step (its tokens are read at the next
        step), and report what the host read."""
        out = StepOutput()
        self.steps += 1
        for r in [r for r in self.running if r.finish is not None and not self._mid_pass(r)]:
            self._release(r, out)
        self._admit(out)
        pre = [r for r in self.running if r.prefilled < len(r.ids)]
        if pre:
            self._prefill(pre, self._decoding(), out)
        dec = self._decoding()  # with the requests whose prompt this step's prefill completed
        prev, self.inflight = self.inflight, None
        busy = set() if prev is None else set(map(id, prev.reqs))
        live = [r for r in dec if len(r.out) + (id(r) in busy) < r.max_new_tokens]
        if live:
            self.inflight = Inflight(*(self.spec.decode if self.spec else self._decode)(live, prev, out))
        self._emit(prev, out)  # unless a constrained step read it already
        for r in [r for r in self.running if r.finish is not None and not self._mid_pass(r)]:
            self._release(r, out)
        return out

    @staticmethod
    def _reach(pieces: list) -> list:
        """The prefix store's points the pieces' tokens reach [(piece, position)], in order."""
        return [(p, x) for p in pieces for x in sorted(p.req.points) if p.start < x <= p.start + p.n]

    def _decoding(self) -> list:
        """The running requests that decode: prompt prefilled, first token taken, not finished."""
        return [r for r in self.running if r.prefilled == len(r.ids) and r.finish is None and r.out]

    def _mid_pass(self, r: Request) -> bool:
        """r's prefill pass runs split over steps and has layers left: its slot stays its own until the pass ends."""
        return self.split is not None and any(p.req is r for p in self.split.pieces)

    def _prefill(self, reqs: list, streams: list, out: StepOutput):
        """Up to prefill_chunk prompt tokens, packed over the requests in order, or the next layers of a pass split
        over steps; the requests whose prompt completes get their first token. streams: the requests that decode in
        this step: while there are any, a pass runs prefill_layers_per_step layers per step (Engine._splits), and
        fresh prompts replay their graphs only up to GRAPH_BUSY padded tokens."""
        if self.split is None:
            budget, pieces = self.config.prefill_chunk, []
            for r in reqs:
                n = min(len(r.ids) - r.prefilled, budget)
                if n <= 0:
                    break
                pieces.append(Piece(r, r.prefilled, n))
                budget -= n
            # the prefix store's points these pieces reach: a graph's pass leaves them to its rings, which hold the
            # windows of points near its end; an eager pass's layers write them into reserved snapshots
            # (model.Placement.snaps)
            reach = self._reach(pieces)
            far = any(p.start + p.n - x > self.store.margin for p, x in reach)
            split = self._splits(pieces, streams)
            plan = None if far else self._prefill_graphs_for(pieces, GRAPH_BUSY if split else None)
            snaps = {}
            if plan:  # each piece's replays in order; its last one's output read before the next replay
                logits = torch.cat([[self._replay_prefill(g, step) for g, step in steps][-1].clone()
                                    for steps in plan])
            else:
                for p, x in reach:
                    i = self.store.reserve()
                    if i is not None:
                        snaps[p.req.slot, x] = i
                try:
                    if split:
                        self.split = Split(pieces, self._begin(pieces, [(b, x, i) for (b, x), i in snaps.items()]),
                                           snaps)
                    else:
                        logits = self._eager_prefill(pieces, [(b, x, i) for (b, x), i in snaps.items()])
                except BaseException:  # the reserved snapshots back to the store (the step's requests end: abandon)
                    self._free_snaps(snaps)
                    raise
        if self.split is not None:  # its next part; all its layers left once no stream decodes (or pads lack)
            sp = self.split
            n = self.config.prefill_layers_per_step if self._splits(sp.pieces, streams) else None
            try:
                if not self.model.run_layers(sp.trunk, n, self._hook(sp.pieces)):
                    return
            except BaseException:
                self.split = None
                self._free_snaps(sp.snaps)
                raise
            self.split = None
            pieces, snaps = sp.pieces, sp.snaps
            logits = self.model.last_logits(sp.trunk.res, [p.n for p in pieces])
        self.prefill_tokens += sum(p.n for p in pieces)
        for p in pieces:
            p.req.prefilled = p.start + p.n
            self.slots[p.req.slot].held = p.req.key[:p.req.prefilled]
        for p, x in self._reach(pieces):
            p.req.points.discard(x)
            i = snaps.get((p.req.slot, x))
            if i is not None or p.start + p.n - x <= self.store.margin:
                self.store.put(p.req.slot, p.req.key, p.req.cache_salt, x, i)
        done = [(p.req, lg) for p, lg in zip(pieces, logits) if p.req.prefilled == len(p.req.ids)]
        for r, _ in done:
            if r.max_new_tokens == 0:  # an echo request for the prompt's logprobs alone
                r.finish = Finish.LENGTH
        first = [(r, lg) for r, lg in done if r.max_new_tokens > 0 and r.finish is None]
        if not first:
            return
        rs = [r for r, _ in first]
        n = len(rs)
        slots = torch.tensor([r.slot for r in rs], device=self.dev)
        logits = torch.stack([x for _, x in first])
        lps = None
        if any(r.chosen_fully for r in rs):
            self._masks(rs, 1)
            tok, *lps = choice.choose(logits, self.choice, slots, self.mask[:n], self.count[slots],
                                      torch.ones(n, dtype=torch.long, device=self.dev))
            lps = [x[:, None].tolist() for x in lps]  # as a decode step's: one position per row
        else:
            tok = greedy(logits)
        self.next_tok[slots] = tok.clamp(min=0)
        self.count[slots] = 1
        for i, (r, t) in enumerate(zip(rs, tok.tolist())):  # a host read: the prompt's first token is reported at once
            self._take(r, [t], out, "its prefill", None if lps is None else [x[i] for x in lps])
        if self.spec:  # queued after that read, which would otherwise wait for the drafts too
            self.spec.first_drafts(rs, slots)

    def _splits(self, pieces: list, streams: list) -> bool:
        """Whether a prefill pass over the pieces runs split by layers in this step: streams decode in it, the engine
        is not speculative and no piece is an echo (those run whole passes), and the decode step's bucket finds its
        padding rows without the pass's slots (a padding row writes at its slot's next position in every layer, and
        the layers the pass has not run yet still read that slot's history there: the sliding rings, the pending
        DSA rows)."""
        if not (self.config.prefill_layers_per_step and streams) or self.spec or any(p.req.echo for p in pieces):
            return False
        return self.bucket(len(streams)) + len(pieces) <= len(self.slots)

    def _free_snaps(self, snaps: dict):
        if snaps:
            self.store.unreserve(snaps.values())

    def _prefill_graphs_for(self, pieces: list, limit: int | None = None) -> list | None:
        """Per piece, its graph replays [(graph, Piece of the replay's tokens)], when every piece is the whole rest of
        a text prompt: a fresh prompt of up to the largest prefill graph's length, the prefill graph of its padded
        length; up to EXTEND_TURN tokens on top of a cached prefix, extension steps of up to 128 tokens each. And only
        when their padded lengths add up to at most the largest prefill graph's (their replays then cost about one such
        pass of kernels, no more than an eager pass of that size costs the host), and at most `limit` (while streams
        decode: GRAPH_BUSY); else None: one eager pass."""
        if not self.prefill_graphs or any(pc.req.echo for pc in pieces):  # echo reads every row's logits
            return None
        plan, total = [], 0
        for pc in pieces:
            a, n = pc.start, pc.n
            if a + n < len(pc.req.ids) or pc.req.features is not None or (
                    a and (not self.extend_graphs or n > EXTEND_TURN)):
                return None
            sizes, step = (self.extend_graphs, max(self.extend_graphs)) if a else (self.prefill_graphs, n)
            steps = []
            for o in range(0, n, step):
                p = next((p for p in sizes if p >= min(step, n - o)), None)
                if p is None:
                    return None
                steps.append((sizes[p], Piece(pc.req, a + o, min(step, n - o))))
                total += p
            plan.append(steps)
        return plan if total <= max(self.prefill_graphs) and (limit is None or total <= limit) else None

    def _inputs(self, pieces: list) -> "PassInputs":
        """An eager pass's inputs over the pieces, packed."""
        ids = torch.tensor([t for p in pieces for t in p.req.ids[p.start:p.start + p.n]], dtype=torch.long,
                           device=self.dev)
        lens = [p.n for p in pieces]
        embeds = None
        if any(p.req.features is not None for p in pieces):
            embeds = torch.cat([p.req.embeds(self.model, p.start, p.start + p.n) if p.req.features is not None else
                                self.model.embed(ids[o:o + p.n]) for p, o in zip(pieces, itertools.accumulate(
                                    [0] + lens))])
        return PassInputs(ids, lens, [p.req.slot for p in pieces], embeds, [p.start for p in pieces])

    def _hook(self, pieces: list):
        """The pass's per-layer progress report (Engine.progress), or None."""
        if self.progress is None:
            return None
        first, start = pieces[0].start, pieces[0].req.cached
        tokens, longest = sum(p.n for p in pieces), max(len(p.req.ids) for p in pieces)
        return lambda i, layers: self.progress(first, tokens, longest, i, layers, start)

    def _begin(self, pieces: list, snaps: list) -> M.Trunk:
        """A pass over the pieces, packed, placed with no layer run yet (Split; snaps: _eager_prefill's)."""
        ids, lens, rows, embeds, held = self._inputs(pieces)
        return self.model.begin(ids, self.cache, lens, rows=rows, embeds=embeds, held=held, snaps=snaps)

    def _eager_prefill(self, pieces: list, snaps: list | None = None) -> torch.Tensor:
        """One pass over the pieces, packed -> the logits [pieces, V/tp] of each piece's last token; an echo piece's
        prompt logprobs from every row of the pass. snaps: the prefix store's windows the layers write
        (model.Placement.snaps)."""
        ids, lens, rows, embeds, held = self._inputs(pieces)
        hook = self._hook(pieces)
        if not self.spec and not any(p.req.echo for p in pieces):
            return self.model.forward(ids, self.cache, lens, rows=rows, embeds=embeds, held=held, progress=hook,
                                      snaps=snaps)
        if self.spec:
            hidden = self.spec.prefill(pieces, ids, embeds, hook, snaps)
        else:
            hidden = self.model.forward_rows(ids, self.cache, lens, rows=rows, embeds=embeds, held=held, progress=hook,
                                             snaps=snaps)
        starts = list(itertools.accumulate([0] + lens))
        for p, o in zip(pieces, starts):
            if p.req.echo:  # row i predicts prompt token start + i + 1
                targets = p.req.ids[p.start + 1:p.start + p.n + 1]
                got = choice.prompt_logprobs(self.model, hidden[o:o + len(targets)], targets, p.req.logprobs)
                p.req.prompt_logprobs += ([None] if p.start == 0 else []) + [Logprob(*x) for x in got]
        return self.model.logits(hidden[torch.tensor([o + p.n - 1 for p, o in zip(pieces, starts)],
                                                     device=self.dev)])

    def _replay_prefill(self, g: startup.Graph, p: Piece) -> torch.Tensor:
        """A piece (the rest of its request's prompt, or part of it) by a prefill or extension graph (inputs: the ids,
        padded; the real count; the slot) -> this rank's logits [1, V/tp] of its last token. With speculative
        decoding the MTP layers then absorb the graph's real rows."""
        pinned = self.dev.type == "cuda"
        ids = torch.zeros(g.inputs[0].numel(), dtype=torch.long, pin_memory=pinned)
        ids[:p.n] = torch.tensor(p.req.ids[p.start:p.start + p.n])
        g.inputs[0].copy_(ids.view(g.inputs[0].shape), non_blocking=pinned)
        g.inputs[1].copy_(torch.tensor([p.n], pin_memory=pinned), non_blocking=pinned)
        g.inputs[2].copy_(torch.tensor([p.req.slot], pin_memory=pinned), non_blocking=pinned)
        if not self.spec:
            return g()
        lg, res = g()
        self.spec.absorb([p], g.inputs[0].view(-1)[:p.n], res[:p.n])
        return lg

    def bucket(self, n: int) -> int:
        """The batch bucket a decode step of n requests runs in: the smallest that holds them."""
        return next(x for x in self.graphs if x >= n)

    def padding_slots(self, reqs: list) -> list:
        """Slots a padding row of a decode step over `reqs` may point at, free ones first. A padding row writes only at
        its slot's next position, which that slot's next real write covers, so a slot whose request does not decode
        in this step pads too (all slots may be held while some requests prefill or end): one that prefills, or one
        that has ended (its last token in flight, or max_new_tokens reached); never one whose prefill pass runs split
        over steps (Split: its unrun layers still read that position's ring slot and pending row). A speculative
        step also writes MTP rows and ring entries below that position, so it pads only with free and ended slots."""
        mine = {r.slot for r in reqs} | ({p.req.slot for p in self.split.pieces} if self.split else set())
        free = [i for i, s in enumerate(self.slots) if s.owner is None]
        held = [i for i, s in enumerate(self.slots) if s.owner is not None and i not in mine
                and (not self.k or s.owner.prefilled == len(s.owner.ids))]
        return free + held

    def fill_inputs(self, g: startup.Graph, reqs: list, b: int, pads: list | None = None) -> list:
        """A bucket graph's slot and live inputs for the requests, padded (with `pads`, else padding_slots; pinned host
        copies) -> the padding slots."""
        n = len(reqs)
        pad = (self.padding_slots(reqs) if pads is None else pads)[:b - n]
        slots = [r.slot for r in reqs] + pad
        pinned = self.dev.type == "cuda"
        g.inputs[0].copy_(torch.tensor(slots, pin_memory=pinned), non_blocking=pinned)
        g.inputs[1].copy_(torch.tensor([1] * n + [0] * (b - n), pin_memory=pinned), non_blocking=pinned)
        return pad

    def _decode(self, reqs: list, prev: Inflight | None, out: StepOutput) -> tuple:
        """Queue one plain decode step over the requests. Its forward graph takes greedy's argmax; when a request needs
        more (sampling.Sampling.processed, logprobs, a grammar, a reasoning budget: Request.chosen_fully) a choose
        graph follows, the variant the requests need (choice.Pick), and with a constrained request the host first
        reads the previous step (the forward runs meanwhile), advances their grammars and fills their masks (_masks).
        Otherwise the host reads the previous step after this one is queued (step)."""
        n = len(reqs)
        b = self.bucket(n)
        g_fwd, *picks = self.graphs[b]  # the choose graphs in choice.Pick's order
        self.fill_inputs(g_fwd, reqs, b)
        logits, tok = g_fwd()
        if not any(r.chosen_fully for r in reqs):
            self.count[g_fwd.inputs[0][:n]] += 1
            return (reqs, *self.to_host(tok[:n]))
        if any(r.matcher is not None for r in reqs):
            self._emit(prev, out)
            self._masks(reqs, 1)
        tok, *lps = picks[choice.Pick.of(reqs).value]()
        return (reqs, *self.to_host(tok[:n], *(x[:n, None] for x in lps)))

    def _masks(self, reqs: list, P: int):
        """The grammar masks of a step's rows (P positions per request: a verify step's K + 1, fed its drafts) into
        the host buffer, then to the device, where the choose step reads those of constrained requests. A request
        whose grammar allows no token here finishes ("error", naming its field); its rows allow all (never used)."""
        if not any(r.matcher is not None for r in reqs):
            return
        rows = self.mask_host[:len(reqs) * P]
        for i, r in enumerate(reqs):
            at = rows[i * P:(i + 1) * P]
            if r.matcher is None or r.finish is not None:
                continue
            if r.matcher.fill(at, r.drafts[:P - 1]) is grammar.Status.DEAD_END:
                r.finish, r.error = Finish.ERROR, r.matcher.error
                at.fill_(-1)
        pinned = self.dev.type == "cuda"
        self.mask[:len(reqs) * P].copy_(rows, non_blocking=pinned)

    def to_host(self, *ts: torch.Tensor) -> tuple:
        """Pinned host copies of a step's outputs, queued on the current stream -> (the copies, the event that marks
        them done; None on the CPU, where the copies are done)."""
        if ts[0].device.type != "cuda":
            return tuple(t.clone() for t in ts), None
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in ts)
        for h, t in zip(host, ts):
            h.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return host, ev

    def _emit(self, step: Inflight | None, out: StepOutput):
        """The host reads a queued step's outputs (waiting for that step only), once, and hands them to their
        requests."""
        if step is None or step.read:
            return
        step.read = True
        if step.ev is not None:
            step.ev.synchronize()
        rows, *lps = (h.tolist() for h in step.host)
        toks = self.spec.unpack(rows, step.reqs) if self.spec else [[t] for t in rows]
        for i, (r, t) in enumerate(zip(step.reqs, toks)):
            self._take(r, t, out, "a decode step", [x[i] for x in lps] if lps else None)

    def _take(self, r: Request, toks: list, out: StepOutput, where: str, lps: list | None = None):
        """Append a step's tokens to a request, stopping at a stop id or at max_new_tokens; its logprobs (lps: the
        step's [P] logprobs, [P, TOP] top ids and theirs, position j for token j) and its grammar advanced."""
        if r.finish is not None:
            return
        if r.t_first is None:
            r.t_first = time.perf_counter()
        new = []
        for j, t in enumerate(toks):
            if t < 0:
                raise EngineError(f"request {r.rid}: non-finite logits at new token {len(r.out)} ({where}): the "
                                  "weights or inputs hold NaN or Inf")
            r.out.append(t)
            new.append(t)
            if r.logprobs is not None and lps is not None:
                lp, ids, top = lps[0][j], lps[1][j], lps[2][j]
                r.token_logprobs.append(Logprob(lp, list(zip(ids[:r.logprobs], top[:r.logprobs]))))
            if t in r.stop_ids:
                r.finish = Finish.STOP
                break
            if len(r.out) >= r.max_new_tokens:
                r.finish = Finish.LENGTH
                break
        if r.matcher is not None and r.matcher.advance(new) is grammar.Status.DEAD_END:
            r.finish, r.error = Finish.ERROR, r.matcher.error
        if new:
            out.tokens.append((r, new))


# --------------------------------------------------------------------------------------------------
# requests' image inputs, and the ranks' agreement on the tokens


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
