"""Anthropic's Messages API on the same engine, template and parser as the OpenAI one: POST /v1/messages and POST
/v1/messages/count_tokens (serve_http.py routes them; x-api-key or Bearer).

A request is translated to the chat request it means (request_of: system -> a system message, text and base64
image blocks -> parts, tool_use -> the assistant's tool_calls, tool_result -> tool messages, thinking blocks ->
reasoning_content, tools / tool_choice / disable_parallel_tool_use -> OpenAI's, thinking.budget_tokens -> the
reasoning budget, stop_sequences -> stop), so serve_requests.chat_jobs checks and renders it; errors name the
Anthropic field where this file checks it, and go out in Anthropic's envelope on these routes (error_body).

The answer (Message) is serve_answers.Answer's events, as content blocks: thinking (signed), text, tool_use, in
the order the model wrote them; a stream sends message_start, then per block content_block_start, its deltas
(thinking_delta and a signature_delta, text_delta, input_json_delta) and content_block_stop, then message_delta (the
stop reason and usage) and message_stop. The whole message is built by replaying the same events, so a stream
accumulates to exactly the non-streamed message.

Usage: input_tokens are the prompt's tokens not read from the cache; cache_read_input_tokens those the engine
reused (Event.cached, the prefix cache's hook); cache_creation_input_tokens is 0 (nothing is written on request).
"""
import base64
import hashlib
import hmac
import json
import secrets

import serve_requests as Q
from serve_answers import Answer
from serve_requests import ApiError, bad, shown

KNOWN = {"model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k",
         "tools", "tool_choice", "thinking", "metadata", "service_tier", "container", "mcp_servers",
         "seed", "cache_salt"}  # this server's extensions, as on the OpenAI routes: seed (a request's own random
# stream) and cache_salt (prefixes shared only within one salt)
IGNORED = {"metadata", "service_tier"}  # accepted, change nothing here
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               529: "overloaded_error"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}
SIGNING_KEY = secrets.token_bytes(32)  # signs this process's thinking blocks (a signature is returned, not checked)


def error_body(e: ApiError) -> dict:
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    where = f" ({e.param})" if e.param and e.param not in e.message else ""
    return {"type": "error", "error": {"type": kind, "message": e.message + where}}


def sign(thinking: str) -> str:
    return base64.b64encode(hmac.new(SIGNING_KEY, thinking.encode(), hashlib.sha256).digest()).decode()


# --------------------------------------------------------------------------------------------------
# requests


def request_of(body: dict, count: bool = False) -> dict:
    """An Anthropic Messages body -> the OpenAI chat body it means (count: a count_tokens body, which has no
    max_tokens and takes no sampling fields)."""
    for k in body:
        if k not in KNOWN or k in ("container", "mcp_servers") and body[k]:
            raise bad(k, f"{k} is not supported by this server", "unsupported_parameter")
    out = {"model": body.get("model")} if body.get("model") is not None else {}
    msgs = []
    system = body.get("system")
    if system is not None:
        msgs.append({"role": "system", "content": _text_of(system, "system")})
    given = body.get("messages")
    if not isinstance(given, list) or not given:
        raise bad("messages", "messages must be a non-empty list")
    for i, m in enumerate(given):
        msgs += _messages_of(m, f"messages[{i}]")
    out["messages"] = msgs
    tools = body.get("tools")
    if tools is not None:
        out["tools"] = _tools_of(tools)
    choice = body.get("tool_choice")
    if choice is not None and not count:
        out.update(_tool_choice_of(choice))
    if count:
        out["max_tokens"] = 1
        return out
    n = body.get("max_tokens")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise bad("max_tokens", f"max_tokens is required: an integer >= 1, got {shown(n)}")
    out["max_tokens"] = n
    for k in ("temperature", "top_p", "top_k", "stream", "seed", "cache_salt"):
        if body.get(k) is not None:
            out[k] = body[k]
    t = body.get("temperature")
    if t is not None and not (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t <= 1):
        raise bad("temperature", f"temperature must be a number in [0, 1], got {shown(t)}")
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or \
                len(stops) > Q.MAX_STOP:
            raise bad("stop_sequences", f"stop_sequences must be a list of at most {Q.MAX_STOP} non-empty strings")
        out["stop"] = stops
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind == "enabled":
            b = thinking.get("budget_tokens")
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < n:
                raise bad("thinking.budget_tokens", f"thinking.budget_tokens must be an integer in [0, max_tokens "
                          f"{n}), got {shown(b)}")
            out["thinking_token_budget"] = b
        elif kind == "disabled":
            out["thinking_token_budget"] = 0
        else:
            raise bad("thinking.type", f'thinking.type must be "enabled" or "disabled", got {shown(kind)}')
    return out


def _text_of(v, at: str) -> str:
    """A string, or a list of text blocks (cache_control accepted) -> its text."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise bad(at, f"{at} must be a string or a list of text blocks")
    out = ""
    for j, b in enumerate(v):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise bad(f"{at}[{j}]", f"{at}[{j}] must be a text block, got {shown(b)}")
        out += b["text"]
    return out


def _messages_of(m, at: str) -> list:
    """One Anthropic message -> the chat messages it means: a user message's tool_result blocks become tool
    messages (before its other content), an assistant's tool_use blocks its tool_calls, thinking its reasoning."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        role = m.get("role") if isinstance(m, dict) else None
        raise bad(f"{at}.role", f'{at}.role must be "user" or "assistant", got {shown(role, 40)}')
    role, c = m["role"], m.get("content")
    if isinstance(c, str):
        return [{"role": role, "content": c}]
    if not isinstance(c, list):
        raise bad(f"{at}.content", f"{at}.content must be a string or a list of content blocks")
    parts, calls, results, reasoning = [], [], [], None
    for j, b in enumerate(c):
        bat = f"{at}.content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image" and role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(b.get("source"), f"{bat}.source")}})
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise bad(bat, f"{bat}: a tool_use block needs a name and an input object")
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _text_of(b.get("content", ""), f"{bat}.content")})
        elif kind == "thinking" and role == "assistant" and isinstance(b.get("thinking"), str):
            reasoning = (reasoning or "") + b["thinking"]  # its signature is accepted as it comes back
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # nothing this server can read
        else:
            raise bad(f"{bat}.type", f"{bat}: a {shown(kind)} block is not accepted in a {role} message here")
    out = list(results)
    if role == "assistant":
        msg = {"role": "assistant", "content": parts or ""}
        if calls:
            msg["tool_calls"] = calls
        if reasoning is not None:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    elif parts or not results:
        out.append({"role": "user", "content": parts})
    return out


def _image_url(src, at: str) -> str:
    if not isinstance(src, dict) or src.get("type") != "base64":
        raise bad(at, f'{at}: images go in as {{"type": "base64", "media_type": ..., "data": ...}}; they are never '
                  "fetched")
    media = src.get("media_type")
    if media not in ("image/png", "image/jpeg"):
        raise bad(f"{at}.media_type", f"{at}.media_type must be image/png or image/jpeg, got {shown(media)}")
    if not isinstance(src.get("data"), str):
        raise bad(f"{at}.data", f"{at}.data must be base64 text")
    return f"data:{media};base64,{src['data']}"


def _tools_of(tools) -> list:
    if not isinstance(tools, list):
        raise bad("tools", "tools must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or "input_schema" not in t:
            raise bad(f"tools[{i}]", f"tools[{i}] must be a custom tool {{name, description, input_schema}} (server "
                      "tools are not supported)")
        f = {"name": t.get("name"), "parameters": t["input_schema"]}
        if isinstance(t.get("description"), str):
            f["description"] = t["description"]
        out.append({"type": "function", "function": f})
    return out


def _tool_choice_of(c) -> dict:
    kind = c.get("type") if isinstance(c, dict) else None
    parallel = c.get("disable_parallel_tool_use") if isinstance(c, dict) else None
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("tool_choice.disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use must be a boolean")
    out = {"parallel_tool_calls": not parallel} if parallel is not None else {}
    if kind in ("auto", "none"):
        return {**out, "tool_choice": kind}
    if kind == "any":
        return {**out, "tool_choice": "required"}
    if kind == "tool" and isinstance(c.get("name"), str):
        return {**out, "tool_choice": {"type": "function", "function": {"name": c["name"]}}}
    raise bad("tool_choice", f'tool_choice must be {{"type": "auto" | "any" | "none"}} or {{"type": "tool", '
              f'"name": ...}}, got {shown(c)}')


def jobs(data: bytes, srv) -> list:
    """A /v1/messages body -> its Job (one choice)."""
    body = Q.parse_body(data, srv.name)
    return Q.chat_jobs(request_of(body), srv.btok, srv.lim, srv.eos, srv.think)


def count_tokens(data: bytes, srv) -> dict:
    """A /v1/messages/count_tokens body -> {"input_tokens": the prompt's tokens as the template renders it}."""
    body = Q.parse_body(data, srv.name)
    job = Q.chat_jobs(request_of(body, count=True), srv.btok, srv.lim, srv.eos, srv.think)[0]
    return {"input_tokens": len(job.ids)}


# --------------------------------------------------------------------------------------------------
# answers


class Blocks:
    """An answer's deltas -> Anthropic's block events: a block opens where the kind of text changes (thinking, text,
    each tool call) and closes when the next opens or the answer ends; a thinking block closes with its signature."""

    def __init__(self):
        self.open = None  # ("thinking" | "text" | "tool_use", the call's index or None)
        self.index = -1  # the open block's index
        self.thinking = ""  # the open thinking block's text (its signature signs it)

    def push(self, deltas: list) -> list:
        out = []
        for kind, d in deltas:
            if kind == "tool_call":
                if d.id is not None:
                    out += self._start(("tool_use", d.index), {"type": "tool_use", "id": "toolu_" +
                                                                d.id.removeprefix("call_"), "name": d.name,
                                                                "input": {}})
                if d.arguments:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": d.arguments}))
                continue
            if not d:
                continue
            if kind == "reasoning":
                if self.open != ("thinking", None):
                    out += self._start(("thinking", None), {"type": "thinking", "thinking": "", "signature": ""})
                self.thinking += d
                out.append(self._delta({"type": "thinking_delta", "thinking": d}))
            else:
                if self.open != ("text", None):
                    out += self._start(("text", None), {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d}))
        return out

    def close(self) -> list:
        return self._stop()

    def _start(self, key: tuple, block: dict) -> list:
        out = self._stop()
        self.open, self.index = key, self.index + 1
        return out + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _stop(self) -> list:
        if self.open is None:
            return []
        out = []
        if self.open[0] == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": sign(self.thinking)}))
            self.thinking = ""
        self.open = None
        return out + [{"type": "content_block_stop", "index": self.index}]


def replay(events: list) -> list:
    """Block events -> the content blocks they build (as a client accumulates them)."""
    content, partial = [], {}
    for e in events:
        if e["type"] == "content_block_start":
            content.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            b, d = content[e["index"]], e["delta"]
            if d["type"] == "text_delta":
                b["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                b["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                b["signature"] = d["signature"]
            else:
                partial[e["index"]] = partial.get(e["index"], "") + d["partial_json"]
        elif e["type"] == "content_block_stop" and e["index"] in partial:
            content[e["index"]]["input"] = json.loads(partial.pop(e["index"]))
    return content


class Message(Answer):
    """One /v1/messages request's events -> Anthropic's message, or its event stream."""

    def __init__(self, srv, jobs: list, lives: list):
        super().__init__(srv, jobs, lives)
        self.id = f"msg_{secrets.token_hex(12)}"

    def _head(self) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.srv.name, "content": [],
                "stop_reason": None, "stop_sequence": None, "usage": self._usage()}

    def _usage(self) -> dict:
        cached = self.cached[0]
        return {"input_tokens": len(self.job.ids) - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": len(self.outs[0].ids)}

    def _stop(self, finish: str) -> dict:
        out = self.outs[0]
        if out.stopped:
            return {"stop_reason": "stop_sequence", "stop_sequence": out.hit}
        return {"stop_reason": STOP_REASONS.get(finish, "end_turn"), "stop_sequence": None}

    async def _events(self):
        """-> Anthropic's events as dicts, message_start after the engine's first event (its cache reads known)."""
        blocks, started, finish = Blocks(), False, None
        async for _, deltas, _, _, end in self.events():
            if not started:
                started = True
                yield {"type": "message_start", "message": self._head()}
            for e in blocks.push(deltas):
                yield e
            finish = end or finish
        for e in blocks.close():
            yield e
        yield {"type": "message_delta", "delta": self._stop(finish), "usage": self._usage()}
        yield {"type": "message_stop"}

    async def whole(self) -> dict:
        events = [e async for e in self._events()]
        msg = events[0]["message"]
        return {**msg, "content": replay(events), **events[-2]["delta"], "usage": events[-2]["usage"]}

    async def chunks(self):
        try:
            async for e in self._events():
                yield f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n"
        except ApiError as e:
            self.cancel()
            yield f"event: error\ndata: {json.dumps(error_body(e), ensure_ascii=False)}\n\n"
