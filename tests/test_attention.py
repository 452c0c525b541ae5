"""Attention over the half KV cache: accuracy against a float64 reference, bit-for-bit batch
invariance (batch size, positions, chunking, threads), edge cases, the vector math it is built
on, and the same bits on a generic (non-x86-specific) compile target.
Run as a script (``python test_attention.py OUT.npz``) it saves the fixed ISA workload."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from numba import njit

from localllm.kernels import attention as attn
from localllm.kernels import simd, vmath

CTX = 320  # cache capacity in the tests (a multiple of 16)


def new_cache(n_kv, hd, ctx=CTX):
    return (np.zeros((n_kv, ctx // 16, hd, 16), np.uint16), np.zeros((n_kv, ctx, hd), np.uint16))


def cache_as_f64(K, V):
    """(n_kv, ctx, hd) float64 keys and values as the cache holds them."""
    n_kv, nb, hd, _ = K.shape
    keys = K.view(np.float16).transpose(0, 1, 3, 2).reshape(n_kv, nb * 16, hd)
    return keys.astype(np.float64), V.view(np.float16).astype(np.float64)


def reference(q, K, V, positions, window, scale):
    """Causal GQA attention with a sliding window in float64 over the cache's keys/values."""
    keys, vals = cache_as_f64(K, V)
    n, H, hd = q.shape
    G = H // K.shape[0]
    out = np.zeros((n, H, hd))
    for t, p in enumerate(positions):
        lo = max(0, p - window + 1) if window > 0 else 0
        for h in range(H):
            s = keys[h // G, lo:p + 1] @ q[t, h].astype(np.float64) * scale
            e = np.exp(s - s.max())
            out[t, h] = e @ vals[h // G, lo:p + 1] / e.sum()
    return out


def filled(n_kv, H, hd, n_pos, seed, spread=1.0):
    """A cache holding random keys/values at positions 0..n_pos-1, and queries for them."""
    rng = np.random.default_rng(seed)
    K, V = new_cache(n_kv, hd)
    k = rng.standard_normal((n_pos, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_pos, n_kv, hd)).astype(np.float32)
    q = (rng.standard_normal((n_pos, H, hd)) * spread).astype(np.float32)
    attn.kv_write(K, V, k, v, np.arange(n_pos, dtype=np.int64))
    return q, K, V


def attend(q, K, V, positions, window, scale):
    q = np.ascontiguousarray(q)
    out = np.empty_like(q)
    attn.attend(q, K, V, np.asarray(positions, np.int64), window, scale, out)
    return out


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


# ----------------------------------------------------------------------------- kv_write

def test_kv_write_rounds_like_numpy_and_lays_out_keys():
    rng = np.random.default_rng(0)
    n, n_kv, hd = 40, 2, 40  # hd not a multiple of 16: the scalar tail too
    special = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, -1e6, np.inf, -np.inf,
                        2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.0001, 3 * 2.0 ** -25, 2.0 ** -14,
                        2.0 ** -14 - 2.0 ** -25, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1e-30,
                        6.1e-5, -7.3e-6], np.float32)
    k = (rng.standard_normal((n, n_kv, hd)) * np.exp(rng.uniform(-18, 12, (n, n_kv, hd))))
    k = k.astype(np.float32)
    k.reshape(-1)[:special.size] = special
    v = k[::-1].copy()
    K, V = new_cache(n_kv, hd)
    pos = rng.permutation(CTX)[:n].astype(np.int64)
    attn.kv_write(K, V, k, v, pos)
    with np.errstate(over="ignore"):  # the values past half's range, on purpose
        k16, v16 = k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
    for t, p in enumerate(pos):
        np.testing.assert_array_equal(K[:, p // 16, :, p % 16], k16[t])
        np.testing.assert_array_equal(V[:, p], v16[t])


def test_kv_write_nan_stays_nan():
    K, V = new_cache(1, 32)
    k = np.full((1, 1, 32), np.nan, np.float32)
    attn.kv_write(K, V, k, k, np.array([5]))
    assert np.isnan(K[0, 0, :, 5].view(np.float16)).all()
    assert np.isnan(V[0, 5].view(np.float16)).all()


def test_rejects_bad_positions_and_layouts():
    K, V = new_cache(1, 16)
    k = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError):
        attn.kv_write(K, V, k, k, np.array([CTX]))
    with pytest.raises(ValueError):
        attend(np.zeros((1, 2, 16), np.float32), K, V, [-1], 0, 1.0)
    with pytest.raises(ValueError):  # 3 query heads over 2 KV heads
        attend(np.zeros((1, 3, 16), np.float32), *new_cache(2, 16), [0], 0, 1.0)
    with pytest.raises(ValueError):  # a strided query array
        attn.attend(np.zeros((4, 2, 16), np.float32)[::2], K, V, np.zeros(2, np.int64), 0, 1.0,
                    np.zeros((2, 2, 16), np.float32))


def test_empty_batch():
    K, V = new_cache(1, 16)
    empty = np.zeros((0, 1, 16), np.float32)
    attn.kv_write(K, V, empty, empty, np.zeros(0, np.int64))
    assert attend(np.zeros((0, 2, 16), np.float32), K, V, [], 0, 1.0).shape == (0, 2, 16)
    assert not K.any() and not V.any()


# ----------------------------------------------------------------------------- accuracy

@pytest.mark.parametrize("H,n_kv,hd,window,spread", [
    (9, 3, 64, 0, 1.0), (4, 1, 256, 0, 1.0), (4, 1, 256, 32, 1.0), (4, 4, 64, 100, 1.0),
    (6, 2, 40, 0, 1.0), (8, 2, 80, 17, 1.0), (3, 1, 8, 0, 1.0), (9, 3, 64, 0, 6.0),
])
def test_matches_float64_reference(H, n_kv, hd, window, spread):
    n = 300
    q, K, V = filled(n_kv, H, hd, n, seed=hd + H, spread=spread)
    scale = 1.0 / np.sqrt(hd)
    pos = np.arange(n)
    out = attend(q, K, V, pos, window, scale)
    want = reference(q, K, V, pos, window, scale)
    err = np.abs(out - want).max() / np.abs(want).max()
    assert err < 1e-5, err
    # Decode at the last position too (the path that splits the keys between threads).
    one = attend(q[-1:], K, V, pos[-1:], window, scale)
    assert np.abs(one - want[-1:]).max() / np.abs(want[-1]).max() < 1e-5


# ----------------------------------------------------------------------------- invariance

# (head_dim, query heads per KV head, window, KV heads): each batch size below takes its own
# path through the kernel (keys split between threads or not, float32 copy or half reads).
INVARIANCE_CASES = [(hd, G, window, 2 if G != 4 else 1)
                    for hd in (64, 256) for G in (1, 3, 4) for window in (0, 32)]
INVARIANCE_CASES += [(64, 1, 0, 4), (256, 2, 32, 4)]


@pytest.mark.parametrize("hd,G,window,n_kv", INVARIANCE_CASES)
def test_batch_invariant_bits(hd, G, window, n_kv):
    H = G * n_kv
    n = 300
    q, K, V = filled(n_kv, H, hd, n, seed=7 * hd + G + window)
    scale = 0.7 / np.sqrt(hd)
    pos = np.arange(n)
    full = attend(q, K, V, pos, window, scale)
    rng = np.random.default_rng(hd + G + window)
    # Arbitrary subsets of queries, in any order, computed alone or in small batches.
    for size in (1, 3, 17, 64):
        for _ in range(2):
            idx = rng.choice(n, size, replace=False)
            np.testing.assert_array_equal(bits(attend(q[idx], K, V, pos[idx], window, scale)),
                                          bits(full[idx]), err_msg=f"n={size}")
    # A prompt processed in chunks, each written to a fresh cache just before its attention.
    K2, V2 = new_cache(n_kv, hd)
    keys, vals = cache_as_f64(K, V)
    out = np.empty_like(full)
    for a, b in ((0, 1), (1, 6), (6, 70), (70, 71), (71, 300)):
        k = keys[:, a:b].transpose(1, 0, 2).astype(np.float32).copy()
        v = vals[:, a:b].transpose(1, 0, 2).astype(np.float32).copy()
        attn.kv_write(K2, V2, k, v, pos[a:b])
        out[a:b] = attend(q[a:b], K2, V2, pos[a:b], window, scale)
    np.testing.assert_array_equal(bits(out), bits(full))


def test_thread_count_does_not_change_bits():
    q, K, V = filled(1, 4, 256, 300, seed=3)
    pos = np.arange(300)
    want = attend(q, K, V, pos, 0, 0.0625)
    want1 = attend(q[-1:], K, V, pos[-1:], 0, 0.0625)
    before = numba.get_num_threads()
    try:
        for threads in range(1, numba.config.NUMBA_NUM_THREADS + 1):
            numba.set_num_threads(threads)
            np.testing.assert_array_equal(bits(attend(q, K, V, pos, 0, 0.0625)), bits(want))
            np.testing.assert_array_equal(bits(attend(q[-1:], K, V, pos[-1:], 0, 0.0625)),
                                          bits(want1))
    finally:
        numba.set_num_threads(before)


# ----------------------------------------------------------------------------- edge cases

def test_position_zero_and_window_one_return_the_value_exactly():
    q, K, V = filled(1, 3, 64, 40, seed=11)
    vals = cache_as_f64(K, V)[1]
    out = attend(q[:1], K, V, [0], 0, 0.125)
    np.testing.assert_array_equal(out[0], np.broadcast_to(vals[0, 0], (3, 64)))
    pos = np.array([0, 5, 16, 39])
    out = attend(q[pos], K, V, pos, 1, 0.125)
    for t, p in enumerate(pos):
        np.testing.assert_array_equal(out[t], np.broadcast_to(vals[0, p], (3, 64)))


def test_window_larger_than_position_is_no_window():
    q, K, V = filled(2, 4, 64, 200, seed=12)
    pos = np.arange(200)
    for window in (200, 201, 10_000):
        np.testing.assert_array_equal(bits(attend(q, K, V, pos, window, 0.125)),
                                      bits(attend(q, K, V, pos, 0, 0.125)))


def test_window_edges_follow_reference():
    q, K, V = filled(1, 2, 16, 260, seed=13)
    pos = np.array([0, 15, 16, 63, 64, 65, 127, 128, 200, 259])
    for window in (2, 15, 16, 17, 64, 65):
        out = attend(q[pos], K, V, pos, window, 0.25)
        want = reference(q[pos], K, V, pos, window, 0.25)
        assert np.abs(out - want).max() / np.abs(want).max() < 1e-5, window


# ----------------------------------------------------------------------------- vector math

@njit(cache=True)
def _vmath_lanes(x, out):
    """Per 16 inputs: exp2, the scalar exp2 of each, hsum, hmax."""
    for i in range(0, x.size, 16):
        v = simd.vf_load(x, i * 4)
        simd.vf_store(out, i * 4, vmath.vf_exp2(v))
        for j in range(16):
            out[x.size + i + j] = vmath.f32_exp2(x[i + j])
        out[2 * x.size + i // 16] = vmath.vf_hsum(v)
        out[2 * x.size + x.size // 16 + i // 16] = vmath.vf_hmax(v)


def test_exp2_accuracy_and_scalar_matches_vector():
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.uniform(-125, 0, 4096), rng.uniform(-1, 0, 4096),
                        [0.0, -0.0, -125.0, -125.5, -np.inf, -1e30, -0.5, -1.5] + [-3.0] * 8])
    x = x.astype(np.float32)
    out = np.empty(2 * x.size + 2 * (x.size // 16), np.float32)
    _vmath_lanes(x, out)
    e, es = out[:x.size], out[x.size:2 * x.size]
    np.testing.assert_array_equal(bits(e), bits(es))
    ok = x >= -125  # results stay normal floats
    assert np.abs(e[ok] / np.exp2(x[ok].astype(np.float64)) - 1).max() < 1.5e-7
    assert (e[x < -126] == np.float32(2.0 ** -126)).all() and e[x == 0].tolist() == [1.0, 1.0]
    sums = out[2 * x.size:2 * x.size + x.size // 16]
    lanes = x[:4096].reshape(-1, 16)
    tree = lanes[:, :8] + lanes[:, 8:]
    tree = tree[:, :4] + tree[:, 4:]
    tree = tree[:, :2] + tree[:, 2:]
    np.testing.assert_array_equal(sums[:256], tree[:, 0] + tree[:, 1])
    np.testing.assert_array_equal(out[2 * x.size + x.size // 16:][:256], lanes.max(axis=1))


# ----------------------------------------------------------------------------- ISA

def isa_workload() -> dict[str, np.ndarray]:
    """A fixed workload through every path: fold and split, tails, window; plus vmath."""
    res = {}
    for H, n_kv, hd, window in ((9, 3, 64, 0), (4, 1, 256, 32), (3, 3, 40, 5)):
        q, K, V = filled(n_kv, H, hd, 300, seed=hd)
        pos = np.arange(300)
        res[f"prefill-{hd}"] = attend(q, K, V, pos, window, 0.2)
        res[f"decode-{hd}"] = attend(q[-3:], K, V, pos[-3:], window, 0.2)
        res[f"cache-{hd}"] = np.concatenate([K.reshape(-1), V.reshape(-1)])
    x = np.random.default_rng(1).uniform(-130, 0, 1024).astype(np.float32)
    out = np.empty(2 * x.size + 2 * (x.size // 16), np.float32)
    _vmath_lanes(x, out)
    res["vmath"] = out
    return res


def generic_cache_dir() -> Path:
    """Numba cache for the generic target, one per version of the kernel sources (Numba only
    notices edits to a jitted function's own file, not to the intrinsics it inlines)."""
    digest = hashlib.sha256()
    for src in sorted(Path(simd.__file__).parent.glob("*.py")):
        digest.update(src.name.encode() + b"\0" + src.read_bytes())
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "localllm" / "test-numba" / "attn-generic" / digest.hexdigest()[:16]


def test_generic_target_gives_identical_bits(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    env["NUMBA_CPU_NAME"] = "generic"
    env["NUMBA_CACHE_DIR"] = str(generic_cache_dir())
    out = tmp_path / "generic.npz"
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = isa_workload()
    with np.load(out) as got:
        assert str(got["isa"]) == "generic"
        for key, value in want.items():
            np.testing.assert_array_equal(got[key].view(np.uint8), value.view(np.uint8),
                                          err_msg=key)


if __name__ == "__main__":
    np.savez(sys.argv[1], isa=simd.ISA, **isa_workload())
