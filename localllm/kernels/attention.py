"""Causal (optionally sliding-window) GQA attention over paged KV caches, batch-invariant:
each output element has one fixed arithmetic sequence, whatever the batch, the sequences
batched with it, the page placement or the thread split.

Keys and values live in pages of ``block_size`` tokens (kvpages.py: the layout and the KV
types); each sequence's block table maps its blocks to pages, and the kernels read the pages
through it, for prompt chunks and decode alike.
"""

from collections import namedtuple

import numpy as np
from numba import prange

from .attention_steps import KEYS_PER_BLOCK  # noqa: F401 (the cache layout, for callers)
from .attention_steps import CHUNK, _scores, _softmax, _values, _weights
from .jit import njit
from .kvpages import (PAD, balance_block, group_nbytes, rotate_block, rotated, row_nbytes,
                      store_key, store_value)
from .simd import vf_load, vf_mul, vf_splat, vf_store, vf_zero
from .vmath import f32_fma, vf_div, vf_fma

LOG2E = 1.4426950408889634

# What one layer's attention reads: its pages (kvpages.Pages* tuples), the batch's block
# tables (int32 (n_seqs, max_blocks), -1 for blocks not held) and each token's row in them.
# (The parallel kernels take the fields one by one: Numba's parallel loops cannot use a
# tuple nested in another tuple.)
PagedKV = namedtuple("PagedKV", ["K", "V", "tables", "row_seq", "block_size", "n_kv"])

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
# Tokens per work unit of kv_write.
_WRITE_RUN = 16


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
def n_pages(K, V, bs, n_kv, hd):
    """Pages a layer's arrays hold, or -1 when K and V disagree or the geometry is bad."""
    if bs <= 0 or bs % 16 or n_kv <= 0:
        return -1
    kp = (K.a.size - PAD) // (n_kv * (bs // 16) * group_nbytes(K, hd))
    vp = (V.a.size - PAD) // (n_kv * bs * row_nbytes(V, hd))
    return kp if kp == vp else -1


@njit(cache=True)
def _check_rows(K, V, tables, row_seq, bs, n_kv, positions, window, hd, need_all):
    """Every token's page (need_all: and every page its attention reads) is a valid page of
    the layer; raises ValueError otherwise, before anything is read or written. Returns the
    layer's page count."""
    npg = n_pages(K, V, bs, n_kv, hd)
    if npg < 0 or positions.shape[0] != row_seq.shape[0]:
        raise ValueError("paged KV: shapes or layouts do not match")
    # Table entries cs, clo..chi are known good: a prompt chunk's tokens share most of theirs.
    cs = np.int64(-1)
    clo = np.int64(0)
    chi = np.int64(-1)
    for t in range(positions.shape[0]):
        s = row_seq[t]
        p = positions[t]
        if s < 0 or s >= tables.shape[0] or p < 0 or p >= tables.shape[1] * bs:
            raise ValueError("paged KV: position or sequence outside the block tables")
        first = p
        if need_all:
            first = max(0, p - window + 1) if window > 0 else 0
        lo = first // bs
        hi = p // bs
        if s != cs or hi < clo - 1 or lo > chi + 1:
            cs = s
            clo = lo
            chi = lo - 1
        for part in range(2):  # the entries below clo, then those above chi
            a = lo if part == 0 else max(lo, chi + 1)
            b = min(hi, clo - 1) if part == 0 else hi
            for i in range(a, b + 1):
                page = tables[s, i]
                if page < 0 or page >= npg:
                    raise ValueError("paged KV: a block the attention needs is not held")
        clo = min(clo, lo)
        chi = max(chi, hi)
    return npg


@njit(cache=True, parallel=True)
def kv_write(K, V, tables, row_seq, bs, k, v, positions):
    """Round new keys/values to the KV type and store them in their sequences' pages.

    Args:
        K, V, tables, row_seq, bs: the PagedKV fields of the layer and batch.
        k, v: float32 (n, n_kv, hd), C-contiguous, for the tokens at ``positions`` (int64 (n,)),
            token t in the sequence of table row row_seq[t].
    """
    n, n_kv, hd = k.shape
    if not (_check_c3(k, n, n_kv, hd) and _check_c3(v, n, n_kv, hd)):
        raise ValueError("kv_write: shapes or layouts do not match")
    npg = _check_rows(K, V, tables, row_seq, bs, n_kv, positions, 0, hd, False)
    gpp = bs // 16
    gb = group_nbytes(K, hd)
    rb = row_nbytes(V, hd)
    # Work units: a KV head's runs of _WRITE_RUN tokens (a prompt chunk's rounding would
    # otherwise wait on the thread holding two of three heads).
    runs = (n + _WRITE_RUN - 1) // _WRITE_RUN
    for u in prange(n_kv * runs):
        h = u % n_kv
        t0 = u // n_kv * _WRITE_RUN
        tmp = np.empty(max(64, hd), np.int32)  # the stores' scratch
        for t in range(t0, min(n, t0 + _WRITE_RUN)):
            p = positions[t]
            page = tables[row_seq[t], p // bs]
            slot = p % bs
            store_key(K, ((h * npg + page) * gpp + slot // 16) * gb, slot % 16, hd, k[t, h],
                      tmp)
            store_value(V, ((h * npg + page) * bs + slot) * rb, hd, v[t, h], tmp)


@njit(cache=True)
def _item(q, K, V, trow, bs, n_kv, npg, positions, window, c, sinks, out, t0, t1, kvh, c0,
          c1, split, P, PmPl):
    """Attention of tokens t0..t1-1 (one sequence, block table ``trow``) for the query heads
    of KV head kvh, over key chunks c0..c1, with the heads' sinks (log2 units, or empty).
    Not split: the whole result into ``out``. Split: per-chunk partials into P (n * H,
    chunks, hd) and PmPl (2, n * H, chunks) (chunk maxima and sums) for _merge."""
    n, H, hd = q.shape
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
    # Byte addresses of the blocks' key groups, then of their first value rows.
    gpp = bs // 16
    gb = group_nbytes(K, hd)
    rb = row_nbytes(V, hd)
    nb = bmax - bmin + 1
    ad = np.empty(2 * nb, np.int64)
    head = kvh * npg
    if gpp == 1:  # a page per block (the default): a loop LLVM vectorizes
        for i in range(nb):
            ph = head + np.int64(trow[np.uint64(bmin + i)])
            ad[i] = ph * gb
            ad[nb + i] = ph * (16 * rb)
    else:
        pg = bmin // gpp  # block b is group g of table entry pg (no division per block)
        g = bmin % gpp
        for i in range(nb):
            ph = head + trow[pg]
            ad[i] = (ph * gpp + g) * gb
            ad[nb + i] = (ph * bs + g * 16) * rb
            g += 1
            if g == gpp:
                g = 0
                pg += 1
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
    sk = np.empty(rows if sinks.size > 0 and fold else 0, np.float32)
    for r in range(sk.size):
        sk[r] = sinks[kvh * G + r % G]
    _scores(fl, K, ad, bmin, ri, rows, hd, qo * 4)
    _softmax(fl, ri, rows, cbase, mo, lo, wo, to, nch, fold, sk)
    vb = nb - bmin
    if split:
        nchunks = P.shape[1]
        for r in range(rows):
            row = (t0 + r // G) * H + kvh * G + r % G
            ri[3 * R + r] = row * nchunks * hd * 4
            if ri[r] <= ri[R + r]:
                for cc in range(ri[r] // CHUNK, ri[R + r] // CHUNK + 1):
                    PmPl[0, row, cc] = fl[mo + r * nch + cc - cbase]
                    PmPl[1, row, cc] = fl[lo + r * nch + cc - cbase]
        _values(fl, V, P.reshape(-1), ri, rows, hd, ad, vb, rb, hd * 4, cbase,
                cbase + nch - 1, cbase, fold)
        return
    fl[oo:oo + rows * hd] = 0.0
    _values(fl, V, fl, ri, rows, hd, ad, vb, rb, np.int64(0), cbase, cbase + nch - 1,
            cbase, fold)
    for r in range(rows):
        t = t0 + r // G
        h = kvh * G + r % G
        ob = (t * H + h) * hd * 4
        den = vf_splat(fl[to + r])
        for d in range(0, hd16, 16):
            vf_store(out, ob + d * 4, vf_div(vf_load(fl, (oo + r * hd + d) * 4), den))
        for d in range(hd16, hd):
            out[t, h, d] = fl[oo + r * hd + d] / fl[to + r]


@njit(cache=True)
def _merge(P, PmPl, positions, window, sinks, out):
    """Combine per-chunk partials (as _item stores them when split) into ``out``, with the
    same arithmetic as an unsplit item: weights from _weights (with the head's sink),
    outputs an fma chain over chunks in order of w_c * o_c, divided by the total."""
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
            sink = sinks[h] if sinks.size > 0 else np.float32(-np.inf)
            tot = _weights(Pm, row * nchunks, Pl, row * nchunks, w, 0, ca, cb, sink)
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
def attend(q, K, V, tables, row_seq, bs, n_kv, positions, window, scale, sinks, out):
    """out[t, h] = softmax(scale * q[t, h] . K[j]) @ V[j] over keys j = lo..positions[t] of
    token t's own sequence.

    Per output element, whatever the batch and thread split (float32; K, V widened exactly
    from their KV type; fma = one rounding; chunk c = keys 128c..128c+127 within lo..p):
      qs[d] = q[d] * f32(scale * log2(e));
      s_j = fma chain over d = 0..hd-1 of qs[d] * K_j[d], from +0;
      per chunk: m_c = max s_j;  e_j = exp2(s_j - m_c)  (vmath.vf_exp2);
          l_c = per lane i (keys 16b + i) sum of e_j over the chunk's blocks b in order from
          +0, then the 16 lanes summed by halving ((0..7)+(8..15), ...);
          o_c[d] = fma chain over its keys j in order of e_j * V_j[d], from +0;
      M = max m_c;  w_c = exp2(m_c - M);  L = fma chain over chunks of w_c * l_c, from +0;
      o[d] = (fma chain over chunks in order of w_c * o_c[d], from +0) / L.
    With attention sinks (gpt-oss: a learned logit per head that joins the softmax's
    denominator and adds no value), z = f32(sink[h] * log2(e)): M = max(M, z) and
    L = L + exp2(z - M) after the chain.

    Args:
        q: float32 (n, H, hd), C-contiguous; H a multiple of n_kv (grouped-query attention).
        K, V, tables, row_seq, bs, n_kv: the PagedKV fields of the layer and batch, its pages
            already holding every key up to each token's position (kv_write first).
        positions: int64 (n,) each query's position; it sees keys lo..position.
        window: sliding window (lo = position - window + 1, at least 0), 0 for none.
        scale: score multiplier.
        sinks: float32 (H,) each query head's sink logit, or empty for none.
        out: float32 (n, H, hd), C-contiguous; written.
    """
    n, H, hd = q.shape
    if not (_check_c3(q, n, H, hd) and _check_c3(out, n, H, hd) and n_kv > 0
            and H % n_kv == 0 and (sinks.size == 0 or sinks.size == H)):
        raise ValueError("attend: shapes or layouts do not match")
    npg = _check_rows(K, V, tables, row_seq, bs, n_kv, positions, window, hd, True)
    pmax = 0
    for t in range(n):
        pmax = max(pmax, positions[t])
    G = H // n_kv
    c = np.float32(scale * LOG2E)
    s2 = np.empty(sinks.size, np.float32)  # the sinks in the scores' log2 units
    for h in range(sinks.size):
        s2[h] = np.float32(sinks[h]) * np.float32(LOG2E)
    tile = 4 * max(1, _ROWS_PER_ITEM // (4 * G))
    # Token tiles: runs of consecutive tokens of one sequence, at most ``tile`` long.
    tiles = np.empty(n + 1, np.int64)
    nt = 0
    t = 0
    while t < n:
        tiles[nt] = t
        e = t + 1
        while e < n and e - t < tile and row_seq[e] == row_seq[t]:
            e += 1
        nt += 1
        t = e
    tiles[nt] = n
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
        t0 = tiles[ti]
        t1 = tiles[ti + 1]
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
    for w in prange(_RUNS):
        for i in range(bounds[w], bounds[w + 1]):
            ti = i // (n_kv * ncg)
            kvh = (i // ncg) % n_kv
            c0 = (i % ncg) * cg
            t0 = tiles[ti]
            t1 = tiles[ti + 1]
            c1 = min(nchunks, c0 + cg) - 1
            _item(q, K, V, tables[row_seq[t0]], bs, n_kv, npg, positions, window, c, s2, out,
                  t0, t1, kvh, c0, c1, split, P, PmPl)
    if split:
        _merge(P, PmPl, positions, window, s2, out)


@njit(cache=True)
def paged_attention(q, k, v, K, V, tables, row_seq, bs, n_kv, positions, window, scale,
                    kbal, sinks, out):
    """Store k, v in the pages and attend: attend() after kv_write(), with the rotation of
    the KV types that store vectors rotated (kvpages.ROTATED) applied around them, keys of
    such a type first divided by the key balance and queries multiplied by it.

    Args:
        q: float32 (n, H * hd); k, v: float32 (n, n_kv * hd); all C-contiguous scratch (the
            rotated types turn them in place).
        K, V, tables, row_seq, bs, n_kv: the PagedKV fields; positions: int64 (n,).
        kbal: float32 (hd,) key balance (kvpages.key_balance), or empty for none.
        sinks: float32 (H,) attention sinks (see attend), or empty for none.
        out: float32 (n, H * hd), written.
    """
    n = q.shape[0]
    H = q.shape[1] * n_kv // max(k.shape[1], 1)
    hd = k.shape[1] // n_kv
    if rotated(K):
        if kbal.size == hd:
            balance_block(q, H, hd, kbal, False)
            balance_block(k, n_kv, hd, kbal, True)
        rotate_block(q, H, hd)
        rotate_block(k, n_kv, hd)
    if rotated(V):
        rotate_block(v, n_kv, hd)
    kv_write(K, V, tables, row_seq, bs, k.reshape(n, n_kv, hd), v.reshape(n, n_kv, hd),
             positions)
    attend(q.reshape(n, H, hd), K, V, tables, row_seq, bs, n_kv, positions, window, scale,
           sinks, out.reshape(n, H, hd))
    if rotated(V):
        rotate_block(out, H, hd)
