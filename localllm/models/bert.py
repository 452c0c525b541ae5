"""BERT-family encoders (`bert`, `nomic-bert`): bidirectional attention over each whole input
with no KV cache, token-type and (bert) absolute position embeddings or (nomic-bert) rotary
positions, post-LayerNorm blocks with a GELU (bert) or SwiGLU (nomic-bert) feed-forward, and
the classification head of rerankers (``cls``, ``cls.output``), as llama.cpp runs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from localllm.backends.base import KVBatch, RopeSpec

from .block import BlockSpec
from .common import ModelError, WeightLoader, meta_float, meta_get, meta_int, pooling_type
from .net import Net, PlacedLayer

@dataclass(frozen=True)
class ModelArgs:
    arch: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    norm_eps: float
    context_length: int
    rope_theta: float
    n_rot: int
    pooling: str

    @classmethod
    def from_gguf(cls, meta: dict, arch: str = "bert") -> "ModelArgs":
        p = f"{arch}."
        dim = meta_int(meta, p + "embedding_length")
        n_heads = meta_int(meta, p + "attention.head_count")
        if n_heads <= 0 or dim % n_heads:
            raise ModelError(f"metadata '{p}embedding_length' ({dim}) is not a multiple of "
                             f"'{p}attention.head_count' ({n_heads})")
        tokens = meta_get(meta, "tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelError("metadata key 'tokenizer.ggml.tokens' is missing")
        if meta_get(meta, p + "attention.causal", False):
            raise ModelError(f"metadata '{p}attention.causal' is true; {arch} encoders "
                             "attend bidirectionally")
        head_dim = dim // n_heads
        args = cls(
            arch=arch, dim=dim, n_layers=meta_int(meta, p + "block_count"), n_heads=n_heads,
            n_kv_heads=meta_int(meta, p + "attention.head_count_kv", n_heads),
            head_dim=head_dim, hidden_dim=meta_int(meta, p + "feed_forward_length"),
            vocab_size=len(tokens),
            norm_eps=meta_float(meta, p + "attention.layer_norm_epsilon", 1e-12),
            context_length=meta_int(meta, p + "context_length", 512),
            rope_theta=meta_float(meta, p + "rope.freq_base", 1000.0),
            n_rot=meta_int(meta, p + "rope.dimension_count", head_dim),
            pooling=pooling_type(meta, arch))
        for name in ("n_layers", "n_kv_heads", "hidden_dim", "context_length"):
            if getattr(args, name) <= 0:
                raise ModelError(f"metadata for {name} of {arch} must be positive")
        if n_heads % args.n_kv_heads:
            raise ModelError(f"metadata '{p}attention.head_count' ({n_heads}) is not a "
                             f"multiple of '{p}attention.head_count_kv' ({args.n_kv_heads})")
        return args


@dataclass(frozen=True)
class EncoderWeights:
    """One encoder layer's tensors as uploaded; optional biases are None."""
    wq: Any
    wk: Any
    wv: Any
    wo: Any
    attn_out_norm: Any
    attn_out_norm_b: Any
    w_up: Any
    w_down: Any
    out_norm: Any
    out_norm_b: Any
    w_gate: Any = None           # nomic-bert's SwiGLU gate
    bq: Any = None
    bk: Any = None
    bv: Any = None
    bo: Any = None
    b_up: Any = None
    b_down: Any = None


def sequence_starts(row_seq) -> list[int]:
    """Where each sequence's rows begin (and the end), from each token's row in the batch.

    Raises:
        ModelError: a sequence's tokens that are not contiguous.
    """
    starts = [0]
    seen = set()
    for i in range(1, len(row_seq) + 1):
        if i == len(row_seq) or row_seq[i] != row_seq[i - 1]:
            r = int(row_seq[i - 1])
            if r in seen:
                raise ModelError("an encoder batch must hold each sequence's tokens together")
            seen.add(r)
            starts.append(i)
    return starts


class Model(Net):
    """A BERT-family encoder: its outputs are hidden states, pooled into embeddings."""

    generates = False

    def __init__(self, args: ModelArgs, w: WeightLoader, ctx: int = 0):
        self.args = a = args
        self.be = w.placement.embed
        self.head_be = w.placement.head
        self.rotary = a.arch == "nomic-bert"
        self.rope = RopeSpec(a.n_rot, a.rope_theta, True)
        self.tok_embd = w.embedding("token_embd.weight", a.vocab_size, a.dim)
        self.type_embd = self._types(w)
        self.pos_embd = None
        if not self.rotary:
            info = w.file.tensors.get("position_embd.weight")
            if info is None:
                raise ModelError("tensor 'position_embd.weight' is missing from the file")
            self.n_positions = int(info.shape[0])
            self.pos_embd = w.embedding("position_embd.weight", self.n_positions, a.dim)
        self.tok_norm = w.vector("token_embd_norm.weight", a.dim)
        self.tok_norm_b = w.vector("token_embd_norm.bias", a.dim)
        spec = BlockSpec(a.n_heads, a.n_kv_heads, a.head_dim, a.norm_eps, self.rope,
                         1.0 / math.sqrt(a.head_dim))
        self.layers = [PlacedLayer(i, w.placement.layers[i], self._block(w, i), spec)
                       for i in range(a.n_layers)]
        self.cls, self.cls_b = self._head(w, "cls", a.dim)
        n_out = len(meta_get(w.file.metadata, f"{a.arch}.classifier.output_labels", [0]))
        self.cls_out, self.cls_out_b = self._head(w, "cls.output", n_out)
        self.n_cls_out = n_out

    def _types(self, w: WeightLoader):
        info = w.file.tensors.get("token_types.weight")
        if info is None:
            return None
        return w.embedding("token_types.weight", int(info.shape[0]), self.args.dim)

    def _head(self, w: WeightLoader, name: str, n: int):
        if not w.has(name + ".weight"):
            return None, None
        return (w.matrix(name + ".weight", n, self.args.dim),
                w.optional_vector(name + ".bias", n))

    def _block(self, w: WeightLoader, i: int) -> EncoderWeights:
        a, p = self.args, f"blk.{i}."
        kvd = a.n_kv_heads * a.head_dim
        rows = [a.dim, kvd, kvd]
        if w.has(p + "attn_qkv.weight"):
            wq, wk, wv = w.matrix_split(p + "attn_qkv.weight", a.dim, rows)
            bq = bk = bv = None
            if w.has(p + "attn_qkv.bias"):
                b = w.host_vector(p + "attn_qkv.bias", sum(rows))
                be = w.backend_for(p + "attn_qkv.bias")
                bq, bk, bv = (be.upload_vector(b[s:s + n])
                              for s, n in ((0, a.dim), (a.dim, kvd), (a.dim + kvd, kvd)))
        else:
            wq, wk, wv = (w.matrix(p + f"attn_{x}.weight", n, a.dim)
                          for x, n in zip("qkv", rows))
            bq, bk, bv = (w.optional_vector(p + f"attn_{x}.bias", n)
                          for x, n in zip("qkv", rows))
        gate = w.matrix(p + "ffn_gate.weight", a.hidden_dim, a.dim) if self.rotary else None
        return EncoderWeights(
            wq=wq, wk=wk, wv=wv, bq=bq, bk=bk, bv=bv,
            wo=w.matrix(p + "attn_output.weight", a.dim, a.dim),
            bo=w.optional_vector(p + "attn_output.bias", a.dim),
            attn_out_norm=w.vector(p + "attn_output_norm.weight", a.dim),
            attn_out_norm_b=w.vector(p + "attn_output_norm.bias", a.dim),
            w_up=w.matrix(p + "ffn_up.weight", a.hidden_dim, a.dim),
            b_up=w.optional_vector(p + "ffn_up.bias", a.hidden_dim),
            w_gate=gate,
            w_down=w.matrix(p + "ffn_down.weight", a.dim, a.hidden_dim),
            b_down=w.optional_vector(p + "ffn_down.bias", a.dim),
            out_norm=w.vector(p + "layer_output_norm.weight", a.dim),
            out_norm_b=w.vector(p + "layer_output_norm.bias", a.dim))

    def embed(self, ids, positions=None):
        """Token (+ type 0) (+ position) embeddings, LayerNormed, on the embedding's backend."""
        be, a = self.be, self.args
        x = be.embed(self.tok_embd, ids)
        if self.type_embd is not None:  # llama.cpp: every token is of type 0 ("sentence A")
            x = be.add(x, be.embed(self.type_embd, [0] * len(ids)))
        if self.pos_embd is not None:
            x = be.add(x, be.embed(self.pos_embd, positions))
        return be.layer_norm(x, self.tok_norm, self.tok_norm_b, a.norm_eps)

    def _layer(self, be, x, w: EncoderWeights, positions, starts):
        a = self.args
        biases = [w.bq, w.bk, w.bv] if w.bq is not None else None
        q, k, v = be.linear(x, [w.wq, w.wk, w.wv], biases)
        if self.rotary:
            q = be.rope(q, a.n_heads, positions, self.rope)
            k = be.rope(k, a.n_kv_heads, positions, self.rope)
        o = be.encoder_attention(q, k, v, starts, a.n_heads, 1.0 / math.sqrt(a.head_dim))
        o = be.linear(o, [w.wo], [w.bo] if w.bo is not None else None)[0]
        x = be.layer_norm(be.add(o, x), w.attn_out_norm, w.attn_out_norm_b, a.norm_eps)
        if w.w_gate is not None:
            gate, up = be.linear(x, [w.w_gate, w.w_up])
            h = be.glu(gate, up, "silu")
        else:
            h = be.act(be.linear(x, [w.w_up], [w.b_up] if w.b_up is not None else None)[0],
                       "gelu_tanh")
        y = be.linear(h, [w.w_down], [w.b_down] if w.b_down is not None else None)[0]
        return be.layer_norm(be.add(y, x), w.out_norm, w.out_norm_b, a.norm_eps)

    def forward(self, ids, positions, kv: KVBatch, logit_rows, hidden: bool = False):
        """Hidden states of the rows ``logit_rows`` (see Net.forward); each sequence of the
        batch must be whole (its first token at position 0): attention reads every token.

        Raises:
            UnsupportedModel: asked for logits, or for part of a sequence.
        """
        if not hidden:
            raise ModelError(f"{self.args.arch} is an embedding model; it does not generate "
                             "text")
        starts = sequence_starts(kv.row_seq)
        if any(int(positions[s]) != 0 for s in starts[:-1]):
            raise ModelError(f"{self.args.arch} encodes each input whole, in one batch")
        if self.pos_embd is not None and len(ids) and max(positions) >= self.n_positions:
            raise ModelError(f"an input of {int(max(positions)) + 1} tokens exceeds the "
                             f"model's {self.n_positions} positions")
        x = self.embed(ids, positions)
        be = self.be
        for layer in self.layers:
            if layer.backend is not be:
                x = layer.backend.from_numpy(be.to_numpy(x))
                be = layer.backend
            x = self._layer(be, x, layer.weights, positions, starts)
        if len(logit_rows) == 0:
            return None
        return be.to_numpy(be.select_rows(x, logit_rows))

    def classify(self, pooled):
        """Rank scores of pooled states (n, dim) numpy: cls, tanh, cls.output as llama.cpp.

        Returns:
            float32 numpy (n, n_cls_out).
        """
        if self.cls is None and self.cls_out is None:
            return super().classify(pooled)
        be = self.be
        x = be.from_numpy(pooled)
        if self.cls is not None:
            x = be.act(be.linear(x, [self.cls], [self.cls_b] if self.cls_b is not None
                                 else None)[0], "tanh")
        if self.cls_out is not None:
            x = be.linear(x, [self.cls_out], [self.cls_out_b] if self.cls_out_b is not None
                          else None)[0]
        return be.to_numpy(x)
