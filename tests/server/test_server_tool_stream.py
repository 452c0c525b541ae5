"""Tool calls streamed as they are written, through the real server and the real clients:
OpenAI's tool_calls deltas (id and name first, then argument fragments), the Responses API's
function_call_arguments events and Anthropic's input_json_delta, each adding up to exactly the
arguments the whole (non-streamed) answer has for the same seed."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
pytest.importorskip("fastapi")

from support.tools import (ANTHROPIC_WEATHER, ASK_WEATHER, RESPONSES_WEATHER,  # noqa: E402
                           TIME, WEATHER, weather_args_ok)

M = "smollm2-135m"
ASK = [{"role": "user", "content": ASK_WEATHER}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(tool_client):
    """The session's tool server (tests/server/conftest.py), shared with the other tool tests."""
    return tool_client


def test_openai_raw_stream_sends_fragments_that_add_up(client):
    kw = dict(model=M, messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED, max_tokens=80,
              seed=7, temperature=0.7)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    deltas, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        ch = chunk.choices[0]
        deltas += ch.delta.tool_calls or []
        finish = ch.finish_reason or finish
        assert not (ch.delta.tool_calls and ch.delta.content)
    assert finish == "tool_calls" and len(whole) == 1
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    fragments = [d.function.arguments for d in rest]
    # two arguments: written token by token, so several fragments, not one whole text
    assert len(fragments) > 2
    assert "".join(fragments) == whole[0].function.arguments
    assert weather_args_ok("get_weather", json.loads("".join(fragments)))


def test_openai_stream_helper_assembles_the_calls(client):
    kw = dict(model=M, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
              max_tokens=120, seed=2)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    with client.chat.completions.stream(**kw) as s:
        events = list(s)
        final = s.get_final_completion()
    got = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in got] == \
        [(c.function.name, c.function.arguments) for c in whole]
    args_events = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(args_events) > len(got) and len(done) == len(got)
    assert [e.arguments for e in done] == [c.function.arguments for c in got]


def test_tool_choice_none_streamed_is_content_only(client):
    deltas, content, finish = [], [], None
    for chunk in client.chat.completions.create(model=M, messages=ASK, tools=[WEATHER, TIME],
                                                tool_choice="none", max_tokens=12, seed=1,
                                                stream=True):
        ch = chunk.choices[0]
        deltas += ch.delta.tool_calls or []
        content.append(ch.delta.content or "")
        finish = ch.finish_reason or finish
    assert deltas == [] and "".join(content) and finish in ("stop", "length")


def test_responses_function_call_argument_events(client):
    kw = dict(model=M, input=ASK_WEATHER, tools=[RESPONSES_WEATHER],
              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
              temperature=0.7, top_p=1.0)
    whole = client.responses.create(**kw)
    want = [o for o in whole.output if o.type == "function_call"]
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    added = [e for e in events if e.type == "response.output_item.added"
             and e.item.type == "function_call"]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(added) == 1 and added[0].item.name == "get_weather"
    assert added[0].item.arguments == "" and added[0].item.status == "in_progress"
    assert len(deltas) > 2 and all(d.item_id == added[0].item.id for d in deltas)
    assert "".join(d.delta for d in deltas) == done[0].arguments
    # added, then the deltas, then done, then the item's end
    first_delta = kinds.index("response.function_call_arguments.delta")
    assert kinds.index("response.output_item.added") < first_delta
    assert first_delta < kinds.index("response.function_call_arguments.done")
    final = events[-1].response
    got = [o for o in final.output if o.type == "function_call"]
    assert [(o.name, o.arguments) for o in got] == [("get_weather", done[0].arguments)]
    assert got[0].id == added[0].item.id and got[0].call_id == added[0].item.call_id
    assert len(want) == 1 and want[0].name == "get_weather"
    assert weather_args_ok("get_weather", json.loads(done[0].arguments))


def test_responses_stream_helper_assembles_the_call(client):
    with client.responses.stream(model=M, input=ASK_WEATHER, tools=[RESPONSES_WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=120) as s:
        deltas = [e.delta for e in s if e.type == "response.function_call_arguments.delta"]
        final = s.get_final_response()
    calls = [o for o in final.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].arguments == "".join(deltas)
    assert weather_args_ok("get_weather", json.loads(calls[0].arguments))


def test_anthropic_input_json_deltas(tool_server):
    c = anthropic.Anthropic(base_url=tool_server.url, api_key="x", max_retries=0, timeout=300)
    kw = dict(model=M, max_tokens=80, messages=ASK, tools=[ANTHROPIC_WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"})
    with c.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(uses) == 1
    starts = [e for e in events if e.type == "content_block_start"
              and e.content_block.type == "tool_use"]
    parts = [e.delta.partial_json for e in events if e.type == "content_block_delta"
             and e.delta.type == "input_json_delta"]
    assert len(starts) == 1 and starts[0].content_block.name == "get_weather"
    assert starts[0].content_block.id == uses[0].id
    assert len(parts) > 2
    assert json.loads("".join(parts)) == uses[0].input
    assert weather_args_ok("get_weather", uses[0].input)
    c.close()
