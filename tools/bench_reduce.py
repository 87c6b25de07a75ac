"""Microbenchmark of the TP reduction of one decode layer, between the GPUs of one host (torchrun, one process each).

Each layer reduces twice: the attention's bf16 partial and the MoE's fp32 partial, [B, 4096] per rank, both added in
rank order with one fp32 accumulator (model.tp_reduce_add: an all_gather then one add+norm kernel). This times, in a
CUDA graph of 2 x 92 chained reductions (a whole step's worth), per call:
  gather   model.tp_reduce_add as the model runs it (NCCL all_gather into [W, B, D], add_norm kernel)
  oneshot  torch's symmetric-memory one-shot all-reduce of the partial widened to fp32 (each rank reads every peer's
           buffer and adds them in rank order), then the same add_norm kernel on the [1, B, D] sum (rounded to bf16
           first for bf16 partials, as the model rounds); its results are checked bit-identical to `gather`.
  fused    model.OneShotReduce (opt-in in the model): the partial copied into this rank's symmetric
           buffer (two alternating slots), then ONE kernel (kernel.peer_add_norm_triton) that signals every rank,
           waits for every rank's signal and adds the W rows read over NVLink in rank order, with the residual and
           the norm; checked bit-identical to `gather` too.
and prints an estimate for W = 8 from a latency + bandwidth model fitted to the W measured here (stated in the output).

From the repository root (torchrun takes a module with -m, as python does):

    torchrun --standalone --nproc-per-node=2 -m tools.bench_reduce [--batch 1 16]
On CPU (gloo, `--device cpu`) only `gather` runs, eagerly: a smoke test of the script, not a measurement.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

import kernel
import model as M

D, CALLS = 4096, 2 * 92
NVLINK_BPS = 450e9  # H200 NVLink 4: ~450 GB/s per direction per GPU (datasheet 900 GB/s bidirectional)


def timed(fn, graph: bool, iters: int = 10) -> float:
    """Seconds per call of fn (which makes CALLS calls) as a replayed CUDA graph, or eagerly on CPU."""
    if not graph:
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) / CALLS
    fn()  # warm-up: compiles, NCCL/symmetric-memory setup outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / (iters * CALLS)


def fused_line(res, x, w, want, world) -> str:
    """Time and check the fused one-shot reduction (model.OneShotReduce: the partial, in its own dtype, copied into a
    symmetric-memory slot, then kernel.peer_add_norm_triton)."""
    one_shot = M.OneShotReduce(x.shape[0], D, x.device)
    got = one_shot(res, x, w, 1e-5)
    same = all(torch.equal(a, b) for a, b in zip(got, want))

    def fused():
        r = res
        for _ in range(CALLS):  # CALLS is even: every replay starts in the slot its predecessor's last call did not use
            r, _h = one_shot(r, x, w, 1e-5)
        return r

    t = timed(fused, True)
    nbytes = x.numel() * x.element_size()
    lat = t - (world - 1) * nbytes / NVLINK_BPS
    return (f" | fused {t * 1e6:6.1f} us (bit-identical: {same}) -> W=8 estimate "
            f"{(lat + 7 * nbytes / NVLINK_BPS) * 1e6:6.1f} us")


def main(batches: list, device: str):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = device == "cuda"
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=dev if cuda else None)
    M.set_parallel(world, rank)
    say = print if rank == 0 else (lambda *a: None)
    g = torch.Generator(device=dev).manual_seed(rank)
    w = torch.randn(D, device=dev, generator=g) * 0.1
    symm = None
    if cuda:
        try:
            import torch.distributed._symmetric_memory as symm_mem
            name = dist.group.WORLD.group_name
            symm = (symm_mem, name)
        except Exception as e:  # report, do not hide
            say(f"symmetric memory unavailable: {type(e).__name__}: {e}")
    say(f"{world} ranks on {device}; {CALLS} chained reductions per timing (2 per layer x 92 layers)")
    for B in batches:
        res = torch.randn(B, D, device=dev, generator=g)
        for dt in (torch.bfloat16, torch.float32):
            x = (torch.randn(B, D, device=dev, generator=g) * 4).to(dt)

            def gather():
                r = res
                for _ in range(CALLS):
                    r, _h = M.tp_reduce_add(r, x, w, 1e-5)
                return r

            t_gather = timed(gather, cuda)
            line = f"B={B:3d} {str(dt).split('.')[-1]:8s} ({B * D * dt.itemsize / 1024:5.0f} KiB/rank): gather " \
                   f"{t_gather * 1e6:6.1f} us"
            if symm is not None:
                symm_mem, name = symm
                buf = symm_mem.empty(B, D, dtype=torch.float32, device=dev)
                symm_mem.rendezvous(buf, name)

                def oneshot():
                    r = res
                    for _ in range(CALLS):
                        buf.copy_(x)  # widened to fp32: bf16 inputs would be added in bf16
                        s = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
                        r, _h = kernel.add_norm(r, s.to(dt)[None], w, 1e-5)
                    return r

                want = M.tp_reduce_add(res, x, w, 1e-5)
                s = torch.ops.symm_mem.one_shot_all_reduce(buf.copy_(x), "sum", name)
                got = kernel.add_norm(res, s.to(dt)[None], w, 1e-5)
                same = all(torch.equal(a, b) for a, b in zip(got, want))
                t_one = timed(oneshot, cuda)
                line += f" | oneshot {t_one * 1e6:6.1f} us (bit-identical to gather: {same})"
                # W = 8 estimate: a one-shot call is a fixed latency (launch, signal exchange) plus reading W - 1 peers'
                # buffers over NVLink; the latency measured here minus this W's transfer, plus 7 peers' transfer
                nbytes = B * D * 4
                lat = t_one - (world - 1) * nbytes / NVLINK_BPS
                line += f" -> W=8 estimate {(lat + 7 * nbytes / NVLINK_BPS) * 1e6:6.1f} us (latency + 7 x bytes / 450 GB/s)"
                line += fused_line(res, x, w, want, world)
            say(line)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.bench_reduce", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    main(a.batch, a.device)
