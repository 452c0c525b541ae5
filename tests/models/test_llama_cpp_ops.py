"""Each step of a decoder block, fed llama.cpp's own input, gives llama.cpp's output to within
float32 rounding (fixtures from `scripts/make_fixtures.py ops`).

This pins down the arithmetic itself: norm conventions, RoPE angles, QK-norm, attention
scale and window, activations, residuals. The logit tests compare whole forward passes,
where any rounding difference is amplified by the next layer's 8-bit activation
quantization; here each step is compared in isolation.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from localllm.backends.base import KVBatch

FIXTURES = Path(__file__).parents[1] / "fixtures" / "ops"

# Observed: 2e-8 .. 1e-6 relative RMS (float sums in another order, FMA or not). An error in
# the math (a norm epsilon, a RoPE angle, a scale) shows as 1e-4 or more.
RMS_REL_MAX = 3e-6
# The one step where llama.cpp's CPU backend computes something else on purpose: its GEGLU
# rounds the gate to float16 and looks GELU up in a float16 table (|gate| < 10). Ours is
# the float32 formula, so the step differs by float16 rounding (2^-11 relative), and the
# test checks that the table explains llama.cpp's output exactly.
TOLERANCE = {"gelu_tanh": 1e-3}


def llama_cpp_geglu(gate, up):
    """llama.cpp's CPU GEGLU (GGML_GELU_FP16): float16 gate -> float16 GELU table -> * up.

    The table holds 0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2))) in float32 as its
    build computes it (the inner 1 + a x x fused into one FMA, tanh correctly rounded).
    """
    f32 = np.float32
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(f32)
    with np.errstate(all="ignore"):
        poly = (np.float64(f32(0.044715) * h) * h + 1.0).astype(f32)
        inner = f32(0.7978845608028654) * h * poly
        t = np.tanh(inner.astype(np.float64)).astype(f32)
        table = (f32(0.5) * h * (f32(1) + t)).astype(np.float16).astype(f32)
    y = table[gate.astype(np.float16).view(np.uint16)] * up
    y = np.where(gate >= 10, gate * up, y)
    return np.where(gate <= -10, f32(0), y)


@pytest.fixture(scope="module")
def models(smollm_model, gemma_model):
    return {"smollm": smollm_model.with_kv("f16", "f16"),  # the session's weights
            "gemma": gemma_model.with_kv("f16", "f16")}


def rms_rel(ours, ref):
    ours = np.asarray(ours, np.float64).reshape(ref.shape)
    return float(np.sqrt(((ours - ref) ** 2).mean() / (ref.astype(np.float64) ** 2).mean()))


def block_steps(m, fx, layer):
    """(name, ours, llama.cpp's) for each step of ``layer``, each fed llama.cpp's input."""
    be, net = m.backend, m.net
    w, s = net.layers[layer].weights, net.layers[layer].spec
    rows = fx["rows"]
    n = len(fx["ids"])

    def g(key):  # a fresh copy: some backend ops work in place
        return fx[f"{layer}/{key}"].copy()

    steps = []

    def residual(part, x_key, out_key, post_norm, post_key, sum_key):
        """The sub-block's output, normed first where the architecture does, added back."""
        y = g(out_key)
        if post_norm is not None:
            steps.append((f"post_{part}_norm", be.rms_norm(y, post_norm, s.norm_eps),
                          g(post_key)))
            y = g(post_key)
        steps.append((f"residual_{part}", be.add(g(x_key), y), g(sum_key)))

    if layer == 0:
        steps.append(("embedding", net.embed(fx["ids"][rows]), g("x")))
    steps.append(("attn_norm", be.rms_norm(g("x"), w.attn_norm, s.norm_eps), g("attn_norm")))
    q, k, v = be.linear(g("attn_norm"), [w.wq, w.wk, w.wv])
    steps += [("wq", q, g("q")), ("wk", k, g("k")), ("wv", v, g("v")[rows])]
    q_in, k_in = g("q"), g("k")
    if w.q_norm is not None:
        steps.append(("q_norm", be.head_norm(g("q"), s.n_heads, w.q_norm, s.norm_eps),
                      g("q_norm")))
        steps.append(("k_norm", be.head_norm(g("k"), s.n_kv_heads, w.k_norm, s.norm_eps),
                      g("k_norm")))
        q_in, k_in = g("q_norm"), g("k_norm")
    steps.append(("rope_q", be.rope(q_in, s.n_heads, rows, s.rope), g("q_rope")))
    steps.append(("rope_k", be.rope(k_in, s.n_kv_heads, rows, s.rope), g("k_rope")[rows]))
    # Attention over all n keys/values; only the stored rows have llama.cpp's queries.
    q_all = np.zeros((n, g("q_rope").shape[1]), np.float32)
    q_all[rows] = g("q_rope")
    with m.new_sequence() as seq:
        m.kv.cache.reserve(seq.kv, n)  # blocks for positions 0..n-1
        group = m.kv.layer_group[layer]
        kv = KVBatch(m.kv.pages[layer], np.array([seq.kv.tables[group]], np.int32),
                     np.zeros(n, np.int32), m.kv.block_size)
        o = be.attention(q_all, g("k_rope"), g("v"), kv, np.arange(n), s.n_heads,
                         s.attn_scale, s.window)
    steps.append(("attention", np.asarray(o)[rows], g("attn")))
    steps.append(("wo", be.linear(g("attn"), [w.wo])[0], g("attn_out")))
    residual("attn", "x", "attn_out", w.post_attn_norm, "attn_post_norm", "ffn_inp")
    steps.append(("ffn_norm", be.rms_norm(g("ffn_inp"), w.ffn_norm, s.norm_eps), g("ffn_norm")))
    gate, up = be.linear(g("ffn_norm"), [w.w_gate, w.w_up])
    steps += [("w_gate", gate, g("gate")), ("w_up", up, g("up"))]
    steps.append((s.activation, be.glu(g("gate"), g("up"), s.activation), g("act")))
    if s.activation == "gelu_tanh":
        steps.append(("llama_cpp_geglu_table", llama_cpp_geglu(g("gate"), g("up")), g("act")))
    steps.append(("w_down", be.linear(g("act"), [w.w_down])[0], g("ffn_out")))
    residual("ffn", "ffn_inp", "ffn_out", w.post_ffn_norm, "ffn_post_norm", "l_out")
    return steps


CASES = [("smollm", 0), ("gemma", 0), ("gemma", 5)]


@pytest.mark.parametrize("name,layer", CASES)
def test_each_block_step_matches_llama_cpp(models, name, layer):
    fx = dict(np.load(FIXTURES / f"{name}_ops.npz"))
    assert layer in fx["layers"]
    m = models[name]
    passage = json.loads((FIXTURES.parent / "logits" / f"{name}_logits.json").read_text())
    assert fx["ids"].tolist() == m.tokenize(passage["passage"])[:len(fx["ids"])]
    errors = {step: rms_rel(ours, ref) for step, ours, ref in block_steps(m, fx, layer)}
    print(name, layer, " ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE.get(k, RMS_REL_MAX)}
    assert not bad, f"steps off llama.cpp by more than float rounding: {bad}"


def test_a_wrong_rope_base_is_caught(models):
    """The comparison is sharp enough to see a small change in the math."""
    import dataclasses
    m = models["gemma"]
    fx = dict(np.load(FIXTURES / "gemma_ops.npz"))
    s = m.net.layers[5].spec
    rope = dataclasses.replace(s.rope, theta=s.rope.theta * 1.01)
    ours = m.backend.rope(fx["5/k_norm"], s.n_kv_heads, fx["rows"], rope)
    assert rms_rel(ours, fx["5/k_rope"][fx["rows"]]) > 100 * RMS_REL_MAX
