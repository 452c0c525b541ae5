"""Function calling for chat: how tools reach the prompt (the template's own tool support, or
the generic JSON format described in a system message), the JSON schema the answer is held to
for tool_choice required / named, and the split of the output into calls."""

from __future__ import annotations

from dataclasses import dataclass, field

from localllm.text.tool_calls import (GENERIC, ToolCall, ToolCallError, ToolFormat,
                                      canonical_text, detect_format, functions,
                                      generic_schema, generic_system_prompt, harmony_call,
                                      template_messages)


@dataclass
class ToolPlan:
    """How one chat request uses its tools.

    fmt: the format the output is parsed with (None: no tools, plain text).
    messages / template_kwargs: what the template renders.
    schema: the JSON schema the answer is constrained to, or None.
    """
    fmt: ToolFormat | None
    messages: list[dict]
    template_kwargs: dict = field(default_factory=dict)
    schema: dict | None = None

    def split(self, text: str, parts=()) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a choice's whole output.

        Args:
            text: the output's content.
            parts: harmony messages to functions that the reasoning split already took
                out of ``text`` (localllm.text.reasoning Parts of kind "tool_call").
        """
        if self.fmt is None:
            return text, []
        content, calls = self.fmt.parse(text)
        return content, calls + harmony_calls(parts)

    @property
    def buffers(self) -> bool:
        """Whether streamed text must be held back whole (the generic format is one JSON)."""
        return self.fmt is GENERIC


def harmony_calls(parts) -> list[ToolCall]:
    """The calls of harmony "tool_call" Parts addressed to functions (others dropped)."""
    return [c for c in (harmony_call(p.name, p.text) for p in parts if p.kind == "tool_call")
            if c is not None]


def _generic_history(messages: list[dict]) -> list[dict]:
    """History for a template without tools: calls as the JSON the model answers with,
    results as user messages."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [ToolCall(c["function"]["name"], c["function"].get("arguments") or "{}")
                     for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": canonical_text(GENERIC, calls)})
        elif m["role"] == "tool":
            who = m.get("name") or m.get("tool_call_id") or "the tool"
            out.append({"role": "user", "content": f"Result of {who}: {m['content']}"})
        else:
            out.append(m)
    return out


def _with_system(messages: list[dict], text: str) -> list[dict]:
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def plan(template_source: str, messages: list[dict], template_kwargs: dict, tools, tool_choice,
         parallel: bool) -> ToolPlan:
    """The plan of a chat request.

    Args:
        template_source: the model's chat template source.
        messages: the conversation as template messages (with tool_calls / tool messages).
        template_kwargs: the request's further template variables.
        tools, tool_choice, parallel: the request's fields.
    Returns:
        the ToolPlan.
    Raises:
        ToolCallError: tools or a tool_choice that cannot be used.
    """
    funcs = functions(tools)
    mode = tool_choice if isinstance(tool_choice, str) else ("auto" if tool_choice is None
                                                            else "required")
    name = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    if name is not None and name not in {f["name"] for f in funcs}:
        raise ToolCallError(f"tool_choice names the function {name!r}, which is not "
                            "among the tools")
    native = detect_format(template_source)
    if native is GENERIC:
        history = _generic_history(messages)
    else:
        history = template_messages(messages, native)
    if not funcs or mode == "none":
        kw = dict(template_kwargs, tools=tools) if funcs and native is not GENERIC \
            else template_kwargs
        return ToolPlan(None, history, kw)
    if native is not GENERIC and mode == "auto":
        return ToolPlan(native, history, dict(template_kwargs, tools=tools))
    # The generic JSON answer: for templates without tools, and (constrained, so the call
    # always parses and fits the schemas) for required / a named function.
    parallel = parallel and name is None   # a named function: that one call
    schema = generic_schema(tools, mode, name, parallel)
    if native is GENERIC:
        history = _with_system(history, generic_system_prompt(
            [t for t in tools if name is None or t["function"]["name"] == name],
            mode, parallel))
        kw = template_kwargs
    else:
        kw = dict(template_kwargs, tools=tools)
    return ToolPlan(GENERIC, history, kw, schema)
