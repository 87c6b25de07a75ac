"""The long-lived engine (engine.py) on the tiny checkpoints, in process at TP=1: slots that are reused after a request
leaves, prefix reuse (a conversation's next turn prefills only its new tokens), requests that join a running batch,
padding rows of a batch bucket, cancellation, incremental detokenization, prompts that arrive while streams decode
(their passes split by layers between decode steps).

Two runs that differ in batch composition or in what a prefill pass holds round differently in last bits (other
GEMM row counts); the comparisons pin one run's routing and region decisions into the other (model.Pins, keyed by
request id) and accept a token difference only at a measured near-tie (tests/invariants.py).
"""

import os

import pytest
import torch

import engine as E
import model as M
from helpers import ids, record_replays
from invariants import NOISE, pinned, tokens_agree_up_to_near_tie
from sampling import Sampling


@pytest.fixture(scope="module")
def lm(tp1_models):
    return tp1_models("bf16_text")


def solo(lm, prompt, new, rec=None, rid=0, stop=(), context=256):
    """A fresh engine's tokens for one request (with another run's decisions of request `rid` pinned)."""
    eng = E.Engine(lm, E.EngineConfig(max_batch=1, max_context=context))
    eng.start()
    req = E.Request(prompt, new, frozenset(stop))
    if rec is None:
        return eng.run([req])[0].out
    with pinned(lm, M.Pins(rec.data, requests=[rid])):
        return eng.run([req])[0].out


@torch.inference_mode()
def test_a_slot_reused_after_a_request_gives_a_fresh_engines_tokens(lm):
    """One slot, three requests in turn (the second stops at an EOS id): each gets a fresh engine's tokens; the
    third, unrelated to what the slot holds, reuses nothing."""
    eng = E.Engine(lm, E.EngineConfig(max_batch=1, max_context=256))
    eng.start()
    a, b, c = ids(30, 1), ids(45, 2), ids(20, 3)
    want_b = solo(lm, b, 6)
    eos = next(t for t in want_b[2:] if t not in want_b[:2])
    with pinned(lm, M.Pins()) as rec:
        first = eng.run([E.Request(a, 6)])[0]
        second = eng.run([E.Request(b, 6, frozenset({eos}))])[0]
        third = eng.run([E.Request(c, 6)])[0]
    assert second.out[-1] == eos and len(second.out) < 6 and second.finish == "stop"
    assert third.cached == 0 and third.finish == "length"
    for p, r in ((a, first), (b, second), (c, third)):
        tokens_agree_up_to_near_tie(lm, p, solo(lm, p, 6, rec, r.rid, r.stop_ids), r.out)


@torch.inference_mode()
def test_a_next_turn_prefills_only_its_new_tokens(lm):
    """A request that starts with what its slot holds (the prompt and answer of the last turn) reuses that prefix: the
    cache keeps the common prefix at a region boundary, and only the rest is prefilled. Its tokens are a fresh
    engine's on the whole prompt (decisions pinned)."""
    eng = E.Engine(lm, E.EngineConfig(max_batch=1, max_context=256, prefill_chunk=7))
    eng.start()
    blk = lm.cfg.sparse.block
    t1 = ids(37, 5)
    with pinned(lm, M.Pins()) as rec:
        r1 = eng.run([E.Request(t1, 5)])[0]
        t2 = t1 + r1.out + ids(9, 6)  # the conversation so far, then the next user turn
        r2 = eng.run([E.Request(t2, 5)])[0]
    held = len(t1) + len(r1.out) - 1  # the last answer token was never fed
    assert r2.cached == min(held, len(t2) - 1) // blk * blk > 0
    assert r2.prefilled == len(t2)
    # the reused positions' decisions are the first turn's: pinned into the fresh engine under the second's id
    rec.data.update({(k[0], k[1], r2.rid, *k[3:]): v for k, v in list(rec.data.items())
                     if k[2] == r1.rid and k[3] < r2.cached})
    tokens_agree_up_to_near_tie(lm, t2, solo(lm, t2, 5, rec, r2.rid), r2.out)


@torch.inference_mode()
def test_requests_that_join_a_running_batch_get_their_solo_tokens(lm):
    """Continuous batching: a request submitted while others decode is prefilled between their steps and joins the
    decode batch; three requests on four slots decode in the bucket of 4 with a padding row (a free slot: its rows
    do not touch the others). Each gets its solo tokens."""
    eng = E.Engine(lm, E.EngineConfig(max_batch=4, max_context=256, prefill_chunk=16))
    eng.start()
    assert list(eng.graphs) == [1, 2, 4]
    ps = [ids(40, 7), ids(25, 8), ids(33, 9)]
    reqs = [E.Request(p, 7) for p in ps]
    with pinned(lm, M.Pins()) as rec:
        eng.submit(reqs[0])
        for _ in range(4):
            eng.step()
        eng.submit(reqs[1])
        eng.submit(reqs[2])
        while eng.busy():
            eng.step()
    for p, r in zip(ps, reqs):
        assert r.finish == "length" and len(r.out) == 7
        tokens_agree_up_to_near_tie(lm, p, solo(lm, p, 7, rec, r.rid), r.out)


@torch.inference_mode()
def test_a_cancelled_request_frees_its_slot_for_a_waiting_one(lm):
    eng = E.Engine(lm, E.EngineConfig(max_batch=1, max_context=256))
    eng.start()
    long, short = E.Request(ids(20, 10), 100), E.Request(ids(12, 11), 3)
    eng.submit(long)
    eng.submit(short)
    for _ in range(3):
        eng.step()
    assert short.slot == -1 and len(long.out) >= 2  # waiting: the only slot is busy
    eng.cancel(long)
    while eng.busy():
        eng.step()
    assert long.finish == "cancelled" and len(long.out) < 100
    assert short.finish == "length" and len(short.out) == 3 and short.slot == long.slot


@torch.inference_mode()
@pytest.mark.slow
def test_fresh_prompts_prefilled_as_padded_graphs_get_the_eager_prefills_tokens(lm):
    """A fresh prompt runs as the pass of its padded length (32 ... 256: CUDA graphs on a GPU, eager here) in the
    staging row, adopted by its slot, and a next turn as decode steps of up to 128 tokens (16, 32, 64 or 128) on its
    slot: the tokens of an engine that prefills them as they are, for prompts within a ring (5, 33), past the ring
    and across DSA regions (150 tokens, padded to 256), on the second slot, two that arrive together (padded 32 + 64:
    one replay each), a next turn of 38 tokens across five regions on top of a padded prompt's cache, and a turn of
    ~145 tokens as two extension steps (128 and the rest). A prompt past the largest padded length (260) and two whose
    padded lengths add up past it (200 + 45: 256 + 64) prefill eagerly, packed."""
    eng = E.Engine(lm, E.EngineConfig(max_batch=2, max_context=384, graph_prefill=256))
    eng.start()
    assert list(eng.prefill_graphs) == [32, 64, 128, 256] and list(eng.extend_graphs) == [16, 32, 64, 128]
    assert eng.cache.layers[0].k.shape[2] < 150  # a sliding ring shorter than the 150-token prompt
    padded = []
    record_replays(eng, padded)  # (first position, tokens, padded length) of each replay
    ps = [ids(5, 30), ids(33, 31), ids(150, 32), ids(260, 33)]
    with pinned(lm, M.Pins()) as rec:
        outs = [eng.run([E.Request(p, 5)])[0] for p in ps[:3]]
        t2 = ps[2] + outs[2].out + ids(35, 36)  # the 150-token prompt's next turn, on the slot that holds it
        turn = eng.run([E.Request(t2, 5)])[0]
        t3 = t2 + turn.out + ids(140, 41)  # a longer turn: extension steps of 128 and the rest
        turn3 = eng.run([E.Request(t3, 5)])[0]
        outs.append(eng.run([E.Request(ps[3], 5)])[0])
        busy = E.Request(ids(70, 34), 12)  # on one slot while the next prompt takes the other
        eng.submit(busy)
        eng.step()
        second = eng.run([E.Request(ids(45, 35), 5)])[0]
        pair = eng.run([E.Request(ids(9, 37), 4), E.Request(ids(40, 38), 4)])
        packed = eng.run([E.Request(ids(200, 39), 4), E.Request(ids(45, 40), 4)])
    c3, n3 = turn3.cached, len(t3) - turn3.cached
    assert padded == [(0, 5, 32), (0, 33, 64), (0, 150, 256), (152, 38, 64), (c3, 128, 128),
                      (c3 + 128, n3 - 128, 16 if n3 <= 144 else 32), (0, 70, 128), (0, 45, 64), (0, 9, 32),
                      (0, 40, 64)], padded  # 260 tokens and 200 + 45 (256 + 64 > 256) eagerly
    assert second.slot != busy.slot and turn.cached > 0 and busy.finish == "length"
    for p, r in [*zip(ps, outs), (busy.ids, busy), (second.ids, second), *((r.ids, r) for r in pair + packed)]:
        tokens_agree_up_to_near_tie(lm, p, solo(lm, p, len(r.out), rec, r.rid, context=384), r.out)
    for prev, r, t in ((outs[2], turn, t2), (turn, turn3, t3)):  # the reused positions' decisions under the turn's id
        rec.data.update({(k[0], k[1], r.rid, *k[3:]): v for k, v in list(rec.data.items())
                         if k[2] == prev.rid and k[3] < r.cached})
        tokens_agree_up_to_near_tie(lm, t, solo(lm, t, 5, rec, r.rid, context=384), r.out)


@torch.inference_mode()
def test_a_padded_decode_step_keeps_the_pending_rows_its_padding_overwrites(lm):
    """An extension step of 3 real tokens padded to 16 (positions 58..73) writes padding past two region boundaries
    (regions of 8), over the pending indexer rows of the region its real tokens end in (56..63). The layers put them
    back: when later tokens complete that region, its summary is the one of a step without padding, and so are the
    logits of queries that select among regions past it (unpadded: the region's summary built from padding keys)."""
    blk = lm.cfg.sparse.block
    assert blk == 8
    prompt, x = ids(58, 50), ids(9, 51)
    dsa = [i for i, lc in enumerate(lm.new_cache(1, 8).layers) if getattr(lc, "summ", None) is not None]
    caches = [lm.new_cache(1, 128, slack=16) for _ in range(2)]
    for c in caches:
        lm.forward(torch.tensor(prompt), c, [58])
    row = torch.tensor([0])
    lm.forward_rows(torch.tensor([x[:3] + [7] * 13]), caches[0], rows=row, real=torch.tensor([3]))
    lm.forward_rows(torch.tensor([x[:3]]), caches[1], rows=row)
    assert [int(c.lengths[0]) for c in caches] == [61, 61]
    for t in x[3:]:  # positions 61..66: region 7 completes at 63, then queries select among 8 regions (topk 4)
        out = [lm.forward(torch.tensor([t]), c) for c in caches]
    for i in dsa:
        same = (caches[0].layers[i].summ[0, 7] == caches[1].layers[i].summ[0, 7]).float().mean().item()
        assert same > 0.9, f"layer {i}: region 7's summary agrees on {same:.0%} of its bytes"
    assert ((out[0] - out[1]).abs().max() / out[1].std()).item() < NOISE["bf16"]


def test_requests_that_do_not_fit_are_refused_naming_the_context(lm):
    eng = E.Engine(lm, E.EngineConfig(max_batch=1, max_context=64))
    with pytest.raises(ValueError, match="max_context=64"):
        eng.submit(E.Request(ids(60, 1), 8))
    with pytest.raises(ValueError, match="top_p"):
        eng.submit(E.Request(ids(6, 1), 8, sampling=Sampling(1.0, top_p=0.0)))


def test_bad_requests_are_refused_before_any_is_queued_naming_the_field(tp1_models):
    """Everything a step would fail on, or silently misread, is refused by submit / run naming the field; run checks
    every request before it queues one; the engine then serves a good request as a fresh one would."""
    vl = tp1_models("fp8_vl")
    eng = E.Engine(vl, E.EngineConfig(max_batch=2, max_context=128))
    eng.start()
    D, img = vl.cfg.hidden_size, vl.vl.image_token_id
    good = ids(6, 1)
    cases = [
        (E.Request([1024, 6], 4), r"ids\[0\] = 1024 is not a token id in \[0, 1024\)"),
        (E.Request([6, -1], 4), r"ids\[1\] = -1"),
        (E.Request([6, 5.5], 4), r"ids\[1\] = 5.5"),
        (E.Request([True, 6], 4), r"ids\[0\] = True"),
        (E.Request(torch.tensor(good), 4), "ids must be a non-empty list"),
        (E.Request(good, -1), "max_new_tokens -1 must be an integer >= 0"),
        (E.Request(good, float("nan")), "max_new_tokens nan"),
        (E.Request(good, 2.5), "max_new_tokens 2.5"),
        (E.Request(good, 4, 7), "stop_ids must be a set of token ids"),
        (E.Request(good, 4, frozenset({"535"})), "stop_ids must be a set of token ids"),
        (E.Request(good + [img], 4), r"1 image placeholder\(s\) \(id 5\) but the request has no features"),
        (E.Request(good + [img], 4, features=torch.zeros(1, D + 1, dtype=torch.bfloat16)),
         rf"features must be \[1, {D}\] bfloat16 on cpu .* got \(1, {D + 1}\)"),
        (E.Request(good + [img], 4, features=torch.zeros(1, D)), "got .*torch.float32"),
        (E.Request(good, 4, features=torch.zeros(1, D, dtype=torch.bfloat16)), r"must be \[0, "),
        (E.Request(good, 4, sampling=Sampling("1.0")), "temperature 1.0 must be a finite number"),
    ]
    for req, match in cases:
        with pytest.raises(ValueError, match=match):
            eng.run([E.Request(ids(6, 2), 3), req])  # the good first request is not queued either
        assert not eng.busy()
    r = E.Request(good, 3)
    with pytest.raises(ValueError, match="appears twice"):
        eng.run([r, r])
    eng.run([r])
    with pytest.raises(ValueError, match="was submitted before"):
        eng.run([r])
    eng.cancel(E.Request(good, 3))  # not this engine's: nothing happens to it
    again = eng.run([E.Request(good, 3)])[0]
    assert again.finish == "length" and again.out == r.out


def test_a_step_that_raises_ends_every_request_and_the_engine_serves_the_next(lm):
    """A non-finite logit (an EngineError) mid-run: the run raises, its requests end as "error", their slots are
    forgotten, and the next request gets a fresh engine's tokens (it hung, or raised again, before)."""
    eng = E.Engine(lm, E.EngineConfig(max_batch=2, max_context=128))
    eng.start()
    a, b = E.Request(ids(20, 3), 4), E.Request(ids(9, 4), 4)
    real = lm.forward
    lm.forward = lambda *args, **kw: real(*args, **kw).fill_(float("nan"))
    try:
        with pytest.raises(E.EngineError):
            eng.run([a, b])
    finally:
        lm.forward = real
    assert a.finish == b.finish == "error" and not eng.busy()
    assert eng.run([E.Request(ids(20, 3), 4)])[0].out == solo(lm, ids(20, 3), 4, context=128)


def _stream_beside(lm, layers: int, arrival: list | None, new: int = 1, streams: int = 1, max_batch: int = 2,
                   graph_prefill: int = 0, replays: list | None = None, chunk: int = 64) -> tuple:
    """`streams` greedy streams of 24 tokens (the first: the stream) decode in an engine whose prefill passes (chunks
    of `chunk` tokens) run `layers` layers per step while streams decode; after their third step a request with the
    prompt `arrival` (and `new` tokens) arrives -> (the stream, the arrival or None, the step log from its arrival:
    per step, the stream's new tokens, the arrival's prefilled prompt tokens and the layers its pass in flight has
    run, 0 when none; the engine). replays: where the prefill graphs log their replays (record_replays)."""
    eng = E.Engine(lm, E.EngineConfig(max_batch=max_batch, max_context=384, prefill_chunk=chunk,
                                      prefill_layers_per_step=layers, graph_prefill=graph_prefill))
    eng.start()
    if replays is not None:
        record_replays(eng, replays)
    a, *_ = [eng.submit(E.Request(ids(20, 60 + i), 24)) for i in range(streams)]
    log = []
    for _ in range(3):
        eng.step()
    b = eng.submit(E.Request(arrival, new)) if arrival is not None else None
    while eng.busy():
        o = eng.step()
        log.append((sum(len(t) for r, t in o.tokens if r is a), b.prefilled if b else 0,
                    eng.split.trunk.done if eng.split else 0))
    return a, b, log, eng


def _prompt_cache(eng, r) -> list:
    """What request r's prefill left in its slot for later tokens to read: the DSA layers' keys and values of its
    prompt and the summaries of the regions it completed."""
    n, blk = len(r.ids), eng.model.cfg.sparse.block
    return [t for lc in eng.cache.layers if getattr(lc, "summ", None) is not None
            for t in (lc.k[r.slot, :n], lc.v[r.slot, :n], lc.summ[r.slot, :n // blk])]


@torch.inference_mode()
@pytest.mark.slow
def test_a_streams_tokens_are_bit_for_bit_its_own_while_a_long_prompt_prefills_between_its_steps(lm):
    """A stream decodes (greedy) while a request with a 200-token prompt arrives (chunks of 64, each pass split into
    parts of 3, 3 and 2 layers with a decode step after each): the stream's tokens are exactly those it decodes alone,
    and those it decodes beside the same prompt prefilled in whole passes (its rows are the same decode step's, and
    the arrival's half-written slot never pads it); the arrival's first token is the whole passes' one."""
    prompt = ids(200, 61)
    alone, *_ = _stream_beside(lm, 3, None)
    split_a, split_b, log, _ = _stream_beside(lm, 3, prompt)
    whole_a, whole_b, *_ = _stream_beside(lm, 0, prompt)
    assert any(done for *_, done in log)  # the pass did run split
    assert len(alone.out) == 24 and split_a.out == alone.out == whole_a.out
    assert len(split_b.out) == 1 and split_b.out == whole_b.out


@torch.inference_mode()
@pytest.mark.slow
def test_a_long_prompt_prefills_in_parts_of_layers_with_a_decode_step_after_each(lm):
    """While a stream decodes, each 64-token chunk of a 200-token prompt runs as parts of 3, 3 and 2 of the 8 layers,
    one engine step each, and the stream gets a token in every step; without streams (or with
    prefill_layers_per_step 0) a chunk is one step."""
    assert lm.cfg.num_hidden_layers == 8
    prompt = ids(200, 61)
    parts = [(1, x, done) for x in (0, 64, 128, 192) for done in (3, 6)]
    ends = [(1, x, 0) for x in (64, 128, 192, 200)]
    _, b, log, _ = _stream_beside(lm, 3, prompt, new=2)
    assert log[:12] == [s for pair in zip(parts[0::2], parts[1::2], ends) for s in pair], log
    assert b.out and b.finish == "length"
    _, _, log, _ = _stream_beside(lm, 0, prompt, new=2)
    assert log[:4] == ends, log
    eng = E.Engine(lm, E.EngineConfig(max_batch=2, max_context=384, prefill_chunk=64, prefill_layers_per_step=3))
    eng.start()
    c = eng.submit(E.Request(prompt, 1))
    seen = []
    while eng.busy():
        eng.step()
        seen.append(c.prefilled)
    assert seen == [64, 128, 192, 200]


@torch.inference_mode()
@pytest.mark.slow
def test_a_pass_runs_whole_where_the_decode_bucket_needs_its_slot_for_padding(lm):
    """Four slots, a 200-token prompt in chunks of 86: beside two streams (bucket 2) the arrival's pass runs split;
    beside three (bucket 4) its slot would be the padding row's, which writes at the slot's next position in every
    layer, where the layers the pass has not run yet still read history (position 172: ring slot 76 holds position
    76 of the second chunk's window, pending DSA row 4 holds position 84), so it runs whole, one chunk a step. The
    stream gets a token every step; the arrival's first token and what its prefill left in its slot are the whole
    passes' ones, bit for bit, either way."""
    prompt = ids(200, 62)
    _, whole, _, eng = _stream_beside(lm, 0, prompt, chunk=86)
    want = _prompt_cache(eng, whole)
    for streams, steps in ((2, [0, 0, 86, 86, 86, 172, 172, 172, 200]), (3, [86, 172, 200])):
        a, b, log, eng = _stream_beside(lm, 3, prompt, streams=streams, max_batch=4, chunk=86)
        assert [x for _, x, _ in log[:len(steps)]] == steps and {n for n, *_ in log[:len(steps)]} == {1}, log
        assert len(a.out) == 24 and b.out == whole.out
        assert all(torch.equal(x, y) for x, y in zip(_prompt_cache(eng, b), want))


@torch.inference_mode()
@pytest.mark.slow
def test_while_streams_decode_only_short_fresh_prompts_replay_their_prefill_graphs(lm, monkeypatch):
    """With prefill graphs (padded passes, eager on the CPU) and GRAPH_BUSY at 64 tokens: beside a stream a 40-token
    prompt (padded to 64) replays its graph, a 100-token one (128) runs split by layers instead; without streams the
    100-token prompt replays its graph. The stream's tokens stay its own."""
    monkeypatch.setattr(E, "GRAPH_BUSY", 64)
    alone = _stream_beside(lm, 3, None)[0].out
    for n, want in ((40, [(0, 40, 64)]), (100, [])):  # after the stream's own prompt's replay, (0, 20, 32)
        replays = []
        a, b, log, _ = _stream_beside(lm, 3, ids(n, 63), graph_prefill=256, replays=replays, chunk=256)
        assert replays == [(0, 20, 32)] + want and any(done for *_, done in log) is not want, (n, replays, log)
        assert a.out == alone and len(b.out) == 1
    eng = E.Engine(lm, E.EngineConfig(max_batch=2, max_context=384, prefill_layers_per_step=3, graph_prefill=256))
    eng.start()
    padded = []
    record_replays(eng, padded)
    eng.run([E.Request(ids(100, 63), 1)])
    assert padded == [(0, 100, 128)]


@torch.inference_mode()
@pytest.mark.slow
def test_a_request_cancelled_mid_pass_keeps_its_slot_until_its_pass_ends(lm):
    """A request cancelled while its pass runs split over steps is released once the pass has run all its layers
    (its slot is being written until then), not at the next step; a waiting request then takes the slot and gets its
    solo tokens (decisions pinned)."""
    eng = E.Engine(lm, E.EngineConfig(max_batch=2, max_context=384, prefill_chunk=64, prefill_layers_per_step=3))
    eng.start()
    steps = []
    with pinned(lm, M.Pins()) as rec:
        a = eng.submit(E.Request(ids(20, 60), 40))
        for _ in range(3):
            eng.step()
        b = eng.submit(E.Request(ids(200, 61), 4))
        eng.step()
        assert eng.split is not None and eng.split.trunk.done == 3
        eng.cancel(b)
        c = eng.submit(E.Request(ids(30, 64), 3))
        while b.finish is None or b in eng.running:
            o = eng.step()
            steps.append((b in o.finished, eng.split.trunk.done if eng.split else 0))
        while eng.busy():
            eng.step()
    assert steps == [(False, 6), (True, 0)], steps
    assert b.out == [] and c.slot == b.slot and c.finish == "length" and len(a.out) == 40
    tokens_agree_up_to_near_tie(lm, c.ids, solo(lm, c.ids, 3, rec, c.rid, context=384), c.out)


def test_a_negative_layers_per_step_is_refused_naming_the_field(lm):
    for v, match in ((-1, "prefill_layers_per_step -1 must be >= 0"), (2.5, "prefill_layers_per_step 2.5 must be")):
        with pytest.raises(ValueError, match=match):
            E.Engine(lm, E.EngineConfig(max_batch=1, max_context=64, prefill_layers_per_step=v))


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA device and TRITON_INTERPRET=0")
@torch.inference_mode()
def test_cuda_prompts_arriving_beside_a_stream_compile_nothing_and_keep_its_tokens(tp1_models):
    """On the GPU (Triton kernels, CUDA graphs): a stream decodes while prompts of 300 tokens (a prefill graph
    replay, within GRAPH_BUSY) and 1,500 tokens (three eager passes of 512, 3 layers a step) arrive one after the
    other: no Triton kernel is built and no CUDA graph captured after start-up, the passes did run split, and the
    stream's tokens are bit for bit those it decodes alone."""
    from tools.bench_request import Counters
    gpu = tp1_models("fp8_text", "cuda")
    counters = Counters()

    def run(arrivals: list) -> tuple:
        eng = E.Engine(gpu, E.EngineConfig(max_batch=4, max_context=2048, prefill_chunk=512,
                                           prefill_layers_per_step=3, graph_prefill=512))
        eng.start()
        before = counters.snapshot()
        a = eng.submit(E.Request(ids(20, 60), 120))
        parts = 0
        for _ in range(3):
            eng.step()
        for p in arrivals:
            b = eng.submit(E.Request(p, 1))
            while b.finish is None:
                eng.step()
                parts += eng.split is not None
        while eng.busy():
            eng.step()
        return a.out, parts, counters.snapshot() == before
    alone, _, _ = run([])
    out, parts, clean = run([ids(300, 65), ids(1500, 66)])
    assert clean, f"compiled {counters.names}"
    assert parts == 6 and out == alone  # 3 passes of 3 parts: 2 steps each with a part left


@torch.inference_mode()
def test_a_stream_gets_a_token_between_the_parts_of_an_arriving_prompts_pass(lm):
    """The quick tier's check of split passes: a 20-token prompt arriving beside a stream (chunks of 8, 3 of the 8
    layers a step) prefills over 9 steps, the stream getting a token in each; its tokens are those it gets alone."""
    def run(arrival):
        eng = E.Engine(lm, E.EngineConfig(max_batch=2, max_context=64, prefill_chunk=8, prefill_layers_per_step=3))
        eng.start()
        a = eng.submit(E.Request(ids(6, 70), 14))
        eng.step()
        b = eng.submit(E.Request(arrival, 1)) if arrival else None
        log = []
        while eng.busy():
            o = eng.step()
            log.append((sum(len(t) for r, t in o.tokens if r is a), b.prefilled if b else 0))
        return a.out, log
    alone, _ = run(None)
    out, log = run(ids(20, 71))
    assert log[:9] == [(1, x) for x in (0, 0, 8, 8, 8, 16, 16, 16, 20)], log
    assert out == alone
