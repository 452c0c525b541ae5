"""y = x @ W.T straight from repacked GGUF blocks, for one token (decode) or many (prompts).

Every output element is defined as a fixed sequence of float32 operations over the row's
blocks in order (integer block dot products are exact), so any tiling, token count or
thread split gives the same bits: a token's result never depends on its batch.

Per-element recipes (isum: exact int32 dot of stored weight bytes with activation bytes;
dx/xs/sx: activation block scale, integer sum, scaled sum; bsum: 16-wide activation sums):
  Q4_0/Q5_0/Q8_0/IQ4_NL  acc += f32(isum - off*xs) * (d*dx)       off = 8/16/128/128
  MXFP4                  acc += f32(isum - 128*xs) * (d*dx)       d = 2**(e-128), float32
  Q4_1/Q5_1              acc += f32(isum) * (d*dx) + m*sx
  Q4_K/Q5_K/Q2_K         acc += (d*dx)*f32(sum_j sc_j*isum_j) - (dmin*dx)*f32(sum_j mn_j*bsum_j)
  Q6_K/Q3_K/IQ4_XS       acc += (d*dx)*f32(sum_j sc_j*isum_j - off*sum_j sc_j*bsum_j)  off = 32/4/128
  F32/F16/BF16           acc += w_k * x_k for k ascending
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import prange
from numba.extending import overload

from . import packing as P
from .actquant import act_buffers, quantize_q8_32, quantize_q8_256
from .jit import njit
from .simd import (target_features, vf_add, vf_from_vi, vf_load, vf_load_bf16, vf_load_f16,
                   vf_mul, vf_splat, vf_store, vf_sub, vf_zero, vi_add, vi_bcast4, vi_load,
                   vi_load_i8, vi_mul, vi_sll, vi_store, vi_sub, vi_zero)
from .unpack import dot, prefetch_chunk, unpack_chunk
from .vmath import vf_bcast

TOKENS_PER_PASS = 64  # tokens that share one unpacking of a weight chunk
FLOAT_PAIR_MIN_TOKENS = 12  # float weights: tokens from which a tile pair widens its weights
PREFETCH_AHEAD = 16    # chunk-tiles ahead whose bytes are requested early


# ----------------------------------------------------------------------------- 32-wide blocks

@njit
def _unpack_one(w, ct):
    """unpack_chunk as a call of its own (LLVM inlines it): two inline copies in one
    function trip Numba's IR checks on some formats."""
    return unpack_chunk(w, ct)


def block_scales(w, i):
    """(d, m) vectors of block-tile ``i`` (m is zero for formats without a min)."""


@overload(block_scales, inline="always")
def _ol_block_scales(w, i):
    if "m" in getattr(w, "fields", ()):
        return lambda w, i: (vf_load_f16(w.d, i * 32), vf_load_f16(w.m, i * 32))
    if getattr(w, "instance_class", None) is P.PackedMXFP4:
        return lambda w, i: (vf_load(w.d, i * 64), vf_zero())
    return lambda w, i: (vf_load_f16(w.d, i * 32), vf_zero())


def block_term(w, isum, s, dx, xs, sx, o):
    """The float contribution of one 32-wide block to 16 outputs; the activation block's
    scale, integer sum and scaled sum are at byte offset ``o`` of dx, xs, sx."""


@overload(block_term, inline="always")
def _ol_block_term(w, isum, s, dx, xs, sx, o):
    # Scalars are broadcast straight from memory by byte offset: indexing dx[t, b] would
    # make Numba emit negative-index wraparound arithmetic in the innermost loop.
    cls = w.instance_class
    if cls in (P.PackedQ4_1, P.PackedQ5_1):
        def term_min(w, isum, s, dx, xs, sx, o):
            return vf_add(vf_mul(vf_from_vi(isum), vf_mul(s[0], vf_bcast(dx, o))),
                          vf_mul(s[1], vf_bcast(sx, o)))
        return term_min
    shift = {P.PackedQ4_0: 3, P.PackedQ5_0: 4, P.PackedQ8_0: 7, P.PackedIQ4_NL: 7,
             P.PackedMXFP4: 7}[cls]

    def term_offset(w, isum, s, dx, xs, sx, o):  # offset * sum as a shift: exact in int32
        return vf_mul(vf_from_vi(vi_sub(isum, vi_sll(vi_bcast4(xs, o), shift))),
                      vf_mul(s[0], vf_bcast(dx, o)))
    return term_offset


@njit(cache=True)
def _token_blocks32(w, tile, xq, dx, xs, sx, out, col):
    """tile_blocks32 for one token: the same sums in the same order, kept in registers
    (no scratch buffer to fill and read back)."""
    K = xq.shape[1]
    nb = K // 32
    a = vf_zero()
    for b in range(nb):
        i = tile * nb + b
        prefetch_chunk(w, i + PREFETCH_AHEAD)
        isum = dot(w, unpack_chunk(w, i), xq, b * 32, None, vi_bcast4(xs, b * 4))
        a = vf_add(a, block_term(w, isum, block_scales(w, i), dx, xs, sx, b * 4))
    vf_store(out, col * 64, a)


@njit(cache=True)
def tile_blocks32(w, tile, xq, dx, xs, sx, out, col):
    """out[:, 16*col : 16*col+16] = x @ W[tile rows].T for a 32-block format."""
    n, K = xq.shape
    nb = K // 32
    Np = out.shape[1]
    if n == 1:  # a decode step
        _token_blocks32(w, tile, xq, dx, xs, sx, out, col)
        return
    # Sums build up in a small local buffer (L1) rather than in the strided rows of out.
    acc = np.empty((TOKENS_PER_PASS, 16), np.float32)
    for t0 in range(0, n, TOKENS_PER_PASS):
        t1 = min(n, t0 + TOKENS_PER_PASS)
        for t in range(t1 - t0):
            vf_store(acc, t * 64, vf_zero())
        # two blocks (one 64-byte line of each token's activations) per visit to a token,
        # as in tile_superblocks; the sums still add up block by block in order
        for b in range(0, nb - 1, 2):
            i = tile * nb + b
            prefetch_chunk(w, i + PREFETCH_AHEAD)
            prefetch_chunk(w, i + 1 + PREFETCH_AHEAD)
            v0 = _unpack_one(w, i)
            v1 = _unpack_one(w, i + 1)
            s0 = block_scales(w, i)
            s1 = block_scales(w, i + 1)
            for t in range(t0, t1):
                o = (t * nb + b) * 4
                xo = t * K + b * 32
                term0 = block_term(w, dot(w, v0, xq, xo, None, vi_bcast4(xs, o)),
                                   s0, dx, xs, sx, o)
                term1 = block_term(w, dot(w, v1, xq, xo + 32, None, vi_bcast4(xs, o + 4)),
                                   s1, dx, xs, sx, o + 4)
                ao = (t - t0) * 64
                vf_store(acc, ao, vf_add(vf_add(vf_load(acc, ao), term0), term1))
        if nb % 2:
            b = nb - 1
            i = tile * nb + b
            v = _unpack_one(w, i)
            s = block_scales(w, i)
            for t in range(t0, t1):
                o = (t * nb + b) * 4
                isum = dot(w, v, xq, t * K + b * 32, None, vi_bcast4(xs, o))
                ao = (t - t0) * 64
                vf_store(acc, ao, vf_add(vf_load(acc, ao), block_term(w, isum, s, dx, xs,
                                                                      sx, o)))
        for t in range(t0, t1):
            vf_store(out, (t * Np + col * 16) * 4, vf_load(acc, (t - t0) * 64))


# ----------------------------------------------------------------------------- 256-wide superblocks

def chunk_scales(w, scb):
    """The sub-block scale vectors of one chunk-tile (from byte ``scb`` of w.sc): one per
    16-element sub-block."""


@overload(chunk_scales, inline="always")
def _ol_chunk_scales(w, scb):
    if w.instance_class in (P.PackedQ2_K, P.PackedQ3_K, P.PackedQ6_K):
        return lambda w, scb: (vi_load_i8(w.sc, scb), vi_load_i8(w.sc, scb + 16))
    return lambda w, scb: (vi_load_i8(w.sc, scb),)


def chunk_part(w, v, scs, xq, xo, bsum, bo):
    """Scaled integer sum of one 32-element chunk: sum over its sub-blocks of sc * isum (the
    chunk's two 16-wide activation sums at byte ``bo`` of bsum)."""


@overload(chunk_part, inline="always")
def _ol_chunk_part(w, v, scs, xq, xo, bsum, bo):
    if w.instance_class in (P.PackedQ2_K, P.PackedQ3_K, P.PackedQ6_K):
        def part16(w, v, scs, xq, xo, bsum, bo):  # two 16-element sub-blocks per chunk
            return vi_add(dot(w, (v[0], v[1], v[2], v[3]), xq, xo, scs[0], None),
                          dot(w, (v[4], v[5], v[6], v[7]), xq, xo + 16, scs[1], None))
        return part16

    def part32(w, v, scs, xq, xo, bsum, bo):
        xsum = vi_add(vi_bcast4(bsum, bo), vi_bcast4(bsum, bo + 4))
        return dot(w, v, xq, xo, scs[0], xsum)
    return part32


def sub_scale_offset(w):
    """Byte offset step between consecutive chunks' scale vectors (16 rows x sub-blocks/chunk)."""


@overload(sub_scale_offset, inline="always")
def _ol_sub_scale_offset(w):
    step = 32 if w.instance_class in (P.PackedQ2_K, P.PackedQ3_K, P.PackedQ6_K) else 16
    return lambda w: step


def super_term(w, isum, sbi, dx, do, bsum, bo):
    """The float contribution of one superblock-tile to 16 outputs (the activation scale at
    byte ``do`` of dx, its 16-wide sums from byte ``bo`` of bsum)."""


@overload(super_term, inline="always")
def _ol_super_term(w, isum, sbi, dx, do, bsum, bo):
    return lambda w, isum, sbi, dx, do, bsum, bo: super_term_of(
        w, super_consts(w, sbi), isum, dx, do, bsum, bo)


@njit(inline="always")
def _i8_rows8(a, o):
    """Eight 16-lane vectors of int8 (one per sub-block) from byte o of a."""
    return (vi_load_i8(a, o), vi_load_i8(a, o + 16), vi_load_i8(a, o + 32),
            vi_load_i8(a, o + 48), vi_load_i8(a, o + 64), vi_load_i8(a, o + 80),
            vi_load_i8(a, o + 96), vi_load_i8(a, o + 112))


@njit(inline="always")
def _weighted_sums_of(scales, bsum, bo, n_sub):
    """sum over sub-blocks j of scales_j (16 lanes) * the activation sum of sub-block j (the
    superblock's 16-wide sums start at byte ``bo`` of bsum); ``scales``: one tuple of 8
    vectors, or two of 8 for 16 sub-blocks."""
    acc = vi_zero()
    if n_sub == 16:
        for j in range(8):
            acc = vi_add(acc, vi_mul(scales[0][j], vi_bcast4(bsum, bo + 4 * j)))
        for j in range(8):
            acc = vi_add(acc, vi_mul(scales[1][j], vi_bcast4(bsum, bo + 32 + 4 * j)))
    else:
        for j in range(8):
            s32 = vi_add(vi_bcast4(bsum, bo + 8 * j), vi_bcast4(bsum, bo + 8 * j + 4))
            acc = vi_add(acc, vi_mul(scales[0][j], s32))
    return acc


def super_consts(w, sbi):
    """The token-independent vectors of one superblock-tile's super_term (its f16 scales
    and sub-block scales or mins), loaded once for every token of a pass."""


@overload(super_consts, inline="always")
def _ol_super_consts(w, sbi):
    cls = w.instance_class
    if cls in (P.PackedQ2_K, P.PackedQ4_K, P.PackedQ5_K):
        if cls is P.PackedQ2_K:
            return lambda w, sbi: (vf_load_f16(w.d, sbi * 32), vf_load_f16(w.dmin, sbi * 32),
                                   (_i8_rows8(w.mn, sbi * 256),
                                    _i8_rows8(w.mn, sbi * 256 + 128)))
        return lambda w, sbi: (vf_load_f16(w.d, sbi * 32), vf_load_f16(w.dmin, sbi * 32),
                               (_i8_rows8(w.mn, sbi * 128),))
    if cls is P.PackedIQ4_XS:
        return lambda w, sbi: (vf_load_f16(w.d, sbi * 32), vf_load_f16(w.d, sbi * 32),
                               (_i8_rows8(w.sc, sbi * 128),))
    return lambda w, sbi: (vf_load_f16(w.d, sbi * 32), vf_load_f16(w.d, sbi * 32),
                           (_i8_rows8(w.sc, sbi * 256), _i8_rows8(w.sc, sbi * 256 + 128)))


def super_term_of(w, consts, isum, dx, do, bsum, bo):
    """super_term with its token-independent vectors from super_consts (loaded once for a
    prompt pass's tokens)."""


@overload(super_term_of, inline="always")
def _ol_super_term_of(w, consts, isum, dx, do, bsum, bo):
    cls = w.instance_class
    if cls in (P.PackedQ2_K, P.PackedQ4_K, P.PackedQ5_K):
        n_sub = 16 if cls is P.PackedQ2_K else 8

        def term_min(w, consts, isum, dx, do, bsum, bo):
            msum = _weighted_sums_of(consts[2], bsum, bo, n_sub)
            dxv = vf_bcast(dx, do)
            return vf_sub(vf_mul(vf_mul(consts[0], dxv), vf_from_vi(isum)),
                          vf_mul(vf_mul(consts[1], dxv), vf_from_vi(msum)))
        return term_min
    shift = {P.PackedQ6_K: 5, P.PackedQ3_K: 2, P.PackedIQ4_XS: 7}[cls]
    n_sub = 8 if cls is P.PackedIQ4_XS else 16

    def term_offset(w, consts, isum, dx, do, bsum, bo):
        osum = _weighted_sums_of(consts[2], bsum, bo, n_sub)
        total = vi_sub(isum, vi_sll(osum, shift))
        return vf_mul(vf_mul(consts[0], vf_bcast(dx, do)), vf_from_vi(total))
    return term_offset


@njit(cache=True)
def _token_superblocks(w, tile, xq, dx, bsum, out, col):
    """tile_superblocks for one token: the same sums in the same order, kept in registers."""
    K = xq.shape[1]
    nsb = K // 256
    step = sub_scale_offset(w)
    a = vf_zero()
    for sb in range(nsb):
        sbi = tile * nsb + sb
        isum = vi_zero()
        for c in range(8):
            prefetch_chunk(w, sbi * 8 + c + PREFETCH_AHEAD)
            part = chunk_part(w, unpack_chunk(w, sbi * 8 + c),
                              chunk_scales(w, sbi * 8 * step + c * step), xq,
                              sb * 256 + c * 32, bsum, (sb * 16 + 2 * c) * 4)
            isum = vi_add(isum, part)
        a = vf_add(a, super_term(w, isum, sbi, dx, sb * 4, bsum, sb * 64))
    vf_store(out, col * 64, a)


@njit(cache=True)
def tile_superblocks(w, tile, xq, dx, bsum, out, col):
    """out[:, 16*col : 16*col+16] = x @ W[tile rows].T for a 256-superblock format."""
    n, K = xq.shape
    nsb = K // 256
    Np = out.shape[1]
    step = sub_scale_offset(w)
    if n == 1:  # a decode step
        _token_superblocks(w, tile, xq, dx, bsum, out, col)
        return
    iacc = np.empty((TOKENS_PER_PASS, 16), np.int32)
    acc = np.empty((TOKENS_PER_PASS, 16), np.float32)
    for t0 in range(0, n, TOKENS_PER_PASS):
        t1 = min(n, t0 + TOKENS_PER_PASS)
        for t in range(t1 - t0):
            vf_store(acc, t * 64, vf_zero())
        for sb in range(nsb):
            sbi = tile * nsb + sb
            # two chunks (one 64-byte line of each token's activations) per visit to a
            # token: a line is used once, so the tokens' lines, K bytes apart and hence in
            # the same few L1 sets, need not survive a sweep over the pass
            for c in range(0, 8, 2):
                ct = sbi * 8 + c
                prefetch_chunk(w, ct + PREFETCH_AHEAD)
                prefetch_chunk(w, ct + 1 + PREFETCH_AHEAD)
                v0 = _unpack_one(w, ct)
                v1 = _unpack_one(w, ct + 1)
                s0 = chunk_scales(w, sbi * 8 * step + c * step)
                s1 = chunk_scales(w, sbi * 8 * step + (c + 1) * step)
                for t in range(t0, t1):
                    xo = t * K + sb * 256 + c * 32
                    bo = (t * (K // 16) + sb * 16 + 2 * c) * 4
                    part = vi_add(chunk_part(w, v0, s0, xq, xo, bsum, bo),
                                  chunk_part(w, v1, s1, xq, xo + 32, bsum, bo + 8))
                    io = (t - t0) * 64
                    if c == 0:
                        vi_store(iacc, io, part)
                    else:
                        vi_store(iacc, io, vi_add(vi_load(iacc, io), part))
            consts = super_consts(w, sbi)
            for t in range(t0, t1):
                term = super_term_of(w, consts, vi_load(iacc, (t - t0) * 64),
                                     dx, (t * nsb + sb) * 4, bsum, (t * (K // 16) + sb * 16) * 4)
                ao = (t - t0) * 64
                vf_store(acc, ao, vf_add(vf_load(acc, ao), term))
        for t in range(t0, t1):
            vf_store(out, (t * Np + col * 16) * 4, vf_load(acc, (t - t0) * 64))


# ----------------------------------------------------------------------------- float weights

def load_row_values(w, o):
    """16 weights (one per row) at element offset ``o`` as float32."""


@overload(load_row_values, inline="always")
def _ol_load_row_values(w, o):
    cls = w.instance_class
    if cls is P.PackedF32:
        return lambda w, o: vf_load(w.w, o * 4)
    if cls is P.PackedF16:
        return lambda w, o: vf_load_f16(w.w, o * 2)
    return lambda w, o: vf_load_bf16(w.w, o * 2)


@njit(cache=True)
def tile_float(w, tile, x, out):
    """out[:, 16*tile : 16*tile+16] = x @ W[tile rows].T for float weights (k ascending)."""
    n, K = x.shape
    Np = out.shape[1]
    base = tile * K * 16
    t = 0
    while t + 4 <= n:  # four tokens share each weight load
        a0 = vf_zero()
        a1 = vf_zero()
        a2 = vf_zero()
        a3 = vf_zero()
        for k in range(K):
            wv = load_row_values(w, base + k * 16)
            a0 = vf_add(a0, vf_mul(wv, vf_splat(x[t, k])))
            a1 = vf_add(a1, vf_mul(wv, vf_splat(x[t + 1, k])))
            a2 = vf_add(a2, vf_mul(wv, vf_splat(x[t + 2, k])))
            a3 = vf_add(a3, vf_mul(wv, vf_splat(x[t + 3, k])))
        vf_store(out, (t * Np + tile * 16) * 4, a0)
        vf_store(out, ((t + 1) * Np + tile * 16) * 4, a1)
        vf_store(out, ((t + 2) * Np + tile * 16) * 4, a2)
        vf_store(out, ((t + 3) * Np + tile * 16) * 4, a3)
        t += 4
    while t < n:
        a0 = vf_zero()
        for k in range(K):
            a0 = vf_add(a0, vf_mul(load_row_values(w, base + k * 16), vf_splat(x[t, k])))
        vf_store(out, (t * Np + tile * 16) * 4, a0)
        t += 1


def pair_rows_f32(w, tile, K):
    """(PackedF32, element offset) holding tiles ``tile`` and ``tile + 1`` of a float weight
    as float32: F32 weights as they are, F16/BF16 widened (exactly) once into a scratch
    buffer, so the token loop reads them with plain loads instead of converting per token."""


@overload(pair_rows_f32, inline="always")
def _ol_pair_rows_f32(w, tile, K):
    if w.instance_class is P.PackedF32:
        return lambda w, tile, K: (w, tile * K * 16)

    def widen(w, tile, K):
        buf = np.empty(K * 128, np.uint8)  # 32 rows x K float32
        base = tile * K * 16
        for i in range(2 * K):
            vf_store(buf, i * 64, load_row_values(w, base + i * 16))
        return P.PackedF32(buf), 0
    return widen


@njit(inline="always")
def _pair_block6(w, b0, x, t, K, out, ob, Np):
    """Tiles at element offsets b0 and b0 + 16K (two 16-row tiles) times tokens t..t+5 into
    out from byte ``ob`` (token t, the first tile's columns): each of the 12 accumulators
    is the same mul-then-add chain over k as tile_float's, so the bits match it."""
    b1 = b0 + K * 16
    a0, a1, a2, a3, a4, a5 = vf_zero(), vf_zero(), vf_zero(), vf_zero(), vf_zero(), vf_zero()
    c0, c1, c2, c3, c4, c5 = vf_zero(), vf_zero(), vf_zero(), vf_zero(), vf_zero(), vf_zero()
    xr = K * 4  # bytes from one token's row of x to the next
    for k in range(K):
        w0 = load_row_values(w, b0 + k * 16)
        w1 = load_row_values(w, b1 + k * 16)
        o = t * xr + k * 4
        s = vf_bcast(x, o)
        a0 = vf_add(a0, vf_mul(w0, s))
        c0 = vf_add(c0, vf_mul(w1, s))
        s = vf_bcast(x, o + xr)
        a1 = vf_add(a1, vf_mul(w0, s))
        c1 = vf_add(c1, vf_mul(w1, s))
        s = vf_bcast(x, o + 2 * xr)
        a2 = vf_add(a2, vf_mul(w0, s))
        c2 = vf_add(c2, vf_mul(w1, s))
        s = vf_bcast(x, o + 3 * xr)
        a3 = vf_add(a3, vf_mul(w0, s))
        c3 = vf_add(c3, vf_mul(w1, s))
        s = vf_bcast(x, o + 4 * xr)
        a4 = vf_add(a4, vf_mul(w0, s))
        c4 = vf_add(c4, vf_mul(w1, s))
        s = vf_bcast(x, o + 5 * xr)
        a5 = vf_add(a5, vf_mul(w0, s))
        c5 = vf_add(c5, vf_mul(w1, s))
    r = Np * 4  # bytes from one token's row of out to the next
    vf_store(out, ob, a0)
    vf_store(out, ob + r, a1)
    vf_store(out, ob + 2 * r, a2)
    vf_store(out, ob + 3 * r, a3)
    vf_store(out, ob + 4 * r, a4)
    vf_store(out, ob + 5 * r, a5)
    vf_store(out, ob + 64, c0)
    vf_store(out, ob + r + 64, c1)
    vf_store(out, ob + 2 * r + 64, c2)
    vf_store(out, ob + 3 * r + 64, c3)
    vf_store(out, ob + 4 * r + 64, c4)
    vf_store(out, ob + 5 * r + 64, c5)


@njit(cache=True)
def tile_pair_float(w, tile, x, out):
    """Tiles ``tile`` and ``tile + 1`` of float weights, six tokens at a time: each weight
    vector is loaded once per six tokens and each activation broadcast once per two tiles.
    Every output element is the same sequence of operations as in tile_float."""
    n, K = x.shape
    if n < FLOAT_PAIR_MIN_TOKENS:  # too few tokens to repay widening the weights
        tile_float(w, tile, x, out)
        tile_float(w, tile + 1, x, out)
        return
    Np = out.shape[1]
    wf, b0 = pair_rows_f32(w, tile, K)
    t = 0
    while t + 6 <= n:
        _pair_block6(wf, b0, x, t, K, out, (t * Np + tile * 16) * 4, Np)
        t += 6
    while t < n:
        for r in range(2):
            a0 = vf_zero()
            for k in range(K):
                a0 = vf_add(a0, vf_mul(load_row_values(wf, b0 + (r * K + k) * 16),
                                       vf_bcast(x, (t * K + k) * 4)))
            vf_store(out, (t * Np + (tile + r) * 16) * 4, a0)
        t += 1


# ----------------------------------------------------------------------------- any format

def matmul_tile(w, tile, a32, a256, x, out):
    """One 16-row tile of out = x @ W.T, whatever W's format (chosen at compile time).

    a32 = (xq, dx, xs, sx) and a256 = (xq, dx, bsum) are the quantized activations (only
    the one the format reads needs real contents); x is the float input.
    """


@overload(matmul_tile, inline="always")
def _ol_matmul_tile(w, tile, a32, a256, x, out):
    # The tile index is passed on as int64 whatever its type here (prange makes it uint64):
    # one compiled tile kernel per format rather than one per index type.
    cls = w.instance_class
    if cls in (P.PackedF32, P.PackedF16, P.PackedBF16):
        return lambda w, tile, a32, a256, x, out: tile_float(w, np.int64(tile), x, out)
    if cls.__name__[6:] in P.SUPERBLOCK_FORMATS:
        return lambda w, tile, a32, a256, x, out: tile_superblocks(
            w, np.int64(tile), a256[0], a256[1], a256[2], out, np.int64(tile))
    return lambda w, tile, a32, a256, x, out: tile_blocks32(
        w, np.int64(tile), a32[0], a32[1], a32[2], a32[3], out, np.int64(tile))


def matmul_tile_at(w, tile, col, a32, a256, x, out):
    """matmul_tile of a quantized weight, its 16 outputs written at columns 16*col.. of out
    (a tile of a larger packed array, such as a pool of experts, into an output of its own)."""


@overload(matmul_tile_at, inline="always")
def _ol_matmul_tile_at(w, tile, col, a32, a256, x, out):
    if w.instance_class.__name__[6:] in P.SUPERBLOCK_FORMATS:
        return lambda w, tile, col, a32, a256, x, out: tile_superblocks(
            w, np.int64(tile), a256[0], a256[1], a256[2], out, np.int64(col))
    return lambda w, tile, col, a32, a256, x, out: tile_blocks32(
        w, np.int64(tile), a32[0], a32[1], a32[2], a32[3], out, np.int64(col))


def _pairs_float(w) -> bool:
    """Whether float weights go two tiles at a time: tile_pair_float's 12 accumulators and
    its weight vectors need AVX-512's 32 vector registers (on AVX2 they spill)."""
    return (w.instance_class in (P.PackedF32, P.PackedF16, P.PackedBF16)
            and "avx512f" in target_features())


def matmul_units(w, n_tiles):
    """Work items of one matmul: pairs of tiles for float weights on AVX-512, single tiles
    otherwise."""


@overload(matmul_units, inline="always")
def _ol_matmul_units(w, n_tiles):
    if _pairs_float(w):
        return lambda w, n_tiles: (n_tiles + 1) // 2
    return lambda w, n_tiles: n_tiles


def matmul_unit(w, u, n_tiles, a32, a256, x, out):
    """Work item ``u`` of matmul_units: the same results as matmul_tile over its tiles."""


@overload(matmul_unit, inline="always")
def _ol_matmul_unit(w, u, n_tiles, a32, a256, x, out):
    if _pairs_float(w):
        def pair(w, u, n_tiles, a32, a256, x, out):
            if 2 * u + 1 < n_tiles:
                tile_pair_float(w, np.int64(2 * u), x, out)
            else:
                tile_float(w, np.int64(2 * u), x, out)
        return pair
    return lambda w, u, n_tiles, a32, a256, x, out: matmul_tile(w, u, a32, a256, x, out)


@njit(parallel=True, cache=True, nogil=True)
def matmul_kernel(w, a32, a256, x, out):
    """out = x @ W.T over all tiles in parallel (out: float32 (n, padded rows))."""
    n_tiles = out.shape[1] // 16
    for u in prange(matmul_units(w, n_tiles)):
        matmul_unit(w, u, n_tiles, a32, a256, x, out)


# ----------------------------------------------------------------------------- Python API

# Stand-ins for an activation form a weight does not read (typed like the real ones).
_NO_Q32 = (np.zeros((0, 0), np.int8), np.zeros((0, 0), np.float32), np.zeros((0, 0), np.int32),
           np.zeros((0, 0), np.float32))
_NO_Q256 = (np.zeros((0, 0), np.int8), np.zeros((0, 0), np.float32), np.zeros((0, 0), np.int32))


@dataclass(frozen=True)
class QuantActivations:
    """Activations quantized once and shared by every matmul that reads them."""
    x: np.ndarray            # float32 (n, K), kept for float weights
    q32: tuple | None        # (xq, dx, xs, sx) for 32-block formats
    q256: tuple | None       # (xq, dx, bsum) for superblock formats


@dataclass(frozen=True)
class Weight:
    """A repacked weight matrix W of shape (N, K)."""
    type_name: str
    N: int
    K: int
    packed: tuple

    @property
    def padded_rows(self) -> int:
        return -(-self.N // P.ROWS) * P.ROWS

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.packed)

    @property
    def file_nbytes(self) -> int:
        return 0  # a copy: nothing is read from the file in place


def pack(type_name: str, raw: np.ndarray, N: int, K: int, done=None) -> Weight:
    """Repack GGUF tensor bytes (N rows of K elements) for the kernels.

    Args:
        type_name: GGML type name.
        raw: uint8 bytes of the tensor.
        N, K: rows and row length.
        done: optional callback(start, end) for byte ranges of raw already consumed.
    Returns:
        A Weight.
    """
    return Weight(type_name, N, K, P.pack_weight(type_name, raw, N, K, done))


def quantize(x: np.ndarray, need32: bool = True, need256: bool = False) -> QuantActivations:
    """Quantize activations for the weight families that will read them.

    Args:
        x: float32 (n, K).
        need32: produce 32-wide blocks (for Q4_0..Q8_0, IQ4_NL, MXFP4).
        need256: produce 256-wide blocks (for K-quants, IQ4_XS); K must be a multiple of 256.
    Returns:
        QuantActivations.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, K = x.shape
    a32, a256 = act_buffers(n, K, bool(need32), bool(need256))
    if need32:
        quantize_q8_32(x, *a32)
    if need256:
        quantize_q8_256(x, *a256)
    return QuantActivations(x, a32 if need32 else None, a256 if need256 else None)


def needs(weight: Weight) -> str:
    """Which activation form a weight reads: 'float', 'q32' or 'q256'."""
    if weight.type_name in P.FLOAT_FORMATS:
        return "float"
    return "q256" if weight.type_name in P.SUPERBLOCK_FORMATS else "q32"


def matmul_into(weight: Weight, act: QuantActivations, out: np.ndarray) -> None:
    """out[:, :] = act.x @ W.T with ``out`` float32 (n, padded_rows), C-contiguous.

    Raises:
        ValueError: mismatched shapes, or activations lacking the form the weight reads.
    """
    n, K = act.x.shape
    if K != weight.K:
        raise ValueError(f"matmul: x has {K} features, weight expects {weight.K}")
    if (out.dtype != np.float32 or out.shape != (n, weight.padded_rows)
            or not out.flags.c_contiguous):
        raise ValueError(f"matmul: out must be C-contiguous float32 {(n, weight.padded_rows)}")
    kind = needs(weight)
    if kind != "float" and getattr(act, kind) is None:
        raise ValueError(f"matmul: {weight.type_name} reads {kind} activations, which were not made")
    matmul_kernel(weight.packed, act.q32 or _NO_Q32, act.q256 or _NO_Q256, act.x, out)


def matmul(weight: Weight, x: np.ndarray | QuantActivations) -> np.ndarray:
    """y = x @ W.T.

    Args:
        weight: a packed Weight (N, K).
        x: float32 (n, K) or activations already quantized for this weight.
    Returns:
        float32 (n, N).
    """
    if not isinstance(x, QuantActivations):
        kind = needs(weight)
        x = quantize(x, need32=(kind == "q32"), need256=(kind == "q256"))
    n = x.x.shape[0]
    out = np.empty((n, weight.padded_rows), np.float32)
    matmul_into(weight, x, out)
    return out if weight.padded_rows == weight.N else np.ascontiguousarray(out[:, :weight.N])
