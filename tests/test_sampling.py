"""Token choice (sampling.py): greedy's argmax over the rank-ordered vocabulary windows, and seeded sampling
(temperature, top_k, top_p): the tempered softmax within the top k and the nucleus, each row drawn by its own seed and
counter whatever its batch, reproducible with its seed; temperature 0 and top_k 1 give the greedy tokens through the
engine. (generate.py's sampling flags, at TP=2 included: tests/test_generate.py.)
"""
import torch

import helpers
import kernel as K
import sampling
from test_generate import EOS, NEW, PROMPTS


def sample(logits, rs, counters):
    """A draw per row of the logits [N, V] by its parameters (RowSampling) at its counter."""
    return sampling.draw(sampling.probabilities(logits, rs), rs, counters)


def draws(logits, t, k=0, p=1.0, seed=0):
    """One draw per row of logits [N, V], each row its own counter (so the rows are independent draws)."""
    n = logits.shape[0]
    rs = sampling.RowSampling.of([sampling.Sampling(t, k, p, seed)] * n, logits.device)
    return sample(logits, rs, torch.arange(n))


def test_greedy_is_the_argmax_with_ties_to_the_lowest_id_and_flags_non_finite_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 100, generator=g)
    logits[0, [9, 7]] = logits[0].max() + 1  # a tie: the lowest id wins
    logits[1, 3] = float("nan")
    logits[2, 5] = float("inf")
    want = logits.argmax(-1)
    got = sampling.greedy(logits)
    assert got[0] == 7 and got[1] == -1 and got[2] == -1 and torch.equal(got[3:], want[3:])


def test_sample_top_k_1_and_tiny_top_p_are_the_argmax():
    """A top_p below the nucleus sum's 2^-48 resolution (1e-20; 1e-45 is fp32's smallest) still keeps the first token;
    a top_k of any size up to 2^63 - 1 keeps them all."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 100, generator=g)
    logits[0, [9, 7]] = logits[0].max() + 1  # a tie: the lowest id wins, as in greedy
    want = sampling.greedy(logits)
    assert want[0] == 7
    for t in (0.5, 5.0):
        assert torch.equal(draws(logits, t, 1), want)
        for p in (1e-6, 1e-20, 1e-45):
            assert torch.equal(draws(logits, t, 0, p), want)
    assert torch.equal(draws(logits, 5.0, 2 ** 63 - 1, seed=4), draws(logits, 5.0, 0, seed=4))


def test_sample_top_k_restricts_the_support():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4000, 50, generator=g)
    got = draws(logits, 3.0, 5)  # a high temperature: the whole top 5 gets drawn
    hit = logits.topk(5, dim=-1).indices == got[:, None]  # [4000, 5]
    assert hit.any(-1).all(), "a token outside the top 5 was drawn"
    assert set(hit.float().argmax(-1).tolist()) == set(range(5))


def test_sample_top_p_keeps_the_nucleus():
    # ids 1 and 3 hold 0.5 + 0.3: the nucleus of 0.75 (clear of 0.8, where fp32 rounding of the softmax decides)
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    n = 20000
    got = draws(probs.log().expand(n, 4), 1.0, 0, 0.75, seed=2)
    counts = torch.bincount(got, minlength=4)
    assert counts[0] == counts[2] == 0 and counts[1] > 0 and counts[3] > 0, counts
    assert abs(counts[1].item() / n - 0.5 / 0.8) < 0.02, counts  # renormalised within the nucleus


def test_sample_follows_the_tempered_softmax():
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    n = 20000
    top = {}
    for t in (0.5, 5.0):
        freq = torch.bincount(draws(logits.expand(n, 4), t, seed=3), minlength=4) / n
        assert (freq - (logits / t).softmax(-1)).abs().max() < 0.02, (t, freq)
        top[t] = freq[3].item()
    assert top[5.0] < 0.4 < 0.8 < top[0.5]  # a high temperature spreads the draws


def test_sample_rows_draw_by_their_own_seed_and_counter():
    """A row's draw is a function of (logits, its sampling, its counter) alone: the same in any batch."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, 300, generator=g)
    sp = [sampling.Sampling(1.5, 0, 1.0, s) for s in (1, 2, 3, 1, 2, 3)]
    rs = sampling.RowSampling.of(sp, "cpu")
    counters = torch.tensor([0, 0, 0, 5, 5, 5])
    batch = sample(logits, rs, counters)
    for i in range(6):
        alone = sample(logits[i:i + 1], sampling.RowSampling.of([sp[i]], "cpu"), counters[i:i + 1])
        assert alone[0] == batch[i]
    u = K.uniform(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 1000)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2]) and 0 < u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.02


def test_a_uniform_that_rounds_to_one_never_draws_a_token_of_probability_zero():
    """Seed 2775, counter 0: column 502's uniform is 1.0 in fp32 (its exponential 0). A row whose only possible token
    is another (a grammar's forced token, top_k 1) still draws that token, and a row that allows 502 too draws from
    the two."""
    seed, col, V = 2775, 502, 1024
    assert K.uniform(torch.tensor([seed]), torch.tensor([0]), V)[0, col] == 1.0
    rs = sampling.RowSampling.of([sampling.Sampling(1.0, 0, 1.0, seed)], "cpu")
    probs = torch.zeros(1, V)
    probs[0, 7] = 1.0
    assert sampling.draw(probs, rs, torch.tensor([0])).item() == 7
    probs[0, col] = 1e-3
    assert sampling.draw(probs, rs, torch.tensor([0])).item() in (7, col)


def test_sampling_temperature_0_and_top_k_1_give_the_greedy_tokens(tp1_models):
    tp1_model = tp1_models("fp8_vl")
    want = helpers.generate(tp1_model, PROMPTS, NEW, EOS)[0]
    assert helpers.generate(tp1_model, PROMPTS, NEW, EOS, sampling=sampling.Sampling(0.0, seed=7))[0] == want
    assert helpers.generate(tp1_model, PROMPTS, NEW, EOS, sampling=sampling.Sampling(1.0, 1, seed=7))[0] == want


def test_sampling_is_reproducible_with_its_seed(tp1_models):
    tp1_model = tp1_models("fp8_vl")
    # temperature 5 on the tiny model's logits (std ~8 over 1024 ids): near-flat, so two seeds agreeing on all
    # 18 tokens is out of the question
    run = lambda seed: helpers.generate(tp1_model, PROMPTS, NEW, EOS, sampling=sampling.Sampling(5.0, seed=seed))[0]  # noqa: E731,E501
    a = run(3)
    assert run(3) == a
    assert run(4) != a
