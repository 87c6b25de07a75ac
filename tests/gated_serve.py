"""Test instrument: serve.py whose engine, on every rank, holds the step that would start the prefill of a prompt of
GATE_TOKENS tokens until a file exists, so a test acts while a step is in progress (a long prefill, made
deterministic: no clock decides what happens first).

    STEP5_GATE=DIR torchrun --standalone --nproc-per-node=2 tests/gated_serve.py <serve.py's flags>

Each rank writes DIR/reached<rank> when it holds the step, and goes on once DIR/open exists.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import engine  # noqa: E402
import runtime  # noqa: E402
import serve  # noqa: E402

GATE_TOKENS = 77
step = engine.Engine.step


def held(self):
    if any(len(r.ids) == GATE_TOKENS and r.prefilled == 0 for r in self.waiting + self.running):
        gate = os.environ["STEP5_GATE"]
        open(os.path.join(gate, f"reached{os.environ['RANK']}"), "w").close()
        while not os.path.exists(os.path.join(gate, "open")):
            time.sleep(0.05)
    return step(self)


engine.Engine.step = held

if __name__ == "__main__":
    runtime.exit_now(runtime.run_cli(sys.argv[1:], serve.parse, serve.main))
