"""How the kernels are compiled: the project's ``njit``, whose on-disk cache opens on first
compile, and the settings of Numba's compiler that ``configure_process`` makes.

Numba's on-disk cache only notices edits to a kernel's own file, while these kernels inline
code from their neighbours (simd.py, unpack.py, ...). So compiled kernels are cached in a
directory named by a hash of all the kernel sources: any edit here starts a fresh cache.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import time
from pathlib import Path

import numba
from numba.core import caching
from numba.core import config as numba_config

_HASH_LEN = 16


@functools.cache
def source_hash() -> str:
    """A hash of every kernel source file (read once: the sources do not change under a
    running process)."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:_HASH_LEN]


def is_kernel_cache_dir(path: str | os.PathLike | None) -> bool:
    """Whether a directory is one named by the current kernel sources."""
    return bool(path) and Path(path).name == source_hash()


def active_cache_dir() -> str:
    """The kernel cache directory Numba compiles into (set by ``configure_process``).

    Raises:
        RuntimeError: the process has not been configured.
    """
    if not is_kernel_cache_dir(numba_config.CACHE_DIR):
        raise RuntimeError("the kernel cache is not set: call localllm.configure_process() first")
    return numba_config.CACHE_DIR


class _KernelLocator(caching.UserProvidedCacheLocator):
    """Numba's locator for its CACHE_DIR, without its fallbacks (the source tree, the user's
    Numba folder), which are not named by the kernel sources."""


class _KernelCacheImpl(caching.CompileResultCacheImpl):
    _locator_classes = [_KernelLocator]


class _FunctionCache(caching.FunctionCache):
    _impl_class = _KernelCacheImpl


class KernelCache(caching._Cache):
    """A kernel's on-disk cache, opened when the kernel first compiles (not when its module is
    imported) in the kernel cache directory: compiled code is stored only once
    ``configure_process`` has pointed Numba there, and before that the kernel is simply not
    cached. It follows Numba's CACHE_DIR if that changes."""

    def __init__(self, py_func):
        self._py_func = py_func
        self._dir = None                     # the CACHE_DIR self._open was opened for
        self._open: caching._Cache = caching.NullCache()
        self._enabled = True

    def _current(self) -> caching._Cache:
        d = numba_config.CACHE_DIR
        if d != self._dir:
            self._dir = d
            self._open = caching.NullCache()
            if is_kernel_cache_dir(d):
                try:
                    self._open = _FunctionCache(self._py_func)
                except RuntimeError:  # the directory cannot be written: compile, do not cache
                    pass
            if not self._enabled:
                self._open.disable()
        return self._open

    @property
    def cache_path(self):
        return self._current().cache_path

    def load_overload(self, sig, target_context):
        return self._current().load_overload(sig, target_context)

    def save_overload(self, sig, data):
        self._current().save_overload(sig, data)

    def enable(self):
        self._enabled = True
        self._current().enable()

    def disable(self):
        self._enabled = False
        self._current().disable()

    def flush(self):
        self._current().flush()


def njit(fn=None, *, cache: bool = False, **options):
    """``numba.njit`` for the project's kernels: with ``cache=True`` the kernel's on-disk
    cache is a ``KernelCache``, so importing a kernel module touches no file and Numba's cache
    setting is read when the kernel compiles.

    Args:
        fn: the function (when used as ``@njit`` without arguments).
        cache: keep compiled versions in the kernel cache directory.
        **options: numba.njit's options (parallel, inline, nogil, ...).
    Returns:
        The dispatcher (or a decorator that makes it).
    """
    def wrap(py_func):
        dispatcher = numba.njit(**options)(py_func)
        if cache and isinstance(dispatcher, numba.core.dispatcher.Dispatcher):  # not DISABLE_JIT
            dispatcher._cache = KernelCache(py_func)
        return dispatcher
    return wrap if fn is None else wrap(fn)


# ----------------------------------------------------------------------------- settings

def default_cache_root() -> Path:
    """Where kernel caches live unless NUMBA_CACHE_DIR says: the user's cache folder."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "localllm" / "numba"


def _prune(base: Path, current: Path, max_age_s: float = 30 * 86400) -> None:
    """Marks ``current`` as used and removes sibling builds unused for ``max_age_s``."""
    try:
        current.mkdir(parents=True, exist_ok=True)
        os.utime(current)
        now = time.time()
        for old in base.iterdir():
            if old != current and old.is_dir() and len(old.name) == _HASH_LEN \
                    and now - old.stat().st_mtime > max_age_s:
                shutil.rmtree(old, ignore_errors=True)
    except OSError:
        pass  # a read-only or shared cache location: nothing to tidy


def use_cache_dir(root: str | os.PathLike | None = None) -> str:
    """Point Numba's cache at the kernel cache directory under ``root``; idempotent.

    Args:
        root: the folder of kernel caches (None: NUMBA_CACHE_DIR when set, else the user's
            cache folder, where builds of other kernel versions unused for 30 days are
            removed).
    Returns:
        The kernel cache directory (``root`` / the kernel source hash).
    """
    current = numba_config.CACHE_DIR
    if root is None and is_kernel_cache_dir(current):
        return current  # already set
    if root is None and not current:
        root = default_cache_root()
        target = root / source_hash()
        _prune(root, target)
    else:
        target = Path(root if root is not None else current) / source_hash()
    numba_config.CACHE_DIR = str(target)
    return str(target)


def use_cpu_features(features: str) -> str:
    """Compile the kernels for ``features`` (an LLVM feature string), as NUMBA_CPU_FEATURES
    would have.

    Numba builds its JIT's target machine when the first dispatcher is made, which for the
    kernels is when their modules are imported; while nothing has been compiled yet that
    target machine is rebuilt for the new features.

    Returns:
        The features the JIT compiles for (the old ones where code was already compiled).
    """
    from numba.core import codegen
    from numba.core.registry import cpu_target
    from numba.core.runtime import nrt

    built = "_toplevel_target_context" in cpu_target.__dict__
    if built and nrt.rtsys._init:  # code is compiled: its target stays
        return cpu_target.target_context.codegen()._tm_features
    numba_config.CPU_FEATURES = features
    if built:
        ctx = cpu_target.target_context
        ctx._internal_codegen = codegen.JITCPUCodegen("numba.exec")
    return features


def use_host_features() -> str | None:
    """On arm64, compile for the dot-product extension the OS reports and LLVM's host string
    omits, unless NUMBA_CPU_FEATURES already says what to build for; idempotent.

    Returns:
        The feature string the kernels compile for (None: the host's own, as LLVM sees it).
    """
    from . import hostcpu
    if numba_config.CPU_FEATURES is None and hostcpu.arm_dotprod():
        features = hostcpu.compile_features(hostcpu.llvm_host_features(), True)
        if features is not None:
            use_cpu_features(features)
    return numba_config.CPU_FEATURES
