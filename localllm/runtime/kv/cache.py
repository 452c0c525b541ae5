"""The paged KV cache of one model: groups of layers that share a block layout, each with a
block pool, and per-sequence block tables over them — allocation on demand, copy-on-write
forks, trimming, prefix reuse by chained hashes, and sliding windows whose old blocks are
released, with checkpoints that keep a window at turn boundaries.

Bookkeeping only: page contents live in the backends; ``copy_block(group, src, dst)`` is
called to copy a block's pages in every layer of a group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .blocks import BlockPool, PoolStats, chain_hashes, group_hash


@dataclass
class CacheGroup:
    """Layers whose sequences share one block table (same window, same pool)."""
    index: int
    layers: list[int]
    window: int               # sliding-window span, 0 for full attention
    pool: BlockPool
    key: bytes                # what besides the tokens shapes a block (model, group, KV types)
    max_cached: int = -1      # sliding groups: cached free blocks kept at most (-1: no limit)


@dataclass
class Checkpoint:
    """A sliding-window state kept at a turn boundary: the blocks each sliding group held when
    the sequence had ``n`` tokens (held by the checkpoint itself)."""
    n: int
    blocks: dict[int, dict[int, int]]   # group -> {block index: block id}


@dataclass
class SeqKV:
    """One sequence's place in the cache: ``n`` tokens have KV, block tables per group (-1
    for blocks not held), the chain hashes of its full blocks, and its checkpoints."""
    n: int = 0
    tables: list[list[int]] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)


class PagedCache:
    """Block pools and tables for every layer group of a model."""

    def __init__(self, groups: list[CacheGroup], block_size: int,
                 copy_block: Callable[[int, int, int], None], max_checkpoints: int = 4):
        """Args:
            groups: the layer groups, each with its pool.
            block_size: tokens per block (a multiple of 16).
            copy_block: copies a block's pages in every layer of a group: (group, src, dst).
            max_checkpoints: sliding-window checkpoints a sequence keeps (oldest dropped).
        """
        self.groups = groups
        self.block_size = block_size
        self._copy = copy_block
        self.max_checkpoints = max_checkpoints
        self.sliding = [g for g in groups if g.window > 0]
        # Partly filled last blocks of released sequences, cached like full ones under a key
        # of their tokens: chain hash of the full blocks before -> [(tokens, key), ...].
        self.partials: dict[bytes, list[tuple[tuple[int, ...], bytes]]] = {}

    def new_state(self) -> SeqKV:
        return SeqKV(tables=[[] for _ in self.groups])

    # ---- the window a position needs --------------------------------------------

    def _first_needed(self, g: CacheGroup, n: int) -> int:
        """First block a sliding group must hold for a query at position n, with one block
        of slack so that a short rollback (rejected draft tokens) finds its window."""
        return max(0, n - g.window + 1 - self.block_size) // self.block_size

    def resumable(self, st: SeqKV, n: int) -> bool:
        """Whether the state holds what a query at position n (<= st.n) reads."""
        bs = self.block_size
        for g in self.sliding:
            lo = max(0, n - g.window + 1) // bs
            tab = st.tables[g.index]
            if any(i >= len(tab) or tab[i] < 0 for i in range(lo, (n - 1) // bs + 1)):
                return False
        return True

    # ---- growing, writing, committing ---------------------------------------------

    def reserve(self, st: SeqKV, count: int) -> None:
        """Make positions st.n .. st.n + count - 1 writable in every group: allocate missing
        blocks, copy shared ones (copy-on-write), and unhash owned ones about to change.

        Raises:
            blocks.PoolExhausted: a pool has no free block (the state is left consistent).
        """
        bs = self.block_size
        first, last = st.n // bs, (st.n + count - 1) // bs
        for g in self.groups:
            tab, pool = st.tables[g.index], g.pool
            while len(tab) <= last:
                tab.append(-1)
            for i in range(first, last + 1):
                b = tab[i]
                if b < 0:
                    tab[i] = pool.allocate()
                elif pool.ref_cnt[b] > 1:
                    nb = pool.allocate()
                    self._copy(g.index, b, nb)
                    pool.free(b)
                    tab[i] = nb
                elif pool.block_hash[b] is not None:
                    pool.uncommit(b)

    def advance(self, st: SeqKV, tokens: Sequence[int], n: int) -> None:
        """Record that positions up to n - 1 now hold KV (``tokens`` are the sequence's first
        n or more tokens): hash the newly full blocks, release blocks that left every
        sliding window."""
        bs = self.block_size
        done = len(st.hashes)
        st.n = n
        if n // bs > done:
            st.hashes = chain_hashes(tokens[:n // bs * bs], bs, done, st.hashes)
            for g in self.groups:
                tab = st.tables[g.index]
                for i in range(done, n // bs):
                    if tab[i] >= 0:
                        g.pool.commit(tab[i], group_hash(st.hashes[i], g.key))
        held = self._checkpoint_blocks(st)
        for g in self.sliding:
            tab = st.tables[g.index]
            for i in range(min(self._first_needed(g, n), len(tab))):
                if tab[i] >= 0:
                    # Out of the window: its pages are reused at once unless a checkpoint
                    # holds the block.
                    g.pool.free(tab[i], keep=(g.index, tab[i]) in held)
                    tab[i] = -1

    def _checkpoint_blocks(self, st: SeqKV) -> set[tuple[int, int]]:
        return {(gi, b) for cp in st.checkpoints for gi, m in cp.blocks.items()
                for b in m.values()}

    # ---- sharing ------------------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], limit: int) -> tuple[int, SeqKV]:
        """The longest cached prefix of ``tokens`` that a new sequence can start from, in
        whole blocks and at most ``limit`` tokens; its blocks are taken (ref counted).

        Returns:
            (tokens reused, the new state holding them).
        """
        bs = self.block_size
        st = self.new_state()
        chain = chain_hashes(tokens[:limit // bs * bs], bs)
        hits = []  # per group: block id per block index, or None
        for g in self.groups:
            hits.append([g.pool.lookup(group_hash(h, g.key)) for h in chain])
        best = 0
        for k in range(len(chain), 0, -1):
            p = k * bs
            ok = True
            for g in self.groups:
                lo = max(0, p - g.window + 1) // bs if g.window > 0 else 0
                if any(hits[g.index][i] is None for i in range(lo, k)):
                    ok = False
                    break
            if ok:
                best = k
                break
        extra, pblocks = self._match_partial(chain[best - 1] if best else b"",
                                             tokens[best * bs:limit])
        for g in self.groups:
            lo = self._first_needed(g, best * bs) if g.window > 0 else 0
            tab = st.tables[g.index]
            for i in range(best):
                b = hits[g.index][i] if i >= lo else None
                if b is None:
                    tab.append(-1)
                else:
                    g.pool.incref(b)
                    tab.append(b)
            if extra:
                g.pool.incref(pblocks[g.index])
                tab.append(pblocks[g.index])
        st.n = best * bs + extra
        st.hashes = chain[:best]
        return st.n, st

    def _match_partial(self, parent: bytes, rest: Sequence[int]) -> tuple[int, list[int]]:
        """The cached partial block after ``parent`` sharing most tokens with ``rest``:
        (tokens shared, its block id per group), or (0, [])."""
        best, blocks = 0, []
        entries = self.partials.get(parent, [])
        for toks, key in list(entries):
            found = [g.pool.lookup(group_hash(key, g.key)) for g in self.groups]
            if any(b is None for b in found):
                entries.remove((toks, key))  # evicted meanwhile
                continue
            m = 0
            while m < min(len(toks), len(rest)) and toks[m] == rest[m]:
                m += 1
            if m > best:
                best, blocks = m, found
        if not entries:
            self.partials.pop(parent, None)
        return best, blocks

    def fork(self, st: SeqKV) -> SeqKV:
        """A second state sharing every block and checkpoint of ``st`` (copy-on-write)."""
        new = SeqKV(st.n, [list(t) for t in st.tables], list(st.hashes),
                    [Checkpoint(cp.n, {g: dict(m) for g, m in cp.blocks.items()})
                     for cp in st.checkpoints])
        for g in self.groups:
            for b in new.tables[g.index]:
                if b >= 0:
                    g.pool.incref(b)
        for cp in new.checkpoints:
            for gi, m in cp.blocks.items():
                for b in m.values():
                    self.groups[gi].pool.incref(b)
        return new

    def trim(self, st: SeqKV, n: int) -> None:
        """Forget positions n.. (n <= st.n): whole blocks past n go back to the pool (cached
        if full), the block holding position n stays for the next writes."""
        bs = self.block_size
        keep = -(-n // bs)
        for g in self.groups:
            tab = st.tables[g.index]
            for b in tab[keep:]:
                if b >= 0:
                    g.pool.free(b)
            del tab[keep:]
        st.n = n
        del st.hashes[n // bs:]

    def checkpoint(self, st: SeqKV) -> None:
        """Keep the sliding windows at the current position (a turn boundary), so that the
        sequence, or a later one sharing this prefix, can resume here after moving on."""
        if not self.sliding or (st.checkpoints and st.checkpoints[-1].n == st.n):
            return
        blocks = {}
        for g in self.sliding:
            m = {i: b for i, b in enumerate(st.tables[g.index]) if b >= 0}
            for b in m.values():
                g.pool.incref(b)
            blocks[g.index] = m
        st.checkpoints.append(Checkpoint(st.n, blocks))
        while len(st.checkpoints) > self.max_checkpoints:
            self._drop_checkpoint(st.checkpoints.pop(0), keep=False)

    def _drop_checkpoint(self, cp: Checkpoint, keep: bool) -> None:
        for gi, m in cp.blocks.items():
            for b in m.values():
                self.groups[gi].pool.free(b, keep=keep)

    def restore(self, st: SeqKV, n: int) -> bool:
        """Go back to position n using a checkpoint whose windows cover it (sliding groups
        take the checkpoint's blocks, every group is trimmed to n). False if none does."""
        for cp in reversed(st.checkpoints):
            if not (cp.n - self.block_size <= n <= cp.n <= st.n):
                continue
            self.trim(st, n)
            for g in self.sliding:
                tab = st.tables[g.index]
                m = cp.blocks[g.index]
                for i in range(len(tab)):
                    b = m.get(i, -1)
                    if tab[i] >= 0:
                        g.pool.free(tab[i])
                    if b >= 0:
                        g.pool.incref(b)
                    tab[i] = b
            if self.resumable(st, n):
                return True
        return False

    def release(self, st: SeqKV, tokens: Sequence[int] = ()) -> None:
        """Give back everything the state holds; full blocks stay cached for later prefixes,
        and so does a partly filled last block when ``tokens`` (the sequence's) are given."""
        bs = self.block_size
        tail = tokens[st.n // bs * bs:st.n] if len(tokens) >= st.n else ()
        last = st.n // bs
        if tail and all(len(st.tables[g.index]) > last and st.tables[g.index][last] >= 0
                        for g in self.groups):
            parent = st.hashes[last - 1] if last else b""
            key = hashlib.blake2b(parent + b"partial" + bytes(repr(tuple(tail)), "ascii"),
                                  digest_size=16).digest()
            for g in self.groups:
                g.pool.commit(st.tables[g.index][last], group_hash(key, g.key))
            entries = self.partials.setdefault(parent, [])
            if (tuple(tail), key) not in entries:
                entries.append((tuple(tail), key))
                del entries[:-8]  # a few variants per prefix are plenty
        for g in self.groups:
            for b in st.tables[g.index]:
                if b >= 0:
                    g.pool.free(b)
            st.tables[g.index] = []
        for cp in st.checkpoints:
            self._drop_checkpoint(cp, keep=True)
        st.checkpoints = []
        st.n = 0
        st.hashes = []
        for g in self.sliding:
            if g.max_cached >= 0:
                g.pool.evict_cached(g.max_cached)

    def forget_cached(self) -> None:
        """Drop every cached prefix (blocks held by sequences are untouched)."""
        for g in self.groups:
            g.pool.evict_cached(0)
        self.partials.clear()

    # ---- batches and statistics ---------------------------------------------------

    def held_blocks(self, st: SeqKV, group: int) -> int:
        return sum(1 for b in st.tables[group] if b >= 0)

    def stats(self) -> list[PoolStats]:
        return [g.pool.stats() for g in self.groups]
