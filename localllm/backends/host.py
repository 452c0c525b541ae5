"""What the device backends prepare on the host before a layer runs: where each token's keys
go in its pages, which slots each sequence's attention reads (with the causal and sliding-
window mask), rotary cos/sin tables formed exactly as the CPU backend forms them, and q4_0
KV blocks rounded by the CPU pages' own code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from localllm.kernels import moe as moe_k
from localllm.kernels.jit import njit
from localllm.kernels.kvpages import ROTATED, _q4_block, v_row_nbytes
from localllm.kernels.ops import rope_tables

from .base import KVBatch, KVLayout, RopeSpec


def copy_expert_halves(be, name: str, type_name: str, raw, n_experts: int, N: int, K: int,
                       done=None) -> tuple:
    """``upload_expert_halves`` by copying each half out of the file's stride and uploading
    it as a stack of its own: every output row is its own dot product, so the halves compute
    what the whole would."""
    stack = np.asarray(raw).reshape(n_experts, -1)
    per = stack.shape[1] // 2
    halves = tuple(be.upload_experts(f"{name}#{h}", type_name,
                                     np.ascontiguousarray(stack[:, h * per:(h + 1) * per]),
                                     n_experts, N, K)
                   for h in range(2))
    if done is not None:
        done(0, stack.size)
    return halves


def kv_block_nbytes(layout: KVLayout) -> int:
    """Bytes of one block's keys and values in the device backends' token-major pages: the
    same as the CPU backend's for every KV type."""
    per = v_row_nbytes(layout.k_type, layout.head_dim) + v_row_nbytes(layout.v_type,
                                                                        layout.head_dim)
    return layout.n_kv_heads * layout.block_size * per


def kv_rotated(kv_type: str) -> bool:
    """Whether a KV type stores its vectors Hadamard-rotated (kvpages.ROTATED): its keys turn
    with the query, its values on the way in and the attention output on the way out."""
    return kv_type.upper() in ROTATED


def hadamard(x, stack):
    """Each (..., hd) vector of a device array (torch or MLX) through the normalized fast
    Walsh-Hadamard transform in blocks of the largest power of two dividing hd, with the
    float32 steps of kvpages.rotate_block (the same butterflies, then one scaling), so it is
    bit for bit the CPU pages' rotation; its own inverse.

    Args:
        x: the array; stack(a, b): a and b stacked along a new second-to-last axis.
    """
    hd = x.shape[-1]
    blk = hd & -hd
    y = x.reshape(-1, hd // blk, blk)
    h = 1
    while h < blk:
        pairs = y.reshape(y.shape[0], y.shape[1], blk // (2 * h), 2, h)
        a, c = pairs[..., 0, :], pairs[..., 1, :]
        y = stack(a + c, a - c).reshape(y.shape)
        h *= 2
    return (y * float(np.float32(1.0 / np.sqrt(blk)))).reshape(x.shape)


@njit(cache=True)
def _q4_0_rows(x, codes, bits):
    tmp = np.empty(64, np.int32)  # _q4_block's quants and scratch
    for r in range(x.shape[0]):
        bits[r] = _q4_block(x[r], tmp)
        codes[r] = tmp[:32]


def q4_0_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q4_0 KV blocks of 32-dim rows exactly as the CPU pages store them (the scale picked for
    the least squared error, kvpages._q4_block; its float64 sums are why this runs on the
    host, where MLX's Metal has no float64).

    Args:
        x: float32 (m, 32).
    Returns:
        (codes uint8 (m, 32) in 0..15, scales float16 (m,)).
    """
    x = np.ascontiguousarray(x, np.float32)
    codes = np.empty(x.shape, np.int32)
    bits = np.empty(x.shape[0], np.uint16)
    _q4_0_rows(x, codes, bits)
    return codes.astype(np.uint8), bits.view(np.float16)


@dataclass
class SeqSlots:
    """One sequence's part of an attention call: its tokens' rows in the batch, the page
    slots its keys are gathered from, and which of them each token may see."""
    rows: np.ndarray     # int64 (n_s,)
    slots: np.ndarray    # int64 (L,): block * block_size + offset
    mask: np.ndarray     # bool (n_s, L)


@dataclass
class AttentionPlan:
    """Where a batch writes its keys and what each of its sequences reads."""
    write: np.ndarray    # int64 (n,) the slot of each token's new key and value
    seqs: list


def _check(kv: KVBatch, positions: np.ndarray, n_blocks: int) -> None:
    tables, rs, bs = kv.tables, kv.row_seq, kv.block_size
    if positions.shape[0] != rs.shape[0]:
        raise ValueError("paged KV: positions and row_seq differ in length")
    if np.any(rs < 0) or np.any(rs >= tables.shape[0]) or np.any(positions < 0) \
            or np.any(positions >= tables.shape[1] * bs):
        raise ValueError("paged KV: position or sequence outside the block tables")
    page = tables[rs, positions // bs]
    if np.any(page < 0) or np.any(page >= n_blocks):
        raise ValueError("paged KV: a block the attention needs is not held")


def attention_plan(kv: KVBatch, positions, window: int, n_blocks: int) -> AttentionPlan:
    """The slots a batch writes and reads.

    Args:
        kv: the layer's KVBatch (numpy tables and row_seq).
        positions: int (n,) each token's position in its sequence.
        window: sliding-window span (keys at positions p - window + 1 .. p), 0 for none.
        n_blocks: blocks the layer's pages hold.
    Returns:
        An AttentionPlan; raises ValueError when a token's block is not held.
    """
    pos = np.asarray(positions, np.int64)
    bs = kv.block_size
    tables = np.asarray(kv.tables)
    rs = np.asarray(kv.row_seq, np.int64)
    _check(kv, pos, n_blocks)
    write = tables[rs, pos // bs].astype(np.int64) * bs + pos % bs
    seqs = []
    for s in np.unique(rs):
        rows = np.nonzero(rs == s)[0]
        p = pos[rows]
        nb = int(p.max()) // bs + 1
        blocks = tables[s, :nb].astype(np.int64)
        held = np.repeat(blocks >= 0, bs)
        slots = (np.maximum(blocks, 0)[:, None] * bs + np.arange(bs)).reshape(-1)
        kpos = np.arange(nb * bs)
        mask = kpos[None, :] <= p[:, None]
        if window > 0:
            mask &= kpos[None, :] > p[:, None] - window
        if np.any(mask & ~held[None, :]):
            raise ValueError("paged KV: a block the attention needs is not held")
        seqs.append(SeqSlots(rows, slots, mask))
    return AttentionPlan(write, seqs)


class PlanCache:
    """Attention plans of the current forward pass: every layer of a KV group sees the same
    tables, row_seq and positions, so each group's plan is made once per pass."""

    def __init__(self):
        self._pass = None

    def get(self, kv: KVBatch, positions, window: int, n_blocks: int) -> AttentionPlan:
        p = self._pass
        if p is None or p[0] is not positions or p[1] is not kv.row_seq:
            p = self._pass = (positions, kv.row_seq, {})
        key = (id(kv.tables), window)
        hit = p[2].get(key)
        if hit is None or hit[0] is not kv.tables:  # (the arrays are held: ids stay unique)
            hit = p[2][key] = (kv.tables, attention_plan(kv, positions, window, n_blocks))
        return hit[1]


class RopeTables:
    """cos/sin rows per position for each RopeSpec, grown as positions are seen (numpy)."""

    def __init__(self):
        self._tables: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._pass = None

    def lookup(self, positions, spec: RopeSpec) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin), float32 (n, n_rot // 2) each, for the given positions."""
        key = (spec.n_rot, spec.theta, spec.pos_scale, id(spec.freq_factors), spec.mscale,
               spec.yarn, spec.temp_scale, spec.temp_floor)
        pos = np.asarray(positions, np.int64)
        hi = int(pos.max()) + 1
        have = self._tables.get(key)
        if have is None or have[0].shape[0] < hi:
            n = max(hi, 2 * (have[0].shape[0] if have else 256))
            have = rope_tables(np.arange(n), spec.n_rot, spec.theta, spec.freq_factors,
                               spec.pos_scale, spec.mscale, spec.yarn, spec.temp_scale,
                               spec.temp_floor)
            self._tables[key] = have
        return have[0][pos], have[1][pos]

    def on_device(self, positions, spec: RopeSpec, upload):
        """lookup's tables as ``upload`` makes them device arrays, made once per forward pass
        (every layer with this spec sees the same positions object)."""
        p = self._pass
        if p is None or p[0] is not positions:
            p = self._pass = (positions, {})
        hit = p[1].get(id(spec))
        if hit is None or hit[0] is not spec:
            cos, sin = self.lookup(positions, spec)
            hit = p[1][id(spec)] = (spec, upload(cos), upload(sin))
        return hit[1], hit[2]


def route_tokens(logits, spec, down_scale=None) -> tuple[np.ndarray, list]:
    """Each token's top-k experts from its router logits (kernels.moe.route) and the
    (token, slot) pairs grouped by expert, as every backend's ``moe_ffn`` runs them.

    Args:
        logits: (n, n_experts) router outputs on the host; spec: the layer's MoESpec;
            down_scale: None, or float32 (n_experts,) scales of each expert's output,
            multiplied into its weights (the experts have no output biases then).
    Returns:
        (weights, groups): float32 (n, k) weights by rank, and (expert, pairs) for each chosen
        expert in ascending order, pairs the ascending flat indices t * k + j of its slots.
    """
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    n, k = logits.shape[0], spec.n_used
    ids = np.empty((n, k), np.int32)
    weights = np.empty((n, k), np.float32)
    moe_k.route(logits, k, moe_k.GATING[spec.gating], bool(spec.norm), float(spec.scale),
                ids, weights)
    if down_scale is not None:
        weights *= down_scale[ids]
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    bounds = np.searchsorted(flat[order], np.arange(spec.n_experts + 1))
    return weights, [(int(e), order[bounds[e]:bounds[e + 1]])
                     for e in np.flatnonzero(np.diff(bounds))]


def expert_biases(w, e: int) -> tuple:
    """Expert e's gate, up and down biases (Nones where the layer has none)."""
    if w.gate_bias is None:
        return None, None, None
    return w.gate_bias[e], w.up_bias[e], w.down_bias[e]
