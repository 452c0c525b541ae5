"""Comparing logits: log-softmax, KL against llama.cpp's stored top tokens, top-1 agreement
and KL between two backends, and argmax along given continuations; with the thresholds the GPU
backends are held to against the CPU backend (tests/models/test_backends_models.py and
scripts/gpu_check.py share them)."""

from __future__ import annotations

import numpy as np

TOP1_MIN = {"smollm": 0.95, "gemma": 0.92}  # where llama.cpp sits from our CPU backend
KL_MAX = 0.01
GREEDY_MIN = 0.95
GREEDY_PROMPTS = 4    # of the fixture's greedy prompts, each continued for 32 tokens


def log_softmax(z):
    """float64 log-probabilities of logits along the last axis."""
    z = z.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def coarse_kl(fx, our_lp):
    """KL(llama.cpp || ours) over llama.cpp's top tokens (a fixture's ``top_ids`` and
    ``top_logprobs``) plus one bucket for the rest."""
    top = np.array(fx["top_ids"])
    tlp = np.array(fx["top_logprobs"])
    p = np.exp(tlp)
    q = np.exp(np.take_along_axis(our_lp, top, 1))
    P, Q = p.sum(1), q.sum(1)
    rest = (1 - P) * np.log(np.maximum(1 - P, 1e-12) / np.maximum(1 - Q, 1e-12))
    return (p * (tlp - np.log(q))).sum(1) + rest


def compare(ref, got, chunk=64):
    """(top-1 agreement, mean KL(ref || got)) of two (n, vocab) logit arrays."""
    top, kl = [], []
    for i in range(0, len(ref), chunk):
        a, b = log_softmax(ref[i:i + chunk]), log_softmax(got[i:i + chunk])
        top.append(a.argmax(1) == b.argmax(1))
        kl.append((np.exp(a) * (a - b)).sum(1))
    return float(np.concatenate(top).mean()), float(np.concatenate(kl).mean())


def greedy_rows(m, seqs):
    """Argmax of every continuation position of the given (prompt, continuation) pairs, all
    sequences in one forward pass."""
    from localllm.api import StepItem
    items = [StepItem(m.new_sequence(), p + c, "all") for p, c in seqs]
    try:
        outs = m.step(items)
    finally:
        for it in items:
            it.seq.release()
    return [o[len(p) - 1:len(p) + len(c) - 1].argmax(1) for o, (p, c) in zip(outs, seqs)]
