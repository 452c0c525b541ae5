"""Attention over paged KV caches in every KV type: stored values as each type's rounding
defines them (checked against gguf's quantizers and independent numpy encoders), accuracy
against a float64 reference over what is stored, bit-for-bit batch invariance (batch size,
positions, chunking, threads, other sequences in the batch, page placement, block size),
edge cases, the vector math it is built on, and the same bits on a generic compile target.
Run as a script (``python test_attention.py OUT.npz``) it saves the fixed ISA workload."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import gguf.quants
import numba
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType
from numba import njit

from localllm.kernels import attention as attn
from localllm.kernels import kvpages, simd, vmath
from support.kv_pages import CTX, E4M3, Cache

KV_TYPES = ("f16", "bf16", "fp8", "q8_0", "q4_0")


def reference(q, keys, vals, positions, window, scale, sinks=None):
    """Causal GQA attention with a sliding window in float64 over the stored keys/values;
    ``sinks``: per-head logits that join each softmax's denominator."""
    n, H, hd = q.shape
    G = H // keys.shape[0]
    out = np.zeros((n, H, hd))
    for t, p in enumerate(positions):
        lo = max(0, p - window + 1) if window > 0 else 0
        for h in range(H):
            s = keys[h // G, lo:p + 1] @ q[t, h].astype(np.float64) * scale
            m = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            e = np.exp(s - m)
            den = e.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
            out[t, h] = e @ vals[h // G, lo:p + 1] / den
    return out


def filled(n_kv, H, hd, n_pos, seed, spread=1.0, kind="f16", **cache_kw):
    """A cache holding random keys/values at positions 0..n_pos-1, and queries for them."""
    rng = np.random.default_rng(seed)
    c = Cache(kind, n_kv, hd, seed=seed, **cache_kw)
    k = rng.standard_normal((n_pos, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n_pos, n_kv, hd)).astype(np.float32)
    q = (rng.standard_normal((n_pos, H, hd)) * spread).astype(np.float32)
    c.write(k, v, np.arange(n_pos))
    return q, c, k, v


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


# ----------------------------------------------------------------------------- kv_write

def test_f16_rounds_like_numpy_including_specials():
    rng = np.random.default_rng(0)
    n, n_kv, hd = 40, 2, 40  # hd not a multiple of 16
    special = np.array([0.0, -0.0, 65504.0, 65519.99, 65520.0, -1e6, np.inf, -np.inf,
                        2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.0001, 3 * 2.0 ** -25, 2.0 ** -14,
                        2.0 ** -14 - 2.0 ** -25, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1e-30,
                        6.1e-5, -7.3e-6], np.float32)
    k = (rng.standard_normal((n, n_kv, hd)) * np.exp(rng.uniform(-18, 12, (n, n_kv, hd))))
    k = k.astype(np.float32)
    k.reshape(-1)[:special.size] = special
    v = k[::-1].copy()
    c = Cache("f16", n_kv, hd)
    pos = rng.permutation(CTX)[:n]
    c.write(k, v, pos)
    with np.errstate(over="ignore"):  # the values past half's range, on purpose
        k16, v16 = k.astype(np.float16), v.astype(np.float16)
    for t, p in enumerate(pos):
        for h in range(n_kv):
            np.testing.assert_array_equal(c.key(0, p, h), k16[t, h].astype(np.float64))
            np.testing.assert_array_equal(c.value(0, p, h), v16[t, h].astype(np.float64))


def test_nan_stays_nan_in_f16():
    c = Cache("f16", 1, 32)
    k = np.full((1, 1, 32), np.nan, np.float32)
    c.write(k, k, [5])
    assert np.isnan(c.key(0, 5, 0)).all() and np.isnan(c.value(0, 5, 0)).all()


def _nearest_even(x, values, codes):
    """Round each x to the nearest of ``values`` (ties to the even code)."""
    d = np.abs(x[:, None] - values[None, :])
    best = d.min(axis=1, keepdims=True)
    cand = np.where(d == best, codes[None, :], 1 << 20)
    even = np.where(cand % 2 == 0, cand, 1 << 20).min(axis=1)
    return np.where(even < 1 << 20, even, cand.min(axis=1))


def test_bf16_and_fp8_round_to_nearest_even():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(3000) * np.exp(rng.uniform(-12, 7, 3000)),
                        [0.0, 1e-9, 2.0 ** -9, 1.5 * 2.0 ** -9, 2.5 * 2.0 ** -9, 448.0, 460.0,
                         -500.0, 1e6, 2.0 ** -6, 1.0 + 1 / 16, 1.0 + 3 / 16]]).astype(np.float32)
    hd = 16
    x = x[:x.size // hd * hd]
    n = x.size // hd
    for kind in ("bf16", "fp8"):
        c = Cache(kind, 1, hd, ctx=-(-n // 16) * 16)
        c.write(x.reshape(n, 1, hd), x.reshape(n, 1, hd), np.arange(n))
        got = np.concatenate([c.key(0, p, 0) for p in range(n)])
        gotv = np.concatenate([c.value(0, p, 0) for p in range(n)])
        np.testing.assert_array_equal(got, gotv)
        if kind == "bf16":
            u = x.view(np.uint32).astype(np.uint64)
            want = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32)
            np.testing.assert_array_equal(got, want.view(np.float32).astype(np.float64))
        else:
            codes = np.arange(127)  # non-negative, finite
            clipped = np.clip(np.abs(x), 0, 448).astype(np.float64)
            mag = E4M3[_nearest_even(clipped, E4M3[codes], codes)]
            np.testing.assert_array_equal(np.abs(got), mag)
            assert (np.sign(got) == np.sign(x))[got != 0].all()


def test_quantized_types_store_ggml_blocks():
    """q8_0 keys and values hold exactly the blocks gguf's (llama.cpp's) quantizer makes;
    q4_0 holds q4_0 blocks whose scale is chosen for the least error: never worse than
    llama.cpp's rounding of the same block, and better on most."""
    rng = np.random.default_rng(2)
    n, n_kv, hd = 37, 2, 64
    k = (rng.standard_normal((n, n_kv, hd)) * rng.uniform(0.01, 30, (n, n_kv, 1))).astype(np.float32)
    k[3, 0, :32] = 0.0  # an all-zero block
    v = k[::-1].copy()
    deq = {}
    for kind, gtype in (("q8_0", GGMLQuantizationType.Q8_0), ("q4_0", GGMLQuantizationType.Q4_0)):
        deq[kind] = lambda a, g=gtype: gguf.quants.dequantize(gguf.quants.quantize(a, g), g)
    c8 = Cache("q8_0", n_kv, hd, bs=32)
    c8.write(k, v, np.arange(n))
    c4 = Cache("q4_0", n_kv, hd, bs=32)
    c4.write(k, v, np.arange(n))
    better = 0
    for t in range(n):
        for h in range(n_kv):
            np.testing.assert_array_equal(c8.key(0, t, h), deq["q8_0"](k[t, h][None])[0])
            np.testing.assert_array_equal(c8.value(0, t, h), deq["q8_0"](v[t, h][None])[0])
            row = c8._value_row(0, t, h)
            blocks = gguf.quants.quantize(v[t, h][None], GGMLQuantizationType.Q8_0)
            blocks = blocks.reshape(hd // 32, -1)
            np.testing.assert_array_equal(row[:-(hd // 16)], blocks[:, 2:].reshape(-1))
            np.testing.assert_array_equal(row[-(hd // 16):].reshape(-1, 2), blocks[:, :2])
            for got, x in ((c4.key(0, t, h), k[t, h]), (c4.value(0, t, h), v[t, h])):
                ours = ((got - x) ** 2).reshape(-1, 32).sum(1)
                ref = ((deq["q4_0"](x[None])[0] - x) ** 2).reshape(-1, 32).sum(1)
                assert (ours <= ref * (1 + 1e-6) + 1e-30).all()
                better += int((ours < ref * (1 - 1e-6)).sum())
    assert better > n * n_kv * 2  # most of the 4 * 74 blocks


def test_rotation_is_orthonormal_and_cuts_quantization_error():
    """q8_0/q4_0 store Hadamard-rotated vectors: attention is unchanged in exact arithmetic,
    and keys with outlier dims lose far less to the block scales."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((5, 3 * 64)).astype(np.float32)
    y = x.copy()
    kvpages.rotate_block(y, 3, 64)
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1), rtol=1e-6)
    kvpages.rotate_block(y, 3, 64)
    np.testing.assert_allclose(y, x, atol=1e-6)
    n, n_kv, H, hd = 200, 2, 4, 64
    q = rng.standard_normal((n, H * hd)).astype(np.float32)
    k = rng.standard_normal((n, n_kv * hd)).astype(np.float32)
    v = rng.standard_normal((n, n_kv * hd)).astype(np.float32)
    k[:, ::16] *= 20.0  # outlier channels, as real keys have
    pos = np.arange(n)
    keys, vals = k.reshape(n, n_kv, hd).transpose(1, 0, 2), v.reshape(n, n_kv, hd).transpose(1, 0, 2)
    want = reference(q.reshape(n, H, hd), keys.astype(np.float64), vals.astype(np.float64),
                     pos, 0, 0.05).reshape(n, -1)
    errs = {}
    for rotate in (False, True):
        c = Cache("q4_0", n_kv, hd)
        out = np.empty_like(q)
        if rotate:
            attn.paged_attention(q.copy(), k.copy(), v.copy(), c.K, c.V, c.tables,
                                 np.zeros(n, np.int32), 16, n_kv, pos, 0, 0.05, NO_BALANCE, NO_BALANCE, out)
        else:
            c.write(k.reshape(n, n_kv, hd), v.reshape(n, n_kv, hd), pos)
            out = c.attend(q.reshape(n, H, hd), pos, 0, 0.05).reshape(n, -1)
        errs[rotate] = np.abs(out - want).mean()
    assert errs[True] < 0.7 * errs[False], errs
    # f16 is stored as it is: paged_attention equals kv_write + attend there
    c1, c2 = Cache("f16", n_kv, hd), Cache("f16", n_kv, hd)
    out = np.empty_like(q)
    attn.paged_attention(q.copy(), k.copy(), v.copy(), c1.K, c1.V, c1.tables,
                         np.zeros(n, np.int32), 16, n_kv, pos, 0, 0.05, NO_BALANCE, NO_BALANCE, out)
    c2.write(k.reshape(n, n_kv, hd), v.reshape(n, n_kv, hd), pos)
    np.testing.assert_array_equal(bits(out.reshape(n, H, hd)),
                                  bits(c2.attend(q.reshape(n, H, hd), pos, 0, 0.05)))


NO_BALANCE = np.zeros(0, np.float32)


def test_key_balance_is_exact_powers_of_two_shared_by_rope_pairs():
    rng = np.random.default_rng(3)
    assert kvpages.key_balance(None, None, 64, True) is None
    gq = rng.uniform(0.5, 3, 64)
    gk = rng.uniform(0.5, 3, 64)
    gk[[3, 40]] = 20.0  # outlier key dims, as Gemma 3's k_norm has
    for neox, partner in ((True, lambda c: (c + 32) % 64), (False, lambda c: c ^ 1)):
        d = np.array(kvpages.key_balance(gq, gk, 64, neox))
        assert np.all(np.log2(d) == np.round(np.log2(d))) and d.min() >= 1 / 16 and d.max() <= 16
        assert all(d[c] == d[partner(c)] for c in range(64))  # RoPE mixes a pair's dims
        assert d[3] > np.median(d)
    # scaling by powers of two is exact both ways
    x = rng.standard_normal((5, 128)).astype(np.float32)
    y = x.copy()
    kvpages.balance_block(y, 2, 64, d.astype(np.float32), True)
    kvpages.balance_block(y, 2, 64, d.astype(np.float32), False)
    np.testing.assert_array_equal(y, x)


def test_key_balance_cuts_the_error_of_outlier_key_dims():
    rng = np.random.default_rng(4)
    n, H, n_kv, hd = 96, 4, 1, 64
    gq = rng.uniform(0.8, 1.5, hd)
    gk = rng.uniform(0.8, 1.5, hd)
    gk[[5, 37, 20, 52]] = 16.0
    q = (rng.standard_normal((n, H, hd)) * gq).astype(np.float32).reshape(n, -1)
    k = (rng.standard_normal((n, n_kv, hd)) * gk).astype(np.float32).reshape(n, -1)
    v = rng.standard_normal((n, n_kv * hd)).astype(np.float32)
    pos = np.arange(n, dtype=np.int64)
    want = reference(q.reshape(n, H, hd), k.reshape(n, n_kv, hd).transpose(1, 0, 2).astype(
        np.float64), v.reshape(n, n_kv, hd).transpose(1, 0, 2).astype(np.float64), pos, 0,
        0.12).reshape(n, -1)
    errs = []
    for bal in (NO_BALANCE, np.array(kvpages.key_balance(gq, gk, hd, True), np.float32)):
        c = Cache("q4_0", n_kv, hd)
        out = np.empty_like(q)
        attn.paged_attention(q.copy(), k.copy(), v.copy(), c.K, c.V, c.tables,
                             np.zeros(n, np.int32), 16, n_kv, pos, 0, 0.12, bal, NO_BALANCE,
                             out)
        errs.append(np.abs(out - want).mean())
    assert errs[1] < 0.85 * errs[0], errs  # 0.74x here; Gemma 3's keys gain far more


def test_bytes_per_token_of_each_type():
    per = {t: kvpages.k_group_nbytes(t, 64) / 16 + kvpages.v_row_nbytes(t, 64) for t in KV_TYPES}
    assert per["f16"] == 256
    assert per["q8_0"] / per["f16"] <= 0.55 and per["q4_0"] / per["f16"] <= 0.30
    assert per["fp8"] / per["f16"] == 0.5 and per["bf16"] == per["f16"]
    with pytest.raises(ValueError, match="multiple of 32"):
        kvpages.check_head_dim("q4_0", 40)


def test_rejects_bad_tables_positions_and_layouts():
    c = Cache("f16", 1, 16)
    k = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError):  # past the sequence's table
        c.write(k, k, [CTX])
    c.tables[0, 3] = -1  # a block not held
    with pytest.raises(ValueError):
        c.write(k, k, [50])
    with pytest.raises(ValueError):  # attending over it
        c.attend(np.zeros((1, 2, 16)), [70], 0, 1.0)
    c.attend(np.zeros((1, 2, 16)), [70], 6, 1.0)  # a window that skips it is fine
    with pytest.raises(ValueError):
        c.attend(np.zeros((1, 2, 16)), [-1], 0, 1.0)
    with pytest.raises(ValueError):  # a sequence row outside the tables
        c.attend(np.zeros((1, 2, 16)), [3], 0, 1.0, seqs=[1])
    with pytest.raises(ValueError):  # 3 query heads over 2 KV heads
        Cache("f16", 2, 16).attend(np.zeros((1, 3, 16)), [0], 0, 1.0)
    with pytest.raises(ValueError):  # a strided query array
        attn.attend(np.zeros((4, 2, 16), np.float32)[::2], c.K, c.V, c.tables,
                    np.zeros(2, np.int32), 16, 1, np.zeros(2, np.int64), 0, 1.0,
                    np.zeros(0, np.float32), np.zeros((2, 2, 16), np.float32))


def test_empty_batch():
    c = Cache("f16", 1, 16)
    empty = np.zeros((0, 1, 16), np.float32)
    c.write(empty, empty, np.zeros(0, np.int64))
    assert c.attend(np.zeros((0, 2, 16)), [], 0, 1.0).shape == (0, 2, 16)
    assert not c.K.a.any() and not c.V.a.any()


# ----------------------------------------------------------------------------- accuracy

@pytest.mark.parametrize("H,n_kv,hd,window,spread,kind", [
    (9, 3, 64, 0, 1.0, "f16"), (4, 1, 256, 0, 1.0, "f16"), (4, 1, 256, 32, 1.0, "f16"),
    (4, 4, 64, 100, 1.0, "f16"), (6, 2, 40, 0, 1.0, "f16"), (8, 2, 80, 17, 1.0, "f16"),
    (3, 1, 8, 0, 1.0, "f16"), (9, 3, 64, 0, 6.0, "f16"), (9, 3, 64, 0, 1.0, "bf16"),
    (4, 1, 256, 32, 1.0, "fp8"), (6, 2, 40, 7, 1.0, "fp8"), (9, 3, 64, 0, 3.0, "q8_0"),
    (4, 1, 256, 32, 1.0, "q4_0"), (4, 2, 96, 0, 1.0, "q8_0"),
])
def test_matches_float64_reference(H, n_kv, hd, window, spread, kind):
    n = 300
    q, c, _, _ = filled(n_kv, H, hd, n, seed=hd + H, spread=spread, kind=kind)
    keys, vals = c.stored(n)
    scale = 1.0 / np.sqrt(hd)
    pos = np.arange(n)
    out = c.attend(q, pos, window, scale)
    want = reference(q, keys, vals, pos, window, scale)
    err = np.abs(out - want).max() / np.abs(want).max()
    assert err < 1e-5, err
    # Decode at the last position too (the path that splits the keys between threads).
    one = c.attend(q[-1:], pos[-1:], window, scale)
    assert np.abs(one - want[-1:]).max() / np.abs(want[-1]).max() < 1e-5


@pytest.mark.parametrize("H,n_kv,hd,window,kind", [
    (8, 2, 64, 0, "f16"), (8, 2, 64, 128, "f16"), (6, 3, 96, 17, "q8_0"), (4, 1, 256, 0, "fp8")])
def test_sinks_match_float64_reference(H, n_kv, hd, window, kind):
    """gpt-oss's attention sinks: a per-head logit in the softmax's denominator. Sinks from
    far below to far above the scores; removing them changes the result."""
    n = 300
    q, c, _, _ = filled(n_kv, H, hd, n, seed=hd + H + 1, kind=kind)
    keys, vals = c.stored(n)
    scale = 1.0 / np.sqrt(hd)
    pos = np.arange(n)
    sinks = np.linspace(-6.0, 8.0, H).astype(np.float32)
    want = reference(q, keys, vals, pos, window, scale, sinks)
    for rows in (slice(None), slice(n - 1, n)):  # a prompt, and decode (keys split)
        out = c.attend(q[rows], pos[rows], window, scale, sinks=sinks)
        err = np.abs(out - want[rows]).max() / np.abs(want[rows]).max()
        assert err < 1e-5, err
    plain = c.attend(q, pos, window, scale)
    assert np.abs(plain - want).max() > 0.1 * np.abs(want).max()
    # sinks of -inf are no sinks, bit for bit
    none = c.attend(q, pos, window, scale, sinks=np.full(H, -np.inf, np.float32))
    np.testing.assert_array_equal(bits(none), bits(plain))


# ----------------------------------------------------------------------------- invariance

# (head_dim, query heads per KV head, window, KV heads, KV type): each batch size below takes
# its own path through the kernel (keys split between threads or not).
INVARIANCE_CASES = [(hd, G, window, 2 if G != 4 else 1, "f16")
                    for hd in (64, 256) for G in (1, 3, 4) for window in (0, 32)]
INVARIANCE_CASES += [(64, 1, 0, 4, "f16"), (256, 2, 32, 4, "f16")]
INVARIANCE_CASES += [(64, 3, 0, 3, t) for t in ("bf16", "fp8", "q8_0", "q4_0")]
INVARIANCE_CASES += [(256, 4, 32, 1, t) for t in ("fp8", "q8_0", "q4_0")]
# with attention sinks (gpt-oss: 8 query heads per KV head, windows of 128)
SINK_CASES = [(64, 8, 128, 1, "f16"), (64, 2, 0, 4, "q8_0")]


@pytest.mark.parametrize("hd,G,window,n_kv,kind,sinks",
                         [(*c, False) for c in INVARIANCE_CASES]
                         + [(*c, True) for c in SINK_CASES])
def test_batch_invariant_bits(hd, G, window, n_kv, kind, sinks):
    H = G * n_kv
    n = 300
    q, c, k, v = filled(n_kv, H, hd, n, seed=7 * hd + G + window, kind=kind)
    scale = 0.7 / np.sqrt(hd)
    pos = np.arange(n)
    sk = np.linspace(-2.0, 3.0, H).astype(np.float32) if sinks else None
    c.attend = functools.partial(c.attend, sinks=sk)
    full = c.attend(q, pos, window, scale)
    rng = np.random.default_rng(hd + G + window)
    # Arbitrary subsets of queries, in any order, computed alone or in small batches.
    for size in (1, 3, 17, 64):
        for _ in range(2):
            idx = rng.choice(n, size, replace=False)
            np.testing.assert_array_equal(bits(c.attend(q[idx], pos[idx], window, scale)),
                                          bits(full[idx]), err_msg=f"n={size}")
    # A prompt processed in chunks, each written just before its attention, into pages
    # placed differently: a chunk's own keys are read as stored, like a later step's.
    c2 = Cache(kind, n_kv, hd, seed=99)
    c2.attend = functools.partial(c2.attend, sinks=sk)
    out = np.empty_like(full)
    for a, b in ((0, 1), (1, 6), (6, 70), (70, 71), (71, 300)):
        c2.write(k[a:b], v[a:b], pos[a:b])
        out[a:b] = c2.attend(q[a:b], pos[a:b], window, scale)
    np.testing.assert_array_equal(bits(out), bits(full))


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_other_sequences_in_the_batch_and_block_size_do_not_change_bits(kind):
    """Sequences batched together each see only their own keys, with their own bits."""
    n_kv, H, hd, n = 2, 6, 64, 200
    rng = np.random.default_rng(4)
    ks = [rng.standard_normal((n, n_kv, hd)).astype(np.float32) for _ in range(3)]
    qs = [rng.standard_normal((n, H, hd)).astype(np.float32) for _ in range(3)]
    alone = []
    for i in range(3):
        c = Cache(kind, n_kv, hd, seed=i)
        c.write(ks[i], ks[i][::-1].copy(), np.arange(n))
        alone.append(c.attend(qs[i], np.arange(n), 0, 0.125))
    for bs in (16, 32, 64):
        c = Cache(kind, n_kv, hd, bs=bs, n_seqs=3, seed=bs)
        for i in range(3):
            c.write(ks[i], ks[i][::-1].copy(), np.arange(n), seq=i)
        # a mixed batch: seq 0 decoding, seq 1 a chunk, seq 2 one token in the middle
        pos = np.concatenate([[n - 1], np.arange(50, 90), [7]])
        seqs = np.concatenate([[0], np.ones(40, int), [2]])
        q = np.concatenate([qs[0][n - 1:], qs[1][50:90], qs[2][7:8]])
        out = c.attend(q, pos, 0, 0.125, seqs=seqs)
        np.testing.assert_array_equal(bits(out[0]), bits(alone[0][n - 1]))
        np.testing.assert_array_equal(bits(out[1:41]), bits(alone[1][50:90]))
        np.testing.assert_array_equal(bits(out[41]), bits(alone[2][7]))


@pytest.mark.parametrize("kind", ["f16", "q4_0"])
@pytest.mark.parametrize("G", [3, 2])
def test_pages_in_order_and_scattered_give_the_same_bits(kind, G):
    """Pages handed out in order (as the pool does), shifted, in runs that start below their
    block index or broken in the middle give the bits of pages placed at random: for whole
    prompts, chunks, windows and split decode items that start past block 0."""
    n_kv, hd, n = 2, 64, CTX
    H = G * n_kv
    rng = np.random.default_rng(30 + G)
    k = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    v = rng.standard_normal((n, n_kv, hd)).astype(np.float32)
    q = rng.standard_normal((n, H, hd)).astype(np.float32)
    nblk = n // 16
    scattered = Cache(kind, n_kv, hd)
    in_order = np.arange(nblk)
    low_run = np.concatenate([np.arange(nblk + 3 - 10, nblk + 3), np.arange(nblk - 10)])
    broken = in_order.copy()
    broken[[7, 12]] = broken[[12, 7]]
    decode = np.array([n - 1, 200, 17])
    for table in (in_order, in_order + 3, low_run, broken):
        c = Cache(kind, n_kv, hd)
        c.tables[0] = table
        for a, b in ((0, 150), (150, n)):
            c.write(k[a:b], v[a:b], np.arange(a, b))
            if table is in_order:
                scattered.write(k[a:b], v[a:b], np.arange(a, b))
        for window in (0, 100):
            for pos in (np.arange(n), np.arange(150, n)) + tuple(decode[i:i + 1] for i in range(3)):
                np.testing.assert_array_equal(
                    bits(c.attend(q[pos], pos, window, 0.125)),
                    bits(scattered.attend(q[pos], pos, window, 0.125)),
                    err_msg=f"table {table[:12]} window {window} pos {pos[:3]}")


def test_thread_count_does_not_change_bits():
    q, c, _, _ = filled(1, 4, 256, 300, seed=3)
    pos = np.arange(300)
    want = c.attend(q, pos, 0, 0.0625)
    want1 = c.attend(q[-1:], pos[-1:], 0, 0.0625)
    before = numba.get_num_threads()
    try:
        for threads in range(1, numba.config.NUMBA_NUM_THREADS + 1):
            numba.set_num_threads(threads)
            np.testing.assert_array_equal(bits(c.attend(q, pos, 0, 0.0625)), bits(want))
            np.testing.assert_array_equal(bits(c.attend(q[-1:], pos[-1:], 0, 0.0625)),
                                          bits(want1))
    finally:
        numba.set_num_threads(before)


# ----------------------------------------------------------------------------- edge cases

def test_position_zero_and_window_one_return_the_value_exactly():
    q, c, _, _ = filled(1, 3, 64, 40, seed=11)
    vals = c.stored(40)[1]
    out = c.attend(q[:1], [0], 0, 0.125)
    np.testing.assert_array_equal(out[0], np.broadcast_to(vals[0, 0], (3, 64)))
    pos = np.array([0, 5, 16, 39])
    out = c.attend(q[pos], pos, 1, 0.125)
    for t, p in enumerate(pos):
        np.testing.assert_array_equal(out[t], np.broadcast_to(vals[0, p], (3, 64)))


def test_window_larger_than_position_is_no_window():
    q, c, _, _ = filled(2, 4, 64, 200, seed=12)
    pos = np.arange(200)
    for window in (200, 201, 10_000):
        np.testing.assert_array_equal(bits(c.attend(q, pos, window, 0.125)),
                                      bits(c.attend(q, pos, 0, 0.125)))


def test_window_edges_follow_reference():
    q, c, _, _ = filled(1, 2, 16, 260, seed=13)
    keys, vals = c.stored(260)
    pos = np.array([0, 15, 16, 63, 64, 65, 127, 128, 200, 259])
    for window in (2, 15, 16, 17, 64, 65):
        out = c.attend(q[pos], pos, window, 0.25)
        want = reference(q[pos], keys, vals, pos, window, 0.25)
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


@njit(cache=True)
def _halves_widened(b, out):
    for i in range(b.size):
        out[i] = vmath.f16_bits_to_f32(b[i])


def test_scalar_half_widening_is_exact_for_every_pattern():
    """The scalar half -> float32 widening (q4_0's scale search) against numpy, all 65,536
    bit patterns: finite ones bit for bit, NaNs still NaN."""
    b = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(b.size, np.float32)
    _halves_widened(b, out)
    ref = b.view(np.float16).astype(np.float32)
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(bits(out[fin]), bits(ref[fin]))
    assert np.isnan(out[np.isnan(ref)]).all()


@njit(cache=True)
def _half_columns(x, tile, rows):
    """x (16 k floats) rounded to half twice: 32-byte rows as vf_store_f16 writes them, and
    the same vectors as columns of a (16, 16 k) u16 tile (byte stride 32 k)."""
    k = x.size // 16
    for i in range(k):
        v = simd.vf_load(x, i * 64)
        vmath.vf_store_f16(rows, i * 32, v)
        vmath.vf_store_f16_strided(tile, i * 2, 2 * k, v)
    simd.store_u16(tile, 0, np.int64(0x1ABCD))  # low 16 bits only, 2 bytes


def test_strided_half_store_writes_the_columns_of_the_rows():
    """vf_store_f16_strided (how f16 keys go into their transposed key groups) stores the
    bits vf_store_f16 stores, element i at offset + i * stride, and nothing between."""
    rng = np.random.default_rng(8)
    k = 5
    x = np.concatenate([rng.standard_normal(16 * k - 4) * 1e3, [np.inf, -0.0, 7e4, 1e-6]])
    x = x.astype(np.float32)
    tile = np.full(16 * k, 0x7E7E, np.uint16).view(np.uint8)
    rows = np.empty(16 * k, np.uint16)
    _half_columns(x, tile, rows)
    got = tile.view(np.uint16).reshape(16, k)
    want = rows.reshape(k, 16).T.copy()
    want[0, 0] = 0xABCD
    np.testing.assert_array_equal(got, want)
    with np.errstate(over="ignore"):  # 7e4 rounds to inf in half, on purpose
        ref = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(rows, ref)


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
    """A fixed workload through every path: fold and split, tails, window, KV types; plus
    vmath."""
    res = {}
    for H, n_kv, hd, window, kind in ((9, 3, 64, 0, "f16"), (4, 1, 256, 32, "f16"),
                                      (3, 3, 40, 5, "f16"), (4, 2, 64, 0, "q8_0"),
                                      (4, 1, 256, 32, "q4_0"), (3, 3, 40, 0, "fp8"),
                                      (4, 2, 64, 0, "bf16")):
        q, c, _, _ = filled(n_kv, H, hd, 300, seed=hd, kind=kind)
        pos = np.arange(300)
        res[f"prefill-{hd}-{kind}"] = c.attend(q, pos, window, 0.2)
        res[f"decode-{hd}-{kind}"] = c.attend(q[-3:], pos[-3:], window, 0.2)
        res[f"cache-{hd}-{kind}"] = np.concatenate([c.K.a, c.V.a])
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
    # Run as a script, this file finds tests/support/ through the path (as pytest finds it).
    tests_dir = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, env.get("PYTHONPATH")]))
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
    from localllm import configure_process
    configure_process()  # compile into NUMBA_CACHE_DIR's kernel cache
    np.savez(sys.argv[1], isa=simd.ISA, **isa_workload())
