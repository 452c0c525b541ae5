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
def smollm_model(smollm_path):
    """SmolLM2 loaded once for the session (CPU backend, 1024 tokens of context, 2 threads).
    Modules take a view with a KV cache of its own (``with_kv``), so the weights are shared
    and no module sees another's cached prefixes."""
    import localllm
    m = localllm.load(smollm_path, ctx_size=1024, threads=2, backend="cpu")
    yield m
    m.close()


@pytest.fixture(scope="session")
def gemma_model(gemma_path):
    """Gemma-3 loaded once for the session (CPU backend, 4096 tokens of context, 2 threads);
    modules take views with KV caches of their own, as for ``smollm_model``."""
    import localllm
    m = localllm.load(gemma_path, ctx_size=4096, threads=2, backend="cpu")
    yield m
    m.close()


@pytest.fixture(scope="session")
def metas(smollm_path, gemma_path):
    """Both real models' metadata (read once)."""
    from localllm.formats.gguf import GGUFFile
    files = {"smollm": GGUFFile(smollm_path), "gemma": GGUFFile(gemma_path)}
    yield {k: f.metadata for k, f in files.items()}
    for f in files.values():
        f.close()
