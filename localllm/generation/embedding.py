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


def batches(lengths: Seq[int], budget: int) -> list[list[int]]:
    """Consecutive inputs grouped so each group's tokens fit ``budget`` (a longer input
    alone), in order.

    Args:
        lengths: tokens of each input; budget: tokens per forward pass.
    Returns:
        Lists of input indices.
    """
    out: list[list[int]] = []
    used = 0
    for i, n in enumerate(lengths):
        if not out or used + n > budget:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    return out


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


def run_embeddings(runner, net, inputs: Seq[Seq[int]], pooling: str, budget: int, ctx: int,
                   new_sequence, normalize: bool = True, block: int = 1) -> list[np.ndarray]:
    """Pooled (and normalised) vectors of token inputs.

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
    check_pooling(pooling)
    for i, ids in enumerate(inputs):
        if not ids:
            raise EmptyPrompt(f"input {i} has no tokens", param="input")
        if len(ids) > ctx:
            raise PromptTooLong(f"input {i} has {len(ids)} tokens but the context holds {ctx}",
                                param="input", n_tokens=len(ids), ctx=ctx)
    # A decoder reads only the rows it pools; an encoder's rows all come back (they are few).
    rows = "last" if pooling == "last" and net.generates else "all"
    out: list[np.ndarray] = [None] * len(inputs)  # type: ignore[list-item]
    for group in batches([-(-len(x) // block) * block for x in inputs], budget):
        seqs = [new_sequence() for _ in group]
        try:
            items = [StepItem(s, [int(t) for t in inputs[i]], rows) for s, i in zip(seqs, group)]
            hidden = runner.step(items, hidden=True)
        finally:
            for s in seqs:
                s.release()
        pooled = [pool(np.atleast_2d(h), pooling) for h in hidden]
        if pooling == "rank":
            scores = net.classify(np.stack(pooled))
            pooled = list(scores)
        for i, v in zip(group, pooled):
            out[i] = l2_normalize(v) if normalize and pooling != "rank" else v
    return out
