"""Activation quantization: float rows to int8 blocks, once per matmul input.

The arithmetic is llama.cpp's (facts of its Q8_0/Q8_1/Q8_K activation formats: the scale
max/127 stored as f16, quants round(x * 127/max) to nearest-even; for Q8_K the scale is
-max/127 in float32 with the signed extreme mapped to -127), so the two engines see the same
integers and differ only in summation order.
"""

import numpy as np
from numba import prange

from .jit import njit
from .rowmath import (q8_32_x1, q8_32_x2, q8_32_x4, q8_32_x8, q8_32_x16, q8_256_block,
                      rows_contiguous)

# Below this many elements a call stays on one thread: a parallel region costs 2-30 us to
# start, more than the job (~0.2 ns per element).
PAR_MIN_ELEMS = 1 << 15


@njit(cache=True)
def act_buffers(n, K, need32, need256):
    """Empty buffers for the quantized forms of an (n, K) input: (xq, dx, xs, sx) of 32-wide
    blocks and (xq, dx, bsum) of 256-wide blocks (see quantize_q8_32 / quantize_q8_256); a
    form that is not needed gets 0 rows."""
    m32 = n if need32 else 0
    m256 = n if need256 else 0
    a32 = (np.empty((m32, K), np.int8), np.empty((m32, K // 32), np.float32),
           np.empty((m32, K // 32), np.int32), np.empty((m32, K // 32), np.float32))
    a256 = (np.empty((m256, K), np.int8), np.empty((m256, K // 256), np.float32),
            np.empty((m256, K // 16), np.int32))
    return a32, a256


@njit(cache=True)
def quantize_q8_32_row(xr, qr, dx, xs, sx):
    """Quantize one contiguous row into 32-wide blocks (see quantize_q8_32), in groups of
    16 blocks and then 8, 4, 2, 1 for the rest."""
    nb = xr.shape[0] // 32
    b = 0
    while nb - b >= 16:
        q8_32_x16(xr, 128 * b, qr, 32 * b, dx, xs, sx, 4 * b)
        b += 16
    if nb - b >= 8:
        q8_32_x8(xr, 128 * b, qr, 32 * b, dx, xs, sx, 4 * b)
        b += 8
    if nb - b >= 4:
        q8_32_x4(xr, 128 * b, qr, 32 * b, dx, xs, sx, 4 * b)
        b += 4
    if nb - b >= 2:
        q8_32_x2(xr, 128 * b, qr, 32 * b, dx, xs, sx, 4 * b)
        b += 2
    if nb - b >= 1:
        q8_32_x1(xr, 128 * b, qr, 32 * b, dx, xs, sx, 4 * b)


@njit(cache=True, parallel=True)
def _quantize_q8_32_par(x, qx, dx, xs, sx):
    for t in prange(x.shape[0]):
        quantize_q8_32_row(x[t], qx[t], dx[t], xs[t], sx[t])


@njit(cache=True)
def quantize_q8_32(x, qx, dx, xs, sx):
    """Quantize rows into 32-wide int8 blocks (llama.cpp's Q8_0 / Q8_1 arithmetic).

    Per block: amax = max |x|, d = amax / 127, q = rint(x * (127 / amax)) (0 when amax is 0),
    all in float32; a block whose amax is below ~4e-37 (127 / amax overflows) is out of range.

    Args:
        x: float32 (n, K), K a multiple of 32, rows contiguous.
        qx: int8 (n, K) output quants.
        dx: float32 (n, K // 32) output scales (max |x| / 127, rounded to f16).
        xs: int32 (n, K // 32) output: the block's sum of quants.
        sx: float32 (n, K // 32) output: (unrounded scale) * sum, rounded to f16.
    """
    n, K = x.shape
    nb = K // 32
    if (K % 32 != 0 or qx.shape != (n, K) or dx.shape != (n, nb) or xs.shape != (n, nb)
            or sx.shape != (n, nb)):
        raise ValueError("quantize_q8_32: K must be a multiple of 32, outputs shaped to match")
    if not (rows_contiguous(x) and rows_contiguous(qx) and rows_contiguous(dx)
            and rows_contiguous(xs) and rows_contiguous(sx)):
        raise ValueError("quantize_q8_32: rows must be contiguous")
    if n > 1 and n * K >= PAR_MIN_ELEMS:
        _quantize_q8_32_par(x, qx, dx, xs, sx)
    else:
        for t in range(n):
            quantize_q8_32_row(x[t], qx[t], dx[t], xs[t], sx[t])


@njit(cache=True)
def quantize_q8_256_row(xr, qr, dx, bsum):
    """Quantize one contiguous row into 256-wide blocks (see quantize_q8_256)."""
    for b in range(xr.shape[0] // 256):
        dx[b] = q8_256_block(xr, 1024 * b, qr, 256 * b, bsum, 64 * b)


@njit(cache=True, parallel=True)
def _quantize_q8_256_par(x, qx, dx, bsum):
    for t in prange(x.shape[0]):
        quantize_q8_256_row(x[t], qx[t], dx[t], bsum[t])


@njit(cache=True)
def quantize_q8_256(x, qx, dx, bsum):
    """Quantize rows into 256-wide int8 blocks with 16-wide sums (llama.cpp's Q8_K).

    Per block: vmax = the first element of largest |x|, iscale = -127 / vmax,
    q = min(127, rint(iscale * x)), d = 1 / iscale, all in float32 (a zero block: d = 0, q = 0).

    Args:
        x: float32 (n, K), K a multiple of 256, rows contiguous.
        qx: int8 (n, K) output quants.
        dx: float32 (n, K // 256) output scales (may be negative).
        bsum: int32 (n, K // 16) output: sum of each 16 consecutive quants.
    """
    n, K = x.shape
    if (K % 256 != 0 or qx.shape != (n, K) or dx.shape != (n, K // 256)
            or bsum.shape != (n, K // 16)):
        raise ValueError("quantize_q8_256: K must be a multiple of 256, outputs shaped to match")
    if not (rows_contiguous(x) and rows_contiguous(qx) and rows_contiguous(dx)
            and rows_contiguous(bsum)):
        raise ValueError("quantize_q8_256: rows must be contiguous")
    if n > 1 and n * K >= PAR_MIN_ELEMS:
        _quantize_q8_256_par(x, qx, dx, bsum)
    else:
        for t in range(n):
            quantize_q8_256_row(x[t], qx[t], dx[t], bsum[t])
