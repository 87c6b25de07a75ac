"""Fixtures shared by tests/ and test_vision.py."""
import os
import sys

# The Triton interpreter must be chosen before any @triton.jit decorates a kernel (kernel.py is imported by several
# test files): CPU-only CI runs every Triton kernel under it. Set TRITON_INTERPRET=0 to run the kernels on a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the scripts, and the tests' shared helpers (invariants.py)

import pytest  # noqa: E402

# Tiny checkpoints shared by the test files, each written once per session on first use. TINY_SEED_OFFSET shifts
# every kind's seed: the suite must pass on checkpoints it was not written against (e.g. TINY_SEED_OFFSET=10).
SEED_OFFSET = int(os.environ.get("TINY_SEED_OFFSET", "0"))
CKPT_KINDS = {"fp8_vl": {}, "bf16_text": {"fp8": False, "vl": False, "seed": 1},
              "fp8_text": {"vl": False, "seed": 1}, "bf16_vl": {"fp8": False},
              "fp8_vl_seed1": {"seed": 1}, "fp8_vl_seed2": {"seed": 2}}


class _Checkpoints(dict):
    def __init__(self, base):
        super().__init__()
        self.base = base

    def __missing__(self, kind):
        from tiny_checkpoint import make_checkpoint
        kw = dict(CKPT_KINDS[kind])
        kw["seed"] = kw.get("seed", 0) + SEED_OFFSET
        self[kind] = make_checkpoint(str(self.base / kind), **kw)
        return self[kind]


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    """ckpts[kind] -> directory of a tiny original checkpoint (kinds: CKPT_KINDS)."""
    return _Checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="session")
def converted(ckpts, tmp_path_factory):
    """converted(kind, tp, keep_mtp=False) -> OUT/tp{tp}, a clean conversion of ckpts[kind] (one OUT per kind and
    keep_mtp, so the tokenizer_files directory sits beside every tp dir of that kind)."""
    import convert
    outs, done = {}, set()

    def get(kind, tp, keep_mtp=False):
        key = (kind, keep_mtp)
        if key not in outs:
            outs[key] = str(tmp_path_factory.mktemp(f"converted_{kind}{'_mtp' if keep_mtp else ''}"))
        if (key, tp) not in done:
            convert.main(ckpts[kind], outs[key], tp_size=tp, ep_size=tp, keep_mtp=keep_mtp)
            done.add((key, tp))
        return os.path.join(outs[key], f"tp{tp}")
    return get


@pytest.fixture(scope="session")
def tp1_models(converted):
    """tp1_models(kind, device="cpu") -> the TP=1 model of that kind, loaded once per session and device."""
    import config
    import model as M
    loaded = {}

    def get(kind, device="cpu"):
        if (kind, device) not in loaded:
            d = converted(kind, 1)
            cfg, vl, _ = config.load_config(os.path.join(d, "config-r0.json"))
            loaded[kind, device] = M.Step5ForCausalLM.from_shard(os.path.join(d, "model-r0.safetensors"), cfg,
                                                                 device, vl, rank=0)
        return loaded[kind, device]
    return get


@pytest.fixture(scope="session")
def interpreted_model_run(tp1_models):
    """The FP8 text model on every Triton kernel (the interpreter) with the GPU's launch shapes (kernel._GPU_LAUNCH,
    an H200's 132 SMs), every launch recorded, beside the same run on the PyTorch references (decisions pinned):
    a batched prefill, a prefill chunk on cached keys, a one-token step, a three-token step, and a one-token step
    with the launch shapes of a grid that fills the GPU (one SM). DSA top-2 instead of the checkpoint's 4, so that
    these short prompts reach both prefill paths (queries that select every region, and the scores, selection and
    sparse attention past them) and real selections in decode. Shared by the model test (logits) and the sm90 build
    test (launches): the interpreter is the slowest thing CI runs.
    -> (reference logits [2, 7, V], Triton logits [2, 7, V], {launch key: launch record})"""
    import torch

    import kernel
    import model as M
    from invariants import pinned
    from sass import launch_records
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter's run (CPU CI)")
    lm = tp1_models("fp8_text")
    g = torch.Generator().manual_seed(3)
    ids, cont = torch.randint(11, 700, (30,), generator=g).tolist(), torch.randint(11, 700, (16,), generator=g).tolist()

    def run(mp):
        cache = lm.new_cache(2, 34, slack=2)
        first = lm.forward(torch.tensor(ids), cache, [27, 3])[:, None]  # [2, 1, V]; positions from 24 select
        more = lm.forward(torch.tensor(cont[8:14]), cache, [2, 4])[:, None]  # chunks after cached keys
        one = lm.forward(torch.tensor(cont[:2]), cache)[:, None]
        three = lm.forward(torch.tensor([cont[2:5], cont[5:8]]), cache)  # [2, 3, V]
        if mp is not None:
            mp.setattr(kernel, "_sms", lambda: 1)
        wide = lm.forward(torch.tensor(cont[14:16]), cache)[:, None]
        return torch.cat([first, more, one, three, wide], 1)

    with torch.inference_mode(), pytest.MonkeyPatch.context() as top:
        top.setattr(lm.cfg.sparse, "topk", 2)
        with pinned(lm, M.Pins()) as rec:
            ref = run(None)
        with pytest.MonkeyPatch.context() as mp, pinned(lm, M.Pins(rec.data)), launch_records({}) as seen:
            mp.setattr(kernel, "_triton", lambda x: True)
            mp.setattr(kernel, "_GPU_LAUNCH", True)
            mp.setattr(kernel, "_sms", lambda: 132)  # the H200's
            got = run(mp)
    return ref, got, seen
