"""The long-lived engine (engine.py) on the tiny checkpoints, in process at TP=1: slots that are reused after a request
leaves, prefix reuse (a conversation's next turn prefills only its new tokens), requests that join a running batch,
padding rows of a batch bucket, cancellation, incremental detokenization.

Two runs that differ in batch composition or in what a prefill pass holds round differently in last bits (other
GEMM row counts); the comparisons pin one run's routing and region decisions into the other (model.Pins, keyed by
request id) and accept a token difference only at a measured near-tie (tests/invariants.py).
"""
import os
import random
import threading

import pytest
import torch

import engine as E
import model as M
from invariants import NOISE, pinned, tokens_agree_up_to_near_tie


def ids(n: int, seed: int) -> list:
    r = random.Random(seed)
    return [r.randrange(11, 1024) for _ in range(n)]


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
def test_fresh_prompts_prefilled_as_padded_graphs_get_the_eager_prefills_tokens(lm, monkeypatch):
    """A fresh prompt runs as the pass of its padded length (32 ... 256: CUDA graphs on a GPU, eager here) in the
    staging row, adopted by its slot, and a next turn as decode steps of up to 64 tokens (16, 32 or 64) on its slot:
    the tokens of an engine that prefills them as they are, for prompts within a ring (5, 33), past the ring and
    across DSA regions (100 tokens, padded to 128), on the second slot, two that arrive together (padded 32 + 64:
    one replay each), a next turn of 36 tokens across five regions on top of a padded prompt's cache, and a turn of
    ~145 tokens as three extension steps. A prompt past the largest padded length (260) and two whose padded
    lengths add up past it (200 + 45: 256 + 64) prefill eagerly, packed."""
    eng = E.Engine(lm, E.EngineConfig(max_batch=2, max_context=384, graph_prefill=256))
    eng.start()
    assert list(eng.prefill_graphs) == [32, 64, 128, 256] and list(eng.extend_graphs) == [16, 32, 64]
    assert eng.cache.layers[0].k.shape[2] < 100 < 128  # a sliding ring shorter than the 100-token prompt
    padded = []
    run = E.Engine._replay_prefill
    monkeypatch.setattr(E.Engine, "_replay_prefill",
                        lambda self, g, r, a, n: padded.append((a, n, g.inputs[0].numel())) or run(self, g, r, a, n))
    ps = [ids(5, 30), ids(33, 31), ids(100, 32), ids(260, 33)]
    with pinned(lm, M.Pins()) as rec:
        outs = [eng.run([E.Request(p, 5)])[0] for p in ps[:3]]
        t2 = ps[2] + outs[2].out + ids(35, 36)  # the 100-token prompt's next turn, on the slot that holds it
        turn = eng.run([E.Request(t2, 5)])[0]
        t3 = t2 + turn.out + ids(140, 41)  # a longer turn: extension steps of 64, 64 and the rest
        turn3 = eng.run([E.Request(t3, 5)])[0]
        outs.append(eng.run([E.Request(ps[3], 5)])[0])
        busy = E.Request(ids(70, 34), 12)  # on one slot while the next prompt takes the other
        eng.submit(busy)
        eng.step()
        second = eng.run([E.Request(ids(45, 35), 5)])[0]
        pair = eng.run([E.Request(ids(9, 37), 4), E.Request(ids(40, 38), 4)])
        packed = eng.run([E.Request(ids(200, 39), 4), E.Request(ids(45, 40), 4)])
    c3, n3 = turn3.cached, len(t3) - turn3.cached
    assert padded == [(0, 5, 32), (0, 33, 64), (0, 100, 128), (104, 36, 64), (c3, 64, 64), (c3 + 64, 64, 64),
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


@pytest.mark.parametrize("path", ["references", "triton launchers"])
@torch.inference_mode()
def test_a_padded_prefill_reads_nothing_back_to_the_host(tp1_models, monkeypatch, request, path):
    """A CUDA graph cannot hold a host read or a host-to-device copy: the padded pass and the extension step (as
    captured, here run on the CPU) make no op that would (a tensor's value read on the host, a data-dependent shape,
    a tensor from host data), through the references or through the Triton launchers (their launches recorded, not
    run, as gpu_launches makes them, then the references). The eager prefill, which reads the cache lengths unless
    told them, is caught reading."""
    import contextlib
    import sass
    from torch.utils._python_dispatch import TorchDispatchMode
    lm = tp1_models("fp8_text")
    launchers = path == "triton launchers"
    if launchers:
        request.getfixturevalue("gpu_launches")
    seen = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t, f=torch.Tensor.tolist: seen.append("tolist") or f(t))
    eng = E.Engine(lm, E.EngineConfig(max_batch=2, max_context=256, graph_prefill=64))
    with sass.launch_keys(set(), execute=False) if launchers else contextlib.nullcontext():
        eng.start()
    g = eng.prefill_graphs[64]
    g.inputs[1].fill_(45)
    g.inputs[2].fill_(1)
    banned = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.lift_fresh.default",
              "aten.masked_select.default", "aten.unique_consecutive.default", "aten._unique2.default"}
    seen.clear()

    class Host(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in banned:
                seen.append(str(func))
            return func(*args, **(kwargs or {}))
    x = eng.extend_graphs[32]
    x.inputs[1].fill_(20)
    x.inputs[2].fill_(1)
    keys = set()
    with sass.launch_keys(keys, execute=False) if launchers else contextlib.nullcontext(), Host():
        logits = g()
        turn = x()
    assert not seen, f"host reads in the padded prefill: {sorted(set(seen))}"
    assert logits.shape == turn.shape == (1, lm.lm_head.weight.shape[0]) and int(eng.cache.lengths[1]) == 65
    assert (len(keys) > 10) == launchers  # the Triton launchers ran (their launches recorded)
    with sass.launch_keys(set(), execute=False) if launchers else contextlib.nullcontext(), Host():
        lm.forward(g.inputs[0], eng.cache, [64], rows=[0])
    assert "tolist" in seen and "aten.lift_fresh.default" in seen


def test_requests_that_do_not_fit_are_refused_naming_the_context(lm):
    eng = E.Engine(lm, E.EngineConfig(max_batch=1, max_context=64))
    with pytest.raises(ValueError, match="max_context=64"):
        eng.submit(E.Request(ids(60, 1), 8))
    with pytest.raises(ValueError, match="top_p"):
        eng.submit(E.Request(ids(6, 1), 8, sampling=E.Sampling(1.0, top_p=0.0)))


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
        (E.Request(good, 4, sampling=E.Sampling("1.0")), "temperature 1.0 must be a finite number"),
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


def test_text_stream_never_splits_a_character(tp1_models, converted):
    """Incremental detokenization: the pieces concatenate to the whole decode, and no piece ends inside a UTF-8
    sequence (a character split over byte-level tokens is held back until it is complete)."""
    import os
    import generate
    tok = generate.load_tokenizer(os.path.join(converted("bf16_text", 1), "..", "tokenizer_files"))
    text = "张量并行 splits 矩阵 across ranks; 稀疏注意力 🙂 done"
    toks = tok(text, add_special_tokens=False)["input_ids"]
    s = E.TextStream(tok)
    pieces = [s.push([t]) for t in toks] + [s.flush()]
    assert "".join(pieces) == tok.decode(toks) == text
    assert all("\ufffd" not in p for p in pieces)
    assert sum(1 for p in pieces if p) > 5  # it streams, not just at the end


# the kernel.py functions model.py calls, each dispatching to its Triton launcher or its reference
DISPATCHERS = ("rms_norm", "norm_rope_jobs", "banded_attention", "sliding_decode", "region_summary", "dsa_cache_write",
               "indexer_scores", "select_regions", "sparse_attention", "route", "swiglu", "moe_experts",
               "skinny_linear", "add_norm")


@pytest.fixture
def gpu_launches(monkeypatch):
    """Every kernel call made twice: its Triton launches (with the GPU's launch choices) recorded and not executed,
    then its reference, whose results the model goes on with (the interpreter is too slow for a whole engine's run).
    The switch between the two is per thread (start-up's parallel builds call kernels from several)."""
    import kernel
    from kernels import common
    monkeypatch.setattr(common, "_GPU_LAUNCH", True)
    monkeypatch.setattr(common, "_sms", lambda: 132)
    on = threading.local()
    monkeypatch.setattr(kernel, "_triton", lambda x: getattr(on, "triton", False))

    def both(f):
        def call(*a, **k):
            on.triton = True
            try:
                f(*a, **k)  # its launches, recorded only
            finally:
                on.triton = False
            return f(*a, **k)
        return call
    for name in DISPATCHERS:
        monkeypatch.setattr(kernel, name, both(getattr(kernel, name)))
    warm_lengths = M.Step5ForCausalLM.warm_lengths  # the passes it lists on the Triton path

    def triton_warm_lengths(self, *a):
        on.triton = True
        try:
            return warm_lengths(self, *a)
        finally:
            on.triton = False
    monkeypatch.setattr(M.Step5ForCausalLM, "warm_lengths", triton_warm_lengths)


@pytest.mark.parametrize("graph_prefill, speculative", [(0, 0), (256, 0), (256, 1)])
@torch.inference_mode()
def test_requests_after_start_up_launch_only_what_start_up_compiled(tp1_models, converted, gpu_launches,
                                                                    graph_prefill, speculative):
    """Nothing compiles on the request path: every Triton launch of requests of other prompt lengths and batch sizes
    is one that start-up made, each launch keyed as Triton compiles it (sass.launch_key: constexprs, each integer's
    class, each pointer's alignment), with fresh prompts prefilled eagerly or padded (graph_prefill), and with MTP
    drafts (speculative: verify and draft steps, the MTP layers' absorb of each padded prompt's real rows).
    bench_request.py counts real compilations on the GPU."""
    import sass
    from conftest import load_tp1
    lm = load_tp1(converted("fp8_text", 1, keep_mtp=True)) if speculative else tp1_models("fp8_text")
    warm, seen = set(), set()
    eng = E.Engine(lm, E.EngineConfig(max_batch=4, max_context=640, prefill_chunk=256, graph_prefill=graph_prefill,
                                      speculative=speculative))
    with sass.launch_keys(warm, execute=False):
        eng.start()
    with sass.launch_keys(seen, execute=False):
        eng.run([E.Request(ids(7, 20), 3)])
        eng.run([E.Request(ids(300, 21), 2), E.Request(ids(23, 22), 4), E.Request(ids(1, 23), 2)])
        eng.run([E.Request(ids(29, 24), 3), E.Request(ids(290, 25), 3)])
        r = eng.run([E.Request(ids(50, 26), 2)])[0]  # a few queries past those that select every region
        eng.run([E.Request(r.ids + r.out + ids(20, 27), 2)])  # a next turn on top of its cache
    new = seen - warm

    def differs(k):  # the arguments in which a new launch differs from every start-up launch of its kernel
        alike = [w for w in warm if w[0] == k[0]]
        return sorted(set(k[1]) - set.intersection(*(set(w[1]) for w in alike)), key=str) if alike else "a new kernel"
    assert not new, "launches start-up did not make:\n" + "\n".join(f"{k[0]}: {differs(k)}" for k in sorted(new, key=str))
    assert len(warm) > 20 and len(seen) > 10


@torch.inference_mode()
def test_start_up_builds_from_threads_until_a_start_up_has_built_its_kernels(tp1_models, gpu_launches, monkeypatch,
                                                                             tmp_path):
    """The builds from threads are for a Triton cache that lacks the warm-up's kernels: a start-up leaves a marker in
    Triton's cache directory, and the next start-up of the same code, passes, config and device warms up in order
    (its builds would only read the disk cache, the threads contending for the GIL); other passes (another context)
    or another cache directory build from threads again; without threads nothing is marked."""
    import triton

    import sass
    lm = tp1_models("fp8_text")
    built = []
    monkeypatch.setattr(E.Engine, "_build_ahead", lambda self, passes, threads: built.append(len(passes)))
    warm = E.Engine._warm
    in_order = []

    def counted_warm(self, p0, n, cache=None, mtps=None, main=True):
        in_order.append(cache is None)
        return warm(self, p0, n, cache, mtps, main)
    monkeypatch.setattr(E.Engine, "_warm", counted_warm)

    def start(context, cache_dir, threads=2):
        monkeypatch.setattr(triton.knobs.cache, "dir", str(cache_dir))
        in_order.clear()
        with sass.launch_keys(set(), execute=False):  # the warm-up's launches recorded, not interpreted
            E.Engine(lm, E.EngineConfig(max_batch=1, max_context=context, prefill_chunk=64,
                                        build_threads=threads)).start()
        return len(in_order)
    assert start(256, tmp_path / "a") == 0 and len(built) == 1  # from threads (stubbed here), then marked
    assert [f.startswith("step5-built-") for f in os.listdir(tmp_path / "a")] == [True]
    assert start(256, tmp_path / "a") > 0 and len(built) == 1  # marked: in order
    assert start(128, tmp_path / "a") == 0 and len(built) == 2  # other passes (a shorter context): threads
    assert start(256, tmp_path / "b") == 0 and len(built) == 3  # another cache: threads
    assert start(256, tmp_path / "c", threads=0) > 0 and not (tmp_path / "c").exists()
    (tmp_path / "ro").write_text("a file where the cache directory would be")  # an unwritable cache: not marked
    assert start(256, tmp_path / "ro" / "cache") == 0 and len(built) == 4


@torch.inference_mode()
def test_start_up_builds_ahead_from_threads_every_launch_of_the_warm_up_in_order(tp1_models, gpu_launches, monkeypatch,
                                                                                 tmp_path):
    """Start-up's parallel kernel builds make every launch of the warm-up passes in order, which they replace: each
    pass run from a thread, in a cache of its own as long as the pass needs (not the engine's), makes the launches
    the same pass makes on the engine's cache."""
    import sass
    lm = tp1_models("fp8_text")
    ahead, warm, threads = set(), set(), set()
    build, run_warm = E.Engine._build_ahead, E.Engine._warm

    def recorded_build(self, *a):
        with sass.launch_keys(ahead, execute=False):
            build(self, *a)

    def recorded_warm(self, p0, n, cache=None, mtps=None, main=True):
        if cache is not None:  # a pass of the parallel builds
            threads.add(threading.get_ident())
            return run_warm(self, p0, n, cache, mtps)
        with sass.launch_keys(warm, execute=False):
            return run_warm(self, p0, n, main=main)
    monkeypatch.setattr(E.Engine, "_build_ahead", recorded_build)
    monkeypatch.setattr(E.Engine, "_warm", recorded_warm)
    import triton
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))  # no start-up has built into it
    for n in (0, 3):  # the warm-up in order, then the builds from threads
        eng = E.Engine(lm, E.EngineConfig(max_batch=2, max_context=640, prefill_chunk=256, build_threads=n))
        with sass.launch_keys(set(), execute=False):  # the decode graphs' launches too: recorded, not interpreted
            eng.start()
    assert len(threads) > 1 and eng.timing["build_s"] > 0
    missed = warm - ahead
    assert not missed, "warm-up launches the parallel builds did not make:\n" + "\n".join(
        map(str, sorted(missed, key=str)))
    assert len(warm) > 20


def test_start_up_threads_compile_each_kernel_variant_once(monkeypatch):
    """Start-up's threads that launch a Triton kernel variant before it is built compile it once
    (E.one_build_per_variant): the first builds it, the others wait and take that build; other variants build side by
    side. Without it every thread compiles its own (Triton's JIT looks its cache up before compiling, stores after)."""
    import time
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from triton.runtime.jit import JITFunction
    builds, running, most, lock = [], [0], [0], threading.Lock()

    def compile_variant(self, key, signature, device, *rest):  # stands for Triton's: slow, stores its build
        with lock:
            builds.append(key)
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.2)
        self.device_caches[device][0][key] = built = object()
        with lock:
            running[0] -= 1
        return built
    monkeypatch.setattr(JITFunction, "_do_compile", compile_variant)
    fn = SimpleNamespace(device_caches={0: ({}, None, None, None, None)})
    wanted = ["a", "a", "b", "a", "b", "a"]

    def launch_all():
        fn.device_caches[0][0].clear()
        builds.clear()
        most[0] = 0
        with ThreadPoolExecutor(len(wanted)) as pool:
            return list(pool.map(lambda key: JITFunction._do_compile(fn, key, None, 0, None, None, None, False),
                                 wanted))
    launch_all()
    assert len(builds) == len(wanted)  # each thread its own build
    with E.one_build_per_variant():
        got = launch_all()
    assert sorted(builds) == ["a", "b"] and most[0] >= 2
    assert len({id(k) for k, key in zip(got, wanted) if key == "a"}) == 1
    assert JITFunction._do_compile is compile_variant  # put back


@torch.inference_mode()
def test_start_up_builds_the_decode_steps_from_threads_before_capturing_them(tp1_models, gpu_launches, monkeypatch,
                                                                             tmp_path):
    """A start-up that builds from threads also runs each batch bucket's decode step once from a thread (a bucket a
    thread) before the captures: the captures, on the start-up's thread, make no launch the threads did not make,
    and the slots hold nothing after start-up."""
    import triton

    import sass
    lm = tp1_models("fp8_text")
    monkeypatch.setattr(E.Engine, "_build_ahead", lambda self, passes, threads: None)  # the prefill passes' builds
    ahead, captured, warmed_on = set(), set(), set()
    warm_graphs, capture, warm = E.Engine._warm_graphs_ahead, E.Graph.capture, E.Graph.warm

    def recorded_warm_graphs(self, threads):
        with sass.launch_keys(ahead, execute=False):
            warm_graphs(self, threads)

    def recorded_capture(self):
        with sass.launch_keys(captured, execute=False):
            capture(self)

    def noted_warm(self):
        warmed_on.add(threading.get_ident())
        warm(self)
    monkeypatch.setattr(E.Engine, "_warm_graphs_ahead", recorded_warm_graphs)
    monkeypatch.setattr(E.Graph, "capture", recorded_capture)
    monkeypatch.setattr(E.Graph, "warm", noted_warm)
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))  # no start-up has built into it
    eng = E.Engine(lm, E.EngineConfig(max_batch=4, max_context=256, prefill_chunk=64, build_threads=3))
    with sass.launch_keys(set(), execute=False):  # the prefill warm-ups' launches: recorded, not interpreted
        eng.start()
    assert list(eng.graphs) == [1, 2, 4] and len(warmed_on - {threading.get_ident()}) > 1
    missed = captured - ahead
    assert captured and not missed, "decode launches the threads did not make:\n" + "\n".join(
        map(str, sorted(missed, key=str)))
    assert not eng.cache.lengths.any()
