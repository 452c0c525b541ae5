"""A model's summary from its GGUF header: architecture, quantization, tensors by type,
parameter count, and the memory its weights and KV cache take."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from gguf import LlamaFileType

KV_BYTES_PER_VALUE = 2  # the CPU backend keeps keys and values in float16


def _file_type_name(value) -> str | None:
    try:
        return LlamaFileType(int(value)).name.replace("MOSTLY_", "").replace("ALL_", "")
    except (ValueError, TypeError):
        return None


def describe(f) -> dict:
    """Summarize an open GGUFFile.

    Returns:
        dict with architecture, name, quant, n_params, weight_bytes, tensor_types
        (type -> (count, bytes)), context_length, kv_bytes_per_1k, and key model dims.
    """
    meta = f.metadata
    arch = meta.get("general.architecture", "?")
    p = f"{arch}."
    types: dict[str, list[int]] = {}
    n_params = 0
    for t in f.tensors.values():
        entry = types.setdefault(t.type_name, [0, 0])
        entry[0] += 1
        entry[1] += t.nbytes
        n_params += t.n_elements
    quant = _file_type_name(meta.get("general.file_type"))
    if quant is None:  # the most common type among matrices
        mats = Counter(t.type_name for t in f.tensors.values() if len(t.shape) == 2)
        quant = mats.most_common(1)[0][0] if mats else "?"
    n_layers = int(meta.get(p + "block_count", 0) or 0)
    n_heads = meta.get(p + "attention.head_count", 0)
    n_heads = int(n_heads[0] if hasattr(n_heads, "__len__") else n_heads or 0)
    n_kv = meta.get(p + "attention.head_count_kv", n_heads)
    n_kv = int(n_kv[0] if hasattr(n_kv, "__len__") else n_kv or 0)
    dim = int(meta.get(p + "embedding_length", 0) or 0)
    k_len = int(meta.get(p + "attention.key_length", dim // n_heads if n_heads else 0) or 0)
    v_len = int(meta.get(p + "attention.value_length", k_len) or 0)
    # Layers sharing an earlier layer's KV hold none; sliding layers may have their own head
    # size (Gemma 4: attention.shared_kv_layers, sliding_window_pattern flags, key_length_swa)
    shared = int(meta.get(p + "attention.shared_kv_layers", 0) or 0)
    pattern = meta.get(p + "attention.sliding_window_pattern")
    swa_k = int(meta.get(p + "attention.key_length_swa", k_len) or 0)
    swa_v = int(meta.get(p + "attention.value_length_swa", swa_k) or 0)
    recurrent, state_bytes = _recurrent_layers(meta, p, n_layers)
    per_token = 0
    for i in range(max(0, n_layers - shared)):
        if i < len(recurrent) and recurrent[i] or recurrent and i >= len(recurrent):
            continue  # a linear-attention layer (a state per sequence), or an MTP block
        sliding = hasattr(pattern, "__len__") and i < len(pattern) and bool(pattern[i])
        per_token += n_kv * ((swa_k + swa_v) if sliding else (k_len + v_len))
    kv_1k = per_token * 1000 * KV_BYTES_PER_VALUE
    vocab = meta.get("tokenizer.ggml.tokens")
    return {
        "architecture": arch,
        "name": meta.get("general.name", ""),
        "quant": quant,
        "n_params": n_params,
        "weight_bytes": sum(b for _, b in types.values()),
        "tensor_types": {k: tuple(v) for k, v in sorted(types.items())},
        "n_tensors": len(f.tensors),
        "context_length": meta.get(p + "context_length"),
        "n_layers": n_layers, "dim": dim, "n_heads": n_heads, "n_kv_heads": n_kv,
        "head_dim": k_len,
        "vocab_size": len(vocab) if vocab is not None else meta.get(p + "vocab_size"),
        "tokenizer": meta.get("tokenizer.ggml.model"),
        "chat_template": "tokenizer.chat_template" in meta,
        "kv_bytes_per_1k": kv_1k,
        "recurrent_layers": sum(recurrent),
        "state_bytes": state_bytes,
        "metadata": meta,
        "version": f.version,
    }


def _recurrent_layers(meta: dict, p: str, n_layers: int) -> tuple[list[bool], int]:
    """Per trunk layer, whether it is a linear-attention (Gated DeltaNet) layer, as
    llama.cpp reads Qwen3.5's keys (multi-token-prediction blocks excluded), and the bytes
    of one sequence's recurrent state (float32 conv windows and delta states); ([], 0) for
    files without ``{arch}.ssm.*`` keys."""
    if p + "ssm.inner_size" not in meta or p + "ssm.state_size" not in meta:
        return [], 0
    n = n_layers - int(meta.get(p + "nextn_predict_layers", 0) or 0)
    flags = meta.get(p + "attention.recurrent_layers")
    if flags is not None:
        recurrent = [bool(x) for x in list(flags)[:n]]
    else:
        every = int(meta.get(p + "full_attention_interval", 4) or 4)
        recurrent = [(i + 1) % every != 0 for i in range(n)]
    S, inner = int(meta[p + "ssm.state_size"]), int(meta[p + "ssm.inner_size"])
    groups = int(meta.get(p + "ssm.group_count", 0) or 0)
    conv = int(meta.get(p + "ssm.conv_kernel", 4) or 4)
    per_layer = 4 * ((conv - 1) * (2 * groups * S + inner) + inner * S)
    return recurrent, sum(recurrent) * per_layer


def _plain(value):
    """Metadata as Python values (numpy arrays and scalars print as their numbers)."""
    return value.tolist() if hasattr(value, "tolist") else value


def _short(value, limit: int = 80) -> str:
    value = _plain(value)
    if isinstance(value, list):
        n = len(value)
        head = ", ".join(repr(v) for v in value[:3])
        return f"[{head}{', ...' if n > 3 else ''}] ({n} items)"
    s = repr(value)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def format_description(path: Path, d: dict, show_all: bool = False) -> str:
    """Human-readable text of describe()'s result."""
    lines = [
        f"file:           {path}",
        f"architecture:   {d['architecture']}  ({d['name']})",
        f"quantization:   {d['quant']}",
        f"parameters:     {d['n_params'] / 1e6:.1f} M",
        f"layers:         {d['n_layers']}  (dim {d['dim']}, heads {d['n_heads']}, "
        f"kv heads {d['n_kv_heads']}, head dim {d['head_dim']})",
        f"context length: {d['context_length']}",
        f"vocabulary:     {d['vocab_size']} ({d['tokenizer']})",
        f"chat template:  {'yes' if d['chat_template'] else 'no'}",
        f"weights:        {d['weight_bytes'] / 1e6:.1f} MB",
        f"KV cache:       {d['kv_bytes_per_1k'] / 1e6:.1f} MB per 1k tokens (float16)",
    ]
    if d.get("recurrent_layers"):
        lines.append(f"recurrent:      {d['state_bytes'] / 1e6:.1f} MB per sequence "
                     f"({d['recurrent_layers']} linear-attention layers)")
    lines += [
        f"tensors:        {d['n_tensors']}",
    ]
    for t, (count, nbytes) in d["tensor_types"].items():
        lines.append(f"  {t:8s} {count:5d} tensors  {nbytes / 1e6:9.1f} MB")
    lines.append(f"metadata:       {len(d['metadata'])} keys (GGUF v{d['version']})")
    for k, v in d["metadata"].items():
        lines.append(f"  {k} = {repr(_plain(v)) if show_all else _short(v)}")
    return "\n".join(lines)
