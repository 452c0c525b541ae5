"""Tool-call syntaxes of the model families whose calls are not one tagged JSON object:
DeepSeek R1 / V3 and V3.1, Command R7B, Functionary v3.2, and the XML calls of Qwen3-Coder
and GLM (parsers and the text each model writes); plus the call record and JSON helpers
that every format shares."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    """One call of a function: ``arguments`` is a JSON text, as OpenAI's API carries it."""
    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def as_openai(self) -> dict:
        """The call as an assistant message's ``tool_calls`` item."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def args_text(v) -> str:
    """A call's arguments as JSON text (a string that is JSON stays as it is)."""
    if isinstance(v, str):
        try:
            json.loads(v)
            return v
        except ValueError:
            return json.dumps(v)
    return json.dumps(v if v is not None else {}, ensure_ascii=False)


def arguments_value(arguments: str):
    """A call's arguments as a JSON value: a client's history may hold any string there (empty
    is no arguments; text that is not JSON is kept as the string it is)."""
    if not arguments.strip():
        return {}
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class JSONArguments(dict):
    """A call's arguments as a template reads them: a mapping (``| tojson``, ``.items()``)
    that prints, and joins strings with ``+``, as its JSON text, as llama.cpp's Jinja does
    (Functionary v3.2's and R1-Distill-Llama's templates write ``'...' + arguments``)."""

    def __str__(self) -> str:
        return json.dumps(self, ensure_ascii=False)

    def __add__(self, other):
        return str(self) + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other):
        return other + str(self) if isinstance(other, str) else NotImplemented


_decoder = json.JSONDecoder()


def json_at(text: str, pos: int):
    """(value, end) of the JSON value starting at text[pos:] (after blanks), or (None, pos)."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    try:
        return _decoder.raw_decode(text, pos)
    except ValueError:
        return None, pos


def skip_blanks(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


# ----------------------------------------------------------------------------- DeepSeek

# DeepSeek's markers use U+FF5C (fullwidth bar) and U+2581 (lower block) as word breaks;
# models are also seen writing "_" or " " for the latter, so the parser takes all three.
DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"


def _ds_marker(words: str) -> str:
    return "<｜" + "[▁_ ]".join(re.escape(w) for w in words.split()) + "｜>"


DS_CALLS_BEGIN_RE = re.compile(_ds_marker("tool calls begin"))
DS_CALLS_END_RE = re.compile(r"\s*" + _ds_marker("tool calls end"))
DS_CALL_BEGIN_RE = re.compile(r"\s*" + _ds_marker("tool call begin"))
DS_CALL_END_RE = re.compile(r"\s*" + _ds_marker("tool call end"))
_DS_SEP = _ds_marker("tool sep")
# R1 / V3: TYPE<sep>NAME then a ```json fence; V3.1: NAME<sep> then the JSON itself.
DS_R1_HEAD_RE = re.compile(r"([A-Za-z_]*)" + _DS_SEP + r"([^\n<｜]+?)\s*```(?:json)?\s*")
DS_V31_HEAD_RE = re.compile(r"([^\n<｜]+?)" + _DS_SEP + r"\s*")
FENCE_END_RE = re.compile(r"\s*```")


def _ds_call(text: str, pos: int) -> tuple[ToolCall | None, int]:
    """The call whose <｜tool▁call▁begin｜> ends at ``pos`` (either generation's shape)."""
    fenced = DS_R1_HEAD_RE.match(text, pos)
    head = fenced or DS_V31_HEAD_RE.match(text, pos)
    if head is None:
        return None, pos
    value, end = json_at(text, head.end())
    if value is None:
        return None, pos
    if fenced:
        fence = FENCE_END_RE.match(text, end)
        if fence is None:
            return None, pos
        end = fence.end()
    close = DS_CALL_END_RE.match(text, end)
    if close is None:
        return None, pos
    name = (fenced.group(2) if fenced else head.group(1)).strip()
    return ToolCall(name, args_text(value)), close.end()


def parse_deepseek(fmt, text: str) -> tuple[str, list[ToolCall]]:
    """DeepSeek R1 / V3 / V3.1: calls in one <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>
    block; content is the text around the block. A block whose first call does not parse is
    left as content; after a call that does not parse, the rest is content."""
    block = DS_CALLS_BEGIN_RE.search(text) or DS_CALL_BEGIN_RE.search(text)
    if block is None:
        return text, []
    calls, pos = [], block.end() if block.re is DS_CALLS_BEGIN_RE else block.start()
    while True:
        begin = DS_CALL_BEGIN_RE.match(text, pos)
        if begin is None:
            break
        call, end = _ds_call(text, begin.end())
        if call is None:
            break
        calls.append(call)
        pos = end
    if not calls:
        return text, []
    close = DS_CALLS_END_RE.match(text, pos)
    pos = close.end() if close else pos
    return (text[:block.start()] + text[pos:]).strip(), calls


def deepseek_text(calls: list[ToolCall], fenced: bool) -> str:
    """The calls as DeepSeek writes them: R1 / V3 (``fenced``) or V3.1."""
    if fenced:
        body = "\n".join(f"{DS_CALL_BEGIN}function{DS_SEP}{c.name}\n```json\n"
                         f"{json.dumps(arguments_value(c.arguments), ensure_ascii=False)}"
                         f"\n```{DS_CALL_END}" for c in calls)
    else:
        body = "".join(f"{DS_CALL_BEGIN}{c.name}{DS_SEP}"
                       f"{json.dumps(arguments_value(c.arguments), ensure_ascii=False)}"
                       f"{DS_CALL_END}" for c in calls)
    return DS_CALLS_BEGIN + body + DS_CALLS_END


# ----------------------------------------------------------------------------- Command R7B

R7B_ACTION = ("<|START_ACTION|>", "<|END_ACTION|>")
R7B_RESPONSE = ("<|START_RESPONSE|>", "<|END_RESPONSE|>")


def parse_command_r7b(fmt, text: str) -> tuple[str, list[ToolCall]]:
    """Command R7B: <|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}, ...]
    <|END_ACTION|>. The answer's <|START_RESPONSE|> / <|END_RESPONSE|> markers are not
    content; the plan (<|START_THINKING|> ... <|END_THINKING|>) stays where it is."""
    for marker in R7B_RESPONSE:
        text = text.replace(marker, "")
    start = text.find(R7B_ACTION[0])
    if start < 0:
        return text, []
    value, end = json_at(text, start + len(R7B_ACTION[0]))
    if not isinstance(value, list) or not value:
        return text, []
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("tool_name"), str):
            return text, []
        calls.append(ToolCall(item["tool_name"], args_text(item.get("parameters"))))
    end = skip_blanks(text, end)
    if text.startswith(R7B_ACTION[1], end):
        end += len(R7B_ACTION[1])
    return (text[:start] + text[end:]).strip(), calls


def command_r7b_text(calls: list[ToolCall]) -> str:
    """The calls as Command R7B writes them (its template's layout, ids by position)."""
    items = [json.dumps({"tool_call_id": str(i), "tool_name": c.name,
                         "parameters": arguments_value(c.arguments)}, ensure_ascii=False)
             for i, c in enumerate(calls)]
    return R7B_ACTION[0] + "[\n    " + ",\n    ".join(items) + "\n]" + R7B_ACTION[1]


# ----------------------------------------------------------------------------- Functionary

FUNCTIONARY_ALL = "all"   # the recipient of plain text to the user
RECIPIENT_RE = re.compile(r"([A-Za-z0-9_.\-]+)\n")
_RECIPIENT_SO_FAR_RE = re.compile(r"[A-Za-z0-9_.\-]*")
NEXT_BLOCK_RE = re.compile(r">>>(?=[A-Za-z0-9_.\-]+\n)")


def functionary_opening(text: str) -> tuple[str | None, int]:
    """The recipient line Functionary v3.2's output opens with.

    Returns:
        (recipient, where its line ends); (None, 0) while the text may still become such a
        line; ("", 0) when it does not open with one.
    """
    pos = 3 if text.startswith(">>>") else 0
    head = RECIPIENT_RE.match(text, pos)
    if head is not None:
        return head.group(1), head.end()
    if _RECIPIENT_SO_FAR_RE.fullmatch(text, pos) or ">>>".startswith(text):
        return None, 0
    return "", 0


def parse_functionary_v32(fmt, text: str) -> tuple[str, list[ToolCall]]:
    """Functionary v3.2: blocks ``>>>RECIPIENT\\nBODY``; recipient ``all`` is text to the
    user, any other a function with JSON arguments. The prompt ends with the first ``>>>``,
    so the output opens with a recipient. Text without a recipient line, or whose first call
    is not JSON, is left as it is; after a call that is not JSON, the rest is content."""
    pos = 3 if text.startswith(">>>") else 0
    if RECIPIENT_RE.match(text, pos) is None:
        return text, []
    content, calls = [], []
    while pos < len(text):
        head = RECIPIENT_RE.match(text, pos)
        if head is None:
            content.append(text[pos:])
            break
        if head.group(1) == FUNCTIONARY_ALL:
            nxt = NEXT_BLOCK_RE.search(text, head.end())
            stop = nxt.start() if nxt else len(text)
            content.append(text[head.end():stop])
            pos = stop + 3 if nxt else stop
            continue
        value, end = json_at(text, head.end())
        if value is None:
            if not calls:
                return text, []
            content.append(text[pos - 3:])
            break
        calls.append(ToolCall(head.group(1), args_text(value)))
        pos = skip_blanks(text, end)
        if text.startswith(">>>", pos):
            pos += 3
    joined = "".join(content)
    return (joined.strip() if calls else joined), calls


def functionary_v32_text(calls: list[ToolCall]) -> str:
    """The calls as Functionary v3.2 writes them after its prompt's opening ``>>>``."""
    return ">>>".join(f"{c.name}\n{json.dumps(arguments_value(c.arguments), ensure_ascii=False)}"
                      for c in calls)


# ----------------------------------------------------------------------------- XML calls

# Qwen3-Coder (and Qwen3.5, Nemotron 3 Nano, StepFun 3.5):
#   <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>
# GLM 4.5-4.7 (and Laguna, Ling 3, Spark):
#   <tool_call>NAME\n<arg_key>P</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>
# A value is raw text: a string parameter's as it is, any other's as JSON.

@dataclass(frozen=True)
class XMLStyle:
    """The markup of one XML call syntax.

    name_open / name_close: around the function's name, after <tool_call> (GLM: none, the
        name runs to a newline or the first tag). key_open / key_close: around a parameter's
        name; value_open / value_close: around its value. call_close: after the parameters;
        outer_close: after that, optional (Qwen3-Coder's </tool_call>). trim: one newline
        at each end of a value is layout, not value.
    """
    name_open: str
    name_close: str
    key_open: str
    key_close: str
    value_open: str
    value_close: str
    call_close: str
    outer_close: str
    trim: bool


XML_OPEN = "<tool_call>"
QWEN3_CODER_XML = XMLStyle("<function=", ">", "<parameter=", ">", "", "</parameter>",
                           "</function>", "</tool_call>", True)
GLM_XML = XMLStyle("", "", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                   "</tool_call>", "", False)


class _Short(Exception):
    """The text ends inside a call."""


class _Bad(Exception):
    """The text is not a call."""


@dataclass
class XMLCall:
    """One call as far as the text shows it.

    name: the function's name once complete (None before). arguments: its arguments' JSON
    text so far, a prefix of the whole (which it is once ``done``). end: where the call's
    text ends (so far).
    """
    name: str | None = None
    arguments: str = ""
    done: bool = False
    end: int = 0


def _types(schema) -> set[str] | None:
    """The JSON types a parameter's schema allows (None: any, or not known)."""
    if not isinstance(schema, dict):
        return None
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)} or None
    out: set[str] = set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            got = _types(sub)
            if got is None:
                return None
            out |= got
    values = schema.get("enum") or ([schema["const"]] if "const" in schema else [])
    out |= {_json_type(v) for v in values}
    return out or None


def _json_type(v) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(v), "null")


def param_types(tools, name: str, key: str) -> set[str] | None:
    """The types parameter ``key`` of function ``name`` takes in the request's tools."""
    for t in tools or []:
        f = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(f, dict) and f.get("name") == name:
            props = (f.get("parameters") or {}).get("properties") or {}
            return _types(props.get(key))
    return None


def xml_value(raw: str, types: set[str] | None):
    """A parameter's value from its text: a string parameter's text as it is; else the JSON
    it holds when that is of an allowed type (any, without a schema), else the text itself."""
    if types == {"string"}:
        return raw
    try:
        v = json.loads(raw)
    except ValueError:
        return raw
    t = _json_type(v)
    if types is None or t in types or (t == "integer" and "number" in types):
        return v
    return raw


def _member(key: str, value) -> str:
    return json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)


def _lit(text: str, pos: int, lit: str) -> int:
    """Past ``lit`` at ``pos`` (blanks before it skipped)."""
    pos = skip_blanks(text, pos)
    if text.startswith(lit, pos):
        return pos + len(lit)
    raise _Short if lit.startswith(text[pos:]) else _Bad


def _held(raw: str, closers: tuple[str, ...]) -> int:
    """Length of the end of ``raw`` that may yet be layout or the start of a closer."""
    best = 0
    for c in closers:
        for n in range(min(len(c) - 1, len(raw)), best, -1):
            if raw.endswith(c[:n]):
                best = n
                break
    return best


def scan_xml_call(style: XMLStyle, text: str, pos: int, tools=None) -> XMLCall:
    """The call whose <tool_call> starts at ``pos``, as far as the text shows it.

    Args:
        style: the syntax; tools: the request's tools, whose parameter schemas type the
            values (None: a value that is JSON is taken as JSON, any other as a string).
    Returns:
        the XMLCall (not done where the text ends inside it or stops being a call).
    """
    call = XMLCall(end=pos)
    try:
        _scan(style, text, pos + len(XML_OPEN), tools, call)
    except (_Short, _Bad):
        pass
    return call


def _scan(style: XMLStyle, text: str, pos: int, tools, call: XMLCall) -> None:
    if style.name_open:
        pos = _lit(text, pos, style.name_open)
        close = text.find(style.name_close, pos)
        line = text[pos:close if close >= 0 else len(text)]
        if "\n" in line or "<" in line:
            raise _Bad
        if close < 0:
            raise _Short
        name, pos = line.strip(), close + len(style.name_close)
    else:
        m = re.compile(r"[^\n<]*").match(text, skip_blanks(text, pos))
        if m.end() == len(text):
            raise _Short
        name, pos = m.group().strip(), m.end()
    if not name:
        raise _Bad
    call.name, call.arguments = name, "{"
    members: list[str] = []
    while True:
        at = skip_blanks(text, pos)
        if text.startswith(style.call_close, at):
            call.arguments = "{" + ", ".join(members) + "}"
            call.done, call.end = True, at + len(style.call_close)
            if style.outer_close:
                try:
                    call.end = _lit(text, call.end, style.outer_close)
                except (_Short, _Bad):
                    pass
            return
        if style.call_close.startswith(text[at:]):
            raise _Short   # the text ends in the close, or before it
        pos = _lit(text, at, style.key_open)
        close = text.find(style.key_close, pos)
        if close < 0:
            raise _Short
        key = text[pos:close].strip()
        pos = _lit(text, close + len(style.key_close), style.value_open) \
            if style.value_open else close + len(style.key_close)
        types = param_types(tools, name, key)
        head = ", ".join(members + [json.dumps(key, ensure_ascii=False) + ": "])
        end = text.find(style.value_close, pos)
        raw = text[pos:end if end >= 0 else len(text)]
        if style.trim and raw.startswith("\n"):
            raw = raw[1:]
        if end < 0:
            if types == {"string"}:   # a string streams as it comes
                closers = ("\n" + style.value_close, style.value_close) if style.trim \
                    else (style.value_close,)
                shown = raw[:len(raw) - _held(raw, closers)]
                call.arguments = "{" + head + json.dumps(shown, ensure_ascii=False)[:-1]
            raise _Short
        if style.trim and raw.endswith("\n"):
            raw = raw[:-1]
        members.append(_member(key, xml_value(raw, types)))
        call.arguments = "{" + ", ".join(members)
        pos = end + len(style.value_close)


def parse_xml(fmt, text: str, tools=None, style: XMLStyle = QWEN3_CODER_XML):
    """Qwen3-Coder's or GLM's XML calls: (content, calls). A call that does not parse, and
    all after it, stays content."""
    calls, content, pos = [], [], 0
    while True:
        start = text.find(XML_OPEN, pos)
        if start < 0:
            break
        c = scan_xml_call(style, text, start, tools)
        if not c.done:
            break
        calls.append(ToolCall(c.name, c.arguments))
        content.append(text[pos:start])
        pos = c.end
    content.append(text[pos:])
    joined = "".join(content)
    return (joined.strip() if calls else joined), calls


def xml_text(style: XMLStyle, calls: list[ToolCall]) -> str:
    """The calls as a model of this XML style writes them."""
    out = []
    for c in calls:
        args = arguments_value(c.arguments)
        params = []
        for k, v in (args.items() if isinstance(args, dict) else ()):
            value = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
            if style.trim:
                value = "\n" + value + "\n"
            sep = "\n" if style.value_open else ""   # GLM: a line for the key, one for the value
            params.append(f"{style.key_open}{k}{style.key_close}{sep}{style.value_open}"
                          f"{value}{style.value_close}\n")
        if style.name_open:
            out.append(f"{XML_OPEN}\n{style.name_open}{c.name}{style.name_close}\n"
                       f"{''.join(params)}{style.call_close}\n{style.outer_close}")
        else:
            out.append(f"{XML_OPEN}{c.name}\n{''.join(params)}{style.call_close}")
    return "\n".join(out)
