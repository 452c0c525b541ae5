"""CPU features the operating system reports but LLVM's host detection misses: on arm64 the
dot-product instructions (sdot/udot), which LLVM's feature string never lists on Linux or macOS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform


def _linux_features(cpuinfo: str) -> set[str]:
    """The flags of the first 'Features' line of /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Features":
            return set(value.split())
    return set()


def _macos_sysctl(name: str) -> int:
    """An integer sysctl by name (0 where it does not exist)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    value = ctypes.c_int(0)
    size = ctypes.c_size_t(ctypes.sizeof(value))
    if libc.sysctlbyname(name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0) != 0:
        return 0
    return value.value


def arm_dotprod(machine: str | None = None, system: str | None = None,
                cpuinfo: str | None = None) -> bool:
    """Whether this arm64 CPU has the Armv8.2 dot-product instructions, as the OS says:
    'asimddp' among /proc/cpuinfo's features on Linux, hw.optional.arm.FEAT_DotProd on macOS.

    Args:
        machine, system: platform.machine() / platform.system() (None: this host's).
        cpuinfo: /proc/cpuinfo text (None: read it on Linux).
    Returns:
        False on other architectures or where the OS does not say.
    """
    machine = (machine or platform.machine()).lower()
    system = system or platform.system()
    if machine not in ("arm64", "aarch64"):
        return False
    try:
        if system == "Darwin":
            return _macos_sysctl("hw.optional.arm.FEAT_DotProd") == 1
        if cpuinfo is None:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        return "asimddp" in _linux_features(cpuinfo)
    except (OSError, AttributeError, TypeError):
        return False


def compile_features(host_features: str, dotprod: bool) -> str | None:
    """The feature string to compile the kernels for: LLVM's host features plus '+dotprod'
    where the OS reports it and LLVM did not (None: the host's own string will do)."""
    if not dotprod or "+dotprod" in host_features.split(","):
        return None
    return ",".join([f for f in host_features.split(",") if f and f != "-dotprod"] + ["+dotprod"])


@functools.cache
def llvm_host_features() -> str:
    """LLVM's feature string for this host ('' where LLVM cannot detect them)."""
    import llvmlite.binding as llvm
    try:
        return llvm.get_host_cpu_features().flatten()
    except RuntimeError:  # no feature detection for this host in LLVM
        return ""
