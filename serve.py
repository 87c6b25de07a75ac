"""An OpenAI-compatible HTTP server on the engine, under torchrun.

    torchrun --standalone --nproc-per-node=N serve.py --tp-dir OUT/tpN [--host 127.0.0.1] [--port 8000] [--api-key K]
    curl -s 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "step5", "messages": [{"role": "user", "content": "Hello"}], "stream": true}'

Endpoints: POST /v1/chat/completions (string content, or text and image_url parts whose URL is a base64 data: URL of
a PNG or JPEG image), POST /v1/completions (prompt: a string, a list of strings, a list of token ids or a list of
lists of them: a choice per prompt), GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (Prometheus);
HEAD wherever GET is. SSE streaming, usage with the prompt tokens reused from the cache, finish reasons stop / length /
abort (the server stopped mid-request). Sampling: n, logprobs (chat: top_logprobs; completions: echo), penalties,
min_p, logit_bias, constraints (response_format json_object / json_schema, vLLM's structured_outputs and guided_*),
thinking_token_budget (serve_requests.params_of lists them). Extensions: top_k, ignore_eos, return_token_ids (the
completion's ids in each choice).

The files: serve.py (this: rank 0's Hub between the HTTP side and the engine, the engine loop of every rank, signals,
the flags), serve_http.py (connections and their limits, bodies, preparation lanes, the routes), serve_requests.py
(a body -> checked Jobs, in the API's error shape), serve_answers.py (engine events -> the API's objects),
serve_metrics.py (/metrics).

Ranks and threads: every rank runs the engine loop in its main thread; rank 0 also runs uvicorn in a daemon thread
with its own event loop. Each loop iteration rank 0 drains its inbox (new requests, cancellations) and broadcasts
that decision over a gloo group; every rank applies it in the same order (image features on every rank: they hold a
collective) and steps the engine; rank 0 hands each step's tokens to the requests' asyncio queues. Detokenization,
stop strings and the <think> split run on rank 0's event loop, never in the engine loop. SIGTERM (or SIGINT) closes
rank 0's HTTP side at once from a thread of its own (503 shutting_down, the requests in flight end with abort); the
engine loop stops every rank after the step it is in.
"""
import argparse
import asyncio
import collections
import itertools
import math
import os
import queue
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import chat
import image_processing
import runtime as R
import serve_http as H
import serve_requests as Q
from serve_metrics import Metrics
from serve_requests import ApiError

# A step prefills at most this many prompt tokens, so running streams keep their pace while a long prompt comes in.
# A chunk's host enqueue (~0.2 s for 92 layers on an H200 host) bounds a step whatever its size: 4096 tokens take
# about that on the device, so a step stalls the streams no longer than 2048 did and prefills twice as much
# (16 streams of 1k-token prompts: 1043 against 914 tok/s, PERF_LOG "... the DSA prefill's dense regime, the server
# measured"); the CLI takes 16k.
PREFILL_CHUNK = 4096
MAX_BATCH = 16  # slots (the README's decode figures: batch 16 costs 2x batch 1 per step, for 16x the tokens)
MAX_QUEUE = 64  # requests waiting for a slot beyond --max-batch; more are answered 503 with Retry-After
DEFAULT_MAX_TOKENS = 8192  # a request without max_tokens gets the context left, capped here
IDLE_WAIT_S = 0.03  # an idle rank 0 waits this long on its inbox before broadcasting an empty decision
CTL_TIMEOUT_S = 120  # a control broadcast (one per engine step) that takes longer means a rank is stuck
SIGTERM_GRACE_S = 10  # a rank > 0 that got SIGTERM waits this long for rank 0's stop decision
RATE_OF = 32  # Retry-After: the queue drains at the rate of the last this many finished requests
RETRY_MAX_S = 60  # ... and the estimate is capped here


# --------------------------------------------------------------------------------------------------
# rank 0's inbox and the requests' queues


@dataclass
class Event:
    """The engine loop to one request: its new ids, then (once) how it ended, or an error."""
    ids: list
    finish: str | None = None  # the engine's: "stop", "length", "cancelled"; or "abort" (the server stopped)
    cached: int = 0  # prompt tokens reused from the cache
    error: str | None = None
    status: int = 500
    logprobs: list | None = None  # an engine.Logprob per id (a request with logprobs)
    prompt_logprobs: list | None = None  # the prompt's (echo with logprobs), with the request's first event


@dataclass(eq=False)
class Live:
    """A request in flight: its choice's index and the queue its answer reads (index, Event) from, shared by the
    choices of one answer; the times its metrics are measured from."""
    rid: int
    index: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    t0: float  # perf_counter of the HTTP request's arrival
    ended: bool = False  # its answer is complete (the engine may still hold it: a stop string's cancel)
    t_last: float | None = None  # perf_counter of the step that gave its last tokens
    told: bool = False  # it has had an event (the first carries the prompt's logprobs)


class Hub:
    """Rank 0: requests in flight, the inbox the engine loop drains, the way back to each request's queue, and what
    both sides count (the metrics, the prepared images held, /health's numbers)."""

    def __init__(self, capacity: int, metrics: Metrics):
        self.capacity, self.metrics = capacity, metrics  # capacity: --max-batch + --max-queue
        self.inbox = queue.Queue()
        self.live = {}  # rid -> Live: submitted, not yet finished by the engine
        self.lock = threading.Lock()
        self.rids = itertools.count()
        self.closing = False
        self.running = self.waiting = 0  # the engine's, after its last step (0 once closing: none is served)
        self.images = H.Budget(Q.MAX_PREPARED)  # prepared pixels of requests the engine has not taken yet
        self.held = {}  # rid -> its image bytes held in `images`
        self.finishes = collections.deque(maxlen=RATE_OF)  # perf_counter of recent finishes
        self.on_close = []  # callables: the HTTP side's wake-ups

    def check_open(self, n: int):
        """503 unless the server is serving and has room for n more requests."""
        if self.closing:
            raise ApiError(503, "the server is shutting down", None, "shutting_down")
        if len(self.live) + n > self.capacity:
            raise ApiError(503, f"the server is at capacity ({len(self.live)} requests in flight); retry later",
                           None, "overloaded", {"Retry-After": str(self.retry_after())})

    def retry_after(self) -> int:
        """Seconds until the queue is expected to have room: the requests waiting for a slot, plus this one, at the
        rate the last RATE_OF requests finished; 1 before two have finished; at most RETRY_MAX_S."""
        f = self.finishes
        if len(f) < 2 or f[-1] <= f[0]:
            return 1
        rate = (len(f) - 1) / (f[-1] - f[0])
        return max(1, min(RETRY_MAX_S, math.ceil((len(self.live) - self.running + 1) / rate)))

    def submit(self, jobs: list, t0: float) -> list:
        """Jobs (one request's choices) into the inbox -> their Lives, sharing one queue."""
        loop, q = asyncio.get_running_loop(), asyncio.Queue()
        with self.lock:
            self.check_open(len(jobs))
            lives = [Live(next(self.rids), j.index, loop, q, t0) for j in jobs]
            for lv, j in zip(lives, jobs):
                self.live[lv.rid] = lv
                if j.images is not None:
                    self.held[lv.rid] = j.image_bytes
        for lv, j in zip(lives, jobs):
            self.metrics.prompt_tokens.inc(len(j.ids))
            self.inbox.put(new_of(lv.rid, j))
        return lives

    def cancel(self, lv: Live):
        self.inbox.put(lv.rid)

    def decide(self, wait: bool) -> R.Decision:
        """The engine loop: everything in the inbox (waiting up to IDLE_WAIT_S for something when told to)."""
        d = R.Decision()
        try:
            item = self.inbox.get(timeout=IDLE_WAIT_S) if wait else self.inbox.get_nowait()
            while True:
                (d.new if isinstance(item, R.New) else d.cancel).append(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return d

    def taken(self, new: list):
        """The engine loop has applied these requests: their image inputs are features now, and their bytes free."""
        for n in new:
            n.images = None
            with self.lock:
                held = self.held.pop(n.rid, 0)
            self.images.give(held)

    def post(self, rid: int, ev: Event):
        """The engine loop: an event to a request's queue (on its event loop's thread)."""
        with self.lock:
            lv = self.live.pop(rid) if ev.finish is not None or ev.error is not None else self.live.get(rid)
        if lv is not None:
            try:
                lv.loop.call_soon_threadsafe(lv.queue.put_nowait, (lv.index, ev))
            except RuntimeError:  # the event loop is closed: the HTTP side has stopped
                pass

    def stepped(self, updates: list, dt: float, running: int, waiting: int):
        """The engine loop after a step that took dt seconds: the metrics (from this one timestamp, taken after the
        step read its tokens), then each request's news."""
        t, m = time.perf_counter(), self.metrics
        m.step.observe(dt)
        with self.lock:
            if not self.closing:
                self.running, self.waiting = running, waiting
            m.running.set(self.running)
            m.waiting.set(self.waiting)
        for u in updates:
            lv = self.live.get(u.rid)
            if lv is not None and u.ids:
                if lv.t_last is None:
                    m.ttft.observe(t - lv.t0)
                    m.cached_tokens.inc(u.req.cached)
                else:
                    for _ in u.ids:
                        m.itl.observe((t - lv.t_last) / len(u.ids))
                lv.t_last = t
            m.generation_tokens.inc(len(u.ids))
            if u.done:
                m.finished.labels(str(u.req.finish)).inc()
                self.finishes.append(t)
                if lv is not None:
                    m.e2e.observe(t - lv.t0)
            self.post(u.rid, event_of(u, lv))

    def close(self, ev: Event):
        """Stop accepting and end every request in flight with `ev` (a shutdown's abort, or an error); wake the
        HTTP side (uploads and image preparation waiting end with 503 shutting_down)."""
        with self.lock:
            self.closing = True
            self.running = self.waiting = 0
            rids = list(self.live)
        for rid in rids:
            self.post(rid, ev)
        self.images.close()
        for wake in self.on_close:
            wake()


def new_of(rid: int, j: Q.Job) -> R.New:
    """A Job as every rank submits it (an echo without logprobs is the front end's text alone)."""
    return R.New(rid, j.ids, j.images, j.max_tokens, j.sampling, j.stop_ids, False, j.logprobs,
                 j.echo and j.logprobs is not None, j.constraint, j.think, j.cache_salt, j.share)


def event_of(u: R.Update, lv: Live | None) -> Event:
    """An engine update -> the request's Event: its ids and their logprobs, the prompt's logprobs on its first, and
    how it ended (a grammar's dead end as an error naming the field)."""
    r = u.req
    lps = r.token_logprobs[len(r.out) - len(u.ids):len(r.out)] if r.logprobs is not None else None
    first = lv is not None and not lv.told
    if lv is not None:
        lv.told = True
    ev = Event(u.ids, r.finish if u.done else None, r.cached, logprobs=lps,
               prompt_logprobs=r.prompt_logprobs if first and r.echo else None)
    if u.done and r.finish == "error" and r.error:
        ev.error, ev.status = r.error, 500
    return ev


# --------------------------------------------------------------------------------------------------
# the engine loop (every rank) and the signals


def engine_loop(drv: R.Driver, hub: Hub | None, signalled: list):
    """Until rank 0 decides to stop: its decision, broadcast; news submitted (image features computed on every
    rank), cancellations applied; an engine step; rank 0 posts each request's tokens and its end. signalled[0]:
    when this rank got SIGTERM / SIGINT (rank 0 stops then; a rank > 0 waits SIGTERM_GRACE_S for rank 0's stop)."""
    s, eng = drv.s, drv.s.eng
    while True:
        d = None
        if s.rank == 0:
            d = R.Decision(stop=True) if signalled[0] else hub.decide(wait=not eng.busy())
        d = drv.agree(d)
        if d.stop:
            return
        if s.rank > 0 and signalled[0] and time.monotonic() - signalled[0] > SIGTERM_GRACE_S:
            raise RuntimeError(f"got SIGTERM, but rank 0 did not stop the server within {SIGTERM_GRACE_S} s")
        refused = drv.apply(d)
        if hub is not None:
            hub.taken(d.new)
            for rid, why in refused:
                hub.post(rid, Event([], error=why, status=400))
        if not eng.busy():
            continue
        t0 = time.perf_counter()
        updates = drv.step()
        if hub is not None:
            hub.stepped(updates, time.perf_counter() - t0, len(eng.running), len(eng.waiting))
            if eng.store is not None:
                hub.metrics.prefix_store(eng.store.stats, eng.store.used_bytes())


def on_signals(hub: Hub | None) -> list:
    """SIGTERM / SIGINT -> signalled[0] = when (the engine loop reads it after its step). On rank 0 the signal also
    wakes a thread of its own at once (Python's wakeup fd, written by the C-level handler even while the main thread
    is inside a long step), which closes the HTTP side: new requests get 503 shutting_down, /health says so, the
    requests in flight end with abort. -> signalled."""
    signalled = [0.0]

    def on_signal(*_):  # torchrun forwards SIGTERM (and Ctrl-C's SIGINT) to every rank
        signalled[0] = signalled[0] or time.monotonic()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if hub is not None:
        wake, woken = socket.socketpair()
        woken.setblocking(False)
        signal.set_wakeup_fd(woken.fileno(), warn_on_full_buffer=False)

        def watch(keep=woken):  # keep: the write end lives as long as this thread (closed, it would read EOF)
            while wake.recv(1)[0] not in (signal.SIGTERM, signal.SIGINT):  # every signal Python handles is there
                pass
            hub.close(Event([], finish="abort"))
        threading.Thread(target=watch, daemon=True, name="signals").start()
    return signalled


# --------------------------------------------------------------------------------------------------
# the CLI


@dataclass
class Options:
    """serve.py's own flags (the engine's are runtime.EngineFlags)."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = MAX_QUEUE
    served_model_name: str = "step5"
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_connections: int | None = None  # None: H.default_max_connections of the file limit
    allowed_origins: list = field(default_factory=list)
    metrics_without_key: bool = False


def origins(text: str) -> list:
    """--allowed-origins' value: comma-separated origins (scheme://host[:port]) or *."""
    out = [o.strip() for o in text.split(",") if o.strip()]
    for o in out:
        scheme, sep, rest = o.partition("://")
        if o != "*" and not (sep and scheme in ("http", "https") and rest and "/" not in rest):
            raise argparse.ArgumentTypeError(f"{o!r} is not an origin (scheme://host[:port], or *)")
    return out


def parser() -> R.Parser:
    ap = R.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    ap.add_argument("--port", type=int, default=8000, help="port (0: any free one, printed at start-up)")
    ap.add_argument("--api-key", default=os.environ.get("STEP5_API_KEY"), metavar="KEY",
                    help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: the "
                    "STEP5_API_KEY environment variable, which ps does not show)")
    ap.add_argument("--served-model-name", default="step5", metavar="NAME", help="the model's id in the API")
    ap.add_argument("--max-queue", type=int, default=MAX_QUEUE, metavar="Q", help="requests waiting for a slot; "
                    f"more are answered 503 with Retry-After (default {MAX_QUEUE})")
    ap.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                    help=f"max_tokens of a request that sets none: the context left, at most N (default "
                    f"{DEFAULT_MAX_TOKENS})")
    ap.add_argument("--max-connections", type=int, metavar="C", help="open HTTP connections at most; past it a new "
                    "connection closes the one idle the longest, or is refused (default: half the process's file "
                    "limit, ulimit -n, at most 1024)")
    ap.add_argument("--allowed-origins", type=origins, default=[], metavar="ORIGINS",
                    help="CORS: comma-separated origins (https://app.example.com, or *) whose browser pages may call "
                    "the API (default: none, CORS off)")
    ap.add_argument("--metrics-without-key", action="store_true",
                    help="serve /metrics without the API key (for a Prometheus scraper; default: /metrics needs it)")
    R.add_engine_flags(ap, prefill_chunk=PREFILL_CHUNK, max_batch=MAX_BATCH)
    return ap


def parse(argv: list) -> dict:
    kw = vars(parser().parse_args(argv))
    o, flags = split(kw)
    if not 0 <= o.port <= 65535:
        raise R.UserError(f"--port {o.port} must be in [0, 65535]")
    if o.max_queue < 0 or o.default_max_tokens < 1:
        raise R.UserError(f"--max-queue {o.max_queue} must be >= 0 and --default-max-tokens "
                          f"{o.default_max_tokens} >= 1")
    if o.api_key is not None and (not o.api_key or any(c.isspace() for c in o.api_key)):
        raise R.UserError("--api-key must be a non-empty string without spaces")
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if o.max_connections is not None and not 1 <= o.max_connections <= files - H.FD_RESERVE:
        raise R.UserError(f"--max-connections {o.max_connections} must be in [1, {files - H.FD_RESERVE}]: this "
                          f"process may open {files} files (ulimit -n), {H.FD_RESERVE} of them kept for the rest")
    flags.check()
    R.check_launched()
    return kw


def split(kw: dict) -> tuple[Options, R.EngineFlags]:
    """The flags by dest name -> (serve's options, the engine's)."""
    flags, mine = R.EngineFlags.split(kw)
    return Options(**mine), flags


def main(**kw):
    t_start = time.perf_counter()
    o, flags = split(kw)
    with R.process(flags.device) as (rank, world, dev):
        s = R.setup(flags, rank, world, dev, needs_tokenizer=True)

        def listen():  # before the long load: a port in use is reported at once
            try:
                return socket.create_server((o.host, o.port))
            except OSError as e:
                why = (e.strerror or str(e)).split(" (while")[0]  # create_server appends the address again
                raise R.UserError(f"--host {o.host} --port {o.port}: cannot listen there ({why})") from None
        sock = R.phase(listen) if rank == 0 else R.agree(None)
        t_load = R.load(s, "(serving)")
        t0 = time.perf_counter()
        R.start_engine(s, flags.max_batch, flags.max_context, constrained=True)
        times = {"load": t_load, "engine": time.perf_counter() - t0}
        drv = R.Driver(s, CTL_TIMEOUT_S)
        hub = http = thread = None
        if rank == 0:
            times["total"] = time.perf_counter() - t_start
            hub, http, thread = start_http(s, o, sock, times)
        signalled = on_signals(hub)
        try:
            with torch.inference_mode():
                engine_loop(drv, hub, signalled)
        except Exception as e:  # a rank died or hangs (the collectives fail or time out), or the engine stopped
            what, lost = R.failure(e)
            if not lost:  # a bug or bad weights: worth its traceback
                traceback.print_exc()
            msg = f"rank {rank}: the engine loop stopped: {what}"
            if hub is not None:  # the client hears what happened, not the ranks' addresses: those are in this log
                why = "lost another rank" if lost else "an internal error"
                hub.close(Event([], error=f"the server stopped ({why}); its log says more", status=500))
                http.should_exit = True
                thread.join(H.SHUTDOWN_S)
            print(f"error: {msg}; every rank stops (see the other ranks' output)", file=sys.stderr, flush=True)
            os._exit(R.EXIT_FAILED)
        if hub is not None:
            hub.close(Event([], finish="abort"))
            http.should_exit = True
            thread.join(H.SHUTDOWN_S)  # a daemon thread: what is left of uvicorn's drain ends with the process
            s.say("stopped: every rank exits")
        if drv.group is not None:
            dist.barrier(group=drv.group)


def start_http(s: R.Session, o: Options, sock, times: dict | None = None):
    """Rank 0: the HTTP side (serve_http.start) around a new Hub. times: start-up seconds by phase (for /metrics).
    -> (the hub, the uvicorn Server, its thread)."""
    eng, f = s.eng, s.flags
    k = f.speculative
    vis = s.vl.vision if s.vl is not None else None
    if vis is not None:
        try:
            image_processing.image_token_ids(s.tok)
            if s.tok.convert_tokens_to_ids(image_processing.IMAGE_TOKENS[0]) != s.vl.image_token_id:
                raise ValueError("the tokenizer's <im_patch> id differs from the config's image_token_id")
        except ValueError as e:
            s.say(f"warning: {e}: image parts are refused")
            vis = None
    lim = Q.Limits(eng.max_context - (k + 1 if k else 0), s.cfg.vocab_size, o.default_max_tokens,
                   s.vl.image_token_id if s.vl is not None else None, vis, f.max_batch + o.max_queue, eng.grammars)
    metrics = Metrics()
    metrics.slots.set(f.max_batch)
    for phase, dt in (times or {}).items():
        metrics.startup.labels(phase).set(dt)
    hub = Hub(f.max_batch + o.max_queue, metrics)
    btok = chat.BoundedTokenizer(s.tok)
    if btok.whole:
        s.say(f"warning: the tokenizer's text is tokenized whole, not in bounded pieces: {btok.whole}")
    cap = o.max_connections or H.default_max_connections(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    srv = H.Served(hub, btok, lim, s.eos, chat.think_ids(s.tok), o.served_model_name, o.api_key, metrics,
                   H.RateLog(s.say), cap, o.allowed_origins, o.metrics_without_key)
    reads = chat.template_variables(s.tok)
    if reads is not None:
        fields = [f for f in chat.TEMPLATE_FIELDS if f in reads]
        s.say(f"the chat template reads {', '.join(fields) or 'none of ' + ', '.join(chat.TEMPLATE_FIELDS)}"
              + "".join(f"; not {f} (accepted, changes nothing)" for f in chat.TEMPLATE_FIELDS if f not in reads))
    http, thread = H.start(srv, sock)
    host, port = sock.getsockname()[:2]
    s.say(f"serving {o.served_model_name!r} on http://{host}:{port} (max batch {f.max_batch}, queue {o.max_queue}, "
          f"context {lim.context}, prefill chunk {f.prefill_chunk}, connections {cap}"
          + (f", speculative {k}" if k else "") + (", API key required" if o.api_key else "")
          + (", <think> as reasoning_content" if srv.think else "")
          + (f", CORS for {','.join(o.allowed_origins)}" if o.allowed_origins else "") + ")")
    return hub, http, thread


if __name__ == "__main__":
    R.exit_now(R.run_cli(sys.argv[1:], parse, main))
