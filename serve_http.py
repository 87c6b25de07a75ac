"""serve.py's HTTP side (rank 0): connections and their limits, bodies, the preparation lanes, the FastAPI app's
routes, uvicorn in a daemon thread. serve_requests.py turns a body into Jobs, serve_answers.py their events into
the API's objects, serve.Hub carries them to and from the engine loop.

Limits, each bounding memory or time before the work it guards:
- Connections: at most --max-connections open; a connection past the cap closes the one idle the longest (no request
  in progress, no bytes waiting to be read), or is refused if none is idle. Either one is answered 503 overloaded
  (Retry-After) and closed at once, never held: a client whose request had not arrived yet (a fresh connection
  looks idle until its first bytes come) reads a clean refusal, not a reset. A connection without a request in
  progress (fresh, between requests, or still sending its headers) is closed (RST) HEADER_TIMEOUT_S after it opened
  or its last answer ended; keep-alive connections after KEEP_ALIVE_S (uvicorn's). A half-closed client socket still
  gets its answer; a client that is gone is noticed when an answer is written to it.
- Bodies: at most MAX_BODY each, BODY_BUDGET for all bodies held at once (past it: 503 overloaded); a body must keep
  coming (BODY_CHUNK_S between chunks) and arrive within BODY_TIMEOUT_S (else 408).
- Preparation (JSON, checks, tokenization) runs in threads, in lanes by body size so a small request never waits
  behind big ones: SMALL_LANE bodies of up to SMALL_BODY at once, one bigger body at a time; images are decoded in a
  lane of their own, one request at a time, once their prepared pixels fit serve.Hub.images.
- The log: one line per condition per LOG_EVERY_S (the first at once, then a count), uvicorn's own lines too.
"""
import array
import asyncio
import contextlib
import fcntl
import hmac
import json
import logging
import math
import socket
import struct
import termios
import threading
import time
from dataclasses import dataclass, field

import chat
import serve_anthropic as anthropic
import serve_requests as Q
from serve_answers import Answer
from serve_metrics import Metrics
from serve_requests import ApiError, shown

ANTHROPIC = "/v1/messages"  # the routes of Anthropic's Messages API: its error envelope, x-api-key
MAX_BODY = 32 << 20  # bytes of a request body
BODY_BUDGET = 8 * MAX_BODY  # bytes of all bodies being received or prepared at once
SMALL_BODY = 1 << 20  # bodies up to this size are prepared in the small lane
SMALL_LANE = 4  # small bodies prepared at once (big ones and images: one at a time)
HEADER_TIMEOUT_S = 10  # a connection with no request in progress is closed after this long
KEEP_ALIVE_S = 5  # uvicorn's keep-alive timeout after an answer
BODY_CHUNK_S = 30  # a body that stalls this long: 408
BODY_TIMEOUT_S = 300  # a whole body (32 MiB at 110 KB/s)
SHUTDOWN_S = 5  # open HTTP connections get this long to drain after the stop
DISCONNECT_POLL_S = 0.25  # a non-streaming request checks this often whether its client is still there
SWEEP_S = 1.0  # the connection sweep's period
LOG_EVERY_S = 10.0  # one log line per condition per this long
FD_RESERVE = 256  # file descriptors kept for everything but connections (gloo, files, the Triton cache)


def default_max_connections(soft_limit: int) -> int:
    """--max-connections' default: half the process's file limit (ulimit -n), at most 1024."""
    return max(1, min(1024, soft_limit // 2))


# --------------------------------------------------------------------------------------------------
# the log and shared budgets


class RateLog:
    """One log line per condition per LOG_EVERY_S: the first at once, the rest counted and said by flush()."""

    def __init__(self, say):
        self.say, self.lock, self.last, self.held = say, threading.Lock(), {}, {}

    def allow(self, key: str) -> bool:
        """Whether a line of this condition may be written now (else it is counted)."""
        with self.lock:
            now = time.monotonic()
            if now - self.last.get(key, -math.inf) >= LOG_EVERY_S:
                self.last[key] = now
                return True
            self.held[key] = self.held.get(key, 0) + 1
            return False

    def note(self, key: str, detail: str = ""):
        if self.allow(key):
            self.say(f"{key}{': ' + detail if detail else ''} (more of these: one line per {LOG_EVERY_S:.0f} s)")

    def flush(self):
        """A line for each condition with lines held back whose interval has passed."""
        with self.lock:
            now = time.monotonic()
            due = [(k, n) for k, n in self.held.items() if now - self.last[k] >= LOG_EVERY_S]
            for k, _ in due:
                del self.held[k]
                self.last[k] = now
        for k, n in due:
            self.say(f"{k}: {n} more in the last {LOG_EVERY_S:.0f} s")


class LogFilter(logging.Filter):
    """uvicorn's own lines through a RateLog (an invalid request, an application error: one per interval)."""

    def __init__(self, rate: RateLog):
        super().__init__()
        self.rate = rate

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rate.allow("uvicorn: " + record.getMessage().split("\n")[0][:80])


class Budget:
    """Bytes shared by threads: take() them (waiting until they are free, if asked), give() them back."""

    def __init__(self, total: int):
        self.total, self.used, self.closed, self.cond = total, 0, False, threading.Condition()

    def take(self, n: int, wait: bool) -> bool:
        with self.cond:
            while self.used + n > self.total:
                if not wait or self.closed:
                    return False
                self.cond.wait()
            self.used += n
            return True

    def give(self, n: int):
        with self.cond:
            self.used -= n
            self.cond.notify_all()

    def close(self):
        with self.cond:
            self.closed = True
            self.cond.notify_all()


# --------------------------------------------------------------------------------------------------
# connections


class Conns:
    """The server's open connections: the cap at accept and the sweep of those without a request in progress.
    retry_after: seconds a client turned away at the cap is told to wait (serve.Hub.retry_after)."""

    def __init__(self, cap: int, rate: RateLog, metrics: Metrics, retry_after):
        self.cap, self.rate, self.metrics, self.retry_after = cap, rate, metrics, retry_after
        self.open = {}  # Conn -> None (an ordered set)

    def admit(self, c) -> bool:
        if len(self.open) >= self.cap:  # the order of `open` is that of `since`: the first idle one is the oldest
            idle = next((o for o in self.open if not o.busy() and not o.pending()), None)
            if idle is None:
                self.closed("refused", f"at --max-connections {self.cap}, none idle: a new connection was answered "
                            "503 overloaded and closed")
                return False
            self.closed("evicted", f"at --max-connections {self.cap}: the connection idle the longest was answered "
                        "503 overloaded and closed for a new one")
            idle.turn_away()
        self.open[c] = None
        return True

    def refusal(self) -> bytes:
        """The whole HTTP answer of a connection turned away at the cap. Its request (path, API) is not known yet:
        the body is OpenAI's error shape; the status and Retry-After are what clients of either API act on."""
        e = ApiError(503, f"the server holds --max-connections {self.cap} connections; retry later", None,
                     "overloaded")
        body = json.dumps(e.body()).encode()
        return (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                f"\r\nRetry-After: {self.retry_after()}\r\nConnection: close\r\n\r\n").encode() + body

    def touch(self, c):
        """c has no request in progress from now (c.since): it moves to the end of the order."""
        if self.open.pop(c, 0) is None:
            self.open[c] = None

    def closed(self, reason: str, line: str):
        self.metrics.closed.labels(reason).inc()
        self.rate.note(f"connections: {reason}", line)

    def sweep(self):
        now = time.monotonic()
        for c in [c for c in self.open if not c.busy() and now - c.since > HEADER_TIMEOUT_S]:
            self.closed("timeout", f"no request within {HEADER_TIMEOUT_S} s")
            c.drop()
        self.metrics.connections.set(len(self.open))


def connection_class(conns: Conns):
    """uvicorn's h11 protocol with the cap, the idle sweep and half-closed clients (see the module's docstring)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Conn(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self.since, self.eof = time.monotonic(), False  # no request in progress since
            if not conns.admit(self):
                self.turn_away()

        def connection_lost(self, exc):
            conns.open.pop(self, None)
            super().connection_lost(exc)

        def busy(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def pending(self) -> bool:
            """Bytes of a request wait in the kernel's buffer (a client that connected and sent at once, not yet
            read): not idle."""
            sock = self.transport.get_extra_info("socket")
            if sock is None:
                return False
            n = array.array("i", [0])
            with contextlib.suppress(OSError):
                fcntl.ioctl(sock.fileno(), termios.FIONREAD, n)
            return n[0] > 0

        def on_response_complete(self):
            self.since = time.monotonic()
            conns.touch(self)
            super().on_response_complete()
            if self.eof and not self.busy():
                self.transport.close()

        def eof_received(self):
            """The client half-closed its socket: a request it sent whole still gets its answer (True keeps the
            transport open for it); a connection with none, or with a body still to come, is closed."""
            self.eof = True
            return True if self.busy() and not self.cycle.more_body else None

        def turn_away(self):
            """Answered Conns.refusal() and closed now (FIN): the descriptor is free at once, the client reads the
            503 even if a request it sends later meets a reset (the answer is in its socket's buffer by then). An
            answer the socket cannot take at once (a client that reads nothing) is not waited for: drop()."""
            conns.open.pop(self, None)
            if self.transport.is_closing():
                return
            self.transport.write(conns.refusal())
            if self.transport.get_write_buffer_size():
                return self.drop()
            self.transport.close()

        def drop(self):
            """Closed now, with a reset (SO_LINGER 0): the descriptor is free at once, nothing lingers. It leaves the
            count at once too (connections accepted together are admitted before any is lost)."""
            conns.open.pop(self, None)
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()
    return Conn


# --------------------------------------------------------------------------------------------------
# the app


@dataclass
class Served:
    """What the HTTP side knows of the model and its limits, and how it reaches the engine (serve.Hub)."""
    hub: object
    btok: chat.BoundedTokenizer
    lim: Q.Limits
    eos: list
    think: tuple | None
    name: str
    api_key: str | None
    metrics: Metrics
    rate: RateLog
    max_connections: int
    allowed_origins: list = field(default_factory=list)
    metrics_without_key: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    bodies: Budget = field(default_factory=lambda: Budget(BODY_BUDGET))

    @property
    def tok(self):
        return self.btok.tok


class Lane:
    """Work of one kind run in threads, at most n at once."""

    def __init__(self, n: int):
        self.sem = asyncio.Semaphore(n)

    async def run(self, fn, *args):
        from starlette.concurrency import run_in_threadpool
        async with self.sem:
            return await run_in_threadpool(fn, *args)


async def first(aw, closed: asyncio.Event, timeout: float):
    """aw's result, unless the server starts closing first (503) or `timeout` seconds pass (408)."""
    task, stop = asyncio.ensure_future(aw), asyncio.ensure_future(closed.wait())
    try:
        done, _ = await asyncio.wait({task, stop}, timeout=max(timeout, 0), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    if stop in done:
        raise ApiError(503, "the server is shutting down", None, "shutting_down", {"Connection": "close"})
    raise ApiError(408, f"the request body stalled (none of it for {BODY_CHUNK_S} s, or not all of it within "
                   f"{BODY_TIMEOUT_S} s)", None, "request_timeout", {"Connection": "close"})


def make_app(srv: Served):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    small, big, images = Lane(SMALL_LANE), Lane(1), Lane(1)
    closed = asyncio.Event()  # set (on the server's loop) when the hub closes

    async def sweep():
        while True:
            await asyncio.sleep(SWEEP_S)
            conns.sweep()
            srv.rate.flush()

    @contextlib.asynccontextmanager
    async def lifespan(_):
        loop = asyncio.get_running_loop()
        srv.hub.on_close.append(lambda: loop.call_soon_threadsafe(closed.set))
        task = asyncio.create_task(sweep())
        yield
        task.cancel()

    app = FastAPI(title="Step-5", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    conns = Conns(srv.max_connections, srv.rate, srv.metrics, srv.hub.retry_after)
    if srv.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=srv.allowed_origins, allow_headers=["*"],
                           allow_methods=["GET", "HEAD", "POST", "OPTIONS"], expose_headers=["Retry-After"])

    def error(request: Request, e: ApiError):
        request.state.outcome = e.code or str(e.status)
        body = anthropic.error_body(e) if request.url.path.startswith(ANTHROPIC) else e.body()
        return JSONResponse(body, e.status, headers=e.headers)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError):
        return error(request, e)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException):  # unknown routes, wrong methods: OpenAI-shaped too
        return error(request, ApiError(e.status_code, str(e.detail), None, None))

    @app.exception_handler(ClientDisconnect)
    async def on_disconnect(request: Request, _):
        gone(request, "during its upload")
        return Response(status_code=499)  # nobody reads it

    @app.exception_handler(Exception)
    async def on_bug(request: Request, e: Exception):  # a bug: an OpenAI-shaped answer, the server goes on
        return error(request, ApiError(500, f"internal error: {type(e).__name__}", None, "internal_error"))

    def gone(request: Request, when: str):
        request.state.outcome = "disconnected"
        srv.rate.note(f"a client disconnected {when}")

    def auth(request: Request):
        """Authorization: Bearer KEY; on Anthropic's routes x-api-key: KEY too."""
        if srv.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if request.url.path.startswith(ANTHROPIC) and "x-api-key" in request.headers:
            scheme, given = "bearer", request.headers["x-api-key"]
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), srv.api_key.encode())):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", None, "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"})

    @contextlib.asynccontextmanager
    async def body_of(request: Request):
        """The request's body as it arrives, within MAX_BODY, the shared BODY_BUDGET (held until the block ends)
        and the body timeouts."""
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > MAX_BODY:
            raise ApiError(413, f"the request body is larger than {MAX_BODY >> 20} MiB", None, "body_too_large")

        async def chunk(it):
            with contextlib.suppress(StopAsyncIteration):
                return await it.__anext__()

        data, it, end = bytearray(), request.stream().__aiter__(), time.monotonic() + BODY_TIMEOUT_S
        try:
            while (c := await first(chunk(it), closed, min(BODY_CHUNK_S, end - time.monotonic()))) is not None:
                if not srv.bodies.take(len(c), wait=False):
                    raise ApiError(503, "the server is receiving too many request bodies at once; retry later",
                                   None, "overloaded", {"Retry-After": str(srv.hub.retry_after())})
                data += c
                if len(data) > MAX_BODY:
                    raise ApiError(413, f"the request body is larger than {MAX_BODY >> 20} MiB", None,
                                   "body_too_large")
            yield data
        finally:
            srv.bodies.give(len(data))

    async def jobs_of(request: Request, make, *args) -> list:
        """A request's Jobs: its body read and prepared in the lane of its size, its images in theirs."""
        srv.hub.check_open(1)  # 503 before the body is read
        async with body_of(request) as data:
            jobs = await (small if len(data) <= SMALL_BODY else big).run(make, data, *args)
        del data  # its budget is given back: so are its bytes, before images are decoded
        for job in jobs:
            if job.pending:
                await images.run(decode, job)
        for job in jobs[1:]:  # a chat's n choices share its first choice's decoded images (held once)
            if job.ids is jobs[0].ids:
                job.images = jobs[0].images
        return jobs

    def decode(job: Q.Job):
        if not srv.hub.images.take(job.image_bytes, wait=True):
            raise ApiError(503, "the server is shutting down", None, "shutting_down")
        try:
            Q.decode_images(job, srv.lim)
        except BaseException:
            srv.hub.images.give(job.image_bytes)
            raise

    def completion(data: bytearray) -> list:
        return Q.completion_jobs(Q.parse_body(data, srv.name), srv.btok, srv.lim, srv.eos)

    def chat_completion(data: bytearray) -> list:
        return Q.chat_jobs(Q.parse_body(data, srv.name), srv.btok, srv.lim, srv.eos, srv.think)

    class SSE(StreamingResponse):
        """An event stream whose close() runs however it ends: finished, client gone, server stopping. Choices
        whose answer is not complete then are cancelled, so their slots are freed at the next step."""

        def __init__(self, request: Request, answer: Answer):
            super().__init__(answer.chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            self.request, self.answer = request, answer

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                if not all(lv.ended for lv in self.answer.lives):
                    gone(self.request, "during its stream")
                    self.answer.cancel()
                else:
                    self.request.state.outcome = self.answer.outcome

    async def answer(request: Request, jobs: list, kind=Answer):
        try:
            lives = srv.hub.submit(jobs, request.state.t0)
        except BaseException:  # refused: the images' pixels were never the engine's
            srv.hub.images.give(sum(j.image_bytes for j in jobs if j.images is not None))
            raise
        a = kind(srv, jobs, lives)
        if jobs[0].stream:
            return SSE(request, a)
        task = asyncio.ensure_future(a.whole())
        try:
            while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    task.cancel()
                    gone(request, "while its answer was made")
                    return Response(status_code=499)  # nobody reads it
            return JSONResponse(task.result())
        finally:
            a.cancel()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        h = srv.hub
        ok = not h.closing
        return JSONResponse({"status": "ok" if ok else "shutting down", "in_flight": len(h.live),
                             "running": h.running, "waiting": h.waiting}, 200 if ok else 503)

    def model_card() -> dict:
        return {"id": srv.name, "object": "model", "created": srv.created, "owned_by": "stepfun",
                "max_model_len": srv.lim.context}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models(request: Request):
        auth(request)
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(request: Request, model_id: str):
        auth(request)
        if model_id != srv.name:
            raise ApiError(404, f"the model {shown(model_id)} does not exist; this server serves {shown(srv.name)}",
                           "model", "model_not_found")
        return model_card()

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics(request: Request):
        if not srv.metrics_without_key:
            auth(request)
        text, kind = srv.metrics.text()
        return Response(text, media_type=kind)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        auth(request)
        return await answer(request, await jobs_of(request, chat_completion))

    @app.post("/v1/completions")
    async def completions(request: Request):
        auth(request)
        return await answer(request, await jobs_of(request, completion))

    @app.post("/v1/messages")
    async def messages(request: Request):
        auth(request)
        return await answer(request, await jobs_of(request, anthropic.jobs, srv), anthropic.Message)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        auth(request)
        srv.hub.check_open(1)
        async with body_of(request) as data:
            return JSONResponse(await small.run(anthropic.count_tokens, data, srv))

    return Outer(app, srv), conns


class Outer:
    """The outermost ASGI layer: each HTTP request counted by endpoint and outcome; a request that uvicorn cancels
    SHUTDOWN_S after the stop ends with one log line and a 503, not a traceback."""

    def __init__(self, app, srv: Served):
        self.app, self.srv = app, srv

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":  # the lifespan
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["t0"] = time.perf_counter()  # the request's arrival (request.state.t0)
        status = []

        async def sending(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)
        outcome = None
        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            outcome = "shutting_down"
            self.srv.rate.note("shutdown", "a request still in progress was cut short")
            if not status:
                e = ApiError(503, "the server is shutting down", None, "shutting_down")
                from fastapi.responses import JSONResponse
                await JSONResponse(e.body(), e.status, headers={"Connection": "close"})(scope, receive, send)
        finally:
            said = (scope.get("state") or {}).get("outcome")
            self.srv.metrics.request(scope["path"], outcome or said or (
                "ok" if status and status[0] < 400 else str(status[0]) if status else "none"))


def start(srv: Served, sock):
    """uvicorn in a daemon thread (it never keeps the process alive) on the socket bound at start-up. -> (the
    uvicorn Server, its thread)."""
    import uvicorn
    app, conns = make_app(srv)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", http=connection_class(conns),
                            timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=SHUTDOWN_S)
    rate_filter = LogFilter(srv.rate)  # after the Config, which sets up uvicorn's logging
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).addFilter(rate_filter)
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True, name="http")
    thread.start()
    while not http.started and thread.is_alive():
        time.sleep(0.01)
    if not http.started:
        raise RuntimeError("the HTTP server did not start (see uvicorn's message above)")
    return http, thread
