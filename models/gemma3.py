"""Gemma 3: scaled embeddings, norms before and after attention and FFN, QK-norm, GELU-tanh
gated FFN, sliding-window layers with their own RoPE base and a global layer every sixth.

Norm weights are used as the GGUF file stores them (llama.cpp's converter already folds
Gemma's ``1 + w`` into the stored values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from localllm.backends.base import RopeSpec

from . import llama
from .common import WeightLoader, meta_float, meta_int

SWA_ROPE_THETA = 10000.0  # Gemma 3's local layers use a fixed base


@dataclass(frozen=True)
class ModelArgs(llama.ModelArgs):
    sliding_window: int = 512
    swa_pattern: int = 6          # every n-th layer (the last of each group) is global
    attn_scale: float = 0.0

    @classmethod
    def from_gguf(cls, meta: dict, arch: str = "gemma3") -> "ModelArgs":
        base = llama.ModelArgs.from_gguf(meta, arch)
        p = f"{arch}."
        head_dim = base.head_dim
        return cls(**{**base.__dict__,
                      "sliding_window": meta_int(meta, p + "attention.sliding_window", 512),
                      "swa_pattern": meta_int(meta, p + "attention.sliding_window_pattern", 6),
                      "attn_scale": meta_float(meta, p + "attention.scale", 0.0)
                      or 1.0 / math.sqrt(head_dim)})

    def is_sliding(self, layer: int) -> bool:
        return self.swa_pattern > 0 and layer % self.swa_pattern < self.swa_pattern - 1


class Layer(llama.Layer):
    def __init__(self, w: WeightLoader, i: int, a: ModelArgs):
        super().__init__(w, i, a)
        p = f"blk.{i}."
        self.q_norm = w.vector(p + "attn_q_norm.weight", a.head_dim)
        self.k_norm = w.vector(p + "attn_k_norm.weight", a.head_dim)
        self.post_attn_norm = w.vector(p + "post_attention_norm.weight", a.dim)
        self.post_ffn_norm = w.vector(p + "post_ffw_norm.weight", a.dim)
        self.sliding = a.is_sliding(i)


class Model(llama.Model):
    rope_neox = True
    activation = "gelu_tanh"

    def __init__(self, args: ModelArgs, w: WeightLoader):
        self.args = args
        self.be = w.backend
        a = args
        self.rope = RopeSpec(a.n_rot, a.rope_theta, True, a.rope_scale)
        self.rope_local = replace(self.rope, theta=SWA_ROPE_THETA, pos_scale=1.0)
        self.tok_embd = w.embedding("token_embd.weight", a.vocab_size, a.dim)
        self.layers = [Layer(w, i, a) for i in range(a.n_layers)]
        self.out_norm = w.vector("output_norm.weight", a.dim)
        name = "output.weight" if w.has("output.weight") else "token_embd.weight"
        self.output = w.matrix(name, a.vocab_size, a.dim)
        self.attn_scale = a.attn_scale
        self.embed_scale = math.sqrt(a.dim)

    def embed(self, ids):
        return self.be.embed(self.tok_embd, ids, self.embed_scale)

    def attention_block(self, L: Layer, x, positions, cache):
        a, be = self.args, self.be
        h = be.rms_norm(x, L.attn_norm, a.norm_eps)
        q, k, v = be.linear(h, [L.wq, L.wk, L.wv], L.qkv_bias)
        q = be.head_norm(q, a.n_heads, L.q_norm, a.norm_eps)
        k = be.head_norm(k, a.n_kv_heads, L.k_norm, a.norm_eps)
        spec = self.rope_local if L.sliding else self.rope
        q = be.rope(q, a.n_heads, positions, spec)
        k = be.rope(k, a.n_kv_heads, positions, spec)
        window = a.sliding_window if L.sliding else 0
        o = be.attention(q, k, v, cache, positions, a.n_heads, self.attn_scale, window)
        o = be.linear(o, [L.wo])[0]
        return be.add(x, be.rms_norm(o, L.post_attn_norm, a.norm_eps))

    def ffn_block(self, L: Layer, x):
        a, be = self.args, self.be
        h = be.rms_norm(x, L.ffn_norm, a.norm_eps)
        gate, up = be.linear(h, [L.w_gate, L.w_up])
        y = be.linear(be.glu(gate, up, self.activation), [L.w_down])[0]
        return be.add(x, be.rms_norm(y, L.post_ffn_norm, a.norm_eps))
