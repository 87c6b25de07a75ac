"""Teacher-forced logits dump for cross-TP comparison (a test helper, run under torchrun).

    torchrun --standalone --nproc-per-node=N tests/tp_logits_dump.py TP_DIR SPEC.json OUT.pt

SPEC.json: {"batch_file": PATH (generate.py's batch form: ids lists, or {"prompt_ids", "image_inputs"}), "new": N, "forced": [[ids...], ...] or null, "pins": PATH or null}. First
generate.py's main() runs the batch file (its --prompt-json-batch, --max-new-tokens N, --json: the JSON document goes
to stdout) in the same process group, so one launch covers the CLI code path and the dump. Then the prompts are
replayed with the fixed decode tokens `forced` (null: the tokens generate.py just produced, less the last), same
count for every request: prefilled as one packed batch, then decoded teacher-forced, so the logits of every step
depend only on the fixed prefixes, never on the model's own greedy choices.

The replay runs twice: free (its routing and DSA selections recorded with model.Pins), and, when SPEC names a pins
file (another run's recording), with those decisions pinned. Rank 0 writes {"logits", "pinned_logits" (or None):
[steps+1, B, V] fp32 (full vocabulary, gathered in rank order), "pins": the free run's recorded decisions} to OUT.pt.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
import engine  # noqa: E402
import generate  # noqa: E402
import model as M  # noqa: E402
from helpers import prefill  # noqa: E402
from sampling import full_vocab  # noqa: E402


DEVICE = os.environ.get("DUMP_DEVICE", "cpu")  # cuda: NCCL and the GPU kernels


@torch.inference_mode()
def replay(m, prompts: list, images: list, forced: list) -> torch.Tensor:
    steps = len(forced[0])
    assert all(len(f) == steps for f in forced)
    cache = m.new_cache(len(prompts), max(len(p) for p in prompts) + steps + 1)
    out = [full_vocab(prefill(m, cache, prompts, engine.request_features(m, prompts, images))).cpu()]
    for s in range(steps):
        out.append(full_vocab(m.forward(torch.tensor([f[s] for f in forced], device=DEVICE), cache)).cpu())
    return torch.stack(out).float()


def main(tp_dir: str, spec_path: str, out_path: str):
    rank = int(os.environ["RANK"])
    dev = torch.device(DEVICE, int(os.environ["LOCAL_RANK"])) if DEVICE == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    try:
        with open(spec_path) as f:
            spec = json.load(f)
        with open(spec["batch_file"]) as f:
            entries = json.load(f)  # [ids...] or {"prompt_ids": [...], "image_inputs": file beside the batch file}
        base = os.path.dirname(spec["batch_file"])
        prompts = [e["prompt_ids"] if isinstance(e, dict) else e for e in entries]
        images = [generate.load_image_inputs(os.path.join(base, e["image_inputs"]))
                  if isinstance(e, dict) and "image_inputs" in e else None for e in entries]
        gen = generate.main(tp_dir, prompt_json_batch=spec["batch_file"], max_new_tokens=spec["new"], as_json=True,
                            device=dev.type, ignore_eos=True)  # every request NEW tokens, whatever the checkpoint
        forced = spec["forced"] or [o[:-1] for o in gen]
        cfg, vl, _ = config.load_config(os.path.join(tp_dir, f"config-r{rank}.json"))
        m = M.Step5ForCausalLM.from_shard(os.path.join(tp_dir, f"model-r{rank}.safetensors"), cfg, dev, vl)
        m.set_pins(M.Pins())
        free = replay(m, prompts, images, forced)
        recorded = m.pins.data
        pinned = None
        if spec["pins"]:
            m.set_pins(M.Pins(torch.load(spec["pins"], weights_only=False)))
            pinned = replay(m, prompts, images, forced)
        m.set_pins(None)
        if rank == 0:
            torch.save({"logits": free, "pinned_logits": pinned, "pins": recorded}, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter finalisation: see runtime.exit_now (gloo teardown abort)
