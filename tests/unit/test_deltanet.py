"""The Gated DeltaNet kernels (kernels/deltanet.py) against a plain numpy reference, and
their batch invariance: a token's output and the states after it are bit identical however
the sequence's tokens were split into calls."""

import numpy as np
import pytest

from localllm.kernels import deltanet

HK, HV, S, K = 2, 4, 16, 4
C = (2 * HK + HV) * S
EPS = 1e-6


def inputs(T, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *shape, std=1.0: (std * rng.standard_normal(shape)).astype(np.float32)  # noqa
    return dict(qkv=f(T, C), alpha=f(T, HV), beta_in=f(T, HV), conv_w=f(C, K, std=0.5),
                dt_bias=f(HV, std=0.5) - 1, a=-np.exp(f(HV, std=0.3)))


def reference(qkv, alpha, beta_in, conv_w, dt_bias, a):
    """The mixer as the model card writes it, in float64: a causal conv over zero-padded
    inputs, SiLU, L2-normalised q and k, and the delta rule with S of (S_v, S_k)."""
    T = qkv.shape[0]
    x = np.concatenate([np.zeros((K - 1, C)), qkv.astype(np.float64)])
    conv = np.stack([(x[t:t + K].T * conv_w).sum(1) for t in range(T)])
    conv = conv / (1 + np.exp(-conv))
    kd = HK * S
    q = conv[:, :kd].reshape(T, HK, S)
    k = conv[:, kd:2 * kd].reshape(T, HK, S)
    v = conv[:, 2 * kd:].reshape(T, HV, S)
    q = q / np.sqrt((q ** 2).sum(-1, keepdims=True) + EPS)
    k = k / np.sqrt((k ** 2).sum(-1, keepdims=True) + EPS)
    g = np.log1p(np.exp(alpha + dt_bias)) * a
    beta = 1 / (1 + np.exp(-beta_in.astype(np.float64)))
    state = np.zeros((HV, S, S))
    out = np.zeros((T, HV, S))
    for t in range(T):
        for h in range(HV):
            kh, qh = k[t, h % HK], q[t, h % HK]
            state[h] *= np.exp(g[t, h])
            state[h] += beta[t, h] * np.outer(v[t, h] - state[h] @ kh, kh)
            out[t, h] = state[h] @ qh / np.sqrt(S)
    return out.reshape(T, HV * S), state


def run(x, splits):
    """The kernel over the tokens in calls of the given sizes."""
    window = np.zeros((K - 1, C), np.float32)
    state = np.zeros((HV, S, S), np.float32)
    outs, at = [], 0
    for n in splits:
        out = np.empty((n, HV * S), np.float32)
        deltanet.delta_net(x["qkv"][at:at + n], x["alpha"][at:at + n], x["beta_in"][at:at + n],
                           x["conv_w"], x["dt_bias"], x["a"], window, state, HK, S, EPS, out)
        outs.append(out)
        at += n
    return np.concatenate(outs), window, state


def test_matches_the_numpy_reference():
    x = inputs(40)
    out, window, state = run(x, [40])
    ref, ref_state = reference(**x)
    assert np.abs(out - ref).max() < 1e-4 * np.abs(ref).max()
    assert np.abs(state - ref_state).max() < 1e-4 * np.abs(ref_state).max()
    np.testing.assert_array_equal(window, x["qkv"][-(K - 1):])


@pytest.mark.parametrize("splits", [[1] * 23, [2, 1, 20], [5, 5, 5, 8], [22, 1]])
def test_chunking_is_bit_identical(splits):
    x = inputs(23, seed=1)
    whole = run(x, [23])
    parts = run(x, splits)
    for a, b in zip(whole, parts):
        np.testing.assert_array_equal(a, b)


def test_the_window_carries_the_previous_inputs():
    """Without the kept window a later call's first outputs differ (the conv would read
    zeros where the previous call's inputs were)."""
    x = inputs(12, seed=2)
    whole = run(x, [12])[0]
    window = np.zeros((K - 1, C), np.float32)
    state = np.zeros((HV, S, S), np.float32)
    first = np.empty((6, HV * S), np.float32)
    deltanet.delta_net(x["qkv"][:6], x["alpha"][:6], x["beta_in"][:6], x["conv_w"],
                       x["dt_bias"], x["a"], window, state, HK, S, EPS, first)
    window[:] = 0
    rest = np.empty((6, HV * S), np.float32)
    deltanet.delta_net(x["qkv"][6:], x["alpha"][6:], x["beta_in"][6:], x["conv_w"],
                       x["dt_bias"], x["a"], window, state, HK, S, EPS, rest)
    assert not np.array_equal(rest[0], whole[6])


def test_head_sizes_off_the_vector_width_are_refused():
    """The kernels sum in 16-lane vectors: a head size that is no multiple of 16 is an error,
    not a read past the row."""
    hk, hv, s = 1, 2, 24
    c = (2 * hk + hv) * s
    with pytest.raises(ValueError, match="multiple of 16"):
        deltanet.delta_net(np.zeros((2, c), np.float32), np.zeros((2, hv), np.float32),
                           np.zeros((2, hv), np.float32), np.zeros((c, K), np.float32),
                           np.zeros(hv, np.float32), np.zeros(hv, np.float32),
                           np.zeros((K - 1, c), np.float32), np.zeros((hv, s, s), np.float32),
                           hk, s, EPS, np.empty((2, hv * s), np.float32))
