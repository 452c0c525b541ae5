"""Tool-call parsing of each format, the generic answer's schema, and the stream splitter's
holding back of a call's start."""

from __future__ import annotations

import json

import pytest

from localllm.apps.server.tool_use import StreamSplitter, ToolPlan, plan
from localllm.text.tool_calls import (GENERIC, HERMES, LLAMA3, MISTRAL, MISTRAL_NEMO,
                                      ToolCallError, detect_format, functions, generic_schema)

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]


def pairs(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_content_around_calls():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n' \
           '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = HERMES.parse(text)
    assert content == "Sure." and pairs(calls) == [("f", {"x": 1}), ("g", {})]
    broken = 'a <tool_call>{"name": "f", "argu'
    assert HERMES.parse(broken) == (broken, [])


def test_llama3_mistral_and_generic():
    assert pairs(LLAMA3.parse('<|python_tag|>{"name": "f", "parameters": {"x": 2}}')[1]) == \
        [("f", {"x": 2})]
    assert LLAMA3.parse("The answer is {1}")[1] == []
    assert pairs(MISTRAL_NEMO.parse('[TOOL_CALLS][{"name": "f", "arguments": {"x": 3}}]')[1]) \
        == [("f", {"x": 3})]
    assert pairs(MISTRAL.parse('[TOOL_CALLS]f[ARGS]{"x": 4}[TOOL_CALLS]g[ARGS]{}')[1]) == \
        [("f", {"x": 4}), ("g", {})]
    assert GENERIC.parse('{"response": "hi"}') == ("hi", [])
    assert pairs(GENERIC.parse('{"tool_calls": [{"name": "f", "arguments": {"x": 5}}]}')[1]) \
        == [("f", {"x": 5})]


def test_detection():
    assert detect_format("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert detect_format("{{ messages }}") is GENERIC
    assert detect_format("{% for t in tools %}[TOOL_CALLS]{% endfor %}") is MISTRAL_NEMO


def test_bad_tools_are_typed_errors():
    with pytest.raises(ToolCallError):
        functions([{"type": "retrieval"}])
    with pytest.raises(ToolCallError):
        generic_schema(TOOLS, "required", name="nope")
    s = generic_schema(TOOLS, "required", parallel=False)
    assert s["properties"]["tool_calls"]["maxItems"] == 1


def test_stream_splitter_holds_back_a_call():
    p = ToolPlan(HERMES, [])
    sp = StreamSplitter(p)
    shown = "".join(sp.feed(x) for x in ["Let me ", "check <to", "ol_call>\n{\"name\": \"f\", ",
                                         "\"arguments\": {\"x\": 1}}\n</tool_call>"])
    assert shown == "Let me check "
    rest, calls = sp.finish()
    assert rest == "" and pairs(calls) == [("f", {"x": 1})]
    sp = StreamSplitter(p)
    assert sp.feed("a <to") == "a " and sp.feed("y>") == "<toy>"
    assert sp.finish() == ("", [])


def test_plan_modes():
    hermes = "{% if tools %}<tool_call>{% endif %}"
    msgs = [{"role": "user", "content": "hi"}]
    auto = plan(hermes, msgs, {}, TOOLS, "auto", True)
    assert auto.fmt is HERMES and auto.output is None and auto.template_kwargs["tools"]
    forced = plan("{{ messages }}", msgs, {}, TOOLS, "required", True)
    assert forced.fmt is GENERIC and forced.output.schema["required"] == ["tool_calls"]
    assert forced.messages[0]["role"] == "system" and '"f"' in forced.messages[0]["content"]
    assert plan(hermes, msgs, {}, TOOLS, "none", True).fmt is None


@pytest.mark.parametrize("arguments", ["", "not json {", '{"x": 1}'])
def test_history_calls_with_any_arguments_string(arguments):
    # A client's history may hold any string as a call's arguments: the generic format's
    # rewrite of that history keeps it rather than failing the request.
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    p = plan("{{ messages }}", msgs, {}, TOOLS, "required", True)
    said = json.loads(next(m["content"] for m in p.messages if m["role"] == "assistant"))
    expect = {"": {}, "not json {": "not json {", '{"x": 1}': {"x": 1}}[arguments]
    assert said == {"tool_calls": [{"name": "f", "arguments": expect}]}
