"""A large /v1/embeddings request beside a streamed chat completion on a real server: its
passes run between the stream's decode steps, so the stream keeps producing tokens, and
neither the vectors nor the chat's tokens change for it."""

from __future__ import annotations

import asyncio
import base64
import json
import threading

import numpy as np
import pytest

pytest.importorskip("fastapi")

from localllm.apps.server.errors import APIError  # noqa: E402
from localllm.apps.server.metrics import Metrics  # noqa: E402
from localllm.apps.server.scheduler import Limits, Scheduler  # noqa: E402
from localllm.errors import EmptyPrompt  # noqa: E402
from localllm.testing.server_process import ServerProcess  # noqa: E402

N_INPUTS = 200
CHAT = {"messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": 64, "temperature": 0, "seed": 7, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(smollm_path):
    # A small batch (64 tokens) cuts the embedding request into many passes beside a stream.
    s = ServerProcess(smollm_path, "-c", "1024", "--parallel", "1", "-b", "64")
    s.wait_ready()
    yield s
    s.stop()


def _texts() -> list[str]:
    return [f"Sentence number {i} is about {'rivers' if i % 3 else 'mountains'} and "
            f"the colour {('red', 'green', 'blue', 'amber')[i % 4]}." for i in range(N_INPUTS)]


def _embed(http, texts: list[str]) -> list[np.ndarray]:
    r = http.post("/v1/embeddings", json={"input": texts, "encoding_format": "base64"},
                  timeout=120)
    assert r.status_code == 200, r.text
    return [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in r.json()["data"]]


def _stream_chat(http, log: list, lock: threading.Lock, started: threading.Event) -> str:
    """The chat's text, appending ("token", piece) to ``log`` as each chunk arrives."""
    text = []
    with http.stream("POST", "/v1/chat/completions", json=CHAT, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if delta:
                with lock:
                    log.append(("token", delta))
                    if sum(1 for e in log if e[0] == "token") >= 3:
                        started.set()
                text.append(delta)
    started.set()
    return "".join(text)


def test_stream_keeps_decoding_during_a_large_embedding_request(server, smollm_model):
    texts = _texts()
    with server.client() as http:
        alone_chat = _stream_chat(http, [], threading.Lock(), threading.Event())
        alone_vectors = _embed(http, texts)

    log: list = []
    lock = threading.Lock()
    started = threading.Event()
    result: dict = {}

    def chat():
        with server.client() as http:
            result["chat"] = _stream_chat(http, log, lock, started)
    t = threading.Thread(target=chat)
    t.start()
    try:
        assert started.wait(120), "the stream produced no tokens"
        with server.client() as http:
            with lock:
                log.append(("embed_sent", None))
            vectors = _embed(http, texts)
            with lock:
                log.append(("embed_done", None))
    finally:
        t.join(120)
    assert not t.is_alive()

    kinds = [k for k, _ in log]
    sent, done = kinds.index("embed_sent"), kinds.index("embed_done")
    during = kinds[sent:done].count("token")
    # Run whole between two decode steps, the request would let through only the tokens
    # already on their way; a pass per turn lets the stream go on while it runs.
    assert during >= 10, f"the stream got {during} tokens while the embeddings ran: {kinds}"

    assert result["chat"] == alone_chat
    assert len(vectors) == N_INPUTS
    for got, want in zip(vectors, alone_vectors):
        np.testing.assert_array_equal(got, want)
    local = smollm_model.embed(texts)
    for got, want in zip(vectors, local):
        np.testing.assert_array_equal(got, want)


class _Counted:
    """Passes of one input each, counted; each waits for ``go`` once it has begun."""

    def __init__(self, n: int, fail_at: int | None = None):
        self.n, self.ran, self.fail_at = n, 0, fail_at
        self.began, self.go = threading.Event(), threading.Event()

    @property
    def done(self) -> bool:
        return self.ran >= self.n

    def next_pass_tokens(self) -> int:
        return 16

    def step(self, limit=None) -> int:
        self.ran += 1
        if self.ran == self.fail_at:
            raise EmptyPrompt("input 1 has no tokens", param="input")
        self.began.set()
        self.go.wait(30)
        return 1


def test_a_cancelled_embedding_request_runs_no_further_pass(smollm_model):
    model = smollm_model.with_kv("f16", "f16")   # the session's weights, a cache of its own
    sched = Scheduler(lambda: model, Limits(), Metrics())
    sched.start()

    async def main():
        while sched.state == "loading":
            await asyncio.sleep(0.01)
        left = _Counted(100)
        work = sched.submit_passes(lambda m: left, lambda p: "all")
        await asyncio.get_running_loop().run_in_executor(None, left.began.wait, 30)
        work.cancel()            # the client leaves while the first pass runs
        left.go.set()
        failing = _Counted(3, fail_at=2)
        failing.go.set()
        bad = sched.submit_passes(lambda m: failing, lambda p: "all")
        after = _Counted(2)
        after.go.set()
        good = sched.submit_passes(lambda m: after, lambda p: "all")
        with pytest.raises(APIError) as e:   # a pass's error maps as a request's would
            await asyncio.wait_for(bad.future, 30)
        assert e.value.status == 400
        assert await asyncio.wait_for(good.future, 30) == "all"
        return left.ran, failing.ran, after.ran

    try:
        # Work runs oldest first, so the later ones finishing means the cancelled one is gone.
        assert asyncio.run(main()) == (1, 2, 2)
    finally:
        sched.shutdown()
        sched.join(10)
