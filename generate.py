"""Generation with Step-5 on converted per-rank shards, under torchrun: greedy, or sampled with --temperature > 0.

    torchrun --standalone --nproc-per-node=N generate.py --tp-dir OUT/tpN --prompt "..."
    torchrun ... generate.py --tp-dir OUT/tpN --prompt "..." --temperature 0.7 --top-p 0.9 [--top-k 50] [--seed 0]
    torchrun ... generate.py --tp-dir OUT/tpN --prompt-json ids.json [--image-inputs image-inputs.safetensors]
    torchrun ... generate.py --tp-dir OUT/tpN --prompt-json-batch batch.json
    torchrun ... generate.py --tp-dir OUT/tpN --prompt "What is in <image>?" --image photo.jpg
    torchrun ... generate.py --tp-dir OUT/tpN --prompt "..." --speculative 3   # shards from convert.py --keep-mtp

TP comes from the shard config and must equal WORLD_SIZE. NCCL on GPUs, gloo on CPU. Rank 0 prepares the prompts
and prints; every rank validates what it receives. Any failure on any rank ends every rank with one message.

The decoding loop lives here, not in model.py (gpt-fast's prefill / decode step / generate): the model computes
logits; this file chooses tokens, captures the decode step as a CUDA graph, stops requests at EOS and times it all.
"""
import argparse
import datetime
import itertools
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import config
import image_processing
import model as M

IMAGE_KEYS = ("pixel_values", "patch_pixel_values", "num_patches", "image_embeds")
PROGRESS_AFTER_S = 5.0  # a prefill that runs longer than this reports its progress on rank 0
MAX_LISTED = 10  # bad requests listed in one message
# tokens per prompt per prefill pass. H200, one TP=8 rank's layers (bench_prefill.py, 2026-12-02), 128k tokens, 92
# layers' kernels back to back: 6.46 / 6.21 / 6.10 s at chunks of 8192 / 16384 / 32768; a sliding layer's chunk takes
# 3-4 ms to enqueue at 8192 and at 16384 (2.0 / 3.6 ms of kernels), so at 8192 the host bound the prefill (6.64 s);
# a layer's peak memory 2.7 / 4.4 / 8.0 GiB
PREFILL_CHUNK = 16384


class UserError(Exception):
    """Bad input: reported as one message naming the file, key or value."""


# --------------------------------------------------------------------------------------------------
# decoding


def full_vocab(logits: torch.Tensor) -> torch.Tensor:
    """This rank's logits window [B, V/tp] -> the full-vocabulary logits [B, V], bit-identical on every rank (every
    rank gathers the same windows in rank order)."""
    return M.tp_gather(logits).permute(1, 0, 2).flatten(1)  # [world, B, V/tp] -> [B, V]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Global argmax over the rank-ordered vocabulary windows (lowest id on ties): [B, V/tp] -> [B] int64, the same
    on every rank."""
    return full_vocab(logits).argmax(-1)


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator) -> torch.Tensor:
    """A draw from softmax(logits / temperature) restricted to the top_k most likely tokens (0: no limit), then to
    the top_p nucleus of what is left (1: no limit): [B, V/tp] -> [B] int64, the same on every rank.

    The nucleus is the smallest set of most likely tokens whose probability mass reaches top_p (at least one token).
    Every rank holds the same full-vocabulary logits and a generator seeded the same way, so every rank draws the
    same token without a broadcast. Torch ops with shapes fixed by the arguments: no host sync. The random streams
    of CPU and CUDA generators differ: a seed reproduces a run on the same device type, not across them.
    """
    x = full_vocab(logits).float()  # [B, V] fp32
    x = (x - x.amax(-1, keepdim=True)) / temperature  # largest 0: a tiny temperature gives -inf, never inf - inf
    ids = None
    if top_k > 0 or top_p < 1:
        # most likely first; stable, so tied logits keep the lowest id first (as greedy's argmax)
        x, ids = x.sort(dim=-1, descending=True, stable=True)
        if top_k > 0:
            x, ids = x[:, :top_k], ids[:, :top_k]  # [B, min(k, V)]
    probs = x.softmax(-1)
    if top_p < 1:
        # The mass of the more likely tokens (0 for the first, which always stays), summed in 2^-48 fixed point:
        # integer sums are exact in any order, while a float cumsum on CUDA may round differently between runs and
        # so move the nucleus boundary on one rank.
        q = (probs * 2.0 ** 48).long()
        probs = probs.masked_fill(q.cumsum(-1) - q >= int(top_p * 2 ** 48), 0.0)
    # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with probability p_i / sum(p), so the masked
    # probabilities need no renormalising. The clamp keeps a (rare) exact 0 draw from dividing by zero.
    e = torch.empty_like(probs).exponential_(generator=generator).clamp_min_(torch.finfo(probs.dtype).tiny)
    choice = (probs / e).argmax(-1)  # [B], an index into x's columns
    return choice if ids is None else ids.gather(-1, choice[:, None])[:, 0]


def check_sampling(temperature: float, top_k: int, top_p: float, seed: int):
    """The sampling settings, validated: UserError naming the flag and its value."""
    if not 0 <= temperature < float("inf"):
        raise UserError(f"--temperature {temperature} must be a finite number >= 0 (0 is greedy decoding)")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p {top_p} must be in (0, 1] (1 keeps every token)")
    if top_k < 0:
        raise UserError(f"--top-k {top_k} must be >= 0 (0 keeps every token)")
    if temperature == 0 and (top_k != 0 or top_p != 1):
        flag = f"--top-k {top_k}" if top_k != 0 else f"--top-p {top_p}"
        raise UserError(f"{flag} needs --temperature > 0 (temperature 0 is greedy decoding)")
    if not 0 <= seed < 2 ** 64:
        raise UserError(f"--seed {seed} must be in [0, 2**64)")


class DecodeStep:
    """A step function with static shapes and no host sync, replayed as a CUDA graph when `graph` is set.

    fn(*inputs) -> output. `state()` names tensors that fn updates in place (the cache lengths): the warm-up and
    capture runs restore them, so only replays advance the state. The warm-up also writes K/V, pending indexer rows
    and ring slots at the next position, which the first real step overwrites. Call reset() whenever the tensors fn
    reads change shape (a compacted cache): the next call captures again.
    """

    def __init__(self, fn, graph: bool, state=lambda: ()):
        self.fn, self.use_graph, self.state = fn, graph, state
        self.graph = None

    def reset(self):
        self.graph = None

    def __call__(self, *inputs):
        if not self.use_graph:
            return self.fn(*inputs)
        if self.graph is None:
            self._capture(inputs)
        for s, x in zip(self.inputs, inputs):
            s.copy_(x)
        self.graph.replay()
        return self.out

    def _capture(self, inputs):
        self.inputs = [x.clone() for x in inputs]
        saved = [s.clone() for s in self.state()]

        def restore():
            for s, v in zip(self.state(), saved):
                s.copy_(v)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compilation and library workspaces happen outside capture
            self.fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        restore()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # collectives are captured with the rest
            self.out = self.fn(*self.inputs)
        restore()  # capture records without running; keep the state exact anyway


def prompt_embeds(model: M.Step5ForCausalLM, prompts: list, images: list | None = None) -> torch.Tensor:
    """Packed input rows [T, D] bf16 of the prompts: token embeddings, and each request's image features at its
    placeholders. images: per request None or a dict of image inputs (pixel_values [+ patch_pixel_values,
    num_patches] or image_embeds). A request whose placeholders and features disagree raises ValueError naming it."""
    dev = model.lm_head.weight.device
    rows = []
    for i, (ids, img) in enumerate(zip(prompts, images or [None] * len(prompts))):
        try:
            feats = model.image_features(**img) if img else None
            rows.append(model.input_embeds(torch.tensor(ids, device=dev), feats))
        except ValueError as e:
            raise ValueError(f"request {i}: {e}") from None
    return torch.cat(rows)


def prefill(model: M.Step5ForCausalLM, cache: M.Cache, prompts: list, embeds=None, progress=None,
            chunk: int | None = None) -> torch.Tensor:
    """Packed prefill of every prompt on top of what the cache holds -> this rank's logits of each prompt's last
    token [B, V/tp]. With `chunk`, at most that many tokens of each prompt go through the model per pass, so the
    activation memory is set by the chunk, not the prompt. embeds: the packed prompts' input rows [T, D] or None;
    an image block may straddle chunks (its rows are sliced like the ids). progress(first token, layer, layers)."""
    dev = model.lm_head.weight.device
    lens = [len(p) for p in prompts]
    starts = [e - n for e, n in zip(itertools.accumulate(lens), lens)]
    step = chunk or max(lens)
    final = [None] * len(prompts)
    for o in range(0, max(lens), step):
        n = [min(max(L - o, 0), step) for L in lens]  # this pass's tokens of each prompt (0: that prompt is done)
        ids = torch.tensor([t for p, k in zip(prompts, n) for t in p[o:o + k]], dtype=torch.long, device=dev)
        rows = None if embeds is None else torch.cat([embeds[s + o:s + o + k] for s, k in zip(starts, n)])
        hook = None if progress is None else (lambda i, layers, o=o: progress(o, i, layers))
        out = model.forward(ids, cache, n, rows, hook)  # [prompts with tokens in this pass, V/tp]
        for r, b in enumerate(b for b, k in enumerate(n) if k):
            if o + n[b] == lens[b]:
                final[b] = out[r]
    return torch.stack(final)


@torch.inference_mode()
def generate(model: M.Step5ForCausalLM, prompts: list, max_new_tokens: int, eos_ids, embeds=None,
             cuda_graph: bool = True, progress=None, prefill_chunk: int | None = None, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> tuple[list, dict]:
    """Decoding of a packed batch -> (each request's generated ids, EOS included when emitted; timings).

    Greedy when temperature is 0 (the default), else `sample` with one generator seeded with `seed`: the same
    seed reproduces the batch's tokens (on the same device type; a request's draws depend on the batch it is in).
    embeds: the packed prompts' input rows [T, D] (prompt_embeds: image features placed), or None for plain token
    embeddings. A request that emits EOS leaves the batch: its cache rows are compacted away before the next
    step. The host reads each step's tokens only after the next step has been queued, so the device never waits.
    """
    check_sampling(temperature, top_k, top_p, seed)
    B = len(prompts)
    if B == 0:
        return [], {}
    dev = model.lm_head.weight.device
    if temperature == 0:
        choose = greedy
    else:
        gen = torch.Generator(device=dev).manual_seed(seed)  # one stream per run, seeded alike on every rank

        def choose(logits):
            return sample(logits, temperature, top_k, top_p, gen)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    cache = model.new_cache(B, max(len(p) for p in prompts) + max_new_tokens)
    logits = prefill(model, cache, prompts, embeds, progress, prefill_chunk)
    sync()
    t1 = time.perf_counter()
    out = [[] for _ in range(B)]
    live = list(range(B))  # request index of each cache row
    eos = set(int(e) for e in eos_ids)
    # installed test Pins read decisions on the host, which a replayed graph would skip: they run the steps eagerly
    step = DecodeStep(lambda t: model.forward(t, cache), cuda_graph and dev.type == "cuda" and model.pins is None,
                      state=lambda: (cache.lengths,))
    tok = choose(logits) if max_new_tokens > 0 else None
    for i in range(max_new_tokens):
        last = i == max_new_tokens - 1
        if not last:
            logits = step(tok)  # queued before the host reads tok below
        finished = []
        for row, t in enumerate(tok.tolist()):
            out[live[row]].append(t)
            if t in eos:
                finished.append(row)
        if last or len(finished) == len(live):
            break
        if finished:
            keep = [r for r in range(len(live)) if r not in finished]
            rows = torch.tensor(keep, device=dev)
            cache.keep(rows)
            step.reset()
            logits, live = logits.index_select(0, rows), [live[r] for r in keep]
        tok = choose(logits)
    sync()
    n_dec = sum(max(len(o) - 1, 0) for o in out)  # the first token of each request comes from the prefill
    stats = {"prefill_tokens": sum(len(p) for p in prompts), "prefill_s": t1 - t0, "decode_tokens": n_dec,
             "decode_s": time.perf_counter() - t1}
    check_same_on_all_ranks(out, dev)
    return out, stats


@torch.inference_mode()
def speculative(model: M.Step5ForCausalLM, prompts: list, max_new_tokens: int, eos_ids, k: int, embeds=None,
                draft_hook=None, state: dict | None = None, cuda_graph: bool = True) -> tuple[list, dict]:
    """Greedy decoding with the checkpoint's own MTP layers as the drafter -> (ids per request, stats).

    Each round feeds the pending token and k drafts as one decode step of k + 1 tokens per row of the main model
    (verify); the longest prefix of drafts equal to the main model's argmax is accepted, plus the main model's next
    token, so every emitted token is the main model's greedy choice at its position whatever the drafts. Rejected
    rows are rolled back by resetting the cache lengths: the sliding rings carry k spare slots, so a rejected row
    never overwrote a key that a kept row still needs; K/V, pending indexer rows and region summaries at rejected
    positions are rewritten before any kept query reads them. Requests accept independently.

    Drafting: MTP depth j's row at position p reads depth j-1's residual at p (depth -1: the main model's) and the
    token at p + j + 1; depth j's draft is its row at the last kept position L. Rows past L - j read drafts, so they
    are provisional; each round therefore recomputes, at depth j, the k + 1 + j positions L - k - j .. L (clamped
    at 0) as one static-shape decode step of the MTP layer: every provisional row of the last round is among them,
    and final rows come out the same. Residuals and tokens of recent positions live in device rings (position p in
    slot p mod S), so verify and draft steps are replayed as CUDA graphs on GPUs; the host reads each round's
    argmax tokens (to accept and to stop) and drafts.
    draft_hook(requests, emitted, drafts [B, k]) -> drafts lets tests force drafts; a `state` dict receives the final
    caches and, per depth and row, the first position whose MTP row may be provisional (tests compare the rows before
    it with a one-pass absorb).
    """
    B = len(prompts)
    if not 1 <= k <= model.cfg.mtp_layers_kept:
        raise ValueError(f"speculative decoding with {k} drafts needs {k} MTP layers; the shards keep "
                         f"{model.cfg.mtp_layers_kept} (convert.py --keep-mtp)")
    dev = model.lm_head.weight.device
    t0 = time.perf_counter()
    cap = max(len(p) for p in prompts) + max_new_tokens + k + 1
    cache, mtps = model.new_cache(B, cap, slack=k), model.new_mtp_caches(B, cap, slack=2 * k)
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)
    lens = [len(p) for p in prompts]
    starts = [e - n for e, n in zip(itertools.accumulate(lens), lens)]
    hidden = model.forward_rows(ids, cache, lens, embeds)  # [T, D]: every prompt row feeds the first MTP layer
    ends = torch.tensor([s + n - 1 for s, n in zip(starts, lens)], device=dev)
    pending = greedy(model.logits(hidden[ends])).tolist()  # [B]: the main model's next token, emitted, not fed

    # rings of the last S positions: residuals of the main model (ring 0) and of each depth (ring j + 1), tokens
    S, D = 4 * k + 4, model.cfg.hidden_size
    rings = {"h": torch.zeros(k + 1, B, S, D, device=dev), "tok": torch.zeros(B, S, dtype=torch.long, device=dev)}

    def put(ring, b, first, rows):  # rows [n, ...] of request b at positions first .. first + n - 1 (host counts)
        keep = min(S, rows.shape[0])
        at = torch.arange(first + rows.shape[0] - keep, first + rows.shape[0], device=dev) % S
        ring[b, at] = rows[-keep:]

    # the prompt: each depth absorbs every prompt row in one prefill-style pass (drafts chained from the last one).
    # At image positions an MTP row reads the placeholder token's embedding as its next token (a choice: the release
    # drops the MTP layers, and the main model's rows there already carry the image features in their residuals)
    ext = [p + [t] for p, t in zip(prompts, pending)]
    prev, drafts = hidden, [[0] * k for _ in range(B)]
    for b in range(B):
        put(rings["h"][0], b, 0, hidden[starts[b]:starts[b] + lens[b]])
        put(rings["tok"], b, 0, torch.tensor(ext[b], device=dev))
    for j in range(k):
        nxt = torch.tensor([ext[b][p + j + 1] for b in range(B) for p in range(lens[b])], device=dev)
        prev, lg = model.mtp(j, prev, nxt, mtps[j], lens)
        for b, d in enumerate(greedy(lg[ends]).tolist()):
            drafts[b][j] = d
            ext[b].append(d)
            put(rings["h"][j + 1], b, 0, prev[starts[b]:starts[b] + lens[b]])

    def verify_fn(fed_ids):  # [R, k + 1] -> residuals [R*(k+1), D], the main model's argmax after each row [R*(k+1)]
        h = model.forward_rows(fed_ids, cache)
        return h, greedy(model.logits(h))

    def draft_fn(L, p0, h_main, main):
        """After a verify fed at positions p0 [R] (kept through L [R]): ring writes, then each depth's k + 1 + j rows
        -> drafts [R, k]. Static shapes: rows past L (a clamped start, rejected verify rows) are never read as
        final, and later rounds overwrite them before any kept row needs them."""
        R = L.shape[0]
        r_ = torch.arange(R, device=dev)[:, None]
        steps = p0[:, None] + torch.arange(k + 1, device=dev)  # [R, k+1]: positions of the verify rows
        rings["h"][0][r_, steps % S] = h_main.view(R, k + 1, D)
        rings["tok"][r_, (steps + 1) % S] = main.view(R, k + 1)  # main[j]: the token after position p0 + j
        out = torch.zeros(R, k, dtype=torch.long, device=dev)
        for j in range(k):
            q = k + 1 + j
            first = (L - k - j).clamp(min=0)
            pos = first[:, None] + torch.arange(q, device=dev)  # [R, q]
            t = pos + j + 1  # the token each row reads: final up to L + 1, then this round's drafts
            i = (t - L[:, None] - 2).clamp(0, k - 1)
            tok = torch.where(t <= L[:, None] + 1, rings["tok"][r_, t % S], out[r_, i])
            mtps[j].lengths.copy_(first)
            res, lg = model.mtp(j, rings["h"][j][r_, pos % S].view(R * q, D), tok.flatten(), mtps[j], None, q)
            rings["h"][j + 1][r_, pos % S] = res.view(R, q, D)
            out[:, j] = greedy(lg.view(R, q, -1)[r_[:, 0], L - first])
        return out

    # installed test Pins read decisions on the host, which a replayed graph would skip: they run the steps eagerly
    graphs = cuda_graph and dev.type == "cuda" and model.pins is None
    verify = DecodeStep(verify_fn, graphs, state=lambda: (cache.lengths,))
    draft = DecodeStep(draft_fn, graphs)
    t1 = time.perf_counter()
    out = [[t] if max_new_tokens > 0 else [] for t in pending]
    live = [b for b in range(B) if max_new_tokens > 0]
    eos = set(int(e) for e in eos_ids)
    stats = {"prefill_tokens": sum(lens), "prefill_s": t1 - t0, "verify_steps": 0,
             "verify_rows": 0, "proposed": [0] * k, "accepted": [0] * k}

    def finished(b):
        return len(out[b]) >= max_new_tokens or out[b][-1] in eos

    rows = [r for r, b in enumerate(live) if not finished(b)]
    while rows:
        if len(rows) < len(live):  # requests that finished leave the batch: compact every cache and ring
            keep = torch.tensor(rows, dtype=torch.long, device=dev)
            for c in [cache] + mtps:
                c.keep(keep)
            rings["h"], rings["tok"] = rings["h"][:, keep], rings["tok"][keep]
            verify.reset()
            draft.reset()
            live, pending, drafts = [live[r] for r in rows], [pending[r] for r in rows], [drafts[r] for r in rows]
        if draft_hook is not None:
            drafts = draft_hook(live, out, drafts)
        fed = [[pending[r]] + drafts[r] for r in range(len(live))]  # [live, k + 1]
        start = cache.lengths.clone()
        hidden, main_ids = verify(torch.tensor(fed, device=dev))
        main = main_ids.view(len(live), k + 1).tolist()  # main[r][j]: the main model's argmax after fed[r][:j+1]
        stats["verify_steps"] += 1
        stats["verify_rows"] += len(live)  # one request verified
        counts = []
        for r, b in enumerate(live):
            a = 0
            while a < k and drafts[r][a] == main[r][a]:
                a += 1
            for j in range(k):
                stats["proposed"][j] += 1
                stats["accepted"][j] += j < a
            for t in main[r][:a + 1]:  # the accepted drafts (equal to the main model's argmax) and its next token
                if not finished(b):
                    out[b].append(t)
            counts.append(a + 1)
            pending[r] = main[r][a]
        counts = torch.tensor(counts, device=dev)
        cache.lengths.copy_(start + counts)  # roll back the rejected rows
        drafts = draft(start + counts - 1, start, hidden, main_ids).tolist()
        rows = [r for r, b in enumerate(live) if not finished(b)]
    stats["decode_tokens"] = sum(max(len(o) - 1, 0) for o in out)
    stats["decode_s"] = time.perf_counter() - t1
    if state is not None:  # depth j's rows at positions <= L - j read final tokens only (L: the last kept position,
        # capped at the last one fed of the output)
        last = (cache.lengths - 1).tolist()
        fin = [[min(L, len(prompts[b]) + len(out[b]) - 2) - j + 1 for L, b in zip(last, live)] for j in range(k)]
        state.update(cache=cache, mtps=mtps, fin=fin, live=live)
    check_same_on_all_ranks(out, dev)
    return out, stats


def check_same_on_all_ranks(out: list, device):
    """Every rank must have produced the same tokens: checked once at the end, not assumed."""
    if M.world_size == 1:
        return
    flat = torch.tensor([len(o) for o in out] + [t for o in out for t in o], dtype=torch.long, device=device)
    n = torch.tensor([flat.numel()], dtype=torch.long, device=device)
    if not bool((M.tp_gather(n) == n).all()):
        raise RuntimeError("ranks generated different numbers of tokens")
    if not bool((M.tp_gather(flat) == flat).all()):
        raise RuntimeError("ranks generated different tokens")


# --------------------------------------------------------------------------------------------------
# inputs


def load_tokenizer(path: str):
    """The converted tokenizer, loaded directly from tokenizer.json as a fast tokenizer (no class auto-selection:
    transformers 5.x maps the legacy class name to an implementation that mangles long byte-level BPE prompts)."""
    from transformers import PreTrainedTokenizerFast
    tj, tc = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer_config.json")
    for f in (tj, tc):
        if not os.path.isfile(f):
            raise UserError(f"{f}: missing (the tokenizer needs tokenizer.json and tokenizer_config.json)")
    try:
        with open(tc) as f:
            conf = json.load(f)
    except json.JSONDecodeError as e:
        raise UserError(f"{tc}: not valid JSON ({e})") from None
    special = {k: v for k, v in conf.items() if k in ("bos_token", "eos_token", "pad_token", "unk_token")
               and isinstance(v, str)}
    tok = PreTrainedTokenizerFast(tokenizer_file=tj, **special)
    template = conf.get("chat_template")
    jinja = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        with open(jinja) as f:
            template = f.read()
    tok.chat_template = template
    return tok


def find_tokenizer(tp_dir: str, explicit: str | None):
    if explicit:
        return load_tokenizer(explicit)
    for d in (os.path.join(tp_dir, "tokenizer_files"), os.path.join(tp_dir, os.pardir, "tokenizer_files")):
        if os.path.isfile(os.path.join(d, "tokenizer.json")):
            return load_tokenizer(d)
    return None


def read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, not a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None


def check_ids(ids, where: str, cfg: config.Step5Config, max_new_tokens: int) -> list:
    if not isinstance(ids, list) or not ids:
        raise UserError(f"{where}: a prompt must be a non-empty list of token ids")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise UserError(f"{where}: token {i} is {t!r}, not an integer id")
        if not 0 <= t < cfg.vocab_size:
            raise UserError(f"{where}: token id {t} (position {i}) is outside the vocabulary [0, {cfg.vocab_size})")
    if len(ids) + max_new_tokens > cfg.max_position_embeddings:
        raise UserError(f"{where}: {len(ids)} prompt tokens + {max_new_tokens} new tokens exceed "
                        f"max_position_embeddings={cfg.max_position_embeddings}")
    return ids


ID_FORMS = '[ids...] or {"prompt_ids": [ids...]}'
REQUEST_FORMS = ('[ids...], {"prompt_ids": [ids...], "image_inputs": "prepared.safetensors"} or '
                 '{"prompt": "text", "images": ["photo.jpg", ...]} ("image_inputs" and "images" optional)')
IMAGE_MARKER = "<image>"  # where a text prompt places an image block; without markers the images lead the text


def prepare_requests(a: dict, cfg: config.Step5Config, vl, tok) -> list:
    """Rank 0: [(prompt ids, image inputs: a file path, a dict of prepared tensors, or None)], validated; every bad
    batch request is listed."""
    def chat(text, where, images=()):
        if not isinstance(text, str):
            raise UserError(f'{where}: "prompt" must be a string, got {type(text).__name__} {text!r}')
        if tok is None:
            raise UserError(f"{where}: a text prompt needs a tokenizer: none found in <tp-dir>/../tokenizer_files; "
                            "pass --tokenizer")
        marks = text.count(IMAGE_MARKER)
        if marks and marks != len(images):
            raise UserError(f"{where}: the text holds {marks} {IMAGE_MARKER} marker(s) for {len(images)} image(s)")
        if images and not marks:  # no markers: the images come first in the user turn, in order
            text = IMAGE_MARKER * len(images) + text
        if a["raw_prompt"]:
            rendered = text
        elif not tok.chat_template:
            raise UserError("the tokenizer has no chat template; use --raw-prompt to tokenize plain text")
        else:
            rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True)
        if not images:
            return tok(rendered, add_special_tokens=a["raw_prompt"])["input_ids"], None
        # each marker becomes that image's placeholder block (crops, then the overview), built from the tokenizer
        batch = image_processing.preprocess([image_processing.load_image(f) for f in images], vl.vision)
        blocks = [image_processing.image_block_ids(tok, lay, vl.vision) for lay in batch.layouts]
        pieces = rendered.split(IMAGE_MARKER)
        ids = tok(pieces[0], add_special_tokens=a["raw_prompt"])["input_ids"]
        for block, piece in zip(blocks, pieces[1:]):
            ids += block + tok(piece, add_special_tokens=False)["input_ids"]
        return ids, batch.model_inputs()

    def text_request(text, images, where):
        images = list(images or [])
        if images and vl is None:
            raise UserError(f"{where}: images given but the shards hold a text-only model")
        if images and tok.convert_tokens_to_ids(image_processing.IMAGE_TOKENS[0]) != vl.image_token_id:
            raise UserError(f"the tokenizer's {image_processing.IMAGE_TOKENS[0]} id differs from the config's "
                            f"image_token_id={vl.image_token_id}")
        try:
            ids, inputs = chat(text, where, images)
        except ValueError as e:  # image_processing: an unreadable file, or a tokenizer without the image tokens
            raise UserError(f"{where}: {e}") from None
        extra = f" (with {len(images)} image block(s))" if images else ""
        return check_ids(ids, where + extra, cfg, new), inputs

    new = a["max_new_tokens"]
    if a["prompt"] is not None:
        ids, inputs = text_request(a["prompt"], a["images"], "--prompt")
        return [(ids, inputs or a["image_inputs"])]
    if a["prompt_json"] is not None:
        path = a["prompt_json"]
        d = read_json(path)
        if isinstance(d, dict):
            if set(d) != {"prompt_ids"}:
                raise UserError(f"{path}: expected {ID_FORMS}, got an object with keys {sorted(d)}")
            d = d["prompt_ids"]
        return [(check_ids(d, path, cfg, new), a["image_inputs"])]
    path = a["prompt_json_batch"]
    d = read_json(path)
    entries = d.get("prompts") if isinstance(d, dict) else d
    if not isinstance(entries, list) or not entries:
        raise UserError(f'{path}: expected a non-empty list of requests or {{"prompts": [...]}}')
    base = os.path.dirname(os.path.abspath(path))
    reqs, bad = [], []
    for i, e in enumerate(entries):
        where = f"request {i}"
        try:
            img = None
            if isinstance(e, dict):
                unknown = sorted(set(e) - {"prompt", "prompt_ids", "image_inputs", "images"})
                if (unknown or ("prompt" in e) == ("prompt_ids" in e) or ("images" in e and "prompt" not in e)
                        or ("images" in e and "image_inputs" in e)):
                    raise UserError(f"{where}: expected {REQUEST_FORMS}; got keys {sorted(e)}")
                img = e.get("image_inputs")
                if "images" in e:
                    if not isinstance(e["images"], list) or not all(isinstance(f, str) for f in e["images"]):
                        raise UserError(f'{where}: "images" must be a list of file names, got {e["images"]!r}')
                    ids, img = text_request(e["prompt"], [os.path.join(base, f) for f in e["images"]], where)
                else:
                    ids = text_request(e["prompt"], (), where)[0] if "prompt" in e else e["prompt_ids"]
                if isinstance(img, str):
                    if not isinstance(img, str):
                        raise UserError(f'{where}: "image_inputs" must be a file name, got {img!r}')
                    img = os.path.join(base, img)
            else:
                ids = e
            reqs.append((check_ids(ids, where, cfg, new), img))
        except UserError as err:
            bad.append(str(err))
    if bad:
        more = f"; and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else ""
        raise UserError(f"{path}: {len(bad)} of {len(entries)} requests are bad: " + "; ".join(bad[:MAX_LISTED]) + more)
    return reqs


def save_prepared(path: str, ids: list, img):
    """--save-image-inputs: the prepared tensors to PATH and the prompt ids to PATH's .json sibling, written under
    temporary names and renamed, replayable with --prompt-json PATH.json --image-inputs PATH."""
    from safetensors.torch import save_file
    if not isinstance(img, dict):
        raise UserError("--save-image-inputs needs --image files to prepare")
    ids_path = os.path.splitext(path)[0] + ".json"
    t = {k: (torch.tensor(v, dtype=torch.long) if k == "num_patches" else v.contiguous()) for k, v in img.items()}
    try:
        save_file(t, path + ".tmp")
        with open(ids_path + ".tmp", "w") as f:
            json.dump({"prompt_ids": ids}, f)
        os.replace(path + ".tmp", path)
        os.replace(ids_path + ".tmp", ids_path)
    except OSError as e:
        raise UserError(f"--save-image-inputs {path}: cannot write ({e.strerror})") from None


def load_image_inputs(path: str) -> dict:
    """An image-inputs safetensors file -> the model's keyword arguments (same file on every rank)."""
    from safetensors.torch import load_file
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such image-inputs file")
    try:
        t = load_file(path)
    except Exception as e:  # safetensors' own error types for truncated / foreign files
        raise UserError(f"{path}: not a readable safetensors file ({e})") from None
    unknown = sorted(set(t) - set(IMAGE_KEYS))
    if unknown:
        raise UserError(f"{path}: unexpected tensor(s) {unknown}; expected some of {list(IMAGE_KEYS)}")
    if not t:
        raise UserError(f"{path}: holds none of {list(IMAGE_KEYS)}")
    if "num_patches" in t:
        t["num_patches"] = t["num_patches"].long().flatten().tolist()
    return t


# --------------------------------------------------------------------------------------------------
# the CLI: phases that every rank runs, each ending in agreement


def agree(err: str | None):
    """Every rank learns whether any rank failed; all then stop with the first message (no rank left hanging)."""
    errs = [None] * dist.get_world_size()
    dist.all_gather_object(errs, err)
    first = next((e for e in errs if e), None)
    if first:
        raise UserError(first)


def phase(fn, *args, errors=(UserError, config.ConfigError, M.ShardError)):
    """Run fn on this rank; the project's error types become one message, agreed on by every rank."""
    out, err = None, None
    try:
        out = fn(*args)
    except errors as e:
        err = str(e)
    agree(err)
    return out


def main(tp_dir: str, prompt: str | None = None, prompt_json: str | None = None, prompt_json_batch: str | None = None,
         image_inputs: str | None = None, images: list | None = None, save_image_inputs: str | None = None,
         max_new_tokens: int = 128, prefill_chunk: int = PREFILL_CHUNK, ep_size: int | None = None,
         tokenizer: str | None = None, raw_prompt: bool = False, print_ids: bool = False, as_json: bool = False,
         device: str = "auto", cuda_graph: bool = True, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
         seed: int = 0, speculative: int = 0, ignore_eos: bool = False) -> list:
    check_sampling(temperature, top_k, top_p, seed)  # same flags on every rank: all fail alike, before any collective
    if speculative and not 1 <= speculative <= 3:
        raise UserError(f"--speculative {speculative}: the checkpoint has at most 3 MTP layers (1..3 drafts)")
    if speculative and temperature > 0:
        raise UserError("--speculative with --temperature > 0 is not supported yet (the draft/verify rule is greedy)")
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        if v not in os.environ:
            raise UserError(f"environment variable {v} is not set: launch with torchrun "
                            "(e.g. torchrun --standalone --nproc-per-node=N generate.py ...)")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if rank == 0 else (lambda *a: None)
    inputs = dict(prompt=prompt, prompt_json=prompt_json, prompt_json_batch=prompt_json_batch,
                  image_inputs=image_inputs, images=images, save_image_inputs=save_image_inputs,
                  max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk, tokenizer=tokenizer,
                  raw_prompt=raw_prompt, speculative=speculative, ignore_eos=ignore_eos)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    try:
        out, tok, reqs, eos, stats = _run(tp_dir, inputs, ep_size, dev, cuda_graph, sampling, rank, world, say)
        say(f"prefill: {stats['prefill_tokens']} tokens in {stats['prefill_s']:.3f} s "
            f"({stats['prefill_tokens'] / max(stats['prefill_s'], 1e-9):.1f} tok/s); decode: "
            f"{stats['decode_tokens']} tokens in {stats['decode_s']:.3f} s "
            f"({stats['decode_tokens'] / max(stats['decode_s'], 1e-9):.1f} tok/s)")
        if rank == 0:
            report(out, tok, [len(ids) for ids, _ in reqs], eos, print_ids, as_json)
        dist.barrier()  # no rank tears the group down while another still talks to it
        return out
    finally:
        if created:
            dist.destroy_process_group()


def _run(tp_dir, inputs, ep_size, dev, cuda_graph, sampling, rank, world, say):
    # 1. every rank: its own config, and the topology it implies
    def topology():
        cfg_path = os.path.join(tp_dir, f"config-r{rank}.json")
        cfg, vl, _ = config.load_config(cfg_path)
        if cfg.tp_size != world:
            raise UserError(f"{cfg_path}: tp_size={cfg.tp_size} but WORLD_SIZE={world}: run with "
                            f"--nproc-per-node={cfg.tp_size} (TP comes from the shards, there is no --tp-size)")
        if ep_size is not None and ep_size != cfg.expert_parallel_size:
            raise UserError(f"--ep-size {ep_size} does not match the shards' expert_parallel_size="
                            f"{cfg.expert_parallel_size} (co-located EP equals TP)")
        if inputs["max_new_tokens"] < 0:
            raise UserError(f"--max-new-tokens {inputs['max_new_tokens']} must be >= 0")
        if inputs["prefill_chunk"] < 1:
            raise UserError(f"--prefill-chunk {inputs['prefill_chunk']} must be >= 1")
        if inputs["speculative"] > cfg.mtp_layers_kept:
            raise UserError(f"--speculative {inputs['speculative']} needs {inputs['speculative']} MTP layer(s) but "
                            f"{cfg_path} keeps {cfg.mtp_layers_kept}: convert with --keep-mtp")
        if (inputs["image_inputs"] or inputs["images"]) and vl is None:
            raise UserError(f"{'--image' if inputs['images'] else '--image-inputs'} given but {cfg_path} is a "
                            "text-only model")
        return cfg, vl
    cfg, vl = phase(topology)

    # 2. rank 0: tokenizer, prompts, EOS set -> broadcast; every rank re-validates
    def requests():
        try:
            tok = find_tokenizer(tp_dir, inputs["tokenizer"])
        except UserError:
            if inputs["tokenizer"] or inputs["prompt"] is not None:
                raise
            tok = None  # ids-only prompts: an auto-discovered tokenizer is optional
        reqs = prepare_requests(inputs, cfg, vl, tok)
        if inputs["save_image_inputs"]:
            save_prepared(inputs["save_image_inputs"], *reqs[0])
        eos = set(cfg.eos_token_id) | ({tok.eos_token_id} if tok is not None and tok.eos_token_id is not None
                                       else set())
        if not eos or any(not isinstance(e, int) or e < 0 for e in eos):
            raise UserError(f"invalid EOS id set {sorted(eos, key=str)}")
        return tok, reqs, sorted(eos)
    tok, reqs, eos = phase(requests) if rank == 0 else (None, None, None)
    if rank != 0:
        agree(None)  # rank 0's phase ends in this agreement
    payload = [(reqs, eos)]
    dist.broadcast_object_list(payload, src=0)
    reqs, eos = payload[0]

    def received():
        for i, (ids, img) in enumerate(reqs):
            check_ids(ids, f"request {i}", cfg, inputs["max_new_tokens"])
            if img and vl is None:
                raise UserError(f"request {i} has image inputs ({img}) but the shards hold a text-only model")
        return [load_image_inputs(img) if isinstance(img, str) else img for _, img in reqs]
    images = phase(received)
    n_tok = [len(ids) for ids, _ in reqs]
    say(f"loading Step-5 TP={world}, co-located EP={cfg.expert_parallel_size} on {dev.type} "
        + (f"({n_tok[0]} prompt tokens)" if len(reqs) == 1 else f"(batch={len(reqs)}, prompt tokens={n_tok})"))

    # 3. every rank: strict load of its shard
    t0 = time.perf_counter()
    m = phase(lambda: M.Step5ForCausalLM.from_shard(os.path.join(tp_dir, f"model-r{rank}.safetensors"), cfg, dev, vl,
                                                    rank))
    say(f"loaded in {time.perf_counter() - t0:.1f} s; compute path: "
        + (f"Triton kernels (kernel.py), decode as {'a CUDA graph' if cuda_graph else 'eager launches'}"
           if dev.type == "cuda" else "PyTorch reference (CPU)"))

    # 4. every request's input rows: token embeddings, image features at its placeholders (checked per request)
    with torch.inference_mode():
        embeds = phase(prompt_embeds, m, [ids for ids, _ in reqs], images,
                       errors=(UserError, config.ConfigError, ValueError))

    # 5. generate, with progress on rank 0 when the prefill is long
    if sampling["temperature"] > 0:
        say(f"sampling: temperature {sampling['temperature']}, top-k {sampling['top_k'] or 'off'}, top-p "
            f"{sampling['top_p'] if sampling['top_p'] < 1 else 'off'}, seed {sampling['seed']} (reproducible on "
            f"{dev.type} with this seed)")
    t_pre = time.perf_counter()

    longest = max(n_tok)

    def progress(first, i, n):
        el = time.perf_counter() - t_pre  # host time: the launch queue keeps it close behind the device's
        if el > PROGRESS_AFTER_S and el - progress.last > PROGRESS_AFTER_S:
            if dev.type == "cuda":  # only when a line is due: a sync per layer would stall the launch queue
                torch.cuda.synchronize()
                el = time.perf_counter() - t_pre
            progress.last = el
            say(f"prefill: tokens {first}-{min(first + chunk, longest)} of {longest}, layer {i}/{n} after {el:.0f} s")
    progress.last = 0.0
    chunk = inputs["prefill_chunk"]
    prompts = [ids for ids, _ in reqs]
    stop = [] if inputs["ignore_eos"] else eos
    if inputs["speculative"]:
        out, stats = speculative(m, prompts, inputs["max_new_tokens"], stop, inputs["speculative"], embeds,
                                 cuda_graph=cuda_graph)
        acc = ", ".join(f"depth {j + 1}: {a}/{p}" for j, (a, p) in enumerate(zip(stats["accepted"], stats["proposed"])))
        say(f"speculative: {inputs['speculative']} MTP draft(s) per step; accepted {acc}; "
            f"{stats['decode_tokens'] / max(stats['verify_rows'], 1):.2f} tokens per request and verify step")
    else:
        out, stats = generate(m, prompts, inputs["max_new_tokens"], stop, embeds, cuda_graph, progress, chunk,
                              **sampling)
    return out, tok, reqs, eos, stats


def report(out, tok, n_tok, eos, print_ids, as_json):
    texts = [tok.decode(o, skip_special_tokens=False) if tok is not None else None for o in out]
    results = [{"prompt_token_count": n, "completion_token_ids": o, "completion": t}
               for n, o, t in zip(n_tok, out, texts)]
    if as_json:
        doc = ({**results[0], "eos_token_ids": eos} if len(results) == 1
               else {"batch_size": len(results), "eos_token_ids": eos, "results": results})
        print(json.dumps(doc, ensure_ascii=False))
        return
    for i, r in enumerate(results):
        head = f"[{i}] " if len(results) > 1 else ""
        print(f"{head}{r['completion'] if r['completion'] is not None else '(no tokenizer)'}")
        if print_ids:
            print(f"{head}ids: {r['completion_token_ids']}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp-dir", required=True, help="directory with config-r{rank}.json and model-r{rank}.safetensors")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="user text; the chat template is applied unless --raw-prompt")
    src.add_argument("--prompt-json", help=f"exact ids: {ID_FORMS}")
    src.add_argument("--prompt-json-batch", help='[[ids...], ...] or {"prompts": [{"prompt_ids": [...], '
                     '"image_inputs": "file.safetensors"}, {"prompt": "text"}, ...]}')
    ap.add_argument("--image", dest="images", action="append", metavar="FILE",
                    help="an image file for --prompt (repeatable, in order); each goes where the text has an "
                    f"{IMAGE_MARKER} marker, or before the text without markers")
    ap.add_argument("--save-image-inputs", metavar="OUT.safetensors",
                    help="also write the prepared image tensors there and the prompt ids to OUT.json")
    ap.add_argument("--image-inputs", help="safetensors with pixel_values [+ patch_pixel_values, num_patches] "
                    "or image_embeds, for --prompt / --prompt-json")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="generate exactly --max-new-tokens tokens per request, past any EOS (benchmarks, tests)")
    ap.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="N",
                    help=f"prefill at most N tokens of each prompt per pass (bounds activation memory; default "
                    f"{PREFILL_CHUNK})")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample from softmax(logits / T); 0 (the default) is greedy decoding")
    ap.add_argument("--top-k", type=int, default=0, help="sample among the K most likely tokens (0: no limit; "
                    "needs --temperature)")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample within the smallest set of most likely tokens "
                    "whose probability reaches P (1: no limit; needs --temperature)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0): the same seed "
                    "gives the same tokens on the same device type")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="draft K tokens per step with the checkpoint's MTP layers (1..3; shards converted with "
                    "--keep-mtp); greedy output is unchanged. Prompts are prefilled in one pass")
    ap.add_argument("--ep-size", "--expert-parallel-size", dest="ep_size", type=int, default=None,
                    help="expert-parallel size; must equal the shards' expert_parallel_size (= TP), which is the "
                    "default")
    ap.add_argument("--tokenizer", "--tokenizer-path", "--checkpoint", "--ckpt-path", dest="tokenizer",
                    help="tokenizer directory, e.g. the original checkpoint (default: tokenizer_files beside the "
                    "TP dir)")
    ap.add_argument("--raw-prompt", action="store_true", help="tokenize --prompt as plain text, no chat template")
    ap.add_argument("--print-ids", action="store_true", help="also print the generated token ids")
    ap.add_argument("--json", dest="as_json", action="store_true", help="print one JSON document with ids and text")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                    help="launch decode kernels eagerly instead of replaying a captured CUDA graph (debugging)")
    a = ap.parse_args()
    if a.raw_prompt and a.prompt is None:
        ap.error("--raw-prompt is only valid with --prompt")
    if a.image_inputs and a.prompt_json_batch:
        ap.error("--image-inputs applies to --prompt / --prompt-json; name image files inside the batch JSON instead")
    if a.images and a.prompt is None:
        ap.error("--image applies to --prompt; use \"images\" entries inside a --prompt-json-batch file")
    if a.images and a.image_inputs:
        ap.error("--image and --image-inputs are exclusive")
    if a.save_image_inputs and not a.images:
        ap.error("--save-image-inputs needs --image")
    code = 0
    try:
        main(a.tp_dir, prompt=a.prompt, prompt_json=a.prompt_json, prompt_json_batch=a.prompt_json_batch,
             image_inputs=a.image_inputs, images=a.images, save_image_inputs=a.save_image_inputs,
             max_new_tokens=a.max_new_tokens, prefill_chunk=a.prefill_chunk, ep_size=a.ep_size, tokenizer=a.tokenizer,
             raw_prompt=a.raw_prompt, print_ids=a.print_ids, as_json=a.as_json, device=a.device,
             cuda_graph=a.cuda_graph, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
             speculative=a.speculative, ignore_eos=a.ignore_eos)
    except UserError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        code = 2
    # The process group is destroyed by now. Skip interpreter finalisation: with gloo, a worker thread that is still
    # being torn down then can abort the process ("terminate called without an active exception", seen about once
    # in 30 CPU runs) after a fully successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
