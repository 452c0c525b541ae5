"""Numba kernels over numpy arrays: quantized matmul per GGUF format, attention over the KV
cache, row operations, and the SIMD building blocks they share.

Numba's on-disk cache only notices edits to a kernel's own file, while these kernels inline
code from their neighbours (simd.py, unpack.py, ...). So compiled kernels are cached in a
directory named by a hash of all the kernel sources: any edit here starts a fresh cache.
"""

import hashlib
import os
from pathlib import Path

from numba.core import config as _numba_config


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


CACHE_DIR = str(_cache_base() / _source_hash())
_numba_config.CACHE_DIR = CACHE_DIR
