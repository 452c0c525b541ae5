"""The CPU backend: Numba kernels over weights repacked from GGUF quant blocks.

It is the reference the other backends are held to. Every operation is batch-invariant: a
token's result does not depend on the other tokens computed with it.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from localllm.errors import BadSetting
from localllm.formats.dequant import dequantize
from localllm.formats.quants import row_nbytes
from localllm.kernels import attention as attn_k
from localllm.kernels import deltanet
from localllm.kernels import encoder as enc_k
from localllm.kernels.direct import DirectCall, fingerprint
from localllm.kernels import kvpages
from localllm.kernels import matmul as mm
from localllm.kernels import ops

from . import cpu_block, cpu_moe
from .base import KVBatch, KVLayout, MemoryInfo, RopeSpec
from .cpu_store import PackedStore
from .host import RopeTables, copy_expert_halves

_EMPTY = np.zeros(0, np.float32)


def _balance(k_balance) -> np.ndarray:
    """A BlockSpec's key balance as the kernels take it (empty for none)."""
    return _EMPTY if k_balance is None else np.asarray(k_balance, np.float32)


# The fused block without Numba's per-call dispatch (kernels/direct.py).
_BLOCK = DirectCall(cpu_block.decoder_block)
_DELTA_BLOCK = DirectCall(cpu_block.delta_block)
_ATTN_BLOCK = DirectCall(cpu_block.attention_block)
_GATED_FRONT = DirectCall(cpu_block.gated_attention_front)
_GATED_BACK = DirectCall(cpu_block.gated_attention_back)


def _block_args(w, spec) -> tuple:
    """The fused kernel's BlockArrays and BlockConfig for a BlockWeights and BlockSpec (with a
    mixture of experts: attention_block's AttnArrays, the FFN's sizes 0)."""
    vec = lambda a: _EMPTY if a is None else a  # noqa: E731
    if w.moe is not None:
        weights = cpu_block.AttnArrays(
            attn_norm=w.attn_norm, wq=w.wq.packed, wk=w.wk.packed, wv=w.wv.packed,
            bq=vec(w.bq), bk=vec(w.bk), bv=vec(w.bv), q_norm=vec(w.q_norm),
            k_norm=vec(w.k_norm), wo=w.wo.packed, post_attn_norm=vec(w.post_attn_norm),
            ffn_norm=w.ffn_norm, k_balance=_balance(spec.k_balance))
        cfg = cpu_block.BlockConfig(
            eps=float(spec.norm_eps), n_heads=spec.n_heads, n_kv=spec.n_kv_heads,
            hd=spec.head_dim, neox=bool(spec.rope.neox), window=int(spec.window),
            scale=float(spec.attn_scale), gelu=False, hidden=0, q_rows=w.wq.padded_rows,
            kv_rows=w.wk.padded_rows, f_rows=0, d_rows=w.wo.padded_rows)
        return weights, cfg
    weights = cpu_block.BlockArrays(
        attn_norm=w.attn_norm, wq=w.wq.packed, wk=w.wk.packed, wv=w.wv.packed, bq=vec(w.bq),
        bk=vec(w.bk), bv=vec(w.bv), q_norm=vec(w.q_norm), k_norm=vec(w.k_norm),
        wo=w.wo.packed, post_attn_norm=vec(w.post_attn_norm), ffn_norm=w.ffn_norm,
        w_gate=w.w_gate.packed, w_up=w.w_up.packed, w_down=w.w_down.packed,
        post_ffn_norm=vec(w.post_ffn_norm), k_balance=_balance(spec.k_balance))
    cfg = cpu_block.BlockConfig(
        eps=float(spec.norm_eps), n_heads=spec.n_heads, n_kv=spec.n_kv_heads,
        hd=spec.head_dim, neox=bool(spec.rope.neox), window=int(spec.window),
        scale=float(spec.attn_scale), gelu=spec.activation == "gelu_tanh", hidden=w.w_gate.N,
        q_rows=w.wq.padded_rows, kv_rows=w.wk.padded_rows, f_rows=w.w_gate.padded_rows,
        d_rows=w.wo.padded_rows)
    if spec.activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"unknown activation {spec.activation}")
    return weights, cfg


def _delta_args(w, spec) -> tuple:
    """The fused DeltaNet block's DeltaArrays and DeltaConfig for a DeltaNet layer's tensors
    (models/qwen35.py DeltaNetLayer, dense FFN) and its BlockSpec."""
    f, r = w.ffn, spec.recurrent
    if spec.activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"unknown activation {spec.activation}")
    weights = cpu_block.DeltaArrays(
        attn_norm=w.attn_norm, wqkv=w.wqkv.packed, wz=w.wz.packed, wbeta=w.wbeta.packed,
        walpha=w.walpha.packed, conv_t=np.ascontiguousarray(w.small.conv.T, np.float32),
        dt_bias=w.small.dt_bias, a=w.small.a, ssm_norm=w.ssm_norm, wout=w.wout.packed,
        ffn_norm=f["norm"], w_gate=f["w_gate"].packed, w_up=f["w_up"].packed,
        w_down=f["w_down"].packed)
    cfg = cpu_block.DeltaConfig(
        eps=float(spec.norm_eps), l2_eps=float(r.eps), n_k=r.n_k_heads, n_v=r.n_v_heads,
        hd=r.head_dim, gelu=spec.activation == "gelu_tanh", hidden=f["w_gate"].N,
        qkv_rows=w.wqkv.padded_rows, z_rows=w.wz.padded_rows, h_rows=w.wbeta.padded_rows,
        f_rows=f["w_gate"].padded_rows, d_rows=w.wout.padded_rows)
    if w.walpha.padded_rows != w.wbeta.padded_rows or f["w_down"].padded_rows != w.wout.padded_rows:
        raise ValueError("a DeltaNet block's alpha and beta (and its two output projections) "
                         "must have the same shapes")
    return weights, cfg


def _gated_args(w, spec) -> tuple:
    """The fused gated-attention kernels' GatedArrays and BlockConfig for a gated attention
    layer's tensors (models/qwen35.py AttnWeights, dense FFN) and its BlockSpec."""
    f = w.ffn
    if spec.activation not in ("silu", "gelu_tanh"):
        raise ValueError(f"unknown activation {spec.activation}")
    weights = cpu_block.GatedArrays(
        attn_norm=w.attn_norm, wq=w.wq.packed, wq_gate=w.wq_gate.packed, wk=w.wk.packed,
        wv=w.wv.packed, q_norm=w.q_norm, k_norm=w.k_norm, wo=w.wo.packed, ffn_norm=f["norm"],
        w_gate=f["w_gate"].packed, w_up=f["w_up"].packed, w_down=f["w_down"].packed)
    cfg = cpu_block.BlockConfig(
        eps=float(spec.norm_eps), n_heads=spec.n_heads, n_kv=spec.n_kv_heads,
        hd=spec.head_dim, neox=bool(spec.rope.neox), window=0, scale=float(spec.attn_scale),
        gelu=spec.activation == "gelu_tanh", hidden=f["w_gate"].N, q_rows=w.wq.padded_rows,
        kv_rows=w.wk.padded_rows, f_rows=f["w_gate"].padded_rows, d_rows=w.wo.padded_rows)
    if (w.wq_gate.padded_rows != w.wq.padded_rows or w.wv.padded_rows != w.wk.padded_rows
            or f["w_down"].padded_rows != w.wo.padded_rows):
        raise ValueError("a gated attention block's query and gate (keys and values, two "
                         "output projections) must have the same shapes")
    return weights, cfg


@dataclass
class Embedding:
    """Token embedding rows kept as GGUF blocks; rows are dequantized on lookup."""
    type_name: str
    rows: np.ndarray  # uint8 (vocab, row_bytes), usually a view of the mapped file
    dim: int


@dataclass
class RecurrentState:
    """One sequence's state of a DeltaNet layer: the conv's last inputs (K - 1, channels)
    and the delta rule's (n_v_heads, head_dim, head_dim) matrices."""
    window: np.ndarray
    state: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.window.nbytes + self.state.nbytes


@dataclass
class KVPages:
    """One layer's KV pages: flat byte arrays in the kernels' page layout (kernels/kvpages.py),
    mapped lazily, so memory is taken only as blocks are first written."""
    layout: KVLayout
    K: tuple        # kvpages.Pages<type>
    V: tuple
    k_block: int    # bytes of one block's keys, of its values
    v_block: int

    @property
    def nbytes(self) -> int:
        return self.K.a.size + self.V.a.size - 2 * kvpages.PAD


def _block_nbytes(layout: KVLayout) -> tuple[int, int]:
    hd, n = layout.head_dim, layout.n_kv_heads
    return (n * layout.block_size // 16 * kvpages.k_group_nbytes(layout.k_type, hd),
            n * layout.block_size * kvpages.v_row_nbytes(layout.v_type, hd))


def _lazy_bytes(n: int) -> np.ndarray:
    """A zeroed byte array whose pages the OS maps only when first touched."""
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), np.uint8)[:n]


class CpuBackend:
    """Backend on the host CPU."""

    name = "cpu"
    device = "cpu"
    copies_weights = True  # matrices are repacked, so the file's pages can be dropped
    recurrent = True

    def __init__(self, fused: bool = True, weight_cache: str | os.PathLike | None = None,
                 expert_cache: int | None = None):
        """The kernels' thread count and the allocator are the process's, set by
        ``configure_process``.

        Args:
            fused: run decoder blocks as one kernel call (same bits as op by op).
            weight_cache: directory for repacked-weight files reused across loads (None: off).
            expert_cache: bytes of packed copies kept of mapped experts (cpu_moe.ExpertPools;
                None: half the memory available beyond 1 GiB when the first MoE layer runs).
        """
        self.expert_pools = cpu_moe.ExpertPools(expert_cache)
        self._rope = RopeTables()  # cos/sin per RopeSpec, grown as positions are seen
        self._blocks: dict[int, tuple] = {}
        self._weight_cache = weight_cache
        self._store = None
        self._rope_memo = None
        self._held = 0
        self._tile_bytes: dict[tuple[str, int], int] = {}
        # False: blocks run op by op (models/block.py's reference composition); same bits.
        self.fused_blocks = fused

    # ---- memory --------------------------------------------------------------------

    def memory_info(self) -> MemoryInfo:
        import psutil
        vm = psutil.virtual_memory()
        return MemoryInfo("host", int(vm.available), int(vm.total))

    def plan_matrix_nbytes(self, type_name: str, N: int, K: int) -> int:
        """Packed bytes: the kernels' layout per 16-row tile (measured once per format and
        row length by packing one empty tile), times the tiles."""
        key = (type_name, K)
        if key not in self._tile_bytes:
            rows = np.zeros(16 * row_nbytes(type_name, K), np.uint8)
            self._tile_bytes[key] = mm.pack(type_name, rows, 16, K).nbytes
        return -(-N // 16) * self._tile_bytes[key]

    def plan_experts_nbytes(self, type_name: str, n_experts: int, N: int,
                            K: int) -> tuple[int, int]:
        """Quantized experts are read from the mapped file in place: (0, their file bytes);
        others are packed: (packed bytes, 0)."""
        if cpu_moe.can_map(type_name, N, K):
            return 0, n_experts * N * row_nbytes(type_name, K)
        return n_experts * self.plan_matrix_nbytes(type_name, N, K), 0

    def plan_scratch_nbytes(self, largest: int) -> int:
        return 0  # the kernels read the packed blocks directly

    def held_nbytes(self) -> int:
        return self._held

    # ---- weights -------------------------------------------------------------------

    def begin_model(self, gguf_path) -> None:
        """Look for (or start) the repacked-weight file of the model about to be loaded."""
        if self._weight_cache is not None:
            self._store = PackedStore(self._weight_cache, gguf_path)

    def end_model(self) -> None:
        """Write the repacked-weight file if this load had to pack."""
        if self._store is not None:
            self._store.save()
            self._store = None

    def upload_matrix(self, name, type_name, raw, N, K, done=None):
        store = self._store
        if store is not None:
            w = store.get(name, type_name, N, K)
            if w is not None:
                self._held += w.nbytes
                return w
        w = mm.pack(type_name, raw, N, K, done)
        if store is not None:
            store.add(name, w)
        self._held += w.nbytes
        return w

    def upload_experts(self, name, type_name, raw, n_experts, N, K, done=None):
        if cpu_moe.can_map(type_name, N, K):
            # the file's pages are the weights; ``done`` drops an expert's pages once the
            # expert pool holds a packed copy
            w = cpu_moe.map_experts(type_name, raw, n_experts, N, K, done)
            self.expert_pools.register(w)
            return w
        w = cpu_moe.pack_experts(type_name, raw, n_experts, N, K, done)
        self._held += w.nbytes
        return w

    def upload_expert_halves(self, name, type_name, raw, n_experts, N, K, done=None):
        if cpu_moe.can_map(type_name, 2 * N, K):
            # one mapped stack of 2N rows; moe_ffn computes both halves in one matmul
            halves = cpu_moe.map_expert_halves(type_name, raw, n_experts, N, K, done)
            self.expert_pools.register(halves[0])
            return halves
        return copy_expert_halves(self, name, type_name, raw, n_experts, N, K, done)

    def upload_vector(self, values):
        v = np.ascontiguousarray(values, dtype=np.float32)
        self._held += v.nbytes
        return v

    def upload_embedding(self, type_name: str, rows: np.ndarray, dim: int) -> Embedding:
        return Embedding(type_name, rows, dim)

    def matrix_nbytes(self, w) -> int:
        """Anonymous bytes plus those read from the mapped file in place (mapped experts)."""
        return int(w.nbytes) + int(w.file_nbytes)

    def embed(self, table: Embedding, ids, scale: float = 1.0):
        ids = np.asarray(ids, np.int64)
        rows = np.ascontiguousarray(table.rows[ids])
        x = dequantize(rows.reshape(-1), table.type_name, (len(ids), table.dim))
        if scale != 1.0:
            x *= np.float32(scale)
        return np.ascontiguousarray(x, dtype=np.float32)

    # ---- math ----------------------------------------------------------------------

    def rms_norm(self, x, weight, eps):
        out = np.empty_like(x)
        ops.rms_norm(x, weight, eps, out)
        return out

    def linear(self, x, weights, biases=None):
        kinds = {mm.needs(w) for w in weights}
        act = mm.quantize(x, need32="q32" in kinds, need256="q256" in kinds)
        outs = [mm.matmul(w, act) for w in weights]
        if biases is not None:
            for y, b in zip(outs, biases):
                if b is not None:
                    y += b
        return outs

    def head_norm(self, x, n_heads, weight, eps):
        x = np.ascontiguousarray(x)
        ops.rms_norm_heads(x.reshape(x.shape[0], n_heads, -1), weight, eps)
        return x

    def rope(self, x, n_heads, positions, spec: RopeSpec):
        x = np.ascontiguousarray(x)
        cos, sin = self._rope.lookup(positions, spec)
        ops.rope(x.reshape(x.shape[0], n_heads, -1), cos, sin, spec.neox)
        return x

    # ---- recurrent layers ------------------------------------------------------------

    def delta_net(self, qkv, alpha, beta, w, spec, kv: KVBatch):
        qkv, alpha, beta = (np.ascontiguousarray(a, dtype=np.float32) for a in (qkv, alpha, beta))
        out = np.empty((qkv.shape[0], spec.n_v_heads * spec.head_dim), np.float32)
        rows = np.asarray(kv.row_seq)
        start = 0
        while start < len(rows):  # each sequence's tokens are consecutive rows
            r = rows[start]
            end = start + 1
            while end < len(rows) and rows[end] == r:
                end += 1
            st = kv.states[r]
            deltanet.delta_net(qkv[start:end], alpha[start:end], beta[start:end], w.conv,
                               w.dt_bias, w.a, st.window, st.state, spec.n_k_heads,
                               spec.head_dim, float(spec.eps), out[start:end])
            start = end
        return out

    def new_recurrent_state(self, spec):
        st = RecurrentState(np.zeros((spec.conv_kernel - 1, spec.conv_channels), np.float32),
                            np.zeros((spec.n_v_heads, spec.head_dim, spec.head_dim),
                                     np.float32))
        return st

    def copy_recurrent_state(self, state):
        return RecurrentState(state.window.copy(), state.state.copy())

    @staticmethod
    def recurrent_state_nbytes(spec) -> int:
        return 4 * ((spec.conv_kernel - 1) * spec.conv_channels
                    + spec.n_v_heads * spec.head_dim ** 2)

    # ---- KV pages --------------------------------------------------------------------

    @staticmethod
    def kv_block_nbytes(layout: KVLayout) -> int:
        return sum(_block_nbytes(layout))

    def new_kv_pages(self, layout: KVLayout, n_blocks: int) -> KVPages:
        for t in (layout.k_type, layout.v_type):
            kvpages.check_head_dim(t, layout.head_dim)
        if layout.block_size <= 0 or layout.block_size % attn_k.KEYS_PER_BLOCK:
            raise BadSetting(f"KV block size must be a positive multiple of "
                             f"{attn_k.KEYS_PER_BLOCK}, got {layout.block_size}",
                             param="kv_block_size")
        kb, vb = _block_nbytes(layout)
        K = kvpages.PAGE_CLASSES[layout.k_type](_lazy_bytes(n_blocks * kb + kvpages.PAD))
        V = kvpages.PAGE_CLASSES[layout.v_type](_lazy_bytes(n_blocks * vb + kvpages.PAD))
        pages = KVPages(layout, K, V, kb, vb)
        self._held += pages.nbytes
        return pages

    def copy_kv_block(self, pages: KVPages, src: int, dst: int) -> None:
        n_kv = pages.layout.n_kv_heads
        for arr, nb in ((pages.K.a, pages.k_block), (pages.V.a, pages.v_block)):
            per = nb // n_kv  # a block's bytes of one head: heads are laid out apart
            n_blocks = (arr.size - kvpages.PAD) // nb
            for h in range(n_kv):
                a = (h * n_blocks + src) * per
                b = (h * n_blocks + dst) * per
                arr[b:b + per] = arr[a:a + per]

    def _paged(self, kv: KVBatch) -> attn_k.PagedKV:
        p = kv.pages
        return attn_k.PagedKV(p.K, p.V, kv.tables, kv.row_seq, kv.block_size,
                              p.layout.n_kv_heads)

    def attention(self, q, k, v, kv: KVBatch, positions, n_heads, scale, window=0,
                  k_balance=None, sinks=None):
        pk = self._paged(kv)
        # copies: the kernel works in place on its scratch
        q, k, v = (np.array(a, np.float32, order="C") for a in (q, k, v))
        out = np.empty_like(q)
        attn_k.paged_attention(q, k, v, pk.K, pk.V, pk.tables, pk.row_seq, pk.block_size,
                               pk.n_kv, np.asarray(positions, np.int64), int(window),
                               float(scale), _balance(k_balance), _balance(sinks), out)
        return out

    def decoder_block(self, x, w, spec, positions, kv: KVBatch):
        """One whole decoder block in a single Numba call (see models/block.py; with a mixture
        of experts on this backend, its attention sublayer in one call and the experts as
        ``moe_ffn`` runs them); a DeltaNet
        block with a dense FFN (``spec.recurrent`` set: models/qwen35.py) in one call per
        sequence of the batch; a gated attention block (a ``wq_gate``: Qwen3.5's) in two
        calls, its gate's sigmoid between them."""
        if spec.recurrent is not None:
            return self._delta_block(x, w, spec, kv)
        gated = getattr(w, "wq_gate", None) is not None
        entry = self._blocks.get(id(w))
        if entry is None or entry[0] is not w:
            args = (_gated_args if gated else _block_args)(w, spec)
            entry = (w, args, fingerprint(args))
            self._blocks[id(w)] = entry
        weights, cfg = entry[1]
        # Every layer of one forward pass sees the same positions: look the rotary tables
        # up once per (positions, spec) rather than once per layer.
        memo = self._rope_memo
        if memo is None or memo[0] is not positions or memo[1] is not spec.rope:
            cos, sin = self._rope.lookup(positions, spec.rope)
            memo = self._rope_memo = (positions, spec.rope, cos, sin,
                                      np.asarray(positions, np.int64))
        x = np.ascontiguousarray(x, dtype=np.float32)  # updated in place by the kernel
        p = kv.pages
        # What decides the compiled version: the layer's argument types, and those of the
        # arrays that change from call to call.
        key = (entry[2], type(p.K), type(p.V), fingerprint(
            (x, kv.tables, kv.row_seq, memo[4], memo[2], memo[3], p.K.a, p.V.a)))
        if getattr(w, "moe", None) is not None:
            # the attention sublayer and the FFN's norm in one call, the experts as moe_ffn
            # runs them (compose_block's order)
            h = np.empty_like(x)
            _ATTN_BLOCK(key, x, weights, cfg, self._paged(kv), memo[4], memo[2], memo[3], h)
            y = self.moe_ffn(h, w.moe, spec.moe)
            if w.post_ffn_norm is not None:
                y = self.rms_norm(y, w.post_ffn_norm, spec.norm_eps)
            return self.add(x, y)
        if not gated:
            _BLOCK(key, x, weights, cfg, self._paged(kv), memo[4], memo[2], memo[3])
            return x
        o, gate = _GATED_FRONT(key, x, weights, cfg, self._paged(kv), memo[4], memo[2],
                               memo[3])
        # the gate's sigmoid as the op-by-op path takes it (numpy's exp), between the calls
        g = cpu_moe.glu(gate, o, "sigmoid")
        _GATED_BACK((entry[2], fingerprint((x, g))), x, g, weights, cfg)
        return x

    def _delta_block(self, x, w, spec, kv: KVBatch):
        entry = self._blocks.get(id(w))
        if entry is None or entry[0] is not w:
            args = _delta_args(w, spec)
            entry = (w, args, fingerprint(args))
            self._blocks[id(w)] = entry
        weights, cfg = entry[1]
        x = np.ascontiguousarray(x, dtype=np.float32)  # updated in place by the kernel
        rows = np.asarray(kv.row_seq)
        start = 0
        while start < len(rows):  # each sequence's tokens are consecutive rows
            end = start + 1
            while end < len(rows) and rows[end] == rows[start]:
                end += 1
            st = kv.states[rows[start]]
            part = x if end - start == len(rows) else np.ascontiguousarray(x[start:end])
            key = (entry[2], fingerprint((part, st.window, st.state)))
            _DELTA_BLOCK(key, part, weights, cfg, st.window, st.state)
            if part is not x:
                x[start:end] = part
            start = end
        return x

    def glu(self, gate, up, act):
        return cpu_moe.glu(gate, up, act)

    def add(self, x, y):
        ops.add_inplace(x, y)
        return x

    def moe_ffn(self, x, w, spec):
        return cpu_moe.moe_ffn(x, w, spec, self.expert_pools)

    def layer_norm(self, x, weight, bias, eps):
        out = np.empty_like(x)
        enc_k.layer_norm(np.ascontiguousarray(x), weight, _EMPTY if bias is None else bias,
                         float(eps), out)
        return out

    def act(self, x, act):
        kinds = {"gelu_tanh": 0, "tanh": 1}
        if act not in kinds:
            raise ValueError(f"unknown activation {act}")
        out = np.empty_like(x)
        enc_k.activation(np.ascontiguousarray(x), out, kinds[act])
        return out

    def encoder_attention(self, q, k, v, starts, n_heads, scale):
        q, k, v = (np.ascontiguousarray(a, np.float32) for a in (q, k, v))
        hd = q.shape[1] // n_heads
        out = np.empty_like(q)
        enc_k.encoder_attention(q, k, v, np.asarray(starts, np.int64), n_heads,
                                k.shape[1] // hd, float(scale), out)
        return out

    def select_rows(self, x, rows: Sequence[int]):
        return np.ascontiguousarray(x[np.asarray(rows, np.int64)])

    def to_numpy(self, x):
        return x

    def from_numpy(self, x):
        return np.ascontiguousarray(x, dtype=np.float32)

    def logsumexp(self, logits) -> float:
        """log(sum(exp(logits))) of one row, vectorized (for the chosen token's log-prob)."""
        return float(ops.logsumexp(np.ascontiguousarray(logits, dtype=np.float32)))
