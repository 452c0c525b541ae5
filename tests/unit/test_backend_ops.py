"""Backend parity, in the manner of llama.cpp's test-backend-ops: every operation the torch and
MLX backends implement, on random data, against the CPU backend, each at a stated tolerance
(normalized mean squared error, NMSE = |a - b|^2 / |b|^2). Also: the torch dequantizers and the
MLX exact mappings equal the numpy reference bit for bit, and every KV type stores the CPU
backend's values exactly."""

from __future__ import annotations

import numpy as np
import pytest

from localllm.testing.kernel_data import FORMATS, random_weight
from localllm.backends.base import KVLayout, KVBatch, RopeSpec
from localllm.backends.cpu import CpuBackend
from localllm.formats.dequant import dequantize
from localllm.kernels import attention as attn
from localllm.formats.quants import row_nbytes
from support.backends import (TOL_ATTENTION, TOL_CONVERTED, TOL_FLOAT_OP, TOL_LINEAR, _backends,
                              check, rnd, run)
from support.kv_pages import Cache

KV_TYPES = ("f16", "bf16", "fp8", "q8_0", "q4_0")
@pytest.fixture(scope="module", params=_backends())
def be(request):
    return request.param()


@pytest.fixture(scope="module")
def cpu():
    return CpuBackend()


# ---------------------------------------------------------------------------- weights

@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_dequantizers_equal_the_reference_bit_for_bit(fmt):
    torch = pytest.importorskip("torch")
    from localllm.backends.torch_quant import dequantize_rows
    N, K = 24, 768
    raw = random_weight(fmt, N, K, np.random.default_rng(1))
    got = dequantize_rows(torch.from_numpy(raw.reshape(N, -1).copy()), fmt, K).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), dequantize(raw, fmt, (N, K)).view(np.uint32))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"])
def test_mlx_exact_mappings_round_trip_bit_for_bit(fmt):
    mx = pytest.importorskip("mlx.core")
    from localllm.backends import mlx_quant
    from localllm.backends.mlx import convert, dequantize as mlx_dequantize
    assert fmt in mlx_quant.EXACT
    N, K = 40, 1024
    rng = np.random.default_rng(2)
    raw = random_weight(fmt, N, K, rng)
    w = convert(raw, fmt, N, K)
    ref = dequantize(raw, fmt, (N, K))
    np.testing.assert_array_equal(np.array(mlx_dequantize(w)).view(np.uint32),
                                  ref.view(np.uint32))
    if fmt in ("Q4_K", "Q5_K"):
        # The condition for exactness: d * sc needs more bits than a float16 scale has.
        half = mx.dequantize(w.wq, w.scales.astype(mx.float16), w.biases.astype(mx.float16),
                             group_size=32, bits=w.bits)
        assert not np.array_equal(np.array(half.astype(mx.float32)), ref)


def test_mlx_mxfp4_mode_round_trips_bit_for_bit():
    """MXFP4 goes into MLX's own mxfp4 mode unchanged: the same codes and E8M0 bytes."""
    mx = pytest.importorskip("mlx.core")
    from localllm.backends.mlx import convert, dequantize as mlx_dequantize
    N, K = 40, 1024
    raw = random_weight("MXFP4", N, K, np.random.default_rng(2))
    blocks = raw.reshape(-1, 17)
    # Every E8M0 byte but 255 (MLX reads it as inf, ggml as 2**127; no quantizer writes it:
    # it needs a block maximum of 2**130), the subnormal scales 0 and 1 included.
    blocks[:, 0] = np.arange(blocks.shape[0]) % 255
    w = convert(raw, "MXFP4", N, K)
    assert w.mode == "mxfp4" and w.biases is None and w.scales.dtype == mx.uint8
    ref = dequantize(raw, "MXFP4", (N, K))
    with np.errstate(over="ignore"):
        got = np.array(mlx_dequantize(w))
    # Bit for bit, but for the sign of zero: MLX reads code 8 as -0.0, ggml as +0.0 (the
    # same in every product and sum).
    nonzero = ref != 0
    np.testing.assert_array_equal(got[nonzero].view(np.uint32), ref[nonzero].view(np.uint32))
    assert (got[~nonzero] == 0).all() and nonzero.mean() > 0.8
    rows = mx.array(np.array([3, 0, 39], np.int32))
    np.testing.assert_array_equal(np.array(mlx_dequantize(w, rows)), ref[[3, 0, 39]])


# ---------------------------------------------------------------------------- ops

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n", [1, 7])
def test_linear(be, cpu, fmt, n):
    rng = np.random.default_rng(3)
    N, K = 40, 512   # 40 rows: not whole 16-row tiles of the CPU layout
    raw = random_weight(fmt, N, K, rng)
    x = rnd(rng, n, K)
    bias = rnd(rng, N)
    want = cpu.linear(x, [cpu.upload_matrix("w", fmt, raw, N, K)], [cpu.upload_vector(bias)])[0]
    w = be.upload_matrix("w", fmt, raw, N, K)
    got = be.to_numpy(be.linear(be.from_numpy(x), [w], [be.upload_vector(bias)])[0])
    tol = TOL_CONVERTED.get(fmt, TOL_LINEAR) if be.name == "mlx" else TOL_LINEAR
    check(f"{be.name} linear {fmt} n={n}", got, want, tol)
    assert be.matrix_nbytes(w) == be.plan_matrix_nbytes(fmt, N, K)


@pytest.mark.parametrize("fmt", ["F16", "Q8_0", "Q4_K", "Q4_1", "MXFP4"])
def test_embed(be, cpu, fmt):
    rng = np.random.default_rng(4)
    vocab, dim = 64, 256
    rows = random_weight(fmt, vocab, dim, rng).reshape(vocab, row_nbytes(fmt, dim))
    ids = [5, 0, 63, 5, 17]
    for scale in (1.0, 16.0):
        want = cpu.embed(cpu.upload_embedding(fmt, rows, dim), ids, scale)
        got = be.to_numpy(be.embed(be.upload_embedding(fmt, rows, dim), ids, scale))
        check(f"{be.name} embed {fmt} x{scale}", got, want, 0.0)


def test_rms_norm_and_head_norm(be, cpu):
    rng = np.random.default_rng(5)
    x, w = rnd(rng, 9, 576, scale=3.0), rnd(rng, 576)
    check(f"{be.name} rms_norm", run(be, lambda b, x, w: b.rms_norm(x, w, 1e-6), x, w),
          cpu.rms_norm(x, w, 1e-6), TOL_FLOAT_OP)
    x, w = rnd(rng, 5, 4 * 256), rnd(rng, 256)
    check(f"{be.name} head_norm", run(be, lambda b, x, w: b.head_norm(x, 4, w, 1e-6), x, w),
          cpu.head_norm(x.copy(), 4, w, 1e-6), TOL_FLOAT_OP)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot", [64, 32])
def test_rope(be, cpu, neox, n_rot):
    rng = np.random.default_rng(6)
    H, hd = 3, 64
    freq = (1.0 + rng.random(n_rot // 2)).astype(np.float32) if n_rot == 32 else None
    spec = RopeSpec(n_rot, 10000.0, neox, 0.5 if n_rot == 32 else 1.0, freq)
    x = rnd(rng, 6, H * hd)
    pos = np.array([0, 1, 2, 300, 301, 5000])
    want = cpu.rope(x.copy(), H, pos, spec)
    check(f"{be.name} rope neox={neox} n_rot={n_rot}",
          run(be, lambda b, x: b.rope(x, H, pos, spec), x), want, TOL_FLOAT_OP)


@pytest.mark.parametrize("neox", [False, True])
def test_rope_yarn(be, cpu, neox):
    from localllm.kernels.ops import yarn_corr_dims, yarn_mscale
    rng = np.random.default_rng(6)
    H, hd = 3, 64
    low, high = yarn_corr_dims(hd, 1024, 10000.0)
    spec = RopeSpec(hd, 10000.0, neox, 0.25, None, yarn_mscale(4.0), (1.0, low, high))
    x = rnd(rng, 6, H * hd)
    pos = np.array([0, 1, 2, 300, 301, 5000])
    want = cpu.rope(x.copy(), H, pos, spec)
    linear = cpu.rope(x.copy(), H, pos, RopeSpec(hd, 10000.0, neox, 0.25, None, spec.mscale))
    assert not np.allclose(want, linear)
    check(f"{be.name} rope yarn neox={neox}", run(be, lambda b, x: b.rope(x, H, pos, spec), x),
          want, TOL_FLOAT_OP)


def test_rope_without_rotated_dims_and_with_a_query_temperature(be, cpu):
    """n_rot 0 (SmolLM3's NoPE layers) leaves x as it is; the attention temperature scales
    position p by log(floor(p / temp_floor) + 1) * temp_scale + 1 (1 below temp_floor)."""
    rng = np.random.default_rng(8)
    H, hd = 2, 64
    x = rnd(rng, 5, H * hd)
    pos = np.array([0, 63, 64, 200, 1000])
    none = RopeSpec(0, 10000.0, False)
    assert np.array_equal(run(be, lambda b, x: b.rope(x, H, pos, none), x), x)
    plain = RopeSpec(hd, 10000.0, False)
    temp = RopeSpec(hd, 10000.0, False, temp_scale=0.5, temp_floor=64)
    factor = (np.log(np.floor(pos / 64) + 1) * 0.5 + 1).astype(np.float32)[:, None]
    want = cpu.rope(x.copy(), H, pos, plain) * factor
    check(f"{be.name} rope with temperature", run(be, lambda b, x: b.rope(x, H, pos, temp), x),
          want, TOL_FLOAT_OP)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_glu(be, cpu, act):
    rng = np.random.default_rng(7)
    g, u = rnd(rng, 4, 1536, scale=4.0), rnd(rng, 4, 1536)
    check(f"{be.name} glu {act}", run(be, lambda b, g, u: b.glu(g, u, act), g, u),
          cpu.glu(g, u, act), TOL_FLOAT_OP)


def test_add_select_rows_and_the_host_boundary(be, cpu):
    rng = np.random.default_rng(8)
    x, y = rnd(rng, 6, 64), rnd(rng, 6, 64)
    np.testing.assert_array_equal(run(be, lambda b, x, y: b.add(x, y), x, y), x + y)
    np.testing.assert_array_equal(run(be, lambda b, x: b.select_rows(x, [4, 0, 4]), x),
                                  x[[4, 0, 4]])
    np.testing.assert_array_equal(be.to_numpy(be.from_numpy(x)), x)
    z = rnd(rng, 1000, scale=30.0)
    assert abs(be.logsumexp(z) - cpu.logsumexp(z)) <= 1e-5 * abs(cpu.logsumexp(z))


# ---------------------------------------------------------------------------- KV and attention

class Batch:
    """The same paged-KV batch for two backends: per sequence a block table (blocks placed
    at random, some dropped as a sliding window drops them), tokens at given positions."""

    def __init__(self, layout, n_blocks, tables, row_seq, positions):
        self.layout, self.n_blocks = layout, n_blocks
        self.tables = np.asarray(tables, np.int32)
        self.row_seq = np.asarray(row_seq, np.int32)
        self.positions = np.asarray(positions, np.int64)

    def kv(self, pages):
        return KVBatch(pages, self.tables, self.row_seq, self.layout.block_size)


def _attend(backend, batch, pages, q, k, v, H, scale, window):
    b = backend
    return b.to_numpy(b.attention(b.from_numpy(q), b.from_numpy(k), b.from_numpy(v),
                                  batch.kv(pages), batch.positions, H, scale, window))


@pytest.mark.parametrize("kind", KV_TYPES)
@pytest.mark.parametrize("H,n_kv,hd,window", [(9, 3, 64, 0), (4, 1, 256, 0), (4, 4, 32, 24)])
def test_attention(be, cpu, kind, H, n_kv, hd, window):
    rng = np.random.default_rng(9)
    layout = KVLayout(n_kv, hd, 16, kind, kind)
    n_blocks = 12
    perm = rng.permutation(n_blocks)
    ta, tb = perm[:3], np.array([perm[3], perm[4], -1])
    pages = [cpu.new_kv_pages(layout, n_blocks), be.new_kv_pages(layout, n_blocks)]
    steps = [  # (tables, row_seq, positions): two prompts in one batch, then a decode step
        ([ta, tb], [0] * 40 + [1] * 21, list(range(40)) + list(range(21))),
        ([ta, tb], [1, 0, 1], [21, 40, 22])]
    if window:  # A's first block has left the window (a sliding layer drops it)
        steps.append(([np.array([-1, ta[1], ta[2]]), tb], [0], [41]))
    for i, (tables, row_seq, pos) in enumerate(steps):
        batch = Batch(layout, n_blocks, tables, row_seq, pos)
        n = len(pos)
        q, k, v = rnd(rng, n, H * hd), rnd(rng, n, n_kv * hd, scale=2.0), rnd(rng, n, n_kv * hd)
        got = [_attend(b, batch, p, q, k, v, H, 0.125, window) for b, p in zip((cpu, be), pages)]
        check(f"{be.name} attention step {i} {kind} H={H}/{n_kv} hd={hd} window={window}",
              got[1], got[0], TOL_ATTENTION)
    assert be.kv_block_nbytes(layout) == cpu.kv_block_nbytes(layout)


@pytest.mark.parametrize("kind", KV_TYPES)
@pytest.mark.parametrize("hd", [64, 96])   # rotated in blocks of 64, and of 32
def test_kv_types_store_the_cpu_backends_values_exactly(be, kind, hd):
    """What the pages hold after an attention call, decoded: the CPU pages' own values, the
    key balance and Hadamard rotation of q8_0/q4_0 and q4_0's least-squares scales
    included."""
    rng = np.random.default_rng(10)
    n_kv, n = 2, 37
    ref = Cache(kind, n_kv, hd)
    spread = np.exp(rng.uniform(-12, 8, (n, n_kv, 1)))  # tiny to saturating (fp8's 448)
    k = (rng.standard_normal((n, n_kv, hd)) * spread).astype(np.float32)
    v = (rng.standard_normal((n, n_kv, hd)) * spread).astype(np.float32)
    k[0, 0, :5] = [0.0, -0.0, np.nan, 1e6, -1e6] if kind == "fp8" else [0.0, -0.0, 1, 2, 3]
    k[1, 1, :32] = 0.0   # an all-zero block
    q = rnd(rng, n, 2 * n_kv * hd)
    # a key balance (kvpages.key_balance: per-dim powers of two) at head size 64
    bal = 2.0 ** rng.integers(-3, 4, hd).astype(np.float32) if hd == 64 else None
    out_ref = np.empty_like(q)
    attn.paged_attention(q.copy(), k.reshape(n, -1).copy(), v.reshape(n, -1).copy(), ref.K,
                         ref.V, ref.tables, np.zeros(n, np.int32), ref.bs, n_kv,
                         np.arange(n, dtype=np.int64), 0, 0.125,
                         np.zeros(0, np.float32) if bal is None else bal,
                         np.zeros(0, np.float32), out_ref)
    want_k, want_v = ref.stored(n)  # (n_kv, n, hd), decoded from the CPU pages
    layout = KVLayout(n_kv, hd, 16, kind, kind)
    pages = be.new_kv_pages(layout, 4)
    batch = Batch(layout, 4, [[2, 0, 3]], [0] * n, np.arange(n))
    out = be.attention(be.from_numpy(q), be.from_numpy(k.reshape(n, -1)),
                       be.from_numpy(v.reshape(n, -1)), batch.kv(pages), batch.positions,
                       2 * n_kv, 0.125, 0, None if bal is None else tuple(float(x) for x in bal))
    # keys up to fp8's 448 make scores of thousands: float32 softmax sums in another order
    # differ more than on the op test's data (an unbalanced query is off by NMSE ~1)
    check(f"{be.name} attention {kind} hd={hd} balanced={bal is not None}", be.to_numpy(out),
          out_ref, 1e-8)
    got = [np.concatenate(x) for x in zip(*(pages.read_block(b) for b in (2, 0, 3)))]
    for side, have, want in (("keys", got[0], want_k), ("values", got[1], want_v)):
        np.testing.assert_array_equal(have[:n].transpose(1, 0, 2), want, err_msg=side)
    # copy-on-write: a copied block reads back the same
    be.copy_kv_block(pages, 0, 1)
    for a, b in zip(pages.read_block(0), pages.read_block(1)):
        np.testing.assert_array_equal(a, b)


def test_attention_refuses_a_block_it_does_not_hold(be):
    layout = KVLayout(1, 32, 16, "f16", "f16")
    pages = be.new_kv_pages(layout, 2)
    batch = Batch(layout, 2, [[0, -1]], [0], [20])
    x = np.zeros((1, 32), np.float32)
    with pytest.raises(ValueError, match="not held"):
        _attend(be, batch, pages, x, x, x, 1, 1.0, 0)


@pytest.mark.metal
def test_mlx_computes_on_metal_where_present():
    mx = pytest.importorskip("mlx.core")
    if not mx.metal.is_available():
        pytest.skip("no Metal device")
    from localllm.backends.mlx import MlxBackend
    assert MlxBackend().device == "metal"
