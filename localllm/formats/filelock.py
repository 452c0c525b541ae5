"""Marking a file as in use by this process (an exclusive lock, released when the process
dies), and telling the files a killed process left behind from those still being written."""

from __future__ import annotations

import os
from typing import IO

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: nothing is marked, nothing is swept
    fcntl = None


def hold(f: IO) -> None:
    """Marks open file `f` as this process's until it is closed."""
    if fcntl is not None:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)


def abandoned(path: str | os.PathLike) -> bool:
    """Whether `path` exists and no live process holds it (always False where there are no
    locks, so nothing is taken for abandoned)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # held: being written
    finally:
        os.close(fd)
