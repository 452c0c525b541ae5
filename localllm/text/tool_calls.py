"""Tool (function) calls in model output: the call formats chat templates teach, each with how
it is recognised in a template, the text that starts a call, and a parser from output text to
(content, calls); plus the generic JSON format for templates that know no tools."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from localllm.errors import LocalLLMError

from .tool_formats import (GLM_XML, QWEN3_CODER_XML, JSONArguments, ToolCall, args_text,
                           arguments_value, command_r7b_text, deepseek_text,
                           functionary_v32_text, json_at, parse_command_r7b, parse_deepseek,
                           parse_functionary_v32, parse_xml, xml_text)


class ToolCallError(LocalLLMError, ValueError):
    """Tool definitions or a tool_choice that cannot be used."""


# the shared record and JSON helpers live with the per-family syntaxes (tool_formats)
_args_text, _arguments_value, _json_at = args_text, arguments_value, json_at


def _call_of(obj, args_keys=("arguments", "parameters")) -> ToolCall | None:
    """A ToolCall from a decoded {"name":.., "arguments":..} object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if "function" in obj and isinstance(obj["function"], dict):
        return _call_of(obj["function"], args_keys)
    for k in args_keys:
        if k in obj:
            return ToolCall(obj["name"], _args_text(obj[k]),
                            **({"id": obj["id"]} if isinstance(obj.get("id"), str) else {}))
    return ToolCall(obj["name"], "{}")


# ----------------------------------------------------------------------------- formats

@dataclass(frozen=True)
class ToolFormat:
    """A tool-call format.

    name: short name ("hermes", "llama3", "mistral", "harmony", "generic").
    trigger: the text that starts a call in the output ("" for generic: the whole answer is JSON).
    prefix / suffix: literal text around one call's JSON body.
    args_key: the body's key for the arguments ("arguments" or "parameters").
    as_list: whether the body is a JSON list of calls (Mistral Nemo) rather than one object.
    name_key: the body's key for the function's name (Command R7B: "tool_name").
    id_key: a key the body also carries, the call's id as a string (Command R7B), or None.
    name_sep: None when the name is inside the JSON body; else the name is written as text
        and a call is prefix + NAME + name_sep + ARGUMENTS_JSON + suffix (DeepSeek,
        Functionary v3.2, harmony, and Mistral Small 3.2's "[ARGS]").
    block_open / block_close: text written once around all of one answer's calls, the
        calls (each prefix ... suffix) between (DeepSeek's <｜tool▁calls▁begin｜>).
    starts_open: the generation prompt already ends with the trigger, so the output opens
        inside the first call's prefix (Functionary v3.2's ">>>", before even plain text).
    """
    name: str
    trigger: str
    prefix: str
    suffix: str
    args_key: str = "arguments"
    as_list: bool = False
    name_key: str = "name"
    id_key: str | None = None
    name_sep: str | None = None
    block_open: str = ""
    block_close: str = ""
    starts_open: bool = False

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str, list[ToolCall]]:
        """Split output text into its content and the tool calls in it.

        Args:
            text: the model's raw output.
            tools: the request's tools, for formats that write arguments as text (the XML
                ones: a value is a string or JSON as its parameter's schema says); without
                them, a value that is JSON is taken as JSON.
        Returns:
            (content, calls): the text outside any call (stripped when there were calls), and
            the calls in order. Text that looks like a call but does not parse stays content.
        """
        if self.name in _XML_STYLES:
            return parse_xml(self, text, tools, _XML_STYLES[self.name])
        return _PARSERS[self.name](self, text)

    def body_schema(self, tools: list[dict], name: str | None = None) -> dict:
        """JSON schema of one call's body, from the tools' parameter schemas.

        Args:
            tools: OpenAI tool definitions.
            name: only this function (a named tool_choice).
        Returns:
            a schema: anyOf over the functions of {<name_key>: const, <args_key>: parameters}
            (with <id_key> first where the format has one).
        """
        alts = []
        for f in functions(tools):
            if name is not None and f["name"] != name:
                continue
            params = f.get("parameters") or {"type": "object"}
            props = {self.id_key: {"type": "string"}} if self.id_key else {}
            props.update({self.name_key: {"const": f["name"]}, self.args_key: params})
            alts.append({"type": "object", "properties": props,
                         "required": list(props), "additionalProperties": False})
        if not alts:
            raise ToolCallError(f"tool_choice names {name!r}, which is not among the tools")
        return alts[0] if len(alts) == 1 else {"anyOf": alts}


def _parse_tagged(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall]]:
    calls, content, pos = [], [], 0
    while True:
        start = text.find(fmt.trigger, pos)
        if start < 0:
            break
        value, end = _json_at(text, start + len(fmt.trigger))
        items = value if fmt.as_list and isinstance(value, list) else [value]
        got = [c for c in (_call_of(v) for v in items) if c is not None]
        if value is None or len(got) != len(items):
            break   # not a call after all: the rest is content
        calls += got
        content.append(text[pos:start])
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if fmt.suffix and text.startswith(fmt.suffix.strip(), pos):
            pos += len(fmt.suffix.strip())
    content.append(text[pos:])
    joined = "".join(content)
    return (joined.strip() if calls else joined), calls


def _parse_llama3(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):]
    calls, pos = [], 0
    while True:
        value, end = _json_at(body, pos)
        c = _call_of(value, ("parameters", "arguments")) if value is not None else None
        if c is None:
            break
        calls.append(c)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    if calls and not body[pos:].strip():
        return "", calls
    return text, []


def _parse_mistral(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall]]:
    start = text.find(fmt.trigger)
    if start < 0:
        return text, []
    rest = text[start + len(fmt.trigger):]
    value, end = _json_at(rest, 0)
    if isinstance(value, list):
        calls = [_call_of(v) for v in value]
        if calls and all(calls):
            return (text[:start] + rest[end:]).strip(), calls
        return text, []
    # Small 3.2: name[ARGS]{...} (its history: name[CALL_ID]id[ARGS]{...}), repeated after
    # [TOOL_CALLS]
    calls, pos = [], 0
    while True:
        m = re.match(r"\s*(?:\[TOOL_CALLS\])?\s*([A-Za-z0-9_.-]+)(?:\[CALL_ID\][A-Za-z0-9]+)?"
                     r"\[ARGS\]", rest[pos:])
        if not m:
            break
        value, end = _json_at(rest, pos + m.end())
        if value is None:
            break
        calls.append(ToolCall(m.group(1), _args_text(value)))
        pos = end
    if calls:
        return (text[:start] + rest[pos:]).strip(), calls
    return text, []


def _parse_generic(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall]]:
    value, end = _json_at(text, 0)
    if not isinstance(value, dict) or text[end:].strip():
        return text, []
    if isinstance(value.get("tool_calls"), list):
        calls = [_call_of(v) for v in value["tool_calls"]]
        if all(calls):
            return "", calls
    if isinstance(value.get("tool_call"), dict):
        c = _call_of(value["tool_call"])
        if c:
            return "", [c]
    if isinstance(value.get("response"), str):
        return value["response"], []
    return text, []


HARMONY_FUNCTIONS = "functions."   # harmony recipients that are the request's functions


def harmony_call(recipient: str | None, body: str) -> ToolCall | None:
    """The call of a harmony message addressed to ``recipient`` (``functions.NAME``) with
    ``body`` as its arguments; None for other recipients (gpt-oss's built-in browser and
    python tools, which a request's functions never name).

    Args:
        recipient: the header's ``to=`` value as written.
        body: the message text, the arguments as JSON (a body that is not JSON is kept as
            a JSON string; an empty one is no arguments).
    """
    if not recipient or not recipient.startswith(HARMONY_FUNCTIONS):
        return None
    name = recipient[len(HARMONY_FUNCTIONS):]
    if not name:
        return None
    body = body.strip()
    return ToolCall(name, _args_text(body) if body else "{}")


def _parse_harmony(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall]]:
    """gpt-oss's channels: messages addressed ``to=functions.NAME`` (on the commentary
    channel) are calls; with calls, the content is the answer's text (the final and plain
    commentary channels, reasoning apart); without, the text is left as it is."""
    from .reasoning import ReasoningSplitter
    # the output follows the prompt's <|start|>assistant, so it may open with " to=NAME"
    sp = ReasoningSplitter("harmony", "<|start|>assistant")
    parts = sp.feed(text) + sp.finish()
    calls = [c for c in (harmony_call(p.name, p.text) for p in parts if p.kind == "tool_call")
             if c is not None]
    if not calls:
        return text, []
    return "".join(p.text for p in parts if p.kind == "content").strip(), calls


_PARSERS = {"hermes": _parse_tagged, "llama3": _parse_llama3, "mistral": _parse_mistral,
            "mistral_nemo": _parse_tagged, "generic": _parse_generic, "harmony": _parse_harmony,
            "deepseek_r1": parse_deepseek, "deepseek_v31": parse_deepseek,
            "command_r7b": parse_command_r7b, "functionary_v32": parse_functionary_v32,
            "granite": _parse_tagged}
_XML_STYLES = {"qwen3_coder": QWEN3_CODER_XML, "glm": GLM_XML}

HERMES = ToolFormat("hermes", "<tool_call>", "<tool_call>\n", "\n</tool_call>")
LLAMA3 = ToolFormat("llama3", "{", "", "", args_key="parameters")
MISTRAL_NEMO = ToolFormat("mistral_nemo", "[TOOL_CALLS]", "[TOOL_CALLS]", "", as_list=True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", "", name_sep="[ARGS]")
GENERIC = ToolFormat("generic", "", "", "")
# gpt-oss: <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>.
# Raw output opens with a channel, so a stream of it is held whole (split by channel, as
# the server does by default, the answer's text has no markers and streams as it comes).
HARMONY = ToolFormat("harmony", "<|channel|>", "<|channel|>commentary to=functions.", "<|call|>",
                     name_sep=" <|constrain|>json<|message|>")
# DeepSeek R1 and V3 (and R1's distills): <｜tool▁calls▁begin｜>, then per call
# <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>
# (a newline between calls), then <｜tool▁calls▁end｜>. V3.1 drops the type and the fence:
# <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>.
DEEPSEEK_R1 = ToolFormat("deepseek_r1", "<｜tool▁calls▁begin｜>",
                         "<｜tool▁call▁begin｜>function<｜tool▁sep｜>", "\n```<｜tool▁call▁end｜>",
                         name_sep="\n```json\n", block_open="<｜tool▁calls▁begin｜>",
                         block_close="<｜tool▁calls▁end｜>")
DEEPSEEK_V31 = ToolFormat("deepseek_v31", "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>",
                          "<｜tool▁call▁end｜>", name_sep="<｜tool▁sep｜>",
                          block_open="<｜tool▁calls▁begin｜>", block_close="<｜tool▁calls▁end｜>")
# Command R7B: <|START_ACTION|>[{"tool_call_id": "0", "tool_name": .., "parameters": ..}]
# <|END_ACTION|>, after an optional <|START_THINKING|> plan.
COMMAND_R7B = ToolFormat("command_r7b", "<|START_ACTION|>", "<|START_ACTION|>", "<|END_ACTION|>",
                         args_key="parameters", as_list=True, name_key="tool_name",
                         id_key="tool_call_id")
# Functionary v3.2: >>>NAME\n{...} per call, >>>all\n for text; the prompt ends with ">>>".
FUNCTIONARY_V32 = ToolFormat("functionary_v32", ">>>", ">>>", "", name_sep="\n",
                             starts_open=True)
# Granite 3.x: <|tool_call|>[{"name": .., "arguments": ..}, ...] (Granite 4 writes Hermes').
GRANITE = ToolFormat("granite", "<|tool_call|>", "<|tool_call|>", "", as_list=True)
# Qwen3-Coder's XML: <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n
# </function>\n</tool_call>; GLM's: <tool_call>NAME\n<arg_key>P</arg_key>\n<arg_value>VALUE
# </arg_value>\n</tool_call>. Their grammar is built per parameter (constrain/xml_calls.py).
QWEN3_CODER = ToolFormat("qwen3_coder", "<tool_call>", "<tool_call>\n", "\n</tool_call>")
GLM = ToolFormat("glm", "<tool_call>", "<tool_call>", "</tool_call>")
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL_NEMO, MISTRAL, GENERIC, HARMONY,
                               DEEPSEEK_R1, DEEPSEEK_V31, COMMAND_R7B, FUNCTIONARY_V32, GRANITE,
                               QWEN3_CODER, GLM)}


def detect_format(template_source: str | None) -> ToolFormat:
    """The tool-call format a chat template teaches, from its source.

    Args:
        template_source: the Jinja source of the GGUF's chat template (None: none).
    Returns:
        the format; GENERIC for a template that does not take tools.
    """
    src = template_source or ""
    if "tools" not in src and "tool_calls" not in src:
        return GENERIC
    if "<|channel|>" in src and "to=" in src and "functions." in src:
        return HARMONY
    if "<tool_call>" in src:
        if "<function=" in src and "<parameter=" in src:
            return QWEN3_CODER
        if "<arg_key>" in src and "<arg_value>" in src:
            return GLM
        # MiniMax M3's <invoke name=..> markup and Apriel 1.5's <tool_calls>[...] list
        # mention <tool_call> but write no Hermes calls
        if "<invoke" in src or "<tool_calls>[" in src:
            return GENERIC
        return HERMES
    if "[TOOL_CALLS]" in src:
        return MISTRAL if "[ARGS]" in src else MISTRAL_NEMO
    if "<|python_tag|>" in src or ("<|start_header_id|>" in src and '"parameters"' in src):
        return LLAMA3
    # Families found after the ones above, so that no template they match changes format.
    if "tool▁sep" in src:   # V3.2 / V4 write DSML instead and have no tool▁sep
        return DEEPSEEK_R1 if "```json" in src else DEEPSEEK_V31
    if "<|START_ACTION|>" in src and "<|START_TEXT|>" not in src:   # not Cohere2's MoE
        return COMMAND_R7B
    if ">>>all" in src:
        return FUNCTIONARY_V32
    if "<|tool_call|>" in src:
        return GRANITE
    return GENERIC


def supports_tools(template_source: str | None) -> bool:
    """Whether a template renders the tools itself (else they go in a system message)."""
    src = template_source or ""
    return "tools" in src and detect_format(src) is not GENERIC


# ----------------------------------------------------------------------------- requests

def functions(tools: list[dict] | None) -> list[dict]:
    """The function definitions of OpenAI tools ({"type": "function", "function": {...}}).

    Raises:
        ToolCallError: a tool of another type, or a function without a name.
    """
    out = []
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ToolCallError(f"tools[{i}]: only tools of type 'function' are supported")
        f = t.get("function", t)
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolCallError(f"tools[{i}]: a function needs a name")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolCallError(f"tools[{i}]: parameters must be a JSON schema object")
        out.append(f)
    return out


def generic_schema(tools: list[dict], mode: str, name: str | None = None,
                   parallel: bool = True) -> dict:
    """JSON schema of the generic format's whole answer.

    Args:
        tools: OpenAI tool definitions.
        mode: "auto" (a call or a text response), "required" (calls only).
        name: only this function.
        parallel: whether several calls may come in one answer.
    Returns:
        the schema: {"tool_calls": [call, ...]} or, with auto, also {"response": "text"}.
    """
    calls = {"type": "array", "items": GENERIC.body_schema(tools, name), "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    with_calls = {"type": "object", "properties": {"tool_calls": calls},
                  "required": ["tool_calls"], "additionalProperties": False}
    if mode != "auto":
        return with_calls
    answer = {"type": "object", "properties": {"response": {"type": "string"}},
              "required": ["response"], "additionalProperties": False}
    return {"anyOf": [with_calls, answer]}


def generic_system_prompt(tools: list[dict], mode: str, parallel: bool = True) -> str:
    """The system message that describes the tools and the answer shape to a model whose
    template does not take tools."""
    listing = json.dumps([{"name": f["name"], "description": f.get("description", ""),
                           "parameters": f.get("parameters") or {"type": "object"}}
                          for f in functions(tools)], ensure_ascii=False, indent=2)
    shape = '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}'
    text = (f"You can call these functions:\n{listing}\n\nTo call functions, answer with JSON "
            f"only, shaped as {shape}"
            + ("" if parallel else ", with exactly one call"))
    if mode == "auto":
        text += ('. To answer without calling a function, reply with JSON shaped as '
                 '{"response": "<your answer>"}')
    return text + "."


def _short_id(call_id: str) -> str:
    """A call id as Mistral's templates demand it: 9 letters or digits."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    digest = hashlib.sha256(call_id.encode()).hexdigest()
    return "".join(c for c in digest if c.isalnum())[:9]


def template_messages(messages: list[dict], fmt: ToolFormat | None = None) -> list[dict]:
    """Messages as chat templates read them: an assistant call's arguments become a mapping
    (templates do ``arguments | tojson`` or iterate ``arguments.items()``; joined to a string
    it is its JSON text), with each call's function fields also at its top level (templates
    differ in which they read).

    Args:
        messages: OpenAI-shaped messages (tool_calls with JSON-text arguments).
        fmt: the template's format; Mistral's get call ids of 9 letters or digits, and
            DeepSeek's a null content beside calls (R1-Distill-Llama writes its calls only
            when the content ``is none``).
    Returns:
        new messages; the given ones are not changed.
    """
    short = fmt is not None and fmt.name.startswith("mistral")
    null_content = fmt is not None and fmt.name.startswith("deepseek")
    out = []
    for m in messages:
        if short and m.get("tool_call_id") is not None:
            m = {**m, "tool_call_id": _short_id(str(m["tool_call_id"]))}
        calls = m.get("tool_calls")
        if calls and null_content and not m.get("content"):
            m = {**m, "content": None}
        if calls:
            fixed = []
            for c in calls:
                f = dict(c.get("function", c))
                args = f.get("arguments")
                if isinstance(args, str):
                    f["arguments"] = _arguments_value(args)
                if isinstance(f.get("arguments"), dict):
                    f["arguments"] = JSONArguments(f["arguments"])
                if short and c.get("id") is not None:
                    c = {**c, "id": _short_id(str(c["id"]))}
                fixed.append({**c, "function": f, "name": f.get("name"),
                              "arguments": f.get("arguments")})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def canonical_text(fmt: ToolFormat, calls: list[ToolCall]) -> str:
    """The text a model of this format writes for these calls (round-trip tests, prompts)."""
    if fmt.name == "generic":
        return json.dumps({"tool_calls": [
            {"name": c.name, "arguments": _arguments_value(c.arguments)} for c in calls]})
    if fmt.name == "mistral":
        return "".join(f"[TOOL_CALLS]{c.name}[ARGS]{c.arguments}" for c in calls)
    if fmt.name == "harmony":   # after the prompt's <|start|>assistant; later ones anew
        return "<|start|>assistant".join(
            f"<|channel|>commentary to=functions.{c.name} <|constrain|>json<|message|>"
            f"{json.dumps(_arguments_value(c.arguments))}<|call|>" for c in calls)
    if fmt.name in ("deepseek_r1", "deepseek_v31"):
        return deepseek_text(calls, fenced=fmt.name == "deepseek_r1")
    if fmt.name == "command_r7b":
        return command_r7b_text(calls)
    if fmt.name == "functionary_v32":   # after the prompt's first ">>>"
        return functionary_v32_text(calls)
    if fmt.name in _XML_STYLES:
        return xml_text(_XML_STYLES[fmt.name], calls)
    bodies = [{"name": c.name, fmt.args_key: _arguments_value(c.arguments)} for c in calls]
    if fmt.as_list:
        return fmt.prefix + json.dumps(bodies)
    if fmt.name == "llama3":
        return "; ".join(json.dumps(b) for b in bodies)
    return "\n".join(fmt.prefix + json.dumps(b) + fmt.suffix for b in bodies)
