"""Numerical invariants of the text model (in-process, TP=1, PyTorch reference path).

DSA equals dense attention while every region is selected; an independent brute-force selection agrees with the
selector; streamed (decode) region summaries equal prefill summaries bit for bit; prefill N + one decode step equals
prefill N+1; the sliding ring cache matches banded prefill past its wrap-around; config and strict-loading guards.
"""
import json
import math
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import generate
import kernel
import config
import model as M
import tiny_checkpoint
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
    got = att(h, pos, rope, [(0, n, 0)], cache.layers[i])
    orig = att._dsa
    try:
        def dense(h_, q, k, v, g, pos_, rope_, spans, c, req=None):  # gated, as _dsa returns
            T, H, hd = q.shape
            return kernel.gate_heads(dense_causal(q.view(T, att.n_groups, H // att.n_groups, hd), k, v, att.scale).to(
                torch.bfloat16).reshape(T, H, hd), g)
        att._dsa = dense
        want = att(h, pos, rope, [(0, n, 0)], cache.layers[i])
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
        att(h[:n0], torch.arange(n0), rope, [(0, n0, 0)], stream)
        for p in range(n0, N):
            att(h[p:p + 1], torch.tensor([p]), rope, None, stream)
        pre = lm.new_cache(1, N).layers[i]
        att(h, torch.arange(N), rope, [(0, N, 0)], pre)
    finally:
        att._norm_rope = orig
    done = N // cfg.sparse.block
    assert stream.summ[0, :done].any()
    assert torch.equal(stream.summ[0, :done], pre.summ[0, :done])
    assert not stream.summ[0, done:].any()  # the unfinished region is never summarised


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["bf16_text", "fp8_text"])
@pytest.mark.parametrize("n", [5, 30, 47])  # inside the window, past the 16-slot ring, past topk*8 (pruning)
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
        out = [generate.prefill(lm, cache, ps, chunk=chunk_)]
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
        return generate.prefill(lm, lm.new_cache(2, 46), ps)

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
        generate.prefill(lm, cache, ps)
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


@torch.inference_mode()
def test_model_on_the_triton_kernels_matches_the_references(tp1_models, monkeypatch):
    """The whole model with every Triton kernel (the interpreter on CPU) against the PyTorch references: a batched
    prefill, a prefill chunk on top of it, a one-token step (the fused sliding-window kernel, the sort-free MoE path,
    the DSA cache-write and selection kernels) and a three-token step; the sliding prefill through the banded Triton
    kernel. GPU time is scarce: this is what catches a kernel wired
    in with the wrong strides, shapes or offsets before a GPU run. Decisions pinned; rounding noise only."""
    lm = tp1_models("fp8_text")
    ids, cont = prompt(19, seed=3), prompt(14, seed=4)

    def run():
        cache = lm.new_cache(2, 34, slack=2)
        first = lm.forward(torch.tensor(ids + ids[:11]), cache, [19, 11])[:, None]  # [2, 1, V]
        more = lm.forward(torch.tensor(cont[8:14]), cache, [2, 4])[:, None]  # chunks after cached keys
        one = lm.forward(torch.tensor(cont[:2]), cache)[:, None]
        three = lm.forward(torch.tensor([cont[2:5], cont[5:8]]), cache)  # [2, 3, V]
        return torch.cat([first, more, one, three], 1)

    with pinned(lm, M.Pins()) as rec:
        ref = run()
    monkeypatch.setattr(kernel, "_triton", lambda x: True)
    with pinned(lm, M.Pins(rec.data)):
        got = run()
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


def test_batch_rows_match_single_requests_and_eos_compacts(lm_bf16):
    """A batch request gets its single-request tokens, and EOS compaction leaves the others' tokens unchanged.
    Batch and single runs differ in GEMM row counts (last bits): the batch run's routing and region choices are
    pinned into the others, and a token may differ only at a measured logit near-tie."""
    lm = lm_bf16
    ps = [prompt(9, 1), prompt(44, 2), prompt(3, 3)]
    with pinned(lm, M.Pins()) as rec:
        batch = generate.generate(lm, ps, 6, eos_ids=[])[0]
    for b, p in enumerate(ps):
        with pinned(lm, M.Pins(rec.data, requests=[b])):
            single = generate.generate(lm, [p], 6, eos_ids=[])[0][0]
        tokens_agree_up_to_near_tie(lm, p, single, batch[b])
    # request 1 stops at its token s when that token is an EOS id; the others are unchanged
    # an EOS id that request 1 emits at step s (and not before), which the others never emit
    s, eos = next((s, batch[1][s]) for s in (1, 2, 3, 4) if batch[1][s] not in batch[1][:s] + batch[0] + batch[2])
    rows = []
    orig = M.Cache.keep
    M.Cache.keep = lambda self, r: (rows.append(r.tolist()), orig(self, r))[1]
    try:
        with pinned(lm, M.Pins(rec.data)):  # requests keep their identity through the compaction
            out = generate.generate(lm, ps, 6, eos_ids=[eos])[0]
    finally:
        M.Cache.keep = orig
    assert out[1] == batch[1][:s + 1]
    for b in (0, 2):
        tokens_agree_up_to_near_tie(lm, ps[b], out[b], batch[b])
    assert rows == [[0, 2]]  # the finished row left the cache once


# ------------------------------------------------------------------------------------------------ config


real_config = tiny_checkpoint.real_text_config


def test_real_geometry_config():
    c = config.Step5Config.from_dict(real_config())
    assert [i for i in range(92) if c.is_dsa(i)] == list(range(3, 92, 4))
    assert c.moe_layers == list(range(3, 91))
    assert [i for i in range(92) if not c.is_moe(i)] == [0, 1, 2, 91]
    assert c.is_dsa(91) and not c.is_moe(91)
    assert {c.rope_span(i) for i in range(92) if c.is_dsa(i)} == {64}
    assert {c.rope_span(i) for i in range(92) if not c.is_dsa(i)} == {192}
    assert all(c.rope_scaled(i) == c.is_dsa(i) for i in range(92))
    for tp, (heads, groups) in {1: (64, 4), 2: (32, 2), 4: (16, 1), 8: (8, 1), 16: (4, 1)}.items():
        t = config.Step5Config.from_dict(real_config(tp_size=tp, expert_parallel_size=tp,
                                                tp_layout_version=config.LAYOUT_VERSION))
        assert (t.n_local_heads, t.n_local_groups, t.n_local_experts) == (heads, groups, 352 // tp)
    assert [config.group_window(4, 8, r) for r in range(8)] == [(r // 2, 1) for r in range(8)]


@pytest.mark.parametrize("over,needle", [
    ({"moe_layers_enum": "3,4"}, "disagree"),
    ({"num_experts_per_tok": 6}, "num_experts_per_tok=6"),
    ({"num_key_value_heads": 8}, "num_key_value_heads=8"),
    ({"tp_size": 2, "expert_parallel_size": 2}, "tp_layout_version"),
    ({"tp_size": 3, "expert_parallel_size": 3, "tp_layout_version": config.LAYOUT_VERSION}, "not divisible"),
    ({"tp_size": 2, "expert_parallel_size": 4, "tp_layout_version": config.LAYOUT_VERSION}, "expert_parallel_size"),
    ({"tp_size": True}, "tp_size"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "llama3"),
    ({"att_impl_type": "MLA"}, "att_impl_type"),
])
def test_bad_configs_are_refused_by_name(over, needle):
    with pytest.raises(config.ConfigError, match=needle):
        config.Step5Config.from_dict(real_config(**over))


@pytest.mark.parametrize("key,value,needle", [
    ("num_attention_heads", "64", 'num_attention_heads="64" must be an integer (got a JSON string)'),
    ("hidden_size", 4096.0, "hidden_size=4096.0 must be an integer (got a JSON float)"),
    ("moe_top_k", True, "moe_top_k=true must be an integer (got a JSON boolean)"),
    ("sliding_window", None, "sliding_window=null must be an integer (got a JSON null)"),
    ("num_key_value_heads", "4", 'num_key_value_heads="4" must be an integer (got a JSON string)'),
    ("rms_norm_eps", "1e-5", 'rms_norm_eps="1e-5" must be a number (got a JSON string)'),
    ("sparse_config.topk", [512], "sparse_config.topk=[512] must be an integer (got a JSON array)"),
])
def test_config_field_of_the_wrong_json_type_is_named(key, value, needle):
    d = real_config()
    if key.startswith("sparse_config."):
        d["sparse_config"] = {**d["sparse_config"], key.split(".")[1]: value}
    else:
        d[key] = value
    with pytest.raises(config.ConfigError) as e:
        config.Step5Config.from_dict(d)
    assert str(e.value) == needle


def test_config_integer_valued_numbers_still_accepted_for_float_fields():
    c = config.Step5Config.from_dict(real_config(moe_router_scaling_factor=3, rms_norm_eps=1e-5))
    assert c.moe_router_scaling_factor == 3.0 and isinstance(c.moe_router_scaling_factor, float)


def test_rope_tables_are_built_in_fp32():
    cos, sin = M.rope_table(192, 10000.0, None, 64, "cpu")
    inv = 1.0 / (10000.0 ** (torch.arange(0, 192, 2, dtype=torch.float64) / 192))
    f64 = torch.outer(torch.arange(64, dtype=torch.float64), inv)
    diff = (f64.cos().to(torch.bfloat16) != cos) | (f64.sin().to(torch.bfloat16) != sin)
    assert diff.any() and not diff[:24].any()  # a float64 build rounds to other bf16 values from position 24 on


def test_llama3_rescale_applies_only_to_listed_layer_types():
    c = config.Step5Config.from_dict(tiny_checkpoint.tiny_text_config())
    assert [c.rope_scaled(i) for i in range(8)] == [c.is_dsa(i) for i in range(8)]
    s = c.rope_scaling
    plain = M.rope_table(16, 1e7, None, 300, "cpu")[0]
    scaled = M.rope_table(16, 1e7, s, 300, "cpu")[0]
    assert not torch.equal(plain, scaled)
    # the highest frequency is untouched (wavelength below original / high_freq_factor), the lowest divided by factor
    assert torch.equal(plain[:, 0], scaled[:, 0])
    wl = 2 * math.pi * 1e7 ** (14 / 16)
    assert wl > s["original_max_position_embeddings"] / s["low_freq_factor"]
    inv = 1.0 / (1e7 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))  # the table's own fp32 frequencies
    lowest = (torch.arange(300, dtype=torch.float32) * (inv[-1] / s["factor"])).sin().to(torch.bfloat16)
    plain_sin, scaled_sin = M.rope_table(16, 1e7, None, 300, "cpu")[1], M.rope_table(16, 1e7, s, 300, "cpu")[1]
    assert torch.equal(scaled_sin[:, -1], lowest) and not torch.equal(plain_sin[:, -1], lowest)


# ------------------------------------------------------------------------------------------------ strict loading


def rewrite_shard(src, dst, edit, meta_edit=None):
    with safe_open(src, "pt") as f:
        meta = f.metadata()
        t = {k: f.get_tensor(k) for k in f.keys()}
    edit(t)
    if meta_edit:
        meta_edit(meta)
    save_file(t, dst, metadata=meta)


@pytest.mark.parametrize("case,needle", [
    ("missing", "missing 1 key"),
    ("unexpected", "unexpected 1 key"),
    ("shape", "model.layers.0.self_attn.g_proj.weight: BF16[8, 256]"),
    ("dtype", "model.norm.weight: BF16"),
    ("rank", "rank='1'"),
    ("fingerprint", "source_fingerprint"),
])
def test_strict_loading_names_the_problem(tp1, tmp_path, case, needle):
    d, cfg = tp1
    src = os.path.join(d, "model-r0.safetensors")
    dst = str(tmp_path / "model-r0.safetensors")
    edits = {
        "missing": lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
        "unexpected": lambda t: t.__setitem__("model.layers.1.extra.weight", torch.zeros(2)),
        "shape": lambda t: t.__setitem__("model.layers.0.self_attn.g_proj.weight",
                                         t["model.layers.0.self_attn.g_proj.weight"][:8].clone()),
        "dtype": lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].bfloat16()),
    }
    metas = {"rank": lambda m: m.__setitem__("rank", "1"),
             "fingerprint": lambda m: m.__setitem__("source_fingerprint", "0" * 16)}
    rewrite_shard(src, dst, edits.get(case, lambda t: None), metas.get(case))
    with pytest.raises(M.ShardError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        M.Step5ForCausalLM.from_shard(dst, cfg)


def test_truncated_shard_is_refused(tp1, tmp_path):
    d, cfg = tp1
    dst = tmp_path / "model-r0.safetensors"
    shutil.copy(os.path.join(d, "model-r0.safetensors"), dst)
    with open(dst, "r+b") as f:
        f.truncate(os.path.getsize(dst) // 2)
    with pytest.raises(M.ShardError, match="model-r0.safetensors"):
        M.Step5ForCausalLM.from_shard(str(dst), cfg)


REDUCE_SCRIPT = r"""
import os, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import model as M
dist.init_process_group("gloo")
M.set_parallel(dist.get_world_size(), dist.get_rank())
g = torch.Generator().manual_seed(100 + M.rank)
res = torch.randn(37, 64, generator=torch.Generator().manual_seed(1))  # the replicated residual
w = torch.randn(64, generator=torch.Generator().manual_seed(2)) * 0.1
for dt in (torch.float32, torch.bfloat16):
    x = (torch.randn(37, 64, generator=g) * 100).to(dt)
    whole = M.tp_reduce_add(res, x, w, 1e-5)
    M._REDUCE_BYTES = 3 * 64 * 4 * M.world_size  # forces chunks of a few rows
    chunked = M.tp_reduce_add(res, x, w, 1e-5)
    M._REDUCE_BYTES = 1 << 30
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b), dt
        assert torch.equal(M.tp_gather(a)[0], a)  # every rank holds the same bits
    parts = M.tp_gather(x)
    assert torch.equal(whole[0], res + (parts[0].float() + parts[1].float()).to(dt).float())  # rank order
    print("ok", dt)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
"""


def test_tp_reduce_add_chunked_equals_whole_and_is_identical_on_all_ranks(tmp_path):
    import subprocess
    import sys
    script = tmp_path / "reduce.py"
    script.write_text(REDUCE_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        str(script), root], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("ok") == 4


def test_shards_with_kept_mtp_layers_load(ckpts, converted):
    """`convert.py --keep-mtp` shards load with their MTP layers."""
    d = converted("bf16_text", 1, keep_mtp=True)
    cfg = config.load_config(os.path.join(d, "config-r0.json"))[0]
    assert cfg.mtp_layers_kept == cfg.num_nextn_predict_layers > 0
    m = M.Step5ForCausalLM.from_shard(os.path.join(d, "model-r0.safetensors"), cfg)
    L = cfg.num_hidden_layers
    assert len(m.model.layers) == L + cfg.mtp_layers_kept
    name = f"model.layers.{L}.eh_proj.weight"
    with open(os.path.join(ckpts["bf16_text"], "model.safetensors.index.json")) as f:
        file = json.load(f)["weight_map"][name]
    with safe_open(os.path.join(ckpts["bf16_text"], file), "pt") as f:
        assert torch.equal(m.model.layers[L].eh_proj.weight, f.get_tensor(name))


@torch.inference_mode()
def test_chunked_prefill_reports_progress_per_chunk_and_layer(tp1_models):
    """generate.py prints long prefills' progress from this hook: (first token of the chunk, layer, layers)."""
    lm = tp1_models("bf16_text")
    calls = []
    generate.prefill(lm, lm.new_cache(2, 24), [prompt(20, 1), prompt(9, 2)], progress=lambda *a: calls.append(a),
                     chunk=8)
    L = lm.cfg.num_hidden_layers
    assert calls == [(first, i, L) for first in (0, 8, 16) for i in range(1, L + 1)]
