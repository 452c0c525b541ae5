"""First-run kernel building: groups dealt to worker processes that fill Numba's cache."""

import os
import subprocess
import sys

from localllm.runtime import warm as cpu_warm


def test_groups_dealt_longest_first_to_the_least_loaded():
    jobs = ["ops", "matmul:Q4_1", "attention", "matmul:Q8_0"]
    shares = cpu_warm._deal(jobs, 2)
    assert shares[0] == ["attention"]
    assert sorted(shares[1]) == sorted(["ops", "matmul:Q4_1", "matmul:Q8_0"])
    assert cpu_warm._deal(jobs, 8) == [[j] for j in ["attention", "ops", "matmul:Q4_1",
                                                     "matmul:Q8_0"]]
    assert cpu_warm._deal(["ops"], 1) == [["ops"]]
    # the repacking kernels (one set for every format) go beside attention
    assert cpu_warm._deal(["ops", "pack", *jobs[1:]], 2) == [
        ["attention", "pack"], ["ops", "matmul:Q4_1", "matmul:Q8_0"]]


def test_model_formats(smollm_path, gemma_path):
    assert cpu_warm.model_formats(smollm_path) == ["Q4_1", "Q8_0"]
    assert cpu_warm.model_formats(gemma_path) == ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]


def _worker(cache, *jobs):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "localllm.runtime.warm", *jobs],
                          env=env, capture_output=True, text=True, timeout=600)


_REAL_MATMUL = """
import numpy as np
from numba.core import event
from localllm.runtime.process import configure_process
configure_process(threads=1)
compiled = []
class Seen(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__qualname__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Seen())
from localllm.backends.cpu import CpuBackend
from localllm.formats import quants
be = CpuBackend()
N, K = 48, 512
raw = np.random.default_rng(0).integers(0, 256, N * quants.row_nbytes("Q4_0", K), np.uint8)
raw.reshape(N, -1)[:, :2] = 0  # scales of zero: no NaN from random f16 bits
w = be.upload_matrix("x", "Q4_0", raw, N, K)
be.linear(np.ones((3, K), np.float32), [w])
be.linear(np.ones((1, K), np.float32), [w])
print(sorted(set(compiled)))
"""


def test_worker_fills_the_cache_and_says_so(tmp_path):
    """Groups compile into the cache and are marked there; the matmul group compiles on a
    weight of zeros packed without the repacking kernels (the pack group builds those), so
    a real weight repacked and multiplied afterwards finds every kernel it needs."""
    jobs = ("ops", "pack", "matmul:Q4_0")
    first = _worker(tmp_path, *jobs)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == ["compiling", *[f"done {j}" for j in jobs]]
    # A second worker loads the groups from the cache: it never says 'compiling'.
    again = _worker(tmp_path, *jobs)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == [f"done {j}" for j in jobs]
    assert len(list(tmp_path.glob("*/warm/*"))) == 3
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", _REAL_MATMUL], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


def test_worker_failure_is_reported_and_marked(tmp_path):
    r = _worker(tmp_path, "matmul:NOPE")
    assert r.returncode == 1
    assert "failed matmul:NOPE" in r.stderr
    assert r.stdout.splitlines() == ["done matmul:NOPE"]
    assert [p.suffix for p in tmp_path.glob("*/warm/*")] == [".failed"]


def test_compile_profile_times_a_group_on_an_empty_cache():
    """scripts/compile_profile.py compiles a group in a fresh process on an empty cache (so
    it compiles even where this session's cache holds the group) and accounts its seconds:
    each function's own seconds within its inclusive ones, all within the group's."""
    import json
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "scripts" / "compile_profile.py"
    out = subprocess.run([sys.executable, str(script), "ops", "--json"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    (r,) = json.loads(out.stdout)
    assert r["group"] == "ops"
    names = {c["name"] for c in r["compiled"]}
    assert {"localllm.kernels.ops.rms_norm", "localllm.kernels.ops.rope"} <= names
    assert 0 < r["llvm_seconds"] < r["seconds"]
    for c in r["compiled"]:
        assert 0 <= c["exclusive"] <= c["inclusive"] <= r["seconds"]
    # exclusive seconds partition the compiling: together no more than the group's time
    assert sum(c["exclusive"] for c in r["compiled"]) <= r["seconds"]
    top = max(r["compiled"], key=lambda c: c["inclusive"])
    assert top["inclusive"] >= max(c["exclusive"] for c in r["compiled"])
