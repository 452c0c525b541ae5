"""KV pages of a layer on a torch device, in every KV type, with the CPU backend's rounding
(kernels/kvpages.py): f16 and bf16 nearest-even, fp8 E4M3 nearest-even saturating at 448
(NaN stored as 0), q8_0 and q4_0 in llama.cpp's blocks of 32 dims with f16 scales (q4_0's
scale chosen as the CPU pages choose it), both holding Hadamard-rotated vectors (``rotate``).
The layout and the read and write paths are device.py's; this fills in torch's arrays.
"""

from __future__ import annotations

import torch

from .device import FP8_MAX, QBLOCK, DeviceKVStore
from .host import hadamard, q4_0_blocks

_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn,
           "int8": torch.int8, "uint8": torch.uint8}


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


class KVStore(DeviceKVStore):
    """One side (keys or values) of a layer's pages in one KV type, on a torch device."""

    def __init__(self, kv_type: str, n_slots: int, n_kv: int, hd: int, device: torch.device):
        self.torch_device = device
        super().__init__(kv_type, n_slots, n_kv, hd)

    def _zeros(self, shape, kind):
        return torch.zeros(shape, dtype=_DTYPES[kind], device=self.torch_device)

    def _nbytes(self, a):
        return a.numel() * a.element_size()

    def _store_float(self, x):
        if self.kv_type == "fp8":
            x = torch.nan_to_num(x, nan=0.0).clamp(-FP8_MAX, FP8_MAX)
        return x.to(self.data.dtype)

    def _load_float(self, q):
        return q.float()

    def _quantize(self, x):
        return (_q8_0 if self.kv_type == "q8_0" else _q4_0)(x.float())

    def _dequantize(self, q, s):
        if self.kv_type == "q4_0":
            g = q.reshape(*q.shape[:-1], -1, 16)
            q = torch.cat([g & 0x0F, g >> 4], dim=-1).reshape(*q.shape[:-1], -1).float() - 8.0
        else:
            q = q.float()
        return q * s.float().repeat_interleave(QBLOCK, dim=-1)

    def _slots(self, start, stop):
        return torch.arange(start, stop, device=self.torch_device)

    def _to_numpy(self, x):
        return x.cpu().numpy()
