"""Mixture-of-experts routing (kernels/moe.py) against a numpy reference, the CPU backend's
expert FFN against dequantized float math and against itself token by token, and the torch
and MLX backends' against the CPU's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from localllm.backends.base import MoESpec, MoEWeights
from localllm.backends.cpu import CpuBackend
from localllm.formats.dequant import dequantize
from localllm.kernels import moe as moe_k
from localllm.testing.kernel_data import random_weight
from support.backends import _backends, check, rnd

E, DIM, F = 6, 64, 256


def route(logits, k, gating="softmax", norm=False, scale=0.0):
    ids = np.empty((len(logits), k), np.int32)
    w = np.empty((len(logits), k), np.float32)
    moe_k.route(np.ascontiguousarray(logits, np.float32), k, moe_k.GATING[gating], norm,
                scale, ids, w)
    return ids, w


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm", [False, True])
def test_route_picks_the_top_k_with_their_weights(gating, norm):
    logits = rnd(np.random.default_rng(0), 50, E, scale=2.0)
    ids, w = route(logits, 3, gating, norm)
    z = logits.astype(np.float64)
    if gating == "softmax":
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
    else:
        p = 1 / (1 + np.exp(-z))
    want_ids = np.argsort(-p, axis=1, kind="stable")[:, :3]
    want = np.take_along_axis(p, want_ids, 1)
    if norm:
        want = want / want.sum(1, keepdims=True)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want, rtol=1e-5)


def test_route_softmax_weight_takes_top_k_logits_and_softmaxes_them():
    """gpt-oss: the k largest logits, weighted by a softmax over those k alone."""
    logits = rnd(np.random.default_rng(3), 50, E, scale=2.0)
    ids, w = route(logits, 4, "softmax_weight")
    want_ids = np.argsort(-logits.astype(np.float64), axis=1, kind="stable")[:, :4]
    z = np.take_along_axis(logits.astype(np.float64), want_ids, 1)
    want = np.exp(z - z.max(1, keepdims=True))
    want /= want.sum(1, keepdims=True)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want, rtol=1e-5)
    # not the full softmax's probabilities of those experts
    p = np.exp(logits - logits.max(1, keepdims=True))
    p = np.take_along_axis(p / p.sum(1, keepdims=True), want_ids, 1)
    assert np.abs(w - p).max() > 0.05


def swiglu_oai_ref(g, u, alpha=1.702, limit=7.0):
    x = np.minimum(g.astype(np.float64), limit)
    y = np.clip(u.astype(np.float64), -limit, limit)
    return x / (1 + np.exp(-alpha * x)) * (y + 1)


def test_swiglu_oai_clamps_as_ggml():
    rng = np.random.default_rng(8)
    g, u = rnd(rng, 7, 300, scale=6.0), rnd(rng, 7, 300, scale=6.0)
    out = CpuBackend().glu(g, u, "swiglu_oai")
    want = swiglu_oai_ref(g, u)
    assert (g > 7).any() and (np.abs(u) > 7).any()  # both clamps are exercised
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-6)


def test_route_ties_go_to_the_lower_expert_and_scale_applies():
    ids, w = route(np.zeros((1, E), np.float32), 2, scale=2.5)
    assert ids.tolist() == [[0, 1]]
    np.testing.assert_allclose(w, [[2.5 / E, 2.5 / E]], rtol=1e-6)


def test_combine_sums_slots_in_rank_order_and_gates_the_shared_expert():
    rng = np.random.default_rng(1)
    n, k = 5, 3
    y, wts, shared, gate = rnd(rng, n * k, DIM), rnd(rng, n, k), rnd(rng, n, DIM), rnd(rng, n)
    out = np.empty((n, DIM), np.float32)
    moe_k.combine(y, wts, shared, gate, out)
    y3 = y.reshape(n, k, DIM)
    want = y3[:, 0] * wts[:, :1]
    for j in range(1, k):
        want = want + y3[:, j] * wts[:, j:j + 1]
    sig = (np.float32(1) / (np.float32(1) + np.exp(-gate))).astype(np.float32)
    want = want + shared * sig[:, None]
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=1e-6)


def _layer(be, fmt="Q8_0", down_fmt="Q4_K", shared=True, seed=2, biases=False):
    """Random router, experts and shared expert uploaded to ``be``; also their float
    values for the reference. ``biases``: gpt-oss's router and expert biases too."""
    rng = np.random.default_rng(seed)
    bias = {"router": rnd(rng, E), "gate": rnd(rng, E, F), "up": rnd(rng, E, F),
            "down": rnd(rng, E, DIM, scale=0.1)}
    raws = {"gate": random_weight(fmt, E * F, DIM, rng), "up": random_weight(fmt, E * F, DIM, rng),
            "down": random_weight(down_fmt, E * DIM, F, rng)}
    router = (rng.standard_normal((E, DIM)) * 0.3).astype(np.float32)
    sh = {"gate": random_weight(fmt, F, DIM, rng), "up": random_weight(fmt, F, DIM, rng),
          "down": random_weight(fmt, DIM, F, rng)}
    gate_inp = (rng.standard_normal(DIM) * 0.2).astype(np.float32)
    w = MoEWeights(
        router=be.upload_matrix("r", "F32", router.view(np.uint8).reshape(-1), E, DIM),
        gate=be.upload_experts("g", fmt, raws["gate"], E, F, DIM),
        up=be.upload_experts("u", fmt, raws["up"], E, F, DIM),
        down=be.upload_experts("d", down_fmt, raws["down"], E, DIM, F),
        **({"shared_gate": be.upload_matrix("sg", fmt, sh["gate"], F, DIM),
            "shared_up": be.upload_matrix("su", fmt, sh["up"], F, DIM),
            "shared_down": be.upload_matrix("sd", fmt, sh["down"], DIM, F),
            "shared_gate_inp": be.upload_matrix("si", "F32", gate_inp.view(np.uint8), 1, DIM)}
           if shared else {}),
        **({"router_bias": be.upload_vector(bias["router"]),
            **{f"{k}_bias": tuple(be.upload_vector(r) for r in bias[k])
               for k in ("gate", "up", "down")}} if biases else {}))
    floats = {"router": router, "gate_inp": gate_inp,
              **({"b_" + k: v.astype(np.float64) for k, v in bias.items()} if biases else {}),
              **{k: dequantize(v, fmt if k != "down" else down_fmt,
                               (E * (DIM if k == "down" else F), F if k == "down" else DIM))
                 for k, v in raws.items()},
              **{"s" + k: dequantize(v, fmt, (DIM, F) if k == "down" else (F, DIM))
                 for k, v in sh.items()}}
    return w, floats


def _reference(x, f, spec, shared):
    """The layer in float64 from dequantized weights."""
    x = x.astype(np.float64)
    b = f.get("b_router", 0.0), f.get("b_gate"), f.get("b_up"), f.get("b_down")
    ids, wts = route(x @ f["router"].T.astype(np.float64) + b[0], spec.n_used, spec.gating,
                     spec.norm)
    silu = lambda a: a / (1 + np.exp(-a))  # noqa: E731
    act = swiglu_oai_ref if spec.activation == "swiglu_oai" else (lambda g, u: silu(g) * u)
    out = np.zeros_like(x)
    for t in range(len(x)):
        for j, e in enumerate(ids[t]):
            g = f["gate"][e * F:(e + 1) * F] @ x[t] + (0 if b[1] is None else b[1][e])
            u = f["up"][e * F:(e + 1) * F] @ x[t] + (0 if b[2] is None else b[2][e])
            y = f["down"][e * DIM:(e + 1) * DIM] @ act(g, u) + (0 if b[3] is None else b[3][e])
            out[t] += wts[t, j] * y
    if shared:
        s = (f["sdown"] @ (silu(f["sgate"] @ x.T) * (f["sup"] @ x.T))).T
        out += s / (1 + np.exp(-(x @ f["gate_inp"])))[:, None]
    return out


SPEC = MoESpec(E, 2, "softmax", True)
GPTOSS = MoESpec(E, 4, "softmax_weight", False, 0.0, "swiglu_oai")


@pytest.mark.parametrize("shared", [False, True])
def test_cpu_moe_ffn_matches_float_math(shared):
    cpu = CpuBackend()
    w, f = _layer(cpu, shared=shared)
    x = rnd(np.random.default_rng(4), 9, DIM)
    got = cpu.moe_ffn(x, w, SPEC)
    # two matmuls in a row on 8-bit activations (measured 3e-4)
    check(f"cpu moe_ffn shared={shared}", got, _reference(x, f, SPEC, shared), 1e-3)


def test_cpu_moe_ffn_with_gptoss_biases_and_routing_matches_float_math():
    cpu = CpuBackend()
    w, f = _layer(cpu, shared=False, biases=True)
    x = rnd(np.random.default_rng(4), 9, DIM)
    got = cpu.moe_ffn(x, w, GPTOSS)
    want = _reference(x, f, GPTOSS, False)
    check("cpu moe_ffn gpt-oss", got, want, 1e-3)
    nob = cpu.moe_ffn(x, dataclasses.replace(w, gate_bias=None), GPTOSS)
    assert np.abs(nob - want).max() > 10 * np.abs(got - want).max()  # the biases count


def test_cpu_moe_ffn_is_batch_invariant():
    """Each token alone gives the bits it gets among 40 others (which share its experts)."""
    cpu = CpuBackend()
    w, _ = _layer(cpu)
    x = rnd(np.random.default_rng(5), 40, DIM)
    whole = cpu.moe_ffn(x, w, SPEC)
    for t in (0, 17, 39):
        alone = cpu.moe_ffn(x[t:t + 1], w, SPEC)
        assert np.array_equal(alone.view(np.uint32), whole[t:t + 1].view(np.uint32))


@pytest.fixture(scope="module", params=_backends())
def be(request):
    return request.param()


def test_device_moe_ffn_agrees_with_the_cpu(be):
    cpu = CpuBackend()
    w_cpu, _ = _layer(cpu)
    w_dev, _ = _layer(be)
    x = rnd(np.random.default_rng(6), 12, DIM)
    want = cpu.moe_ffn(x, w_cpu, SPEC)
    got = be.to_numpy(be.moe_ffn(be.from_numpy(x), w_dev, SPEC))
    check(f"{be.name} moe_ffn", got, want, 5e-4)
    assert be.matrix_nbytes(w_dev.gate) == E * be.plan_matrix_nbytes("Q8_0", F, DIM)
    w_cpu, _ = _layer(cpu, shared=False, biases=True)
    w_dev, _ = _layer(be, shared=False, biases=True)
    want = cpu.moe_ffn(x, w_cpu, GPTOSS)
    got = be.to_numpy(be.moe_ffn(be.from_numpy(x), w_dev, GPTOSS))
    check(f"{be.name} moe_ffn gpt-oss", got, want, 5e-4)
