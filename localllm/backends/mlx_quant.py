"""GGUF weight formats in MLX's affine quantization (w = s * q + b per group of 32).

Exact (the MLX dequantization equals localllm.formats.dequant bit for bit), with float32 scales:
  Q4_0  q + 8,   s = d,      b = -8 d        Q4_1  q,  s = d,       b = m
  Q5_0  q + 16,  s = d,      b = -16 d       Q5_1  q,  s = d,       b = m
  Q8_0  q + 128, s = d,      b = -128 d
  Q4_K, Q5_K     q (32-element sub-blocks),  s = d * sc,  b = -(dmin * m)
Every product is exact in float32 (an f16 d has 11 significant bits, sc 6 and q at most 8),
so only the final sum rounds, as in the reference. float16 scales could not hold d * sc.
MXFP4 maps exactly onto MLX's own "mxfp4" mode: the same E2M1 codes in element order and
the E8M0 byte as the group scale (MLX reads 2**(e - 127) times the E2M1 value, ggml
2**(e - 128) times the doubled value): no biases.
Q6_K, Q3_K and Q2_K (16-element sub-blocks, below MLX's smallest group of 32) and the IQ4
formats (non-uniform levels) are dequantized and quantized again by MLX at CONVERT_BITS.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from localllm.formats import quants
from localllm.formats.dequant import dequantize

GROUP = 32
EXACT = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K")
MXFP4 = "MXFP4"  # exact in MLX's mxfp4 mode (to_mlx_mxfp4)
# The MLX bit width each converted format is quantized to again (scripts/mlx_conversion_kl.py
# measures what that costs in KL divergence on a real model).
CONVERT_BITS = {"Q6_K": 8, "Q3_K": 6, "Q2_K": 4, "IQ4_NL": 6, "IQ4_XS": 6}
FLOAT = ("F32", "F16", "BF16")
_ROWS_PER_STEP = 1024  # rows converted at a time: bounds the temporaries of a large tensor


@dataclass
class Affine:
    """A format's blocks as MLX affine groups: unsigned quants in element order, and a
    float32 scale and bias per group of 32."""
    bits: int
    q: np.ndarray        # uint8 (n_blocks, block_size), each < 2**bits
    scales: np.ndarray   # float32 (n_blocks, block_size // 32)
    biases: np.ndarray


def _groups(x: np.ndarray, nb: int) -> np.ndarray:
    return np.ascontiguousarray(np.broadcast_to(x, (nb, x.shape[1])), dtype=np.float32)


def affine(blocks: np.ndarray, type_name: str) -> Affine:
    """The exact MLX affine form of whole blocks of an EXACT format.

    Args:
        blocks: uint8 (n_blocks, type_size).
        type_name: one of EXACT.
    Returns:
        An Affine.
    """
    nb = blocks.shape[0]
    if type_name in ("Q4_K", "Q5_K"):
        sc, m = quants.kquant_scales_mins(blocks)
        d = quants.half_field(blocks, type_name, "d")
        dmin = quants.half_field(blocks, type_name, "dmin")
        q = quants.q4k_quants(blocks) if type_name == "Q4_K" else quants.q5k_quants(blocks)
        return Affine(4 if type_name == "Q4_K" else 5, q.astype(np.uint8),
                      d * sc.astype(np.float32), -(dmin * m.astype(np.float32)))
    d = quants.half_field(blocks, type_name, "d")
    if type_name in ("Q4_1", "Q5_1"):
        q = quants.q4_1_quants(blocks) if type_name == "Q4_1" else quants.q5_1_quants(blocks)
        return Affine(4 if type_name == "Q4_1" else 5, q.astype(np.uint8), _groups(d, nb),
                      _groups(quants.half_field(blocks, type_name, "m"), nb))
    signed = {"Q4_0": (quants.q4_0_quants, 4), "Q5_0": (quants.q5_0_quants, 5),
              "Q8_0": (quants.q8_0_quants, 8)}
    fn, bits = signed[type_name]
    off = 1 << (bits - 1)
    q = (fn(blocks).astype(np.int16) + off).astype(np.uint8)
    return Affine(bits, q, _groups(d, nb), _groups(d * np.float32(-off), nb))


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Quants (N, K) as MLX packs them: a little-endian bit stream, ``bits`` per element,
    read as uint32 (N, K * bits // 32)."""
    N, K = q.shape
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32)
    if bits == 4:
        b = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
        return np.ascontiguousarray(b).view(np.uint32)
    planes = (q[..., None] >> np.arange(bits, dtype=np.uint8)) & 1
    return np.packbits(planes.reshape(N, K * bits), axis=1, bitorder="little").view(np.uint32)


@dataclass
class Packed:
    """A matrix (N, K) in MLX's quantized form, as numpy arrays ready to upload."""
    bits: int
    wq: np.ndarray       # uint32 (N, K * bits // 32)
    scales: np.ndarray   # float32 (N, K // 32)
    biases: np.ndarray


def to_mlx_exact(raw: np.ndarray, type_name: str, N: int, K: int) -> Packed:
    """An EXACT format's matrix packed for mx.quantized_matmul, converted in row slices."""
    rb, ts = quants.row_nbytes(type_name, K), quants.type_size(type_name)
    rows = np.asarray(raw, np.uint8).reshape(N, rb)
    parts = []
    for r in range(0, N, _ROWS_PER_STEP):
        a = affine(rows[r:r + _ROWS_PER_STEP].reshape(-1, ts), type_name)
        n = min(_ROWS_PER_STEP, N - r)
        parts.append((pack(a.q.reshape(n, K), a.bits), a.scales.reshape(n, -1),
                      a.biases.reshape(n, -1), a.bits))
    bits = parts[0][3]
    return Packed(bits, *(np.concatenate([p[i] for p in parts]) for i in range(3)))


def to_mlx_mxfp4(raw: np.ndarray, N: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    """An MXFP4 matrix in MLX's mxfp4 form: (uint32 (N, K // 8) packed codes, uint8 (N, K // 32)
    E8M0 scales). The codes are repacked into element order, two per byte, low nibble first."""
    rb, ts = quants.row_nbytes("MXFP4", K), quants.type_size("MXFP4")
    blocks = np.asarray(raw, np.uint8).reshape(N * (rb // ts), ts)
    idx = quants.mxfp4_indices(blocks).reshape(N, K)
    wq = np.ascontiguousarray((idx[:, 0::2] | (idx[:, 1::2] << 4)).astype(np.uint8)).view(np.uint32)
    scales = np.ascontiguousarray(quants.field(blocks, "MXFP4", "e")).reshape(N, K // GROUP)
    return wq, scales


def dequantized_rows(raw: np.ndarray, type_name: str, N: int, K: int):
    """The matrix's rows as float32 slices (N_i, K), by the numpy reference dequantizer."""
    rb = quants.row_nbytes(type_name, K)
    rows = np.asarray(raw, np.uint8).reshape(N, rb)
    for r in range(0, N, _ROWS_PER_STEP):
        part = rows[r:r + _ROWS_PER_STEP]
        yield dequantize(np.ascontiguousarray(part).reshape(-1), type_name, (part.shape[0], K))


def packed_nbytes(type_name: str, N: int, K: int, convert_bits: dict | None = None) -> int:
    """Bytes of a matrix in the MLX backend: packed quants plus float32 scales and biases
    per group, or the float values of float formats."""
    if type_name in FLOAT:
        return N * K * {"F32": 4, "F16": 2, "BF16": 2}[type_name]
    if type_name == MXFP4:
        return N * K // 2 + N * (K // GROUP)
    bits = (convert_bits or CONVERT_BITS).get(type_name) or {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5,
                                            "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}[type_name]
    return N * K * bits // 8 + N * (K // GROUP) * 8
