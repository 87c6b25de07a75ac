"""The FP8 text model on every Triton kernel under the interpreter with the GPU's launch shapes, beside the same run on
the PyTorch references (conftest.interpreted_model_run). The interpreter's run is the slowest thing CI runs and
uses one core, so a test session computes it in a process of its own beside the other tests:

    python tests/interpreted_run.py OUT.pt        # torch.save((reference logits, Triton logits, launch records))
"""
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any @triton.jit decorates a kernel
TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(TESTS), TESTS]


def run_model(lm):
    """A batched prefill, a prefill chunk on cached keys, a one-token step, a three-token step, and a one-token step
    with the launch shapes of a grid that fills the GPU (one SM), on the references (decisions recorded) and then on
    the Triton kernels (the interpreter, an H200's launch shapes; decisions replayed, every launch recorded). DSA
    top-2 instead of the checkpoint's 4 and dense tiles up to position 26, so that these short prompts reach the three
    prefill paths (queries that select every region; the scores and selection, then dense tiles masked by it or the
    per-query sparse attention) and real selections in decode.
    -> (reference logits [2, 7, V], Triton logits [2, 7, V], {launch key: launch record})"""
    import pytest
    import torch

    import kernel
    import model as M
    from invariants import pinned
    from kernels import common
    from tools.sass import launch_records
    g = torch.Generator().manual_seed(3)
    ids, cont = torch.randint(11, 700, (30,), generator=g).tolist(), torch.randint(11, 700, (16,), generator=g).tolist()

    def run(mp):
        cache = lm.new_cache(2, 34, slack=2)
        first = lm.forward(torch.tensor(ids), cache, [27, 3])[:, None]  # [2, 1, V]; positions from 24 select
        more = lm.forward(torch.tensor(cont[8:14]), cache, [2, 4])[:, None]  # chunks after cached keys
        one = lm.forward(torch.tensor(cont[:2]), cache)[:, None]
        three = lm.forward(torch.tensor([cont[2:5], cont[5:8]]), cache)  # [2, 3, V]
        if mp is not None:
            mp.setattr(common, "_sms", lambda: 1)
        wide = lm.forward(torch.tensor(cont[14:16]), cache)[:, None]
        return torch.cat([first, more, one, three, wide], 1)

    with torch.inference_mode(), pytest.MonkeyPatch.context() as top:
        top.setattr(lm.cfg.sparse, "topk", 2)
        top.setitem(kernel.TUNING, "dense_tiles", 1.1)  # positions 24, 25: dense tiles, masked; from 26: per query
        with pinned(lm, M.Pins()) as rec:
            ref = run(None)
        with pytest.MonkeyPatch.context() as mp, pinned(lm, M.Pins(rec.data)), launch_records({}) as seen:
            mp.setattr(kernel, "_triton", lambda x: True)
            mp.setattr(common, "_GPU_LAUNCH", True)
            mp.setattr(common, "_sms", lambda: 132)  # the H200's
            got = run(mp)
    return ref, got, seen


def main(out: str):
    """conftest's fp8_text checkpoint, converted at TP=1 in a temporary directory, run_model on it; the result saved
    to `out` under a temporary name, then renamed."""
    import tempfile

    import torch

    import convert
    from conftest import load_tp1, make_kind
    with tempfile.TemporaryDirectory() as tmp:
        convert.main(make_kind("fp8_text", os.path.join(tmp, "ckpt")), os.path.join(tmp, "out"), tp_size=1, ep_size=1)
        result = run_model(load_tp1(os.path.join(tmp, "out", "tp1")))
    torch.save(result, out + ".part")
    os.replace(out + ".part", out)


if __name__ == "__main__":
    main(sys.argv[1])
