"""Function tools through the Responses API with the real openai client: a forced call as a
function_call item, streamed as its events, and a round trip (the call, its output, an answer)."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from support.tools import ASK_WEATHER, weather_args_ok  # noqa: E402
from support.tools import RESPONSES_WEATHER as WEATHER  # noqa: E402

NAMED = {"type": "function", "name": "get_weather"}
M = "smollm2-135m"
ASK = ASK_WEATHER


@pytest.fixture(scope="module")
def client(tool_client):
    """The session's tool server (tests/server/conftest.py), shared with the other tool tests."""
    return tool_client


def weather_ok(arguments: str) -> bool:
    return weather_args_ok("get_weather", json.loads(arguments))


def test_weather_check_can_fail():
    assert not weather_ok('{"city": "Paris"}') and weather_ok('{"city": "Paris", "unit": "c"}')


def test_round_trip(client):
    first = client.responses.create(model=M, input=ASK, tools=[WEATHER], tool_choice=NAMED,
                                    max_output_tokens=80)
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and weather_ok(call.arguments)
    assert call.id.startswith("fc_") and call.call_id
    assert not [o for o in first.output if o.type == "message"]
    history = [{"role": "user", "content": ASK}] + [o.model_dump(exclude_none=True)
                                                    for o in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id,
                    "output": "18 C and sunny"})
    second = client.responses.create(model=M, input=history, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=30, store=False)
    assert [o.type for o in second.output] == ["message"]
    assert second.output_text


def test_bad_tools_refused(client):
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=M, input=ASK, tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=M, input=ASK, tools=[WEATHER],
                                tool_choice={"type": "function", "name": "nope"})


def test_forced_call_streamed(client):
    with client.responses.stream(model=M, input=ASK, tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, temperature=0,
                                 max_output_tokens=120) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_item.added" in kinds
    assert "response.function_call_arguments.delta" in kinds
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and all(weather_ok(e.arguments) for e in done)
    calls = [o for o in final.output if o.type == "function_call"]
    assert [c.arguments for c in calls] == [e.arguments for e in done]
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert deltas == "".join(c.arguments for c in calls)
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["function_call"] * len(calls) and len(calls) == 1
    assert final.status == "completed" and final.parallel_tool_calls is False
