"""`llm serve --parallel 4` under load, as clients see it: concurrent streams share forward
passes without mixing, n choices fork one prompt, JSON output is constrained while other
requests run, and clients that leave, trickle or flood leave nothing behind."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from localllm.testing.server_process import ServerProcess  # noqa: E402

TIMEOUT = 1.5          # --request-timeout of the server under test
CONNECTIONS = 24       # --max-connections


@pytest.fixture(scope="module")
def server(smollm_path):
    s = ServerProcess(smollm_path, "-c", "1024", "--parallel", "4", "--max-queue", "8",
                      "--request-timeout", str(TIMEOUT), "--max-connections", str(CONNECTIONS))
    s.wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield c
    c.close()


def _story(client, i: int, seed: int, max_tokens: int = 24, **kw) -> str:
    r = client.completions.create(model="smollm2-135m", prompt=f"Story {i}: once", seed=seed,
                                  max_tokens=max_tokens, temperature=0.9, **kw)
    return r.choices[0].text


def _together(fn, n: int) -> list:
    """fn(0..n-1) on n threads at once; their results in order."""
    out: list = [None] * n
    errors: list = []

    def run(i):
        try:
            out[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def _wait_idle(server, blocks_used: float, timeout: float = 30) -> dict:
    """Poll /metrics until nothing runs or waits and the KV blocks in use are back."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["localllm_requests_running"] == m["localllm_requests_waiting"] == 0
                and m["localllm_kv_blocks_used"] == blocks_used):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle: {m}")
        time.sleep(0.05)


# ----------------------------------------------------------------------------- batching

def test_concurrent_streams_never_mix(client):
    together = _together(lambda i: _story(client, i, seed=100 + i), 4)
    alone = [_story(client, i, seed=100 + i) for i in range(4)]
    assert together == alone
    assert len(set(alone)) == 4


def test_n_choices_fork_the_prompt(client):
    r = client.completions.create(model="smollm2-135m", prompt="Story 7: once", seed=40, n=3,
                                  max_tokens=16, temperature=0.9)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    # choice i samples with seed + i: the same text as a single request with that seed
    assert texts == [_story(client, 7, seed=40 + i, max_tokens=16) for i in range(3)]
    # the prompt was processed once and counts once in usage
    single = client.completions.create(model="smollm2-135m", prompt="Story 7: once",
                                       max_tokens=1)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens
    assert 3 <= r.usage.completion_tokens <= 48


def test_json_schema_while_others_run(client):
    import jsonschema
    schemas = [{"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                 "people": {"type": "integer"}},
                "required": ["city", "people"]},
               {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3}]

    def ask(i):
        if i >= 2:
            return _story(client, i, seed=i)
        r = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "Answer in JSON."}],
            max_tokens=200, temperature=0,
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schemas[i]}})
        return r.choices[0]
    out = _together(ask, 4)
    for i in range(2):
        assert out[i].finish_reason == "stop"   # the value closed, not cut short
        jsonschema.validate(json.loads(out[i].message.content), schemas[i])


def test_unsupported_schema_is_a_400(server):
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "p", "schema": {"type": "object", "patternProperties": {}}}}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and "patternProperties" in err["message"]


# ----------------------------------------------------------------------------- leaving

def test_disconnects_mid_stream_release_their_blocks(server):
    base = _wait_idle(server, server.metrics()["localllm_kv_blocks_used"])
    rng = random.Random(11)

    def leave(i):
        body = {"prompt": f"Chapter {i}.", "max_tokens": 200, "ignore_eos": True,
                "stream": True, "seed": i}
        cut = rng.randrange(2, 30)
        with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == cut:
                    return n
    _together(leave, 6)
    m = _wait_idle(server, base["localllm_kv_blocks_used"])
    # every one stopped long before its 200 tokens
    assert m["localllm_generation_tokens_total"] - base["localllm_generation_tokens_total"] \
        < 6 * 100


# ----------------------------------------------------------------------------- slow clients

def _raw(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes the connection (or answers and closes) in time."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True


def test_a_trickled_request_head_is_cut_off(server, client):
    s = _raw(server)
    t0 = time.monotonic()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    for _ in range(int(TIMEOUT / 0.25) + 8):   # a byte every 0.25 s, past the deadline
        try:
            s.sendall(b"X")
        except OSError:
            break
        time.sleep(0.25)
    assert _closed_within(s, 5)
    assert time.monotonic() - t0 < TIMEOUT + 5
    s.close()
    assert _story(client, 0, seed=1, max_tokens=2)   # others are served meanwhile


def test_a_stalled_body_gets_408(server):
    s = _raw(server)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    s.settimeout(TIMEOUT + 5)
    reply = b""
    while b"}}" not in reply:   # the head, then the error body
        part = s.recv(4096)
        if not part:
            break
        reply += part
    s.close()
    reply = reply.decode("latin-1")
    assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply


def test_idle_connections_are_bounded_and_expire(server, client):
    idle = [_raw(server) for _ in range(CONNECTIONS + 4)]
    try:
        time.sleep(0.2)
        with server.client() as c:   # every slot is held: refused at once, not hung
            assert c.get("/v1/models").status_code == 503
        time.sleep(TIMEOUT + 1.0)    # the heads never came: all are closed
        assert all(_closed_within(s, 2) for s in idle)
        assert client.models.list().data
    finally:
        for s in idle:
            s.close()


# ----------------------------------------------------------------------------- soak

def test_short_soak_leaves_nothing_behind(server):
    """60 requests from 6 clients, streaming and not, a third cut off mid-stream: every
    completed response is whole, and the KV blocks in use are back where they started."""
    base = _wait_idle(server, server.metrics()["localllm_kv_blocks_used"])
    rng = random.Random(3)
    plan = [(rng.random() < 0.6, rng.random() < 0.33, rng.randrange(2, 24)) for _ in range(60)]
    done = {"whole": 0, "cut": 0}
    lock = threading.Lock()

    def client_loop(k):
        with server.client() as c:
            for i in range(k, len(plan), 6):
                streaming, cut, tokens = plan[i]
                body = {"prompt": f"Note {i}:", "max_tokens": tokens, "seed": i,
                        "stream": streaming}
                if not streaming:
                    r = c.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    ch = r.json()["choices"][0]
                    assert ch["finish_reason"] in ("stop", "length")
                    assert r.json()["usage"]["completion_tokens"] <= tokens
                    kind = "whole"
                else:
                    kind = _stream_once(c, body, rng_cut=(i % 7) + 1 if cut else None)
                with lock:
                    done[kind] += 1
    _together(client_loop, 6)
    _wait_idle(server, base["localllm_kv_blocks_used"])
    assert done["whole"] + done["cut"] == len(plan) and done["cut"] > 5


def _stream_once(c, body, rng_cut: int | None) -> str:
    events = []
    with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if rng_cut is not None and len(events) == rng_cut:
                    return "cut"
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    return "whole"
