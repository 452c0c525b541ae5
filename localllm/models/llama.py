"""The llama family (Llama 2/3, Mistral, SmolLM, TinyLlama): pre-norm decoder, GQA, RoPE,
SwiGLU feed-forward, tied or separate output head.

Llama 3.1/3.2's "llama3" rope scaling reaches GGUF files as the ``rope_freqs`` tensor (the
converter turns the scaling into per-frequency divisors), which the RoPE tables apply.
YaRN (``rope.scaling.type = yarn``, as Qwen2.5/Qwen3 long-context files set it) is read as
llama.cpp reads it for these architectures: the factor, the original context length (else
the training one) and the attention factor from the file; beta_fast 32, beta_slow 1 and
ext_factor 1 fixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from localllm.backends.base import RopeSpec
from localllm.kernels.kvpages import key_balance
from localllm.kernels.ops import yarn_corr_dims, yarn_mscale

from . import moe
from .block import BlockSpec, BlockWeights
from .common import ModelError, WeightLoader, meta_float, meta_get, meta_int
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
    rope_theta: float
    n_rot: int
    rope_scale: float
    context_length: int
    rope_attn_factor: float = 1.0   # multiplies rotated q and k (LongRoPE's attention factor)
    n_experts: int = 0              # mixture-of-experts layers (models/moe.py); 0: dense
    n_experts_used: int = 0
    expert_hidden_dim: int = 0      # each expert's FFN width
    shared_hidden_dim: int = 0      # the shared expert's (Qwen2-MoE)
    rope_scaling: str = "none"      # {arch}.rope.scaling.type
    rope_orig_ctx: int = 0          # rope.scaling.original_context_length (0: context_length)

    # rope scaling types ({arch}.rope.scaling.type) this architecture runs
    rope_scalings = ("none", "linear", "yarn")
    # YaRN's blend range and extrapolation mix, llama.cpp's defaults (these architectures
    # read no file keys for them)
    yarn_beta_fast = 32.0
    yarn_beta_slow = 1.0
    yarn_ext_factor = 1.0

    @classmethod
    def from_gguf(cls, meta: dict, arch: str = "llama") -> "ModelArgs":
        p = f"{arch}."
        dim = meta_int(meta, p + "embedding_length")
        n_heads = meta_int(meta, p + "attention.head_count")
        n_kv = meta_int(meta, p + "attention.head_count_kv", n_heads)
        if p + "attention.key_length" not in meta and n_heads > 0 and dim % n_heads:
            raise ModelError(f"metadata '{p}embedding_length' ({dim}) is not a multiple of "
                             f"'{p}attention.head_count' ({n_heads})")
        head_dim = meta_int(meta, p + "attention.key_length", dim // max(n_heads, 1))
        value_dim = meta_int(meta, p + "attention.value_length", head_dim)
        if value_dim != head_dim:
            raise ModelError(f"metadata '{p}attention.value_length' ({value_dim}) differs from "
                             f"the key length ({head_dim}); not supported")
        tokens = meta_get(meta, "tokenizer.ggml.tokens")
        vocab = meta_get(meta, p + "vocab_size")
        if vocab is None:
            if tokens is None:
                raise ModelError("metadata key 'tokenizer.ggml.tokens' is missing")
            vocab = len(tokens)
        vocab = meta_int(meta, p + "vocab_size", vocab)
        if tokens is not None and len(tokens) != vocab:
            # Sampling would pick ids the tokenizer cannot spell, or never reach some.
            raise ModelError(f"metadata '{p}vocab_size' is {vocab} but "
                             f"'tokenizer.ggml.tokens' has {len(tokens)} entries")
        scale_type = meta_get(meta, p + "rope.scaling.type", "none")
        factor = meta_float(meta, p + "rope.scaling.factor", 1.0)
        if scale_type not in cls.rope_scalings and factor != 1.0:
            raise ModelError(f"metadata '{p}rope.scaling.type' is {scale_type!r}, not supported "
                             f"for {arch} (supported: {', '.join(cls.rope_scalings)})")
        args = cls(
            arch=arch, dim=dim, n_layers=meta_int(meta, p + "block_count"), n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim,
            hidden_dim=meta_int(meta, p + "feed_forward_length"), vocab_size=vocab,
            norm_eps=meta_float(meta, p + "attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=meta_float(meta, p + "rope.freq_base", 10000.0),
            n_rot=meta_int(meta, p + "rope.dimension_count", head_dim),
            rope_scale=1.0 / factor if factor > 0 else 1.0,
            context_length=meta_int(meta, p + "context_length", 2048),
            rope_attn_factor=meta_float(meta, p + "rope.scaling.attn_factor", 1.0),
            **moe.args_from_gguf(meta, arch),
            rope_scaling=str(scale_type),
            rope_orig_ctx=meta_int(meta, p + "rope.scaling.original_context_length", 0),
        )
        args.check()
        return args

    def check(self) -> None:
        """Raises ModelError, naming the metadata key, for values no model can run with."""
        keys = {"dim": "embedding_length", "n_layers": "block_count",
                "n_heads": "attention.head_count", "n_kv_heads": "attention.head_count_kv",
                "head_dim": "attention.key_length", "hidden_dim": "feed_forward_length",
                "vocab_size": "vocab_size", "context_length": "context_length",
                "norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base"}
        for name, key in keys.items():
            if not getattr(self, name) > 0:
                raise ModelError(f"metadata '{self.arch}.{key}' must be positive, "
                                 f"got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ModelError(f"metadata '{self.arch}.attention.head_count' ({self.n_heads}) is "
                             f"not a multiple of '{self.arch}.attention.head_count_kv' "
                             f"({self.n_kv_heads})")
        if not self.rope_attn_factor > 0:
            raise ModelError(f"metadata '{self.arch}.rope.scaling.attn_factor' must be "
                             f"positive, got {self.rope_attn_factor}")
        moe.check_args(self)
        if not 0 <= self.n_rot <= self.head_dim or self.n_rot % 2:
            raise ModelError(f"metadata '{self.arch}.rope.dimension_count' ({self.n_rot}) must be "
                             f"even and at most the head size {self.head_dim}")

    def kv_layers(self) -> list:
        """Per layer, the (KV heads, head size) of the KV pages it holds, or None where it
        holds none (a layer reading another's KV, a recurrent layer): what the memory plan
        sizes the KV cache by."""
        return [(self.n_kv_heads, self.head_dim)] * self.n_layers

    def recurrent_spec(self, i: int):
        """Layer i's DeltaNetSpec where it keeps a recurrent state instead of KV, else None."""
        return None


def load_qkv(w: WeightLoader, i: int, a: ModelArgs) -> dict:
    """Layer i's query, key and value projections and their biases, as BlockWeights fields:
    separate ``attn_q/k/v`` tensors, or one fused ``attn_qkv`` (Phi-3) split by rows.
    Biases are optional (Qwen2 has them) but all or none."""
    p = f"blk.{i}."
    qd, kvd = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    if w.has(p + "attn_qkv.weight"):
        wq, wk, wv = w.matrix_split(p + "attn_qkv.weight", a.dim, [qd, kvd, kvd])
        if w.has(p + "attn_qkv.bias"):
            raise ModelError(f"layer {i}: a fused q/k/v bias (attn_qkv.bias) is not supported")
    else:
        wq, wk, wv = (w.matrix(p + f"attn_{x}.weight", n, a.dim)
                      for x, n in (("q", qd), ("k", kvd), ("v", kvd)))
    bq, bk, bv = (w.optional_vector(p + f"attn_{x}.bias", n)
                  for x, n in (("q", qd), ("k", kvd), ("v", kvd)))
    if (bq is None) != (bk is None) or (bq is None) != (bv is None):
        raise ModelError(f"layer {i}: q/k/v biases must be all present or all absent")
    return {"wq": wq, "wk": wk, "wv": wv, "bq": bq, "bk": bk, "bv": bv}


def load_block(w: WeightLoader, i: int, a: ModelArgs) -> BlockWeights:
    """Layer i's tensors (llama naming)."""
    p = f"blk.{i}."
    qd = a.n_heads * a.head_dim
    return BlockWeights(
        attn_norm=w.vector(p + "attn_norm.weight", a.dim),
        **load_qkv(w, i, a),
        wo=w.matrix(p + "attn_output.weight", a.dim, qd),
        ffn_norm=w.vector(p + "ffn_norm.weight", a.dim),
        **load_ffn(w, i, a))


def load_ffn(w: WeightLoader, i: int, a: ModelArgs) -> dict:
    """Layer i's feed-forward as BlockWeights fields: a dense SwiGLU, or the experts when
    the file has ``ffn_*_exps`` tensors for the layer."""
    p = f"blk.{i}."
    if moe.has_experts(w, i):
        return {"w_gate": None, "w_up": None, "w_down": None, "moe": moe.load(w, i, a)}
    return {"w_gate": w.matrix(p + "ffn_gate.weight", a.hidden_dim, a.dim),
            "w_up": w.matrix(p + "ffn_up.weight", a.hidden_dim, a.dim),
            "w_down": w.matrix(p + "ffn_down.weight", a.dim, a.hidden_dim)}


class Model(Net):
    """A llama-family transformer, its layers placed as the loader's placement says."""

    rope_neox = False   # GGUF llama weights are permuted for adjacent-pair rotation
    activation = "silu"
    moe_norm = True     # renormalise the chosen experts' weights (Mixtral does)
    moe_gating = "softmax"  # the router's gating (MoESpec.gating)

    def __init__(self, args: ModelArgs, w: WeightLoader, ctx: int = 0):
        """Args: args: the file's ModelArgs; w: its tensors; ctx: the context size the model
        will run at (Phi-3's LongRoPE picks its factors by it; 0: the training context)."""
        self.args = args
        self.be = w.placement.embed
        self.head_be = w.placement.head
        a = args
        self.rope = self.load_rope(w, ctx or a.context_length)
        self.tok_embd = w.embedding("token_embd.weight", a.vocab_size, a.dim)
        self.layers = []
        for i in range(a.n_layers):
            weights = self.load_block(w, i)
            spec = self.balanced(w, i, self.block_spec(i))
            if weights.moe is not None:
                spec = replace(spec, moe=moe.spec(a, self.moe_norm, self.activation,
                                                  self.moe_gating))
            self.layers.append(PlacedLayer(i, w.placement.layers[i], weights, spec))
        self.out_norm = w.vector("output_norm.weight", a.dim)
        name = "output.weight" if w.has("output.weight") else "token_embd.weight"
        self.output = w.matrix(name, a.vocab_size, a.dim, head=True)

    def load_rope(self, w: WeightLoader, ctx: int) -> RopeSpec:
        """The global layers' RoPE, with the ``rope_freqs`` divisors when the file has them."""
        a = self.args
        freq = None
        if w.has("rope_freqs.weight"):
            freq = w.host_vector("rope_freqs.weight", a.n_rot // 2)
        if a.rope_scaling == "yarn":
            low, high = yarn_corr_dims(a.n_rot, a.rope_orig_ctx or a.context_length,
                                       a.rope_theta, a.yarn_beta_fast, a.yarn_beta_slow)
            return RopeSpec(a.n_rot, a.rope_theta, self.rope_neox, a.rope_scale, freq,
                            yarn_mscale(1.0 / a.rope_scale, a.rope_attn_factor),
                            (a.yarn_ext_factor, low, high))
        return RopeSpec(a.n_rot, a.rope_theta, self.rope_neox, a.rope_scale, freq,
                        a.rope_attn_factor)

    def load_block(self, w: WeightLoader, i: int) -> BlockWeights:
        return load_block(w, i, self.args)

    def balanced(self, w: WeightLoader, i: int, spec: BlockSpec) -> BlockSpec:
        """The spec with its key balance, for layers with QK-norm (kvpages.key_balance)."""
        q, k = f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"
        if not (w.has(q) and w.has(k)):
            return spec
        hd = self.args.head_dim
        return replace(spec, k_balance=key_balance(w.host_vector(q, hd), w.host_vector(k, hd),
                                                   spec.rope.n_rot, spec.rope.neox))

    def block_spec(self, i: int) -> BlockSpec:
        a = self.args
        return BlockSpec(a.n_heads, a.n_kv_heads, a.head_dim, a.norm_eps, self.rope,
                         1.0 / math.sqrt(a.head_dim), 0, self.activation)
