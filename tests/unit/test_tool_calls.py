"""Tool-call parsing of each format, the generic answer's schema, and the stream splitter's
holding back of a call's start."""

from __future__ import annotations

import json

import pytest

from localllm.apps.server.tool_use import StreamSplitter, ToolPlan, plan
from localllm.text.reasoning import split_reasoning
from localllm.text.tool_calls import (GENERIC, HARMONY, HERMES, LLAMA3, MISTRAL, MISTRAL_NEMO,
                                      ToolCall, ToolCallError, canonical_text, detect_format,
                                      functions, generic_schema)

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


# ----------------------------------------------------------------------------- harmony

HARMONY_TEMPLATE = ("{%- for tool in tools %}{{ tool.function.name }}{% endfor %}"
                    "{{- '<|start|>assistant to=' + 'functions.' + tool_call.name + "
                    "'<|channel|>commentary json<|message|>' }}")
CALL_OUT = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant'
            '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Rome"}<|call|>')


def test_harmony_detection_and_calls():
    assert detect_format(HARMONY_TEMPLATE) is HARMONY
    # reasoning, then the call on the commentary channel
    content, calls = HARMONY.parse(CALL_OUT)
    assert content == "" and pairs(calls) == [("get_weather", {"city": "Rome"})]
    # the recipient before the channel (as the template writes history), and a preamble
    text = ('<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant '
            'to=functions.f<|channel|>commentary json<|message|>{"x": 7}<|call|>')
    assert HARMONY.parse(text)[0] == "Checking." and pairs(HARMONY.parse(text)[1]) == [("f", {"x": 7})]
    # an answer without calls stays as it was; built-in tools are not the request's functions
    plain = "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>Hi<|return|>"
    assert HARMONY.parse(plain) == (plain, [])
    browser = "<|channel|>analysis to=browser.search<|message|>{\"q\": 1}<|call|>"
    assert HARMONY.parse(browser) == (browser, [])
    # arguments that are not JSON are kept as a JSON string, none as an empty object
    bad = "<|channel|>commentary to=functions.f<|message|>x = 1<|call|>"
    assert pairs(HARMONY.parse(bad)[1]) == [("f", "x = 1")]
    assert pairs(HARMONY.parse("<|channel|>commentary to=functions.f<|message|><|call|>")[1]) \
        == [("f", {})]


def test_harmony_round_trip_of_several_calls():
    calls = [ToolCall("f", '{"x": 1}'), ToolCall("get_weather", '{"city": "Oslo"}')]
    assert pairs(HARMONY.parse(canonical_text(HARMONY, calls))[1]) == pairs(calls)


def test_harmony_plan_and_stream():
    msgs = [{"role": "user", "content": "hi"}]
    auto = plan(HARMONY_TEMPLATE, msgs, {}, TOOLS, "auto", True)
    assert auto.fmt is HARMONY and auto.template_kwargs["tools"]
    # raw output (reasoning_format none): held from its first channel, split at the end,
    # however it is cut
    for cut in (1, 5, 17, len(CALL_OUT)):
        sp = StreamSplitter(auto)
        shown = "".join(sp.feed(CALL_OUT[i:i + cut]) for i in range(0, len(CALL_OUT), cut))
        rest, calls = sp.finish()
        assert shown + rest == "" and pairs(calls) == [("get_weather", {"city": "Rome"})]
    # split by channel (the server's default): the answer streams, the calls come as parts
    parts = split_reasoning(CALL_OUT, "harmony").tool_calls
    sp = StreamSplitter(auto)
    assert sp.feed("Let me look.", parts) == "Let me look."
    rest, calls = sp.finish()
    assert rest == "" and pairs(calls) == [("get_weather", {"city": "Rome"})]
    content, calls = auto.split("Let me look.", parts)
    assert content == "Let me look." and pairs(calls) == [("get_weather", {"city": "Rome"})]
    # without tools in the request, the parts are not calls
    assert ToolPlan(None, []).split("x", parts) == ("x", [])
