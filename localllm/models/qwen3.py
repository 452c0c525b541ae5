"""Qwen3 (dense): the llama block without projection biases, with an RMSNorm over each query
and key head (QK-norm) before NeoX-style RoPE; head_dim may differ from dim / n_heads."""

from __future__ import annotations

from dataclasses import replace

from . import llama
from .block import BlockWeights
from .common import WeightLoader

ModelArgs = llama.ModelArgs


class Model(llama.Model):
    rope_neox = True

    def load_block(self, w: WeightLoader, i: int) -> BlockWeights:
        a, p = self.args, f"blk.{i}."
        return replace(llama.load_block(w, i, a),
                       q_norm=w.vector(p + "attn_q_norm.weight", a.head_dim),
                       k_norm=w.vector(p + "attn_k_norm.weight", a.head_dim))
