"""The prefix store: prompt prefixes kept across requests, whatever slot computed them, so that a shared system prompt,
a tools block or an agent's resent history prefills once. The engine (engine.py) copies a request's longest stored
prefix into its slot on the device and prefills only the rest.

What a prefix of X tokens (X a multiple of the DSA region size) needs, per slot, to continue exactly as if the slot
had prefilled it:
- DSA layers: K/V of positions 0 .. X-1 and the summaries of regions 0 .. X/blk - 1 (X on a region boundary: no
  pending indexer rows). These are per position, so they are kept in pages of one region each, shared by every
  prefix that holds the same tokens there.
- Sliding layers (and the MTP layers, also sliding): the window at X, the keys and values of positions X-W+1 .. X-1.
  Each layer's window depends on the windows below it, so it cannot be recomputed from the DSA layers' state; it is
  kept as a snapshot, written by the layers themselves during an eager prefill pass that reaches X
  (model.Placement.snaps: into a snapshot reserved before the pass), or copied from the slot's rings after a pass
  (a prefill graph's, a request's release) that ends within the rings' spare slots of X.
A stored prefix is (its pages, a snapshot at its end). A prefix of the request that ends between two snapshots of a
stored one reuses the shorter and prefills the rest: exact, unlike recomputing the last window alone.

Index: a trie of region-sized edges (node = one page; key = (parent node, the region's tokens)). Region-aligned is
what a copy can reuse, so edges of one region lose nothing; the edge holds the tokens themselves, so no hash
collision can hand a request another prompt's cache (a hash-of-blocks index would have to compare them anyway). The
root is the request's cache_salt: tenants never share a node. Image placeholders enter the key as fingerprints of
their feature rows (engine.reuse_key): a prefix holding an image is reused for the same image only.

Eviction: least recently used snapshot first; a node lives while a snapshot at or below it does (its page is freed
with the last). The store's pools are allocated once at start-up from its budget in the memory plan
(StoreSize); nothing is compiled or captured by a copy (plain indexed copies).
"""
from collections import OrderedDict
from typing import NamedTuple

import torch

# Mid-prompt snapshots every SNAP_EVERY positions, so a request that shares only the first part of a long prompt (a
# system prompt and tools, then another conversation) still finds one at most this far below the fork. A snapshot of
# the released geometry (69 sliding layers x 511 positions) weighs as much as ~1.5k positions of the 23 DSA layers,
# so 2048 costs ~1.75x the pages' memory; chosen, not measured.
SNAP_EVERY = 2048
# Budget share of the snapshots (the rest holds pages): about one snapshot per 1k positions of the released geometry;
# chosen, not measured.
SNAP_SHARE = 0.5


class StoreSize(NamedTuple):
    """The pools of a store: pages (one DSA region of every DSA layer each), snapshots (one window of every sliding
    layer, main and MTP), and their bytes."""
    pages: int
    snaps: int
    page_bytes: int
    snap_bytes: int

    @property
    def bytes(self) -> int:
        return self.pages * self.page_bytes + self.snaps * self.snap_bytes


def layer_caches(caches: list) -> tuple:
    """(DSA layer caches, sliding layer caches) of model.Cache objects (the main stack's, then the MTP layers')."""
    dsa = [lc for c in caches for lc in c.layers if getattr(lc, "summ", None) is not None]
    sliding = [lc for c in caches for lc in c.layers if getattr(lc, "summ", None) is None]
    return dsa, sliding


def region(model) -> int:
    """Tokens per page: the DSA region (a prefix is reusable up to a whole region), or 16 without DSA layers."""
    return model.cfg.sparse.block if model.cfg.sparse else 16


def size_for(model, caches: list, budget: int) -> StoreSize:
    """The pools a budget of `budget` bytes holds for caches shaped like `caches` (model.Cache objects, the "meta"
    device will do): their layers' K/V widths, summaries and the window."""
    blk, W = region(model), model.cfg.sliding_window
    dsa, sliding = layer_caches(caches)
    page = sum(2 * blk * lc.k[0, 0].numel() * lc.k.element_size() + lc.summ.shape[2] for lc in dsa)
    snap = sum(2 * lc.k.shape[1] * (W - 1) * lc.k.shape[3] * lc.k.element_size() for lc in sliding)
    snaps = int(budget * SNAP_SHARE) // snap if snap else 0
    pages = (budget - snaps * snap) // page if page else 0
    if snaps < 1 or pages < 1:
        return StoreSize(0, 0, page, snap)
    return StoreSize(pages, snaps, page, snap)


class Hit(NamedTuple):
    """A stored prefix: its length (positions), its pages in position order, its snapshot's index."""
    n: int
    pages: list
    snap: int


class _Node:
    __slots__ = ("page", "parent", "edge", "children", "snap")

    def __init__(self, page: int, parent, edge):
        self.page, self.parent, self.edge = page, parent, edge
        self.children = 0
        self.snap = None  # the snapshot index of the prefix ending here, if stored


class PrefixStore:
    """Pools on the engine's device (allocated here, sized by StoreSize) and the trie that indexes them. Counters:
    hits, misses (lookups of requests that found nothing stored), evictions (snapshots dropped for room), tokens_hit
    (prompt tokens copied in)."""

    def __init__(self, eng, size: StoreSize):
        self.e, self.size = eng, size
        self.blk, self.W = region(eng.model), eng.model.cfg.sliding_window
        dsa, sliding = layer_caches([eng.cache] + list(eng.mtps))
        dev = eng.dev
        self.dsa, self.sliding = dsa, sliding
        # [pages, blk, G, hd] K and V, [pages, P] summaries, per DSA layer; [snaps, G, W-1, hd] per sliding layer
        self.pk = [torch.zeros(size.pages, self.blk, *lc.k.shape[2:], dtype=lc.k.dtype, device=dev) for lc in dsa]
        self.pv = [torch.zeros_like(t) for t in self.pk]
        self.ps = [torch.zeros(size.pages, lc.summ.shape[2], dtype=lc.summ.dtype, device=dev) for lc in dsa]
        self.sk = [torch.zeros(size.snaps, lc.k.shape[1], self.W - 1, lc.k.shape[3], dtype=lc.k.dtype, device=dev)
                   for lc in sliding]
        self.sv = [torch.zeros_like(t) for t in self.sk]
        for lc, k, v in zip(sliding, self.sk, self.sv):  # where a prefill's layers write its windows (Placement.snaps)
            lc.snap_k, lc.snap_v = k, v
        # positions a pass may run past a point and still find its window in every ring (R >= W + the engine's slack)
        self.margin = min((lc.k.shape[2] for lc in sliding), default=self.W + (1 << 30)) - self.W
        self.free_pages = list(range(size.pages))[::-1]
        self.free_snaps = list(range(size.snaps))[::-1]
        self.roots = {}  # cache_salt -> root node (no page; its edge is the salt)
        self.edges = {}  # (parent node id, region tokens) -> node
        self.lru = OrderedDict()  # node id -> node holding a snapshot, least recently used first
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "tokens_hit": 0}

    # ---- the index
    def used_bytes(self) -> int:
        """Bytes of the pools that hold stored prefixes."""
        s = self.size
        return (s.pages - len(self.free_pages)) * s.page_bytes + (s.snaps - len(self.free_snaps)) * s.snap_bytes

    def _walk(self, key: list, salt, limit: int) -> list:
        """The stored nodes along key's whole regions within `limit` positions, from the root (its first)."""
        node, path = self.roots.get(salt), []
        if node is None:
            return path
        blk = self.blk
        for i in range(limit // blk):
            nxt = self.edges.get((id(node), tuple(key[i * blk:(i + 1) * blk])))
            if nxt is None:
                break
            node = nxt
            path.append(node)
        return path

    def lookup(self, key: list, salt, limit: int) -> Hit | None:
        """The longest stored prefix of key of at most `limit` positions (the store's LRU order refreshed), or None."""
        path = self._walk(key, salt, limit)
        end = next((i for i in range(len(path) - 1, -1, -1) if path[i].snap is not None), None)
        if end is None:
            return None
        node = path[end]
        self.lru.move_to_end(id(node))
        return Hit((end + 1) * self.blk, [nd.page for nd in path[:end + 1]], node.snap)

    def stored(self, key: list, salt, limit: int) -> set:
        """The lengths of key's prefixes stored (a snapshot at their end), up to `limit` positions: one walk."""
        return {(i + 1) * self.blk for i, nd in enumerate(self._walk(key, salt, limit)) if nd.snap is not None}

    def _evict_one(self) -> bool:
        if not self.lru:
            return False
        _, node = self.lru.popitem(last=False)
        self.free_snaps.append(node.snap)
        node.snap = None
        self.stats["evictions"] += 1
        while node.parent is not None and node.children == 0 and node.snap is None:  # prune up to a live node
            del self.edges[(id(node.parent), node.edge)]
            self.free_pages.append(node.page)
            node.parent.children -= 1
            node = node.parent
        if node.parent is None and node.children == 0:  # a tenant's root with nothing stored below
            self.roots.pop(node.edge, None)
        return True

    def reserve(self) -> int | None:
        """A snapshot for a prefill pass to write (Placement.snaps), evicting for it; None when none can be had."""
        while not self.free_snaps:
            if not self._evict_one():
                return None
        return self.free_snaps.pop()

    def unreserve(self, snaps):
        """Reserved snapshots a pass will not store (it failed or was abandoned) back to the free ones."""
        self.free_snaps += list(snaps)

    # ---- copies
    def _index(self, rows: list) -> torch.Tensor:
        """Page ids as a device index, by a pinned asynchronous copy: a plain one would wait for the queued steps."""
        pinned = self.e.dev.type == "cuda"
        return torch.tensor(rows, pin_memory=pinned).to(self.e.dev, non_blocking=pinned)

    def _window(self, X: int, R: int, dev) -> tuple:
        """(positions max(0, X-W+1) .. X-1 as ring slots of a ring of R [n], their rows in a snapshot [n])."""
        lo = max(0, X - self.W + 1)
        p = torch.arange(lo, X, device=dev)
        return p % R, p - (X - self.W + 1)

    def put(self, slot: int, key: list, salt, X: int, snap: int | None = None) -> bool:
        """Store the first X positions (a multiple of the region) of what slot holds, key its reuse key: its pages
        that are not stored yet, and the window at X: snapshot `snap` (reserved, and written by the pass), else copied
        from the slot's rings, which must still hold it (the caller's bound: the slot's length at most `margin` past
        X). Evicts least recently used prefixes for room; False when the store cannot hold it (`snap` is then freed).
        A prefix stored already is only refreshed."""
        blk = self.blk
        if X <= 0 or X % blk:
            raise ValueError(f"a stored prefix must be a positive multiple of the region ({blk}), not {X}")
        while True:
            path = self._walk(key, salt, X)
            need = X // blk - len(path)
            if len(path) == X // blk and path[-1].snap is not None:
                self.lru.move_to_end(id(path[-1]))
                self.free_snaps += [] if snap is None else [snap]
                return True
            if need <= len(self.free_pages) and (snap is not None or self.free_snaps):
                break
            ok = X // blk <= self.size.pages
            while ok and (need > len(self.free_pages) or snap is None and not self.free_snaps):
                ok = self._evict_one()  # then walk again: evictions may prune the path
            if not ok:
                self.free_snaps += [] if snap is None else [snap]
                return False
        dev = self.e.dev
        node = path[-1] if path else self.roots.setdefault(salt, _Node(-1, None, salt))
        new, first = [], len(path)
        for i in range(first, X // blk):
            edge = tuple(key[i * blk:(i + 1) * blk])
            child = _Node(self.free_pages.pop(), node, edge)
            self.edges[(id(node), edge)] = child
            node.children += 1
            new.append(child.page)
            node = child
        if new:
            pages = self._index(new)
            a, b = first * blk, X
            for lc, k, v, s in zip(self.dsa, self.pk, self.pv, self.ps):
                k.index_copy_(0, pages, lc.k[slot, a:b].reshape(-1, blk, *lc.k.shape[2:]))
                v.index_copy_(0, pages, lc.v[slot, a:b].reshape(-1, blk, *lc.v.shape[2:]))
                s.index_copy_(0, pages, lc.summ[slot, first:X // blk])
        node.snap = self.free_snaps.pop() if snap is None else snap
        self.lru[id(node)] = node
        if snap is not None:
            return True
        wins = {}  # ring size -> its window's slots and rows
        for lc, k, v in zip(self.sliding, self.sk, self.sv):
            R = lc.k.shape[2]
            ring, rows = wins[R] if R in wins else wins.setdefault(R, self._window(X, R, dev))
            k[node.snap, :, rows] = lc.k[slot][:, ring]
            v[node.snap, :, rows] = lc.v[slot][:, ring]
        return True

    def load(self, slot: int, hit: Hit):
        """The stored prefix into the slot: DSA K/V and summaries of its positions, the window of every sliding
        layer at its end; the lengths are the caller's."""
        dev, blk, X = self.e.dev, self.blk, hit.n
        pages = self._index(hit.pages)
        for lc, k, v, s in zip(self.dsa, self.pk, self.pv, self.ps):
            lc.k[slot, :X] = k.index_select(0, pages).flatten(0, 1)
            lc.v[slot, :X] = v.index_select(0, pages).flatten(0, 1)
            lc.summ[slot, :X // blk] = s.index_select(0, pages)
        wins = {}
        for lc, k, v in zip(self.sliding, self.sk, self.sv):
            R = lc.k.shape[2]
            ring, rows = wins[R] if R in wins else wins.setdefault(R, self._window(X, R, dev))
            lc.k[slot][:, ring] = k[hit.snap][:, rows]
            lc.v[slot][:, ring] = v[hit.snap][:, rows]
        self.stats["tokens_hit"] += X
