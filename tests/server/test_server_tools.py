"""Function calling through the server with the real openai client: every tool_choice mode,
streamed and whole, parallel calls, a two-round agent loop, and calls that always parse and
match the tools' schemas at a high temperature."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from support.tools import ASK_WEATHER, TIME, WEATHER  # noqa: E402

TOOLS = [WEATHER, TIME]
M = "smollm2-135m"
ASK = [{"role": "user", "content": ASK_WEATHER}]


@pytest.fixture(scope="module")
def client(tool_client):
    """The session's tool server (tests/server/conftest.py), shared with the other tool tests."""
    return tool_client


def valid_call(name: str, arguments: str) -> bool:
    """Whether a call matches TOOLS' schemas (written out: the schemas are small)."""
    args = json.loads(arguments)
    if name == "get_weather":
        return (set(args) == {"city", "unit"} and isinstance(args["city"], str)
                and len(args["city"]) <= 12 and args["unit"] in ("c", "f"))
    if name == "get_time":
        return set(args) == {"zone"} and type(args["zone"]) is int and -12 <= args["zone"] <= 14
    return False


def test_validity_check_can_fail():
    assert not valid_call("get_weather", '{"city": "Paris"}')
    assert not valid_call("get_time", '{"zone": 1.5}')
    assert valid_call("get_time", '{"zone": 2}')


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_forced_calls_whole(client, choice):
    r = client.chat.completions.create(model=M, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       max_tokens=80, temperature=0.8, seed=1)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert valid_call(call.function.name, call.function.arguments)
        if isinstance(choice, dict):
            assert call.function.name == "get_time"


def _stream(client, **kw):
    with client.beta.chat.completions.stream(model=M, messages=ASK, tools=TOOLS, **kw) as s:
        chunks = [ev for ev in s if ev.type == "chunk"]
        return s.get_final_completion(), chunks


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_calls_streamed_as_openai_does(client, choice):
    whole = client.chat.completions.create(model=M, messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=80, seed=3)
    final, chunks = _stream(client, tool_choice=choice, max_tokens=80, seed=3)
    got, want = final.choices[0].message.tool_calls, whole.choices[0].message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in got] == \
        [(c.function.name, c.function.arguments) for c in want]
    assert final.choices[0].finish_reason == "tool_calls"
    deltas = [d for ch in chunks for ch_ in ch.chunk.choices for d in (ch_.delta.tool_calls or [])]
    first = deltas[0]
    assert first.index == 0 and first.id and first.type == "function"
    assert first.function.name == got[0].function.name and first.function.arguments == ""
    assert all(d.id is None for d in deltas[1:] if d.index == 0)


def test_parallel_calls(client):
    text = ("Answer with JSON: " + json.dumps({"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
        {"name": "get_time", "arguments": {"zone": 1}}]}))
    seen = set()
    for seed in range(6):
        r = client.chat.completions.create(model=M, 
            messages=[{"role": "user", "content": "Weather in Paris and the time in zone 1. "
                       + text}], tools=TOOLS, tool_choice="required", max_tokens=120,
            seed=seed, temperature=0.7)
        calls = r.choices[0].message.tool_calls
        assert all(valid_call(c.function.name, c.function.arguments) for c in calls)
        assert len({c.id for c in calls}) == len(calls)
        seen.add(len(calls))
    assert max(seen) >= 2
    r = client.chat.completions.create(model=M, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=120, seed=0)
    assert len(r.choices[0].message.tool_calls) == 1


def test_none_and_auto(client):
    r = client.chat.completions.create(model=M, messages=ASK, tools=TOOLS, tool_choice="none",
                                       max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    for stream in (False, True):
        kw = dict(messages=ASK, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False,
                  max_tokens=120, seed=5)
        if stream:
            final, _ = _stream(client, **{k: v for k, v in kw.items() if k not in ("messages", "tools")})
            m = final.choices[0].message
        else:
            m = client.chat.completions.create(model=M, **kw).choices[0].message
        # a call that parses and fits, or a plain answer: never the raw JSON as content
        if m.tool_calls:
            assert all(valid_call(c.function.name, c.function.arguments) for c in m.tool_calls)
        else:
            assert m.content is not None and '"tool_calls"' not in m.content


def test_agent_loop_two_rounds(client):
    messages = list(ASK)
    r = client.chat.completions.create(model=M, messages=messages, tools=TOOLS,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "get_weather"}},
                                       max_tokens=80, seed=2)
    m = r.choices[0].message
    call = m.tool_calls[0]
    messages.append(m.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"})
    r2 = client.chat.completions.create(model=M, messages=messages, tools=TOOLS, tool_choice="none",
                                        max_tokens=30, seed=2)
    assert r2.choices[0].finish_reason in ("stop", "length")
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls
    alone = client.chat.completions.create(model=M, messages=ASK, max_tokens=1)
    assert r2.usage.prompt_tokens > alone.usage.prompt_tokens + 10   # the call and its result


def test_two_hundred_hot_calls_all_valid(client):
    bad = []
    for seed in range(200):
        r = client.chat.completions.create(model=M, messages=ASK, tools=[TIME], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=60,
                                           temperature=1.5, seed=seed)
        c = r.choices[0]
        calls = c.message.tool_calls or []
        if c.finish_reason != "tool_calls" or len(calls) != 1 or not valid_call(
                calls[0].function.name, calls[0].function.arguments):
            bad.append((seed, c.finish_reason, c.message))
    assert not bad, bad[:3]
