"""What every architecture shares: reading `{arch}.*` metadata and placing GGUF tensors."""

from __future__ import annotations

from typing import Any


class ModelError(ValueError):
    """The file's metadata or tensors don't describe a model we can run."""


def meta_get(meta: dict, key: str, default: Any = None, required: bool = False) -> Any:
    """A metadata value, or ``default``; ``required`` raises ModelError naming the key."""
    if key in meta:
        return meta[key]
    if required:
        raise ModelError(f"metadata key {key!r} is missing")
    return default


def meta_int(meta: dict, key: str, default: int | None = None) -> int:
    """An integer metadata value; a per-layer array must be uniform (we run uniform layers)."""
    v = meta_get(meta, key, default, required=default is None)
    if hasattr(v, "__len__") and not isinstance(v, str):
        vals = {int(a) for a in v}
        if len(vals) != 1:
            raise ModelError(f"metadata {key!r} varies per layer ({sorted(vals)}); not supported")
        v = vals.pop()
    if isinstance(v, bool) or not isinstance(v, (int,)) and not hasattr(v, "__index__"):
        raise ModelError(f"metadata {key!r} should be an integer, got {v!r}")
    return int(v)


def meta_float(meta: dict, key: str, default: float | None = None) -> float:
    v = meta_get(meta, key, default, required=default is None)
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ModelError(f"metadata {key!r} should be a number, got {v!r}") from None


class WeightLoader:
    """Hands a model its tensors from a GGUF file, uploaded to a backend, shape-checked."""

    def __init__(self, gguf_file, backend):
        self.file = gguf_file
        self.backend = backend

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def _info(self, name: str, shape: tuple[int, ...]):
        info = self.file.tensors.get(name)
        if info is None:
            raise ModelError(f"tensor {name!r} is missing from the file")
        if tuple(info.shape) != tuple(shape):
            raise ModelError(f"tensor {name!r} has shape {info.shape}, expected {shape}")
        return info

    def matrix(self, name: str, N: int, K: int):
        """A weight W (N out, K in) uploaded for matmul."""
        info = self._info(name, (N, K))
        done = None
        if getattr(self.backend, "copies_weights", False):
            # The backend keeps its own copy: drop the file's pages as they are consumed.
            done = lambda a, b: self.file.release(name, a, b)  # noqa: E731
        return self.backend.upload_matrix(name, info.type_name, self.file.raw(name), N, K, done)

    def vector(self, name: str, n: int):
        """A float 1-D tensor (norm weight or bias) as float32."""
        info = self._info(name, (n,))
        if info.type_name not in ("F32", "F16", "BF16"):
            raise ModelError(f"tensor {name!r} has type {info.type_name}; expected a float type")
        from localllm.dequant import dequantize  # the reference decoder handles F16/BF16 exactly
        return self.backend.upload_vector(dequantize(self.file.raw(name), info.type_name, (n,)))

    def optional_vector(self, name: str, n: int):
        return self.vector(name, n) if self.has(name) else None

    def embedding(self, name: str, vocab: int, dim: int):
        info = self._info(name, (vocab, dim))
        return self.backend.upload_embedding(info.type_name, self.file.blocks(name), dim)
