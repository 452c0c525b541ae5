"""Function calling for chat: how tools reach the prompt (the template's own tool support, or
the generic JSON format described in a system message), what the answer is held to (the
calls in the template's own format, lazily under tool_choice auto; the generic JSON), and
the split of the output into calls."""

from __future__ import annotations

from dataclasses import dataclass, field

import json

from localllm.generation.constrain.calls import ToolGrammar, answer_constraint
from localllm.text.tool_formats import XML_OPEN
from localllm.text.tool_calls import (GENERIC, ToolCall, ToolCallError, ToolFormat,
                                      canonical_text, detect_format, functions,
                                      generic_schema, generic_system_prompt, harmony_call,
                                      supports_tools, template_messages)


@dataclass
class ToolPlan:
    """How one chat request uses its tools.

    fmt: the format the output is parsed with (None: no tools, plain text).
    messages / template_kwargs: what the template renders.
    schema: what the answer is held to: the JSON schema of the generic format's whole
        answer (a dict), a ToolGrammar of the template's own call format (lazy under
        tool_choice auto), or None (free text).
    """
    fmt: ToolFormat | None
    messages: list[dict]
    template_kwargs: dict = field(default_factory=dict)
    schema: dict | ToolGrammar | None = None

    def constraint(self, vocab):
        """The answer's constraint over a vocabulary (a TokenConstraint or LazyConstraint
        to copy() for each generation), or None for free text.

        Raises:
            GrammarError: a tool's parameters schema the compiler does not support.
        """
        return None if self.schema is None else answer_constraint(self.schema, vocab)

    def split(self, text: str, parts=()) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a choice's whole output.

        Args:
            text: the output's content.
            parts: harmony messages to functions that the reasoning split already took
                out of ``text`` (localllm.text.reasoning Parts of kind "tool_call").
        """
        if self.fmt is None:
            return text, []
        # the tools type XML parameter values (a string parameter "10001" stays a string)
        content, calls = self.fmt.parse(text, self.template_kwargs.get("tools"))
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


def _example_value(schema):
    """A placeholder value of a parameter's schema, for the example call."""
    if not isinstance(schema, dict):
        return "..."
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    t = schema.get("type")
    t = t[0] if isinstance(t, list) and t else t
    return {"integer": 0, "number": 0, "boolean": True, "array": [], "object": {},
            "null": None}.get(t, "...")


def native_system_prompt(fmt: ToolFormat, tools: list[dict]) -> str:
    """The system message that lists the tools and shows one call in the format's own syntax,
    for a template that reads calls in that format but never renders the tools.

    Args:
        fmt: the template's format.
        tools: the OpenAI tools the model may call.
    Returns:
        the message's text.
    """
    funcs = functions(tools)
    listing = json.dumps([{"name": f["name"], "description": f.get("description", ""),
                           "parameters": f.get("parameters") or {"type": "object"}}
                          for f in funcs], ensure_ascii=False, indent=2)
    params = funcs[0].get("parameters") or {}
    args = {k: _example_value(v) for k, v in (params.get("properties") or {}).items()}
    example = canonical_text(fmt, [ToolCall(funcs[0]["name"], json.dumps(args))])
    return (f"You can call these functions to answer the user:\n{listing}\n\n"
            f"To call a function, write the call exactly in this form (here "
            f"{funcs[0]['name']} with placeholder arguments, as JSON):\n{example}\n"
            "Then wait for its result.")


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
    one = name is not None   # a named function: that one call
    parallel = parallel and not one
    offered = [t for t in tools if name is None or t["function"]["name"] == name]
    shown = supports_tools(template_source)
    if native is not GENERIC:
        kw = dict(template_kwargs, tools=tools)
        grammar = native_grammar(native, tools, name, parallel, lazy=mode == "auto")
        if grammar is not None or mode == "auto":
            if not shown:
                # The template reads calls back but never shows the tools (DeepSeek R1's
                # distills, V3.1): tell the model about them and the call syntax.
                history = _with_system(history, native_system_prompt(native, offered))
            return ToolPlan(native, history, kw, grammar)
    # The generic JSON answer: for templates without tools, and for required / a named
    # function where the template's format has no grammar here.
    schema = generic_schema(tools, mode, name, parallel)
    if not shown:
        history = _with_system(history, generic_system_prompt(offered, mode, parallel))
        kw = template_kwargs
    return ToolPlan(GENERIC, history, kw, schema)


XML_FORMATS = ("qwen3_coder", "glm")   # calls whose arguments are XML, one value a parameter

_PROBE_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
_PROBE_ARGS = {"x": 1}


def _probe_text(fmt: ToolFormat) -> str:
    """One call of the probe tool, written as the grammar of ``fmt`` lays it out."""
    if fmt.name_sep is not None:
        call = ("" if fmt.starts_open else fmt.prefix) + "f" + fmt.name_sep \
            + json.dumps(_PROBE_ARGS) + fmt.suffix
        return fmt.block_open + call + fmt.block_close
    shape = fmt.body_schema(_PROBE_TOOLS)["properties"]
    body = {k: s["const"] if "const" in s else (_PROBE_ARGS if s.get("type") == "object"
                                                 else "abc123xyz")
            for k, s in shape.items()}
    return fmt.prefix + json.dumps([body] if fmt.as_list else body) + fmt.suffix


def _reads_back(fmt: ToolFormat) -> bool:
    """Whether the format reads back one call written as its grammar would hold it: its
    prefix, a JSON body in the shape of its body_schema and its suffix; or, for formats that
    write the name as text, prefix + NAME + name_sep + arguments + suffix inside the block.
    A format whose calls are written otherwise gets no grammar."""
    try:
        content, calls = fmt.parse(_probe_text(fmt))
    except (ValueError, KeyError, TypeError):
        return False
    return (not content.strip() and len(calls) == 1 and calls[0].name == "f"
            and json.loads(calls[0].arguments) == _PROBE_ARGS)


def native_grammar(fmt: ToolFormat, tools: list[dict], name: str | None, parallel: bool,
                   lazy: bool) -> ToolGrammar | None:
    """The grammar of a format's own calls, from the tools' schemas.

    Args:
        fmt: the template's format.
        tools: the request's tools; name: only this function (a named tool_choice).
        parallel: whether several calls may come; lazy: free text until the trigger.
    Returns:
        the ToolGrammar, or None for a format whose calls are not its prefix, a JSON body
        (or a name, its separator and the arguments) and its suffix, nor XML calls, or
        whose trigger does not begin that text.
    """
    if fmt.name == "harmony":
        return _harmony_grammar(fmt, tools, name, lazy)
    if fmt.trigger and fmt.prefix.startswith(fmt.trigger) and fmt.prefix != fmt.trigger \
            and fmt.name_sep is not None:
        # The trigger is shared with other text (harmony's "<|channel|>" opens its analysis
        # and final channels too): holding all that follows it would forbid them.
        return None
    if fmt.name in XML_FORMATS:
        named = {f["name"]: f.get("parameters") or {"type": "object"}
                 for f in functions(tools) if name is None or f["name"] == name}
        return ToolGrammar(XML_OPEN, {}, repeat=parallel, trigger=fmt.trigger if lazy else "",
                           named=named, xml=fmt.name)
    if not _reads_back(fmt):
        return None
    if fmt.name_sep is not None:
        return _named_grammar(fmt, tools, name, parallel, lazy)
    opening = fmt.prefix.rstrip() + ("[" if fmt.as_list else "{")
    if lazy and not (fmt.trigger and opening.startswith(fmt.trigger)):
        return None
    body = fmt.body_schema(tools, name)
    if fmt.as_list:
        body = {"type": "array", "items": body, "minItems": 1,
                **({} if parallel else {"maxItems": 1})}
    # A format without a marker of its own (bare JSON) is read only at the output's start.
    return ToolGrammar(fmt.prefix, body, fmt.suffix, repeat=parallel and not fmt.as_list,
                       trigger=fmt.trigger if lazy else "", anchored=lazy and not fmt.prefix)


def _named_grammar(fmt: ToolFormat, tools: list[dict], name: str | None, parallel: bool,
                   lazy: bool) -> ToolGrammar | None:
    """The grammar of a format that writes the name as text: an alternation over the
    functions, each its literal name, the separator and its own parameters' schema."""
    opening = fmt.block_open or fmt.prefix
    if lazy and (fmt.starts_open or not (fmt.trigger and opening.startswith(fmt.trigger))):
        return None   # a call that opens the output has no trigger to wait for
    named = {f["name"]: f.get("parameters") or {"type": "object"} for f in functions(tools)
             if name is None or f["name"] == name}
    return ToolGrammar(fmt.prefix, {}, fmt.suffix, repeat=parallel,
                       trigger=fmt.trigger if lazy else "", named=named,
                       name_sep=fmt.name_sep, block_open=fmt.block_open,
                       block_close=fmt.block_close, open_first=fmt.starts_open)


HARMONY_RECIPIENT = "to=functions."
HARMONY_ANALYSIS = ("<|channel|>analysis<|message|>", "<|end|>", "<|start|>assistant")


def _harmony_grammar(fmt: ToolFormat, tools: list[dict], name: str | None,
                     lazy: bool) -> ToolGrammar:
    """gpt-oss's calls. Its <|channel|> also opens the analysis and final channels, so auto
    waits for the recipient ("to=functions.") and holds NAME <|constrain|>json<|message|>
    ARGS from there; required holds an optional analysis message, then one call. A call
    ends at its arguments and an optional <|call|> (an end of generation for gpt-oss)."""
    named = {f["name"]: f.get("parameters") or {"type": "object"} for f in functions(tools)
             if name is None or f["name"] == name}
    if lazy:
        return ToolGrammar(HARMONY_RECIPIENT, {}, trigger=HARMONY_RECIPIENT, named=named,
                           name_sep=fmt.name_sep, tail=fmt.suffix)
    return ToolGrammar(fmt.prefix, {}, named=named, name_sep=fmt.name_sep,
                       lead=HARMONY_ANALYSIS, tail=fmt.suffix)
