"""CPU features the operating system reports but LLVM's host detection misses (on arm64 the
dot-product instructions, sdot/udot, which LLVM's feature string never lists on Linux or
macOS), and those the OS must be asked for before use (Intel AMX's tile registers on Linux).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
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


_SYS_ARCH_PRCTL = 158          # x86-64 Linux
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
AMX_FEATURES = ("amx-tile", "amx-int8")


@functools.cache
def amx_permission() -> bool:
    """Ask Linux for this process's AMX tile data state (arch_prctl ARCH_REQ_XCOMP_PERM),
    which it must grant before any thread runs a tile instruction; asked once per process.

    Returns:
        Whether it was granted (False on other systems, or where LOCALLLM_AMX=0 says not to
        use AMX).
    """
    if os.environ.get("LOCALLLM_AMX", "1") == "0":
        return False
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def without_amx(features: str) -> str:
    """An LLVM feature string with the AMX features turned off."""
    amx = {f[1:] for f in features.split(",") if f[1:].startswith("amx-")}
    kept = [f for f in features.split(",") if f and f[1:] not in amx]
    return ",".join(kept + [f"-{f}" for f in sorted(amx)])
