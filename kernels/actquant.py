"""Activation quantization: float rows to int8 blocks, once per matmul input.

Two block layouts serve all weight formats: 32-wide blocks with a scale and a scaled sum
(for the 32-block weight formats) and 256-wide blocks with 16-wide integer sums (for the
K-quants and IQ4_XS).
"""

import numpy as np
from numba import njit, prange


@njit(cache=True, inline="always")
def _quantize_block(x, q, start, width):
    amax = np.float32(0.0)
    for i in range(start, start + width):
        a = abs(x[i])
        if a > amax:
            amax = a
    d = amax / np.float32(127.0)
    inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
    for i in range(start, start + width):
        v = np.rint(x[i] * inv)
        q[i] = np.int8(min(max(v, np.float32(-127.0)), np.float32(127.0)))
    return d


@njit(cache=True, parallel=True)
def quantize_q8_32(x, qx, dx, xs, sx):
    """Quantize rows into 32-wide int8 blocks.

    Args:
        x: float32 (n, K), K a multiple of 32.
        qx: int8 (n, K) output quants.
        dx: float32 (n, K // 32) output scales (max |x| / 127).
        xs: int32 (n, K // 32) output: the block's sum of quants.
        sx: float32 (n, K // 32) output: scale times that sum.
    """
    n, K = x.shape
    for t in prange(n):
        xr = x[t]
        qr = qx[t]
        for b in range(K // 32):
            d = _quantize_block(xr, qr, b * 32, 32)
            s = 0
            for i in range(b * 32, b * 32 + 32):
                s += qr[i]
            dx[t, b] = d
            xs[t, b] = s
            sx[t, b] = d * np.float32(s)


@njit(cache=True, parallel=True)
def quantize_q8_256(x, qx, dx, bsum):
    """Quantize rows into 256-wide int8 blocks with 16-wide integer sums.

    Args:
        x: float32 (n, K), K a multiple of 256.
        qx: int8 (n, K) output quants.
        dx: float32 (n, K // 256) output scales.
        bsum: int32 (n, K // 16) output: sum of each 16 consecutive quants.
    """
    n, K = x.shape
    for t in prange(n):
        xr = x[t]
        qr = qx[t]
        for b in range(K // 256):
            dx[t, b] = _quantize_block(xr, qr, b * 256, 256)
        for j in range(K // 16):
            s = 0
            for i in range(j * 16, j * 16 + 16):
                s += qr[i]
            bsum[t, j] = s
