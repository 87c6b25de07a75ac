"""serve_requests.py in process: request bodies -> Jobs on the tiny checkpoint's tokenizer, without a server. The
work a request may cost before it is refused is counted (ids made, list items read), not timed. The server end to
end: tests/test_serve.py.
"""
import os

import pytest

import chat
import engine as E
import runtime
import serve_requests as Q
from helpers import Counting

CONTEXT = 1024


@pytest.fixture(scope="module")
def tok(converted):
    return runtime.load_tokenizer(os.path.join(converted("fp8_vl", 1), "..", "tokenizer_files"))


def limits() -> Q.Limits:
    return Q.Limits(CONTEXT, 1024, 8192, 5, None, 4)


def refused(fn, *args) -> dict:
    with pytest.raises(Q.ApiError) as e:
        fn(*args)
    assert e.value.status == 400, e.value.body()
    return e.value.body()["error"]


def test_a_long_text_is_refused_after_a_bounded_number_of_ids(tok):
    """A text of megabytes (a completions prompt, a chat message) is refused naming its field once its ids pass the
    context: the ids made for it stay within the context + one piece, however long it is."""
    text = "Expert parallelism places whole experts on ranks. 混合专家模型。 " * 60_000  # 3.4 M characters
    for body, make, param in (({"prompt": text}, Q.completion_jobs, "prompt"),
                              ({"prompt": ["hi", text]}, Q.completion_jobs, "prompt[1]"),
                              ({"messages": [{"role": "user", "content": text}]}, Q.chat_jobs, "messages")):
        count = Counting(tok)
        btok = chat.BoundedTokenizer(count)
        count.ids = 0
        args = (body, btok, limits(), [4]) + ((None,) if make is Q.chat_jobs else ())
        err = refused(make, *args)
        assert err["code"] == "context_length_exceeded" and err["param"] == param, err
        assert count.ids <= CONTEXT + 4 * (chat.PIECE + chat.EDGE), count.ids


class Counted(list):
    """A list that counts the items read from it."""
    reads = 0

    def __iter__(self):
        for x in super().__iter__():
            Counted.reads += 1
            yield x

    def __getitem__(self, i):
        Counted.reads += 1
        return super().__getitem__(i)


def test_id_lists_are_measured_before_they_are_read(tok):
    """A list of ids longer than the context is refused before any of its items is read."""
    btok = chat.BoundedTokenizer(tok)
    for body, param in (({"prompt": Counted([11] * CONTEXT)}, "prompt"),
                        ({"prompt": ["hi", Counted([11] * 10 * CONTEXT)]}, "prompt[1]")):
        Counted.reads = 0
        err = refused(Q.completion_jobs, body, btok, limits(), [4])
        assert err["code"] == "context_length_exceeded" and err["param"] == param and Counted.reads <= 1, err


def test_the_four_prompt_forms(tok):
    """prompt as a string, a list of strings, a list of ids, a list of id lists: a Job per prompt, its index its
    place; a bad one is named by its place."""
    btok = chat.BoundedTokenizer(tok)
    ids = tok("The quick brown fox", add_special_tokens=True)["input_ids"]

    def jobs(p):
        return [(j.index, j.ids) for j in Q.completion_jobs({"prompt": p, "max_tokens": 2}, btok, limits(), [4])]
    assert jobs("The quick brown fox") == [(0, ids)]
    assert jobs(["The quick brown fox", "hi"]) == [(0, ids), (1, tok("hi")["input_ids"])]
    assert jobs([11, 12]) == [(0, [11, 12])]
    assert jobs([[11, 12], [13]]) == [(0, [11, 12]), (1, [13])]
    for p, param in ((["a", [11, 5]], "prompt[1]"), ([[11], []], "prompt[1]"), ([True], "prompt"),
                     (["a"] * 5, "prompt")):  # 5: past Limits.max_prompts
        assert refused(Q.completion_jobs, {"prompt": p}, btok, limits(), [4])["param"] == param, p


def test_messages_quote_the_values_they_show(tok):
    """A string value in an error message is quoted (JSON), so "1" and 1 read apart."""
    btok = chat.BoundedTokenizer(tok)
    for body, shown in (({"prompt": "hi", "temperature": "1"}, '"1"'), ({"prompt": "hi", "max_tokens": "2"}, '"2"'),
                        ({"prompt": "hi", "stop": 5}, "5"), ({"prompt": {"a": "b"}}, '{"a": "b"}')):
        assert shown in refused(Q.completion_jobs, body, btok, limits(), [4])["message"], body
    with pytest.raises(Q.ApiError) as e:
        Q.parse_body(b'{"model": "other"}', "step5")
    assert e.value.status == 404 and '"other"' in e.value.message and '"step5"' in e.value.message


# --------------------------------------------------------------------------------------------------
# conversations with tools and reasoning: the server's prompt is the template's own, from OpenAI-shaped messages

TOOL = {"type": "function", "function": {"name": "weather", "description": "The weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "hourly": {"type": "boolean"}, "where": {"type": "object"}}}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}


def call(i: int, name: str, args: dict, raw: bool) -> dict:
    import json
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": name, "arguments": args if raw else json.dumps(args)}}


def conversations(raw: bool) -> dict:
    """name -> (tools, messages): OpenAI's shapes (raw False) or what the template reads (raw True: arguments as
    objects, reasoning_content, system for developer)."""
    r = "reasoning_content" if raw else "reasoning"
    sys_role = "system" if raw else "developer"
    user = {"role": "user", "content": "Weather in Oslo?"}
    asked = {"role": "assistant", "content": None if not raw else "", r: "Use the tool.",
             "tool_calls": [call(1, "weather", {"city": "Oslo", "days": 2}, raw)]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"}
    return {
        "tools and a system message": ([TOOL, CLOCK], [{"role": "system", "content": "Be brief."}, user]),
        "tools without a system message": ([TOOL], [user]),
        "a tool loop": ([TOOL], [user, asked, result]),
        "parallel calls, their results in one turn": ([TOOL, CLOCK], [
            user, {"role": "assistant", "content": "Two calls.", "tool_calls": [
                call(1, "weather", {"city": "Oslo"}, raw), call(2, "clock", {}, raw)]},
            result, {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]),
        "reasoning across user turns: kept after the last user only": ([], [
            user, {"role": "assistant", "content": "Sunny.", r: "Old thought."},
            {"role": "user", "content": "And Rome?"}, {"role": "assistant", "content": "", r: "New thought.",
                                                       "tool_calls": [call(3, "weather", {"city": "Rome"}, raw)]},
            {"role": "tool", "tool_call_id": "call_3", "content": "Rain"}]),
        "developer as system": ([TOOL], [{"role": sys_role, "content": "Rules."}, user]),
        "an observation": ([], [user, {"role": "assistant", "content": "Hm."},
                                {"role": "system", "name": "observation", "content": "It is raining."},
                                {"role": "user", "content": "So?"}]),
        "text parts": ([], [{"role": "user", "content": [{"type": "text", "text": "Part one. "},
                                                         {"type": "text", "text": "Part two."}]
                             if not raw else "Part one. Part two."}]),
        "Python spellings of scalars, JSON of objects": ([TOOL], [
            user, {"role": "assistant", "content": "", "tool_calls": [call(
                4, "weather", {"city": "Oslo", "hourly": False, "where": {"lat": 59.9, "tags": [None, True]}}, raw)]},
            {"role": "tool", "tool_call_id": "call_4", "content": "ok"}]),
        "no tools: the plain template": ([], [{"role": "system", "content": "S"}, user]),
    }


@pytest.mark.parametrize("name", list(conversations(False)))
def test_a_conversation_with_tools_renders_as_the_templates_own_text(tok, name):
    tools, msgs = conversations(False)[name]
    want_tools, want_msgs = conversations(True)[name]
    body = {"messages": msgs, "max_tokens": 1, **({"tools": tools} if tools else {})}
    job = Q.chat_jobs(body, chat.BoundedTokenizer(tok), limits(), [4], chat.think_ids(tok))[0]
    text = tok.apply_chat_template(want_msgs, tools=want_tools or None, tokenize=False, add_generation_prompt=True)
    assert job.ids == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(job.ids, skip_special_tokens=False) == text and job.reasoning  # the prompt opens <think>
    assert ("# Tools" in text) == bool(tools) and text.count(tok.bos_token) == 1



@pytest.mark.parametrize("name", ["tools and a system message", "tools without a system message",
                                  "developer as system", "no tools: the plain template", "a tool loop"])
def test_a_chats_leading_system_turn_is_what_its_job_shares(tok, name):
    """Job.share: the leading ids every conversation with the same system messages and tools starts with (the
    template's system turn, up to the first user message's own text), for the prefix store to keep. Two chats that
    differ only in their user message share exactly that many ids; another system message shares less."""
    tools, msgs = conversations(False)[name]
    body = {"messages": msgs, "max_tokens": 1, **({"tools": tools} if tools else {})}

    def job(messages):
        return Q.chat_jobs({**body, "messages": messages}, chat.BoundedTokenizer(tok), limits(), [4],
                           chat.think_ids(tok))[0]
    one = job(msgs)
    sys_ = [m for m in msgs[:1] if m["role"] in ("system", "developer")]
    two = job(sys_ + [{"role": "user", "content": "Tell me a story about 7 cats."}])
    assert 0 < one.share < len(one.ids) and one.share == two.share
    assert E.common_prefix(one.ids, two.ids) == one.share
    text = tok.decode(one.ids[:one.share], skip_special_tokens=False)
    assert text.endswith("user\n") and all(m["content"] in text for m in sys_)
    if sys_:
        three = job([{"role": "system", "content": "Another rule entirely."}] + msgs[1:])
        assert E.common_prefix(one.ids, three.ids) < one.share


def test_a_chat_with_no_system_message_and_no_tools_shares_nothing(tok):
    job = Q.chat_jobs({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}, chat.BoundedTokenizer(tok),
                      limits(), [4], None)[0]
    assert job.share == 0


def test_past_reasoning_and_tool_calls_reach_the_template(tok):
    """The rendered texts hold what the normalisation passed (not only equal to a template that could ignore it)."""
    text = tok.decode(Q.chat_jobs({"messages": conversations(False)["reasoning across user turns: kept after the "
                                                                    "last user only"][1], "max_tokens": 1},
                                  chat.BoundedTokenizer(tok), limits(), [4], None)[0].ids, skip_special_tokens=False)
    assert "New thought." in text and "Old thought." not in text and "<parameter=city>\nRome\n</parameter>" in text
    text = tok.decode(Q.chat_jobs({"messages": conversations(False)["Python spellings of scalars, JSON of objects"][1],
                                   "tools": [TOOL], "max_tokens": 1}, chat.BoundedTokenizer(tok), limits(), [4],
                                  None)[0].ids, skip_special_tokens=False)
    assert "<parameter=hourly>\nFalse\n</parameter>" in text and '{"lat": 59.9, "tags": [null, true]}' in text


def test_a_template_without_tools_refuses_them_naming_tools(tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", "{% for m in messages %}{{ m.content }}{% endfor %}")
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "max_tokens": 1}
    err = refused(Q.chat_jobs, body, chat.BoundedTokenizer(tok), limits(), [4], None)
    assert err["param"] == "tools" and "does not render tools" in err["message"]
    assert chat.template_variables(tok) == {"messages"}


def test_a_jobs_fields_reach_the_engine_request_every_rank_submits(tok):
    """serve.new_of and runtime.request_of carry a Job's engine fields (a chat's shared system turn, cache_salt,
    sampling, constraint, reasoning) to the engine.Request unchanged."""
    import serve
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            "max_tokens": 3, "cache_salt": "tenant-a", "seed": 5, "temperature": 0.5, "logprobs": True,
            "top_logprobs": 2, "response_format": {"type": "json_object"}}
    lim = limits()  # without the engine's grammars: a constraint is refused here
    with pytest.raises(Q.ApiError):
        Q.chat_jobs(body, chat.BoundedTokenizer(tok), lim, [4], chat.think_ids(tok))
    del body["response_format"]
    job = Q.chat_jobs(body, chat.BoundedTokenizer(tok), lim, [4], chat.think_ids(tok))[0]
    req = runtime.request_of(serve.new_of(7, job), None)
    assert (req.ids, req.max_new_tokens, req.sampling, req.logprobs) == (job.ids, 3, job.sampling, 2)
    assert req.share == job.share > 0 and req.cache_salt == "tenant-a" and req.stop_ids == frozenset({4})
    assert req.reasoning == job.think and req.reasoning is not None


def test_a_system_turn_sent_again_is_tokenized_once(tok):
    """Agents resend their system prompt and tools with every request: its ids (for Job.share) are made once, and
    the second request's share is the first's."""
    from helpers import Counting
    tools, msgs = conversations(False)["tools and a system message"]
    count = Counting(tok)
    btok = chat.BoundedTokenizer(count)
    shares, calls = [], []
    for q in ("First question?", "Second question?"):
        body = {"messages": msgs[:1] + [{"role": "user", "content": q}], "max_tokens": 1, "tools": tools}
        before = count.calls
        shares.append(Q.chat_jobs(body, btok, limits(), [4], chat.think_ids(tok))[0].share)
        calls.append(count.calls - before)
    assert shares[0] == shares[1] > 0 and calls[1] < calls[0]
