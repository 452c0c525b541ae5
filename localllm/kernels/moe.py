"""Mixture-of-experts routing and the weighted sum of a token's experts.

``route`` picks each token's top-k experts from its router logits; ``combine`` sums the
experts' outputs in slot order (and adds a gated shared expert). Every token is computed on
its own with a fixed operation order, so its result never depends on the other tokens of the
chunk or on which of them share its experts.
"""

import math

import numpy as np
from numba import prange

from .jit import njit

# softmax_weight (gpt-oss): the top-k by raw logit, weighted by a softmax over those k
GATING = {"softmax": 0, "sigmoid": 1, "softmax_weight": 2}
# Renormalised weights divide by their sum, kept from zero as llama.cpp keeps it (the
# smallest normal float16).
NORM_MIN = 6.103515625e-5


@njit(cache=True)
def route(logits, k, gating, norm, scale, ids, weights):
    """Each token's top-k experts and their weights.

    Per token: probabilities p = softmax(logits) (float64 sum of exp(x - max), then times
    f32(1 / sum)), sigmoid(logits), or (softmax_weight) the logits themselves; the k largest
    in descending order, ties to the lower expert; their p as weights (softmax_weight: the
    softmax of the k chosen logits, formed as above), divided by their sum (slot order) when
    ``norm``, times ``scale`` unless it is 0 or 1.

    Args:
        logits: float32 (n, n_experts) router outputs.
        k: experts per token; gating: GATING's code; norm: renormalise the k weights;
        scale: factor on the weights ({arch}.expert_weights_scale).
        ids: int32 (n, k) out, the chosen experts by rank; weights: float32 (n, k) out.
    """
    n, E = logits.shape
    p = np.empty(E, np.float32)
    taken = np.empty(E, np.bool_)
    for t in range(n):
        if gating == 0:
            m = logits[t, 0]
            for e in range(1, E):
                m = max(m, logits[t, e])
            s = 0.0
            for e in range(E):
                p[e] = np.float32(math.exp(np.float32(logits[t, e] - m)))
                s += np.float64(p[e])
            inv = np.float32(1.0 / s)
            for e in range(E):
                p[e] = p[e] * inv
        elif gating == 1:
            for e in range(E):
                p[e] = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-logits[t, e])))
        else:
            for e in range(E):
                p[e] = logits[t, e]
        taken[:] = False
        for j in range(k):
            best = -1
            for e in range(E):
                if not taken[e] and (best < 0 or p[e] > p[best]):
                    best = e
            taken[best] = True
            ids[t, j] = best
            weights[t, j] = p[best]
        if gating == 2:
            m = weights[t, 0]  # the largest: slots go in descending order
            s = 0.0
            for j in range(k):
                weights[t, j] = np.float32(math.exp(np.float32(weights[t, j] - m)))
                s += np.float64(weights[t, j])
            inv = np.float32(1.0 / s)
            for j in range(k):
                weights[t, j] = weights[t, j] * inv
        if norm:
            s32 = np.float32(0.0)
            for j in range(k):
                s32 += weights[t, j]
            s32 = max(s32, np.float32(NORM_MIN))
            for j in range(k):
                weights[t, j] = weights[t, j] / s32
        if scale != 0.0 and scale != 1.0:
            for j in range(k):
                weights[t, j] = weights[t, j] * np.float32(scale)


@njit(cache=True, inline="always")
def _combine_row(t, y, weights, shared, shared_gate, out):
    k = weights.shape[1]
    dim = out.shape[1]
    for d in range(dim):
        acc = y[t * k, d] * weights[t, 0]
        for j in range(1, k):
            acc = acc + y[t * k + j, d] * weights[t, j]
        out[t, d] = acc
    if shared.shape[0] > 0:
        g = np.float32(1.0)
        if shared_gate.shape[0] > 0:
            g = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-shared_gate[t])))
        for d in range(dim):
            out[t, d] = out[t, d] + shared[t, d] * g


@njit(cache=True, parallel=True)
def combine(y, weights, shared, shared_gate, out):
    """out[t] = sum over slots j (ascending) of weights[t, j] * y[t * k + j], then
    + sigmoid(shared_gate[t]) * shared[t] when a shared expert is given.

    Args:
        y: float32 (n * k, dim) expert outputs, token t's slot j at row t * k + j.
        weights: float32 (n, k) from ``route``.
        shared: float32 (n, dim) shared-expert outputs, or (0, dim) for none.
        shared_gate: float32 (n,) the shared expert's gate logits, or (0,) for an ungated
            shared expert (weight 1).
        out: float32 (n, dim) result.
    """
    n = out.shape[0]
    if n == 1:
        _combine_row(0, y, weights, shared, shared_gate, out)
    else:
        for t in prange(n):
            _combine_row(t, y, weights, shared, shared_gate, out)
