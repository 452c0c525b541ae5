"""SmolLM3: the llama block, with RoPE left out of every fourth layer (NoPE: layers 3, 7,
11, ... attend by content alone), as llama.cpp's fixed ``n_no_rope_layer_step`` of 4."""

from __future__ import annotations

from dataclasses import replace

from . import llama
from .block import BlockSpec

ModelArgs = llama.ModelArgs

NO_ROPE_LAYER_STEP = 4   # not in the file's metadata: llama.cpp fixes it for the architecture


def uses_rope(layer: int) -> bool:
    """False for the NoPE layers (the last of each group of four)."""
    return (layer + 1) % NO_ROPE_LAYER_STEP != 0


class Model(llama.Model):

    def block_spec(self, i: int) -> BlockSpec:
        spec = super().block_spec(i)
        if uses_rope(i):
            return spec
        # no rotated dims: queries and keys pass through RoPE unchanged
        return replace(spec, rope=replace(self.rope, n_rot=0, freq_factors=None))
