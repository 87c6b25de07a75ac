"""The sampling API of serve.py end to end (issue 55): constraints (response_format, structured_outputs, guided_*),
the reasoning budget, logprobs and echo, n, penalties, min_p, logit_bias, on a TP=2 server of the tiny BF16 text
checkpoint (torchrun on gloo, CPU), plain and with --speculative 2, driven by the official openai client (httpx for
raw error bodies). The engine's own tests (tests/test_grammar.py, tests/test_choice.py) check the numbers below the
API; these check that the API asks the engine for the right thing and writes back what it gave.
"""
import json
import os
import random
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch

import config
import grammar as G
import runtime
import serve_requests as Q
from invariants import NOISE, ROOT, TORCHRUN
from test_grammar import CHOICES, REGEX
from test_grammar import SCHEMAS as ALL_SCHEMAS
from test_serve import Server, env, stop, wait_serving
from test_startup import gpu_launches  # noqa: F401 (a fixture: kernel launches recorded as the GPU makes them)

MAX_BATCH, MAX_QUEUE, CONTEXT = 16, 56, 256  # MAX_BATCH + MAX_QUEUE = 72 places: the n tests ask for more
SCHEMAS = ALL_SCHEMAS[:5]  # the object schemas (nested objects, arrays, enums, ranges, lengths)


def constraint_fields() -> list:
    """Each way a request asks for a constraint: (the body's fields, how its answer is checked)."""
    out = [({"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s,
                                                                        "strict": True}}}, s)
           for i, s in enumerate(SCHEMAS)]
    return out + [({"guided_json": SCHEMAS[3]}, SCHEMAS[3]), ({"structured_outputs": {"regex": REGEX}}, "regex"),
                  ({"guided_choice": CHOICES}, "choice"), ({"response_format": {"type": "json_object"}}, "object")]


def validate(want, text: str):
    if want == "regex":
        assert re.fullmatch(REGEX, text), text
    elif want == "choice":
        assert text in CHOICES, text
    elif want == "object":
        assert isinstance(json.loads(text), dict), text
    else:
        jsonschema.validate(json.loads(text), want)


def start(tp_dir: str, tmp, *args) -> tuple:
    log = str(tmp / "rank0.err")
    p = subprocess.Popen([TORCHRUN, "--standalone", "--nproc-per-node=2", "serve.py", "--tp-dir", tp_dir, "--port",
                          "0", "--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE),
                          "--max-context", str(CONTEXT), *map(str, args)], cwd=ROOT, env=env(),
                         stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    return Server(wait_serving([p], log), [p], log), p


@pytest.fixture(scope="module")
def tp2(converted):
    return converted("bf16_text", 2, keep_mtp=True)


def serving(tp2, tmp_path_factory, *args):
    """A server for the fixture's scope, stopped by SIGTERM at its end (every rank exits 0)."""
    srv, p = start(tp2, tmp_path_factory.mktemp("serve"), *args)
    try:
        yield srv
        stop(p, srv.log)
    finally:
        if p.poll() is None:
            p.kill()


@pytest.fixture(scope="module")
def plain(tp2, tmp_path_factory):
    yield from serving(tp2, tmp_path_factory)


@pytest.fixture
def speculative(tp2, tmp_path_factory):
    """The speculative server of its one test (the constrained requests): stopped when that test ends rather than
    left idle through the module (an idle server's ranks take ~3% of a core)."""
    yield from serving(tp2, tmp_path_factory, "--speculative", 2)


@pytest.fixture(scope="module")
def served(tp2):
    """(tokenizer, EOS ids, the grammars, the TP=1 model) of the served checkpoint."""
    from conftest import load_tp1
    cfg, _, _ = config.load_config(os.path.join(tp2, "config-r0.json"))
    tdir = os.path.join(tp2, "..", "tokenizer_files")
    tok = runtime.load_tokenizer(tdir)
    eos = sorted(set(cfg.eos_token_id) | {tok.eos_token_id})
    return tok, eos, G.Grammars(os.path.join(tdir, "tokenizer.json"), cfg.vocab_size, eos[0]), cfg


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


def post(srv: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=300)


def chat_body(i: int, fields: dict, budget: int, stream: bool = False) -> dict:
    rng = random.Random(i)
    words = " ".join(rng.choice(["record", "city", "name", "tag", "user", "give", "one", "two"]) for _ in range(4))
    return {"messages": [{"role": "user", "content": f"Answer {i}: {words}"}], "temperature": 1.0, "seed": i,
            "max_tokens": 80, "thinking_token_budget": budget, "return_token_ids": True, "stream": stream, **fields}


def ask(srv: Server, body: dict) -> dict:
    """A chat request (streamed or whole) -> {content, reasoning, ids, finish} of its one choice."""
    if not body.get("stream"):
        r = post(srv, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return {"content": c["message"]["content"], "reasoning": c["message"].get("reasoning_content") or "",
                "ids": c["token_ids"], "finish": c["finish_reason"]}
    got = {"content": "", "reasoning": "", "ids": [], "finish": None}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])["choices"]
            if not c:
                continue
            d = c[0]["delta"]
            got["content"] += d.get("content") or ""
            got["reasoning"] += d.get("reasoning_content") or ""
            got["ids"] += c[0].get("token_ids") or []
            got["finish"] = c[0]["finish_reason"] or got["finish"]
    return got


def replay(served, body: dict, ids: list):
    """Every emitted token through a fresh matcher of the request's constraint (reasoning free until </think>)."""
    tok, eos, grammars, cfg = served
    m = grammars.matcher(grammars.compiled(Q.constraint_of(body)), frozenset(eos),
                         tok.convert_tokens_to_ids("</think>"))
    for t in ids:
        if t in eos:
            assert m.accepting(), "stopped where the grammar cannot end"
            return
        row = torch.zeros(1, grammars.words, dtype=torch.int32)
        assert m.fill(row) is G.Status.OK and G._allowed(row[0], t), f"token {t} not allowed"
        assert m.advance([t]) is G.Status.OK


# ---------------------------------------------------------------------------------------------- constraints
# Constrained requests per server: request i asks for constraint_fields()[i % 9] with the reasoning budget
# [0, 2, 6][i % 3], so each of the nine constraints always comes with the same budget and 27 requests are three seeded
# samples of every (constraint, budget) pair, in more than one round of the server's 16 slots (41 requests with the
# streamed and unconstrained ones). Each sample replays every emitted token through a fresh matcher, so further samples
# of a pair add decode time more than coverage.
CONSTRAINED = 27


@pytest.mark.parametrize("mode", ["plain", "speculative"])
@pytest.mark.slow
def test_constrained_chat_answers_parse_and_validate_beside_unconstrained_ones(request, mode, served):
    """27 constrained chat requests (five bounded JSON schemas by response_format, one by guided_json, a regex by
    structured_outputs, a choice by guided_choice, json_object) sampled at temperature 1 with a reasoning budget of 0,
    2 or 6 tokens, 8 unconstrained requests beside them, all at once: every emitted token replays through a fresh
    matcher, every stopped answer parses and validates, at least 80% stop, the reasoning is cut at its budget; and
    six of them streamed give the same answer as whole."""
    server = request.getfixturevalue(mode)
    tok, _, _, _ = served
    cases = constraint_fields()
    bodies = [chat_body(i, cases[i % len(cases)][0], [0, 2, 6][i % 3]) for i in range(CONSTRAINED)]
    free = [{"messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 12, "temperature": i % 2,
             "seed": i} for i in range(8)]
    streamed = [dict(b, stream=True) for b in bodies[:6]]
    with ThreadPoolExecutor(70) as ex:
        others = [ex.submit(post, server, "/v1/chat/completions", b) for b in free]
        got = list(ex.map(lambda b: ask(server, b), bodies + streamed))
        assert all(o.result().status_code == 200 for o in others)
    end = tok.convert_tokens_to_ids("</think>")
    for i, (b, g) in enumerate(zip(bodies, got)):
        assert g["finish"] in ("stop", "length"), g
        ids = g["ids"]
        assert (ids.index(end) if end in ids else len(ids)) <= b["thinking_token_budget"], (b, ids)
        replay(served, b, ids)
        if g["finish"] == "stop":
            validate(cases[i % len(cases)][1], g["content"])
    stopped = sum(g["finish"] == "stop" for g in got[:CONSTRAINED])
    assert stopped >= 0.8 * CONSTRAINED, f"{stopped} of {CONSTRAINED} stopped"
    for whole, stream in zip(got[:6], got[CONSTRAINED:]):
        assert stream == whole


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "("}}}}}}, "response_format"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs.regex"),
    ({"guided_grammar": "start: ("}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"5": 101}}, "logit_bias"), ({"logit_bias": {"99999": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"n": 0}, "n"), ({"n": 100}, "n"), ({"echo": True}, "echo"), ({"best_of": 2}, "best_of"),
    ({"thinking_token_budget": -1}, "thinking_token_budget"),
])
def test_bad_sampling_fields_are_refused_naming_the_field(plain, body, param):
    r = post(plain, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                             **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_completions_refuse_what_chat_alone_takes(plain):
    for body, param in (({"logprobs": 21}, "logprobs"), ({"top_logprobs": 1}, "top_logprobs"),
                        ({"thinking_token_budget": 4}, "thinking_token_budget"), ({"max_tokens": 0}, "max_tokens"),
                        ({"suffix": "x"}, "suffix"), ({"prompt": [[11, 12]] * 40, "n": 2}, "n")):
        r = post(plain, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_choice_constraint_on_completions_and_a_grammar(plain):
    """Completions take the same constraints: a guided_choice answer is one of the choices; an EBNF grammar's
    answer matches it."""
    c = client(plain)
    for i in range(3):
        r = c.completions.create(model="step5", prompt=f"Capital {i}:", max_tokens=20, temperature=1, seed=i,
                                 extra_body={"guided_choice": CHOICES})
        assert r.choices[0].text in CHOICES and r.choices[0].finish_reason == "stop", r
    r = c.completions.create(model="step5", prompt="Yes or no:", max_tokens=20, temperature=1, seed=3,
                             extra_body={"guided_grammar": 'root ::= "yes" | "no" | "maybe"'})
    assert r.choices[0].text in ("yes", "no", "maybe")


# ---------------------------------------------------------------------------------------------- logprobs
def test_token_bytes_concatenate_to_the_texts_utf8(served):
    """logprobs' bytes: a text's tokens' bytes concatenate to its UTF-8, though a token may hold part of a character
    (its own text then reads U+FFFD); a special token's bytes are its text's."""
    import serve_answers
    tok = served[0]
    tt = serve_answers.token_text(tok)
    for text in ("Hello 你好 world", "张量并行 tensor parallelism", "naïve café ☕ 🙂"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert b"".join(bytes(tt(t)[1]) for t in ids).decode("utf-8") == text
    end = tok.convert_tokens_to_ids("</think>")
    assert tt(end) == ("</think>", list(b"</think>"))


@torch.inference_mode()
def raw_logprobs(model, prompt: list, out: list) -> torch.Tensor:
    """float64 log_softmax of the TP=1 model's logits teacher-forced on prompt + out -> [len(out), V]."""
    ids = prompt + out
    cache = model.new_cache(1, len(ids) + 1)
    h = model.forward_rows(torch.tensor(ids), cache, [len(ids)], rows=[0], held=[0])
    return model.logits(h[len(prompt) - 1:len(ids) - 1]).double().log_softmax(-1)


def tp_noise(logprobs: torch.Tensor) -> float:
    """How far TP=2's logprobs may lie from TP=1's: both logits carry bf16 rounding of the tiny model's (tests/
    invariants.py NOISE, a multiple of std(logits)), twice: a wrong token or position is off by nats."""
    return 2 * NOISE["bf16"] * logprobs.std().item()


def test_chat_logprobs_in_openais_shape_streamed_too(plain, served):
    """logprobs: true with top_logprobs 3: an entry per emitted token (its text, bytes, logprob and 3 alternatives,
    most likely first); a greedy token is its own top alternative; the bytes decode to the text; streamed entries
    are the same."""
    tok = served[0]
    c = client(plain)
    kw = dict(model="step5", messages=[{"role": "user", "content": "Tell me about tensors"}], max_tokens=6,
              temperature=0, logprobs=True, top_logprobs=3, extra_body={"return_token_ids": True, "ignore_eos": True})
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    content = ch.logprobs.content
    assert len(content) == len(ch.token_ids) == 6
    for e, t in zip(content, ch.token_ids):
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token == tok.decode([t], skip_special_tokens=False)
        assert e.logprob <= 0
    parts = [x for x in c.chat.completions.create(**kw, stream=True) if x.choices and x.choices[0].logprobs]
    assert [e for x in parts for e in x.choices[0].logprobs.content] == content


@pytest.mark.slow
def test_completion_logprobs_and_echo_equal_the_models_own(plain, served, tp1_models):
    """Completions logprobs 2 in the legacy shape; echo with a prompt of token-id lists (lm-eval's request) gives the
    prompt's logprobs (the first null) and max_tokens 0 the prompt's alone (as max_tokens 1 gives them); emitted and
    echo logprobs are a float64 log_softmax of the model's logits (the TP=1 model's here, and each other's, within
    the rounding of TP=2 and of prefill against decode, whose MoE routing may flip at a near-tie: tp_noise)."""
    model = tp1_models("bf16_text")
    prompt = [0, 3, 31, 77, 90, 15, 201]
    r = post(plain, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 2,
                                        "ignore_eos": True, "return_token_ids": True}).json()
    ch = r["choices"][0]
    lp, out = ch["logprobs"], ch["token_ids"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(out) == 5
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    ref = raw_logprobs(model, prompt, out)
    for i, t in enumerate(out):
        assert abs(lp["token_logprobs"][i] - ref[i, t].item()) <= tp_noise(ref[i])
        assert 1 <= len(lp["top_logprobs"][i]) <= 3 and max(lp["top_logprobs"][i].values()) == lp["token_logprobs"][i]
    echo = post(plain, "/v1/completions", {"prompt": [prompt + out], "max_tokens": 1, "temperature": 0,
                                           "logprobs": 1, "echo": True}).json()["choices"][0]
    el = echo["logprobs"]
    assert len(el["token_logprobs"]) == len(prompt) + len(out) + 1 and el["token_logprobs"][0] is None
    assert el["top_logprobs"][0] is None
    assert echo["text"].startswith(served[0].decode(prompt + out, skip_special_tokens=False))
    ref = raw_logprobs(model, prompt[:1], prompt[1:] + out)
    for i in range(len(out)):
        assert abs(el["token_logprobs"][len(prompt) + i] - lp["token_logprobs"][i]) <= tp_noise(ref[i])
    for i, x in enumerate(el["token_logprobs"][1:len(prompt) + len(out)]):
        assert abs(x - ref[i, (prompt + out)[i + 1]].item()) <= tp_noise(ref[i])
    zero = post(plain, "/v1/completions", {"prompt": [prompt, prompt[:4]], "max_tokens": 0, "logprobs": 0,
                                           "echo": True}).json()["choices"]
    assert [len(z["logprobs"]["token_logprobs"]) for z in zero] == [len(prompt), 4]
    one = post(plain, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "logprobs": 0, "temperature": 0,
                                          "echo": True}).json()["choices"][0]["logprobs"]
    assert zero[0]["logprobs"]["token_logprobs"] == one["token_logprobs"][:len(prompt)]  # the same prefill's


# ---------------------------------------------------------------------------------------------- n, penalties, bias
@pytest.mark.slow
def test_n_choices_are_the_requests_of_the_derived_seeds(plain):
    """n = 3 with seed s: choices 0..2 (indexed prompt * n + j, streamed with their index) equal three requests with
    seeds s, s + 1, s + 2 run the same way; two prompts x n = 2 are indexed 0..3; usage counts a prompt once."""
    c = client(plain)
    kw = dict(model="step5", prompt=[11, 40, 300, 52], max_tokens=6, temperature=1.0,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    many = c.completions.create(n=3, seed=7, **kw)
    assert [x.index for x in many.choices] == [0, 1, 2] and many.usage.prompt_tokens == 4
    assert many.usage.completion_tokens == 18
    one = [c.completions.create(seed=7 + j, **kw).choices[0].token_ids for j in range(3)]
    assert [x.token_ids for x in many.choices] == one
    assert len({tuple(x) for x in one}) > 1
    got = {}
    for x in c.completions.create(n=3, seed=7, stream=True, **kw):
        for ch in x.choices:
            got.setdefault(ch.index, []).extend(ch.token_ids or [])
    assert [got[j] for j in range(3)] == one
    two = c.completions.create(n=2, seed=1, **{**kw, "prompt": [[11, 40], [12, 41]]})
    assert [x.index for x in two.choices] == [0, 1, 2, 3] and two.usage.prompt_tokens == 4


def test_logit_bias_forces_and_forbids_tokens(plain):
    c = client(plain)
    kw = dict(model="step5", prompt=[11, 40, 300, 52], max_tokens=4, extra_body={"return_token_ids": True,
                                                                                "ignore_eos": True})
    forced = c.completions.create(temperature=1.0, seed=3, logit_bias={"123": 100}, **kw).choices[0]
    assert forced.token_ids == [123] * 4
    greedy = c.completions.create(temperature=0, **kw).choices[0].token_ids
    banned = c.completions.create(temperature=0, logit_bias={str(greedy[0]): -100}, **kw).choices[0].token_ids
    assert banned[0] != greedy[0]


@torch.inference_mode()
def test_penalties_change_the_answer_as_the_reference_says(plain, tp1_models):
    """Greedy with presence, frequency and repetition penalties: each token is the argmax of the TP=1 model's logits
    penalised by the reference rule (OpenAI's: logit - frequency * count - presence * [count > 0]; repetition over
    prompt and output: positive / r, negative * r), up to a near-tie; and the answer differs from the unpenalised
    one."""
    model = tp1_models("bf16_text")
    prompt = [0, 3, 31, 77, 90]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    base = post(plain, "/v1/completions", body).json()["choices"][0]["token_ids"]
    pen = dict(presence_penalty=-2.0, frequency_penalty=-1.5, repetition_penalty=0.7)  # repeats made likelier
    got = post(plain, "/v1/completions", {**body, **pen}).json()["choices"][0]["token_ids"]
    assert got != base
    for i, t in enumerate(got):
        ids = prompt + got[:i]
        cache = model.new_cache(1, len(ids) + 1)
        x = model.forward(torch.tensor(ids), cache, [len(ids)])[0].double()
        seen = set(ids)
        r = pen["repetition_penalty"]
        for s in seen:
            x[s] = x[s] / r if x[s] > 0 else x[s] * r
        for s in set(got[:i]):
            x[s] -= pen["frequency_penalty"] * got[:i].count(s) + pen["presence_penalty"]
        gap = (x.max() - x[t]).item()
        assert gap <= 0.06 * x.std().item(), f"step {i}: token {t} is {gap:.3f} below the reference's argmax"
        if gap > 0:
            break  # a near-tie: the continuations differ from here on


def test_min_p_keeps_only_the_likely_tokens(plain, tp1_models):
    """min_p 1 at temperature 1 leaves the most likely token alone (the answer is greedy's)."""
    body = {"prompt": [11, 40, 300, 52], "max_tokens": 5, "ignore_eos": True, "return_token_ids": True}
    greedy = post(plain, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["token_ids"]
    got = post(plain, "/v1/completions", {**body, "temperature": 1, "min_p": 1, "seed": 5}).json()
    assert got["choices"][0]["token_ids"] == greedy


# ---------------------------------------------------------------------------------------------- lm-eval
def score_choices(srv: Server, tok, items: list) -> tuple[float, list]:
    """Accuracy of a multiple-choice task scored as lm-eval's local-completions scores it: one request per batch of
    (context + continuation) token-id lists with echo, logprobs 1, max_tokens 1; each choice's log-likelihood the sum
    of its continuation's logprobs; the answer the most likely choice. -> (accuracy, each item's log-likelihoods)"""
    reqs, spans = [], []
    for it in items:
        ctx = tok(it["question"], add_special_tokens=False)["input_ids"]
        for ch in it["choices"]:
            cont = tok(" " + ch, add_special_tokens=False)["input_ids"]
            reqs.append(ctx + cont)
            spans.append(len(ctx))
    body = {"model": "step5", "prompt": reqs, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
            "seed": 1234}
    got = sorted(post(srv, "/v1/completions", body).json()["choices"], key=lambda c: c["index"])
    ll = [sum(c["logprobs"]["token_logprobs"][n:-1]) for c, n in zip(got, spans)]
    right, k, per = 0, 0, []
    for it in items:
        scores = ll[k:k + len(it["choices"])]
        right += max(range(len(scores)), key=scores.__getitem__) == it["answer"]
        k += len(it["choices"])
        per.append(scores)
    return right / len(items), per


TASK = [{"question": q, "choices": c, "answer": a} for q, c, a in [
    ("The capital of France is", ["Paris", "London", "Tokyo"], 0),
    ("Two plus two is", ["four", "five", "three"], 0),
    ("The sky is", ["blue", "green", "loud"], 0),
    ("Water is", ["wet", "dry", "square"], 0),
    ("A cat says", ["meow", "moo", "quack"], 0),
    ("The sun rises in the", ["east", "west", "north"], 0),
]]


@pytest.mark.slow
def test_lm_eval_scores_the_server_as_its_own_echo_logprobs_do(plain, served, tmp_path):
    """lm-evaluation-harness (lm-eval[api], requirements-eval.txt) runs a local multiple-choice task through its
    local-completions model against the server, offline; its accuracy equals the one computed from the server's own
    echo logprobs (score_choices, lm-eval's request shape), and so do its samples' log-likelihoods."""
    import importlib.util
    if importlib.util.find_spec("lm_eval") is None:  # not imported here: transformers would take kernels/ for HF's
        pytest.skip("lm-eval[api] is not installed (pip install -r requirements-eval.txt)")
    tok = served[0]
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in TASK))
    (tmp_path / "mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: " + str(data) + "\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n")
    tdir = os.path.join(os.path.dirname(served[2].tokenizer_file))
    out = tmp_path / "res"
    r = subprocess.run([os.path.join(os.path.dirname(TORCHRUN), "lm_eval"), "--model", "local-completions",
                        "--model_args", f"model=step5,base_url={plain.url}/v1/completions,tokenizer={tdir},"
                        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,tokenized_requests=True",
                        "--tasks", "tiny_mc", "--include_path", str(tmp_path), "--output_path", str(out),
                        "--log_samples"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,  # not beside kernels/
                       env=dict(env(), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"))
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(next(out.rglob("results*.json")).read_text())
    acc, lls = score_choices(plain, tok, TASK)
    assert res["results"]["tiny_mc"]["acc,none"] == pytest.approx(acc)
    samples = [json.loads(x) for x in next(out.rglob("samples_tiny_mc*.jsonl")).read_text().splitlines()]
    got = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in samples}  # written as strings
    assert sum((got[i] for i in range(len(TASK))), []) == pytest.approx(sum(lls, []), abs=1e-6)


# ---------------------------------------------------------------------------------------------- start-up's promise
@pytest.mark.slow
@torch.inference_mode()
def test_api_requests_compile_and_capture_nothing_after_start_up(converted, tp1_models, gpu_launches):
    """The requests the API makes of sampling bodies (a constrained chat with a reasoning budget, a penalised and
    biased one with min_p and logprobs, n = 2, completions echo with max_tokens 0 and 1), turned into engine requests
    as serve.py does (serve.new_of, runtime.request_of), launch only what start-up compiled and capture no graph; and
    the engine's check finds each constraint compiled by the front end (no compile of its own)."""
    import chat
    import engine as E
    import serve
    import startup
    from tools import sass
    d = converted("fp8_text", 1)
    lm = tp1_models("fp8_text")
    cfg = lm.cfg
    tdir = os.path.join(d, "..", "tokenizer_files")
    tok = runtime.load_tokenizer(tdir)
    eos = sorted(set(cfg.eos_token_id) | {tok.eos_token_id})
    grammars = G.Grammars(os.path.join(tdir, "tokenizer.json"), cfg.vocab_size, eos[0])
    # 256 positions in chunks of 64: 11 warm passes (kernel.prefill_warm_lengths) against 18 at 640 in chunks of 256,
    # whose added ones reach the DSA regimes past 240 positions that these requests (at most ~50) never take
    eng = E.Engine(lm, E.EngineConfig(max_batch=4, max_context=256, prefill_chunk=64), grammars=grammars)
    warm, seen, captured = set(), set(), []
    with sass.launch_keys(warm, execute=False):
        eng.start()
    lim = Q.Limits(eng.max_context, cfg.vocab_size, 64, None, None, 8, grammars)
    btok, think = chat.BoundedTokenizer(tok), chat.think_ids(tok)
    say = {"messages": [{"role": "user", "content": "Give me a record"}], "max_tokens": 12, "seed": 1}
    jobs = Q.chat_jobs({**say, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMAS[0]}},
                        "thinking_token_budget": 2}, btok, lim, eos, think)
    jobs += Q.chat_jobs({**say, "presence_penalty": 1, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                         "min_p": 0.1, "logit_bias": {"7": 3}, "logprobs": True, "top_logprobs": 3, "n": 2},
                        btok, lim, eos, think)
    for n in (0, 1):
        jobs += Q.completion_jobs({"prompt": [[11, 40, 300, 52] * 8], "max_tokens": n, "echo": True, "logprobs": 2},
                                  btok, lim, eos)
    compiles = grammars.compiles
    reqs = [runtime.request_of(serve.new_of(i, j), None) for i, j in enumerate(jobs)]
    real_capture = startup.Graph.capture
    startup.Graph.capture = lambda g: captured.append(g) or real_capture(g)
    try:
        with sass.launch_keys(seen, execute=False):
            eng.run(reqs)
    finally:
        startup.Graph.capture = real_capture
    assert grammars.compiles == compiles, "the engine compiled a constraint the front end had compiled"
    assert len(seen) > 10 and not captured and not seen - warm, sorted(seen - warm, key=str)[:3]
    assert all(r.finish in ("stop", "length") for r in reqs), [(r.finish, r.error) for r in reqs]
    assert reqs[0].reasoning is not None and reqs[0].constraint is not None
    assert len(reqs[1].token_logprobs) == len(reqs[1].out) and reqs[1].sampling.seed + 1 == reqs[2].sampling.seed
    assert [len(r.prompt_logprobs) for r in reqs[3:]] == [32, 32] and reqs[3].out == []
