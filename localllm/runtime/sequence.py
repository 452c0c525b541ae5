"""Sequences over a model's placed layers: the per-request state (tokens, block tables), the
model's paged KV space on the layers' backends, and the forward pass over a batch of
sequences (blocks reserved, tables built, prefixes reused).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence as Seq

import numpy as np

from localllm.backends.base import KVBatch, KVLayout
from localllm.runtime.kv.blocks import BlockPool, PoolExhausted, PoolStats
from localllm.runtime.kv.cache import CacheGroup, PagedCache, SeqKV
from localllm.models.net import Net


class EngineError(ValueError):
    """A request the engine cannot serve (e.g. a prompt longer than the context)."""


@dataclass
class KVStats:
    """The KV cache at a glance: blocks (all groups together), bytes per token for the KV
    types, and what the blocks in use take."""
    block_size: int
    blocks_total: int
    blocks_used: int
    blocks_cached: int
    blocks_free: int
    bytes_per_token: int
    k_type: str
    v_type: str
    used_bytes: int
    groups: list[PoolStats]


class KVSpace:
    """A model's paged KV cache: its layers grouped by block layout (window, heads, head
    size), a block pool per group, and each layer's pages on that layer's backend."""

    def __init__(self, net: Net, k_type: str, v_type: str, block_size: int, pool_tokens: int,
                 model_key: bytes, max_checkpoints: int = 4):
        self.k_type, self.v_type, self.block_size = k_type, v_type, block_size
        keys: dict[tuple, int] = {}
        for layer in net.layers:
            s = layer.spec
            layer.group = keys.setdefault((s.window, s.n_kv_heads, s.head_dim), len(keys))
        n_blocks = max(1, -(-pool_tokens // block_size))
        self.group_layers: list[list] = [[] for _ in keys]
        for layer in net.layers:
            self.group_layers[layer.group].append(layer)
        groups = []
        self.pages: list = [None] * len(net.layers)  # per layer, on its backend
        for (window, n_kv, hd), gi in keys.items():
            layout = KVLayout(n_kv, hd, block_size, k_type, v_type)
            for layer in self.group_layers[gi]:
                self.pages[layer.index] = layer.backend.new_kv_pages(layout, n_blocks)
            key = hashlib.blake2b(model_key + repr((gi, window, n_kv, hd, block_size, k_type,
                                                    v_type)).encode(), digest_size=16).digest()
            # A sliding group keeps few cached blocks beyond its windows: its memory stays
            # bounded however many turns have passed.
            cap = 4 * (window // block_size + 2) if window else -1
            groups.append(CacheGroup(gi, [la.index for la in self.group_layers[gi]], window,
                                     BlockPool(n_blocks, block_size), key, cap))
        self.cache = PagedCache(groups, block_size, self._copy, max_checkpoints)
        self.block_bytes = [sum(la.backend.kv_block_nbytes(self.pages[la.index].layout)
                                for la in g) for g in self.group_layers]
        self.bytes_per_token = sum(self.block_bytes) // block_size

    def _copy(self, group: int, src: int, dst: int) -> None:
        for layer in self.group_layers[group]:
            layer.backend.copy_kv_block(self.pages[layer.index], src, dst)

    def stats(self) -> KVStats:
        per = self.cache.stats()
        return KVStats(self.block_size, sum(p.total for p in per), sum(p.used for p in per),
                       sum(p.cached for p in per), sum(p.free for p in per),
                       self.bytes_per_token, self.k_type, self.v_type,
                       sum(p.used * b for p, b in zip(per, self.block_bytes)), per)


class Sequence:
    """One request's state: the tokens whose KV it holds and its block tables. Made by
    ``Model.new_sequence()``; release it (or use it as a context manager) when done."""

    def __init__(self, runner: "Runner", kv: SeqKV | None = None, tokens: Seq[int] = ()):
        self._runner = runner
        self.kv = kv if kv is not None else runner.space.cache.new_state()
        self._tokens = list(tokens)
        self.released = False

    @property
    def tokens(self) -> tuple[int, ...]:
        """The tokens whose keys and values this sequence holds, in order."""
        return tuple(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def feed(self, ids: Seq[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens and return the last position's logits (vocab,), or every new
        position's (len(ids), vocab) with ``all_logits``."""
        return self._runner.feed(self, ids, all_logits)

    def fork(self) -> "Sequence":
        """A copy that shares every block with this one until either writes (copy-on-write)."""
        self._check()
        return Sequence(self._runner, self._runner.space.cache.fork(self.kv), self._tokens)

    def trim(self, n: int) -> int:
        """Keep only the first n tokens (e.g. to drop rejected draft tokens). Returns the
        length kept: n, or less where a sliding window has moved on past n (then from the
        latest checkpoint before it; a rollback of up to a block is always exact)."""
        self._check()
        if not 0 <= n <= len(self._tokens):
            raise EngineError(f"cannot trim a sequence of {len(self._tokens)} tokens to {n}")
        return self._runner.rewind(self, n)

    def adopt(self, other: "Sequence") -> None:
        """Take over ``other``'s tokens and blocks (releasing this one's); ``other`` ends."""
        self._check()
        other._check()
        self._runner.space.cache.release(self.kv, self._tokens)
        self.kv, self._tokens = other.kv, other._tokens
        other.released = True
        other._tokens = []

    def release(self) -> None:
        """Return the blocks to the pool (full ones stay cached for later prefixes)."""
        if not self.released:
            self.released = True
            self._runner.space.cache.release(self.kv, self._tokens)
            self._tokens = []

    def _check(self) -> None:
        if self.released:
            raise EngineError("this sequence has been released")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        # Dropped without release(): hand the state to the runner, which frees it before its
        # next step (never here, where a collection may interrupt the pool's bookkeeping).
        if not self.released:
            self._runner.orphans.append((self.kv, self._tokens))


class Runner:
    """Runs sequences through a model's layers."""

    def __init__(self, net: Net, space: KVSpace, ctx: int, batch_size: int, vocab_size: int):
        self.net, self.space, self.ctx = net, space, ctx
        self.batch_size = max(1, batch_size)
        self.vocab_size = vocab_size
        self.orphans: list[tuple[SeqKV, list[int]]] = []

    def _collect(self) -> None:
        while self.orphans:
            self.space.cache.release(*self.orphans.pop())

    def feed(self, seq: Sequence, ids: Seq[int], all_logits: bool) -> np.ndarray:
        """Tokens appended to one sequence in prompt chunks of at most batch_size."""
        ids = [int(t) for t in ids]
        if not ids:
            raise EngineError("nothing to process")
        if len(seq) + len(ids) > self.ctx:
            raise EngineError(f"{len(seq) + len(ids)} tokens exceed the context size {self.ctx}")
        outs = []
        bs = self.batch_size
        for s in range(0, len(ids), bs):
            # logits: every row's, the very last row's, or none for an inner prompt chunk
            want = True if all_logits else (False if s + bs >= len(ids) else None)
            out = self.step([(seq, ids[s:s + bs], want)])[0]
            if out is not None:
                outs.append(out)
        return np.concatenate(outs) if all_logits and len(outs) > 1 else outs[-1]

    def step(self, items: list[tuple[Sequence, list[int], bool | None]]) -> list:
        """One forward pass over several sequences' new tokens.

        Args:
            items: (sequence, token ids, logits wanted: True every position's, False the
                last one's, None none); each sequence at most once.
        Returns:
            Per item: float32 (len(ids), vocab), (vocab,) or None.
        Raises:
            EngineError: bad tokens, a full context or a full KV pool.
        """
        self._collect()
        cache = self.space.cache
        if len({id(s) for s, _, _ in items}) != len(items):
            raise EngineError("a sequence appears twice in one step")
        for seq, ids, _ in items:
            seq._check()
            if not ids:
                raise EngineError("nothing to process")
            if len(seq) + len(ids) > self.ctx:
                raise EngineError(f"{len(seq) + len(ids)} tokens exceed the context size "
                                  f"{self.ctx}")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise EngineError(f"token id {bad[0]} is outside the vocabulary "
                                  f"(0..{self.vocab_size - 1})")
        for seq, ids, _ in items:
            try:
                cache.reserve(seq.kv, len(ids))
            except PoolExhausted as e:
                raise EngineError(f"the KV cache is full ({e}); free sequences, or give the "
                                  "pool more room (--kv-pool-mb)") from None
        lens = [len(ids) for _, ids, _ in items]
        flat = np.fromiter((t for _, ids, _ in items for t in ids), np.int64, sum(lens))
        positions = np.concatenate([np.arange(len(s), len(s) + n, dtype=np.int64)
                                    for (s, _, _), n in zip(items, lens)])
        row_seq = np.repeat(np.arange(len(items), dtype=np.int32), lens)
        tables = []
        for g in cache.groups:
            width = max(len(s.kv.tables[g.index]) for s, _, _ in items)
            tab = np.full((len(items), width), -1, np.int32)
            for r, (s, _, _) in enumerate(items):
                t = s.kv.tables[g.index]
                tab[r, :len(t)] = t
            tables.append(tab)
        kv = KVBatch(self.space.pages, tables, row_seq, cache.block_size)
        rows, spans, at = [], [], 0
        for (_, _, want), n in zip(items, lens):
            first = len(rows)
            if want:
                rows.extend(range(at, at + n))
            elif want is not None:
                rows.append(at + n - 1)
            spans.append((first, len(rows)))
            at += n
        logits = self.net.forward(flat, positions, kv, rows)
        out = []
        for (seq, ids, want), (a, b) in zip(items, spans):
            seq._tokens.extend(ids)
            cache.advance(seq.kv, seq._tokens, len(seq._tokens))
            out.append(None if want is None else logits[a:b] if want else logits[a])
        return out

    def rewind(self, seq: Sequence, n: int) -> int:
        """Go back to the latest point at or before n from which the sequence can go on (a
        sliding window that has moved on needs a checkpoint); returns that point."""
        cache = self.space.cache
        if n < len(seq):
            if cache.resumable(seq.kv, n):
                cache.trim(seq.kv, n)
            elif not cache.restore(seq.kv, n):
                at = next((cp.n for cp in reversed(seq.kv.checkpoints)
                           if cp.n <= n and cache.restore(seq.kv, cp.n)), 0)
                if at == 0:
                    cache.release(seq.kv)
                    seq.kv = cache.new_state()
                n = at
        del seq._tokens[n:]
        return n

    def reuse(self, seq: Sequence, ids: Seq[int]) -> int:
        """Prepare ``seq`` to process ``ids``: keep its longest usable common prefix, or take
        a longer one from the prefix cache; returns how many tokens need no processing (at
        most len(ids) - 1: the last token always runs, for its logits)."""
        self._collect()
        limit = len(ids) - 1
        own = seq._tokens
        common = 0
        while common < min(len(own), limit) and own[common] == ids[common]:
            common += 1
        kept = self.rewind(seq, common)
        cache = self.space.cache
        if limit // cache.block_size * cache.block_size > kept:  # the cache may hold more
            n, st = cache.match_prefix(ids, limit)
            if n > kept:
                cache.release(seq.kv, seq._tokens)
                seq.kv = st
                seq._tokens = list(ids[:n])
                return n
            cache.release(st)
        return kept
