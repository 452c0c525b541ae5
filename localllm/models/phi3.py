"""Phi-3 (and Phi-3.5 / Phi-4-mini, which share the GGUF architecture): the llama block with
fused QKV and gate/up projections and NeoX-style RoPE, possibly partial, with LongRoPE's
per-frequency factors for long contexts.

LongRoPE files carry two factor sets: llama.cpp uses the long one when the context is longer
than the original training context, else the short one, and multiplies the rotated dims by
the file's attention factor (llama.ModelArgs.rope_attn_factor). Sliding-window attention,
which the metadata may name, is not applied, as in llama.cpp.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from localllm.backends.base import RopeSpec

from . import llama
from .block import BlockWeights
from .common import ModelError, WeightLoader, meta_int


@dataclass(frozen=True)
class ModelArgs(llama.ModelArgs):
    original_context_length: int = 0   # beyond it the long LongRoPE factors apply

    rope_scalings = ("none", "linear", "longrope")

    @classmethod
    def from_gguf(cls, meta: dict, arch: str = "phi3") -> "ModelArgs":
        base = super().from_gguf(meta, arch)   # checks the scaling type against ours
        p = f"{arch}."
        args = replace(base, original_context_length=meta_int(
            meta, p + "rope.scaling.original_context_length", base.context_length))
        if args.n_heads * args.head_dim != args.dim:
            raise ModelError(f"metadata '{p}attention.head_count' ({args.n_heads}) times the "
                             f"head size ({args.head_dim}) is not '{p}embedding_length' "
                             f"({args.dim}), as {arch} needs")
        return args


class Model(llama.Model):
    rope_neox = True

    def load_rope(self, w: WeightLoader, ctx: int) -> RopeSpec:
        """LongRoPE's long factors beyond the original context, else the short ones."""
        a = self.args
        have = [w.has(f"rope_factors_{k}.weight") for k in ("long", "short")]
        if not any(have):
            return super().load_rope(w, ctx)
        if not all(have):
            raise ModelError("the file has only one of rope_factors_long and "
                             "rope_factors_short; LongRoPE needs both")
        which = "long" if ctx > a.original_context_length else "short"
        factors = w.host_vector(f"rope_factors_{which}.weight", a.n_rot // 2)
        return RopeSpec(a.n_rot, a.rope_theta, True, a.rope_scale, factors, a.rope_attn_factor)

    def load_block(self, w: WeightLoader, i: int) -> BlockWeights:
        a, p = self.args, f"blk.{i}."
        # ffn_up holds the gate's rows, then the up projection's
        gate, up = w.matrix_split(p + "ffn_up.weight", a.dim, [a.hidden_dim] * 2)
        return BlockWeights(
            attn_norm=w.vector(p + "attn_norm.weight", a.dim),
            **llama.load_qkv(w, i, a),
            wo=w.matrix(p + "attn_output.weight", a.dim, a.dim),
            ffn_norm=w.vector(p + "ffn_norm.weight", a.dim),
            w_gate=gate, w_up=up,
            w_down=w.matrix(p + "ffn_down.weight", a.dim, a.hidden_dim))
