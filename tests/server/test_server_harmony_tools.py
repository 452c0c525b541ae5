"""gpt-oss's harmony tool calls through a real server process: SmolLM2 under a template in
harmony's shape with tools, whose earlier turns show calls on the commentary channel
(``to=functions.get_weather``) after a line of analysis, which the model, greedy, follows.
The calls come back as OpenAI tool_calls (whole and streamed, with the reasoning split and
without), as the Responses API's function_call items and as Anthropic tool_use blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from localllm.testing.server_process import ServerProcess  # noqa: E402
from support.tools import ANTHROPIC_WEATHER, RESPONSES_WEATHER, WEATHER  # noqa: E402

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "templates" / "harmony-tools.jinja"
SHOTS = [("Rome", "21 C"), ("Oslo", "5 C"), ("Lima", "17 C")]
PARIS = ("get_weather", {"city": "Paris", "unit": "c"})
STOP = ["<|call|>"]   # gpt-oss ends a call with it (an end-of-generation token there)
KEY = "sk-test-harmony"


def conversation(question: str = "What is the weather in Paris?") -> list[dict]:
    msgs = []
    for i, (city, temp) in enumerate(SHOTS):
        msgs += [{"role": "user", "content": f"What is the weather in {city}?"},
                 {"role": "assistant", "content": None,
                  "reasoning_content": f"I will call get_weather for {city}.",
                  "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
                      "name": "get_weather", "arguments": json.dumps({"city": city, "unit": "c"})}}]},
                 {"role": "tool", "tool_call_id": f"call_{i}", "content": temp}]
    return msgs + [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def server(smollm_path):
    s = ServerProcess(smollm_path, "-c", "2048", "--chat-template", str(TEMPLATE), "--temp", "0",
                      api_key=KEY)
    s.wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=180)
    yield c
    c.close()


def ask(client, **kw):
    return client.chat.completions.create(model="gpt-oss", messages=conversation(),
                                          tools=[WEATHER], max_tokens=150, stop=STOP, **kw)


def pairs(calls):
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("reasoning_format", [None, "none"])
def test_call_whole(client, reasoning_format):
    extra = {"extra_body": {"reasoning_format": reasoning_format}} if reasoning_format else {}
    c = ask(client, **extra).choices[0]
    assert c.finish_reason == "tool_calls" and pairs(c.message.tool_calls) == [PARIS]
    assert c.message.content is None and c.message.tool_calls[0].id.startswith("call_")
    reasoning = getattr(c.message, "reasoning_content", None)
    assert reasoning == (None if reasoning_format == "none" else "I will call get_weather for Paris.")


def test_call_streamed(client):
    with client.beta.chat.completions.stream(model="gpt-oss", messages=conversation(),
                                             tools=[WEATHER], max_tokens=150, stop=STOP) as s:
        chunks = [ev.chunk for ev in s if ev.type == "chunk"]
        final = s.get_final_completion()
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        "I will call get_weather for Paris."
    assert not "".join(d.content or "" for d in deltas)   # no harmony markup leaks as text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert pairs(final.choices[0].message.tool_calls) == [PARIS]


def test_no_tools_in_the_request_gives_no_calls(client):
    r = client.chat.completions.create(model="gpt-oss", messages=conversation(), max_tokens=150,
                                       stop=STOP)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls


def test_responses_function_call(client):
    items = []   # (Responses input has no reasoning items: the shots are calls alone)
    for i, (city, temp) in enumerate(SHOTS):
        items += [{"role": "user", "content": f"What is the weather in {city}?"},
                  {"type": "function_call", "call_id": f"call_{i}", "name": "get_weather",
                   "arguments": json.dumps({"city": city, "unit": "c"})},
                  {"type": "function_call_output", "call_id": f"call_{i}", "output": temp}]
    items.append({"role": "user", "content": "What is the weather in Paris?"})
    r = client.responses.create(model="gpt-oss", input=items, tools=[RESPONSES_WEATHER],
                                max_output_tokens=150, extra_body={"stop": STOP})
    calls = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    # (SmolLM2 does not end at <|call|> as gpt-oss does: it may go on to a second call)
    assert calls[0] == PARIS and all(name == "get_weather" for name, _ in calls)


def test_anthropic_tool_use(server):
    anthropic = pytest.importorskip("anthropic")
    msgs = []
    for i, (city, temp) in enumerate(SHOTS):
        msgs += [{"role": "user", "content": f"What is the weather in {city}?"},
                 {"role": "assistant", "content": [
                     {"type": "thinking", "thinking": f"I will call get_weather for {city}.",
                      "signature": ""},
                     {"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather",
                      "input": {"city": city, "unit": "c"}}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                               "content": temp}]}]
    msgs.append({"role": "user", "content": "What is the weather in Paris?"})
    c = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=180)
    r = c.messages.create(model="gpt-oss", max_tokens=150, messages=msgs, tools=[ANTHROPIC_WEATHER],
                          stop_sequences=STOP)
    c.close()
    uses = [b for b in r.content if b.type == "tool_use"]
    # (ended by our stop sequence, which the Messages API reports as such)
    assert r.stop_reason == "stop_sequence" and [(b.name, b.input) for b in uses] == [PARIS]
    assert not [b for b in r.content if b.type == "text"]
