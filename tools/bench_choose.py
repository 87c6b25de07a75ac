"""The choose step's own cost on a GPU (choice.choose at the real vocabulary of 128,896 tokens, captured as a CUDA
graph and replayed, as a decode step's choose graph runs): the whole step (the nucleus sort and the logprobs) against
the lean one (neither) and the argmax one (no draw either: the sampled rows are timed as if greedy), per batch,
beside the decode step it follows. Rows are greedy and constrained (a random grammar mask) or sampled with
penalties, as bench_grammar's constrained requests and a chat's sampled ones choose.

    python -m tools.bench_choose                       # batches 1 and 16
    python -m tools.bench_choose --batch 1 --profile   # and each step's kernels

Each variant is timed twice: with the choose step's kernels (kernel.process_logits: the logits processing in one
launch; kernel.uniform: the draws' uniforms in one; kernel.advance: the requests' state in one) and with their
PyTorch forms (the `*_ref` references).

The ceiling printed is the HBM floor of the bytes a step must touch: the logits read once (fp32), the output counts
read and written (int32), the prompt marks and the mask read.
"""
import argparse
from types import SimpleNamespace

import torch

import choice
import kernel
from sampling import Sampling
from startup import Graph
from tools.rank import HBM_BPS, kernel_table, time_step

V = 128896


def slots(b: int) -> choice.Slots:
    """b slots, the even ones greedy and constrained, the odd ones sampled with a presence and a repetition penalty."""
    st = choice.Slots(b, V, "cuda")
    for i in range(b):
        s = Sampling() if i % 2 == 0 else Sampling(0.8, seed=i, presence_penalty=0.5, repetition_penalty=1.1)
        st.take(i, SimpleNamespace(sampling=s, ids=list(range(100 * i, 100 * i + 1000)),
                                   constraint=object() if i % 2 == 0 else None, reasoning=None))
    return st


def graphs(b: int) -> dict:
    """Each choose step variant (choice.Pick) of b rows, captured -> {name: Graph}."""
    g = torch.Generator(device="cuda").manual_seed(b)
    logits = torch.randn(b, V, device="cuda", generator=g) * 3
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (b, (V + 31) // 32), dtype=torch.int32, device="cuda", generator=g)
    mask[:, 0] |= 1  # every row allows a token
    st, rows = slots(b), torch.arange(b, device="cuda")
    count, live = torch.zeros(b, dtype=torch.long, device="cuda"), torch.ones(b, dtype=torch.long, device="cuda")
    out = {}
    for pick in choice.Pick:
        gr = Graph(lambda rows, live, pick=pick: choice.choose(logits, st, rows, mask, count[rows], live, pick),
                   [rows, live], True)
        gr.capture()
        out[pick.name.lower()] = gr
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--step-ms", type=float, default=4.84,
                    help="the decode step the choice follows (the README's H200 batch-1 step), for its share")
    ap.add_argument("--profile", action="store_true", help="print each step's kernels (one eager call)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: bench_choose times CUDA graphs: no GPU here")
    print(f"== {torch.cuda.get_device_name(0)}; V {V}; rows: even greedy + grammar mask, odd sampled + penalties")
    for b in a.batch:
        nbytes = b * V * (4 + 2 * 4 + 1) + b * V // 8
        ms = {}
        for backend in ("triton", "torch"):  # the choose step's kernels, or their PyTorch forms
            kernel.set_backend(backend == "triton")
            gs = graphs(b)
            for name, gr in gs.items():
                t = ms[name, backend] = time_step(gr, a.iters) * 1e3
                print(f"batch {b:3d} {name:6s} {backend:6s}: {t * 1e3:7.1f} us a step | {t / a.step_ms:5.1%} of a "
                      f"{a.step_ms} ms decode step | HBM floor {nbytes / HBM_BPS * 1e6:5.1f} us, ratio "
                      f"{nbytes / HBM_BPS * 1e3 / t:5.1%}")
            if a.profile:
                for name, gr in gs.items():
                    print(f"-- batch {b} {name} {backend}: kernels of one eager call")
                    print(kernel_table(lambda: gr.fn(*gr.inputs), 25))
        kernel.set_backend(True)
        for backend in ("triton", "torch"):
            print(f"batch {b:3d} {backend}: lean / whole {ms['lean', backend] / ms['whole', backend]:.1%}; argmax / "
                  f"whole {ms['argmax', backend] / ms['whole', backend]:.1%}")
        print(f"batch {b:3d} kernels / PyTorch forms: " + ", ".join(
            f"{p.name.lower()} {ms[p.name.lower(), 'triton'] / ms[p.name.lower(), 'torch']:.1%}" for p in choice.Pick))


if __name__ == "__main__":
    main()
