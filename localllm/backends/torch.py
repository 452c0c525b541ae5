"""The torch backend: layers on a torch device, CUDA when present, else the CPU (where it
stands in for a GPU in tests).

Weights stay as their GGUF blocks on the device; a matmul dequantizes them (bit-exact with
the numpy reference) in chunks of rows into scratch and multiplies in the compute type:
float16 on CUDA, float32 on the CPU. Activations between operations are float32. KV pages
live on the device in every KV type (torch_kv.py), q8_0 and q4_0 Hadamard-rotated as the CPU
backend's; attention gathers each sequence's pages through its block table per call (the part
shared with MLX is device.py's). Results are not batch-invariant (a GPU GEMM's reduction order
depends on its shape), unlike the CPU backend's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from localllm.formats.quants import row_nbytes

from . import torch_kv
from .base import MemoryInfo, RopeSpec
from .device import GELU_K1, GELU_K3, DeviceBackend, DeviceKVPages
from .host import AttentionPlan
from .torch_quant import dequantize_rows

# Elements of a weight dequantized at once: bounds the scratch (a 262k-row output head is
# done in slices).
SCRATCH_ELEMS = 1 << 22
# Bytes the scratch takes per element while a slice is dequantized and multiplied: the
# float32 result and its float quants (8), the integer unpacking temporaries (~2), and the
# compute-type copy where it is not float32.
_SCRATCH_PER_ELEM = 10


@dataclass
class TorchMatrix:
    """A weight matrix (N out, K in) as its GGUF rows, uint8 (N, row_bytes), on the device."""
    type_name: str
    N: int
    K: int
    rows: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.rows.numel()


@dataclass
class TorchEmbedding:
    """A token embedding table as GGUF rows on the device, dequantized on lookup."""
    type_name: str
    rows: torch.Tensor
    dim: int


def cuda_available() -> bool:
    """Whether torch sees a CUDA device."""
    return torch.cuda.is_available()


class TorchBackend(DeviceBackend):
    """Backend on a torch device."""

    name = "torch"

    def __init__(self, device: str | None = None,
                 compute_dtype: torch.dtype | None = None, scratch_elems: int = SCRATCH_ELEMS):
        """Args:
            device: a torch device name; None: 'cuda' when available, else 'cpu'.
            compute_dtype: matmul type; None: float16 on CUDA, float32 on the CPU.
            scratch_elems: weight elements dequantized at once.
        """
        super().__init__()
        self.torch_device = torch.device(device or ("cuda" if cuda_available() else "cpu"))
        if self.torch_device.type == "cuda" and self.torch_device.index is None:
            self.torch_device = torch.device("cuda", torch.cuda.current_device())
        self.device = str(self.torch_device)
        self.dtype = compute_dtype or (torch.float16 if self.torch_device.type == "cuda"
                                       else torch.float32)
        self.scratch_elems = int(scratch_elems)

    # ---- array hooks (device.py) -----------------------------------------------------

    def _indices(self, values):
        return torch.as_tensor(np.asarray(values, np.int64), device=self.torch_device)

    def _floats(self, values):
        return torch.as_tensor(np.asarray(values, np.float32)).to(self.torch_device)

    def _nbytes(self, a):
        return a.numel() * a.element_size()

    def _rotate(self, x):
        return torch_kv.rotate(x)

    def _exp(self, x):
        return torch.exp(x)

    def _gelu_exp(self, gate):
        g = gate.double()  # float64 inside, as the CPU kernel's tanh-GELU
        return torch.exp(g * (GELU_K1 + GELU_K3 * g * g)).float()

    def _clip(self, x, lo, hi):
        return torch.clamp(x, min=lo, max=hi)

    def _embedding_rows(self, table: TorchEmbedding, idx):
        return dequantize_rows(table.rows[idx], table.type_name, table.dim)

    def _concat(self, parts):
        return torch.cat(list(parts), 0)

    def _kv_store(self, kv_type, n_slots, n_kv, hd):
        return torch_kv.KVStore(kv_type, n_slots, n_kv, hd, self.torch_device)

    def _attend(self, q3, pages: DeviceKVPages, plan: AttentionPlan, n_heads, scale,
                sinks=None):
        n, _, hd = q3.shape
        dev = self.torch_device
        out = torch.empty((n, n_heads, hd), dtype=torch.float32, device=dev)
        G = n_heads // pages.layout.n_kv_heads
        for sq in plan.seqs:
            rows = torch.from_numpy(sq.rows).to(dev)
            slots = torch.from_numpy(sq.slots).to(dev)
            K = pages.k.read(slots).permute(1, 0, 2).repeat_interleave(G, dim=0)  # (H, L, hd)
            V = pages.v.read(slots).permute(1, 0, 2).repeat_interleave(G, dim=0)
            qs = q3[rows].permute(1, 0, 2)                                         # (H, n_s, hd)
            mask = torch.from_numpy(sq.mask).to(dev)
            scores = (qs @ K.transpose(1, 2)) * scale
            scores = scores.masked_fill(~mask, -math.inf)
            if sinks is not None:  # one more logit per row, with no value
                L = scores.shape[-1]
                sk = sinks[:, None, None].expand(-1, scores.shape[1], 1)
                p = torch.softmax(torch.cat([scores, sk], -1), dim=-1)[..., :L]
            else:
                p = torch.softmax(scores, dim=-1)
            out[rows] = (p @ V).permute(1, 0, 2)
        return out

    # ---- memory ----------------------------------------------------------------------

    def memory_info(self) -> MemoryInfo:
        if self.torch_device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.torch_device)
            return MemoryInfo(self.device, int(free), int(total))
        import psutil
        vm = psutil.virtual_memory()
        return MemoryInfo("host", int(vm.available), int(vm.total))

    def plan_matrix_nbytes(self, type_name: str, N: int, K: int) -> int:
        return N * row_nbytes(type_name, K)

    def plan_scratch_nbytes(self, largest: int) -> int:
        extra = 0 if self.dtype == torch.float32 else torch.finfo(self.dtype).bits // 8
        return min(largest, self.scratch_elems) * (_SCRATCH_PER_ELEM + extra)

    # ---- weights ---------------------------------------------------------------------

    def _to_device(self, raw: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True)).to(self.torch_device)
        self._held += t.numel()
        return t

    def upload_matrix(self, name, type_name, raw, N, K, done=None):
        rows = self._to_device(np.asarray(raw).reshape(N, row_nbytes(type_name, K)))
        if done is not None:
            done(0, N * row_nbytes(type_name, K))
        return TorchMatrix(type_name, N, K, rows)

    def upload_embedding(self, type_name, rows, dim):
        return TorchEmbedding(type_name, self._to_device(rows), dim)

    # ---- math ------------------------------------------------------------------------

    def rms_norm(self, x, weight, eps):
        # As the CPU backend: squares summed in float64, one float32 inverse, (x * inv) * w.
        ss = x.double().square().mean(-1, keepdim=True)
        inv = (1.0 / torch.sqrt(ss + eps)).float()
        return (x * inv) * weight

    def linear(self, x, weights, biases=None):
        xc = x.to(self.dtype)
        outs = []
        for i, w in enumerate(weights):
            y = torch.empty((x.shape[0], w.N), dtype=torch.float32, device=self.torch_device)
            step = max(1, self.scratch_elems // w.K)
            for r in range(0, w.N, step):
                wd = dequantize_rows(w.rows[r:r + step], w.type_name, w.K).to(self.dtype)
                y[:, r:r + step] = (xc @ wd.T).float()
            if biases is not None and biases[i] is not None:
                y += biases[i]
            outs.append(y)
        return outs

    def rope(self, x, n_heads, positions, spec: RopeSpec):
        c, s = self._rope.on_device(
            positions, spec, lambda a: torch.from_numpy(a).to(self.torch_device)[:, None, :])
        n = x.shape[0]
        y = x.reshape(n, n_heads, -1).clone()
        half = c.shape[2]
        if spec.neox:
            a, b = y[..., :half].clone(), y[..., half:2 * half].clone()
            y[..., :half] = a * c - b * s
            y[..., half:2 * half] = a * s + b * c
        else:
            a, b = y[..., 0:2 * half:2].clone(), y[..., 1:2 * half:2].clone()
            y[..., 0:2 * half:2] = a * c - b * s
            y[..., 1:2 * half:2] = b * c + a * s
        return y.reshape(n, -1)

    def add(self, x, y):
        return x.add_(y)

    def layer_norm(self, x, weight, bias, eps):
        # As the CPU backend: mean and variance in float64, the scaling in float32.
        xd = x.double()
        mean = xd.mean(-1, keepdim=True)
        inv = (1.0 / torch.sqrt((xd - mean).square().mean(-1, keepdim=True) + eps)).float()
        y = (x - mean.float()) * inv * weight
        return y + bias if bias is not None else y

    def encoder_attention(self, q, k, v, starts, n_heads, scale):
        hd = q.shape[1] // n_heads
        group = n_heads // (k.shape[1] // hd)
        out = torch.empty_like(q)
        for a, b in zip(starts[:-1], starts[1:]):
            a, b = int(a), int(b)
            L = b - a
            q3 = q[a:b].reshape(L, n_heads, hd).transpose(0, 1)
            k3 = k[a:b].reshape(L, -1, hd).transpose(0, 1).repeat_interleave(group, 0)
            v3 = v[a:b].reshape(L, -1, hd).transpose(0, 1).repeat_interleave(group, 0)
            w = torch.softmax((q3 @ k3.transpose(1, 2)) * scale, -1)
            out[a:b] = (w @ v3).transpose(0, 1).reshape(L, -1)
        return out

    def to_numpy(self, x):
        # A copy: on the CPU device .numpy() would share memory that later in-place adds
        # change.
        y = x.float().cpu()
        return y.numpy().copy() if y.data_ptr() == x.data_ptr() else y.numpy()

    def from_numpy(self, x):
        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        return t.to(self.torch_device, copy=True)  # never the caller's memory

    def logsumexp(self, logits) -> float:
        return float(torch.logsumexp(torch.from_numpy(np.asarray(logits, np.float32)), 0))
