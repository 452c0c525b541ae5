"""Numba kernels over numpy arrays: quantized matmul per GGUF format, attention over the KV
cache, row operations, and the SIMD building blocks they share.

Numba's on-disk cache only notices edits to a kernel's own file, while these kernels inline
code from their neighbours (simd.py, unpack.py, ...). So compiled kernels are cached in a
directory named by a hash of all the kernel sources: any edit here starts a fresh cache.
Builds of other versions in the default location are removed once unused for 30 days.

On arm64 the dot-product extension is taken from the OS (LLVM's host feature string omits it)
and handed to the compiler, unless NUMBA_CPU_FEATURES already says what to build for.
"""

import hashlib
import os
import shutil
import time
from pathlib import Path

from numba.core import config as _numba_config

from . import hostcpu as _hostcpu


def _source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _cache_base() -> Path:
    if _numba_config.CACHE_DIR:
        return Path(_numba_config.CACHE_DIR)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "localllm" / "numba"


def _prune(base: Path, current: Path, max_age_s: float = 30 * 86400) -> None:
    """Marks ``current`` as used and removes sibling builds unused for ``max_age_s``."""
    try:
        current.mkdir(parents=True, exist_ok=True)
        os.utime(current)
        now = time.time()
        for old in base.iterdir():
            if old != current and old.is_dir() and len(old.name) == 16 \
                    and now - old.stat().st_mtime > max_age_s:
                shutil.rmtree(old, ignore_errors=True)
    except OSError:
        pass  # a read-only or shared cache location: nothing to tidy


_USER_DIR = bool(_numba_config.CACHE_DIR)
CACHE_DIR = str(_cache_base() / _source_hash())
if not _USER_DIR:
    _prune(_cache_base(), Path(CACHE_DIR))
_numba_config.CACHE_DIR = CACHE_DIR


def _host_features() -> str:
    import llvmlite.binding as llvm
    try:
        return llvm.get_host_cpu_features().flatten()
    except RuntimeError:  # no feature detection for this host in LLVM
        return ""


if _numba_config.CPU_FEATURES is None and _hostcpu.arm_dotprod():
    _numba_config.CPU_FEATURES = _hostcpu.compile_features(_host_features(), True)
