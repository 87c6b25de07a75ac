"""serve_requests.py in process: request bodies -> Jobs on the tiny checkpoint's tokenizer, without a server. The
work a request may cost before it is refused is counted (ids made, list items read), not timed. The server end to
end: tests/test_serve.py.
"""
import os

import pytest

import chat
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
