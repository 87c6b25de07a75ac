"""What a user sees: requests through the engine (engine.py) on one GPU holding one whole TP=EP=8 rank of random FP8
weights (92 layers; bench_decode.py's builder), start-up included.

Per engine: the start-up (warm-up, i.e. Triton compilation, and CUDA graph capture, timed separately), then
requests of P prompt tokens and N new tokens at batch B: time to first token, decode tokens/s as the host saw them
(first token to last), and the Triton compilations and CUDA graph captures that happened during the requests
(the engine's promise: none). The replayed step's rate beside it (the same engine's bucket graph, timed alone)
is what the decode rate rests on. Run it twice with the same TRITON_CACHE_DIR for a cold and a warm start.

    TRITON_CACHE_DIR=$(mktemp -d) python bench_request.py                 # cold start, then the request table
    python bench_request.py --cases 1x1024,1x4096,1x32768,1x131072,16x1024,16x4096 --new 256
    python bench_request.py --max-context 8192 --cases 1x4096           # the same request on a small cache
"""
import argparse
import time

import torch

import engine as E
import model as M
from bench_decode import randomise, real_rank_config, time_step


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


def build(seed: int = 0) -> M.Step5ForCausalLM:
    cfg = real_rank_config(8)
    with torch.device("meta"):
        m = M.Step5ForCausalLM(cfg, set(cfg.moe_layers), 0)
    randomise(m, seed=seed)
    m.finalize()
    M.set_parallel(1, 0)  # one GPU holds one rank's shapes; the sums are of one partial
    return m


def run_case(eng: E.Engine, batch: int, P: int, new: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    reqs = [E.Request(torch.randint(11, 100000, (P,), generator=g).tolist(), new) for _ in range(batch)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.run(reqs)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    t1 = max(r.t_first for r in reqs)
    n_dec = sum(len(r.out) - 1 for r in reqs)
    return {"ttft": t1 - t0, "decode_s": t2 - t1, "tok_s": n_dec / (t2 - t1) / batch, "agg": n_dec / (t2 - t1)}


def step_time(eng: E.Engine, b: int) -> float:
    """The bucket's decode graph replayed alone (slots 0..b-1, the lengths restored): the rate's ceiling."""
    g = eng.graphs[b][0]
    g.inputs[0].copy_(torch.arange(b))
    g.inputs[1].fill_(1)
    saved = eng.cache.lengths.clone()
    t = time_step(g.graph.replay if g.graph is not None else g, iters=20)
    eng.cache.lengths.copy_(saved)
    return t


def main(cases: list, new: int, max_batch: int, max_context: int | None, prefill_chunk: int):
    counters = Counters()
    t0 = time.perf_counter()
    m = build()
    torch.cuda.synchronize()
    print(f"built one TP=8 rank of random weights in {time.perf_counter() - t0:.0f} s "
          f"({torch.cuda.memory_allocated() / 2 ** 30:.1f} GiB)", flush=True)
    with torch.inference_mode():
        c0 = counters.snapshot()
        eng = E.Engine(m, E.EngineConfig(max_batch, max_context, prefill_chunk), print)
        t0 = time.perf_counter()
        eng.start()
        t_start = time.perf_counter() - t0
        c1 = counters.snapshot()
        print(f"start-up {t_start:.1f} s: warm-up {eng.timing['warmup_s']:.1f} s, capture {eng.timing['capture_s']:.1f}"
              f" s; {c1[0] - c0[0]} Triton kernel builds (compiled or from its disk cache), {c1[1] - c0[1]} graph "
              f"captures; max_context {eng.max_context}, peak {torch.cuda.max_memory_allocated() / 2 ** 30:.1f} GiB", flush=True)
        print(f"{'batch':>5} {'prompt':>7} {'new':>4} | {'TTFT s':>7} {'decode tok/s':>12} {'(per req)':>9} | "
              f"{'step ms':>7} {'ceiling tok/s':>13} {'seen/ceil':>9} | compiles captures")
        for i, (b, P) in enumerate(cases):
            c0 = counters.snapshot()
            r = run_case(eng, b, P, new, seed=i)
            c1 = counters.snapshot()
            bucket = next(x for x in eng.graphs if x >= b)
            st = step_time(eng, bucket)
            print(f"{b:5d} {P:7d} {new:4d} | {r['ttft']:7.3f} {r['agg']:12.1f} {r['tok_s']:9.1f} | {st * 1e3:7.3f} "
                  f"{b / st:13.1f} {r['agg'] / (b / st):9.1%} | {c1[0] - c0[0]:8d} {c1[1] - c0[1]:8d}"
                  + (f"  compiled: {sorted(set(counters.names[c0[0]:]))}" if c1[0] > c0[0] else ""), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="1x1024,1x4096,1x32768,1x131072,16x1024,16x4096",
                    help="comma-separated BATCHxPROMPT cases")
    ap.add_argument("--new", type=int, default=256, help="new tokens per request")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-context", type=int, default=None, help="default: what fits")
    ap.add_argument("--prefill-chunk", type=int, default=E.PREFILL_CHUNK)
    a = ap.parse_args()
    main([tuple(map(int, c.split("x"))) for c in a.cases.split(",")], a.new, a.max_batch, a.max_context,
         a.prefill_chunk)
