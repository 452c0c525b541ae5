"""Weight layouts the matmul kernels read: GGUF blocks repacked at load into 16-row tiles.

Rows are the vector lanes. A tile's row data is cut into 32-element chunks; within a chunk,
lane ``r`` of vector ``j`` (0..7) holds elements ``4j..4j+3`` of row ``r`` as bytes, so one
``vpdpbusd`` against 4 broadcast activation bytes advances 16 rows at once. Each bit width
has a fixed packing of those bytes (see the ``pack_*`` functions); scales are stored per tile
as 16 consecutive values, one per row.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import prange

from localllm.formats import quants

from .jit import njit

ROWS = 16  # rows per tile = int32 lanes of a 512-bit vector

# One namedtuple per weight format; all arrays are flat uint8 byte arrays. Field meanings:
#   qs: low 4 bits (or all 8 / the 2-bit crumbs) per chunk-tile; hb: extra high bits;
#   d, m, dmin: f16 scales per (tile, block) x 16 rows; sc, mn: int8/uint8 sub-block scales
#   per (tile, superblock, sub-block) x 16 rows; lut: a 16-entry byte table repeated 4 times.
PackedQ4_0 = namedtuple("PackedQ4_0", ["qs", "d"])
PackedQ4_1 = namedtuple("PackedQ4_1", ["qs", "d", "m"])
PackedQ5_0 = namedtuple("PackedQ5_0", ["qs", "hb", "d"])
PackedQ5_1 = namedtuple("PackedQ5_1", ["qs", "hb", "d", "m"])
PackedQ8_0 = namedtuple("PackedQ8_0", ["qs", "d"])
PackedIQ4_NL = namedtuple("PackedIQ4_NL", ["qs", "d", "lut"])
PackedQ2_K = namedtuple("PackedQ2_K", ["qs", "sc", "mn", "d", "dmin"])
PackedQ3_K = namedtuple("PackedQ3_K", ["qs", "hb", "sc", "d"])
PackedQ4_K = namedtuple("PackedQ4_K", ["qs", "sc", "mn", "d", "dmin"])
PackedQ5_K = namedtuple("PackedQ5_K", ["qs", "hb", "sc", "mn", "d", "dmin"])
PackedQ6_K = namedtuple("PackedQ6_K", ["qs", "hb", "sc", "d"])
PackedIQ4_XS = namedtuple("PackedIQ4_XS", ["qs", "sc", "d", "lut"])
PackedF32 = namedtuple("PackedF32", ["w"])
PackedF16 = namedtuple("PackedF16", ["w"])
PackedBF16 = namedtuple("PackedBF16", ["w"])

# Formats whose activations are quantized in 256-wide blocks (one scale per superblock).
SUPERBLOCK_FORMATS = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"})
FLOAT_FORMATS = frozenset({"F32", "F16", "BF16"})

# Rows repacked per step, to bound the temporary memory of large matrices.
_ROW_STEP = 4096


@njit(cache=True, parallel=True)
def pack_nibbles(v):
    """Values 0..15, (Np, K) uint8 -> bytes: per chunk-tile [g 0..3][row][i 0..3] holding
    element 4g+i in the low nibble and element 16+4g+i in the high nibble (256 bytes)."""
    n, K = v.shape
    nc = K // 32
    out = np.empty(n // ROWS * nc * 256, np.uint8)
    for tc in prange(n // ROWS * nc):
        row0 = tc // nc * ROWS
        e0 = tc % nc * 32
        for g in range(4):
            for r in range(ROWS):
                o = tc * 256 + g * 64 + r * 4
                for i in range(4):
                    e = e0 + 4 * g + i
                    out[o + i] = (v[row0 + r, e] & 15) | ((v[row0 + r, e + 16] & 15) << 4)
    return out


@njit(cache=True, parallel=True)
def pack_bytes(v):
    """Values 0..255, (Np, K) uint8 -> bytes: per chunk-tile [j 0..7][row][i] = element 4j+i."""
    n, K = v.shape
    nc = K // 32
    out = np.empty(n // ROWS * nc * 512, np.uint8)
    for tc in prange(n // ROWS * nc):
        row0 = tc // nc * ROWS
        e0 = tc % nc * 32
        for j in range(8):
            for r in range(ROWS):
                o = tc * 512 + j * 64 + r * 4
                for i in range(4):
                    out[o + i] = v[row0 + r, e0 + 4 * j + i]
    return out


@njit(cache=True, parallel=True)
def pack_bits(v, shift):
    """Bit ``shift`` of each value, (Np, K) uint8 -> bytes: per chunk-tile [row][i] with bit j
    = element 4j+i (64 bytes)."""
    n, K = v.shape
    nc = K // 32
    out = np.empty(n // ROWS * nc * 64, np.uint8)
    for tc in prange(n // ROWS * nc):
        row0 = tc // nc * ROWS
        e0 = tc % nc * 32
        for r in range(ROWS):
            for i in range(4):
                b = 0
                for j in range(8):
                    b |= ((v[row0 + r, e0 + 4 * j + i] >> shift) & 1) << j
                out[tc * 64 + r * 4 + i] = b
    return out


@njit(cache=True, parallel=True)
def pack_crumbs(v, shift):
    """Two bits (from ``shift``) of each value, (Np, K) uint8 -> bytes: per chunk-tile two words
    [half][row][i] with bits 2j..2j+1 = element 16*half + 4j + i (128 bytes)."""
    n, K = v.shape
    nc = K // 32
    out = np.empty(n // ROWS * nc * 128, np.uint8)
    for tc in prange(n // ROWS * nc):
        row0 = tc // nc * ROWS
        e0 = tc % nc * 32
        for half in range(2):
            for r in range(ROWS):
                for i in range(4):
                    b = 0
                    for j in range(4):
                        b |= ((v[row0 + r, e0 + 16 * half + 4 * j + i] >> shift) & 3) << (2 * j)
                    out[tc * 128 + half * 64 + r * 4 + i] = b
    return out


def pack_row_values(a: np.ndarray, per_row: int) -> np.ndarray:
    """Per-row values (Np, per_row) -> bytes laid out [tile][per_row][row] (16 per group)."""
    n = a.shape[0]
    t = a.reshape(n // ROWS, ROWS, per_row).transpose(0, 2, 1)
    return np.ascontiguousarray(t).view(np.uint8).reshape(-1)


def _lut(table) -> np.ndarray:
    return np.tile(np.asarray(table, np.int16).astype(np.uint8), 4)


_IQ4_LUT = _lut(quants.IQ4NL_VALUES.astype(np.int16) + 128)


def _values_and_scales(name: str, blocks: np.ndarray):
    """Integer values (nb, bs) as stored in the tiles plus per-block scale arrays."""
    q = quants
    if name == "Q4_0":
        return (q.q4_0_quants(blocks) + np.int8(8)).view(np.uint8), {"d": q.half_field(blocks, name, "d")}
    if name == "Q4_1":
        return q.q4_1_quants(blocks), {"d": q.half_field(blocks, name, "d"),
                                       "m": q.half_field(blocks, name, "m")}
    if name == "Q5_0":
        return (q.q5_0_quants(blocks) + np.int8(16)).view(np.uint8), {"d": q.half_field(blocks, name, "d")}
    if name == "Q5_1":
        return q.q5_1_quants(blocks), {"d": q.half_field(blocks, name, "d"),
                                       "m": q.half_field(blocks, name, "m")}
    if name == "Q8_0":
        # int8 q + 128 as a byte is q with its sign bit flipped
        return q.field(blocks, name, "qs") ^ np.uint8(0x80), {"d": q.half_field(blocks, name, "d")}
    if name == "IQ4_NL":
        return q.iq4nl_indices(blocks), {"d": q.half_field(blocks, name, "d")}
    if name == "Q2_K":
        sc, mn = q.q2k_scales_mins(blocks)
        return q.q2k_quants(blocks), {"d": q.half_field(blocks, name, "d"),
                                      "dmin": q.half_field(blocks, name, "dmin"), "sc": sc, "mn": mn}
    if name == "Q3_K":
        return (q.q3k_quants(blocks) + np.int8(4)).view(np.uint8), {"d": q.half_field(blocks, name, "d"),
                                            "sc": q.q3k_scales(blocks)}
    if name in ("Q4_K", "Q5_K"):
        sc, mn = q.kquant_scales_mins(blocks)
        vals = q.q4k_quants(blocks) if name == "Q4_K" else q.q5k_quants(blocks)
        return vals, {"d": q.half_field(blocks, name, "d"), "dmin": q.half_field(blocks, name, "dmin"),
                      "sc": sc, "mn": mn}
    if name == "Q6_K":
        return (q.q6k_quants(blocks) + np.int8(32)).view(np.uint8), {"d": q.half_field(blocks, name, "d"),
                                             "sc": q.q6k_scales(blocks)}
    if name == "IQ4_XS":
        return q.iq4xs_indices(blocks), {"d": q.half_field(blocks, name, "d"),
                                         "sc": q.iq4xs_scales(blocks)}
    raise ValueError(f"no packing for {name}")


def _pack_rows(name: str, rows: np.ndarray, K: int) -> dict[str, np.ndarray]:
    """Pack a slab of whole tiles (rows.shape[0] % 16 == 0) into the format's byte arrays."""
    n = rows.shape[0]
    bs = quants.block_size(name)
    nb = K // bs
    blocks = rows.reshape(n * nb, quants.type_size(name))
    vals, sc = _values_and_scales(name, blocks)
    v = np.ascontiguousarray(vals, dtype=np.uint8).reshape(n, K)
    out: dict[str, np.ndarray] = {}
    if name in ("Q8_0",):
        out["qs"] = pack_bytes(v)
    elif name in ("Q2_K",):
        out["qs"] = pack_crumbs(v, 0)
    elif name in ("Q3_K",):
        out["qs"] = pack_crumbs(v, 0)
        out["hb"] = pack_bits(v, 2)
    elif name in ("Q6_K",):
        out["qs"] = pack_nibbles(v)
        out["hb"] = pack_crumbs(v, 4)
    elif name in ("Q5_0", "Q5_1", "Q5_K"):
        out["qs"] = pack_nibbles(v)
        out["hb"] = pack_bits(v, 4)
    else:  # 4-bit values or table indices
        out["qs"] = pack_nibbles(v)
    for key in ("d", "m", "dmin"):
        if key in sc:
            out[key] = pack_row_values(sc[key].astype(np.float16).reshape(n, nb), nb)
    for key in ("sc", "mn"):
        if key in sc:
            a = sc[key].reshape(n, nb, -1)
            out[key] = pack_row_values(a.reshape(n, -1).astype(np.int8 if a.dtype == np.int8 else np.uint8),
                                       a.shape[1] * a.shape[2])
    return out


_PACKED = {
    "Q4_0": PackedQ4_0, "Q4_1": PackedQ4_1, "Q5_0": PackedQ5_0, "Q5_1": PackedQ5_1,
    "Q8_0": PackedQ8_0, "IQ4_NL": PackedIQ4_NL, "Q2_K": PackedQ2_K, "Q3_K": PackedQ3_K,
    "Q4_K": PackedQ4_K, "Q5_K": PackedQ5_K, "Q6_K": PackedQ6_K, "IQ4_XS": PackedIQ4_XS,
    "F32": PackedF32, "F16": PackedF16, "BF16": PackedBF16,
}


def packed_class(name: str):
    """The namedtuple class holding a packed weight of GGML type ``name``."""
    return _PACKED[name]


def _pack_float(name: str, rows: np.ndarray, K: int) -> np.ndarray:
    """Float rows -> [tile][k][row] elements (the element's own width), as bytes."""
    dt = {"F32": np.uint32, "F16": np.uint16, "BF16": np.uint16}[name]
    a = rows.view(dt).reshape(rows.shape[0], K)
    return pack_row_values(a, K)


def pack_weight(name: str, raw: np.ndarray, N: int, K: int, done=None):
    """Repack a GGUF weight matrix for the kernels.

    Args:
        name: GGML type name (one of ``quants.SUPPORTED_TYPES``).
        raw: the tensor's bytes, uint8, N rows of ``row_nbytes(name, K)`` each.
        N: output rows; K: row length (input features).
        done: optional callback(start, end) told which byte range of ``raw`` has been
            consumed, so a mapped file's pages can be dropped while packing goes on.
    Returns:
        A ``Packed<name>`` namedtuple of flat byte arrays, rows padded to a multiple of 16.
    """
    if name not in _PACKED:
        raise ValueError(f"weight type {name} is not supported by the CPU kernels")
    bs = quants.block_size(name)
    if name in SUPERBLOCK_FORMATS and K % 256:
        raise ValueError(f"{name} rows must be a multiple of 256 elements, got {K}")
    if K % 32 or K % bs:
        raise ValueError(f"rows of {K} elements are not a whole number of 32-wide blocks")
    row_bytes = quants.row_nbytes(name, K)
    rows = np.asarray(raw, np.uint8).reshape(N, row_bytes)
    Np = -(-N // ROWS) * ROWS
    fields: dict[str, np.ndarray] = {}
    for r0 in range(0, Np, _ROW_STEP):
        r1 = min(Np, r0 + _ROW_STEP)
        slab = rows[r0:min(r1, N)]
        if slab.shape[0] < r1 - r0:  # zero rows pad the last tile; their outputs are dropped
            slab = np.concatenate([slab, np.zeros((r1 - r0 - slab.shape[0], row_bytes), np.uint8)])
        if name in FLOAT_FORMATS:
            packed = {"w": _pack_float(name, slab, K)}
        else:
            packed = _pack_rows(name, slab, K)
        # Slabs are whole tiles and the layouts are tile-major: each lands at its byte offset.
        for key, arr in packed.items():
            if key not in fields:
                fields[key] = np.empty(arr.size * Np // (r1 - r0), np.uint8)
            per_row = arr.size // (r1 - r0)
            fields[key][r0 * per_row:r1 * per_row] = arr
        if done is not None:
            done(r0 * row_bytes, min(r1, N) * row_bytes)
    if name in ("IQ4_NL", "IQ4_XS"):
        fields["lut"] = _IQ4_LUT
    return _PACKED[name](**fields)
