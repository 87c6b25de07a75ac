"""Numerical invariants of the text model (in-process, TP=1, PyTorch reference path).

DSA equals dense attention while every region is selected; an independent brute-force selection agrees with the
selector; streamed (decode) region summaries equal prefill summaries bit for bit; prefill N + one decode step equals
prefill N+1; the sliding ring cache matches banded prefill past its wrap-around; config and strict-loading guards.
"""
import os

import pytest
import torch

import helpers
import kernel
import config
import model as M
from invariants import NOISE, pinned, tokens_agree_up_to_near_tie


@pytest.fixture(scope="module")
def tp1(converted):
    """FP8 text-only tiny checkpoint converted at TP=1: (tp dir, config)."""
    d = converted("fp8_text", 1)
    return d, config.load_config(os.path.join(d, "config-r0.json"))[0]


@pytest.fixture(scope="module")
def lm(tp1_models):
    return tp1_models("fp8_text")


@pytest.fixture(scope="module")
def lm_bf16(tp1_models):
    """BF16 experts: cache-logic tests compare paths whose GEMMs differ in row count; with FP8 experts the
    activation quantisation turns those last-bit differences into router near-tie flips on this random model."""
    return tp1_models("bf16_text")


def prompt(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(11, 700, (n,), generator=g).tolist()


# ------------------------------------------------------------------------------------------------ DSA


def dense_causal(q, k, v, scale):
    """q [T, G, Hg, d], k/v [T, G, d] -> causal softmax attention in fp32 (positions 0..T-1)."""
    s = torch.einsum("tghd,sgd->ghts", q.float(), k.float()) * scale
    T = q.shape[0]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("ghts,sgd->tghd", s.softmax(-1), v.float())


def test_sparse_attention_equals_dense_while_every_region_is_selected():
    torch.manual_seed(0)
    T, G, Hg, d, blk = 37, 2, 3, 16, 8
    q, k, v = (torch.randn(T, G, *s).bfloat16() for s in ((Hg, d), (d,), (d,)))
    pos = torch.arange(T)[None]
    n_hist = pos // blk
    R = (T + blk - 1) // blk
    scores = torch.randn(1, G, T, R)
    ids, valid = kernel.select_regions_ref(scores, n_hist, topk=8)  # 8 >= every query's history
    assert int(valid.sum(-1).max()) == (T - 1) // blk
    o = kernel.sparse_attention_ref(q[None], k[None], v[None], ids, valid, pos, blk, d ** -0.5)[0]
    ref = dense_causal(q, k, v, d ** -0.5)
    # the kernel rounds probabilities to bf16 before P.V: a few bf16 ulps of the output
    assert (o.float() - ref).abs().max() < 2e-2
    # negative control: with a budget of 1 region the result must differ from dense attention
    ids1, valid1 = kernel.select_regions_ref(scores, n_hist, topk=1)
    o1 = kernel.sparse_attention_ref(q[None], k[None], v[None], ids1, valid1, pos, blk, d ** -0.5)[0]
    assert (o1.float() - ref).abs().max() > 5e-2


def brute_force_selection(scores, p, blk, topk):
    """Region selection written directly: history regions of p (the current region excluded), ordered by
    (score desc, id asc), the first min(topk, n)."""
    n = p // blk
    cand = sorted(range(n), key=lambda r: (-(scores[r] + 0.0), r))
    return sorted(cand[:min(topk, n)])


@pytest.mark.parametrize("topk", [1, 3, 5, 64])
def test_selection_matches_brute_force_with_ties(topk):
    torch.manual_seed(topk)
    S, G, T, R, blk = 2, 3, 50, 7, 8
    # heavy ties: many exact +0.0 and -0.0 entries and repeated values, as relu-weighted scores produce
    base = torch.randint(-2, 3, (S, G, T, R)).float() * 0.5
    base = torch.where(torch.rand(S, G, T, R) < 0.3, torch.tensor(-0.0), base)
    pos = torch.randint(0, R * blk, (S, T))
    ids, valid = kernel.select_regions_ref(base, pos // blk, topk)
    for s in range(S):
        for g in range(G):
            for t in range(T):
                want = brute_force_selection(base[s, g, t].tolist(), int(pos[s, t]), blk, topk)
                got = ids[s, g, t][valid[s, g, t]].tolist()
                assert got == want, (s, g, t)
                assert (ids[s, g, t][~valid[s, g, t]] == R).all()


def test_model_dsa_layer_equals_dense_attention_before_pruning(lm):
    """Inside the model: a DSA layer's output for a prompt whose history fits in topk regions equals the same
    layer with its core replaced by dense causal attention."""
    cfg = lm.cfg
    i = next(i for i in range(cfg.num_hidden_layers) if cfg.is_dsa(i))
    att = lm.model.layers[i].self_attn
    n = cfg.sparse.topk * cfg.sparse.block + cfg.sparse.block - 1  # last query sees exactly topk history regions
    cache = lm.new_cache(1, n + 4)
    h = torch.randn(n, cfg.hidden_size).bfloat16()
    pos = torch.arange(n)
    rope = lm.rope["layers"][i]
    at = M.Placement(pos, spans=[(0, 0, n, 0)])
    got = att(h, at, rope, cache.layers[i])
    orig = att._dsa
    try:
        def dense(idx, q, k, v, g, at_, c, req=None):  # gated, as _dsa returns
            T, H, hd = q.shape
            return kernel.gate_heads(dense_causal(q.view(T, att.n_groups, H // att.n_groups, hd), k, v, att.scale).to(
                torch.bfloat16).reshape(T, H, hd), g)
        att._dsa = dense
        want = att(h, at, rope, cache.layers[i])
    finally:
        att._dsa = orig
    assert (got.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2 ** -8


def run_prefill(lm, ids, extra=0):
    cache = lm.new_cache(1, len(ids) + extra + 1)
    logits = lm.forward(torch.tensor(ids), cache, [len(ids)])
    return cache, logits


def dsa_layers(lm):
    return [i for i in range(lm.cfg.num_hidden_layers) if lm.cfg.is_dsa(i)]


@torch.inference_mode()
def test_decode_summaries_equal_prefill_summaries_bit_for_bit(lm):
    """Streamed summaries (pending buffer, completed on a region's last decode token) are byte-identical to the
    prefill summaries of the same tokens. The indexer projections are computed once for all positions and served to
    both paths, so both see the same bf16 inputs whatever the GEMM row count."""
    cfg = lm.cfg
    i = dsa_layers(lm)[0]
    att = lm.model.layers[i].self_attn
    N, n0 = 61, 21  # prefill ends mid-region; decode then completes regions 2..6 one token at a time
    torch.manual_seed(0)
    h = torch.randn(N, cfg.hidden_size).bfloat16()
    lm.new_cache(1, N)
    rope = lm.rope["layers"][i]
    proj = att.project(h)
    full = att._norm_rope(*proj[:2], proj[4:], torch.arange(N), rope)[2]
    orig = att._norm_rope
    att._norm_rope = lambda q, k, idx, pos, r: orig(q, k, idx, pos, r)[:2] + (tuple(t[pos] for t in full),)
    try:
        stream = lm.new_cache(1, N).layers[i]
        att(h[:n0], M.Placement(torch.arange(n0), spans=[(0, 0, n0, 0)]), rope, stream)
        for p in range(n0, N):
            att(h[p:p + 1], M.Placement(torch.tensor([p]), rows=torch.tensor([0])), rope, stream)
        pre = lm.new_cache(1, N).layers[i]
        att(h, M.Placement(torch.arange(N), spans=[(0, 0, N, 0)]), rope, pre)
    finally:
        att._norm_rope = orig
    done = N // cfg.sparse.block
    assert stream.summ[0, :done].any()
    assert torch.equal(stream.summ[0, :done], pre.summ[0, :done])
    assert not stream.summ[0, done:].any()  # the unfinished region is never summarised


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["bf16_text", "fp8_text"])
@pytest.mark.parametrize("n", [5, 30, 47])  # inside the window, past the 16-slot ring, past topk*8 (pruning)
@pytest.mark.slow
def test_prefill_then_decode_equals_longer_prefill(tp1_models, kind, n):
    """Prefill n + decode steps equals one-shot prefills of the longer prompts. The two paths run GEMMs of other
    row counts, so their logits differ in last bits; a router or DSA near-tie would turn that into an O(1) change,
    so the decisions of one recorded prefill are pinned into both paths (Pins) and the tolerance stays tight."""
    lm = tp1_models(kind)
    ids = prompt(n + 6, seed=n)
    with pinned(lm, M.Pins()) as rec:
        run_prefill(lm, ids)
    with pinned(lm, M.Pins(rec.data)):
        cache, _ = run_prefill(lm, ids[:n], extra=6)
        for j in range(6):
            step = lm.forward(torch.tensor([ids[n + j]]), cache)
            _, ref = run_prefill(lm, ids[:n + j + 1])
            d = (step - ref).abs().max().item()
            # rounding noise only: a logic error (wrong position, stale cache, lost region) is O(std)
            assert d < NOISE[kind.split("_")[0]] * ref.std().item(), (j, d, ref.std().item())
            top2 = ref[0].topk(2).values
            if top2[0] - top2[1] > 2 * d:
                assert int(step.argmax()) == int(ref.argmax())


@torch.inference_mode()
@pytest.mark.parametrize("kind,chunk", [("bf16_text", 1), ("fp8_text", 5), ("bf16_text", 8), ("fp8_text", 13),
                                        ("bf16_text", 16), ("fp8_text", 33)])  # a token, odd, a region, the ring
@pytest.mark.slow
def test_chunked_prefill_equals_one_shot(tp1_models, kind, chunk):
    """Prefill in chunks on a growing cache (ring continuation, DSA pending rows carried across chunks, summaries of
    regions completed inside a chunk, selection over all history) equals the one-shot prefill, for a batch whose
    prompts end in different chunks; three decode steps on each cache then agree too. The one-shot run's routing and
    region decisions are pinned into the chunked run (other GEMM row counts round differently)."""
    lm = tp1_models(kind)
    ps = [prompt(37, seed=5), prompt(42, seed=6), prompt(9, seed=7)]  # past the ring and topk*8 regions; short
    cont = [prompt(3, seed=8 + b) for b in range(3)]
    tol = NOISE[kind.split("_")[0]]

    def run(chunk_):
        cache = lm.new_cache(3, 42 + 4)
        out = [helpers.prefill(lm, cache, ps, chunk=chunk_)]
        for j in range(3):
            out.append(lm.forward(torch.tensor([c[j] for c in cont]), cache))
        return torch.stack(out), cache

    with pinned(lm, M.Pins()) as rec:
        whole, cw = run(None)
    with pinned(lm, M.Pins(rec.data)):
        chunked, cc = run(chunk)
    assert torch.equal(cw.lengths, cc.lengths) and cc.lengths.tolist() == [37 + 3, 42 + 3, 9 + 3]
    d = (chunked - whole).abs().amax(-1) / whole.std(-1)  # [4, 3]
    assert d.max() < tol, d


@torch.inference_mode()
def test_dsa_query_chunks_do_not_change_the_prefill(tp1_models, monkeypatch):
    """The DSA prefill's scores, selection and sparse attention run in query chunks (kernel.dsa_query_chunk: 256 on
    the references, larger with the Triton kernels): odd chunks of 5 queries give the one-launch result. Decisions
    pinned (the scores' GEMM rounds differently at other row counts)."""
    lm = tp1_models("fp8_text")
    ps = [prompt(37, seed=5), prompt(42, seed=6)]

    def run():
        return helpers.prefill(lm, lm.new_cache(2, 46), ps)

    with monkeypatch.context() as mp, pinned(lm, M.Pins()) as rec:  # first: its rows never meet stale copies
        mp.setattr(kernel, "dsa_query_chunk", lambda x, groups, regions: 5)
        chunked = run()
    with pinned(lm, M.Pins(rec.data)):
        whole = run()
    d = (chunked - whole).abs().amax(-1) / whole.std(-1)
    assert d.max() < NOISE["fp8"], d


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["bf16_text", "fp8_text"])
def test_multi_token_decode_equals_token_by_token(tp1_models, kind):
    """A decode step of Q tokens per row (ids [B, Q]: the speculative verify step, static shapes) equals Q one-token
    steps: every query sees its own window and regions (a region completed by an earlier token of the step is
    summarised before later queries select), rows at other positions in one batch. Decisions pinned."""
    lm = tp1_models(kind)
    ps, Q = [prompt(30, seed=3), prompt(13, seed=4)], 4  # steps cross a region end and the 16-slot ring
    cont = [prompt(2 * Q, seed=10 + b) for b in range(2)]

    def run(q):
        cache = lm.new_cache(2, 30 + 2 * Q, slack=Q - 1)
        helpers.prefill(lm, cache, ps)
        out = []
        for s in range(0, 2 * Q, q):
            if q == 1:  # the one-token step: ids [B] -> [B, V]
                out.append(lm.forward(torch.tensor([c[s] for c in cont]), cache)[:, None])
            else:
                out.append(lm.forward(torch.tensor([c[s:s + q] for c in cont]), cache))  # [2, q, V]
        return torch.cat(out, 1), cache

    with pinned(lm, M.Pins()) as rec:
        one, c1 = run(1)
    with pinned(lm, M.Pins(rec.data)):
        many, cq = run(Q)
    assert many.shape == one.shape == (2, 2 * Q, one.shape[-1])
    assert torch.equal(c1.lengths, cq.lengths) and cq.lengths.tolist() == [30 + 2 * Q, 13 + 2 * Q]
    d = (many - one).abs().amax(-1) / one.std(-1)
    assert d.max() < NOISE[kind.split("_")[0]], d
    with pytest.raises(ValueError, match="ring of"):  # a ring without slack cannot take Q tokens at once
        lm.forward(torch.tensor([c[:Q] for c in cont]), lm.new_cache(2, 64))


@pytest.mark.slow
def test_model_on_the_triton_kernels_matches_the_references(interpreted_model_run):
    """The whole model with every Triton kernel (the interpreter on CPU, the GPU's launch shapes) against the PyTorch
    references (conftest.interpreted_model_run): a batched prefill, a prefill chunk on top of it, one-token steps
    (the fused sliding-window kernel, the sort-free MoE path, the DSA cache-write and selection kernels) and a
    three-token step; the sliding prefill through the banded Triton kernel; the DSA prefill's three paths (every
    region, dense tiles over a selection, per query), each applying the output gate itself. GPU time is scarce: this is
    what catches a kernel wired in with the wrong strides, shapes or offsets before a GPU run. Decisions pinned;
    rounding noise only."""
    ref, got, seen = interpreted_model_run
    kinds = {(r["name"], r["constexprs"].get("SELECT"), r["constexprs"].get("GATE")) for r in seen.values()}
    assert {("_dense_prefix_kernel", False, True), ("_dense_prefix_kernel", True, True),
            ("_banded_attn_kernel", None, True)} <= kinds, kinds
    assert any(r["name"] == "_sparse_attn_kernel" and r["constexprs"]["SPLITS"] == 1 and r["constexprs"]["GATE"]
               and not r["constexprs"]["ROWS"] for r in seen.values())  # prefill's per-query launch (decode's: rows)
    assert got.shape == ref.shape and ref.shape[1] == 7
    d = (got - ref).abs().amax(-1) / ref.std(-1)
    assert d.max() < NOISE["fp8"], d


def test_prefill_on_a_full_cache_is_refused(tp1_models):
    lm = tp1_models("bf16_text")
    cache = lm.new_cache(1, 16)
    with torch.inference_mode():
        lm.forward(torch.tensor(prompt(12)), cache, [12])
        with pytest.raises(ValueError, match="exceeds the cache"):
            lm.forward(torch.tensor(prompt(8)), cache, [8])


def test_pins_change_the_decisions_they_replay(tp1_models):
    """Negative control of the instrument: replaying another prompt's decisions changes the logits, so a pinned
    comparison really runs on the recorded choices."""
    lm = tp1_models("bf16_text")
    a, b = prompt(40, seed=1), prompt(40, seed=2)
    with torch.inference_mode():
        with pinned(lm, M.Pins()) as rec:
            _, la = run_prefill(lm, a)
        _, plain = run_prefill(lm, b)
        with pinned(lm, M.Pins(rec.data)):
            _, forced = run_prefill(lm, b)
        with pinned(lm, M.Pins()) as rec_b:
            _, again = run_prefill(lm, b)
    assert torch.equal(plain, again)  # recording never changes the computation
    assert (forced - plain).abs().max() > 0.1 * plain.std()
    assert rec_b.data.keys() == rec.data.keys() and any(
        not torch.equal(rec.data[k], rec_b.data[k]) for k in rec.data)


def test_batch_rows_match_single_requests_and_eos_leaves_the_others_alone(lm_bf16):
    """A batch request gets its single-request tokens, and a request that stops at an EOS leaves the others' tokens
    unchanged. Batch and single runs differ in GEMM row counts (last bits): the batch run's routing and region choices
    are pinned into the others, and a token may differ only at a measured logit near-tie."""
    lm = lm_bf16
    ps = [prompt(9, 1), prompt(44, 2), prompt(3, 3)]
    with pinned(lm, M.Pins()) as rec:
        batch = helpers.generate(lm, ps, 6, eos_ids=[])[0]
    for b, p in enumerate(ps):
        with pinned(lm, M.Pins(rec.data, requests=[b])):
            single = helpers.generate(lm, [p], 6, eos_ids=[])[0][0]
        tokens_agree_up_to_near_tie(lm, p, single, batch[b])
    # request 1 stops at its token s when that token is an EOS id; the others are unchanged
    # an EOS id that request 1 emits at step s (and not before), which the others never emit
    s, eos = next((s, batch[1][s]) for s in (1, 2, 3, 4) if batch[1][s] not in batch[1][:s] + batch[0] + batch[2])
    with pinned(lm, M.Pins(rec.data)):  # requests keep their identity in their slots
        out = helpers.generate(lm, ps, 6, eos_ids=[eos])[0]
    assert out[1] == batch[1][:s + 1]
    for b in (0, 2):
        tokens_agree_up_to_near_tie(lm, ps[b], out[b], batch[b])


@torch.inference_mode()
def test_chunked_prefill_reports_progress_per_chunk_and_layer(tp1_models):
    """generate.py prints long prefills' progress from this hook: (first token of the chunk, layer, layers)."""
    lm = tp1_models("bf16_text")
    calls = []
    helpers.prefill(lm, lm.new_cache(2, 24), [prompt(20, 1), prompt(9, 2)], progress=lambda *a: calls.append(a),
                     chunk=8)
    L = lm.cfg.num_hidden_layers
    assert calls == [(first, i, L) for first in (0, 8, 16) for i in range(1, L + 1)]


def test_alone_stands_in_for_the_gather_in_its_thread_only():
    """model.alone (start-up's parallel kernel builds): tp_gather gives world_size copies of this rank's rows, in the
    gather's shape and layout, without a collective, and only in the thread that asked."""
    import threading
    x = torch.randn(3, 5)
    M.set_parallel(2, 0)
    try:
        with M.alone():
            g = M.tp_gather(x)
            other = []
            t = threading.Thread(target=lambda: other.append(getattr(M._thread, "alone", False)))
            t.start()
            t.join()
        assert g.shape == (2, 3, 5) and g.is_contiguous() and torch.equal(g[0], x) and torch.equal(g[1], x)
        assert other == [False] and not getattr(M._thread, "alone", False)
    finally:
        M.set_parallel(1, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_a_non_finite_weight_is_found_at_its_index(dtype):
    """first_nonfinite finds a NaN or an infinity (FP8 by its bit patterns) at its flat index, across the chunks it
    reads, and nothing in finite tensors (FP8's largest values included)."""
    t = torch.linspace(-400, 400, 1000).to(dtype).reshape(10, 100)
    assert M.first_nonfinite(t, chunk=64) is None
    for i, v in ((0, float("nan")), (517, float("nan")), (999, float("-inf"))):
        if dtype == torch.float8_e4m3fn and v != v or dtype != torch.float8_e4m3fn:  # e4m3fn has no infinity
            x = t.clone()
            x.view(-1)[i] = torch.tensor(v).to(dtype)
            assert M.first_nonfinite(x, chunk=64) == i, (dtype, i, v)
    assert M.first_nonfinite(torch.arange(5)) is None
