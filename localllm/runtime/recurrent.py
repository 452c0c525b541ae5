"""Per-layer memory of the second kind: the recurrent states of a model's linear-attention
layers (one per sequence, on each layer's backend), their checkpoints at KV block boundaries
and turn ends, and a small store of released sequences' states for prefix reuse.

A recurrent state cannot be trimmed: going back to n tokens needs the state as it was at n,
so sequences keep a bounded number of snapshots; a rewind or a reused prefix lands on the
latest snapshot at or before the point asked for.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence as Seq


SEQ_CHECKPOINTS = 2   # block-boundary snapshots a sequence keeps (and as many turn-end ones)
CACHED_SNAPSHOTS = 6  # released sequences' snapshots kept for later prefixes


def states_held(n_seqs: int) -> int:
    """The most recurrent states (each a whole model's worth) n_seqs sequences hold: each a
    live one and its snapshots, plus the released ones cached."""
    return n_seqs * (1 + 2 * SEQ_CHECKPOINTS) + CACHED_SNAPSHOTS


@dataclass(frozen=True, eq=False)
class Snapshot:
    """The states of every recurrent layer after ``n`` tokens (never written again)."""
    n: int
    states: tuple
    turn: bool = False   # taken at a turn end (kept apart from the block-boundary ones)


@dataclass
class SeqStates:
    """One sequence's recurrent states (by recurrent layer, in layer order) after ``n``
    tokens, and its snapshots, oldest first."""
    n: int = 0
    states: list = field(default_factory=list)
    checkpoints: list[Snapshot] = field(default_factory=list)


class RecurrentSpace:
    """The recurrent layers of a model and the states of its sequences."""

    def __init__(self, net, block_size: int, max_checkpoints: int = SEQ_CHECKPOINTS,
                 max_cached: int = CACHED_SNAPSHOTS):
        """Args:
            net: the model's Net (layers whose spec has ``recurrent`` set keep states).
            block_size: the KV block size: snapshots are taken at its multiples.
            max_checkpoints: block-boundary snapshots a sequence keeps (and as many turn-end
                ones); max_cached: released sequences' snapshots kept for later prefixes.
        """
        self.layers = [la for la in net.layers if la.spec.recurrent is not None]
        self.block_size = block_size
        self.max_checkpoints = max_checkpoints
        self.max_cached = max_cached
        self.state_nbytes = sum(la.backend.recurrent_state_nbytes(la.spec.recurrent)
                                for la in self.layers)
        # released sequences' snapshots: their tokens -> Snapshot, least recently used first
        self.cached: OrderedDict[tuple, Snapshot] = OrderedDict()
        self.live = 0    # sequences holding states
        self._snapshots: weakref.WeakSet = weakref.WeakSet()  # every snapshot still held

    def __bool__(self) -> bool:
        return bool(self.layers)

    # ---- a sequence's states

    def new(self) -> SeqStates:
        self.live += 1
        return SeqStates(0, [la.backend.new_recurrent_state(la.spec.recurrent)
                             for la in self.layers])

    def _copies(self, states) -> list:
        return [la.backend.copy_recurrent_state(s) for la, s in zip(self.layers, states)]

    def fork(self, st: SeqStates) -> SeqStates:
        """An independent copy (snapshots are shared: they are never written)."""
        self.live += 1
        return SeqStates(st.n, self._copies(st.states), list(st.checkpoints))

    def from_snapshot(self, snap: Snapshot) -> SeqStates:
        self.live += 1
        return SeqStates(snap.n, self._copies(snap.states), [snap])

    def batch(self, seqs: Seq[SeqStates], n_layers: int) -> list:
        """KVBatch.states for a step over these sequences: by layer index, each row's state
        (None for layers without)."""
        out: list = [None] * n_layers
        for k, la in enumerate(self.layers):
            out[la.index] = [st.states[k] for st in seqs]
        return out

    def advanced(self, st: SeqStates, count: int, turn: bool = False) -> None:
        """Record ``count`` more tokens run; snapshot at a block boundary (or ``turn``)."""
        st.n += count
        if turn or st.n % self.block_size == 0:
            self.checkpoint(st, turn)

    def checkpoint(self, st: SeqStates, turn: bool = False) -> None:
        """Snapshot the states now; the oldest snapshots of the kind beyond the bound go."""
        if st.n == 0:
            return
        if st.checkpoints and st.checkpoints[-1].n == st.n:
            if turn and not st.checkpoints[-1].turn:
                st.checkpoints[-1] = snap = Snapshot(st.n, st.checkpoints[-1].states, True)
                self._snapshots.add(snap)
            return
        snap = Snapshot(st.n, tuple(self._copies(st.states)), turn)
        self._snapshots.add(snap)
        st.checkpoints.append(snap)
        kind = [cp for cp in st.checkpoints if cp.turn == turn]
        if len(kind) > self.max_checkpoints:
            st.checkpoints.remove(kind[0])

    def restore(self, st: SeqStates, n: int) -> int:
        """Go back to the latest snapshot at or before n (or keep the states when n is where
        they are); returns the point reached (0: fresh states)."""
        if n >= st.n:
            return st.n
        snap = next((cp for cp in reversed(st.checkpoints) if cp.n <= n), None)
        st.checkpoints = [cp for cp in st.checkpoints if cp.n <= n]
        if snap is None:
            st.n = 0
            st.states = [la.backend.new_recurrent_state(la.spec.recurrent) for la in self.layers]
            return 0
        st.n = snap.n
        st.states = self._copies(snap.states)
        return snap.n

    def release(self, st: SeqStates, tokens: Seq[int]) -> None:
        """Done with ``st``: its final states and snapshots are kept (bounded) for prefixes
        of later sequences. ``tokens``: the sequence's (at least st.n of them)."""
        self.live -= 1
        if len(tokens) < st.n:
            return
        for cp in st.checkpoints:
            self._keep(tuple(tokens[:cp.n]), cp)
        if st.n:
            snap = Snapshot(st.n, tuple(st.states))
            self._snapshots.add(snap)
            self._keep(tuple(tokens[:st.n]), snap)
        st.states, st.checkpoints = [], []

    def _keep(self, key: tuple, snap: Snapshot) -> None:
        self.cached[key] = snap
        self.cached.move_to_end(key)
        while len(self.cached) > self.max_cached:
            self.cached.popitem(last=False)

    def lookup(self, ids: Seq[int], limit: int) -> Snapshot | None:
        """The cached snapshot of the longest prefix of ids, at most ``limit`` tokens."""
        best = None
        for key, snap in self.cached.items():
            if snap.n <= limit and (best is None or snap.n > best.n) \
                    and tuple(ids[:snap.n]) == key:
                best = snap
        if best is not None:
            self.cached.move_to_end(tuple(ids[:best.n]))
        return best

    def forget_cached(self) -> None:
        self.cached.clear()

    # ---- statistics

    def live_bytes(self) -> int:
        """Bytes of the sequences' current states."""
        return self.live * self.state_nbytes

    def checkpoint_bytes(self) -> int:
        """Bytes of the snapshots held (by sequences or the prefix store; shared ones once)."""
        return len({id(s): s for s in self._snapshots}) * self.state_nbytes
