"""Fixtures shared by tests/ and test_vision.py (the vision tests stand at the root beside vision_encoder.py)."""
import os
import signal
import sys

# The Triton interpreter must be chosen before any @triton.jit decorates a kernel (kernel.py is imported by several
# test files): CPU-only CI runs every Triton kernel under it. Set TRITON_INTERPRET=0 to run the kernels on a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the product's modules, and the tests' shared helpers

import pytest  # noqa: E402

# A background job (`cmd &` without job control, e.g. under nohup) starts with SIGINT ignored, and its children inherit
# that: the tests that press Ctrl-C on convert.py / generate.py would see nothing happen. A handler here resets to the
# default in every child (exec keeps an ignored signal ignored, but not a handler).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Tiny checkpoints shared by the test files, each written once per session on first use. TINY_SEED_OFFSET shifts
# every kind's seed: the suite must pass on checkpoints it was not written against (e.g. TINY_SEED_OFFSET=10).
SEED_OFFSET = int(os.environ.get("TINY_SEED_OFFSET", "0"))
CKPT_KINDS = {"fp8_vl": {}, "bf16_text": {"fp8": False, "vl": False, "seed": 1},
              "fp8_text": {"vl": False, "seed": 1}, "bf16_vl": {"fp8": False},
              "fp8_vl_seed1": {"seed": 1}, "fp8_vl_seed2": {"seed": 2}}


def make_kind(kind: str, out_dir: str) -> str:
    """A tiny original checkpoint of that kind (CKPT_KINDS, seeds shifted by TINY_SEED_OFFSET) in out_dir."""
    from tiny_checkpoint import make_checkpoint
    kw = dict(CKPT_KINDS[kind])
    kw["seed"] = kw.get("seed", 0) + SEED_OFFSET
    return make_checkpoint(out_dir, **kw)


def load_tp1(tp_dir: str, device="cpu"):
    """The TP=1 model of a converted tp1 directory."""
    import config
    import model as M
    cfg, vl, _ = config.load_config(os.path.join(tp_dir, "config-r0.json"))
    return M.Step5ForCausalLM.from_shard(os.path.join(tp_dir, "model-r0.safetensors"), cfg, device, vl, rank=0)


class _Checkpoints(dict):
    def __init__(self, base):
        super().__init__()
        self.base = base

    def __missing__(self, kind):
        self[kind] = make_kind(kind, str(self.base / kind))
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
    loaded = {}

    def get(kind, device="cpu"):
        if (kind, device) not in loaded:
            loaded[kind, device] = load_tp1(converted(kind, 1), device)
        return loaded[kind, device]
    return get


# The interpreted model run (tests/interpreted_run.py): started in a process of its own as soon as the session knows a
# selected test needs it, so its single core of work overlaps the other tests; the fixture waits for it.
_BACKGROUND = {}


def _start_interpreted_run(tmp_dir: str):
    import subprocess
    out = os.path.join(tmp_dir, "interpreted_run.pt")
    log = os.path.join(tmp_dir, "interpreted_run.log")
    with open(log, "w") as f:  # the child keeps its own handle
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "interpreted_run.py"), out], cwd=ROOT,
                                stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, TRITON_INTERPRET="1"))
    _BACKGROUND.update(proc=proc, out=out, log=log)


def pytest_collection_finish(session):
    if os.environ.get("TRITON_INTERPRET") == "1" and any(
            "interpreted_model_run" in getattr(item, "fixturenames", ()) for item in session.items):
        import tempfile
        _start_interpreted_run(tempfile.mkdtemp(prefix="interpreted_run_"))


def pytest_sessionfinish(session):
    proc = _BACKGROUND.get("proc")
    if proc is not None:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        import shutil
        shutil.rmtree(os.path.dirname(_BACKGROUND["out"]), ignore_errors=True)


@pytest.fixture(scope="session")
def interpreted_model_run():
    """tests/interpreted_run.py's run_model on the FP8 text model (the interpreter's CPU run only), computed in its
    own process from the start of the session. Shared by the model test (logits) and the sm90 build test
    (launches). -> (reference logits [2, 7, V], Triton logits [2, 7, V], {launch key: launch record})"""
    import tempfile

    import torch
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter's run (CPU CI)")
    if "proc" not in _BACKGROUND:
        _start_interpreted_run(tempfile.mkdtemp(prefix="interpreted_run_"))
    rc = _BACKGROUND["proc"].wait(timeout=1800)
    with open(_BACKGROUND["log"]) as f:
        log = f.read()
    assert rc == 0, f"tests/interpreted_run.py failed (exit {rc}):\n{log[-4000:]}"
    return torch.load(_BACKGROUND["out"], weights_only=False)
