"""Float weights' matmul: the tile-pair path (many tokens, two tiles and six tokens a pass,
weights widened once) gives the same bits as one token at a time and as a float64-checked
plain sum, whatever the token count, the tiles' parity or the threads."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from localllm.kernels import matmul as M
from localllm.testing.kernel_data import FLOAT_FORMATS, assert_same_bits, random_weight


def reference_f32(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """x @ w.T as the kernels define it: float32 products added in k order, no FMA."""
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for k in range(x.shape[1]):
        acc = acc + np.multiply(x[:, k:k + 1], w[:, k][None, :], dtype=np.float32)
    return acc


def float_values(name: str, raw: np.ndarray, N: int, K: int) -> np.ndarray:
    if name == "F32":
        return raw.view(np.float32).reshape(N, K)
    if name == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(N, K)
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(N, K)


@pytest.mark.parametrize("name", sorted(FLOAT_FORMATS))
@pytest.mark.parametrize("N", [48, 64, 40])  # a pair and a lone tile; two pairs; padded rows
def test_tile_pairs_match_single_tokens_and_the_defined_sum(name, N):
    K = 96
    rng = np.random.default_rng(N)
    raw = random_weight(name, N, K, rng)
    w = M.pack(name, raw, N, K)
    x = rng.standard_normal((31, K)).astype(np.float32)  # 5 blocks of six, then a lone token
    ref = reference_f32(float_values(name, raw, N, K), x)
    for n in (11, 12, 13, 18, 31):  # below the pair threshold, at it, remainders
        y = M.matmul(w, x[:n])
        assert_same_bits(y, ref[:n], f"{name} N={N} n={n} against the defined sum")
        for t in (0, n // 2, n - 1):
            assert_same_bits(M.matmul(w, x[t:t + 1]), y[t:t + 1], f"{name} n={n} row {t} alone")


def test_tile_pairs_same_bits_on_one_thread_and_two():
    name, N, K = "F16", 96, 64
    rng = np.random.default_rng(1)
    w = M.pack(name, random_weight(name, N, K, rng), N, K)
    x = rng.standard_normal((40, K)).astype(np.float32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = M.matmul(w, x)
    finally:
        numba.set_num_threads(before)
    assert_same_bits(M.matmul(w, x), one, "threads")
