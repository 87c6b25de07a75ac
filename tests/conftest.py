import os
import sys

# The Triton interpreter must be chosen before any @triton.jit decorates a kernel (kernel.py is imported by several
# test files): CPU-only CI runs every Triton kernel under it. Set TRITON_INTERPRET=0 to run the kernels on a GPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
