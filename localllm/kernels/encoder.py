"""Kernels of encoder models (BERT and its kin): LayerNorm with bias, plain activations and
bidirectional attention of each sequence over all of its own tokens, with no KV cache.

Each output row has one fixed arithmetic sequence, whatever else is in the batch or the
thread split: a text's embedding never depends on the texts batched with it.
"""

import math

import numpy as np
from numba import prange

from .jit import njit
from .rowmath import rows_contiguous, vf_gelu_tanh, vf_load_n, vf_store_n
from .simd import vf_load, vf_mul, vf_splat, vf_store, vf_zero
from .vmath import f32_exp2, vf_fma, vf_hsum

LOG2E = 1.4426950408889634
PAR_MIN_ROWS = 4          # rows below which a norm or an activation stays on one thread
QUERY_TILE = 16           # query rows per attention work item


@njit(cache=True, inline="always")
def _check(a):
    if not rows_contiguous(a):
        raise ValueError("encoder kernels: rows must be contiguous")


# ----------------------------------------------------------------------------- LayerNorm

@njit(cache=True)
def layer_norm_row(x, w, b, eps, out):
    """out = (x - mean) / sqrt(var + eps) * w (+ b) for one float32 row: mean and variance
    summed in float64 in index order, the scaling in float32; ``b`` empty for no bias."""
    D = x.shape[0]
    s = 0.0
    for i in range(D):
        s += x[i]
    mean = s / D
    ss = 0.0
    for i in range(D):
        d = x[i] - mean
        ss += d * d
    inv = np.float32(1.0 / math.sqrt(ss / D + eps))
    m32 = np.float32(mean)
    if b.shape[0] == D:
        for i in range(D):
            out[i] = (x[i] - m32) * inv * w[i] + b[i]
    else:
        for i in range(D):
            out[i] = (x[i] - m32) * inv * w[i]


@njit(cache=True, parallel=True)
def _layer_norm_par(x, w, b, eps, out):
    for t in prange(x.shape[0]):
        layer_norm_row(x[t], w, b, eps, out[t])


@njit(cache=True)
def layer_norm(x, w, b, eps, out):
    """LayerNorm of each row of x (n, D) with weight w (D,) and bias b (D,) or empty (0,)
    into out (n, D) (may alias x)."""
    n, D = x.shape
    if w.shape[0] != D or (b.shape[0] != D and b.shape[0] != 0) or out.shape != x.shape:
        raise ValueError("layer_norm: shapes differ")
    _check(x)
    _check(out)
    if n >= PAR_MIN_ROWS:
        _layer_norm_par(x, w, b, eps, out)
    else:
        for t in range(n):
            layer_norm_row(x[t], w, b, eps, out[t])


# ----------------------------------------------------------------------------- activations

@njit(cache=True)
def act_row(x, out, kind):
    """out = act(x) over one row: kind 0 gelu_tanh (rowmath.vf_gelu_tanh), 1 tanh."""
    F = x.shape[0]
    if kind == 0:
        for i in range(0, F & ~15, 16):
            vf_store(out, 4 * i, vf_gelu_tanh(vf_load(x, 4 * i)))
        i = F & ~15
        if i < F:
            vf_store_n(out, 4 * i, vf_gelu_tanh(vf_load_n(x, 4 * i, F - i)), F - i)
    else:
        for i in range(F):
            out[i] = np.float32(math.tanh(np.float64(x[i])))


@njit(cache=True, parallel=True)
def _act_par(x, out, kind):
    for t in prange(x.shape[0]):
        act_row(x[t], out[t], kind)


@njit(cache=True)
def activation(x, out, kind):
    """out = act(x) elementwise over (n, F), kind as act_row (out may alias x)."""
    if out.shape != x.shape:
        raise ValueError("activation: shapes differ")
    _check(x)
    _check(out)
    if x.shape[0] >= PAR_MIN_ROWS:
        _act_par(x, out, kind)
    else:
        for t in range(x.shape[0]):
            act_row(x[t], out[t], kind)


# ----------------------------------------------------------------------------- attention

@njit(cache=True, inline="always")
def _dot(a, ao, b, bo, hd):
    """Dot product of hd float32 at element offsets ao of a and bo of b: 16 lanes by fma in
    order, then vf_hsum's fixed tree."""
    acc = vf_zero()
    d = 0
    while d + 16 <= hd:
        acc = vf_fma(vf_load(a, 4 * (ao + d)), vf_load(b, 4 * (bo + d)), acc)
        d += 16
    if d < hd:
        acc = vf_fma(vf_load_n(a, 4 * (ao + d), hd - d), vf_load_n(b, 4 * (bo + d), hd - d), acc)
    return vf_hsum(acc)


@njit(cache=True)
def _attend_rows(q, k, v, a, b, r0, r1, h, kvh, hd, scale, scores, acc, out):
    """Query rows r0..r1 (of the sequence spanning rows a..b) of head h against every key of
    the sequence: softmax(q k^T * scale) v, keys in order."""
    L = b - a
    for i in range(r0, r1):
        qi = q[i]
        m = -np.inf
        for j in range(L):
            s = np.float32(_dot(qi, h * hd, k[a + j], kvh * hd, hd) * scale)
            scores[j] = s
            if s > m:
                m = s
        total = np.float32(0.0)
        for j in range(L):
            p = f32_exp2(np.float32((scores[j] - m) * np.float32(LOG2E)))
            scores[j] = p
            total += p
        for d in range(hd):
            acc[d] = 0.0
        for j in range(L):
            pj = vf_splat(scores[j])
            vj = v[a + j]
            d = 0
            while d + 16 <= hd:
                vf_store(acc, 4 * d, vf_fma(pj, vf_load(vj, 4 * (kvh * hd + d)),
                                            vf_load(acc, 4 * d)))
                d += 16
            if d < hd:
                n = hd - d
                vf_store_n(acc, 4 * d, vf_fma(pj, vf_load_n(vj, 4 * (kvh * hd + d), n),
                                              vf_load_n(acc, 4 * d, n)), n)
        inv = vf_splat(np.float32(1.0) / total)
        oi = out[i]
        d = 0
        while d + 16 <= hd:
            vf_store(oi, 4 * (h * hd + d), vf_mul(vf_load(acc, 4 * d), inv))
            d += 16
        if d < hd:
            vf_store_n(oi, 4 * (h * hd + d), vf_mul(vf_load_n(acc, 4 * d, hd - d), inv),
                       hd - d)


@njit(cache=True, parallel=True)
def encoder_attention(q, k, v, starts, n_heads, n_kv, scale, out):
    """Bidirectional GQA attention of each sequence over its own tokens.

    Args:
        q: float32 (n, n_heads * hd); k, v: float32 (n, n_kv * hd); starts: int64
            (n_seqs + 1,), sequence s spans rows starts[s]..starts[s+1]; scale: the score
            scale; out: float32 (n, n_heads * hd).
    """
    n = q.shape[0]
    hd = q.shape[1] // n_heads
    if (q.shape[1] != n_heads * hd or k.shape[1] != n_kv * hd or v.shape != k.shape
            or k.shape[0] != n or out.shape != q.shape or n_heads % n_kv
            or starts[0] != 0 or starts[-1] != n):
        raise ValueError("encoder_attention: shapes differ")
    for x in (q, k, v, out):
        _check(x)
    n_seq = starts.shape[0] - 1
    longest = 0
    counts = np.zeros(n_seq + 1, np.int64)
    for s in range(n_seq):
        L = starts[s + 1] - starts[s]
        if L < 0:
            raise ValueError("encoder_attention: starts must not decrease")
        longest = max(longest, L)
        counts[s + 1] = counts[s] + (L + QUERY_TILE - 1) // QUERY_TILE
    n_items = counts[n_seq] * n_heads
    group = n_heads // n_kv
    for it in prange(n_items):
        h = it % n_heads
        tile = it // n_heads
        s = np.searchsorted(counts, tile, side="right") - 1
        a, b = starts[s], starts[s + 1]
        r0 = a + (tile - counts[s]) * QUERY_TILE
        r1 = min(r0 + QUERY_TILE, b)
        scores = np.empty(longest, np.float32)
        acc = np.empty(hd + 16, np.float32)
        _attend_rows(q, k, v, a, b, r0, r1, h, h // group, hd, np.float32(scale), scores,
                     acc, out)
