"""An OpenAI-compatible HTTP server on the engine, under torchrun.

    torchrun --standalone --nproc-per-node=N serve.py --tp-dir OUT/tpN [--host 127.0.0.1] [--port 8000] [--api-key K]
    curl -s 127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "step5", "messages": [{"role": "user", "content": "Hello"}], "stream": true}'

Endpoints: POST /v1/chat/completions (string content, or text and image_url parts whose URL is a base64 data: URL of
a PNG or JPEG image), POST /v1/completions (a string or a list of token ids), GET /v1/models, GET /health. SSE
streaming, usage with the prompt tokens reused from the cache, finish reasons stop / length / abort (the server
stopped mid-request). Extensions: top_k, ignore_eos, return_token_ids (the completion's ids in each choice).

Ranks and threads: every rank runs the engine loop in its main thread; rank 0 also runs uvicorn in a daemon thread
with its own event loop. Each loop iteration rank 0 drains its inbox (new requests, cancellations) and broadcasts
that decision over a gloo group; every rank applies it in the same order (image features on every rank: they hold a
collective) and steps the engine; rank 0 hands each step's tokens to the requests' asyncio queues. Detokenization,
stop strings and the <think> split run on rank 0's event loop, never in the engine loop.
"""
import argparse
import asyncio
import base64
import binascii
import hmac
import io
import itertools
import json
import math
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

import chat
import image_processing
import runtime as R
from sampling import Sampling

# A step prefills at most this many prompt tokens, so running streams keep their pace while a long prompt comes in.
# A chunk's host enqueue (~0.2 s for 92 layers on an H200 host) bounds a step whatever its size: 4096 tokens take
# about that on the device, so a step stalls the streams no longer than 2048 did and prefills twice as much
# (16 streams of 1k-token prompts: 1043 against 914 tok/s, PERF_LOG "... the DSA prefill's dense regime, the server
# measured"); the CLI takes 16k.
PREFILL_CHUNK = 4096
MAX_BATCH = 16  # slots (the README's decode figures: batch 16 costs 2x batch 1 per step, for 16x the tokens)
MAX_QUEUE = 64  # requests waiting for a slot beyond --max-batch; more are answered 503 with Retry-After
DEFAULT_MAX_TOKENS = 8192  # a request without max_tokens gets the context left, capped here
DEFAULT_TEMPERATURE = 1.0  # the OpenAI API's default (the CLI's default is greedy)
MAX_BODY = 32 << 20  # bytes of a request body
MAX_IMAGE_BYTES = 20 << 20  # bytes of one decoded image file
MAX_IMAGE_PIXELS = 50_000_000  # pixels of one image, checked from its header before it is decoded
MAX_IMAGES = 16  # images per request (each costs up to ~110 MB of prepared crops)
MAX_STOP = 4  # stop strings per request (the OpenAI API's limit)
PREPARE_AT_ONCE = 4  # requests tokenized and their images decoded at once (a 32 MiB body of text takes GBs to tokenize)
IDLE_WAIT_S = 0.03  # an idle rank 0 waits this long on its inbox before broadcasting an empty decision
CTL_TIMEOUT_S = 120  # a control broadcast (one per engine step) that takes longer means a rank is stuck
SIGTERM_GRACE_S = 10  # a rank > 0 that got SIGTERM waits this long for rank 0's stop decision
SHUTDOWN_S = 5  # open HTTP connections get this long to drain after the stop
DISCONNECT_POLL_S = 0.25  # a non-streaming request checks this often whether its client is still there
REFUSED = {  # OpenAI fields this server does not implement -> the values that change nothing (others: a 400)
    "n": (1,), "logprobs": (False,), "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "suffix": (),
    "tools": ([],), "tool_choice": ("none", "auto"), "functions": ([],), "function_call": ("none", "auto"),
    "logit_bias": ({},), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "response_format":
    ({"type": "text"},), "audio": (), "modalities": (["text"],), "prediction": (), "web_search_options": (),
}
ROLES = ("system", "developer", "user", "assistant")


# --------------------------------------------------------------------------------------------------
# errors: OpenAI-shaped, naming the field


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 or self.status == 503 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


# --------------------------------------------------------------------------------------------------
# requests: a JSON body -> a Job (HTTP thread pool of rank 0)


@dataclass
class Job:
    """One validated request."""
    ids: list
    images: dict | None  # prepared image tensors (image_processing.ImageBatch.model_inputs), or None
    max_tokens: int
    sampling: Sampling
    stop_ids: frozenset  # EOS ids (none with ignore_eos)
    stop: list  # stop strings
    stream: bool = False
    include_usage: bool = False
    token_ids: bool = False  # return_token_ids
    chat: bool = True
    reasoning: bool = False  # the prompt leaves a <think> block open: the answer starts in reasoning_content


@dataclass
class Limits:
    """What a request is checked against (rank 0)."""
    context: int  # prompt + max_tokens (the engine's max_context, less a speculative step's extra rows)
    vocab: int
    default_max_tokens: int
    image_token: int | None  # the placeholder id (None: a text-only model)
    vision: object  # the VisionConfig, or None


def _is(v, ok) -> bool:
    return type(v) is type(ok) and v == ok


def _int(body: dict, name: str, lo: int | None = None):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"{name} must be an integer, got {v!r}")
    if lo is not None and v < lo:
        raise bad(name, f"{name} {v} must be >= {lo}")
    return v


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    try:
        f = float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan
    except OverflowError:  # an integer past float's range
        f = math.inf
    if not math.isfinite(f):
        raise bad(name, f"{name} must be a finite number, got {str(v)[:40]}")
    return f


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {v!r}")
    return v


def check_common(body: dict, model_name: str):
    """Fields every endpoint shares: the model's name and the refused OpenAI options."""
    m = body.get("model")
    if m is not None and m != model_name:
        raise ApiError(404, f"model {m!r} does not exist; this server serves {model_name!r}", "model",
                       "model_not_found")
    for name, ok in REFUSED.items():
        v = body.get(name)
        if v is not None and not any(_is(v, x) for x in ok):
            raise bad(name, f"{name}={json.dumps(v)[:80]} is not supported by this server", "unsupported_parameter")


def sampling_of(body: dict) -> Sampling:
    t = _num(body, "temperature", DEFAULT_TEMPERATURE)
    top_p = _num(body, "top_p", 1.0)
    top_k = body.get("top_k")
    top_k = 0 if top_k is None or _is(top_k, -1) else top_k  # -1: "off", as other servers spell it
    seed = body.get("seed")
    s = Sampling(t, top_k, top_p, secrets.randbits(63) if seed is None else seed)
    p = None
    if t == 0:  # greedy: top_p / top_k restrict nothing (OpenAI clients send them beside it), but are checked as given
        p = replace(s, temperature=1.0).problem()
        s = replace(s, top_k=0, top_p=1.0)
    p = p or s.problem()
    if p:
        raise bad(p.split()[0], p)  # problem() names the field first
    return s


def stops_of(body: dict) -> list:
    v = body.get("stop")
    if v is None:
        return []
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v) or len(v) > MAX_STOP:
        raise bad("stop", f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, got "
                  f"{json.dumps(body['stop'])[:80]}")
    return v


def max_tokens_of(body: dict, n_prompt: int, lim: Limits, prompt_param: str) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    n = _int(body, name, 1)
    left = lim.context - n_prompt
    if n is None:
        if left < 1:
            raise bad(prompt_param, f"the prompt ({n_prompt} tokens) leaves no room in the context of "
                      f"{lim.context} tokens", "context_length_exceeded")
        return min(left, lim.default_max_tokens)
    if n > left:
        raise bad(name, f"the prompt ({n_prompt} tokens) + {name} {n} exceed the context of {lim.context} tokens",
                  "context_length_exceeded")
    return n


def job_of(body: dict, ids: list, images, lim: Limits, eos: list, chat: bool, prompt_param: str,
           reasoning: bool = False) -> Job:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict)):
        raise bad("stream_options", "stream_options is only allowed with stream: true, as an object")
    usage = _bool(opts or {}, "include_usage")
    stop_ids = frozenset() if _bool(body, "ignore_eos") else frozenset(eos)
    return Job(ids, images, max_tokens_of(body, len(ids), lim, prompt_param), sampling_of(body), stop_ids,
               stops_of(body), stream, usage, _bool(body, "return_token_ids"), chat, reasoning)


def check_text(text: str, param: str):
    """A prompt text must encode as UTF-8 (chat.not_utf8) and hold no image token literally."""
    at = chat.not_utf8(text)
    if at is not None:
        raise bad(param, f"{param} is not valid Unicode: a lone surrogate {text[at]!r} at character {at}")
    literal = chat.literal_image_token(text)
    if literal:
        raise bad(param, f"{param} holds the image token {literal!r} literally; images go in image_url parts")


def completion_job(body: dict, tok, lim: Limits, eos: list) -> Job:
    p = body.get("prompt")
    if isinstance(p, str):
        check_text(p, "prompt")
        ids = tok(p, add_special_tokens=True)["input_ids"]  # as generate.py --raw-prompt
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        ids = p
        for i, t in enumerate(ids):
            if not 0 <= t < lim.vocab:
                raise bad("prompt", f"prompt: token id {t} (position {i}) is outside the vocabulary [0, {lim.vocab})")
            if t == lim.image_token:
                raise bad("prompt", f"prompt: token id {t} (position {i}) is the image placeholder; images go in "
                          "chat image_url parts")
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        raise bad("prompt", "a list of prompts is not supported: send one request per prompt")
    else:
        raise bad("prompt", f"prompt must be a non-empty string or a list of token ids, got {json.dumps(p)[:80]}")
    if not ids:
        raise bad("prompt", "prompt gives no tokens")
    return job_of(body, ids, None, lim, eos, False, "prompt")


def open_image(url, param: str, lim: Limits):
    """A base64 data: URL -> an undecoded PIL image (its header read: size and format known)."""
    from PIL import Image, UnidentifiedImageError
    if lim.vision is None:
        raise bad(param, "this server's model is text-only: it takes no images")
    if not isinstance(url, str) or not url.startswith("data:"):
        what = "an http(s) URL" if isinstance(url, str) and url.startswith(("http://", "https://")) else repr(url)[:60]
        raise bad(param, f"{param} is {what}: images are never fetched; send a base64 data: URL "
                  "(data:image/png;base64,...)")
    head, _, data = url.partition(",")
    if head not in ("data:image/png;base64", "data:image/jpeg;base64", "data:image/jpg;base64"):
        raise bad(param, f"{param}: expected data:image/png;base64,... or data:image/jpeg;base64,..., got "
                  f"{head[:60]!r}")
    if len(data) * 3 // 4 > MAX_IMAGE_BYTES + 3:
        raise bad(param, f"{param}: the image is larger than {MAX_IMAGE_BYTES >> 20} MiB", "image_too_large")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad(param, f"{param}: not valid base64") from None
    try:
        im = Image.open(io.BytesIO(raw))
    except Image.DecompressionBombError:  # a header of over twice Pillow's pixel limit
        raise bad(param, f"{param}: more than {MAX_IMAGE_PIXELS // 10 ** 6} Mpx", "image_too_large") from None
    except (UnidentifiedImageError, OSError):
        raise bad(param, f"{param}: not a PNG or JPEG image (Pillow cannot identify it)") from None
    if im.format not in ("PNG", "JPEG"):
        raise bad(param, f"{param}: a {im.format} image; PNG and JPEG are accepted")
    w, h = im.size
    if w * h == 0:
        raise bad(param, f"{param}: the image has zero size ({w}x{h})")
    side = max(w, h) if image_processing.plan(w, h, image_processing.geometry(lim.vision)).padded else 0
    if max(w * h, side * side) > MAX_IMAGE_PIXELS:  # a thin strip is decoded into a square of its long side
        what = f"{w}x{h}" + (f" (a strip, padded to {side}x{side})" if side else "")
        raise bad(param, f"{param}: {what} is more than {MAX_IMAGE_PIXELS // 10 ** 6} Mpx", "image_too_large")
    return im


def chat_job(body: dict, tok, lim: Limits, eos: list, think: tuple | None) -> Job:
    """A chat request -> its Job: the conversation rendered by the chat template, each image part's placeholder
    block spliced in where the part was (a marker no text holds), the images decoded only after the prompt's
    length, counted from their headers, fits."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages must be a non-empty list")
    marker = f"<image-{secrets.token_hex(8)}>"
    conv, images = [], []
    for i, m in enumerate(msgs):
        at = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise bad(f"{at}.role", f"{at}.role must be one of {list(ROLES)}, got {json.dumps(role)[:40]} (this "
                      "server has no tools)")
        if m.get("tool_calls"):
            raise bad(f"{at}.tool_calls", f"{at}.tool_calls: this server has no tools", "unsupported_parameter")
        c = m.get("content")
        if c is None and m["role"] == "assistant":
            c = ""
        if isinstance(c, str):
            check_text(c, f"{at}.content")
            text = c
        elif isinstance(c, list):
            text = ""
            for j, part in enumerate(c):
                pat = f"{at}.content[{j}]"
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    check_text(part["text"], f"{pat}.text")
                    text += part["text"]
                elif kind == "image_url" and m["role"] == "user":
                    u = part.get("image_url")
                    images.append(open_image(u.get("url") if isinstance(u, dict) else u, f"{pat}.image_url.url", lim))
                    text += marker
                else:
                    raise bad(f"{pat}.type", f"{pat}: expected a text part or (in a user message) an image_url "
                              f"part, got {json.dumps(part)[:80]}")
        else:
            raise bad(f"{at}.content", f"{at}.content must be a string or a list of parts")
        conv.append({"role": "system" if m["role"] == "developer" else m["role"], "content": text})
    if conv[-1]["role"] != "user":
        raise bad(f"messages[{len(conv) - 1}].role", "the last message must be the user's")
    if len(images) > MAX_IMAGES:
        raise bad("messages", f"{len(images)} images: at most {MAX_IMAGES} per request")
    try:
        rendered = chat.render(tok, conv, raw=False)
    except R.UserError as e:
        raise ApiError(500, str(e), None, "no_chat_template") from None
    except Exception as e:  # the template's own errors (jinja, raise_exception) name what it refuses
        raise bad("messages", f"the chat template refused the conversation: {e}") from None
    if rendered.count(marker) != len(images):
        raise bad("messages", "the chat template dropped an image part")
    geo = image_processing.geometry(lim.vision) if images else None
    layouts = [image_processing.plan(*im.size, geo) for im in images]
    try:
        blocks = [image_processing.image_block_ids(tok, lay, lim.vision) for lay in layouts]
    except ValueError as e:  # a tokenizer without the image tokens
        raise ApiError(500, str(e), None, "no_image_tokens") from None
    ids = chat.splice(tok, rendered, blocks, raw=False, marker=marker)
    reasoning = think is not None and _last(ids, think[0]) > _last(ids, think[1])
    job = job_of(body, ids, None, lim, eos, True, "messages", reasoning)  # the length, before any pixel is decoded
    if images:
        try:
            for im in images:
                im.load()  # decode now: a truncated file fails here
            batch = image_processing.preprocess([im.convert("RGB") for im in images], lim.vision)
        except (OSError, ValueError) as e:
            raise bad("messages", f"an image could not be decoded ({e})") from None
        job.images = batch.model_inputs()
    return job


def _last(ids: list, t: int) -> int:
    return max((i for i, x in enumerate(ids) if x == t), default=-1)


# --------------------------------------------------------------------------------------------------
# output text (rank 0's event loop)


class Output:
    """One request's ids -> text deltas, as ("content" | "reasoning", text) pairs. Stop ids give no text; with
    `think` ids, the text between <think> and </think> is reasoning (the tokens themselves give none). Stop strings
    end the content before the first one; content that could still begin one (len(longest) - 1 characters) is held
    back until it cannot, so streamed and whole answers are the same text."""

    def __init__(self, tok, stop_ids: frozenset, stops: list, think: tuple | None, reasoning: bool):
        self.stop_ids, self.stops, self.think = stop_ids, stops, think
        self.keep = max((len(s) for s in stops), default=1) - 1
        self.channel = "reasoning" if reasoning else "content"
        self.streams = {"content": chat.TextStream(tok), "reasoning": chat.TextStream(tok)}
        self.held = ""  # content not sent yet (it may begin a stop string)
        self.ids = []  # the completion's ids so far (none after a stop string)
        self.stopped = False  # a stop string was found

    def push(self, ids: list) -> tuple[list, list]:
        """-> (deltas, the ids taken: those after a stop string are dropped)."""
        out, n0 = [], len(self.ids)
        for t in ids:
            if self.stopped:
                break
            self.ids.append(t)
            if t in self.stop_ids:
                continue
            if self.think is not None and t in self.think:
                out += self._flush(self.channel)
                self.channel = "reasoning" if t == self.think[0] else "content"
                continue
            out += self._text(self.channel, self.streams[self.channel].push([t]))
        return _merge(out), self.ids[n0:]

    def close(self) -> list:
        """The text still held (not after a stop string)."""
        if self.stopped:
            return []
        out = self._flush("reasoning") + self._flush("content")
        if self.held and not self.stopped:
            out.append(("content", self.held))
        self.held = ""
        return _merge(out)

    def _flush(self, channel: str) -> list:
        return self._text(channel, self.streams[channel].flush())

    def _text(self, channel: str, piece: str) -> list:
        if not piece or self.stopped:
            return []
        if channel == "reasoning":
            return [("reasoning", piece)]
        self.held += piece
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            text, self.held = self.held[:min(hits)], ""
        else:
            cut = len(self.held) - self.keep
            text, self.held = self.held[:max(cut, 0)], self.held[max(cut, 0):]
        return [("content", text)] if text else []


def _merge(deltas: list) -> list:
    out = []
    for ch, text in deltas:
        if out and out[-1][0] == ch:
            out[-1] = (ch, out[-1][1] + text)
        else:
            out.append((ch, text))
    return out


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


@dataclass(eq=False)
class Live:
    rid: int
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    ended: bool = False  # its answer is complete (the engine may still hold it: a stop string's cancel)


class Hub:
    """Rank 0: requests in flight, the inbox the engine loop drains, and the way back to each request's queue."""

    def __init__(self, capacity: int):
        self.capacity = capacity  # --max-batch + --max-queue
        self.inbox = queue.Queue()
        self.live = {}  # rid -> Live: submitted, not yet finished by the engine
        self.lock = threading.Lock()
        self.rids = itertools.count()
        self.closing = False
        self.running = self.waiting = 0  # the engine's, after its last step (for /health)

    def submit(self, job: Job) -> Live:
        with self.lock:
            if self.closing:
                raise ApiError(503, "the server is shutting down", None, "shutting_down")
            if len(self.live) >= self.capacity:
                raise ApiError(503, f"the server is at capacity ({len(self.live)} requests in flight); retry later",
                               None, "server_busy", {"Retry-After": "1"})
            lv = Live(next(self.rids), asyncio.get_running_loop(), asyncio.Queue())
            self.live[lv.rid] = lv
        self.inbox.put(R.New(lv.rid, job.ids, job.images, job.max_tokens, job.sampling, job.stop_ids))
        return lv

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

    def post(self, rid: int, ev: Event):
        """The engine loop: an event to a request's queue (on its event loop's thread)."""
        with self.lock:
            lv = self.live.pop(rid) if ev.finish is not None or ev.error is not None else self.live.get(rid)
        if lv is not None:
            try:
                lv.loop.call_soon_threadsafe(lv.queue.put_nowait, ev)
            except RuntimeError:  # the event loop is closed: the HTTP side has stopped
                pass

    def end_all(self, ev: Event):
        """Stop accepting and end every request in flight with `ev` (a shutdown's abort, or an error)."""
        with self.lock:
            self.closing = True
            rids = list(self.live)
        for rid in rids:
            self.post(rid, ev)


# --------------------------------------------------------------------------------------------------
# the HTTP side (rank 0)


@dataclass
class Served:
    """What the HTTP side knows of the model, and how it reaches the engine."""
    hub: Hub
    tok: object
    lim: Limits
    eos: list
    think: tuple | None
    name: str
    api_key: str | None
    created: int = field(default_factory=lambda: int(time.time()))


def usage_of(job: Job, out: Output, cached: int) -> dict:
    n = len(out.ids)
    return {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_of(out: Output, finish: str | None) -> str:
    if out.stopped:
        return "stop"
    return {"stop": "stop", "length": "length"}.get(finish, "abort")


class Answer:
    """One request's events -> OpenAI objects: chunks of a stream, or the whole completion."""

    def __init__(self, srv: Served, job: Job, lv: Live):
        self.srv, self.job, self.lv = srv, job, lv
        self.out = Output(srv.tok, job.stop_ids, job.stop, srv.think if job.chat else None, job.reasoning)
        self.kind = "chatcmpl" if job.chat else "cmpl"
        self.id = f"{self.kind}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.cached = 0

    async def events(self):
        """-> (deltas, ids, finish) per engine event, the last with finish set; a stop string cancels the request."""
        while True:
            ev = await self.lv.queue.get()
            if ev.error is not None:
                self.lv.ended = True
                raise ApiError(ev.status, ev.error, None, "engine_error" if ev.status >= 500 else None)
            self.cached = ev.cached
            deltas, ids = self.out.push(ev.ids)
            if self.out.stopped:
                self.srv.hub.cancel(self.lv)
            if ev.finish is not None or self.out.stopped:
                self.lv.ended = True
                yield deltas + self.out.close(), ids, finish_of(self.out, ev.finish)
                return
            yield deltas, ids, None

    def _choice(self, deltas: list, ids: list | None, finish: str | None, whole: bool) -> dict:
        text = "".join(t for ch, t in deltas if ch == "content")
        reasoning = "".join(t for ch, t in deltas if ch == "reasoning")
        if self.job.chat:
            msg = {"role": "assistant", "content": text} if whole else {"content": text} if text else {}
            if self.srv.think is not None and (reasoning or whole):
                msg["reasoning_content"] = reasoning or None
            c = {"index": 0, ("message" if whole else "delta"): msg, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if self.job.token_ids and ids is not None:
            c["token_ids"] = ids
        return c

    def _object(self, choices: list, whole: bool, usage=False) -> dict:
        kind = ("chat.completion" if whole else "chat.completion.chunk") if self.job.chat else "text_completion"
        o = {"id": self.id, "object": kind, "created": self.created, "model": self.srv.name, "choices": choices}
        if usage is not False:
            o["usage"] = usage
        return o

    async def whole(self) -> dict:
        deltas, ids, finish = [], [], None
        async for d, i, f in self.events():
            deltas += d
            ids += i
            finish = f
        o = self._object([self._choice(_merge(deltas), ids, finish, True)], True,
                         usage_of(self.job, self.out, self.cached))
        if self.job.token_ids:
            o["prompt_token_ids"] = self.job.ids
        return o

    async def chunks(self):
        """SSE lines: a role chunk (chat), one chunk per event, the finish, the usage (include_usage), [DONE]."""
        usage = None if self.job.include_usage else False
        first = {"prompt_token_ids": self.job.ids} if self.job.token_ids else {}
        if self.job.chat:
            c = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield sse({**self._object([c], False, usage), **first})
            first = {}
        try:
            async for deltas, ids, finish in self.events():
                if deltas or (ids and self.job.token_ids) or finish:
                    yield sse({**self._object([self._choice(deltas, ids, finish, False)], False, usage), **first})
                    first = {}
        except ApiError as e:
            yield sse(e.body())
            return
        if self.job.include_usage:
            yield sse(self._object([], False, usage_of(self.job, self.out, self.cached)))
        yield "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def make_app(srv: Served):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    class SSE(StreamingResponse):
        """An event stream whose close() runs however it ends: finished, client gone, server stopping. A request
        whose answer is not complete then is cancelled, so its slot is freed at the next step."""

        def __init__(self, answer: Answer):
            super().__init__(answer.chunks(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            self.answer = answer

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                if not self.answer.lv.ended:
                    srv.hub.cancel(self.answer.lv)

    app = FastAPI(title="Step-5", docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: ApiError):
        return JSONResponse(e.body(), e.status, headers=e.headers)

    preparing = asyncio.Semaphore(PREPARE_AT_ONCE)

    async def prepare(make_job, *args) -> Job:
        async with preparing:
            return await run_in_threadpool(make_job, *args)

    @app.exception_handler(ApiError)
    async def on_api_error(_, e: ApiError):
        return error(e)

    @app.exception_handler(Exception)
    async def on_bug(_, e: Exception):  # a bug: still an OpenAI-shaped answer, and the server goes on
        return error(ApiError(500, f"internal error: {type(e).__name__}: {str(e)[:200]}", None, "internal_error"))

    @app.exception_handler(HTTPException)
    async def on_http_error(_, e: HTTPException):  # unknown routes, wrong methods: OpenAI-shaped too
        return error(ApiError(e.status_code, str(e.detail), None, None))

    def auth(request: Request):
        if srv.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), srv.api_key.encode())):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)", None, "invalid_api_key",
                           {"WWW-Authenticate": "Bearer"})

    async def body_of(request: Request) -> dict:
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > MAX_BODY:
            raise ApiError(413, f"the request body is larger than {MAX_BODY >> 20} MiB", None, "body_too_large")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY:
                raise ApiError(413, f"the request body is larger than {MAX_BODY >> 20} MiB", None, "body_too_large")
        try:
            body = json.loads(data)
        except RecursionError:
            raise bad(None, "the request body nests JSON too deeply") from None
        except ValueError as e:  # not JSON, not UTF-8, an integer of more than 4300 digits
            raise bad(None, f"the request body is not valid JSON ({str(e)[:200]})") from None
        if not isinstance(body, dict):
            raise bad(None, "the request body must be a JSON object")
        check_common(body, srv.name)
        return body

    async def answer(request: Request, job: Job):
        lv = srv.hub.submit(job)
        a = Answer(srv, job, lv)
        if job.stream:
            return SSE(a)
        task = asyncio.ensure_future(a.whole())
        try:
            while not (await asyncio.wait({task}, timeout=DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    srv.hub.cancel(lv)
                    task.cancel()
                    return Response(status_code=499)  # nobody reads it
            return JSONResponse(task.result())
        finally:
            if not lv.ended:
                srv.hub.cancel(lv)

    @app.get("/health")
    async def health():
        h = srv.hub
        ok = not h.closing
        return JSONResponse({"status": "ok" if ok else "shutting down", "in_flight": len(h.live),
                             "running": h.running, "waiting": h.waiting}, 200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        auth(request)
        return {"object": "list", "data": [{"id": srv.name, "object": "model", "created": srv.created,
                                            "owned_by": "stepfun", "max_model_len": srv.lim.context}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        auth(request)
        body = await body_of(request)
        job = await prepare(chat_job, body, srv.tok, srv.lim, srv.eos, srv.think)
        return await answer(request, job)

    @app.post("/v1/completions")
    async def completions(request: Request):
        auth(request)
        body = await body_of(request)
        job = await prepare(completion_job, body, srv.tok, srv.lim, srv.eos)
        return await answer(request, job)

    return app


# --------------------------------------------------------------------------------------------------
# the engine loop (every rank)


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
        for rid, why in drv.apply(d):
            if hub is not None:
                hub.post(rid, Event([], error=why, status=400))
        if not eng.busy():
            continue
        updates = drv.step()
        if hub is not None:
            hub.running, hub.waiting = len(eng.running), len(eng.waiting)
            for u in updates:
                hub.post(u.rid, Event(u.ids, u.req.finish if u.done else None, u.req.cached))


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
    flags.check()
    R.check_launched()
    return kw


def split(kw: dict) -> tuple[Options, R.EngineFlags]:
    """The flags by dest name -> (serve's options, the engine's)."""
    flags, mine = R.EngineFlags.split(kw)
    return Options(**mine), flags


def main(**kw):
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
        R.load(s, "(serving)")
        R.start_engine(s, flags.max_batch, flags.max_context)
        drv = R.Driver(s, CTL_TIMEOUT_S)
        signalled = [0.0]

        def on_signal(*_):  # torchrun forwards SIGTERM (and Ctrl-C's SIGINT) to every rank; the loop notices
            signalled[0] = signalled[0] or time.monotonic()
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        hub = http = thread = None
        if rank == 0:
            hub, http, thread = start_http(s, o, sock)
        try:
            with torch.inference_mode():
                engine_loop(drv, hub, signalled)
        except Exception as e:  # a rank died or hangs (the collectives fail or time out), or the engine stopped
            what, lost = R.failure(e)
            if not lost:  # a bug or bad weights: worth its traceback
                traceback.print_exc()
            msg = f"rank {rank}: the engine loop stopped: {what}"
            if hub is not None:
                hub.end_all(Event([], error=f"the server stopped ({msg})", status=500))
                http.should_exit = True
                thread.join(SHUTDOWN_S)
            print(f"error: {msg}; every rank stops (see the other ranks' output)", file=sys.stderr, flush=True)
            os._exit(R.EXIT_FAILED)
        if hub is not None:
            hub.end_all(Event([], finish="abort"))
            http.should_exit = True
            thread.join(SHUTDOWN_S + 2)
            s.say("stopped: every rank exits")
        if drv.group is not None:
            dist.barrier(group=drv.group)


def start_http(s: R.Session, o: Options, sock):
    """Rank 0: uvicorn in a daemon thread (it never keeps the process alive) on the socket bound at start-up."""
    import uvicorn
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
    lim = Limits(eng.max_context - (k + 1 if k else 0), s.cfg.vocab_size, o.default_max_tokens,
                 s.vl.image_token_id if s.vl is not None else None, vis)
    hub = Hub(f.max_batch + o.max_queue)
    srv = Served(hub, s.tok, lim, s.eos, chat.think_ids(s.tok), o.served_model_name, o.api_key)
    http = uvicorn.Server(uvicorn.Config(make_app(srv), log_level="warning", access_log=False, lifespan="off",
                                         timeout_graceful_shutdown=SHUTDOWN_S))
    thread = threading.Thread(target=http.run, kwargs={"sockets": [sock]}, daemon=True, name="http")
    thread.start()
    while not http.started and thread.is_alive():
        time.sleep(0.01)
    if not http.started:
        raise RuntimeError("the HTTP server did not start (see uvicorn's message above)")
    host, port = sock.getsockname()[:2]
    s.say(f"serving {o.served_model_name!r} on http://{host}:{port} (max batch {f.max_batch}, queue {o.max_queue}, "
          f"context {lim.context}, prefill chunk {f.prefill_chunk}" + (f", speculative {k}" if k else "")
          + (", API key required" if o.api_key else "") + (", <think> as reasoning_content" if srv.think else "")
          + ")")
    return hub, http, thread


if __name__ == "__main__":
    R.exit_now(R.run_cli(sys.argv[1:], parse, main))
