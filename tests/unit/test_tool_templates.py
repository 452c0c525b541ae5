"""Every tool-taking chat template of llama.cpp's collection renders a conversation with
tools, a call and its result, and its format's call text parses back to the same calls."""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path

import pytest

from localllm.errors import TemplateError
from localllm.formats.fetch import vocab_suite_dir
from localllm.text.chat_template import ChatTemplate
from localllm.text.tool_calls import (ToolCall, canonical_text, detect_format, supports_tools,
                                      template_messages)

# llama.cpp's models/templates folder, extracted with the vocab suite
# (`python scripts/fetch_models.py --vocab-suite`); LLAMA_CPP_TEMPLATES names another copy.
TEMPLATES = Path(os.environ.get("LLAMA_CPP_TEMPLATES") or vocab_suite_dir() / "templates")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALLS = [ToolCall("get_weather", '{"city": "Paris"}', id="call_123456789"),
         ToolCall("get_weather", '{"city": "Rome"}', id="call_987654321")]
CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [c.as_openai() for c in CALLS]},
    {"role": "tool", "tool_call_id": CALLS[0].id, "name": "get_weather", "content": "18 C"},
    {"role": "tool", "tool_call_id": CALLS[1].id, "name": "get_weather", "content": "21 C"},
    {"role": "assistant", "content": "Paris 18 C, Rome 21 C."},
    {"role": "user", "content": "Thanks. And tomorrow?"},
]

ONE_CALL = [m if not m.get("tool_calls") else {**m, "tool_calls": m["tool_calls"][:1]}
            for m in CONVERSATION if m.get("tool_call_id") != CALLS[1].id]


def tool_templates() -> list[Path]:
    if not TEMPLATES.is_dir():
        return []
    return sorted(p for p in TEMPLATES.glob("*.jinja") if supports_tools(p.read_text()))


@pytest.mark.skipif(not TEMPLATES.is_dir(),
                    reason="no templates: `python scripts/fetch_models.py --vocab-suite`")
def test_every_tool_template_renders_and_round_trips():
    passed, failed = collections.Counter(), []
    for path in tool_templates():
        src = path.read_text()
        fmt = detect_format(src)
        try:
            t = ChatTemplate(src, path.name, bos_token="<s>", eos_token="</s>")
            try:
                text = t.render(template_messages(CONVERSATION, fmt), True, TOOLS)
            except TemplateError as e:   # Llama 3.1-3.3 take one call a turn
                if "single tool-call" not in str(e):
                    raise
                text = t.render(template_messages(ONE_CALL, fmt), True, TOOLS)
        except Exception as e:   # noqa: BLE001 - gathered, reported below
            failed.append(f"{path.name}: {type(e).__name__}: {str(e)[-260:]}")
            continue
        assert "get_weather" in text, path.name
        content, calls = fmt.parse(canonical_text(fmt, CALLS))
        assert [(c.name, json.loads(c.arguments)) for c in calls] == \
            [(c.name, json.loads(c.arguments)) for c in CALLS], path.name
        passed[fmt.name] += 1
    print("\ntool templates passed per format:", dict(passed), "failed:", len(failed))
    for f in failed:
        print("  ", f)
    assert sum(passed.values()) >= 10 and not failed, failed
