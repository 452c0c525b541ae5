"""KV pages of a layer on a torch device, in every KV type, with the CPU backend's rounding
(kernels/kvpages.py): f16 and bf16 nearest-even, fp8 E4M3 nearest-even saturating at 448
(NaN stored as 0), q8_0 and q4_0 in llama.cpp's blocks of 32 dims with f16 scales (q4_0's
scale chosen as the CPU pages choose it), both holding Hadamard-rotated vectors (``rotate``).

A page array is token-major: slot ``block * block_size + offset`` holds one token's
(n_kv_heads, head_dim) keys or values, so a sequence's keys are one gather of its slots.
"""

from __future__ import annotations

import torch

from localllm.kernels.kvpages import check_head_dim

from .base import KVLayout
from .host import DeviceKVPages, hadamard, q4_0_blocks

QBLOCK = 32  # dims per scale of q8_0 / q4_0
FP8_MAX = 448.0
_FLOAT_TYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def _q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., hd) float32 -> int8 quants and f16 scales (..., hd / 32): d = amax / 127,
    q = round(x / d) with ties away from zero, in the CPU backend's float32 steps."""
    b = x.reshape(*x.shape[:-1], -1, QBLOCK)
    d = b.abs().amax(-1, keepdim=True) / 127.0
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    y = b * inv
    q = torch.where(y >= 0, torch.floor(y + 0.5), -torch.floor(-y + 0.5))
    return q.to(torch.int8).reshape(x.shape), d.squeeze(-1).to(torch.float16)


def _q4_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., hd) float32 -> packed nibbles (..., hd / 2) and f16 scales, the CPU pages' own
    blocks (host.q4_0_blocks); byte i of a block holds dims i (low nibble) and i + 16."""
    codes, d = q4_0_blocks(x.detach().cpu().numpy().reshape(-1, QBLOCK))
    q = torch.from_numpy(codes).to(x.device).reshape(*x.shape[:-1], -1, QBLOCK)
    packed = q[..., :16] | (q[..., 16:] << 4)
    scale = torch.from_numpy(d).to(x.device).reshape(*x.shape[:-1], -1)
    return packed.reshape(*x.shape[:-1], -1), scale


def rotate(x: torch.Tensor) -> torch.Tensor:
    """The CPU pages' Hadamard rotation of each (..., hd) vector (host.hadamard)."""
    return hadamard(x, lambda a, b: torch.stack((a, b), dim=-2))


class KVStore:
    """One side (keys or values) of a layer's pages in one KV type."""

    def __init__(self, kv_type: str, n_slots: int, n_kv: int, hd: int, device):
        self.kv_type = kv_type
        self.scale = None
        if kv_type in _FLOAT_TYPES:
            self.data = torch.zeros((n_slots, n_kv, hd), dtype=_FLOAT_TYPES[kv_type],
                                    device=device)
        else:
            width = hd if kv_type == "q8_0" else hd // 2
            dtype = torch.int8 if kv_type == "q8_0" else torch.uint8
            self.data = torch.zeros((n_slots, n_kv, width), dtype=dtype, device=device)
            self.scale = torch.zeros((n_slots, n_kv, hd // QBLOCK), dtype=torch.float16,
                                     device=device)

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        if self.scale is not None:
            n += self.scale.numel() * self.scale.element_size()
        return n

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Store x (n, n_kv, hd) float32 at slots (n,), rounded to the KV type."""
        t = self.kv_type
        if t == "fp8":
            x = torch.nan_to_num(x, nan=0.0).clamp(-FP8_MAX, FP8_MAX)
        if t in _FLOAT_TYPES:
            self.data[slots] = x.to(self.data.dtype)
            return
        q, d = (_q8_0 if t == "q8_0" else _q4_0)(x.float())
        self.data[slots] = q
        self.scale[slots] = d

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The stored vectors at slots as float32 (len(slots), n_kv, hd), widened exactly."""
        if self.scale is None:
            return self.data[slots].float()
        q = self.data[slots]
        if self.kv_type == "q4_0":
            q = torch.cat([(q.reshape(*q.shape[:-1], -1, 16) & 0x0F),
                           (q.reshape(*q.shape[:-1], -1, 16) >> 4)], dim=-1)
            q = q.reshape(*q.shape[:-2], -1).float() - 8.0
        else:
            q = q.float()
        s = self.scale[slots].float().repeat_interleave(QBLOCK, dim=-1)
        return q * s

    def read_numpy(self, start: int, stop: int):
        """Slots start..stop-1 as float32 numpy."""
        return self.read(torch.arange(start, stop, device=self.data.device)).cpu().numpy()

    def copy(self, src: slice, dst: slice) -> None:
        self.data[dst] = self.data[src]
        if self.scale is not None:
            self.scale[dst] = self.scale[src]


def new_pages(layout: KVLayout, n_blocks: int, device) -> DeviceKVPages:
    """Zeroed pages for n_blocks blocks (zeros: a masked slot never holds NaN)."""
    for t in (layout.k_type, layout.v_type):
        check_head_dim(t, layout.head_dim)
    n = n_blocks * layout.block_size
    return DeviceKVPages(layout,
                        KVStore(layout.k_type, n, layout.n_kv_heads, layout.head_dim, device),
                        KVStore(layout.v_type, n, layout.n_kv_heads, layout.head_dim, device))
