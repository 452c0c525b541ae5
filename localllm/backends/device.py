"""The half the device backends (torch, MLX) share: attention over token-major KV pages,
the gated activations, embedding lookup and the KV page methods, written once over a few
array-library hooks that each backend (torch.py, mlx.py) and KV store (torch_kv, mlx_kv) fills.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from localllm.errors import UnsupportedModel
from localllm.formats.quants import row_nbytes
from localllm.kernels.ops import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from localllm.kernels.kvpages import check_head_dim

from .base import KVBatch, KVLayout
from .host import (AttentionPlan, PlanCache, RopeTables, copy_expert_halves, expert_biases,
                   kv_block_nbytes, kv_rotated, route_tokens)

QBLOCK = 32        # dims per scale of q8_0 / q4_0
FP8_MAX = 448.0    # E4M3's largest finite value: fp8 keys and values saturate there
QUANT_KV_TYPES = ("q8_0", "q4_0")
GELU_K1 = -2.0 * 0.7978845608028654  # -2 sqrt(2/pi)
GELU_K3 = GELU_K1 * 0.044715


class DeviceKVStore:
    """One side (keys or values) of a layer's pages in one KV type: ``data`` (n_slots, n_kv,
    width) and, for q8_0 and q4_0, f16 ``scale`` (n_slots, n_kv, hd / 32). Subclasses give
    the array library's storage and rounding; the layout and the paths are the same."""

    def __init__(self, kv_type: str, n_slots: int, n_kv: int, hd: int):
        self.kv_type = kv_type
        self.scale = None
        if kv_type in QUANT_KV_TYPES:
            width = hd if kv_type == "q8_0" else hd // 2   # q4_0: two dims a byte
            self.data = self._zeros((n_slots, n_kv, width),
                                    "int8" if kv_type == "q8_0" else "uint8")
            self.scale = self._zeros((n_slots, n_kv, hd // QBLOCK), "f16")
        else:
            self.data = self._zeros((n_slots, n_kv, hd), kv_type)

    # ---- hooks

    def _zeros(self, shape: tuple, kind: str) -> Any:
        """A zeroed array holding ``kind``: a float KV type ('f16', 'bf16', 'fp8') or a raw
        integer type ('int8', 'uint8')."""
        raise NotImplementedError

    def _nbytes(self, a: Any) -> int:
        raise NotImplementedError

    def _store_float(self, x: Any) -> Any:
        """float32 (n, n_kv, hd) in this side's float KV type, rounded as the CPU pages round."""
        raise NotImplementedError

    def _load_float(self, q: Any) -> Any:
        """Stored float codes widened exactly to float32."""
        raise NotImplementedError

    def _quantize(self, x: Any) -> tuple[Any, Any]:
        """float32 (..., hd) -> (quants as ``data`` holds them, f16 scales (..., hd / 32))."""
        raise NotImplementedError

    def _dequantize(self, q: Any, s: Any) -> Any:
        """Stored quants and scales (..., hd / 32) -> float32 (..., hd)."""
        raise NotImplementedError

    def _slots(self, start: int, stop: int) -> Any:
        raise NotImplementedError

    def _to_numpy(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    # ---- the store

    @property
    def nbytes(self) -> int:
        return self._nbytes(self.data) + (self._nbytes(self.scale) if self.scale is not None
                                          else 0)

    def write(self, slots: Any, x: Any) -> None:
        """Store x (n, n_kv, hd) float32 at slots (n,), rounded to the KV type."""
        if self.scale is None:
            self.data[slots] = self._store_float(x)
            return
        q, d = self._quantize(x)
        self.data[slots] = q
        self.scale[slots] = d

    def read(self, slots: Any) -> Any:
        """The stored vectors at slots as float32 (len(slots), n_kv, hd), widened exactly."""
        if self.scale is None:
            return self._load_float(self.data[slots])
        return self._dequantize(self.data[slots], self.scale[slots])

    def read_numpy(self, start: int, stop: int) -> np.ndarray:
        """Slots start..stop-1 as float32 numpy."""
        return self._to_numpy(self.read(self._slots(start, stop)))

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy slots src..src+n-1 to dst..dst+n-1."""
        self.data[dst:dst + n] = self.data[src:src + n]
        if self.scale is not None:
            self.scale[dst:dst + n] = self.scale[src:src + n]


@dataclass
class DeviceKVPages:
    """One layer's KV pages on a device backend: keys and values, each a DeviceKVStore of
    that backend (torch_kv, mlx_kv). A page array is token-major: slot ``block * block_size
    + offset`` holds one token's (n_kv_heads, head_dim), so a sequence's keys are one gather."""
    layout: KVLayout
    k: DeviceKVStore
    v: DeviceKVStore

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def n_blocks(self) -> int:
        return self.k.data.shape[0] // self.layout.block_size

    def read_block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of one block as float32 numpy (block_size, n_kv, hd) each, for
        inspection and tests."""
        bs = self.layout.block_size
        return (self.k.read_numpy(block * bs, (block + 1) * bs),
                self.v.read_numpy(block * bs, (block + 1) * bs))


def new_pages(layout: KVLayout, n_blocks: int,
              make_store: Callable[[str, int, int, int], DeviceKVStore]) -> DeviceKVPages:
    """Zeroed pages for n_blocks blocks (zeros: a masked slot never holds NaN).

    Args:
        layout: the layer's KV layout; n_blocks: blocks the pages hold.
        make_store: (kv_type, n_slots, n_kv_heads, head_dim) -> a store of the backend.
    Returns:
        The layer's DeviceKVPages.
    """
    for t in (layout.k_type, layout.v_type):
        check_head_dim(t, layout.head_dim)
    n = n_blocks * layout.block_size
    return DeviceKVPages(layout, make_store(layout.k_type, n, layout.n_kv_heads, layout.head_dim),
                         make_store(layout.v_type, n, layout.n_kv_heads, layout.head_dim))


@dataclass(frozen=True)
class DeviceExperts:
    """A layer's stack of expert matrices, each uploaded as the backend's matrix."""
    parts: tuple

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.parts)


class DeviceBackend:
    """What the torch and MLX backends do the same way. Subclasses set ``name`` and
    ``device``, call ``super().__init__()``, and fill the hooks (the ``_`` methods that raise
    NotImplementedError here) with their array library."""

    fused_blocks = False
    copies_weights = True
    recurrent = False  # no DeltaNet layers yet (models place them on the CPU or refuse)

    def __init__(self):
        self._rope = RopeTables()
        self._plans = PlanCache()
        self._held = 0

    # ---- hooks

    def _indices(self, values: Sequence[int]) -> Any:
        """Integer positions (numpy or a list) as an index array on the device."""
        raise NotImplementedError

    def _floats(self, values: Any) -> Any:
        """float32 values (numpy or a list) as a 1-D array on the device."""
        raise NotImplementedError

    def _nbytes(self, a: Any) -> int:
        raise NotImplementedError

    def _rotate(self, x: Any) -> Any:
        """The CPU pages' Hadamard rotation of each (..., hd) vector (host.hadamard)."""
        raise NotImplementedError

    def _exp(self, x: Any) -> Any:
        raise NotImplementedError

    def _gelu_exp(self, gate: Any) -> Any:
        """exp(gate * (k1 + k3 gate^2)), the tanh-GELU's exponential, as float32."""
        raise NotImplementedError

    def _clip(self, x: Any, lo: float | None, hi: float) -> Any:
        """x clamped to [lo, hi] elementwise (lo None: no lower bound)."""
        raise NotImplementedError

    def _embedding_rows(self, table: Any, idx: Any) -> Any:
        """Rows ``idx`` of an uploaded embedding as float32 (n, dim)."""
        raise NotImplementedError

    def _attend(self, q3: Any, pages: DeviceKVPages, plan: AttentionPlan, n_heads: int,
                scale: float, sinks: Any = None) -> Any:
        """Each sequence's queries (n, n_heads, hd) against the keys and values its plan
        gathers, as the CPU's softmax attention: (n, n_heads, hd) float32; ``sinks``: None
        or the heads' sink logits (n_heads,) on the device, in each softmax's denominator."""
        raise NotImplementedError

    def _kv_store(self, kv_type: str, n_slots: int, n_kv: int, hd: int) -> DeviceKVStore:
        raise NotImplementedError

    def _concat(self, parts: list) -> Any:
        """Arrays (n_i, d) stacked by rows."""
        raise NotImplementedError

    # ---- memory and weights

    def held_nbytes(self) -> int:
        return self._held

    def begin_model(self, gguf_path: Any) -> None:
        pass

    def end_model(self) -> None:
        pass

    def upload_vector(self, values: Any) -> Any:
        v = self._floats(np.ascontiguousarray(values, dtype=np.float32))
        self._held += self._nbytes(v)
        return v

    def matrix_nbytes(self, w: Any) -> int:
        return w.nbytes

    def plan_experts_nbytes(self, type_name: str, n_experts: int, N: int,
                            K: int) -> tuple[int, int]:
        return n_experts * self.plan_matrix_nbytes(type_name, N, K), 0  # copied to the device

    def upload_experts(self, name: str, type_name: str, raw: Any, n_experts: int, N: int,
                       K: int, done: Any = None) -> DeviceExperts:
        per = N * row_nbytes(type_name, K)
        raw = np.asarray(raw).reshape(-1)
        parts = tuple(self.upload_matrix(f"{name}#{e}", type_name, raw[e * per:(e + 1) * per],
                                         N, K) for e in range(n_experts))
        if done is not None:
            done(0, n_experts * per)
        return DeviceExperts(parts)

    def upload_expert_halves(self, name: str, type_name: str, raw: Any, n_experts: int,
                             N: int, K: int, done: Any = None) -> tuple:
        return copy_expert_halves(self, name, type_name, raw, n_experts, N, K, done)

    # ---- math

    def embed(self, table: Any, ids: Sequence[int], scale: float = 1.0) -> Any:
        x = self._embedding_rows(table, self._indices(ids))
        return x * np.float32(scale) if scale != 1.0 else x

    def head_norm(self, x: Any, n_heads: int, weight: Any, eps: float) -> Any:
        n = x.shape[0]
        return self.rms_norm(x.reshape(n, n_heads, -1), weight, eps).reshape(n, -1)

    def attention(self, q: Any, k: Any, v: Any, kv: KVBatch, positions: Sequence[int],
                  n_heads: int, scale: float, window: int = 0,
                  k_balance: Sequence[float] | None = None, sinks: Any = None) -> Any:
        pages = kv.pages
        lay = pages.layout
        n, n_kv, hd = q.shape[0], lay.n_kv_heads, lay.head_dim
        plan = self._plans.get(kv, positions, window, pages.n_blocks)
        write = self._indices(plan.write)
        q3, k3, v3 = q.reshape(n, n_heads, hd), k.reshape(n, n_kv, hd), v.reshape(n, n_kv, hd)
        # q8_0/q4_0 hold balanced, rotated vectors as the CPU pages do (paged_attention)
        turn_k, turn_v = kv_rotated(lay.k_type), kv_rotated(lay.v_type)
        if turn_k:
            if k_balance is not None:  # powers of two per dim: exact, as the CPU's
                d = self._floats(np.asarray(k_balance, np.float32))
                q3, k3 = q3 * d, k3 / d
            q3, k3 = self._rotate(q3), self._rotate(k3)
        pages.k.write(write, k3)
        pages.v.write(write, self._rotate(v3) if turn_v else v3)
        if sinks is not None:
            sinks = self._floats(np.asarray(sinks, np.float32))
        out = self._attend(q3, pages, plan, n_heads, scale, sinks)
        if turn_v:
            out = self._rotate(out)
        return out.reshape(n, n_heads * hd)

    def _no_recurrent(self):
        raise UnsupportedModel(f"the {self.name} backend does not run recurrent (linear "
                               "attention) layers yet; run this model on the CPU")

    def delta_net(self, qkv, alpha, beta, w, spec, kv):
        self._no_recurrent()

    def new_recurrent_state(self, spec):
        self._no_recurrent()

    def copy_recurrent_state(self, state):
        self._no_recurrent()

    def recurrent_state_nbytes(self, spec) -> int:
        self._no_recurrent()

    def decoder_block(self, x: Any, w: Any, spec: Any, positions: Sequence[int],
                      kv: KVBatch) -> Any:
        raise NotImplementedError(f"the {self.name} backend runs blocks op by op "
                                  "(fused_blocks=False)")

    def glu(self, gate: Any, up: Any, act: str) -> Any:
        if act == "silu":
            return gate / (1.0 + self._exp(-gate)) * up
        if act == "gelu_tanh":
            return gate / (1.0 + self._gelu_exp(gate)) * up
        if act == "sigmoid":
            return up / (1.0 + self._exp(-gate))
        if act == "swiglu_oai":  # as ggml's swiglu_oai (kernels/ops.py swiglu_oai_row)
            x = self._clip(gate, None, SWIGLU_OAI_LIMIT)
            y = self._clip(up, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
            return x / (1.0 + self._exp(x * -SWIGLU_OAI_ALPHA)) * (y + 1.0)
        raise ValueError(f"unknown activation {act}")

    def act(self, x: Any, act: str) -> Any:
        if act == "gelu_tanh":
            return x / (1.0 + self._gelu_exp(x))
        if act == "tanh":
            return 2.0 / (1.0 + self._exp(-2.0 * x)) - 1.0
        raise ValueError(f"unknown activation {act}")

    def select_rows(self, x: Any, rows: Sequence[int]) -> Any:
        return x[self._indices(rows)]

    def _swiglu(self, x: Any, gate: Any, up: Any, down: Any, act: str,
                biases: tuple = (None, None, None)) -> Any:
        g, u = self.linear(x, [gate, up], biases[:2])
        return self.linear(self.glu(g, u, act), [down], biases[2:])[0]

    def moe_ffn(self, x: Any, w: Any, spec: Any) -> Any:
        """As the CPU's (backends/cpu_moe.py): routing on the host with the same kernel,
        each chosen expert once over its tokens, the weighted sum in rank order."""
        logits = self.linear(x, [w.router], [w.router_bias])[0]
        weights, groups = route_tokens(self.to_numpy(logits), spec, w.down_scale)
        n, k = weights.shape
        outs, pairs = [], []
        for e, p in groups:
            outs.append(self._swiglu(self.select_rows(x, p // k), w.gate.parts[e],
                                     w.up.parts[e], w.down.parts[e], spec.activation,
                                     expert_biases(w, e)))
            pairs.append(p)
        back = np.empty(n * k, np.int64)  # row of (token t, slot j) in the stacked outputs
        back[np.concatenate(pairs)] = np.arange(n * k)
        y = self.select_rows(self._concat(outs), back).reshape(n, k, -1)
        wt = self._floats(weights.reshape(-1)).reshape(n, k, 1)
        out = y[:, 0] * wt[:, 0]
        for j in range(1, k):
            out = out + y[:, j] * wt[:, j]
        if w.shared_up is not None:
            s = self._swiglu(x, w.shared_gate, w.shared_up, w.shared_down, spec.activation)
            if w.shared_gate_inp is not None:
                g = self.linear(x, [w.shared_gate_inp])[0]  # (n, 1)
                s = s * (1.0 / (1.0 + self._exp(-g)))
            out = out + s
        return out

    # ---- KV pages

    @staticmethod
    def kv_block_nbytes(layout: KVLayout) -> int:
        return kv_block_nbytes(layout)

    def new_kv_pages(self, layout: KVLayout, n_blocks: int) -> DeviceKVPages:
        pages = new_pages(layout, n_blocks, self._kv_store)
        self._held += pages.nbytes
        return pages

    def copy_kv_block(self, pages: DeviceKVPages, src: int, dst: int) -> None:
        bs = pages.layout.block_size
        for side in (pages.k, pages.v):
            side.copy(src * bs, dst * bs, bs)
