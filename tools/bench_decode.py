"""Decode-step benchmark of real-geometry Step-5 on one GPU, as one TP=EP=8 rank holds it (random weights).

Default: a sliding-window MoE layer and a DSA MoE layer with the real shapes of one rank (8 query heads, 1 KV group,
44 FP8 experts, indexer 4 heads x 256), a KV cache of CONTEXT tokens, one decode step per layer (eager, then
replayed as a CUDA graph), the kernels of one step (profiler), and the 92-layer step projected from the two.
--whole-rank: the whole rank instead (92 layers, final norm, lm_head window, argmax; ~75 GB of FP8 experts), one
decode step replayed as a CUDA graph and measured, not projected. Both print the ratio to the HBM floor of the
bytes one step must read. --profile: the device time of each kernel of one eager step, and with --whole-rank also
each kernel's share of the replayed graph (replay_table: how far each kernel moved the end of the work done).
Under `torchrun --nproc-per-node=W`, --whole-rank also times the step with the real TP reductions between W GPUs
(--one-shot: also with the opt-in model.OneShotReduce). --tokens-per-row Q (both modes): a step of Q tokens per
row against a 1-token step (--whole-rank: several Q, each timed in turn, as a next turn's extension steps of 64 or
128). --candidates [KEY ...] (with --whole-rank): the step with each of kernel.TUNING's launch choices (or only the
KEYs) set to each of its alternatives (ALTERNATIVES; TOGETHER: several keys at once), against
the defaults timed just before and after it; --tune KEY=VALUE changes a default for the whole run (e.g. --tune
"moe_stages=((3, 3), (3, 3))").

From the repository root (torchrun takes a module with -m, as python does):

    python -m tools.bench_decode [--batch 1 16 32] [--context 4096] [--whole-rank [--candidates]] [--torch-ref]
                                 [--profile]
    python -m tools.bench_decode --whole-rank --tune "moe_stages=((4, 4), (4, 3))" --tune "moe_unroll=((4, 4), (1, 1))"
    python -m tools.bench_decode [--whole-rank] --tokens-per-row 4    # a speculative verify step (3 drafts)
    python -m tools.bench_decode --whole-rank --tokens-per-row 64 128    # a turn's extension steps on one slot
    torchrun --standalone --nproc-per-node=2 -m tools.bench_decode --whole-rank [--one-shot]
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

import kernel
import config
import model as M
from sampling import greedy
from startup import Graph
from tools.rank import HBM_BPS, kernel_table, profiled, randomise, real_rank_config, time_step

# the other values of kernel.TUNING's launch choices, each measured and not taken (PERF_LOG.md: "kernel.TUNING, key
# by key"); --candidates re-times the step with each
ALTERNATIVES = {"sliding_warps": [(4, 4), (8, 8)], "sparse_block_n": [32], "router_block_e": [64], "router_parts": [1],
                "moe_block_n": [((32, 64), (32, 64)), ((32, 64), (64, 64)), ((32, 64), (32, 128))],
                "moe_stages": [((4, 4), (4, 3)), ((6, 6), (4, 3)), ((4, 3), (4, 3)), ((3, 2), (4, 3)),
                               ((3, 3), (3, 3)), ((3, 3), (4, 4))],
                "moe_unroll": [((4, 4), (1, 1)), ((8, 1), (1, 1)), ((4, 2), (1, 1))],
                "moe_maxnreg": [((0, 0), (0, 0)), ((0, 0), (168, 168)), ((0, 0), (128, 0))],
                "moe_tma": [((False, False), (False, False)), ((False, False), (True, True)),
                            ((True, True), (True, True))],
                "moe_early_down": [(False, False), (True, True)], "shared_parts": [(4, 4), (8, 8)],
                "skinny_tiles": [((16, 512), (8, 256)), ((32, 256), (8, 256))], "skinny_stages": [4],
                "skinny_parts": [1, 2, 8], "skinny_warps": [8]}
# several keys at once: name -> the TUNING entries they set together
TOGETHER = {"moe_down_3cta": {"moe_maxnreg": ((0, 0), (168, 168)), "moe_stages": ((3, 3), (3, 2))}}


def fill_cache(cache: M.Cache, context: int):
    """A context of `context` tokens of random keys, values and region summaries in every layer's cache."""
    for lc in cache.layers:
        lc.k.normal_()
        lc.v.normal_()
        if hasattr(lc, "summ"):
            lc.summ.copy_(torch.randn(lc.summ.shape, device="cuda").clamp(-4, 4).to(kernel.FP8).view(torch.uint8))
    cache.lengths.fill_(context)


def count_kernels(fn) -> int:
    """Device activities of one eager call: the nodes a CUDA graph of it replays."""
    return sum(1 for e in profiled(fn).events() if e.device_type == torch.autograd.DeviceType.CUDA)


def replay_table(replay, rows: int, reps: int = 3) -> str:
    """Where a replayed graph's time goes: per kernel name, the time by which each of its kernels moved the end of
    the work done so far (its end minus the latest end before it, >= 0), summed over `reps` replays and divided by
    reps. With PDL a kernel starts (and waits) inside its predecessor, so its own duration overstates it; these
    shares add up to the step (gaps included: a launch gap counts for the kernel after it)."""
    torch.cuda.synchronize()
    p = profiled(lambda: [replay() for _ in range(reps)])
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in p.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    share, count, end = {}, {}, ks[0][0]
    for t0, t1, name in ks:
        share[name] = share.get(name, 0.0) + max(t1 - end, 0.0)
        count[name] = count.get(name, 0) + 1
        end = max(end, t1)
    total = sum(share.values())
    lines = [f"graph replay, {len(ks) / reps:.0f} kernels, {total / reps:.1f} us per step (profiler clock):",
             f"{'share us':>9s} {'%':>6s} {'n':>5s}  kernel"]
    for name in sorted(share, key=share.get, reverse=True)[:rows]:
        lines.append(f"{share[name] / reps:9.1f} {share[name] / total:6.1%} {count[name] // reps:5d}  {name[:90]}")
    return "\n".join(lines)


def weight_bytes(mod: torch.nn.Module, batch: int, cfg: config.Step5Config) -> int:
    """Weight bytes one decode step of mod (a block or the whole model) must read: every non-expert weight once
    (not the embedding table: a step reads `batch` rows of it), and of each MoE layer the experts the batch routes
    to (the expected number of distinct local experts for batch*top_k uniform picks, one byte per e4m3 weight)."""
    E, k = cfg.moe_num_experts, cfg.moe_top_k
    hit = cfg.n_local_experts * (1 - (1 - 1 / E) ** (batch * k))
    total = 0
    for name, p in mod.named_parameters():
        if "embed_tokens" in name:
            total += batch * p.shape[1] * p.element_size()
        n = f".{name}"
        if not any(s in n for s in ("embed_tokens", ".moe.gate_proj.", ".moe.up_proj.", ".moe.down_proj.")):
            total += p.numel() * p.element_size()
    for sub in mod.modules():
        if isinstance(sub, M.Attention):  # the packed projection finalize() built (not a parameter)
            total += sub.wpack.numel() * sub.wpack.element_size()
        if isinstance(sub, M.MoE):
            total += int(hit * sum(getattr(sub, n).weight[0].numel() for n in ("gate_proj", "up_proj", "down_proj")))
    return total


def captured(fn, *inputs, state=lambda: ()) -> Graph:
    """fn(*inputs) captured as a CUDA graph: the engine's own graph object (startup.Graph), replayed by
    .graph.replay."""
    g = Graph(fn, list(inputs), True, state=state)
    with torch.inference_mode():
        g.capture()
    return g


def bench_layers(cfg, batch: int, context: int, profile: bool, q: int = 1):
    """One sliding and one DSA MoE layer: per-layer eager and graph times, kernels per layer, the projected step.
    q > 1: decode steps of q tokens per row (a speculative verify step), also timed at q = 1 for the ratio."""
    results = {}
    for kind, layer_id in (("sliding", 4), ("dsa", 7)):
        with torch.device("meta"):
            block = M.Block(cfg, layer_id, fp8=True)
        randomise(block)
        block.self_attn.finalize()
        cap = -(-(context + 64) // 16) * 16
        rope = M.rope_tables(cfg, cap, "cuda")[layer_id]
        cache = M.Cache([block.self_attn.new_cache(batch, cap, "cuda", slack=q - 1)], batch, cap, "cuda")
        fill_cache(cache, context)
        lc = cache.layers[0]
        pos = (context + torch.arange(q, device="cuda")).repeat(batch)  # [batch * q], row-major
        rows = torch.arange(batch, device="cuda")
        at, at_one = M.Placement(pos, rows=rows, Q=q), M.Placement(pos[::q].contiguous(), rows=rows)
        res = torch.randn(batch * q, cfg.hidden_size, device="cuda")

        def step():
            with torch.inference_mode():
                return block(res, at, rope, lc)

        if q > 1:  # the same layer and cache at one token per row, for the verify/decode ratio
            one = captured(lambda r: block(r, at_one, rope, lc), res[::q].contiguous())
            t_one = time_step(one.graph.replay)
        eager = time_step(step)
        kernels = count_kernels(step)
        if profile:
            print(kernel_table(step, 25))
        graph_t = None
        try:  # the decode loop's own graph object (startup.Graph), replayed alone
            graph_t = time_step(captured(lambda r: block(r, at, rope, lc), res).graph.replay)
        except Exception as e:  # report, do not hide: a capture failure means a host sync crept into decode
            print(f"{kind}: CUDA graph capture failed: {type(e).__name__}: {str(e)[:200]}")
        nbytes = weight_bytes(block, batch, cfg) + kv_bytes(cfg, kind, batch, context)
        results[kind] = (eager, graph_t, nbytes)
        if q > 1 and graph_t:
            print(f"{kind:8s} layer: {q} tokens per row {graph_t * 1e6:8.1f} us vs 1 token {t_one * 1e6:8.1f} us "
                  f"(graphs): ratio {graph_t / t_one:.2f}")
        best = graph_t or eager
        print(f"{kind:8s} layer: {kernels:3d} kernels | eager {eager * 1e6:8.1f} us | graph "
              + (f"{graph_t * 1e6:8.1f} us" if graph_t else "   n/a    ")
              + f" | {nbytes / 1e6:6.1f} MB -> floor {nbytes / HBM_BPS * 1e6:6.1f} us | "
              f"{nbytes / best / 1e9:7.1f} GB/s = {nbytes / best / HBM_BPS:5.1%} of HBM")
        block = cache = lc = None  # free this layer before building the next
        torch.cuda.empty_cache()
    n_dsa = sum(cfg.is_dsa(i) for i in range(cfg.num_hidden_layers))
    n_sl = cfg.num_hidden_layers - n_dsa
    step_t = n_sl * (results["sliding"][1] or results["sliding"][0]) + n_dsa * (results["dsa"][1] or results["dsa"][0])
    floor = (n_sl * results["sliding"][2] + n_dsa * results["dsa"][2]) / HBM_BPS
    return step_t, floor


def timed_around(timed, trials: dict, tuning: dict) -> dict:
    """name -> (candidate seconds, defaults seconds) for each trial (a dict of tuning changes), or name -> the
    exception its timing raised. The defaults are timed just before and just after each candidate and averaged:
    timed once before all of them, the defaults looked ~2% slower than every candidate (on the H200, a candidate
    equal to the old default included; PERF_LOG "kernel.TUNING, key by key"), so a drift within the process cancels.
    tuning is restored after each."""
    default, out = dict(tuning), {}
    for name, tune in trials.items():
        before = timed()
        tuning.update(tune)
        try:
            t = timed()
        except Exception as e:  # one failing candidate (a capture or compile error) must not end the run
            out[name] = e
            continue
        finally:
            tuning.update(default)
        out[name] = t, (before + timed()) / 2
    return out


def kv_bytes(cfg, kind: str, batch: int, context: int) -> int:
    """Cache bytes one decode step of a layer reads: the window (sliding) or the selected regions plus the summaries
    (DSA), keys and values of one KV group of head_dim bf16."""
    row = 2 * cfg.head_dim * 2 * cfg.n_local_groups
    if kind == "dsa":
        sel = min(cfg.sparse.topk + 1, context // cfg.sparse.block + 1) * cfg.sparse.block
        return batch * (sel * row + (context // cfg.sparse.block) * cfg.sparse.proxy_dim)
    return batch * min(context, cfg.sliding_window) * row


def bench_rank(cfg, batches: list, context: int, profile: bool, qs: tuple = (1,), one_shot: bool = False,
               capacity: int = 0, candidates: "bool | list" = False):
    """The whole rank: embed, 92 layers, final norm, lm_head window, argmax; one decode step as a CUDA graph at each
    batch size of `batches` (the weights built once, a cache per batch); returns [(batch, step seconds, floor)].
    Under torchrun (one process per GPU, NCCL) the step includes the real TP reductions between the GPUs (each GPU
    holds one TP=8 rank's shapes; the sums are of W partials instead of 8), timed with and without them.
    qs: also a step of q tokens per row for each q > 1 of them (a speculative verify step, a turn's extension step)
    and its ratio to the 1-token step; the rings get the slack of the largest.
    candidates: the step again with each of kernel.TUNING's launch choices (True) or of those named (a list) set to
    each of its ALTERNATIVES."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(rank)
    say = print if rank == 0 else (lambda *a, **k: None)
    with torch.device("meta"):  # before the process group: the model checks a group's size against tp_size
        m = M.Step5ForCausalLM(cfg, set(cfg.moe_layers), 0)
    if world > 1:
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    t0 = time.perf_counter()
    randomise(m, seed=rank)
    m.finalize()
    say(f"built the weights in {time.perf_counter() - t0:.0f} s")
    results, q = [], max(qs)  # the rings' slack and the timed replays' room: the largest step's
    for batch in batches:
        t0 = time.perf_counter()
        spare = 24 * q + 8  # positions the timed replays advance (21 replays of q tokens), plus slack
        cache = m.new_cache(batch, max(capacity, context + spare), slack=q - 1)
        fill_cache(cache, context)
        torch.cuda.synchronize()
        say(f"batch {batch}: the cache filled in {time.perf_counter() - t0:.0f} s: "
            f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB (weights and a {batch} x {cache.cap} cache)")
        ids = torch.zeros(batch, dtype=torch.long, device="cuda")

        def step(x):  # x [B] or [B, q] -> argmax of every row
            with torch.inference_mode():
                return greedy(m(x, cache).view(-1, m.lm_head.weight.shape[0]))

        def timed_graph(ws, x=ids):
            M.set_parallel(ws, rank if ws > 1 else 0)
            replay = captured(step, x, state=lambda: (cache.lengths,))
            cache.lengths.fill_(context)
            if ws > 1:
                dist.barrier()
            t = time_step(replay.graph.replay, iters=20)  # 21 replays: the context grows by 21 steps of `spare`
            cache.lengths.fill_(context)
            return t

        M.set_parallel(1, 0)
        eager = time_step(lambda: step(ids), iters=3)
        cache.lengths.fill_(context)
        kernels = count_kernels(lambda: step(ids))
        cache.lengths.fill_(context)
        if profile:
            say(kernel_table(lambda: step(ids), 30))
            cache.lengths.fill_(context)
        graph_t = timed_graph(1)
        if profile:
            say(replay_table(captured(step, ids, state=lambda: (cache.lengths,)).graph.replay, 40))
            cache.lengths.fill_(context)
        nbytes = weight_bytes(m, batch, cfg) + sum(kv_bytes(cfg, "dsa" if cfg.is_dsa(i) else "sliding", batch, context)
                                                   for i in range(cfg.num_hidden_layers))
        say(f"whole rank: {kernels} kernels per step ({kernels / cfg.num_hidden_layers:.1f} per layer) | eager "
            f"{eager * 1e3:8.2f} ms | graph {graph_t * 1e3:7.3f} ms | {nbytes / 1e9:5.2f} GB -> floor "
            f"{nbytes / HBM_BPS * 1e3:5.2f} ms | {nbytes / graph_t / 1e9:7.1f} GB/s = "
            f"{nbytes / graph_t / HBM_BPS:5.1%} of HBM")
        if candidates:  # graphs re-captured under each choice
            trials = {f"{k}={v}": {k: v} for k, vs in ALTERNATIVES.items() for v in vs
                      if candidates is True or k in candidates}
            trials.update({k: v for k, v in TOGETHER.items() if candidates is True or k in candidates})
            for name, r in timed_around(lambda: timed_graph(1), trials, kernel.TUNING).items():
                if isinstance(r, Exception):
                    say(f"candidate {name:18s}: {type(r).__name__}: {str(r)[:200]}")
                else:
                    say(f"candidate {name:18s}: graph {r[0] * 1e3:7.3f} ms ({r[0] / r[1] - 1:+6.1%} vs the defaults "
                        f"timed around it: {r[1] * 1e3:7.3f} ms)")
        for n in sorted(set(qs) - {1}):
            t_n = timed_graph(1, torch.zeros(batch, n, dtype=torch.long, device="cuda"))
            say(f"step of {n} tokens per row: {t_n * 1e3:7.3f} ms = {t_n / graph_t:.2f}x the 1-token step")
        if world > 1:
            with_tp = timed_graph(world)
            say(f"with the TP reductions between {world} GPUs (2 per layer + the logits gather): "
                f"{with_tp * 1e3:7.3f} ms; reductions {(with_tp - graph_t) * 1e3:.3f} ms = "
                f"{(with_tp - graph_t) / with_tp:.1%} of the step, "
                f"{(with_tp - graph_t) / (2 * cfg.num_hidden_layers + 1) * 1e6:.1f} us per reduction")
            if one_shot:  # the opt-in M.OneShotReduce for the layers' reductions (the logits still gather)
                M.set_one_shot(batch * q, cfg.hidden_size, torch.device("cuda", rank))
                t_os = timed_graph(world)
                M.set_one_shot(0)
                say(f"same with the one-shot reduction (kernel.peer_add_norm_triton): {t_os * 1e3:7.3f} ms; "
                    f"reductions {(t_os - graph_t) * 1e3:.3f} ms, "
                    f"{(t_os - graph_t) / (2 * cfg.num_hidden_layers + 1) * 1e6:.1f} us per reduction")
                with_tp = min(with_tp, t_os)
            graph_t = with_tp
        results.append((batch, graph_t, nbytes / HBM_BPS))
        del cache, ids
        torch.cuda.empty_cache()
    if world > 1:
        dist.destroy_process_group()
    return results


def main(batches: list, context: int, torch_ref: bool, profile: bool = False, whole_rank: bool = False,
         qs: tuple = (1,), one_shot: bool = False, candidates: "bool | list" = False, capacity: int = 0):
    torch.manual_seed(0)
    cfg = real_rank_config()
    M.set_parallel(1, 0)  # one rank's shapes; the TP collectives are not part of this measurement
    kernel.set_backend(not torch_ref)  # Triton for CUDA tensors unless the reference is asked for
    if whole_rank:
        results = bench_rank(cfg, batches, context, profile, qs, one_shot, capacity, candidates)
    else:
        results = [(b, *bench_layers(cfg, b, context, profile, max(qs))) for b in batches]
    what = "measured" if whole_rank else "projected from the two layers"
    world = int(os.environ.get("WORLD_SIZE", "1")) if whole_rank else 1
    if int(os.environ.get("RANK", "0")) == 0:
        for batch, step_t, floor in results:
            print(f"decode step {what}, 92 MoE-shaped layers, batch {batch}, context {context}, "
                  f"{'torch reference' if torch_ref else 'Triton kernels'}: "
                  f"{step_t * 1e3:.2f} ms, {batch / step_t:,.0f} tokens/s "
                  f"(HBM floor {floor * 1e3:.2f} ms, ratio {floor / step_t:.1%}); "
                  + (f"TP reductions between {world} GPUs included" if world > 1 else "collectives excluded"))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.bench_decode", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1],
                    help="batch sizes, each timed in turn (--whole-rank: the weights built once)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--torch-ref", action="store_true", help="time the PyTorch reference path instead of Triton")
    ap.add_argument("--profile", action="store_true", help="print the device time of each kernel of one step")
    ap.add_argument("--whole-rank", action="store_true", help="build and time the whole rank (~80 GB of HBM)")
    ap.add_argument("--capacity", type=int, default=0,
                    help="with --whole-rank: a cache of this many positions per row (the engine's --max-context) "
                         "holding CONTEXT tokens; default: the context and the timed steps' room")
    ap.add_argument("--tokens-per-row", type=int, nargs="+", default=[1],
                    help="decode steps of this many tokens per row (a speculative verify step with K drafts has "
                         "K + 1), compared with one token per row (layer and whole-rank modes; several: "
                         "--whole-rank only)")
    ap.add_argument("--one-shot", action="store_true",
                    help="under torchrun with --whole-rank: also time the step with model.OneShotReduce (opt-in)")
    ap.add_argument("--candidates", nargs="*", metavar="KEY",
                    help="with --whole-rank: also time the step with each of kernel.TUNING's choices (or only these "
                         "KEYs) set to each of its ALTERNATIVES")
    ap.add_argument("--tune", action="append", default=[], metavar="KEY=VALUE",
                    help="set kernel.TUNING[KEY] (a Python literal) for the whole run; repeatable")
    a = ap.parse_args()
    try:
        kernel.set_tuning(a.tune)
    except ValueError as e:
        raise SystemExit(str(e))
    bad = set(a.candidates or ()) - set(ALTERNATIVES) - set(TOGETHER)
    if bad:
        raise SystemExit(f"--candidates {' '.join(sorted(bad))}: no alternatives; those with some: "
                         f"{', '.join([*ALTERNATIVES, *TOGETHER])}")
    if len(a.tokens_per_row) > 1 and not a.whole_rank:
        raise SystemExit("--tokens-per-row takes several values with --whole-rank only")
    if not torch.cuda.is_available():
        raise SystemExit("tools.bench_decode needs a CUDA device")
    cands = a.candidates if a.candidates else a.candidates == []  # [] (the flag alone): every choice
    main(a.batch, a.context, a.torch_ref, a.profile, a.whole_rank, a.tokens_per_row, a.one_shot, cands, a.capacity)
