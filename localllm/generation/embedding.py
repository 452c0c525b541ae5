"""Embeddings and rank scores: inputs batched into forward passes of whole sequences, their
final hidden states pooled (none, mean, cls, last, rank) and L2-normalised as llama.cpp does.

A vector never depends on the inputs batched with it: each input is its own sequence and the
kernels are batch-invariant, so batching only saves time.
"""

from __future__ import annotations

from typing import Sequence as Seq

import numpy as np

from localllm.errors import BadSetting, EmptyPrompt, PromptTooLong
from localllm.runtime.sequence import StepItem

POOLINGS = ("none", "mean", "cls", "last", "rank")


def check_pooling(pooling: str) -> str:
    """Raises BadSetting for a pooling llama.cpp does not define; returns it."""
    if pooling not in POOLINGS:
        raise BadSetting(f"unknown pooling {pooling!r} (choose from {', '.join(POOLINGS)})",
                         param="pooling")
    return pooling


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """One input's final hidden states (n, dim) pooled: mean over tokens, the first (cls,
    rank) or last token, or every token (none)."""
    if pooling == "mean":
        return (hidden.astype(np.float64).sum(0) / hidden.shape[0]).astype(np.float32)
    if pooling in ("cls", "rank"):
        return hidden[0].copy()
    if pooling == "last":
        return hidden[-1].copy()
    return hidden.copy()


def l2_normalize(v: np.ndarray) -> np.ndarray:
    """v / ||v|| along the last axis (llama.cpp's embd_normalize 2); a zero vector stays."""
    v = np.asarray(v, np.float32)
    norm = np.sqrt((v.astype(np.float64) ** 2).sum(-1, keepdims=True))
    return (v / np.where(norm > 0, norm, 1.0)).astype(np.float32)


class EmbeddingRun:
    """One embedding request's inputs, run a forward pass at a time, so that a scheduler can
    put other work (decode steps) between its passes. The vectors do not depend on how the
    inputs are grouped into passes."""

    def __init__(self, runner, net, inputs: Seq[Seq[int]], pooling: str, budget: int, ctx: int,
                 new_sequence, normalize: bool = True, block: int = 1):
        """Args: as run_embeddings.

        Raises:
            BadSetting: an unknown pooling; EmptyPrompt: an input without tokens;
            PromptTooLong: one beyond the context.
        """
        check_pooling(pooling)
        for i, ids in enumerate(inputs):
            if not ids:
                raise EmptyPrompt(f"input {i} has no tokens", param="input")
            if len(ids) > ctx:
                raise PromptTooLong(f"input {i} has {len(ids)} tokens but the context holds "
                                    f"{ctx}", param="input", n_tokens=len(ids), ctx=ctx)
        self._runner, self._net, self._new_sequence = runner, net, new_sequence
        self.inputs = [[int(t) for t in x] for x in inputs]
        self.pooling, self.budget, self.normalize = pooling, max(1, budget), normalize
        # Each input takes whole KV blocks while its pass runs.
        self._sizes = [-(-len(x) // block) * block for x in self.inputs]
        self.vectors: list[np.ndarray] = [None] * len(self.inputs)  # type: ignore[list-item]
        self.passes = 0
        self._next = 0

    @property
    def done(self) -> bool:
        return self._next >= len(self.inputs)

    def next_pass_tokens(self) -> int:
        """KV tokens the next pass takes at least (its first input's whole blocks); 0 when
        done."""
        return 0 if self.done else self._sizes[self._next]

    def step(self, limit: int | None = None) -> int:
        """Run the next pass: the following inputs whose tokens fit the budget (and
        ``limit``), the first one alone if it is longer.

        Args:
            limit: tokens this pass may take at most (the KV room left beside other work).
        Returns:
            How many inputs the pass embedded (0 when done).
        """
        cap = self.budget if limit is None else min(self.budget, max(1, limit))
        group, used = [], 0
        for i in range(self._next, len(self.inputs)):
            if group and used + self._sizes[i] > cap:
                break
            group.append(i)
            used += self._sizes[i]
        if not group:
            return 0
        # A decoder reads only the rows it pools; an encoder's rows all come back (few).
        rows = "last" if self.pooling == "last" and self._net.generates else "all"
        seqs = [self._new_sequence() for _ in group]
        try:
            items = [StepItem(s, self.inputs[i], rows) for s, i in zip(seqs, group)]
            hidden = self._runner.step(items, hidden=True)
        finally:
            for s in seqs:
                s.release()
        pooled = [pool(np.atleast_2d(h), self.pooling) for h in hidden]
        if self.pooling == "rank":
            pooled = list(self._net.classify(np.stack(pooled)))
        for i, v in zip(group, pooled):
            self.vectors[i] = l2_normalize(v) if self.normalize and self.pooling != "rank" \
                else v
        self._next = group[-1] + 1
        self.passes += 1
        return len(group)


def run_embeddings(runner, net, inputs: Seq[Seq[int]], pooling: str, budget: int, ctx: int,
                   new_sequence, normalize: bool = True, block: int = 1) -> list[np.ndarray]:
    """Pooled (and normalised) vectors of token inputs, every pass run now.

    Args:
        runner: the model's Runner; net: its Net (for ``generates`` and ``classify``).
        inputs: token ids per input; pooling: one of POOLINGS; budget: tokens per pass.
        ctx: the context size (longest input); new_sequence: makes a fresh Sequence.
        normalize: L2-normalise each vector (not rank scores).
        block: tokens per KV block (each input takes whole blocks of the budget).
    Returns:
        Per input: float32 (dim,), (n_tokens, dim) for "none", (n_cls_out,) for "rank".
    Raises:
        EmptyPrompt: an input without tokens; PromptTooLong: one beyond the context.
    """
    run = EmbeddingRun(runner, net, inputs, pooling, budget, ctx, new_sequence, normalize,
                       block)
    while not run.done:
        run.step()
    return run.vectors
