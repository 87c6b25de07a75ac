"""Speculative decoding (speculative.py) on the tiny BF16 text checkpoint converted with --keep-mtp, in process at
TP=1: whatever the drafts (the MTP layers', plain greedy's own tokens, wrong ones), every emitted token is the main
model's argmax, so the output is plain greedy's; an image request, an EOS inside an accepted run, the rollback of the
MTP caches and fresh prompts and next turns by padded passes likewise. (generate.py's --speculative:
tests/test_generate.py.)

The verify step's extend rounds differently from 1-row decode steps, so plain greedy's routing and region decisions
are pinned into it (model.Pins; rejected rows keep their own) and a token may differ only at a measured near-tie
(tests/invariants.py).
"""
import os

import pytest
import torch

import engine
import generate
import helpers
import kernel
import model as M
from helpers import force_drafts, record_replays
from invariants import pinned, tokens_agree_up_to_near_tie
from test_generate import PROMPTS, ids_prompt, image_batch


@pytest.fixture(scope="module")
def mtp_model(converted):
    """The TP=1 BF16 text model converted with --keep-mtp."""
    import config
    d = converted("bf16_text", 1, keep_mtp=True)
    cfg = config.load_config(os.path.join(d, "config-r0.json"))[0]
    return M.Step5ForCausalLM.from_shard(os.path.join(d, "model-r0.safetensors"), cfg)


SPEC_NEW = 10


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drafts", ["mtp", "right", "wrong"])
@pytest.mark.slow
def test_speculative_output_is_plain_greedy(mtp_model, k, drafts, monkeypatch):
    """Whatever the drafts, every emitted token is the main model's argmax: the output equals plain greedy. With
    plain greedy's own tokens as drafts every draft is accepted; with wrong ones none is, and the rolled-back rows
    leave no trace. The verify step's extend rounds differently from 1-row decode steps, so plain greedy's routing and
    region decisions are pinned into it (rejected rows keep their own) and a token may differ only at a near-tie."""
    m = mtp_model
    with pinned(m, M.Pins()) as rec:
        ref = helpers.generate(m, PROMPTS, SPEC_NEW, [])[0]
    if drafts != "mtp":
        force_drafts(monkeypatch, ref, PROMPTS, int(drafts == "wrong"))
    with pinned(m, M.Pins(rec.data, strict=False)):
        out, st = helpers.generate(m, PROMPTS, SPEC_NEW, [], speculative=k)
    for p, o, r in zip(PROMPTS, out, ref):
        tokens_agree_up_to_near_tie(m, p, o, r)
    assert len(st["proposed"]) == k and st["verify_steps"] >= 1
    if out == ref and drafts == "right":
        assert st["accepted"] == st["proposed"]  # all accepted: (k + 1) tokens per verify step
    if drafts == "wrong":
        assert st["accepted"] == [0] * k


@pytest.mark.slow
def test_speculative_with_an_image_request_is_plain_greedy(converted, tmp_path, monkeypatch):
    """An image request through speculative decoding: the prefill places the image features (the MTP layers read the
    placeholder token's embedding at image positions, see speculative.Speculator); with the MTP drafts or with plain
    greedy's own tokens as drafts the output is plain greedy's (decisions pinned; a token may differ at a near-tie)."""
    import config
    d = converted("fp8_vl", 1, keep_mtp=True)
    cfg, vl, _ = config.load_config(os.path.join(d, "config-r0.json"))
    m = M.Step5ForCausalLM.from_shard(os.path.join(d, "model-r0.safetensors"), cfg, "cpu", vl, rank=0)
    reqs = image_batch(tmp_path)
    prompts = [r["prompt_ids"] if isinstance(r, dict) else r for r in reqs]
    images = [None, generate.load_image_inputs(str(tmp_path / "img.safetensors")), None]
    with pinned(m, M.Pins()) as rec:
        ref = helpers.generate(m, prompts, SPEC_NEW, [], images)[0]
    for forced in (False, True):
        if forced:
            force_drafts(monkeypatch, ref, prompts, 0)
        with pinned(m, M.Pins(rec.data, strict=False)):
            out, st = helpers.generate(m, prompts, SPEC_NEW, [], images, speculative=2)
        for p, o, r, img in zip(prompts, out, ref, images):
            tokens_agree_up_to_near_tie(m, p, o, r, images=img)
        if forced and out == ref:
            assert st["accepted"] == st["proposed"]


def test_speculative_eos_inside_an_accepted_run_stops_the_request(mtp_model, monkeypatch):
    m = mtp_model
    with pinned(m, M.Pins()) as rec:  # the smaller batch rounds differently: plain greedy's decisions pinned
        ref = helpers.generate(m, PROMPTS, SPEC_NEW, [])[0]
    s, eos = next((s, ref[1][s]) for s in (3, 4, 2, 5) if ref[1][s] not in ref[1][:s] + ref[0] + ref[2])
    force_drafts(monkeypatch, ref, PROMPTS, 0)
    with pinned(m, M.Pins(rec.data, strict=False)):
        out, _ = helpers.generate(m, PROMPTS, SPEC_NEW, [eos], speculative=2)
    if out[1][:s + 1] == ref[1][:s + 1]:
        assert out[1] == ref[1][:s + 1]  # the EOS ends it even when accepted drafts follow in the same step
    else:  # it diverged before its EOS, at a measured near-tie (the verify step's rounding)
        tokens_agree_up_to_near_tie(m, PROMPTS[1], out[1], ref[1])
    assert eos not in out[1][:-1]  # whatever it emitted, it stopped at its first EOS
    for b in (0, 2):  # the others go on in a smaller batch (other row counts: up to a near-tie)
        tokens_agree_up_to_near_tie(m, PROMPTS[b], out[b], ref[b])


def test_drafts_through_the_draft_rows_launch_equal_the_reference(mtp_model, monkeypatch):
    """The engine's drafting with each depth's input rows from kernel.draft_rows' Triton launch (the interpreter's
    here; the GPU's in tests/test_gpu.py) instead of its PyTorch reference: the same drafts at every step (first
    drafts after a prompt and after each verify step, with start clamps on short prompts), hence the same tokens."""
    import speculative
    from kernels import draft

    real = speculative.Speculator.draft

    def recorded(into):
        def draft_and_record(self, slots, L):
            out = real(self, slots, L)
            into.append(out.tolist())
            return out
        return draft_and_record
    prompts = [PROMPTS[0], PROMPTS[1][:2]]  # a 2-token prompt: its first drafts start clamped at position 0
    ref_drafts, got_drafts, launches = [], [], []
    monkeypatch.setattr(speculative.Speculator, "draft", recorded(ref_drafts))
    ref, _ = helpers.generate(mtp_model, prompts, SPEC_NEW, [], speculative=2)
    monkeypatch.setattr(speculative.Speculator, "draft", recorded(got_drafts))
    monkeypatch.setattr(kernel, "draft_rows", lambda *a: launches.append(1) or draft.draft_rows_triton(*a))
    out, _ = helpers.generate(mtp_model, prompts, SPEC_NEW, [], speculative=2)
    assert launches and len(ref_drafts) >= 3
    assert got_drafts == ref_drafts and out == ref


@pytest.mark.parametrize("graph_prefill", [0, 128])
@torch.inference_mode()
def test_speculative_mtp_caches_equal_one_pass_absorb(mtp_model, monkeypatch, graph_prefill):
    """Rollback of the MTP caches: after speculative rounds whose drafts are all rejected (every round leaves each
    depth j >= 1 with j provisional rows that read drafts), every final row of every depth equals the row a one-pass
    absorb of the final tokens writes, and so does every completed DSA region summary of the main cache; with the
    prompts prefilled eagerly or as padded passes (graph_prefill: CUDA graphs on a GPU), whose real rows the MTP
    layers absorb after each replay. The main model's decisions of the speculative run are pinned into the one-pass
    reference (its residual rows round differently in last bits); the tolerance is rounding noise, while a row that
    kept a rejected draft's token differs by O(1)."""
    m, k, new = mtp_model, 2, 8
    ref = helpers.generate(m, PROMPTS[:2], new, [])[0]
    force_drafts(monkeypatch, ref, PROMPTS[:2], 1)
    eng = engine.Engine(m, engine.EngineConfig(max_batch=2, max_context=256, speculative=k,
                                               graph_prefill=graph_prefill))
    eng.start()
    replays = []
    record_replays(eng, replays)
    reqs = [engine.Request(p, new) for p in PROMPTS[:2]]
    with pinned(m, M.Pins()) as rec:
        eng.run(reqs)
    assert [(a, n) for a, n, _ in replays] == ([(0, len(p)) for p in PROMPTS[:2]] if graph_prefill else [])
    W = m.cfg.sliding_window
    for b, (p, r) in enumerate(zip(PROMPTS[:2], reqs)):
        seq = p + r.out  # final tokens; the last one was never fed
        cache = m.new_cache(1, len(seq) + 1)
        with pinned(m, M.Pins(rec.data, requests=[b], strict=False)):
            hidden = m.forward_rows(torch.tensor(seq[:-1]), cache, [len(seq) - 1])
        mtps = m.new_mtp_caches(1, len(seq) + k + 1)
        n = len(seq) - 1  # positions fed to the main model
        last = int(eng.cache.lengths[r.slot]) - 1  # the last kept position (an unread last step may pass n)
        # the main cache's DSA region summaries: rejected drafts past a region boundary overwrite the pending rows
        # of the kept tokens' region (put back by keep_pending); a region summarised from them agrees on 8-14% of
        # its bytes, against >= 87% for the rounding of verify steps vs one pass
        blk = m.cfg.sparse.block
        for i, (got, want) in enumerate(zip(eng.cache.layers, cache.layers)):
            for reg in range(min(last + 1, n) // blk if hasattr(got, "summ") else 0):
                same = (got.summ[r.slot, reg] == want.summ[0, reg]).float().mean().item()
                assert same > 0.5, f"layer {i}, region {reg}: {same:.0%} of the summary's bytes agree"
        for j in range(k):
            # the run's final rows of depth j: positions < done (its last step was not absorbed: it ended there)
            done = min(last, n - 1) - j + 1
            assert len(p) <= done <= n - j  # generated positions are compared; none reads a draft
            hidden = m.mtp(j, hidden[:done], torch.tensor(seq[j + 1:j + 1 + done]), mtps[j], [done])
            got, want = eng.mtps[j].layers[0].k[r.slot], mtps[j].layers[0].k[0]  # [G, R, hd] rings
            # the final positions the run's ring still holds (its j provisional rows past them took j slots)
            for pos in range(max(0, done + j - W), done):
                a, w = got[:, pos % got.shape[1]].float(), want[:, pos % want.shape[1]].float()
                assert (a - w).abs().max() <= 0.1 * w.abs().max() + 1e-3, (b, j, pos)


@torch.inference_mode()
def test_speculative_prompts_and_next_turns_by_padded_passes_are_plain_greedy(mtp_model):
    """With speculative decoding, fresh prompts prefill as padded passes and a next turn as an extension step (CUDA
    graphs on a GPU, eager here), the MTP layers absorbing each replay's real rows: plain greedy's tokens (an eager
    plain engine's decisions pinned; rows a draft reads differ only in last bits)."""
    m = mtp_model
    turn = PROMPTS[1] + ids_prompt(30, 7)  # on the 45-token prompt's slot: 40 positions reused, 35 new

    def run(cfg, pins, replays: list):
        eng = engine.Engine(m, cfg)
        eng.start()
        record_replays(eng, replays)
        with pinned(m, pins):
            first = eng.run([engine.Request(p, SPEC_NEW) for p in PROMPTS[:2]])
            nxt = eng.run([engine.Request(turn, SPEC_NEW)])[0]
        return [r.out for r in first] + [nxt.out], nxt.cached
    rec = M.Pins()
    want, cached = run(engine.EngineConfig(max_batch=2, max_context=256), rec, [])
    replays = []
    got, spec_cached = run(engine.EngineConfig(max_batch=2, max_context=256, speculative=2, graph_prefill=128),
                           M.Pins(rec.data, strict=False), replays)
    assert cached == spec_cached == 40
    assert replays == [(0, 12, 32), (0, 45, 64), (40, 35, 64)]
    for p, o, w in zip(PROMPTS[:2] + [turn], got, want):
        tokens_agree_up_to_near_tie(m, p, o, w)


@pytest.mark.parametrize("drafts", ["right", "wrong"])
@torch.inference_mode()
def test_greedy_logprobs_are_the_same_with_and_without_speculative_decoding(mtp_model, monkeypatch, drafts):
    """Greedy requests with logprobs: with speculative 2 (every draft accepted: several tokens per verify step; or
    none) each emitted token's logprob and top alternatives are plain decoding's, each greedy token its own top
    alternative. Plain greedy's decisions are pinned into the verify steps; the verify step's logits round
    differently in last bits, and this fixture's bf16 logits (magnitudes up to ~40) have ulps up to 0.25, so a
    logprob may move by twice that; a logprob of another position would be nats away."""
    m = mtp_model

    def run(k, pins):
        eng = engine.Engine(m, engine.EngineConfig(max_batch=3, max_context=256, speculative=k))
        eng.start()
        with pinned(m, pins):
            return eng.run([engine.Request(p, SPEC_NEW, logprobs=3) for p in PROMPTS])
    rec = M.Pins()
    plain = run(0, rec)
    force_drafts(monkeypatch, [r.out for r in plain], PROMPTS, int(drafts == "wrong"))
    spec = run(2, M.Pins(rec.data, strict=False))
    for p, a, b in zip(PROMPTS, plain, spec):
        tokens_agree_up_to_near_tie(m, p, b.out, a.out)
        assert len(a.token_logprobs) == len(a.out) and len(b.token_logprobs) == len(b.out)
        for j, (x, y) in enumerate(zip(a.token_logprobs, b.token_logprobs)):
            if a.out[:j + 1] != b.out[:j + 1]:
                break
            assert abs(x.logprob - y.logprob) < 0.5, (j, x, y)
            assert x.top[0][0] == y.top[0][0] == a.out[j] and abs(x.top[0][1] - x.logprob) < 1e-6
