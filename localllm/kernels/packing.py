"""Weight layouts the matmul kernels read: GGUF blocks repacked at load into 16-row tiles.

Rows are the vector lanes. A tile's row data is cut into 32-element chunks; within a chunk,
lane ``r`` of vector ``j`` (0..7) holds elements ``4j..4j+3`` of row ``r`` as bytes, so one
``vpdpbusd`` against 4 broadcast activation bytes advances 16 rows at once. Each bit width
has a fixed packing of those bytes (see ``_repack_quants``); scales are stored per tile
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
#   MXFP4's d holds float32 scales 2**(e - 128) (beyond f16's range) per (tile, block) x 16 rows.
PackedQ4_0 = namedtuple("PackedQ4_0", ["qs", "d"])
PackedQ4_1 = namedtuple("PackedQ4_1", ["qs", "d", "m"])
PackedQ5_0 = namedtuple("PackedQ5_0", ["qs", "hb", "d"])
PackedQ5_1 = namedtuple("PackedQ5_1", ["qs", "hb", "d", "m"])
PackedQ8_0 = namedtuple("PackedQ8_0", ["qs", "d"])
PackedIQ4_NL = namedtuple("PackedIQ4_NL", ["qs", "d", "lut"])
PackedMXFP4 = namedtuple("PackedMXFP4", ["qs", "d", "lut"])  # d: float32 scales, not f16
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


# Format codes of the repack kernels. The 32-wide formats come first (one block per chunk).
_CODE = {"Q4_0": 0, "Q4_1": 1, "Q5_0": 2, "Q5_1": 3, "Q8_0": 4, "IQ4_NL": 5, "MXFP4": 6,
         "Q2_K": 7, "Q3_K": 8, "Q4_K": 9, "Q5_K": 10, "Q6_K": 11, "IQ4_XS": 12}
(_Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q8_0, _IQ4_NL, _MXFP4,
 _Q2_K, _Q3_K, _Q4_K, _Q5_K, _Q6_K, _IQ4_XS) = range(13)
_LAST32 = _MXFP4  # codes up to this one are the 32-wide formats
# Per code: block bytes; byte offset of d, of m / dmin (-1: none); sub-block scales per block.
# (MXFP4's E8M0 byte at offset 0 becomes a float32 scale in numpy: see _pack_slab.)
_TYPE_SIZE = (18, 20, 22, 24, 34, 18, 17, 84, 110, 144, 176, 210, 136)
_D_OFF = (0, 0, 0, 0, 0, 0, 0, 80, 108, 0, 0, 208, 0)
_M_OFF = (-1, 2, -1, 2, -1, -1, -1, 82, -1, 2, 2, -1, -1)
_QS_OFF = (2, 4, 6, 8, 2, 2, 1) + (0,) * 6  # qs (nibbles) offset in the 32-wide formats
_N_SC = (0, 0, 0, 0, 0, 0, 0, 16, 16, 8, 8, 16, 8)
_HAS_MN = (False,) * 7 + (True, False, True, True, False, False)


M01 = 0x01010101
M03 = 0x03030303
M0F = 0x0F0F0F0F


@njit(inline="always")
def _ld32(row, o):
    """The little-endian 32-bit word at byte ``o`` (any alignment)."""
    return (np.int64(row[o]) | (np.int64(row[o + 1]) << 8) | (np.int64(row[o + 2]) << 16)
            | (np.int64(row[o + 3]) << 24))


@njit(inline="always")
def _spread4(b):
    """Bits 0..3 of ``b`` -> bit 0 of bytes 0..3 (no two partial products overlap)."""
    return (b * 0x00204081) & M01


@njit(inline="always")
def _chunk_words(code, row, c, v):
    """Chunk ``c`` (32 elements) of a raw GGUF row as 8 words, byte i of ``v[j]`` holding
    element 4j+i as the tiles store it (the reference unpackers' quants made unsigned)."""
    if code <= _LAST32:
        o = c * _TYPE_SIZE[code]
        if code == _Q8_0:
            for j in range(8):
                v[j] = _ld32(row, o + 2 + 4 * j) ^ 0x80808080
            return
        q = o + _QS_OFF[code]
        for j in range(4):  # low nibbles: elements 0..15, high nibbles: 16..31
            w = _ld32(row, q + 4 * j)
            v[j] = w & M0F
            v[j + 4] = (w >> 4) & M0F
        if code == _Q5_0 or code == _Q5_1:  # fifth bit of element e: bit e of qh (4 bytes)
            for j in range(8):
                v[j] |= _spread4((np.int64(row[q - 4 + j // 2]) >> (4 * (j % 2))) & 15) << 4
        return
    o = c // 8 * _TYPE_SIZE[code]
    s = c % 8  # 32-element group within the 256-element superblock
    if code == _Q2_K or code == _Q3_K:
        q = o + (16 if code == _Q2_K else 32) + s // 4 * 32
        for j in range(8):
            v[j] = (_ld32(row, q + 4 * j) >> (2 * (s % 4))) & M03
        if code == _Q3_K:  # hmask bit s of byte l is element 32s + l's bit 2
            for j in range(8):
                v[j] |= ((_ld32(row, o + 4 * j) >> s) & M01) << 2
    elif code == _Q4_K or code == _Q5_K:
        q = o + (16 if code == _Q4_K else 48) + s // 2 * 32
        for j in range(8):
            v[j] = (_ld32(row, q + 4 * j) >> (4 * (s % 2))) & M0F
        if code == _Q5_K:
            for j in range(8):
                v[j] |= ((_ld32(row, o + 16 + 4 * j) >> s) & M01) << 4
    elif code == _Q6_K:
        q = o + s // 4 * 64 + (s % 2) * 32
        qh = o + 128 + s // 4 * 32
        for j in range(8):
            v[j] = (((_ld32(row, q + 4 * j) >> (4 * ((s % 4) // 2))) & M0F)
                    | (((_ld32(row, qh + 4 * j) >> (2 * (s % 4))) & M03) << 4))
    else:  # IQ4_XS: one 16-byte group per 32-element sub-block, like Q4_0's
        q = o + 8 + 16 * s
        for j in range(4):
            w = _ld32(row, q + 4 * j)
            v[j] = w & M0F
            v[j + 4] = (w >> 4) & M0F


@njit(inline="always")
def _store_bits(v, shift, out, o):
    """One row's pack_bits word: bit j of byte i = bit ``shift`` of element 4j+i."""
    w = 0
    for j in range(8):
        w |= ((v[j] >> shift) & M01) << j
    out[o] = w


@njit(inline="always")
def _store_crumbs(v, shift, out, o):
    """One row's two crumb words (16 words apart): bits 2j of byte i of word ``half`` = two
    bits (from ``shift``) of element 16*half + 4j + i."""
    for half in range(2):
        w = 0
        for j in range(4):
            w |= ((v[4 * half + j] >> shift) & M03) << (2 * j)
        out[o + 16 * half] = w


@njit(inline="always")
def repack_tile_quants(code, rows, r0, K, tile, qs, hb, v):
    """Values of raw rows r0..r0+15 -> the qs (and hb) uint32 words of tile ``tile``
    (``v``: int64 scratch of 8)."""
    nc = K // 32
    for c in range(nc):
        tc = tile * nc + c
        for r in range(ROWS):
            _chunk_words(code, rows[r0 + r], c, v)
            if code == _Q8_0:
                for j in range(8):
                    qs[tc * 128 + j * 16 + r] = v[j]
            elif code == _Q2_K or code == _Q3_K:
                _store_crumbs(v, 0, qs, tc * 32 + r)
                if code == _Q3_K:
                    _store_bits(v, 2, hb, tc * 16 + r)
            else:
                for g in range(4):
                    qs[tc * 64 + g * 16 + r] = (v[g] & M0F) | ((v[g + 4] & M0F) << 4)
                if code == _Q6_K:
                    _store_crumbs(v, 4, hb, tc * 32 + r)
                elif code == _Q5_0 or code == _Q5_1 or code == _Q5_K:
                    _store_bits(v, 4, hb, tc * 16 + r)


@njit(cache=True, parallel=True)
def _repack_quants(code, rows, K, t0, qs, hb):
    """Values of whole tiles of raw rows -> the qs (and hb) uint32 words of tiles t0.. ."""
    for t in prange(rows.shape[0] // ROWS):
        v = np.empty(8, np.int64)
        repack_tile_quants(code, rows, t * ROWS, K, t0 + t, qs, hb, v)


@njit(inline="always")
def _sub_scales(code, row, o, j):
    """Sub-block ``j``'s scale and min bytes (int8 scales as their bytes) of the block at ``o``."""
    if code == _Q2_K:
        b = np.int64(row[o + j])
        return b & 15, b >> 4
    if code == _Q3_K:
        s = o + 96
        low = np.int64(row[s + j % 8]) >> (4 * (j // 8)) & 15
        high = (np.int64(row[s + 8 + j % 4]) >> (2 * (j // 4))) & 3
        return ((low | (high << 4)) - 32) & 255, np.int64(0)
    if code == _Q4_K or code == _Q5_K:
        s = o + 4
        if j < 4:
            return np.int64(row[s + j]) & 63, np.int64(row[s + 4 + j]) & 63
        p = np.int64(row[s + 4 + j])
        return ((p & 15) | ((np.int64(row[s + j - 4]) >> 6) << 4),
                (p >> 4) | ((np.int64(row[s + j]) >> 6) << 4))
    if code == _Q6_K:
        return np.int64(row[o + 192 + j]), np.int64(0)
    # IQ4_XS
    low = (np.int64(row[o + 4 + j // 2]) >> (4 * (j % 2))) & 15
    high = ((np.int64(row[o + 2]) | (np.int64(row[o + 3]) << 8)) >> (2 * j)) & 3
    return ((low | (high << 4)) - 32) & 255, np.int64(0)


@njit(inline="always")
def repack_tile_scales(code, rows, r0, K, tile, d, m, sc, mn):
    """Per-block f16 scales (copied bit for bit) and sub-block scales of raw rows
    r0..r0+15 -> the [tile][block][sub-block][row] arrays of tile ``tile``."""
    ts = _TYPE_SIZE[code]
    nb = K // 32 if code <= _LAST32 else K // 256
    do, mo, ns = _D_OFF[code], _M_OFF[code], _N_SC[code]
    for b in range(nb):
        ob = (tile * nb + b) * ROWS
        for r in range(ROWS):
            row = rows[r0 + r]
            o = b * ts
            d[(ob + r) * 2] = row[o + do]
            d[(ob + r) * 2 + 1] = row[o + do + 1]
            if mo >= 0:
                m[(ob + r) * 2] = row[o + mo]
                m[(ob + r) * 2 + 1] = row[o + mo + 1]
            for j in range(ns):
                a, z = _sub_scales(code, row, o, j)
                sc[(ob * ns) + j * ROWS + r] = a
                if _HAS_MN[code]:
                    mn[(ob * ns) + j * ROWS + r] = z


@njit(cache=True, parallel=True)
def _repack_scales(code, rows, K, t0, d, m, sc, mn):
    """Per-block f16 scales (copied bit for bit) and sub-block scales of whole tiles of raw
    rows -> the [tile][block][sub-block][row] arrays of tiles t0.. ."""
    for t in prange(rows.shape[0] // ROWS):
        repack_tile_scales(code, rows, t * ROWS, K, t0 + t, d, m, sc, mn)


def _lut(table) -> np.ndarray:
    return np.tile(np.asarray(table, np.int16).astype(np.uint8), 4)


_IQ4_LUT = _lut(quants.IQ4NL_VALUES.astype(np.int16) + 128)
_MXFP4_LUT = _lut(quants.MXFP4_VALUES.astype(np.int16) + 128)

# Bytes per tile-chunk of each format's qs / hb words.
_QS_BYTES = {"Q8_0": 512, "Q2_K": 128, "Q3_K": 128}
_HB_BYTES = {"Q3_K": 64, "Q5_0": 64, "Q5_1": 64, "Q5_K": 64, "Q6_K": 128}
_EMPTY = np.empty(0, np.uint8)


def _alloc(name: str, Np: int, K: int) -> dict[str, np.ndarray]:
    """The empty field arrays of an (Np, K) weight."""
    tiles, nc = Np // ROWS, K // 32
    if name in FLOAT_FORMATS:
        return {"w": np.empty(Np * K * (4 if name == "F32" else 2), np.uint8)}
    nb = K // quants.block_size(name)
    fields = {"qs": np.empty(tiles * nc * _QS_BYTES.get(name, 256), np.uint8)}
    if name in _HB_BYTES:
        fields["hb"] = np.empty(tiles * nc * _HB_BYTES[name], np.uint8)
    code = _CODE[name]
    if _N_SC[code]:
        fields["sc"] = np.empty(Np * nb * _N_SC[code], np.uint8)
        if _HAS_MN[code]:
            fields["mn"] = np.empty(Np * nb * _N_SC[code], np.uint8)
    fields["d"] = np.empty(Np * nb * (4 if name == "MXFP4" else 2), np.uint8)
    if _M_OFF[code] >= 0:
        fields["dmin" if name in SUPERBLOCK_FORMATS else "m"] = np.empty(Np * nb * 2, np.uint8)
    return fields


def _pack_slab(name: str, slab: np.ndarray, K: int, t0: int, fields: dict) -> None:
    """Pack a slab of whole tiles (rows.shape[0] % 16 == 0) into ``fields`` from tile t0."""
    if name in FLOAT_FORMATS:
        # a plain transpose runs at memory speed already; no kernel to compile
        dt = np.uint32 if name == "F32" else np.uint16
        n = slab.shape[0]
        out = fields["w"].view(dt).reshape(-1, K, ROWS)   # [tile][k][row]
        out[t0:t0 + n // ROWS] = slab.view(dt).reshape(n // ROWS, ROWS, K).transpose(0, 2, 1)
        return
    code = _CODE[name]
    _repack_quants(code, slab, K, t0, fields["qs"].view(np.uint32),
                   fields.get("hb", _EMPTY).view(np.uint32))
    if name == "MXFP4":  # E8M0 bytes -> float32 scales, [tile][block][row]
        n, nb = slab.shape[0], K // 32
        e = slab.reshape(n // ROWS, ROWS, nb, _TYPE_SIZE[code])[:, :, :, 0].transpose(0, 2, 1)
        fields["d"].view(np.float32).reshape(-1, nb, ROWS)[t0:t0 + n // ROWS] = quants.e8m0_half(e)
        return
    m = fields.get("m", fields.get("dmin", _EMPTY))
    _repack_scales(code, slab, K, t0, fields["d"], m, fields.get("sc", _EMPTY),
                   fields.get("mn", _EMPTY))


_PACKED = {
    "Q4_0": PackedQ4_0, "Q4_1": PackedQ4_1, "Q5_0": PackedQ5_0, "Q5_1": PackedQ5_1,
    "Q8_0": PackedQ8_0, "IQ4_NL": PackedIQ4_NL, "MXFP4": PackedMXFP4, "Q2_K": PackedQ2_K,
    "Q3_K": PackedQ3_K,
    "Q4_K": PackedQ4_K, "Q5_K": PackedQ5_K, "Q6_K": PackedQ6_K, "IQ4_XS": PackedIQ4_XS,
    "F32": PackedF32, "F16": PackedF16, "BF16": PackedBF16,
}


def packed_class(name: str):
    """The namedtuple class holding a packed weight of GGML type ``name``."""
    return _PACKED[name]


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
    fields = _alloc(name, Np, K)
    for r0 in range(0, Np, _ROW_STEP):
        r1 = min(Np, r0 + _ROW_STEP)
        slab = rows[r0:min(r1, N)]
        if slab.shape[0] < r1 - r0:  # zero rows pad the last tile; their outputs are dropped
            slab = np.concatenate([slab, np.zeros((r1 - r0 - slab.shape[0], row_bytes), np.uint8)])
        slab = np.ascontiguousarray(slab).view()
        slab.flags.writeable = False  # as a mapped file's: one compiled signature for both
        _pack_slab(name, slab, K, r0 // ROWS, fields)
        if done is not None:
            done(r0 * row_bytes, min(r1, N) * row_bytes)
    return _PACKED[name](**_with_lut(name, fields))


def _with_lut(name: str, fields: dict) -> dict:
    """``fields`` with the value table of the formats that read one."""
    if name in ("IQ4_NL", "IQ4_XS"):
        fields["lut"] = _IQ4_LUT
    elif name == "MXFP4":
        fields["lut"] = _MXFP4_LUT
    return fields


def zero_weight(name: str, N: int, K: int):
    """A packed weight of zeros (N rows, padded to whole tiles, of K elements): the types of
    ``pack_weight``'s without running the repacking kernels (to compile the kernels that
    read packed weights apart from those that write them)."""
    if name not in _PACKED:
        raise ValueError(f"weight type {name} is not supported by the CPU kernels")
    Np = -(-N // ROWS) * ROWS
    fields = {k: np.zeros_like(a) for k, a in _alloc(name, Np, K).items()}
    return _PACKED[name](**_with_lut(name, fields))
