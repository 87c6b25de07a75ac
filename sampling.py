"""Token choice: this rank's logits window -> the next tokens, identical on every rank without a broadcast. Every rank
gathers the same full-vocabulary logits in rank order (full_vocab, greedy), and a sampled row draws from a
counter-based random stream of its own request (seed, counter), so no generator state is shared and a request's
draws do not depend on its batch. The engine's decode graph takes greedy's tokens; choice.py's choose step (bias,
penalties, grammar masks, the reasoning budget, logprobs) ends in probabilities / draw; speculative.py's acceptance
uses them with kernel.uniform.
"""
import math
import numbers
from dataclasses import dataclass, replace

import torch

import kernel
import model as M


def full_vocab(logits: torch.Tensor) -> torch.Tensor:
    """This rank's logits window [B, V/tp] -> the full-vocabulary logits [B, V], bit-identical on every rank (every
    rank gathers the same windows in rank order)."""
    return M.tp_gather(logits).permute(1, 0, 2).flatten(1)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N, G, V / G], G = gcd(V, 128): a row reduced as G partial rows and then once over G runs on many
    GPU blocks, where one long row (a batch of 1 over the vocabulary) runs on few."""
    g = math.gcd(x.shape[-1], 128)
    return x.reshape(x.shape[0], g, x.shape[-1] // g)


def row_max(x: torch.Tensor) -> torch.Tensor:
    """[N, V] -> each row's maximum [N] (NaN if the row holds one), as x.amax(-1)."""
    return _blocks(x).amax(-1).amax(-1)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """[N, V] -> each row's sum [N], summed per block of the row, then the blocks' sums."""
    return _blocks(x).sum(-1).sum(-1)


def row_top(x: torch.Tensor) -> tuple:
    """[N, V] -> (each row's maximum [N], its first index [N]), as x.max(-1): the first block holding the maximum, and
    the first index of it there (a NaN counts as the maximum, as in max)."""
    v, i = _blocks(x).max(-1)  # [N, G]
    vmax, g = v.max(-1)
    return vmax, g * (x.shape[-1] // v.shape[-1]) + i.gather(1, g[:, None])[:, 0]


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Global argmax over the rank-ordered vocabulary windows (the lowest id on ties): [B, V/tp] -> [B] int64, the
    same on every rank; -1 in a row whose maximum is not finite (a NaN anywhere in the row, or +inf). Gathers each
    rank's maximum and its id, not the vocabulary: the first maximal window wins, as an argmax of the concatenated
    windows picks."""
    v, i = logits.max(-1)  # [B]: the first maximum, i.e. the lowest id of this window (NaN propagates)
    if M.world_size == 1:
        return torch.where(torch.isfinite(v), i, -1)
    every = M.tp_gather(torch.stack([v.float(), (i + M.rank * logits.shape[-1]).float()]))  # [world, 2, B]
    vals = every[:, 0]  # ids < 2^24 are exact in fp32
    top = vals.amax(0)
    win = (vals == top).int().argmax(0)  # the first rank holding the maximum
    tok = every[:, 1].gather(0, win[None])[0].long()
    return torch.where(torch.isfinite(top), tok, -1)


def is_int(v) -> bool:
    """An integer, Python's or numpy's, and not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


LOGIT_BIAS_MAX = 1024  # entries of one request's logit_bias (the per-slot device table's width)


@dataclass(frozen=True)
class Sampling:
    """One request's token choice: greedy at temperature 0, else a draw from softmax(logits / temperature) within the
    tokens at least min_p times as likely as the most likely one (0: all), then within the top_k most likely tokens
    (0: all), then within the top_p nucleus (1: all). `seed` keys the request's own random stream: whatever else runs
    in the batch never changes its draws (on the same device type).

    Before that, the logits are processed in this order (choice.py): logit_bias {token id: bias in [-100, 100]}
    added; repetition_penalty (> 0; 1: none) divides the positive and multiplies the negative logits of every token
    of the prompt and of the output so far (the usual multiplicative rule); frequency_penalty times each token's
    count in the output so far and presence_penalty once for each token present in it are subtracted (OpenAI's
    definitions, both in [-2, 2]). Greedy rows take the argmax of the processed logits."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict | None = None

    def problem(self, name=lambda field: field) -> str | None:
        """None, or what is wrong, naming the field as name(field) calls it (a flag, a request field)."""
        t, k, p = name("temperature"), name("top_k"), name("top_p")
        if not is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            return f"{t} {self.temperature} must be a finite number >= 0 (0 is greedy decoding)"
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            return f"{p} {self.top_p} must be in (0, 1] (1 keeps every token)"
        if not is_int(self.top_k) or not 0 <= self.top_k < 2 ** 63:
            return f"{k} {self.top_k} must be an integer in [0, 2**63) (0 keeps every token)"
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            return f"{name('min_p')} {self.min_p} must be in [0, 1] (0 keeps every token)"
        if self.temperature == 0 and (self.top_k != 0 or self.top_p != 1 or self.min_p != 0):
            what = (f"{k} {self.top_k}" if self.top_k else f"{p} {self.top_p}" if self.top_p != 1
                    else f"{name('min_p')} {self.min_p}")
            return f"{what} needs {t} > 0 ({t} 0 is greedy decoding)"
        if not is_int(self.seed) or not 0 <= self.seed < 2 ** 63:
            return f"{name('seed')} {self.seed} must be an integer in [0, 2**63)"
        for f in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, f)
            if not is_number(v) or not -2 <= v <= 2:
                return f"{name(f)} {v} must be a number in [-2, 2]"
        r = self.repetition_penalty
        if not is_number(r) or not 0 < r < float("inf"):
            return f"{name('repetition_penalty')} {r} must be a finite number > 0 (1: none)"
        return self._bias_problem(name("logit_bias"))

    def _bias_problem(self, field: str) -> str | None:
        b = self.logit_bias
        if b is None:
            return None
        if not isinstance(b, dict):
            return f"{field} must be a map of token id to bias, got {type(b).__name__}"
        if len(b) > LOGIT_BIAS_MAX:
            return f"{field} holds {len(b)} entries; at most {LOGIT_BIAS_MAX}"
        for tok, v in b.items():
            if not is_int(tok) or tok < 0:
                return f"{field}: {tok!r} is not a token id"
            if not is_number(v) or not -100 <= v <= 100:
                return f"{field}[{tok}] = {v!r} must be a number in [-100, 100]"
        return None

    @property
    def nucleus(self) -> bool:
        """It keeps only a top_k or top_p part of the distribution: the choose step's sort by likelihood."""
        return bool(self.top_k or self.top_p != 1)

    @property
    def processed(self) -> bool:
        """The choice needs the full-vocabulary choose step (a draw, a filter or a change of the logits), not greedy's
        argmax alone."""
        return bool(self.temperature > 0 or self.presence_penalty or self.frequency_penalty
                     or self.repetition_penalty != 1 or self.logit_bias)

    def derived(self, j: int) -> "Sampling":
        """The sampling of choice j of a request for n choices (n > 1 is n requests): its own random stream, the seed
        plus j (mod 2**63)."""
        return replace(self, seed=(self.seed + j) % 2 ** 63)


@dataclass
class RowSampling:
    """Per-row sampling parameters of a batch as device tensors [B] (Sampling of each row)."""
    temperature: torch.Tensor  # fp32, 0 = greedy
    top_k: torch.Tensor  # int64, 0 = all
    top_p: torch.Tensor  # fp32
    seed: torch.Tensor  # int64
    min_p: torch.Tensor  # fp32, 0 = all

    @staticmethod
    def of(samplings: list, device) -> "RowSampling":
        return RowSampling(torch.tensor([s.temperature for s in samplings], dtype=torch.float32, device=device),
                           torch.tensor([s.top_k for s in samplings], dtype=torch.long, device=device),
                           torch.tensor([s.top_p for s in samplings], dtype=torch.float32, device=device),
                           torch.tensor([s.seed for s in samplings], dtype=torch.long, device=device),
                           torch.tensor([s.min_p for s in samplings], dtype=torch.float32, device=device))

    def repeat(self, n: int) -> "RowSampling":
        """Each row's parameters n times over (the positions of a speculative verify step)."""
        return RowSampling(*(t.repeat_interleave(n) for t in vars(self).values()))


def probabilities(full: torch.Tensor, rs: RowSampling, nucleus: bool = True) -> torch.Tensor:
    """Full-vocabulary logits [B, V] -> each row's sampling distribution [B, V] fp32: softmax(logits / temperature)
    restricted to the tokens at least min_p times as likely as the most likely one, then to its top_k most likely
    tokens, then to its top_p nucleus (the smallest set of most likely tokens whose mass reaches top_p),
    renormalised. Greedy rows (temperature 0) get a one-hot at the argmax. Rows with neither top_k nor top_p take the
    softmax in vocabulary order, unsorted; nucleus=False: no row has either, and the sort is skipped (a row's result
    is the same with or without it)."""
    x = full.float()
    greedy_row = rs.temperature == 0
    t = torch.where(greedy_row, 1.0, rs.temperature)[:, None]
    x = (x - row_max(x)[:, None]) / t  # largest 0: a tiny temperature gives -inf, never inf - inf
    # min_p: p_i >= min_p * p_max, i.e. x_i >= log(min_p) with the largest x at 0 (min_p 0: log 0 = -inf keeps all)
    x = x.masked_fill(x < torch.log(rs.min_p)[:, None], float("-inf"))
    rank = torch.arange(x.shape[-1], device=x.device)
    onehot = (rank[None, :] == row_top(x)[1][:, None]).float()  # the first maximum: the lowest id on ties
    e = x.exp()  # the largest is 1
    dense = torch.where(greedy_row[:, None], onehot, e / row_sum(e)[:, None])
    if not nucleus:
        return dense
    # most likely first; stable, so tied logits keep the lowest id first (as greedy's argmax)
    xs, ids = x.sort(dim=-1, descending=True, stable=True)
    keep = (rs.top_k[:, None] == 0) | (rank[None, :] < rs.top_k[:, None])
    # softmax of the kept part: xs is sorted, its first the largest, which the shift above made 0
    ps = torch.where(keep, xs.exp(), 0.0)
    ps = ps / row_sum(ps)[:, None]
    # The mass of the more likely tokens (0 for the first), summed in 2^-48 fixed point: integer sums are exact in any
    # order, while a float cumsum on CUDA may round differently between runs and so move the nucleus boundary on one
    # rank. The bound is at least 1 so that the first token always stays (a top_p below 2^-48 keeps only it).
    q = (ps * 2.0 ** 48).long()
    ps = ps.masked_fill(q.cumsum(-1) - q >= (rs.top_p[:, None].double() * 2 ** 48).long().clamp_min(1), 0.0)
    ps = ps / row_sum(ps)[:, None]
    cut = torch.zeros_like(ps).scatter_(-1, ids, ps)
    return torch.where(((rs.top_k != 0) | (rs.top_p < 1))[:, None] & ~greedy_row[:, None], cut, dense)


def draw(probs: torch.Tensor, rs: RowSampling, counters: torch.Tensor) -> torch.Tensor:
    """A token per row from probs [B, V] -> [B] int64, keyed by (seed, counter): the exponential race argmax_i p_i /
    E_i with E_i ~ Exp(1) picks i with probability p_i / sum(p), so a masked distribution needs no renormalising.
    A row whose probabilities are not finite gets -1."""
    # stream 0 of the counter; a uniform of 2^24 - 1 (+ 0.5) rounds to 1.0 in fp32, where -log gives 0 and a token of
    # probability 0 would win the race as 0 / 0 = NaN (a masked token, about once in 130 draws at 128,896 tokens): the
    # floor keeps every E_i > 0 and changes no other draw (any other uniform gives E_i >= 2^-24)
    e = (-torch.log(kernel.uniform(rs.seed, counters * 4, probs.shape[-1]))).clamp_min(2.0 ** -25)
    tok = row_top(probs / e)[1]
    return torch.where(torch.isfinite(row_sum(probs)), tok, -1)  # probabilities sum to at most V: no overflow
