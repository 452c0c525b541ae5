"""Sequences over a model's placed layers: the per-request state (tokens, block tables), the
model's paged KV space on the layers' backends, and the forward pass over a batch of
sequences (blocks reserved, tables built, prefixes reused).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal, Sequence as Seq

import numpy as np

from localllm.backends.base import KVBatch, KVLayout
from localllm.errors import (ContextFull, EmptyPrompt, EngineError, KVPoolFull, SequenceError,
                             TokenOutOfVocab)
from localllm.runtime.kv.blocks import BlockPool, PoolStats
from localllm.runtime.kv.cache import CacheGroup, PagedCache, SeqKV
from localllm.runtime.recurrent import RecurrentSpace, SeqStates
from localllm.models.net import Net

# EngineError is re-exported here, where it was defined before localllm.errors.
__all__ = ["EngineError", "KVSpace", "KVStats", "Runner", "Sequence", "StepItem", "check_tokens"]


def check_tokens(ids: Seq[int], vocab_size: int, param: str | None = None) -> None:
    """Raises TokenOutOfVocab naming the first id outside 0..vocab_size - 1.

    Args:
        ids: token ids.
        vocab_size: the model's vocabulary size.
        param: the argument or request field the ids came from.
    """
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise TokenOutOfVocab(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                              param=param, token=int(bad), vocab_size=vocab_size)


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
    recurrent_bytes: int = 0     # recurrent layers' states of the live sequences
    checkpoint_bytes: int = 0    # their snapshots (sequences' and the prefix store's)


@dataclass(frozen=True)
class KVGroupSpec:
    """Layers that share one block table per sequence: those with the same sliding window
    (0: full attention), KV heads and head size."""
    window: int
    n_kv_heads: int
    head_dim: int
    layers: tuple[int, ...]    # layer indices, in order


def kv_groups(layers: Seq) -> list[KVGroupSpec]:
    """Group a net's placed layers by block layout, groups in order of first appearance.

    Args:
        layers: the net's PlacedLayers.
    Returns:
        One KVGroupSpec per group; every layer with pages of its own is in exactly one
        (a layer reading another's KV, ``spec.kv_source``, is in none: it uses that
        layer's pages and group; nor is a recurrent layer, which has a state instead).
    """
    members: dict[tuple[int, int, int], list[int]] = {}
    for layer in layers:
        s = layer.spec
        if s.kv_source >= 0 or s.recurrent is not None:
            continue
        members.setdefault((s.window, s.n_kv_heads, s.head_dim), []).append(layer.index)
    return [KVGroupSpec(w, n_kv, hd, tuple(ix)) for (w, n_kv, hd), ix in members.items()]


class KVSpace:
    """A model's paged KV cache: its layers grouped by block layout (window, heads, head
    size), a block pool per group, and each layer's pages on that layer's backend.
    ``layer_group[i]`` is layer i's group: the forward pass reads it from here (KVBatch).
    A layer that reads another's KV (shared KV) gets that layer's pages and group: no
    memory of its own."""

    def __init__(self, net: Net, k_type: str, v_type: str, block_size: int, pool_tokens: int,
                 model_key: bytes, max_checkpoints: int = 4):
        self.k_type, self.v_type, self.block_size = k_type, v_type, block_size
        self.kv_groups = kv_groups(net.layers)
        self.layer_group: list[int] = [0] * len(net.layers)
        for gi, g in enumerate(self.kv_groups):
            for i in g.layers:
                self.layer_group[i] = gi
        n_blocks = max(1, -(-pool_tokens // block_size))
        by_index = {layer.index: layer for layer in net.layers}
        self.group_layers: list[list] = [[by_index[i] for i in g.layers] for g in self.kv_groups]
        groups = []
        self.pages: list = [None] * len(net.layers)  # per layer, on its backend
        for gi, g in enumerate(self.kv_groups):
            window, n_kv, hd = g.window, g.n_kv_heads, g.head_dim
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
        for layer in net.layers:
            src = layer.spec.kv_source
            if src >= 0:
                if self.pages[src] is None or by_index[src].spec.kv_source >= 0:
                    raise EngineError(f"layer {layer.index} reads the KV of layer {src}, "
                                      "which has none of its own")
                self.pages[layer.index] = self.pages[src]
                self.layer_group[layer.index] = self.layer_group[src]
        self.cache = PagedCache(groups, block_size, self._copy, max_checkpoints)
        # a recurrent snapshot is a whole state (MBs per sequence): few are kept
        self.recurrent = RecurrentSpace(net, block_size)
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
                       sum(p.used * b for p, b in zip(per, self.block_bytes)), per,
                       self.recurrent.live_bytes(), self.recurrent.checkpoint_bytes())


class Sequence:
    """One request's state: the tokens whose KV it holds, its block tables and, for models
    with recurrent layers, their states (``rec``). Made by ``Model.new_sequence()``; release
    it (or use it as a context manager) when done."""

    def __init__(self, runner: "Runner", kv: SeqKV | None = None, tokens: Seq[int] = (),
                 rec: SeqStates | None = None):
        self._runner = runner
        self.kv = kv if kv is not None else runner.space.cache.new_state()
        space = runner.space.recurrent
        self.rec = rec if rec is not None or not space else space.new()
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
        space = self._runner.space
        rec = space.recurrent.fork(self.rec) if self.rec is not None else None
        return Sequence(self._runner, space.cache.fork(self.kv), self._tokens, rec)

    def trim(self, n: int) -> int:
        """Keep only the first n tokens (e.g. to drop rejected draft tokens). Returns the
        length kept: n, or less where a sliding window has moved on past n (then from the
        latest checkpoint before it; a rollback of up to a block is always exact)."""
        self._check()
        if not 0 <= n <= len(self._tokens):
            raise SequenceError(f"cannot trim a sequence of {len(self._tokens)} tokens to {n}",
                                param="n")
        return self._runner.rewind(self, n)

    def adopt(self, other: "Sequence") -> None:
        """Take over ``other``'s tokens and blocks (releasing this one's); ``other`` ends."""
        self._check()
        other._check()
        self._runner.space.cache.release(self.kv, self._tokens)
        if self.rec is not None:
            self._runner.space.recurrent.release(self.rec, self._tokens)
        self.kv, self._tokens, self.rec = other.kv, other._tokens, other.rec
        other.released = True
        other._tokens = []

    def release(self) -> None:
        """Return the blocks to the pool (full ones stay cached for later prefixes)."""
        if not self.released:
            self.released = True
            self._runner.space.cache.release(self.kv, self._tokens)
            if self.rec is not None:
                self._runner.space.recurrent.release(self.rec, self._tokens)
            self._tokens = []

    # ---- the Runner's side: it keeps the tokens and the KV state in step -------------

    def extend_tokens(self, ids: Seq[int]) -> None:
        """Append tokens whose KV a forward pass has just written, and let the cache hash
        the blocks they filled (for prefix reuse). Called by the Runner after a step.

        Args:
            ids: the tokens run, in order.
        """
        self._tokens.extend(ids)
        self._runner.space.cache.advance(self.kv, self._tokens, len(self._tokens))

    def truncate_tokens(self, n: int) -> None:
        """Forget every token after the first n (the cache state is already rewound).

        Args:
            n: tokens kept.
        """
        del self._tokens[n:]

    def reset_state(self, kv: SeqKV, tokens: Seq[int], rec: SeqStates | None = None) -> None:
        """Take a new cache state holding ``tokens`` (e.g. a prefix found in the cache); the
        caller has released the old one.

        Args:
            kv: the new state; tokens: the tokens whose KV it holds; rec: the recurrent
                states after them (models with recurrent layers; None: keep the current).
        """
        self.kv = kv
        self._tokens = list(tokens)
        if rec is not None:
            self.rec = rec

    def _check(self) -> None:
        if self.released:
            raise SequenceError("this sequence has been released")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        # Dropped without release(): hand the state to the runner, which frees it before its
        # next step (never here, where a collection may interrupt the pool's bookkeeping).
        if not self.released:
            self._runner.orphans.append((self.kv, self._tokens))
            if self.rec is not None:
                self._runner.space.recurrent.live -= 1


LOGITS = ("none", "last", "all")


@dataclass(frozen=True)
class StepItem:
    """One sequence's part of a forward pass: its new tokens and the logits wanted back,
    "none" (an inner prompt chunk), "last" (the last position's) or "all" (every position's,
    e.g. a draft to verify)."""
    seq: Sequence
    tokens: Seq[int]
    logits: Literal["none", "last", "all"] = "last"

    def __post_init__(self):
        if self.logits not in LOGITS:
            raise ValueError(f"StepItem logits must be one of {', '.join(map(repr, LOGITS))}, "
                             f"got {self.logits!r}")


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
            raise EmptyPrompt("nothing to process", param="ids")
        if len(seq) + len(ids) > self.ctx:
            raise ContextFull(f"{len(seq) + len(ids)} tokens exceed the context size {self.ctx}",
                              param="ids")
        outs = []
        for s, e in self._chunks(len(seq), len(ids)):
            # logits: every row's, the very last row's, or none for an inner prompt chunk
            want = "all" if all_logits else ("last" if e >= len(ids) else "none")
            out = self.step([StepItem(seq, ids[s:e], want)])[0]
            if out is not None:
                outs.append(out)
            if e == len(ids) - 1 and seq.rec is not None:  # a regenerated answer starts here
                self.space.recurrent.checkpoint(seq.rec, turn=True)
        return np.concatenate(outs) if all_logits and len(outs) > 1 else outs[-1]

    def _chunks(self, start: int, n: int) -> list[tuple[int, int]]:
        """Prompt chunks of at most batch_size over n tokens that follow ``start`` ones; with
        recurrent layers also cut at the last block boundary and before the last token, where
        their states are snapshot (for a later turn or a regenerated answer: the results do
        not depend on the cuts)."""
        cuts = set(range(0, n, self.batch_size)) | {n}
        if self.space.recurrent and n > 1:
            bs = self.space.block_size
            last = (start + n - 1) // bs * bs - start
            cuts |= {c for c in (last, n - 1) if 0 < c < n}
        cuts = sorted(cuts)
        return list(zip(cuts[:-1], cuts[1:]))

    def step(self, items: list[StepItem], hidden: bool = False) -> list:
        """One forward pass over several sequences' new tokens.

        Args:
            items: each sequence at most once, with its tokens and the logits wanted.
            hidden: the rows' final hidden states (dim wide) in place of logits (embeddings).
        Returns:
            Per item, as its ``logits`` says: float32 (len(tokens), vocab) for "all",
            (vocab,) for "last", None for "none".
        Raises:
            SequenceError: a sequence released, or given twice.
            EmptyPrompt, ContextFull, TokenOutOfVocab: no tokens, too many, or unknown ones.
            KVPoolFull: the KV pool has no room for the new tokens.
            TypeError: an item that is not a StepItem.
        """
        self._collect()
        cache = self.space.cache
        for it in items:
            if not isinstance(it, StepItem):
                raise TypeError(f"Runner.step takes StepItems, got {type(it).__name__}")
        if len({id(it.seq) for it in items}) != len(items):
            raise SequenceError("a sequence appears twice in one step")
        for it in items:
            seq, ids = it.seq, it.tokens
            seq._check()
            if not ids:
                raise EmptyPrompt("nothing to process", param="ids")
            if len(seq) + len(ids) > self.ctx:
                raise ContextFull(f"{len(seq) + len(ids)} tokens exceed the context size "
                                  f"{self.ctx}", param="ids")
            check_tokens(ids, self.vocab_size, "ids")
        for it in items:
            try:
                cache.reserve(it.seq.kv, len(it.tokens))
            except KVPoolFull as e:
                raise KVPoolFull(f"the KV cache is full ({e}); free sequences, or give the "
                                 "pool more room (--kv-pool-mb)", param="kv_pool_mb") from None
        lens = [len(it.tokens) for it in items]
        flat = np.fromiter((t for it in items for t in it.tokens), np.int64, sum(lens))
        positions = np.concatenate([np.arange(len(it.seq), len(it.seq) + n, dtype=np.int64)
                                    for it, n in zip(items, lens)])
        row_seq = np.repeat(np.arange(len(items), dtype=np.int32), lens)
        tables = []
        for g in cache.groups:
            width = max(len(it.seq.kv.tables[g.index]) for it in items)
            tab = np.full((len(items), width), -1, np.int32)
            for r, it in enumerate(items):
                t = it.seq.kv.tables[g.index]
                tab[r, :len(t)] = t
            tables.append(tab)
        rec = self.space.recurrent
        states = rec.batch([it.seq.rec for it in items], len(self.space.pages)) if rec else ()
        kv = KVBatch(self.space.pages, tables, row_seq, cache.block_size,
                     self.space.layer_group, states)
        rows, spans, at = [], [], 0
        for it, n in zip(items, lens):
            first = len(rows)
            if it.logits == "all":
                rows.extend(range(at, at + n))
            elif it.logits == "last":
                rows.append(at + n - 1)
            spans.append((first, len(rows)))
            at += n
        logits = self.net.forward(flat, positions, kv, rows, hidden) if hidden else \
            self.net.forward(flat, positions, kv, rows)
        out = []
        for it, (a, b) in zip(items, spans):
            it.seq.extend_tokens(it.tokens)
            if rec:
                rec.advanced(it.seq.rec, len(it.tokens))
            out.append(None if it.logits == "none" else logits[a:b] if it.logits == "all"
                       else logits[a])
        return out

    def rewind(self, seq: Sequence, n: int) -> int:
        """Go back to the latest point at or before n from which the sequence can go on (a
        sliding window that has moved on needs a checkpoint); returns that point."""
        cache = self.space.cache
        if n < len(seq) and seq.rec is not None:
            n = self.space.recurrent.restore(seq.rec, n)  # exact only at a snapshot
        if n < len(seq):
            if cache.resumable(seq.kv, n):
                cache.trim(seq.kv, n)
            elif not cache.restore(seq.kv, n):
                at = next((cp.n for cp in reversed(seq.kv.checkpoints)
                           if cp.n <= n and cache.restore(seq.kv, cp.n)), 0)
                if at == 0:
                    cache.release(seq.kv)
                    seq.reset_state(cache.new_state(), ())
                n = at
        seq.truncate_tokens(n)
        return n

    def reuse(self, seq: Sequence, ids: Seq[int]) -> int:
        """Prepare ``seq`` to process ``ids``: keep its longest usable common prefix, or take
        a longer one from the prefix cache; returns how many tokens need no processing (at
        most len(ids) - 1: the last token always runs, for its logits)."""
        self._collect()
        limit = len(ids) - 1
        own = seq.tokens
        common = 0
        while common < min(len(own), limit) and own[common] == ids[common]:
            common += 1
        kept = self.rewind(seq, common)
        cache = self.space.cache
        # the cache may hold more (in whole blocks; or, where states are snapshot at turn
        # ends, in a released sequence's partial block)
        if limit // cache.block_size * cache.block_size > kept or \
                (self.space.recurrent and limit > kept):
            n, st = cache.match_prefix(ids, limit)
            snap = None
            if n > kept and seq.rec is not None:  # recurrent states exist at snapshots only
                snap = self.space.recurrent.lookup(ids, n)
                if snap is None or snap.n <= kept:
                    n = kept
                else:
                    cache.trim(st, snap.n)
                    n = snap.n
            if n > kept:
                cache.release(seq.kv, seq.tokens)
                rec = None
                if snap is not None:
                    self.space.recurrent.release(seq.rec, seq.tokens)
                    rec = self.space.recurrent.from_snapshot(snap)
                seq.reset_state(st, ids[:n], rec)
                return n
            cache.release(st)
        return kept

    def checkpoint(self, seq: Sequence) -> None:
        """Keep the sequence's state at a turn end (sliding windows, recurrent states), so
        that it, or a later sequence sharing this prefix, can resume here."""
        self.space.cache.checkpoint(seq.kv)
        if seq.rec is not None:
            self.space.recurrent.checkpoint(seq.rec, turn=True)
