"""The MLX backend: layers on Metal on Apple Silicon, or on MLX's CPU device elsewhere (where
it stands in for the GPU in tests).

Weights in formats that map exactly onto MLX's affine quantization stay quantized and run
through mx.quantized_matmul (mlx_quant.py); the others are quantized again by MLX. Compute
and scales are float32, which keeps the exact mappings exact. KV pages are MLX arrays in
every KV type (mlx_kv.py), q8_0 and q4_0 Hadamard-rotated as the CPU backend's; attention
gathers each sequence's pages per call (the part shared with torch is device.py's).
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from localllm.formats.quants import row_nbytes

from . import mlx_kv, mlx_quant
from .base import MemoryInfo, RopeSpec
from .device import GELU_K1, GELU_K3, DeviceBackend, DeviceKVPages
from .host import AttentionPlan


@dataclass
class MlxMatrix:
    """A weight matrix (N out, K in): quantized (wq, scales, biases at ``bits``) or dense."""
    type_name: str
    N: int
    K: int
    bits: int               # 0: dense float ``w``
    wq: mx.array | None
    scales: mx.array | None
    biases: mx.array | None
    w: mx.array | None = None
    mode: str = "affine"    # MLX's quantization mode: "affine" or "mxfp4" (no biases)

    @property
    def nbytes(self) -> int:
        if self.bits == 0:
            return self.w.nbytes
        return self.wq.nbytes + self.scales.nbytes + (0 if self.biases is None else self.biases.nbytes)


def metal_available() -> bool:
    """Whether MLX can use a Metal GPU."""
    return mx.metal.is_available()


def on_apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def convert(raw: np.ndarray, type_name: str, N: int, K: int,
            convert_bits: dict | None = None) -> MlxMatrix:
    """A GGUF matrix in the MLX backend's form (see mlx_quant); ``convert_bits`` overrides
    mlx_quant.CONVERT_BITS for the formats MLX cannot hold exactly."""
    if type_name in mlx_quant.EXACT:
        p = mlx_quant.to_mlx_exact(raw, type_name, N, K)
        return MlxMatrix(type_name, N, K, p.bits, mx.array(p.wq), mx.array(p.scales),
                         mx.array(p.biases))
    if type_name == mlx_quant.MXFP4:
        wq, scales = mlx_quant.to_mlx_mxfp4(raw, N, K)
        return MlxMatrix(type_name, N, K, 4, mx.array(wq), mx.array(scales), None, mode="mxfp4")
    if type_name in mlx_quant.FLOAT:
        dtype = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}[type_name]
        rows = [mx.array(r).astype(dtype) for r in mlx_quant.dequantized_rows(raw, type_name,
                                                                             N, K)]
        return MlxMatrix(type_name, N, K, 0, None, None, None, mx.concatenate(rows))
    bits = (convert_bits or mlx_quant.CONVERT_BITS)[type_name]
    parts = []
    for rows in mlx_quant.dequantized_rows(raw, type_name, N, K):
        part = mx.quantize(mx.array(rows), group_size=mlx_quant.GROUP, bits=bits)
        mx.eval(part)
        parts.append(part)
    wq, scales, biases = (mx.concatenate([p[i] for p in parts]) for i in range(3))
    return MlxMatrix(type_name, N, K, bits, wq, scales, biases)


def dequantize(w: MlxMatrix, rows: mx.array | None = None) -> mx.array:
    """The matrix (or some of its rows) as float32, as MLX computes with it."""
    if w.bits == 0:
        return (w.w if rows is None else w.w[rows]).astype(mx.float32)
    wq, s, b = (w.wq, w.scales, w.biases) if rows is None else (
        w.wq[rows], w.scales[rows], None if w.biases is None else w.biases[rows])
    return mx.dequantize(wq, s, b, group_size=mlx_quant.GROUP, bits=w.bits, mode=w.mode,
                         dtype=mx.float32)


class MlxBackend(DeviceBackend):
    """Backend on MLX's default device (Metal when available)."""

    name = "mlx"

    def __init__(self, convert_bits: dict | None = None):
        """Args:
            convert_bits: MLX bits per converted format (None: mlx_quant.CONVERT_BITS).

        It computes on MLX's default device: the GPU where Metal is available.
        """
        super().__init__()
        self.convert_bits = dict(convert_bits or mlx_quant.CONVERT_BITS)
        self.gpu = mx.default_device() == mx.gpu
        self.device = "metal" if self.gpu else "mlx-cpu"

    # ---- array hooks (device.py) -----------------------------------------------------

    def _indices(self, values):
        return mx.array(np.asarray(values, np.int32))

    def _floats(self, values):
        return mx.array(np.asarray(values, np.float32))

    def _nbytes(self, a):
        return a.nbytes

    def _rotate(self, x):
        return mlx_kv.rotate(x)

    def _exp(self, x):
        return mx.exp(x)

    def _gelu_exp(self, gate):
        return mx.exp(gate * (GELU_K1 + GELU_K3 * gate * gate))

    def _clip(self, x, lo, hi):
        return mx.minimum(x, hi) if lo is None else mx.clip(x, lo, hi)

    def _embedding_rows(self, table: MlxMatrix, idx):
        return dequantize(table, idx)

    def _concat(self, parts):
        return mx.concatenate(list(parts), 0)

    def _kv_store(self, kv_type, n_slots, n_kv, hd):
        return mlx_kv.KVStore(kv_type, n_slots, n_kv, hd)

    def _attend(self, q3, pages: DeviceKVPages, plan: AttentionPlan, n_heads, scale,
                sinks=None):
        n, _, hd = q3.shape
        n_kv = pages.layout.n_kv_heads
        G = n_heads // n_kv
        parts = []
        for sq in plan.seqs:
            slots = mx.array(sq.slots.astype(np.int32))
            K = pages.k.read(slots).transpose(1, 0, 2)                     # (n_kv, L, hd)
            V = pages.v.read(slots).transpose(1, 0, 2)
            n_s = len(sq.rows)
            qs = q3[mx.array(sq.rows.astype(np.int32))].transpose(1, 0, 2)  # (H, n_s, hd)
            qs = qs.reshape(n_kv, G * n_s, hd)
            scores = (qs @ K.transpose(0, 2, 1)).reshape(n_kv, G, n_s, -1) * scale
            scores = mx.where(mx.array(sq.mask), scores, -math.inf)
            if sinks is not None:  # one more logit per row, with no value
                L = scores.shape[-1]
                sk = mx.broadcast_to(sinks.reshape(n_kv, G, 1, 1), (n_kv, G, n_s, 1))
                p = mx.softmax(mx.concatenate([scores, sk], -1), axis=-1)[..., :L]
            else:
                p = mx.softmax(scores, axis=-1)
            p = p.reshape(n_kv, G * n_s, -1)
            o = (p @ V).reshape(n_heads, n_s, hd).transpose(1, 0, 2)
            parts.append((sq.rows, o))
        if len(parts) == 1 and len(parts[0][0]) == n:
            return parts[0][1][mx.array(np.argsort(parts[0][0]).astype(np.int32))]
        out = mx.zeros((n, n_heads, hd), dtype=mx.float32)
        for rows, o in parts:
            out[mx.array(rows.astype(np.int32))] = o
        return out

    # ---- memory ----------------------------------------------------------------------

    def memory_info(self) -> MemoryInfo:
        # Apple Silicon's GPU memory is the host's: one pool, capped by Metal's working set.
        import psutil
        vm = psutil.virtual_memory()
        free = int(vm.available)
        if self.gpu:
            limit = int(mx.device_info().get("max_recommended_working_set_size", free))
            free = min(free, limit - int(mx.get_active_memory()))
        return MemoryInfo("host", free, int(vm.total))

    def plan_matrix_nbytes(self, type_name: str, N: int, K: int) -> int:
        return mlx_quant.packed_nbytes(type_name, N, K, self.convert_bits)

    def plan_scratch_nbytes(self, largest: int) -> int:
        return 0  # quantized_matmul reads the packed weights directly

    # ---- weights ---------------------------------------------------------------------

    def upload_matrix(self, name, type_name, raw, N, K, done=None):
        w = convert(raw, type_name, N, K, self.convert_bits)
        mx.eval(*(a for a in (w.wq, w.scales, w.biases, w.w) if a is not None))
        if done is not None:
            done(0, N * row_nbytes(type_name, K))
        self._held += w.nbytes
        return w

    def upload_embedding(self, type_name, rows, dim):
        w = convert(np.asarray(rows).reshape(-1), type_name, rows.shape[0], dim,
                    self.convert_bits)
        self._held += w.nbytes
        return w

    # ---- math ------------------------------------------------------------------------

    def rms_norm(self, x, weight, eps):
        inv = mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + eps)
        return (x * inv) * weight

    def linear(self, x, weights, biases=None):
        outs = []
        for i, w in enumerate(weights):
            if w.bits == 0:
                y = x @ w.w.astype(mx.float32).T
            else:
                y = mx.quantized_matmul(x, w.wq, w.scales, w.biases, transpose=True,
                                        group_size=mlx_quant.GROUP, bits=w.bits, mode=w.mode)
            if biases is not None and biases[i] is not None:
                y = y + biases[i]
            outs.append(y)
        return outs

    def rope(self, x, n_heads, positions, spec: RopeSpec):
        c, s = self._rope.on_device(positions, spec, lambda a: mx.array(a)[:, None, :])
        n = x.shape[0]
        y = x.reshape(n, n_heads, -1)
        half = c.shape[2]
        rest = y[..., 2 * half:]
        if spec.neox:
            a, b = y[..., :half], y[..., half:2 * half]
            rot = [a * c - b * s, a * s + b * c]
        else:
            pairs = y[..., :2 * half].reshape(n, n_heads, half, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            rot = [mx.stack([a * c - b * s, b * c + a * s], axis=-1).reshape(n, n_heads, -1)]
        return mx.concatenate(rot + [rest], axis=-1).reshape(n, -1)

    def add(self, x, y):
        return x + y

    def layer_norm(self, x, weight, bias, eps):
        mean = mx.mean(x, axis=-1, keepdims=True)
        d = x - mean
        y = d * mx.rsqrt(mx.mean(mx.square(d), axis=-1, keepdims=True) + eps) * weight
        return y + bias if bias is not None else y

    def encoder_attention(self, q, k, v, starts, n_heads, scale):
        hd = q.shape[1] // n_heads
        group = n_heads // (k.shape[1] // hd)
        parts = []
        for a, b in zip(starts[:-1], starts[1:]):
            a, b = int(a), int(b)
            L = b - a
            q3 = q[a:b].reshape(L, n_heads, hd).transpose(1, 0, 2)
            k3 = mx.repeat(k[a:b].reshape(L, -1, hd).transpose(1, 0, 2), group, axis=0)
            v3 = mx.repeat(v[a:b].reshape(L, -1, hd).transpose(1, 0, 2), group, axis=0)
            w = mx.softmax((q3 @ k3.transpose(0, 2, 1)) * scale, axis=-1)
            parts.append((w @ v3).transpose(1, 0, 2).reshape(L, -1))
        return mx.concatenate(parts, axis=0)

    def to_numpy(self, x):
        return np.array(x.astype(mx.float32), copy=True)

    def from_numpy(self, x):
        return mx.array(np.ascontiguousarray(x, dtype=np.float32))

    def logsumexp(self, logits) -> float:
        return float(mx.logsumexp(mx.array(np.asarray(logits, np.float32))).item())
