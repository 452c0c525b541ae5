"""GGML weight formats: the (block size, bytes per block) table from the `gguf` package,
each format's byte layout, and numpy unpackers of each block's integer quants and scales
(the numpy reference dequantizers built on them are in `localllm.formats.dequant`).
"""

from __future__ import annotations

import operator

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

SUPPORTED_TYPES = frozenset({
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4",
})

# Byte layout of one block, fields in storage order as (name, bytes); mirrors the
# block_* structs of ggml-common.h. f16 fields are "d", "m" and "dmin".
BLOCK_LAYOUT: dict[str, tuple[tuple[str, int], ...]] = {
    "F32": (("x", 4),),
    "F16": (("x", 2),),
    "BF16": (("x", 2),),
    "Q4_0": (("d", 2), ("qs", 16)),
    "Q4_1": (("d", 2), ("m", 2), ("qs", 16)),
    "Q5_0": (("d", 2), ("qh", 4), ("qs", 16)),
    "Q5_1": (("d", 2), ("m", 2), ("qh", 4), ("qs", 16)),
    "Q8_0": (("d", 2), ("qs", 32)),
    "Q2_K": (("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2)),
    "Q3_K": (("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2)),
    "Q4_K": (("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128)),
    "Q5_K": (("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128)),
    "Q6_K": (("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)),
    "IQ4_NL": (("d", 2), ("qs", 16)),
    "IQ4_XS": (("d", 2), ("scales_h", 2), ("scales_l", 4), ("qs", 128)),
    "MXFP4": (("e", 1), ("qs", 16)),
}

# The 16 non-linear levels shared by IQ4_NL and IQ4_XS (kvalues_iq4nl in ggml-common.h).
IQ4NL_VALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
IQ4NL_VALUES.setflags(write=False)

# MXFP4's 16 E2M1 codes as doubled integers (kvalues_mxfp4 in ggml-common.h): code c is
# sign (bit 3) times {0, 0.5, 1, 1.5, 2, 3, 4, 6}[c & 7], times 2. The block's E8M0 byte e
# scales them by 2**(e - 128), the half that undoes the doubling folded in.
MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
MXFP4_VALUES.setflags(write=False)

_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)
_CRUMB_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)
_BIT_SHIFTS = np.arange(8, dtype=np.uint8)


# ---------------------------------------------------------------------------- table

def _ggml_type(t: int | str) -> GGMLQuantizationType:
    """Resolve a type id or name to the gguf enum member; ValueError if unknown."""
    if isinstance(t, str):
        try:
            return GGMLQuantizationType[t.upper()]
        except KeyError:
            raise ValueError(f"unknown GGML type name {t!r}") from None
    try:
        return GGMLQuantizationType(operator.index(t))
    except (ValueError, TypeError):
        raise ValueError(f"unknown GGML type id {t!r}") from None


def type_name(t: int | str) -> str:
    """Name of a GGML type.

    Args:
        t: type id (as stored in a GGUF tensor table) or name.
    Returns:
        The GGML name, e.g. "Q4_K". Raises ValueError for an unknown type.
    """
    return _ggml_type(t).name


def type_id(name: int | str) -> int:
    """Numeric id of a GGML type.

    Args:
        name: type name such as "Q4_K" (case-insensitive), or an id to validate.
    Returns:
        The id as stored in GGUF files. Raises ValueError for an unknown type.
    """
    return int(_ggml_type(name))


def _sizes(t: int | str) -> tuple[int, int]:
    gt = _ggml_type(t)
    if gt not in GGML_QUANT_SIZES:
        raise ValueError(f"GGML type {gt.name} has no block size in the gguf table")
    return GGML_QUANT_SIZES[gt]


def block_size(t: int | str) -> int:
    """Elements per block.

    Args:
        t: type id or name.
    Returns:
        Number of weights one block encodes (1 for F32/F16/BF16, 32 or 256 otherwise).
    """
    return _sizes(t)[0]


def type_size(t: int | str) -> int:
    """Bytes per block.

    Args:
        t: type id or name.
    Returns:
        Size in bytes of one block of type `t`.
    """
    return _sizes(t)[1]


def row_nbytes(t: int | str, n_elements: int) -> int:
    """Bytes taken by a row of `n_elements` weights.

    Args:
        t: type id or name.
        n_elements: row length; must be a non-negative multiple of the block size.
    Returns:
        Byte size of the row. Raises ValueError if the row is not whole blocks.
    """
    bs, ts = _sizes(t)
    if n_elements < 0 or n_elements % bs:
        raise ValueError(
            f"row of {n_elements} elements is not a whole number of {type_name(t)} "
            f"blocks of {bs}")
    return n_elements // bs * ts


# ---------------------------------------------------------------------------- fields

def _check_blocks(blocks: np.ndarray, name: str) -> np.ndarray:
    ts = type_size(name)
    if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint8:
        raise ValueError(f"{name} blocks must be a uint8 numpy array")
    if blocks.ndim != 2 or blocks.shape[1] != ts:
        raise ValueError(f"{name} blocks must have shape (n_blocks, {ts}), got {blocks.shape}")
    return blocks


def field(blocks: np.ndarray, ggml_type: int | str, name: str) -> np.ndarray:
    """The bytes of one field of every block.

    Args:
        blocks: uint8 (n_blocks, type_size) array of whole blocks.
        ggml_type: the blocks' type (id or name), a key of BLOCK_LAYOUT.
        name: field name from BLOCK_LAYOUT, e.g. "qs".
    Returns:
        uint8 (n_blocks, field_bytes) view into `blocks`.
    """
    tname = type_name(ggml_type)
    _check_blocks(blocks, tname)
    offset = 0
    for fname, nbytes in BLOCK_LAYOUT[tname]:
        if fname == name:
            return blocks[:, offset:offset + nbytes]
        offset += nbytes
    raise ValueError(f"{tname} blocks have no field {name!r}")


def half_field(blocks: np.ndarray, ggml_type: int | str, name: str = "d") -> np.ndarray:
    """An f16 field of every block (scale "d", min "m" or "dmin"), widened to float32.

    Args:
        blocks: uint8 (n_blocks, type_size) array of whole blocks.
        ggml_type: the blocks' type (id or name).
        name: which f16 field.
    Returns:
        float32 (n_blocks, 1); the widening is exact, NaN/Inf kept.
    """
    raw = np.ascontiguousarray(field(blocks, ggml_type, name))
    return raw.view("<f2").astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """(nb, 16k) packed bytes -> (nb, 32k) nibbles: in each 16-byte group the low
    nibbles are elements 0..15 and the high nibbles elements 16..31."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, 16) >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(nb, -1)


def _crumbs128(qs: np.ndarray) -> np.ndarray:
    """(nb, 32k) bytes -> (nb, 128k) 2-bit values: in each 32-byte group, bit pair j
    of byte l is element 32*j + l."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, 32) >> _CRUMB_SHIFTS.reshape(1, 1, 4, 1)
    return (q & 0x03).reshape(nb, -1)


def _bits256(mask: np.ndarray) -> np.ndarray:
    """(nb, 32) bytes -> (nb, 256) bits: bit j of byte l is element 32*j + l."""
    nb = mask.shape[0]
    q = mask.reshape(nb, 1, 32) >> _BIT_SHIFTS.reshape(1, 8, 1)
    return (q & 0x01).reshape(nb, 256)


def _kquant_nibbles(qs: np.ndarray) -> np.ndarray:
    """(nb, 128) bytes -> (nb, 256) nibbles: in each 32-byte group the low nibbles are
    elements 0..31 and the high nibbles elements 32..63."""
    nb = qs.shape[0]
    q = qs.reshape(nb, 4, 1, 32) >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(nb, 256)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """(nb, 4) little-endian uint32 -> (nb, 32): bit j is element j's fifth bit."""
    return np.unpackbits(qh, axis=1, bitorder="little")


# ---------------------------------------------------------------------------- unpackers

def q4_0_quants(blocks: np.ndarray) -> np.ndarray:
    """Signed Q4_0 quants in element order.

    Args:
        blocks: uint8 (n_blocks, 18).
    Returns:
        int8 (n_blocks, 32) in [-8, 7]; weight = d * q.
    """
    qs = field(blocks, "Q4_0", "qs")
    return _nibbles32(qs).astype(np.int8) - np.int8(8)


def q4_1_quants(blocks: np.ndarray) -> np.ndarray:
    """Unsigned Q4_1 quants in element order.

    Args:
        blocks: uint8 (n_blocks, 20).
    Returns:
        uint8 (n_blocks, 32) in [0, 15]; weight = d * q + m.
    """
    return _nibbles32(field(blocks, "Q4_1", "qs"))


def q5_0_quants(blocks: np.ndarray) -> np.ndarray:
    """Signed Q5_0 quants in element order.

    Args:
        blocks: uint8 (n_blocks, 22).
    Returns:
        int8 (n_blocks, 32) in [-16, 15]; weight = d * q.
    """
    q = _nibbles32(field(blocks, "Q5_0", "qs")) | (_high_bits32(field(blocks, "Q5_0", "qh")) << 4)
    return q.astype(np.int8) - np.int8(16)


def q5_1_quants(blocks: np.ndarray) -> np.ndarray:
    """Unsigned Q5_1 quants in element order.

    Args:
        blocks: uint8 (n_blocks, 24).
    Returns:
        uint8 (n_blocks, 32) in [0, 31]; weight = d * q + m.
    """
    return _nibbles32(field(blocks, "Q5_1", "qs")) | (_high_bits32(field(blocks, "Q5_1", "qh")) << 4)


def q8_0_quants(blocks: np.ndarray) -> np.ndarray:
    """Q8_0 quants.

    Args:
        blocks: uint8 (n_blocks, 34).
    Returns:
        int8 (n_blocks, 32), a view into `blocks`; weight = d * q.
    """
    return field(blocks, "Q8_0", "qs").view(np.int8)


def q2k_quants(blocks: np.ndarray) -> np.ndarray:
    """Q2_K quants in element order.

    Args:
        blocks: uint8 (n_blocks, 84).
    Returns:
        uint8 (n_blocks, 256) in [0, 3]; element e uses sub-block e // 16.
    """
    return _crumbs128(field(blocks, "Q2_K", "qs"))


def q2k_scales_mins(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q2_K 4-bit scales and mins of the 16 sub-blocks.

    Args:
        blocks: uint8 (n_blocks, 84).
    Returns:
        (sc, m), each uint8 (n_blocks, 16) in [0, 15];
        weight = (d * sc) * q - (dmin * m).
    """
    scales = field(blocks, "Q2_K", "scales")
    return scales & 0x0F, scales >> 4


def q3k_quants(blocks: np.ndarray) -> np.ndarray:
    """Signed Q3_K quants in element order (2 low bits, minus 4 when the hmask bit is clear).

    Args:
        blocks: uint8 (n_blocks, 110).
    Returns:
        int8 (n_blocks, 256) in [-4, 3]; element e uses sub-block e // 16.
    """
    low = _crumbs128(field(blocks, "Q3_K", "qs")).astype(np.int8)
    high = _bits256(field(blocks, "Q3_K", "hmask"))
    # A set hmask bit means "no offset": the stored value is q + 4 with the bit as bit 2.
    return low - ((high ^ 1) << 2).astype(np.int8)


def q3k_scales(blocks: np.ndarray) -> np.ndarray:
    """Q3_K 6-bit sub-block scales, unpacked from 12 bytes and made signed.

    Bytes 0..7 hold the low nibbles (scale j < 8 in byte j's low half, j >= 8 in byte
    j - 8's high half); bytes 8..11 hold the 2-bit tops (scale j in bits 2*(j // 4) of
    byte 8 + j % 4).

    Args:
        blocks: uint8 (n_blocks, 110).
    Returns:
        int8 (n_blocks, 16) in [-32, 31]; weight = (d * sc) * q.
    """
    s = field(blocks, "Q3_K", "scales")
    nb = s.shape[0]
    low = np.concatenate([s[:, :8] & 0x0F, s[:, :8] >> 4], axis=1)
    high = (s[:, 8:12].reshape(nb, 1, 4) >> _CRUMB_SHIFTS.reshape(1, 4, 1)) & 0x03
    return (low | (high.reshape(nb, 16) << 4)).astype(np.int8) - np.int8(32)


def kquant_scales_mins(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K 6-bit scales and mins of the 8 sub-blocks, unpacked from 12 bytes.

    Sub-blocks 0..3 keep scale and min in the low 6 bits of bytes 0..3 and 4..7;
    sub-blocks 4..7 take their low 4 bits from bytes 8..11 (scale low nibble, min high
    nibble) and their top 2 bits from the top bits of bytes 0..3 (scale) and 4..7 (min).

    Args:
        blocks: uint8 (n_blocks, 144) of Q4_K or (n_blocks, 176) of Q5_K.
    Returns:
        (sc, m), each uint8 (n_blocks, 8) in [0, 63];
        weight = (d * sc) * q - (dmin * m).
    """
    if not isinstance(blocks, np.ndarray) or blocks.ndim != 2:
        raise ValueError("blocks must be a 2-D uint8 array of Q4_K or Q5_K blocks")
    kind = {type_size("Q4_K"): "Q4_K", type_size("Q5_K"): "Q5_K"}.get(blocks.shape[1])
    if kind is None:
        raise ValueError(f"blocks of {blocks.shape[1]} bytes are neither Q4_K nor Q5_K")
    s = field(blocks, kind, "scales")
    lo_sc, lo_m, packed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo_sc & 0x3F, (packed & 0x0F) | ((lo_sc >> 6) << 4)], axis=1)
    m = np.concatenate([lo_m & 0x3F, (packed >> 4) | ((lo_m >> 6) << 4)], axis=1)
    return sc, m


def q4k_quants(blocks: np.ndarray) -> np.ndarray:
    """Q4_K quants in element order: each 32-byte group holds 64 elements, low nibbles
    first.

    Args:
        blocks: uint8 (n_blocks, 144).
    Returns:
        uint8 (n_blocks, 256) in [0, 15]; element e uses sub-block e // 32.
    """
    return _kquant_nibbles(field(blocks, "Q4_K", "qs"))


def q5k_quants(blocks: np.ndarray) -> np.ndarray:
    """Q5_K quants in element order (Q4_K nibbles plus a fifth bit from qh).

    Args:
        blocks: uint8 (n_blocks, 176).
    Returns:
        uint8 (n_blocks, 256) in [0, 31]; element e uses sub-block e // 32.
    """
    low = _kquant_nibbles(field(blocks, "Q5_K", "qs"))
    return low | (_bits256(field(blocks, "Q5_K", "qh")) << 4)


def q6k_quants(blocks: np.ndarray) -> np.ndarray:
    """Signed Q6_K quants in element order.

    Element e = 128*n + 32*j + l takes 4 bits from ql[64*n + 32*(j % 2) + l]
    (high nibble when j >= 2) and 2 bits from qh[32*n + l] at bit 2*j.

    Args:
        blocks: uint8 (n_blocks, 210).
    Returns:
        int8 (n_blocks, 256) in [-32, 31]; element e uses sub-block e // 16.
    """
    ql = field(blocks, "Q6_K", "ql")
    nb = ql.shape[0]
    low = (ql.reshape(nb, 2, 1, 2, 32) >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1, 1)) & 0x0F
    high = _crumbs128(field(blocks, "Q6_K", "qh"))
    return (low.reshape(nb, 256) | (high << 4)).astype(np.int8) - np.int8(32)


def q6k_scales(blocks: np.ndarray) -> np.ndarray:
    """Q6_K 8-bit signed sub-block scales.

    Args:
        blocks: uint8 (n_blocks, 210).
    Returns:
        int8 (n_blocks, 16); weight = (d * sc) * q.
    """
    return field(blocks, "Q6_K", "scales").view(np.int8)


def iq4nl_indices(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL 4-bit indices into IQ4NL_VALUES, in element order (Q4_0 nibble order).

    Args:
        blocks: uint8 (n_blocks, 18).
    Returns:
        uint8 (n_blocks, 32) in [0, 15]; weight = d * IQ4NL_VALUES[idx].
    """
    return _nibbles32(field(blocks, "IQ4_NL", "qs"))


def iq4xs_indices(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS 4-bit indices into IQ4NL_VALUES, in element order (each 16-byte group is
    one 32-element sub-block, low nibbles first).

    Args:
        blocks: uint8 (n_blocks, 136).
    Returns:
        uint8 (n_blocks, 256) in [0, 15]; element e uses sub-block e // 32.
    """
    return _nibbles32(field(blocks, "IQ4_XS", "qs"))


def iq4xs_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS 6-bit sub-block scales, made signed.

    Sub-block i takes its low 4 bits from scales_l[i // 2] (high nibble for odd i) and
    its top 2 bits from bits 2*i of the little-endian uint16 scales_h.

    Args:
        blocks: uint8 (n_blocks, 136).
    Returns:
        int8 (n_blocks, 8) in [-32, 31]; weight = (d * sc) * IQ4NL_VALUES[idx].
    """
    sl = field(blocks, "IQ4_XS", "scales_l")
    sh = np.ascontiguousarray(field(blocks, "IQ4_XS", "scales_h")).view("<u2")
    nb = sl.shape[0]
    low = ((sl.reshape(nb, 4, 1) >> _NIBBLE_SHIFTS.reshape(1, 1, 2)) & 0x0F).reshape(nb, 8)
    high = ((sh >> np.arange(0, 16, 2, dtype=np.uint16)) & 0x03).astype(np.uint8)
    return (low | (high << 4)).astype(np.int8) - np.int8(32)


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """E8M0 exponent bytes as the float32 scale 2**(e - 128) that multiplies MXFP4_VALUES
    (ggml's GGML_E8M0_TO_FP32_HALF): e = 0 and 1 give the subnormals 2**-128 and 2**-127,
    e = 255 gives 2**127 (no NaN code, as in ggml).

    Args:
        e: uint8 array of any shape.
    Returns:
        float32 array of the same shape, exact.
    """
    e = np.asarray(e, dtype=np.uint8).astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def mxfp4_scales(blocks: np.ndarray) -> np.ndarray:
    """MXFP4 block scales from the E8M0 byte.

    Args:
        blocks: uint8 (n_blocks, 17).
    Returns:
        float32 (n_blocks, 1); weight = scale * MXFP4_VALUES[idx].
    """
    return e8m0_half(field(blocks, "MXFP4", "e"))


def mxfp4_indices(blocks: np.ndarray) -> np.ndarray:
    """MXFP4 4-bit E2M1 codes, indices into MXFP4_VALUES, in element order (Q4_0 nibble
    order: low nibbles are elements 0..15, high nibbles 16..31).

    Args:
        blocks: uint8 (n_blocks, 17).
    Returns:
        uint8 (n_blocks, 32) in [0, 15].
    """
    return _nibbles32(field(blocks, "MXFP4", "qs"))
