"""Intel AMX tiles for prompt matmuls: the tile path gives the VNNI path's bits, batched or
not, and a process without AMX (refused by the OS, or LOCALLLM_AMX=0) compiles without it.

The bit-for-bit comparisons need an AMX host (Sapphire Rapids or later); elsewhere only the
host-independent pieces run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from localllm.kernels import hostcpu, simd
from localllm.kernels import matmul as M
from localllm.kernels.amx import config_bytes
from localllm.testing.kernel_data import assert_same_bits, random_weight

SUPERBLOCKS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
# batch sizes around the 16-token tile groups and the 64-token passes
BATCHES = (16, 17, 31, 48, 64, 65, 80, 131)
N, K = 48, 768

needs_amx = pytest.mark.skipif(not simd.amx(), reason="this host's kernels do not use AMX")


def _workload():
    """(name, packed weight, activations) of every superblock format, fixed seeds."""
    out = []
    for i, name in enumerate(SUPERBLOCKS):
        rng = np.random.default_rng(100 + i)
        w = M.pack(name, random_weight(name, N, K, rng), N, K)
        x = rng.standard_normal((max(BATCHES), K)).astype(np.float32)
        x[3] *= 1e3      # rows of very different scale in one tile group
        x[4] *= 1e-3
        x[5] = 0.0
        out.append((name, w, x))
    return out


def results() -> dict[str, np.ndarray]:
    """Every format's matmul at each batch size (run in this process and in a child)."""
    res = {}
    for name, w, x in _workload():
        for n in BATCHES:
            res[f"{name}_{n}"] = M.matmul(w, x[:n])
    return res


def test_config_bytes_layout():
    cfg = config_bytes({0: (16, 64), 3: (8, 64), 6: (16, 32)})
    assert cfg.shape == (64,) and cfg.dtype == np.uint8
    assert cfg[0] == 1 and cfg[1] == 0                      # palette 1, from row 0
    assert cfg[16:18].view(np.uint16)[0] == 64 and cfg[48] == 16
    assert cfg[22:24].view(np.uint16)[0] == 64 and cfg[51] == 8
    assert cfg[28:30].view(np.uint16)[0] == 32 and cfg[54] == 16
    assert not cfg[18:22].any() and cfg[49] == 0 and cfg[50] == 0


def test_without_amx_turns_every_amx_feature_off():
    feats = "+avx2,+amx-tile,+avx512f,+amx-int8,+amx-bf16,-amx-fp16,+fma"
    out = hostcpu.without_amx(feats).split(",")
    assert {"+avx2", "+avx512f", "+fma"} <= set(out)
    assert {"-amx-tile", "-amx-int8", "-amx-bf16", "-amx-fp16"} <= set(out)
    assert not [f for f in out if f.startswith("+amx")]
    assert hostcpu.without_amx("+avx2,+fma") == "+avx2,+fma"


def test_amx_off_by_environment(monkeypatch):
    monkeypatch.setenv("LOCALLLM_AMX", "0")
    hostcpu.amx_permission.cache_clear()
    try:
        assert hostcpu.amx_permission() is False
    finally:
        monkeypatch.delenv("LOCALLLM_AMX")
        hostcpu.amx_permission.cache_clear()


@needs_amx
def test_tiles_in_use_here():
    from localllm import configure_process
    cfg = configure_process()
    assert cfg.amx and cfg.kernel_path == "avx512vnni+amx"


@needs_amx
@pytest.mark.parametrize("name", SUPERBLOCKS)
def test_tile_batches_equal_single_tokens(name):
    """Every token of a batch run on tiles equals that token alone (the VNNI decode path)."""
    _, w, x = next(item for item in _workload() if item[0] == name)
    alone = np.concatenate([M.matmul(w, x[i:i + 1]) for i in range(max(BATCHES))])
    for n in BATCHES:
        assert_same_bits(M.matmul(w, x[:n]), alone[:n], f"{name} batch of {n} on tiles")


@needs_amx
def test_tiles_equal_the_vnni_path_bit_for_bit(tmp_path):
    """A child compiled without AMX (LOCALLLM_AMX=0: its own compile target and cache)
    gives this process's bits for every format and batch size."""
    out = tmp_path / "vnni.npz"
    env = dict(os.environ, LOCALLLM_AMX="0")
    code = ("import sys, numpy as np; sys.path.insert(0, sys.argv[2]);"
            "from localllm import configure_process; cfg = configure_process();"
            "import test_amx as t; r = t.results();"
            "np.savez(sys.argv[1], path=np.array(cfg.kernel_path), **r)")
    proc = subprocess.run([sys.executable, "-c", code, str(out), str(Path(__file__).parent)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    want = results()
    with np.load(out) as got:
        assert str(got["path"]) == "avx512vnni"
        assert sorted(k for k in got.files if k != "path") == sorted(want)
        for key, y in want.items():
            assert np.isfinite(y).all() and np.abs(y).max() > 0, key
            assert_same_bits(y, got[key], f"tiles vs VNNI: {key}")
