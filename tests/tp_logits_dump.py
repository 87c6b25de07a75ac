"""Teacher-forced logits dump for cross-TP comparison (a test helper, run under torchrun).

    torchrun --standalone --nproc-per-node=N tests/tp_logits_dump.py TP_DIR SPEC.json OUT.pt

SPEC.json: {"batch_file": PATH, "new": N, "forced": [[ids...], ...] or null}. First generate.py's main() runs the
batch file (its --prompt-json-batch, --max-new-tokens N, --json: the JSON document goes to stdout) in the same
process group, so one launch covers the CLI code path and the dump. Then the prompts are replayed with the fixed
decode tokens `forced` (null: the tokens generate.py just produced, less the last), same count for every request. The requests are prefilled as one packed
batch, then decoded teacher-forced, so the logits of every step depend only on the fixed prefixes, never on the
model's own greedy choices. Rank 0 writes {"logits": [steps+1, B, V] fp32} (full vocabulary, gathered in rank order
with model.tp_gather) to OUT.pt.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import generate  # noqa: E402
import kernel  # noqa: E402
import config  # noqa: E402
import model as M  # noqa: E402

_routes = []
_route = kernel.route


def _recording_route(*a, **k):
    ids, w = _route(*a, **k)
    _routes.append(ids.sort(-1).values)
    return ids, w


kernel.route = _recording_route


def full_vocab(logits: torch.Tensor) -> torch.Tensor:
    return M.tp_gather(logits.contiguous()).permute(1, 0, 2).flatten(1)  # [B, V] in rank order


@torch.inference_mode()
def main(tp_dir: str, spec_path: str, out_path: str):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    try:
        cfg, vl, _ = config.load_config(os.path.join(tp_dir, f"config-r{rank}.json"))
        assert cfg.tp_size == world, (cfg.tp_size, world)
        M.set_parallel(world, rank)
        m = M.Step5ForCausalLM.from_shard(os.path.join(tp_dir, f"model-r{rank}.safetensors"), cfg, "cpu", vl)
        with open(spec_path) as f:
            spec = json.load(f)
        with open(spec["batch_file"]) as f:
            prompts = json.load(f)
        gen = generate.main(tp_dir, prompt_json_batch=spec["batch_file"], max_new_tokens=spec["new"], ep_size=world,
                            as_json=True)
        forced = spec["forced"] or [o[:-1] for o in gen]
        _routes.clear()
        steps = len(forced[0])
        assert all(len(f) == steps for f in forced)
        lens = [len(p) for p in prompts]
        cache = m.new_cache(len(prompts), max(lens) + steps + 1)
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long)
        last = torch.tensor(lens).cumsum(0) - 1
        out = [full_vocab(m.forward(ids, cache, lens))]
        routes = [torch.stack(_routes, 1)[last] if _routes else torch.zeros(len(lens), 0, 0, dtype=torch.long)]
        for s in range(steps):
            _routes.clear()
            tok = torch.tensor([f[s] for f in forced], dtype=torch.long)
            out.append(full_vocab(m.forward(tok, cache)))
            routes.append(torch.stack(_routes, 1) if _routes else routes[0])
        if rank == 0:
            torch.save({"logits": torch.stack(out).float(), "routes": torch.stack(routes)}, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter finalisation: see the end of generate.py (gloo teardown abort)
