"""Constrained, penalised, biased and logprob requests at TP > 1 (a test driver, run under torchrun).

    torchrun --standalone --nproc-per-node=2 tests/structured_tp2.py TP_DIR OUT

Each rank loads its shard and the tokenizer beside the shards, builds its own grammar matchers (no per-step mask
broadcast) and runs the same requests on a plain engine and on a speculative one (when the shards keep MTP layers);
each rank writes OUT.{rank}.json: {"0" | "2": [{"out", "finish", "logprobs": [[logprob, [[id, logprob], ...]], ...],
"prompt_logprobs"}, ...]} for the test to compare across ranks and check.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(__file__)]
import choice  # noqa: E402
import engine as E  # noqa: E402
import grammar as G  # noqa: E402
from helpers import rank_model  # noqa: E402
from sampling import Sampling  # noqa: E402
from test_grammar import CHOICES, REGEX, schemas  # noqa: E402

EOS = 4


def requests(end: int) -> list:
    cs = schemas()[:3] + [G.Constraint(G.Kind.REGEX, REGEX), G.Constraint.choice(CHOICES),
                          G.Constraint(G.Kind.JSON_OBJECT)]
    reqs = [E.Request([0, 3, 20 + i, 30 + i, 41], 40, frozenset({EOS}), Sampling(1.0, seed=i), constraint=c,
                      reasoning=choice.Reasoning(end, 3), logprobs=2) for i, c in enumerate(cs)]
    reqs += [E.Request([0, 3, 60, 61, 62, 63], 10, frozenset({EOS}),
                       Sampling(0.7, top_p=0.9, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                                repetition_penalty=1.2, logit_bias={100: 5.0, 200: -100.0}, seed=9), logprobs=3),
             E.Request([0, 3, 70, 71], 8, frozenset(), logprobs=0, echo=True),
             E.Request([0, 3, 80, 81, 82], 0, frozenset(), logprobs=1, echo=True)]
    return reqs


@torch.inference_mode()
def main(tp_dir: str, out: str):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    try:
        m = rank_model(tp_dir)
        cfg = m.cfg
        tokf = os.path.join(tp_dir, "..", "tokenizer_files", "tokenizer.json")
        grammars = G.Grammars(tokf, cfg.vocab_size, EOS)
        from transformers import PreTrainedTokenizerFast
        end = PreTrainedTokenizerFast(tokenizer_file=tokf).convert_tokens_to_ids("</think>")
        runs = {}
        for k in ([0, 2] if cfg.mtp_layers_kept >= 2 else [0]):
            eng = E.Engine(m, E.EngineConfig(max_batch=4, max_context=128, speculative=k), grammars=grammars)
            eng.start()
            reqs = eng.run(requests(end))
            E.check_same_on_all_ranks([r.out for r in reqs], eng.dev)
            runs[str(k)] = [{"out": r.out, "finish": str(r.finish), "logprobs": r.token_logprobs,
                             "prompt_logprobs": r.prompt_logprobs} for r in reqs]
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump(runs, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    assert world > 1


if __name__ == "__main__":
    main(*sys.argv[1:3])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter finalisation: see runtime.exit_now (gloo teardown abort)
