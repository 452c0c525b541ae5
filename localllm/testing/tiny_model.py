"""A tiny llama-architecture GGUF (byte-level BPE vocabulary, Q8_0 weights) written with
gguf.GGUFWriter, and variants of it whose metadata or tensors are well-formed but wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf.constants import GGMLQuantizationType as Q
from gguf.constants import GGUFValueType as V

from localllm.text.tokenizer_bpe import BYTE_TO_CHAR

DIM, N_HEADS, N_KV, HIDDEN, N_LAYERS = 64, 4, 2, 128, 2
HEAD_DIM = DIM // N_HEADS
WORDS = ("he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    """Returns: (tokens, token types, merges) of the tiny byte-level BPE vocabulary."""
    tokens = list(SPECIALS) + list(BYTE_TO_CHAR) + list(WORDS)
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    return tokens, types, merges


def metadata() -> dict[str, tuple[Any, V, V | None]]:
    """key -> (value, value type, array item type) of the tiny model's metadata."""
    tokens, types, merges = vocabulary()
    p = "llama."
    return {
        p + "block_count": (N_LAYERS, V.UINT32, None),
        p + "context_length": (256, V.UINT32, None),
        p + "embedding_length": (DIM, V.UINT32, None),
        p + "feed_forward_length": (HIDDEN, V.UINT32, None),
        p + "attention.head_count": (N_HEADS, V.UINT32, None),
        p + "attention.head_count_kv": (N_KV, V.UINT32, None),
        p + "attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32, None),
        p + "rope.freq_base": (10000.0, V.FLOAT32, None),
        p + "rope.dimension_count": (HEAD_DIM, V.UINT32, None),
        p + "vocab_size": (len(tokens), V.UINT32, None),
        "tokenizer.ggml.model": ("gpt2", V.STRING, None),
        "tokenizer.ggml.pre": ("gpt-2", V.STRING, None),
        "tokenizer.ggml.tokens": (tokens, V.ARRAY, V.STRING),
        "tokenizer.ggml.token_type": (types, V.ARRAY, V.INT32),
        "tokenizer.ggml.merges": (merges, V.ARRAY, V.STRING),
        "tokenizer.ggml.bos_token_id": (0, V.UINT32, None),
        "tokenizer.ggml.eos_token_id": (2, V.UINT32, None),
        "tokenizer.ggml.padding_token_id": (0, V.UINT32, None),
        "tokenizer.ggml.add_bos_token": (False, V.BOOL, None),
    }


def tensors(n_layers: int = N_LAYERS, seed: int = 0) -> dict[str, np.ndarray]:
    """name -> float32 array (numpy shape) of the tiny model's weights."""
    rng = np.random.default_rng(seed)
    vocab = len(vocabulary()[0])

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    out = {"token_embd.weight": w(vocab, DIM), "output_norm.weight": np.ones(DIM, np.float32)}
    for i in range(n_layers):
        b = f"blk.{i}."
        out.update({
            b + "attn_norm.weight": np.ones(DIM, np.float32),
            b + "attn_q.weight": w(N_HEADS * HEAD_DIM, DIM),
            b + "attn_k.weight": w(N_KV * HEAD_DIM, DIM),
            b + "attn_v.weight": w(N_KV * HEAD_DIM, DIM),
            b + "attn_output.weight": w(DIM, N_HEADS * HEAD_DIM),
            b + "ffn_norm.weight": np.ones(DIM, np.float32),
            b + "ffn_gate.weight": w(HIDDEN, DIM),
            b + "ffn_up.weight": w(HIDDEN, DIM),
            b + "ffn_down.weight": w(DIM, HIDDEN),
        })
    return out


def write(path: str | Path, meta: dict | None = None, weights: dict | None = None,
          n_layers: int = N_LAYERS, seed: int = 0) -> Path:
    """Writes a tiny model; `meta` entries replace the defaults (None drops a key; a plain
    value keeps the key's type, uint32 or float32 for a new key; a (value, type, item type)
    tuple sets the type), and so do `weights` entries. 2-D float tensors are stored Q8_0
    (when their rows allow it), 1-D ones F32.

    Returns:
        The path written.
    """
    m = metadata()
    m["llama.block_count"] = (n_layers, V.UINT32, None)
    for k, v in (meta or {}).items():
        if v is None:
            m.pop(k, None)
        elif isinstance(v, tuple):
            m[k] = v
        elif k in m:
            m[k] = (v, m[k][1], m[k][2])
        else:
            m[k] = (v, V.FLOAT32 if isinstance(v, float) else V.UINT32, None)
    t = tensors(n_layers, seed)
    for k, v in (weights or {}).items():
        if v is None:
            t.pop(k, None)
        else:
            t[k] = v
    w = gguf.GGUFWriter(str(path), "llama")
    for k, (value, vtype, sub) in m.items():
        w.add_key_value(k, value, vtype, sub_type=sub)
    for name, arr in t.items():
        if arr.ndim == 2 and arr.shape[1] % 32 == 0 and np.isfinite(arr).all():
            w.add_tensor(name, gguf.quants.quantize(arr, Q.Q8_0),
                         raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)
