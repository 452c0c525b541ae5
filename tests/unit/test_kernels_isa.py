"""Every instruction-set path of the kernels gives the same bits: one subprocess per path this
host can run, each with Numba's compile target forced, compared with this process's results."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import llvmlite.binding as llvm
import numpy as np
import pytest
from numba.core import config

from localllm.testing import kernel_data
from localllm.kernels import hostcpu, simd

_X86_BASE = "+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+popcnt,+sse4.2,+ssse3,+sse4.1"

# path -> (environment forcing Numba's target, or None for the host's own; host features needed)
PATHS = {
    "avx512vnni": (None, {"avx512f", "avx512bw", "avx512vl", "avx512vnni"}),
    "avxvnni": ({"NUMBA_CPU_NAME": "alderlake", "NUMBA_CPU_FEATURES": _X86_BASE + ",+avxvnni"},
                {"avx", "avx2", "fma", "f16c", "avxvnni", "bmi", "bmi2", "popcnt"}),
    "avx2": ({"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": _X86_BASE},
             {"avx", "avx2", "fma", "f16c", "bmi", "bmi2", "popcnt"}),
    "generic": ({"NUMBA_CPU_NAME": "generic"}, set()),
}
CHILD_TIMEOUT_S = 900  # a cold child compiles every kernel for its target (~35 s here)


def host_features() -> set[str]:
    return {name for name, on in llvm.get_host_cpu_features().items() if on}


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def skip_reason(path: str) -> str | None:
    env, needed = PATHS[path]
    if path != "generic" and not is_x86():
        return f"{path} needs an x86-64 host"
    missing = needed - host_features()
    if missing:
        return f"host lacks {sorted(missing)}"
    if env is None and simd.select_isa(frozenset(host_features())) != path:
        return f"the host's own path is {simd.select_isa(frozenset(host_features()))}"
    return None


def kernel_sources() -> list[Path]:
    """matmul.py and every kernel module it imports, directly or not."""
    kdir = Path(simd.__file__).parent
    todo, seen = ["matmul"], set()
    while todo:
        mod = todo.pop()
        if mod in seen or not (kdir / f"{mod}.py").exists():
            continue
        seen.add(mod)
        text = (kdir / f"{mod}.py").read_text()
        for name, names in re.findall(r"^from \.(\w*) import ([^\n]+)", text, re.M):
            todo.extend([name] if name else re.findall(r"\w+", names))
    return [kdir / f"{m}.py" for m in sorted(seen)]


def cache_root() -> Path:
    """Persistent Numba caches for the forced targets, one set per version of the kernel sources.

    Numba's cache only notices edits to the file that defines a jitted function, not to the
    modules it inlines from, so keying on all of them keeps stale builds out.
    """
    digest = hashlib.sha256()
    for src in kernel_sources():
        digest.update(src.name.encode() + b"\0" + src.read_bytes())
    base = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
            / "localllm" / "test-numba" / "matmul")
    root = base / digest.hexdigest()[:16]
    root.mkdir(parents=True, exist_ok=True)
    os.utime(root)
    for old in base.iterdir():  # builds for kernel sources unused for a week
        if old != root and old.is_dir() and time.time() - old.stat().st_mtime > 7 * 86400:
            shutil.rmtree(old, ignore_errors=True)
    return root


def run_child(path: str, out_dir: Path, cache: Path) -> tuple[subprocess.CompletedProcess, Path]:
    forced, _ = PATHS[path]
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")}
    if forced is not None:
        env.update(forced)
        env["NUMBA_CACHE_DIR"] = str(cache / path)
    out = out_dir / f"{path}.npz"
    script = Path(kernel_data.__file__).resolve()
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env, cwd=out_dir,
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    return proc, out


@pytest.fixture(scope="module")
def isa_runs(request, tmp_path_factory):
    """This process's results and, per selected runnable path, a future of its child's output."""
    out_dir = tmp_path_factory.mktemp("isa")
    cache = cache_root()
    selected = {item.callspec.params["path"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_isa_path_gives_identical_bits"}
    runnable = [p for p in PATHS if p in selected and skip_reason(p) is None]
    # Children with their own caches start first; the host-target child shares this process's
    # cache, so it starts after this process has built (or loaded) the kernels.
    forced = [p for p in runnable if PATHS[p][0] is not None]
    host = [p for p in runnable if PATHS[p][0] is None]
    # All children at once, up to one per core: cold, each is a single-threaded compile.
    with ThreadPoolExecutor(max_workers=max(1, min(len(runnable), os.cpu_count() or 1))) as pool:
        futures = {p: pool.submit(run_child, p, out_dir, cache) for p in forced}
        expected = kernel_data.isa_results()
        futures.update({p: pool.submit(run_child, p, out_dir, cache) for p in host})
        yield expected, futures
        for f in futures.values():
            f.cancel()


@pytest.mark.parametrize("path", list(PATHS))
def test_isa_path_gives_identical_bits(isa_runs, path):
    reason = skip_reason(path)
    if reason:
        pytest.skip(reason)
    expected, futures = isa_runs
    proc, out = futures[path].result()
    assert proc.returncode == 0, proc.stderr[-4000:]
    with np.load(out) as got:
        assert str(got["isa"]) == path, f"child compiled for {got['isa']}, not {path}"
        assert sorted(k for k in got.files if k != "isa") == sorted(expected)
        for key, want in expected.items():
            kernel_data.assert_same_bits(got[key], want, f"{path} vs {simd.ISA}: {key}")


def test_workload_is_finite_and_nontrivial(isa_runs):
    expected, _ = isa_runs
    assert len(expected) == 2 * len(kernel_data.FORMATS)
    for key, y in expected.items():
        assert np.isfinite(y).all() and np.abs(y).max() > 0, key


# ----------------------------------------------------------------------------- select_isa

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx2", "avx", "fma"}


@pytest.mark.parametrize("features,machine,want", [
    (AVX512, "x86_64", "avx512vnni"),
    (AVX512 | {"avxvnni"}, "x86_64", "avx512vnni"),
    (AVX512, "AMD64", "avx512vnni"),
    (AVX512 - {"avx512vnni"}, "x86_64", "avx2"),
    (AVX512 - {"avx512vl"} | {"avxvnni"}, "x86_64", "avxvnni"),
    ({"avxvnni", "avx2", "avx", "fma"}, "x86_64", "avxvnni"),
    ({"avxvnni"}, "x86_64", "generic"),
    ({"avx2", "avx"}, "x86_64", "avx2"),
    ({"sse4.2", "avx"}, "x86_64", "generic"),
    (set(), "x86_64", "generic"),
    ({"dotprod", "neon"}, "aarch64", "neon-dot"),
    ({"dotprod"}, "arm64", "neon-dot"),
    ({"neon"}, "aarch64", "generic"),
    (AVX512, "aarch64", "generic"),
    ({"dotprod"}, "x86_64", "generic"),
    ({"avx2"}, "riscv64", "generic"),
])
def test_select_isa(features, machine, want):
    assert simd.select_isa(frozenset(features), machine) == want


def test_target_features_follow_numba_setting(monkeypatch):
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,-avx512f,+fma")
    assert simd.target_features() == frozenset({"avx2", "fma"})
    monkeypatch.setattr(config, "CPU_FEATURES", "")
    assert simd.target_features() == frozenset()
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    assert simd.target_features() == frozenset(host_features())


def test_module_isa_matches_target():
    assert simd.ISA == simd.select_isa()
    assert simd.ISA in ("avx512vnni", "avxvnni", "avx2", "neon-dot", "generic")


# ----------------------------------------------------------------------------- arm64 dot product

_A76_CPUINFO = """processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer\t: 0x41
"""
_A72_CPUINFO = _A76_CPUINFO.replace(" asimddp", "").replace("asimdrdm lrcpc dcpop", "")


@pytest.mark.parametrize("machine,cpuinfo,want", [
    ("aarch64", _A76_CPUINFO, True),
    ("aarch64", _A72_CPUINFO, False),
    ("aarch64", "", False),
    ("x86_64", _A76_CPUINFO, False),  # only arm64 asks
])
def test_arm_dotprod_from_linux_cpuinfo(machine, cpuinfo, want):
    assert hostcpu.arm_dotprod(machine, "Linux", cpuinfo) is want


def test_compile_features_add_dotprod_only_where_missing():
    assert hostcpu.compile_features("+neon,+fp-armv8", True) == "+neon,+fp-armv8,+dotprod"
    assert hostcpu.compile_features("+neon,-dotprod", True) == "+neon,+dotprod"
    assert hostcpu.compile_features("+neon,+dotprod", True) is None
    assert hostcpu.compile_features("+neon", False) is None
    # The string the kernels then compile for selects the dot-product path.
    feats = frozenset(f[1:] for f in hostcpu.compile_features("+neon", True).split(","))
    assert simd.select_isa(feats, "aarch64") == "neon-dot"
