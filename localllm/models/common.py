"""What every architecture shares: reading `{arch}.*` metadata and placing GGUF tensors on the
backends a placement assigns them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from localllm.backends.base import Backend
from localllm.errors import UnsupportedModel


# The architectures' name for localllm.errors.UnsupportedModel (the same class): the file's
# metadata or tensors don't describe a model we can run.
ModelError = UnsupportedModel


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
    """A finite float metadata value (NaN or Inf would reach every activation)."""
    v = meta_get(meta, key, default, required=default is None)
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ModelError(f"metadata {key!r} should be a number, got {v!r}") from None
    if not math.isfinite(x):
        raise ModelError(f"metadata {key!r} is {x}, not a finite number")
    return x


# {arch}.pooling_type as llama.cpp numbers it
POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def pooling_type(meta: dict, arch: str) -> str:
    """The file's pooling for embeddings ("none" when it names none).

    Raises:
        ModelError: a number llama.cpp does not define.
    """
    v = meta_get(meta, f"{arch}.pooling_type", 0)
    if isinstance(v, bool) or not isinstance(v, int) or int(v) not in POOLING:
        raise ModelError(f"metadata '{arch}.pooling_type' is {v!r}; expected one of "
                         f"{', '.join(f'{k} ({n})' for k, n in POOLING.items())}")
    return POOLING[int(v)]


# A layer's router and shared expert run where its experts do (one crossing per layer).
_FOLLOWS_EXPERTS = re.compile(r"(blk\.\d+\.)ffn_(gate_inp|gate_inp_shexp|gate_shexp|"
                              r"up_shexp|down_shexp)\.")


def tensor_override(name: str, overrides) -> Any:
    """The value of the first (regex, value) rule whose pattern is found in the tensor's
    name, as llama.cpp's ``--override-tensor`` matches; a router or shared expert answers
    for its layer's ``ffn_gate_exps``. None when no rule matches."""
    m = _FOLLOWS_EXPERTS.match(name)
    if m:
        name = m.group(1) + "ffn_gate_exps.weight"
    for pattern, value in overrides:
        if re.search(pattern, name):
            return value
    return None


@dataclass(frozen=True)
class Placement:
    """Which backend holds what: the token embedding, each decoder layer, the output head,
    and tensors named by override rules ((regex, Backend), e.g. experts kept on the CPU)."""
    embed: Backend
    layers: tuple[Backend, ...]
    head: Backend
    overrides: tuple = ()

    @classmethod
    def single(cls, backend: Backend, n_layers: int) -> "Placement":
        """Everything on one backend."""
        return cls(backend, (backend,) * n_layers, backend)

    def backends(self) -> list[Backend]:
        """Each distinct backend once, in placement order."""
        out = []
        for be in (self.embed, *self.layers, self.head, *(b for _, b in self.overrides)):
            if all(be is not b for b in out):
                out.append(be)
        return out


_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.")


def check_blocks(tensors, arch: str, n_layers: int) -> None:
    """Raises ModelError unless the file's ``blk.N.*`` tensors number exactly ``n_layers``
    blocks, 0..n_layers-1 (checked before the KV cache is sized from the block count).

    Args:
        tensors: the file's tensor names (or name -> info mapping).
        arch: the architecture, naming the key in the message.
        n_layers: ``{arch}.block_count``.
    """
    present = {int(m.group(1)) for m in map(_LAYER_TENSOR.match, tensors) if m}
    first_missing = next(i for i in range(len(present) + 1) if i not in present)
    if first_missing < n_layers:
        have = f"blocks 0..{max(present)}" if present else "no blocks"
        raise ModelError(f"metadata '{arch}.block_count' is {n_layers} but the file has tensors "
                         f"for {have} (block {first_missing} is missing)")
    if present and max(present) >= n_layers:
        raise ModelError(f"metadata '{arch}.block_count' is {n_layers} but the file has tensors "
                         f"for block {max(present)}")


class WeightLoader:
    """Hands a model its tensors from a GGUF file, each uploaded to the backend its placement
    names (``blk.N.*`` to layer N's, ``output*`` to the head's, the rest to the embedding's),
    shape-checked."""

    def __init__(self, gguf_file, placement: Placement):
        self.file = gguf_file
        self.placement = placement
        self.backend: Backend = placement.embed  # the embedding's backend

    def backend_for(self, name: str) -> Backend:
        """The backend a tensor goes to."""
        be = tensor_override(name, self.placement.overrides)
        if be is not None:
            return be
        m = _LAYER_TENSOR.match(name)
        if m:
            i = int(m.group(1))
            if i >= len(self.placement.layers):
                raise ModelError(f"tensor {name!r} belongs to layer {i}, but the model has "
                                 f"{len(self.placement.layers)} layers")
            return self.placement.layers[i]
        if name.startswith("output"):
            return self.placement.head
        return self.placement.embed

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def _info(self, name: str, shape: tuple[int, ...]):
        info = self.file.tensors.get(name)
        if info is None:
            raise ModelError(f"tensor {name!r} is missing from the file")
        if tuple(info.shape) != tuple(shape):
            raise ModelError(f"tensor {name!r} has shape {info.shape}, expected {shape}")
        return info

    def matrix(self, name: str, N: int, K: int, head: bool = False):
        """A weight W (N out, K in) uploaded for matmul; ``head``: to the output head's
        backend whatever its name (a tied token embedding)."""
        info = self._info(name, (N, K))
        be = self.placement.head if head else self.backend_for(name)
        done = None
        if be.copies_weights:
            # The backend keeps its own copy: drop the file's pages as they are consumed.
            done = lambda a, b: self.file.release(name, a, b)  # noqa: E731
        return be.upload_matrix(name, info.type_name, self.file.raw(name), N, K, done)

    def matrix_split(self, name: str, K: int, rows: list[int]) -> list:
        """A fused weight (sum(rows) out, K in) uploaded as one matrix per block of rows
        (Phi-3's attn_qkv and gate+up ffn_up): each output row is its own dot product, so
        the parts compute exactly what the whole would.

        Args:
            name: the tensor; K: its input width; rows: the output rows of each part.
        Returns:
            The uploaded parts, in order.
        """
        self._info(name, (sum(rows), K))
        be = self.backend_for(name)
        table = self.file.blocks(name)
        row_bytes = table.shape[1]
        info = self.file.tensors[name]
        out, start = [], 0
        for i, n in enumerate(rows):
            done = None
            if be.copies_weights:
                base = start * row_bytes
                done = lambda a, b, base=base: self.file.release(name, base + a, base + b)  # noqa: E731
            out.append(be.upload_matrix(f"{name}#{i}", info.type_name,
                                        table[start:start + n].reshape(-1), n, K, done))
            start += n
        return out

    def matrix_rows(self, name: str, K: int, rows) -> Any:
        """Some output rows of a weight (rows given by index, in order) as a matrix of its
        own: each output row is its own dot product, so it computes what those rows of the
        whole would (Qwen3.5's query projection interleaves queries and gates by head).

        Args:
            name: the tensor; K: its input width; rows: the row indices kept.
        """
        info = self.file.tensors.get(name)
        if info is None:
            raise ModelError(f"tensor {name!r} is missing from the file")
        self._info(name, (info.shape[0], K))
        table = self.file.blocks(name)
        part = np.ascontiguousarray(table[np.asarray(rows, np.int64)])
        return self.backend_for(name).upload_matrix(f"{name}#rows", info.type_name,
                                                    part.reshape(-1), len(rows), K)

    def host_matrix(self, name: str, N: int, K: int):
        """A float 2-D tensor (N, K) as a float32 numpy array (e.g. a conv kernel)."""
        info = self._info(name, (N, K))
        if info.type_name not in ("F32", "F16", "BF16"):
            raise ModelError(f"tensor {name!r} has type {info.type_name}; expected a float type")
        from localllm.formats.dequant import dequantize
        values = dequantize(self.file.raw(name), info.type_name, (N, K))
        if not np.isfinite(values).all():
            raise ModelError(f"tensor {name!r} holds non-finite values")
        return np.ascontiguousarray(values, dtype=np.float32)

    def experts(self, name: str, n_experts: int, N: int, K: int):
        """A GGUF 3-D stack of expert matrices (n_experts of N out, K in), uploaded with
        ``upload_experts`` to its layer's backend."""
        info = self._info(name, (n_experts, N, K))
        be = self.backend_for(name)
        done = None
        if be.copies_weights:
            done = lambda a, b: self.file.release(name, a, b)  # noqa: E731
        return be.upload_experts(name, info.type_name, self.file.raw(name), n_experts, N, K,
                                 done)

    def experts_split(self, name: str, n_experts: int, N: int, K: int) -> tuple:
        """A fused stack of expert matrices (n_experts of 2N out, K in: each expert's first N
        rows, then its second N, as Gemma 4's ``ffn_gate_up_exps``) uploaded with
        ``upload_expert_halves`` as two stacks of n_experts x (N, K)."""
        info = self._info(name, (n_experts, 2 * N, K))
        be = self.backend_for(name)
        done = None
        if be.copies_weights:
            done = lambda a, b: self.file.release(name, a, b)  # noqa: E731
        return be.upload_expert_halves(name, info.type_name, self.file.raw(name), n_experts,
                                       N, K, done)

    def expert_vectors(self, name: str, n_experts: int, n: int) -> tuple:
        """A float 2-D tensor of one vector of n per expert (gpt-oss's expert biases), as
        n_experts float32 vectors on the backend of its layer's experts."""
        info = self._info(name, (n_experts, n))
        if info.type_name not in ("F32", "F16", "BF16"):
            raise ModelError(f"tensor {name!r} has type {info.type_name}; expected a float type")
        from localllm.formats.dequant import dequantize
        values = dequantize(self.file.raw(name), info.type_name, (n_experts, n))
        if not all(math.isfinite(x) for x in values.reshape(-1).tolist()):
            raise ModelError(f"tensor {name!r} holds non-finite values")
        be = self.backend_for(name)
        return tuple(be.upload_vector(values[e].copy()) for e in range(n_experts))

    def row_matrix(self, name: str, K: int):
        """A 1-D tensor of K weights used as a (1, K) matrix (a shared expert's gate)."""
        info = self._info(name, (K,))
        be = self.backend_for(name)
        return be.upload_matrix(name, info.type_name, self.file.raw(name), 1, K)

    def vector(self, name: str, n: int):
        """A float 1-D tensor (norm weight or bias) as float32, on its backend."""
        return self.backend_for(name).upload_vector(self.host_vector(name, n))

    def host_vector(self, name: str, n: int):
        """A float 1-D tensor as a float32 numpy array (tables the model computes from)."""
        info = self._info(name, (n,))
        if info.type_name not in ("F32", "F16", "BF16"):
            raise ModelError(f"tensor {name!r} has type {info.type_name}; expected a float type")
        from localllm.formats.dequant import dequantize  # the reference decoder handles F16/BF16 exactly
        values = dequantize(self.file.raw(name), info.type_name, (n,))
        # A NaN or Inf here would turn every activation after it into NaN.
        bad = [i for i, x in enumerate(values.tolist()) if not math.isfinite(x)]
        if bad:
            raise ModelError(f"tensor {name!r} holds {values[bad[0]]} at index {bad[0]} "
                             f"({len(bad)} non-finite values)")
        return values

    def optional_vector(self, name: str, n: int):
        return self.vector(name, n) if self.has(name) else None

    def embedding(self, name: str, vocab: int, dim: int):
        info = self._info(name, (vocab, dim))
        return self.placement.embed.upload_embedding(info.type_name, self.file.blocks(name), dim)
