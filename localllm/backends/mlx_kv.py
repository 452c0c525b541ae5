"""KV pages of a layer as MLX arrays, in every KV type, with the CPU backend's rounding
(kernels/kvpages.py): f16 and bf16 nearest-even, fp8 E4M3 nearest-even saturating at 448
(NaN stored as 0; MLX has no fp8 type, so the codes are uint8), q8_0 and q4_0 in llama.cpp's
blocks of 32 dims with f16 scales (q4_0's scale chosen as the CPU pages choose it), both
holding Hadamard-rotated vectors (``rotate``). The layout and the read and write paths are
device.py's, as the torch backend's (torch_kv.py); this fills in MLX's arrays.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .device import FP8_MAX, QBLOCK, DeviceKVStore
from .host import hadamard, q4_0_blocks

_DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16, "fp8": mx.uint8, "int8": mx.int8,
           "uint8": mx.uint8}


def _q8_0(x: mx.array) -> tuple[mx.array, mx.array]:
    """(..., hd) float32 -> int8 quants and f16 scales: d = amax / 127, q = round(x / d),
    ties away from zero, in the CPU backend's float32 steps."""
    b = x.reshape(*x.shape[:-1], -1, QBLOCK)
    d = mx.max(mx.abs(b), axis=-1, keepdims=True) / 127.0
    inv = mx.where(d != 0, 1.0 / d, 0.0)
    y = b * inv
    q = mx.where(y >= 0, mx.floor(y + 0.5), -mx.floor(-y + 0.5))
    return q.astype(mx.int8).reshape(x.shape), d.squeeze(-1).astype(mx.float16)


def _q4_0(x: mx.array) -> tuple[mx.array, mx.array]:
    """(..., hd) float32 -> packed nibbles (..., hd / 2) and f16 scales, the CPU pages' own
    blocks (host.q4_0_blocks); byte i of a block holds dims i (low nibble) and i + 16."""
    codes, d = q4_0_blocks(np.array(x).reshape(-1, QBLOCK))
    q = mx.array(codes).reshape(*x.shape[:-1], -1, QBLOCK)
    packed = q[..., :16] | (q[..., 16:] << 4)
    return packed.reshape(*x.shape[:-1], -1), mx.array(d).reshape(*x.shape[:-1], -1)


def rotate(x: mx.array) -> mx.array:
    """The CPU pages' Hadamard rotation of each (..., hd) vector (host.hadamard)."""
    return hadamard(x, lambda a, b: mx.stack((a, b), axis=-2))


class KVStore(DeviceKVStore):
    """One side (keys or values) of a layer's pages in one KV type, as MLX arrays (MLX
    allocates them when first evaluated)."""

    def _zeros(self, shape, kind):
        return mx.zeros(shape, dtype=_DTYPES[kind])

    def _nbytes(self, a):
        return a.nbytes

    def _store_float(self, x):
        if self.kv_type == "fp8":
            return mx.to_fp8(mx.clip(mx.where(mx.isnan(x), 0.0, x), -FP8_MAX, FP8_MAX))
        return x.astype(self.data.dtype)

    def _load_float(self, q):
        if self.kv_type == "fp8":
            return mx.from_fp8(q, dtype=mx.float32)
        return q.astype(mx.float32)

    def _quantize(self, x):
        return (_q8_0 if self.kv_type == "q8_0" else _q4_0)(x.astype(mx.float32))

    def _dequantize(self, q, s):
        if self.kv_type == "q4_0":
            g = q.reshape(*q.shape[:-1], -1, 16)
            q = mx.concatenate([g & 0x0F, g >> 4], axis=-1).reshape(*q.shape[:-1], -1)
            q = q.astype(mx.float32) - 8.0
        else:
            q = q.astype(mx.float32)
        return q * mx.repeat(s.astype(mx.float32), QBLOCK, axis=-1)

    def _slots(self, start, stop):
        return mx.arange(start, stop)

    def _to_numpy(self, x):
        return np.array(x)
