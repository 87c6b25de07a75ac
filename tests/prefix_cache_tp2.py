"""The prefix store at TP > 1 (a test driver, run under torchrun).

    torchrun --standalone --nproc-per-node=2 tests/prefix_cache_tp2.py TP_DIR OUT

Each rank runs two conversations sharing a prefix of N tokens on an engine with a store (they arrive together: the
second copies what the first's prefill stored) and on an engine without one whose single slot reuses the prefix it
computed (each prefill in one pass); each rank writes OUT.{rank}.json with the second
request's cached tokens, first logprobs and tokens from both, for the test to compare across ranks and runs.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(__file__)]
import engine as E  # noqa: E402
from helpers import ids, rank_model  # noqa: E402

N = 40


@torch.inference_mode()
def main(tp_dir: str, out: str):
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    try:
        m = rank_model(tp_dir)
        P = ids(N, 1)
        a, b = P + ids(5, 2), P + ids(7, 3)
        runs = {}
        for name, gib, batch in (("store", 0.01, 2), ("slot", 0, 1)):
            eng = E.Engine(m, E.EngineConfig(max_batch=batch, max_context=128, prefix_cache_gib=gib,
                                             prefix_cache_min=0))
            eng.start()
            reqs = [E.Request(a, 3), E.Request(b, 4, logprobs=3)]  # a holds its slot while b is admitted
            eng.run(reqs) if batch == 2 else [eng.run([r]) for r in reqs]
            E.check_same_on_all_ranks([r.out for r in reqs], eng.dev)
            rb = reqs[1]
            runs[name] = {"cached": rb.cached, "slots": [r.slot for r in reqs], "out": rb.out,
                          "first": [rb.token_logprobs[0].logprob, rb.token_logprobs[0].top],
                          "prefilled": eng.prefill_tokens}
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump(runs, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
