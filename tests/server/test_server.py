"""`llm serve` as clients see it: a real server process on 127.0.0.1 with SmolLM2, driven by
the OpenAI Python client and by raw httpx requests."""

from __future__ import annotations

import json
import math
import random
import re
import threading

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from localllm.testing.server_process import ServerProcess  # noqa: E402

KEY = "sk-test-0123456789"
QUESTION = [{"role": "user", "content": "Name three rivers."}]


@pytest.fixture(scope="module")
def server(smollm_path):
    s = ServerProcess(smollm_path, "-c", "1024", "--max-queue", "2", "--parallel", "1",
                      "--alias", "my-model", api_key=KEY)
    s.first_health = s.wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


def count_tokens(http, **body) -> int:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def error_of(r: httpx.Response, status: int) -> dict:
    """The OpenAI-shaped error of a response, checked for status and shape."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert not re.search(r"Traceback|\.py\b|site-packages|\.cache|\.gguf", err["message"])
    return err


# ----------------------------------------------------------------------------- basics

def test_models_and_health(server, client, http):
    assert set(server.first_health) <= {200, 503}
    assert [m.id for m in client.models.list().data] == ["smollm2-135m", "my-model"]
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/v1/models/gpt-4").json()["id"] == "gpt-4"   # any name is served


def test_any_model_name_is_served_and_reported(client):
    r = client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)
    assert r.model == "gpt-4o"
    r = client.completions.create(model="my-model", prompt="Hi", max_tokens=2)
    assert r.model == "my-model"


def test_routes_without_the_v1_prefix(server, http):
    bare = openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    try:
        assert [m.id for m in bare.models.list().data][0] == "smollm2-135m"
        r = bare.chat.completions.create(model="x", messages=QUESTION, max_tokens=2)
        assert r.choices[0].message.content is not None
        assert bare.completions.create(model="x", prompt="Hi", max_tokens=2).choices
    finally:
        bare.close()
    assert http.get("/props").json() == http.get("/v1/props").json()
    assert http.get("/health").status_code == 200 and http.get("/nothing").status_code == 404


def test_props(http):
    p = http.get("/props").json()
    assert p["n_ctx"] == 1024 and p["total_slots"] == 1
    assert p["modalities"] == {"vision": False, "audio": False}
    assert "<|im_start|>" in p["chat_template"] and p["model_alias"] == "smollm2-135m"


def test_llama_cpp_constraints(client, http):
    from localllm.generation.constrain.gbnf import parse_gbnf
    grammar = 'root ::= ("yes" | "no") "!" [a-z]{0,3}'
    r = client.chat.completions.create(model="x", messages=QUESTION, max_tokens=8,
                                       extra_body={"grammar": grammar})
    assert parse_gbnf(grammar).matches(r.choices[0].message.content)
    r = client.completions.create(model="x", prompt="Answer:", max_tokens=8,
                                  extra_body={"grammar": grammar, "top_k": 20, "min_p": 0.1,
                                              "repeat_penalty": 1.1, "cache_prompt": True})
    assert parse_gbnf(grammar).matches(r.choices[0].text)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    for extra in ({"json_schema": schema},
                  {"response_format": {"type": "json_object", "schema": schema}},
                  {"response_format": {"type": "json_schema", "schema": schema}}):
        r = client.chat.completions.create(model="x", messages=QUESTION, max_tokens=40,
                                           temperature=0, extra_body=extra)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content)["n"], int)
    r = http.post("/v1/chat/completions", json={"messages": QUESTION, "grammar": "root ::= x"})
    err = error_of(r, 400)
    assert err["param"] == "grammar" and "line 1, column 10" in err["message"]
    r = http.post("/v1/chat/completions", json={"messages": QUESTION, "grammar": 'root ::= "a"',
                                                "json_schema": schema})
    assert error_of(r, 400)["param"] == "json_schema"


@pytest.mark.parametrize("field, value", [("mirostat", 2), ("typical_p", 0.5),
                                          ("dynatemp_range", 0.5), ("n_keep", 10),
                                          ("dry_multiplier", 0.8)])
def test_unsupported_llama_cpp_fields_are_refused_by_name(http, field, value):
    for path, body in (("/v1/chat/completions", {"messages": QUESTION}),
                       ("/completions", {"prompt": "Hi"})):
        r = http.post(path, json={**body, field: value, "max_tokens": 2})
        assert field in error_of(r, 400)["message"]
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "mirostat": 0,
                                           "typical_p": 1.0})
    assert r.status_code == 200, r.text   # the values meaning "off" are fine


def test_openapi_schema_is_valid(http):
    from openapi_spec_validator import validate
    spec = http.get("/openapi.json").json()
    validate(spec)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/tokenize"):
        assert path in spec["paths"]


def test_chat_usage_matches_the_tokenizer(client, http):
    r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=8,
                                       temperature=0, logprobs=True)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert c.message.content and c.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == count_tokens(http, messages=QUESTION)
    assert r.usage.completion_tokens == len(c.logprobs.content) <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_whole(client):
    whole = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                           max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finals[-1] == whole.choices[0].finish_reason and not any(finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_second_turn_reuses_the_cache(client):
    first = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                           max_tokens=12, temperature=0)
    turn2 = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And two more?"}]
    second = client.chat.completions.create(model="smollm2-135m", messages=turn2,
                                            max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2


def test_content_as_text_parts(client):
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    a = client.chat.completions.create(model="smollm2-135m", messages=parts, max_tokens=6,
                                       temperature=0)
    b = client.chat.completions.create(model="smollm2-135m", messages=plain, max_tokens=6,
                                       temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


# ----------------------------------------------------------------------------- parameters

def test_seed_reproducible(client):
    def sample(seed):
        r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                           max_tokens=12, temperature=1.0, seed=seed)
        return r.choices[0].message.content
    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1   # the seed is used, not ignored


def test_logprobs_shape(client):
    r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=3)
    items = r.choices[0].logprobs.content
    assert len(items) == r.usage.completion_tokens
    for it in items:
        assert it.logprob <= 0 and len(it.top_logprobs) == 3
        assert bytes(it.bytes).decode("utf-8", errors="backslashreplace") == it.token
        values = [a.logprob for a in it.top_logprobs]
        assert values == sorted(values, reverse=True) and sum(map(math.exp, values)) <= 1.0001
        # greedy: the chosen token is the most likely one
        assert it.top_logprobs[0].token == it.token
        assert it.top_logprobs[0].logprob == pytest.approx(it.logprob, abs=1e-4)
    plain = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                           max_tokens=8, temperature=0, logprobs=True)
    assert all(it.top_logprobs == [] for it in plain.choices[0].logprobs.content)
    text = b"".join(bytes(it.bytes) for it in items).decode("utf-8", errors="replace")
    assert text == r.choices[0].message.content
    # greedy: each chosen token is the most likely, so its log-probability is high
    assert max(it.logprob for it in items) > -1.0


def test_n_choices(client, http):
    r = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=6,
                                       temperature=1.0, seed=11, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage.prompt_tokens == count_tokens(http, messages=QUESTION)  # counted once
    streamed = list(client.chat.completions.create(
        model="smollm2-135m", messages=QUESTION, max_tokens=6, temperature=1.0, seed=11, n=2,
        stream=True))
    for c in r.choices:
        text = "".join(ch.choices[0].delta.content or "" for ch in streamed
                       if ch.choices and ch.choices[0].index == c.index)
        assert text == c.message.content


def test_stop_strings(client):
    full = client.chat.completions.create(model="smollm2-135m", messages=QUESTION,
                                          max_tokens=16, temperature=0).choices[0].message.content
    words = full.split(" ")
    assert len(words) > 3
    stop = " " + words[2]
    cut = client.chat.completions.create(model="smollm2-135m", messages=QUESTION, max_tokens=16,
                                         temperature=0, stop=[stop, "unlikely###"]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == full[:full.index(stop)]


def test_harmless_unknown_fields_are_ignored(http):
    r = http.post("/v1/chat/completions", json={
        "messages": QUESTION, "max_tokens": 2, "user": "u1", "metadata": {"a": "b"},
        "service_tier": "auto", "store": False, "some_future_field": 3})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"n": 1000}, "n"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "c"}]}]},
     "messages[0]"),
    ({"messages": []}, "messages"),
])
def test_bad_parameters_get_400(http, body, param):
    err = error_of(http.post("/v1/chat/completions", json={"messages": QUESTION, **body}), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_errors_in_openai_shape(client, http):
    assert error_of(http.post("/v1/chat/completions", content=b"{nope",
                              headers={"content-type": "application/json"}), 400)
    assert error_of(http.get("/v1/nothing"), 404)["type"] == "not_found_error"
    long = [{"role": "user", "content": "word " * 1100}]
    err = error_of(http.post("/v1/chat/completions", json={"messages": long}), 400)
    assert err["code"] == "context_length_exceeded" and "1024" in err["message"]


def test_prompt_errors_are_the_engines_own_as_400s(http):
    """The engine checks prompts and raises typed errors; the server's table gives the same
    400s it always gave, naming the request field, for every prompt before any output (also
    when the bad prompt is the second of two, and when the client asked for a stream)."""
    vocab = 49152   # SmolLM2's
    body = {"max_tokens": 2, "temperature": 0}
    for stream in (False, True):
        err = error_of(http.post("/v1/completions", json={
            **body, "stream": stream, "prompt": [[1, 2, 3], [1, vocab + 7]]}), 400)
        assert err == {"message": f"token id {vocab + 7} is outside the vocabulary "
                                  f"(0..{vocab - 1})", "type": "invalid_request_error",
                       "param": "prompt", "code": "invalid_value"}
    err = error_of(http.post("/v1/completions", json={**body, "prompt": [-3, 5]}), 400)
    assert err["param"] == "prompt" and "token id -3" in err["message"]
    err = error_of(http.post("/v1/completions", json={**body, "prompt": [1] * 1024}), 400)
    assert err == {"message": "the prompt has 1024 tokens but the context holds 1024; shorten "
                              "it, or restart the server with a larger --ctx-size",
                   "type": "invalid_request_error", "param": "prompt",
                   "code": "context_length_exceeded"}
    err = error_of(http.post("/v1/responses", json={"input": "word " * 1100,
                                                    "max_output_tokens": 2}), 400)
    assert (err["param"], err["code"]) == ("input", "context_length_exceeded")
    err = error_of(http.post("/v1/chat/completions", json={
        "messages": QUESTION, **body, "logit_bias": {str(vocab): 5}}), 400)
    assert (err["param"], err["code"]) == ("logit_bias", "invalid_value")
    assert f"token {vocab} is outside the vocabulary" in err["message"]
    # the server still answers after each refusal
    r = http.post("/v1/completions", json={**body, "prompt": [1, 2, 3]})
    assert r.status_code == 200, r.text


def test_json_output(client, http):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}},
              "required": ["name"]}
    formats = [{"type": "json_object"},
               {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}]
    for fmt in formats:
        body = {"messages": [{"role": "user", "content": "Give a name as JSON."}],
                "max_tokens": 200, "temperature": 0, "response_format": fmt}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "stop"   # closed, not cut short
        value = json.loads(r.json()["choices"][0]["message"]["content"])
        if fmt["type"] == "json_schema":
            import jsonschema
            jsonschema.validate(value, schema)


# ----------------------------------------------------------------------------- completions

def test_completions(client, http):
    r = client.completions.create(model="smollm2-135m", prompt="The sky is", max_tokens=6,
                                  temperature=0, logprobs=2)
    c = r.choices[0]
    assert c.text and len(c.logprobs.tokens) == r.usage.completion_tokens
    assert all(len(top) == 2 and tok in top
               for tok, top in zip(c.logprobs.tokens, c.logprobs.top_logprobs))
    assert r.usage.prompt_tokens == count_tokens(http, content="The sky is")
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="smollm2-135m", prompt="The sky is", max_tokens=6, temperature=0, stream=True)
        if ch.choices)
    assert streamed == c.text
    echo = client.completions.create(model="smollm2-135m", prompt="The sky is", max_tokens=6,
                                     temperature=0, echo=True)
    assert echo.choices[0].text == "The sky is" + c.text
    ids = http.post("/tokenize", json={"content": "The sky is"}).json()["tokens"]
    by_ids = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=6,
                                       temperature=0)
    assert by_ids.choices[0].text == c.text


def test_tokenize_round_trip(http):
    text = "Hello, world! Ünïcödé ✓"
    ids = http.post("/tokenize", json={"content": text, "add_special": False}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["content"] == text
    assert error_of(http.post("/detokenize", json={"tokens": [10 ** 7]}), 400)["param"] == "tokens"


# ----------------------------------------------------------------------------- responses

def test_responses_with_previous_response_id(client, http):
    first = client.responses.create(model="smollm2-135m", input="Name a river.",
                                    max_output_tokens=12, temperature=0)
    assert first.object == "response" and first.output_text
    assert first.usage.input_tokens == count_tokens(
        http, messages=[{"role": "user", "content": "Name a river."}])
    second = client.responses.create(
        model="smollm2-135m", previous_response_id=first.id, max_output_tokens=6, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Another one?"}]}])
    assert second.previous_response_id == first.id and second.output_text
    # the second prompt starts with the first conversation: answered from the prefix cache
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert client.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="smollm2-135m", input="x", previous_response_id="resp_no")


def test_responses_streaming(client):
    whole = client.responses.create(model="smollm2-135m", input="Say hello.",
                                    instructions="Be brief.", max_output_tokens=8, temperature=0)
    events = list(client.responses.create(model="smollm2-135m", input="Say hello.",
                                          instructions="Be brief.", max_output_tokens=8,
                                          temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text


# ----------------------------------------------------------------------------- safety

def test_api_key_required(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        body = {"messages": QUESTION, "max_tokens": 1}
        assert error_of(c.post("/v1/chat/completions", json=body), 401)["code"] == \
            "invalid_api_key"
        wrong = {"Authorization": "Bearer sk-test-0123456780"}
        error_of(c.post("/v1/chat/completions", json=body, headers=wrong), 401)
        error_of(c.get("/v1/models", headers={"Authorization": KEY}), 401)  # no scheme
        assert c.get("/health").status_code == 200   # probes need no key
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_rebinding_host_refused(server, http):
    err = error_of(http.get("/v1/models", headers={"Host": "attacker.example:8080"}), 403)
    assert err["code"] == "host_not_allowed"
    for host in ("localhost", "127.0.0.1:1", "[::1]:80", "LOCALHOST."):
        assert http.get("/v1/models", headers={"Host": host}).status_code == 200


def test_cors_off_by_default(http):
    r = http.options("/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_oversized_body_413(http):
    big = {"messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    assert error_of(http.post("/v1/chat/completions", json=big), 413)["code"] == \
        "request_too_large"

    def chunks():  # no Content-Length: the limit holds while the body is read
        for _ in range(6):
            yield b" " * (1 << 20)
    r = http.post("/v1/chat/completions", content=chunks(),
                  headers={"content-type": "application/json"})
    error_of(r, 413)


# ----------------------------------------------------------------------------- scheduling

LONG = {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 400,
        "ignore_eos": True, "temperature": 0, "stream": True}


def _stream_lines(server, body, ready: threading.Event | None = None, stop=None):
    """Open a streaming request; set ``ready`` at its first data line and read until
    ``stop`` is set (then close the connection)."""
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and ready is not None:
                ready.set()
            if stop is not None and stop.is_set():
                return r.status_code
        return r.status_code


def _wait_metric(server, name, value, timeout=60):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metrics()[name] == value:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} did not reach {value}: {server.metrics()[name]}")


def test_queue_full_gives_503(server, http):
    stop = threading.Event()
    running = threading.Event()
    threads = [threading.Thread(target=_stream_lines, args=(server, LONG, running, stop))]
    threads[0].start()
    assert running.wait(60)
    for _ in range(2):   # --max-queue 2: these two wait
        threads.append(threading.Thread(target=_stream_lines, args=(server, LONG, None, stop)))
        threads[-1].start()
    _wait_metric(server, "localllm_requests_waiting", 2)
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert error_of(r, 503)["code"] == "server_busy" and int(r.headers["retry-after"]) >= 1
    stop.set()
    for t in threads:
        t.join(60)
    _wait_metric(server, "localllm_requests_running", 0)
    _wait_metric(server, "localllm_requests_waiting", 0)


def test_disconnect_stops_generation_and_the_next_request_starts(server, client):
    before = server.metrics()["localllm_generation_tokens_total"]
    with server.client() as c, c.stream("POST", "/v1/completions", json=LONG) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen == 4:
                break
    r = client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=4,
                                  temperature=0)
    after = server.metrics()["localllm_generation_tokens_total"]
    # the cancelled stream stopped long before its 400 tokens
    assert after - before - r.usage.completion_tokens < 100


def test_random_disconnects_leave_nothing_behind(server, client):
    rng = random.Random(5)
    base = server.metrics()
    for i in range(20):
        body = {**LONG, "max_tokens": 12, "prompt": f"Story {i}:"}
        cut_at = rng.randrange(1, 12) if rng.random() < 0.5 else None
        with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == cut_at:
                    break
    client.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2)
    m = server.metrics()
    assert m["localllm_requests_running"] == m["localllm_requests_waiting"] == 0
    assert m["localllm_kv_blocks_used"] == base["localllm_kv_blocks_used"]
    assert m["localllm_generations_total"] == base["localllm_generations_total"] + 21


def test_metrics_exposition(server):
    m = server.metrics()
    for name in ("localllm_prompt_tokens_total", "localllm_generation_tokens_total",
                 "localllm_prefix_cache_hit_tokens_total", "localllm_kv_blocks_used",
                 "localllm_kv_blocks_free", "localllm_requests_waiting",
                 "localllm_spec_decode_acceptance_ratio",
                 'localllm_time_to_first_token_seconds_bucket{le="+Inf"}',
                 "localllm_time_per_output_token_seconds_count"):
        assert name in m
    assert m["localllm_generation_tokens_total"] > 0
    assert m["localllm_prefix_cache_hit_tokens_total"] > 0
    assert m['localllm_time_to_first_token_seconds_bucket{le="+Inf"}'] == \
        m["localllm_time_to_first_token_seconds_count"] > 0


def test_metrics_count_prompt_lookup_drafts(server, client):
    # `llm serve` drafts by prompt lookup unless --no-lookup: a prompt the model copies.
    text = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying "
            "a can of oil and a cloth. He trimmed the wick and polished the great lens.")
    before = server.metrics()
    r = client.completions.create(model="smollm2-135m", prompt=f"{text}\n\n{text[:50]}",
                                  max_tokens=24, temperature=0)
    m = server.metrics()
    drafted = (m["localllm_spec_decode_draft_tokens_total"]
               - before["localllm_spec_decode_draft_tokens_total"])
    accepted = (m["localllm_spec_decode_accepted_tokens_total"]
                - before["localllm_spec_decode_accepted_tokens_total"])
    passes = (m["localllm_spec_decode_target_passes_total"]
              - before["localllm_spec_decode_target_passes_total"])
    assert 5 < accepted <= drafted
    assert passes < r.usage.completion_tokens - 1  # fewer passes than tokens
    assert 0 < m["localllm_spec_decode_acceptance_ratio"] <= 1
    assert m["localllm_spec_decode_tokens_per_pass"] > 1


def test_host_rules():
    from localllm.apps.server.security import HostAllowlist, host_of, is_loopback
    assert [host_of(h) for h in ("a.b:80", "[::1]:8080", "[::1]", "Local.Host.", "1.2.3.4")] == \
        ["a.b", "::1", "::1", "local.host", "1.2.3.4"]
    assert all(is_loopback(h) for h in ("localhost", "127.0.0.1", "127.9.9.9", "::1",
                                        "app.localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "localhost.attacker.example",
                                            "192.0.2.1", "example.com", "::"))
    hosts = HostAllowlist(["box.lan", "[2001:db8::1]:80"])
    assert hosts.allows("box.lan:8080") and hosts.allows("[2001:db8::1]:8080")
    assert not hosts.allows("attacker.example") and HostAllowlist(["*"]).allows("any")


def test_settings_checks():
    from localllm.apps.server import ServerSettings
    ServerSettings(host="::1").check()
    ServerSettings(host="0.0.0.0", api_key="k").check()
    for bad in (dict(host="0.0.0.0"), dict(host="example.com"), dict(port=70000),
                dict(max_queue=-1), dict(cors_origins=["localhost:3000"]),
                dict(api_key=" ")):
        with pytest.raises(ValueError):
            ServerSettings(**bad).check()


# ----------------------------------------------------------------------------- the process

def _serve(*args):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "localllm.apps.cli", "serve", *args],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_refuses_a_public_address_without_a_key(smollm_path, tmp_path):
    r = _serve(str(smollm_path), "--host", "0.0.0.0")
    assert r.returncode == 1 and r.stderr.startswith("error: refusing to listen on 0.0.0.0")
    assert r.stderr.count("\n") == 1
    empty = tmp_path / "key"
    empty.write_text("\n")
    r = _serve(str(smollm_path), "--host", "0.0.0.0", "--api-key-file", str(empty))
    assert r.returncode == 1 and "is empty" in r.stderr


def test_loading_cors_and_shutdown(smollm_path):
    # Loading (the cached kernels, repacking the weights) takes a moment: the server is
    # bound and answering meanwhile.
    s = ServerProcess(smollm_path, "-c", "512", "--no-weight-cache", "--strict-model",
                      "--cors-origin", "http://localhost:3000")
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            h = c.get("/health")
            r = c.post("/v1/chat/completions", json={"messages": QUESTION})
        assert h.status_code == 503 and h.json()["status"] == "loading"
        assert error_of(r, 503)["code"] == "server_busy"
        assert "loading" in r.json()["error"]["message"]
        s.wait_ready()
        with s.client() as c:
            def preflight(origin):
                return c.options("/v1/chat/completions", headers={
                    "Origin": origin, "Access-Control-Request-Method": "POST"})
            ok, other = preflight("http://localhost:3000"), preflight("http://evil.example")
        assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "access-control-allow-origin" not in other.headers
        with s.client() as c:   # --strict-model: other names are refused
            r = c.post("/v1/chat/completions", json={"model": "gpt-4", "messages": QUESTION})
            assert error_of(r, 404)["code"] == "model_not_found"
            assert error_of(c.get("/models/gpt-4"), 404)["code"] == "model_not_found"
            assert c.get("/props").json()["total_slots"] == 4   # --parallel's default

        data = []
        body = {"messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with s.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data.append(line[6:])
                    if len(data) == 4:
                        s.signal()   # SIGTERM mid-stream
        assert data[-1] == "[DONE]" and len(data) < 200
        assert json.loads(data[-2])["choices"][0]["finish_reason"] == "length"
        s.proc.wait(timeout=15)   # and the process exits
    finally:
        s.stop()


def test_completion_logprobs_include_the_sampled_token_and_echo(client, http):
    r = client.completions.create(model="x", prompt="The sky is", max_tokens=4, logprobs=2,
                                  temperature=0.8, seed=3)
    lp = r.choices[0].logprobs
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == value and len(top) in (2, 3)
    prompt_ids = http.post("/tokenize", json={"content": "The sky is"}).json()["tokens"]
    r = client.completions.create(model="x", prompt="The sky is", max_tokens=3, logprobs=1,
                                  echo=True, temperature=0)
    c = r.choices[0]
    lp = c.logprobs
    n = len(prompt_ids)
    assert c.text.startswith("The sky is") and len(lp.tokens) == n + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == c.text
    # the prompt's logprobs are the model's: the same as scoring it with one more token
    again = client.completions.create(model="x", prompt="The sky is", max_tokens=1,
                                      logprobs=0, echo=True, temperature=0)
    assert again.choices[0].logprobs.token_logprobs[1:n] == pytest.approx(
        lp.token_logprobs[1:n], abs=1e-3)
    chunks = list(client.completions.create(model="x", prompt="The sky is", max_tokens=3,
                                            logprobs=1, echo=True, temperature=0,
                                            stream=True))
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert "".join(ch.choices[0].text for ch in chunks) == c.text


def test_parallel_default_shrinks_to_the_kv_cache(smollm_path):
    # SmolLM2's KV is 23 KB a token (f16): 20 MB hold one 512-token context, not four.
    s = ServerProcess(smollm_path, "-c", "512", "--kv-pool-mb", "20")
    try:
        s.wait_ready()
        with s.client() as c:
            assert c.get("/props").json()["total_slots"] == 1
        said = "--parallel 1: the KV cache has room for 1 full 512-token context(s), not 4"
        assert any(said in line for line in s.lines), s.lines
    finally:
        s.stop()
