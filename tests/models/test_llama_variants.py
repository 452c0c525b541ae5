"""Llama variants on the synthetic models that tests/models/test_synthetic.py checks against
llama.cpp: SmolLM3's NoPE layers (no RoPE on every fourth layer) and Mistral 3's attention
temperature, each shown to matter (the same weights without it are far from llama.cpp), the
torch and MLX backends (CPU builds standing in for CUDA and Metal), and prefix reuse across
chat turns."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import localllm
from localllm.models import smollm3
from localllm.testing import synthetic
from localllm.testing.compare import coarse_kl, log_softmax

FIXTURES = Path(__file__).parents[1] / "fixtures" / "synthetic"
MODELS = ["smollm3", "mistral3"]
BACKEND_TOP1_MIN = 0.97   # the GPU backends against llama.cpp (their own float rounding)
BACKEND_KL_MAX = 0.01


def load_fixture(name: str) -> dict:
    with np.load(FIXTURES / f"{name}.npz") as z:
        fx = {k: z[k] for k in z.files}
    return {**fx, **json.loads(str(fx.pop("info")))}


@pytest.fixture(scope="module")
def files(tmp_path_factory, metas):
    d = tmp_path_factory.mktemp("variants")
    return {name: synthetic.write(name, d / f"{name}.gguf", metas["smollm"]) for name in MODELS}


def agreement(m, fx) -> tuple[float, float]:
    lp = log_softmax(m.logits(fx["ids"].tolist()))
    return float((lp.argmax(1) == fx["argmax"]).mean()), float(coarse_kl(fx, lp).mean())


def test_every_fourth_layer_has_no_rope(files):
    m = localllm.load(files["smollm3"], ctx_size=1024, threads=2, weight_cache=False)
    n_rot = [la.spec.rope.n_rot for la in m.net.layers]
    m.close()
    assert n_rot == [64, 64, 64, 0, 64, 64, 64, 0]
    assert [smollm3.uses_rope(i) for i in range(8)] == [n > 0 for n in n_rot]


def test_rope_on_every_layer_is_far_from_llama_cpp(tmp_path, metas):
    """The same weights read as a llama file (RoPE everywhere) miss llama.cpp's SmolLM3
    logits by far: the reference tells the NoPE layers apart."""
    path = synthetic.write("smollm3", tmp_path / "as_llama.gguf", metas["smollm"], arch="llama")
    m = localllm.load(path, ctx_size=1024, threads=2, weight_cache=False)
    top1, kl = agreement(m, load_fixture("smollm3"))
    m.close()
    print(f"smollm3 weights with RoPE on every layer: top-1 {top1:.4f}, mean KL {kl:.3f}")
    assert top1 < 0.9 and kl > 0.1


def test_mistral3_queries_carry_the_temperature(files):
    m = localllm.load(files["mistral3"], ctx_size=1024, threads=2, weight_cache=False)
    specs = [la.spec for la in m.net.layers]
    m.close()
    assert all(s.q_rope.temp_scale == 0.5 and s.q_rope.temp_floor == 64 for s in specs)
    assert all(s.rope.temp_scale == 0 for s in specs)        # keys are not scaled


def test_no_attention_temperature_is_far_from_llama_cpp(tmp_path, metas):
    """The same weights without attention.temperature_scale miss llama.cpp's logits."""
    path = synthetic.write("mistral3", tmp_path / "no_temp.gguf", metas["smollm"], meta={})
    m = localllm.load(path, ctx_size=1024, threads=2, weight_cache=False)
    top1, kl = agreement(m, load_fixture("mistral3"))
    m.close()
    print(f"mistral3 weights without the attention temperature: top-1 {top1:.4f}, "
          f"mean KL {kl:.3f}")
    assert top1 < 0.95 and kl > 0.05


def test_mistral3_with_yarn_is_a_one_line_error(tmp_path, metas):
    from localllm.models import ModelError
    from gguf import GGUFValueType
    meta = {**synthetic.SPECS["mistral3"].meta,
            "rope.scaling.type": ("yarn", GGUFValueType.STRING),
            "rope.scaling.factor": (16.0, GGUFValueType.FLOAT32)}
    path = synthetic.write("mistral3", tmp_path / "yarn.gguf", metas["smollm"], meta=meta)
    with pytest.raises(ModelError) as err:
        localllm.load(path, ctx_size=64, threads=1, weight_cache=False)
    assert "'mistral3.rope.scaling.type' is 'yarn', not supported" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("backend", ["torch", "mlx"])
def test_gpu_backends_agree_with_llama_cpp(files, name, backend):
    pytest.importorskip({"torch": "torch", "mlx": "mlx.core"}[backend])
    m = localllm.load(files[name], ctx_size=1024, threads=2, backend=backend,
                      gpu_layers="all", weight_cache=False)
    assert m.plan.gpu_layers == m.args.n_layers
    top1, kl = agreement(m, load_fixture(name))
    m.close()
    print(f"{name} on {backend}: top-1 {top1:.4f}, mean KL {kl:.2e}")
    assert top1 >= BACKEND_TOP1_MIN and kl <= BACKEND_KL_MAX


@pytest.mark.parametrize("name", MODELS)
def test_prefix_reuse_across_turns(files, name):
    """A second turn runs only its new tokens and gives what a fresh run gives."""
    m = localllm.load(files[name], ctx_size=1024, threads=2, weight_cache=False)
    fx = load_fixture(name)
    first, more = fx["ids"][:150].tolist(), fx["ids"][150:200].tolist()
    seq = m.new_sequence()
    g = m.generate(first, seq=seq, temperature=0, max_tokens=20, ignore_eos=True)
    reply = [t for c in g for t in c.tokens]
    prompt = first + reply + more
    g = m.generate(prompt, seq=seq, temperature=0, max_tokens=20, ignore_eos=True)
    again = [t for c in g for t in c.tokens]
    # only the new text, and the reply's last token (sampled, never run)
    assert g.stats.prompt_tokens - g.stats.cached_tokens == len(more) + 1
    seq.release()
    m.forget_cached()
    scratch = m.generate(prompt, temperature=0, max_tokens=20, ignore_eos=True)
    assert scratch.stats.cached_tokens == 0
    assert [t for c in scratch for t in c.tokens] == again
    m.close()


@pytest.mark.parametrize("name", MODELS)
def test_logits_bit_identical_however_the_tokens_are_batched(files, name):
    """Also where blocks run composed (Mistral 3's query temperature) rather than fused."""
    m = localllm.load(files[name], ctx_size=1024, threads=2, weight_cache=False)
    ids = load_fixture(name)["ids"][:80].tolist()
    whole = m.logits(ids)
    for size in (1, 7):
        seq = m.new_sequence()
        parts = [seq.feed(ids[i:i + size], all_logits=True) for i in range(0, len(ids), size)]
        seq.release()
        assert np.array_equal(np.concatenate(parts).view(np.uint32), whole.view(np.uint32)), size
    m.close()
