"""Small encoder GGUFs (`bert`, `nomic-bert`, a `bert` reranker) and a decoder embedder in
Qwen3-Embedding's layout, with random weights and a real model's BPE tokenizer, written with
gguf.GGUFWriter: same seed, same bytes. The llama.cpp reference embeddings in
tests/fixtures/embeddings/ were computed on exactly these files.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf import quants as gguf_quants

from . import synthetic
from .synthetic import _encode_float, _value_type

# FIM tokens given to a decoder's SmolLM2 vocabulary for fill-in-the-middle tests: existing
# special tokens (<gh_stars>, <issue_start>, ...) named as the prefix, suffix, ... tokens
FIM_IDS = {"fim_pre": 7, "fim_suf": 8, "fim_mid": 9, "fim_pad": 10, "fim_rep": 3, "fim_sep": 5}

# llama.cpp's {arch}.pooling_type numbers
POOL_IDS = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}


@dataclass(frozen=True)
class EncoderSpec:
    """One synthetic encoder: shape, pooling and weight type."""
    arch: str
    pooling: str
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    hidden_dim: int = 512
    n_positions: int = 512
    matrix_type: str = "F16"
    rank_head: bool = False


SPECS = {
    "bert": EncoderSpec("bert", "mean"),
    "bert_cls": EncoderSpec("bert", "cls", matrix_type="F32"),
    "nomic_bert": EncoderSpec("nomic-bert", "mean"),
    "bert_q8": EncoderSpec("bert", "last", matrix_type="Q8_0"),
    "bert_rank": EncoderSpec("bert", "rank", rank_head=True),
}
# BERT-base's shape (110M parameters with a 30k vocabulary), for benchmarks
BERT_BASE = EncoderSpec("bert", "mean", dim=768, n_layers=12, n_heads=12, hidden_dim=3072)


def _tensors(s: EncoderSpec, vocab: int, rng: np.random.Generator) -> list[tuple[str, np.ndarray, str]]:
    """(name, float32 values, GGML type) of every tensor, in file order."""
    d, f = s.dim, s.hidden_dim
    mat = lambda n, k, g=1.0: (g * rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)  # noqa: E731
    vec = lambda n, c=0.0, g=0.1: (c + g * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    out = [("token_embd.weight", rng.standard_normal((vocab, d)).astype(np.float32), "F16"),
           ("token_types.weight", vec((2, d)), "F32"),
           ("token_embd_norm.weight", vec(d, 1.0), "F32"),
           ("token_embd_norm.bias", vec(d), "F32")]
    if s.arch == "bert":
        out.append(("position_embd.weight", vec((s.n_positions, d), g=0.5), "F32"))
    t = s.matrix_type
    for i in range(s.n_layers):
        p = f"blk.{i}."
        if s.arch == "nomic-bert":
            out.append((p + "attn_qkv.weight", mat(3 * d, d, 1.5), t))
        else:
            for x in "qkv":
                out += [(p + f"attn_{x}.weight", mat(d, d, 1.5), t),
                        (p + f"attn_{x}.bias", vec(d), "F32")]
        out.append((p + "attn_output.weight", mat(d, d), t))
        if s.arch == "bert":
            out.append((p + "attn_output.bias", vec(d), "F32"))
        out += [(p + "attn_output_norm.weight", vec(d, 1.0), "F32"),
                (p + "attn_output_norm.bias", vec(d), "F32")]
        if s.arch == "nomic-bert":
            out += [(p + "ffn_up.weight", mat(f, d), t), (p + "ffn_gate.weight", mat(f, d), t)]
        else:
            out += [(p + "ffn_up.weight", mat(f, d), t), (p + "ffn_up.bias", vec(f), "F32")]
        out.append((p + "ffn_down.weight", mat(d, f), t))
        if s.arch == "bert":
            out.append((p + "ffn_down.bias", vec(d), "F32"))
        out += [(p + "layer_output_norm.weight", vec(d, 1.0), "F32"),
                (p + "layer_output_norm.bias", vec(d), "F32")]
    if s.rank_head:
        out += [("cls.weight", mat(d, d, 2.0), "F32"), ("cls.bias", vec(d), "F32"),
                ("cls.output.weight", mat(1, d, 2.0), "F32"), ("cls.output.bias", vec(1), "F32")]
    return out


def write(name: str, path: str | Path, tokenizer_meta: dict, spec: EncoderSpec | None = None,
          **changes) -> Path:
    """Write the synthetic encoder ``name`` (a key of SPECS, or any name with ``spec``).

    Args:
        name: which model (also seeds the weights); path: the .gguf file to write.
        tokenizer_meta: metadata of a real model whose ``tokenizer.*`` keys are copied.
        spec: the shape, instead of SPECS[name]; changes: EncoderSpec fields to change.
    Returns:
        The path written.
    """
    s = replace(spec or SPECS[name], **changes)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    w = GGUFWriter(str(path), s.arch)
    w.add_name(f"synthetic {name}")
    a = s.arch + "."
    for k, v in {"context_length": s.n_positions, "embedding_length": s.dim,
                 "block_count": s.n_layers, "feed_forward_length": s.hidden_dim,
                 "attention.head_count": s.n_heads,
                 "pooling_type": POOL_IDS[s.pooling]}.items():
        w.add_key_value(a + k, v, GGUFValueType.UINT32)
    w.add_key_value(a + "attention.layer_norm_epsilon", 1e-12, GGUFValueType.FLOAT32)
    w.add_key_value(a + "attention.causal", False, GGUFValueType.BOOL)
    if s.arch == "nomic-bert":
        w.add_key_value(a + "rope.freq_base", 1000.0, GGUFValueType.FLOAT32)
    for k, v in tokenizer_meta.items():
        if k.startswith("tokenizer.") and k != "tokenizer.chat_template":
            vt, sub = _value_type(v)
            w.add_key_value(k, list(v) if isinstance(v, np.ndarray) else v, vt, sub)
    w.add_key_value("tokenizer.ggml.token_type_count", 2, GGUFValueType.UINT32)
    for tname, values, type_name in _tensors(s, vocab, rng):
        if type_name == "F32":
            w.add_tensor(tname, values)
        elif type_name not in ("F16", "BF16"):  # a quantized type: gguf's own quantizer
            qtype = GGMLQuantizationType[type_name]
            w.add_tensor(tname, gguf_quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(tname, _encode_float(values, type_name),
                         raw_dtype=GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def with_fim_tokens(tokenizer_meta: dict, drop: tuple = (), add_bos: bool | None = None) -> dict:
    """A copy of a model's metadata whose tokenizer names FIM_IDS as its fill-in-the-middle
    tokens (tokenizer.ggml.fim_*_token_id), for synthetic.write.

    Args:
        tokenizer_meta: the real model's metadata; drop: FIM_IDS names left unnamed (a
            tokenizer may still find such a token by its text, as llama.cpp does);
        add_bos: tokenizer.ggml.add_bos_token to set (None: the model's own).
    """
    meta = dict(tokenizer_meta)
    for name, tid in FIM_IDS.items():
        if name not in drop:
            meta[f"tokenizer.ggml.{name}_token_id"] = tid
    if add_bos is not None:
        meta["tokenizer.ggml.add_bos_token"] = add_bos
    return meta


# Qwen3-Embedding's layout: a `qwen3` decoder whose file names last-token pooling, and whose
# tokenizer appends <|endoftext|> as EOS (the converter reads that from the post-processor of
# Qwen3-Embedding's tokenizer.json), so the last token pooled is always that EOS. Float
# weights, and blocks that weigh as much as the embedding (block_gain 1), so that the pooled
# vector depends on the whole text, not mostly on that EOS's embedding.
QWEN3_EMBEDDING_TYPES = {"attn": "F16", "attn_output": "F16", "ffn": "F16", "ffn_down": "F16",
                         "embd": "F16", "output": "F16"}


def write_qwen3_embedding(path: str | Path, tokenizer_meta: dict) -> Path:
    """Write the synthetic Qwen3-Embedding-like decoder (synthetic "qwen3"'s shape).

    Args:
        path: the .gguf file to write.
        tokenizer_meta: metadata of a real model whose ``tokenizer.*`` keys are copied; its
            "<|endoftext|>" token becomes EOS, appended to every text (add_eos_token).
    Returns:
        The path written.
    """
    tokens = list(tokenizer_meta["tokenizer.ggml.tokens"])
    meta = {**tokenizer_meta, "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"),
            "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True}
    meta.pop("tokenizer.chat_template", None)
    return synthetic.write("qwen3", path, meta, types=QWEN3_EMBEDDING_TYPES, block_gain=1.0,
                           meta={"pooling_type": (POOL_IDS["last"], GGUFValueType.UINT32)})
