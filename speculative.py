"""Speculative decoding with the checkpoint's MTP layers: the Speculator, a decode step kind of the engine that verifies
K drafts per request (engine.py's Engine makes one when `speculative=K`). Its docstring says how drafting,
verification and rollback work.
"""
import functools
import itertools

import torch

import choice
import kernel
from sampling import draw, full_vocab, greedy, probabilities, row_max, row_top
from startup import Graph


class Speculator:
    """Decode steps that verify K drafts of the MTP layers per request (a step kind of the engine).

    A verify step feeds each request's pending token and its K drafts as one decode step of K + 1 tokens per row of
    the main model. Greedy rows accept the longest prefix of drafts equal to the main model's argmax, plus the main
    model's next token, so every emitted token is the greedy choice at its position; sampled rows follow the
    speculative-sampling rule for greedy drafts: draft x is accepted with probability p(x), and at the first rejection
    a token is drawn from p with x removed (renormalised); after K acceptances one more is drawn from p. Rejected rows
    are rolled back by resetting the cache lengths: the sliding rings carry spare slots, so a rejected row never
    overwrote a key that a kept row still needs; K/V, pending indexer rows and region summaries at rejected positions
    are rewritten before any kept query reads them. Acceptance, rollback and drafting run on the device, so a step is
    queued without the host reading the last one.

    A step is three graphs: verify (the main model's forward over the K + 1 fed tokens), accept (greedy's, or the
    full choose step's, in choice.Pick's variants: choice.py's processing per position, each position's counts
    and reasoning state as if the drafts before it were accepted, and its own grammar mask), then draft. With a
    constrained request the host reads the last step's tokens and drafts while verify runs, and fills each position's
    mask (grammar.Matcher.fill: the matcher walks the drafts and rolls back) before accept; a draft the grammar
    refuses is masked out, so it is rejected and every later position is dropped with it.

    Drafting: MTP depth j's row at position p reads depth j-1's residual at p (depth -1: the main model's) and the
    token at p + j + 1; depth j's draft is its row at the last kept position L. Rows past L - j read drafts, so they
    are provisional; each step therefore recomputes, at depth j, the K + 1 + j positions L - K - j .. L (clamped at 0)
    as one static-shape decode step of the MTP layer: every provisional row of the last step is among them, and final
    rows come out the same. Residuals and tokens of recent positions live in per-slot device rings (position p in
    ring slot p mod S). Prefill chunks are absorbed by every depth as they come (the rows whose next tokens are
    prompt tokens, up to where drafting recomputes); the prompt's last rows are drafted as after a verify step. At
    image positions an MTP row reads the placeholder token's embedding as its next token (a choice: the release drops
    the MTP layers, and the main model's rows there already carry the image features in their residuals).
    """

    def __init__(self, eng):
        """eng: the Engine whose decode steps these are (its model, caches, slots and graphs)."""
        self.e, k = eng, eng.k
        B, dev, D = eng.config.max_batch, eng.dev, eng.model.cfg.hidden_size
        self.S = 4 * k + 4
        self.h = torch.zeros(k + 1, B, self.S, D, device=dev)  # ring 0: the main model's residuals; j + 1: depth j's
        self.tok = torch.zeros(B, self.S, dtype=torch.long, device=dev)  # ring: the token at each position
        self.drafts = torch.zeros(B, k, dtype=torch.long, device=dev)
        self.stats = {"verify_steps": 0, "verify_rows": 0, "proposed": [0] * k, "accepted": [0] * k}

    def _put(self, ring, slot: int, first: int, rows):
        """rows [n, ...] of one slot at positions first .. first + n - 1 into a ring (the last S of them)."""
        keep = min(self.S, rows.shape[0])
        at = torch.arange(first + rows.shape[0] - keep, first + rows.shape[0], device=rows.device) % self.S
        ring[slot, at] = rows[-keep:]

    def prefill(self, pieces, ids, embeds, hook, snaps=None):
        """A prefill pass of the main model over the pieces (engine.Piece; every row kept), absorbed by the MTP layers
        -> the main model's residual rows [T, D]. snaps: the prefix store's window snapshots (model.Placement's), taken
        by every layer of the main model and of each depth."""
        m = self.e.model
        lens, rows = [pc.n for pc in pieces], [pc.req.slot for pc in pieces]
        hidden = m.forward_rows(ids, self.e.cache, lens, rows=rows, embeds=embeds, held=[pc.start for pc in pieces],
                                progress=hook, snaps=snaps)  # [T, D]
        self.absorb(pieces, ids, hidden, snaps)
        return hidden

    def absorb(self, pieces, ids, hidden, snaps=None):
        """The main model's rows of a prefill pass (hidden [T, D], ids [T]: the pieces' tokens, packed; pieces:
        engine.Piece) into the rings, then each depth absorbs those whose next tokens are prompt tokens and that
        drafting will not recompute (depth j: positions p < len - 1 - K - j), taking the snapshots of `snaps` at
        positions it reaches in this pass (the engine asks only for positions every depth reaches)."""
        e, k, m = self.e, self.e.k, self.e.model
        starts = list(itertools.accumulate([0] + [pc.n for pc in pieces]))
        src = {}  # piece -> (first position, rows) of the previous depth computed in this pass
        for i, (pc, s) in enumerate(zip(pieces, starts)):
            self._put(self.h[0], pc.req.slot, pc.start, hidden[s:s + pc.n])
            self._put(self.tok, pc.req.slot, pc.start, ids[s:s + pc.n])
            src[i] = (pc.start, hidden[s:s + pc.n])
        for j in range(k):
            parts = []
            for i, pc in enumerate(pieces):
                have = int(e.mtps[j].lengths[pc.req.slot])  # host read: prefill only
                stop = min(pc.start + pc.n, len(pc.req.ids) - 1 - k - j)
                if i in src and stop > have:
                    p0, x = src[i]
                    parts.append((i, pc.req, have, stop, x[have - p0:stop - p0]))
            if not parts:
                break
            nxt = torch.tensor([r.ids[p + j + 1] for _, r, have, stop, _ in parts for p in range(have, stop)],
                               device=e.dev)
            mine = [(b, x, i) for b, x, i in snaps or () for _, r, have, stop, _ in parts
                    if b == r.slot and have < x <= stop]
            res = m.mtp(j, torch.cat([x for *_, x in parts]), nxt, e.mtps[j],
                        [stop - have for _, _, have, stop, _ in parts], rows=[r.slot for _, r, *_ in parts], snaps=mine)
            src, o = {}, 0
            for i, r, have, stop, _ in parts:
                src[i] = (have, res[o:o + stop - have])
                self._put(self.h[j + 1], r.slot, have, src[i][1])
                o += stop - have

    def first_drafts(self, reqs, slots):
        """After a prompt's last chunk and its first token (next_tok): the drafts of every depth, as after a verify
        step that kept position len - 1."""
        L = torch.tensor([len(r.ids) - 1 for r in reqs], device=self.e.dev)
        self.tok[slots, (L + 1) % self.S] = self.e.next_tok[slots]
        self.drafts[slots] = self.draft(slots, L)
        if any(r.matcher is not None for r in reqs):  # their first verify step's masks read these drafts
            for r, d in zip(reqs, self.drafts[slots].tolist()):
                r.drafts = d

    def draft(self, slots, L):
        """Each depth's K + 1 + j rows L - K - j .. L of the slots [R] -> drafts [R, K]. Static shapes: rows past L
        (a clamped start) are never read as final, and later steps overwrite them before any kept row needs them."""
        e, k, m = self.e, self.e.k, self.e.model
        R, D = slots.shape[0], m.cfg.hidden_size
        out = torch.zeros(R, k, dtype=torch.long, device=e.dev)
        for j in range(k):
            q = k + 1 + j
            tok, ring, row = kernel.draft_rows(slots, L, self.tok, out, e.mtps[j].lengths, j, k)  # [R, q] x 2, [R]
            res = m.mtp(j, self.h[j][slots[:, None], ring].view(R * q, D), tok.flatten(), e.mtps[j], None, q,
                        rows=slots)
            self.h[j + 1][slots[:, None], ring] = res.view(R, q, D)
            out[:, j] = greedy(m.mtp_logits(j, res.index_select(0, row))).clamp(min=0)  # row L's alone
        return out

    def graphs(self, b: int, pool) -> list:
        """The graphs of a verify step for batch bucket b: verify, accept (greedy's), accept (chosen fully), draft.
        Inputs: the slots and live rows of verify, shared by the others; accept writes draft's other inputs."""
        e, k, m, S = self.e, self.e.k, self.e.model, self.S
        dev, D = e.dev, m.cfg.hidden_size
        slots = torch.arange(b, device=dev)
        live = torch.ones(b, dtype=torch.long, device=dev)

        def verify(slots, live):  # -> residuals [b*(k+1), D], logits [b*(k+1), V/tp], greedy ids [b, k+1], start [b]
            start = e.cache.lengths[slots]  # the positions of the pending tokens
            fed = torch.cat([e.next_tok[slots][:, None], self.drafts[slots]], 1)  # [b, k+1]
            m.hold_pending(e.cache, slots)  # the DSA pending rows, for keep_pending after acceptance
            h = m.forward_rows(fed, e.cache, rows=slots, live=live)
            lg = m.logits(h)
            return h, lg, greedy(lg).view(b, k + 1), start
        g_verify = Graph(verify, [slots, live], e.use_graph, state=lambda: (e.cache.lengths,), pool=pool)
        d_in = [torch.zeros(b, dtype=torch.long, device=dev), torch.zeros(b, dtype=torch.long, device=dev),
                torch.zeros(b * (k + 1), D, device=dev), torch.zeros(b, k + 1, dtype=torch.long, device=dev)]

        def commit(slots, live, a, toks):
            """Roll back the rejected rows, feed the next token, count the emitted ones, and give draft its inputs."""
            h, _, _, start = g_verify.out
            kept = start + a  # the last kept position: the new pending token's predecessor
            e.cache.lengths[slots] = torch.where(live > 0, kept + 1, start)
            e.next_tok[slots] = toks.gather(1, a[:, None])[:, 0].clamp(min=0)
            e.count[slots] += (a + 1) * live
            for dst, src in zip(d_in, (kept, start, h, toks)):
                dst.copy_(src)

        def accept_greedy(slots, live):  # -> accepted drafts [b], the step's tokens [b, k+1]
            main = g_verify.out[2]
            a = (self.drafts[slots] == main[:, :k]).long().cumprod(1).sum(1)
            commit(slots, live, a, main)
            return a, main

        def accept_full(slots, live, pick):  # -> ..., and (Pick.WHOLE) the logprobs [b, k+1], top ids and theirs
            a, toks, lps = self._accept(slots, g_verify.out[1], pick)  # [b, k+1, TOP]
            commit(slots, live, a, toks)
            emitted = (torch.arange(k + 1, device=dev) <= a[:, None]) & (live[:, None] > 0)
            choice.advance(e.choice, slots, toks, emitted)
            return (a, toks, *lps)

        def draft(slots, kept, start, h, toks):
            """The DSA pending rows of the kept tokens put back, the verify rows into the rings (toks[j]: the token
            after position start + j), then the drafts -> the slots' drafts [b, k]."""
            m.keep_pending(e.cache, slots, start, kept - start + 1)
            steps = start[:, None] + torch.arange(k + 1, device=dev)  # [b, k+1]: positions of the verify rows
            self.h[0][slots[:, None], steps % S] = h.view(b, k + 1, D)
            self.tok[slots[:, None], (steps + 1) % S] = toks
            self.drafts[slots] = self.draft(slots, kept)
            return self.drafts[slots]
        state = lambda: (e.cache.lengths, *e.startup._choice_state())  # noqa: E731
        return [g_verify, Graph(accept_greedy, [slots, live], e.use_graph, state=state, pool=pool),
                *(Graph(functools.partial(accept_full, pick=pick), [slots, live], e.use_graph, state=state,
                        pool=pool) for pick in choice.Pick),
                Graph(draft, [slots, *d_in], e.use_graph, state=lambda: [c.lengths for c in e.mtps], pool=pool)]

    def decode(self, reqs: list, prev, out):
        """Queue one verify step over the requests -> (the requests, pinned host copies of [accepted, tokens...,
        drafts...] per row and of the logprobs of a step chosen fully, their event: Engine.to_host). With a
        constrained request the host reads the previous step and fills each position's mask while verify runs
        (Engine._masks)."""
        e = self.e
        n = len(reqs)
        b = e.bucket(n)
        pads = e.padding_slots(reqs)  # before any turn is skipped: a request that waits a step never pads
        if b - n > len(pads):  # prefilling slots cannot pad: decode a bucket without padding, in turns
            r = e.steps % n
            n = max(x for x in e.graphs if x <= n)
            reqs, b = (reqs[r:] + reqs[:r])[:n], n
        g_verify, g_greedy, *picks, g_draft = e.graphs[b]  # picks: the full accept graphs in choice.Pick's order
        # a padding row rewrites its slot's recent rows: forget the slot
        for i in e.fill_inputs(g_verify, reqs, b, pads):
            e.slots[i].held = []
            e.slots[i].stale = e.slots[i].owner is not None
        g_verify()
        if any(r.matcher is not None for r in reqs):
            e._emit(prev, out)
            e._masks(reqs, e.k + 1)
        g_accept = picks[choice.Pick.of(reqs).value] if any(r.chosen_fully for r in reqs) else g_greedy
        a, toks, *lps = g_accept()
        drafts = g_draft()
        self.stats["verify_steps"] += 1
        self.stats["verify_rows"] += n
        return (reqs, *e.to_host(torch.cat([a[:n, None], toks[:n], drafts[:n]], 1), *(x[:n] for x in lps)))

    def unpack(self, rows: list, reqs: list) -> list:
        """Host rows [accepted, tokens..., drafts...] -> each request's emitted tokens; the drafts its next verify
        step feeds go to the request (its masks walk them); the acceptance counts to the stats."""
        k, out = self.e.k, []
        for row, r in zip(rows, reqs):
            a = row[0]
            for j in range(k):
                self.stats["proposed"][j] += 1
                self.stats["accepted"][j] += j < a
            out.append(row[1:a + 2])
            r.drafts = row[k + 2:]
        return out

    def _accept(self, slots, lg, pick: choice.Pick = choice.Pick.WHOLE):
        """The full choose step of a verify step -> (accepted drafts a [b], the step's tokens [b, k+1], logprobs of
        each position's token: choice.logprobs' three, [b, k+1, ...], with Pick.WHOLE; else ()), for rows that `pick`
        serves (choice.Pick). Each position is processed (choice.process) with the output counts and reasoning state
        it has if the drafts before it are accepted, and with its own mask; greedy rows accept the drafts equal to the
        processed argmax, sampled rows follow the speculative-sampling rule on the processed distribution."""
        e, k, st = self.e, self.e.k, self.e.choice
        b, P = slots.shape[0], k + 1
        drafts = self.drafts[slots]  # [b, k]
        full = full_vocab(lg)  # [b*P, V]
        V = full.shape[1]
        fed = torch.zeros(b, P, V, dtype=torch.int32, device=e.dev)
        fed[:, 1:].scatter_(2, drafts[:, :, None], 1)
        counts = (st.counts[slots][:, None] + fed.cumsum(1, dtype=torch.int32)).view(b * P, V)
        hit = torch.cat([torch.zeros(b, 1, dtype=torch.bool, device=e.dev),
                         (drafts == st.think_end[slots][:, None]).cumsum(1) > 0], 1)  # an end among the drafts before
        thinking = st.thinking[slots][:, None] & ~hit  # [b, P]
        left = st.think_left[slots][:, None] - (thinking.long().cumsum(1) - thinking.long())
        x = choice.process(full, st, slots.repeat_interleave(P), e.mask[:b * P], counts, thinking.flatten(),
                           left.flatten())
        finite = torch.isfinite(row_max(full)).view(b, P)
        main = torch.where(finite, row_top(x)[1].view(b, P), -1)
        a = (drafts == main[:, :k]).long().cumprod(1).sum(1)
        if pick is choice.Pick.ARGMAX:
            return a, main, ()
        rs = choice.rows_of(st, slots)
        probs = probabilities(x, rs.repeat(P), nucleus=pick is choice.Pick.WHOLE).view(b, P, V)
        base = e.count[slots]  # the index of the step's first token in its request
        u = kernel.uniform(rs.seed, base * 4 + 1, k)  # counter stream 1: acceptance
        px = probs[:, :k].gather(2, drafts[:, :, None])[:, :, 0]  # [b, k]
        acc = (u <= px).long().cumprod(1).sum(1)  # u may be 1.0 in fp32: a draft of probability 1 is still accepted
        # the token after the accepted drafts: p at position acc, with the rejected draft removed (acc < k)
        pa = probs[torch.arange(b, device=e.dev), acc]  # [b, V]
        rej = drafts.gather(1, acc.clamp(max=k - 1)[:, None])
        pa = torch.where((acc < k)[:, None], pa.scatter(1, rej, 0.0), pa)
        nxt = draw(pa, rs, base + acc)  # keyed by the emitted token's index
        toks = torch.cat([drafts, drafts[:, :1]], 1).scatter(1, acc[:, None], nxt[:, None])
        toks = torch.where(finite, toks, -1)
        sampled = rs.temperature > 0
        a, toks = torch.where(sampled, acc, a), torch.where(sampled[:, None], toks, main)
        if pick is not choice.Pick.WHOLE:
            return a, toks, ()
        lp, ids, top = choice.logprobs(full, toks.flatten())
        return a, toks, (lp.view(b, P), ids.view(b, P, -1), top.view(b, P, -1))
