"""Model.chat with tools on SmolLM2: a forced call comes out as a ToolCall that matches the
tool's schema, a named tool only that one, and a call's result answered in text."""

from __future__ import annotations

import json

import pytest

import localllm
from localllm.text.tool_calls import ToolCallError

from support.tools import TIME, WEATHER, weather_args_ok

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def weather_ok(call) -> bool:
    return weather_args_ok(call.name, json.loads(call.arguments))


def test_check_can_fail():
    assert not weather_ok(localllm.ToolCall("get_weather", '{"city": "Paris"}'))


@pytest.mark.parametrize("seed", [1, 2])
def test_named_tool_gives_one_valid_call(smollm_model, seed):
    out = list(smollm_model.chat(ASK, tools=[WEATHER, TIME], tool_choice=NAMED,
                                 temperature=0.8, seed=seed, max_tokens=120))
    calls = [x for x in out if isinstance(x, localllm.ToolCall)]
    assert len(calls) == 1 and weather_ok(calls[0])
    assert not "".join(x for x in out if isinstance(x, str)).strip()


def test_required_and_the_answer_after_the_result(smollm_model):
    calls = [x for x in smollm_model.chat(ASK, tools=[WEATHER, TIME], tool_choice="required",
                                          temperature=0, max_tokens=160)
             if isinstance(x, localllm.ToolCall)]
    assert calls and all(c.name in ("get_weather", "get_time") for c in calls)
    assert all(isinstance(json.loads(c.arguments), dict) for c in calls)
    history = ASK + [{"role": "assistant", "content": "",
                      "tool_calls": [c.as_openai() for c in calls]}]
    history += [{"role": "tool", "tool_call_id": c.id, "content": "18 C"} for c in calls]
    out = list(smollm_model.chat(history, tools=[WEATHER], tool_choice="none",
                                 temperature=0, max_tokens=20))
    assert out and all(isinstance(x, str) for x in out) and "".join(out).strip()


def test_bad_tool_choice(smollm_model):
    with pytest.raises(ToolCallError):
        smollm_model.chat(ASK, tools=[WEATHER], tool_choice={
            "type": "function", "function": {"name": "nope"}})


NOTE = {"type": "function", "function": {"name": "save_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}


def test_prompt_lookup_drafts_under_a_tool_constraint(smollm_path):
    """A call that quotes its prompt is drafted by prompt lookup through the tool grammar,
    and the drafts change nothing: the same calls as without speculation."""
    text = ("The quarterly report for the northern region is attached below; please review "
            "the figures before the meeting on Thursday morning.")
    ask = [{"role": "user", "content": f"Save this note exactly: {text}"}]

    model = localllm.load(smollm_path, threads=2, lookup=8)

    def run(speculate: bool):
        gen = model.chat(ask, tools=[NOTE], tool_choice="required", temperature=0,
                                parallel_tool_calls=False, max_tokens=120,
                                speculate=speculate)
        calls = [x for x in gen if isinstance(x, localllm.ToolCall)]
        return [(c.name, json.loads(c.arguments)) for c in calls], gen.stats

    try:
        fast, stats = run(True)
        plain, plain_stats = run(False)
    finally:
        model.close()
    assert fast and fast == plain and all(n == "save_note" for n, _ in fast)
    assert stats.draft_tokens > 0 and stats.accepted_tokens > 0
    print(f"drafted {stats.draft_tokens}, accepted {stats.accepted_tokens}, passes "
          f"{stats.decode_passes} against {plain_stats.decode_passes}")
    assert plain_stats.draft_tokens == 0
    assert stats.generated_tokens == plain_stats.generated_tokens
