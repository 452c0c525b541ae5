"""gpt-oss (OpenAI's gpt-oss-20b and -120b; llama.cpp's "openai-moe"): a pre-norm block with
biases on q, k, v and the attention output, a learned attention sink per head, sliding-window
layers of 128 alternating with full ones (the even layers slide), NeoX-style YaRN RoPE, and
mixture-of-experts FFNs with a router bias and expert biases, routed by a softmax over the
top-k router logits, through gpt-oss's clamped SwiGLU.

The pre-FFN norm is stored as ``post_attention_norm``; experts usually come as MXFP4.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from localllm.backends.base import RopeSpec

from . import llama, moe
from .block import BlockSpec, BlockWeights
from .common import ModelError, WeightLoader, meta_float, meta_get, meta_int


@dataclass(frozen=True)
class ModelArgs(llama.ModelArgs):
    sliding_window: int = 128
    swa_layers: tuple = ()       # per layer: True where the attention slides
    rope_theta_swa: float = 0.0  # the sliding layers' RoPE base (0: rope_theta)

    @classmethod
    def from_gguf(cls, meta: dict, arch: str = "gpt-oss") -> "ModelArgs":
        p = f"{arch}."
        if p + "feed_forward_length" not in meta:
            # llama.cpp reads only the experts' width for this architecture
            meta = {**meta, p + "feed_forward_length":
                    meta_get(meta, p + "expert_feed_forward_length", required=True)}
        base = llama.ModelArgs.from_gguf(meta, arch)
        pattern = meta_get(meta, p + "attention.sliding_window_pattern", 2)
        n = base.n_layers
        if hasattr(pattern, "__len__") and not isinstance(pattern, str):
            swa = tuple(bool(x) for x in pattern)
            if len(swa) != n:
                raise ModelError(f"metadata '{p}attention.sliding_window_pattern' has "
                                 f"{len(swa)} entries for {n} layers")
        else:
            k = meta_int(meta, p + "attention.sliding_window_pattern", 2)
            if k < 0:
                raise ModelError(f"metadata '{p}attention.sliding_window_pattern' is {k}")
            # as llama.cpp's set_swa_pattern: the last layer of every k is global
            swa = tuple(k == 0 or i % k < k - 1 for i in range(n))
        args = cls(**{**base.__dict__,
                      "sliding_window": meta_int(meta, p + "attention.sliding_window", 128),
                      "swa_layers": swa,
                      "rope_theta_swa": meta_float(meta, p + "rope.freq_base_swa", 0.0)})
        args.check()
        return args

    def check(self) -> None:
        super().check()
        if any(self.swa_layers) and self.sliding_window <= 0:
            raise ModelError(f"metadata '{self.arch}.attention.sliding_window' must be "
                             f"positive, got {self.sliding_window}")
        if self.n_experts == 0:
            raise ModelError(f"metadata '{self.arch}.expert_count' is missing: gpt-oss "
                             "layers are mixtures of experts")


def load_experts(w: WeightLoader, i: int, a: ModelArgs):
    """Layer i's router and experts with their biases."""
    p = f"blk.{i}."
    E, F, D = a.n_experts, a.expert_hidden_dim, a.dim
    return replace(moe.load(w, i, a),
                   router_bias=w.vector(p + "ffn_gate_inp.bias", E),
                   gate_bias=w.expert_vectors(p + "ffn_gate_exps.bias", E, F),
                   up_bias=w.expert_vectors(p + "ffn_up_exps.bias", E, F),
                   down_bias=w.expert_vectors(p + "ffn_down_exps.bias", E, D))


class Model(llama.Model):
    rope_neox = True
    activation = "swiglu_oai"
    moe_norm = False
    moe_gating = "softmax_weight"

    def load_rope(self, w: WeightLoader, ctx: int) -> RopeSpec:
        rope = super().load_rope(w, ctx)
        a = self.args
        # the sliding layers share the scaling, with their own base where the file sets one
        self.rope_swa = rope if not a.rope_theta_swa else replace(rope, theta=a.rope_theta_swa)
        return rope

    def load_block(self, w: WeightLoader, i: int) -> BlockWeights:
        a, p = self.args, f"blk.{i}."
        if not moe.has_experts(w, i):
            raise ModelError(f"layer {i} has no experts (blk.{i}.ffn_gate_exps.weight)")
        qkv = llama.load_qkv(w, i, a)
        if qkv["bq"] is None:
            raise ModelError(f"layer {i}: gpt-oss attention needs q/k/v biases")
        return BlockWeights(
            attn_norm=w.vector(p + "attn_norm.weight", a.dim), **qkv,
            wo=w.matrix(p + "attn_output.weight", a.dim, a.n_heads * a.head_dim),
            bo=w.vector(p + "attn_output.bias", a.dim),
            sinks=w.host_vector(p + "attn_sinks.weight", a.n_heads),
            ffn_norm=w.vector(p + "post_attention_norm.weight", a.dim),
            w_gate=None, w_up=None, w_down=None, moe=load_experts(w, i, a))

    def block_spec(self, i: int) -> BlockSpec:
        spec = super().block_spec(i)
        if self.args.swa_layers[i]:
            return replace(spec, window=self.args.sliding_window, rope=self.rope_swa)
        return spec
