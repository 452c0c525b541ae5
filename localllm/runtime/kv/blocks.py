"""KV block bookkeeping (no arrays): a pool of fixed-size blocks with reference counts, an O(1)
free queue that doubles as the LRU order of cached blocks, and chained prefix hashes.

The pages themselves belong to the backends that hold each layer; a block id names the same
page in every layer of one group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

from localllm.errors import KVPoolFull

# Every block of a pool is referenced: nothing is free and nothing cached can be evicted.
# The pool's name for localllm.errors.KVPoolFull (the same class, still a RuntimeError).
PoolExhausted = KVPoolFull


def chain_hashes(tokens: Sequence[int], block_size: int, start: int = 0,
                 parents: Sequence[bytes] = ()) -> list[bytes]:
    """Hashes of the full blocks of ``tokens``: block i's hash covers tokens 0..(i+1)*bs-1,
    chained through the previous block's hash.

    Args:
        tokens: the sequence's tokens.
        block_size: tokens per block.
        start: blocks already hashed (their hashes are ``parents``, which has ``start`` items).
        parents: earlier hashes of the same chain.
    Returns:
        The hashes of blocks 0 .. len(tokens) // block_size - 1 (``parents`` included).
    """
    out = list(parents[:start])
    prev = out[-1] if out else b""
    for i in range(start, len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(b"".join(int(t).to_bytes(4, "little") for t in block))
        prev = h.digest()
        out.append(prev)
    return out


def group_hash(chain: bytes, key: bytes) -> bytes:
    """A block's hash within one cache group: the chain hash bound to what else shapes the
    block's content (model file, layer group, KV types)."""
    return hashlib.blake2b(chain + key, digest_size=16).digest()


@dataclass
class PoolStats:
    """Counts of a pool's blocks: ``used`` are referenced, ``cached`` are free but hold a
    hashed full block (reusable until evicted), ``free`` is every unreferenced one (cached
    included)."""
    total: int
    used: int
    cached: int
    free: int


class BlockPool:
    """Blocks 0..num_blocks-1 of ``block_size`` tokens.

    Free blocks wait in one queue: a block freed without content worth keeping goes to the
    front (taken first: its pages are already in memory), a freed block that holds a hashed
    prefix goes to the back (kept longest: least recently used first out). New blocks come
    from the front; taking a cached block evicts its hash.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("a block pool needs a positive size")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Doubly linked free queue over block ids, sentinel at index num_blocks.
        n = num_blocks
        self._next = list(range(1, n + 1)) + [0]
        self._prev = [n] + list(range(n))
        self._in_queue = [True] * n
        self.num_free = n
        self.num_cached_free = 0  # free blocks that still hold a hashed prefix

    # ---- free queue --------------------------------------------------------------

    def _unlink(self, b: int) -> None:
        if self.block_hash[b] is not None:
            self.num_cached_free -= 1
        p, q = self._prev[b], self._next[b]
        self._next[p] = q
        self._prev[q] = p
        self._in_queue[b] = False
        self.num_free -= 1

    def _link_after(self, at: int, b: int) -> None:
        q = self._next[at]
        self._next[at] = b
        self._prev[b] = at
        self._next[b] = q
        self._prev[q] = b
        self._in_queue[b] = True
        self.num_free += 1
        if self.block_hash[b] is not None:
            self.num_cached_free += 1

    def free_order(self) -> list[int]:
        """Free block ids in the order they would be taken (for tests and statistics)."""
        out, b = [], self._next[self.num_blocks]
        while b != self.num_blocks:
            out.append(b)
            b = self._next[b]
        return out

    # ---- allocation ----------------------------------------------------------------

    def allocate(self) -> int:
        """A block with ref_cnt 1 and no hash (its page content is stale).

        Raises:
            PoolExhausted: every block is referenced.
        """
        b = self._next[self.num_blocks]
        if b == self.num_blocks:
            raise PoolExhausted(f"all {self.num_blocks} KV blocks are in use")
        self._unlink(b)
        self._drop_hash(b)
        self.ref_cnt[b] = 1
        return b

    def incref(self, b: int) -> None:
        """One more holder of block ``b`` (a cache hit, a fork, a checkpoint)."""
        if self.ref_cnt[b] == 0:
            self._unlink(b)
        self.ref_cnt[b] += 1

    def free(self, b: int, keep: bool = True) -> None:
        """One holder fewer. At zero the block becomes free: cached at the back of the queue
        if it holds a hashed block and ``keep``, else unhashed at the front."""
        if self.ref_cnt[b] <= 0:
            raise ValueError(f"block {b} freed more often than held")
        self.ref_cnt[b] -= 1
        if self.ref_cnt[b]:
            return
        if keep and self.block_hash[b] is not None:
            self._link_after(self._prev[self.num_blocks], b)
        else:
            self._drop_hash(b)
            self._link_after(self.num_blocks, b)

    # ---- prefix cache --------------------------------------------------------------

    def lookup(self, h: bytes) -> int | None:
        """The block holding hash ``h``, if cached (referenced or not)."""
        return self.cached.get(h)

    def commit(self, b: int, h: bytes) -> None:
        """Register full block ``b`` under hash ``h`` (no-op if another block holds it)."""
        if self.block_hash[b] is None and h not in self.cached:
            self.block_hash[b] = h
            self.cached[h] = b
            if self._in_queue[b]:
                self.num_cached_free += 1

    def uncommit(self, b: int) -> None:
        """Forget block ``b``'s hash: its content is about to change."""
        self._drop_hash(b)

    def _drop_hash(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            if self._in_queue[b]:
                self.num_cached_free -= 1
            self.block_hash[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]

    def evict_cached(self, keep: int) -> None:
        """Forget the least recently used cached free blocks until at most ``keep`` remain
        (the freed blocks move to the front of the queue)."""
        n = self.num_blocks
        over = self.num_cached_free - keep
        b = self._next[n]
        while over > 0 and b != n:
            nxt = self._next[b]
            if self.block_hash[b] is not None:
                self._unlink(b)
                self._drop_hash(b)
                self._link_after(n, b)
                over -= 1
            b = nxt

    def stats(self) -> PoolStats:
        return PoolStats(self.num_blocks, self.num_blocks - self.num_free,
                         self.num_cached_free, self.num_free)
