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
from typing import Callable

import numpy as np

from localllm.formats.quants import row_nbytes
from localllm.kernels.direct import DirectCall, fingerprint
from localllm.kernels import mapped as mapped_k
from localllm.kernels import matmul as mm
from localllm.kernels import moe as moe_k
from localllm.kernels import ops
from localllm.kernels import packing as P

from . import cpu_block
from .cpu_block import _NO_GATE, _NO_SHARED  # no shared expert, no shared gate
from .host import expert_biases, route_tokens


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
    # mapped: release(start, end) drops that byte range of the stack from this process's
    # resident pages (the file keeps it), once an expert has a packed copy; None: kept
    release: Callable[[int, int], None] | None = None

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


def map_experts(type_name: str, raw: np.ndarray, n_experts: int, N: int, K: int,
                release=None) -> Experts:
    """Zero-copy views of a GGUF 3-D expert tensor, expert by expert.

    Args:
        type_name: GGML type; raw: the tensor's bytes (a view of the mapped file);
            n_experts, N, K: its shape; release: see ``Experts.release``.
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
    return Experts(type_name, N, K, parts, mapped=True, stacked=stacked, release=release)


def map_expert_halves(type_name: str, raw: np.ndarray, n_experts: int, N: int,
                      K: int, release=None) -> tuple[Experts, Experts]:
    """A fused GGUF stack (n_experts of 2N rows: each expert's first N, then its second N)
    mapped once, as its two halves (see ``Experts.half``)."""
    whole = map_experts(type_name, raw, n_experts, 2 * N, K, release)
    return tuple(Experts(type_name, N, K, whole.parts, mapped=True, stacked=whole.stacked,
                         half=h, release=release) for h in range(2))


class ExpertPool:
    """Packed copies of one mapped stack's most recently used experts, in a fixed number of
    slots (least recently used first out).

    The slots are one packed weight of ``capacity`` x (the stack's rows), expert copy s
    from tile s * n_tiles, so a decode step's experts run in one parallel region with the
    packed kernels; their bits are those of the mapped path (which forms the same tiles on
    the fly, at a tenth of the speed). Its pages are touched only as slots fill.
    """

    def __init__(self, experts: Experts, capacity: int):
        self.type_name = experts.type_name
        self.rows3 = experts.stacked            # (n_experts, rows, row bytes), the file's
        rows, self.K = self.rows3.shape[1], experts.K
        self.n_tiles = rows // P.ROWS
        self.capacity = capacity
        self.packed, fields = mapped_k._scratch(self.type_name, capacity * self.n_tiles, self.K)
        self.fields = fields
        self.nbytes = sum(a.nbytes for k, a in fields.items() if k != "lut")
        self._release = experts.release
        # by expert: its slot (-1: not held); by slot: its expert (-1: free) and when it was
        # last used (a clock ticking once per expert asked for: least recently used first out)
        self._slot_of = np.full(self.rows3.shape[0], -1, np.int64)
        self._held = np.full(capacity, -1, np.int64)
        self._used = np.zeros(capacity, np.int64)
        self._clock = 0
        self._free = list(range(capacity - 1, -1, -1))
        self.hits = 0
        self.misses = 0

    def slots(self, ids) -> np.ndarray:
        """The slots holding experts ``ids`` (distinct; at most ``capacity``), packing those
        not held in place of the least recently used others."""
        ids = np.asarray(ids, np.int64)
        out = self._slot_of[ids]
        k = len(ids)
        if k and out.min() >= 0:  # a decode step's usual case: every one held
            self._used[out] = np.arange(self._clock, self._clock + k)
            self._clock += k
            self.hits += k
            return out
        for j in range(k):
            e = int(ids[j])
            s = int(self._slot_of[e])
            if s >= 0:
                self.hits += 1
            else:
                if self._free:
                    s = self._free.pop()
                else:
                    # the least recently used slot whose expert this call does not ask for
                    held = np.flatnonzero(~np.isin(self._held, ids))
                    s = int(held[np.argmin(self._used[held])])
                    self._slot_of[self._held[s]] = -1
                P._pack_slab(self.type_name, self.rows3[e], self.K, s * self.n_tiles,
                             self.fields)
                if self._release is not None:
                    per = self.rows3.shape[1] * self.rows3.shape[2]
                    self._release(e * per, (e + 1) * per)
                self._slot_of[e] = s
                self._held[s] = e
                self.misses += 1
            out[j] = s
            self._used[s] = self._clock
            self._clock += 1
        return out


class ExpertPools:
    """The packed expert copies of one model's mapped stacks, within a byte budget shared
    in proportion to each stack's size.

    A stack whose share holds fewer experts than a token uses gets no pool (its experts
    are then formed tile by tile from the file at every use)."""

    def __init__(self, budget: int | None):
        self.budget = budget        # bytes; None: decided at first use from free memory
        self._pools: dict[int, ExpertPool | None] = {}
        self._stacks: dict[int, Experts] = {}
        # per MoE layer (by id of its weights): how its decode step runs (_Native)
        self.native: dict[int, _Native] = {}

    def register(self, experts: Experts) -> None:
        """A mapped stack of the model being loaded."""
        if experts.mapped:
            self._stacks[id(experts.stacked)] = experts

    def _packed_nbytes(self, e: Experts) -> int:
        rows = e.stacked.shape[1]
        fields = P._alloc(e.type_name, P.ROWS, e.K)
        per_tile = sum(a.nbytes for a in fields.values())
        return rows // P.ROWS * per_tile

    def resolve_budget(self) -> int:
        """The budget in bytes: as set, or half the memory available beyond 1 GiB, at most
        what every registered stack's experts take packed."""
        total = sum(self._packed_nbytes(e) * e.stacked.shape[0] for e in self._stacks.values())
        if self.budget is None:
            import psutil
            free = psutil.virtual_memory().available - (1 << 30)
            self.budget = int(min(total, max(0, free // 2)))
        return self.budget

    def pool(self, experts: Experts, k: int) -> ExpertPool | None:
        """The pool of a mapped stack (None: none, or a share too small for k experts)."""
        key = id(experts.stacked)
        if key in self._pools:
            return self._pools[key]
        self.register(experts)
        budget = self.resolve_budget()
        total = sum(e.stacked.nbytes for e in self._stacks.values())
        share = budget * experts.stacked.nbytes // max(1, total)
        capacity = min(experts.stacked.shape[0], share // self._packed_nbytes(experts))
        pool = ExpertPool(experts, int(capacity)) if capacity >= max(1, k) else None
        self._pools[key] = pool
        return pool

    @property
    def nbytes(self) -> int:
        """Bytes reserved for the pools (touched only as their slots fill)."""
        return sum(p.nbytes for p in self._pools.values() if p is not None)

    def stats(self) -> tuple[int, int]:
        """(hits, misses) over every pool."""
        pools = [p for p in self._pools.values() if p is not None]
        return sum(p.hits for p in pools), sum(p.misses for p in pools)


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


@dataclass(frozen=True)
class _Pooled:
    """Expert ``expert`` of a pooled stack, as one matrix."""
    pool: ExpertPool
    expert: int

    @property
    def type_name(self) -> str:
        return self.pool.type_name


_NO_SLOTS = np.zeros(0, np.int64)


def _pool_matmul(pool: ExpertPool, ids, act: mm.QuantActivations) -> np.ndarray:
    """out[j] = act row j (or its only row) @ W_{ids[j]}.T from the pool's packed copies."""
    slots = pool.slots(ids)
    out = np.empty((len(ids), pool.n_tiles * P.ROWS), np.float32)
    mapped_k.pool_stack_kernel(pool.packed, slots, pool.packed, _NO_SLOTS, pool.n_tiles,
                               act.q32 or mm._NO_Q32, act.q256 or mm._NO_Q256, act.x, out, out)
    return out


def _pool_pair(a: ExpertPool, b: ExpertPool, ids, act: mm.QuantActivations):
    """_pool_matmul of two pools of one format and shape (gate and up) in one region."""
    slots_a, slots_b = a.slots(ids), b.slots(ids)
    out_a = np.empty((len(ids), a.n_tiles * P.ROWS), np.float32)
    out_b = np.empty_like(out_a)
    mapped_k.pool_stack_kernel(a.packed, slots_a, b.packed, slots_b, a.n_tiles,
                               act.q32 or mm._NO_Q32, act.q256 or mm._NO_Q256, act.x,
                               out_a, out_b)
    return out_a, out_b


def _pairable(a: ExpertPool | None, b: ExpertPool | None) -> bool:
    return (a is not None and b is not None and a.type_name == b.type_name
            and a.n_tiles == b.n_tiles and a.K == b.K)


def _matmul(w, act: mm.QuantActivations, mapped: bool) -> np.ndarray:
    if isinstance(w, _Pooled):
        slot = int(w.pool.slots([w.expert])[0])
        out = np.empty((act.x.shape[0], w.pool.n_tiles * P.ROWS), np.float32)
        mapped_k.pool_matmul_kernel(w.pool.packed, slot, w.pool.n_tiles,
                                    act.q32 or mm._NO_Q32, act.q256 or mm._NO_Q256, act.x, out)
        return out
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


def _stack(experts: Experts, ids, act, pools, k: int) -> np.ndarray:
    """out[j] = act row j (or its only row) @ expert ids[j]'s whole stacked matrix, from the
    stack's pool of packed copies when it has one, else formed from the file."""
    pool = pools.pool(experts, k) if pools is not None else None
    if pool is not None:
        return _pool_matmul(pool, ids, act)
    return mapped_k.matmul_stack(experts.type_name, experts.stacked, ids, act)


def _one_token(act, w, groups, k: int, activation: str, pools=None) -> np.ndarray:
    """A decode step's k experts, each matrix kind in one parallel region (mapped stacks):
    the bits of the expert-by-expert loop, as every row is computed and quantized alone.
    Returns: float32 (k, dim), slot j's output at row j."""
    ids = np.empty(k, np.int64)
    for e, pairs in groups:
        ids[pairs] = e
    pg = pu = None
    if pools is not None and not fused(w.gate, w.up):
        pg, pu = pools.pool(w.gate, k), pools.pool(w.up, k)
    if fused(w.gate, w.up):  # both halves in one region
        g, u = _split(_stack(w.gate, ids, act, pools, k), w.gate.N)
    elif _pairable(pg, pu):  # gate and up pools in one region
        g, u = _pool_pair(pg, pu, ids, act)
    else:
        g = _stack(w.gate, ids, act, pools, k)
        u = _stack(w.up, ids, act, pools, k)
    h = _quantize_for(glu(g, u, activation), [w.down.parts[0]])
    return _stack(w.down, ids, h, pools, k)


def _pooled_parts(w, e: int, pools, k: int) -> tuple:
    """Expert e's gate, up and down as _matmul takes them: pooled where the stack has a
    pool, else the stack's own parts."""
    def part(experts):
        pool = pools.pool(experts, k) if pools is not None and experts.mapped else None
        return _Pooled(pool, e) if pool is not None else experts.parts[e]
    return part(w.gate), part(w.up), part(w.down)


# Off: decode steps take the op-by-op path below (the tests compare the two).
native_decode = True
_ROUTE_ONE = DirectCall(cpu_block.moe_route_one)
_EXPERTS_ONE = DirectCall(cpu_block.moe_experts_one)
_NO_SCALE = np.zeros(0, np.float32)


@dataclass
class _Native:
    """How a layer's decode step runs: its weights (to tell a reused id apart), and, when it
    runs in two native calls, its three pools (None: the general path), the router's
    arguments and the calls' keys (see DirectCall)."""
    w: object
    pools: tuple | None = None
    route_args: tuple = ()
    gelu: bool = False
    keys: list | None = None


def _native(w, spec, pools: ExpertPools | None) -> _Native | None:
    """How a layer's decode step runs natively (decided once per layer), or None where it
    cannot: biases, a shared expert, gpt-oss's activation, a fused gate-and-up stack, or
    experts without pools."""
    if pools is None:
        return None
    got = pools.native.get(id(w))
    if got is None or got.w is not w:
        got = pools.native[id(w)] = _decide_native(w, spec, pools)
    return got if got.pools is not None else None


def _decide_native(w, spec, pools: ExpertPools) -> _Native:
    k = spec.n_used
    ok = (w.gate_bias is None and w.router_bias is None and w.shared_up is None
          and w.shared_gate_inp is None and spec.activation in ("silu", "gelu_tanh")
          and isinstance(w.router, mm.Weight) and w.gate.mapped and w.up.mapped
          and w.down.mapped and not fused(w.gate, w.up))
    trio = (pools.pool(w.gate, k), pools.pool(w.up, k), pools.pool(w.down, k)) if ok else ()
    if not ok or not _pairable(trio[0], trio[1]) or trio[2] is None:
        return _Native(w)
    kinds = {mm.needs(m) for m in (w.router, w.gate.parts[0], w.up.parts[0])}
    scale = _NO_SCALE if w.down_scale is None else np.ascontiguousarray(w.down_scale,
                                                                         np.float32)
    route_args = (w.router.packed, w.router.padded_rows, spec.n_experts, "q32" in kinds,
                  "q256" in kinds, moe_k.GATING[spec.gating], bool(spec.norm),
                  float(spec.scale), scale)
    return _Native(w, trio, route_args, spec.activation == "gelu_tanh", [None, None])


def _one_token_native(x: np.ndarray, nat: _Native, k: int) -> np.ndarray:
    """_one_token's bits in two native calls: the router, then (with the chosen experts'
    pool slots) the experts and their weighted sum."""
    ids = np.empty((1, k), np.int32)
    weights = np.empty((1, k), np.float32)
    args = (x, *nat.route_args, ids, weights)
    if nat.keys[0] is None:
        nat.keys[0] = fingerprint(args)
    a32, a256 = _ROUTE_ONE(nat.keys[0], *args)
    pg, pu, pd = nat.pools
    chosen = ids[0]
    out = np.empty((1, x.shape[1]), np.float32)
    args = (pg.packed, pg.slots(chosen), pu.packed, pu.slots(chosen), pd.packed,
            pd.slots(chosen), pg.n_tiles, pd.n_tiles, a32, a256, x, weights, nat.gelu, out)
    if nat.keys[1] is None:
        nat.keys[1] = fingerprint(args)
    _EXPERTS_ONE(nat.keys[1], *args)
    return out


def moe_ffn(x: np.ndarray, w, spec, pools: ExpertPools | None = None) -> np.ndarray:
    """The backend's ``moe_ffn`` (see backends/base.py) on numpy arrays.

    Args:
        x: float32 (n, dim) normed hidden states; w: MoEWeights of packed Weights and
            Experts; spec: MoESpec; pools: packed copies of mapped experts (None: none).
    Returns:
        float32 (n, dim).
    """
    if spec.activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {spec.activation}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    n, dim = x.shape
    k = spec.n_used
    if n == 1 and native_decode:
        nat = _native(w, spec, pools)
        if nat is not None:
            return _one_token_native(x, nat, k)
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
        y = _one_token(act, w, groups, k, spec.activation, pools)
    else:
        y = np.empty((n * k, dim), np.float32)
        rows = w.gate.N if fused(w.gate, w.up) else 0
        for e, pairs in groups:
            gate, up, down = _pooled_parts(w, e, pools, k)
            y[pairs] = _swiglu(_rows(act, pairs // k), gate, up, down, spec.activation,
                               expert_biases(w, e), mapped, rows)
    shared, shared_gate = _NO_SHARED, _NO_GATE
    if w.shared_up is not None:
        shared = _swiglu(act, w.shared_gate, w.shared_up, w.shared_down, spec.activation)
        if w.shared_gate_inp is not None:
            shared_gate = np.ascontiguousarray(mm.matmul(w.shared_gate_inp, act)[:, 0])
    out = np.empty((n, dim), np.float32)
    moe_k.combine(y, weights, shared, shared_gate, out)
    return out
