"""Shared fixtures: the two real models, fetched once into the user cache."""

import pytest

from localllm.fetch import fetch


@pytest.fixture(scope="session")
def smollm_path():
    return fetch("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def gemma_path():
    return fetch("gemma3-270m", quiet=True)
