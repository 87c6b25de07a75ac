"""GPU end to end: the tiny model on CUDA (reference path and Triton kernels) agrees with the CPU run, graph replay
equals eager launches, and TP=2 over NCCL agrees with TP=1. Skipped without CUDA. Run with TRITON_INTERPRET=0
(conftest defaults it to 1 for CPU CI):

    TRITON_INTERPRET=0 python -m pytest -q tests/test_gpu.py

CPU and CUDA (and TP=1 and TP=2) round differently in the last bits, which a router or DSA near-tie turns into an
O(1) change: the comparisons pin the reference run's decisions (model.Pins) and hold the logits to rounding level.
"""
import json
import os

import pytest
import torch

import engine
import helpers
import kernel
import model as M
from invariants import decisions_differ, gen_and_dump, pinned
from kernels import common, experts

cuda = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                          reason="needs a CUDA device and TRITON_INTERPRET=0")
PROMPTS = [list(range(40, 52)), [(7 * i) % 600 + 11 for i in range(57)], [300, 301, 302]]
TOL = {"fp8_text": 0.15, "bf16_text": 0.06}  # x std(logits), decisions pinned: rounding noise (tests/invariants.py)


def teacher_forced_logits(m, prompt, cont):
    """Prefill, then decode the fixed continuation: per-step full logits [len(cont) + 1, V]."""
    dev = m.lm_head.weight.device
    with torch.inference_mode():
        cache = m.new_cache(1, len(prompt) + len(cont) + 1)
        out = [m.forward(torch.tensor(prompt, device=dev), cache, [len(prompt)])]
        for t in cont:
            out.append(m.forward(torch.tensor([t], device=dev), cache))
    return torch.cat(out).float().cpu()


@cuda
@pytest.mark.parametrize("kind", ["fp8_text", "bf16_text"])
@pytest.mark.parametrize("triton", [False, True], ids=["torch-ref", "triton"])
def test_cuda_matches_cpu(tp1_models, kind, triton):
    cpu, gpu = tp1_models(kind), tp1_models(kind, "cuda")
    want = helpers.generate(cpu, PROMPTS, 8, eos_ids=[])[0]
    kernel.set_backend(triton)
    try:
        worst = 0.0
        for p, w in zip(PROMPTS, want):
            with pinned(cpu, M.Pins()) as rec:
                a = teacher_forced_logits(cpu, p, w[:-1])
            with pinned(gpu, M.Pins(rec.data)):
                b = teacher_forced_logits(gpu, p, w[:-1])
            worst = max(worst, ((a - b).abs().amax(-1) / a.std(-1)).max().item())
    finally:
        kernel.set_backend(True)
    print(f"{kind} triton={triton}: worst per-step max |logit diff| / logit std, decisions pinned: {worst:.4f}")
    assert worst < TOL[kind]


@cuda
def test_cuda_graph_decode_equals_eager(tp1_models):
    """The captured decode step replays the very kernels of the eager step: identical tokens."""
    gpu = tp1_models("fp8_text", "cuda")
    eager = helpers.generate(gpu, PROMPTS, 10, eos_ids=[], cuda_graph=False)[0]
    graph = helpers.generate(gpu, PROMPTS, 10, eos_ids=[], cuda_graph=True)[0]
    # with an EOS that finishes one request early: the smaller batch replays its own bucket's graph
    eos = [eager[1][3]]
    eager_eos = helpers.generate(gpu, PROMPTS, 10, eos_ids=eos, cuda_graph=False)[0]
    graph_eos = helpers.generate(gpu, PROMPTS, 10, eos_ids=eos, cuda_graph=True)[0]
    assert graph == eager
    assert graph_eos == eager_eos and len(graph_eos[1]) <= 4


@cuda
def test_prefill_graphs_replay_the_padded_passes(tp1_models):
    """A fresh prompt's prefill graph and a next turn's extension graph replay the very kernels of their steps run
    eagerly: identical tokens, for prompts padded to 32 and 64, a next turn of 20 tokens (a step of 32) and one of ~100
    (one step of 128) (tests/test_engine.py compares them with unpadded prefills on the CPU)."""
    gpu = tp1_models("fp8_text", "cuda")
    runs = {}
    for graph in (False, True):
        eng = engine.Engine(gpu, engine.EngineConfig(max_batch=2, max_context=256, cuda_graph=graph, graph_prefill=128))
        eng.start()
        assert list(eng.prefill_graphs) == [32, 64, 128] and list(eng.extend_graphs) == [16, 32, 64, 128]
        assert all(g.use_graph == graph for g in [*eng.prefill_graphs.values(), *eng.extend_graphs.values()])
        padded = []
        helpers.record_replays(eng, padded)
        outs = [eng.run([engine.Request(p, 8)])[0].out for p in PROMPTS]
        turn = eng.run([engine.Request(PROMPTS[-1] + outs[-1] + list(range(60, 80)), 8)])[0]
        wide = eng.run([engine.Request(turn.ids + turn.out + list(range(100, 200)), 8)])[0]
        assert turn.cached > 0 and wide.cached > len(turn.ids)
        assert [n for *_, n in padded] == [32, 64, 32, 32, 128]  # the prompts, the turns' extension steps
        runs[graph] = outs + [turn.out, wide.out]
    assert runs[True] == runs[False]


@pytest.mark.skipif(torch.cuda.device_count() < 2 or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs 2 CUDA devices and TRITON_INTERPRET=0")
@pytest.mark.parametrize("kind", ["fp8_text", "bf16_text"])
def test_nccl_tp2_matches_tp1(converted, kind, tmp_path):
    """TP=2 over NCCL with TP=1's decisions pinned: logits within rounding of TP=1 at every step; the CLI's own
    tokens agree up to a measured near-tie or a decision flip."""
    batch = str(tmp_path / "batch.json")
    with open(batch, "w") as f:
        json.dump(PROMPTS, f)
    lengths = [len(p) for p in PROMPTS]
    toks1, d1 = gen_and_dump(1, converted(kind, 1), batch, None, None, tmp_path, lengths, 6, "cuda")
    pins = tmp_path / "pins.pt"
    torch.save(d1["pins"], pins)
    toks2, d2 = gen_and_dump(2, converted(kind, 2), batch, [t[:-1] for t in toks1], pins, tmp_path, lengths, 6, "cuda")
    L1 = d1["logits"]
    rel = ((d2["pinned_logits"] - L1).abs().amax(-1) / L1.std()).max().item()
    print(f"{kind} NCCL TP=2 vs TP=1, decisions pinned: max |dlogit| / std = {rel:.4f}")
    assert rel < TOL[kind]
    top2 = L1.topk(2, dim=-1).values
    for b in range(len(PROMPTS)):
        if toks2[b] != toks1[b]:
            s = next(i for i, (x, y) in enumerate(zip(toks2[b], toks1[b])) if x != y)
            assert (decisions_differ(d1["pins"], d2["pins"], b, lengths[b] - 1 + s)
                    or (top2[s, b, 0] - top2[s, b, 1]).item() <= TOL[kind] * L1.std().item()), (b, s)


@cuda
def test_pdl_decode_equals_plain_launches(tp1_models, monkeypatch):
    """Programmatic dependent launch (kernels.common._pdl, on on sm90): every Triton kernel waits for its predecessor before
    touching memory, so the same bits as plain launches: the same logits (eager) and the same tokens through the
    captured graph."""
    gpu = tp1_models("fp8_text", "cuda")
    assert common._pdl()["PDL"]  # on on an H200
    got = helpers.generate(gpu, PROMPTS, 10, eos_ids=[], cuda_graph=True)[0]
    got_logits = teacher_forced_logits(gpu, PROMPTS[1], got[1][:-1])
    with monkeypatch.context() as mp:
        mp.setattr(common, "_pdl", lambda: {"PDL": False})
        want = helpers.generate(gpu, PROMPTS, 10, eos_ids=[], cuda_graph=True)[0]
        logits = teacher_forced_logits(gpu, PROMPTS[1], got[1][:-1])
    assert got == want
    assert torch.equal(got_logits, logits)


@cuda
def test_early_down_decode_equals_grid_wait(tp1_models):
    """kernel.TUNING["moe_early_down"] (on at T > 1 by default): each decode down program awaits only its own
    expert's gate/up tiles (arrival counters that the combine launch zeroes) instead of the whole gate/up grid. The
    same bits: the same tokens through many graph replays of a 3-request batch, and with it on at T = 1 too, the
    same teacher-forced logits."""
    gpu = tp1_models("fp8_text", "cuda")
    runs, default = {}, kernel.TUNING["moe_early_down"]
    for early in ((False, True), (True, True), (False, False)):
        kernel.TUNING["moe_early_down"] = early
        try:
            toks = helpers.generate(gpu, PROMPTS, 24, eos_ids=[], cuda_graph=True)[0]
            runs[early] = toks, teacher_forced_logits(gpu, PROMPTS[1], toks[1][:8])
        finally:
            kernel.TUNING["moe_early_down"] = default
    (t0, l0), (t1, l1), (t2, l2) = runs.values()
    assert t0 == t1 == t2
    assert torch.equal(l0, l1) and torch.equal(l1, l2)
    assert not experts._arrival_counters(torch.device("cuda", torch.cuda.current_device()), 1).any()


@cuda
def test_cuda_vision_path(tp1_models):
    """VL on CUDA: pixel path == image_embeds path (tokens), and the features agree with the CPU encoder."""
    cpu, gpu = tp1_models("fp8_vl"), tp1_models("fp8_vl", "cuda")
    g = torch.Generator().manual_seed(0)
    px, crops = torch.randn(1, 3, 728, 728, generator=g), torch.randn(2, 3, 504, 504, generator=g)
    img = gpu.vl.image_token_id
    prompt = [20, 21] + [img] * (2 * 81 + 169) + [22, 23]
    pixels = dict(pixel_values=px, patch_pixel_values=crops, num_patches=[2])
    f_cpu = cpu.image_features(**pixels)
    f_gpu = gpu.image_features(**pixels)
    a = helpers.generate(gpu, [prompt], 6, [], [pixels])[0]
    b = helpers.generate(gpu, [prompt], 6, [], [dict(image_embeds=f_gpu)])[0]
    assert a == b
    cos = torch.nn.functional.cosine_similarity(f_cpu.float(), f_gpu.float().cpu(), dim=-1)
    print(f"vision features CPU vs CUDA: min cosine per row {cos.min().item():.6f}")
    assert cos.min() > 0.999


@cuda
@pytest.mark.parametrize("batch", [1, 5])
def test_decode_stress_graph_equals_eager_as_requests_leave(tp1_models, batch):
    """Many graph replays, requests leaving at their EOS (smaller buckets, padding rows), several batch sizes: the
    graph path gives the eager tokens. Run it under `compute-sanitizer --tool memcheck` (STRESS_STEPS=400) to prove the decode path clean."""
    steps = int(os.environ.get("STRESS_STEPS", "64"))
    gpu = tp1_models("fp8_text", "cuda")
    prompts = [[(11 + 37 * b + 5 * i) % 1000 + 11 for i in range(3 + 9 * b)] for b in range(batch)]
    free = helpers.generate(gpu, prompts, steps, eos_ids=[], cuda_graph=False)[0]
    # EOS ids that end requests at different steps, so the batch shrinks through the buckets repeatedly
    eos = sorted({free[b][min(steps - 1, 5 + 11 * b)] for b in range(batch)})
    eager = helpers.generate(gpu, prompts, steps, eos_ids=eos, cuda_graph=False)[0]
    graph = helpers.generate(gpu, prompts, steps, eos_ids=eos, cuda_graph=True)[0]
    assert graph == eager
    assert batch == 1 or len({len(o) for o in graph}) > 1  # requests really left the batch at different steps


@cuda
def test_bench_kernels_checks_and_gemm_run_clean():
    """tools.bench_kernels's real-shape checks followed by the GEMM benchmarks: every check within its tolerance and no
    CUDA error (an unsynchronised graph-timing harness once read freed memory here: 'illegal memory access')."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "tools.bench_kernels", "--only", "check", "gemm"],
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True, text=True,
                       timeout=900, env=dict(os.environ, TRITON_INTERPRET="0"))
    assert r.returncode == 0 and "illegal" not in r.stdout + r.stderr, (r.stdout + r.stderr)[-4000:]


@cuda
def test_cuda_speculative_and_chunked_prefill_give_plain_greedy(converted, monkeypatch):
    """On CUDA with the Triton kernels: speculative decoding (MTP drafts; forced right drafts) and a chunked prefill
    give plain greedy's tokens (plain greedy's decisions pinned, so eager steps; a token may differ only at a
    near-tie)."""
    import config
    from invariants import pinned, tokens_agree_up_to_near_tie
    from helpers import force_drafts
    d = converted("bf16_text", 1, keep_mtp=True)
    cfg = config.load_config(os.path.join(d, "config-r0.json"))[0]
    gpu = M.Step5ForCausalLM.from_shard(os.path.join(d, "model-r0.safetensors"), cfg, "cuda")
    with pinned(gpu, M.Pins()) as rec:
        ref = helpers.generate(gpu, PROMPTS, 10, [], cuda_graph=False)[0]
    with pinned(gpu, M.Pins(rec.data, strict=False)):
        mtp = helpers.generate(gpu, PROMPTS, 10, [], speculative=2, cuda_graph=False)[0]
        chunked = helpers.generate(gpu, PROMPTS, 10, [], prefill_chunk=7, cuda_graph=False)[0]
        force_drafts(monkeypatch, ref, PROMPTS, 0)
        right = helpers.generate(gpu, PROMPTS, 10, [], speculative=2, cuda_graph=False)[0]
    for got in (mtp, right, chunked):
        for p, g, r in zip(PROMPTS, got, ref):
            tokens_agree_up_to_near_tie(gpu, p, g, r)


@cuda
def test_cuda_speculative_graphs_equal_eager(converted):
    """The speculative verify and draft steps, the prompts' padded prefills and a next turn's extension step replayed
    as CUDA graphs (through a request's EOS: a smaller bucket) give the eager run's tokens and acceptance exactly:
    same device, same kernels, same shapes (graph_prefill: the eager engine pads its prompts too)."""
    import config
    d = converted("bf16_text", 1, keep_mtp=True)
    cfg = config.load_config(os.path.join(d, "config-r0.json"))[0]
    gpu = M.Step5ForCausalLM.from_shard(os.path.join(d, "model-r0.safetensors"), cfg, "cuda")

    def run(graph, eos=()):
        eng = engine.Engine(gpu, engine.EngineConfig(max_batch=len(PROMPTS), max_context=256, speculative=2,
                                                     cuda_graph=graph, graph_prefill=128))
        eng.start()
        assert list(eng.prefill_graphs) == [32, 64, 128]
        outs = [r.out for r in eng.run([engine.Request(p, 12, frozenset(eos)) for p in PROMPTS])]
        turn = eng.run([engine.Request(PROMPTS[1] + outs[1] + list(range(60, 90)), 12)])[0]
        assert turn.cached > 0
        return outs + [turn.out], list(eng.spec.stats["accepted"])
    eager, graph = run(False), run(True)
    assert graph == eager
    out = eager[0]
    eos = [next(t for t in out[1][2:8] if t not in out[1][:2] + out[0] + out[2])]  # request 1 stops early
    eager, graph = run(False, eos), run(True, eos)
    assert len(eager[0][1]) < 12 and graph == eager


@cuda
def test_no_compile_or_capture_after_start_up(tp1_models):
    """The engine's promise on the GPU: after start-up, requests of any prompt length and batch size compile no
    Triton kernel and capture no CUDA graph (counted by hooks: tools.bench_request.Counters)."""
    from tools.bench_request import Counters
    gpu = tp1_models("fp8_text", "cuda")
    counters = Counters()
    eng = engine.Engine(gpu, engine.EngineConfig(max_batch=16, max_context=2048, prefill_chunk=512))
    eng.start()
    before = counters.snapshot()
    g = torch.Generator().manual_seed(0)
    for batch, n in ((1, 1), (1, 7), (1, 300), (3, 1500), (16, 33), (1, 1024), (2, 2000)):
        eng.run([engine.Request(torch.randint(11, 1000, (n,), generator=g).tolist(), 4) for _ in range(batch)])
    after = counters.snapshot()
    assert after == before, f"compiled {counters.names[before[0]:]}, {after[1] - before[1]} captures"


@cuda
@pytest.mark.parametrize("pick", ["whole", "lean", "argmax"])
@pytest.mark.parametrize("speculative", [0, 2])
def test_cuda_structured_graphs_equal_eager(converted, speculative, pick):
    """The split decode step (the forward graph, then the choose graph with the grammar masks the host filled while
    the forward ran) and the verify step's accept graphs, replayed as CUDA graphs, give the eager run's tokens and
    logprobs exactly: constrained requests with a reasoning budget, penalised and biased sampling, logprobs and echo,
    beside plain greedy ones (pick "lean": no logprobs, echo or top_p, so the lean choose graphs run; "argmax": nor a
    temperature, so the argmax ones run); then nothing compiled or captured after start-up."""
    import config
    import choice
    import grammar
    from sampling import Sampling
    from tools.bench_request import Counters
    d = converted("bf16_text", 1, keep_mtp=True)
    cfg = config.load_config(os.path.join(d, "config-r0.json"))[0]
    gpu = M.Step5ForCausalLM.from_shard(os.path.join(d, "model-r0.safetensors"), cfg, "cuda")
    grammars = grammar.Grammars(os.path.join(d, "..", "tokenizer_files", "tokenizer.json"), cfg.vocab_size, 4)
    schema = grammar.Constraint.json_schema({"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "yy"]}},
        "required": ["a", "b"], "additionalProperties": False})
    counters = Counters()

    def run(graph):
        eng = engine.Engine(gpu, engine.EngineConfig(max_batch=6, max_context=256, speculative=speculative,
                                                     cuda_graph=graph), grammars=grammars)
        eng.start()
        before = counters.snapshot()
        whole = pick == "whole"
        lp, t = (lambda n: n if whole else None), (0.0 if pick == "argmax" else 1.0)
        reqs = [engine.Request(p, 24, frozenset({4}), Sampling(t, seed=i), constraint=c,
                               reasoning=choice.Reasoning(900, 3), logprobs=lp(2))
                for i, (p, c) in enumerate(zip(PROMPTS, [schema, grammar.Constraint(grammar.Kind.JSON_OBJECT),
                                                         grammar.Constraint(grammar.Kind.REGEX, "[a-z]{2,8}")]))]
        reqs += [engine.Request(PROMPTS[0], 12, sampling=Sampling(0.8 * t, top_p=0.9 if whole else 1.0,
                                                                  min_p=0.05 if t else 0.0, presence_penalty=1,
                                                                  repetition_penalty=1.2, logit_bias={7: 4.0}, seed=5),
                                logprobs=lp(4)),
                 engine.Request(PROMPTS[1], 3, logprobs=1, echo=True) if whole else engine.Request(PROMPTS[1], 3),
                 engine.Request(PROMPTS[2], 12)]
        eng.run(reqs)
        assert counters.snapshot() == before, f"compiled {counters.names[before[0]:]} or captured after start-up"
        return [(r.out, str(r.finish), r.token_logprobs, r.prompt_logprobs) for r in reqs]
    eager, graph = run(False), run(True)
    assert graph == eager
    assert all(f in ("stop", "length") for _, f, _, _ in eager), [f for _, f, _, _ in eager]
