import os
import sys

# The Triton interpreter must be chosen before any @triton.jit decorates a kernel (kernel.py is imported by several
# test files): CPU-only CI runs every Triton kernel under it. Set TRITON_INTERPRET=0 to run the kernels on a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402

# Tiny checkpoints shared by the test files, each written once per session on first use.
CKPT_KINDS = {"fp8_vl": {}, "bf16_text": {"fp8": False, "vl": False, "seed": 1},
              "fp8_vl_seed1": {"seed": 1}, "fp8_vl_seed2": {"seed": 2}}


class _Checkpoints(dict):
    def __init__(self, base):
        super().__init__()
        self.base = base

    def __missing__(self, kind):
        from tiny_checkpoint import make_checkpoint
        self[kind] = make_checkpoint(str(self.base / kind), **CKPT_KINDS[kind])
        return self[kind]


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    """ckpts[kind] -> directory of a tiny original checkpoint (kinds: CKPT_KINDS)."""
    return _Checkpoints(tmp_path_factory.mktemp("ckpt"))
