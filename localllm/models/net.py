"""A loaded model as placed layers: each decoder layer knows its backend, its weights and its
BlockSpec; the embedding and the output head sit on backends of their own. ``forward`` runs
one batch of tokens (from one or several sequences) through them, with the KV pages (on each
layer's backend) and the cache groups' block tables it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from localllm.backends.base import Backend, KVBatch

from .block import BlockSpec, BlockWeights, run_block
from .common import ModelError


@dataclass
class PlacedLayer:
    """One decoder layer where it runs."""
    index: int
    backend: Backend
    weights: BlockWeights
    spec: BlockSpec


class Net:
    """The layers and ends of a model. Architectures set ``args``, ``layers``, ``tok_embd``,
    ``out_norm``, ``output`` and the backends ``be`` (embedding) and ``head_be``."""

    args: Any
    layers: list[PlacedLayer]
    be: Backend
    head_be: Backend
    generates = True      # False: an encoder, whose outputs are hidden states only

    def embed(self, ids):
        """Hidden states of the tokens, on the embedding's backend."""
        return self.be.embed(self.tok_embd, ids)

    def forward(self, ids, positions, kv: KVBatch, logit_rows, hidden: bool = False):
        """Run tokens ``ids`` at ``positions`` through every layer, writing their KV.

        Args:
            ids: int64 (n,) token ids; positions: int64 (n,) their positions in their sequences.
            kv: the pages and block tables the layers read and write.
            logit_rows: indices into ids whose logits are wanted.
            hidden: return those rows' final hidden states (after the output norm, as
                llama.cpp's embeddings) instead of logits.
        Returns:
            float32 numpy (len(logit_rows), vocab_size) (hidden: (len(logit_rows), dim)), or
            None if no rows are wanted.
        """
        x = self.embed(ids)
        be = self.be
        for layer in self.layers:
            if layer.backend is not be:  # activations cross devices only at a boundary
                x = layer.backend.from_numpy(be.to_numpy(x))
                be = layer.backend
            x = run_block(be, x, layer.weights, layer.spec, positions, kv.layer(layer.index))
        if len(logit_rows) == 0:
            return None
        if self.head_be is not be:
            x = self.head_be.from_numpy(be.to_numpy(x))
        hb = self.head_be
        x = hb.select_rows(x, logit_rows)
        x = hb.rms_norm(x, self.out_norm, self.args.norm_eps)
        if hidden:
            return hb.to_numpy(x)
        return hb.to_numpy(hb.linear(x, [self.output])[0])

    def classify(self, pooled):
        """The classification head over pooled hidden states (rank pooling).

        Raises:
            UnsupportedModel: the model has no classification head.
        """
        raise ModelError(f"{self.args.arch} models have no classification head (cls tensors); "
                         "they cannot rank")
