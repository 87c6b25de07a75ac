"""The choose step: full-vocabulary logits -> each row's token by its request's own processing and draw, and the
log-probabilities of what it chose. Every per-request quantity lives on the device, one row per slot (Slots), so one
captured graph serves any mix of requests; the host writes a slot's row only when a request takes the slot.

Processing, in order (sampling.Sampling says each): logit bias added; repetition penalty over the prompt's and the
output's tokens; frequency and presence penalties over the output's counts; the grammar's bitmask (grammar.py: a row
per constrained request, all allowed elsewhere); the reasoning budget (a row whose reasoning has used its budget can
only choose the end of reasoning). Then greedy's argmax, or a draw (temperature, min_p, top_k, top_p:
sampling.probabilities / draw).

Logprobs are those of the model's own distribution: log_softmax of the logits before bias, penalties, masks and
temperature (vLLM's default, "raw logprobs"). An evaluation harness scores the model, not the sampler; a prompt
token's logprob (echo) has no sampler to apply; so emitted and prompt logprobs mean the same. A greedy token is its
own top alternative unless a bias, a penalty or a mask moved it. Top alternatives are ordered most likely first,
the lowest id first among equals (as greedy breaks ties).
"""
from dataclasses import dataclass
from enum import Enum

import torch

import kernel
import model as M
from sampling import (LOGIT_BIAS_MAX, RowSampling, draw, full_vocab, is_int, probabilities, row_max, row_sum,
                      row_top)

TOP = 20  # top alternatives computed per chosen token; a request reports the first `logprobs` of them


@dataclass(frozen=True)
class Reasoning:
    """The prompt opened a reasoning block: the answer starts after end_id (the </think> token). budget: reasoning
    tokens allowed before end_id is forced (0: at once, i.e. no reasoning; None: no cap). A constrained request's
    grammar applies to the answer."""
    end_id: int
    budget: int | None = None

    def problem(self, vocab_size: int, name=lambda field: field) -> str | None:
        if not is_int(self.end_id) or not 0 <= self.end_id < vocab_size:
            return f"{name('reasoning.end_id')} {self.end_id!r} is not a token id in [0, {vocab_size})"
        if self.budget is not None and (not is_int(self.budget) or not 0 <= self.budget < 2 ** 31):
            return f"{name('thinking_token_budget')} {self.budget!r} must be an integer in [0, 2**31) (0: no reasoning)"
        return None


class Slots:
    """Per-slot device rows of the requests' choice parameters and state ([B] or [B, V]; B = max_batch). A request
    writes its slot's rows when it takes the slot (take); the choose step reads them by the rows' slots and updates
    the state of the rows it emits for (counts, reasoning)."""

    def __init__(self, B: int, V: int, device):
        f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.long, device=device)
        self.V = V
        self.temperature, self.top_p, self.min_p = (torch.zeros(B, **f32), torch.ones(B, **f32),
                                                    torch.zeros(B, **f32))
        self.top_k, self.seed = torch.zeros(B, **i64), torch.zeros(B, **i64)
        self.presence, self.frequency, self.repetition = (torch.zeros(B, **f32), torch.zeros(B, **f32),
                                                          torch.ones(B, **f32))
        self.bias_ids = torch.zeros(B, LOGIT_BIAS_MAX, **i64)  # padding: id 0, bias 0
        self.bias = torch.zeros(B, LOGIT_BIAS_MAX, **f32)
        self.counts = torch.zeros(B, V, dtype=torch.int32, device=device)  # each token's count in the output
        self.prompt = torch.zeros(B, V, dtype=torch.bool, device=device)  # the prompt's tokens (repetition)
        self.masked = torch.zeros(B, dtype=torch.bool, device=device)  # the rows read the grammar's bitmask
        self.think_end = torch.full((B,), -1, **i64)  # the end of reasoning (-1: no reasoning block)
        self.thinking = torch.zeros(B, dtype=torch.bool, device=device)  # still reasoning
        self.think_left = torch.zeros(B, **i64)  # reasoning tokens left before the end is forced

    def take(self, slot: int, req):
        """The slot's rows for request req (engine.Request): its Sampling, its grammar (constrained or not), its
        reasoning block and budget; counts cleared; the prompt's tokens marked when its repetition penalty reads
        them. A few small host-to-device writes, once per request."""
        s = req.sampling
        for name, v in (("temperature", s.temperature), ("top_p", s.top_p), ("min_p", s.min_p), ("top_k", s.top_k),
                        ("seed", s.seed), ("presence", s.presence_penalty), ("frequency", s.frequency_penalty),
                        ("repetition", s.repetition_penalty)):
            getattr(self, name)[slot] = v
        self.bias_ids[slot] = 0
        self.bias[slot] = 0
        if s.logit_bias:
            n = len(s.logit_bias)
            self.bias_ids[slot, :n] = _device(list(s.logit_bias), torch.long, self.bias.device)
            self.bias[slot, :n] = _device(list(s.logit_bias.values()), torch.float32, self.bias.device)
        self.counts[slot] = 0
        self.prompt[slot] = False
        if s.repetition_penalty != 1:
            self.prompt[slot, _device(req.ids, torch.long, self.prompt.device)] = True
        self.masked[slot] = req.constraint is not None
        r = req.reasoning
        self.think_end[slot] = -1 if r is None else r.end_id
        self.thinking[slot] = r is not None
        self.think_left[slot] = 2 ** 62 if r is None or r.budget is None else r.budget


def _device(data: list, dtype, device) -> torch.Tensor:
    """Host data on the device without waiting for the queued steps (a pinned copy on a GPU)."""
    cuda = torch.device(device).type == "cuda"
    return torch.tensor(data, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)


def process(full: torch.Tensor, st: Slots, slots: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor,
            thinking: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [N, V] of rows whose slots are `slots` [N] -> the processed logits [N, V] fp32 (module
    docstring's order): the logit bias added here, the rest by kernel.process_logits (one launch on a GPU). counts
    [N, V] int32: each token's count in the row's output so far; thinking [N] bool and left [N] int64: the row's
    reasoning state (a speculative verify step passes each position's, drafts included); mask [N, words] int32: the
    grammar's rows (read where the slot is constrained)."""
    x = full.float().scatter_add(1, st.bias_ids[slots], st.bias[slots])  # padding entries add 0 to token 0
    return kernel.process_logits(x, slots, counts, mask, thinking, left, st.repetition, st.frequency, st.presence,
                                 st.prompt, st.masked, st.think_end)


def logprobs(full: torch.Tensor, tok: torch.Tensor) -> tuple:
    """Raw log-probabilities: full-vocabulary logits [N, V] and chosen tokens [N] -> (the chosen tokens' [N], the TOP
    most likely ids [N, TOP] int64 and theirs [N, TOP]), most likely first, the lowest id first among equals."""
    x = full.float()
    m = row_max(x)[:, None]
    m = torch.where(torch.isfinite(m), m, 0.0)  # a row of -inf: log(0) = -inf; one holding +inf or NaN: itself
    lse = m + torch.log(row_sum((x - m).exp()))[:, None]  # logsumexp, its one-row reductions in blocks
    v, i = x.topk(min(TOP, x.shape[1]), -1)
    i, order = i.sort(dim=-1)  # ids ascending, then a stable sort by value: equal values keep the lowest id first
    v = v.gather(1, order)
    v, order = v.sort(dim=-1, descending=True, stable=True)
    chosen = x.gather(1, tok.clamp(min=0)[:, None])[:, 0] - lse[:, 0]
    return chosen, i.gather(1, order), v - lse


class Pick(Enum):
    """A choose step's variant, by what its rows need; a row's token is the same in every variant that serves it.
    WHOLE: a row keeps a top_k / top_p part (the vocabulary sorted) or reports logprobs; LEAN: a row draws, none needs
    those; ARGMAX: every row is greedy (the processed logits' argmax: no draw). A value is the index of its graph among
    a batch bucket's choose graphs."""
    WHOLE = 0
    LEAN = 1
    ARGMAX = 2

    @staticmethod
    def of(reqs: list) -> "Pick":
        """The variant for a step's requests (engine.Request: their sampling and logprobs)."""
        if any(r.sampling.nucleus or r.logprobs is not None for r in reqs):
            return Pick.WHOLE
        return Pick.ARGMAX if all(r.sampling.temperature == 0 for r in reqs) else Pick.LEAN


def rows_of(st: Slots, slots: torch.Tensor) -> RowSampling:
    return RowSampling(st.temperature[slots], st.top_k[slots], st.top_p[slots], st.seed[slots], st.min_p[slots])


def choose(logits: torch.Tensor, st: Slots, slots: torch.Tensor, mask: torch.Tensor, counters: torch.Tensor,
           live: torch.Tensor, pick: Pick = Pick.WHOLE) -> tuple:
    """This rank's logits window [N, V/tp] of rows on `slots` [N] -> (tokens [N] int64, -1 where the logits are not
    finite; with Pick.WHOLE, logprobs: logprobs()'s three), the same on every rank; each row drawn at its counter (its
    slot's emitted-token count). The state of the live rows (live [N] 0/1) advances by their token. The rows must be
    those `pick` serves (Pick)."""
    full = full_vocab(logits)
    x = process(full, st, slots, mask, st.counts[slots], st.thinking[slots], st.think_left[slots])
    if pick is Pick.ARGMAX:  # where a greedy row's one-hot lies in probabilities(), so where its draw lands
        tok = row_top(x)[1]
    else:
        rs = rows_of(st, slots)
        tok = draw(probabilities(x, rs, nucleus=pick is Pick.WHOLE), rs, counters)
    tok = torch.where(torch.isfinite(row_max(full)), tok, -1)  # as greedy: a NaN or +inf in the row
    advance(st, slots, tok[:, None], live[:, None].bool())
    return (tok, *logprobs(full, tok)) if pick is Pick.WHOLE else (tok,)


def advance(st: Slots, slots: torch.Tensor, toks: torch.Tensor, emitted: torch.Tensor):
    """The state of rows on `slots` [N] after emitting toks [N, P] where emitted [N, P] (in order): the output counts,
    and the reasoning state (tokens spent while reasoning; the end of reasoning ends it): kernel.advance (one launch
    on a GPU)."""
    kernel.advance(st.counts, st.thinking, st.think_left, st.think_end, slots, toks, emitted)


PROMPT_ROWS = 512  # prompt rows whose logits an echo computes at once: [512, V/tp] fp32 (32 MB at TP=8)


def prompt_logprobs(model, hidden: torch.Tensor, targets: list, k: int) -> list:
    """Echo: residual rows [n, D] of prompt positions and the prompt token each predicts (targets [n]) -> per row
    (the target's raw logprob, its k most likely [(id, logprob)]), the same on every rank. Logits are made PROMPT_ROWS
    rows at a time, and no rank gathers the vocabulary: each rank's log-sum-exp, target logit and top k of its window
    are gathered and combined in rank order."""
    out = []
    world, dev = M.world_size, hidden.device
    for a in range(0, len(targets), PROMPT_ROWS):
        t = torch.tensor(targets[a:a + PROMPT_ROWS], dtype=torch.long, device=dev)
        lg = model.logits(hidden[a:a + len(t)])  # [m, V/tp]
        Vr = lg.shape[1]
        off = M.rank * Vr
        own = (t >= off) & (t < off + Vr)
        mine = torch.where(own, lg.gather(1, (t - off).clamp(0, Vr - 1)[:, None])[:, 0], float("-inf"))
        v, i = lg.topk(min(max(k, 1), Vr), -1)
        parts = torch.cat([torch.logsumexp(lg, -1)[:, None], mine[:, None], v, (i + off).float()], 1)  # [m, 2+2k']
        every = M.tp_gather(parts) if world > 1 else parts[None]  # [world, m, 2 + 2k'], ids < 2^24 exact in fp32
        lse = torch.logsumexp(every[:, :, 0], 0)
        tgt = every[:, :, 1].amax(0) - lse  # the one rank that holds the target
        kk = v.shape[1]
        vals = every[:, :, 2:2 + kk].permute(1, 0, 2).flatten(1)  # [m, world * k']
        ids = every[:, :, 2 + kk:].permute(1, 0, 2).flatten(1).long()
        ids, order = ids.sort(dim=-1)
        vals, o2 = vals.gather(1, order).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, o2)[:, :k]
        vals = vals[:, :k] - lse[:, None]
        for lp, ii, vv in zip(tgt.tolist(), ids.tolist(), vals.tolist()):  # a host read per block (prefill only)
            out.append((lp, list(zip(ii, vv))))
    return out
