"""What the benchmarks share: one TP=EP=8 rank of Step-5 with random weights on one GPU (its config, its weights, the
whole model), the timer and the per-kernel profile they read it with, and the H200's ceilings they compare it to."""
import dataclasses
import time

import torch

import config
import kernel
import model as M

# H200 ceilings measured with PyTorch (ENVIRONMENT.md): HBM as a device-to-device copy (read + write); dense GEMMs
# of 8192^3, bf16 and fp8 torch._scaled_mm with tensor-wise scales
HBM_BPS = 4.28e12
BF16_FLOPS, FP8_FLOPS = 767e12, 1263e12


def real_rank_config(tp: int = 8) -> config.Step5Config:
    from tiny_checkpoint import real_text_config
    return config.Step5Config.from_dict(real_text_config(tp_size=tp, expert_parallel_size=tp,
                                                         tp_layout_version=config.LAYOUT_VERSION))


def randomise(mod: torch.nn.Module, seed: int = 0, device="cuda"):
    """Random weights on `device` for every parameter of mod (also parameters still on the meta device)."""
    g = torch.Generator(device=device).manual_seed(seed)
    for sub in mod.modules():
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            if p.dtype == kernel.FP8:  # |x| <= 448 before the cast: CUDA turns larger values into NaN
                t = (torch.randn(p.shape, device=device, generator=g) * 64).clamp(-448, 448).to(kernel.FP8)
            elif name.endswith("weight_scale_inv"):
                t = torch.full(p.shape, 1e-3 / 64, device=device)
            elif p.dim() == 1:
                t = torch.randn(p.shape, device=device, generator=g) * 0.1
            else:
                t = (torch.randn(p.shape, device=device, generator=g) * p.shape[-1] ** -0.5).to(p.dtype)
            sub._parameters[name] = torch.nn.Parameter(t, requires_grad=False)


def build(seed: int = 0, mtp: int = 0) -> M.Step5ForCausalLM:
    """The whole rank (92 layers, the first `mtp` MTP layers) of random weights on this process's GPU, finalized."""
    cfg = dataclasses.replace(real_rank_config(8), mtp_layers_kept=mtp)
    with torch.device("meta"):
        m = M.Step5ForCausalLM(cfg, set(cfg.moe_layers), 0)
    randomise(m, seed=seed)
    m.finalize()
    M.set_parallel(1, 0)  # one GPU holds one rank's shapes; the sums are of one partial
    return m


def time_step(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def profiled(fn):
    """The profiler's events of one eager call of fn (device activities: kernels, copies, memsets)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return p


def kernel_table(fn, rows: int) -> str:
    """Device time per kernel of one eager call: where a step's time goes."""
    return profiled(fn).key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)
