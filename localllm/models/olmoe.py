"""OLMoE: a llama block with NeoX-style RoPE whose QK-norm is one RMSNorm over all heads'
queries (and keys) together, and mixture-of-experts FFNs with softmax top-k weights left
unnormalised."""

from __future__ import annotations

from dataclasses import replace

from . import llama
from .block import BlockSpec, BlockWeights
from .common import WeightLoader

ModelArgs = llama.ModelArgs


class Model(llama.Model):
    rope_neox = True
    moe_norm = False

    def load_block(self, w: WeightLoader, i: int) -> BlockWeights:
        a, p = self.args, f"blk.{i}."
        return replace(llama.load_block(w, i, a),
                       q_norm=w.vector(p + "attn_q_norm.weight", a.n_heads * a.head_dim),
                       k_norm=w.vector(p + "attn_k_norm.weight", a.n_kv_heads * a.head_dim))

    def balanced(self, w: WeightLoader, i: int, spec: BlockSpec) -> BlockSpec:
        # A norm across heads leaves no per-dimension key scale to balance.
        return spec

    def block_spec(self, i: int) -> BlockSpec:
        return replace(super().block_spec(i), qk_norm_whole=True)
