"""Gemma 4 on its synthetic files (with per-layer token embeddings; without, with values
taken from the keys on full layers; with MoE layers; all with shared-KV layers): the
shared layers use the pages of the layer they read (no memory of their own), logits are
bit identical however the tokens are batched, the torch and MLX backends agree with the
CPU, and the files it cannot run are one-line errors. Agreement with llama.cpp (logits,
greedy tokens, token ids, `llm inspect` and `llm run`) is in tests/models/test_synthetic.py
(tests/models/test_moe.py for the MoE file)."""

import json
from pathlib import Path

import numpy as np
import pytest

import localllm
from localllm.testing import synthetic
from localllm.testing.compare import log_softmax
from support.backends import device_agreement

FIXTURES = Path(__file__).parents[1] / "fixtures" / "synthetic"
NAMES = ["gemma4", "gemma4_nople", "gemma4moe"]
FUSED = "gemma4moe_fused"   # the MoE file with fused gate/up experts and output scales
DEVICE_TOP1, DEVICE_KL = 0.95, 0.01   # torch and MLX (float activations) against the CPU


def load_case(case: str) -> dict:
    with np.load(FIXTURES / f"{case}.npz") as z:
        fx = {k: z[k] for k in z.files}
    return {**fx, **json.loads(str(fx.pop("info")))}


@pytest.fixture(scope="module")
def files(tmp_path_factory, metas):
    d = tmp_path_factory.mktemp("gemma4")
    return {name: synthetic.write(name, d / f"{name}.gguf", metas["smollm"])
            for name in NAMES + [FUSED]}


@pytest.fixture(scope="module")
def models(files):
    loaded = {}
    yield lambda name: loaded.setdefault(name, localllm.load(
        files[name], ctx_size=1024, threads=2, weight_cache=False))
    for m in loaded.values():
        m.close()


@pytest.mark.parametrize("name", NAMES)
def test_shared_layers_read_the_pages_of_their_source(models, name):
    m = models(name)
    spec = synthetic.ALL_SPECS[name]
    space = m._runner.space
    first = spec.n_layers - spec.shared_kv
    for layer in m.net.layers:
        i = layer.index
        if i < first:
            assert layer.spec.kv_source == -1
            continue
        # the last full layer with KV, or the sliding one before it
        src = first - 2 if spec.swa_layers[i] else first - 1
        assert spec.swa_layers[src] == spec.swa_layers[i]
        assert layer.spec.kv_source == src
        assert space.pages[i] is space.pages[src]
        assert space.layer_group[i] == space.layer_group[src]
    # one group per kind (sliding, full), holding only the layers with KV
    assert sorted(g.layers for g in space.kv_groups) == sorted(
        [tuple(i for i in range(first) if spec.swa_layers[i]),
         tuple(i for i in range(first) if not spec.swa_layers[i])])
    # bytes per token: the KV layers' keys and values (f16 pages) and no more
    kv_dims = sum(2 * spec.n_kv_heads * spec.layer_head_dim(i) for i in range(first))
    assert m.kv_stats().bytes_per_token == 2 * kv_dims
    # and `llm inspect` counts the same
    from localllm.formats.inspect import describe
    assert describe(m.file)["kv_bytes_per_1k"] == 1000 * 2 * kv_dims
    # and the memory plan sizes the pool by the same (not by every layer at the largest size)
    assert m.plan.devices[0].kv_per_token == 2 * kv_dims


@pytest.mark.parametrize("name", NAMES)
def test_logits_bit_identical_token_by_token_and_in_one_chunk(models, name):
    """Past the sliding window too (128): the passage's first 200 tokens."""
    m = models(name)
    ids = load_case(name)["ids"][:200].tolist()
    whole = m.logits(ids)
    for sizes in ([1] * len(ids), [5, 17, 1, 9, 100, 68]):
        seq = m.new_sequence()
        parts, pos = [], 0
        for size in sizes:
            parts.append(seq.feed(ids[pos:pos + size], all_logits=True))
            pos += size
        seq.release()
        chunked = np.concatenate(parts)
        assert np.array_equal(chunked.view(np.uint32), whole.view(np.uint32)), sizes[:5]


def test_two_sequences_in_one_step_are_each_what_they_are_alone(models):
    """The per-layer inputs and the shared layers' KV follow each token's own sequence."""
    m = models("gemma4")
    ids = load_case("gemma4")["ids"].tolist()
    a, b = ids[:40], ids[100:130]
    want_a, want_b = m.logits(a), m.logits(b)
    from localllm.runtime.sequence import StepItem
    sa, sb = m.new_sequence(), m.new_sequence()
    got = m.step([StepItem(sa, a, "all"), StepItem(sb, b, "all")])
    sa.release()
    sb.release()
    assert np.array_equal(np.asarray(got[0]).view(np.uint32), want_a.view(np.uint32))
    assert np.array_equal(np.asarray(got[1]).view(np.uint32), want_b.view(np.uint32))


@pytest.mark.parametrize("backend, name", [(b, n) for n in NAMES for b in ("torch", "mlx")]
                         + [("torch", FUSED)])
def test_device_backends_agree_with_the_cpu(files, models, backend, name):
    ids = load_case(name)["ids"].tolist()
    want = log_softmax(models(name).logits(ids))

    def check(m):
        assert all(la.backend is m.gpu_backend for la in m.net.layers)
    top1, kl = device_agreement(files[name], want, ids, backend, check)
    print(f"{name} on {backend}: top-1 {top1:.4f}, mean KL {kl:.2e}")
    assert top1 >= DEVICE_TOP1
    assert kl <= DEVICE_KL


def test_layers_split_between_backends_agree_with_the_cpu(files, models):
    """The shared layers on the device, the layers whose KV they read on the CPU."""
    name = "gemma4"
    ids = load_case(name)["ids"][:120].tolist()
    want = log_softmax(models(name).logits(ids))

    def check(m):
        homes = [la.backend.name for la in m.net.layers]
        assert homes[:3] == ["cpu"] * 3 and "cpu" not in homes[3:], homes
    top1, kl = device_agreement(files[name], want, ids, "torch", check, gpu_layers=3)
    assert top1 >= DEVICE_TOP1
    assert kl <= DEVICE_KL


def test_experts_kept_on_the_cpu_agree_with_the_cpu_backend(files, models):
    """Attention, norms and the dense FFN on the device, the experts (and their router) on
    the CPU."""
    name = "gemma4moe"
    ids = load_case(name)["ids"][:120].tolist()
    want = log_softmax(models(name).logits(ids))

    def check(m):
        for la in m.net.layers:
            assert la.backend is m.gpu_backend and la.weights.moe.backend.name == "cpu"
    top1, kl = device_agreement(files[name], want, ids, "torch", check, cpu_moe=True)
    assert top1 >= DEVICE_TOP1
    assert kl <= DEVICE_KL


@pytest.mark.parametrize("name, changes, drop, needle", [
    ("gemma4", {"shared_kv": 2}, (), "layer 4 shares the KV of layer 2, which is not sliding"),
    ("gemma4", {"shared_kv": 5}, (), "must leave at least two of the 6 layers with their own KV"),
    ("gemma4", {}, ("blk.0.attn_k.weight",), "tensor 'blk.0.attn_k.weight' is missing"),
    ("gemma4moe", {}, ("blk.1.ffn_gate_inp.scale",),
     "tensor 'blk.1.ffn_gate_inp.scale' is missing"),
])
def test_files_it_cannot_run_are_one_line_errors(tmp_path, metas, name, changes, drop, needle):
    from localllm.models import ModelError
    path = synthetic.write(name, tmp_path / "bad.gguf", metas["smollm"], drop, **changes)
    with pytest.raises(ModelError) as err:
        localllm.load(path, ctx_size=64, threads=1, weight_cache=False)
    assert needle in str(err.value) and "\n" not in str(err.value)
