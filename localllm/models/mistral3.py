"""Mistral 3 (``mistral3`` files, e.g. Ministral 3's text model): the llama block, with
llama 4's attention temperature when the file asks for it: queries of position p scaled by
log(floor(p / n_orig) + 1) * ``attention.temperature_scale`` + 1, n_orig the original
context (``rope.scaling.original_context_length``, else the training context).

YaRN-scaled files are refused by ModelArgs (not run here), as are MoE and biased variants.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from localllm.backends.base import RopeSpec

from . import llama
from .block import BlockSpec
from .common import ModelError, WeightLoader, meta_float, meta_int


@dataclass(frozen=True)
class ModelArgs(llama.ModelArgs):
    temp_scale: float = 0.0      # 0: no attention temperature
    temp_floor: int = 0          # positions per temperature step (the original context)

    # Mistral 3's YaRN files carry their own beta and log-multiplier keys, not read here
    rope_scalings = ("none", "linear")

    @classmethod
    def from_gguf(cls, meta: dict, arch: str = "mistral3") -> "ModelArgs":
        # (llama's reader under this class, so that its rope_scalings refuse YaRN)
        base = llama.ModelArgs.from_gguf.__func__(cls, meta, arch)
        p = f"{arch}."
        args = cls(**{**base.__dict__,
                      "temp_scale": meta_float(meta, p + "attention.temperature_scale", 0.0),
                      "temp_floor": meta_int(meta, p + "rope.scaling.original_context_length",
                                             base.context_length)})
        args.check()
        return args

    def check(self) -> None:
        super().check()
        if self.temp_scale and self.temp_floor <= 0:
            raise ModelError(f"metadata '{self.arch}.rope.scaling.original_context_length' "
                             f"must be positive for the attention temperature, "
                             f"got {self.temp_floor}")
        if self.temp_scale and self.n_rot != self.head_dim:
            raise ModelError(f"metadata '{self.arch}.rope.dimension_count' ({self.n_rot}) must "
                             f"be the head size ({self.head_dim}) with an attention temperature")


class Model(llama.Model):

    def __init__(self, args: ModelArgs, w: WeightLoader, ctx: int = 0):
        for name in ("blk.0.ffn_gate_inp.weight", "blk.0.attn_output.bias",
                     "blk.0.ffn_up.bias"):
            if w.has(name):
                raise ModelError(f"mistral3 files with {name.split('.', 2)[2]} "
                                 "(mixture of experts, output or FFN biases) are not supported")
        super().__init__(args, w, ctx)

    def load_rope(self, w: WeightLoader, ctx: int) -> RopeSpec:
        rope = super().load_rope(w, ctx)
        a = self.args
        # the queries' RoPE carries the temperature: their cos and sin scaled by position
        self.q_rope = (replace(rope, temp_scale=a.temp_scale, temp_floor=a.temp_floor)
                       if a.temp_scale else None)
        return rope

    def block_spec(self, i: int) -> BlockSpec:
        return replace(super().block_spec(i), q_rope=self.q_rope)
