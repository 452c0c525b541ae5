"""A server compiles its kernels while it loads, grammar kernels included: on a kernel cache
that lacks them, its first constrained request compiles nothing (the /metrics counter of
compiles does not move) and its answer is the constrained one."""

import json
import shutil

from localllm.kernels.jit import active_cache_dir
from localllm.testing.server_process import ServerProcess

GRAMMAR_KERNELS = "grammar."   # kernels/grammar.py's entries in the kernel cache


def _cache_without_grammar(tmp_path):
    """A kernel cache root holding this session's compiled kernels but the grammar ones."""
    src = active_cache_dir()
    root = tmp_path / "kernels"
    dest = root / src.rstrip("/").rsplit("/", 1)[-1]
    shutil.copytree(src, dest, ignore=lambda d, names: [
        n for n in names if n.startswith(GRAMMAR_KERNELS) or n == "warm"])
    assert not list(dest.rglob(GRAMMAR_KERNELS + "*"))
    return root, dest


def test_first_constrained_request_compiles_nothing(smollm_path, tmp_path):
    root, cache = _cache_without_grammar(tmp_path)
    s = ServerProcess(smollm_path, "-c", "512", "--parallel", "1",
                      env={"NUMBA_CACHE_DIR": str(root)})
    try:
        s.wait_ready()
        before = s.metrics()["localllm_kernel_compiles_total"]
        with s.client() as c:
            r = c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Give me a JSON object."}],
                "response_format": {"type": "json_object"}, "max_tokens": 24,
                "temperature": 0})
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["message"]["content"]
        after = s.metrics()["localllm_kernel_compiles_total"]
    finally:
        s.stop()
    assert after == before, f"{after - before} kernel(s) compiled while the request waited"
    assert list(cache.rglob(GRAMMAR_KERNELS + "*.nbc")), "the load did not build the grammar"
    assert text.startswith("{")
    if r.json()["choices"][0]["finish_reason"] == "stop":
        json.loads(text)
