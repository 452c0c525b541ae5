#!/usr/bin/env python3
"""Write the scale ladder: random-weight GGUFs of real model shapes (Llama 3.2 1B and 3B,
Llama 3.1 8B, Gemma 3 4B, OLMoE-1B-7B's mixture of experts, four layers of Qwen3-30B-A3B's,
and Qwen3.5 4B's hybrid of Gated DeltaNet and full attention)
with their real tokenizers, quantized by llama.cpp's own quantizer so the per-tensor mix of
types is the one people download.

The F16 file is written tensor by tensor from a pool of random values (memory stays near one
tensor), quantized with `llama_cpp.llama_model_quantize`, then deleted. Tokenizers come from
llama.cpp's vocab-only test files (the llama-cpp-python 0.3.36 sdist, `--vocab-dir`) and from
the Gemma 3 test model. Needs llama-cpp-python installed; keep the output outside the repo.

    python scripts/make_scale_models.py --out /data/scale llama-3.2-1b --types Q4_K_M Q8_0
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from localllm.formats.fetch import cached_path
from localllm.testing.synthetic import llama3_freq_factors, qwen35_ssm_keys


@dataclass(frozen=True)
class Shape:
    arch: str            # general.architecture
    vocab: str           # "llama-bpe" (a vocab file) or "gemma3" (the test model's tokenizer)
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    rope_theta: float
    tied: bool
    context: int
    sliding_window: int = 0
    n_experts: int = 0   # mixture-of-experts FFNs (hidden_dim is then each expert's width)
    n_used: int = 0
    ssm: tuple = ()      # Qwen3.5's DeltaNet layers: (key heads, value heads, head size, conv)
    full_every: int = 0  # Qwen3.5: full attention on every this-th layer, DeltaNet between


SHAPES = {
    "llama-3.2-1b": Shape("llama", "llama-bpe", 2048, 16, 32, 8, 64, 8192, 500000.0, True, 131072),
    "llama-3.2-3b": Shape("llama", "llama-bpe", 3072, 28, 24, 8, 128, 8192, 500000.0, True, 131072),
    "llama-3.1-8b": Shape("llama", "llama-bpe", 4096, 32, 32, 8, 128, 14336, 500000.0, False,
                          131072),
    "gemma-3-4b": Shape("gemma3", "gemma3", 2560, 34, 8, 4, 256, 10240, 1000000.0, True, 131072,
                        sliding_window=1024),
    # 64 experts, top-8 (1.3B of its 6.9B parameters active), QK-norm over all heads
    "olmoe-1b-7b": Shape("olmoe", "gpt-2", 2048, 16, 16, 16, 128, 1024, 10000.0, False, 4096,
                         n_experts=64, n_used=8),
    # Qwen3-30B-A3B's layer (128 experts of width 768, top-8; 32 query heads of 128 over 4 KV
    # heads, QK-norm per head) in 4 of its 48 layers: the experts' memory and speed at real
    # width, in a file (1.9 GB at Q4_K_M) that takes minutes, not an hour, to make
    "qwen3-30b-a3b-4l": Shape("qwen3moe", "qwen2", 2048, 4, 32, 4, 128, 768, 1000000.0, False,
                              40960, n_experts=128, n_used=8),
    # Qwen3.5 4B's shape: 32 layers, full (gated) attention on every fourth, 16 query heads
    # of 256 over 4 KV heads with a quarter of each rotated; Gated DeltaNet elsewhere with 16
    # key and 32 value heads of 128; tied embedding (the qwen35 vocab file's 152k tokens,
    # where the real model has 248k)
    "qwen3.5-4b": Shape("qwen35", "qwen35", 2560, 32, 16, 4, 256, 9216, 10000000.0, True,
                        262144, ssm=(16, 32, 128, 4), full_every=4),
}

# llama.cpp's llama_ftype values for the quantizer.
FTYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "IQ4_XS": 30}

_POOL = 1 << 24  # random f16 values drawn once; tensors take windows of it


def _tokenizer_source(shape: Shape, vocab_dir: Path) -> Path:
    if shape.vocab == "gemma3":
        path = cached_path("gemma3-270m")
        if path is None:
            sys.exit("the Gemma 3 test model is not cached: run scripts/fetch_models.py")
        return path
    path = vocab_dir / f"ggml-vocab-{shape.vocab}.gguf"
    if not path.exists():
        sys.exit(f"{path} is missing: point --vocab-dir at the sdist's vendor/llama.cpp/models")
    return path


def _copy_tokenizer(w: gguf.GGUFWriter, src: Path) -> int:
    """Copies the tokenizer.* keys of `src` into `w`. Returns: the vocabulary size."""
    r = gguf.GGUFReader(str(src))
    n_vocab = 0
    for k, f in r.fields.items():
        if not k.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(k, f.contents(), vtype, sub_type=sub)
        if k == "tokenizer.ggml.tokens":
            n_vocab = len(f.data)
    return n_vocab


def _tensors(s: Shape, n_vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, kind) of every tensor; kind is 'matrix' (an expert stack too),
    'norm', 'freqs' or 'router' (kept float32: llama.cpp's quantizer leaves it as it is)."""
    D, H = s.dim, s.hidden_dim
    q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    out = [("token_embd.weight", (n_vocab, D), "matrix")]
    if s.arch == "llama":
        out.append(("rope_freqs.weight", (s.head_dim // 2,), "freqs"))
    for i in range(s.n_layers):
        b = f"blk.{i}."
        if s.arch == "qwen35":
            out += _qwen35_layer(s, b, i)
            continue
        out += [(b + "attn_norm.weight", (D,), "norm"),
                (b + "attn_q.weight", (q, D), "matrix"),
                (b + "attn_k.weight", (kv, D), "matrix"),
                (b + "attn_v.weight", (kv, D), "matrix"),
                (b + "attn_output.weight", (D, q), "matrix")]
        if s.arch == "olmoe":
            out += [(b + "attn_q_norm.weight", (q,), "norm"),
                    (b + "attn_k_norm.weight", (kv,), "norm")]
        elif s.arch == "qwen3moe":
            out += [(b + "attn_q_norm.weight", (s.head_dim,), "norm"),
                    (b + "attn_k_norm.weight", (s.head_dim,), "norm")]
        if s.n_experts:
            E = s.n_experts
            out += [(b + "ffn_norm.weight", (D,), "norm"),
                    (b + "ffn_gate_inp.weight", (E, D), "router"),
                    (b + "ffn_gate_exps.weight", (E, H, D), "matrix"),
                    (b + "ffn_up_exps.weight", (E, H, D), "matrix"),
                    (b + "ffn_down_exps.weight", (E, D, H), "matrix")]
            continue
        if s.arch == "gemma3":
            out += [(b + "attn_q_norm.weight", (s.head_dim,), "norm"),
                    (b + "attn_k_norm.weight", (s.head_dim,), "norm"),
                    (b + "post_attention_norm.weight", (D,), "norm"),
                    (b + "post_ffw_norm.weight", (D,), "norm")]
        out += [(b + "ffn_norm.weight", (D,), "norm"),
                (b + "ffn_gate.weight", (H, D), "matrix"),
                (b + "ffn_up.weight", (H, D), "matrix"),
                (b + "ffn_down.weight", (D, H), "matrix")]
    out.append(("output_norm.weight", (D,), "norm"))
    if not s.tied:
        out.append(("output.weight", (n_vocab, D), "matrix"))
    return out


def _qwen35_layer(s: Shape, b: str, i: int) -> list[tuple[str, tuple[int, ...], str]]:
    D, H = s.dim, s.hidden_dim
    out = [(b + "attn_norm.weight", (D,), "norm"), (b + "post_attention_norm.weight", (D,), "norm")]
    if (i + 1) % s.full_every == 0:  # gated attention: each head's query rows, then its gate's
        q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        out += [(b + "attn_q.weight", (2 * q, D), "matrix"),
                (b + "attn_k.weight", (kv, D), "matrix"),
                (b + "attn_v.weight", (kv, D), "matrix"),
                (b + "attn_output.weight", (D, q), "matrix"),
                (b + "attn_q_norm.weight", (s.head_dim,), "norm"),
                (b + "attn_k_norm.weight", (s.head_dim,), "norm")]
    else:
        Hk, Hv, S, K = s.ssm
        C = (2 * Hk + Hv) * S
        out += [(b + "attn_qkv.weight", (C, D), "matrix"),
                (b + "attn_gate.weight", (Hv * S, D), "matrix"),
                (b + "ssm_beta.weight", (Hv, D), "matrix"),
                (b + "ssm_alpha.weight", (Hv, D), "matrix"),
                (b + "ssm_out.weight", (D, Hv * S), "matrix"),
                (b + "ssm_conv1d.weight", (C, K), "conv"),
                (b + "ssm_dt.bias", (Hv,), "dt"),
                (b + "ssm_a", (Hv,), "decay"),
                (b + "ssm_norm.weight", (S,), "norm")]
    return out + [(b + "ffn_gate.weight", (H, D), "matrix"),
                  (b + "ffn_up.weight", (H, D), "matrix"),
                  (b + "ffn_down.weight", (D, H), "matrix")]


def _metadata(w: gguf.GGUFWriter, s: Shape, n_vocab: int) -> None:
    a = s.arch
    w.add_name(f"scale ladder {a} {s.dim}x{s.n_layers}")
    w.add_uint32(f"{a}.context_length", s.context)
    w.add_uint32(f"{a}.embedding_length", s.dim)
    w.add_uint32(f"{a}.block_count", s.n_layers)
    w.add_uint32(f"{a}.feed_forward_length", s.hidden_dim)
    w.add_uint32(f"{a}.attention.head_count", s.n_heads)
    w.add_uint32(f"{a}.attention.head_count_kv", s.n_kv_heads)
    w.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5 if a == "llama" else 1e-6)
    if a == "llama":
        w.add_uint32(f"{a}.vocab_size", n_vocab)
        w.add_uint32(f"{a}.rope.dimension_count", s.head_dim)
    else:
        w.add_uint32(f"{a}.attention.key_length", s.head_dim)
        w.add_uint32(f"{a}.attention.value_length", s.head_dim)
    if a == "gemma3":
        w.add_uint32(f"{a}.attention.sliding_window", s.sliding_window)
    if a == "qwen35":
        keys = {**qwen35_ssm_keys(s.ssm, s.full_every), "rope.dimension_count": s.head_dim // 4}
        for k, v in keys.items():
            w.add_uint32(f"{a}.{k}", v)
        w.add_array(f"{a}.rope.dimension_sections", [11, 11, 10, 0])
    if s.n_experts:
        w.add_uint32(f"{a}.expert_count", s.n_experts)
        w.add_uint32(f"{a}.expert_used_count", s.n_used)
        w.add_uint32(f"{a}.expert_feed_forward_length", s.hidden_dim)
    w.add_uint32("general.file_type", 1)


def write_f16(name: str, path: Path, vocab_dir: Path, seed: int = 0) -> Path:
    """Writes the F16 model of shape `name` to `path`. Returns: the path."""
    s = SHAPES[name]
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(_POOL, dtype=np.float32) * 0.02).astype(np.float16)
    w = gguf.GGUFWriter(str(path), s.arch)
    n_vocab = _copy_tokenizer(w, _tokenizer_source(s, vocab_dir))
    _metadata(w, s, n_vocab)
    tensors = _tensors(s, n_vocab)
    for tname, shp, kind in tensors:
        dt = np.float16 if kind == "matrix" else np.float32
        w.add_tensor_info(tname, shp, np.dtype(dt), int(np.prod(shp)) * np.dtype(dt).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for tname, shp, kind in tensors:
        if kind == "norm":
            data = np.ones(shp, np.float32)
        elif kind == "router":  # logits of std ~1: each token its own mix of experts
            data = (rng.standard_normal(shp, dtype=np.float32) / np.sqrt(s.dim)).astype(np.float32)
        elif kind == "conv":  # DeltaNet conv taps, decay bias and factor: a few tokens' memory
            data = (0.5 * rng.standard_normal(shp)).astype(np.float32)
        elif kind == "dt":
            data = np.full(shp, -1.5, np.float32)
        elif kind == "decay":
            data = -np.exp(0.3 * rng.standard_normal(shp)).astype(np.float32)
        elif kind == "freqs":
            data = llama3_freq_factors(s.head_dim, s.rope_theta, 32.0, 1.0, 4.0, 8192)
        else:
            n = int(np.prod(shp))
            data = np.empty(n, np.float16)
            step = _POOL // 2
            for o in range(0, n, step):  # windows at random offsets: no two tensors alike
                m = min(step, n - o)
                start = int(rng.integers(0, _POOL - m + 1))
                data[o:o + m] = pool[start:start + m]
            data = data.reshape(shp)
        w.write_tensor_data(data)
    w.close()
    return path


def quantize(src: Path, dst: Path, type_name: str, threads: int) -> None:
    """Quantizes `src` into `dst` with llama.cpp's quantizer (its per-tensor type mix)."""
    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[type_name]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({type_name}) returned {rc}")


def ladder_path(out: Path, name: str, type_name: str) -> Path:
    return out / f"{name}.{type_name}.gguf"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q8_0", "Q4_0", "IQ4_XS"],
                    choices=list(FTYPES))
    ap.add_argument("--out", type=Path, required=True,
                    help="folder for the models (outside the repo)")
    ap.add_argument("--vocab-dir", type=Path,
                    default=Path(os.environ.get("LLAMA_CPP_MODELS", "vendor/llama.cpp/models")),
                    help="llama.cpp's models/ folder with the ggml-vocab-*.gguf files")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes:
        todo = [t for t in args.types if not ladder_path(args.out, name, t).exists()]
        if not todo:
            continue
        f16 = args.out / f"{name}.F16.gguf"
        t0 = time.perf_counter()
        write_f16(name, f16, args.vocab_dir)
        print(f"{f16.name}: {f16.stat().st_size / 1e9:.2f} GB in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        try:
            for t in todo:
                dst = ladder_path(args.out, name, t)
                t0 = time.perf_counter()
                quantize(f16, dst.with_suffix(".part"), t, args.threads)
                dst.with_suffix(".part").rename(dst)
                print(f"{dst.name}: {dst.stat().st_size / 1e9:.2f} GB in "
                      f"{time.perf_counter() - t0:.0f} s",
                      flush=True)
        finally:
            f16.unlink(missing_ok=True)  # the F16 intermediate is large: never keep it
    return 0


if __name__ == "__main__":
    sys.exit(main())
