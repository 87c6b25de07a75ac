"""Peak host memory of convert.py against the checkpoint size (it must stay bounded: tensors are read and sliced
one at a time, never the whole checkpoint). Not a CI test: run it by hand.

    .venv/bin/python tests/measure_convert_memory.py [--tp 2] [--keep DIR]

Makes a few-hundred-MB tiny Step-5 checkpoint, converts it in a child process and prints the child's peak RSS
(VmHWM), the RSS of a child that only imports convert (interpreter + torch), and the checkpoint size.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BIG = dict(moe_num_experts=64, moe_intermediate_size=512, hidden_size=512, num_hidden_layers=8,
           intermediate_size=1024, vocab_size=4096)


def child_peak_mib(code: str) -> float:
    """Peak RSS of a fresh interpreter running `code` (each measured in its own grandchild-free process)."""
    # VmHWM belongs to the process's own address space; ru_maxrss would also carry the forking parent's peak
    out = subprocess.run([sys.executable, "-c", code + "\nprint([l for l in open('/proc/self/status') "
                          "if l.startswith('VmHWM')][0].split()[1])"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1]) / 1024  # KiB


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--keep", help="write the checkpoint and output here instead of a temp dir")
    a = ap.parse_args()
    from tiny_checkpoint import make_checkpoint
    base = a.keep or tempfile.mkdtemp(prefix="convert_mem_")
    ckpt, out = os.path.join(base, "ckpt"), os.path.join(base, "out")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        make_checkpoint(ckpt, fp8=True, vl=True, text_overrides=BIG)
    size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    idle = child_peak_mib("import convert")
    t0 = time.time()
    peak = child_peak_mib(f"import convert; convert.main({ckpt!r}, {out!r}, tp_size={a.tp})")
    print(f"checkpoint {size / 2**20:.0f} MiB; convert at TP={a.tp}: peak RSS {peak:.0f} MiB "
          f"(interpreter + torch alone {idle:.0f} MiB, conversion adds {peak - idle:.0f} MiB) in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
