"""Start-up: everything an engine makes once, before its first request. The memory plan (what the caches, the prefill
workspace and the graphs take, and the context that fits), every kernel variant a request can reach compiled
(warm-up prefill passes, from a pool of threads while Triton's cache lacks them), the caches allocated, and every
CUDA graph built and captured: a decode step per batch bucket (plain, or speculative.py's verify and draft steps), a
fresh prompt's prefill per padded length and a next turn's extension steps. One object, `Startup`, that the engine
makes in its constructor (its plan settles the engine's context) and runs from Engine.start; what it makes goes
into the engine (cache, mtps, graphs, prefill_graphs, extend_graphs, max_context).

- The memory plan. Before allocating, rank 0 says the weights, caches, prefill workspace, graphs and headroom against
  the free memory (MemoryPlan.line: the GPU's, or on CPU the rank's share of the host memory available,
  Startup.free_memory); a plan that does not fit is refused, naming the flag to lower. Without a max_context the
  context is what fits, capped at the config's max_position_embeddings, and the ranks take the least any of them fits
  (one whole TP=8 rank of FP8 weights on an H200 with 16 slots: about 205k positions, PERF_LOG "the clean-up's decode
  step against the tree before it").
- The builds. Warm-up prefill passes reach every Triton kernel variant a request can reach; then each batch bucket's
  graph is captured, and the times are said. On a GPU the passes run first from a pool of threads (the rank's share
  of the node's CPU cores, at most 16), each in a small cache of its own, before the engine's caches are allocated,
  so Triton compiles their kernels side by side (each variant once: one_build_per_variant); the plan is then made
  again on what is left, and each batch bucket's decode step runs once from the same pool before the graphs are
  captured. The builds are sized to the memory left: passes run together only as far as the free memory holds their
  caches and workspaces, the decode steps' threads likewise, and where the memory left does not hold two of the
  largest passes side by side, or the plan has no room for what builds from threads leave taken (a whole rank on an
  H100), the warm-up runs in order, inside the plan. A start-up that still runs out of memory is refused in one line
  naming the flags that size it.
- Triton's disk cache. Triton keeps compiled kernels in ~/.triton/cache (or $TRITON_CACHE_DIR): a second start on
  the same machine reads them instead of compiling, and a copy of that directory on another node with the same GPU,
  driver and Triton skips the compile there too. A start-up leaves a marker there if it can (`step5-built-*`,
  _built_marker: named by the code, the model, the passes and the GPU); a start-up that finds its marker warms up in
  order instead of from threads, which would only read the cache and contend for the GIL.

Tests drive it through its public methods (run, warm_pass, build_ahead, warm_graphs_ahead, free_memory), wrapping
them on the engine's own Startup object to record what each makes, or to fake the memory it sees.
"""
import contextlib
import functools
import hashlib
import inspect
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch
import triton

import choice
import kernel
import model as M
import prefix_cache
import sampling

# Fresh prompts up to this many tokens prefill as a CUDA graph: an eager pass of <= 4k tokens is bound by the host's
# launches (~0.11-0.21 s a pass on the H200 machines, 0.047 s of kernels at 1k; PERF_LOG "fresh prompts and short
# next turns prefill as CUDA graphs")
GRAPH_PREFILL = 4096
# ... and so does a conversation's next turn, as decode steps of up to 128 tokens for its row, each padded to one of
# these (the sliding rings' spare slots bound a step: _extend_sizes; engine.EXTEND_TURN bounds the turn). The widest
# step is planned only where its graph's share of memory costs the caches little (WIDE_ROOM): one step of 128 tokens
# costs 25.6 ms at 8k where two of 64 cost 36.2 (an H100; PERF_LOG "extension steps of 64 and 128 tokens").
EXTEND = (16, 32, 64, 128)
EXTEND_GRAPH = 256 << 20  # an extension graph's memory in the plan (chosen, not measured), as a decode step's
WIDE_ROOM = 8  # the widest step's graph may take 1/WIDE_ROOM of a fitted context's caches (chosen, not measured)
GIB = 1 << 30
# A build thread's memory beside its pass's cache and workspace: its stream's cuBLAS workspaces and the caching
# allocator's rounding of its blocks (chosen, not measured)
PER_THREAD = 256 << 20
# Memory a plan leaves unplanned ([CPU, GPU]): on a GPU the CUDA context's growth, library workspaces and the caching
# allocator's rounding; on the host the Python objects, the tokenizer and the activations outside the prefill
# workspace (both chosen, not measured)
HEADROOM = (1 * GIB, 2 * GIB)
# Memory the builds from threads leave taken ([CPU, GPU]): loaded kernels and library workspaces outside the caching
# allocator, which the plan after them takes from the caches. 1.1 GiB measured on an H100 holding a whole rank (16
# threads, 107 builds), rounded up; none on the host.
BUILD_LEFTOVER = (0, 5 * GIB // 4)


# --------------------------------------------------------------------------------------------------
# graphs


class Graph:
    """fn(*inputs) as a CUDA graph, captured once (`capture`) and replayed (`__call__`): callers write the inputs
    into the graph's own input tensors. `state()` names tensors fn updates in place (cache lengths): the warm-up and
    capture runs restore them, so only replays advance the state. The warm-up also writes K/V, pending indexer rows
    and ring slots at the next position of the slots it is given, which the slots' next real step overwrites.
    Without `use_graph` (CPU, or --no-cuda-graph) fn runs eagerly. `out` holds the last outputs (a captured graph's
    static ones): a graph that runs after this one in a step reads them there (a decode step's choose graph reads
    its forward graph's logits)."""

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
            self.out = self.fn(*self.inputs)

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
            self.out = self.fn(*self.inputs)
            return self.out
        self.graph.replay()
        return self.out


def buckets(max_batch: int) -> list:
    """Decode batch sizes with a graph of their own: the powers of two below max_batch, and max_batch."""
    return [b for b in (1 << i for i in range(max_batch.bit_length())) if b < max_batch] + [max_batch]


# --------------------------------------------------------------------------------------------------
# memory plan


def size_text(n: int) -> str:
    """Bytes as a person reads them: 512 B, 14.3 MiB, 5.9 GiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def host_available() -> int:
    """Bytes of host memory this process may still take: the kernel's MemAvailable, within the memory cgroup's limit
    where one is set (a container's: v2 memory.max, v1 memory.limit_in_bytes, less what the group uses)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):  # not Linux
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit, used in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes",
                                                           "memory/memory.usage_in_bytes")):
        try:
            with open(f"/sys/fs/cgroup/{limit}") as a, open(f"/sys/fs/cgroup/{used}") as b:
                avail = min(avail, int(a.read()) - int(b.read()))
        except (OSError, ValueError):  # no such group, or no limit ("max")
            continue
    return avail


@dataclass
class MemoryPlan:
    """Memory of an engine on its device (a GPU, or the host's share of the rank on CPU), in bytes: what is loaded,
    what the plan allocates, what is left."""
    weights: int
    caches: int
    prefill: int
    graphs: int
    headroom: int
    free: int  # what the device had free after loading (the host: the rank's share of what is available)
    where: str  # the device, as the line names it
    store: prefix_cache.StoreSize = prefix_cache.StoreSize(0, 0, 0, 0)  # the prefix store's pools
    extend: tuple = ()  # the extension steps' sizes the graphs' memory holds

    def spare(self) -> int:
        """What the free memory holds beyond the plan (negative: the plan does not fit)."""
        return self.free - (self.caches + self.store.bytes + self.prefill + self.graphs + self.headroom)

    def fits(self) -> bool:
        return self.spare() >= 0

    def line(self) -> str:
        parts = [f"weights {size_text(self.weights)}", f"caches {size_text(self.caches)}",
                 f"prefix store {size_text(self.store.bytes)}" + (f" ({self.store.pages} regions, {self.store.snaps} "
                                                                  "windows)" if self.store.pages else ""),
                 f"prefill workspace {size_text(self.prefill)}", f"graphs {size_text(self.graphs)}",
                 f"headroom {size_text(self.headroom)}"]
        return f"memory plan ({self.where}): " + ", ".join(parts) + f"; free {size_text(self.free)}"


def prefill_workspace(cfg, chunk: int) -> int:
    """Activation bytes of one prefill pass of `chunk` tokens: ~64 B per token and hidden unit (an H200 measurement of
    one TP=8 rank's layer, tools.bench_prefill: 4.4 GiB at 16384 tokens, 0.8 GiB of it weights), plus the DSA
    scores' 128 MiB bound."""
    return chunk * cfg.hidden_size * 64 + (128 << 20)


# --------------------------------------------------------------------------------------------------
# parallel kernel builds


@contextlib.contextmanager
def one_build_per_variant():
    """Within: a Triton kernel variant that several threads launch before it is built is compiled by the first of
    them, and the others wait for it and take its build. Triton's JIT looks a variant up in its in-memory cache
    before compiling and stores it after, so threads that want it meanwhile compile it again each (a cold start
    from threads made 411 builds where one in order makes 124, PERF_LOG "the clean-up's decode step against the tree
    before it"). Wraps JITFunction._do_compile(self, key, signature, device, ...) where it has that form; elsewhere
    nothing changes."""
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


# --------------------------------------------------------------------------------------------------
# start-up


class Startup:
    """An engine's start-up (see the module docstring). `eng`: the Engine (its model, config, device, speculative
    depth k, spare ring slots); `code`: the engine's source files, which with kernel.py, model.py, sampling.py and this
    file name the built marker (_built_marker)."""

    def __init__(self, eng, code: tuple):
        self.e, self.code = eng, code
        self.plan, self._said = None, None  # the memory plan, and its line as last said
        self.staging = None  # the padded prefill passes' cache row (_staging)
        self.timing = {}  # seconds of the last run's phases: build_s, warmup_s, capture_s
        self.leftover = BUILD_LEFTOVER[eng.dev.type == "cuda"]  # what builds from threads leave taken (estimate)

    # ---- the memory plan
    def replan(self, agree: bool = False):
        """The memory plan and the engine's context on what the device has free now, said; refused (naming the flags)
        when it does not fit. agree (start-up, on every rank): the ranks take the least context any of them fits, so
        each refuses or keeps a request as every other does."""
        e = self.e
        self.plan, e.max_context = self._plan(e.config)
        if agree and M.world_size > 1:  # and every rank's steps the same sizes, as its peers' collectives need
            wide = max(self.plan.extend) == max(EXTEND)
            least, wide = M.tp_gather(torch.tensor([e.max_context, int(wide)], device=e.dev)).min(0).values.tolist()
            if least != e.max_context or not wide:
                self.plan, e.max_context = self._plan(replace(e.config, max_context=least), bool(wide))
        if self.plan.line() != self._said:  # said once, and again only if it changed
            self._said = self.plan.line()
            e.say(self._said)
        if not self.plan.fits():
            raise MemoryError(f"the engine does not fit: {self.plan.line()}; lower --max-context "
                              f"({e.max_context}), --max-batch ({e.config.max_batch}) or --prefix-cache-gib")

    def _plan(self, c, wide: bool = True) -> tuple[MemoryPlan, int]:
        """The memory plan and the context length for EngineConfig c: c.max_context, or what fits (a multiple of 128,
        capped at max_position_embeddings); with the widest extension step (unless not `wide`) where its graph fits in
        what the plan leaves spare, or (a fitted context) takes at most 1/WIDE_ROOM of the caches' room."""
        narrow = self._plan_for(c, EXTEND[:-1])
        if not wide:
            return narrow
        plan = self._plan_for(c, EXTEND)
        room = narrow[0].spare() + (narrow[0].caches // WIDE_ROOM if c.max_context is None else 0)
        return plan if plan[0].graphs - narrow[0].graphs <= room else narrow

    def _plan_for(self, c, extend: tuple) -> tuple[MemoryPlan, int]:
        """_plan's plan with extension steps of the sizes `extend`."""
        e = self.e
        m, cfg = e.model, e.model.cfg
        limit = cfg.max_position_embeddings
        # caches: a fixed part (sliding rings, pending rows) and bytes per position of every slot
        per_token = (self._cache_bytes(2048) - self._cache_bytes(1024)) / 1024
        fixed = self._cache_bytes(1024) - 1024 * per_token
        free = self.free_memory()
        if e.dev.type == "cuda":
            weights, where = torch.cuda.memory_allocated(e.dev), str(e.dev)
        else:
            weights = sum(t.numel() * t.element_size() for t in m.state_dict().values())
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            where = "host memory" + (f", this rank's 1/{ranks}" if ranks > 1 else "")
        prefill = prefill_workspace(cfg, c.prefill_chunk)
        graphs = (256 << 20) * len(buckets(c.max_batch)) if e.use_graph else 0
        sizes = self._prefill_sizes(c)
        if sizes:  # the padded passes' staging row and their graphs' workspace; the extensions' graphs
            graphs += self._staging_bytes(sizes[-1]) + (prefill_workspace(cfg, sizes[-1]) if e.use_graph else 0)
            graphs += EXTEND_GRAPH * len(extend) if e.use_graph else 0
            graphs += 2 * sizes[-1] * cfg.hidden_size * 4 if e.k else 0  # their residual rows kept as outputs
        headroom = HEADROOM[e.dev.type == "cuda"]
        # the prefix store: --prefix-cache-gib, by default one slot's cache, at most 1/8 of caches and store together
        # (chosen, not measured: an H100 rank holds 1-2 slots, whose context the store would otherwise halve)
        gib, B = c.prefix_cache_gib, c.max_batch
        ctx = c.max_context
        if ctx is None:
            share = 1 + min(1 / B, 1 / 7) if gib is None else 1  # the default store as a share of the caches
            rest = free - prefill - graphs - headroom - fixed * share - (int(gib * GIB) if gib else 0)
            fit = int(rest / (per_token * share)) - e.slack
            ctx = min(limit, fit // 128 * 128)
            if ctx < 16:
                raise MemoryError(f"no room for a KV cache after the weights ({size_text(weights)}, "
                                  f"{size_text(max(free, 0))} free on {where}): lower --max-batch ({c.max_batch}) or "
                                  f"--prefill-chunk ({c.prefill_chunk})")
        if not 1 <= ctx <= limit:
            raise ValueError(f"max_context {ctx} must be in [1, max_position_embeddings={limit}]")
        store = prefix_cache.StoreSize(0, 0, 0, 0)
        if gib != 0:
            budget = min(self._cache_bytes(ctx, 1), self._cache_bytes(ctx) // 7) if gib is None else int(gib * GIB)
            metas = [m.new_cache(1, 16, slack=e.slack, device="meta")]
            metas += m.new_mtp_caches(1, 16, slack=e.slack, device="meta") if e.k else []
            store = prefix_cache.size_for(m, metas, budget)
        return MemoryPlan(weights, self._cache_bytes(ctx), prefill, graphs, headroom, free, where, store, extend), ctx

    def free_memory(self) -> int:
        """Bytes the engine may still take on its device: on a GPU what the driver has free and the caching allocator
        holds unused; on CPU the rank's share of the host memory available (the node's ranks share it)."""
        e = self.e
        if e.dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(e.dev)
            return free + torch.cuda.memory_reserved(e.dev) - torch.cuda.memory_allocated(e.dev)
        return host_available() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def _prefill_sizes(self, c) -> list:
        """The padded lengths of the prefill graphs: powers of two from 32 up to the first that holds
        c.graph_prefill tokens, within the prefill chunk and the context."""
        e = self.e
        top = c.graph_prefill if c.graph_prefill is not None else GRAPH_PREFILL if e.use_graph else 0
        ctx = c.max_context or e.model.cfg.max_position_embeddings
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
        return self.e.model.new_cache(1, n, slack=n, device=device)

    def _cache_bytes(self, ctx: int, B: int | None = None) -> int:
        """Bytes of the caches for B (default max_batch) slots of ctx positions (built on the meta device: nothing
        allocated)."""
        e = self.e
        m, B = e.model, B or e.config.max_batch
        caches = [m.new_cache(B, ctx, slack=e.slack, device="meta", verify=bool(e.k))]
        if e.k:
            caches += m.new_mtp_caches(B, ctx, slack=e.slack, device="meta")
        tensors = [t for c in caches for lc in c.layers for t in vars(lc).values()] + [t for c in caches
                                                                                   for t in c.held or ()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- the run
    def run(self):
        """Every kernel variant a request can reach compiled (warm-up prefills, and per batch bucket the decode
        step), the engine's caches allocated, every graph captured; times reported. A device that runs out of memory
        meanwhile is a MemoryError naming the flags that size what start-up allocates."""
        try:
            self._run()
        except torch.OutOfMemoryError as err:
            e = self.e
            raise MemoryError(f"start-up ran out of memory on {e.dev} ({str(err).splitlines()[0][:160]}); lower "
                              f"--max-context ({e.max_context}), --max-batch ({e.config.max_batch}) or --prefill-chunk "
                              f"({e.config.prefill_chunk})") from None

    @torch.inference_mode()
    def _run(self):
        e = self.e
        sync = torch.cuda.synchronize if e.dev.type == "cuda" else (lambda: None)
        m, B, t0 = e.model, e.config.max_batch, time.perf_counter()
        threads = e.config.build_threads
        if threads is None:  # the CPU cores this process may use, shared with the node's other ranks
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            threads = min(16, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))) if e.dev.type == "cuda" else 0
        passes = m.warm_lengths(e.max_context, e.config.prefill_chunk)
        # the warm-up passes from threads, before the caches exist (their launches are the passes' own), unless a
        # start-up has built them into Triton's disk cache: then the builds only read it and the threads only contend
        # for the GIL, slower than the warm-up in order. Every rank takes one answer (the warm-up in order runs
        # collectives): from threads if any rank lacks the marker.
        # Where the memory is tight for them (builds_tight: a whole rank on an H100), the warm-up runs in order,
        # inside the plan; every rank takes that answer too.
        marker = self._built_marker(passes) if threads > 1 and passes else None
        want = marker is not None and not os.path.exists(marker)
        why = self.builds_tight(passes) if marker is not None else None
        tight = why is not None
        if M.world_size > 1:
            want, tight = map(bool, M.tp_gather(torch.tensor([int(want), int(tight)], device=e.dev)).max(0).values)
        if want and tight:
            e.say(f"start-up: {why or 'another rank is short of memory for builds from threads'}: kernels build in "
                  "order")
        ahead = want and not tight
        if ahead:
            self.build_ahead(passes, threads)
        self.replan(agree=True)  # on what the builds left free (loaded kernels and library workspaces stay taken)
        sizes = self._prefill_sizes(replace(e.config, max_context=e.max_context))
        # the agreed context's passes; a prefill graph's capture runs its own pass (the same launches) first, so of
        # a pass of a graph's length only the MTP layers' absorb of its rows is left to warm up
        in_order = [] if ahead else [(p0, n, not (p0 == 0 and n in sizes))
                                     for p0, n in m.warm_lengths(e.max_context, e.config.prefill_chunk)]
        in_order = [(p0, n, main) for p0, n, main in in_order if main or e.k]
        tb = time.perf_counter()
        e.cache = m.new_cache(B, e.max_context, slack=e.slack, verify=bool(e.k))
        e.mtps = m.new_mtp_caches(B, e.max_context, slack=e.slack) if e.k else []
        e.store = prefix_cache.PrefixStore(e, self.plan.store) if self.plan.store.pages else None
        self.staging = self._staging(sizes[-1]) if sizes else None  # before any capture: it may extend RoPE's tables
        with torch.inference_mode():
            for p0, n, main in in_order:
                self.warm_pass(p0, n, main=main)
            sync()
            t1 = time.perf_counter()
            pool = torch.cuda.graph_pool_handle() if e.use_graph else None
            for b in buckets(B):
                e.graphs[b] = e.spec.graphs(b, pool) if e.spec else self._plain_graph(b, pool)
            e.extend_graphs = {q: self._extend_graph(q, pool) for q in self._extend_sizes(sizes)}
            if ahead:
                self.warm_graphs_ahead(self.graph_threads(threads))
            for gs in e.graphs.values():
                for g in gs:
                    g.capture()
            self._capture_prefill_graphs(sizes)
            sync()
        t2 = time.perf_counter()
        e.cache.lengths.zero_()  # the warm-ups wrote garbage at the first positions of slots: nothing is held
        for c in e.mtps:
            c.lengths.zero_()
        self.timing = {"build_s": tb - t0, "warmup_s": t1 - tb, "capture_s": t2 - t1}
        if marker is not None and not os.path.exists(marker):
            try:  # best effort: a read-only cache (copied from another node) only means the next start builds again
                os.makedirs(os.path.dirname(marker), exist_ok=True)
                with open(f"{marker}.{os.getpid()}.tmp", "w") as f:
                    f.write("a start-up built every kernel of its warm-up passes into this cache\n")
                os.replace(f"{marker}.{os.getpid()}.tmp", marker)
            except OSError as err:
                e.say(f"start-up: could not mark Triton's cache as built ({err}); the next start-up builds from "
                      "threads again")
        e.say("start-up: " + (f"kernels built ahead from {threads} threads in {tb - t0:.1f} s, " if ahead
                               else f"warm-up {t1 - tb:.1f} s, ")
              + (f"{sum(map(len, (*e.graphs.values(), e.prefill_graphs, e.extend_graphs)))} CUDA graphs "
                 f"captured in {t2 - t1:.1f} s" if e.use_graph else "decode steps run eagerly")
              + f" (batch buckets {list(e.graphs)}"
              + (f"; prefills padded to {list(e.prefill_graphs)}, turns in steps of {list(e.extend_graphs)}"
                 if e.prefill_graphs else "") + ")")

    def warm_pass(self, p0: int, n: int, cache=None, mtps=None, main: bool = True):
        """A prefill pass of n tokens at position p0 of slot 0 of the engine's caches (or of `cache` and `mtps`),
        whatever it holds, and of every MTP layer (without `main`: theirs alone, on zero residuals): its launches
        compile whatever they need; the slot is forgotten after start-up."""
        e = self.e
        cache, mtps = (e.cache, e.mtps) if cache is None else (cache, mtps)
        ids = torch.zeros(n, dtype=torch.long, device=e.dev)
        cache.lengths[0] = p0
        if not e.k:
            e.model.forward(ids, cache, [n], rows=[0])
            return
        h = (e.model.forward_rows(ids, cache, [n], rows=[0]) if main
             else torch.zeros(n, e.model.cfg.hidden_size, device=e.dev))
        for j, c in enumerate(mtps):
            c.lengths[0] = p0
            h = e.model.mtp(j, h, ids, c, [n], rows=[0])

    # ---- the graphs
    def _plain_graph(self, b: int, pool) -> list:
        """A plain decode step of batch bucket b: the forward graph (-> this rank's logits [b, V/tp] and greedy's
        tokens [b], -1 for non-finite logits, fed as the slots' next tokens) and the choose graphs that may follow it,
        one per choice.Pick in its order (engine.Engine._decode; choice.choose on the forward's logits and the grammar
        masks -> tokens, fed instead, and the whole one's logprobs; the slots' random counters and choice state
        advance for the live rows)."""
        e = self.e
        rows = torch.arange(b, device=e.dev)
        live = torch.ones(b, dtype=torch.long, device=e.dev)
        cache, m = e.cache, e.model

        def step(rows, live):
            logits = m.forward(e.next_tok[rows], cache, rows=rows, live=live)
            tok = sampling.greedy(logits)
            e.next_tok[rows] = tok.clamp(min=0)
            return logits, tok
        fwd = Graph(step, [rows, live], e.use_graph, state=lambda: (cache.lengths,), pool=pool)

        def choose(rows, live, pick):
            tok, *lps = choice.choose(fwd.out[0], e.choice, rows, e.mask[:b], e.count[rows], live, pick)
            e.next_tok[rows] = tok.clamp(min=0)
            e.count[rows] += live
            return (tok, *lps)
        return [fwd] + [Graph(functools.partial(choose, pick=pick), [rows, live], e.use_graph,
                              state=lambda: self._choice_state(), pool=pool) for pick in choice.Pick]

    def _choice_state(self) -> tuple:
        """What a choose step updates in place: the slots' random counters and choice state (choice.Slots)."""
        st = self.e.choice
        return self.e.count, st.counts, st.thinking, st.think_left

    def _extend_sizes(self, sizes: list) -> list:
        """The extension graphs' token counts (with the prefill graphs): at most what the sliding rings' spare slots
        let one decode step write before its queries read (a ring of R slots and window W takes W + Q - 1 <= R)."""
        e = self.e
        if not sizes:
            return []
        W = e.model.cfg.sliding_window
        spare = min((lc.k.shape[2] - W + 1 for lc in e.cache.layers if getattr(lc, "summ", None) is None),
                    default=max(self.plan.extend))
        return [q for q in self.plan.extend if q <= min(spare, e.max_context)]

    def _extend_graph(self, q: int, pool) -> Graph:
        """A next turn's prefill of up to q tokens on top of what its slot holds, as one decode step of q tokens for
        that row (the positions, the slot and the real count are device inputs: any turn of up to q tokens replays
        it). Inputs: the ids [1, q] (padded with token 0), the real tokens [1], the slot [1]; -> this rank's logits
        [1, V/tp] of the last real token (with speculative decoding, and the residual rows [q, D] for the MTP
        layers). The padding's writes past the real tokens are rewritten by later steps before anything reads them, but
        for the pending DSA rows it overwrites past a region boundary, which the layers put back (Placement.real); the
        slot's length advances by the real count."""
        e = self.e
        m, cache = e.model, e.cache
        ids = torch.zeros(1, q, dtype=torch.long, device=e.dev)
        real = torch.full((1,), q, dtype=torch.long, device=e.dev)
        slot = torch.zeros(1, dtype=torch.long, device=e.dev)

        def extend(ids, real, slot):
            res = m.forward_rows(ids, cache, rows=slot, real=real)  # [q, D]; the slot's length advances by real
            lg = m.logits(res.index_select(0, real - 1))
            return (lg, res) if e.spec else lg
        return Graph(extend, [ids, real, slot], e.use_graph, state=lambda: (cache.lengths,), pool=pool)

    def _prefill_graph(self, n: int, pool) -> Graph:
        """A fresh prompt's prefill padded to n tokens in the staging row, then adopted by its slot. Inputs: the ids
        [n] (padded with token 0), the real tokens [1], the slot [1]; -> this rank's logits [1, V/tp] of the last real
        token (with speculative decoding, and the residual rows [n, D] for the MTP layers). Padding follows the real
        tokens, so no real token attends to it (causal) or shares a decision with it (routing and region selection are
        per token); the real rows are an n-token pass's but for the GEMMs' row counts (their accumulation order may
        differ in last bits, as between prefill chunkings)."""
        e = self.e
        m, st = e.model, self.staging
        ids = torch.zeros(n, dtype=torch.long, device=e.dev)
        real = torch.full((1,), n, dtype=torch.long, device=e.dev)
        slot = torch.zeros(1, dtype=torch.long, device=e.dev)

        def prefill(ids, real, slot):
            st.requests.copy_(e.cache.requests.index_select(0, slot))  # the request, for installed Pins
            res = m.forward_rows(ids, st, [n], rows=[0], held=[0], real=real)  # [n, D]
            self._adopt(slot, real, n)
            lg = m.logits(res.index_select(0, real - 1))
            return (lg, res) if e.spec else lg
        return Graph(prefill, [ids, real, slot], e.use_graph, state=lambda: (e.cache.lengths,), pool=pool)

    def _adopt(self, slot, real, n: int):
        """The staging row after a padded pass of n tokens into cache row slot [1], by index tensors (no host read):
        DSA K/V of the n positions, the summaries of the regions they complete and the pending rows; ring slot j of a
        sliding layer <- the last real position in slot j (mod R), which the staging ring holds at slot = position
        (padding's writes past `real` are overwritten by later steps before they are read, as a decode step's)."""
        e = self.e
        src = {}
        for lc, sc in zip(e.cache.layers, self.staging.layers):
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
        e.cache.lengths.index_copy_(0, slot, real)

    def _capture_prefill_graphs(self, sizes: list):
        """The extension graphs, and a prefill graph per padded length. One that cannot be captured (a host read on
        the prefill path) leaves prompts to the eager prefill, said once."""
        e = self.e
        pool = torch.cuda.graph_pool_handle() if e.use_graph else None
        try:
            for g in e.extend_graphs.values():
                g.capture()
            for n in sizes:
                e.prefill_graphs[n] = g = self._prefill_graph(n, pool)
                g.capture()
        except RuntimeError as err:
            if not e.use_graph:
                raise
            e.prefill_graphs, e.extend_graphs = {}, {}
            e.say(f"start-up: a prefill graph could not be captured ({str(err).splitlines()[0]}); prompts prefill "
                  "eagerly")

    # ---- kernel builds from threads
    def _pass_bytes(self, p0: int, n: int) -> int:
        """Memory a warm-up pass of n tokens at position p0 takes from a thread: its cache (one slot, as long as the
        pass needs), its prefill workspace and the thread's own (PER_THREAD)."""
        return self._cache_bytes(p0 + n, 1) + prefill_workspace(self.e.model.cfg, n) + PER_THREAD

    def builds_tight(self, passes: list) -> str | None:
        """Why builds from threads do not fit the memory (None where they do): the memory left now (before the caches
        exist; the plan's headroom kept) must hold two of the largest warm-up passes side by side, or threads would
        mostly wait for each other and the estimates' error would land in the headroom; and the plan must have room
        for what the builds leave taken (self.leftover): its spare memory, or half of its caches where the context is
        fitted to the memory (the plan after the builds takes it from them)."""
        p, largest = self.plan, max(self._pass_bytes(p0, n) for p0, n in passes)
        if self.free_memory() - p.headroom < 2 * largest:
            return (f"{size_text(self.free_memory() - p.headroom)} left beside the weights does not hold two of the "
                    f"largest warm-up passes ({size_text(largest)} each) side by side")
        room = p.spare() + (p.caches // 2 if self.e.config.max_context is None else 0)
        if room < self.leftover:
            return (f"the plan has {size_text(max(room, 0))} for the {size_text(self.leftover)} that builds from "
                    "threads leave taken (loaded kernels, library workspaces)")
        return None

    def build_ahead(self, passes: list, threads: int):
        """The warm-up prefill passes from a pool of threads, before the caches exist: each pass in a cache of its own
        (one slot, as long as the pass needs: its launches are those of the engine's cache, whose strides take the
        same integer classes; tests/test_startup.py compares the two), on a stream of its own, with this rank's
        collectives left out (model.alone: threads take turns in another order on every rank). Triton's compilation
        leaves the GIL for most of its time, so the passes' kernels compile side by side. Passes wait for memory:
        those running together take at most what the device has free now, the plan's headroom kept (_pass_bytes
        each; run checked that the largest fits twice). The results are discarded."""
        e = self.e
        e.model._capacity(e.max_context + e.slack)  # RoPE tables for every pass, built before any thread reads them
        room, ready = [self.free_memory() - self.plan.headroom], threading.Condition()

        def one(p0: int, n: int):
            need = self._pass_bytes(p0, n)
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

    def graph_threads(self, threads: int) -> int:
        """How many of `threads` the decode steps' builds may use in the memory left beside the caches (the plan's
        headroom kept): each thread takes the workspace of the largest step (a batch bucket's rows, or an extension
        step's) and its own (PER_THREAD)."""
        e = self.e
        rows = max([b * (e.k + 1) for b in e.graphs] + list(e.extend_graphs))
        need = prefill_workspace(e.model.cfg, rows) + PER_THREAD
        return max(1, min(threads, (self.free_memory() - self.plan.headroom) // need))

    def warm_graphs_ahead(self, threads: int):
        """Each batch bucket's decode step(s) and each extension step once, eagerly, from a pool of threads (one a
        thread), so their kernels compile side by side and the captures after only capture. The steps write at the
        first slots' next positions, as a capture's warm-up does; the threads' steps overlap on the same slots, so what
        they write is garbage the slots' first real steps overwrite (start-up forgets the slots)."""
        e = self.e
        if e.dev.type == "cuda":
            torch.cuda.synchronize(e.dev)  # the caches' zeroing done before the threads' streams read them

        def one(graphs: list):
            with self._alone():
                for g in graphs:
                    g.warm()
        self._from_threads(threads, one, [(gs,) for gs in e.graphs.values()]
                           + [([g],) for g in e.extend_graphs.values()])

    def _from_threads(self, threads: int, fn, calls: list):
        """fn(*args) for each args of calls from a pool of threads (a kernel variant wanted by several at once is
        compiled once: one_build_per_variant), then the threads' leftovers given back: their cuBLAS workspaces (one
        per thread's stream) and the blocks cached for their streams."""
        e = self.e
        with one_build_per_variant(), ThreadPoolExecutor(min(threads, len(calls)), thread_name_prefix="build") as pool:
            for f in [pool.submit(fn, *args) for args in calls]:
                f.result()
        if e.dev.type == "cuda":
            torch.cuda.synchronize(e.dev)
            torch._C._cuda_clearCublasWorkspaces()
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def _alone(self):
        """This thread's launches on a stream of its own, with this rank's collectives left out (model.alone):
        start-up's parallel builds, whose threads take turns in another order on every rank. Waits for the stream at
        the end."""
        e = self.e
        cuda = e.dev.type == "cuda"
        if cuda:
            torch.cuda.set_device(e.dev)
        stream = torch.cuda.Stream(e.dev) if cuda else None
        with torch.inference_mode(), M.alone(), torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            yield
            if cuda:
                stream.synchronize()

    def _warm_alone(self, p0: int, n: int):
        """A warm-up pass in a cache of its own (one slot, as long as the pass needs), in this thread's own stream
        without collectives (_alone); its results are discarded."""
        e = self.e
        with self._alone():
            cache = e.model.new_cache(1, p0 + n, slack=e.slack)
            mtps = e.model.new_mtp_caches(1, p0 + n, slack=e.slack) if e.k else []
            self.warm_pass(p0, n, cache, mtps)

    def _built_marker(self, passes: list) -> str:
        """A file in Triton's cache directory that says a start-up of this rank built every kernel of these warm-up
        passes: named by a hash of the code that makes the launches (kernel.py and kernels/, model.py, the engine's
        files), the passes, the model's config and TP size, Triton's version and the device."""
        e = self.e
        h = hashlib.sha256()
        for f in (*kernel.SOURCE_FILES, M.__file__, *self.code, sampling.__file__, __file__):
            with open(f, "rb") as src:
                h.update(src.read())
        dev = torch.cuda.get_device_name(e.dev) if e.dev.type == "cuda" else "cpu"
        h.update(repr((passes, e.model.cfg, M.world_size, triton.__version__, dev)).encode())
        return os.path.join(triton.knobs.cache.dir, f"step5-built-{h.hexdigest()[:24]}")
