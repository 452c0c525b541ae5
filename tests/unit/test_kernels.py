"""The CPU matmul kernels against float64 references: accuracy per format on random and real
tensors, bit-exact batch invariance, activation quantization, and edge cases."""

from __future__ import annotations

import contextlib

import numba
import numpy as np
import pytest

from localllm.testing.kernel_data import (FLOAT_FORMATS, FORMATS, activation_width, assert_same_bits,
                         block_mins, dequant64, f16_fields, q8_blocks32, q8_blocks256, q8_dequant,
                         random_weight, set_f16)
from localllm.formats import quants
from localllm.formats.gguf import GGUFFile
from localllm.kernels import matmul as M

# Quantized formats: activations are rounded to int8 blocks (as llama.cpp's Q8 activations),
# which on Gaussian x costs ~5e-3 relative Frobenius error (32-wide blocks) to ~7e-3 (256-wide
# blocks of the K-quants); the bound leaves 2x headroom over the worst format.
QUANT_REL_TOL = 1.5e-2
# Each output's error as a fraction of its expected size, |W_j| |x_t| / sqrt(K) (the standard
# deviation of W_j . x_t for Gaussian x). Measured maxima over 72 x 64 outputs are ~3e-2; one
# corrupted weight block moves its outputs by ~0.3 or more.
QUANT_OUT_TOL = 8e-2
# Against the same sums in float64 on the kernels' own int8 activations x^ (W @ x^, with the
# f16-rounded block sums that Q4_1/Q5_1 use for their min term) the only error left is float32
# rounding: each output within this fraction of sum_k |W_jk x^_tk| (measured <= 1e-7).
QUANT_EXACT_TOL = 1e-5
# Float weights: plain float32 accumulation over k (measured ~4e-7 Frobenius, ~2e-7 per
# output relative to sum_k |W_jk x_tk|).
FLOAT_REL_TOL = 1e-5
FLOAT_EXACT_TOL = 2e-6

BATCH_SIZES = (1, 2, 7, 64)


def accuracy_failures(name: str, y: np.ndarray, W: np.ndarray, x: np.ndarray,
                      raw: np.ndarray) -> list[str]:
    """Every tolerance that kernel output ``y`` (n, N) breaks against float64 W (N, K) and x
    (``raw``: the weight's GGUF bytes, for the per-block mins of Q4_1 / Q5_1)."""
    y = y.astype(np.float64)
    x64 = x.astype(np.float64)
    ref = x64 @ W.T
    N, K = W.shape
    fails = []
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    width = activation_width(name)
    if width is None:
        if rel > FLOAT_REL_TOL:
            fails.append(f"relative Frobenius error {rel:.3g} > {FLOAT_REL_TOL}")
        exact = np.abs(y - ref) / (np.abs(x64) @ np.abs(W).T)
        if exact.max() > FLOAT_EXACT_TOL:
            fails.append(f"per-output error {exact.max():.3g} of sum|w x| > {FLOAT_EXACT_TOL}")
        return fails
    if rel > QUANT_REL_TOL:
        fails.append(f"relative Frobenius error {rel:.3g} > {QUANT_REL_TOL}")
    size = np.linalg.norm(W, axis=1)[None, :] * np.linalg.norm(x64, axis=1)[:, None] / np.sqrt(K)
    out = np.abs(y - ref) / size
    if out.max() > QUANT_OUT_TOL:
        t, j = np.unravel_index(out.argmax(), out.shape)
        fails.append(f"output ({t}, {j}) off by {out.max():.3g} of its size > {QUANT_OUT_TOL}")
    xh = q8_dequant(x, width)
    same_sums = xh @ W.T
    mins = block_mins(name, raw, N, K)
    if mins is not None:  # min term m * f16(d * sum q) in place of m * f16(d) * sum q
        _, dx, xs, sx = q8_blocks32(x)
        same_sums += (sx.astype(np.float64) - dx.astype(np.float64) * xs) @ mins.T
    exact = np.abs(y - same_sums) / (np.abs(xh) @ np.abs(W).T)
    if exact.max() > QUANT_EXACT_TOL:
        fails.append(f"error against quantized activations {exact.max():.3g} > {QUANT_EXACT_TOL}")
    return fails


# ----------------------------------------------------------------------------- random data

ACC_N, ACC_K = 72, 512  # 72 rows: four full tiles and a padded one


@pytest.fixture(scope="module")
def random_weights():
    """name -> (raw bytes, packed Weight, float64 W) for every format."""
    rng = np.random.default_rng(7)
    out = {}
    for name in FORMATS:
        raw = random_weight(name, ACC_N, ACC_K, rng)
        out[name] = raw, M.pack(name, raw, ACC_N, ACC_K), dequant64(name, raw, ACC_N, ACC_K)
    return out


@pytest.mark.parametrize("n", BATCH_SIZES)
@pytest.mark.parametrize("name", FORMATS)
def test_random_accuracy(random_weights, name, n):
    raw, w, W = random_weights[name]
    x = np.random.default_rng(100 + n).standard_normal((n, ACC_K)).astype(np.float32)
    y = M.matmul(w, x)
    assert y.shape == (n, ACC_N) and y.dtype == np.float32
    assert accuracy_failures(name, y, W, x, raw) == []


@pytest.mark.parametrize("name", [f for f in FORMATS if f not in FLOAT_FORMATS])
def test_tolerance_is_meaningful(random_weights, name):
    """The bound sits near the error int8 activations alone cause, and one bad block breaks it."""
    raw, w, W = random_weights[name]
    x = np.random.default_rng(3).standard_normal((64, ACC_K)).astype(np.float32)
    ref = x.astype(np.float64) @ W.T
    honest = np.linalg.norm(q8_dequant(x, activation_width(name)) @ W.T - ref) / np.linalg.norm(ref)
    kernel = np.linalg.norm(M.matmul(w, x) - ref) / np.linalg.norm(ref)
    assert 2e-3 < honest < QUANT_REL_TOL < 4 * honest
    assert abs(kernel - honest) < 2e-2 * honest  # (Q4_1/Q5_1's f16 block sums add ~0.5%)

    bad = raw.copy()
    row, block = 37, 1
    ts = quants.type_size(name)
    start = row * quants.row_nbytes(name, ACC_K) + block * ts
    keep = np.zeros(ts, bool)  # leave the f16 scales alone so the block stays finite
    for off in f16_fields(name).values():
        keep[off:off + 2] = True
    bad[start:start + ts] = np.where(keep, bad[start:start + ts], bad[start:start + ts] ^ 0xFF)
    fails = accuracy_failures(name, M.matmul(M.pack(name, bad, ACC_N, ACC_K), x), W, x, raw)
    assert any("output (" in f for f in fails), fails


def test_float_tolerance_is_meaningful(random_weights):
    """Float weights: one flipped sign, or one row rounded to bfloat16, breaks the bound."""
    raw, w, W = random_weights["F32"]
    x = np.random.default_rng(4).standard_normal((7, ACC_K)).astype(np.float32)
    sign = raw.view(np.float32).copy().reshape(ACC_N, ACC_K)
    sign[5, 9] *= -1
    bf16 = raw.view(np.uint32).copy().reshape(ACC_N, ACC_K)
    bf16[60] &= 0xFFFF0000
    for bad in (sign, bf16):
        y = M.matmul(M.pack("F32", bad.view(np.uint8).reshape(-1), ACC_N, ACC_K), x)
        assert accuracy_failures("F32", y, W, x, raw)


# ----------------------------------------------------------------------------- real tensors

REAL_TYPES = {  # the 2-D weight types of each model (their F32 tensors are all 1-D norms)
    "smollm": ("Q4_1", "Q8_0"),
    "gemma": ("Q4_K", "Q5_0", "Q6_K", "Q8_0"),
}
MAX_ROWS = 4096  # big embeddings are checked on their first rows only


@pytest.fixture(scope="module")
def real_models(request):
    """model -> {type: [(tensor name, rows, K, raw bytes of those rows)]}, a few per type."""
    out = {}
    with contextlib.ExitStack() as stack:
        for model in REAL_TYPES:
            path = request.getfixturevalue(f"{model}_path")
            out[model] = _pick_tensors(stack.enter_context(GGUFFile(path)))
        yield out


def _pick_tensors(f: GGUFFile) -> dict[str, list]:
    by_type: dict[str, dict] = {}
    for info in sorted(f.tensors.values(), key=lambda i: i.name):
        if len(info.shape) == 2:  # one tensor per distinct shape: attn_q, ffn_down, embeddings...
            by_type.setdefault(info.type_name, {}).setdefault(info.shape, info)
    picked = {}
    for tname, shapes in by_type.items():
        infos = sorted(shapes.values(), key=lambda i: i.shape)
        chosen = {i.name: i for i in (infos[0], infos[len(infos) // 2], infos[-1])}.values()
        picked[tname] = []
        for i in chosen:
            N, K = min(i.shape[0], MAX_ROWS), i.shape[1]
            picked[tname].append((i.name, N, K, f.raw(i.name)[:N * quants.row_nbytes(tname, K)]))
    return picked


def test_real_model_weight_types(real_models):
    for model, types in REAL_TYPES.items():
        assert sorted(real_models[model]) == sorted(types), model


@pytest.mark.parametrize("model,tname", [(m, t) for m, ts in REAL_TYPES.items() for t in ts])
def test_real_tensor_accuracy(real_models, model, tname):
    """Real weights of each type in both models, Gaussian activations, n = 1, 2, 7, 64."""
    tensors = real_models[model][tname]
    assert tensors
    rng = np.random.default_rng(11)
    for name, N, K, raw in tensors:
        w = M.pack(tname, raw, N, K)
        W = dequant64(tname, raw, N, K)
        for n in BATCH_SIZES:
            x = rng.standard_normal((n, K)).astype(np.float32)
            fails = accuracy_failures(tname, M.matmul(w, x), W, x, raw)
            assert fails == [], (name, (N, K), n, fails)


# ----------------------------------------------------------------------------- batch invariance

# (N, K, largest batch): N not a multiple of the 16-row tile; one shape per format goes past
# several 64-token passes, the others just past one.
INVARIANCE_SHAPES = [(40, 512, 300), (40, 256, 70), (40, 1024, 70), (17, 768, 70)]


@contextlib.contextmanager
def numba_threads(n: int):
    before = numba.get_num_threads()
    numba.set_num_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("N,K,n_max", INVARIANCE_SHAPES)
@pytest.mark.parametrize("name", FORMATS)
def test_batch_invariance(name, N, K, n_max):
    """Row i of any batch equals that row computed alone, bit for bit."""
    rng = np.random.default_rng(N * K)
    w = M.pack(name, random_weight(name, N, K, rng), N, K)
    x = rng.standard_normal((n_max, K)).astype(np.float32)
    x[5] *= 1e3                     # rows of very different scale side by side
    x[6] *= 1e-3
    x[7] = 0.0
    # Alone on one thread, batches on all: the thread split must not matter either (and
    # single-row calls on one thread do not wait on a busy machine's second core).
    with numba_threads(1):
        alone = np.concatenate([M.matmul(w, x[i:i + 1]) for i in range(n_max)])
    for n in (1, 2, 7, 64, 65, n_max):
        assert_same_bits(M.matmul(w, x[:n]), alone[:n], f"{name} batch of {n}")
    perm = rng.permutation(n_max)
    assert_same_bits(M.matmul(w, x[perm]), alone[perm], f"{name} shuffled batch")
    sub = rng.choice(n_max, 37, replace=False)
    assert_same_bits(M.matmul(w, x[sub]), alone[sub], f"{name} scattered rows")


@pytest.mark.parametrize("name", FORMATS)
def test_invariance_across_threads_and_shared_activations(name):
    """Thread count and which activation forms were quantized together change no bits."""
    N, K = 40, 512
    rng = np.random.default_rng(5)
    w = M.pack(name, random_weight(name, N, K, rng), N, K)
    x = rng.standard_normal((70, K)).astype(np.float32)
    ref = M.matmul(w, x)
    with numba_threads(1):
        assert_same_bits(M.matmul(w, x), ref, f"{name} one thread")
    act = M.quantize(x, need32=True, need256=(K % 256 == 0))
    out = np.full((70, w.padded_rows), np.nan, np.float32)
    M.matmul_into(w, act, out)
    assert_same_bits(out[:, :N], ref, f"{name} matmul_into with shared activations")
    assert_same_bits(M.matmul(w, x.astype(np.float64)), ref, f"{name} float64 input")


@pytest.mark.parametrize("name", FORMATS)
def test_nonfinite_row_stays_in_its_row(name):
    """A NaN or inf token poisons at most its own outputs, never its batch neighbours."""
    N, K = 24, 256
    rng = np.random.default_rng(9)
    w = M.pack(name, random_weight(name, N, K, rng), N, K)
    x = rng.standard_normal((9, K)).astype(np.float32)
    clean = M.matmul(w, x)
    x[2, 10] = np.nan
    x[6, 3] = np.inf
    y = M.matmul(w, x)
    keep = [0, 1, 3, 4, 5, 7, 8]
    assert_same_bits(y[keep], clean[keep], name)


# ----------------------------------------------------------------------------- activation quantization

def _sample_activations(K: int) -> np.ndarray:
    rng = np.random.default_rng(K)
    x = rng.standard_normal((12, K)).astype(np.float32)
    x[1] = 0.0                                           # all-zero row
    x[2, :K // 2] = 0.0                                  # zero blocks next to live ones
    x[3] *= np.float32(1e30)                             # huge but finite
    x[4] *= np.float32(1e-30)                            # tiny but normal scales
    x[5] = np.round(x[5] * 4) / 4                        # many exact halves after scaling
    x[6, ::32] = 127.0                                   # amax 127: scale exactly 1, ties at .5
    x[6, 1::32] = np.float32(2.5)
    x[6, 2::32] = np.float32(-3.5)
    x[7] = -np.abs(x[7])
    x[8, 0] = 1e4                                        # one outlier per row
    x[9] = np.float32(1.0)                               # constant rows: every quant at 127
    x[10] = np.float32(-1.0)
    x[11] = np.where(np.arange(K) % 2, 1, -1).astype(np.float32)
    return x


@pytest.mark.parametrize("K", [256, 2048])
def test_activation_quantization_matches_numpy(K):
    x = _sample_activations(K)
    act = M.quantize(x, need32=True, need256=True)
    assert act.x.dtype == np.float32 and np.array_equal(act.x, x)

    want = q8_blocks32(x)
    for got, exp, what in zip(act.q32, want, ("quants", "scales", "sums", "scaled sums")):
        assert got.dtype == exp.dtype and got.shape == exp.shape, what
        assert np.array_equal(got.view(np.uint32) if got.dtype == np.float32 else got,
                              exp.view(np.uint32) if exp.dtype == np.float32 else exp), what
    assert act.q32[0].min() >= -127

    want = q8_blocks256(x)
    for got, exp, what in zip(act.q256, want, ("quants", "scales", "16-wide sums")):
        assert got.dtype == exp.dtype and got.shape == exp.shape, what
        assert np.array_equal(got.view(np.uint32) if got.dtype == np.float32 else got,
                              exp.view(np.uint32) if exp.dtype == np.float32 else exp), what
    assert act.q256[0].min() >= -127

    # Zero rows quantize to zero everywhere, with no NaN from 0 / 0.
    for arr in (*act.q32, *act.q256):
        assert not np.isnan(arr[1].astype(np.float64)).any()
        assert not arr[1].any()


def test_q8_256_scale_takes_the_first_extreme():
    """Q8_K's scale carries the sign of the first element of largest magnitude."""
    x = np.zeros((2, 256), np.float32)
    x[0, 3], x[0, 100] = -5.0, 5.0
    x[1, 3], x[1, 100] = 5.0, -5.0
    xq, dx, _ = M.quantize(x, need32=False, need256=True).q256
    assert dx[0, 0] > 0 and dx[1, 0] < 0
    assert (xq[0, 3], xq[0, 100], xq[1, 3], xq[1, 100]) == (-127, 127, -127, 127)


def test_quantize_only_what_is_asked():
    x = np.ones((3, 256), np.float32)
    assert M.quantize(x, need32=True, need256=False).q256 is None
    assert M.quantize(x, need32=False, need256=True).q32 is None
    a = M.quantize(x, need32=False, need256=False)
    assert a.q32 is None and a.q256 is None and a.x.shape == (3, 256)


def test_zero_activations_give_zero_outputs():
    for name in FORMATS:
        N, K = 20, 256
        w = M.pack(name, random_weight(name, N, K, np.random.default_rng(1)), N, K)
        y = M.matmul(w, np.zeros((3, K), np.float32))
        assert np.array_equal(y, np.zeros((3, N), np.float32)), name


# ----------------------------------------------------------------------------- API and edge cases

def test_bit_comparison_is_strict():
    a = np.array([1.0, 0.0, np.nan], np.float32)
    assert_same_bits(a, a.copy())
    for b in (np.array([np.nextafter(np.float32(1), np.float32(2)), 0.0, np.nan], np.float32),
              np.array([1.0, -0.0, np.nan], np.float32)):
        with pytest.raises(AssertionError):
            assert_same_bits(b, a)


def test_empty_and_strided_batches():
    N, K = 20, 256
    for name in FORMATS:
        w = M.pack(name, random_weight(name, N, K, np.random.default_rng(0)), N, K)
        assert M.matmul(w, np.zeros((0, K), np.float32)).shape == (0, N)
        x = np.random.default_rng(1).standard_normal((5, 2 * K)).astype(np.float32)[:, ::2]
        assert_same_bits(M.matmul(w, x), M.matmul(w, np.ascontiguousarray(x)), name)


def test_needs():
    for name in FORMATS:
        w = M.pack(name, random_weight(name, 16, 256, np.random.default_rng(0)), 16, 256)
        want = {None: "float", 32: "q32", 256: "q256"}[activation_width(name)]
        assert M.needs(w) == want, name
        assert w.type_name == name and (w.N, w.K) == (16, 256)


@pytest.mark.parametrize("name", FORMATS)
def test_small_and_odd_shapes(name):
    """A single row, one row past a tile, and the largest K of the real models."""
    rng = np.random.default_rng(2)
    for N, K in [(1, 256), (17, 256), (3, 2048)]:
        raw = random_weight(name, N, K, rng)
        w = M.pack(name, raw, N, K)
        assert w.padded_rows == -(-N // 16) * 16
        x = rng.standard_normal((16, K)).astype(np.float32)  # enough outputs for a stable norm
        y = M.matmul(w, x)
        assert y.shape == (16, N)
        assert accuracy_failures(name, y, dequant64(name, raw, N, K), x, raw) == [], (N, K)


@pytest.mark.parametrize("name", ["Q4_0", "Q6_K", "F16"])
def test_matmul_rejects_wrong_k(name):
    w = M.pack(name, random_weight(name, 16, 512, np.random.default_rng(0)), 16, 512)
    for K in (256, 1024, 544):
        x = np.ones((2, K), np.float32)
        with pytest.raises(ValueError):
            M.matmul(w, x)
        with pytest.raises(ValueError):
            M.matmul(w, M.quantize(x, need32=K % 32 == 0, need256=K % 256 == 0))


def test_pack_rejects_bad_shapes():
    rng = np.random.default_rng(0)
    for name, K in [("Q4_0", 48), ("Q8_0", 16), ("IQ4_NL", 40)]:
        raw = rng.integers(0, 256, 4 * K * 2, dtype=np.uint8)   # bytes are not the point
        with pytest.raises(ValueError):
            M.pack(name, raw, 4, K)
    for name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"):
        for K in (128, 384, 640):                                # not multiples of 256
            with pytest.raises(ValueError):
                M.pack(name, np.zeros(4 * K, np.uint8), 4, K)
    with pytest.raises(ValueError):                              # one byte short
        M.pack("Q4_0", random_weight("Q4_0", 4, 64, rng)[:-1], 4, 64)
    for bad in ("Q8_1", "IQ2_XXS", "Q4_0_4_4"):
        with pytest.raises(ValueError):
            M.pack(bad, np.zeros(1024, np.uint8), 4, 256)


def test_quantize_rejects_partial_blocks():
    for K, need32, need256 in [(100, True, False), (288, False, True), (544, True, True)]:
        with pytest.raises(ValueError):
            M.quantize(np.ones((2, K), np.float32), need32=need32, need256=need256)


def test_mxfp4_largest_exponent_stays_in_its_row():
    """MXFP4's E8M0 scale has no NaN or inf code; its largest, 2**127, overflows the
    outputs of the row that holds it and no other row's."""
    N, K = 40, 512
    rng = np.random.default_rng(8)
    raw = random_weight("MXFP4", N, K, rng)
    x = rng.standard_normal((5, K)).astype(np.float32)
    clean = M.matmul(M.pack("MXFP4", raw, N, K), x)
    bad = raw.copy()
    start = 21 * quants.row_nbytes("MXFP4", K) + 1 * quants.type_size("MXFP4")
    bad[start] = 255
    bad[start + 1:start + 17] = 0x77                      # every code 7: +6.0 * 2**127
    y = M.matmul(M.pack("MXFP4", bad, N, K), x)
    others = [j for j in range(N) if j != 21]
    assert_same_bits(y[:, others], clean[:, others], "MXFP4")
    assert not np.isfinite(y[:, 21]).all()


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("name", [f for f in FORMATS if f not in FLOAT_FORMATS and f != "MXFP4"])
def test_nonfinite_scales_do_not_crash(name, value):
    """A NaN or inf weight scale spoils only the outputs of the row that holds it."""
    N, K = 40, 512
    rng = np.random.default_rng(8)
    raw = random_weight(name, N, K, rng)
    x = rng.standard_normal((5, K)).astype(np.float32)
    clean = M.matmul(M.pack(name, raw, N, K), x)
    bad = raw.copy()
    set_f16(bad, name, K, row=21, block=1, field="d", value=value)
    y = M.matmul(M.pack(name, bad, N, K), x)
    others = [j for j in range(N) if j != 21]
    assert_same_bits(y[:, others], clean[:, others], name)
    assert not np.isfinite(y[:, 21]).all()


@pytest.mark.parametrize("name", FLOAT_FORMATS)
def test_nonfinite_float_weights_do_not_crash(name):
    N, K = 40, 256
    rng = np.random.default_rng(8)
    raw = random_weight(name, N, K, rng)
    x = rng.standard_normal((5, K)).astype(np.float32)
    clean = M.matmul(M.pack(name, raw, N, K), x)
    vals = raw.view({"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[name]).copy()
    vals[21 * K + 3] = 0x7FC0 if name == "BF16" else np.nan
    y = M.matmul(M.pack(name, vals.view(np.uint8), N, K), x)
    others = [j for j in range(N) if j != 21]
    assert_same_bits(y[:, others], clean[:, others], name)
    assert np.isnan(y[:, 21]).all()


def test_compile_cache_keeps_current_and_recent_builds(tmp_path):
    import os
    import time

    from localllm.kernels import jit
    current = tmp_path / "0123456789abcdef"
    recent, stale = tmp_path / "1111111111111111", tmp_path / "2222222222222222"
    other = tmp_path / "not-a-build"
    for d in (current, recent, stale, other):
        d.mkdir()
        (d / "f.nbi").write_bytes(b"x")
    old = time.time() - 40 * 86400
    for d in (current, stale, other):
        os.utime(d, (old, old))
    jit._prune(tmp_path, current)
    assert current.exists() and recent.exists() and other.exists()
    assert not stale.exists()
    assert time.time() - current.stat().st_mtime < 3600  # marked as used
