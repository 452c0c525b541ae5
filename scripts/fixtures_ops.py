"""The `ops` section of make_fixtures.py: llama.cpp's intermediate tensors inside decoder
blocks, so tests can hand each of our operations llama.cpp's own input and compare outputs.

llama.cpp runs the passage's first 64 tokens as one batch (64 rows put its CPU attention on
the tiled float32 path it uses for prompts) and reports every graph node through its
evaluation callback; we keep, per chosen layer, a few token rows of each step and, for
attention, the keys and values of all 64 rows.
"""

from __future__ import annotations

import ctypes
import json
import re

import numpy as np

N_TOKENS = 64
ROWS = [1, 12, 25, 38, 51, 63]
LAYERS = {"smollm": [0], "gemma": [0, 5]}   # Gemma's layer 5 is a global-attention layer
THREADS = 2

# ggml node names (per layer, "-<layer>" appended) -> fixture keys. "#k" marks the k-th
# later node of the same name (llama.cpp reuses names for reshapes and rotations).
NAMES = {
    "llama": {"attn_norm": "attn_norm", "Qcur": "q", "Kcur": "k", "Vcur": "v",
              "Qcur#2": "q_rope", "Kcur#2": "k_rope", "kqv_out": "attn", "ffn_inp": "ffn_inp",
              "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up", "ffn_swiglu": "act",
              "ffn_out": "ffn_out", "l_out": "l_out"},
    "gemma3": {"attn_norm": "attn_norm", "Qcur": "q", "Kcur": "k", "Vcur": "v",
               "Qcur_normed": "q_norm", "Kcur_normed": "k_norm", "Qcur#2": "q_rope",
               "Kcur#2": "k_rope", "kqv_out": "attn", "attn_post_norm": "attn_post_norm",
               "sa_out": "ffn_inp", "ffn_norm": "ffn_norm", "ffn_gate": "gate", "ffn_up": "up",
               "ffn_geglu": "act", "ffn_out": "ffn_out", "ffn_post_norm": "ffn_post_norm",
               "l_out": "l_out"},
}
FULL_ROWS = {"k_rope", "v"}   # attention needs every row's keys and values


class GGMLTensor(ctypes.Structure):
    """The head of ggml's `struct ggml_tensor` (ggml.h: 4 dims, 10 sources, 64-byte names)."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10),
                ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t),
                ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


def _read(t: GGMLTensor) -> np.ndarray | None:
    """A float32/float16 node's data as float32 of shape (ne3, ne2, ne1, ne0)."""
    if t.type not in (0, 1):
        return None
    dt = np.float32 if t.type == 0 else np.float16
    ne, nb = list(t.ne), list(t.nb)
    span = sum((n - 1) * s for n, s in zip(ne, nb)) + nb[0]
    raw = np.frombuffer(ctypes.string_at(t.data, span), dtype=dt)
    view = np.lib.stride_tricks.as_strided(raw, shape=ne[::-1], strides=nb[::-1])
    return view.astype(np.float32)


def capture(path: str, ids: list[int], layers: list[int]) -> dict[str, np.ndarray]:
    """Evaluate ``ids`` in one batch and return the named nodes of ``layers``.

    Keys are "<layer>/<ggml name>[#k]", plus "<layer>/attn_out" for the node evaluated right
    after kqv_out (the output projection, unnamed in some graphs), every layer's "l_out",
    and the token embedding as it enters layer 0 ("embd", or "inp_scaled" where scaled).
    """
    import llama_cpp as L

    got: dict[str, np.ndarray] = {}
    seen: dict[str, int] = {}
    state = {"after_kqv": None}
    pattern = re.compile(r"^(.*)-(\d+)$")

    def on_node(ptr, ask, _user):
        if ask:
            return True
        t = GGMLTensor.from_address(ptr)
        name = t.name.decode(errors="replace")
        if state["after_kqv"] is not None:
            got[f"{state['after_kqv']}/attn_out"] = _read(t)
            state["after_kqv"] = None
        if name in ("embd", "inp_scaled"):
            got[name] = _read(t)
            return True
        m = pattern.match(name)
        if not m or (int(m.group(2)) not in layers and m.group(1) != "l_out"):
            return True
        base, layer = m.group(1), int(m.group(2))
        k = seen.get(name, 0)
        seen[name] = k + 1
        a = _read(t)
        if a is not None:
            got[f"{layer}/{base}" + (f"#{k}" if k else "")] = a
        if base == "kqv_out":
            state["after_kqv"] = layer
        return True

    callback = L.ggml_backend_sched_eval_callback(on_node)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx = cp.n_batch = cp.n_ubatch = 512
    cp.n_threads = cp.n_threads_batch = THREADS
    cp.cb_eval = callback
    ctx = L.llama_init_from_model(model, cp)
    tokens = (L.llama_token * len(ids))(*ids)
    if L.llama_decode(ctx, L.llama_batch_get_one(tokens, len(ids))) != 0:
        raise RuntimeError("llama_decode failed")
    L.llama_free(ctx)
    L.llama_model_free(model)
    return got


def ops_doc(path: str, name: str, passage_ids: list[int]) -> dict[str, np.ndarray]:
    ids = passage_ids[:N_TOKENS]
    arch = "gemma3" if name == "gemma" else "llama"
    got = capture(path, ids, LAYERS[name])
    rows = np.array(ROWS)
    out = {"ids": np.array(ids, np.int32), "rows": rows.astype(np.int32),
           "layers": np.array(LAYERS[name], np.int32)}
    embd = got.get("inp_scaled", got["embd"])
    for layer in LAYERS[name]:
        x = embd if layer == 0 else got[f"{layer - 1}/l_out"]
        out[f"{layer}/x"] = x.reshape(len(ids), -1)[rows]
        for src, key in list(NAMES[arch].items()) + [("attn_out", "attn_out")]:
            a = got[f"{layer}/{src}"].reshape(len(ids), -1)
            out[f"{layer}/{key}"] = a if key in FULL_ROWS else a[rows]
    return out


def section_ops(args, model_path, fixtures) -> None:
    for name in ("smollm", "gemma"):
        ids = json.loads((fixtures / "logits" / f"{name}_logits.json").read_text())["ids"]
        doc = ops_doc(model_path(name), name, ids)
        path = fixtures / "ops" / f"{name}_ops.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, **doc)
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")
