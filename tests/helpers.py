"""Drivers and instruments of the engine and the model for tests: one batch on an engine made for it (generate), a
packed prefill without an engine (prefill), and test instruments installed onto existing objects: a started engine's
prefill and extension graphs that log each replay (record_replays), MTP drafts replaced by given tokens
(force_drafts); a tokenizer that counts the ids its calls make (Counting). For the TP=2 drivers (tests/*_tp2.py):
this rank's model from converted shards (rank_model), and one torchrun launch of a driver that returns both ranks'
JSON results (run_tp2); random prompt ids (ids).
"""
import json
import os
import random
import subprocess
import sys
import time

import torch

from engine import PREFILL_CHUNK, Engine, EngineConfig, Request, check_same_on_all_ranks, request_features
from sampling import Sampling
from speculative import Speculator


def generate(model, prompts: list, max_new_tokens: int, eos_ids=(), images: list | None = None,
             cuda_graph: bool = True, prefill_chunk: int = PREFILL_CHUNK, sampling: Sampling = Sampling(),
             speculative: int = 0) -> tuple[list, dict]:
    """Generation of a batch on an engine made for it -> (each request's generated ids, EOS included when emitted;
    stats). images: per request None or its image inputs (pixel_values [+ patch_pixel_values, num_patches] or
    image_embeds). Every request gets the same sampling (its own random stream, seeded alike)."""
    feats = request_features(model, prompts, images)
    eng = Engine(model, EngineConfig(max_batch=max(len(prompts), 1), prefill_chunk=prefill_chunk,
                                     max_context=max([len(p) for p in prompts] + [1]) + max_new_tokens
                                     + (speculative + 1 if speculative else 0),
                                     speculative=speculative, cuda_graph=cuda_graph))
    eng.start()
    reqs = [Request(list(p), max_new_tokens, frozenset(int(e) for e in eos_ids), sampling, f)
            for p, f in zip(prompts, feats)]
    t0 = time.perf_counter()
    with torch.inference_mode():
        eng.run(reqs)
    out = [r.out for r in reqs]
    check_same_on_all_ranks(out, eng.dev)
    stats = {"prompt_tokens": sum(len(p) for p in prompts), "new_tokens": sum(len(o) for o in out),
             "s": time.perf_counter() - t0}
    if eng.spec:
        stats.update(eng.spec.stats)
    return out, stats


def prefill(model, cache, prompts: list, features: list | None = None, progress=None,
            chunk: int | None = None) -> torch.Tensor:
    """Packed prefill of every prompt on top of what the cache holds (request b in cache row b) -> this rank's logits
    of each prompt's last token [B, V/tp]; at most `chunk` tokens of each prompt per pass. For tests that drive the
    model without an engine."""
    dev = model.lm_head.weight.device
    reqs = [Request(list(p), 0, features=f) for p, f in zip(prompts, features or [None] * len(prompts))]
    lens = [len(p) for p in prompts]
    step = chunk or max(lens)
    final = [None] * len(prompts)
    for o in range(0, max(lens), step):
        n = [min(max(L - o, 0), step) for L in lens]
        ids = torch.tensor([t for p, k in zip(prompts, n) for t in p[o:o + k]], dtype=torch.long, device=dev)
        embeds = None
        if any(f is not None for f in (features or [])):
            embeds = torch.cat([r.embeds(model, o, o + k) if r.features is not None else model.embed(
                torch.tensor(r.ids[o:o + k], dtype=torch.long, device=dev)) for r, k in zip(reqs, n)])
        hook = None if progress is None else (lambda i, layers, o=o: progress(o, i, layers))
        out = model.forward(ids, cache, n, embeds=embeds, progress=hook)  # [prompts with tokens in this pass, V/tp]
        for r, b in enumerate(b for b, k in enumerate(n) if k):
            if o + n[b] == lens[b]:
                final[b] = out[r]
    return torch.stack(final)


class _Logged:
    """A graph that appends (first position, real tokens, padded length) to `log` before each replay: its inputs are
    the ids (padded), the real count and the slot, whose cache length is the first position."""

    def __init__(self, graph, eng: Engine, log: list):
        self.graph, self.inputs, self.eng, self.log = graph, graph.inputs, eng, log

    def __call__(self):
        ids, real, slot = self.inputs
        self.log.append((int(self.eng.cache.lengths[slot]), int(real), ids.numel()))
        return self.graph()


def record_replays(eng: Engine, log: list):
    """Test instrument: every prefill and extension graph of a started engine logs each replay into `log` as (first
    position, real tokens, padded length), then replays."""
    for graphs in (eng.prefill_graphs, eng.extend_graphs):
        for n, g in graphs.items():
            graphs[n] = _Logged(g, eng, log)


def force_drafts(monkeypatch, ref: list, prompts: list, shift: int):
    """Test instrument: the MTP drafts replaced by plain greedy's own next tokens (shift 0) or wrong ones (shift 1).
    The MTP layers still run (their caches and rings as always); only the drafts they return are replaced. A slot
    whose last kept position is L holds the pending token at L + 1, its request's token L + 1 - len(prompt); the
    drafts are the tokens after it."""
    real = Speculator.draft

    def draft(self, slots, L):
        k = real(self, slots, L).shape[1]
        out = []
        for b, last in zip(self.e.cache.requests[slots].tolist(), L.tolist()):
            i0 = last + 2 - len(prompts[b]) if b < len(prompts) else -k
            out.append([(ref[b][i0 + j] + shift) % 1024 if 0 <= i0 + j < len(ref[b]) else 0 for j in range(k)])
        return torch.tensor(out, device=slots.device)
    monkeypatch.setattr(Speculator, "draft", draft)


class Counting:
    """A tokenizer that counts what its calls make (ids and calls), forwarding everything else."""

    def __init__(self, tok):
        self.tok, self.ids, self.calls, self.longest = tok, 0, 0, 0

    def __call__(self, text, **kw):
        out = self.tok(text, **kw)
        self.ids += len(out["input_ids"])
        self.calls += 1
        self.longest = max(self.longest, len(text))
        return out

    def __getattr__(self, name):
        return getattr(self.tok, name)


def ids(n: int, seed: int) -> list:
    """n random prompt ids of a tiny checkpoint's vocabulary (past its special and chat-marker ids)."""
    r = random.Random(seed)
    return [r.randrange(11, 1024) for _ in range(n)]


def rank_model(tp_dir: str):
    """This rank's model from the converted shards in tp_dir (the process group set up already)."""
    import config
    import model as M
    rank = int(os.environ["RANK"])
    cfg, vl, _ = config.load_config(os.path.join(tp_dir, f"config-r{rank}.json"))
    return M.Step5ForCausalLM.from_shard(os.path.join(tp_dir, f"model-r{rank}.safetensors"), cfg, "cpu", vl,
                                         rank=rank)


def run_tp2(driver: str, tp_dir: str, out) -> list:
    """tests/DRIVER run by torchrun on 2 CPU ranks over tp_dir -> each rank's JSON result (OUT.RANK.json)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        os.path.join(root, "tests", driver), tp_dir, str(out)], cwd=root,
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads(open(f"{out}.{rank}.json").read()) for rank in (0, 1)]
