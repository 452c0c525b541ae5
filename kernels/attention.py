"""Causal attention over a KV cache laid out for 16-key vectors.

K is stored as (n_kv_heads, ctx // 16, head_dim, 16): sixteen consecutive positions are the
lanes of one vector, so a query's scores against 16 keys come from head_dim multiply-adds.
V is (n_kv_heads, ctx, head_dim). Each (token, head) is computed alone, in a fixed order.
"""

import numpy as np
from numba import njit, prange

from .simd import vf_add, vf_load, vf_mul, vf_splat, vf_store, vf_zero

KEYS_PER_BLOCK = 16


@njit(cache=True, parallel=True)
def kv_write(K, V, k, v, positions):
    """Store new keys/values.

    Args:
        K: float32 (n_kv, ctx // 16, hd, 16); V: float32 (n_kv, ctx, hd).
        k, v: float32 (n, n_kv, hd) for the tokens at ``positions`` (int64 (n,)).
    """
    n, n_kv, hd = k.shape
    for h in prange(n_kv):
        for t in range(n):
            p = positions[t]
            blk = p // 16
            lane = p % 16
            for d in range(hd):
                K[h, blk, d, lane] = k[t, h, d]
                V[h, p, d] = v[t, h, d]


@njit(cache=True, parallel=True)
def attend(q, K, V, positions, window, scale, scores, out):
    """out[t, h] = softmax(scale * q[t, h] . K[:p]) @ V[:p] for keys p <= positions[t].

    Args:
        q: float32 (n, H, hd). K, V: the cache (see module doc).
        positions: int64 (n,) each query's position; it sees keys 0..position.
        window: sliding window (keys with position > query - window), 0 for none.
        scale: score multiplier.
        scores: float32 scratch (n * H, ctx).
        out: float32 (n, H, hd).
    """
    n, H, hd = q.shape
    n_kv = K.shape[0]
    group = H // n_kv
    nblk = K.shape[1]
    for i in prange(n * H):
        t = i // H
        h = i % H
        kvh = h // group
        p = positions[t]
        lo = 0
        if window > 0 and p - window + 1 > 0:
            lo = p - window + 1
        srow = scores[i]
        for pb in range(lo // 16, p // 16 + 1):
            acc = vf_zero()
            base = ((kvh * nblk + pb) * hd) * 64
            for d in range(hd):
                acc = vf_add(acc, vf_mul(vf_splat(q[t, h, d]), vf_load(K, base + d * 64)))
            vf_store(srow, pb * 64, acc)
        m = np.float32(-np.inf)
        for j in range(lo, p + 1):
            s = srow[j] * np.float32(scale)
            srow[j] = s
            if s > m:
                m = s
        o = out[t, h]
        o[:] = 0.0
        total = np.float32(0.0)
        for j in range(lo, p + 1):
            e = np.exp(srow[j] - m)
            total += e
            vj = V[kvh, j]
            for d in range(hd):
                o[d] += e * vj[d]
        inv = np.float32(1.0) / total
        for d in range(hd):
            o[d] *= inv
