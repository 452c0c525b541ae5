"""The arithmetic of one attention work item (a tile of query rows against one KV head's
chunks): scores q . K, the chunked softmax, and the weighted sum of values, each in one
fixed order per output element (see attention.attend for the whole definition).
"""

import numpy as np

from .jit import njit
from .kvpages import group_nbytes, k_dim, k_scale, v_dims, v_el
from .simd import prefetch, vf_add, vf_load, vf_splat, vf_store, vf_sub, vf_zero
from .vmath import (f32_exp2, f32_fma, vf_bcast, vf_exp2, vf_fma, vf_hmax, vf_hsum, vf_keep,
                    vf_max)

KEYS_PER_BLOCK = 16
# Softmax chunk: keys [128c, 128c + 128) by absolute position. Each chunk gets its own max and
# partial sums, merged in chunk order, so threads may split a long context by chunk.
CHUNK = 128


# ----------------------------------------------------------------------------- scores
# The kernels loop over a whole work item and take few arrays: a call between Numba
# functions costs tens of ns per array argument (reference counting, exploded structs), so
# an item's float32 scratch is one array ``fl`` and its per-row integers one array ``ri``:
# ri[r] = first key, ri[R + r] = last key (R rows; empty when first > last), ri[2R + r] =
# byte offset in fl of the row's score of key 0, ri[3R + r] = byte offset in the output D of
# its dim 0, ri[4R + r] = byte offset in fl of its weight of chunk ``cbase``.
# Keys and values are read from the KV pages through the item's block addresses: ``ad``
# holds, for key block b (16 keys) from ``b0`` on, the byte offset of its key group at
# ad[b - b0] and of its first value row at ad[nb + b - b0] (see kvpages for the layout).

@njit(cache=True)
def _scores(fl, Kp, ad, b0, ri, rows, hd, qb):
    """Scores s_key of each row's key blocks, stored in its S row (see ri); qs at byte qb of
    fl (rows x hd). Rows go 4 at a time (a group of 3 repeats its last row) against 4 blocks,
    then single blocks; 1-2 leftover rows alone. Dims in order, in runs of 32 that share the
    quantized types' scales."""
    per = group_nbytes(Kp, hd) // hd  # bytes of one dim of a key group (for prefetches)
    for ra in range(0, rows, 4):
        rb = min(ra + 3, rows - 1)
        if rb - ra < 2:
            for r in range(ra, rb + 1):
                if ri[r] > ri[rows + r]:
                    continue
                bl = ri[r] // 16
                bh = ri[rows + r] // 16
                q0 = qb + r * hd * 4
                s0 = ri[2 * rows + r]
                for b in range(bl, bh + 1, 4):  # the last group repeats its last block
                    b1 = min(b + 1, bh)
                    b2 = min(b + 2, bh)
                    b3 = min(b + 3, bh)
                    g0 = ad[b - b0]
                    g1 = ad[b1 - b0]
                    g2 = ad[b2 - b0]
                    g3 = ad[b3 - b0]
                    # the key groups two steps ahead, asked for a dim at a time: each block
                    # is a page of its own, where the hardware prefetcher starts cold (a
                    # decode step's keys come from memory, not cache)
                    n0 = ad[min(b + 8, bh) - b0]
                    n1 = ad[min(b + 9, bh) - b0]
                    n2 = ad[min(b + 10, bh) - b0]
                    n3 = ad[min(b + 11, bh) - b0]
                    a0 = vf_zero()
                    a1 = vf_zero()
                    a2 = vf_zero()
                    a3 = vf_zero()
                    for c in range(0, hd, 32):
                        sc0 = k_scale(Kp, g0, hd, c)
                        sc1 = k_scale(Kp, g1, hd, c)
                        sc2 = k_scale(Kp, g2, hd, c)
                        sc3 = k_scale(Kp, g3, hd, c)
                        for d in range(c, min(c + 32, hd)):
                            prefetch(Kp.a, n0 + d * per)
                            prefetch(Kp.a, n1 + d * per)
                            prefetch(Kp.a, n2 + d * per)
                            prefetch(Kp.a, n3 + d * per)
                            x = vf_bcast(fl, q0 + d * 4)
                            a0 = vf_fma(x, k_dim(Kp, g0, d, sc0), a0)
                            a1 = vf_fma(x, k_dim(Kp, g1, d, sc1), a1)
                            a2 = vf_fma(x, k_dim(Kp, g2, d, sc2), a2)
                            a3 = vf_fma(x, k_dim(Kp, g3, d, sc3), a3)
                    vf_store(fl, s0 + b * 64, a0)
                    vf_store(fl, s0 + b1 * 64, a1)
                    vf_store(fl, s0 + b2 * 64, a2)
                    vf_store(fl, s0 + b3 * 64, a3)
            continue
        bl = 1 << 62
        bh = -1
        for r in range(ra, rb + 1):
            if ri[r] <= ri[rows + r]:
                bl = min(bl, ri[r] // 16)
                bh = max(bh, ri[rows + r] // 16)
        q0 = qb + ra * hd * 4
        q1 = qb + min(ra + 1, rb) * hd * 4
        q2 = qb + min(ra + 2, rb) * hd * 4
        q3 = qb + min(ra + 3, rb) * hd * 4
        s0 = ri[2 * rows + ra]
        s1 = ri[2 * rows + min(ra + 1, rb)]
        s2 = ri[2 * rows + min(ra + 2, rb)]
        s3 = ri[2 * rows + min(ra + 3, rb)]
        b = bl
        while b + 3 <= bh:
            g0 = ad[b - b0]
            g1 = ad[b + 1 - b0]
            g2 = ad[b + 2 - b0]
            g3 = ad[b + 3 - b0]
            a00 = vf_zero()
            a01 = vf_zero()
            a02 = vf_zero()
            a03 = vf_zero()
            a10 = vf_zero()
            a11 = vf_zero()
            a12 = vf_zero()
            a13 = vf_zero()
            a20 = vf_zero()
            a21 = vf_zero()
            a22 = vf_zero()
            a23 = vf_zero()
            a30 = vf_zero()
            a31 = vf_zero()
            a32 = vf_zero()
            a33 = vf_zero()
            for c in range(0, hd, 32):
                sc0 = k_scale(Kp, g0, hd, c)
                sc1 = k_scale(Kp, g1, hd, c)
                sc2 = k_scale(Kp, g2, hd, c)
                sc3 = k_scale(Kp, g3, hd, c)
                for d in range(c, min(c + 32, hd)):
                    kv0 = k_dim(Kp, g0, d, sc0)
                    kv1 = k_dim(Kp, g1, d, sc1)
                    kv2 = k_dim(Kp, g2, d, sc2)
                    kv3 = k_dim(Kp, g3, d, sc3)
                    x = vf_bcast(fl, q0 + d * 4)
                    a00 = vf_fma(x, kv0, a00)
                    a01 = vf_fma(x, kv1, a01)
                    a02 = vf_fma(x, kv2, a02)
                    a03 = vf_fma(x, kv3, a03)
                    x = vf_bcast(fl, q1 + d * 4)
                    a10 = vf_fma(x, kv0, a10)
                    a11 = vf_fma(x, kv1, a11)
                    a12 = vf_fma(x, kv2, a12)
                    a13 = vf_fma(x, kv3, a13)
                    x = vf_bcast(fl, q2 + d * 4)
                    a20 = vf_fma(x, kv0, a20)
                    a21 = vf_fma(x, kv1, a21)
                    a22 = vf_fma(x, kv2, a22)
                    a23 = vf_fma(x, kv3, a23)
                    x = vf_bcast(fl, q3 + d * 4)
                    a30 = vf_fma(x, kv0, a30)
                    a31 = vf_fma(x, kv1, a31)
                    a32 = vf_fma(x, kv2, a32)
                    a33 = vf_fma(x, kv3, a33)
            o = b * 64
            vf_store(fl, s0 + o, a00)
            vf_store(fl, s0 + o + 64, a01)
            vf_store(fl, s0 + o + 128, a02)
            vf_store(fl, s0 + o + 192, a03)
            vf_store(fl, s1 + o, a10)
            vf_store(fl, s1 + o + 64, a11)
            vf_store(fl, s1 + o + 128, a12)
            vf_store(fl, s1 + o + 192, a13)
            vf_store(fl, s2 + o, a20)
            vf_store(fl, s2 + o + 64, a21)
            vf_store(fl, s2 + o + 128, a22)
            vf_store(fl, s2 + o + 192, a23)
            vf_store(fl, s3 + o, a30)
            vf_store(fl, s3 + o + 64, a31)
            vf_store(fl, s3 + o + 128, a32)
            vf_store(fl, s3 + o + 192, a33)
            b += 4
        while b <= bh:
            g0 = ad[b - b0]
            a00 = vf_zero()
            a10 = vf_zero()
            a20 = vf_zero()
            a30 = vf_zero()
            for c in range(0, hd, 32):
                sc0 = k_scale(Kp, g0, hd, c)
                for d in range(c, min(c + 32, hd)):
                    kv0 = k_dim(Kp, g0, d, sc0)
                    a00 = vf_fma(vf_bcast(fl, q0 + d * 4), kv0, a00)
                    a10 = vf_fma(vf_bcast(fl, q1 + d * 4), kv0, a10)
                    a20 = vf_fma(vf_bcast(fl, q2 + d * 4), kv0, a20)
                    a30 = vf_fma(vf_bcast(fl, q3 + d * 4), kv0, a30)
            vf_store(fl, s0 + b * 64, a00)
            vf_store(fl, s1 + b * 64, a10)
            vf_store(fl, s2 + b * 64, a20)
            vf_store(fl, s3 + b * 64, a30)
            b += 1


@njit(cache=True, inline="always")
def _weights(m, mo, l, lo, w, wo, c0, c1, sink):
    """Chunk weights w_c = exp2(m_c - M) of chunks c0..c1 (m[mo + c], l[lo + c] ->
    w[wo + c]) and the total: an fma chain over chunks in order of w_c * l_c, from +0.
    M = max m_c; with an attention sink (a per-head logit in log2 units, -inf for none) M
    is also at least the sink, and the total then gains exp2(sink - M) at the end: the
    sink joins the softmax's denominator, with no value."""
    mx = m[mo + c0]
    for c in range(c0 + 1, c1 + 1):
        if m[mo + c] > mx:
            mx = m[mo + c]
    has_sink = sink > -np.inf
    if has_sink and sink > mx:
        mx = sink
    tot = np.float32(0.0)
    for c in range(c0, c1 + 1):
        wc = f32_exp2(m[mo + c] - mx)
        w[wo + c] = wc
        tot = f32_fma(wc, l[lo + c], tot)
    if has_sink:
        tot = tot + f32_exp2(sink - mx)
    return tot


@njit(cache=True)
def _softmax(fl, ri, rows, cbase, mo, lo, wo, to, nch, fold, sk):
    """Per row and chunk: the chunk's max m (fl[mo + r * nch + c - cbase]), its scores (log2
    units) turned into exp2(s - m) in place, and their sum l (at lo likewise): lane-wise over
    its key blocks in order, then a fixed lane tree. ``fold``: also the row's chunk weights
    (at wo) and total (fl[to + r]), see _weights, with row r's sink sk[r] (log2 units; sk
    empty: no sinks)."""
    for r in range(rows):
        first = ri[r]
        last = ri[rows + r]
        if first > last:
            continue
        sr = ri[2 * rows + r]
        for c in range(first // CHUNK, last // CHUNK + 1):
            j0 = max(first, c * CHUNK)
            j1 = min(last, c * CHUNK + CHUNK - 1)
            b0 = j0 // 16
            b1 = j1 // 16
            mx = vf_splat(-np.inf)
            for b in range(b0, b1 + 1):
                s = vf_load(fl, sr + b * 64)
                if b == b0 or b == b1:
                    s = vf_keep(s, j0 - b * 16, j1 - b * 16, -np.inf)
                    vf_store(fl, sr + b * 64, s)
                mx = vf_max(mx, s)
            mc = vf_hmax(mx)
            ms = vf_splat(mc)
            acc = vf_zero()
            for b in range(b0, b1 + 1):
                e = vf_exp2(vf_sub(vf_load(fl, sr + b * 64), ms))
                if b == b0 or b == b1:  # keys outside the row's range weigh exactly 0
                    e = vf_keep(e, j0 - b * 16, j1 - b * 16, 0.0)
                vf_store(fl, sr + b * 64, e)
                acc = vf_add(acc, e)
            fl[mo + r * nch + c - cbase] = mc
            fl[lo + r * nch + c - cbase] = vf_hsum(acc)
        if fold:
            o = r * nch - cbase
            sink = sk[r] if sk.size > 0 else np.float32(-np.inf)
            fl[to + r] = _weights(fl, mo + o, fl, lo + o, fl, wo + o, first // CHUNK,
                                  last // CHUNK, sink)


# ----------------------------------------------------------------------------- values
# Per row, chunk and dim: o_c = fma chain over the chunk's keys in order of e_j * V_j, from 0.
# Then either folded at once into the row's output (o = fma(w_c, o_c, o), chunks in order) or
# stored as a partial (D byte offset ri[3R + r] + c * dstride) for _merge. The last vectors of
# a row may overlap the ones before (offsets clamped to hd16 - 16): they compute the same
# values, and a fold loads all four before it stores.

@njit(cache=True, inline="always")
def _clip(first, last, clo, chi):
    """A row's keys within a chunk; an empty range as (huge, -1), so that it neither widens
    the group's key range nor passes a row test."""
    a = max(first, clo)
    e = min(last, chi)
    if a > e:
        return 1 << 62, -1
    return a, e


@njit(cache=True, inline="always")
def _emit4(D, fl, base, wo, d0, d1, d2, d3, x0, x1, x2, x3, fold):
    if fold:
        w = vf_bcast(fl, wo)
        x0 = vf_fma(w, x0, vf_load(D, base + d0 * 4))
        x1 = vf_fma(w, x1, vf_load(D, base + d1 * 4))
        x2 = vf_fma(w, x2, vf_load(D, base + d2 * 4))
        x3 = vf_fma(w, x3, vf_load(D, base + d3 * 4))
    vf_store(D, base + d0 * 4, x0)
    vf_store(D, base + d1 * 4, x1)
    vf_store(D, base + d2 * 4, x2)
    vf_store(D, base + d3 * 4, x3)


@njit(cache=True)
def _values(fl, Vp, D, ri, rows, hd, ad, vb, vrow, dstride, ca, cb, cbase, fold):
    """Value sums of all rows over chunks ca..cb (probabilities in fl, see ri; key j's value
    row of ``vrow`` bytes in Vp at byte ad[vb + j // 16] + (j % 16) * vrow). Rows 4 at a time x 4 vectors of dims: in a chunk, the keys all
    rows share run unconditionally, the ragged ones before and after with a per-row test,
    so each row sees its keys in order. 1-2 leftover rows alone."""
    hd16 = hd - hd % 16
    R = rows
    for ra in range(0, rows, 4):
        rb = min(ra + 3, rows - 1)
        if hd16 == 0:
            break
        if rb - ra < 2:
            for r in range(ra, rb + 1):
                t = ri[2 * R + r]
                for c in range(ca, cb + 1):
                    a, b = _clip(ri[r], ri[R + r], c * CHUNK, c * CHUNK + CHUNK - 1)
                    if b < 0:
                        continue
                    base = ri[3 * R + r] + c * dstride
                    wo = ri[4 * R + r] + (c - cbase) * 4
                    for d in range(0, hd16, 64):
                        d1 = min(d + 16, hd16 - 16)
                        d2 = min(d + 32, hd16 - 16)
                        d3 = min(d + 48, hd16 - 16)
                        dv = d * vrow // hd  # byte offset of dim d in a value row
                        x0 = vf_zero()
                        x1 = vf_zero()
                        x2 = vf_zero()
                        x3 = vf_zero()
                        for j in range(a, b + 1):
                            # the same dims of the row two blocks ahead (pages of their own)
                            jn = min(j + 32, b)
                            vn = ad[np.uint64(vb + (jn >> 4))] + (jn & 15) * vrow + dv
                            prefetch(Vp.a, vn)
                            prefetch(Vp.a, vn + 64)
                            e = vf_bcast(fl, t + j * 4)
                            vo = ad[np.uint64(vb + (j >> 4))] + (j & 15) * vrow
                            x0 = vf_fma(e, v_dims(Vp, vo, hd, d), x0)
                            x1 = vf_fma(e, v_dims(Vp, vo, hd, d1), x1)
                            x2 = vf_fma(e, v_dims(Vp, vo, hd, d2), x2)
                            x3 = vf_fma(e, v_dims(Vp, vo, hd, d3), x3)
                        _emit4(D, fl, base, wo, d, d1, d2, d3, x0, x1, x2, x3, fold)
            continue
        r0 = ra
        r1 = ra + 1
        r2 = ra + 2
        r3 = rb
        t0 = ri[2 * R + r0]
        t1 = ri[2 * R + r1]
        t2 = ri[2 * R + r2]
        t3 = ri[2 * R + r3]
        for c in range(ca, cb + 1):
            clo = c * CHUNK
            chi = clo + CHUNK - 1
            a0, e0 = _clip(ri[r0], ri[R + r0], clo, chi)
            a1, e1 = _clip(ri[r1], ri[R + r1], clo, chi)
            a2, e2 = _clip(ri[r2], ri[R + r2], clo, chi)
            a3, e3 = _clip(ri[r3], ri[R + r3], clo, chi)
            if e0 < 0 and e1 < 0 and e2 < 0 and e3 < 0:
                continue
            jlo = min(min(a0, a1), min(a2, a3))
            jhi = max(max(e0, e1), max(e2, e3))
            j0 = max(max(a0, a1), max(a2, a3))
            j1 = min(min(e0, e1), min(e2, e3))
            if j0 > j1:  # no key shared by all rows: everything goes through the tests
                j0 = jhi + 1
                j1 = jhi
            wo = (c - cbase) * 4
            for d in range(0, hd16, 64):
                d1 = min(d + 16, hd16 - 16)
                d2 = min(d + 32, hd16 - 16)
                d3 = min(d + 48, hd16 - 16)
                x00 = vf_zero()
                x01 = vf_zero()
                x02 = vf_zero()
                x03 = vf_zero()
                x10 = vf_zero()
                x11 = vf_zero()
                x12 = vf_zero()
                x13 = vf_zero()
                x20 = vf_zero()
                x21 = vf_zero()
                x22 = vf_zero()
                x23 = vf_zero()
                x30 = vf_zero()
                x31 = vf_zero()
                x32 = vf_zero()
                x33 = vf_zero()
                for part in range(3):
                    js = jlo if part == 0 else (j0 if part == 1 else j1 + 1)
                    je = j0 - 1 if part == 0 else (j1 if part == 1 else jhi)
                    for j in range(js, je + 1):
                        vo = ad[np.uint64(vb + (j >> 4))] + (j & 15) * vrow
                        w0 = v_dims(Vp, vo, hd, d)
                        w1 = v_dims(Vp, vo, hd, d1)
                        w2 = v_dims(Vp, vo, hd, d2)
                        w3 = v_dims(Vp, vo, hd, d3)
                        if part == 1 or (a0 <= j and j <= e0):
                            e = vf_bcast(fl, t0 + j * 4)
                            x00 = vf_fma(e, w0, x00)
                            x01 = vf_fma(e, w1, x01)
                            x02 = vf_fma(e, w2, x02)
                            x03 = vf_fma(e, w3, x03)
                        if part == 1 or (a1 <= j and j <= e1):
                            e = vf_bcast(fl, t1 + j * 4)
                            x10 = vf_fma(e, w0, x10)
                            x11 = vf_fma(e, w1, x11)
                            x12 = vf_fma(e, w2, x12)
                            x13 = vf_fma(e, w3, x13)
                        if part == 1 or (a2 <= j and j <= e2):
                            e = vf_bcast(fl, t2 + j * 4)
                            x20 = vf_fma(e, w0, x20)
                            x21 = vf_fma(e, w1, x21)
                            x22 = vf_fma(e, w2, x22)
                            x23 = vf_fma(e, w3, x23)
                        if part == 1 or (a3 <= j and j <= e3):
                            e = vf_bcast(fl, t3 + j * 4)
                            x30 = vf_fma(e, w0, x30)
                            x31 = vf_fma(e, w1, x31)
                            x32 = vf_fma(e, w2, x32)
                            x33 = vf_fma(e, w3, x33)
                if e0 >= 0:
                    _emit4(D, fl, ri[3 * R + r0] + c * dstride, ri[4 * R + r0] + wo, d, d1, d2,
                           d3, x00, x01, x02, x03, fold)
                if e1 >= 0:
                    _emit4(D, fl, ri[3 * R + r1] + c * dstride, ri[4 * R + r1] + wo, d, d1, d2,
                           d3, x10, x11, x12, x13, fold)
                if e2 >= 0:
                    _emit4(D, fl, ri[3 * R + r2] + c * dstride, ri[4 * R + r2] + wo, d, d1, d2,
                           d3, x20, x21, x22, x23, fold)
                if e3 >= 0 and r3 != r2:
                    _emit4(D, fl, ri[3 * R + r3] + c * dstride, ri[4 * R + r3] + wo, d, d1, d2,
                           d3, x30, x31, x32, x33, fold)
    if hd16 < hd:
        _values_tail(fl, Vp, D, ri, rows, hd, ad, vb, vrow, dstride, ca, cb, cbase, fold)


@njit(cache=True)
def _values_tail(fl, Vp, D, ri, rows, hd, ad, vb, vrow, dstride, ca, cb, cbase, fold):
    """_values for dims hd16..hd-1, one at a time (head sizes not a multiple of 16)."""
    R = rows
    for r in range(rows):
        for c in range(ca, cb + 1):
            a, b = _clip(ri[r], ri[R + r], c * CHUNK, c * CHUNK + CHUNK - 1)
            if b < 0:
                continue
            base = (ri[3 * R + r] + c * dstride) // 4
            for d in range(hd - hd % 16, hd):
                x = np.float32(0.0)
                for j in range(a, b + 1):
                    vo = ad[np.uint64(vb + (j >> 4))] + (j & 15) * vrow
                    x = f32_fma(fl[ri[2 * R + r] // 4 + j], v_el(Vp, vo, d), x)
                if fold:
                    x = f32_fma(fl[ri[4 * R + r] // 4 + c - cbase], x, D[base + d])
                D[base + d] = x


# ----------------------------------------------------------------------------- work items
