"""serve.py's requests: a JSON body of one of the APIs -> checked Jobs, or an ApiError in the API's own error shape
naming the field. The OpenAI shapes live here (POST /v1/chat/completions, POST /v1/completions); another API's
request shapes belong here too, beside them, turned into the same Jobs.

Everything here runs in a preparation lane's thread (serve_http.py) and bounds its work before doing it: a text is
tokenized in pieces and refused as soon as its ids pass the context (chat.BoundedTokenizer), an id list is measured
before it is read, an image's size is read from its header and its prepared pixels are counted from its layout
before it is decoded; images are decoded one at a time later (decode_images, in the image lane). A request's
constraint is compiled here too (grammar.Grammars.compile, on its own worker with a time cap), so the engine's own
check finds it in the cache.

Sampling fields (params_of: one home for all of them): temperature, top_p, top_k, min_p, seed, presence_penalty,
frequency_penalty, repetition_penalty, logit_bias, n, logprobs / top_logprobs, echo, response_format,
structured_outputs and the guided_* aliases, thinking_token_budget.
"""
import base64
import binascii
import functools
import io
import json
import math
import secrets
from dataclasses import dataclass, replace

import chat
import choice
import engine as E
import grammar
import image_processing
import runtime as R
import tool_calls
from grammar import Constraint, GrammarError, Kind
from sampling import LOGIT_BIAS_MAX, Sampling

DEFAULT_TEMPERATURE = 1.0  # the OpenAI API's default (the CLI's default is greedy)
MAX_IMAGE_BYTES = 20 << 20  # bytes of one decoded image file
MAX_IMAGE_PIXELS = 50_000_000  # pixels of one image, checked from its header before it is decoded
MAX_IMAGES = 16  # images per request
# Prepared pixels of one request's images (float32 overviews and crops, counted from the layouts before decoding):
# 16 images of 3024 x 3024 (36 crops and an overview each) take 1.86 GB. They stay in memory until the engine loop
# takes the request, so the server holds at most this much of them at once too (serve.Hub.images).
MAX_PREPARED = 2 << 30
MAX_STOP = 4  # stop strings per request (the OpenAI API's limit)
MAX_SALT = 1024  # characters of a cache_salt
REFUSED = {  # OpenAI fields this server does not implement -> the values that change nothing (others: a 400)
    "best_of": (1,), "suffix": (), "functions": ([],), "function_call": ("none", "auto"), "audio": (),
    "modalities": (["text"],), "prediction": (), "web_search_options": (),
}
# The constraint fields, as the request names them -> the constraint kind they give (one per request). vLLM's
# structured_outputs object takes the same keys as its guided_* aliases; response_format is OpenAI's.
GUIDED = {"guided_json": Kind.JSON_SCHEMA, "guided_regex": Kind.REGEX, "guided_choice": Kind.CHOICE,
          "guided_grammar": Kind.GRAMMAR}
STRUCTURED = {"json": Kind.JSON_SCHEMA, "regex": Kind.REGEX, "choice": Kind.CHOICE, "grammar": Kind.GRAMMAR,
              "json_object": Kind.JSON_OBJECT}
ROLES = tuple(chat.ROLES)  # "tool" messages carry results; unknown roles are refused (a template drops them)
MAX_TOOLS = 256  # tools per request (each is rendered into the prompt; the prompt's own bound counts their ids)


# --------------------------------------------------------------------------------------------------
# errors: the API's shape, naming the field


class ApiError(Exception):
    """An answer other than 200: its status, the message, the field it names and a code. 5xx are server_error."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def shown(v, n: int = 80) -> str:
    """A value as a message quotes it: JSON (strings in double quotes), cut to n characters."""
    text = json.dumps(v, ensure_ascii=False)
    return text if len(text) <= n else text[:n] + "..."


def parse_body(data: bytes, model_name: str) -> dict:
    """A request body -> its JSON object, checked for the fields every endpoint shares."""
    try:
        body = json.loads(data)
    except RecursionError:
        raise bad(None, "the request body nests JSON too deeply") from None
    except ValueError as e:  # not JSON, not UTF-8, an integer of more than 4300 digits
        raise bad(None, f"the request body is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    m = body.get("model")
    if m is not None and m != model_name:
        raise ApiError(404, f"model {shown(m)} does not exist; this server serves {shown(model_name)}", "model",
                       "model_not_found")
    for name, ok in REFUSED.items():
        v = body.get(name)
        if v is not None and not any(_is(v, x) for x in ok):
            raise bad(name, f"{name}={shown(v)} is not supported by this server", "unsupported_parameter")
    return body


# --------------------------------------------------------------------------------------------------
# Jobs: one engine request each


@dataclass
class Job:
    """One checked choice of a request: what the engine runs, and how its answer is written."""
    ids: list
    images: dict | None  # prepared image tensors (image_processing.ImageBatch.model_inputs), or None
    max_tokens: int
    sampling: Sampling  # this choice's (Params.sampling.derived(j) for choice j of n)
    stop_ids: frozenset  # EOS ids (none with ignore_eos)
    stop: list  # stop strings
    stream: bool = False
    include_usage: bool = False
    token_ids: bool = False  # return_token_ids
    chat: bool = True
    reasoning: bool = False  # the prompt leaves a <think> block open: the answer starts in reasoning_content
    index: int = 0  # its choice's index: prompt * n + j (a completions request may hold a list of prompts)
    pending: list | None = None  # images opened (header read), decoded by decode_images
    image_bytes: int = 0  # their prepared pixels' bytes (held against serve.Hub.images until the engine takes them)
    n: int = 1  # choices per prompt (the usage counts each prompt once)
    logprobs: int | None = None  # top alternatives reported per token (engine.Request.logprobs); None: no logprobs
    echo: bool = False  # completions: the answer's text (and its logprobs) start with the prompt's
    echo_text: str = ""  # the prompt's text, as echo writes it
    constraint: Constraint | None = None  # compiled already (Grammars.compile): the engine's check is a cache hit
    think: choice.Reasoning | None = None  # the prompt's open reasoning block as the engine takes it (end, budget)
    cache_salt: str | None = None  # prefixes are shared only with requests of the same salt (engine.Request's)
    share: int = 0  # leading prompt ids other requests likely share (a system turn with its tools; engine.Request's)
    tools: dict | None = None  # name -> tool_calls.Tool: the answer's calls are parsed (chat)
    tool_choice: tool_calls.Choice = tool_calls.Choice(tool_calls.Mode.NONE)


@dataclass
class Limits:
    """What a request is checked against (rank 0)."""
    context: int  # prompt + max_tokens (the engine's max_context, less a speculative step's extra rows)
    vocab: int
    default_max_tokens: int
    image_token: int | None  # the placeholder id (None: a text-only model)
    vision: object  # the VisionConfig, or None
    max_prompts: int  # choices of one request, n per prompt (each takes a place: --max-batch + --max-queue)
    grammars: grammar.Grammars | None = None  # the engine's (rank 0's): a constraint compiles into its cache


def _is(v, ok) -> bool:
    return type(v) is type(ok) and v == ok


def _int(body: dict, name: str, lo: int | None = None):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"{name} must be an integer, got {shown(v)}")
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
        raise bad(name, f"{name} must be a finite number, got {shown(v, 40)}")
    return f


def _bool(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be true or false, got {shown(v)}")
    return v


@dataclass(frozen=True)
class Params:
    """A body's sampling fields as the engine takes them (params_of). Choice j of n draws with sampling.derived(j)."""
    sampling: Sampling
    n: int = 1
    logprobs: int | None = None  # top alternatives per token (0..choice.TOP); None: no logprobs
    echo: bool = False  # completions only
    constraint: Constraint | None = None  # not compiled yet (compiled: compile_constraint)
    budget: int | None = None  # thinking_token_budget (0: no reasoning; None: no cap)


def params_of(body: dict, lim: Limits, chat: bool) -> Params:
    """Every sampling field of a request body, checked (a 400 names the field) -> Params. The constraint is checked
    for shape here and compiled by compile_constraint."""
    n = _int(body, "n", 1)
    n = 1 if n is None else n
    if n > lim.max_prompts:
        raise bad("n", f"n={n}: a request's choices take a place each; this server holds at most {lim.max_prompts}")
    if chat:
        want = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0)
        if top is not None and top > choice.TOP:
            raise bad("top_logprobs", f"top_logprobs {top} must be in [0, {choice.TOP}]")
        if top and not want:
            raise bad("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (top or 0) if want else None
        if _bool(body, "echo"):
            raise bad("echo", "echo is a completions field (the chat API has none)", "unsupported_parameter")
    else:
        if body.get("top_logprobs") is not None:
            raise bad("top_logprobs", "top_logprobs is a chat field; completions take logprobs: K (0..20)")
        logprobs = _int(body, "logprobs", 0)
        if logprobs is not None and logprobs > choice.TOP:
            raise bad("logprobs", f"logprobs {logprobs} must be in [0, {choice.TOP}]")
    budget = _int(body, "thinking_token_budget", 0)
    if budget is not None and budget >= 2 ** 31:
        raise bad("thinking_token_budget", f"thinking_token_budget {budget} must be < 2**31")
    return Params(sampling_of(body, lim), n, logprobs, False if chat else _bool(body, "echo"), constraint_of(body),
                  budget)


def sampling_of(body: dict, lim: Limits) -> Sampling:
    t = _num(body, "temperature", DEFAULT_TEMPERATURE)
    top_p = _num(body, "top_p", 1.0)
    top_k = body.get("top_k")
    top_k = 0 if top_k is None or _is(top_k, -1) else top_k  # -1: "off", as other servers spell it
    seed = body.get("seed")
    s = Sampling(t, top_k, top_p, secrets.randbits(63) if seed is None else seed, _num(body, "min_p", 0.0),
                 _num(body, "presence_penalty", 0.0), _num(body, "frequency_penalty", 0.0),
                 _num(body, "repetition_penalty", 1.0), logit_bias_of(body, lim))
    p = None
    if t == 0:  # greedy: top_p / top_k / min_p restrict nothing (clients send them beside it), but are checked as given
        p = replace(s, temperature=1.0).problem()
        s = replace(s, top_k=0, top_p=1.0, min_p=0.0)
    p = p or s.problem()
    if p:
        raise bad(p.split()[0], p)  # problem() names the field first
    return s


def logit_bias_of(body: dict, lim: Limits) -> dict | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} (ids as JSON keys are strings) -> {id: bias}."""
    v = body.get("logit_bias")
    if v is None or v == {}:
        return None
    if not isinstance(v, dict):
        raise bad("logit_bias", f"logit_bias must be an object of token id to bias, got {shown(v)}")
    if len(v) > LOGIT_BIAS_MAX:
        raise bad("logit_bias", f"logit_bias holds {len(v)} entries; at most {LOGIT_BIAS_MAX}")
    out = {}
    for k, b in v.items():
        t = int(k) if k.isascii() and k.isdigit() and len(k) < 12 else -1
        if not 0 <= t < lim.vocab:
            raise bad("logit_bias", f"logit_bias: {shown(k, 20)} is not a token id in [0, {lim.vocab})")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise bad("logit_bias", f"logit_bias[{shown(k, 20)}] = {shown(b, 20)} must be a number in [-100, 100]")
        out[t] = float(b)
    return out


def constraint_of(body: dict) -> Constraint | None:
    """The request's constraint: response_format (json_object, json_schema), vLLM's structured_outputs object, or a
    guided_* alias; at most one of them."""
    got = []
    rf = body.get("response_format")
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_object":
            got.append(Constraint(Kind.JSON_OBJECT, field="response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise bad("response_format", "response_format json_schema needs json_schema: {\"name\": ..., "
                          "\"schema\": {...}, \"strict\": true}")
            strict = js.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise bad("response_format", "response_format.json_schema.strict must be true or false")
            got.append(_spec(Kind.JSON_SCHEMA, js["schema"], "response_format", bool(strict)))
        elif kind != "text":
            raise bad("response_format", "response_format.type must be \"text\", \"json_object\" or "
                      f"\"json_schema\", got {shown(kind)}")
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("structured_outputs", f"structured_outputs must be an object, got {shown(so)}")
        for k, v in so.items():
            if k not in STRUCTURED and v not in (None, False):
                raise bad(f"structured_outputs.{k}", f"structured_outputs.{k} is not supported by this server "
                          f"(supported: {', '.join(STRUCTURED)})", "unsupported_parameter")
        for k, kind in STRUCTURED.items():
            v = so.get(k)
            if v is not None and v is not False:
                got.append(_spec(kind, v, f"structured_outputs.{k}"))
    for k, kind in GUIDED.items():
        if body.get(k) is not None:
            got.append(_spec(kind, body[k], k))
    if len(got) > 1:
        raise bad(got[1].field, f"{got[1].field}: a request takes one constraint, and {got[0].field} gives one "
                  "already")
    return got[0] if got else None


def _spec(kind: Kind, v, field: str, strict: bool = True) -> Constraint:
    """One constraint field's value -> its Constraint (its shape checked; compiled later)."""
    try:
        if kind == Kind.JSON_SCHEMA:
            return Constraint.json_schema(v, strict, field)
        if kind == Kind.CHOICE:
            return Constraint.choice(v, field)
    except GrammarError as e:
        raise bad(field, str(e)) from None
    if kind == Kind.JSON_OBJECT:
        if v is not True:
            raise bad(field, f"{field} must be true, got {shown(v)}")
        return Constraint(kind, field=field)
    if not isinstance(v, str) or not v:
        raise bad(field, f"{field} must be a non-empty string, got {shown(v)}")
    return Constraint(kind, v, True, field)


def compile_constraint(c: Constraint | None, lim: Limits, stop_ids: frozenset):
    """The constraint compiled into the engine's cache, on the grammars' worker within its time cap (this thread
    waits): a 400 naming the field when it cannot compile, or not in time."""
    if c is None:
        return
    if lim.grammars is None:
        raise bad(c.field, f"{c.field}: this server has no tokenizer view for constrained decoding",
                  "unsupported_parameter")
    if not stop_ids:
        raise bad("ignore_eos", f"ignore_eos: a constrained answer ends at EOS ({c.field} gives one)")
    try:
        lim.grammars.compile(c)
    except GrammarError as e:
        raise bad(c.field, str(e)) from None


def stops_of(body: dict) -> list:
    v = body.get("stop")
    if v is None:
        return []
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v) or len(v) > MAX_STOP:
        raise bad("stop", f"stop must be a non-empty string or a list of at most {MAX_STOP} of them, got "
                  f"{shown(body['stop'])}")
    return v


def max_tokens_of(body: dict, n_prompt: int, lim: Limits, prompt_param: str, echo: bool = False) -> int:
    """max_tokens (or max_completion_tokens), >= 1; 0 with echo (the prompt's logprobs alone)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    n = _int(body, name, 0 if echo else 1)
    left = lim.context - n_prompt
    if n is None:
        if left < 1:
            raise too_long(prompt_param, f"({n_prompt} tokens) leaves no room", lim)
        return min(left, lim.default_max_tokens)
    if n > left:
        raise bad(name, f"the prompt ({n_prompt} tokens) + {name} {n} exceed the context of {lim.context} tokens",
                  "context_length_exceeded")
    return n


def too_long(param: str, what: str, lim: Limits) -> ApiError:
    return bad(param, f"{param} {what} in the context of {lim.context} tokens (prompt + max_tokens)",
               "context_length_exceeded")


def jobs_of(body: dict, prompts: list, lim: Limits, eos: list, chat: bool, think: tuple | None = None,
            forced: Constraint | None = None) -> list:
    """A request's prompts [(ids, the field that gave them, its echo text, it opened a reasoning block)] -> a Job per
    choice, n per prompt, choice j of prompt i at index i * n + j with the sampling's stream j (seed + j). forced:
    the constraint tool_choice makes (a request takes one constraint)."""
    p = params_of(body, lim, chat)
    if forced is not None and p.constraint is not None:
        raise bad("tool_choice", f"tool_choice {shown(body.get('tool_choice'), 60)} forces a call, and "
                  f"{p.constraint.field} constrains the answer too: a request takes one of them")
    p = replace(p, constraint=forced or p.constraint)
    if len(prompts) * p.n > lim.max_prompts:
        raise bad("n", f"{len(prompts)} prompt(s) x n={p.n} choices: this server takes at most {lim.max_prompts} "
                  "at once")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict)):
        raise bad("stream_options", "stream_options is only allowed with stream: true, as an object")
    usage = _bool(opts or {}, "include_usage")
    stop_ids = frozenset() if _bool(body, "ignore_eos") else frozenset(eos)
    stops, token_ids, salt = stops_of(body), _bool(body, "return_token_ids"), salt_of(body)
    if p.budget is not None and not (think and any(r for *_, r in prompts)):
        raise bad("thinking_token_budget", "thinking_token_budget applies to a chat whose template opens a "
                  "reasoning block (<think>); this prompt opens none")
    jobs = []
    for i, (ids, param, text, reasoning) in enumerate(prompts):
        n_max = max_tokens_of(body, len(ids), lim, param, p.echo)
        r = choice.Reasoning(think[1], p.budget) if reasoning else None
        for j in range(p.n):
            jobs.append(Job(ids, None, n_max, p.sampling.derived(j), stop_ids, stops, stream, usage, token_ids, chat,
                            reasoning, i * p.n + j, n=p.n, logprobs=p.logprobs, echo=p.echo,
                            echo_text=text if p.echo else "", constraint=p.constraint, think=r, cache_salt=salt))
    compile_constraint(p.constraint, lim, stop_ids)  # last: the cheap checks first
    return jobs


def salt_of(body: dict) -> str | None:
    """cache_salt (vLLM's name): a tenant's string; a request shares cached prefixes only with requests of the same
    salt (none with none)."""
    v = body.get("cache_salt")
    if v is None:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= MAX_SALT:
        raise bad("cache_salt", f"cache_salt must be a string of 1 to {MAX_SALT} characters, got {shown(v, 40)}")
    return v


def check_text(text: str, param: str):
    """A prompt text must encode as UTF-8 (chat.not_utf8) and hold no image token literally."""
    at = chat.not_utf8(text)
    if at is not None:
        raise bad(param, f"{param} is not valid Unicode: a lone surrogate {text[at]!r} at character {at}")
    literal = chat.literal_image_token(text)
    if literal:
        raise bad(param, f"{param} holds the image token {shown(literal)} literally; images go in image_url parts")


def text_ids(btok: chat.BoundedTokenizer, text: str, param: str, lim: Limits) -> list:
    """A completions prompt's text -> its ids (the tokenizer's special tokens around them, as generate.py
    --raw-prompt), refused as soon as they pass the context."""
    check_text(text, param)
    try:
        return btok.ids(text, lim.context - 1, special=True)
    except chat.TooManyIds as e:
        raise too_long(param, f"has more than {e.limit} tokens: no room", lim) from None


def ids_of(p: list, param: str, lim: Limits) -> list:
    """A prompt of token ids, its length checked before any id is read."""
    if not p:
        raise bad(param, f"{param} gives no tokens")
    if len(p) >= lim.context:
        raise too_long(param, f"({len(p)} tokens) leaves no room", lim)
    if not all(type(t) is int for t in p):
        i = next(i for i, t in enumerate(p) if type(t) is not int)
        raise bad(param, f"{param}: position {i} is {shown(p[i], 40)}, not a token id")
    if min(p) < 0 or max(p) >= lim.vocab:
        i, t = next((i, t) for i, t in enumerate(p) if not 0 <= t < lim.vocab)
        raise bad(param, f"{param}: token id {t} (position {i}) is outside the vocabulary [0, {lim.vocab})")
    if lim.image_token is not None and lim.image_token in p:
        raise bad(param, f"{param}: token id {lim.image_token} (position {p.index(lim.image_token)}) is the image "
                  "placeholder; images go in chat image_url parts")
    return p


def completion_jobs(body: dict, btok: chat.BoundedTokenizer, lim: Limits, eos: list) -> list:
    """A completions request -> a Job per prompt. prompt takes the four OpenAI forms: a string, a list of strings, a
    list of token ids, a list of lists of token ids."""
    p = body.get("prompt")
    if isinstance(p, str) or isinstance(p, list) and p and type(p[0]) is int:
        prompts = [("prompt", p)]
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        if len(p) > lim.max_prompts:
            raise bad("prompt", f"{len(p)} prompts: this server takes at most {lim.max_prompts} at once")
        prompts = [(f"prompt[{i}]", x) for i, x in enumerate(p)]
    else:
        raise bad("prompt", "prompt must be a non-empty string, a list of strings, a list of token ids or a list of "
                  f"lists of token ids, got {shown(p)}")
    got = []
    for param, x in prompts:
        ids = text_ids(btok, x, param, lim) if isinstance(x, str) else ids_of(x, param, lim)
        if not ids:
            raise bad(param, f"{param} gives no tokens")
        echo = x if isinstance(x, str) else None  # ids: decoded only if echo asks (below)
        got.append((ids, param, echo, False))
    if _bool(body, "echo"):
        got = [(ids, param, btok.tok.decode(ids, skip_special_tokens=False) if echo is None else echo, r)
               for ids, param, echo, r in got]
    return jobs_of(body, got, lim, eos, False)


# --------------------------------------------------------------------------------------------------
# chat requests and their images


def open_image(url, param: str, lim: Limits):
    """A base64 data: URL -> an undecoded PIL image (its header read: size and format known)."""
    from PIL import Image, UnidentifiedImageError
    if lim.vision is None:
        raise bad(param, "this server's model is text-only: it takes no images")
    if not isinstance(url, str) or not url.startswith("data:"):
        what = "an http(s) URL" if isinstance(url, str) and url.startswith(("http://", "https://")) else shown(url, 60)
        raise bad(param, f"{param} is {what}: images are never fetched; send a base64 data: URL "
                  "(data:image/png;base64,...)")
    head, _, data = url.partition(",")
    if head not in ("data:image/png;base64", "data:image/jpeg;base64", "data:image/jpg;base64"):
        raise bad(param, f"{param}: expected data:image/png;base64,... or data:image/jpeg;base64,..., got "
                  f"{shown(head, 60)}")
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


def chat_jobs(body: dict, btok: chat.BoundedTokenizer, lim: Limits, eos: list, think: tuple | None) -> list:
    """A chat request -> its Jobs (n choices): the conversation (tools, tool calls and results, past reasoning
    included) normalised for the chat template (chat.template_message) and rendered by it, each image part's
    placeholder block spliced in where the part was (a marker no text holds), its ids refused as soon as they pass
    the context; the images opened (their headers read), decoded later by decode_images; tool_choice's grammar
    compiled."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "messages must be a non-empty list")
    marker = f"<image-{secrets.token_hex(8)}>"
    conv, images = [], []
    for i, m in enumerate(msgs):
        at = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise bad(f"{at}.role", f"{at}.role must be one of {list(ROLES)}, got {shown(role, 40)}")
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
                    if len(images) == MAX_IMAGES:
                        raise bad("messages", f"more than {MAX_IMAGES} images: at most {MAX_IMAGES} per request")
                    u = part.get("image_url")
                    images.append(open_image(u.get("url") if isinstance(u, dict) else u, f"{pat}.image_url.url", lim))
                    text += marker
                else:
                    raise bad(f"{pat}.type", f"{pat}: expected a text part or (in a user message) an image_url "
                              f"part, got {shown(part)}")
        else:
            raise bad(f"{at}.content", f"{at}.content must be a string or a list of parts")
        for k in ("reasoning_content", "reasoning"):
            if isinstance(m.get(k), str):
                check_text(m[k], f"{at}.{k}")
        try:
            conv.append(chat.template_message(m, text, at))
        except ValueError as e:
            raise bad(str(e).split()[0], str(e)) from None
    if conv[-1]["role"] not in ("user", "tool"):
        raise bad(f"messages[{len(conv) - 1}].role", "the last message must be the user's or a tool's result")
    tools, tool_choice, forced = tools_of(body, btok.tok)
    variables = template_variables_of(body)
    try:
        rendered = chat.render(btok.tok, conv, raw=False, tools=body.get("tools") if tools else None,
                               variables=variables)
    except R.UserError as e:
        raise ApiError(500, str(e), None, "no_chat_template") from None
    except Exception as e:  # the template's own errors (jinja, raise_exception) name what it refuses
        raise bad("messages", f"the chat template refused the conversation: {e}") from None
    if rendered.count(marker) != len(images):
        raise bad("messages", "the chat template dropped an image part")
    geo = image_processing.geometry(lim.vision) if images else None
    layouts = [image_processing.plan(*im.size, geo) for im in images]
    prepared = sum(4 * 3 * (geo.overview ** 2 + lay.n_crops * geo.crop ** 2) for lay in layouts)
    if prepared > MAX_PREPARED:
        raise bad("messages", f"the images prepare to {prepared / 2 ** 30:.1f} GiB of pixels (overviews and crops); "
                  f"a request's images may take at most {MAX_PREPARED / 2 ** 30:.0f} GiB", "image_too_large")
    try:
        blocks = [image_processing.image_block_ids(btok.tok, lay, lim.vision) for lay in layouts]
    except ValueError as e:  # a tokenizer without the image tokens
        raise ApiError(500, str(e), None, "no_image_tokens") from None
    try:
        ids = btok.splice(rendered, blocks, marker, lim.context - 1)
    except chat.TooManyIds as e:
        raise too_long("messages", f"have more than {e.limit} tokens: no room", lim) from None
    reasoning = think is not None and _last(ids, think[0]) > _last(ids, think[1])
    jobs = jobs_of(body, [(ids, "messages", "", reasoning)], lim, eos, True, think, forced)  # before any pixel
    lead = chat.leading_turn(btok.tok, conv, body.get("tools") if tools else None, variables)
    share = (E.common_prefix(lead_ids(btok, lead, lim.context), ids)
             if lead and marker not in lead and rendered.startswith(lead) else 0)
    for job in jobs:
        job.tools, job.tool_choice, job.share = tools, tool_choice, share
    jobs[0].pending, jobs[0].image_bytes = images or None, prepared  # the first choice's: decoded once, shared
    return jobs


@functools.lru_cache(maxsize=32)  # distinct system turns kept: agents resend theirs with every request
def lead_ids(btok: chat.BoundedTokenizer, text: str, limit: int) -> tuple:
    """A chat's system turn (chat.leading_turn) tokenized, once per distinct turn among the last 32."""
    return tuple(btok.ids(text, limit))


def tools_of(body: dict, tok) -> tuple:
    """A chat body's tools, tool_choice and parallel_tool_calls -> (name -> tool_calls.Tool or None, the Choice, the
    grammar a forced call needs or None). The template must read `tools` to be given any."""
    given = body.get("tools")
    if given is not None and not (isinstance(given, list) and len(given) <= MAX_TOOLS):
        raise bad("tools", f"tools must be a list of at most {MAX_TOOLS} tools")
    try:
        tools = tool_calls.tools_of(given or [])
        how = tool_calls.choice_of(body.get("tool_choice"), body.get("parallel_tool_calls"), tools)
    except ValueError as e:
        raise bad(str(e).split()[0], str(e)) from None
    if not tools:
        return None, how, None
    reads = chat.template_variables(tok)
    if reads is not None and "tools" not in reads:
        raise bad("tools", "tools: this checkpoint's chat template does not render tools (it reads no `tools` "
                  "variable)", "unsupported_parameter")
    ids = tool_calls.call_ids(tok)
    if ids is None:
        raise bad("tools", f"tools: the tokenizer has no {' / '.join(tool_calls.CALL)} tokens, so no call could be "
                  "parsed", "unsupported_parameter")
    try:
        return tools, how, tool_calls.constraint(tools, how, ids)
    except GrammarError as e:
        raise bad("tool_choice", str(e)) from None


def template_variables_of(body: dict) -> dict:
    """reasoning_effort and chat_template_kwargs -> the template's variables (a template that does not read one
    ignores it; start-up says which it reads). chat_template_kwargs may not replace what the server renders."""
    out = {}
    effort = body.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str) or len(effort) > 32:
            raise bad("reasoning_effort", f"reasoning_effort must be a short string (low, medium, high), got "
                      f"{shown(effort)}")
        out["reasoning_effort"] = effort
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, dict):
            raise bad("chat_template_kwargs", "chat_template_kwargs must be an object of template variables")
        for k in kw:
            if not k.isidentifier() or k in ("messages", "tools", "add_generation_prompt", "tokenize", "documents",
                                             "continue_final_message", "return_dict", "chat_template"):
                raise bad("chat_template_kwargs", f"chat_template_kwargs: {shown(k, 40)} is not a variable a "
                          "request may set")
        out.update(kw)
    return out


def decode_images(job: Job, lim: Limits):
    """The image lane: a Job's images decoded one at a time (each freed once prepared) into job.images."""
    def decoded(images: list):
        while images:
            im = images.pop(0)
            im.load()  # decode now: a truncated file fails here
            yield im
    try:
        job.images = image_processing.preprocess(decoded(job.pending), lim.vision).model_inputs()
    except (OSError, ValueError) as e:
        raise bad("messages", f"an image could not be decoded ({e})") from None
    job.pending = None


def _last(ids: list, t: int) -> int:
    return max((i for i, x in enumerate(ids) if x == t), default=-1)
