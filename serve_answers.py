"""serve.py's answers (rank 0's event loop): a request's engine events -> text (detokenized, stop strings, the
<think> split) -> the API's objects: the whole completion, or the chunks of an SSE stream. One Answer may carry
several choices (n per prompt; a completions request may hold a list of prompts), each its own engine request.

Logprobs (logprobs_chat, logprobs_legacy) are the engine's: the model's raw distribution (engine.Logprob), one entry
per emitted token, reasoning and stop ids included, none after a stop string.
"""
import functools
import json
import secrets
import time
from typing import NamedTuple

import chat
import tool_calls
from serve_requests import ApiError


# --------------------------------------------------------------------------------------------------
# output text


class Output:
    """One request's ids -> text deltas, as ("content" | "reasoning", text) pairs, and its markers as their own
    (tool_calls.Kind values: "think_start", "think_end", "call_open", "call_close", the text their spelling). Stop
    ids give no text; with `think` ids, the text between <think> and </think> is reasoning (the tokens themselves
    give none); with `calls` ids, a call marker in the content is a marker (in reasoning it is text). Stop strings
    end the content before the first one; content that could still begin one (len(longest) - 1 characters) is held
    back until it cannot (or a marker comes: a stop string does not span one), so streamed and whole answers are the
    same text."""

    def __init__(self, tok, stop_ids: frozenset, stops: list, think: tuple | None, reasoning: bool,
                 calls: tuple | None = None):
        self.stop_ids, self.stops, self.think, self.calls = stop_ids, stops, think, calls or ()
        self.tok = tok
        self.keep = max((len(s) for s in stops), default=1) - 1
        self.channel = "reasoning" if reasoning else "content"
        self.streams = {"content": chat.TextStream(tok), "reasoning": chat.TextStream(tok)}
        self.held = ""  # content not sent yet (it may begin a stop string)
        self.ids = []  # the completion's ids so far (none after a stop string)
        self.stopped = False  # a stop string was found
        self.hit = None  # the stop string found (the first in the text; the first listed of those that start there)

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
                out.append(("think_start" if t == self.think[0] else "think_end", ""))
                continue
            if t in self.calls and self.channel == "content":
                out += self._flush("content")
                if self.held and not self.stopped:
                    out.append(("content", self.held))
                self.held = ""
                out.append(("call_open" if t == self.calls[0] else "call_close",
                            self.tok.decode([t], skip_special_tokens=False)))
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
            at = min(hits)
            self.hit = next(s for s in self.stops if self.held.find(s) == at)
            text, self.held = self.held[:at], ""
        else:
            cut = len(self.held) - self.keep
            text, self.held = self.held[:max(cut, 0)], self.held[max(cut, 0):]
        return [("content", text)] if text else []


def _merge(deltas: list) -> list:
    """Consecutive text deltas of one channel joined (markers and calls stay apart)."""
    out = []
    for ch, text in deltas:
        if out and out[-1][0] == ch and ch in ("content", "reasoning"):
            out[-1] = (ch, out[-1][1] + text)
        else:
            out.append((ch, text))
    return out


# --------------------------------------------------------------------------------------------------
# logprobs in the API's shapes


def _byte_decoder() -> dict:
    """Byte-level BPE's printable stand-ins -> the bytes they stand for (GPT-2's table: printable Latin-1 bytes stand
    for themselves, the rest map to 256 + i in order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


BYTES_OF = _byte_decoder()


class TokenText:
    """Token id -> (its text, its UTF-8 bytes) as logprobs show it: the text the id alone decodes to (a piece of a
    character reads as U+FFFD), the bytes exact where the tokenizer's decoder is byte-level BPE (else the text's).
    One per tokenizer (token_text), cached per id."""

    def __init__(self, tok):
        self.tok, self.seen = tok, {}
        dec = getattr(getattr(tok, "backend_tokenizer", None), "decoder", None)
        self.byte_level = dec is not None and b'"ByteLevel"' in dec.__getstate__()
        self.added = set(tok.get_added_vocab())  # special and added tokens: their text is their content

    def __call__(self, t: int) -> tuple[str, list]:
        got = self.seen.get(t)
        if got is None:
            text = self.tok.decode([t], skip_special_tokens=False)
            piece = self.tok.convert_ids_to_tokens(t)
            raw = (bytes(BYTES_OF[c] for c in piece) if self.byte_level and isinstance(piece, str) and piece
                   and piece not in self.added and all(c in BYTES_OF for c in piece) else text.encode("utf-8"))
            got = self.seen[t] = (text, list(raw))
        return got


@functools.lru_cache(maxsize=4)
def token_text(tok) -> TokenText:
    return TokenText(tok)


def logprobs_chat(tt: TokenText, ids: list, lps: list) -> list:
    """Chat's choices[i].logprobs.content entries of the ids: token, logprob, bytes, top_logprobs (most likely
    first)."""
    out = []
    for t, lp in zip(ids, lps):
        text, raw = tt(t)
        top = [{"token": (x := tt(a))[0], "logprob": v, "bytes": x[1]} for a, v in lp.top]
        out.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return out


def logprobs_legacy(tt: TokenText, ids: list, lps: list, offset: int) -> tuple[dict, int]:
    """The completions API's logprobs of the ids from text offset `offset` -> ({tokens, token_logprobs, top_logprobs,
    text_offset}, the offset after them). A prompt's first token has none (null); top_logprobs holds the K most
    likely tokens and the chosen one (as OpenAI's: up to K + 1 entries; tokens of the same text keep the likelier);
    text_offset counts the characters of the token texts before each."""
    o = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp in zip(ids, lps):
        text = tt(t)[0]
        o["tokens"].append(text)
        o["text_offset"].append(offset)
        offset += len(text)
        if lp is None:
            o["token_logprobs"].append(None)
            o["top_logprobs"].append(None)
            continue
        top = {}
        for a, v in lp.top:
            top.setdefault(tt(a)[0], v)
        top.setdefault(text, lp.logprob)
        o["token_logprobs"].append(lp.logprob)
        o["top_logprobs"].append(top)
    return o, offset


def _join_legacy(a: dict | None, b: dict) -> dict:
    return b if a is None else {k: a[k] + b[k] for k in a}


# --------------------------------------------------------------------------------------------------
# the API's objects


def usage_of(jobs: list, outs: list, cached: list) -> dict:
    """Prompt tokens once per prompt (its n choices share it), completion tokens of every choice."""
    p, n = sum(len(j.ids) for j in jobs if j.index % j.n == 0), sum(len(o.ids) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": sum(cached)}}


def finish_of(out: Output, finish: str | None) -> str:
    if out.stopped:
        return "stop"
    return {"stop": "stop", "length": "length"}.get(finish, "abort")


class News(NamedTuple):
    """One choice's news from an engine event: text deltas, the ids taken, their logprobs in the API's shape (or
    None), and the finish reason on its last."""
    index: int
    deltas: list
    ids: list
    logprobs: object
    finish: str | None


class Answer:
    """One request's events -> OpenAI objects: chunks of a stream, or the whole completion. jobs[i] is choice i,
    lives[i] its engine request (all post to one queue, as (index, Event))."""

    def __init__(self, srv, jobs: list, lives: list):
        self.srv, self.jobs, self.lives, self.job = srv, jobs, lives, jobs[0]  # job: the settings they share
        self.outs = [Output(srv.tok, j.stop_ids, j.stop, srv.think if j.chat else None, j.reasoning,
                            tool_calls.call_ids(srv.tok) if j.chat else None) for j in jobs]
        self.parsers = [tool_calls.Parser(j.tools, j.tool_choice) if j.chat else None for j in jobs]
        self.kind = "chatcmpl" if self.job.chat else "cmpl"
        self.id = f"{self.kind}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.cached = [0] * len(jobs)
        self.outcome = "ok"  # how it ended, for the metrics: ok, engine_error, disconnected
        self.tt = token_text(srv.tok)
        self.offsets = [0] * len(jobs)  # completions' text_offset so far, per choice

    def cancel(self):
        """Every choice whose answer is not complete is cancelled (its slot is freed at the next step)."""
        for lv in self.lives:
            if not lv.ended:
                lv.ended = True
                self.srv.hub.cancel(lv)

    async def events(self):
        """-> News per engine event, finish set on each choice's last; a stop string cancels its choice's request. A
        choice's first News carries its echo (the prompt's text, and its logprobs when asked). An engine error ends
        the whole answer."""
        done = [False] * len(self.jobs)
        fresh = set(range(len(self.jobs)))
        while not all(done):
            i, ev = await self.lives[0].queue.get()
            lv, out, job = self.lives[i], self.outs[i], self.jobs[i]
            if done[i]:  # a choice a stop string ended: its request's last events (until the cancel) are not read
                continue
            if ev.error is not None:
                lv.ended = True
                self.outcome = "engine_error"
                raise ApiError(ev.status, ev.error, None, "engine_error" if ev.status >= 500 else "invalid_value")
            self.cached[i] = ev.cached
            deltas, ids = out.push(ev.ids)
            end = ev.finish is not None or out.stopped
            deltas = self._parsed(i, deltas + (out.close() if end else []), end)
            if out.stopped and not lv.ended:
                lv.ended = True
                self.srv.hub.cancel(lv)
            lps = self._logprobs(i, ids, ev.logprobs[:len(ids)] if ev.logprobs is not None else None,
                                 ev.prompt_logprobs if i in fresh else None)
            if i in fresh and job.echo:
                deltas = _merge([("content", job.echo_text)] + deltas)
            fresh.discard(i)
            if end:
                lv.ended = done[i] = True
                finish = finish_of(out, ev.finish)
                if finish == "stop" and self.parsers[i] is not None and self.parsers[i].calls:
                    finish = "tool_calls"
                yield News(i, _merge(deltas), ids, lps, finish)
            elif deltas or ids or lps:
                yield News(i, deltas, ids, lps, None)

    def _parsed(self, i: int, deltas: list, end: bool) -> list:
        """A chat choice's Output deltas -> the parser's (reasoning, content, tool calls); a completion's as they are."""
        p = self.parsers[i]
        if p is None:
            return deltas
        got = p.push([tool_calls.Piece(tool_calls.Kind(ch), text) for ch, text in deltas])
        return got + p.close() if end else got

    def _logprobs(self, i: int, ids: list, lps: list | None, prompt: list | None):
        """A choice's new ids' logprobs (and, on its first, the prompt's) in the API's shape; None without."""
        job = self.jobs[i]
        if job.logprobs is None or not ids and not prompt:
            return None
        if job.chat:
            return logprobs_chat(self.tt, ids, lps or [])
        got = None
        if prompt:
            got, self.offsets[i] = logprobs_legacy(self.tt, job.ids, prompt, self.offsets[i])
        mine, self.offsets[i] = logprobs_legacy(self.tt, ids, lps or [], self.offsets[i])
        return _join_legacy(got, mine)

    def _choice(self, i: int, deltas: list, ids: list | None, finish: str | None, whole: bool, lps=None) -> dict:
        if self.job.chat:
            m = tool_calls.assemble([d for d in deltas if d[0] != "tool_call" or whole])  # a chunk's: text alone
            if whole:
                msg = {"role": "assistant", "content": m.content or (None if m.tool_calls else "")}
                if m.tool_calls:
                    msg["tool_calls"] = m.tool_calls
            else:
                msg = {"content": m.content} if m.content else {}
                calls = [call_delta(d) for ch, d in deltas if ch == "tool_call"]
                if calls:
                    msg["tool_calls"] = calls
            if self.srv.think is not None and (m.reasoning or whole):
                msg["reasoning_content"] = msg["reasoning"] = m.reasoning or None  # peers read either name
            lp = None if lps is None else {"content": lps, "refusal": None}
            c = {"index": i, ("message" if whole else "delta"): msg, "logprobs": lp, "finish_reason": finish}
        else:
            text = "".join(t for ch, t in deltas if ch == "content")
            c = {"index": i, "text": text, "logprobs": lps, "finish_reason": finish}
        if self.job.token_ids and ids is not None:
            c["token_ids"] = ids
        return c

    def _object(self, choices: list, whole: bool, usage=False) -> dict:
        kind = ("chat.completion" if whole else "chat.completion.chunk") if self.job.chat else "text_completion"
        o = {"id": self.id, "object": kind, "created": self.created, "model": self.srv.name, "choices": choices}
        if usage is not False:
            o["usage"] = usage
        return o

    def _prompt_ids(self) -> dict:
        """return_token_ids: the prompt's ids, on the object for a chat, on each choice of a completion (its own)."""
        return {"prompt_token_ids": self.job.ids} if self.job.token_ids and self.job.chat else {}

    def _with_prompt(self, i: int, c: dict) -> dict:
        if self.job.token_ids and not self.job.chat:
            c["prompt_token_ids"] = self.jobs[i].ids
        return c

    async def whole(self) -> dict:
        got = [([], [], None, None) for _ in self.jobs]
        async for i, d, ids, lps, finish in self.events():
            deltas, all_ids, all_lps, _ = got[i]
            if lps is not None:
                all_lps = (all_lps or []) + lps if self.job.chat else _join_legacy(all_lps, lps)
            got[i] = (deltas + d, all_ids + ids, all_lps, finish)
        choices = [self._with_prompt(i, self._choice(i, _merge(d), ids, f, True, lps))
                   for i, (d, ids, lps, f) in enumerate(got)]
        return {**self._object(choices, True, usage_of(self.jobs, self.outs, self.cached)), **self._prompt_ids()}

    async def chunks(self):
        """SSE lines: a role chunk per choice (chat), one chunk per event (its choice's index), each choice's finish,
        the usage (include_usage), [DONE]. A completion's first chunk of each choice carries its prompt ids
        (return_token_ids)."""
        usage = None if self.job.include_usage else False
        first, fresh = self._prompt_ids(), set(range(len(self.jobs)))
        if self.job.chat:
            for i in range(len(self.jobs)):
                c = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
                yield sse({**self._object([c], False, usage), **first})
                first = {}
        try:
            async for i, deltas, ids, lps, finish in self.events():
                if deltas or (ids and self.job.token_ids) or finish or lps:
                    groups = _groups(deltas)
                    for g, part in enumerate(groups):  # a call's header, then each of its arguments, a chunk each
                        head, last = g == 0, g == len(groups) - 1
                        c = self._choice(i, part, ids if head else None, finish if last else None, False,
                                         lps if head else None)
                        if i in fresh:
                            fresh.discard(i)
                            c = self._with_prompt(i, c)
                        yield sse({**self._object([c], False, usage), **first})
                        first = {}
        except ApiError as e:
            self.cancel()  # the other choices end with it
            yield sse(e.body())
            return
        if self.job.include_usage:
            yield sse(self._object([], False, usage_of(self.jobs, self.outs, self.cached)))
        yield "data: [DONE]\n\n"


def call_delta(d: tool_calls.CallDelta) -> dict:
    """A call's delta in OpenAI's stream shape: the first carries index, id, type and name; the rest arguments."""
    if d.id is not None:
        return {"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name,
                                                                             "arguments": d.arguments}}
    return {"index": d.index, "function": {"arguments": d.arguments}}


def _groups(deltas: list) -> list:
    """An event's deltas -> the chunks they go out in: text deltas together, each call delta alone (at least one)."""
    out = []
    for d in deltas:
        if d[0] == "tool_call" or not out or out[-1][-1][0] == "tool_call":
            out.append([d])
        else:
            out[-1].append(d)
    return out or [[]]


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
