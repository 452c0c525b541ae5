"""Qwen2 and Qwen2.5: the llama block with biases on the query, key and value projections
and NeoX-style (half-split) RoPE; the output head is often tied to the embedding."""

from __future__ import annotations

from . import llama
from .common import ModelError, WeightLoader

ModelArgs = llama.ModelArgs


class Model(llama.Model):
    rope_neox = True

    def __init__(self, args: ModelArgs, w: WeightLoader, ctx: int = 0):
        if w.has("output.bias"):
            raise ModelError(f"{args.arch}: an output bias (output.bias) is not supported")
        super().__init__(args, w, ctx)
