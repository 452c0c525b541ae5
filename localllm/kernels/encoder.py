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
from .simd import vf_add, vf_load, vf_mul, vf_splat, vf_store, vf_sub, vf_zero
from .vmath import vf_bcast, vf_exp2, vf_fma, vf_hmax, vf_hsum, vf_keep, vf_max

LOG2E = 1.4426950408889634
PAR_MIN_ROWS = 4          # rows below which a norm or an activation stays on one thread
QUERY_TILE = 32           # query rows per attention work item (sharing one key transpose)


@njit(cache=True, inline="always")
def _check(a):
    if not rows_contiguous(a):
        raise ValueError("encoder kernels: rows must be contiguous")


# ----------------------------------------------------------------------------- LayerNorm

@njit(cache=True, inline="always")
def _sum8(s):
    """The fixed tree ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))."""
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]))


@njit(cache=True)
def layer_norm_row(x, w, b, eps, out):
    """out = (x - mean) / sqrt(var + eps) * w (+ b) for one float32 row: mean and variance
    summed in float64 as 8 interleaved partial sums (element i into sum i % 8, in index
    order) joined by a fixed tree, the scaling in float32; ``b`` empty for no bias."""
    D = x.shape[0]
    D8 = D - D % 8
    s = np.zeros(8)
    for i in range(0, D8, 8):
        for j in range(8):
            s[j] += x[i + j]
    for i in range(D8, D):
        s[i - D8] += x[i]
    mean = _sum8(s) / D
    for j in range(8):
        s[j] = 0.0
    for i in range(0, D8, 8):
        for j in range(8):
            d = x[i + j] - mean
            s[j] += d * d
    for i in range(D8, D):
        d = x[i] - mean
        s[i - D8] += d * d
    inv = np.float32(1.0 / math.sqrt(_sum8(s) / D + eps))
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

@njit(cache=True)
def _transpose_keys(k, a, b, kvh, hd, kt):
    """Keys a..b of KV head kvh as kt[d, j] (kt is (hd, >= b - a), zero past b - a)."""
    L = b - a
    kt[:, :] = 0.0
    for j in range(L):
        row = k[a + j]
        for d in range(hd):
            kt[d, j] = row[kvh * hd + d]


@njit(cache=True, inline="always")
def _lanes(n, c):
    """Lanes of 16-wide chunk c of an n-wide span (0..16)."""
    return min(16, max(0, n - 16 * c))


@njit(cache=True, inline="always")
def _scores(qf, qo, qo2, kt, hd, jb, sc, scores, W):
    """Scores of two queries (flat offsets qo, qo2) against keys jb..jb+63 into
    scores[jb..] and scores[W + jb..]: for each key the fma chain over d in order, times the
    scale (the two queries share each key load; a query's arithmetic is the same alone)."""
    a0, a1, a2, a3 = vf_zero(), vf_zero(), vf_zero(), vf_zero()
    b0, b1, b2, b3 = vf_zero(), vf_zero(), vf_zero(), vf_zero()
    for d in range(hd):
        x = vf_splat(qf[qo + d])
        y = vf_splat(qf[qo2 + d])
        row = kt[d]
        k0, k1 = vf_load(row, 4 * jb), vf_load(row, 4 * (jb + 16))
        k2, k3 = vf_load(row, 4 * (jb + 32)), vf_load(row, 4 * (jb + 48))
        a0 = vf_fma(x, k0, a0)
        a1 = vf_fma(x, k1, a1)
        a2 = vf_fma(x, k2, a2)
        a3 = vf_fma(x, k3, a3)
        b0 = vf_fma(y, k0, b0)
        b1 = vf_fma(y, k1, b1)
        b2 = vf_fma(y, k2, b2)
        b3 = vf_fma(y, k3, b3)
    vf_store(scores, 4 * jb, vf_mul(a0, sc))
    vf_store(scores, 4 * (jb + 16), vf_mul(a1, sc))
    vf_store(scores, 4 * (jb + 32), vf_mul(a2, sc))
    vf_store(scores, 4 * (jb + 48), vf_mul(a3, sc))
    vf_store(scores, 4 * (W + jb), vf_mul(b0, sc))
    vf_store(scores, 4 * (W + jb + 16), vf_mul(b1, sc))
    vf_store(scores, 4 * (W + jb + 32), vf_mul(b2, sc))
    vf_store(scores, 4 * (W + jb + 48), vf_mul(b3, sc))


@njit(cache=True, inline="always")
def _softmax(scores, so, L):
    """exp(s - max) of scores[so..so+L] in place, 16 keys a vector (lanes past L become 0;
    the buffer holds whole vectors); returns 1 / their sum. Per key: 2**((s - max) * log2 e)
    in float32; the sum: 16 lane sums over the vectors in order, then vf_hsum's fixed tree."""
    nv = (L + 15) // 16
    mv = vf_splat(-np.inf)
    for c in range(nv):
        mv = vf_max(mv, vf_keep(vf_load(scores, 4 * (so + 16 * c)), 0, L - 1 - 16 * c, -np.inf))
    m = vf_splat(vf_hmax(mv))
    l2e = vf_splat(np.float32(LOG2E))
    total = vf_zero()
    for c in range(nv):
        o = 4 * (so + 16 * c)
        p = vf_exp2(vf_mul(vf_sub(vf_load(scores, o), m), l2e))
        p = vf_keep(p, 0, L - 1 - 16 * c, 0.0)
        vf_store(scores, o, p)
        total = vf_add(total, p)
    return np.float32(1.0) / vf_hsum(total)


@njit(cache=True)
def _attend_rows(qf, qw, kt, vf, vw, a, b, r0, r1, h, kvh, hd, scale, scores, of):
    """Query rows r0..r1 (of the sequence spanning rows a..b) of head h against every key of
    the sequence (kt: its keys transposed; qf, vf, of: flat q, v and out with row widths qw,
    vw, qw): softmax(q k^T * scale) v. A score is the fma chain over d in order; each output
    element the fma chain over keys in order. Queries go in pairs sharing each key and value
    load (a row's arithmetic is the same alone or paired)."""
    L = b - a
    W = scores.shape[0] // 2
    sc = vf_splat(scale)
    for i in range(r0, r1, 2):
        pair = i + 1 < r1
        i2 = i + 1 if pair else i
        for jb in range(0, L, 64):
            _scores(qf, i * qw + h * hd, i2 * qw + h * hd, kt, hd, jb, sc, scores, W)
        inv = vf_splat(_softmax(scores, 0, L))
        inv2 = vf_splat(_softmax(scores, W, L))
        for d in range(0, hd, 64):  # 64 columns of v a pass, 4 vectors x 2 queries
            n0, n1 = _lanes(hd - d, 0), _lanes(hd - d, 1)
            n2, n3 = _lanes(hd - d, 2), _lanes(hd - d, 3)
            a0, a1, a2, a3 = vf_zero(), vf_zero(), vf_zero(), vf_zero()
            b0, b1, b2, b3 = vf_zero(), vf_zero(), vf_zero(), vf_zero()
            for j in range(L):
                x, y = vf_bcast(scores, 4 * j), vf_bcast(scores, 4 * (W + j))
                vo = 4 * ((a + j) * vw + kvh * hd + d)
                v0, v1 = vf_load_n(vf, vo, n0), vf_load_n(vf, vo + 64, n1)
                v2, v3 = vf_load_n(vf, vo + 128, n2), vf_load_n(vf, vo + 192, n3)
                a0 = vf_fma(x, v0, a0)
                a1 = vf_fma(x, v1, a1)
                a2 = vf_fma(x, v2, a2)
                a3 = vf_fma(x, v3, a3)
                b0 = vf_fma(y, v0, b0)
                b1 = vf_fma(y, v1, b1)
                b2 = vf_fma(y, v2, b2)
                b3 = vf_fma(y, v3, b3)
            oo = 4 * (i * qw + h * hd + d)
            vf_store_n(of, oo, vf_mul(a0, inv), n0)
            vf_store_n(of, oo + 64, vf_mul(a1, inv), n1)
            vf_store_n(of, oo + 128, vf_mul(a2, inv), n2)
            vf_store_n(of, oo + 192, vf_mul(a3, inv), n3)
            if pair:
                oo = 4 * (i2 * qw + h * hd + d)
                vf_store_n(of, oo, vf_mul(b0, inv2), n0)
                vf_store_n(of, oo + 64, vf_mul(b1, inv2), n1)
                vf_store_n(of, oo + 128, vf_mul(b2, inv2), n2)
                vf_store_n(of, oo + 192, vf_mul(b3, inv2), n3)


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
    width = (longest + 63) // 64 * 64
    qf, vf, of = q.reshape(-1), v.reshape(-1), out.reshape(-1)
    for it in prange(n_items):
        h = it % n_heads
        tile = it // n_heads
        s = np.searchsorted(counts, tile, side="right") - 1
        a, b = starts[s], starts[s + 1]
        r0 = a + (tile - counts[s]) * QUERY_TILE
        r1 = min(r0 + QUERY_TILE, b)
        kt = np.empty((hd, width), np.float32)
        _transpose_keys(k, a, b, h // group, hd, kt)
        scores = np.empty(2 * width, np.float32)
        _attend_rows(qf, q.shape[1], kt, vf, v.shape[1], a, b, r0, r1, h, h // group, hd,
                     np.float32(scale), scores, of)
