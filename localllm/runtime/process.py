"""The process-wide settings the kernels run under: OpenMP's spin, the kernels' cache and
compile target, their thread count and the allocator. Nothing sets them on import; one
explicit ``configure_process`` does, when ``load()``, the CLI or a worker asks."""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass

from localllm.kernels import jit, simd

# glibc's mallopt parameters (malloc.h), and the values keep_scratch_memory sets: the largest
# mmap threshold glibc takes on 64-bit hosts, and what may stay free at the top of a heap.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 256 << 20


@dataclass(frozen=True)
class ProcessConfig:
    """What configure_process left the process with."""
    threads: int               # kernel threads
    kernel_cache: str          # the directory compiled kernels are kept in
    cpu_features: str | None   # the features kernels compile for (None: the host's own)
    isa: str                   # the kernels' dot-product path for them (simd.select_isa)
    scratch_kept: bool         # whether the allocator took keep_scratch_memory's settings


def configure_process(threads: int | None = None, *,
                      cache_dir: str | os.PathLike | None = None) -> ProcessConfig:
    """Set up this process to run the kernels; idempotent, and a no-op where already done.

    Call it before the first kernel runs: OpenMP reads its spin setting when Numba loads its
    threading layer, and the kernels compile into (and load from) the cache it names.

    Args:
        threads: kernel threads (clamped to the NUMBA_NUM_THREADS Numba started with; None:
            leave the count as it is).
        cache_dir: the folder of kernel caches (None: NUMBA_CACHE_DIR when set, else
            ~/.cache/localllm/numba); kernels go in a directory named by their sources' hash.
    Returns:
        The settings in effect.
    """
    import numba

    _bounded_spin()  # before anything below starts Numba's threads
    cache = jit.use_cache_dir(cache_dir)
    features = jit.use_host_features()
    n = set_threads(threads) if threads else numba.get_num_threads()
    return ProcessConfig(threads=n, kernel_cache=cache, cpu_features=features, isa=simd.isa(),
                         scratch_kept=keep_scratch_memory())


def _bounded_spin() -> None:
    """Let OpenMP workers spin a while between parallel regions, within a bound.

    A decode step runs many short parallel regions: OpenMP workers that sleep between them
    cost ~70 us each to wake, so they spin a while first (~2 us per region when the cores are
    free). Spinning without limit (OMP_WAIT_POLICY=ACTIVE) stalls badly when another process
    holds a core (~0.2-0.5 ms per region, measured); a bounded spin keeps that near 10 us.
    Read by libgomp when Numba loads its OpenMP layer (the first parallel kernel call).
    """
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "30000")


def set_threads(n: int) -> int:
    """Set the kernels' thread count (clamped to what Numba started with).

    Returns:
        The count set.
    """
    import numba
    n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n


def set_torch_threads(n: int) -> None:
    """Set torch's CPU threads (process-wide in torch) for a torch backend on the CPU, the
    stand-in for CUDA."""
    import torch
    if n:
        torch.set_num_threads(int(n))


def keep_scratch_memory(system: str | None = None) -> bool:
    """Keep freed blocks of up to 32 MB in the process instead of unmapping them (glibc).

    Every kernel call allocates its scratch (activations, attention scores) with malloc, and
    glibc serves blocks above its mmap threshold (128 KB at first) from fresh mappings that it
    unmaps on free: the next call faults every page in again, zeroed by the OS. A 256-token
    prompt chunk of SmolLM2-135M took some 32,000 page faults that way, a third of its time on
    a 2-core VM. With blocks up to 32 MB taken from the heap, and up to 256 MB free at a
    heap's top kept rather than trimmed, the same chunk takes none. The peak of memory in use
    is unchanged; what was freed stays mapped for the next call.

    Args:
        system: platform.system()'s answer (None: this host's).
    Returns:
        Whether the allocator took the settings (False off glibc: macOS, musl).
    """
    if (system or platform.system()) != "Linux":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
            and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) == 1)


class _CompileCounter:
    """Numba's compile events, outermost only (a kernel's callees compile inside it)."""

    def __init__(self):
        from numba.core import event

        counter = self
        self.count = 0
        self._depth = 0

        class Listener(event.Listener):
            def on_start(self, ev):
                counter._depth += 1

            def on_end(self, ev):
                counter._depth -= 1
                counter.count += counter._depth == 0
        event.register("numba:compile", Listener())


_counter: _CompileCounter | None = None


def count_compiles() -> None:
    """Start counting this process's kernel compiles (see ``compiles``); idempotent."""
    global _counter
    if _counter is None:
        _counter = _CompileCounter()


def compiles() -> int:
    """Kernels compiled (not loaded from the kernel cache) in this process since
    ``count_compiles`` was first called (0 before): each kept whatever waited for it waiting."""
    return _counter.count if _counter is not None else 0
