"""The prefix store (prefix_cache.py) as a user sees it: time to first token through the engine's request path, on one
GPU holding one whole TP=EP=8 rank of random FP8 weights (tools.rank's build), start-up included and reported.

Case 1, one conversation: a request of a P-token prefix and R new tokens with nothing cached (its prefill stores the
prefix), then an unrelated request (so its slot no longer holds the prefix), then a request of the same prefix and
another R tokens (the store's copy: the prefix's regions and windows, then R tokens of prefill), and R tokens alone.
The issue's target: the hit within 2x of R tokens alone. Beside it the fresh request on an engine without a store
(--no-prefix-cache), which is what the store's writes cost it.

Case 2, A agents arriving together with one S-token system prompt and R tokens each: every first token's time and
the last one's, with the store (the first agent's prefill computes the prompt, the others copy it) and without.

Triton builds and CUDA graph captures during the requests are counted (the engine's promise: none).

    python -m tools.bench_prefix_cache                        # 8k + 100; 16 agents x 4k (an H200)
    python -m tools.bench_prefix_cache --prefix 2048 --agents 0 --prefix-cache-gib 0.25 --prefill-chunk 4096  # H100
    python -m tools.bench_prefix_cache --prefix 32768 --agents 0
    python -m tools.bench_prefix_cache --tiny                 # the tiny checkpoint on the CPU (tests run this)
"""
import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from dataclasses import dataclass, replace

import torch

import engine as E


def tiny_model():
    """The tiny BF16 text checkpoint, converted to TP=1 in a temporary directory and loaded on the CPU."""
    import config
    import convert
    import model as M
    import tiny_checkpoint
    d = tempfile.mkdtemp(prefix="bench_prefix_cache_")
    convert.main(tiny_checkpoint.make_checkpoint(f"{d}/ckpt", fp8=False, vl=False, seed=1), f"{d}/out", tp_size=1,
                 ep_size=1)
    cfg = config.load_config(f"{d}/out/tp1/config-r0.json")[0]
    return M.Step5ForCausalLM.from_shard(f"{d}/out/tp1/model-r0.safetensors", cfg)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def tokens(n: int, seed: int, vocab: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(11, vocab, (n,), generator=g).tolist()


def ttft(eng: E.Engine, reqs: list) -> list:
    """Run the requests (submitted together) -> each one's seconds to its first token."""
    sync(eng.dev)
    t0 = time.perf_counter()
    eng.run(reqs)
    sync(eng.dev)
    return [r.t_first - t0 for r in reqs]


@dataclass(frozen=True)
class Setup:
    """The engines' flags: the store's budget in GiB (None: the default; 0: none), the least tokens a copy takes,
    the prefill chunk and the start-up's build threads (None: the engine's default)."""
    gib: float | None
    least: int
    chunk: int = E.PREFILL_CHUNK
    threads: int | None = None


def make(m, max_batch: int, context: int, setup: Setup, say, counters=None) -> tuple:
    """An engine started -> (engine, start-up seconds); its start-up's builds and captures are not counted."""
    eng = E.Engine(m, E.EngineConfig(max_batch, context, setup.chunk, build_threads=setup.threads,
                                     prefix_cache_gib=setup.gib, prefix_cache_min=setup.least), say)
    t0 = time.perf_counter()
    with counters.excluded() if counters else contextlib.nullcontext():
        eng.start()
    return eng, time.perf_counter() - t0


def copy_time(eng, prefix: list, P: int) -> tuple | None:
    """The stored prefix copied into slot 0, alone: (seconds a copy, positions copied), or None if it is not stored."""
    hit = eng.store.lookup(prefix + [0], None, P)
    if hit is None:
        return None
    eng.store.load(0, hit)
    sync(eng.dev)
    t0 = time.perf_counter()
    for _ in range(10):
        eng.store.load(0, hit)
    sync(eng.dev)
    return (time.perf_counter() - t0) / 10, hit.n


def one_conversation(m, P: int, R: int, new: int, reps: int, setup: Setup, say, counters=None) -> dict:
    V = m.cfg.vocab_size
    out = {}
    for label, s in (("store", setup), ("none", replace(setup, gib=0))):
        eng, t_start = make(m, 1, P + R + new + 64, s, say, counters)
        say(f"{label}: start-up {t_start:.1f} s")
        rows = {"fresh": [], "hit": [], "alone": [], "cached": []}
        copy = None
        for i in range(reps):
            prefix = tokens(P, 1000 + i, V)
            rows["fresh"] += ttft(eng, [E.Request(prefix + tokens(R, 2000 + i, V), new)])
            if label == "store":
                ttft(eng, [E.Request(tokens(R, 3000 + i, V), 1)])  # the slot forgets the prefix
                hit = E.Request(prefix + tokens(R, 4000 + i, V), new)
                rows["hit"] += ttft(eng, [hit])
                rows["cached"].append(hit.cached)
                if i == reps - 1:  # the copy alone, timed while the prefix is still stored (a small store evicts)
                    copy = copy_time(eng, prefix, P)
            rows["alone"] += ttft(eng, [E.Request(tokens(R, 5000 + i, V), new)])
        out[label] = {k: statistics.median(v) for k, v in rows.items() if v}
        if label == "store":
            out[label]["stats"] = dict(eng.store.stats)
            if copy is not None:
                out[label]["copy"], out[label]["copy_n"] = copy
        del eng
        release(m)
    return out


def agents(m, A: int, S: int, R: int, new: int, setup: Setup, say, counters=None) -> dict:
    V = m.cfg.vocab_size
    system = tokens(S, 7, V)
    out = {}
    for label, s in (("store", setup), ("none", replace(setup, gib=0))):
        eng, _ = make(m, A, S + R + new + 64, s, say, counters)
        ttft(eng, [E.Request(tokens(S + R, 8, V), 1)])  # one request first: its kernels' first launches
        reqs = [E.Request(system + tokens(R, 100 + a, V), new) for a in range(A)]
        t = ttft(eng, reqs)
        out[label] = {"mean": statistics.mean(t), "last": max(t), "prefilled": eng.prefill_tokens,
                      "cached": sum(r.cached for r in reqs)}
        del eng
        release(m)
    return out


def release(m):
    """A finished engine's device memory back before the next one plans: its graphs and buffers sit in reference
    cycles, so collect them, then return the cached blocks."""
    gc.collect()
    if m.lm_head.weight.is_cuda:
        torch.cuda.empty_cache()


def main(tiny: bool, prefix: int, rest: int, new: int, reps: int, n_agents: int, system: int, setup: Setup):
    counters = None
    t0 = time.perf_counter()
    if tiny:
        m = tiny_model()
    else:
        from tools.bench_request import Counters
        from tools.rank import build
        counters = Counters()
        m = build()
        torch.cuda.synchronize()
    print(f"model ready in {time.perf_counter() - t0:.0f} s", flush=True)
    with torch.inference_mode():
        c0 = counters.snapshot() if counters else None
        r = one_conversation(m, prefix, rest, new, reps, setup, print, counters)
        s, n = r["store"], r["none"]
        print(f"TTFT, median of {reps} (prefix {prefix} + {rest} new tokens, {new} generated):")
        print(f"  nothing cached, with the store (its prefill stores the prefix): {s['fresh']:.4f} s")
        print(f"  nothing cached, no store:                                      {n['fresh']:.4f} s")
        print(f"  the prefix copied from the store (cached {s['cached']:.0f}):              {s['hit']:.4f} s")
        print(f"  {rest} tokens alone:                                               {s['alone']:.4f} s")
        print(f"  hit / alone {s['hit'] / s['alone']:.2f}x (target <= 2x); fresh / hit {n['fresh'] / s['hit']:.1f}x; "
              f"the store's cost on a fresh prompt {s['fresh'] / n['fresh'] - 1:+.1%}; store {s['stats']}", flush=True)
        if "copy" in s:
            per_token = (n["fresh"] - n["alone"]) / prefix
            print(f"  the copy alone: {s['copy_n']} positions in {s['copy'] * 1e3:.2f} ms; a prefill token costs "
                  f"{per_token * 1e6:.1f} us here ((fresh - alone) / prefix): break-even at "
                  f"{s['copy'] / max(per_token, 1e-12):.0f} tokens (engine.PREFIX_MIN {E.PREFIX_MIN})", flush=True)
        if n_agents:
            a = agents(m, n_agents, system, rest, new, setup, print, counters)
            for label in ("store", "none"):
                x = a[label]
                print(f"{n_agents} agents, one {system}-token system prompt + {rest} tokens each, {label:5s}: mean "
                      f"TTFT {x['mean']:.4f} s, last {x['last']:.4f} s; {x['prefilled']} tokens prefilled, "
                      f"{x['cached']} cached")
            print(f"  aggregate (last first token) without / with the store: "
                  f"{a['none']['last'] / a['store']['last']:.2f}x", flush=True)
        if counters:
            c1 = counters.snapshot()
            print(f"during the requests: {c1[0] - c0[0]} Triton kernel builds, {c1[1] - c0[1]} graph captures "
                  "(start-ups excluded: each engine's start counts its own)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.bench_prefix_cache", description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoint on the CPU at small shapes")
    ap.add_argument("--prefix", type=int, default=None, help="shared prefix tokens (default 8192; --tiny 64)")
    ap.add_argument("--rest", type=int, default=None, help="new prompt tokens after it (default 100; --tiny 8)")
    ap.add_argument("--new", type=int, default=None, help="tokens generated per request (default 8; --tiny 2)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--agents", type=int, default=None, help="agents arriving together (default 16; --tiny 4; 0: "
                    "skip)")
    ap.add_argument("--system", type=int, default=None, help="their shared system prompt's tokens (default 4096; "
                    "--tiny 32)")
    ap.add_argument("--prefix-cache-gib", type=float, default=None,
                    help="the store's budget (default 1 GiB: ~29k positions and ~18 windows of a whole rank; --tiny "
                    "0.01)")
    ap.add_argument("--prefix-cache-min", type=int, default=None,
                    help=f"copy at least this many tokens (default {E.PREFIX_MIN}; --tiny 0)")
    ap.add_argument("--prefill-chunk", type=int, default=E.PREFILL_CHUNK, help="the engines' prefill chunk (an H100 "
                    "holding a whole rank: 4096)")
    ap.add_argument("--build-threads", type=int, default=None, help="start-up's build threads")
    a = ap.parse_args()
    small = a.tiny
    setup = Setup(a.prefix_cache_gib if a.prefix_cache_gib is not None else 0.01 if small else 1.0,
                  a.prefix_cache_min if a.prefix_cache_min is not None else 0 if small else E.PREFIX_MIN,
                  a.prefill_chunk, a.build_threads)
    main(a.tiny, a.prefix or (64 if small else 8192), a.rest or (8 if small else 100), a.new or (2 if small else 8),
         a.reps, a.agents if a.agents is not None else (4 if small else 16), a.system or (32 if small else 4096), setup)
