"""Chat rendering, shared by both front ends: a conversation -> the prompt's ids (the tokenizer's chat template, image
placeholder blocks spliced in at markers), the checks a prompt text passes, the CLI's chat as it goes (Conversation:
its images, and the ids of its last prompt and answer kept where the template renders them alike), the reasoning
markers, text tokenized in bounded pieces that stop at a limit (BoundedTokenizer: a hostile text costs at most its
limit's ids), and ids -> text as they are decoded (TextStream).
"""
import bisect
import functools
import json
import re
import secrets
from dataclasses import dataclass
from typing import NamedTuple

import image_processing
from runtime import UserError

IMAGE_MARKER = "<image>"  # where a text prompt places an image block; without markers the images lead the text
THINK = ("<think>", "</think>")  # a reasoning block's markers, when the tokenizer holds both as tokens


@dataclass
class Prompt:
    """One request as rank 0 prepared it: ids, and image inputs (a file path, a dict of prepared tensors, or None)."""
    ids: list
    images: str | dict | None = None


def not_utf8(text: str) -> int | None:
    """The position of the first character UTF-8 cannot encode, or None. Such a character is a lone surrogate: a
    JSON \\ud800 escape, or an undecodable byte of a command line or of stdin (Python's surrogateescape); the
    tokenizer refuses it."""
    try:
        text.encode()
        return None
    except UnicodeEncodeError as e:
        return e.start


def literal_image_token(text: str) -> str | None:
    """The first image token the text holds literally, or None: images go in as images, never as their tokens."""
    return next((t for t in image_processing.IMAGE_TOKENS if t in text), None)


def render(tok, messages: list, raw: bool, tools: list | None = None, variables: dict | None = None) -> str:
    """The conversation as the chat template writes it (the generation prompt added): `tools` as the template's
    tools (OpenAI's tool objects), `variables` as more template variables (reasoning_effort, chat_template_kwargs)."""
    if raw:
        return "".join(m["content"] for m in messages)
    if not tok.chat_template:
        raise UserError("the tokenizer has no chat template; use --raw-prompt to tokenize plain text")
    return tok.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True,
                                   **(variables or {}))


def leading_turn(tok, messages: list, tools: list | None = None, variables: dict | None = None) -> str | None:
    """The text every conversation with these leading system messages and tools starts with, as the chat template
    writes it: up to where the first user message's own text would begin (the text two one-letter user turns after
    them have in common). None where there are no system messages and no tools, nothing follows them, or the
    template cannot render them. Agents that share a system prompt and a tool set share this part (the prefix store
    keeps it for them)."""
    lead = []
    for m in messages:
        if m["role"] != "system":
            break
        lead.append(m)
    if not (lead or tools) or len(lead) == len(messages) or not tok.chat_template:
        return None
    try:
        a, b = (tok.apply_chat_template(lead + [{"role": "user", "content": c}], tools=tools or None, tokenize=False,
                                        add_generation_prompt=False, **(variables or {})) for c in "AB")
    except Exception:  # the template's own refusal: no leading part
        return None
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n] or None


# --------------------------------------------------------------------------------------------------
# what a chat template reads, and messages in the shape it reads (STEP5_CHAT.md §1, §4)

# Request fields a template may read as its own variables; the server passes each one given (start-up names those
# the checkpoint's template reads, so a client's default field the template ignores is accepted, not surprising).
TEMPLATE_FIELDS = ("tools", "reasoning_effort", "enable_thinking", "thinking")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


def template_variables(tok) -> frozenset | None:
    """The variables the chat template reads but does not set (jinja's undeclared variables), or None where the
    template does not parse as plain jinja (an extension of transformers' own)."""
    t = tok.chat_template
    return _undeclared(t) if isinstance(t, str) and t else None


@functools.lru_cache(maxsize=8)
def _undeclared(template: str) -> frozenset | None:
    import jinja2
    from jinja2 import meta
    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return frozenset(meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return None


def template_message(m: dict, text, where: str) -> dict:
    """A checked message (its content already text, or parts the template reads) -> the message as the template reads
    it: developer -> system; reasoning (vLLM's name) -> reasoning_content; each tool call's arguments, a JSON string
    as OpenAI clients send them, -> the object the template iterates. ValueError names the field."""
    out = {"role": ROLES[m["role"]], "content": text}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if m["role"] == "tool" and isinstance(m.get("tool_call_id"), str):
        out["tool_call_id"] = m["tool_call_id"]
    if m["role"] != "assistant":
        return out
    r = m.get("reasoning_content", m.get("reasoning"))
    if r is not None:
        if not isinstance(r, str):
            raise ValueError(f"{where}.reasoning_content must be a string")
        out["reasoning_content"] = r
    calls = m.get("tool_calls")
    if calls is None:
        return out
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    out["tool_calls"] = []
    for j, c in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ValueError(f'{at} must be {{"id": ..., "type": "function", "function": {{"name", "arguments"}}}}')
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise ValueError(f"{at}.function.arguments is not JSON ({e})") from None
        if not isinstance(args, dict):
            raise ValueError(f"{at}.function.arguments must be a JSON object")
        out["tool_calls"].append({"id": c.get("id"), "type": "function",
                                  "function": {"name": f["name"], "arguments": args}})
    return out


def splice(tok, rendered: str, blocks: list, raw: bool, marker: str = IMAGE_MARKER) -> list:
    """Rendered text -> its ids, the k-th marker replaced by blocks[k] (an image's placeholder ids); the pieces between
    markers are tokenized apart, so no token spans an image."""
    pieces = rendered.split(marker)
    ids = tok(pieces[0], add_special_tokens=raw)["input_ids"]
    for block, piece in zip(blocks, pieces[1:]):
        ids += block + tok(piece, add_special_tokens=False)["input_ids"]
    return ids


class Span(NamedTuple):
    """A stretch of a conversation's rendered text and the ids that stand for it (each image marker's block in it)."""
    text: str
    ids: list


@dataclass
class Turn:
    """A user turn as Conversation.ask prepared it, not yet part of the conversation: its prompt (the conversation so
    far and this turn), its message, the blocks of every image so far and the spans of the prompt."""
    prompt: Prompt
    message: dict
    blocks: list
    spans: list


class Conversation:
    """A chat as the chat template renders it: its messages, the placeholder blocks of its images, and the spans of
    its last prompt and answer (rank 0 of the CLI; a single --prompt is a conversation of one turn).

    Images: an image sits in its user message as this conversation's own marker, random so that no text holds it (an
    `<image>` in an answer stays text), and each `<image>` a user types stands for one of that turn's images. The
    rendered conversation must hold one marker per image, each then replaced by its image's block; a template that
    drops or repeats a message with an image is refused.

    Ids: the engine reuses a slot's cache for the longest common prefix of a turn's ids with what the slot holds (the
    last prompt and the generated answer). So a turn keeps the ids of each span of the last prompt and answer that
    the template renders byte-identically at its place (the generated ids, which a tokenization of their text may
    split otherwise); from the first span it renders otherwise (a template that drops past reasoning or trims an
    answer), the template's tokenization of the rest wins."""

    def __init__(self, tok, vl, raw: bool):
        self.tok, self.vl, self.raw = tok, vl, raw
        self.marker = f"<image-{secrets.token_hex(8)}>"
        self.reset()

    def reset(self):
        self.messages, self.blocks, self.spans = [], [], []

    def ask(self, text: str, images: list, where: str) -> Turn:
        """A user turn of `text` with image files `images` -> its Turn; UserError names `where`. Each IMAGE_MARKER in
        the text places one of the images; without markers the images come first, in order."""
        tok, vl = self.tok, self.vl
        if not isinstance(text, str):
            raise UserError(f'{where}: "prompt" must be a string, got {type(text).__name__} {text!r}')
        at = not_utf8(text)
        if at is not None:
            raise UserError(f"{where}: the text is not valid UTF-8 (character {at}: {text[at]!r})")
        if tok is None:
            raise UserError(f"{where}: a text prompt needs a tokenizer: none found in <tp-dir>/../tokenizer_files; "
                            "pass --tokenizer")
        if images and vl is None:
            raise UserError(f"{where}: images given but the shards hold a text-only model")
        if images and tok.convert_tokens_to_ids(image_processing.IMAGE_TOKENS[0]) != vl.image_token_id:
            raise UserError(f"the tokenizer's {image_processing.IMAGE_TOKENS[0]} id differs from the config's "
                            f"image_token_id={vl.image_token_id}")
        literal = literal_image_token(text)
        if literal:
            raise UserError(f"{where}: the text holds the image token {literal!r} literally; images go in with "
                            f"--image (or \"images\") and an {IMAGE_MARKER} marker")
        marks = text.count(IMAGE_MARKER)
        if marks and marks != len(images):
            raise UserError(f"{where}: the text holds {marks} {IMAGE_MARKER} marker(s) for {len(images)} image(s)")
        if images and not marks:  # no markers: the images come first in the user turn, in order
            text = IMAGE_MARKER * len(images) + text
        message = {"role": "user", "content": text.replace(IMAGE_MARKER, self.marker)}
        try:
            rendered = render(tok, self.messages + [message], self.raw)
        except UserError:
            raise
        except Exception as e:  # a template that does not compile or raises: jinja's and the tokenizer's own errors
            raise UserError(f"{where}: the tokenizer's chat template failed ({type(e).__name__}: {str(e)[:300]}); "
                            "fix chat_template in the tokenizer files, or use --raw-prompt") from None
        inputs, blocks = None, list(self.blocks)
        if images:
            try:
                batch = image_processing.preprocess([image_processing.load_image(f) for f in images], vl.vision)
                blocks += [image_processing.image_block_ids(tok, lay, vl.vision) for lay in batch.layouts]
            except ValueError as e:  # image_processing: an unreadable file, or a tokenizer without the image tokens
                raise UserError(f"{where}: {e}") from None
            inputs = batch.model_inputs()
        if rendered.count(self.marker) != len(blocks):
            raise UserError(f"{where}: the chat template rendered {rendered.count(self.marker)} image(s) of the "
                            f"conversation's {len(blocks)}: it dropped or repeated a message with an image")
        ids, spans = self._ids(rendered, blocks)
        return Turn(Prompt(ids, inputs), message, blocks, spans)

    def _ids(self, rendered: str, blocks: list) -> tuple[list, list]:
        """The rendered conversation -> (its ids, its spans): the known spans it renders at their places, then the
        rest tokenized (each marker replaced by its block)."""
        ids, spans, at, k = [], [], 0, 0
        for sp in self.spans:
            if not rendered.startswith(sp.text, at):
                break
            ids, at, k = ids + sp.ids, at + len(sp.text), k + sp.text.count(self.marker)
            spans.append(sp)
        rest = rendered[at:]
        rest_ids = splice(self.tok, rest, blocks[k:], self.raw and at == 0, self.marker)
        return ids + rest_ids, spans + [Span(rest, rest_ids)]

    def answered(self, turn: Turn, out: list, eos):
        """The turn and its answer (the generated ids `out`, a stop id of `eos` included when emitted) join the
        conversation. An answer of a VL model that holds an image token (the model may emit one) keeps neither the token
        nor its ids: in a later prompt it would stand for an image that is not there."""
        tok = self.tok
        answer = tok.decode([t for t in out if t not in eos], skip_special_tokens=False)
        literal = self.vl is not None and literal_image_token(answer)
        for t in image_processing.IMAGE_TOKENS if literal else ():
            answer = answer.replace(t, "")
        self.messages = self.messages + [turn.message, {"role": "assistant", "content": answer}]
        self.blocks = turn.blocks
        self.spans = turn.spans + ([] if literal else [Span(tok.decode(out, skip_special_tokens=False), list(out))])


def text_ids(tok, vl, text: str, images: list, where: str, raw: bool) -> Prompt:
    """One user turn (--prompt, a batch request's "prompt") -> its prompt: the chat template applied unless `raw`,
    each IMAGE_MARKER replaced by that image's placeholder block (crops, then the overview), built from the
    tokenizer. UserError names `where`."""
    return Conversation(tok, vl, raw).ask(text, images, where).prompt


def think_ids(tok) -> tuple | None:
    """(<think>, </think>) ids when the tokenizer holds both as tokens, else None (no reasoning split)."""
    ids = tuple(tok.convert_tokens_to_ids(t) for t in THINK)
    if all(isinstance(i, int) and i >= 0 and i != tok.unk_token_id for i in ids):
        return ids
    return None


class TextStream:
    """Incremental detokenization of one request: push(ids) -> the text they complete. Text that ends in an
    unfinished UTF-8 sequence (the replacement character) is held back until the next id completes it; the pieces
    concatenate to tok.decode(all ids), and flush() returns what is left."""

    def __init__(self, tok):
        self.tok, self.ids, self.prefix, self.read = tok, [], 0, 0

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def push(self, ids: list) -> str:
        self.ids += ids
        done = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if text.endswith("\ufffd") or len(text) <= len(done):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]

    def flush(self) -> str:
        done = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]


# --------------------------------------------------------------------------------------------------
# text -> ids in bounded pieces: a long text is refused before most of it is tokenized

PIECE = 16384  # characters of text normalized, pre-tokenized and tokenized at once
EDGE = 64  # a cut stays this many characters away from a window's end and from any added token (see BoundedTokenizer)
MAX_RUN = 4 * PIECE  # a run without a cut point this long (no space, no punctuation) is cut anyway
NORMALIZERS = ("NFC", "NFKC", "NFD", "NFKD")  # normalize(normalize(a) + b) == normalize(a + b): a window's tail carries


class TooManyIds(ValueError):
    """A text gave more ids than its limit; `made`: how many were made before it stopped."""

    def __init__(self, made: int, limit: int):
        super().__init__(f"more than {limit} tokens")
        self.made, self.limit = made, limit


def stable(c: str) -> bool:
    """No Unicode normalization joins c with what comes before it or reorders a mark across it, so a text cut just
    before c normalizes as its two sides do: code points below the combining marks (ASCII, Latin), CJK punctuation and
    ideographs, kana, Hangul syllables, fullwidth forms, emoji. A conservative list, not the Unicode property."""
    o = ord(c)
    return (o < 0x300 or 0x3000 <= o <= 0x3029 or 0x3041 <= o <= 0x3096 or 0x30A0 <= o <= 0x30FF
            or 0x4E00 <= o <= 0x9FFF or 0xAC00 <= o <= 0xD7A3 or 0xFF01 <= o <= 0xFF60 or 0x1F300 <= o <= 0x1FAFF)


def _kinds(node) -> list:
    """The component types of a tokenizer.json normalizer or pre_tokenizer (Sequence flattened)."""
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [k for n in node.get("normalizers", node.get("pretokenizers", [])) for k in _kinds(n)]
    return [node]


class BoundedTokenizer:
    """Text -> the ids the tokenizer gives the whole text, made in pieces of about PIECE characters and stopped as soon
    as they pass a limit: a request's text costs at most its limit + one piece of ids, whatever its length.

    A piece ends where the whole text's pre-tokenization has a boundary too, so the pieces' ids are the whole text's:
    at the start of a pre-token of the window's own pre-tokenization, before a stable() character (normalization does
    not cross it), at least EDGE characters before the window's end and from any added token's string (there, a
    pre-token could continue past the window, or the added-token split gives other pre-tokens than the window's
    regex). That holds for normalizers of NORMALIZERS and pre-tokenizers that split by regex (ByteLevel without a
    prefix space, Split, Digits); another pipeline, or added tokens that strip spaces, is tokenized whole (`whole`
    says why). A run of MAX_RUN characters without such a boundary is cut anyway: its ids may differ at the cut."""

    def __init__(self, tok, piece: int = PIECE):
        self.tok, self.piece = tok, piece
        backend = tok.backend_tokenizer
        spec = json.loads(backend.to_str())
        added = list(backend.get_added_tokens_decoder().values())
        norms = [n["type"] for n in _kinds(spec.get("normalizer"))]
        pres = _kinds(spec.get("pre_tokenizer"))
        self.whole = None  # why this tokenizer's text is tokenized whole, or None
        if any(n not in NORMALIZERS for n in norms):
            self.whole = f"its normalizer ({', '.join(norms)}) is not one of {', '.join(NORMALIZERS)}"
        elif not pres or any(p["type"] not in ("ByteLevel", "Split", "Digits") or p.get("add_prefix_space")
                             or p.get("behavior") == "Removed" for p in pres):
            self.whole = f"its pre-tokenizer ({', '.join(p['type'] for p in pres) or 'none'}) does not split by regex"
        elif any(a.lstrip or a.rstrip or a.single_word for a in added):
            self.whole = "an added token strips spaces or matches single words only"
        self.normalize = backend.normalizer.normalize_str if backend.normalizer is not None else (lambda s: s)
        self.pre_tokenize = backend.pre_tokenizer.pre_tokenize_str if backend.pre_tokenizer is not None else None
        strings = sorted({a.content for a in added}, key=len, reverse=True)
        self.added = re.compile("|".join(map(re.escape, strings))) if strings else None
        self.longest_added = max(map(len, strings), default=0)
        a, b = (tok("a", add_special_tokens=s)["input_ids"] for s in (False, True))
        at = next((i for i in range(len(b) - len(a) + 1) if b[i:i + len(a)] == a), None)
        if at is None:
            self.whole = self.whole or "add_special_tokens changes the text's own ids"
            at = 0
        self.around = (b[:at], b[at + len(a):])  # the ids add_special_tokens puts before and after a text's

    def ids(self, text: str, limit: int, special: bool = False) -> list:
        """text -> its ids (with the tokenizer's special tokens around them when `special`), or TooManyIds once they
        pass `limit`, before the rest of the text is tokenized."""
        if self.whole is not None:
            out = self.tok(text, add_special_tokens=special)["input_ids"]
            if len(out) > limit:
                raise TooManyIds(len(out), limit)
            return out
        head, tail = self.around if special else ([], [])
        out, made = list(head), 0
        rest, at = "", 0  # normalized text not tokenized yet; where the raw text goes on
        while True:
            chunk = text[at:at + self.piece]
            at += len(chunk)
            window = self.normalize(rest + chunk)
            cut = len(window) if at >= len(text) else self._cut(window)
            if cut:
                got = self.tok(window[:cut], add_special_tokens=False)["input_ids"]
                made += len(got)
                out += got
                if len(out) + len(tail) > limit:
                    raise TooManyIds(made, limit)
            rest = window[cut:]
            if at >= len(text) and not rest:
                return out + list(tail)

    def splice(self, rendered: str, blocks: list, marker: str, limit: int) -> list:
        """splice() within a limit: the rendered text's ids, the k-th marker replaced by blocks[k]; TooManyIds as
        soon as they pass `limit`."""
        pieces = rendered.split(marker)
        ids = self.ids(pieces[0], limit)
        for block, piece in zip(blocks, pieces[1:]):
            ids += block
            if len(ids) > limit:
                raise TooManyIds(len(ids), limit)
            ids += self.ids(piece, limit - len(ids))
        return ids

    def _cut(self, window: str) -> int:
        """Where the window's text is cut (what follows waits for the next window), or 0: no cut yet. The latest of:
        an added token's start (the tokenizer splits there first), or a pre-token's start before a stable()
        character, EDGE characters from the window's end and from any added token."""
        margin = max(EDGE, self.longest_added)
        found = [m.span() for m in self.added.finditer(window)] if self.added is not None else []
        starts, ends = [a for a, _ in found], [b for _, b in found]

        def ok(s: int) -> bool:  # a stable character, no added token within the margin
            i = bisect.bisect_left(starts, s + margin)
            return stable(window[s]) and not (i and ends[i - 1] + margin > s)
        last = len(window) - margin
        token = max((a for a in starts if 0 < a <= last), default=0)
        for _, (s, _) in reversed(self.pre_tokenize(window)):
            if s <= token:
                break
            if s <= last and ok(s):
                return s
        if token or len(window) < MAX_RUN:
            return token
        return next((s for s in range(last, 0, -1) if ok(s)), last)  # a run without a boundary: cut anyway
