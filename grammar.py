"""Constrained decoding: a request's constraint (a JSON schema, any JSON object, a regex, a choice of strings, a Lark
or EBNF grammar) compiled for the checkpoint's tokenizer by llguidance, and each request's matcher, which fills its
rows of the token bitmask the engine's choose step applies (engine.py says when; choice.py applies it).

    grammars = Grammars("OUT/tokenizer_files/tokenizer.json", vocab_size=128896, eos_id=4)
    compiled = grammars.compile(Constraint.json_schema({"type": "object"}))  # off the engine loop: GrammarError
    m = grammars.matcher(compiled, stop_ids=frozenset({4}))                 # one per request

Why llguidance (PERF_LOG "grammar libraries at the real vocabulary"): its resource caps are fuel counts, not clocks,
so a grammar that is too large or too slow fails the same way on every rank, and each rank can run its own matcher
without a per-step broadcast; it compiles a JSON schema in 0.7-6 ms at a 128,896-token vocabulary (xgrammar: 64-72
ms), has no runtime dependencies, reads Lark natively and masks draft tokens. Its masks cost more than xgrammar's
(means of 74-111 us a token against 21-107 us, p99 up to ~2 ms while a pattern's lexer states are first built), which
the forward of the next step hides.

The tokenizer view spans the model's whole vocabulary (ids the tokenizer has no token for are never allowed) and is
built once per process on the first compile (~2 s and ~200 MB at 128,896 tokens). Special tokens (the chat markers,
EOS) are never allowed inside a grammar's text; the request's stop ids are allowed exactly where the grammar may end.
JSON is compact but for one space after ',' and ':' (Python's json.dumps): flexible whitespace lets a model write
whitespace forever.
"""
import collections
import enum
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import numpy as np
import torch

# The caps of one grammar (llguidance's ParserLimits). Fuel is counted, not timed, so every rank reaches the same
# verdict. Compile: ~20 ms of lexer fuel (50k/ms), 50,000 lexer states (~1-2 kB each: <= ~100 MB), 200,000 grammar
# symbols. A step: llguidance's defaults (~14 ms of lexer fuel, 50,000 Earley items); a step past them ends its
# request with an error that names the grammar.
LIMITS = dict(initial_lexer_fuel=1_000_000, max_lexer_states=50_000, max_grammar_size=200_000,
              step_lexer_fuel=200_000, step_max_items=50_000, verbose_errors=False)
COMPILE_TIMEOUT_S = 10.0  # a front end's wait for one compile (the fuel caps bound it too)
CACHE = 64  # compiled grammars kept (least recently used dropped first)
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Kind(str, enum.Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    REGEX = "regex"  # spec: the regex (Rust regex syntax, anchored at both ends)
    CHOICE = "choice"  # spec: a JSON list of the strings allowed
    GRAMMAR = "grammar"  # spec: a Lark grammar (llguidance's dialect) or a GBNF/EBNF one (rules written `::=`)
    __str__ = str.__str__


class GrammarError(ValueError):
    """A constraint that cannot be compiled, or not within the caps or in time: the message names the request field
    it came from (front ends answer it as a 400 naming that field)."""


@dataclass(frozen=True)
class Constraint:
    """One request's constraint, as a front end builds it (hashable and picklable: the compile cache's key, and what
    rank 0 sends to the other ranks). strict (json_schema): a schema keyword the compiler does not implement is an
    error; else it is ignored. field: the request field it came from, named in errors ("response_format",
    "structured_outputs.regex", ...)."""
    kind: Kind
    spec: str = ""
    strict: bool = True
    field: str = "response_format"

    @staticmethod
    def json_schema(schema, strict: bool = True, field: str = "response_format") -> "Constraint":
        """A schema (a dict or its JSON text); its text is normalised so that equal schemas share a compile."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"{field}: the schema is not JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"{field}: the schema must be a JSON object, got {type(schema).__name__}")
        return Constraint(Kind.JSON_SCHEMA, json.dumps(schema, sort_keys=True), strict, field)

    @staticmethod
    def choice(options, field: str = "structured_outputs.choice") -> "Constraint":
        if not isinstance(options, (list, tuple)) or not options or not all(isinstance(o, str) for o in options):
            raise GrammarError(f"{field}: the choice must be a non-empty list of strings")
        return Constraint(Kind.CHOICE, json.dumps(list(options)), True, field)


class Compiled:
    """A compiled constraint: a fresh matcher that each request's matcher copies (never advanced itself)."""

    def __init__(self, constraint: Constraint, proto):
        self.constraint, self.proto = constraint, proto


def _grammar_text(c: Constraint) -> str:
    """The constraint as an llguidance grammar (its JSON form); GrammarError for what its compilers refuse early."""
    import llguidance as L
    if c.kind == Kind.JSON_OBJECT:
        return L.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if c.kind == Kind.JSON_SCHEMA:
        return L.LLMatcher.grammar_from_json_schema(c.spec, defaults={**JSON_OPTIONS, "lenient": not c.strict})
    if c.kind == Kind.REGEX:
        return L.LLMatcher.grammar_from_regex(c.spec)
    if c.kind == Kind.CHOICE:  # Lark string literals take JSON's escapes
        return L.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in json.loads(c.spec)))
    if c.kind == Kind.GRAMMAR:
        if "::=" in c.spec:  # GBNF / EBNF rules: llguidance's converter writes them as Lark
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                return L.LLMatcher.grammar_from_lark(gbnf_to_lark(c.spec))
            except Exception as e:  # the converter's own parse errors
                raise GrammarError(f"{c.field}: the EBNF grammar does not parse ({str(e).splitlines()[0]})") from None
        return L.LLMatcher.grammar_from_lark(c.spec)
    raise GrammarError(f"{c.field}: unknown constraint kind {c.kind!r}")


class Grammars:
    """One per process: the tokenizer view (built on the first compile), the caps, and an LRU of compiled grammars.
    compile() is for a front end's thread (off the engine loop, with a wait cap); compiled() for the engine (the same
    cache; compiling a constraint another rank has already compiled in bounded fuel)."""

    def __init__(self, tokenizer_file: str, vocab_size: int, eos_id: int, cache: int = CACHE,
                 timeout_s: float = COMPILE_TIMEOUT_S):
        self.tokenizer_file, self.vocab_size, self.eos_id = tokenizer_file, vocab_size, eos_id
        self.words = (vocab_size + 31) // 32  # int32 words of a bitmask row
        self.cache, self.timeout_s = cache, timeout_s
        self._view, self._lru, self._lock = None, collections.OrderedDict(), threading.Lock()
        self._pool = None
        self.compiles = 0  # grammars compiled (cache misses), for tests and metrics

    def view(self):
        """The llguidance tokenizer over the model's vocabulary (built once)."""
        with self._lock:
            if self._view is None:
                import llguidance as L
                self._view = L.LLTokenizer(self.tokenizer_file, n_vocab=self.vocab_size, eos_token=self.eos_id)
            return self._view

    def _build(self, c: Constraint) -> Compiled:
        import llguidance as L
        text = _grammar_text(c)
        proto = L.LLMatcher(self.view(), text, log_level=0, limits=L.LLParserLimits(**LIMITS))
        if proto.is_error():
            raise GrammarError(f"{c.field}: the {c.kind} cannot be compiled: {proto.get_error().strip()[:500]}")
        return Compiled(c, proto)

    def compiled(self, c: Constraint) -> Compiled:
        """The compiled constraint from the cache, else compiled now in this thread (GrammarError)."""
        if not isinstance(c, Constraint):
            raise GrammarError(f"constraint must be a grammar.Constraint, got {type(c).__name__}")
        with self._lock:
            if c in self._lru:
                self._lru.move_to_end(c)
                return self._lru[c]
        got = self._build(c)
        with self._lock:
            self.compiles += 1
            self._lru[c] = got
            while len(self._lru) > self.cache:
                self._lru.popitem(last=False)
        return got

    def compile(self, c: Constraint, timeout_s: float | None = None) -> Compiled:
        """compiled(c) on a worker thread, waiting at most timeout_s (default: the Grammars'): GrammarError when it
        cannot compile or takes longer (the worker then finishes within its fuel and the result is cached)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(2, thread_name_prefix="grammar")
        wait = self.timeout_s if timeout_s is None else timeout_s
        try:
            return self._pool.submit(self.compiled, c).result(timeout=wait)
        except FutureTimeout:
            raise GrammarError(f"{c.field}: the {c.kind} did not compile within {wait:g} s") from None

    def matcher(self, compiled: Compiled, stop_ids: frozenset, think_end: int | None = None) -> "Matcher":
        return Matcher(self, compiled, stop_ids, think_end)


class Status(enum.Enum):
    OK = "ok"
    DEAD_END = "dead end"  # no token allowed: the grammar cannot go on (or hit a cap)


class Matcher:
    """One request's grammar state on this rank (deterministic: every rank's agrees). Before think_end (when the
    prompt opened a reasoning block) the request reasons unconstrained but may not stop; after it, the grammar
    applies. advance() takes the tokens a step emitted; fill() writes the masks of the next step's positions."""

    def __init__(self, grammars: Grammars, compiled: Compiled, stop_ids: frozenset, think_end: int | None):
        self.g, self.constraint = grammars, compiled.constraint
        self.m = compiled.proto.deep_copy()
        self.stop_ids = sorted(stop_ids)
        self.think_end = think_end
        self.thinking = think_end is not None
        self.error = None  # why the request cannot go on (a dead end, a cap), naming the field

    def _fail(self, why: str) -> Status:
        self.error = f"{self.constraint.field}: {why}"
        return Status.DEAD_END

    def advance(self, tokens: list) -> Status:
        """The tokens one step emitted, in order (a stop id ends the request: nothing after it is read)."""
        for t in tokens:
            if self.thinking:
                self.thinking = t != self.think_end
            elif t in self.stop_ids:
                return Status.OK
            elif not self.m.consume_token(t):
                return self._fail(f"the {self.constraint.kind} does not allow token {t} "
                                  f"({self.m.get_error().strip()[:300]})")
        return Status.OK

    def _row(self, row):
        """The grammar's mask at its current state into row [words] (uint32), the stop ids set exactly where the
        grammar may end (llguidance marks the end with its EOS bit, which is no stop id of its own)."""
        self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        end = _allowed(row, self.g.eos_id)
        _set(row, [self.g.eos_id], False)
        _set(row, self.stop_ids, end)

    def fill(self, rows: torch.Tensor, drafts: list = ()) -> Status:
        """Masks of the next step's positions into rows [len(drafts) + 1, words] int32 (a pinned host buffer): row 0 at
        the current state, row j + 1 after drafts 0..j too (a speculative verify step). The drafts are walked and then
        rolled back; rows past the first draft the mask refuses are all-ones (the verify step rejects that draft, so
        they are never used). DEAD_END: no token allowed at row 0 (self.error says why). The rows are written as a
        numpy view: tensor indexing would cost more than the mask."""
        a = rows.numpy().view(np.uint32)
        a.fill(0xFFFFFFFF)
        taken, thinking = 0, self.thinking
        for j in range(a.shape[0]):
            if self.thinking:
                _set(a[j], self.stop_ids, False)  # a constrained request must reach its answer
            else:
                if self.m.is_error():
                    break
                self._row(a[j])
            if j == len(drafts) or not _allowed(a[j], drafts[j]):
                break
            d = drafts[j]
            if self.thinking:
                self.thinking = d != self.think_end
            elif d in self.stop_ids or not self.m.consume_token(d):
                break
            else:
                taken += 1
        if taken:
            self.m.rollback(taken)
        self.thinking = thinking
        if self.m.is_error():
            return self._fail(f"the {self.constraint.kind} hit a limit ({self.m.get_error().strip()[:300]})")
        if not thinking and not a[0].any():
            return self._fail(f"the {self.constraint.kind} allows no next token")
        return Status.OK

    def accepting(self) -> bool:
        """The answer so far is a complete match of the grammar."""
        return not self.thinking and self.m.is_accepting()


def _set(row, ids: list, on: bool):
    """Bits of token ids in a bitmask row [words] (uint32, numpy) set (on) or cleared."""
    for t in ids:
        if on:
            row[t >> 5] |= np.uint32(1 << (t & 31))
        else:
            row[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)


def _allowed(row, t: int) -> bool:
    return bool((int(row[t >> 5]) >> (t & 31)) & 1)


def allowed_ids(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The token ids a bitmask row [words] int32 allows (for tests and checks)."""
    bits = (row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab_size].nonzero().flatten()
