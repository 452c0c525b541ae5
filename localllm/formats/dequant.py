"""Numpy reference dequantizers, one per supported GGML format, bit-exact with ggml's
dequantize_row_* (and the `gguf` package): the kernels' tests measure against these."""

from __future__ import annotations

import functools
import math

import numpy as np

from localllm.formats.quants import (
    IQ4NL_VALUES,
    MXFP4_VALUES,
    SUPPORTED_TYPES,
    _check_blocks,
    _sizes,
    half_field,
    iq4nl_indices,
    iq4xs_indices,
    iq4xs_scales,
    kquant_scales_mins,
    mxfp4_indices,
    mxfp4_scales,
    q2k_quants,
    q2k_scales_mins,
    q3k_quants,
    q3k_scales,
    q4_0_quants,
    q4_1_quants,
    q4k_quants,
    q5_0_quants,
    q5_1_quants,
    q5k_quants,
    q6k_quants,
    q6k_scales,
    q8_0_quants,
    row_nbytes,
    type_name,
)

# Blocks per dequantization step in `dequantize`: bounds the temporaries on big tensors.
_CHUNK_BLOCKS = 1 << 14


# ---------------------------------------------------------------------------- dequantizers
#
# Float order follows ggml's dequantize_row_* (and gguf-py): the block scale times the
# sub-block scale first, then times q, then minus (dmin * m). Every product is exact in
# float32 (f16 d has 11 significant bits, sc * q at most 12 more), so only the final
# subtraction or addition rounds, and an FMA there rounds identically.

def _dequantizer(name: str):
    """Check the blocks' shape for format `name`, and let NaN/Inf scales propagate
    (inf * 0, inf - inf) without numpy warnings: a corrupt scale must not crash."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(blocks):
            _check_blocks(blocks, name)
            with np.errstate(invalid="ignore", over="ignore"):
                return fn(blocks)
        return wrapper
    return decorate


def _per_sub(values: np.ndarray, n_sub: int) -> np.ndarray:
    """(nb, n_sub) per-sub-block values -> (nb, n_sub, 1) for broadcasting over elements."""
    return values.reshape(values.shape[0], n_sub, 1)


def dequant_f32(blocks: np.ndarray) -> np.ndarray:
    """F32 "blocks" (single little-endian floats).

    Args:
        blocks: uint8 (n, 4).
    Returns:
        float32 (n, 1).
    """
    _check_blocks(blocks, "F32")
    return np.ascontiguousarray(blocks).view("<f4").astype(np.float32)


def dequant_f16(blocks: np.ndarray) -> np.ndarray:
    """F16 values widened to float32 (exact).

    Args:
        blocks: uint8 (n, 2).
    Returns:
        float32 (n, 1).
    """
    _check_blocks(blocks, "F16")
    return np.ascontiguousarray(blocks).view("<f2").astype(np.float32)


def dequant_bf16(blocks: np.ndarray) -> np.ndarray:
    """BF16 values widened to float32: the 16 bits become the float's top half.

    Args:
        blocks: uint8 (n, 2).
    Returns:
        float32 (n, 1).
    """
    _check_blocks(blocks, "BF16")
    bits = np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << np.uint32(16)
    return bits.view(np.float32)


@_dequantizer("Q4_0")
def dequant_q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0: weight = d * q, q in [-8, 7].

    Args:
        blocks: uint8 (n_blocks, 18).
    Returns:
        float32 (n_blocks, 32).
    """
    return half_field(blocks, "Q4_0") * q4_0_quants(blocks).astype(np.float32)


@_dequantizer("Q4_1")
def dequant_q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1: weight = d * q + m, q in [0, 15].

    Args:
        blocks: uint8 (n_blocks, 20).
    Returns:
        float32 (n_blocks, 32).
    """
    d, m = half_field(blocks, "Q4_1", "d"), half_field(blocks, "Q4_1", "m")
    return d * q4_1_quants(blocks).astype(np.float32) + m


@_dequantizer("Q5_0")
def dequant_q5_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0: weight = d * q, q in [-16, 15].

    Args:
        blocks: uint8 (n_blocks, 22).
    Returns:
        float32 (n_blocks, 32).
    """
    return half_field(blocks, "Q5_0") * q5_0_quants(blocks).astype(np.float32)


@_dequantizer("Q5_1")
def dequant_q5_1(blocks: np.ndarray) -> np.ndarray:
    """Q5_1: weight = d * q + m, q in [0, 31].

    Args:
        blocks: uint8 (n_blocks, 24).
    Returns:
        float32 (n_blocks, 32).
    """
    d, m = half_field(blocks, "Q5_1", "d"), half_field(blocks, "Q5_1", "m")
    return d * q5_1_quants(blocks).astype(np.float32) + m


@_dequantizer("Q8_0")
def dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0: weight = d * q, q int8.

    Args:
        blocks: uint8 (n_blocks, 34).
    Returns:
        float32 (n_blocks, 32).
    """
    return half_field(blocks, "Q8_0") * q8_0_quants(blocks).astype(np.float32)


@_dequantizer("Q2_K")
def dequant_q2_k(blocks: np.ndarray) -> np.ndarray:
    """Q2_K: 16 sub-blocks of 16; weight = (d * sc) * q - (dmin * m).

    Args:
        blocks: uint8 (n_blocks, 84).
    Returns:
        float32 (n_blocks, 256).
    """
    nb = blocks.shape[0]
    sc, m = q2k_scales_mins(blocks)
    dl = _per_sub(half_field(blocks, "Q2_K", "d") * sc.astype(np.float32), 16)
    ml = _per_sub(half_field(blocks, "Q2_K", "dmin") * m.astype(np.float32), 16)
    q = q2k_quants(blocks).reshape(nb, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(nb, 256)


@_dequantizer("Q3_K")
def dequant_q3_k(blocks: np.ndarray) -> np.ndarray:
    """Q3_K: 16 sub-blocks of 16; weight = (d * sc) * q, sc in [-32, 31], q in [-4, 3].

    Args:
        blocks: uint8 (n_blocks, 110).
    Returns:
        float32 (n_blocks, 256).
    """
    nb = blocks.shape[0]
    dl = _per_sub(half_field(blocks, "Q3_K") * q3k_scales(blocks).astype(np.float32), 16)
    q = q3k_quants(blocks).reshape(nb, 16, 16).astype(np.float32)
    return (dl * q).reshape(nb, 256)


def _dequant_q45k(blocks: np.ndarray, kind: str, q: np.ndarray) -> np.ndarray:
    nb = blocks.shape[0]
    sc, m = kquant_scales_mins(blocks)
    dl = _per_sub(half_field(blocks, kind, "d") * sc.astype(np.float32), 8)
    ml = _per_sub(half_field(blocks, kind, "dmin") * m.astype(np.float32), 8)
    return (dl * q.reshape(nb, 8, 32).astype(np.float32) - ml).reshape(nb, 256)


@_dequantizer("Q4_K")
def dequant_q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K: 8 sub-blocks of 32; weight = (d * sc) * q - (dmin * m), q in [0, 15].

    Args:
        blocks: uint8 (n_blocks, 144).
    Returns:
        float32 (n_blocks, 256).
    """
    return _dequant_q45k(blocks, "Q4_K", q4k_quants(blocks))


@_dequantizer("Q5_K")
def dequant_q5_k(blocks: np.ndarray) -> np.ndarray:
    """Q5_K: 8 sub-blocks of 32; weight = (d * sc) * q - (dmin * m), q in [0, 31].

    Args:
        blocks: uint8 (n_blocks, 176).
    Returns:
        float32 (n_blocks, 256).
    """
    return _dequant_q45k(blocks, "Q5_K", q5k_quants(blocks))


@_dequantizer("Q6_K")
def dequant_q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: 16 sub-blocks of 16; weight = (d * sc) * q, sc int8, q in [-32, 31].

    Args:
        blocks: uint8 (n_blocks, 210).
    Returns:
        float32 (n_blocks, 256).
    """
    nb = blocks.shape[0]
    dl = _per_sub(half_field(blocks, "Q6_K") * q6k_scales(blocks).astype(np.float32), 16)
    q = q6k_quants(blocks).reshape(nb, 16, 16).astype(np.float32)
    return (dl * q).reshape(nb, 256)


@_dequantizer("IQ4_NL")
def dequant_iq4_nl(blocks: np.ndarray) -> np.ndarray:
    """IQ4_NL: weight = d * IQ4NL_VALUES[idx].

    Args:
        blocks: uint8 (n_blocks, 18).
    Returns:
        float32 (n_blocks, 32).
    """
    values = IQ4NL_VALUES.astype(np.float32)[iq4nl_indices(blocks)]
    return half_field(blocks, "IQ4_NL") * values


@_dequantizer("IQ4_XS")
def dequant_iq4_xs(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS: 8 sub-blocks of 32; weight = (d * sc) * IQ4NL_VALUES[idx].

    Args:
        blocks: uint8 (n_blocks, 136).
    Returns:
        float32 (n_blocks, 256).
    """
    nb = blocks.shape[0]
    dl = _per_sub(half_field(blocks, "IQ4_XS") * iq4xs_scales(blocks).astype(np.float32), 8)
    values = IQ4NL_VALUES.astype(np.float32)[iq4xs_indices(blocks)].reshape(nb, 8, 32)
    return (dl * values).reshape(nb, 256)


@_dequantizer("MXFP4")
def dequant_mxfp4(blocks: np.ndarray) -> np.ndarray:
    """MXFP4: weight = 2**(e - 128) * MXFP4_VALUES[idx] (a power of two times a small
    integer: exact, subnormals included).

    Args:
        blocks: uint8 (n_blocks, 17).
    Returns:
        float32 (n_blocks, 32).
    """
    values = MXFP4_VALUES.astype(np.float32)[mxfp4_indices(blocks)]
    return mxfp4_scales(blocks) * values


_DEQUANT = {
    "F32": dequant_f32, "F16": dequant_f16, "BF16": dequant_bf16,
    "Q4_0": dequant_q4_0, "Q4_1": dequant_q4_1, "Q5_0": dequant_q5_0,
    "Q5_1": dequant_q5_1, "Q8_0": dequant_q8_0,
    "Q2_K": dequant_q2_k, "Q3_K": dequant_q3_k, "Q4_K": dequant_q4_k,
    "Q5_K": dequant_q5_k, "Q6_K": dequant_q6_k,
    "IQ4_NL": dequant_iq4_nl, "IQ4_XS": dequant_iq4_xs, "MXFP4": dequant_mxfp4,
}


def dequantize(data: np.ndarray, ggml_type: int | str, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize a whole tensor's bytes.

    Args:
        data: uint8 array (any shape) holding exactly the tensor's bytes, rows of whole
            blocks back to back.
        ggml_type: GGML type id or name; must be in SUPPORTED_TYPES.
        shape: tensor shape in numpy order (last dimension = row length).
    Returns:
        float32 array of `shape`. Raises ValueError for an unsupported type, a row that
        is not whole blocks, or a byte count that does not match `shape`.
    """
    name = type_name(ggml_type)
    if name not in SUPPORTED_TYPES:
        raise ValueError(f"dequantization of {name} is not supported")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8:
        raise ValueError("data must be a uint8 numpy array")
    shape = tuple(int(s) for s in shape)
    if not shape or any(s < 0 for s in shape):
        raise ValueError(f"bad tensor shape {shape}")
    n_rows = math.prod(shape[:-1])
    nbytes = n_rows * row_nbytes(name, shape[-1])
    if data.size != nbytes:
        raise ValueError(
            f"{name} tensor of shape {shape} needs {nbytes} bytes, got {data.size}")
    bs, ts = _sizes(name)
    blocks = data.reshape(-1, ts)
    out = np.empty((blocks.shape[0], bs), dtype=np.float32)
    fn = _DEQUANT[name]
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        stop = start + _CHUNK_BLOCKS
        out[start:stop] = fn(blocks[start:stop])
    return out.reshape(shape)
