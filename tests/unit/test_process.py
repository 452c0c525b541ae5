"""Importing localllm changes nothing in the process; configure_process sets the kernels'
cache, compile target, threads and allocator, and kernels imported before it still cache in
the directory named by the kernel sources. Each case runs in a fresh interpreter."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import llvmlite.binding as llvm
import numba
import pytest
from numba.core import config

from localllm import configure_process
from localllm.kernels import jit

ROOT = Path(__file__).resolve().parents[2]  # the checkout
_X86_BASE = "+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+popcnt,+sse4.2,+ssse3,+sse4.1"
# What a parent process (this one, configured by conftest) may have put in the environment.
_PROCESS_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "NUMBA_CACHE_DIR", "NUMBA_CPU_NAME",
                 "NUMBA_CPU_FEATURES", "NUMBA_NUM_THREADS")


def clean_env(tmp_path: Path, **extra) -> dict:
    """This environment without the process settings, with a cache home of its own."""
    env = {k: v for k, v in os.environ.items() if k not in _PROCESS_VARS}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), **extra)
    return env


def child(code: str, env: dict, *args: str) -> dict:
    """Run ``code`` with ``args`` in a fresh interpreter; it prints one JSON line last."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.splitlines()[-1])


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


_IMPORT_ALL = """
    import importlib, json, os, pkgutil
    from pathlib import Path
    env = dict(os.environ)
    import numba
    from numba.core import config
    before = {"cache_dir": config.CACHE_DIR, "cpu_features": config.CPU_FEATURES}
    import localllm
    tree = Path(localllm.__file__).parent
    nb_files = lambda: sorted(str(p) for p in tree.rglob("*.nb[ic]"))
    nb_before = nb_files()
    imported, skipped = [], []
    for m in pkgutil.walk_packages(localllm.__path__, "localllm."):
        try:
            importlib.import_module(m.name)
            imported.append(m.name)
        except ImportError as e:  # an optional extra (mlx off Apple silicon)
            skipped.append(f"{m.name}: {e}")
    print(json.dumps({
        "imported": imported, "skipped": skipped,
        "env_changed": sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)),
        "before": before, "cache_dir": config.CACHE_DIR, "cpu_features": config.CPU_FEATURES,
        "threads": numba.get_num_threads(), "numba_threads": config.NUMBA_NUM_THREADS,
        "numba_files_added": sorted(set(nb_files()) - set(nb_before))}))
"""


def test_importing_every_module_changes_nothing(tmp_path):
    # Three threads, unlike any core count a backend would pick: a thread change shows.
    got = child(_IMPORT_ALL, clean_env(tmp_path, NUMBA_NUM_THREADS="3"))
    assert len(got["imported"]) > 60, got["skipped"]
    assert all(name.startswith("localllm.backends.mlx") for name in got["skipped"]), got["skipped"]
    assert {"localllm.api", "localllm.backends.cpu", "localllm.kernels.matmul",
            "localllm.runtime.warm", "localllm.apps.cli"} <= set(got["imported"])
    assert got["env_changed"] == []
    assert got["cache_dir"] == got["before"]["cache_dir"] == ""
    assert got["cpu_features"] == got["before"]["cpu_features"]
    assert got["threads"] == got["numba_threads"] == 3
    assert files_under(tmp_path / "xdg") == []     # no kernel cache folder made or pruned
    assert got["numba_files_added"] == []          # nor Numba cache files in the tree


_KERNEL = """
    import json, sys
    import numpy as np
    from localllm.kernels import ops     # imported before the process is configured
    from localllm.kernels.jit import source_hash
    from localllm import configure_process
    cfg = configure_process() if sys.argv[1:] == ["configure"] else None
    x = np.linspace(-1, 1, 64).astype(np.float32)
    out = np.empty_like(x)
    ops.rms_norm_row(x, x, 1e-6, out)
    d = ops.rms_norm_row
    print(json.dumps({"hits": sum(d.stats.cache_hits.values()),
                      "misses": sum(d.stats.cache_misses.values()),
                      "cache": None if cfg is None else cfg.kernel_cache,
                      "path": d._cache.cache_path, "hash": source_hash(),
                      "out": out.view(np.uint32).tolist()}))
"""


def test_kernels_imported_before_configure_cache_in_the_kernel_dir(tmp_path):
    cache = tmp_path / "numba"
    env = clean_env(tmp_path, NUMBA_CACHE_DIR=str(cache))
    # Unconfigured, a kernel runs but is not stored: no cache outside a source-named folder.
    bare = child(_KERNEL, env)
    assert bare["misses"] == 1 and bare["path"] is None
    assert files_under(cache) == []
    first = child(_KERNEL, env, "configure")
    kernel_dir = cache / first["hash"]
    assert first["cache"] == str(kernel_dir)
    assert first["misses"] == 1 and first["hits"] == 0
    assert Path(first["path"]).parent == kernel_dir
    assert any(name.endswith(".nbi") for name in files_under(kernel_dir))
    # A second process loads it without compiling, with the same bits.
    again = child(_KERNEL, env, "configure")
    assert again["hits"] == 1 and again["misses"] == 0
    assert again["out"] == first["out"] == bare["out"]


def _can_run_avx2() -> bool:
    have = {k for k, on in llvm.get_host_cpu_features().items() if on}
    return sys.platform.startswith("linux") and {"avx", "avx2", "fma", "f16c", "bmi", "bmi2"} <= have


@pytest.mark.skipif(not _can_run_avx2(), reason="needs an x86-64 host with AVX2")
def test_cpu_features_set_after_import_reach_the_compiler(tmp_path):
    """What configure_process does on arm64 (adding the dot-product extension), shown with
    a target this host can run: features set after the kernels are imported still decide
    what they compile for, until the first compile."""
    code = f"""
        import json
        import numpy as np
        from numba.core import config
        from numba.core.registry import cpu_target
        from localllm.backends import cpu          # every kernel's dispatcher exists now
        from localllm.kernels import jit, ops, simd
        from localllm import configure_process
        config.CPU_NAME = "haswell"
        set_to = jit.use_cpu_features("{_X86_BASE}")
        configure_process()
        x = np.linspace(-1, 1, 64).astype(np.float32)
        out = np.empty_like(x)
        ops.rms_norm_row(x, x, 1e-6, out)
        late = jit.use_cpu_features("+sse2")      # compiled code keeps its target
        print(json.dumps({{"set": set_to, "late": late, "isa": simd.isa(),
                          "config": config.CPU_FEATURES,
                          "jit": cpu_target.target_context.codegen()._tm_features,
                          "out": out.view(np.uint32).tolist()}}))
    """
    got = child(code, clean_env(tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "numba")))
    assert got["set"] == got["jit"] == got["late"] == got["config"] == _X86_BASE
    assert got["isa"] == "avx2"
    host = child(_KERNEL, clean_env(tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "host")), "configure")
    assert got["out"] == host["out"]


def test_configure_process_is_idempotent(tmp_path):
    cfg = configure_process()
    assert configure_process() == cfg
    assert Path(cfg.kernel_cache).name == jit.source_hash() == Path(config.CACHE_DIR).name
    assert jit.active_cache_dir() == cfg.kernel_cache
    if "OMP_WAIT_POLICY" not in os.environ:
        assert os.environ["GOMP_SPINCOUNT"] == "30000"
    root = Path(cfg.kernel_cache).parent
    threads = numba.get_num_threads()
    try:
        other = configure_process(threads=1, cache_dir=tmp_path)
        assert other.kernel_cache == str(tmp_path / jit.source_hash()) == config.CACHE_DIR
        assert other.threads == numba.get_num_threads() == 1
        assert configure_process(threads=1, cache_dir=tmp_path) == other
    finally:
        configure_process(threads=threads, cache_dir=root)
    assert configure_process() == cfg


def test_first_run_shows_the_compile_line(tmp_path, smollm_path):
    """`llm run` on an empty kernel cache: workers compile, and the progress line shows."""
    cache = tmp_path / "numba"
    env = clean_env(tmp_path, NUMBA_CACHE_DIR=str(cache))
    r = subprocess.run([sys.executable, "-m", "localllm.apps.cli", "run", str(smollm_path),
                        "-p", "Hi", "-n", "1", "--temp", "0"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    try:
        assert r.returncode == 0, r.stderr
        lines = r.stderr.splitlines()
        assert lines and all(line.startswith("compiling kernels for this CPU (first run only): ")
                             for line in lines), r.stderr
        # attention, ops, the repacking kernels, two matmuls
        assert lines[-1].split(": ")[1].startswith("5/5,")
        kernel_dir = cache / jit.source_hash()
        assert len([p for p in (kernel_dir / "warm").iterdir() if not p.suffix]) == 5
    finally:
        # The low-priority worker this run started on the fused block: not needed here.
        for pid_file in cache.glob("*/warm/*.pid"):
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
