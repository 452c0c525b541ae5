"""Shared fixtures: the two real models, fetched once into the user cache. The test process
is configured as load() and the CLI configure theirs, before any test compiles a kernel."""

import pytest

from localllm import configure_process
from localllm.formats.fetch import fetch

configure_process()  # the kernel cache, compile target, allocator; Numba's thread count stays


@pytest.fixture(scope="session")
def smollm_path():
    return fetch("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def gemma_path():
    return fetch("gemma3-270m", quiet=True)


@pytest.fixture(scope="session")
def metas(smollm_path, gemma_path):
    """Both real models' metadata (read once)."""
    from localllm.formats.gguf import GGUFFile
    files = {"smollm": GGUFFile(smollm_path), "gemma": GGUFFile(gemma_path)}
    yield {k: f.metadata for k, f in files.items()}
    for f in files.values():
        f.close()
