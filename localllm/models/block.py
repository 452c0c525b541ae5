"""The pre-norm decoder block that llama-family and Gemma 3 layers are instances of, and its
reference composition from backend operations.

An architecture describes its layers as BlockWeights (GGUF tensors, optional parts None) and
a BlockSpec; a backend may run the whole block natively (``Backend.decoder_block``), and must
then give the same bits as ``compose_block``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localllm.backends.base import Backend, KVBatch, MoESpec, RopeSpec


@dataclass(frozen=True)
class BlockSpec:
    """What varies between architectures' decoder blocks."""
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float
    rope: RopeSpec
    attn_scale: float
    window: int = 0              # sliding-window attention span, 0 for global
    activation: str = "silu"     # gated FFN activation: 'silu' or 'gelu_tanh'
    k_balance: tuple | None = None  # per-dim key scaling of rotated KV types (kvpages)
    moe: MoESpec | None = None   # the routing of a mixture-of-experts FFN (weights.moe)
    qk_norm_whole: bool = False  # QK-norm over all heads at once (OLMoE), not per head
    q_rope: RopeSpec | None = None  # the queries' own RoPE (attention temperature), else rope
    kv_source: int = -1          # the earlier layer whose KV this one reads (shared KV: it
                                 # has no pages of its own and is in that layer's group)
    recurrent: Any = None        # a DeltaNetSpec: a linear-attention layer, which keeps a
                                 # recurrent state per sequence instead of KV pages


@dataclass(frozen=True)
class BlockWeights:
    """One layer's tensors as uploaded to the backend; optional ones are None."""
    attn_norm: Any
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    ffn_norm: Any
    w_gate: Any
    w_up: Any
    w_down: Any
    bq: Any = None
    bk: Any = None
    bv: Any = None
    q_norm: Any = None           # per-head RMSNorm of queries / keys (QK-norm)
    k_norm: Any = None
    post_attn_norm: Any = None   # RMSNorm of the attention / FFN output before the residual
    post_ffn_norm: Any = None
    moe: Any = None              # MoEWeights in place of w_gate/w_up/w_down (then None)
    bo: Any = None               # the attention output's bias (gpt-oss)
    sinks: Any = None            # per-head attention sink logits, float32 numpy (gpt-oss)


def compose_block(be: Backend, x, w: BlockWeights, spec: BlockSpec, positions,
                  kv: KVBatch):
    """One decoder block from backend operations (the reference for native blocks).

    Args:
        be: the backend; x: (n, dim) hidden states; positions: (n,) token positions;
        kv: this layer's KVBatch (KVBatch.layer).
    Returns:
        The new hidden states (n, dim); ``x`` may be updated in place.
    """
    s = spec
    h = be.rms_norm(x, w.attn_norm, s.norm_eps)
    biases = [w.bq, w.bk, w.bv] if w.bq is not None else None
    q, k, v = be.linear(h, [w.wq, w.wk, w.wv], biases)
    if w.q_norm is not None:
        whole = s.qk_norm_whole
        q = be.head_norm(q, 1 if whole else s.n_heads, w.q_norm, s.norm_eps)
        k = be.head_norm(k, 1 if whole else s.n_kv_heads, w.k_norm, s.norm_eps)
    q = be.rope(q, s.n_heads, positions, s.q_rope or s.rope)
    k = be.rope(k, s.n_kv_heads, positions, s.rope)
    o = be.attention(q, k, v, kv, positions, s.n_heads, s.attn_scale, s.window, s.k_balance,
                     w.sinks)
    o = be.linear(o, [w.wo], [w.bo])[0]
    if w.post_attn_norm is not None:
        o = be.rms_norm(o, w.post_attn_norm, s.norm_eps)
    x = be.add(x, o)
    h = be.rms_norm(x, w.ffn_norm, s.norm_eps)
    if w.moe is not None and w.moe.backend is not None:
        # the experts live elsewhere (e.g. on the CPU): the hidden state crosses and back
        home = w.moe.backend
        y = be.from_numpy(home.to_numpy(home.moe_ffn(home.from_numpy(be.to_numpy(h)),
                                                     w.moe, s.moe)))
    elif w.moe is not None:
        y = be.moe_ffn(h, w.moe, s.moe)
    else:
        gate, up = be.linear(h, [w.w_gate, w.w_up])
        y = be.linear(be.glu(gate, up, s.activation), [w.w_down])[0]
    if w.post_ffn_norm is not None:
        y = be.rms_norm(y, w.post_ffn_norm, s.norm_eps)
    return be.add(x, y)


def run_block(be: Backend, x, w: BlockWeights, spec: BlockSpec, positions, kv: KVBatch):
    """The block on the backend's native path when it has one, else composed from ops (the
    native blocks have dense FFNs or experts on the same backend, no output bias or sinks,
    and rotate queries and keys alike; a QK-norm as wide as all heads is OLMoE's)."""
    if (be.fused_blocks and (w.moe is None or w.moe.backend is None)
            and spec.q_rope is None and w.bo is None
            and w.sinks is None):
        return be.decoder_block(x, w, spec, positions, kv)
    return compose_block(be, x, w, spec, positions, kv)
