"""The backends under test (each device build's CPU stand-in, and CUDA or Metal where the
machine has them) and how their results are held to the CPU backend's: tolerances in
normalized mean squared error, NMSE = |a - b|^2 / |b|^2, as llama.cpp's test-backend-ops."""

from __future__ import annotations

import numpy as np
import pytest

# The CPU backend multiplies quantized weights by activations quantized to 8 bits (as
# llama.cpp does); the others multiply float activations by exactly dequantized weights. 5e-4
# is test-backend-ops' own bound for mul_mat.
TOL_LINEAR = 5e-4
# MLX re-quantizes these formats (mlx_quant.CONVERT_BITS); the bound is the conversion's
# measured NMSE on these random weights with a margin of about 2x.
TOL_CONVERTED = {"Q6_K": 3e-4, "Q3_K": 5e-4, "Q2_K": 6e-3, "IQ4_NL": 1e-3, "IQ4_XS": 1e-3}
TOL_FLOAT_OP = 1e-12   # norms, RoPE, activations: the same float32 formulas (seen <= 2e-14)
TOL_ATTENTION = 1e-11  # the same stored keys and values, float32 softmax (seen <= 1e-13)


def _backends():
    """The backends under test: each device build's CPU stand-in, and CUDA and Metal where
    the machine has it (marked, so `-m cuda` selects it and it skips elsewhere)."""
    try:
        from localllm.backends.torch import TorchBackend, cuda_available
        has_torch = True
    except ImportError:
        has_torch = False
    try:
        from localllm.backends.mlx import MlxBackend
        has_mlx = True
    except ImportError:
        has_mlx = False
    no_torch = pytest.mark.skipif(not has_torch, reason="torch is not installed")
    no_mlx = pytest.mark.skipif(not has_mlx, reason="mlx is not installed")
    return [
        pytest.param(lambda: TorchBackend(device="cpu"), id="torch", marks=no_torch),
        pytest.param(lambda: TorchBackend(device="cuda"), id="torch-cuda",
                     marks=[pytest.mark.cuda, no_torch, pytest.mark.skipif(
                         not (has_torch and cuda_available()), reason="no CUDA device")]),
        # MLX computes on its default device: Metal where present, else its CPU build.
        pytest.param(lambda: MlxBackend(), id="mlx", marks=no_mlx),
    ]


def nmse(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / max((b ** 2).sum(), 1e-300))


def check(name, got, want, tol):
    err = nmse(got, want)
    print(f"{name}: NMSE {err:.3e} (max {tol:.0e})")
    assert np.all(np.isfinite(got))
    assert err <= tol, f"{name}: NMSE {err:.3e} > {tol:.0e}"


def run(backend, fn, *arrays):
    """fn(backend, *arrays on the backend) as numpy."""
    return backend.to_numpy(fn(backend, *[backend.from_numpy(a) for a in arrays]))


def rnd(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def device_agreement(path, want_lp, ids, backend: str, check=None,
                     **load) -> tuple[float, float]:
    """The model at ``path`` on ``backend`` (every layer on it unless ``load`` says
    otherwise) against the CPU backend's log-probabilities ``want_lp`` of ``ids``.

    Args:
        check: optional callable run on the loaded model before its logits (placement
            assertions).
    Returns:
        (top-1 agreement, mean KL(want || got)).
    """
    import localllm
    from localllm.testing.compare import log_softmax
    pytest.importorskip({"torch": "torch", "mlx": "mlx.core"}[backend])
    m = localllm.load(path, **{"ctx_size": 1024, "threads": 2, "weight_cache": False,
                               "backend": backend, "gpu_layers": "all", **load})
    try:
        if check is not None:
            check(m)
        got = log_softmax(m.logits(ids))
    finally:
        m.close()
    kl = (np.exp(want_lp) * (want_lp - got)).sum(1)
    return float((got.argmax(1) == want_lp.argmax(1)).mean()), float(kl.mean())
