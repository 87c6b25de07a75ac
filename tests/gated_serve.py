"""Test instrument: serve.py whose engine, on every rank, holds the step that would start the prefill of a prompt of
GATE_TOKENS tokens until a file exists, and whose rank 0 holds the preparation of every body bigger than
serve_http.SMALL_BODY until another file exists, so a test acts while a step or a big preparation is in progress
(made deterministic: no clock decides what happens first).

    STEP5_GATE=DIR torchrun --standalone --nproc-per-node=2 tests/gated_serve.py <serve.py's flags>

Each rank writes DIR/reached<rank> when it holds the step, and goes on once DIR/open exists; rank 0 writes
DIR/preparing when it holds a big body, and goes on once DIR/prepare exists.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import engine  # noqa: E402
import runtime  # noqa: E402
import serve  # noqa: E402
import serve_http  # noqa: E402
import serve_requests  # noqa: E402

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
parse = serve_requests.parse_body


def held_parse(data, name):
    if len(data) > serve_http.SMALL_BODY:
        gate = os.environ["STEP5_GATE"]
        open(os.path.join(gate, "preparing"), "w").close()
        while not os.path.exists(os.path.join(gate, "prepare")):
            time.sleep(0.05)
    return parse(data, name)


serve_requests.parse_body = held_parse

if __name__ == "__main__":
    runtime.exit_now(runtime.run_cli(sys.argv[1:], serve.parse, serve.main))
