"""Servers more than one module uses, started once per session."""

import pytest

from localllm.testing.server_process import ServerProcess


@pytest.fixture(scope="session")
def tool_server(smollm_path):
    """SmolLM2 served with 1024 tokens of context and one slot: the tool-calling tests."""
    s = ServerProcess(smollm_path, "-c", "1024", "--parallel", "1")
    s.wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def tool_client(tool_server):
    """The real openai client on ``tool_server``."""
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    yield c
    c.close()
