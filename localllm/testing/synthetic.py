"""Small GGUF models of each architecture with random weights in several quant types and a
real tokenizer, written with gguf.GGUFWriter: same seed, same bytes. The llama.cpp reference
logits in tests/fixtures/synthetic/ were computed on exactly these files.

Two implementations that differ by one rounding in a norm or a sum diverge further wherever
that flips an int8 rounding of the activations a quantized matmul reads, and with plain
random weights many positions have near-ties between their two best tokens, so even
llama.cpp agrees with its own token-by-token run at only 96-99% of them. These models are
built to have confident predictions, as trained ones do: the token's own embedding (exact in
both implementations) dominates the residual stream, each block adds a tenth or so, and the
float output head gives every token a fixed successor that leads the others by a few nats
(_head), so the blocks shape the rest of the distribution. Embeddings use formats without
per-block offsets, whose shared structure would otherwise line up with the weights'.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from .kernel_data import FLOAT_FORMATS, f16_fields, random_weight
from localllm.formats import quants
from localllm.formats.dequant import dequantize

# Llama 3.2's rope scaling ("llama3" in its config), turned into per-frequency divisors the
# way the GGUF converter stores them (the rope_freqs tensor).
LLAMA3_SCALING = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_context": 512}


@dataclass(frozen=True)
class Spec:
    """One synthetic model: its shape, metadata and the GGML type of each weight role."""
    arch: str
    types: dict                      # role -> GGML type (see _matrices; "output" is a float type)
    pre: str | None = None           # tokenizer.ggml.pre override (None: the source's own)
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 64
    hidden_dim: int = 768
    n_rot: int = 0                   # 0: head_dim
    rope_theta: float = 10000.0
    context_length: int = 4096
    qkv_bias: bool = False
    qk_norm: bool = False
    fused: bool = False              # Phi-3's attn_qkv and gate+up ffn_up
    rope_freqs: bool = False         # Llama 3.1/3.2's scaling as per-frequency divisors
    longrope: bool = False           # Phi-3's long and short factor sets
    meta: dict = field(default_factory=dict)   # extra {arch}.* keys: name -> (value, type)
    block_gain: float = 0.1          # each block's output against the token embedding
    margin: float = 4.0              # nats by which the designed successor leads (see _head)
    n_experts: int = 0               # mixture-of-experts FFNs (types "exps", "exps_down")
    n_used: int = 0                  # experts per token
    expert_hidden: int = 0           # each expert's width
    shared_hidden: int = 0           # a shared expert with a sigmoid gate (Qwen2-MoE); 0: none
    qk_norm_whole: bool = False      # OLMoE's QK-norm over all heads at once
    gptoss: bool = False             # gpt-oss's extras: attention sinks, the attention
    #                                  output's, router's and experts' biases, the pre-FFN
    #                                  norm named post_attention_norm
    ffn_in_gain: float = 1.0         # experts' gate/up outputs times this (their down / it^2)
    fused_experts: bool = False      # gate and up experts in one ffn_gate_up_exps stack (each
    #                                  expert's gate rows, then its up rows) and a scale per
    #                                  expert on its down output (ffn_down_exps.scale), as
    #                                  Gemma 4's converter writes them
    # Gemma 4 (arch "gemma4"): sliding flags per layer, the sliding layers' head size and
    # rope base, the trailing layers that read an earlier layer's KV, per-layer token
    # embeddings of this width (0: none), full layers without attn_v (V = K), the final
    # logit softcap
    swa_layers: tuple = ()
    swa_head_dim: int = 0
    swa_theta: float = 10000.0
    sliding_window: int = 0
    shared_kv: int = 0
    per_layer_dim: int = 0
    full_without_v: bool = False
    softcap: float = 0.0
    # Qwen3.5 (arch "qwen35"): DeltaNet layers' (key heads, value heads, head size, conv
    # kernel), full attention every full_every-th layer, the rope sections, trailing
    # multi-token-prediction blocks
    ssm: tuple = ()
    full_every: int = 4
    rope_sections: tuple = ()
    nextn: int = 0

    def layer_head_dim(self, i: int) -> int:
        return self.swa_head_dim if self.swa_layers and self.swa_layers[i] else self.head_dim

    def has_kv(self, i: int) -> bool:
        return i < self.n_layers - self.shared_kv


PHI3_TYPES = {"attn": "Q8_0", "attn_output": "BF16", "ffn": "F16", "ffn_down": "Q6_K",
              "embd": "Q5_0", "output": "F32"}
SPECS = {
    # Llama 3.2 shape: rope_freqs from the llama3 scaling, Llama 3's pre-split.
    "llama3": Spec("llama", {"attn": "Q4_K", "attn_output": "Q5_K", "ffn": "Q4_K",
                             "ffn_down": "Q6_K", "embd": "Q6_K", "output": "F16"},
                   pre="llama-bpe", rope_theta=500000.0, context_length=131072, rope_freqs=True),
    "qwen2": Spec("qwen2", {"attn": "Q4_0", "attn_output": "Q4_1", "ffn": "Q5_0",
                            "ffn_down": "Q5_1", "embd": "Q8_0", "output": "F32"},
                  pre="qwen2", rope_theta=1000000.0, context_length=32768, qkv_bias=True),
    # Qwen3's head_dim is not dim / n_heads (here 128 * 4 = 512 against dim 256).
    "qwen3": Spec("qwen3", {"attn": "Q3_K", "attn_output": "IQ4_XS", "ffn": "Q2_K",
                            "ffn_down": "IQ4_NL", "embd": "IQ4_NL", "output": "F16"},
                  pre="qwen2", head_dim=128, rope_theta=1000000.0, context_length=40960,
                  qk_norm=True),
    # Phi-3-mini-128k shape: fused projections, LongRoPE factors with the converter's
    # attention factor sqrt(1 + ln(s) / ln(orig)) for s = 16 times the original context.
    "phi3": Spec("phi3", PHI3_TYPES, context_length=8192, fused=True, longrope=True,
                 meta={"rope.scaling.original_context_length": (512, GGUFValueType.UINT32),
                       "rope.scaling.attn_factor": (math.sqrt(1 + math.log(16) / math.log(512)),
                                                    GGUFValueType.FLOAT32),
                       "attention.sliding_window": (2047, GGUFValueType.UINT32)}),
    # Phi-4-mini's partial rotary embedding (48 of 64 dims), here without LongRoPE.
    "phi3_partial": Spec("phi3", PHI3_TYPES, n_rot=48, fused=True,
                         meta={"attention.sliding_window": (2047, GGUFValueType.UINT32)}),
    # SmolLM3-3B's rope base and head size; 8 layers, so two of them (3 and 7) are NoPE.
    "smollm3": Spec("smollm3", {"attn": "Q5_K", "attn_output": "Q4_0", "ffn": "Q4_K",
                                "ffn_down": "Q8_0", "embd": "Q6_K", "output": "F16"},
                    pre="llama-bpe", n_layers=8, rope_theta=5000000.0, context_length=65536),
    # Ministral 3's head size and rope base, with llama 4's attention temperature on a short
    # original context (64), so that the passage's queries are scaled by up to ~2.
    "mistral3": Spec("mistral3", {"attn": "Q6_K", "attn_output": "Q5_0", "ffn": "Q5_K",
                                  "ffn_down": "Q4_1", "embd": "Q8_0", "output": "F16"},
                     head_dim=128, rope_theta=1000000.0, context_length=4096,
                     meta={"attention.temperature_scale": (0.5, GGUFValueType.FLOAT32),
                           "rope.scaling.original_context_length": (64, GGUFValueType.UINT32)}),
}
# Mixture-of-experts models (kept apart: scripts/make_synthetic.py --moe scores them).
# Widths of 128 leave K-quants to the matrices that read 256-wide inputs. Blocks weigh more
# than in the dense models (0.25), so that routing errors show: without the top-k
# renormalisation Qwen3-MoE's argmax moves at 7% of the positions (at 0.1, at 1%).
MOE_SPECS = {
    "qwen3moe": Spec("qwen3moe", {"attn": "Q8_0", "attn_output": "Q4_K", "exps": "Q4_0",
                                  "exps_down": "Q6_K", "embd": "Q8_0", "output": "F16"},
                     pre="qwen2", dim=128, n_layers=2, head_dim=64, rope_theta=1000000.0,
                     context_length=40960, qk_norm=True, n_experts=8, n_used=2, hidden_dim=256,
                     expert_hidden=256, block_gain=0.25),
    "qwen2moe": Spec("qwen2moe", {"attn": "Q5_0", "attn_output": "Q5_1", "exps": "Q8_0",
                                  "exps_down": "Q4_K", "ffn": "Q4_1", "ffn_down": "Q5_K",
                                  "embd": "Q8_0", "output": "F32"},
                     pre="qwen2", dim=128, n_layers=2, head_dim=32, rope_theta=1000000.0,
                     context_length=32768, qkv_bias=True, n_experts=8, n_used=4, hidden_dim=256,
                     expert_hidden=256, shared_hidden=512, block_gain=0.25),
    "olmoe": Spec("olmoe", {"attn": "IQ4_NL", "attn_output": "Q8_0", "exps": "Q5_0",
                            "exps_down": "Q4_K", "embd": "Q5_0", "output": "F16"},
                  dim=128, n_layers=2, n_kv_heads=4, head_dim=32, qk_norm=True,
                  qk_norm_whole=True, n_experts=6, n_used=2, expert_hidden=256, hidden_dim=256,
                  block_gain=0.25),
    # Mixtral: the llama architecture with experts, top-2 of 8, renormalised
    "mixtral": Spec("llama", {"attn": "Q4_0", "attn_output": "Q8_0", "exps": "Q4_1",
                              "exps_down": "Q6_K", "embd": "Q8_0", "output": "F16"},
                    dim=128, n_layers=2, head_dim=32, rope_theta=1000000.0,
                    context_length=32768, n_experts=8, n_used=2, expert_hidden=256, hidden_dim=256,
                    block_gain=0.25),
    # Gemma 4's MoE layout (26B-A4B) in four layers: a dense GELU FFN beside top-2 of 8
    # GELU experts in every layer, the router on its own scaled norm; the last two layers
    # share the KV of layers 0 (sliding) and 1 (full).
    "gemma4moe": Spec("gemma4", {"attn": "Q8_0", "attn_output": "Q5_0", "ffn": "Q4_K",
                                 "ffn_down": "Q8_0", "exps": "Q4_K", "exps_down": "Q8_0",
                                 "embd": "Q8_0", "output": "F16"},
                      n_layers=4, head_dim=128, hidden_dim=256, rope_theta=1000000.0,
                      context_length=131072, qk_norm=True, swa_layers=(True, False, True, False),
                      swa_head_dim=64, sliding_window=128, shared_kv=2, softcap=50.0,
                      margin=8.0, block_gain=0.08, n_experts=8, n_used=2, expert_hidden=128),
}

# Gemma 4's MoE as its converter writes it: gate and up experts fused into one stack, and
# its per_expert_scale as a scale on each expert's output
MOE_SPECS["gemma4moe_fused"] = replace(MOE_SPECS["gemma4moe"], fused_experts=True)

MOE_SPECS["gptoss"] = Spec(
    # gpt-oss-20b's shape scaled down: 8 query heads of 64 over 2 KV heads, 4 layers (the
    # even ones sliding over 128 tokens), YaRN 32x over 4096 on a 131072 context, MXFP4
    # experts (top-4 of 8) whose gate inputs reach the SwiGLU clamp at 7 now and then
    "gpt-oss", {"attn": "Q8_0", "attn_output": "F16", "exps": "MXFP4", "exps_down": "MXFP4",
                "embd": "Q8_0", "output": "F16"},
    dim=128, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=64, rope_theta=150000.0,
    context_length=131072, qkv_bias=True, n_experts=8, n_used=4, hidden_dim=256,
    expert_hidden=256, block_gain=0.25, gptoss=True, ffn_in_gain=2.5,
    meta={"attention.sliding_window": (128, GGUFValueType.UINT32),
          "rope.scaling.type": ("yarn", GGUFValueType.STRING),
          "rope.scaling.factor": (32.0, GGUFValueType.FLOAT32),
          "rope.scaling.original_context_length": (4096, GGUFValueType.UINT32)})


# YaRN as Qwen2.5's long-context configs set it (factor 4 over the original context): the
# converter writes the type, factor and original context; llama.cpp fixes the rest.
def _yarn_meta(factor: float, original: int) -> dict:
    return {"rope.scaling.type": ("yarn", GGUFValueType.STRING),
            "rope.scaling.factor": (factor, GGUFValueType.FLOAT32),
            "rope.scaling.original_context_length": (original, GGUFValueType.UINT32)}


MXFP4_TYPES = {"attn": "MXFP4", "attn_output": "MXFP4", "ffn": "MXFP4", "ffn_down": "MXFP4",
               "embd": "Q8_0", "output": "F16"}
SPECS.update({
    # gpt-oss's weight format on a plain llama: every matrix but the embedding MXFP4.
    "llama_mxfp4": Spec("llama", MXFP4_TYPES),
    # YaRN on a llama file (adjacent-pair rotation) and on Qwen2 (NeoX halves, biases).
    "llama_yarn": Spec("llama", {"attn": "Q4_0", "attn_output": "Q8_0", "ffn": "Q4_K",
                                 "ffn_down": "Q6_K", "embd": "Q8_0", "output": "F16"},
                       context_length=4096, meta=_yarn_meta(4.0, 1024)),
    "qwen2_yarn": Spec("qwen2", {"attn": "Q5_0", "attn_output": "Q8_0", "ffn": "Q4_0",
                                 "ffn_down": "Q8_0", "embd": "Q8_0", "output": "F32"},
                       pre="qwen2", rope_theta=1000000.0, context_length=131072, qkv_bias=True,
                       meta=_yarn_meta(4.0, 32768)),
})
GEMMA4_TYPES = {"attn": "Q8_0", "attn_output": "Q5_0", "ffn": "Q4_K", "ffn_down": "Q6_K",
                "embd": "Q8_0", "ple": "Q8_0", "output": "F16"}
SPECS.update({
    # Gemma 4's layout in six layers: sliding layers (head size 64, base 10^4, window 128)
    # around full ones (head size 128, base 10^6, partial rotation by rope_freqs), the last
    # three layers reading the KV of layers 1 (sliding) and 2 (full), per-layer token
    # embeddings of 32 per layer, layer output scales and a final logit softcap (which
    # narrows the designed successor's lead: hence the wider margin).
    "gemma4": Spec("gemma4", GEMMA4_TYPES, n_layers=6, head_dim=128, hidden_dim=512,
                   rope_theta=1000000.0, context_length=131072, qk_norm=True,
                   swa_layers=(True, True, False, True, True, False), swa_head_dim=64,
                   sliding_window=128, shared_kv=3, per_layer_dim=32, softcap=50.0,
                   margin=8.0, block_gain=0.08),
    # without per-layer embeddings (as the large Gemma 4 files), full layers without
    # attn_v (their values are their keys), two shared layers
    "gemma4_nople": Spec("gemma4", GEMMA4_TYPES, n_layers=6, head_dim=128, hidden_dim=512,
                         rope_theta=1000000.0, context_length=131072, qk_norm=True,
                         swa_layers=(True, False, True, False, True, False), swa_head_dim=64,
                         sliding_window=128, shared_kv=2, full_without_v=True, softcap=50.0),
})
QWEN35_TYPES = {"attn": "Q8_0", "attn_output": "Q5_0", "ssm": "Q8_0", "ssm_out": "Q6_K",
                "ffn": "Q4_K", "ffn_down": "Q6_K", "embd": "Q8_0", "output": "F16"}
# Hybrid models of linear-attention and full-attention layers (kept apart:
# scripts/make_synthetic.py --hybrid scores them; tests/models/test_qwen35.py checks them).
# Their designed successors lead by 8 nats (qwen35's by 10): at 4, llama.cpp's own
# token-by-token run agrees with its batch at 98.3% of the positions on qwen35 and greedy
# texts of 32 tokens rarely survive; at 8, 99.5%, with one disagreement 0.103 nats from a tie.
HYBRID_SPECS = {
    # Qwen3.5's layout in eight layers: DeltaNet layers (2 key heads and 4 value heads of
    # 64, a conv of 4 taps) with full attention every 4th layer (4 query heads of 64 and
    # their gates, 2 KV heads, a quarter of the dims rotated in Qwen3.5's rope sections)
    "qwen35": Spec("qwen35", QWEN35_TYPES, pre="qwen35", n_layers=8, head_dim=64, n_rot=16,
                   rope_theta=10000000.0, context_length=262144, qk_norm=True,
                   ssm=(2, 4, 64, 4), rope_sections=(3, 3, 2, 0), margin=10.0),
    # with a multi-token-prediction block after the trunk (loaded, not run), full attention
    # every third layer, rope sections that leave a quarter of the pairs unrotated (the
    # fourth section's position is 0 for text)
    "qwen35_mtp": Spec("qwen35", QWEN35_TYPES, pre="qwen35", n_layers=7, head_dim=64,
                       n_rot=16, rope_theta=10000000.0, context_length=262144, qk_norm=True,
                       ssm=(4, 4, 64, 4), full_every=3, rope_sections=(2, 2, 2, 2), nextn=1,
                       margin=8.0),
}
# Qwen3.5-MoE's layout in four layers (full attention in the last): top-2 of 8 experts,
# renormalised, and a shared expert with its sigmoid gate
HYBRID_SPECS["qwen35moe"] = Spec(
    "qwen35moe", {"attn": "Q8_0", "attn_output": "Q5_0", "ssm": "Q8_0", "ssm_out": "Q6_K",
                  "exps": "Q4_K", "exps_down": "Q8_0", "ffn": "Q8_0", "ffn_down": "Q8_0",
                  "embd": "Q8_0", "output": "F16"},
    pre="qwen35", n_layers=4, head_dim=64, n_rot=16, rope_theta=10000000.0,
    context_length=262144, qk_norm=True, ssm=(2, 4, 64, 4), rope_sections=(3, 3, 2, 0),
    n_experts=8, n_used=2, hidden_dim=256, expert_hidden=256, shared_hidden=256,
    block_gain=0.25, margin=8.0)
ALL_SPECS = {**SPECS, **MOE_SPECS, **HYBRID_SPECS}

LOGIT_STD = 5.0        # std of the random part of the logits
EXPECTED_MAX = 4.23    # the mean of the largest of 49152 standard normal draws

# Reference cases: (model, context size). Phi-3's LongRoPE picks its factor set by context:
# the short one up to the original context (512 here), the long one beyond.
CASES = {"llama3": ("llama3", 1024), "qwen2": ("qwen2", 1024), "qwen3": ("qwen3", 1024),
         "phi3_short": ("phi3", 512), "phi3_long": ("phi3", 1024),
         "phi3_partial": ("phi3_partial", 1024), "llama_mxfp4": ("llama_mxfp4", 1024),
         "llama_yarn": ("llama_yarn", 1024), "qwen2_yarn": ("qwen2_yarn", 1024),
         "smollm3": ("smollm3", 1024), "mistral3": ("mistral3", 1024),
         "gemma4": ("gemma4", 1024), "gemma4_nople": ("gemma4_nople", 1024)}
MOE_CASES = {name: (name, 1024) for name in MOE_SPECS}
HYBRID_CASES = {name: (name, 1024) for name in HYBRID_SPECS}


def llama3_freq_factors(n_rot: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> np.ndarray:
    """Llama 3.1's frequency scaling as divisors: wavelengths shorter than
    original_context / high_freq_factor keep their frequency, longer than
    original_context / low_freq_factor are divided by ``factor``, and those between are
    interpolated smoothly."""
    freqs = theta ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    wavelen = 2 * np.pi / freqs
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    divisor = 1.0 / ((1 - smooth) / factor + smooth)
    divisor = np.where(wavelen < original_context / high_freq_factor, 1.0, divisor)
    divisor = np.where(wavelen > original_context / low_freq_factor, factor, divisor)
    return divisor.astype(np.float32)


def _scaled(type_name: str, N: int, K: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Random (N, K) weight bytes of a GGML type that map a unit-rms input to outputs of rms
    std * sqrt(K), as independent weights of that std would. (Measured on the output: the
    values of one block share scales and offsets, so their std alone says too little.)"""
    raw = random_weight(type_name, N, K, rng).reshape(N, -1)
    rows = min(N, 64)
    sample = dequantize(raw[:rows].reshape(-1), type_name, (rows, K)).astype(np.float64)
    c = _stable(std / np.sqrt(((sample @ rng.standard_normal((K, 16))) ** 2).mean() / K))
    if type_name in FLOAT_FORMATS:
        return _encode_float(dequantize(raw.reshape(-1), type_name, (N, K)) * np.float32(c),
                             type_name)
    # quantized: every value is linear in the f16 scale fields of its block
    blocks = raw.reshape(-1, quants.type_size(type_name))
    if type_name == "MXFP4":  # a power-of-two scale: c rounded to the nearest power of two
        e = blocks[:, 0].astype(np.int64) + int(np.rint(np.log2(c)))
        blocks[:, 0] = np.clip(e, 0, 254).astype(np.uint8)
        return raw
    for off in f16_fields(type_name).values():
        d = blocks[:, off:off + 2].copy().view(np.float16).astype(np.float32) * np.float32(c)
        blocks[:, off:off + 2] = d.astype(np.float16).view(np.uint8)
    return raw


def _stable(x):
    """A float64 result of sums rounded to float32 precision, so that the last-bit differences
    between CPUs' summation orders do not reach the file's bytes."""
    return np.asarray(x, np.float32).astype(np.float64)


def _matrices(s: Spec) -> list[tuple[str, str, int, int, float]]:
    """(tensor name, type, N, K, value std) of every weight matrix, in file order."""
    qd, kvd, t = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.types
    unit = 1 / math.sqrt(s.dim)
    # q and k a little over unit size so that attention is not uniform; the attention output
    # is an average, so it gets twice the FFN's gain to count as much
    out = [("token_embd.weight", t["embd"], 0, s.dim, 1.0)]
    if s.arch == "gemma4":
        return out + _gemma4_matrices(s)
    if s.arch in ("qwen35", "qwen35moe"):
        return out + _qwen35_matrices(s)
    for i in range(s.n_layers):
        p = f"blk.{i}."
        if s.fused:
            out.append((p + "attn_qkv.weight", t["attn"], qd + 2 * kvd, s.dim, 1.2 * unit))
        else:
            out += [(p + f"attn_{x}.weight", t["attn"], n, s.dim, g * unit)
                    for x, n, g in (("q", qd, 1.5), ("k", kvd, 1.5), ("v", kvd, 1.0))]
        out.append((p + "attn_output.weight", t["attn_output"], s.dim, qd,
                    2 * s.block_gain / math.sqrt(qd)))
        ffn_rows = [("ffn_up", 2 * s.hidden_dim)] if s.fused else [
            ("ffn_gate", s.hidden_dim), ("ffn_up", s.hidden_dim)]
        if s.n_experts:
            out += _expert_matrices(s, p)
            continue
        out += [(p + f"{x}.weight", t["ffn"], n, s.dim, unit) for x, n in ffn_rows]
        out.append((p + "ffn_down.weight", t["ffn_down"], s.dim, s.hidden_dim,
                    s.block_gain / math.sqrt(s.hidden_dim)))
    return out


def _gemma4_matrices(s: Spec) -> list[tuple]:
    """Gemma 4's matrices after the token embedding. Its post-norms set each block's size
    (_vectors), so the matrices here are unit-gain; the per-layer embedding rows are of
    rms 1/sqrt(width), which the model scales back to 1."""
    t, unit, P, L = s.types, 1 / math.sqrt(s.dim), s.per_layer_dim, s.n_layers
    out = []
    if P:
        out += [("per_layer_token_embd.weight", t["ple"], 0, L * P, 1 / math.sqrt(P)),
                ("per_layer_model_proj.weight", t["ple"], L * P, s.dim, unit)]
    for i in range(L):
        p, hd = f"blk.{i}.", s.layer_head_dim(i)
        qd, kvd = s.n_heads * hd, s.n_kv_heads * hd
        out.append((p + "attn_q.weight", t["attn"], qd, s.dim, unit))
        if s.has_kv(i):
            out.append((p + "attn_k.weight", t["attn"], kvd, s.dim, unit))
            if not (s.full_without_v and not s.swa_layers[i]):
                out.append((p + "attn_v.weight", t["attn"], kvd, s.dim, unit))
        out.append((p + "attn_output.weight", t["attn_output"], s.dim, qd, 1 / math.sqrt(qd)))
        out += [(p + f"{x}.weight", t["ffn"], s.hidden_dim, s.dim, unit)
                for x in ("ffn_gate", "ffn_up")]
        out.append((p + "ffn_down.weight", t["ffn_down"], s.dim, s.hidden_dim,
                    1 / math.sqrt(s.hidden_dim)))
        if s.n_experts:
            # the router reads a row of rms 1/sqrt(dim): weights of std 2 give logits of
            # std 2; the experts' output is normed (post_ffw_norm_2)
            F, E = s.expert_hidden, s.n_experts
            out.append((p + "ffn_gate_inp.weight", "F32", E, s.dim, 2.0))
            out += _gate_up_stacks(s, p, unit)
            out.append((p + "ffn_down_exps.weight", t["exps_down"], E * s.dim, F,
                        1 / math.sqrt(F)))
        if P:
            out += [(p + "inp_gate.weight", t["ple"], P, s.dim, unit),
                    (p + "proj.weight", t["ple"], s.dim, P, 1 / math.sqrt(P))]
    return out


def _gemma4_vectors(s: Spec, norm) -> list[tuple[str, np.ndarray]]:
    """Gemma 4's norms (the post-norms scaled to block_gain of the residual, whose rms is
    sqrt(dim) after the embedding scale), layer scales and the full layers' rope factors
    (a quarter of the frequencies rotate, as its proportional RoPE)."""
    gain = s.block_gain * math.sqrt(s.dim)
    out = []
    for i in range(s.n_layers):
        p, hd = f"blk.{i}.", s.layer_head_dim(i)
        out += [(p + "attn_norm.weight", norm(s.dim)),
                (p + "attn_q_norm.weight", 0.4 * norm(hd))]
        if s.has_kv(i):
            out.append((p + "attn_k_norm.weight", norm(hd)))
        out += [(p + "post_attention_norm.weight", 2 * gain * norm(s.dim)),
                (p + "ffn_norm.weight", norm(s.dim)),
                (p + "post_ffw_norm.weight", gain * norm(s.dim))]
        if s.n_experts:
            # the router's input weights spread widely (a factor of 2 either way), so that
            # routing depends on them
            out.append((p + "ffn_gate_inp.scale",
                        np.exp(7 * (norm(s.dim) - 1)).astype(np.float32)))
            out += [(p + x, norm(s.dim)) for x in (
                "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight", "post_ffw_norm_2.weight")]
        if s.per_layer_dim:
            out.append((p + "post_norm.weight", 0.5 * gain * norm(s.dim)))
            out.append((p + "layer_output_scale.weight",
                        np.array([0.9 + 0.02 * i], np.float32)))
    if s.per_layer_dim:
        out.append(("per_layer_proj_norm.weight", norm(s.per_layer_dim)))
    out.append(("output_norm.weight", norm(s.dim)))
    pairs = s.head_dim // 2
    out.append(("rope_freqs.weight", np.where(np.arange(pairs) < pairs // 4, 1.0,
                                              1e30).astype(np.float32)))
    return out


def _qwen35_full(s: Spec, i: int) -> bool:
    return (i + 1) % s.full_every == 0


def _qwen35_matrices(s: Spec) -> list[tuple]:
    """Qwen3.5's matrices after the token embedding (a multi-token-prediction block is a
    full-attention one with its extra projection)."""
    t, unit = s.types, 1 / math.sqrt(s.dim)
    Hk, Hv, S, _ = s.ssm
    qd, kvd, vd = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, Hv * S
    out = []
    for i in range(s.n_layers):
        p = f"blk.{i}."
        if i >= s.n_layers - s.nextn or _qwen35_full(s, i):
            # the query rows interleave each head's queries and gates; gates of std 1
            out += [(p + "attn_q.weight", t["attn"], 2 * qd, s.dim, 1.5 * unit),
                    (p + "attn_k.weight", t["attn"], kvd, s.dim, 1.5 * unit),
                    (p + "attn_v.weight", t["attn"], kvd, s.dim, unit),
                    (p + "attn_output.weight", t["attn_output"], s.dim, qd,
                     4 * s.block_gain / math.sqrt(qd))]
        else:
            out += [(p + "attn_qkv.weight", t["ssm"], (2 * Hk + Hv) * S, s.dim, unit),
                    (p + "attn_gate.weight", t["ssm"], vd, s.dim, unit),
                    (p + "ssm_beta.weight", "F32", Hv, s.dim, unit),
                    (p + "ssm_alpha.weight", "F32", Hv, s.dim, unit),
                    (p + "ssm_out.weight", t["ssm_out"], s.dim, vd,
                     4 * s.block_gain / math.sqrt(vd))]
        if s.n_experts:
            out += _expert_matrices(s, p)
        else:
            out += [(p + f"{x}.weight", t["ffn"], s.hidden_dim, s.dim, unit)
                    for x in ("ffn_gate", "ffn_up")]
            out.append((p + "ffn_down.weight", t["ffn_down"], s.dim, s.hidden_dim,
                        s.block_gain / math.sqrt(s.hidden_dim)))
        if i >= s.n_layers - s.nextn:
            out.append((p + "nextn.eh_proj.weight", t["attn"], s.dim, 2 * s.dim, unit))
    return out


def _qwen35_vectors(s: Spec, norm, rng: np.random.Generator) -> list[tuple]:
    """Qwen3.5's norms, and each DeltaNet layer's conv kernel (taps of std 0.5), decay bias
    and factor A = -exp(A_log) (decays exp(-softplus(alpha + dt) exp(A_log)) of 0.2-0.9 a
    token, so that a state remembers a few tokens to a few tens)."""
    Hk, Hv, S, K = s.ssm
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    out = []
    for i in range(s.n_layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", norm(s.dim)),
                (p + "post_attention_norm.weight", norm(s.dim))]
        if i >= s.n_layers - s.nextn or _qwen35_full(s, i):
            out += [(p + "attn_q_norm.weight", 2 * norm(s.head_dim)),
                    (p + "attn_k_norm.weight", 2 * norm(s.head_dim))]
        else:
            out += [(p + "ssm_conv1d.weight", f32(0.5 * rng.standard_normal(((2 * Hk + Hv) * S,
                                                                              K)))),
                    (p + "ssm_dt.bias", f32(-1.5 + 0.5 * rng.standard_normal(Hv))),
                    (p + "ssm_a", f32(-np.exp(0.3 * rng.standard_normal(Hv)))),
                    (p + "ssm_norm.weight", norm(S))]
        if s.shared_hidden:  # the shared expert's gate: logits of std 1
            out.append((p + "ffn_gate_inp_shexp.weight",
                        (rng.standard_normal(s.dim) / math.sqrt(s.dim)).astype(np.float32)))
        if i >= s.n_layers - s.nextn:
            out += [(p + "nextn.enorm.weight", norm(s.dim)),
                    (p + "nextn.hnorm.weight", norm(s.dim))]
    out.append(("output_norm.weight", norm(s.dim)))
    return out


def qwen35_ssm_keys(ssm: tuple, full_every: int) -> dict:
    """Qwen3.5's DeltaNet metadata (uint32 values by key after ``{arch}.``) for ssm = (key
    heads, value heads, head size, conv kernel) and full attention every full_every layers."""
    Hk, Hv, S, K = ssm
    return {"ssm.conv_kernel": K, "ssm.inner_size": Hv * S, "ssm.state_size": S,
            "ssm.time_step_rank": Hv, "ssm.group_count": Hk,
            "full_attention_interval": full_every}


def _qwen35_meta(w: GGUFWriter, s: Spec) -> None:
    a = s.arch + "."
    for k, v in qwen35_ssm_keys(s.ssm, s.full_every).items():
        w.add_key_value(a + k, v, GGUFValueType.UINT32)
    if s.nextn:
        w.add_key_value(a + "nextn_predict_layers", s.nextn, GGUFValueType.UINT32)
    w.add_array(a + "rope.dimension_sections", list(s.rope_sections))


def _expert_matrices(s: Spec, p: str) -> list[tuple]:
    """A layer's router (logits of std 2 on unit-rms inputs, so that most tokens have a
    clear top-k), experts (the N of a stack is experts x rows) and shared expert."""
    t, unit, F, E = s.types, 1 / math.sqrt(s.dim), s.expert_hidden, s.n_experts
    g = s.ffn_in_gain
    out = [(p + "ffn_gate_inp.weight", "F32", E, s.dim, 2 * unit)]
    out += _gate_up_stacks(s, p, g * unit)
    out.append((p + "ffn_down_exps.weight", t["exps_down"], E * s.dim, F,
                s.block_gain / math.sqrt(F) / g ** 2))
    if s.shared_hidden:
        S = s.shared_hidden
        out += [(p + f"ffn_{x}_shexp.weight", t["ffn"], S, s.dim, unit) for x in ("gate", "up")]
        out.append((p + "ffn_down_shexp.weight", t["ffn_down"], s.dim, S,
                    s.block_gain / math.sqrt(S)))
    return out


def _gate_up_stacks(s: Spec, p: str, std: float) -> list[tuple]:
    """A layer's gate and up expert stacks, or the one fused stack of both."""
    E, F, t = s.n_experts, s.expert_hidden, s.types
    if s.fused_experts:
        return [(p + "ffn_gate_up_exps.weight", t["exps"], E * 2 * F, s.dim, std)]
    return [(p + f"ffn_{x}_exps.weight", t["exps"], E * F, s.dim, std) for x in ("gate", "up")]


def _expert_scales(s: Spec, rng: np.random.Generator) -> list[tuple[str, np.ndarray]]:
    """Fused files' per-expert output scales (0.2 to 4.5: enough to move a token's mix)."""
    if not s.fused_experts:
        return []
    return [(f"blk.{i}.ffn_down_exps.scale",
             np.exp(rng.uniform(-1.5, 1.5, s.n_experts)).astype(np.float32))
            for i in range(s.n_layers)]


def _stack_shape(s: Spec, tname: str) -> tuple | None:
    """(experts, rows) of a stacked expert tensor, None for a matrix."""
    if "_exps." not in tname:
        return None
    if "gate_up" in tname:
        return s.n_experts, 2 * s.expert_hidden
    return s.n_experts, (s.dim if "down" in tname else s.expert_hidden)


def _vectors(s: Spec, rng: np.random.Generator) -> list[tuple[str, np.ndarray]]:
    """Norm weights (around 1), biases and rope factors as float32, in file order."""
    qd, kvd, n_rot = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim, s.n_rot or s.head_dim
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    if s.arch == "gemma4":
        return _gemma4_vectors(s, norm)
    if s.arch in ("qwen35", "qwen35moe"):
        return _qwen35_vectors(s, norm, rng)
    out = []
    for i in range(s.n_layers):
        p = f"blk.{i}."
        ffn_norm = "post_attention_norm" if s.gptoss else "ffn_norm"
        out += [(p + "attn_norm.weight", norm(s.dim)), (p + f"{ffn_norm}.weight", norm(s.dim))]
        if s.qkv_bias:
            out += [(p + f"attn_{x}.bias", (0.5 * rng.standard_normal(n)).astype(np.float32))
                    for x, n in (("q", qd), ("k", kvd), ("v", kvd))]
        if s.gptoss:
            out += _gptoss_vectors(s, p, rng)
        if s.qk_norm:
            # (QK-norm leaves unit-rms heads: larger weights keep attention selective)
            qn, kn = (qd, kvd) if s.qk_norm_whole else (s.head_dim, s.head_dim)
            out += [(p + "attn_q_norm.weight", 2 * norm(qn)),
                    (p + "attn_k_norm.weight", 2 * norm(kn))]
        if s.shared_hidden:  # the shared expert's gate: logits of std 1
            out.append((p + "ffn_gate_inp_shexp.weight",
                        (rng.standard_normal(s.dim) / math.sqrt(s.dim)).astype(np.float32)))
    out.append(("output_norm.weight", norm(s.dim)))
    if s.rope_freqs:
        out.append(("rope_freqs.weight", llama3_freq_factors(n_rot, s.rope_theta,
                                                             **LLAMA3_SCALING)))
    if s.longrope:  # LongRoPE: short factors near 1, long ones growing to ~8
        ramp = np.linspace(0, 1, n_rot // 2)
        out += [("rope_factors_long.weight", (1 + 7 * ramp ** 2).astype(np.float32)),
                ("rope_factors_short.weight", (1 + 0.1 * ramp).astype(np.float32))]
    return out


def _gptoss_vectors(s: Spec, p: str, rng: np.random.Generator) -> list[tuple[str, np.ndarray]]:
    """A gpt-oss layer's sinks (logits around the scores' own size, so that they take a
    good share of some heads' attention), the attention output's bias, the router's bias and
    the experts' biases (float32, the experts' (n_experts, rows))."""
    E, F, g = s.n_experts, s.expert_hidden, s.ffn_in_gain
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    return [(p + "attn_sinks.weight", f32(1.0 + 1.5 * rng.standard_normal(s.n_heads))),
            (p + "attn_output.bias", f32(0.05 * rng.standard_normal(s.dim))),
            (p + "ffn_gate_inp.bias", f32(0.5 * rng.standard_normal(E))),
            (p + "ffn_gate_exps.bias", f32(0.5 * g * rng.standard_normal((E, F)))),
            (p + "ffn_up_exps.bias", f32(0.5 * g * rng.standard_normal((E, F)))),
            (p + "ffn_down_exps.bias", f32(0.02 * rng.standard_normal((E, s.dim))))]


def _head(s: Spec, embd: np.ndarray, out_norm: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The output matrix (vocab, dim) as float32: random rows giving logits of std LOGIT_STD,
    plus, for each token t, a push along t's normalized embedding on the row of a fixed random
    successor, so that when the last hidden state points along that embedding the successor's
    logit leads the expected largest random one by ``s.margin`` nats."""
    V, dim = embd.shape
    rms = np.sqrt(_stable((embd.astype(np.float64) ** 2).mean(1)))
    n = embd / rms[:, None] * out_norm
    n_norm = np.sqrt(_stable((n ** 2).sum(1)))
    w = rng.standard_normal((V, dim)) * _stable(LOGIT_STD / n_norm.mean())
    succ = rng.permutation(V)
    sigma = _stable(np.sqrt((w ** 2).sum(1)).mean()) / math.sqrt(dim) * n_norm
    push = sigma * EXPECTED_MAX + s.margin - _stable((w[succ] * n).sum(1))
    w[succ] += (push / n_norm ** 2)[:, None] * n
    return w.astype(np.float32)


def _encode_float(w: np.ndarray, type_name: str) -> np.ndarray:
    """float32 (N, K) values as GGUF bytes of a float type."""
    w = np.ascontiguousarray(w, np.float32)
    if type_name == "F32":
        return w.view(np.uint8).reshape(w.shape[0], -1)
    if type_name == "F16":
        return w.astype(np.float16).view(np.uint8).reshape(w.shape[0], -1)
    return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(w.shape[0], -1)


def _value_type(v) -> tuple[GGUFValueType, GGUFValueType | None]:
    if isinstance(v, bool):
        return GGUFValueType.BOOL, None
    if isinstance(v, int):
        return GGUFValueType.UINT32, None
    if isinstance(v, str):
        return GGUFValueType.STRING, None
    if isinstance(v, np.ndarray):
        return GGUFValueType.ARRAY, {np.dtype(np.int32): GGUFValueType.INT32,
                                     np.dtype(np.float32): GGUFValueType.FLOAT32}[v.dtype]
    return GGUFValueType.ARRAY, GGUFValueType.STRING


def write(name: str, path: str | Path, tokenizer_meta: dict, drop: tuple = (),
          **changes) -> Path:
    """Write the synthetic model ``name`` (a key of SPECS).

    Args:
        name: which model; path: the .gguf file to write.
        tokenizer_meta: metadata of a real model whose ``tokenizer.*`` keys are copied.
        drop: tensor names to leave out; changes: Spec fields to change (both for files
            a model must refuse).
    Returns:
        The path written.
    """
    s = replace(ALL_SPECS[name], **changes)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    w = GGUFWriter(str(path), s.arch)
    # (not "phi3": llama.cpp gives a model so named Phi-3's special-token handling)
    w.add_name(f"synthetic {name.replace('phi3', 'Phi 3')}")
    a = s.arch + "."
    ints = {"context_length": s.context_length, "embedding_length": s.dim,
            "block_count": s.n_layers, "feed_forward_length": s.hidden_dim,
            "attention.head_count": s.n_heads, "attention.head_count_kv": s.n_kv_heads,
            "attention.key_length": s.head_dim, "attention.value_length": s.head_dim,
            "rope.dimension_count": s.n_rot or s.head_dim}
    for k, v in ints.items():
        w.add_key_value(a + k, v, GGUFValueType.UINT32)
    w.add_key_value(a + "rope.freq_base", s.rope_theta, GGUFValueType.FLOAT32)
    w.add_key_value(a + "attention.layer_norm_rms_epsilon", 1e-6, GGUFValueType.FLOAT32)
    for k, (v, vt) in s.meta.items():
        w.add_key_value(a + k, v, vt)
    if s.arch == "gemma4":
        _gemma4_meta(w, s)
    if s.arch in ("qwen35", "qwen35moe"):
        _qwen35_meta(w, s)
    if s.n_experts:
        moe = {"expert_count": s.n_experts, "expert_used_count": s.n_used,
               "expert_feed_forward_length": s.expert_hidden}
        if s.shared_hidden:
            moe["expert_shared_feed_forward_length"] = s.shared_hidden
        for k, v in moe.items():
            w.add_key_value(a + k, v, GGUFValueType.UINT32)
    for k, v in tokenizer_meta.items():
        if k.startswith("tokenizer."):
            if k == "tokenizer.ggml.pre" and s.pre is not None:
                v = s.pre
            vt, sub = _value_type(v)
            w.add_key_value(k, list(v) if isinstance(v, np.ndarray) else v, vt, sub)
    for tname, type_name, N, K, std in _matrices(s):
        raw = _scaled(type_name, N or vocab, K, std, rng)
        stack = _stack_shape(s, tname)
        if stack is not None:
            raw = raw.reshape(*stack, -1)
        if tname not in drop:
            w.add_tensor(tname, raw, raw_dtype=GGMLQuantizationType[type_name])
        if tname == "token_embd.weight":
            embd = dequantize(raw.reshape(-1), type_name, (vocab, s.dim))
    vectors = _vectors(s, rng) + _expert_scales(s, rng)
    for tname, values in vectors:
        if tname not in drop:
            w.add_tensor(tname, values)
    head = _head(s, embd, dict(vectors)["output_norm.weight"], rng)
    w.add_tensor("output.weight", _encode_float(head, s.types["output"]),
                 raw_dtype=GGMLQuantizationType[s.types["output"]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _gemma4_meta(w: GGUFWriter, s: Spec) -> None:
    a = s.arch + "."
    w.add_array(a + "attention.sliding_window_pattern", [bool(x) for x in s.swa_layers])
    for k, v in {"attention.sliding_window": s.sliding_window,
                 "attention.shared_kv_layers": s.shared_kv,
                 "embedding_length_per_layer_input": s.per_layer_dim,
                 "attention.key_length_swa": s.swa_head_dim,
                 "attention.value_length_swa": s.swa_head_dim,
                 "rope.dimension_count_swa": s.swa_head_dim}.items():
        w.add_key_value(a + k, v, GGUFValueType.UINT32)
    w.add_key_value(a + "rope.freq_base_swa", s.swa_theta, GGUFValueType.FLOAT32)
    if s.softcap:
        w.add_key_value(a + "final_logit_softcapping", s.softcap, GGUFValueType.FLOAT32)


def digest(path: str | Path) -> str:
    """sha256 of a GGUF file's tensors and metadata as our reader sees them (independent of
    how a writer lays the file out): the fixtures record it, so a change in the generated
    weights shows as such rather than as disagreement."""
    from localllm.formats.gguf import GGUFFile
    h = hashlib.sha256()
    f = GGUFFile(path)
    try:
        for k in sorted(f.metadata):
            v = f.metadata[k]
            h.update(repr((k, v.tolist() if isinstance(v, np.ndarray) else v)).encode())
        for t in sorted(f.tensors):
            info = f.tensors[t]
            h.update(repr((t, info.type_name, info.shape)).encode())
            h.update(f.raw(t).tobytes())
    finally:
        f.close()
    return h.hexdigest()
