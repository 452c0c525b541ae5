"""Activation quantization: float rows to int8 blocks, once per matmul input.

The arithmetic is llama.cpp's (facts of its Q8_0/Q8_1/Q8_K activation formats: the scale
max/127 stored as f16, quants round(x * 127/max) to nearest-even; for Q8_K the scale is
-max/127 in float32 with the signed extreme mapped to -127), so the two engines see the same
integers and differ only in summation order.
"""

import math

import numpy as np
from numba import njit, prange


@njit(cache=True, inline="always")
def round_f16(v):
    """The float16 value nearest to ``v`` (ties to even), returned as float32."""
    a = abs(np.float64(v))
    if a >= 65520.0:
        return np.float32(math.copysign(math.inf, v))
    if a < 6.103515625e-05:  # f16 subnormal range: a fixed step of 2**-24
        q = 5.960464477539063e-08
    else:
        e = math.frexp(a)[1]
        q = math.ldexp(1.0, e - 11)
    return np.float32(np.rint(np.float64(v) / q) * q)


@njit(cache=True, parallel=True)
def quantize_q8_32(x, qx, dx, xs, sx):
    """Quantize rows into 32-wide int8 blocks (llama.cpp's Q8_0 / Q8_1 arithmetic).

    Args:
        x: float32 (n, K), K a multiple of 32.
        qx: int8 (n, K) output quants.
        dx: float32 (n, K // 32) output scales (max |x| / 127, rounded to f16).
        xs: int32 (n, K // 32) output: the block's sum of quants.
        sx: float32 (n, K // 32) output: (unrounded scale) * sum, rounded to f16.
    """
    n, K = x.shape
    for t in prange(n):
        xr = x[t]
        qr = qx[t]
        for b in range(K // 32):
            s0 = b * 32
            amax = np.float32(0.0)
            for i in range(s0, s0 + 32):
                amax = max(amax, abs(xr[i]))
            d = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            s = 0
            for i in range(s0, s0 + 32):
                q = np.int32(np.rint(xr[i] * inv))
                qr[i] = q
                s += q
            dx[t, b] = round_f16(d)
            xs[t, b] = s
            sx[t, b] = round_f16(d * np.float32(s))


@njit(cache=True, parallel=True)
def quantize_q8_256(x, qx, dx, bsum):
    """Quantize rows into 256-wide int8 blocks with 16-wide sums (llama.cpp's Q8_K).

    Args:
        x: float32 (n, K), K a multiple of 256.
        qx: int8 (n, K) output quants.
        dx: float32 (n, K // 256) output scales (may be negative).
        bsum: int32 (n, K // 16) output: sum of each 16 consecutive quants.
    """
    n, K = x.shape
    for t in prange(n):
        xr = x[t]
        qr = qx[t]
        for b in range(K // 256):
            s0 = b * 256
            amax = np.float32(0.0)
            vmax = np.float32(0.0)
            for i in range(s0, s0 + 256):
                a = abs(xr[i])
                if a > amax:
                    amax = a
                    vmax = xr[i]
            if amax == 0:
                dx[t, b] = 0.0
                for i in range(s0, s0 + 256):
                    qr[i] = 0
            else:
                iscale = np.float32(-127.0) / vmax
                for i in range(s0, s0 + 256):
                    qr[i] = min(np.int32(127), np.int32(np.rint(iscale * xr[i])))
                dx[t, b] = np.float32(1.0) / iscale
        for j in range(K // 16):
            s = 0
            for i in range(j * 16, j * 16 + 16):
                s += qr[i]
            bsum[t, j] = s
