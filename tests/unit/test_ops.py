"""The per-row kernels (activation quantization, RMSNorm, RoPE, gated activations, residual
add): exact against frozen numpy references or float64 math, bit-identical across batch sizes,
thread counts and compile targets."""

from __future__ import annotations

import hashlib
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numba
import numpy as np
from localllm.testing.kernel_data import q8_blocks32 as ref_q8_32
from localllm.testing.kernel_data import q8_blocks256 as ref_q8_256
from localllm.testing.kernel_data import round_f16 as ref_round_f16
import pytest
from numba import njit

from localllm.kernels import actquant as aq
from localllm.kernels import ops
from localllm.kernels.rowmath import vf_round_f16
from localllm.kernels.simd import vf_load, vf_store

# float32 results of a few rounded operations: RMSNorm rounds the scale, x * inv and * w
# (measured max 1.5e-7 relative); the activations round exp, 1 + e, the division and * up
# (measured max 1.8e-7). Values under 1e-30 are held to an absolute bound instead.
RMS_REL_TOL = 3e-7
ACT_REL_TOL = 2.5e-7
ACT_ABS_TOL = 1e-35


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------- frozen references

def ref_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool) -> np.ndarray:
    """a' = a c - b s, b' = a s + b c, each product and sum rounded to float32."""
    x = x.copy()
    half = cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]
    if neox:
        a, b = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half] = a * c - b * s
        x[..., half:2 * half] = a * s + b * c
    else:
        a, b = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2] = a * c - b * s
        x[..., 1:2 * half:2] = a * s + b * c
    return x


def ref_rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def ref_silu(g: np.ndarray) -> np.ndarray:
    g = g.astype(np.float64)
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-g))


def ref_gelu_tanh(g: np.ndarray) -> np.ndarray:
    # 0.5 g (1 + tanh(u)) = g / (1 + e^-2u) exactly; this form keeps float64 accurate for g < 0.
    g = g.astype(np.float64)
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-2.0 * math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3)))


# ----------------------------------------------------------------------------- kernel wrappers

def run_q8_32(x):
    n, K = x.shape
    out = (np.empty((n, K), np.int8), np.empty((n, K // 32), np.float32),
           np.empty((n, K // 32), np.int32), np.empty((n, K // 32), np.float32))
    aq.quantize_q8_32(x, *out)
    return out


def run_q8_256(x):
    n, K = x.shape
    out = (np.empty((n, K), np.int8), np.empty((n, K // 256), np.float32),
           np.empty((n, K // 16), np.int32))
    aq.quantize_q8_256(x, *out)
    return out


def run_rms(x, w, eps=1e-6):
    out = np.empty_like(x)
    ops.rms_norm(x, w, eps, out)
    return out


def run_rms_heads(x, w, eps=1e-6):
    x = x.copy()
    ops.rms_norm_heads(x, w, eps)
    return x


def run_rope(x, cos, sin, neox):
    x = x.copy()
    ops.rope(x, cos, sin, neox)
    return x


def run_act(name, g, u):
    out = np.empty_like(g)
    getattr(ops, name)(g, u, out)
    return out


def run_add(x, y):
    x = x.copy()
    ops.add_inplace(x, y)
    return x


@njit(cache=True)
def _round_f16_all(v, out):
    for i in range(0, v.shape[0], 16):
        vf_store(out, 4 * i, vf_round_f16(vf_load(v, 4 * i)))


# ----------------------------------------------------------------------------- data

def q8_data(rng, n: int, K: int, block: int) -> np.ndarray:
    """Rows whose blocks span magnitudes 1e-30 .. 1e12 (f16 scales from subnormal to inf),
    with zero blocks, -0.0, exact ties after scaling, and a max magnitude held by both signs."""
    x = rng.standard_normal((n, K)).astype(np.float32)
    nb = K // block
    xb = x.reshape(n, nb, block)
    xb *= (10.0 ** rng.uniform(-30, 12, (n, nb, 1))).astype(np.float32)
    for t in range(n):
        kind = t % 6
        b = xb[t, t % nb]
        if kind == 0:
            b[:] = 0.0
            b[::3] = -0.0
        elif kind == 1:  # scale 1 (Q8_0: 127 / 127; Q8_K: -127 / -127): halves are ties
            b[:] = rng.integers(-126, 127, block) + 0.5
            b[block // 2] = 127.0 if block == 32 else -127.0
        elif kind == 2:  # scale 1/2 or -1/2: odd integers are ties
            b[:] = (2 * rng.integers(-126, 127, block) + 1).astype(np.float32)
            b[1] = 254.0 if block == 32 else -254.0
        elif kind == 3:  # the largest magnitude appears with both signs; the first one wins
            b[:] = rng.uniform(-40, 40, block)
            b[3], b[7] = -50.0, 50.0
        elif kind == 4:
            b[:] = rng.uniform(-8, 8, block)
            b[5], b[2] = 9.0, -9.0
    return x


# ----------------------------------------------------------------------------- quantization

@pytest.mark.parametrize("n,K", [(1, 256), (7, 512), (64, 576), (33, 2048), (5, 480), (4, 96),
                                 (3, 32)])
def test_q8_32_matches_reference(n, K):
    x = q8_data(np.random.default_rng(K + n), n, K, 32)
    for name, got, want in zip(("qx", "dx", "xs", "sx"), run_q8_32(x), ref_q8_32(x)):
        assert same_bits(got, want), (name, np.argwhere(got != want)[:5])


@pytest.mark.parametrize("n,K", [(1, 256), (7, 512), (33, 2048), (5, 4096)])
def test_q8_256_matches_reference(n, K):
    x = q8_data(np.random.default_rng(K + n), n, K, 256)
    for name, got, want in zip(("qx", "dx", "bsum"), run_q8_256(x), ref_q8_256(x)):
        assert same_bits(got, want), (name, np.argwhere(got != want)[:5])


def test_round_f16_is_ieee_round_to_nearest_even():
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2 ** 32, 1 << 21, dtype=np.uint64).astype(np.uint32)
    edges = np.array([65504, 65519.996, 65520, 65536, 2.0 ** -14, 2.0 ** -14 - 2.0 ** -25,
                      2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 1.5 * 2.0 ** -24, 1e-45, 0.0, 1.0,
                      1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2048.5, 2049.0, np.inf], np.float32)
    near = (edges.view(np.uint32)[:, None].astype(np.int64) + np.arange(-3, 4)).clip(0, 0x7F800000)
    bits = np.concatenate([bits, near.ravel().astype(np.uint32)])
    bits = np.concatenate([bits, bits ^ np.uint32(0x80000000)])
    v = bits.view(np.float32)
    v = v[~np.isnan(v)]
    v = np.concatenate([v, np.zeros(-len(v) % 16, np.float32)])
    out = np.empty_like(v)
    _round_f16_all(v, out)
    assert same_bits(out, ref_round_f16(v))


# ----------------------------------------------------------------------------- accuracy

@pytest.mark.parametrize("D", [576, 640, 2048, 100, 7])
def test_rms_norm_accuracy(D):
    rng = np.random.default_rng(D)
    x = (rng.standard_normal((9, D)) * 10.0 ** rng.uniform(-6, 6, (9, 1))).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    ref = ref_rms(x, w, 1e-6)
    assert (np.abs(run_rms(x, w) - ref) <= RMS_REL_TOL * np.abs(ref)).all()
    out = x.copy()
    ops.rms_norm(out, w, 1e-6, out)  # in place
    assert same_bits(out, run_rms(x, w))


@pytest.mark.parametrize("H,hd", [(4, 256), (9, 64), (3, 80)])
def test_rms_norm_heads_accuracy(H, hd):
    rng = np.random.default_rng(hd)
    x = rng.standard_normal((5, H, hd)).astype(np.float32) * 30
    w = rng.standard_normal(hd).astype(np.float32)
    ref = ref_rms(x, w, 1e-6)
    assert (np.abs(run_rms_heads(x, w) - ref) <= RMS_REL_TOL * np.abs(ref)).all()


def act_inputs() -> np.ndarray:
    rng = np.random.default_rng(11)
    g = np.concatenate([rng.standard_normal(600_000) * 4, np.linspace(-20, 20, 200_001),
                        rng.uniform(-200, 200, 20_000), 10.0 ** rng.uniform(-40, 4, 20_000),
                        -(10.0 ** rng.uniform(-40, 4, 20_000)),
                        [0.0, -0.0, 87.0, -87.0, 88.0, -88.0, 89.0, -89.0, 104.0, -104.0,
                         10.02, -10.02, 3e38, -3e38]])
    g = g.astype(np.float32)
    return np.concatenate([g, np.zeros(-len(g) % 64, np.float32)]).reshape(64, -1)


@pytest.mark.parametrize("name,ref", [("silu_mul", ref_silu), ("gelu_tanh_mul", ref_gelu_tanh)])
def test_activation_accuracy(name, ref):
    g = act_inputs()
    u = np.random.default_rng(3).standard_normal(g.shape).astype(np.float32)
    want = ref(g) * u.astype(np.float64)
    got = run_act(name, g, u).astype(np.float64)
    err = np.abs(got - want)
    bad = err > ACT_REL_TOL * np.abs(want) + ACT_ABS_TOL
    assert not bad.any(), (g[bad][:5], got[bad][:5], want[bad][:5])


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("H,hd,half", [(9, 64, 32), (4, 256, 128), (2, 80, 40), (3, 96, 20),
                                       (2, 16, 3), (1, 128, 32), (2, 64, 8)])
def test_rope_matches_reference(neox, H, hd, half):
    rng = np.random.default_rng(hd + half)
    x = rng.standard_normal((6, H, hd)).astype(np.float32)
    ang = rng.uniform(-7, 7, (6, half))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    assert same_bits(run_rope(x, cos, sin, neox), ref_rope(x, cos, sin, neox))


def test_add_inplace():
    rng = np.random.default_rng(5)
    for n, D in ((1, 576), (300, 640), (3, 7)):
        x, y = (rng.standard_normal((2, n, D))).astype(np.float32)
        assert same_bits(run_add(x, y), x + y)


def test_empty_batches():
    rng = np.random.default_rng(6)
    cases = batch_cases(rng, 3)
    for name, f in cases.items():
        for r in as_tuple(f(np.arange(0))):
            assert r.shape[0] == 0, name


def test_rejects_strided_rows():
    x = np.zeros((4, 64), np.float32)[:, ::2]
    with pytest.raises(ValueError):
        run_rms(x, np.ones(32, np.float32))


# ----------------------------------------------------------------------------- batch invariance

def batch_cases(rng, n: int):
    """(name, function of a row selection) per op: each returns the op's outputs for rows ``sel``
    of fixed (n, ...) inputs, computed together."""
    D, F, H, hd = 640, 2048, 4, 256
    x = (rng.standard_normal((n, D)) * 10.0 ** rng.uniform(-3, 3, (n, 1))).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float32)
    xh = rng.standard_normal((n, H, hd)).astype(np.float32)
    wh = rng.standard_normal(hd).astype(np.float32)
    ang = rng.uniform(-7, 7, (n, 40))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    xr = rng.standard_normal((n, 3, 96)).astype(np.float32)
    g = (rng.standard_normal((n, F)) * 4).astype(np.float32)
    u = rng.standard_normal((n, F)).astype(np.float32)
    q = q8_data(rng, n, 2048, 256)
    c = lambda a, s: np.ascontiguousarray(a[s])  # noqa: E731
    return {
        "rms_norm": lambda s: run_rms(c(x, s), w),
        "rms_norm_heads": lambda s: run_rms_heads(c(xh, s), wh),
        "rope": lambda s: run_rope(c(xr, s), c(cos, s), c(sin, s), False),
        "rope_neox": lambda s: run_rope(c(xr, s), c(cos, s), c(sin, s), True),
        "silu_mul": lambda s: run_act("silu_mul", c(g, s), c(u, s)),
        "gelu_tanh_mul": lambda s: run_act("gelu_tanh_mul", c(g, s), c(u, s)),
        "add_inplace": lambda s: run_add(c(g, s), c(u, s)),
        "q8_32": lambda s: run_q8_32(c(q, s)),
        "q8_256": lambda s: run_q8_256(c(q, s)),
    }


def as_tuple(r):
    return r if isinstance(r, tuple) else (r,)


def test_rows_are_batch_and_thread_invariant():
    """Row i of a batch (parallel path) equals that row alone (serial path), shuffled batches
    included, with 1 thread or all of them."""
    n = 300
    rng = np.random.default_rng(99)
    perm = rng.permutation(n)
    before = numba.get_num_threads()
    for name, f in batch_cases(rng, n).items():
        full = as_tuple(f(np.arange(n)))
        shuffled = as_tuple(f(perm))
        for a, b in zip(full, shuffled):
            assert same_bits(a[perm], b), name
        for i in (0, 1, 150, n - 1):
            for a, b in zip(full, as_tuple(f(np.array([i])))):
                assert same_bits(a[i:i + 1], b), (name, i)
        numba.set_num_threads(1)
        try:
            for a, b in zip(full, as_tuple(f(np.arange(n)))):
                assert same_bits(a, b), (name, "1 thread")
        finally:
            numba.set_num_threads(before)


# ----------------------------------------------------------------------------- compile targets

ISA_SEED = 4242
_X86_BASE = "+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+popcnt,+sse4.2,+ssse3,+sse4.1"
FORCED = {
    "generic": {"NUMBA_CPU_NAME": "generic"},
    "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": _X86_BASE},
}
CHILD_TIMEOUT_S = 600  # a cold child compiles the kernels for its target


def isa_results() -> dict[str, np.ndarray]:
    """Every op on fixed inputs (tails and parallel paths included); the same in every process."""
    rng = np.random.default_rng(ISA_SEED)
    out = {}
    for n in (1, 67):
        for name, f in batch_cases(rng, n).items():
            for j, r in enumerate(as_tuple(f(np.arange(n)))):
                out[f"{name}_{j}_n{n}"] = r
        x = rng.standard_normal((n, 100)).astype(np.float32) * 5
        out[f"rms_tail_n{n}"] = run_rms(x, rng.standard_normal(100).astype(np.float32))
        out[f"silu_tail_n{n}"] = run_act("silu_mul", x, x)
        out[f"gelu_tail_n{n}"] = run_act("gelu_tanh_mul", x, x)
    out["silu_wide"] = run_act("silu_mul", act_inputs(), act_inputs())
    out["gelu_wide"] = run_act("gelu_tanh_mul", act_inputs(), act_inputs())
    for j, r in enumerate(run_q8_32(q8_data(rng, 12, 576, 32))):
        out[f"q8_32_edge_{j}"] = r
    return out


def cache_dir(path: str) -> Path:
    """A Numba cache per target and per version of the kernel sources (Numba's own cache does
    not notice edits to modules a kernel inlines from)."""
    kernels = Path(ops.__file__).parent
    digest = hashlib.sha256()
    for name in ("ops.py", "actquant.py", "rowmath.py", "simd.py"):
        digest.update((kernels / name).read_bytes())
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    base = home / "localllm" / "test-numba" / f"ops-{path}"
    root = base / digest.hexdigest()[:16]
    root.mkdir(parents=True, exist_ok=True)
    os.utime(root)
    for old in base.iterdir():
        if old != root and old.is_dir() and time.time() - old.stat().st_mtime > 7 * 86400:
            shutil.rmtree(old, ignore_errors=True)
    return root


def host_can_run(path: str) -> bool:
    if path == "generic":
        return True
    import llvmlite.binding as llvm
    have = {k for k, on in llvm.get_host_cpu_features().items() if on}
    return (platform.machine().lower() in ("x86_64", "amd64")
            and {"avx", "avx2", "fma", "f16c", "bmi", "bmi2"} <= have)


@pytest.fixture(scope="module")
def isa_children(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ops-isa")
    runnable = [p for p in FORCED if host_can_run(p)]

    def child(path):
        env = {k: v for k, v in os.environ.items()
               if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
        env.update(FORCED[path])
        env["NUMBA_CACHE_DIR"] = str(cache_dir(path))
        out = out_dir / f"{path}.npz"
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(out)], env=env,
                              cwd=out_dir, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
        return proc, out

    with ThreadPoolExecutor(max_workers=max(1, len(runnable))) as pool:
        futures = {p: pool.submit(child, p) for p in runnable}
        yield isa_results(), futures


@pytest.mark.parametrize("path", list(FORCED))
def test_targets_give_identical_bits(isa_children, path):
    expected, futures = isa_children
    if path not in futures:
        pytest.skip(f"this host cannot run the {path} target")
    proc, out = futures[path].result()
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(out) as got:
        assert sorted(got.files) == sorted(expected)
        for key, want in expected.items():
            assert same_bits(got[key], want), key


if __name__ == "__main__":
    from localllm import configure_process
    configure_process()  # compile into NUMBA_CACHE_DIR's kernel cache
    np.savez(sys.argv[1], **isa_results())



def test_logsumexp_matches_float64():
    from localllm.kernels.ops import logsumexp
    rng = np.random.default_rng(3)
    for n in (1, 15, 16, 17, 1000, 262147):
        z = (rng.standard_normal(n) * 6).astype(np.float32)
        ref = float(np.log(np.exp(z.astype(np.float64) - z.max()).sum()) + z.max())
        assert abs(logsumexp(z) - ref) < 1e-5 * max(1.0, abs(ref))
    z = np.full(33, -np.inf, np.float32)
    assert logsumexp(z) == -np.inf


# ----------------------------------------------------------------------------- YaRN

def test_yarn_correction_range_follows_the_formula():
    """Pair index that turns beta times over the original context, floor / ceil."""
    n_rot, orig, theta = 64, 1024, 10000.0
    exact = [n_rot * math.log(orig / (2 * math.pi * b)) / (2 * math.log(theta)) for b in (32, 1)]
    assert ops.yarn_corr_dims(n_rot, orig, theta) == (math.floor(exact[0]), math.ceil(exact[1]))
    assert ops.yarn_corr_dims(n_rot, orig, theta) == (5.0, 18.0)
    # as ggml: the low end clipped at 0, the high end at n_rot - 1 (only)
    assert ops.yarn_corr_dims(8, 1 << 20, 10.0) == (14.0, 7.0)
    assert ops.yarn_corr_dims(64, 8, 10000.0)[0] == 0.0


def test_yarn_magnitude_factor():
    assert ops.yarn_mscale(4.0) == pytest.approx(1 + 0.1 * math.log(4.0), rel=1e-6)
    assert ops.yarn_mscale(4.0, 0.5) == pytest.approx(0.5 * (1 + 0.1 * math.log(4.0)), rel=1e-6)
    assert ops.yarn_mscale(1.0) == 1.0


def test_yarn_tables_blend_between_kept_and_interpolated_pairs():
    """Pairs up to the range's low end keep the unscaled angle, pairs past its high end get
    the linearly interpolated one, those between lie strictly between; cos and sin carry
    the magnitude factor."""
    n_rot, theta, factor = 64, 10000.0, 4.0
    low, high = ops.yarn_corr_dims(n_rot, 1024, theta)
    pos = np.arange(0, 3000, 7)
    m = ops.yarn_mscale(factor)
    cy, sy = ops.rope_tables(pos, n_rot, theta, None, 1 / factor, m, (1.0, low, high))
    c0, s0 = ops.rope_tables(pos, n_rot, theta, None, 1.0, m)
    cl, sl = ops.rope_tables(pos, n_rot, theta, None, 1 / factor, m)
    keep, interp = slice(0, int(low) + 1), slice(int(high), None)
    assert np.array_equal(cy[:, keep], c0[:, keep]) and np.array_equal(sy[:, keep], s0[:, keep])
    assert np.array_equal(cy[:, interp], cl[:, interp]) and np.array_equal(sy[:, interp], sl[:, interp])
    ang = np.arctan2(sy, cy)[1]                      # position 7: no wrap-around
    a0, al = np.arctan2(s0, c0)[1], np.arctan2(sl, cl)[1]
    mid = slice(int(low) + 1, int(high))
    assert np.all((ang[mid] < a0[mid]) & (ang[mid] > al[mid]))
    np.testing.assert_allclose(np.hypot(cy, sy), m, rtol=1e-6)
    # ext_factor 0 is plain linear scaling
    c, s = ops.rope_tables(pos, n_rot, theta, None, 1 / factor, m, (0.0, low, high))
    assert np.array_equal(c, cl) and np.array_equal(s, sl)
