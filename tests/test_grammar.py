"""Constrained decoding (grammar.py) on the tiny checkpoint's tokenizer (a vocabulary smaller than the model's): the
tokenizer view masks ids without a token and special tokens, stop ids are allowed exactly where the grammar may end,
compile errors and caps name the request field, compiled grammars are cached, a matcher's draft walk rolls back, and
a reasoning block is unconstrained but may not stop. Then the engine: 50+ constrained requests of every kind sampled
at temperature 1 with a reasoning budget, plain and speculative, beside unconstrained ones, each emitted token
replayed through a fresh matcher, each finished answer parsed and validated (jsonschema); and at TP=2 the ranks'
tokens agree (tests/structured_tp2.py).
"""
import json
import os
import random
import re

import jsonschema
import pytest
import torch

import choice
import engine as E
import grammar as G
import tiny_checkpoint
from helpers import run_tp2
from sampling import Sampling

V = 1024  # the tiny model's vocabulary; its tokenizer holds fewer tokens
EOS = 4


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    tiny_checkpoint.write_tokenizer(d, V)
    return d


@pytest.fixture(scope="module")
def grammars(tok_dir):
    return G.Grammars(os.path.join(tok_dir, "tokenizer.json"), V, EOS)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok_dir, "tokenizer.json"))


def mask_of(m: G.Matcher, drafts=()) -> list:
    rows = torch.zeros(len(drafts) + 1, (V + 31) // 32, dtype=torch.int32)
    assert m.fill(rows, list(drafts)) is G.Status.OK, m.error
    return [set(G.allowed_ids(r, V).tolist()) for r in rows]


def test_the_view_never_allows_ids_without_a_token_nor_special_tokens_and_stops_only_where_the_grammar_ends(
        grammars, tok):
    n_tok = len(tok)
    assert n_tok < V
    specials = set(tok.all_special_ids) | {tok.convert_tokens_to_ids(t) for t in tiny_checkpoint.CHAT_TOKENS}
    m = grammars.matcher(grammars.compiled(G.Constraint(G.Kind.REGEX, "[a-z ]{0,40}")), frozenset({EOS, 2}))
    first = mask_of(m)[0]
    assert first and max(first) < n_tok and not (first - {EOS, 2}) & specials
    assert {EOS, 2} <= first  # the empty string matches: the stop ids are allowed
    m = grammars.matcher(grammars.compiled(G.Constraint(G.Kind.REGEX, "ab")), frozenset({EOS, 2}))
    assert not mask_of(m)[0] & {EOS, 2}  # "" does not match "ab"
    assert m.advance(tok("ab", add_special_tokens=False)["input_ids"]) is G.Status.OK and m.accepting()
    assert mask_of(m)[0] == {EOS, 2}  # complete: only a stop id


@pytest.mark.parametrize("c, words", [
    (G.Constraint(G.Kind.REGEX, "[0-9", field="structured_outputs.regex"), ["structured_outputs.regex", "regex"]),
    (G.Constraint(G.Kind.GRAMMAR, "start: undefined_rule", field="structured_outputs.grammar"),
     ["structured_outputs.grammar", "undefined_rule"]),
    (G.Constraint(G.Kind.GRAMMAR, "root ::= \"a\" other", field="guided_grammar"), ["guided_grammar", "other"]),
    (G.Constraint.json_schema({"type": "strin"}), ["response_format", "strin"]),
    (G.Constraint.json_schema({"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(20000)},
                               "required": [f"k{i}" for i in range(20000)]}), ["response_format", "too large"]),
])
def test_a_constraint_that_cannot_compile_names_its_field(grammars, c, words):
    with pytest.raises(G.GrammarError) as e:
        grammars.compile(c)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_constraint_records_refuse_what_is_not_a_schema_or_a_choice():
    with pytest.raises(G.GrammarError, match="response_format: the schema is not JSON"):
        G.Constraint.json_schema("{nope")
    with pytest.raises(G.GrammarError, match="must be a JSON object, got list"):
        G.Constraint.json_schema([1])
    with pytest.raises(G.GrammarError, match="guided_choice: the choice must be a non-empty list of strings"):
        G.Constraint.choice(["a", 3], field="guided_choice")
    # equal schemas written differently are one cache entry
    assert G.Constraint.json_schema({"b": 1, "type": "object"}) == G.Constraint.json_schema('{"type":"object","b":1}')


def test_compiled_grammars_are_cached_least_recently_used_first_out(tok_dir):
    g = G.Grammars(os.path.join(tok_dir, "tokenizer.json"), V, EOS, cache=2)
    a, b, c = (G.Constraint(G.Kind.REGEX, r) for r in ("a+", "b+", "c+"))
    g.compile(a)
    g.compile(b)
    assert g.compile(a) is g.compiled(a) and g.compiles == 2  # a hit, and a is now the most recent
    g.compile(c)  # evicts b
    g.compiled(a)
    assert g.compiles == 3
    g.compiled(b)
    assert g.compiles == 4


def test_a_compile_past_its_time_is_refused_naming_the_field(tok_dir, monkeypatch):
    import threading
    g = G.Grammars(os.path.join(tok_dir, "tokenizer.json"), V, EOS)
    release = threading.Event()
    build = g._build
    monkeypatch.setattr(g, "_build", lambda c: release.wait(10) and build(c))
    with pytest.raises(G.GrammarError, match=r"response_format: the json_object did not compile within 0.2 s"):
        g.compile(G.Constraint(G.Kind.JSON_OBJECT), timeout_s=0.2)
    release.set()


def test_a_matchers_draft_walk_gives_each_position_its_mask_and_rolls_back(grammars, tok):
    """fill() with drafts: row j is the mask after drafts 0..j-1; a draft the grammar refuses leaves the rows after it
    all-ones (a verify step rejects that draft); the matcher's state afterwards is as before."""
    c = G.Constraint.choice(["alpha", "beta"])
    m = grammars.matcher(grammars.compiled(c), frozenset({EOS}))
    ids = tok("alpha", add_special_tokens=False)["input_ids"]
    assert len(ids) >= 2
    alone = mask_of(m)
    walked = mask_of(m, ids[:2])
    assert walked[0] == alone[0] and ids[0] in walked[0] and ids[1] in walked[1]
    fresh = grammars.matcher(grammars.compiled(c), frozenset({EOS}))
    fresh.advance(ids[:2])
    assert walked[2] == mask_of(fresh)[0]
    assert mask_of(m) == alone  # rolled back
    bad = next(t for t in range(20, 700) if t not in alone[0])
    rows = mask_of(m, [bad, ids[1]])
    assert rows[0] == alone[0] and len(rows[1]) == len(rows[2]) == V  # past the refused draft: all-ones
    assert m.advance(ids) is G.Status.OK and m.accepting()


def test_reasoning_is_free_but_cannot_stop_and_the_grammar_starts_after_its_end(grammars, tok):
    end = tok.convert_tokens_to_ids("</think>")
    m = grammars.matcher(grammars.compiled(G.Constraint(G.Kind.REGEX, "yes|no")), frozenset({EOS}), think_end=end)
    reasoning = mask_of(m)[0]
    assert len(reasoning) == V - 1 and EOS not in reasoning
    rows = mask_of(m, [30, end])  # a reasoning token, the end, then the answer
    assert len(rows[1]) == V - 1 and rows[2] == mask_of(
        grammars.matcher(grammars.compiled(G.Constraint(G.Kind.REGEX, "yes|no")), frozenset({EOS})))[0]
    assert m.thinking  # rolled back
    m.advance([30, 31, end] + tok("no", add_special_tokens=False)["input_ids"])
    assert not m.thinking and m.accepting() and mask_of(m)[0] == {EOS}


def test_a_token_the_grammar_refuses_is_a_dead_end_naming_the_field(grammars):
    m = grammars.matcher(grammars.compiled(G.Constraint(G.Kind.REGEX, "[0-9]+", field="guided_regex")),
                         frozenset({EOS}))
    assert m.advance([1000]) is G.Status.DEAD_END and m.error.startswith("guided_regex: the regex does not allow")


# ---------------------------------------------------------------------------------------------- the engine
@torch.inference_mode()
def test_a_dead_end_in_the_engine_finishes_its_request_as_an_error_naming_the_grammar(converted, monkeypatch):
    """A matcher that finds no allowed token (here forced after the first mask) finishes its request with "error" and a
    message naming the field; the requests beside it go on, and so does the engine. A constrained request without a
    stop id, or whose grammar does not compile, is refused naming the field."""
    from conftest import load_tp1
    d = converted("bf16_text", 1)
    model = load_tp1(d)
    grammars = G.Grammars(os.path.join(d, "..", "tokenizer_files", "tokenizer.json"), V, EOS)
    calls, real = [0], G.Matcher.fill

    def fill(self, rows, drafts=()):
        calls[0] += 1
        if calls[0] > 1:
            return self._fail("the json_object allows no next token")
        return real(self, rows, drafts)
    monkeypatch.setattr(G.Matcher, "fill", fill)
    eng = E.Engine(model, E.EngineConfig(max_batch=2, max_context=64), grammars=grammars)
    eng.start()
    bad, other = eng.run([E.Request([0, 3, 40], 20, frozenset({EOS}), constraint=G.Constraint(G.Kind.JSON_OBJECT)),
                          E.Request([0, 3, 41], 8)])
    assert bad.finish == "error" and bad.error == "response_format: the json_object allows no next token"
    assert len(bad.out) == 1 and other.finish == "length" and len(other.out) == 8
    assert eng.run([E.Request([0, 3, 41], 8)])[0].out == other.out
    with pytest.raises(ValueError, match="response_format: a constrained request needs a stop id"):
        eng.submit(E.Request([0, 3, 40], 4, constraint=G.Constraint(G.Kind.JSON_OBJECT)))
    with pytest.raises(ValueError, match="guided_regex: the regex cannot be compiled"):
        eng.submit(E.Request([0, 3, 40], 4, frozenset({EOS}),
                             constraint=G.Constraint(G.Kind.REGEX, "(", field="guided_regex")))
    assert not eng.busy()


# Bounded schemas: nested objects, arrays, enums, number ranges, string lengths, required and optional keys (the
# objects first; test_serve_sampling sends them through the API)
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "number", "minimum": -5,
                                                                     "maximum": 5}},
     "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9}, "role": {"enum": ["admin", "guest"]}},
        "required": ["id", "role"], "additionalProperties": False},
        "note": {"type": "string", "maxLength": 4}}, "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 3}},
        "required": ["x"], "additionalProperties": False}}}, "required": ["p"], "additionalProperties": False},
    {"enum": ["red", "green", "blue"]},
]


def schemas() -> list:
    """SCHEMAS as constraints."""
    return [G.Constraint.json_schema(x) for x in SCHEMAS]


REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["Paris", "London", "Tokyo"]


def constraints() -> list:
    return schemas() + [G.Constraint(G.Kind.REGEX, REGEX, field="structured_outputs.regex"),
                        G.Constraint.choice(CHOICES), G.Constraint(G.Kind.JSON_OBJECT)]


def check_answer(grammars, r: E.Request, end: int) -> str | None:
    """Every emitted token replays through a fresh matcher; a stopped answer ends in an accepting state and parses and
    validates. -> the answer's finish reason problem, or None."""
    m = grammars.matcher(grammars.compiled(r.constraint), r.stop_ids, end)
    for t in r.out:
        if t in r.stop_ids:
            assert m.accepting(), f"request {r.rid} stopped where its grammar cannot end"
            break
        row = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
        assert m.fill(row) is G.Status.OK and G._allowed(row[0], t), f"request {r.rid}: token {t} not allowed"
        assert m.advance([t]) is G.Status.OK
    return m


def answer_text(tok, r: E.Request, end: int) -> str:
    ids = r.out[r.out.index(end) + 1:] if end in r.out else []
    return tok.decode([t for t in ids if t not in r.stop_ids])


def validate(c: G.Constraint, text: str):
    if c.kind == G.Kind.JSON_SCHEMA:
        jsonschema.validate(json.loads(text), json.loads(c.spec))
    elif c.kind == G.Kind.JSON_OBJECT:
        assert isinstance(json.loads(text), dict)
    elif c.kind == G.Kind.REGEX:
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def run_constrained(model, grammars, tok, speculative: int, n: int, beside: int):
    """n constrained requests (every constraint in turn) sampled at temperature 1 with a reasoning budget, and
    `beside` unconstrained ones, on an engine of 16 slots -> the requests."""
    end = tok.convert_tokens_to_ids("</think>")
    eng = E.Engine(model, E.EngineConfig(max_batch=16, max_context=160, speculative=speculative), grammars=grammars)
    eng.start()
    cs, rng = constraints(), random.Random(5)
    reqs = [E.Request([0, 3] + [rng.randrange(11, 700) for _ in range(rng.randrange(3, 12))], 80,
                      frozenset({EOS, 2}), Sampling(1.0, seed=i), constraint=cs[i % len(cs)],
                      reasoning=choice.Reasoning(end, rng.choice([0, 2, 6])), logprobs=1) for i in range(n)]
    reqs += [E.Request([0, 3, 40 + i, 50], 12, frozenset({EOS}), Sampling(1.0 if i % 2 else 0.0, seed=i))
             for i in range(beside)]
    rng.shuffle(reqs)
    eng.run(reqs)
    return reqs


@pytest.mark.parametrize("speculative", [0, 2])
@pytest.mark.slow
def test_constrained_requests_sampled_with_a_reasoning_budget_give_valid_answers(converted, speculative):
    """54 constrained requests (six bounded JSON schemas, a regex, a choice, json_object) at temperature 1 with a
    reasoning budget of 0, 2 or 6 tokens, with unconstrained requests beside them, plain and with speculative 2:
    every emitted token replays through a fresh matcher, every stopped answer is a complete match that parses and
    validates, at least 80% stop, and each request's reasoning is cut at its budget."""
    from conftest import load_tp1
    d = converted("bf16_text", 1, keep_mtp=True)
    model = load_tp1(d)
    tokf = os.path.join(d, "..", "tokenizer_files", "tokenizer.json")
    grammars = G.Grammars(tokf, V, EOS)
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=tokf)
    end = tok.convert_tokens_to_ids("</think>")
    reqs = run_constrained(model, grammars, tok, speculative, 54, 6)
    done = [r for r in reqs if r.constraint is not None]
    assert len(done) == 54
    for r in done:
        assert r.finish in ("stop", "length"), (r.finish, r.error)
        assert r.out.index(end) <= r.reasoning.budget if end in r.out else len(r.out) <= r.reasoning.budget
        assert len(r.token_logprobs) == len(r.out)
        m = check_answer(grammars, r, end)
        if r.finish == "stop":
            assert m.accepting()
            validate(r.constraint, answer_text(tok, r, end))
    stopped = sum(r.finish == "stop" for r in done)
    assert stopped >= 0.8 * len(done), f"{stopped} of {len(done)} stopped"
    assert all(r.finish in ("stop", "length") for r in reqs if r.constraint is None)


@pytest.mark.parametrize("drafts", ["right", "wrong"])
@pytest.mark.slow
def test_speculative_drafts_are_checked_against_the_grammar_position_by_position(converted, monkeypatch, drafts):
    """Constrained greedy requests with speculative 2 and forced drafts: plain decoding's own tokens (so whole verify
    steps are accepted, and each position's mask must be the grammar's after the drafts before it) or tokens off by
    one (refused by the grammar or by the model). Every answer replays through a fresh matcher and validates; with the
    right drafts most are accepted."""
    from conftest import load_tp1
    from helpers import force_drafts
    d = converted("bf16_text", 1, keep_mtp=True)
    model = load_tp1(d)
    tokf = os.path.join(d, "..", "tokenizer_files", "tokenizer.json")
    grammars = G.Grammars(tokf, V, EOS)
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_file=tokf)
    cs = [schemas()[0], schemas()[3], G.Constraint(G.Kind.REGEX, REGEX), G.Constraint.choice(CHOICES)]
    prompts = [[0, 3, 30 + i, 31, 32] for i in range(len(cs))]

    def run(k):
        eng = E.Engine(model, E.EngineConfig(max_batch=4, max_context=128, speculative=k), grammars=grammars)
        eng.start()
        return eng.run([E.Request(p, 80, frozenset({EOS}), constraint=c) for p, c in zip(prompts, cs)]), eng
    plain, _ = run(0)
    force_drafts(monkeypatch, [r.out for r in plain], prompts, int(drafts == "wrong"))
    spec, eng = run(2)
    for r in spec:
        assert r.finish == "stop", (r.finish, r.error, tok.decode(r.out))
        assert check_answer(grammars, r, None).accepting()
        validate(r.constraint, tok.decode(r.out[:-1]))
    st = eng.spec.stats
    if drafts == "right":
        assert sum(st["accepted"]) > 0.5 * sum(st["proposed"]), st
    else:
        assert sum(st["accepted"]) < 0.2 * sum(st["proposed"]), st


@pytest.mark.slow
def test_constrained_logprob_and_penalised_requests_agree_on_both_ranks(converted, tmp_path):
    """TP=2 (tests/structured_tp2.py): constrained, penalised, biased and logprob requests, plain and speculative;
    each rank runs its own matchers and the ranks' tokens and logprobs are identical, the answers valid."""
    runs = run_tp2("structured_tp2.py", converted("bf16_text", 2, keep_mtp=True), tmp_path / "out")
    assert runs[0] == runs[1]
    for spec in runs[0].values():
        assert len(spec) >= 8
        for req in spec:
            assert req["finish"] in ("stop", "length") and len(req["logprobs"]) == len(req["out"])
