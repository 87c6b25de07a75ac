"""The choose step (choice.py): logit bias, penalties and min_p against a small reference on fixed logits; logprobs
against a float64 log_softmax (a greedy token its own top alternative, ties to the lowest id); through the engine on
the tiny checkpoint: penalised greedy tokens are the reference's argmax of teacher-forced logits, logit_bias +100
forces a token, a reasoning budget forces the end of reasoning, n choices are requests with derived seeds, and echo
gives each prompt token's logprob from its prefill (per chunk, no cache reuse) as a teacher-forced decode does.
"""
from types import SimpleNamespace

import pytest
import torch

import choice
import engine as E
import model as M
import speculative
from sampling import RowSampling, Sampling, probabilities
from test_engine import ids


@pytest.fixture(scope="module")
def lm(tp1_models):
    return tp1_models("bf16_text")


def slots_for(samplings: list, V: int, prompts: list | None = None) -> choice.Slots:
    st = choice.Slots(len(samplings), V, "cpu")
    for i, s in enumerate(samplings):
        st.take(i, SimpleNamespace(sampling=s, ids=(prompts or [[0]] * len(samplings))[i], constraint=None,
                                   reasoning=None))
    return st


def reference(logits: torch.Tensor, s: Sampling, prompt: list, out: list) -> torch.Tensor:
    """One row's processed logits, token by token in float64 (the rules of sampling.Sampling's docstring)."""
    x = logits.double().clone()
    for t, b in (s.logit_bias or {}).items():
        x[t] += b
    for v in range(x.shape[0]):
        n = out.count(v)
        if v in prompt or n:
            x[v] = x[v] / s.repetition_penalty if x[v] > 0 else x[v] * s.repetition_penalty
        x[v] -= s.frequency_penalty * n + s.presence_penalty * (n > 0)
    return x


def test_bias_and_penalties_match_a_reference_on_fixed_logits():
    g = torch.Generator().manual_seed(0)
    V = 40
    logits = torch.randn(4, V, generator=g) * 3
    ss = [Sampling(), Sampling(1.0, presence_penalty=1.5, frequency_penalty=-0.5, seed=1),
          Sampling(0.0, repetition_penalty=1.7, logit_bias={3: 100.0, 7: -42.5}),
          Sampling(0.8, presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.6, logit_bias={0: 1.0})]
    prompts = [[1], [2, 2, 5], [5, 9, 11], [0, 39]]
    outs = [[], [4, 4, 4, 8], [9, 13, 13], [1, 2, 2, 39, 6]]
    st = slots_for(ss, V, prompts)
    for i, o in enumerate(outs):
        for t in o:
            st.counts[i, t] += 1
    slots = torch.arange(4)
    got = choice.process(logits, st, slots, torch.full((4, 2), -1, dtype=torch.int32), st.counts[slots],
                         st.thinking[slots], st.think_left[slots])
    for i in range(4):
        want = reference(logits[i], ss[i], prompts[i], outs[i])
        assert torch.allclose(got[i].double(), want, atol=1e-5), (i, (got[i] - want).abs().max())
    assert got[2].argmax() == 3  # +100 wins


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_best():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 64, generator=g) * 2
    ss = [Sampling(0.7, min_p=0.1), Sampling(1.5, min_p=0.5, top_k=10), Sampling(1.0, min_p=0.0)]
    got = probabilities(logits, RowSampling.of(ss, "cpu"))
    for i, s in enumerate(ss):
        p = (logits[i].double() / s.temperature).softmax(-1)
        keep = p >= s.min_p * p.max()
        if s.top_k:
            keep &= p >= p[keep].topk(min(s.top_k, int(keep.sum()))).values[-1]
        want = torch.where(keep, p, 0.0)
        assert torch.allclose(got[i].double(), want / want.sum(), atol=1e-6), i


def test_logprobs_are_the_raw_log_softmax_and_a_greedy_token_is_its_own_top_alternative():
    g = torch.Generator().manual_seed(2)
    V = 300
    logits = (torch.randn(5, V, generator=g) * 8).bfloat16().float()  # bf16 values, as the head gives: ties happen
    logits[0, [17, 9, 250]] = logits[0].max() + 1.0  # a three-way tie at the top: the lowest id is greedy's
    st = slots_for([Sampling(), Sampling(), Sampling(2.0, seed=3), Sampling(logit_bias={5: 100.0}), Sampling()], V)
    slots = torch.arange(5)
    tok, lp, top_ids, top_lp = choice.choose(logits, st, slots, torch.full((5, 10), -1, dtype=torch.int32),
                                            torch.zeros(5, dtype=torch.long), torch.ones(5, dtype=torch.long))
    want = torch.log_softmax(logits.double(), -1)
    assert tok[0] == 9 and top_ids[0, :3].tolist() == [9, 17, 250]
    assert tok[3] == 5 and top_ids[3, 0] != 5  # the bias moved the choice, not the model's distribution
    for i in range(5):
        assert abs(lp[i].item() - want[i, tok[i]].item()) < 1e-4
        assert (top_lp[i].double() - want[i, top_ids[i]]).abs().max() < 1e-4
        assert top_lp[i].tolist() == sorted(top_lp[i].tolist(), reverse=True)
        assert set(top_ids[i].tolist()) == set(want[i].topk(choice.TOP).indices.tolist()) or i == 0
    for i in (0, 1, 4):
        assert top_ids[i, 0] == tok[i]  # greedy: its own top alternative


# ---------------------------------------------------------------------------------------------- through the engine
def test_the_lean_and_argmax_steps_choose_as_the_whole_step():
    """Rows with neither top_k / top_p nor logprobs: the lean choose step (no sort, no logprobs) gives the same
    distribution bit for bit as the whole step gives them beside a nucleus row, and so the same draws, step after step
    as penalties move the logits; greedy rows (biased, penalised, a grammar's mask) get the same tokens from the
    argmax step (no draw)."""
    g = torch.Generator().manual_seed(3)
    V = 500
    logits = (torch.randn(6, V, generator=g) * 4).bfloat16().float()
    ss = [Sampling(0.9, seed=1, min_p=0.02), Sampling(1.3, seed=2, frequency_penalty=1.5),
          Sampling(presence_penalty=1.0, logit_bias={9: 3.0}), Sampling(repetition_penalty=1.3), Sampling(),
          Sampling(0.7, top_p=0.8, seed=4)]
    whole = probabilities(logits, RowSampling.of(ss, "cpu"))
    assert torch.equal(probabilities(logits[:5], RowSampling.of(ss[:5], "cpu"), nucleus=False), whole[:5])
    mask = torch.full((6, (V + 31) // 32), -1, dtype=torch.int32)
    mask[4, :8] = 0  # the greedy row's grammar refuses ids 0-255
    every, lean, argmax = slots_for(ss, V), slots_for(ss[:5], V), slots_for(ss[2:5], V)
    every.masked[4] = lean.masked[4] = argmax.masked[2] = True
    live = torch.ones(6, dtype=torch.long)
    for step in range(6):
        counters = torch.full((6,), step)
        want = choice.choose(logits, every, torch.arange(6), mask, counters, live)
        got = choice.choose(logits[:5], lean, torch.arange(5), mask[:5], counters[:5], live[:5], choice.Pick.LEAN)
        top = choice.choose(logits[2:5], argmax, torch.arange(3), mask[2:5], counters[2:5], live[2:5],
                            choice.Pick.ARGMAX)
        assert len(want) == 4 and len(got) == 1 and len(top) == 1
        assert torch.equal(got[0], want[0][:5]) and torch.equal(top[0], want[0][2:5]), step
        assert want[0][4] >= 256
    assert torch.equal(lean.counts, every.counts[:5]) and torch.equal(argmax.counts, every.counts[2:5])


def engine(lm, B=4, **kw) -> E.Engine:
    eng = E.Engine(lm, E.EngineConfig(max_batch=B, max_context=192, **kw))
    eng.start()
    return eng


@torch.inference_mode()
def test_penalised_greedy_tokens_are_the_reference_argmax_of_teacher_forced_logits(lm):
    """A greedy request with bias and penalties beside a plain one: each emitted token is the argmax of the reference
    processing of the logits a teacher-forced pass gives at its position (counts of the tokens emitted before it)."""
    prompt = ids(20, 61)
    eng = engine(lm)
    first = eng.run([E.Request(prompt, 1)])[0].out[0]  # biased up: it repeats until the penalties push it down
    s = Sampling(presence_penalty=2.0, frequency_penalty=1.5, repetition_penalty=1.3, logit_bias={first: 30.0})
    r, other = eng.run([E.Request(prompt, 10, sampling=s), E.Request(ids(9, 62), 10)])
    assert len(r.out) == 10 and other.out == engine(lm).run([E.Request(ids(9, 62), 10)])[0].out
    cache = lm.new_cache(1, 64)
    logits = [lm.forward(torch.tensor(prompt), cache, [20])[0]]
    for t in r.out[:-1]:
        logits.append(lm.forward(torch.tensor([t]), cache)[0])
    moved = 0
    for j, lg in enumerate(logits):
        x = reference(lg, s, prompt, r.out[:j])
        top2 = x.topk(2).values
        assert r.out[j] == x.argmax() or top2[0] - top2[1] < 1e-3 * top2[0].abs(), j
        moved += lg.argmax() != x.argmax()
    assert moved > 1 and 1 < r.out.count(first) < 10, (moved, r.out)


@torch.inference_mode()
def test_logit_bias_plus_100_forces_a_token_and_minus_100_forbids_it(lm):
    eng = engine(lm)
    free = eng.run([E.Request(ids(12, 63), 6)])[0].out
    reqs = eng.run([E.Request(ids(12, 63), 6, sampling=Sampling(t, logit_bias={777: 100.0}, seed=4))
                    for t in (0.0, 1.0)] + [E.Request(ids(12, 63), 6, sampling=Sampling(logit_bias={free[0]: -100.0}))])
    assert reqs[0].out == reqs[1].out == [777] * 6
    assert reqs[2].out[0] != free[0]


@torch.inference_mode()
def test_a_reasoning_budget_forces_the_end_of_reasoning(lm):
    """The end id is forced once the reasoning has used its budget (0: the first token), on the device, beside a
    request without reasoning (one batch: a row's tokens do not depend on the others); the model's own end ends
    reasoning early, and then nothing is forced."""
    eng = engine(lm, B=5)
    end, p = 900, ids(15, 64)
    own_end = engine(lm, B=1).run([E.Request(p, 2)])[0].out[1]  # the model's own second token
    plain, *reqs = eng.run([E.Request(p, 8)]
                           + [E.Request(p, 8, reasoning=choice.Reasoning(end, b)) for b in (0, 3, None)]
                           + [E.Request(p, 8, reasoning=choice.Reasoning(own_end, 2))])
    plain = plain.out
    assert end not in plain
    assert reqs[0].out[0] == end and reqs[0].out[1:] != plain[:7]  # the answer after the forced end reads it
    assert reqs[1].out[:4] == plain[:3] + [end] and reqs[2].out == plain
    assert reqs[3].out == plain and plain[2] != plain[1]  # its own end (plain[1]) came first: nothing forced after


@torch.inference_mode()
def test_n_choices_are_requests_with_derived_seeds_whatever_runs_beside_them(lm):
    s = Sampling(3.0, seed=11)
    eng = engine(lm)
    three = eng.run([E.Request(ids(10, 65), 8, sampling=s.derived(j)) for j in range(3)])
    alone = [engine(lm, B=1).run([E.Request(ids(10, 65), 8, sampling=Sampling(3.0, seed=11 + j))])[0].out
             for j in range(3)]
    assert [r.out for r in three] == alone and len({tuple(a) for a in alone}) == 3
    assert Sampling(seed=2 ** 63 - 1).derived(2).seed == 1


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("temperature", [0.0, 1.5])
@torch.inference_mode()
def test_a_request_chooses_the_same_tokens_in_every_choose_step_variant(lm, converted, monkeypatch, k, temperature):
    """A penalised request without top_k / top_p or logprobs, beside a plain greedy one, runs the lean choose step when
    it samples and the argmax step when greedy; beside the same request reporting logprobs (the same batch, so the
    same logits bit for bit), the whole one: its tokens are the same (plain decode steps, and speculative verify steps
    with 2 drafts)."""
    from conftest import load_tp1
    m = load_tp1(converted("bf16_text", 1, keep_mtp=True)) if k else lm
    picks = []  # each decode step's choose variant
    if k:
        real_accept = speculative.Speculator._accept
        monkeypatch.setattr(speculative.Speculator, "_accept", lambda self, slots, lg, pick=choice.Pick.WHOLE: (
            picks.append(pick), real_accept(self, slots, lg, pick))[1])
    else:
        real_choose = choice.choose  # the choose graphs pass the variant as the 7th argument; a prefill, none
        monkeypatch.setattr(choice, "choose", lambda *a: (picks.extend(a[6:7]), real_choose(*a))[1])
    s = Sampling(temperature, seed=3, presence_penalty=0.4, repetition_penalty=1.1)
    outs = []
    for logprobs, pick in ((None, choice.Pick.LEAN if temperature else choice.Pick.ARGMAX), (2, choice.Pick.WHOLE)):
        eng = engine(m, speculative=k)
        picks.clear()  # start-up's warm-ups
        reqs = eng.run([E.Request(ids(10, 65), 12, sampling=s), E.Request(ids(9, 80), 12, logprobs=logprobs)])
        assert set(picks) == {pick}
        outs.append(reqs[0].out)
    assert outs[0] == outs[1] and len(reqs[1].token_logprobs) == 12


@pytest.mark.parametrize("chunk", [16, 256])
@torch.inference_mode()
def test_echo_gives_each_prompt_tokens_logprob_from_its_prefill(lm, monkeypatch, chunk):
    """Echo: a logprob per prompt token (None for the first) from the prefill's own rows, computed per chunk (16:
    three chunks) and PROMPT_ROWS rows at a time without gathering the vocabulary, with no cache reuse: the float64
    log_softmax of the prefill's own logits to 1e-4, with their top alternatives in order; a teacher-forced decode of
    the prompt token by token (the prefill's routing and region decisions pinned) to 0.05 nats beyond the rounding
    of its bf16 logits. max_new_tokens 0
    prefills and ends; with new tokens the prompt's logprobs are the same."""
    from invariants import pinned
    monkeypatch.setattr(choice, "PROMPT_ROWS", 8)
    rows, real = [], choice.prompt_logprobs
    monkeypatch.setattr(choice, "prompt_logprobs", lambda m, h, t, k: rows.append(h.clone()) or real(m, h, t, k))
    prompt = ids(40, 66)
    eng = engine(lm, prefill_chunk=chunk)
    eng.run([E.Request(prompt + ids(5, 67), 2)])  # the slot now holds the prompt: echo must not reuse it
    with pinned(lm, M.Pins()) as rec:
        r = eng.run([E.Request(prompt, 0, logprobs=3, echo=True)])[0]
    assert r.cached == 0 and r.out == [] and r.finish == "length" and len(rows) == (3 if chunk == 16 else 1)
    assert len(r.prompt_logprobs) == len(prompt) and r.prompt_logprobs[0] is None
    own = torch.log_softmax(lm.logits(torch.cat(rows)).double(), -1)  # row i predicts prompt token i + 1
    cache = lm.new_cache(1, 64)
    with pinned(lm, M.Pins(rec.data, requests=[r.rid])):
        forced = [lm.forward(torch.tensor(prompt[:1]), cache, [1])[0]]
        for t in prompt[1:-1]:
            forced.append(lm.forward(torch.tensor([t]), cache)[0])
    for i in range(1, len(prompt)):
        lp, top = r.prompt_logprobs[i]
        assert abs(lp - own[i - 1, prompt[i]].item()) < 1e-4, i
        # the head's logits are bf16: 1 ulp at this fixture's magnitudes (16-38) is 0.125-0.25, and a log_softmax
        # moves by at most twice its inputs' largest change; an off-by-one target would differ by nats
        ulp = 2.0 ** (torch.floor(torch.log2(forced[i - 1].abs().max())).item() - 7)
        assert abs(lp - torch.log_softmax(forced[i - 1].double(), -1)[prompt[i]].item()) < 0.05 + 2 * ulp, i
        want = sorted(range(own.shape[1]), key=lambda v: (-own[i - 1, v].item(), v))[:3]
        assert [t for t, _ in top] == want and all(abs(x - own[i - 1, t].item()) < 1e-4 for t, x in top)
    g = eng.run([E.Request(prompt, 3, logprobs=1, echo=True)])[0]
    assert len(g.out) == 3 and g.cached == 0 and g.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        assert abs(g.prompt_logprobs[i][0] - r.prompt_logprobs[i][0]) < 0.05 and len(g.prompt_logprobs[i][1]) == 1
    with pytest.raises(ValueError, match="echo needs logprobs"):
        eng.submit(E.Request(prompt, 1, echo=True))
    with pytest.raises(ValueError, match="logprobs 21 must be an integer in"):
        eng.submit(E.Request(prompt, 1, logprobs=21))


def test_bad_choice_fields_are_refused_naming_the_field(lm):
    eng = E.Engine(lm, E.EngineConfig(max_batch=1, max_context=64))
    cases = [(Sampling(presence_penalty=2.5), "presence_penalty 2.5 must be a number in"),
             (Sampling(frequency_penalty=float("nan")), "frequency_penalty nan"),
             (Sampling(repetition_penalty=0), "repetition_penalty 0 must be a finite number > 0"),
             (Sampling(min_p=0.5), "min_p 0.5 needs temperature > 0"),
             (Sampling(1.0, min_p=1.5), "min_p 1.5 must be in"),
             (Sampling(logit_bias={5: 101}), r"logit_bias\[5\] = 101 must be a number in \[-100, 100\]"),
             (Sampling(logit_bias={"5": 1}), "logit_bias: '5' is not a token id"),
             (Sampling(logit_bias={1024: 1}), r"logit_bias: 1024 is not a token id in \[0, 1024\)"),
             (Sampling(logit_bias=[(5, 1)]), "logit_bias must be a map"),
             (Sampling(logit_bias={i: 1 for i in range(1025)}), "logit_bias holds 1025 entries")]
    for s, match in cases:
        with pytest.raises(ValueError, match=match):
            eng.submit(E.Request(ids(5, 1), 2, sampling=s))
    with pytest.raises(ValueError, match=r"thinking_token_budget -1 must be an integer"):
        eng.submit(E.Request(ids(5, 1), 2, reasoning=choice.Reasoning(900, -1)))
    with pytest.raises(ValueError, match=r"reasoning.end_id 5000 is not a token id"):
        eng.submit(E.Request(ids(5, 1), 2, reasoning=choice.Reasoning(5000)))
    import grammar as G
    with pytest.raises(ValueError, match="response_format: this engine has no tokenizer view"):
        eng.submit(E.Request(ids(5, 1), 2, frozenset({4}), constraint=G.Constraint(G.Kind.JSON_OBJECT)))
    with pytest.raises(ValueError, match="view spans 2048 ids; the model's vocabulary 1024"):
        E.Engine(lm, E.EngineConfig(max_batch=1, max_context=64), grammars=G.Grammars("unused.json", 2048, 4))
    assert not eng.busy() and M.world_size == 1
