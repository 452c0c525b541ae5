"""Every chat template of llama.cpp's collection that mentions tools renders a conversation
with tools, calls and their results; every one of a known call format parses its canonical
calls back, and (where the format is well-defined there) the calls the template itself
writes into history. Templates of formats we do not parse are named, each with a reason."""

from __future__ import annotations

import collections
import functools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from localllm.errors import TemplateError
from localllm.formats.fetch import vocab_suite_dir
from localllm.text.chat_template import ChatTemplate
from localllm.text.tool_calls import (GENERIC, ToolCall, ToolFormat, canonical_text,
                                      detect_format, template_messages)

# llama.cpp's models/templates folder, extracted with the vocab suite
# (`python scripts/fetch_models.py --vocab-suite`); LLAMA_CPP_TEMPLATES names another copy.
TEMPLATES = Path(os.environ.get("LLAMA_CPP_TEMPLATES") or vocab_suite_dir() / "templates")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALLS = [ToolCall("get_weather", '{"city": "Paris"}', id="call_123456789"),
         ToolCall("get_weather", '{"city": "Rome"}', id="call_987654321")]
ASKED = [{"role": "system", "content": "You are helpful."},
         {"role": "user", "content": "Weather in Paris and Rome?"}]
CALLED = {"role": "assistant", "content": "", "tool_calls": [c.as_openai() for c in CALLS]}
CONVERSATION = ASKED + [
    CALLED,
    {"role": "tool", "tool_call_id": CALLS[0].id, "name": "get_weather", "content": "18 C"},
    {"role": "tool", "tool_call_id": CALLS[1].id, "name": "get_weather", "content": "21 C"},
    {"role": "assistant", "content": "Paris 18 C, Rome 21 C."},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]
# Llama 3.1-3.3 take one call a turn
ONE_CALL = [m if not m.get("tool_calls") else {**m, "tool_calls": m["tool_calls"][:1]}
            for m in CONVERSATION if m.get("tool_call_id") != CALLS[1].id]

# Templates that take tools in a call format no parser here reads: they get the generic
# JSON format (tools described in a system message), named so a new one is not missed.
UNSUPPORTED = {
    "Apertus-8B-Instruct.jinja": "calls as a JSON list after <|tools_prefix|>",
    "Apriel-1.6-15b-Thinker-fixed.jinja": "<tool_calls>[...] JSON list after reasoning",
    "ByteDance-Seed-OSS.jinja": "<seed:tool_call><function=..><parameter=..> XML",
    "Cohere2MoE.jinja": "<|START_ACTION|> as R7B, but text in <|START_TEXT|> blocks",
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": "'Action:' and a ```json list",
    "GigaChat3-10B-A1.8B.jinja": "a `function call` role turn holding the call's JSON",
    "GigaChat3.1-10B-A1.8B.jinja": "a `function call` role turn holding the call's JSON",
    "Kimi-K2-Instruct.jinja": "<|tool_calls_section_begin|> with functions.NAME:IDX ids",
    "Kimi-K2-Thinking.jinja": "<|tool_calls_section_begin|> with functions.NAME:IDX ids",
    "Kimi-K3.jinja": "<|open|>/<|close|> call markup",
    "LFM2-8B-A1B.jinja": "<|tool_call_start|>[name(arg=..)] Python-call syntax",
    "LFM2.5-8B-A1B.jinja": "<|tool_call_start|>[name(arg=..)] Python-call syntax",
    "LFM2.5-Instruct.jinja": "plain 'List of tools: [...]', calls as Python-call syntax",
    "MiniMax-M1.jinja": "<tool_calls> with one JSON object a line",
    "MiniMax-M2.jinja": "<minimax:tool_call><invoke name=..><parameter ..> XML",
    "MiniMax-M3.jinja": "]<]minimax[>[<tool_call> around <invoke name=..> XML markup",
    "NVIDIA-Nemotron-Nano-v2.jinja": "<TOOLCALL>[...]</TOOLCALL> JSON list",
    "deepseek-ai-DeepSeek-V3.2.jinja": "DSML <｜DSML｜invoke> XML markup",
    "deepseek-ai-DeepSeek-V4-Flash-0731.jinja": "DSML <｜DSML｜invoke> XML markup",
    "deepseek-ai-DeepSeek-V4.jinja": "DSML <｜DSML｜invoke> XML markup",
    "fireworks-ai-llama-3-firefunction-v2.jinja": "' functools[...]' JSON list",
    "google-gemma-4-31B-it-interleaved.jinja": "<|tool_call>call:NAME{..} Gemma 4 syntax",
    "google-gemma-4-31B-it.jinja": "<|tool_call>call:NAME{..} Gemma 4 syntax",
    "moonshotai-Kimi-K2.jinja": "<|tool_calls_section_begin|> with functions.NAME:IDX ids",
    "muse-glimmer.jinja": "<atem:function_calls> with to=recipient messages",
    "openbmb-MiniCPM5-1B.jinja": "<function name=..><param name=..> XML",
    "tencent-Hy3.jinja": "<tool_calls…><tool_call…>NAME<tool_sep…> markup (HYTK tokens)",
    "unsloth-Apriel-1.5.jinja": "<tool_calls>[...] JSON list (its prompt says <tool_call>)",
    "upstage-Solar-Open-100B.jinja": "<|tool_call:begin|> markup",
}
# Templates that take tools yet do not render the test conversation, with why.
RENDER_FAILS = {
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja":
        "reads tool.description at the top level (Cohere's own tool shape, not OpenAI's)",
    "fireworks-ai-llama-3-firefunction-v2.jinja":
        "reads a `functions` variable of its own instead of `tools`",
}
# Formats whose templates write calls into history as the model writes them, so that the
# template's own text for an assistant's calls must parse back; templates of these formats
# that do not, with why.
OWN_RENDERING_FORMATS = {"deepseek_r1", "deepseek_v31", "command_r7b", "functionary_v32",
                         "mistral_nemo", "mistral", "harmony", "llama3", "qwen3_coder", "glm"}
OWN_RENDERING_EXCEPTIONS = {
    "meetkai-functionary-medium-v3.1.jinja":
        "writes <function=NAME>{...}</function>; detected as llama3 for its <|python_tag|>",
}
# Where the model's turn ends: its own text for the calls stops before these.
END_OF_TURN = ("<|eot_id|>", "<|eom_id|>", "</s>", "<|end_of_text|>", "<|im_end|>",
               "<｜end▁of▁sentence｜>", "<|END_OF_TURN_TOKEN|>")


def pairs(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def mentions_tools(src: str) -> bool:
    return "tools" in src or "tool_calls" in src


@dataclass
class Survey:
    """What happened to each template that mentions tools."""
    formats: dict[str, str] = field(default_factory=dict)       # template -> format name
    render_errors: dict[str, str] = field(default_factory=dict)
    parse_errors: dict[str, str] = field(default_factory=dict)
    own: dict[str, bool | None] = field(default_factory=dict)    # None: wrote no calls


def _render(t: ChatTemplate, messages: list[dict], fmt: ToolFormat, gen: bool) -> str:
    return t.render(template_messages(messages, fmt), gen, TOOLS)


def _own_calls_text(t: ChatTemplate, fmt: ToolFormat, called: dict) -> str:
    """The text the template adds for an assistant's calls: the conversation through them,
    less its common start with the prompt that asks for that answer."""
    asked = _render(t, ASKED, fmt, True)
    answered = _render(t, ASKED + [called], fmt, False)
    own = answered[len(os.path.commonprefix([asked, answered])):]
    return own[:min([own.find(e) for e in END_OF_TURN if e in own] + [len(own)])]


@functools.lru_cache(maxsize=1)
def survey() -> Survey:
    s = Survey()
    for path in sorted(TEMPLATES.glob("*.jinja")):
        src = path.read_text()
        if not mentions_tools(src):
            continue
        fmt = detect_format(src)
        s.formats[path.name] = fmt.name
        t = ChatTemplate(src, path.name, bos_token="<s>", eos_token="</s>")
        calls, called = CALLS, CALLED
        try:
            try:
                text = _render(t, CONVERSATION, fmt, True)
            except TemplateError as e:
                if "single tool-call" not in str(e):
                    raise
                calls, called = CALLS[:1], {**CALLED, "tool_calls": CALLED["tool_calls"][:1]}
                text = _render(t, ONE_CALL, fmt, True)
            assert "get_weather" in text
        except Exception as e:   # noqa: BLE001 - gathered, asserted below
            s.render_errors[path.name] = f"{type(e).__name__}: {str(e)[-200:]}"
            continue
        if fmt is GENERIC:
            continue
        parsed = fmt.parse(canonical_text(fmt, CALLS))[1]
        if pairs(parsed) != pairs(CALLS):
            s.parse_errors[path.name] = f"parsed {pairs(parsed)}"
        try:
            own = _own_calls_text(t, fmt, called)
        except Exception:   # noqa: BLE001 - a template may refuse to end on calls
            s.own[path.name] = False
            continue
        # the calls the template wrote (gpt-oss's writes a turn's first call only)
        wrote = [c for c in calls if json.loads(c.arguments)["city"] in own]
        s.own[path.name] = pairs(fmt.parse(own)[1]) == pairs(wrote) if wrote else None
    return s


def _table(s: Survey) -> str:
    rows = collections.defaultdict(lambda: [0, 0, 0, 0, 0])
    for name, fmt in s.formats.items():
        r = rows[fmt]
        r[0] += 1
        r[1] += name not in s.render_errors
        if fmt != "generic" and name not in s.render_errors:
            r[2] += name not in s.parse_errors
            r[3] += s.own.get(name) is True
            r[4] += s.own.get(name) is None
    lines = [f"{'format':16} {'templates':>9} {'rendered':>8} {'parsed':>6} {'own':>4} "
             f"{'no-own':>6}"]
    for fmt, r in sorted(rows.items()):
        lines.append(f"{fmt:16} {r[0]:9} {r[1]:8} {r[2]:6} {r[3]:4} {r[4]:6}")
    return "\n".join(lines)


needs_templates = pytest.mark.skipif(
    not TEMPLATES.is_dir(), reason="no templates: `python scripts/fetch_models.py --vocab-suite`")


@needs_templates
def test_every_tool_template_renders_calls_and_results():
    s = survey()
    print("\n" + _table(s))
    assert len(s.formats) >= 60
    assert s.render_errors.keys() == RENDER_FAILS.keys(), s.render_errors


@needs_templates
def test_every_known_format_parses_its_calls_back():
    s = survey()
    assert not s.parse_errors, s.parse_errors
    unknown = {n for n, f in s.formats.items() if f == "generic"}
    assert unknown == UNSUPPORTED.keys(), (sorted(unknown - UNSUPPORTED.keys()),
                                           sorted(UNSUPPORTED.keys() - unknown))
    for family in ("deepseek_r1", "deepseek_v31", "command_r7b", "functionary_v32", "granite",
                   "qwen3_coder", "glm"):
        assert family in s.formats.values(), family


@needs_templates
def test_templates_own_calls_parse_back():
    s = survey()
    checked = {n: ok for n, ok in s.own.items() if s.formats[n] in OWN_RENDERING_FORMATS}
    bad = sorted(n for n, ok in checked.items() if ok is not True)
    print("\nown rendering parsed back:", sum(ok is True for ok in checked.values()),
          "of", len(checked), "checked;", "not:", bad)
    assert set(bad) == OWN_RENDERING_EXCEPTIONS.keys(), bad
