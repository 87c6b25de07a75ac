"""Step's tool-call format (STEP5_CHAT.md §3, §5) both ways: the model's output -> reasoning, content and OpenAI
tool calls, parsed incrementally over the stream; and the grammar that makes the model call (tool_choice "required"
or a named function), its marker tokens by id.

    tools = tools_of(body["tools"], "tools")                       # name -> Tool; ValueError names the field
    parser = Parser(tools, Choice(Mode.AUTO), new_id=call_id)
    deltas = parser.push(pieces) + parser.close()                  # pieces: serve_answers.Output's, in order
    message = assemble(deltas)                                     # what a stream of those deltas adds up to

The parser reads pieces: reasoning text, content text, and the markers as their own pieces (the <think> / </think>
and <tool_call> / </tool_call> tokens, known by id, never by their spelling in ordinary tokens: prose that writes
"<tool_call>" stays prose). Every decision waits for the piece that settles it, and the text held meanwhile is
bounded by what the decision needs (a newline, the whitespace after a call, an open call's block), so the deltas of
any split of the same pieces concatenate to the same message. A call is emitted when its </tool_call> arrives:
before that it may still turn out to be content (an unparsable block, one cut at max_tokens or EOS), and a streamed
call can never be taken back. At the close it goes out as a header delta (index, id, type, name) and one arguments
delta per parameter, their concatenation the final JSON string.
"""
import enum
import json
import re
import secrets
from dataclasses import dataclass
from typing import NamedTuple

import grammar as G

CALL = ("<tool_call>", "</tool_call>")  # the call block's markers, single tokens of the vocabulary
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # a function name OpenAI accepts (dots too, as peers allow)


# --------------------------------------------------------------------------------------------------
# the request's side: tools and tool_choice


@dataclass(frozen=True)
class Tool:
    """One function a request offers: its name and JSON schema of its parameters (an object schema)."""
    name: str
    parameters: dict


class Mode(enum.Enum):
    NONE = "none"  # no call is parsed: markers are content (the tools are still rendered)
    AUTO = "auto"  # calls parsed where the model makes them
    REQUIRED = "required"  # the answer is one or more calls (the grammar)
    NAMED = "named"  # exactly one call of `name` (the grammar)


class Choice(NamedTuple):
    mode: Mode = Mode.AUTO
    name: str | None = None  # the function of Mode.NAMED
    parallel: bool = True  # several calls in one answer (False: the first call only)


def tools_of(tools, field: str = "tools") -> dict:
    """OpenAI's tools list ([{"type": "function", "function": {"name", "parameters", ...}}]) -> name -> Tool.
    ValueError names the field."""
    if not isinstance(tools, list):
        raise ValueError(f"{field} must be a list of tools, got {type(tools).__name__}")
    out = {}
    for i, t in enumerate(tools):
        at = f"{field}[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"),
                                                                                                 dict):
            raise ValueError(f'{at} must be {{"type": "function", "function": {{...}}}}')
        f = t["function"]
        name = f.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"{at}.function.name must be 1-64 letters, digits, '_', '-' or '.', got {name!r}")
        if name in out:
            raise ValueError(f"{at}.function.name {name!r} is given twice")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ValueError(f"{at}.function.parameters must be a JSON schema of type object")
        props = params.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(p, dict) for p in props.values()):
            raise ValueError(f"{at}.function.parameters.properties must map names to schemas")
        out[name] = Tool(name, params)
    return out


def choice_of(tool_choice, parallel, tools: dict, field: str = "tool_choice") -> Choice:
    """OpenAI's tool_choice ("none" | "auto" | "required" | {"type": "function", "function": {"name"}}) and
    parallel_tool_calls -> a Choice. ValueError names the field."""
    if parallel is not None and not isinstance(parallel, bool):
        raise ValueError(f"parallel_tool_calls must be true or false, got {parallel!r}")
    parallel = True if parallel is None else parallel
    if tool_choice is None:
        return Choice(Mode.AUTO if tools else Mode.NONE, None, parallel)
    if tool_choice in ("none", "auto", "required"):
        mode = Mode(tool_choice)
        if mode is not Mode.NONE and not tools:
            raise ValueError(f"{field} {tool_choice!r} needs tools")
        return Choice(mode, None, parallel)
    f = tool_choice.get("function") if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" else None
    name = f.get("name") if isinstance(f, dict) else None
    if not isinstance(name, str):
        raise ValueError(f'{field} must be "none", "auto", "required" or {{"type": "function", "function": '
                         f'{{"name": ...}}}}, got {json.dumps(tool_choice)[:80]}')
    if name not in tools:
        raise ValueError(f"{field}.function.name {name!r} is not one of the tools ({', '.join(tools) or 'none'})")
    return Choice(Mode.NAMED, name, parallel)


def call_ids(tok) -> tuple | None:
    """(<tool_call>, </tool_call>) ids when the tokenizer holds both as tokens, else None (no call is parsed)."""
    ids = tuple(tok.convert_tokens_to_ids(t) for t in CALL)
    if all(isinstance(i, int) and i >= 0 and i != tok.unk_token_id for i in ids):
        return ids
    return None


# --------------------------------------------------------------------------------------------------
# the grammar of a forced call (grammar.py compiles it; the engine applies it after the reasoning)

JSON_X = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # grammar.JSON_OPTIONS


def constraint(tools: dict, choice: Choice, call_ids: tuple) -> G.Constraint | None:
    """The Lark grammar of the answer tool_choice requires, as a Constraint naming tool_choice; None where nothing is
    forced. The answer: an optional newline (the one after </think>), then the call blocks, consecutive ones joined
    by a newline, each with the function's parameters in its schema's order, required ones always written. String
    values are raw text without '<' (up to maxLength characters where the schema sets one, at least minLength);
    other values are JSON of the parameter's schema (llguidance's %json, compact). The markers are emitted by id."""
    if choice.mode not in (Mode.REQUIRED, Mode.NAMED):
        return None
    names = [choice.name] if choice.mode is Mode.NAMED else list(tools)
    lines = []
    for k, name in enumerate(names):
        lines += _call_rules(f"c{k}", tools[name], call_ids)
    one = " | ".join(f"c{k}" for k in range(len(names)))
    many = choice.mode is Mode.REQUIRED and choice.parallel
    start = 'start: "\\n"? call ("\\n" call)*' if many else 'start: "\\n"? call'
    return G.Constraint(G.Kind.GRAMMAR, "\n".join([start, f"call: {one}"] + lines), True, "tool_choice")


def _call_rules(rule: str, tool: Tool, call_ids: tuple) -> list:
    props = tool.parameters.get("properties", {})
    required = set(tool.parameters.get("required", []))
    parts, lines = [], []
    for j, (key, schema) in enumerate(props.items()):
        if not key or any(c in key for c in "<>\n"):
            raise G.GrammarError(f"tool_choice: parameter {key!r} of {tool.name!r} cannot be written in the call "
                                 "format (it holds '<', '>' or a newline)")
        p = f"{rule}_p{j}"
        head = json.dumps(f"<parameter={key}>\n")
        if schema.get("type") == "string" and "enum" not in schema and "const" not in schema:
            lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
            span = f"{{{lo},{int(hi)}}}" if hi is not None else f"{{{lo},}}"
            lines.append(f"{p}: {head} /[^<]{span}\\n<\\/parameter>\\n/")
        elif schema.get("type") == "string" or set(schema) & {"enum", "const"} and _all_strings(schema):
            opts = schema.get("enum", [schema.get("const")] if "const" in schema else [])
            lines.append(f"{p}: {head} ({' | '.join(json.dumps(o) for o in opts)}) \"\\n</parameter>\\n\"")
        else:
            lines.append(f"{p}: {head} %json {json.dumps({**schema, 'x-guidance': JSON_X})} \"\\n</parameter>\\n\"")
        parts.append(p if key in required else f"{p}?")
    body = " ".join(parts)
    lines.insert(0, f'{rule}: <[{call_ids[0]}]> {json.dumps(f"{chr(10)}<function={tool.name}>{chr(10)}")} {body} '
                    f'"</function>\\n" <[{call_ids[1]}]>')
    return lines


def _all_strings(schema: dict) -> bool:
    opts = schema.get("enum", [schema.get("const")] if "const" in schema else [])
    return bool(opts) and all(isinstance(o, str) and "<" not in o for o in opts)


# --------------------------------------------------------------------------------------------------
# values: a parameter's raw text typed by its schema


def typed(raw: str, schema: dict | None):
    """A parameter's raw text -> its value: read as JSON, else in Python's spellings (True, False, None: the template
    writes history with them), kept when the value's JSON type is one the schema allows (any but a string where the
    schema gives no type); else the raw text, which is also what a string parameter always gets."""
    kind = (schema or {}).get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kinds == ["string"]:
        return raw
    s = raw.strip()
    try:
        v = json.loads(s)
    except ValueError:
        if s not in PYTHON:
            return raw
        v = PYTHON[s]
    if kind is None:
        return raw if isinstance(v, str) else v
    return v if _json_type(v) & set(kinds) else raw


PYTHON = {"True": True, "False": False, "None": None}


def _json_type(v) -> set:
    if v is None:
        return {"null"}
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, int):
        return {"integer", "number"}
    if isinstance(v, float):
        return {"number"} | ({"integer"} if v.is_integer() else set())
    return {str: {"string"}, dict: {"object"}, list: {"array"}}[type(v)]


# --------------------------------------------------------------------------------------------------
# the output's side: pieces in, deltas out


class Kind(enum.Enum):
    REASONING = "reasoning"  # text of the reasoning block
    CONTENT = "content"  # text of the answer
    THINK_START = "think_start"  # the <think> token
    THINK_END = "think_end"  # the </think> token
    CALL_OPEN = "call_open"  # the <tool_call> token (text: its spelling)
    CALL_CLOSE = "call_close"  # the </tool_call> token (text: its spelling)


class Piece(NamedTuple):
    kind: Kind
    text: str = ""


class CallDelta(NamedTuple):
    """One delta of a tool call: the first of a call carries its id and name, the rest a piece of its arguments."""
    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass
class Message:
    """What the deltas add up to: reasoning, content (None where there is neither text nor anything else), calls."""
    reasoning: str
    content: str
    tool_calls: list  # [{"id", "type": "function", "function": {"name", "arguments"}}]


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class Parser:
    """One answer's pieces -> deltas ("reasoning", text) | ("content", text) | ("tool_call", CallDelta). With
    Mode.NONE (or no tools) the call markers are content. One newline after <think> and on each side of </think> is
    trimmed; a newline just before a call is the format's (the template writes one there); whitespace between calls
    and after the last one is no content. A block that does not parse, calls an unknown function or is still open at
    the end is content, its markers spelled."""

    def __init__(self, tools: dict | None, choice: Choice = Choice(Mode.NONE), new_id=call_id):
        self.tools = tools or {}
        self.parsing = bool(self.tools) and choice.mode is not Mode.NONE
        self.parallel, self.new_id = choice.parallel, new_id
        self.calls = 0  # calls emitted
        self.trim = None  # the channel whose next text drops a leading newline (after a think marker), or None
        self.held = None  # (channel, "\n"): a trailing newline not sent yet, dropped if </think> or a call follows
        self.block = None  # an open call block: (its <tool_call> spelling after a newline it dropped, the text
        # after it), or None
        self.after = None  # whitespace since the last call, held (None: no call just before)

    def push(self, pieces: list) -> list:
        out = []
        for p in pieces:
            out += self._piece(p)
        return out

    def close(self) -> list:
        """The end of the answer: an open block is content; a held newline is sent; whitespace after a call is not."""
        out = self._unblock()
        self.after = None
        if self.held is not None:
            out.append(self.held)
            self.held = None
        return out

    def _piece(self, p: Piece) -> list:
        k = p.kind
        if self.block is not None and k is Kind.CONTENT:
            self.block = (self.block[0], self.block[1] + p.text)
            return []
        if self.block is not None and k is Kind.CALL_CLOSE:
            (opened, text), self.block = self.block, None
            return self._close(opened, text, p.text)
        if k is Kind.REASONING or k is Kind.CONTENT:
            return self._text(k.value, p.text)
        if k is Kind.THINK_START or k is Kind.THINK_END:
            out = self._unblock()
            self.held, self.after = None, None
            self.trim = "reasoning" if k is Kind.THINK_START else "content"
            return out
        if k is Kind.CALL_OPEN and self.parsing:
            out = self._unblock()  # a block inside a block: the first is content
            lead = ""  # the newline before the call is the format's, unless the block turns out to be content
            if self.held is not None and self.held[0] == "content":
                lead, self.held = "\n", None
            self.after, self.block = None, (lead + p.text, "")
            return out
        return self._text("content", p.text)  # calls not parsed, or a </tool_call> that closes nothing

    def _unblock(self) -> list:
        if self.block is None:
            return []
        (opened, text), self.block = self.block, None
        return self._text("content", opened + text)

    def _close(self, opened: str, text: str, close: str) -> list:
        parsed = self._parse(text)
        if parsed is None:
            return self._text("content", opened + text + close)
        out = [self.held] if self.held is not None else []  # (a reasoning newline: content's was dropped at open)
        self.held, self.after = None, ""
        if not self.parallel and self.calls:
            return out  # parallel_tool_calls false: the first call is kept
        name, args = parsed
        i, self.calls = self.calls, self.calls + 1
        out.append(("tool_call", CallDelta(i, self.new_id(), name, "")))
        pieces = [json.dumps(k, ensure_ascii=False) + ": " + json.dumps(v, ensure_ascii=False) for k, v in args]
        if not pieces:
            return out + [("tool_call", CallDelta(i, None, None, "{}"))]
        for j, s in enumerate(pieces):
            out.append(("tool_call", CallDelta(i, None, None, ("{" if j == 0 else ", ") + s
                                               + ("}" if j == len(pieces) - 1 else ""))))
        return out

    def _parse(self, block: str):
        """A block's text between its markers -> (name, [(key, value)]), or None: it is content."""
        m = BLOCK.fullmatch(block)
        if m is None or m.group(1) not in self.tools:
            return None
        props = self.tools[m.group(1)].parameters.get("properties", {})
        body, args, seen, at = m.group(2), [], set(), 0
        for pm in PARAM.finditer(body):
            key, raw = pm.group(1), pm.group(2)
            if body[at:pm.start()].strip() or key in seen:
                return None
            seen.add(key)
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
            args.append((key, typed(raw, props.get(key))))
            at = pm.end()
        if body[at:].strip():
            return None
        return m.group(1), args

    def _text(self, channel: str, text: str) -> list:
        if not text:
            return []
        if self.trim is not None:
            if self.trim == channel and text.startswith("\n"):
                text = text[1:]
            self.trim = None
            if not text:
                return []
        if self.after is not None:  # right after a call: whitespace waits for what follows it
            if channel == "content" and not text.strip():
                self.after += text
                return []
            text, self.after = self.after + text, None
        out = []
        if self.held is not None:
            out.append(self.held)
            self.held = None
        if text.endswith("\n"):
            text, self.held = text[:-1], (channel, "\n")
        if text:
            out.append((channel, text))
        return out


BLOCK = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.S)
PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def assemble(deltas: list) -> Message:
    """A stream's deltas -> the message they add up to (the non-streamed answer is exactly this)."""
    reasoning, content, calls = [], [], []
    for kind, d in deltas:
        if kind == "reasoning":
            reasoning.append(d)
        elif kind == "content":
            content.append(d)
        elif d.id is not None:
            calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}})
        else:
            calls[d.index]["function"]["arguments"] += d.arguments
    return Message("".join(reasoning), "".join(content), calls)
