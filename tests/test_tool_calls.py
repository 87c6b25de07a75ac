"""tool_calls.py: the parser of Step's tool-call format over pieces (reasoning, content, the markers as their own
pieces) gives the same message whatever the split of its texts (one character per piece, random splits, everything
at once), tables of malformed and edge inputs give the documented message, and the tool_choice grammars force calls
that parse (markers by id), on the tiny checkpoint's tokenizer.
"""
import json
import random

import jsonschema
import pytest
import torch

import grammar as G
import tool_calls as T
from tool_calls import Kind, Piece

R, C, TS, TE = Kind.REASONING, Kind.CONTENT, Kind.THINK_START, Kind.THINK_END
OPEN, CLOSE = Piece(Kind.CALL_OPEN, "<tool_call>"), Piece(Kind.CALL_CLOSE, "</tool_call>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "where": {"type": "object"},
                                     "tags": {"type": "array", "items": {"type": "string"}},
                                     "note": {"type": ["string", "null"]}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = T.tools_of([WEATHER, TIME])


def ids():
    n = iter(range(1000))
    return lambda: f"call_{next(n)}"


def block(name: str, **params) -> str:
    body = "".join(f"\n<parameter={k}>\n{v}\n</parameter>" for k, v in params.items())
    return f"\n<function={name}>{body}\n</function>\n"


def run(pieces: list, choice=T.Choice(T.Mode.AUTO), tools=TOOLS):
    p = T.Parser(tools, choice, new_id=ids())
    return p.push(pieces) + p.close()


def message(pieces: list, **kw) -> T.Message:
    return T.assemble(run(pieces, **kw))


def splits(pieces: list, rng: random.Random) -> list:
    """The same pieces with each text cut at random places (markers stay whole)."""
    out = []
    for p in pieces:
        if p.kind in (R, C) and len(p.text) > 1:
            cuts = sorted(rng.sample(range(1, len(p.text)), rng.randint(0, min(4, len(p.text) - 1))))
            out += [Piece(p.kind, p.text[a:b]) for a, b in zip([0] + cuts, cuts + [len(p.text)])]
        else:
            out.append(p)
    return out


def chars(pieces: list) -> list:
    return [Piece(p.kind, ch) for p in pieces for ch in (p.text if p.kind in (R, C) else [p.text])]


CASES = {  # name -> (pieces, expected (reasoning, content, [(name, arguments dict)]))
    "reasoning then a call": (
        [Piece(R, "Need weather.\n"), Piece(TE), Piece(C, "\n"), OPEN,
         Piece(C, block("get_weather", city="Paris", days="3", metric="true")), CLOSE],
        ("Need weather.", "", [("get_weather", {"city": "Paris", "days": 3, "metric": True})])),
    "content before the call, its newline the format's": (
        [Piece(R, "r\n"), Piece(TE), Piece(C, "\nLet me look.\n"), OPEN, Piece(C, block("now")), CLOSE],
        ("r", "Let me look.", [("now", {})])),
    "parallel calls, whitespace between and after them no content": (
        [Piece(C, "\n"), OPEN, Piece(C, block("now")), CLOSE, Piece(C, "\n \n"), OPEN,
         Piece(C, block("get_weather", city="Rome")), CLOSE, Piece(C, "\n")],
        ("", "", [("now", {}), ("get_weather", {"city": "Rome"})])),
    "text after the last call is content": (
        [OPEN, Piece(C, block("now")), CLOSE, Piece(C, "\nDone.")],
        ("", "\nDone.", [("now", {})])),
    "JSON and Python spellings, objects, arrays, null": (
        [OPEN, Piece(C, block("get_weather", city="  Oslo ", metric="False", where='{"lat": 1.5}',
                              tags='["a", "b"]', note="None", days="-2")), CLOSE],
        ("", "", [("get_weather", {"city": "  Oslo ", "metric": False, "where": {"lat": 1.5}, "tags": ["a", "b"],
                                   "note": None, "days": -2})])),
    "a multi-line string value": (
        [OPEN, Piece(C, block("get_weather", city="line one\nline two")), CLOSE],
        ("", "", [("get_weather", {"city": "line one\nline two"})])),
    "bad JSON for an object parameter stays the raw string": (
        [OPEN, Piece(C, block("get_weather", city="x", where="{not json")), CLOSE],
        ("", "", [("get_weather", {"city": "x", "where": "{not json"})])),
    "an unknown function is content": (
        [Piece(C, "Hi\n"), OPEN, Piece(C, block("rm_rf", path="/")), CLOSE],
        ("", "Hi\n<tool_call>" + block("rm_rf", path="/") + "</tool_call>", [])),
    "an unclosed call is content": (
        [Piece(C, "x\n"), OPEN, Piece(C, "\n<function=now>\n</func")],
        ("", "x\n<tool_call>\n<function=now>\n</func", [])),
    "a malformed block is content": (
        [OPEN, Piece(C, "\n<function=now>\ngarbage\n</function>\n"), CLOSE],
        ("", "<tool_call>\n<function=now>\ngarbage\n</function>\n</tool_call>", [])),
    "a block opened inside a block: the first is content, the second a call": (
        [OPEN, Piece(C, "\n<function=now"), OPEN, Piece(C, block("now")), CLOSE],
        ("", "<tool_call>\n<function=now", [("now", {})])),
    "a repeated parameter is content": (
        [OPEN, Piece(C, "\n<function=now>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n"
                        "</function>\n"), CLOSE],
        ("", "<tool_call>\n<function=now>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n</parameter>\n"
             "</function>\n</tool_call>", [])),
    "a call inside reasoning is reasoning (Output sends it as reasoning text)": (
        [Piece(R, "maybe <tool_call>" + block("now") + "</tool_call>\n"), Piece(TE), Piece(C, "\nno.")],
        ("maybe <tool_call>" + block("now") + "</tool_call>", "no.", [])),
    "a literal <tool_call> in prose (ordinary tokens) is prose": (
        [Piece(C, "Write <tool_call>" + block("now") + "</tool_call> to call.")],
        ("", "Write <tool_call>" + block("now") + "</tool_call> to call.", [])),
    "a stray </tool_call> is content": (
        [Piece(C, "a"), CLOSE, Piece(C, "b")], ("", "a</tool_call>b", [])),
    "one newline trimmed on each side of </think>, not two": (
        [Piece(R, "\n\nthink\n\n"), Piece(TE), Piece(C, "\n\nanswer\n\n")],
        ("\n\nthink\n", "\nanswer\n\n", [])),  # the prompt wrote <think>\n: nothing to trim at the start
    "<think> mid-answer opens reasoning, its newline trimmed": (
        [Piece(C, "a"), Piece(TS), Piece(R, "\nb\n"), Piece(TE), Piece(C, "\nc")], ("b", "ac", [])),
}


def expected_message(exp) -> tuple:
    reasoning, content, calls = exp
    return reasoning, content, [(n, a) for n, a in calls]


def got_message(m: T.Message) -> tuple:
    return m.reasoning, m.content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                    for c in m.tool_calls]


@pytest.mark.parametrize("name", list(CASES))
def test_each_case_gives_its_documented_message_in_every_split(name):
    pieces, exp = CASES[name]
    whole = message(pieces)
    assert got_message(whole) == expected_message(exp)
    rng = random.Random(name)
    for variant in [chars(pieces)] + [splits(pieces, rng) for _ in range(30)]:
        assert message(variant) == whole


def test_the_first_delta_of_a_call_carries_its_id_and_name_then_one_arguments_delta_per_parameter():
    pieces = [OPEN, Piece(C, block("get_weather", city="Paris", days="3")), CLOSE, Piece(C, "\n"), OPEN,
              Piece(C, block("now")), CLOSE]
    calls = [d for kind, d in run(pieces) if kind == "tool_call"]
    assert [(d.index, d.id, d.name, d.arguments) for d in calls] == [
        (0, "call_0", "get_weather", ""), (0, None, None, '{"city": "Paris"'), (0, None, None, ', "days": 3}'),
        (1, "call_1", "now", ""), (1, None, None, "{}")]
    m = T.assemble(run(pieces))
    assert json.loads(m.tool_calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_tool_choice_none_parses_no_call_and_parallel_false_keeps_the_first():
    pieces = [OPEN, Piece(C, block("now")), CLOSE, Piece(C, "\n"), OPEN, Piece(C, block("get_weather", city="A")),
              CLOSE]
    none = message(pieces, choice=T.Choice(T.Mode.NONE))
    assert none.tool_calls == [] and none.content == "<tool_call>" + block("now") + "</tool_call>\n<tool_call>" + \
        block("get_weather", city="A") + "</tool_call>"
    first = message(pieces, choice=T.Choice(T.Mode.AUTO, parallel=False))
    assert [c["function"]["name"] for c in first.tool_calls] == ["now"] and first.content == ""
    assert message(pieces, tools={}).tool_calls == []


def test_typed_values_follow_the_schema_and_fall_back_to_the_raw_string():
    assert T.typed("42", {"type": "integer"}) == 42
    assert T.typed("42", {"type": "string"}) == "42"
    assert T.typed("True", {"type": "boolean"}) is True
    assert T.typed("null", {"type": ["string", "null"]}) is None
    assert T.typed("abc", {"type": ["string", "null"]}) == "abc"
    assert T.typed("1.5e3", {"type": "number"}) == 1500.0
    assert T.typed("oops", {"type": "integer"}) == "oops"
    assert T.typed("[1, 2]", None) == [1, 2]
    assert T.typed("hello", None) == "hello"


@pytest.mark.parametrize("tools,choice,message_part", [
    ("nope", None, "tools must be a list"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, "type object"),
    ([WEATHER], "sometimes", 'tool_choice must be "none"'),
    ([WEATHER], {"type": "function", "function": {"name": "other"}}, "not one of the tools"),
    ([], "required", "needs tools"),
])
def test_bad_tools_and_tool_choice_are_refused_naming_the_field(tools, choice, message_part):
    with pytest.raises(ValueError, match=message_part.replace("[", r"\[").replace("]", r"\]")):
        T.choice_of(choice, None, T.tools_of(tools))


# --------------------------------------------------------------------------------------------------
# the grammars of forced calls, on the tiny tokenizer

from test_grammar import EOS, V, grammars, tok, tok_dir  # noqa: E402,F401 (the tiny tokenizer's fixtures)


FORCED = T.tools_of([
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
        "q": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 1, "maximum": 9},
        "unit": {"type": "string", "enum": ["c", "f"]}, "opts": {"type": "object", "properties": {
            "deep": {"type": "boolean"}}, "required": ["deep"], "additionalProperties": False}},
        "required": ["q", "unit"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}])


def sample(grammars, tok, c: G.Constraint, rng: random.Random, max_len: int = 300) -> list:
    """Tokens drawn uniformly from the grammar's mask until a stop id: what random weights do under the grammar."""
    m = grammars.matcher(grammars.compiled(c), frozenset({EOS}))
    out = []
    rows = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    for _ in range(max_len):
        assert m.fill(rows) is G.Status.OK, m.error
        allowed = G.allowed_ids(rows[0], V).tolist()
        t = EOS if EOS in allowed and rng.random() < 0.5 else rng.choice(allowed)
        if t == EOS:
            return out
        assert m.advance([t]) is G.Status.OK, m.error
        out.append(t)
    raise AssertionError("no stop within max_len tokens")


def pieces_of(tok, out: list) -> list:
    """Ids -> content pieces with the call markers as their own (what serve_answers.Output gives after </think>)."""
    opener, closer = (tok.convert_tokens_to_ids(t) for t in T.CALL)
    pieces, run_ = [], []
    for t in out + [None]:
        if t in (opener, closer, None):
            if run_:
                pieces.append(Piece(C, tok.decode(run_)))
                run_ = []
            if t is not None:
                pieces.append(Piece(Kind.CALL_OPEN if t == opener else Kind.CALL_CLOSE, tok.decode([t])))
        else:
            run_.append(t)
    return pieces


@pytest.mark.parametrize("choice", [T.Choice(T.Mode.REQUIRED), T.Choice(T.Mode.REQUIRED, parallel=False),
                                    T.Choice(T.Mode.NAMED, "lookup")])
def test_forced_calls_sampled_at_random_parse_to_valid_calls_with_the_markers_by_id(grammars, tok, choice):
    call_ids = tuple(tok.convert_tokens_to_ids(t) for t in T.CALL)
    c = T.constraint(FORCED, choice, call_ids)
    assert c.field == "tool_choice" and f"<[{call_ids[0]}]>" in c.spec
    rng = random.Random(str(choice))
    for _ in range(25):
        out = sample(grammars, tok, c, rng)
        assert out.count(call_ids[0]) >= 1 and all(tok.decode([t]) not in T.CALL for t in out if t not in call_ids)
        m = T.assemble(run(pieces_of(tok, out), choice=choice, tools=FORCED))
        assert m.content == "" and m.tool_calls, tok.decode(out)
        if choice.mode is T.Mode.NAMED or not choice.parallel:
            assert len(m.tool_calls) == 1 and out.count(call_ids[0]) == 1
        for call in m.tool_calls:
            f = call["function"]
            assert choice.name in (None, f["name"])
            jsonschema.validate(json.loads(f["arguments"]), FORCED[f["name"]].parameters)


def test_no_grammar_where_nothing_is_forced_and_unwritable_keys_are_refused():
    assert T.constraint(FORCED, T.Choice(T.Mode.AUTO), (1, 2)) is None
    bad = T.tools_of([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a>b": {"type": "string"}}}}}])
    with pytest.raises(G.GrammarError, match="tool_choice"):
        T.constraint(bad, T.Choice(T.Mode.REQUIRED), (1, 2))
