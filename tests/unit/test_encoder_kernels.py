"""The encoder kernels (kernels/encoder.py) against numpy: LayerNorm, GELU/tanh, and
bidirectional attention per sequence, whose rows do not depend on the other sequences."""

import numpy as np

from localllm.backends.cpu import CpuBackend


def _attention_ref(q, k, v, starts, n_heads, scale):
    n, hd = q.shape[0], q.shape[1] // n_heads
    n_kv = k.shape[1] // hd
    out = np.zeros_like(q, dtype=np.float64)
    for a, b in zip(starts[:-1], starts[1:]):
        for h in range(n_heads):
            kh = h // (n_heads // n_kv)
            qs = q[a:b, h * hd:(h + 1) * hd].astype(np.float64)
            ks = k[a:b, kh * hd:(kh + 1) * hd].astype(np.float64)
            vs = v[a:b, kh * hd:(kh + 1) * hd].astype(np.float64)
            s = qs @ ks.T * scale
            p = np.exp(s - s.max(1, keepdims=True))
            out[a:b, h * hd:(h + 1) * hd] = (p / p.sum(1, keepdims=True)) @ vs
    return out


def test_layer_norm_and_activations_match_numpy():
    be = CpuBackend()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, 200)).astype(np.float32) * 3 + 1
    w, b = rng.standard_normal(200).astype(np.float32), rng.standard_normal(200).astype(np.float32)
    xd = x.astype(np.float64)
    ref = (xd - xd.mean(1, keepdims=True)) / np.sqrt(xd.var(1, keepdims=True) + 1e-12) * w + b
    np.testing.assert_allclose(be.layer_norm(x, w, b, 1e-12), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(be.layer_norm(x, w, None, 1e-12), ref - b, rtol=1e-5, atol=1e-5)
    gelu = 0.5 * xd * (1 + np.tanh(np.sqrt(2 / np.pi) * (xd + 0.044715 * xd ** 3)))
    np.testing.assert_allclose(be.act(x, "gelu_tanh"), gelu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(be.act(x, "tanh"), np.tanh(xd), rtol=1e-6, atol=1e-7)


def test_encoder_attention_matches_numpy_for_uneven_heads_and_sequences():
    be = CpuBackend()
    rng = np.random.default_rng(2)
    for hd, n_heads, n_kv in ((64, 4, 4), (40, 6, 2)):
        starts = [0, 1, 18, 53]
        n = starts[-1]
        q = rng.standard_normal((n, n_heads * hd)).astype(np.float32)
        k = rng.standard_normal((n, n_kv * hd)).astype(np.float32)
        v = rng.standard_normal((n, n_kv * hd)).astype(np.float32)
        got = be.encoder_attention(q, k, v, starts, n_heads, 1 / np.sqrt(hd))
        want = _attention_ref(q, k, v, starts, n_heads, 1 / np.sqrt(hd))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
        # The last sequence alone gives the same bits as within the batch.
        alone = be.encoder_attention(q[18:], k[18:], v[18:], [0, 35], n_heads, 1 / np.sqrt(hd))
        np.testing.assert_array_equal(alone, got[18:])
