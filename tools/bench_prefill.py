"""Prefill benchmark of real-geometry Step-5 layers on one GPU, as one TP=EP=8 rank holds them.

Builds the sliding-window MoE layer (4) and the DSA MoE layer (7) with one rank's real shapes (8 query heads, 1 KV
group, 44 FP8 experts, indexer 4 heads x 256) and random weights, and prefills N tokens of one request in chunks of
C tokens on a growing cache, as the engine's prefill does. Per case: time, tokens/s per rank (every rank sees every
token, so this is also the 8-GPU rate with collectives excluded), peak memory and the share of the FLOP roofline
(bf16 767 TFLOP/s, fp8 1263 TFLOP/s); also the kernels' time back to back (the host queues each chunk behind a
sleep kernel) and the host's enqueue time: one layer timed between syncs is bound by whichever is slower, a forward
pass by the larger sum over its layers. Then the projected 92-layer prefill (69 sliding + 23 DSA layers), and for
the DSA layer at the largest N the time of the sparse-attention pieces of its last chunk, its sparse attention timed
also on a locality-biased synthetic selection (local_selection: real prompts' selections cluster, random weights'
do not). Timed after a first pass over the whole prompt (printed too: it includes the Triton compiles); best of
--reps.

    python -m tools.bench_prefill [--tokens 8192 32768 131072] [--chunk 16384] [--layers sliding dsa] [--profile]
                                  [--tune KEY=VALUE] [--sweep KEY=V1,V2,...]
"""
import argparse
import cProfile
import pstats
import time

import torch

import kernel
import model as M
from engine import PREFILL_CHUNK
from tools.rank import BF16_FLOPS, FP8_FLOPS, kernel_table, randomise, real_rank_config

LAYER_ID = {"sliding": 4, "dsa": 7}


def flops(block: M.Block, cfg, kind: str, N: int) -> tuple[float, float]:
    """(bf16, fp8) FLOPs of prefilling positions 0..N-1 in this layer on this rank: useful work only (the masked
    SDPA tiles of the sliding layer and the GEMM rows of other ranks' experts are not counted)."""
    a = block.self_attn
    # every 2-D weight is one bf16 GEMM per token (o/g proj, indexer q/k/z/w, shared expert, router); experts are 3-D
    dense = a.wpack.numel() + sum(p.numel() for p in block.parameters() if p.dim() == 2)
    per_expert = sum(getattr(block.moe, n).weight[0].numel() for n in ("gate_proj", "up_proj", "down_proj"))
    fp8 = 2 * N * per_expert * cfg.moe_top_k * cfg.n_local_experts / cfg.moe_num_experts  # mean experts hit here
    p = torch.arange(N, dtype=torch.float64)
    H, hd = cfg.n_local_heads, cfg.head_dim
    if kind == "sliding":  # QK^T and PV: 2 * 2 * hd per key per head; a query sees min(W, p + 1) keys
        attn = (4 * H * hd * p.add(1).clamp(max=cfg.sliding_window)).sum()
    else:
        sp = cfg.sparse
        keys = torch.clamp(p // sp.block + 1, max=sp.topk + 1) * sp.block  # selected regions + the current one
        heads = a.n_groups * a.idx_heads
        attn = (4 * H * hd * keys).sum() + (2 * heads * sp.proxy_dim * (p // sp.block)).sum()  # + indexer scores
    return 2 * N * dense + float(attn), fp8


def chunk(block, cache, rope, res, p0: int, n: int):
    """Positions p0 .. p0+n-1 on top of the cache, as Step5ForCausalLM.forward builds spans/pos. res [C, D] fp32."""
    block(res[:n], M.Placement(torch.arange(p0, p0 + n, device="cuda"), spans=[(0, 0, n, p0)]), rope, cache)


def prefill(block, cache, rope, res, N: int, C: int):
    """Chunks of C tokens on top of the cache."""
    for p0 in range(0, N, C):
        chunk(block, cache, rope, res, p0, min(C, N - p0))


def timed(fn, reps=1):
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def timed_split(block, cache, rope, res, N: int, C: int, reps: int, hold: float) -> tuple[float, float]:
    """(device seconds, host seconds) of prefill(), each the best of reps, summed over its chunks. Before each chunk
    a sleep kernel of `hold` seconds keeps the GPU busy while the host enqueues the chunk (a few hundred launches,
    well within the launch queue), so events around the chunk time its kernels back to back, as in a forward pass
    whose host runs layers ahead, and the host's enqueue time is measured apart from them."""
    dev = host = float("inf")
    for _ in range(reps):
        d = h = 0.0
        for p0 in range(0, N, C):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            torch.cuda._sleep(int(hold * 2e9))  # clock cycles at up to ~2 GHz: at least `hold` seconds
            t = time.perf_counter()
            a.record()
            chunk(block, cache, rope, res, p0, min(C, N - p0))
            b.record()
            h += time.perf_counter() - t
            torch.cuda.synchronize()
            d += a.elapsed_time(b) / 1e3
        dev, host = min(dev, d), min(host, h)
    return dev, host


def local_selection(pos, G: int, topk: int, blk: int, R: int, share: int = 64, recent: int = 64, seed: int = 0):
    """A synthetic selection with locality, in select_regions' layout, for timing the sparse attention on selections
    that cluster as real prompts' do (random weights give independent selections: neighbouring queries share little).
    Each query of position p (n = p // blk history regions) keeps its `recent` latest regions, then the far regions
    its block of `share` consecutive queries shares (one random draw per block from the regions below the block's
    first query's recent window), then its latest regions not yet taken, up to K = min(topk, R); every group alike.
    pos [T] (on any device) -> ids [1, G, T, K] int64 ascending, invalid slots R; valid [1, G, T, K] bool."""
    K = min(topk, R)
    n_hist = (pos.cpu() // blk).tolist()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((len(n_hist), K), R, dtype=torch.int64)
    for b0 in range(0, len(n_hist), share):
        far = torch.randperm(max(n_hist[b0] - recent, 0), generator=gen)[:max(K - recent, 0)].tolist()
        for t in range(b0, min(b0 + share, len(n_hist))):
            n = n_hist[t]
            if n <= K:
                row = list(range(n))
            else:
                row = list(dict.fromkeys(list(range(n - recent, n)) + far))[:K]
                taken = set(row)
                fill = (r for r in range(n - 1, -1, -1) if r not in taken)
                row += [next(fill) for _ in range(K - len(row))]
            ids[t, :len(row)] = torch.tensor(sorted(row), dtype=torch.int64)
    ids = ids.to(pos.device)[None, None].expand(1, G, -1, -1).contiguous()
    return ids, ids < R


def mean_union(ids, valid, rows: int = 8) -> float:
    """Mean count of distinct valid regions over each `rows` consecutive queries of group 0: how much a tile of
    neighbouring queries would read together. ids, valid [1, G, T, K]."""
    i, v = ids[0, 0], valid[0, 0]
    sizes = [i[t:t + rows][v[t:t + rows]].unique().numel() for t in range(0, i.shape[0], rows)]
    return sum(sizes) / max(len(sizes), 1)


def dsa_breakdown(block, lc, rope, res, N: int, C: int, cfg):
    """The DSA pieces of the last chunk (positions N-C..N-1, the cache full), each called as _dsa calls it, so each
    time includes its launches. Sparse attention reads the selection the real scores give; its q is random (the
    kernel's time depends on the shapes and the selected ids, not on the values)."""
    a, sp = block.self_attn, cfg.sparse
    blk, p0 = sp.block, N - C
    pos = torch.arange(p0, N, device="cuda")
    h = kernel.rms_norm(res[:C], block.input_layernorm.weight, cfg.rms_norm_eps, torch.bfloat16)  # [C, D]
    summ = lc.summ[:1, :N // blk].view(kernel.FP8)  # [1, R, P] every region completed by the chunk's end

    def indexer():  # projections, norm + RoPE (the main q and k's too: one launch), the chunk's C/blk summaries
        p = a.project(h)
        qi, ki, zi, wi = a._norm_rope(*p[:2], p[4:], pos, rope)[2]
        # z is a column slice of the packed projection; the model's prefill joins it to the pending rows (a copy)
        kernel.region_summary(ki.view(-1, blk, sp.proxy_dim), zi.contiguous().view(-1, blk, sp.proxy_dim))
        return qi, wi
    qi, wi = indexer()
    step = kernel.dsa_query_chunk(res, a.n_groups, N // blk)
    subs = [(c0, min(C, c0 + step)) for c0 in range(0, C, step)]  # the query chunks of model._dsa
    scores = [kernel.indexer_scores(qi[None, c0:c1], wi[None, c0:c1], summ, a.w_scale, q_e4m3=True)
              for c0, c1 in subs]  # [1, G, step, R] each
    sel = [kernel.select_regions(s, pos[None, c0:c1], sp.topk, blk) for s, (c0, c1) in zip(scores, subs)]
    local = [local_selection(pos[c0:c1], a.n_groups, sp.topk, blk, N // blk) for c0, c1 in subs]
    q = torch.randn(1, C, a.n_groups, a.n_heads // a.n_groups, cfg.head_dim, device="cuda").bfloat16()

    def attention(selections):
        return [kernel.selected_attention(q[:, c0:c1], lc.k[:1, :N], lc.v[:1, :N], p0 + c0, i, v, pos[None, c0:c1],
                                          blk, sp.topk, a.scale) for (i, v), (c0, c1) in zip(selections, subs)]
    pieces = {
        "indexer proj+summ": indexer,
        "scores": lambda: [kernel.indexer_scores(qi[None, c0:c1], wi[None, c0:c1], summ, a.w_scale, q_e4m3=True)
                           for c0, c1 in subs],
        "selection": lambda: [kernel.select_regions(s, pos[None, c0:c1], sp.topk, blk)
                              for s, (c0, c1) in zip(scores, subs)],
        "attention": lambda: attention(sel),
        # the whole layer on that chunk again (rewrites the same cache rows with the same values)
        "whole layer chunk": lambda: chunk(block, lc, rope, res, p0, C),
    }
    t = {k: timed(f, 3) for k, f in pieces.items()}
    t["rest (QKV, o_proj, MoE...)"] = t["whole layer chunk"] - sum(v for k, v in t.items() if k != "whole layer chunk")
    print(f"dsa breakdown, chunk of {C} at positions {p0}..{N - 1} ({N // blk} regions, {len(subs)} query chunks "
          f"of {step}): " + " | ".join(f"{k} {v * 1e3:.2f} ms" for k, v in t.items()))
    union = [sum(mean_union(*x) for x in s) / len(s) for s in (sel, local)]
    print(f"  sparse attention on the random weights' selection {t['attention'] * 1e3:.2f} ms (mean union of 8 "
          f"neighbouring queries {union[0]:.0f} regions) | on a locality-biased one (local_selection) "
          f"{timed(lambda: attention(local), 3) * 1e3:.2f} ms ({union[1]:.0f} regions; topk {sp.topk})")


def main(tokens: list, C: int, layers: list, reps: int, profile: bool = False):
    torch.manual_seed(0)
    cfg = real_rank_config()
    M.set_parallel(1, 0)  # one rank's shapes; the TP collectives are not part of this measurement
    kernel.set_backend(True)
    results = {}  # (kind, N) -> seconds
    for kind in layers:
        layer_id = LAYER_ID[kind]
        with torch.device("meta"):  # randomise() materialises the weights on the GPU
            block = M.Block(cfg, layer_id, fp8=True)
        randomise(block)
        block.self_attn.finalize()
        rope = M.rope_tables(cfg, -(-max(tokens) // 128) * 128, "cuda")[layer_id]
        res = torch.randn(C, cfg.hidden_size, device="cuda")  # [C, D] fp32 residual rows, reused by every chunk
        for N in tokens:
            cap = -(-N // 128) * 128  # a multiple of 16 and of the region size, as new_cache rounds
            cache = None
            try:
                with torch.inference_mode():
                    cache = block.self_attn.new_cache(1, cap, "cuda")
                    # warm-up over the whole prompt: kernels compile per shape class met on the way (region
                    # counts' powers of two, ...), which a 2-chunk warm-up missed: seconds inside the timed pass
                    t0 = time.perf_counter()
                    prefill(block, cache, rope, res, N, C)
                    torch.cuda.synchronize()
                    first = time.perf_counter() - t0
                    torch.cuda.reset_peak_memory_stats()
                    t = timed(lambda: prefill(block, cache, rope, res, N, C), reps)  # restarts at p0=0: overwrites
                    peak = torch.cuda.max_memory_allocated() / 2 ** 30
                    dev, host = timed_split(block, cache, rope, res, N, C, reps, 2 * t * C / N + 0.005)
                    if kind == "dsa" and N == max(tokens):
                        dsa_breakdown(block, cache, rope, res, N, min(C, N), cfg)
                    if profile and N == max(tokens):  # the last chunk again: device time per kernel, host per call
                        c = min(C, N)
                        print(kernel_table(lambda: chunk(block, cache, rope, res, N - c, c), 12))
                        torch.cuda.synchronize()
                        torch.cuda._sleep(int(0.2 * 2e9))  # the GPU busy: the host never waits for a full queue
                        with cProfile.Profile() as prof:
                            chunk(block, cache, rope, res, N - c, c)
                        calls = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:25]
                        print("host: " + " | ".join(f"{fn} ({file.rsplit('/', 1)[-1]}:{line}) x{n} {own * 1e6:.0f} us "
                                                    f"(with callees {cum * 1e6:.0f})"
                                                    for (file, line, fn), (_, n, own, cum, _) in calls))
            except torch.cuda.OutOfMemoryError as e:
                print(f"{kind:8s} N={N:7d}: out of memory ({str(e)[:120]})")
                cache = None
                torch.cuda.empty_cache()
                continue
            results[kind, N] = t, dev, host
            fb, f8 = flops(block, cfg, kind, N)
            ideal = fb / BF16_FLOPS + f8 / FP8_FLOPS
            print(f"{kind:8s} N={N:7d} chunk {C}: {t * 1e3:9.1f} ms  {N / t:9.0f} tok/s/rank  peak {peak:6.2f} GiB  "
                  f"{(fb + f8) / t / 1e12:6.1f} TFLOP/s ({fb / N / 1e6:.0f} bf16 + {f8 / N / 1e6:.0f} fp8 MFLOP/token)"
                  f"  roofline {ideal * 1e3:7.1f} ms = {ideal / t:5.1%} | first pass {first:.2f} s | kernels back to "
                  f"back {dev * 1e3:.1f} ms ({N / dev:.0f} tok/s, roofline {ideal / dev:.1%}), host enqueue "
                  f"{host * 1e3:.1f} ms")
            cache = None
            torch.cuda.empty_cache()
        block = None
        torch.cuda.empty_cache()
    n_dsa = sum(cfg.is_dsa(i) for i in range(cfg.num_hidden_layers))
    n_sl = cfg.num_hidden_layers - n_dsa
    for N in tokens:
        if ("sliding", N) in results and ("dsa", N) in results:
            t, dev, host = (n_sl * s + n_dsa * d for s, d in zip(results["sliding", N], results["dsa", N]))
            # a forward pass never syncs between layers, so its host runs ahead: it takes the larger of the two sums
            fwd = max(dev, host)
            print(f"projected prefill of {N} tokens, {n_sl} sliding + {n_dsa} DSA MoE-shaped layers, chunk {C}: "
                  f"{fwd:.2f} s = {N / fwd:.0f} tok/s per rank (kernels back to back {dev:.2f} s, host enqueue "
                  f"{host:.2f} s; layers timed one by one between syncs {t:.2f} s; collectives, embedding and head "
                  "excluded)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.bench_prefill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--chunk", type=int, default=PREFILL_CHUNK, help=f"default {PREFILL_CHUNK}, the engine's")
    ap.add_argument("--layers", nargs="+", choices=list(LAYER_ID), default=list(LAYER_ID))
    ap.add_argument("--reps", type=int, default=2, help="time each prefill this many times, keep the best")
    ap.add_argument("--profile", action="store_true",
                    help="the last chunk's device time per kernel and its host time per Python call (cProfile)")
    ap.add_argument("--tune", action="append", default=[], metavar="KEY=VALUE",
                    help="set kernel.TUNING[KEY] for the run (e.g. --tune sparse_block_n=32; repeatable)")
    ap.add_argument("--sweep", metavar="KEY=V1,V2,...",
                    help="the whole run once per value of kernel.TUNING[KEY] (e.g. --sweep dense_tiles=0,2,4,6), in "
                    "one process: kernels compiled once")
    a = ap.parse_args()
    key, _, values = (a.sweep or "").partition("=")
    try:
        kernel.set_tuning(a.tune)
    except ValueError as e:
        raise SystemExit(str(e))
    try:
        for v in values.split(",") if a.sweep else []:
            kernel.set_tuning([f"{key}={v}"])  # checked before any run
    except ValueError as e:
        raise SystemExit(str(e).replace("--tune", "--sweep", 1))
    if not torch.cuda.is_available():
        raise SystemExit("tools.bench_prefill needs a CUDA device")
    for v in values.split(",") if a.sweep else [None]:
        if v is not None:
            kernel.set_tuning([f"{key}={v}"])
            print(f"--- {key}={v}", flush=True)
        main(a.tokens, a.chunk, a.layers, a.reps, a.profile)
