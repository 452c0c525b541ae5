"""Causal (optionally sliding-window) GQA attention over a float16 KV cache, batch-invariant:
each output element has one fixed arithmetic sequence, whatever the batch or thread split.
"""

import numpy as np
from numba import njit, prange

from .attention_steps import KEYS_PER_BLOCK  # noqa: F401 (the cache layout, for callers)
from .attention_steps import CHUNK, _scores, _softmax, _values, _weights
from .simd import vf_load, vf_mul, vf_splat, vf_store, vf_zero
from .vmath import (f32_fma, f32_to_f16_bits, vf_div, vf_fma, vf_load_el,
                    vf_store_f16)

LOG2E = 1.4426950408889634

# Query rows (token, head) per work item about 32: enough to reuse each loaded key/value
# block, few enough that the item's score rows stay in L2; a multiple of 4 tokens.
_ROWS_PER_ITEM = 32
# Per-row cost of an item beyond its keys (q scaling, softmax, normalising), in keys.
_ROW_OVERHEAD = 32
# Runs of work dealt to threads: divisible by the usual thread counts (1-4, 6, 8, 12, 16), so
# that each thread's share has equal cost without asking for the thread count (which would
# keep Numba from caching the kernel).
_RUNS = 48
# Fewer (token tile, KV head) items than this: split each one's keys by chunks instead, into
# about _SPLIT_UNITS pieces (decode and short verification batches).
_MIN_ITEMS = 4
_SPLIT_UNITS = 8
# Largest float32 copy of keys and values a call makes (beyond it, they are read as half).
_COPY_BYTES = 64 << 20


@njit(cache=True)
def _c_strides(a):
    """True when ``a`` is laid out C-contiguously (the kernels read raw bytes); strides of
    axes of length 1, and of empty arrays, do not matter."""
    if a.size == 0:
        return True
    step = a.itemsize
    for ax in range(a.ndim - 1, -1, -1):
        if a.shape[ax] > 1 and a.strides[ax] != step:
            return False
        step *= a.shape[ax]
    return True


@njit(cache=True)
def _check_c3(a, n0, n1, n2):
    """True when a 3-d array has the given shape and a C layout."""
    return a.shape[0] == n0 and a.shape[1] == n1 and a.shape[2] == n2 and _c_strides(a)


@njit(cache=True)
def _check_cache(K, V, n_kv, hd):
    """The cache layout kv_write documents, C-contiguous."""
    ctx = V.shape[1]
    return (_check_c3(V, n_kv, ctx, hd) and K.shape[0] == n_kv and K.shape[1] * 16 == ctx
            and K.shape[2] == hd and K.shape[3] == 16 and _c_strides(K))


@njit(cache=True, parallel=True)
def kv_write(K, V, k, v, positions):
    """Round new keys/values to half and store them in the cache.

    Args:
        K: uint16 (n_kv, ctx // 16, hd, 16), half bits; position p is K[:, p // 16, :, p % 16].
        V: uint16 (n_kv, ctx, hd), half bits.
        k, v: float32 (n, n_kv, hd), C-contiguous, for the tokens at ``positions`` (int64 (n,)).
    """
    n, n_kv, hd = k.shape
    ctx = V.shape[1]
    if not (_check_c3(k, n, n_kv, hd) and _check_c3(v, n, n_kv, hd)
            and _check_cache(K, V, n_kv, hd)):
        raise ValueError("kv_write: shapes or layouts do not match")
    for t in range(n):
        if positions[t] < 0 or positions[t] >= ctx:
            raise ValueError("kv_write: position outside the cache")
    hd16 = hd - hd % 16
    for h in prange(n_kv):
        row = np.empty(hd, np.uint16)
        for t in range(n):
            p = positions[t]
            src = (t * n_kv + h) * hd
            dst = (h * ctx + p) * hd
            for d in range(0, hd16, 16):
                vf_store_f16(row, d * 2, vf_load(k, (src + d) * 4))
                vf_store_f16(V, (dst + d) * 2, vf_load(v, (src + d) * 4))
            for d in range(hd16, hd):
                row[d] = f32_to_f16_bits(k[t, h, d])
                V[h, p, d] = f32_to_f16_bits(v[t, h, d])
            blk = p // 16
            lane = p % 16
            for d in range(hd):
                K[h, blk, d, lane] = row[d]


@njit(cache=True)
def _widen_copy(src, s0, dst, d0, count):
    """dst[d0 : d0 + count] = src[s0 : s0 + count] as float32 (element offsets, count a
    multiple of 16)."""
    for i in range(0, count, 16):
        vf_store(dst, (d0 + i) * 4, vf_load_el(src, s0 + i))


@njit(cache=True)
def _item(q, Ks, Vs, src, positions, window, c, out, t0, t1, kvh, c0, c1, split, P, PmPl):
    """Attention of tokens t0..t1-1 for the query heads of KV head kvh, over key chunks
    c0..c1. Keys and values from Ks, Vs: the cache or its float32 copy, described by src =
    (n_kv, K element offset, V element offset, blocks per KV head, first block). Not split:
    the whole result into ``out``. Split: per-chunk partials into P (n * H, chunks, hd) and
    PmPl (2, n * H, chunks) (chunk maxima and sums) for _merge."""
    n, H, hd = q.shape
    n_kv, ka, va, nbs, b0 = src
    G = H // n_kv
    rows = (t1 - t0) * G
    R = rows
    ri = np.empty(5 * rows, np.int64)
    # Typed int64 from the start: a literal here would make Numba also compile the kernels
    # for literal arguments (and so for every call site that passes one).
    bmin = np.int64(1 << 62)
    bmax = np.int64(-1)
    for r in range(rows):
        p = positions[t0 + r // G]
        first = 0
        if window > 0 and p - window + 1 > 0:
            first = p - window + 1
        ri[r] = max(first, c0 * CHUNK)
        ri[R + r] = min(p, c1 * CHUNK + CHUNK - 1)
        if ri[r] <= ri[R + r]:
            bmin = min(bmin, ri[r] // 16)
            bmax = max(bmax, ri[R + r] // 16)
    if bmax < 0:
        return
    span = (bmax - bmin + 1) * 16
    kbase = bmin * 16
    cbase = kbase // CHUNK
    nch = bmax * 16 // CHUNK - cbase + 1
    # Scratch, element offsets: [align | S (rows x span) | O, qs (rows x hd) | m, l, w
    # (rows x nch) | tot (rows)].
    fl = np.empty(16 + rows * (span + 2 * hd + 3 * nch + 1), np.float32)
    so = np.int64((64 - fl.ctypes.data % 64) % 64 // 4)
    oo = so + rows * span
    qo = oo + rows * hd
    mo = qo + rows * hd
    lo = mo + rows * nch
    wo = lo + rows * nch
    to = wo + rows * nch
    hd16 = hd - hd % 16
    cv = vf_splat(c)
    for r in range(rows):
        t = t0 + r // G
        h = kvh * G + r % G
        qb = (t * H + h) * hd * 4
        for d in range(0, hd16, 16):
            vf_store(fl, (qo + r * hd + d) * 4, vf_mul(vf_load(q, qb + d * 4), cv))
        for d in range(hd16, hd):
            fl[qo + r * hd + d] = q[t, h, d] * c
        ri[2 * R + r] = (so + r * span - kbase) * 4
        ri[3 * R + r] = (oo + r * hd) * 4
        ri[4 * R + r] = (wo + r * nch) * 4
    fold = not split  # a variable, not a literal: one compiled _values for both uses
    _scores(fl, Ks, ri, rows, hd, ka + (kvh * nbs - b0) * hd * 16, qo * 4)
    _softmax(fl, ri, rows, cbase, mo, lo, wo, to, nch, fold)
    v0 = va + (kvh * nbs - b0) * 16 * hd
    if split:
        nchunks = P.shape[1]
        for r in range(rows):
            row = (t0 + r // G) * H + kvh * G + r % G
            ri[3 * R + r] = row * nchunks * hd * 4
            if ri[r] <= ri[R + r]:
                for cc in range(ri[r] // CHUNK, ri[R + r] // CHUNK + 1):
                    PmPl[0, row, cc] = fl[mo + r * nch + cc - cbase]
                    PmPl[1, row, cc] = fl[lo + r * nch + cc - cbase]
        _values(fl, Vs, P.reshape(-1), ri, rows, hd, v0, hd * 4, cbase, cbase + nch - 1, cbase,
                fold)
        return
    fl[oo:oo + rows * hd] = 0.0
    _values(fl, Vs, fl, ri, rows, hd, v0, np.int64(0), cbase, cbase + nch - 1, cbase, fold)
    for r in range(rows):
        t = t0 + r // G
        h = kvh * G + r % G
        ob = (t * H + h) * hd * 4
        den = vf_splat(fl[to + r])
        for d in range(0, hd16, 16):
            vf_store(out, ob + d * 4, vf_div(vf_load(fl, (oo + r * hd + d) * 4), den))
        for d in range(hd16, hd):
            out[t, h, d] = fl[oo + r * hd + d] / fl[to + r]


@njit(cache=True, parallel=True)
def _widen_cache(K, V, b0, nb, Kc, Vc, ka, va):
    """Float32 copies of key blocks b0..b0+nb-1 (and their values) of every KV head, laid out
    like the cache, at element offsets ka of Kc and va of Vc."""
    n_kv, nblk, hd, _ = K.shape
    per = hd * 16  # elements per block
    pieces = (nb + 15) // 16
    for u in prange(n_kv * pieces):
        h = u // pieces
        b = (u % pieces) * 16
        cnt = min(16, nb - b) * per
        _widen_copy(K, (h * nblk + b0 + b) * per, Kc, ka + (h * nb + b) * per, cnt)
        _widen_copy(V, (h * nblk + b0 + b) * per, Vc, va + (h * nb + b) * per, cnt)


@njit(cache=True)
def _merge(P, PmPl, positions, window, out):
    """Combine per-chunk partials (as _item stores them when split) into ``out``, with the
    same arithmetic as an unsplit item: weights from _weights, outputs an fma chain over
    chunks in order of w_c * o_c, divided by the total."""
    n, H, hd = out.shape
    nchunks = P.shape[1]
    w = np.empty(nchunks, np.float32)
    Pm = PmPl[0].reshape(-1)
    Pl = PmPl[1].reshape(-1)
    hd16 = hd - hd % 16
    for t in range(n):
        p = positions[t]
        first = 0
        if window > 0 and p - window + 1 > 0:
            first = p - window + 1
        ca = first // CHUNK
        cb = p // CHUNK
        for h in range(H):
            row = t * H + h
            tot = _weights(Pm, row * nchunks, Pl, row * nchunks, w, 0, ca, cb)
            den = vf_splat(tot)
            ob = (t * H + h) * hd * 4
            for d in range(0, hd16, 16):
                o = vf_zero()
                for cc in range(ca, cb + 1):
                    o = vf_fma(vf_splat(w[cc]), vf_load(P, ((row * nchunks + cc) * hd + d) * 4), o)
                vf_store(out, ob + d * 4, vf_div(o, den))
            for d in range(hd16, hd):
                x = np.float32(0.0)
                for cc in range(ca, cb + 1):
                    x = f32_fma(w[cc], P[row, cc, d], x)
                out[t, h, d] = x / tot


@njit(cache=True, parallel=True)
def attend(q, K, V, positions, window, scale, out):
    """out[t, h] = softmax(scale * q[t, h] . K[j]) @ V[j] over keys j = lo..positions[t].

    Per output element, whatever the batch and thread split (float32; K, V widened exactly
    from half; fma = one rounding; chunk c = keys 128c..128c+127 within lo..p):
      qs[d] = q[d] * f32(scale * log2(e));
      s_j = fma chain over d = 0..hd-1 of qs[d] * K_j[d], from +0;
      per chunk: m_c = max s_j;  e_j = exp2(s_j - m_c)  (vmath.vf_exp2);
          l_c = per lane i (keys 16b + i) sum of e_j over the chunk's blocks b in order from
          +0, then the 16 lanes summed by halving ((0..7)+(8..15), ...);
          o_c[d] = fma chain over its keys j in order of e_j * V_j[d], from +0;
      M = max m_c;  w_c = exp2(m_c - M);  L = fma chain over chunks of w_c * l_c, from +0;
      o[d] = (fma chain over chunks in order of w_c * o_c[d], from +0) / L.

    Args:
        q: float32 (n, H, hd), C-contiguous; H a multiple of n_kv (grouped-query attention).
        K, V: the half cache (see kv_write), already holding every key up to each position.
        positions: int64 (n,) each query's position; it sees keys lo..position.
        window: sliding window (lo = position - window + 1, at least 0), 0 for none.
        scale: score multiplier.
        out: float32 (n, H, hd), C-contiguous; written.
    """
    n, H, hd = q.shape
    n_kv = K.shape[0]
    ctx = V.shape[1]
    if not (_check_c3(q, n, H, hd) and _check_c3(out, n, H, hd) and n_kv > 0
            and H % n_kv == 0 and _check_cache(K, V, n_kv, hd)):
        raise ValueError("attend: shapes or layouts do not match")
    pmax = 0
    kmin = ctx
    for t in range(n):
        p = positions[t]
        if p < 0 or p >= ctx:
            raise ValueError("attend: position outside the cache")
        pmax = max(pmax, p)
        kmin = min(kmin, max(0, p - window + 1) if window > 0 else 0)
    G = H // n_kv
    c = np.float32(scale * LOG2E)
    tile = 4 * max(1, _ROWS_PER_ITEM // (4 * G))
    nt = (n + tile - 1) // tile
    nchunks = pmax // CHUNK + 1
    split = nt * n_kv < _MIN_ITEMS and nchunks > 1
    cg = nchunks  # chunks per item
    if split:
        per = max(1, _SPLIT_UNITS // (nt * n_kv))
        cg = (nchunks + per - 1) // per
    ncg = (nchunks + cg - 1) // cg
    n_items = nt * n_kv * ncg
    # Items in order, cut by estimated cost into _RUNS contiguous runs of equal cost; the
    # parallel loop deals runs out to threads in equal contiguous shares.
    cost = np.empty(n_items + 1, np.float64)
    cost[0] = 0.0
    for i in range(n_items):
        ti = i // (n_kv * ncg)
        c0 = (i % ncg) * cg
        t0 = ti * tile
        t1 = min(n, t0 + tile)
        keys = 0
        for t in range(t0, t1):
            p = positions[t]
            f = 0
            if window > 0 and p - window + 1 > 0:
                f = p - window + 1
            keys += max(0, min(p, (c0 + cg) * CHUNK - 1) - max(f, c0 * CHUNK) + 1)
        cost[i + 1] = cost[i] + G * (keys + (t1 - t0) * _ROW_OVERHEAD)
    bounds = np.zeros(_RUNS + 1, np.int64)
    i = 0
    for w in range(_RUNS):
        while i < n_items and (cost[i] + cost[i + 1]) * 0.5 * _RUNS < cost[n_items] * (w + 1):
            i += 1
        bounds[w + 1] = i
    bounds[_RUNS] = n_items
    P = np.empty((n * H if split else 0, nchunks, hd), np.float32)
    PmPl = np.empty((2, n * H if split else 0, nchunks), np.float32)
    # Prompt-sized batches read keys and values from one float32 copy of the blocks they
    # need: FMAs then take aligned float32 operands instead of sharing ports with half
    # conversions. Decode reads the half cache directly: there each value serves G rows only,
    # too few to pay for the copy. (Two compiled _item variants, one per source type.)
    b0 = kmin // 16
    nb = pmax // 16 - b0 + 1
    copy = not split and n * G >= 8 and 2 * n_kv * nb * 16 * hd * 4 <= _COPY_BYTES
    Kc = np.empty(n_kv * nb * 16 * hd + 16 if copy else 0, np.float32)
    Vc = np.empty(Kc.size, np.float32)
    zero = np.int64(0)
    ka = zero
    va = zero
    if copy:
        ka = np.int64((64 - Kc.ctypes.data % 64) % 64 // 4)
        va = np.int64((64 - Vc.ctypes.data % 64) % 64 // 4)
        _widen_cache(K, V, b0, nb, Kc, Vc, ka, va)
    for w in prange(_RUNS):
        for i in range(bounds[w], bounds[w + 1]):
            ti = i // (n_kv * ncg)
            kvh = (i // ncg) % n_kv
            c0 = (i % ncg) * cg
            t0 = ti * tile
            t1 = min(n, t0 + tile)
            c1 = min(nchunks, c0 + cg) - 1
            if copy:
                _item(q, Kc, Vc, (n_kv, ka, va, nb, b0), positions, window, c, out, t0, t1,
                      kvh, c0, c1, split, P, PmPl)
            else:
                _item(q, K, V, (n_kv, zero, zero, K.shape[1], zero), positions, window, c,
                      out, t0, t1, kvh, c0, c1, split, P, PmPl)
    if split:
        _merge(P, PmPl, positions, window, out)
