"""Tools, reasoning and the Anthropic Messages API through serve.py: one TP=2 server on the tiny bf16 checkpoint
(torchrun on gloo, CPU; its tokenizer holds the Step-3.5 chat markers and a Step-form template), driven by the
official openai and anthropic clients and an agent framework (the OpenAI Agents SDK); a second server with
--speculative 2 for the forced calls under speculation. Weights are random, so calls are forced (tool_choice) and
checked for validity, not for sense.
"""
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import anthropic
import httpx
import jsonschema
import pytest

import runtime
import tool_calls
from test_serve import KEY, Server, start_ranks, torchrun_server

pytestmark = pytest.mark.slow
# A tools request's prompt is ~770 tokens of the tiny tokenizer (the tools block spelled nearly a character a token),
# and its prefill ~6 s on 2 cores. The default prefix store (one slot's cache: 91 regions of 8 tokens at 1024
# positions) cannot hold it, and a slot rewinds to its own prompt only across engine.REWIND (64) positions: after a
# longer answer (a named `weather` call is ~105 tokens) the next request prefilled all 770 again. A store of 20 MiB
# holds the few prompts these tests send (each is then prefilled once), and a stream and its whole answer continue
# from the same stored prefix.
STORE = ["--prefix-cache-gib", 0.02]
ARGS = ["--port", 0, "--max-batch", 16, "--max-queue", 128, "--max-context", 1024, *STORE]
PING = {"type": "function", "function": {"name": "f", "description": "Pick a number.", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}}}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 3},
                                     "note": {"type": "string", "maxLength": 4}},
    "required": ["city"], "additionalProperties": False}}}
TOOLS = [PING, WEATHER]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "system", "content": "You call tools."}, {"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def ckpt(converted):
    return converted("bf16_text", 2, keep_mtp=True)


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    yield from torchrun_server(ckpt, str(tmp_path_factory.mktemp("serve_tools") / "rank0.err"), ARGS)


@pytest.fixture(scope="module")
def tok(ckpt):
    return runtime.load_tokenizer(os.path.join(ckpt, "..", "tokenizer_files"))


def valid_calls(calls: list, only: str | None = None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in SCHEMAS
        assert only in (None, c.function.name)
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def chat(srv: Server, stream: bool = False, **kw):
    kw = {"model": "step5", "messages": ASK, "tools": TOOLS, "temperature": 1.0, "seed": 7, "max_tokens": 120,
          "extra_body": {"thinking_token_budget": 4, "return_token_ids": True}, **kw}
    return srv.client().with_options(timeout=600).chat.completions.create(stream=stream, **kw)


def streamed(srv: Server, **kw) -> dict:
    """A streamed chat's deltas accumulated as a client does (calls by index), its ids and finish."""
    msg = {"content": "", "reasoning_content": "", "reasoning": "", "tool_calls": {}, "ids": [], "finish": None}
    for ch in chat(srv, stream=True, **kw):
        if not ch.choices:
            continue
        c = ch.choices[0]
        d = c.delta
        msg["content"] += d.content or ""
        for k in ("reasoning_content", "reasoning"):
            msg[k] += getattr(d, k, None) or ""
        for tc in d.tool_calls or []:
            if tc.id is not None:  # a call's first delta: index, id, type, name
                assert tc.type == "function" and tc.function.name and tc.index not in msg["tool_calls"]
                msg["tool_calls"][tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            msg["tool_calls"][tc.index]["arguments"] += tc.function.arguments or ""
        msg["ids"] += getattr(c, "token_ids", None) or []
        msg["finish"] = c.finish_reason or msg["finish"]
    return msg


def same(whole, s: dict):
    """The stream adds up to the non-streamed message (same seed, same tokens)."""
    c = whole.choices[0]
    assert s["ids"] == c.token_ids
    m = c.message
    assert s["content"] == (m.content or "") and s["finish"] == c.finish_reason
    assert s["reasoning_content"] == s["reasoning"] == (m.reasoning_content or "") == (m.reasoning or "")
    assert [(v["name"], v["arguments"]) for _, v in sorted(s["tool_calls"].items())] == [
        (t.function.name, t.function.arguments) for t in m.tool_calls or []]  # ids: each request makes its own
    assert sorted(s["tool_calls"]) == list(range(len(s["tool_calls"])))
    assert len({v["id"] for v in s["tool_calls"].values()}) == len(s["tool_calls"])


# ---------------------------------------------------------------------------------------------- the openai client
def test_prompt_tokens_of_a_tools_request_are_the_templates_own_count(server, tok):
    msgs = ASK + [{"role": "assistant", "content": "", "reasoning": "Look it up.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    r = chat(server, messages=msgs, max_tokens=1)
    want = tok.apply_chat_template(
        ASK + [{"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}],
        tools=TOOLS, add_generation_prompt=True, tokenize=False)
    ids = tok(want, add_special_tokens=False)["input_ids"]
    assert r.usage.prompt_tokens == len(ids) and r.prompt_token_ids == ids
    assert "<think>\nLook it up.\n</think>" in want and "<parameter=city>\nOslo\n</parameter>" in want


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_forced_calls_are_valid_and_the_stream_adds_up_to_the_whole_answer(server, choice):
    for seed in (1, 2, 3):
        whole = chat(server, tool_choice=choice, seed=seed)
        c = whole.choices[0]
        named = None if choice == "required" else "weather"
        valid_calls(c.message.tool_calls, named)
        assert c.finish_reason in ("tool_calls", "length")
        if c.finish_reason == "tool_calls":
            assert c.message.content is None  # the answer after the reasoning is calls alone
        if named:
            assert len(c.message.tool_calls) == 1 and c.finish_reason == "tool_calls"
        same(whole, streamed(server, tool_choice=choice, seed=seed))


def test_parallel_tool_calls_false_gives_one_call(server):
    # sent at once (each checked on its own; a stream compared with its whole answer is sent alone: a row's logits may
    # round differently in another batch)
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda s: chat(server, tool_choice="required", parallel_tool_calls=False, seed=s), range(4)))
    for r in got:
        c = r.choices[0]
        valid_calls(c.message.tool_calls)
        assert len(c.message.tool_calls) == 1 and c.finish_reason == "tool_calls"


# Sampled `required` requests sent 16 at a time to the server's 16 slots. 32 is two rounds of those slots: the first 16
# fill every slot, so each later request starts its grammar in a slot a finished request held (where a matcher or a
# reasoning budget left from the last request would show), and every request is an independent sample of the forced
# call (seed = index). The grammar itself is sampled at random in tests/test_tool_calls.py (25 walks per kind of
# tool_choice); what this adds is the server's wiring under a full batch, which a bug breaks for every request or for
# every reused slot, not for one request in a hundred.
REQUIRED_SAMPLES = 32


def test_sampled_required_requests_each_parse_to_a_call(server):
    def one(seed: int):
        return chat(server, tools=[PING], tool_choice="required", seed=seed, max_tokens=50).choices[0]
    with ThreadPoolExecutor(16) as pool:
        t0 = time.monotonic()
        got = list(pool.map(one, range(REQUIRED_SAMPLES)))
        print(f"{REQUIRED_SAMPLES} required requests, 16 at a time: {time.monotonic() - t0:.0f} s")
    for c in got:
        valid_calls(c.message.tool_calls)
    assert sum(c.finish_reason == "tool_calls" for c in got) >= REQUIRED_SAMPLES // 2


def test_a_two_step_tool_loop(server):
    first = chat(server, tool_choice={"type": "function", "function": {"name": "weather"}}).choices[0].message
    call = first.tool_calls[0]
    msgs = ASK + [first.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    second = chat(server, messages=msgs, tool_choice="none", max_tokens=12).choices[0]
    assert second.message.tool_calls is None and second.finish_reason in ("stop", "length")
    r = server.post("/v1/chat/completions", {"messages": msgs, "tools": TOOLS, "max_tokens": 1,
                                            "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert json.loads(call.function.arguments)["city"] in ("Oslo", "Rome")


@pytest.mark.parametrize("body,param", [
    ({"tools": "x"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]},
        {"role": "user", "content": "x"}]}, "messages[2].tool_calls[0].function.arguments"),
    ({"chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
])
def test_bad_tool_fields_are_refused_naming_the_field(server, body, param):
    r = server.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_start_up_says_which_request_fields_the_template_reads(server):
    log = open(server.log).read()
    assert "the chat template reads tools" in log and "not reasoning_effort" in log, log[-2000:]
    r = chat(server, reasoning_effort="high", max_tokens=1)  # accepted: clients send it by default
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_an_agent_framework_completes_a_tool_loop(server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI
    seen = []

    @agents.function_tool
    def weather(city: Literal["Oslo", "Rome"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"Sunny in {city}"

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    model = agents.OpenAIChatCompletionsModel(model="step5", openai_client=client)
    # forced on the first turn (random weights call no tool of their own), then free: the loop must end
    agent = agents.Agent(name="weather", instructions="Use the tool.", tools=[weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=80, temperature=1.0,
                                                             extra_body={"thinking_token_budget": 2}),
                         reset_tool_choice=True, tool_use_behavior="stop_on_first_tool")
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "Weather in Oslo?", max_turns=3)
    assert seen and result.final_output == f"Sunny in {seen[0]}"


# ---------------------------------------------------------------------------------------------- the anthropic client
def claude(srv: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0, timeout=60)


A_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]


def test_anthropic_messages_whole_and_streamed(server):
    kw = dict(model="step5", max_tokens=40, system="Be brief.", temperature=1.0, top_k=0,
              messages=[{"role": "user", "content": "Hello"}], thinking={"type": "enabled", "budget_tokens": 6},
              extra_body={})
    client = claude(server)
    whole = client.messages.create(**kw, metadata={"user_id": "u"})
    assert whole.type == "message" and whole.role == "assistant" and whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.content and whole.content[0].type == "thinking" and whole.content[0].signature
    u = whole.usage
    assert u.output_tokens > 0 and u.input_tokens + u.cache_read_input_tokens > 0
    assert u.cache_creation_input_tokens == 0
    body = {k: v for k, v in kw.items() if k != "extra_body"}
    r = httpx.post(server.url + "/v1/messages", json={**body, "bogus": 1}, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 400 and r.json()["type"] == "error" and "bogus" in r.json()["error"]["message"], r.text
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True},
                      headers={"x-api-key": KEY}, timeout=60) as r:
        events = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    inner = events[1:-2]
    assert inner[0] == "content_block_start" and inner[-1] == "content_block_stop"
    depth = 0
    for e in inner:  # blocks open and close in turn, deltas inside them
        assert e in ("content_block_start", "content_block_delta", "content_block_stop", "ping")
        depth += {"content_block_start": 1, "content_block_stop": -1}.get(e, 0)
        assert depth in (0, 1) and (e != "content_block_delta" or depth == 1)


def test_anthropic_stream_accumulates_to_the_whole_message(server):
    kw = dict(model="step5", max_tokens=120, messages=[{"role": "user", "content": "Weather in Rome?"}],
              tools=A_TOOLS, tool_choice={"type": "tool", "name": "weather"}, temperature=1.0,
              thinking={"type": "enabled", "budget_tokens": 3})
    for seed in (1, 2):
        whole = claude(server).messages.create(**kw, extra_body={"seed": seed})
        with claude(server).messages.stream(**kw, extra_body={"seed": seed}) as s:
            acc = s.get_final_message()
        a, w = acc.model_dump(exclude={"id", "usage"}), whole.model_dump(exclude={"id", "usage"})
        for m in (a, w):  # each request makes its own tool_use ids
            for b in m["content"]:
                if b["type"] == "tool_use":
                    assert b.pop("id").startswith("toolu_")
        assert a == w, (a, w)
        au, wu = acc.usage, whole.usage  # the second request may read the first one's prompt from the cache
        assert au.output_tokens == wu.output_tokens
        assert au.input_tokens + au.cache_read_input_tokens == wu.input_tokens + wu.cache_read_input_tokens
        uses = [b for b in whole.content if b.type == "tool_use"]
        assert len(uses) == 1 and whole.stop_reason == "tool_use" and uses[0].id.startswith("toolu_")
        jsonschema.validate(uses[0].input, SCHEMAS["weather"])


def test_anthropic_tool_use_tool_result_loop_and_thinking_round_trip(server):
    client = claude(server)
    # seeded (the server's extension): an unseeded sample could still be inside its call at max_tokens
    first = client.messages.create(model="step5", max_tokens=120, tools=A_TOOLS, tool_choice={"type": "any"},
                                   messages=[{"role": "user", "content": "Weather?"}],
                                   thinking={"type": "enabled", "budget_tokens": 3}, extra_body={"seed": 7})
    assert first.stop_reason == "tool_use", first.content
    use = next(b for b in first.content if b.type == "tool_use")
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]}]
    second = client.messages.create(model="step5", max_tokens=8, tools=A_TOOLS, messages=history,
                                    tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens") and not [b for b in second.content
                                                                    if b.type == "tool_use"]
    n = client.messages.count_tokens(model="step5", messages=history, tools=A_TOOLS)
    assert n.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens


def test_anthropic_errors_in_its_envelope_with_either_key(server):
    for headers in ({"x-api-key": "wrong"}, {}):
        r = httpx.post(server.url + "/v1/messages", json={"max_tokens": 1, "messages": []}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
    auth = {"Authorization": f"Bearer {KEY}"}
    for body, word in (({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
                       ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
                       ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
                         "thinking": {"type": "enabled", "budget_tokens": 9}}, "thinking.budget_tokens"),
                       ({"max_tokens": 5, "messages": [{"role": "user", "content": [
                           {"type": "image", "source": {"type": "url", "url": "http://x"}}]}]}, "never fetched")):
        r = httpx.post(server.url + "/v1/messages", json=body, headers=auth)
        e = r.json()
        assert r.status_code == 400 and e["type"] == "error" and e["error"]["type"] == "invalid_request_error"
        assert word in e["error"]["message"], e


# ---------------------------------------------------------------------------------------------- speculative
def test_forced_calls_under_speculative_decoding(ckpt, tmp_path):
    srv = start_ranks(ckpt, tmp_path, "--speculative", 2, "--api-key", KEY, *STORE)
    try:
        for choice in ("required", {"type": "function", "function": {"name": "weather"}}):
            whole = chat(srv, tool_choice=choice, seed=5)
            valid_calls(whole.choices[0].message.tool_calls)
            same(whole, streamed(srv, tool_choice=choice, seed=5))
    finally:
        for p in srv.procs:
            if p.poll() is None:
                p.kill()


def test_the_parser_reads_real_token_streams_alike_in_every_split(tok):
    """Output + Parser (the server's text side) over token ids of a reply with reasoning, content and two calls: fed
    one token at a time, 2-4 per step, or all at once, the message is the same."""
    import random

    import serve_answers
    think, calls = (tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>")), tool_calls.call_ids(tok)
    think = tuple(think)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    ids = (enc("Let me see.\n") + [think[1]] + enc("\nChecking.\n") + [calls[0]]
           + enc("\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n") + [calls[1]] + enc("\n")
           + [calls[0]] + enc("\n<function=f>\n<parameter=n>\n3\n</parameter>\n</function>\n") + [calls[1]]
           + enc("\n<tool") + enc("_call> is prose") + [tok.convert_tokens_to_ids("<|im_end|>")])  # prose: no marker
    tools = tool_calls.tools_of(TOOLS)

    def run(sizes):
        o = serve_answers.Output(tok, frozenset({ids[-1]}), [], think, True, calls)
        n = iter(range(9))
        p = tool_calls.Parser(tools, tool_calls.Choice(), new_id=lambda: f"call_{next(n)}")
        out, at = [], 0
        for k in sizes:
            deltas, _ = o.push(ids[at:at + k])
            at += k
            out += p.push([tool_calls.Piece(tool_calls.Kind(ch), t) for ch, t in deltas])
        out += p.push([tool_calls.Piece(tool_calls.Kind(ch), t) for ch, t in o.close()]) + p.close()
        return tool_calls.assemble(out)
    rng = random.Random(0)
    want = run([len(ids)])
    assert want.reasoning == "Let me see." and want.content == "Checking.\n<tool_call> is prose"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want.tool_calls] == [
        ("weather", {"city": "Oslo"}), ("f", {"n": 3})]
    for sizes in ([1] * len(ids), *[[rng.randint(2, 4) for _ in ids] for _ in range(20)]):
        assert run(sizes) == want
