"""KV pages of a layer as MLX arrays, in every KV type, with the CPU backend's rounding
(kernels/kvpages.py): f16 and bf16 nearest-even, fp8 E4M3 nearest-even saturating at 448
(NaN stored as 0; MLX has no fp8 type, so the codes are uint8), q8_0 and q4_0 in llama.cpp's
blocks of 32 dims with f16 scales (q4_0's scale chosen as the CPU pages choose it), both
holding Hadamard-rotated vectors (``rotate``). Token-major, as the torch backend's
(torch_kv.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from localllm.kernels.kvpages import check_head_dim

from .base import KVLayout
from .host import DeviceKVPages, hadamard, q4_0_blocks

QBLOCK = 32
FP8_MAX = 448.0
_FLOAT_TYPES = {"f16": mx.float16, "bf16": mx.bfloat16}


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


class KVStore:
    """One side (keys or values) of a layer's pages in one KV type."""

    def __init__(self, kv_type: str, n_slots: int, n_kv: int, hd: int):
        self.kv_type = kv_type
        self.scale = None
        if kv_type in _FLOAT_TYPES:
            self.data = mx.zeros((n_slots, n_kv, hd), dtype=_FLOAT_TYPES[kv_type])
        elif kv_type == "fp8":
            self.data = mx.zeros((n_slots, n_kv, hd), dtype=mx.uint8)
        else:
            width = hd if kv_type == "q8_0" else hd // 2
            dtype = mx.int8 if kv_type == "q8_0" else mx.uint8
            self.data = mx.zeros((n_slots, n_kv, width), dtype=dtype)
            self.scale = mx.zeros((n_slots, n_kv, hd // QBLOCK), dtype=mx.float16)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    def write(self, slots: mx.array, x: mx.array) -> None:
        """Store x (n, n_kv, hd) float32 at slots (n,), rounded to the KV type."""
        t = self.kv_type
        if t in _FLOAT_TYPES:
            self.data[slots] = x.astype(self.data.dtype)
        elif t == "fp8":
            x = mx.clip(mx.where(mx.isnan(x), 0.0, x), -FP8_MAX, FP8_MAX)
            self.data[slots] = mx.to_fp8(x)
        else:
            q, d = (_q8_0 if t == "q8_0" else _q4_0)(x.astype(mx.float32))
            self.data[slots] = q
            self.scale[slots] = d

    def read(self, slots: mx.array) -> mx.array:
        """The stored vectors at slots as float32 (len(slots), n_kv, hd), widened exactly."""
        t = self.kv_type
        q = self.data[slots]
        if t in _FLOAT_TYPES:
            return q.astype(mx.float32)
        if t == "fp8":
            return mx.from_fp8(q, dtype=mx.float32)
        if t == "q4_0":
            g = q.reshape(*q.shape[:-1], -1, 16)
            q = mx.concatenate([g & 0x0F, g >> 4], axis=-1).reshape(*q.shape[:-1], -1)
            q = q.astype(mx.float32) - 8.0
        else:
            q = q.astype(mx.float32)
        s = mx.repeat(self.scale[slots].astype(mx.float32), QBLOCK, axis=-1)
        return q * s

    def read_numpy(self, start: int, stop: int):
        """Slots start..stop-1 as float32 numpy."""
        return np.array(self.read(mx.arange(start, stop)))

    def copy(self, src: mx.array, dst: mx.array) -> None:
        self.data[dst] = self.data[src]
        if self.scale is not None:
            self.scale[dst] = self.scale[src]


def new_pages(layout: KVLayout, n_blocks: int) -> DeviceKVPages:
    """Zeroed pages for n_blocks blocks (MLX allocates them when first evaluated)."""
    for t in (layout.k_type, layout.v_type):
        check_head_dim(t, layout.head_dim)
    n = n_blocks * layout.block_size
    return DeviceKVPages(layout, KVStore(layout.k_type, n, layout.n_kv_heads, layout.head_dim),
                      KVStore(layout.v_type, n, layout.n_kv_heads, layout.head_dim))
