"""The Backend protocol: what a model's layer math may ask of the device it is placed on.

Arrays are the backend's own (numpy for the CPU); models pass them back unchanged and never
touch numpy, torch or mlx themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence


@dataclass(frozen=True)
class RopeSpec:
    """How one layer rotates queries and keys."""
    n_rot: int                 # rotated dims per head (from the front)
    theta: float               # frequency base
    neox: bool                 # pair i with i + n_rot/2 (True) or 2i with 2i+1 (False)
    pos_scale: float = 1.0     # linear position scaling (1 / factor)
    freq_factors: Any = None   # optional per-frequency divisors (rope_freqs tensor), numpy


class Backend(Protocol):
    """Operations a model uses. ``x`` arrays are (n_tokens, features) unless noted."""

    name: str

    def begin_model(self, gguf_path: Any) -> None:
        """Called before a model's tensors are uploaded (e.g. to reuse stored conversions)."""

    def end_model(self) -> None:
        """Called after all tensors of the model are uploaded."""

    def upload_matrix(self, name: str, type_name: str, raw: Any, N: int, K: int,
                      done: Any = None) -> Any:
        """Keep a weight matrix (N out, K in) from GGUF bytes; quantized where possible.
        ``done(start, end)``, if given, may be called for byte ranges no longer needed."""

    def upload_vector(self, values: Any) -> Any:
        """Keep a float32 1-D tensor (norm weights, biases)."""

    def embed(self, table: Any, ids: Sequence[int], scale: float = 1.0) -> Any:
        """Rows of the token embedding for ``ids``, times ``scale``: (n, dim)."""

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """x / rms(x) * weight, per row."""

    def linear(self, x: Any, weights: Sequence[Any], biases: Sequence[Any] | None = None) -> list:
        """x @ W.T (+ b) for each W, sharing one preparation of x."""

    def head_norm(self, x: Any, n_heads: int, weight: Any, eps: float) -> Any:
        """RMSNorm of each head of x (n, n_heads * head_dim) with a per-head-dim weight."""

    def rope(self, x: Any, n_heads: int, positions: Sequence[int], spec: RopeSpec) -> Any:
        """Rotary position embedding of x (n, n_heads * head_dim)."""

    def kv_cache_nbytes(self, n_kv_heads: int, head_dim: int, ctx: int) -> int:
        """Bytes one layer's KV cache of ``ctx`` positions takes once filled."""

    def new_kv_cache(self, n_kv_heads: int, head_dim: int, ctx: int) -> Any:
        """An empty cache for one layer with room for ``ctx`` positions."""

    def attention(self, q: Any, k: Any, v: Any, cache: Any, positions: Sequence[int],
                  n_heads: int, scale: float, window: int = 0) -> Any:
        """Store k, v at ``positions`` and attend causally: (n, n_heads * head_dim)."""

    def glu(self, gate: Any, up: Any, act: str) -> Any:
        """act(gate) * up with act in {'silu', 'gelu_tanh'}."""

    def add(self, x: Any, y: Any) -> Any:
        """x + y (may reuse x's storage)."""

    def select_rows(self, x: Any, rows: Sequence[int]) -> Any:
        """The given rows of x."""

    def to_numpy(self, x: Any) -> Any:
        """A float32 numpy copy or view of x."""
