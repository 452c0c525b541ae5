"""Requests generated from the server's published OpenAPI schema (schemathesis, bounded in
examples) against a real `llm serve` process: none may get a 500 or a traceback."""

from __future__ import annotations

import re

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from localllm.testing.server_process import ServerProcess  # noqa: E402

# Generation requests cost model time; a 128-token context bounds each one.
EXAMPLES = {"POST": 20, "GET": 20, "DELETE": 20}
# A leak is a traceback or a path on the server's disk; a model's file name alone is not one.
LEAKS = re.compile(r"Traceback|\.py\b|site-packages|[/\\][^\s\"']*\.gguf")


@pytest.fixture(scope="module")
def server(smollm_path):
    s = ServerProcess(smollm_path, "-c", "128", "--parallel", "4", "--max-queue", "4")
    s.wait_ready()
    yield s
    s.stop()


def test_generated_requests_get_no_server_errors(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    failures: list[str] = []
    tried = 0
    for result in schema.get_all_operations():
        op = result.ok()
        examples = EXAMPLES.get(op.method.upper(), 10)

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case):
            nonlocal tried
            tried += 1
            r = case.call(base_url=server.url, timeout=300)
            if r.status_code >= 500 and r.status_code != 503 or LEAKS.search(r.text):
                failures.append(f"{case.method} {case.formatted_path} -> {r.status_code}: "
                                f"{r.text[:200]} (body {case.body!r:.200})")
        run()
    assert tried >= 60
    assert not failures, "\n".join(failures[:10])
    assert server.proc.poll() is None
