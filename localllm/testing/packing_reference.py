"""Slow reference of the kernels' weight repacking: unpack every block with the numpy
unpackers of ``localllm.formats.quants``, then lay the values out in tiles with numpy.
Tests compare ``localllm.kernels.packing.pack_weight`` against it byte for byte.
"""

from __future__ import annotations

import numpy as np

from localllm.formats import quants
from localllm.kernels import packing as P

ROWS = P.ROWS


def _tiles(v: np.ndarray, *inner: int) -> np.ndarray:
    """(Np, K) values -> (tiles, 16, chunks, *inner) with inner splitting each 32-chunk."""
    n, K = v.shape
    return v.reshape(n // ROWS, ROWS, K // 32, *inner)


def pack_nibbles(v: np.ndarray) -> np.ndarray:
    """Per chunk-tile [g][row][i]: element 4g+i low nibble, element 16+4g+i high nibble.

    Args:
        v: (Np, K) uint8 values 0..15.
    Returns:
        Flat uint8 bytes, 256 per chunk-tile.
    """
    t = _tiles(v, 2, 4, 4)
    b = (t[:, :, :, 0] & 15) | ((t[:, :, :, 1] & 15) << 4)   # [t, r, c, g, i]
    return np.ascontiguousarray(b.transpose(0, 2, 3, 1, 4)).reshape(-1)


def pack_bytes(v: np.ndarray) -> np.ndarray:
    """Per chunk-tile [j][row][i] = element 4j+i.

    Args:
        v: (Np, K) uint8 values.
    Returns:
        Flat uint8 bytes, 512 per chunk-tile.
    """
    return np.ascontiguousarray(_tiles(v, 8, 4).transpose(0, 2, 3, 1, 4)).reshape(-1)


def pack_bits(v: np.ndarray, shift: int) -> np.ndarray:
    """Per chunk-tile [row][i], bit j = bit ``shift`` of element 4j+i.

    Args:
        v: (Np, K) uint8 values; shift: which bit.
    Returns:
        Flat uint8 bytes, 64 per chunk-tile.
    """
    b = (_tiles(v, 8, 4) >> shift) & 1
    w = (b << np.arange(8, dtype=np.uint8).reshape(8, 1)).sum(axis=3, dtype=np.uint8)
    return np.ascontiguousarray(w.transpose(0, 2, 1, 3)).reshape(-1)


def pack_crumbs(v: np.ndarray, shift: int) -> np.ndarray:
    """Per chunk-tile [half][row][i], bits 2j..2j+1 = two bits (from ``shift``) of element
    16*half + 4j + i.

    Args:
        v: (Np, K) uint8 values; shift: the lower of the two bits.
    Returns:
        Flat uint8 bytes, 128 per chunk-tile.
    """
    b = (_tiles(v, 2, 4, 4) >> shift) & 3
    w = (b << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)).sum(axis=4, dtype=np.uint8)
    return np.ascontiguousarray(w.transpose(0, 2, 3, 1, 4)).reshape(-1)


def pack_row_values(a: np.ndarray, per_row: int) -> np.ndarray:
    """Per-row values (Np, per_row) -> bytes laid out [tile][per_row][row].

    Args:
        a: (Np, per_row) array of any element width; per_row: its second dimension.
    Returns:
        Flat uint8 bytes.
    """
    n = a.shape[0]
    t = a.reshape(n // ROWS, ROWS, per_row).transpose(0, 2, 1)
    return np.ascontiguousarray(t).view(np.uint8).reshape(-1)


def values_and_scales(name: str, blocks: np.ndarray):
    """Integer values (nb, bs) as stored in the tiles plus per-block scale arrays.

    Args:
        name: GGML type name; blocks: uint8 (n_blocks, type_size).
    Returns:
        (values, {field: per-block array}).
    """
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
        return q.field(blocks, name, "qs") ^ np.uint8(0x80), {"d": q.half_field(blocks, name, "d")}
    if name == "IQ4_NL":
        return q.iq4nl_indices(blocks), {"d": q.half_field(blocks, name, "d")}
    if name == "MXFP4":
        return q.mxfp4_indices(blocks), {"d32": q.mxfp4_scales(blocks)}
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
    n = rows.shape[0]
    nb = K // quants.block_size(name)
    blocks = rows.reshape(n * nb, quants.type_size(name))
    vals, sc = values_and_scales(name, blocks)
    v = np.ascontiguousarray(vals, dtype=np.uint8).reshape(n, K)
    out: dict[str, np.ndarray] = {}
    if name == "Q8_0":
        out["qs"] = pack_bytes(v)
    elif name == "Q2_K":
        out["qs"] = pack_crumbs(v, 0)
    elif name == "Q3_K":
        out["qs"] = pack_crumbs(v, 0)
        out["hb"] = pack_bits(v, 2)
    elif name == "Q6_K":
        out["qs"] = pack_nibbles(v)
        out["hb"] = pack_crumbs(v, 4)
    elif name in ("Q5_0", "Q5_1", "Q5_K"):
        out["qs"] = pack_nibbles(v)
        out["hb"] = pack_bits(v, 4)
    else:
        out["qs"] = pack_nibbles(v)
    for key in ("d", "m", "dmin"):
        if key in sc:
            out[key] = pack_row_values(sc[key].astype(np.float16).reshape(n, nb), nb)
    if "d32" in sc:  # float32 scales (MXFP4)
        out["d"] = pack_row_values(sc["d32"].astype(np.float32).reshape(n, nb), nb)
    for key in ("sc", "mn"):
        if key in sc:
            a = sc[key].reshape(n, -1)
            out[key] = pack_row_values(a.astype(np.int8 if a.dtype == np.int8 else np.uint8), a.shape[1])
    return out


def pack_weight_reference(name: str, raw: np.ndarray, N: int, K: int):
    """The packed weight ``pack_weight`` must produce, built the slow way.

    Args:
        name: GGML type name; raw: uint8 bytes of N rows; N, K: matrix shape.
    Returns:
        The same ``Packed<name>`` namedtuple as ``pack_weight``.
    """
    row_bytes = quants.row_nbytes(name, K)
    rows = np.asarray(raw, np.uint8).reshape(N, row_bytes)
    Np = -(-N // ROWS) * ROWS
    rows = np.concatenate([rows, np.zeros((Np - N, row_bytes), np.uint8)])
    if name in P.FLOAT_FORMATS:
        dt = {"F32": np.uint32, "F16": np.uint16, "BF16": np.uint16}[name]
        fields = {"w": pack_row_values(rows.view(dt).reshape(Np, K), K)}
    else:
        fields = _pack_rows(name, rows, K)
    if name in ("IQ4_NL", "IQ4_XS"):
        fields["lut"] = np.tile((quants.IQ4NL_VALUES.astype(np.int16) + 128).astype(np.uint8), 4)
    elif name == "MXFP4":
        fields["lut"] = np.tile((quants.MXFP4_VALUES.astype(np.int16) + 128).astype(np.uint8), 4)
    return P.packed_class(name)(**fields)
