"""Tool-call parsing of each format, the generic answer's schema, and the stream splitter's
holding back of a call's start."""

from __future__ import annotations

import json

import pytest

from localllm.apps.server.tool_use import StreamSplitter, ToolPlan, plan
from localllm.text.reasoning import split_reasoning
from localllm.text.chat_template import ChatTemplate
from localllm.text.tool_calls import (COMMAND_R7B, DEEPSEEK_R1, DEEPSEEK_V31, FUNCTIONARY_V32,
                                      GENERIC, GLM, GRANITE, HARMONY, HERMES, LLAMA3, MISTRAL,
                                      MISTRAL_NEMO, QWEN3_CODER, ToolCall, ToolCallError, canonical_text,
                                      detect_format, functions, generic_schema,
                                      template_messages)

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
    # <tool_call> beside other markup: MiniMax M3's <invoke>, Apriel 1.5's <tool_calls>[
    assert detect_format("{{ tools }}<tool_call><invoke name=\"f\">") is GENERIC
    assert detect_format("{{ tools }}<tool_call></tool_call> <tool_calls>[{...}]") is GENERIC


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
    assert auto.fmt is HERMES and auto.template_kwargs["tools"]
    assert auto.output.kind == "tool_calls" and auto.output.schema.trigger == "<tool_call>"
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


# ----------------------------------------------------------------------------- families

FAMILIES = [DEEPSEEK_R1, DEEPSEEK_V31, COMMAND_R7B, FUNCTIONARY_V32, GRANITE, QWEN3_CODER, GLM]
TWO = [ToolCall("get_weather", '{"city": "Paris"}'),
       ToolCall("f", '{"x": [1, {"y": "\\u00e9"}], "z": null}')]


@pytest.mark.parametrize("fmt", FAMILIES, ids=lambda f: f.name)
@pytest.mark.parametrize("n", [1, 2])
def test_family_round_trip(fmt, n):
    content, calls = fmt.parse(canonical_text(fmt, TWO[:n]))
    assert content == "" and pairs(calls) == pairs(TWO[:n])


def test_family_content_around_calls():
    r1 = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n"
          '```json\n{"x": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜> Done?')
    assert DEEPSEEK_R1.parse(r1)[0] == "Let me check. Done?"
    assert pairs(DEEPSEEK_R1.parse(r1)[1]) == [("f", {"x": 1})]
    v31 = ("CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"x\": 1}"
           "<｜tool▁call▁end｜><｜tool▁call▁begin｜>g<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
           "<｜tool▁calls▁end｜>")
    assert DEEPSEEK_V31.parse(v31)[0] == "CONTENT"
    assert pairs(DEEPSEEK_V31.parse(v31)[1]) == [("f", {"x": 1}), ("g", {})]
    r7b = ('<|START_THINKING|>I will call f.<|END_THINKING|><|START_ACTION|>[\n    {"tool_call_id":'
           ' "0", "tool_name": "f", "parameters": {"x": 1}}\n]<|END_ACTION|>')
    content, calls = COMMAND_R7B.parse(r7b)
    assert content == "<|START_THINKING|>I will call f.<|END_THINKING|>"
    assert pairs(calls) == [("f", {"x": 1})]
    assert COMMAND_R7B.parse("<|START_RESPONSE|>Hi there.<|END_RESPONSE|>") == ("Hi there.", [])
    fn = 'all\nLet me check.\n>>>f\n{"x": 1}\n>>>g\n{}'
    assert FUNCTIONARY_V32.parse(fn)[0] == "Let me check."
    assert pairs(FUNCTIONARY_V32.parse(fn)[1]) == [("f", {"x": 1}), ("g", {})]
    assert FUNCTIONARY_V32.parse("all\nHello, world!\n>>> print(1)") == \
        ("Hello, world!\n>>> print(1)", [])
    gr = 'Sure.<|tool_call|>[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]'
    assert GRANITE.parse(gr)[0] == "Sure."
    assert pairs(GRANITE.parse(gr)[1]) == [("f", {"x": 1}), ("g", {})]


@pytest.mark.parametrize("text", [
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"x\": ",
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>not json<｜tool▁call▁end｜>",
    "<｜tool▁calls▁begin｜>",
    '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "param',
    '<|START_ACTION|>[{"name": "f"}]<|END_ACTION|>',
    "f\nnot json", "all", "no recipient line at all", ">>>f\n{\"x\": ",
    '<|tool_call|>[{"name": "f", "argu', "<|tool_call|>[1, 2]",
])
def test_family_malformed_text_stays_content(text):
    for fmt in FAMILIES:
        assert fmt.parse(text) == (text, []), fmt.name


def test_family_detection_keeps_earlier_families():
    r1 = "{% for tool in message['tool_calls'] %}<｜tool▁sep｜>```json{% endfor %}"
    assert detect_format(r1) is DEEPSEEK_R1
    assert detect_format("{% if message['tool_calls'] %}<｜tool▁sep｜>{% endif %}") is DEEPSEEK_V31
    assert detect_format("{% if tools %}<|START_ACTION|>{% endif %}") is COMMAND_R7B
    assert detect_format("{% if tools %}<|START_TEXT|><|START_ACTION|>{% endif %}") is GENERIC
    assert detect_format("{% if tools %}>>>all\n{% endif %}") is FUNCTIONARY_V32
    assert detect_format("{% if tools %}<|tool_call|>{% endif %}") is GRANITE
    assert detect_format("{% if tools %}<tool_call><|tool_call|>{% endif %}") is HERMES


def test_history_arguments_join_strings_as_json():
    # Functionary v3.2's and R1-Distill-Llama's templates write '...' + arguments
    src = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
           "{{ '>>>' + c.function.name + '\\n' + c.function.arguments }}"
           "|{{ c.arguments | tojson }}|{{ c.arguments.x }}{% endfor %}"
           "{% if m.content is none %}(none){% endif %}{% endfor %}")
    call = ToolCall("f", '{"x": 1}').as_openai()
    msgs = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    t = ChatTemplate(src, "t")
    assert t.render(template_messages(msgs, FUNCTIONARY_V32), False) == '>>>f\n{"x": 1}|{"x": 1}|1'
    assert t.render(template_messages(msgs, DEEPSEEK_R1), False).endswith("(none)")


def test_command_r7b_body_schema_names_its_keys():
    s = COMMAND_R7B.body_schema(TOOLS)
    assert list(s["properties"]) == ["tool_call_id", "tool_name", "parameters"]
    assert s["required"] == ["tool_call_id", "tool_name", "parameters"]


def _streamed(fmt, text: str, cut: int, tools=None):
    from localllm.generation.tool_stream import CallArgs, CallStart
    sp = StreamSplitter(ToolPlan(fmt, [], {"tools": tools} if tools else {}))
    shown, events = "", []
    for i in range(0, len(text), cut):
        shown += sp.feed(text[i:i + cut])
        events += sp.take()
    rest, calls = sp.finish()
    events += sp.take()
    starts = [e for e in events if isinstance(e, CallStart)]
    args = ["".join(e.fragment for e in events if isinstance(e, CallArgs) and e.index == i)
            for i in range(len(starts))]
    pieces = sum(isinstance(e, CallArgs) for e in events)
    return shown + rest, calls, starts, args, pieces


STREAM_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"},
                                         "n": {"type": "array"}, "x": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer"}}}}}]


def test_calls_stream_in_fragments_that_add_up_in_every_format():
    from localllm.text.tool_calls import FORMATS, ToolCall, canonical_text
    calls = [ToolCall("get_weather", json.dumps(
        {"city": 'Pa"ris é \\u', "unit": "c", "n": [1.5, -2e3, True, None, {}],
         "x": "\U0001F600"}, ensure_ascii=False)), ToolCall("get_time", '{"zone": 10}')]
    for name in ("hermes", "llama3", "mistral_nemo", "mistral", "generic", "deepseek_r1",
                 "deepseek_v31", "command_r7b", "functionary_v32", "granite", "qwen3_coder",
                 "glm"):
        fmt = FORMATS[name]
        text = canonical_text(fmt, calls)
        for t in (text, text.replace(", ", ",").replace(": ", ":"),   # compact JSON
                  text.replace("\\ud83d\\ude00", "\U0001F600")):
            want = fmt.parse(t, STREAM_TOOLS)[1]
            assert [json.loads(c.arguments) for c in want] == \
                [json.loads(c.arguments) for c in calls], name
            for cut in (1, 2, 5, len(t)):
                content, got, starts, args, pieces = _streamed(fmt, t, cut, STREAM_TOOLS)
                assert content == "" and [c.name for c in got] == [c.name for c in want]
                # each call once, with the id its final form keeps, and fragments that
                # make exactly the arguments the whole text parses to
                assert [(s.id, s.name) for s in starts] == [(c.id, c.name) for c in got]
                assert args == [c.arguments for c in want] == [c.arguments for c in got]
                if cut == 1:
                    assert pieces > 20, name


def test_text_that_is_no_call_still_streams_as_content():
    for fmt, text in ((HERMES, "hi <tool_call> not json"), (GENERIC, '{"response": "hey"}'),
                      (HERMES, '<tool_call>{"name": 3}'),
                      (QWEN3_CODER, "<tool_call>\n<function=f\n<parameter=x>\n1\n</tool_call>"),
                      (GLM, "a <tool_call><arg_value>1</arg_value></tool_call>")):
        content, calls, starts, _, _ = _streamed(fmt, text, 2)
        assert calls == [] and starts == []
        assert content == ("hey" if fmt is GENERIC else text)


# ----------------------------------------------------------------------------- XML calls

XML_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"zip": {"type": "string"}, "n": {"type": "integer"},
                                     "tags": {"type": ["array", "string"]},
                                     "code": {"type": "string"},
                                     "opt": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}}}}}]
QWEN_CALL = ("Let me look.\n<tool_call>\n<function=f>\n<parameter=zip>\n10001\n</parameter>\n"
             "<parameter=n>\n7\n</parameter>\n<parameter=tags>\nnot a list\n</parameter>\n"
             "<parameter=opt>\ntrue\n</parameter>\n<parameter=code>\nif a:\n    b()\n"
             "</parameter>\n</function>\n</tool_call>")


def test_xml_values_follow_the_parameter_schemas():
    content, calls = QWEN3_CODER.parse(QWEN_CALL, XML_TOOLS)
    assert content == "Let me look."
    assert pairs(calls) == [("f", {"zip": "10001", "n": 7, "tags": "not a list", "opt": True,
                                   "code": "if a:\n    b()"})]
    # without the tools, a value that is JSON is JSON
    assert json.loads(QWEN3_CODER.parse(QWEN_CALL)[1][0].arguments)["zip"] == 10001
    glm = ("<tool_call>f\n<arg_key>zip</arg_key>\n<arg_value>02134</arg_value>\n"
           "<arg_key>n</arg_key><arg_value>3</arg_value></tool_call>done")
    content, calls = GLM.parse(glm, XML_TOOLS)
    assert content == "done" and pairs(calls) == [("f", {"zip": "02134", "n": 3})]


def test_a_plans_whole_output_types_xml_values_by_its_tools():
    """Not streamed, the plan's split reads the values with the request's tools, as the
    stream does: a string parameter written as digits stays a string."""
    src = "{% if tools %}<tool_call>\n<function={{ n }}>\n<parameter={{ k }}>{% endif %}"
    p = plan(src, [{"role": "user", "content": "zip?"}], {}, XML_TOOLS, "auto", True)
    assert p.fmt is QWEN3_CODER
    content, calls = p.split(QWEN_CALL)
    assert content == "Let me look." and json.loads(calls[0].arguments)["zip"] == "10001"


def test_xml_detection_comes_before_hermes():
    qwen = "{% if tools %}<tool_call>\n<function={{ n }}>\n<parameter={{ k }}>{% endif %}"
    glm = "{% if tools %}<tool_call>{{ n }}<arg_key>{{ k }}</arg_key><arg_value>{% endif %}"
    assert detect_format(qwen) is QWEN3_CODER and detect_format(glm) is GLM


def test_xml_string_values_stream_as_they_come():
    for cut in (1, 3, len(QWEN_CALL)):
        content, calls, starts, args, pieces = _streamed(QWEN3_CODER, QWEN_CALL, cut, XML_TOOLS)
        assert content == "Let me look.\n" and [s.name for s in starts] == ["f"]
        assert args == [c.arguments for c in QWEN3_CODER.parse(QWEN_CALL, XML_TOOLS)[1]]
    _, _, _, _, pieces = _streamed(QWEN3_CODER, QWEN_CALL, 1, XML_TOOLS)
    assert pieces > 15   # the code's characters came one by one


def test_functionary_holds_its_first_line():
    for cut in (1, 2, 7):
        text = 'all\nLet me check.\n>>>f\n{"x": 1}'
        content, calls, starts, args, _ = _streamed(FUNCTIONARY_V32, text, cut)
        assert content == "Let me check.\n" and args == ['{"x": 1}']
        content, calls, starts, args, _ = _streamed(FUNCTIONARY_V32, 'f\n{"x": 2}', cut)
        assert content == "" and pairs(calls) == [("f", {"x": 2})] and args == ['{"x": 2}']
        content, calls, starts, _, _ = _streamed(FUNCTIONARY_V32, "Hello, there!", cut)
        assert content == "Hello, there!" and calls == [] and starts == []
    sp = StreamSplitter(ToolPlan(FUNCTIONARY_V32, []))
    assert sp.feed("al") == "" and sp.feed("l\nHi") == "Hi"
