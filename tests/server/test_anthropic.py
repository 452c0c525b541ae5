"""POST /v1/messages as Anthropic's own Python client sees it: a real server process with
SmolLM2 under a template that opens <think> (earlier answers show thinking blocks, which the
model, greedy, follows), streamed and whole; and the request's translation on its own."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("fastapi")

from localllm.apps.server.anthropic_api import MessagesRequest, to_openai  # noqa: E402
from localllm.testing.server_process import ServerProcess  # noqa: E402
from support.tools import (ANTHROPIC_TIME, ANTHROPIC_WEATHER, SHOTS,  # noqa: E402
                           weather_args_ok)

KEY = "sk-ant-test-0123456789"
TEMPLATE = Path(__file__).parents[1] / "fixtures" / "templates" / "think-open.jinja"


def conversation(question: str = "What is 5+5?") -> list[dict]:
    msgs = []
    for q, r, a in SHOTS:
        msgs += [{"role": "user", "content": q},
                 {"role": "assistant", "content": [
                     {"type": "thinking", "thinking": r, "signature": ""},
                     {"type": "text", "text": a}]}]
    return msgs + [{"role": "user", "content": [{"type": "text", "text": question}]}]


@pytest.fixture(scope="module")
def server(smollm_path):
    s = ServerProcess(smollm_path, "-c", "1024", "--chat-template", str(TEMPLATE), "--temp", "0",
                      api_key=KEY)
    s.wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    c = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)
    yield c
    c.close()


def test_whole_message_has_thinking_then_text(client):
    r = client.messages.create(model="smollm2-135m", max_tokens=40, messages=conversation(),
                               system="Answer with a number.")
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "Five plus five is eight."
    assert r.content[1].text == "8"
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.usage.input_tokens > 50 and 0 < r.usage.output_tokens <= 40


def test_stream_with_the_client(client):
    with client.messages.stream(model="smollm2-135m", max_tokens=40, messages=conversation(),
                                system="Answer with a number.") as s:
        events = list(s)
        final = s.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "thinking"), (1, "text")]
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == ("Five plus five is eight.", "8")
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
    assert events[0].type == "message_start"
    assert events[0].message.usage.input_tokens == final.usage.input_tokens > 50


def test_stream_sends_anthropics_exact_event_sequence(server):
    body = {"model": "smollm2-135m", "max_tokens": 40, "messages": conversation(),
            "stream": True}
    h = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=server.url, headers=h, timeout=120) as c:
        with c.stream("POST", "/v1/messages", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names      # each event's name is its data's type
    deltas = [d["delta"]["type"] for d in datas if d["type"] == "content_block_delta"]
    squeezed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    assert squeezed == ["message_start", "content_block_start", "ping", "content_block_delta",
                        "content_block_stop", "content_block_start", "content_block_delta",
                        "content_block_stop", "message_delta", "message_stop"]
    assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
    assert "signature_delta" in deltas
    thinking = "".join(d["delta"].get("thinking", "") for d in datas
                       if d["type"] == "content_block_delta" and d["index"] == 0)
    text = "".join(d["delta"].get("text", "") for d in datas
                   if d["type"] == "content_block_delta" and d["index"] == 1)
    assert (thinking, text) == ("Five plus five is eight.", "8")
    end = datas[-2]
    assert end["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert end["usage"]["output_tokens"] > 0


def test_stop_sequences_and_max_tokens(client):
    r = client.messages.create(model="smollm2-135m", max_tokens=40, messages=conversation(),
                               stop_sequences=["zzz", "eight"])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "eight")
    assert [b.type for b in r.content] == ["thinking"]
    assert r.content[0].thinking == "Five plus five is"
    r = client.messages.create(model="smollm2-135m", max_tokens=2, messages=conversation(),
                               extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20})
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2


def test_thinking_disabled_reaches_the_template(client):
    # the template closes the block empty: no thinking, all of it is the answer
    r = client.messages.create(model="smollm2-135m", max_tokens=40, messages=conversation(),
                               thinking={"type": "disabled"})
    assert [b.type for b in r.content] == ["text"] and r.content[0].text


def test_errors_in_anthropics_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="smollm2-135m", max_tokens=8, messages=conversation(),
                               tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "nope" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="smollm2-135m", max_tokens=8, messages=conversation())
    assert e.value.body["error"]["type"] == "authentication_error"
    # any model name is served by the one model (unless --strict-model), and reported
    assert client.messages.create(model="claude-nope", max_tokens=2,
                                  messages=conversation()).model == "claude-nope"
    h = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    cases = [({"model": "smollm2-135m", "messages": conversation()}, "max_tokens"),
             ({"model": "smollm2-135m", "max_tokens": 8, "messages": [
                 {"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
             ({"model": "smollm2-135m", "max_tokens": 8, "messages": []}, "messages")]
    with httpx.Client(base_url=server.url, headers=h, timeout=60) as c:
        for body, word in cases:
            r = c.post("/v1/messages", json=body)
            assert r.status_code == 400, r.text
            err = r.json()
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
            assert word in err["error"]["message"]
        r = c.post("/v1/messages", content=b"{not json", headers={"content-type":
                                                                  "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# ----------------------------------------------------------------------------- tools

WEATHER, TIME = ANTHROPIC_WEATHER, ANTHROPIC_TIME
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINK = {"type": "disabled"}


def weather_ok(block) -> bool:
    return weather_args_ok(block.name, block.input)


def test_weather_check_can_fail():
    class B:
        name, input = "get_weather", {"city": "Paris"}
    assert not weather_ok(B())


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_whole(client, choice):
    r = client.messages.create(model="smollm2-135m", max_tokens=80, messages=ASK,
                               tools=[WEATHER, TIME], tool_choice=choice, thinking=NO_THINK)
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and uses
    for b in uses:
        assert b.id.startswith("toolu_") and isinstance(b.input, dict)
        if choice["type"] == "tool":
            assert weather_ok(b)
        else:
            assert b.name in ("get_weather", "get_time")


def test_forced_tool_use_streamed(client, server):
    with client.messages.stream(model="smollm2-135m", max_tokens=80, messages=ASK,
                                tools=[WEATHER, TIME], thinking=NO_THINK,
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:
        events = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    uses = [b for b in final.content if b.type == "tool_use"]
    assert len(uses) == 1 and weather_ok(uses[0])
    starts = [e for e in events if e.type == "content_block_start"]
    assert starts[-1].content_block.type == "tool_use"
    assert starts[-1].content_block.input == {}
    assert starts[-1].content_block.name == "get_weather"
    # the raw stream: the arguments come as input_json_delta partial_json
    body = {"model": "smollm2-135m", "max_tokens": 80, "messages": ASK, "stream": True,
            "tools": [WEATHER], "tool_choice": {"type": "any"}, "thinking": NO_THINK}
    h = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=server.url, headers=h, timeout=120) as c:
        with c.stream("POST", "/v1/messages", json=body) as r:
            datas = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    parts: dict[int, str] = {}
    for d in datas:
        if d["type"] == "content_block_delta" and d["delta"]["type"] == "input_json_delta":
            parts[d["index"]] = parts.get(d["index"], "") + d["delta"]["partial_json"]
    started = {d["index"] for d in datas if d["type"] == "content_block_start"
               and d["content_block"]["type"] == "tool_use"}
    assert parts and set(parts) == started
    assert all(isinstance(json.loads(p), dict) for p in parts.values())
    assert datas[-2]["delta"]["stop_reason"] == "tool_use"


def test_tool_result_round_trip(client):
    first = client.messages.create(model="smollm2-135m", max_tokens=80, messages=ASK,
                                   tools=[WEATHER], thinking=NO_THINK,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    use = next(b for b in first.content if b.type == "tool_use")
    history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "18 C and sunny"}]}]
    r = client.messages.create(model="smollm2-135m", max_tokens=30, messages=history,
                               tools=[WEATHER], tool_choice={"type": "none"},
                               thinking=NO_THINK)
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text


# ----------------------------------------------------------------------------- translation

def test_translation_to_the_openai_shape():
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 10,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        "tools": [{"name": "get_weather", "description": "Weather of a city",
                   "input_schema": {"type": "object",
                                    "properties": {"city": {"type": "string"}}}}],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Need the tool.", "signature": "x"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "18 C"}]},
                {"type": "text", "text": "And tomorrow?"}]}]})
    got = to_openai(req)
    assert got["messages"] == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather",
                                      "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"}]
    assert got["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    assert got["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


def test_translation_of_choices_and_plain_results():
    base = {"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": "done", "is_error": True}]}]}
    for anthropic_choice, openai_choice in (({"type": "auto"}, "auto"), ({"type": "any"},
                                            "required"), ({"type": "none"}, "none")):
        got = to_openai(MessagesRequest.model_validate({**base, "tool_choice": anthropic_choice}))
        assert got["tool_choice"] == openai_choice
    # a user turn of tool results only adds no empty user message
    assert got["messages"] == [{"role": "tool", "tool_call_id": "t", "content": "done"}]
    assert got["tools"] is None
