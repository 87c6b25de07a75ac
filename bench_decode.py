"""Decode-step benchmark of real-geometry Step-5 layers on one GPU, as one TP=8 rank holds them.

Builds a sliding-window MoE layer and a DSA MoE layer with the real shapes of one TP=EP=8 rank (8 query heads,
1 KV group, 44 FP8 experts, indexer 4 heads x 256) and random weights, fills a KV cache of CONTEXT tokens, and times
one decode step per layer (eager, then replayed as a CUDA graph). Prints per-layer times, the projected 92-layer step
(69 sliding + 23 DSA layers; collectives excluded) and its ratio to the HBM floor of the bytes one step must read.

    python bench_decode.py [--batch 1] [--context 4096] [--torch-ref]
"""
import argparse
import time

import torch

import kernel
import config
import model as M
from generate import DecodeStep

HBM_BPS = 4.28e12  # H200 device-to-device copy bandwidth (read + write), measured with PyTorch


def real_rank_config(tp: int = 8) -> config.Step5Config:
    from tiny_checkpoint import real_text_config
    return config.Step5Config.from_dict(real_text_config(tp_size=tp, expert_parallel_size=tp,
                                                         tp_layout_version=config.LAYOUT_VERSION))


def randomise(mod: torch.nn.Module):
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, p in mod.named_parameters():
        if p.dtype == kernel.FP8:
            p.data = (torch.randn(p.shape, device="cuda", generator=g) * 64).clamp(-448, 448).to(kernel.FP8)
        elif name.endswith("weight_scale_inv"):
            p.data = torch.full(p.shape, 1e-3 / 64, device="cuda")
        elif p.dim() == 1:
            p.data = torch.randn(p.shape, device="cuda", generator=g) * 0.1
        else:
            p.data = (torch.randn(p.shape, device="cuda", generator=g) * p.shape[-1] ** -0.5).to(p.dtype)


def layer_bytes(block: M.Block, batch: int, cfg: config.Step5Config) -> int:
    """Bytes one decode step must read: every non-expert weight once, the experts the batch routes to (expected
    distinct local experts for batch*top_k uniform picks), and the KV cache it attends to."""
    total = 0
    for name, p in block.named_parameters():
        if ".moe." in f".{name}" and (name.startswith("moe.gate_proj") or name.startswith("moe.up_proj")
                                      or name.startswith("moe.down_proj")):
            continue
        total += p.numel() * p.element_size()
    a = block.self_attn
    total += a.wqkv.numel() * a.wqkv.element_size()
    E, k = cfg.moe_num_experts, cfg.moe_top_k
    hit = cfg.n_local_experts * (1 - (1 - 1 / E) ** (batch * k))  # expected distinct local experts touched
    per_expert = sum(getattr(block.moe, n).weight[0].numel() for n in ("gate_proj", "up_proj", "down_proj"))
    total += int(hit * per_expert)  # e4m3: one byte per weight
    return total


def time_step(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def main(batch: int, context: int, torch_ref: bool, profile: bool = False):
    torch.manual_seed(0)
    cfg = real_rank_config()
    M.set_parallel(1, 0)  # one rank's shapes; the TP collectives are not part of this measurement
    kernel.set_backend(not torch_ref)  # Triton for CUDA tensors unless the reference is asked for
    results = {}
    for kind, layer_id in (("sliding", 4), ("dsa", 7)):
        with torch.device("cuda"):
            block = M.Block(cfg, layer_id, fp8=True)
        randomise(block)
        block.self_attn.finalize()
        cap = -(-(context + 64) // 16) * 16
        rope = M.rope_tables(cfg, cap, "cuda")[layer_id]
        cache = M.Cache([block.self_attn.new_cache(batch, cap, "cuda")], batch, cap, "cuda")
        lc = cache.layers[0]
        if kind == "dsa":  # a filled context: random keys/values and region summaries
            lc.k.normal_()
            lc.v.normal_()
            lc.summ.copy_(torch.randn(lc.summ.shape, device="cuda").clamp(-4, 4).to(kernel.FP8).view(torch.uint8))
        pos = torch.full((batch,), context, dtype=torch.long, device="cuda")
        res = torch.randn(batch, cfg.hidden_size, device="cuda")

        def step():
            with torch.inference_mode():
                return block(res, pos, rope, None, lc)

        eager = time_step(step)
        if profile:  # device time per kernel of one eager step: where the step's time goes
            from torch.profiler import ProfilerActivity, profile as prof
            with prof(activities=[ProfilerActivity.CUDA]) as p:
                step()
                torch.cuda.synchronize()
            print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
        graph_t = None
        try:  # the decode loop's own graph object (generate.DecodeStep), replayed alone
            replay = DecodeStep(lambda r: block(r, pos, rope, None, lc), graph=True)
            with torch.inference_mode():
                replay(res)
            graph_t = time_step(replay.graph.replay)
        except Exception as e:  # report, do not hide: a capture failure means a host sync crept into decode
            print(f"{kind}: CUDA graph capture failed: {type(e).__name__}: {str(e)[:200]}")
        nbytes = layer_bytes(block, batch, cfg)
        if kind == "dsa":
            sel = min(cfg.sparse.topk + 1, context // cfg.sparse.block + 1) * cfg.sparse.block
            nbytes += batch * (sel * 2 * 192 * 2 + (context // cfg.sparse.block) * 256)  # selected K/V + summaries
        else:
            nbytes += batch * min(context, cfg.sliding_window) * 2 * 192 * 2
        results[kind] = (eager, graph_t, nbytes)
        best = graph_t or eager
        print(f"{kind:8s} layer: eager {eager * 1e6:8.1f} us | graph "
              + (f"{graph_t * 1e6:8.1f} us" if graph_t else "   n/a    ")
              + f" | {nbytes / 1e6:6.1f} MB -> floor {nbytes / HBM_BPS * 1e6:6.1f} us | "
              f"{nbytes / best / 1e9:7.1f} GB/s = {nbytes / best / HBM_BPS:5.1%} of HBM")
        block = cache = lc = None  # free this layer before building the next
        torch.cuda.empty_cache()
    n_dsa = sum(cfg.is_dsa(i) for i in range(cfg.num_hidden_layers))
    n_sl = cfg.num_hidden_layers - n_dsa
    step_t = n_sl * (results["sliding"][1] or results["sliding"][0]) + n_dsa * (results["dsa"][1] or results["dsa"][0])
    floor = (n_sl * results["sliding"][2] + n_dsa * results["dsa"][2]) / HBM_BPS
    print(f"projected decode step, 92 MoE-shaped layers, batch {batch}, context {context}, "
          f"{'torch reference' if torch_ref else 'Triton kernels'}: {step_t * 1e3:.2f} ms "
          f"(HBM floor {floor * 1e3:.2f} ms, ratio {floor / step_t:.1%}); collectives excluded")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--torch-ref", action="store_true", help="time the PyTorch reference path instead of Triton")
    ap.add_argument("--profile", action="store_true", help="print the device time of each kernel of one step")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA device")
    main(a.batch, a.context, a.torch_ref, a.profile)
