"""Per-format pieces of the matmul kernels: unpacking a 32-element chunk-tile into eight
vectors of byte values, and the integer dot product of those against activation bytes.

Each function here is inlined into the kernels; the format is chosen at compile time by the
type of the packed-weight namedtuple (``@overload`` on its class).
"""

from __future__ import annotations

from numba.extending import overload

from . import packing as P
from .dot import dot_intrinsic
from .jit import njit
from .simd import prefetch, vi_and, vi_load, vi_lut16, vi_or, vi_sll, vi_splat, vi_srl

M01 = 0x01010101
M03 = 0x03030303
M0F = 0x0F0F0F0F


@njit(inline="always")
def shift(v, s):
    """Shift int32 lanes left by s (right by -s); s is a compile-time constant in practice."""
    if s >= 0:
        return vi_sll(v, s)
    return vi_srl(v, -s)


@njit(inline="always")
def unpack_nibbles(qs, o):
    """Chunk-tile of 4-bit values at byte ``o`` -> eight vectors (elements 4j..4j+3)."""
    m = vi_splat(M0F)
    w0 = vi_load(qs, o)
    w1 = vi_load(qs, o + 64)
    w2 = vi_load(qs, o + 128)
    w3 = vi_load(qs, o + 192)
    return (vi_and(w0, m), vi_and(w1, m), vi_and(w2, m), vi_and(w3, m),
            vi_and(vi_srl(w0, 4), m), vi_and(vi_srl(w1, 4), m),
            vi_and(vi_srl(w2, 4), m), vi_and(vi_srl(w3, 4), m))


@njit(inline="always")
def unpack_bytes(qs, o):
    """Chunk-tile of 8-bit values at byte ``o`` -> eight vectors."""
    return (vi_load(qs, o), vi_load(qs, o + 64), vi_load(qs, o + 128), vi_load(qs, o + 192),
            vi_load(qs, o + 256), vi_load(qs, o + 320), vi_load(qs, o + 384), vi_load(qs, o + 448))


@njit(inline="always")
def unpack_crumbs(qs, o):
    """Chunk-tile of 2-bit values at byte ``o`` -> eight vectors."""
    m = vi_splat(M03)
    a = vi_load(qs, o)
    b = vi_load(qs, o + 64)
    return (vi_and(a, m), vi_and(vi_srl(a, 2), m), vi_and(vi_srl(a, 4), m), vi_and(vi_srl(a, 6), m),
            vi_and(b, m), vi_and(vi_srl(b, 2), m), vi_and(vi_srl(b, 4), m), vi_and(vi_srl(b, 6), m))


@njit(inline="always")
def add_bit(v, j, h, pos):
    """Or bit j of each byte of ``h`` into bit ``pos`` of vector ``v``."""
    return vi_or(v, vi_and(shift(h, pos - j), vi_splat(M01 << pos)))


@njit(inline="always")
def add_bits(v8, hb, o, pos):
    """Eight vectors plus one high bit each (from a pack_bits word at byte ``o``) at ``pos``."""
    h = vi_load(hb, o)
    return (add_bit(v8[0], 0, h, pos), add_bit(v8[1], 1, h, pos),
            add_bit(v8[2], 2, h, pos), add_bit(v8[3], 3, h, pos),
            add_bit(v8[4], 4, h, pos), add_bit(v8[5], 5, h, pos),
            add_bit(v8[6], 6, h, pos), add_bit(v8[7], 7, h, pos))


@njit(inline="always")
def add_crumbs(v8, hb, o):
    """Eight 4-bit vectors plus two high bits each (pack_crumbs words) -> 6-bit values."""
    c = unpack_crumbs(hb, o)
    return (vi_or(v8[0], vi_sll(c[0], 4)), vi_or(v8[1], vi_sll(c[1], 4)),
            vi_or(v8[2], vi_sll(c[2], 4)), vi_or(v8[3], vi_sll(c[3], 4)),
            vi_or(v8[4], vi_sll(c[4], 4)), vi_or(v8[5], vi_sll(c[5], 4)),
            vi_or(v8[6], vi_sll(c[6], 4)), vi_or(v8[7], vi_sll(c[7], 4)))


@njit(inline="always")
def lookup(v8, lut):
    """Map eight vectors of 4-bit indices through a byte table."""
    t = vi_load(lut, 0)
    return (vi_lut16(t, v8[0]), vi_lut16(t, v8[1]), vi_lut16(t, v8[2]), vi_lut16(t, v8[3]),
            vi_lut16(t, v8[4]), vi_lut16(t, v8[5]), vi_lut16(t, v8[6]), vi_lut16(t, v8[7]))


# The largest byte each format's unpacked chunk holds (values plus the stored offset): it
# bounds how the AVX2 dot products may sum in int16.
MAX_BYTE = {P.PackedQ4_0: 15, P.PackedQ4_1: 15, P.PackedQ4_K: 15, P.PackedQ5_0: 31,
            P.PackedQ5_1: 31, P.PackedQ5_K: 31, P.PackedQ6_K: 63, P.PackedQ2_K: 3,
            P.PackedQ3_K: 7, P.PackedQ8_0: 255, P.PackedIQ4_NL: 255, P.PackedIQ4_XS: 255,
            P.PackedMXFP4: 140}


def dot(w, v, xq, xo, sc, xsum):
    """Per row: sc * (sum over the vectors ``v`` (a tuple) of weight bytes times the int8
    activations from ``xq[xo:]``), exact; ``sc`` a VI of row scales or None; ``xsum`` the
    activation bytes' sum broadcast (read by formats with bytes above 127), or None."""


@overload(dot, inline="always")
def _ol_dot(w, v, xq, xo, sc, xsum):
    f = dot_intrinsic(v.count, MAX_BYTE[w.instance_class])
    return lambda w, v, xq, xo, sc, xsum: f(v, xq, xo, sc, xsum)


def unpack_chunk(w, ct):
    """Eight byte-value vectors of chunk-tile ``ct`` of packed weight ``w``."""


@overload(unpack_chunk, inline="always")
def _ol_unpack_chunk(w, ct):
    cls = getattr(w, "instance_class", None)
    if cls in (P.PackedQ4_0, P.PackedQ4_1, P.PackedQ4_K):
        return lambda w, ct: unpack_nibbles(w.qs, ct * 256)
    if cls in (P.PackedIQ4_NL, P.PackedIQ4_XS, P.PackedMXFP4):
        return lambda w, ct: lookup(unpack_nibbles(w.qs, ct * 256), w.lut)
    if cls in (P.PackedQ5_0, P.PackedQ5_1, P.PackedQ5_K):
        return lambda w, ct: add_bits(unpack_nibbles(w.qs, ct * 256), w.hb, ct * 64, 4)
    if cls is P.PackedQ6_K:
        return lambda w, ct: add_crumbs(unpack_nibbles(w.qs, ct * 256), w.hb, ct * 128)
    if cls is P.PackedQ8_0:
        return lambda w, ct: unpack_bytes(w.qs, ct * 512)
    if cls is P.PackedQ2_K:
        return lambda w, ct: unpack_crumbs(w.qs, ct * 128)
    if cls is P.PackedQ3_K:
        return lambda w, ct: add_bits(unpack_crumbs(w.qs, ct * 128), w.hb, ct * 64, 2)
    return None


def prefetch_chunk(w, ct):
    """Ask for chunk-tile ``ct``'s bytes ahead of use: its quant bytes, its high bits and its
    scales. Each array is a stream of its own; the hardware prefetcher alone leaves a decode
    step (each weight byte read once) well under the memory's streaming rate."""


def _chunk_bytes(cls) -> tuple[int, int, int]:
    """Bytes per chunk-tile of a packed format's qs, hb and sc arrays (packing's layout:
    sc holds 16 rows x a byte per sub-block, 8 chunks to a superblock)."""
    name = cls.__name__[len("Packed"):]
    n_sc = P._N_SC[P._CODE[name]] if name in P._CODE else 0
    return P._QS_BYTES.get(name, 256), P._HB_BYTES.get(name, 0), 2 * n_sc


def _prefetch_hb(w, ct):
    """The high-bit bytes of chunk-tile ``ct`` (formats that have them)."""


@overload(_prefetch_hb, inline="always")
def _ol_prefetch_hb(w, ct):
    lines = _chunk_bytes(w.instance_class)[1] // 64
    if not lines:
        return lambda w, ct: None

    def fetch(w, ct):
        for j in range(lines):
            prefetch(w.hb, (ct * lines + j) * 64)
    return fetch


def _prefetch_scales(w, ct):
    """The scales chunk-tile ``ct`` reads: per chunk for 32-blocks, per sub-block and per
    superblock for the 256-superblock formats."""


@overload(_prefetch_scales, inline="always")
def _ol_prefetch_scales(w, ct):
    cls = w.instance_class
    sc = _chunk_bytes(cls)[2]
    if sc == 0:  # a 32-block format: d (and m) per chunk-tile
        d_bytes = 64 if cls is P.PackedMXFP4 else 32
        if "m" in cls._fields:
            def fetch_dm(w, ct):
                prefetch(w.d, ct * d_bytes)
                prefetch(w.m, ct * 32)
            return fetch_dm
        return lambda w, ct: prefetch(w.d, ct * d_bytes)
    if "mn" in cls._fields:
        def fetch_min(w, ct):
            prefetch(w.sc, ct * sc)
            prefetch(w.mn, ct * sc)
            if ct % 8 == 0:
                prefetch(w.d, (ct // 8) * 32)
                prefetch(w.dmin, (ct // 8) * 32)
        return fetch_min

    def fetch_sc(w, ct):
        prefetch(w.sc, ct * sc)
        if ct % 8 == 0:
            prefetch(w.d, (ct // 8) * 32)
    return fetch_sc


@overload(prefetch_chunk, inline="always")
def _ol_prefetch_chunk(w, ct):
    size = _chunk_bytes(w.instance_class)[0]
    lines = size // 64

    def fetch(w, ct):
        o = ct * size
        for j in range(lines):
            prefetch(w.qs, o + 64 * j)
        _prefetch_hb(w, ct)
        _prefetch_scales(w, ct)
    return fetch
