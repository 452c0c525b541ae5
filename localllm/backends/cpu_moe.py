"""The CPU backend's mixture-of-experts FFN: the router, then each expert that some token of
the chunk chose, run once over those tokens with the ordinary matmul kernels, and the
weighted sum per token in rank order (kernels/moe.py). Quantized experts are read in place
from the mapped file (kernels/mapped.py: the packed kernels' bits, tile by tile), so a model
larger than the memory left for copies still loads; float experts are packed.

A decode step reads only its top-k experts; a prompt chunk reads each chosen expert once.
The matmul kernels compute every row on its own, so grouping tokens by expert leaves each
token's result as it would be alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from localllm.formats.quants import row_nbytes
from localllm.kernels import mapped as mapped_k
from localllm.kernels import matmul as mm
from localllm.kernels import moe as moe_k
from localllm.kernels import ops

from .host import expert_biases, route_tokens

_NO_SHARED = np.zeros((0, 0), np.float32)
_NO_GATE = np.zeros(0, np.float32)


@dataclass(frozen=True)
class Experts:
    """A layer's stack of expert matrices, by expert id: packed ``matmul.Weight``s, or
    (``mapped``) ``mapped.MappedWeight`` views of the file's bytes."""
    type_name: str
    N: int
    K: int
    parts: tuple
    mapped: bool = False
    stacked: np.ndarray | None = None  # mapped: the file's (n_experts, N, row bytes)
    # 0 or 1: the first or second N rows of a fused stack of 2N (``parts`` and ``stacked``
    # are the whole fused stack's, shared by both halves); -1: a stack of its own
    half: int = -1

    @property
    def nbytes(self) -> int:
        """Anonymous bytes (mapped experts hold none)."""
        return sum(w.nbytes for w in self.parts)

    @property
    def file_nbytes(self) -> int:
        """Bytes read from the mapped file in place (a half counts half the fused stack)."""
        if not self.mapped:
            return 0
        total = sum(w.file_nbytes for w in self.parts)
        return total // 2 if self.half >= 0 else total


def fused(gate: Experts, up: Experts) -> bool:
    """Whether gate and up are the two halves of one mapped fused stack."""
    return gate.half == 0 and up.half == 1 and gate.stacked is up.stacked


def can_map(type_name: str, N: int, K: int) -> bool:
    """Whether experts of this type and shape are read from the file in place."""
    return mapped_k.can_map(type_name, N, K)


def map_experts(type_name: str, raw: np.ndarray, n_experts: int, N: int, K: int) -> Experts:
    """Zero-copy views of a GGUF 3-D expert tensor, expert by expert.

    Args:
        type_name: GGML type; raw: the tensor's bytes (a view of the mapped file);
            n_experts, N, K: its shape.
    Returns:
        Experts with ``mapped`` set.
    """
    per = N * row_nbytes(type_name, K)
    raw = raw.reshape(-1)
    if raw.size != n_experts * per:
        raise ValueError(f"experts: {raw.size} bytes for {n_experts} x ({N}, {K}) {type_name}")
    parts = tuple(mapped_k.view(type_name, raw[e * per:(e + 1) * per], N, K)
                  for e in range(n_experts))
    stacked = raw.reshape(n_experts, N, per // N)
    if stacked.flags.writeable:
        stacked = stacked.view()
        stacked.flags.writeable = False
    return Experts(type_name, N, K, parts, mapped=True, stacked=stacked)


def map_expert_halves(type_name: str, raw: np.ndarray, n_experts: int, N: int,
                      K: int) -> tuple[Experts, Experts]:
    """A fused GGUF stack (n_experts of 2N rows: each expert's first N, then its second N)
    mapped once, as its two halves (see ``Experts.half``)."""
    whole = map_experts(type_name, raw, n_experts, 2 * N, K)
    return tuple(Experts(type_name, N, K, whole.parts, mapped=True, stacked=whole.stacked,
                         half=h) for h in range(2))


def pack_experts(type_name: str, raw: np.ndarray, n_experts: int, N: int, K: int,
                 done=None) -> Experts:
    """Repack a GGUF 3-D expert tensor (n_experts x N rows of K) expert by expert.

    Args:
        type_name: GGML type; raw: the tensor's bytes; n_experts, N, K: its shape.
        done: optional callback(start, end) for byte ranges of raw already consumed.
    Returns:
        Experts.
    """
    per = N * row_nbytes(type_name, K)
    raw = raw.reshape(-1)
    if raw.size != n_experts * per:
        raise ValueError(f"experts: {raw.size} bytes for {n_experts} x ({N}, {K}) {type_name}")
    parts = []
    for e in range(n_experts):
        sub = None
        if done is not None:
            sub = lambda a, b, base=e * per: done(base + a, base + b)  # noqa: E731
        parts.append(mm.pack(type_name, raw[e * per:(e + 1) * per], N, K, sub))
    return Experts(type_name, N, K, tuple(parts))


def _quantize_for(x: np.ndarray, weights) -> mm.QuantActivations:
    kinds = {mm.needs(w) for w in weights}
    return mm.quantize(x, need32="q32" in kinds, need256="q256" in kinds)


def _rows(act: mm.QuantActivations, rows: np.ndarray) -> mm.QuantActivations:
    """The given rows of quantized activations (each row is quantized on its own)."""
    def pick(parts):
        return None if parts is None else tuple(np.ascontiguousarray(a[rows]) for a in parts)
    return mm.QuantActivations(np.ascontiguousarray(act.x[rows]), pick(act.q32), pick(act.q256))


ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")


def glu(gate: np.ndarray, up: np.ndarray, act: str) -> np.ndarray:
    """The backend's ``glu``: act(gate) * up, or gpt-oss's clamped SwiGLU."""
    if act == "sigmoid":  # an output gate (Qwen3.5's attention), elementwise
        one = np.float32(1.0)
        return np.ascontiguousarray(up / (one + np.exp(-gate)), dtype=np.float32)
    if act not in ACTIVATIONS:
        raise ValueError(f"unknown activation {act}")
    out = np.empty_like(gate)
    if act == "swiglu_oai":
        ops.swiglu_oai(gate, up, out, ops.SWIGLU_OAI_ALPHA, ops.SWIGLU_OAI_LIMIT)
    else:
        ops.glu(gate, up, out, act == "gelu_tanh")
    return out


def _matmul(w, act: mm.QuantActivations, mapped: bool) -> np.ndarray:
    return mapped_k.matmul_mapped(w, act) if mapped else mm.matmul(w, act)


def _split(gu: np.ndarray, N: int) -> tuple[np.ndarray, np.ndarray]:
    """A fused matmul's output (m, 2N) as gate and up (m, N) each."""
    return np.ascontiguousarray(gu[:, :N]), np.ascontiguousarray(gu[:, N:])


def _swiglu(act: mm.QuantActivations, gate, up, down, activation: str,
            biases=(None, None, None), mapped=(False, False, False),
            fused_rows: int = 0) -> np.ndarray:
    """One expert (or the shared one) over the rows of ``act``; ``biases``: the gate's, the
    up's and the down's, each added to its matmul's output (None: none); ``mapped``: which
    of the three are MappedWeights; ``fused_rows`` N > 0: ``gate`` is a fused matrix of 2N
    rows whose first N are the gate and last N the up (``up`` is not read)."""
    if fused_rows:
        g, u = _split(_matmul(gate, act, mapped[0]), fused_rows)
    else:
        g, u = _matmul(gate, act, mapped[0]), _matmul(up, act, mapped[1])
    if biases[0] is not None:
        g += biases[0]
        u += biases[1]
    y = _matmul(down, _quantize_for(glu(g, u, activation), [down]), mapped[2])
    if biases[2] is not None:
        y += biases[2]
    return y


def _one_token(act, w, groups, k: int, activation: str) -> np.ndarray:
    """A decode step's k experts, each matrix kind in one parallel region (mapped stacks):
    the bits of the expert-by-expert loop, as every row is computed and quantized alone.
    Returns: float32 (k, dim), slot j's output at row j."""
    ids = np.empty(k, np.int64)
    for e, pairs in groups:
        ids[pairs] = e
    if fused(w.gate, w.up):  # both halves in one region
        g, u = _split(mapped_k.matmul_stack(w.gate.type_name, w.gate.stacked, ids, act),
                      w.gate.N)
    else:
        g = mapped_k.matmul_stack(w.gate.type_name, w.gate.stacked, ids, act)
        u = mapped_k.matmul_stack(w.up.type_name, w.up.stacked, ids, act)
    h = _quantize_for(glu(g, u, activation), [w.down.parts[0]])
    return mapped_k.matmul_stack(w.down.type_name, w.down.stacked, ids, h)


def moe_ffn(x: np.ndarray, w, spec) -> np.ndarray:
    """The backend's ``moe_ffn`` (see backends/base.py) on numpy arrays.

    Args:
        x: float32 (n, dim) normed hidden states; w: MoEWeights of packed Weights and
            Experts; spec: MoESpec.
    Returns:
        float32 (n, dim).
    """
    if spec.activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {spec.activation}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, dim = x.shape
    k = spec.n_used
    gates = [w.router, w.gate.parts[0], w.up.parts[0]]
    if w.shared_up is not None:
        gates += [w.shared_gate, w.shared_up]
    if w.shared_gate_inp is not None:
        gates.append(w.shared_gate_inp)
    act = _quantize_for(x, gates)
    logits = mm.matmul(w.router, act)
    if w.router_bias is not None:
        logits += w.router_bias
    weights, groups = route_tokens(logits, spec, w.down_scale)
    mapped = (w.gate.mapped, w.up.mapped, w.down.mapped)
    if n == 1 and all(mapped) and w.gate_bias is None:
        y = _one_token(act, w, groups, k, spec.activation)
    else:
        y = np.empty((n * k, dim), np.float32)
        rows = w.gate.N if fused(w.gate, w.up) else 0
        for e, pairs in groups:
            y[pairs] = _swiglu(_rows(act, pairs // k), w.gate.parts[e], w.up.parts[e],
                               w.down.parts[e], spec.activation, expert_biases(w, e), mapped,
                               rows)
    shared, shared_gate = _NO_SHARED, _NO_GATE
    if w.shared_up is not None:
        shared = _swiglu(act, w.shared_gate, w.shared_up, w.shared_down, spec.activation)
        if w.shared_gate_inp is not None:
            shared_gate = np.ascontiguousarray(mm.matmul(w.shared_gate_inp, act)[:, 0])
    out = np.empty((n, dim), np.float32)
    moe_k.combine(y, weights, shared, shared_gate, out)
    return out
