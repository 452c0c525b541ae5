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
from .block import BlockSpec
from .common import ModelError, WeightLoader, meta_float, meta_int

SWA_ROPE_THETA = 10000.0  # Gemma 3's local layers use a fixed base


@dataclass(frozen=True)
class ModelArgs(llama.ModelArgs):
    sliding_window: int = 512
    swa_pattern: int = 6          # every n-th layer (the last of each group) is global
    attn_scale: float = 0.0

    rope_scalings = ("none", "linear")

    @classmethod
    def from_gguf(cls, meta: dict, arch: str = "gemma3") -> "ModelArgs":
        base = llama.ModelArgs.from_gguf(meta, arch)
        p = f"{arch}."
        head_dim = base.head_dim
        args = cls(**{**base.__dict__,
                      "sliding_window": meta_int(meta, p + "attention.sliding_window", 512),
                      "swa_pattern": meta_int(meta, p + "attention.sliding_window_pattern", 6),
                      "attn_scale": meta_float(meta, p + "attention.scale", 0.0)
                      or 1.0 / math.sqrt(head_dim)})
        args.check()
        return args

    def check(self) -> None:
        super().check()
        if self.swa_pattern < 0 or self.swa_pattern > 0 and self.sliding_window <= 0:
            raise ModelError(f"metadata '{self.arch}.attention.sliding_window' "
                             f"({self.sliding_window}) and '_pattern' ({self.swa_pattern}) "
                             f"must be positive")
        if self.attn_scale <= 0:
            raise ModelError(f"metadata '{self.arch}.attention.scale' must be positive, "
                             f"got {self.attn_scale}")

    def is_sliding(self, layer: int) -> bool:
        return self.swa_pattern > 0 and layer % self.swa_pattern < self.swa_pattern - 1


class Model(llama.Model):
    rope_neox = True
    activation = "gelu_tanh"

    def __init__(self, args: ModelArgs, w: WeightLoader, ctx: int = 0):
        a = args
        self.rope_local = RopeSpec(a.n_rot, SWA_ROPE_THETA, True, 1.0, None, a.rope_attn_factor)
        self.embed_scale = math.sqrt(a.dim)
        super().__init__(args, w, ctx)

    def load_block(self, w: WeightLoader, i: int):
        a, p = self.args, f"blk.{i}."
        return replace(llama.load_block(w, i, a),
                       q_norm=w.vector(p + "attn_q_norm.weight", a.head_dim),
                       k_norm=w.vector(p + "attn_k_norm.weight", a.head_dim),
                       post_attn_norm=w.vector(p + "post_attention_norm.weight", a.dim),
                       post_ffn_norm=w.vector(p + "post_ffw_norm.weight", a.dim))

    def block_spec(self, i: int) -> BlockSpec:
        a = self.args
        sliding = a.is_sliding(i)
        return BlockSpec(a.n_heads, a.n_kv_heads, a.head_dim, a.norm_eps,
                         self.rope_local if sliding else self.rope, a.attn_scale,
                         a.sliding_window if sliding else 0, self.activation)

    def embed(self, ids):
        return self.be.embed(self.tok_embd, ids, self.embed_scale)
