"""What a user sees: requests through the engine (engine.py) on one GPU holding one whole TP=EP=8 rank of random FP8
weights (92 layers; tools.rank's build), start-up included.

Per engine: the start-up (warm-up, i.e. Triton compilation, and CUDA graph capture, timed separately), then
requests of P prompt tokens and N new tokens at batch B: time to first token, decode tokens/s as the host saw them
(first token to last), and the Triton compilations and CUDA graph captures that happened during the requests
(the engine's promise: none). The replayed step's rate beside it (the same engine's bucket graph, timed alone)
is what the decode rate rests on. Run it twice with the same TRITON_CACHE_DIR for a cold and a warm start.

    TRITON_CACHE_DIR=$(mktemp -d) python -m tools.bench_request           # cold start, then the request table
    python -m tools.bench_request --cases 1x1024,1x4096,1x32768,1x131072,16x1024,16x4096 --new 256
    python -m tools.bench_request --max-context 8192 --cases 1x4096     # the same request on a small cache
    python -m tools.bench_request --cases "" --profile 8192 32768 131072    # where a prefill's time goes, by family
    python -m tools.bench_request --cases "" --profile 32768 --tune sparse_block_n=32   # a launch choice

--profile P ...: one request's prefill of P tokens (to its first token) under the profiler: per kernel family, its
share of the prefill's wall time, and for the GEMMs and attention their rate against the H200's FLOP ceilings
(bf16 767, fp8 1263 TFLOP/s). "idle" is wall time with no kernel running (the host behind the device).
"""
import argparse
import contextlib
import json
import time

import torch

import engine as E
import kernel
import model as M
import startup
from tools.bench_decode import replay_table
from tools.rank import BF16_FLOPS, FP8_FLOPS, build, time_step


class Counters:
    """Triton kernel builds (a launch whose specialisation this process had not built yet: compiled, or read from
    Triton's disk cache on a warm start; either way a cost on the path that triggers it) and CUDA
    graph captures, counted from hooks installed here."""

    def __init__(self):
        self.compiles, self.captures, self.names = 0, 0, []
        import triton
        knobs = getattr(triton, "knobs", None)

        def hook(*a, **k):
            self.compiles += 1
            self.names.append(getattr(k.get("fn"), "name", "?"))
            return False
        if knobs is not None and hasattr(knobs.runtime, "jit_post_compile_hook"):
            knobs.runtime.jit_post_compile_hook = hook
        else:
            from triton.runtime.jit import JITFunction
            JITFunction.compiled_hook = hook
        real = torch.cuda.CUDAGraph.capture_begin

        def capture_begin(graph, *a, **k):
            self.captures += 1
            return real(graph, *a, **k)
        torch.cuda.CUDAGraph.capture_begin = capture_begin

    def snapshot(self):
        return self.compiles, self.captures

    @contextlib.contextmanager
    def excluded(self):
        """Builds and captures inside are not counted (an engine's start-up, which reports its own)."""
        c, g, n = self.compiles, self.captures, len(self.names)
        try:
            yield
        finally:
            self.compiles, self.captures = c, g
            del self.names[n:]


def run_case(eng: E.Engine, batch: int, P: int, new: int, seed: int, after: E.Request | None = None) -> dict:
    """batch requests of P random tokens (after: one request, the next turn of that one's conversation: its prompt
    and answer, then P new tokens)."""
    g = torch.Generator().manual_seed(seed)
    reqs = [E.Request(torch.randint(11, 100000, (P,), generator=g).tolist(), new) for _ in range(batch)]
    if after is not None:
        reqs = [E.Request(after.ids + after.out + reqs[0].ids, new)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.run(reqs)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    t1 = max(r.t_first for r in reqs)
    n_dec = sum(len(r.out) - 1 for r in reqs)
    return {"ttft": t1 - t0, "decode_s": t2 - t1, "tok_s": n_dec / (t2 - t1) / batch, "agg": n_dec / (t2 - t1),
            "reqs": reqs}


def step_time(eng: E.Engine, reqs: list, b: int) -> float:
    """The bucket's decode graph replayed alone over the requests' slots as they ended (padded with other slots, not
    live), the lengths restored: the rate's ceiling at the context the requests reached."""
    g = eng.graphs[b][0]
    mine = [r.slot for r in reqs]
    slots = mine + [i for i in range(len(eng.slots)) if i not in mine][:b - len(mine)]
    g.inputs[0].copy_(torch.tensor(slots))
    g.inputs[1].copy_(torch.tensor([1] * len(mine) + [0] * (b - len(mine))))
    saved = eng.cache.lengths.clone()
    t = time_step(g.graph.replay if g.graph is not None else g, iters=20)
    eng.cache.lengths.copy_(saved)
    return t


@contextlib.contextmanager
def round_state_kept(eng: E.Engine):
    """The state a speculative round's graphs advance (cache and MTP lengths, next tokens, counts, drafts), put back
    after the block: replays for timing leave the engine as they found it."""
    state = (eng.cache.lengths, eng.next_tok, eng.count, eng.spec.drafts, *(c.lengths for c in eng.mtps))
    saved = [x.clone() for x in state]
    try:
        yield
    finally:
        for x, y in zip(state, saved):
            x.copy_(y)


def draft_table(eng: E.Engine, b: int, rows: int = 30) -> str:
    """Where the draft graph of bucket b spends its replay (bench_decode.replay_table)."""
    with round_state_kept(eng):
        return replay_table(eng.graphs[b][-1].graph.replay, rows)


def round_time(eng: E.Engine, b: int) -> tuple:
    """A speculative engine's round for bucket b, as step_time set its inputs -> (the verify, greedy accept and draft
    graphs replayed back to back, the accept graph alone, the draft graph alone) in seconds: what a step costs beyond
    its verify graph."""
    g_verify, g_greedy, *_, g_draft = eng.graphs[b]

    def timed(*graphs):
        with round_state_kept(eng):
            return time_step(lambda: [g.graph.replay() if g.graph is not None else g() for g in graphs], iters=20)
    return timed(g_verify, g_greedy, g_draft), timed(g_greedy), timed(g_draft)


# kernel families of a prefill, in model order: (family, substrings of the kernel names it takes); a name takes the
# first family that matches (the expert GEMMs before cuBLAS's "gemm")
FAMILIES = [
    ("norms + RoPE", ("_rms_norm", "_norm_rope")),
    ("expert GEMMs (fp8)", ("_grouped_wgmma", "_grouped_gemm")),
    ("projections (bf16 GEMMs)", ("_skinny_linear", "gemm", "nvjet", "cutlass", "xmma", "sm90_")),
    ("sliding attention", ("_banded_attn",)),
    ("DSA region summaries", ("_region_summary",)),
    ("DSA scores", ("_indexer_scores",)),
    ("DSA selection", ("_select_regions",)),
    ("DSA sparse attention", ("_sparse_attn", "_attn_merge", "_dense_prefix")),
    ("router", ("_router_",)),
    ("MoE quant / SwiGLU / combine", ("_act_quant", "_swiglu", "_moe_combine", "_moe_decode")),
    ("residual add + norm", ("_add_norm",)),
    ("torch: sort / scan / histogram", ("sort", "Sort", "scan", "Scan", "histc", "bincount", "cumsum")),
    ("torch: index / gather / scatter", ("index", "Index", "gather", "scatter")),
    ("torch: copies / cat / fill", ("copy", "Copy", "cat", "CatArray", "fill", "Fill")),
]


def family(name: str) -> str:
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "torch: other" if "at::" in name or "void " in name else "other"


def prefill_flops(m: M.Step5ForCausalLM, P: int) -> dict:
    """Useful FLOPs of one P-token prefill on this rank, by family: the dense projections' (bf16, every layer and the
    router, the last token's head), the routed experts' (fp8, the mean number of this rank's experts per token), and
    the attention's (queries x the keys each sees: min(window, p + 1) on sliding layers; on DSA layers the selected
    regions' tokens and the current region's, plus the indexer's scores over every history region)."""
    cfg = m.cfg
    p = torch.arange(P, dtype=torch.float64)
    H, hd = cfg.n_local_heads, cfg.head_dim
    dense = router = fp8 = sliding = dsa = scores = 0.0
    for i, layer in enumerate(m.model.layers[:cfg.num_hidden_layers]):
        a = layer.self_attn
        dense += 2 * P * (a.wpack.numel() + a.o_proj.weight.numel())
        for name, q in layer.named_parameters():
            if name == "moe.gate.weight":
                router += 2 * P * q.numel()
            elif q.dim() == 2 and not name.startswith("self_attn"):
                dense += 2 * P * q.numel()  # shared expert or dense MLP
        if layer.is_moe:
            per = sum(getattr(layer.moe, n).weight[0].numel() for n in ("gate_proj", "up_proj", "down_proj"))
            fp8 += 2 * P * per * cfg.moe_top_k * cfg.n_local_experts / cfg.moe_num_experts
        if a.dsa:
            sp = cfg.sparse
            keys = torch.clamp(p // sp.block, max=sp.topk) * sp.block + p % sp.block + 1
            dsa += float((4 * H * hd * keys).sum())
            scores += float((2 * a.n_groups * a.idx_heads * sp.proxy_dim * (p // sp.block)).sum())
        else:
            sliding += float((4 * H * hd * p.add(1).clamp(max=cfg.sliding_window)).sum())
    dense += 2 * m.lm_head.weight.numel()
    return {"projections (bf16 GEMMs)": (dense, BF16_FLOPS), "router": (router, BF16_FLOPS),
            "expert GEMMs (fp8)": (fp8, FP8_FLOPS), "sliding attention": (sliding, BF16_FLOPS),
            "DSA sparse attention": (dsa, BF16_FLOPS), "DSA scores": (scores, FP8_FLOPS)}


def prefill_profile(eng: E.Engine, P: int, seed: int) -> dict:
    """One request's prefill of P tokens (to its first token) under the profiler: device time per kernel name, the
    kernels' busy time (union of their intervals) and the wall time. Printed as a table by family."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator().manual_seed(seed)
    req = E.Request(torch.randint(11, 100000, (P,), generator=g).tolist(), 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        eng.run([req])
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    names, busy, end = {}, 0.0, float("-inf")
    for a, b, name in ks:
        n, t = names.get(name, (0, 0.0))
        names[name] = (n + 1, t + (b - a) / 1e6)
        busy += max(0.0, b - max(a, end)) / 1e6
        end = max(end, b)
    span = (ks[-1][1] - ks[0][0]) / 1e6 if ks else 0.0
    fams = {}
    for name, (n, t) in names.items():
        f = fams.setdefault(family(name), [0, 0.0])
        f[0] += n
        f[1] += t
    flops = prefill_flops(eng.model, P)
    print(f"prefill of {P} tokens (chunks of {eng.config.prefill_chunk}): {wall:.3f} s wall = {P / wall:.0f} tok/s; "
          f"kernels busy {busy:.3f} s over a span of {span:.3f} s (idle {wall - busy:.3f} s), {len(ks)} kernels")
    print(f"{'family':32s} {'kernels':>8s} {'s':>7s} {'% wall':>7s} {'TFLOP/s':>8s} {'of ceil':>7s}")
    for fam, (n, t) in sorted(fams.items(), key=lambda kv: -kv[1][1]):
        rate = ""
        if fam in flops and t > 0:
            f, ceil = flops[fam]
            rate = f"{f / t / 1e12:8.1f} {f / t / ceil:7.1%}"
        print(f"{fam:32s} {n:8d} {t:7.3f} {t / wall:7.1%} {rate}")
    print(f"{'idle (no kernel running)':32s} {'':8s} {wall - busy:7.3f} {(wall - busy) / wall:7.1%}", flush=True)
    return {"P": P, "wall_s": wall, "busy_s": busy, "kernels": names}


def main(cases: list, new: int, max_batch: int, max_context: int | None, prefill_chunk: int, profile: list,
         dump: str | None, build_threads: int | None, graph_prefill: int | None = None, turn: int = 0,
         speculative: int = 0, profile_round: bool = False):
    counters = Counters()
    t0 = time.perf_counter()
    m = build(mtp=speculative)
    torch.cuda.synchronize()
    print(f"built one TP=8 rank of random weights in {time.perf_counter() - t0:.0f} s "
          f"({torch.cuda.memory_allocated() / 2 ** 30:.1f} GiB)", flush=True)
    with torch.inference_mode():
        c0 = counters.snapshot()
        eng = E.Engine(m, E.EngineConfig(max_batch, max_context, prefill_chunk, build_threads=build_threads,
                                         graph_prefill=graph_prefill, speculative=speculative), print)
        t0 = time.perf_counter()
        eng.start()
        t_start = time.perf_counter() - t0
        c1 = counters.snapshot()
        t = eng.startup.timing
        print(f"start-up {t_start:.1f} s: built ahead {t['build_s']:.1f} s, warm-up {t['warmup_s']:.1f} s, capture "
              f"{t['capture_s']:.1f} s; {c1[0] - c0[0]} Triton kernel builds (compiled or from its disk cache), "
              f"{c1[1] - c0[1]} graph captures; max_context {eng.max_context}, peak "
              f"{torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB", flush=True)
        if speculative:
            print(f"with {speculative} drafts a step: step ms and ceiling are the verify step's ({speculative + 1} tokens "
                  "a row) at one token a step")
        print(f"{'batch':>5} {'prompt':>7} {'new':>4} | {'TTFT s':>7} {'decode tok/s':>12} {'(per req)':>9} | "
              f"{'step ms':>7} {'ceiling tok/s':>13} {'seen/ceil':>9} | compiles captures")
        for i, (b, P) in enumerate(cases):
            prev = None
            for P_, after in [(P, None)] + ([(turn, True)] if turn and b == 1 else []):
                c0 = counters.snapshot()
                r = run_case(eng, b, P_, new, seed=i, after=prev)
                c1 = counters.snapshot()
                prev = r["reqs"][0]
                bucket = next(x for x in eng.graphs if x >= b)
                st = step_time(eng, r["reqs"], bucket)
                if speculative:  # after step_time, which set the bucket's inputs
                    rt, at, dt = round_time(eng, bucket)
                    print(f"      round (verify + accept + draft graphs) {rt * 1e3:7.3f} ms = {rt / st:.3f}x the "
                          f"verify step (accept alone {at * 1e3:.3f} ms, draft alone {dt * 1e3:.3f} ms); decode as "
                          f"seen {r['agg'] / (b / rt):.1%} of the round", flush=True)
                    if profile_round and eng.graphs[bucket][-1].graph is not None:
                        print(draft_table(eng, bucket), flush=True)
                label = f"{b:5d} {P_:7d}" if after is None else f"{'turn':>5} {f'+{P_}':>7}"
                print(f"{label} {new:4d} | {r['ttft']:7.3f} {r['agg']:12.1f} {r['tok_s']:9.1f} | {st * 1e3:7.3f} "
                      f"{b / st:13.1f} {r['agg'] / (b / st):9.1%} | {c1[0] - c0[0]:8d} {c1[1] - c0[1]:8d}"
                      + (f"  compiled: {sorted(set(counters.names[c0[0]:]))}" if c1[0] > c0[0] else "")
                      + (f"  (cached {prev.cached})" if after else ""), flush=True)
        prof = []
        for i, P in enumerate(profile):
            c0 = counters.snapshot()
            prof.append(prefill_profile(eng, P, seed=100 + i))
            c1 = counters.snapshot()
            if c1 != c0:
                print(f"  (during the profiled prefill: {c1[0] - c0[0]} kernel builds, {c1[1] - c0[1]} captures)")
        if dump:
            with open(dump, "w") as f:
                json.dump(prof, f)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.bench_request", description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x1024,1x4096,1x32768,1x131072,16x1024,16x4096",
                    help="comma-separated BATCHxPROMPT cases")
    ap.add_argument("--new", type=int, default=256, help="new tokens per request")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=None, help="default: what fits")
    ap.add_argument("--prefill-chunk", type=int, default=E.PREFILL_CHUNK)
    ap.add_argument("--profile", type=int, nargs="*", default=[], metavar="P",
                    help="prefill profiles by kernel family of one request of P tokens each")
    ap.add_argument("--dump", help="write the profiles' per-kernel times to this JSON file")
    ap.add_argument("--build-threads", type=int, default=None, help="start-up's parallel kernel builds (0: off)")
    ap.add_argument("--graph-prefill", type=int, default=None, metavar="N",
                    help=f"fresh prompts of up to N tokens prefill as CUDA graphs (default {startup.GRAPH_PREFILL}; "
                    "0: eagerly)")
    ap.add_argument("--turn", type=int, default=0, metavar="N",
                    help="after each one-request case, its conversation's next turn of N new tokens (prefix reused)")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="K MTP drafts per step (random weights: drafts are almost never accepted, so the decode rate "
                    "is a speculative round's cost per token, the floor of what drafts gain)")
    ap.add_argument("--profile-round", action="store_true",
                    help="with --speculative: where the draft graph's replay goes, per kernel")
    ap.add_argument("--tune", action="append", default=[], metavar="KEY=VALUE",
                    help="set kernel.TUNING[KEY] (a Python literal) for the run, e.g. --tune "
                    "sparse_block_n=32; repeatable")
    a = ap.parse_args()
    try:
        kernel.set_tuning(a.tune)
    except ValueError as e:
        raise SystemExit(str(e))
    main([tuple(map(int, c.split("x"))) for c in a.cases.split(",") if c], a.new, a.max_batch, a.max_context,
         a.prefill_chunk, a.profile, a.dump, a.build_threads, a.graph_prefill, a.turn, a.speculative,
         a.profile_round)
