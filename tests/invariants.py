"""Shared helpers for tests that compare two computations which legitimately differ in last bits.

Two discrete top-k choices (expert routing, DSA region selection) turn a last-bit difference at a near-tie into an
O(1) change, and greedy decoding turns a logit near-tie into another token. Tests therefore pin the discrete
decisions (model.Pins) and accept a token difference only where the model's own logits show a measured near-tie.
"""
import contextlib
import json
import os
import subprocess
import sys

import torch

import engine

# Rounding noise of pinned comparisons on the tiny checkpoints, as a multiple of std(logits): measured worst over
# seeds 1/11/21, prompts of 5/30/47 tokens, 6 steps, prefill+decode vs one-shot prefill: 0.031 (BF16 experts) and
# 0.074 (FP8 experts: a last-bit change of an activation moves its e4m3 code by a whole 3-bit-mantissa step).
# Unpinned router/region flips measured 0.4-0.6; a logic error (wrong position, stale cache) is O(1). Limits: 2x.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
NOISE = {"bf16": 0.06, "fp8": 0.15}


@contextlib.contextmanager
def pinned(model, pins):
    """Install a model.Pins instrument for the duration of a block."""
    model.set_pins(pins)
    try:
        yield pins
    finally:
        model.set_pins(None)


@torch.inference_mode()
def tokens_agree_up_to_near_tie(model, prompt: list, got: list, want: list, tol: float = NOISE["bf16"],
                                images: dict | None = None) -> int | None:
    """None when got == want. Otherwise the first step s where they differ must be a near-tie of `model` (TP=1,
    in-process) teacher-forced on prompt + want[:s] (with the request's image inputs): its logits of want[s] and
    got[s] lie within tol * std. Returns s; later tokens are not compared (the prefixes differ from there on)."""
    if got == want:
        return None
    s = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert s < min(len(got), len(want)), f"one completion is a prefix of the other: {got} vs {want}"
    ids = prompt + want[:s]
    cache = model.new_cache(1, len(ids) + 1)
    feats = engine.request_features(model, [ids], [images])[0]
    ids_t = torch.tensor(ids, device=model.lm_head.weight.device)
    logits = model.forward(ids_t, cache, [len(ids)], embeds=model.input_embeds(ids_t, feats))[0].float().cpu()
    gap = (logits[want[s]] - logits[got[s]]).abs().item()
    assert gap <= tol * logits.std().item(), (f"tokens differ at step {s} ({got[s]} vs {want[s]}) without a near-tie: "
                                              f"logit gap {gap:.4f}, std {logits.std().item():.3f}: {got} vs {want}")
    return s


def gen_and_dump(tp: int, tp_dir: str, batch: str, forced, pins, tmp, lengths, new: int, device="cpu",
                 launch=None) -> tuple:
    """One launch of tests/tp_logits_dump.py at TP=tp: generate.py's main() on the batch (its JSON document), then
    the teacher-forced dumps (free, and pinned to `pins` when given) -> (the CLI's tokens, the dump). launch(n, argv,
    env) -> subprocess.CompletedProcess starts the ranks (None: torchrun)."""
    spec = str(tmp / f"spec_tp{tp}.json")
    with open(spec, "w") as f:
        json.dump({"batch_file": batch, "new": new, "forced": forced, "pins": str(pins) if pins else None}, f)
    out = tmp / f"logits_tp{tp}.pt"
    env = dict(os.environ, DUMP_DEVICE=device, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    argv = [os.path.join(ROOT, "tests", "tp_logits_dump.py"), tp_dir, spec, str(out)]
    if launch is not None:
        r = launch(tp, argv, env)
    else:
        r = subprocess.run([TORCHRUN, "--standalone", f"--nproc-per-node={tp}", *argv], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "prefill:" in r.stderr and "decode:" in r.stderr
    doc = json.loads(r.stdout)
    assert doc["batch_size"] == 3 and [x["prompt_token_count"] for x in doc["results"]] == lengths
    return [x["completion_token_ids"] for x in doc["results"]], torch.load(out, weights_only=False)


def decisions_differ(a: dict, b: dict, req: int, last_pos: int) -> bool:
    """Whether two recorded Pins disagree on any routing / region decision of request `req` at positions <= last_pos
    (compared where both recorded it: rank 0 of a TP>1 run records only its own KV groups' regions)."""
    return any(not torch.equal(a[k], b[k]) for k in a.keys() & b.keys() if k[2] == req and k[3] <= last_pos)
