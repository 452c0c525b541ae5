"""Elementwise and per-row kernels: RMSNorm, RoPE, gated activations, residual adds.

Every row is computed on its own with a fixed operation order, so results never depend on
how many rows are processed together.
"""

import math

import numpy as np
from numba import njit, prange


@njit(cache=True, parallel=True)
def rms_norm(x, w, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, row by row.

    Args:
        x: float32 (n, D); w: float32 (D,); eps: float; out: float32 (n, D) (may alias x).
    """
    n, D = x.shape
    for t in prange(n):
        ss = np.float64(0.0)
        for i in range(D):
            v = np.float64(x[t, i])
            ss += v * v
        inv = np.float32(1.0 / math.sqrt(ss / D + eps))
        for i in range(D):
            out[t, i] = (x[t, i] * inv) * w[i]


@njit(cache=True, parallel=True)
def rms_norm_heads(x, w, eps):
    """In-place RMSNorm over the last axis of x (n, H, hd) with one weight (hd,) (QK-norm)."""
    n, H, hd = x.shape
    for t in prange(n):
        for h in range(H):
            ss = np.float64(0.0)
            for i in range(hd):
                v = np.float64(x[t, h, i])
                ss += v * v
            inv = np.float32(1.0 / math.sqrt(ss / hd + eps))
            for i in range(hd):
                x[t, h, i] = (x[t, h, i] * inv) * w[i]


def rope_tables(positions: np.ndarray, n_rot: int, theta: float, freq_factors=None,
                pos_scale: float = 1.0):
    """cos/sin tables for rotary embeddings.

    Args:
        positions: int (n,) token positions.
        n_rot: number of rotated dimensions (even).
        theta: frequency base.
        freq_factors: optional (n_rot // 2,) divisors of each frequency (rope_freqs tensor).
        pos_scale: linear position scaling (1 / scaling factor).
    Returns:
        (cos, sin): float32 (n, n_rot // 2) each.
    """
    i = np.arange(n_rot // 2, dtype=np.float64)
    inv_freq = theta ** (-2.0 * i / n_rot)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, np.float64)
    ang = (np.asarray(positions, np.float64) * pos_scale)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@njit(cache=True, parallel=True)
def rope(x, cos, sin, neox):
    """Rotate x (n, H, hd) in place by position; the first 2 * cos.shape[1] dims rotate.

    Args:
        neox: True pairs dim i with i + n_rot/2 (GPT-NeoX style); False pairs 2i with 2i+1.
    """
    n, H, hd = x.shape
    half = cos.shape[1]
    for t in prange(n):
        for h in range(H):
            for i in range(half):
                c = cos[t, i]
                s = sin[t, i]
                if neox:
                    a = x[t, h, i]
                    b = x[t, h, i + half]
                    x[t, h, i] = a * c - b * s
                    x[t, h, i + half] = a * s + b * c
                else:
                    a = x[t, h, 2 * i]
                    b = x[t, h, 2 * i + 1]
                    x[t, h, 2 * i] = a * c - b * s
                    x[t, h, 2 * i + 1] = a * s + b * c


@njit(cache=True, parallel=True)
def silu_mul(gate, up, out):
    """out = silu(gate) * up, elementwise over (n, F)."""
    n, F = gate.shape
    for t in prange(n):
        for i in range(F):
            g = gate[t, i]
            out[t, i] = (g / (np.float32(1.0) + np.exp(-g))) * up[t, i]


@njit(cache=True, parallel=True)
def gelu_tanh_mul(gate, up, out):
    """out = gelu_tanh(gate) * up, elementwise over (n, F)."""
    n, F = gate.shape
    c = np.float32(math.sqrt(2.0 / math.pi))
    for t in prange(n):
        for i in range(F):
            g = gate[t, i]
            inner = c * (g + np.float32(0.044715) * g * g * g)
            out[t, i] = (np.float32(0.5) * g * (np.float32(1.0) + np.tanh(inner))) * up[t, i]


@njit(cache=True)
def add_inplace(x, y):
    """x += y over (n, D)."""
    n, D = x.shape
    for t in range(n):
        for i in range(D):
            x[t, i] += y[t, i]
