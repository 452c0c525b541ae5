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


def test_model_formats(smollm_path, gemma_path):
    assert cpu_warm.model_formats(smollm_path) == ["Q4_1", "Q8_0"]
    assert cpu_warm.model_formats(gemma_path) == ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]


def _worker(cache, *jobs):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "localllm.runtime.warm", *jobs],
                          env=env, capture_output=True, text=True, timeout=600)


def test_worker_fills_the_cache_and_says_so(tmp_path):
    first = _worker(tmp_path, "ops", "matmul:Q4_0")
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == ["compiling", "done ops", "done matmul:Q4_0"]
    # A second worker loads both groups from the cache: it never says 'compiling'.
    again = _worker(tmp_path, "ops", "matmul:Q4_0")
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines() == ["done ops", "done matmul:Q4_0"]
    assert len(list(tmp_path.glob("*/warm/*"))) == 2


def test_worker_failure_is_reported_and_marked(tmp_path):
    r = _worker(tmp_path, "matmul:NOPE")
    assert r.returncode == 1
    assert "failed matmul:NOPE" in r.stderr
    assert r.stdout.splitlines() == ["done matmul:NOPE"]
    assert [p.suffix for p in tmp_path.glob("*/warm/*")] == [".failed"]
