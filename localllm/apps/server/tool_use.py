"""Function calling for the chat endpoints: the plan of localllm.generation.tool_use with
its schema as the request's output constraint and its errors as 400s, and the calls as
OpenAI's stream deltas."""

from __future__ import annotations

import json
from dataclasses import dataclass

from localllm.generation import tool_use as _plans
from localllm.generation.constrain.calls import ToolGrammar
from localllm.generation.tool_stream import CallArgs, CallDone, CallStart, StreamSplitter
from localllm.text.tool_calls import ToolCall, ToolCallError
from .errors import api_error
from .runs import OutputFormat

__all__ = ["ToolPlan", "StreamSplitter", "CallStart", "CallArgs", "CallDone", "plan",
           "call_deltas", "arguments_json"]


@dataclass
class ToolPlan(_plans.ToolPlan):
    """A plan with its schema as an output format (the ``tools`` field's)."""

    @property
    def output(self) -> OutputFormat | None:
        """The answer's constraint: the template's own calls ('tool_calls', a ToolGrammar),
        the generic format's JSON ('json_schema'), or None for free text."""
        if self.schema is None:
            return None
        kind = "tool_calls" if isinstance(self.schema, ToolGrammar) else "json_schema"
        return OutputFormat(kind, self.schema, "tools")


def plan(template_source: str, messages: list[dict], template_kwargs: dict, tools, tool_choice,
         parallel: bool) -> ToolPlan:
    """The plan of a chat request (localllm.generation.tool_use.plan).

    Args:
        template_source, messages, template_kwargs, tools, tool_choice, parallel: as there.
    Returns:
        the ToolPlan.
    Raises:
        APIError: 400 for tools that cannot be used.
    """
    try:
        p = _plans.plan(template_source, messages, template_kwargs, tools, tool_choice,
                        parallel)
    except ToolCallError as e:
        raise api_error(e, "tools") from None
    return ToolPlan(p.fmt, p.messages, p.template_kwargs, p.schema)


def call_deltas(events) -> list[dict]:
    """Stream deltas of a StreamSplitter's call events as OpenAI sends them: a call's first
    with its index, id, type, name and empty arguments, the next with argument fragments."""
    out = []
    for ev in events:
        if isinstance(ev, CallStart):
            out.append({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                        "function": {"name": ev.name, "arguments": ""}}]})
        elif isinstance(ev, CallArgs):
            out.append({"tool_calls": [{"index": ev.index,
                                        "function": {"arguments": ev.fragment}}]})
    return out


def arguments_json(call: ToolCall) -> dict:
    """A call's arguments decoded."""
    return json.loads(call.arguments)
