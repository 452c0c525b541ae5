"""Tool-call syntaxes of the model families whose calls are not one tagged JSON object:
DeepSeek R1 / V3 and V3.1, Command R7B and Functionary v3.2 (parsers and the text each
model writes); plus the call record and JSON helpers that every format shares."""

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


def _skip_blanks(text: str, pos: int) -> int:
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


_DS_CALLS_BEGIN_RE = re.compile(_ds_marker("tool calls begin"))
_DS_CALLS_END_RE = re.compile(r"\s*" + _ds_marker("tool calls end"))
_DS_CALL_BEGIN_RE = re.compile(r"\s*" + _ds_marker("tool call begin"))
_DS_CALL_END_RE = re.compile(r"\s*" + _ds_marker("tool call end"))
_DS_SEP = _ds_marker("tool sep")
# R1 / V3: TYPE<sep>NAME then a ```json fence; V3.1: NAME<sep> then the JSON itself.
_DS_R1_HEAD_RE = re.compile(r"([A-Za-z_]*)" + _DS_SEP + r"([^\n<｜]+?)\s*```(?:json)?\s*")
_DS_V31_HEAD_RE = re.compile(r"([^\n<｜]+?)" + _DS_SEP + r"\s*")
_FENCE_END_RE = re.compile(r"\s*```")


def _ds_call(text: str, pos: int) -> tuple[ToolCall | None, int]:
    """The call whose <｜tool▁call▁begin｜> ends at ``pos`` (either generation's shape)."""
    fenced = _DS_R1_HEAD_RE.match(text, pos)
    head = fenced or _DS_V31_HEAD_RE.match(text, pos)
    if head is None:
        return None, pos
    value, end = json_at(text, head.end())
    if value is None:
        return None, pos
    if fenced:
        fence = _FENCE_END_RE.match(text, end)
        if fence is None:
            return None, pos
        end = fence.end()
    close = _DS_CALL_END_RE.match(text, end)
    if close is None:
        return None, pos
    name = (fenced.group(2) if fenced else head.group(1)).strip()
    return ToolCall(name, args_text(value)), close.end()


def parse_deepseek(fmt, text: str) -> tuple[str, list[ToolCall]]:
    """DeepSeek R1 / V3 / V3.1: calls in one <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>
    block; content is the text around the block. A block whose first call does not parse is
    left as content; after a call that does not parse, the rest is content."""
    block = _DS_CALLS_BEGIN_RE.search(text) or _DS_CALL_BEGIN_RE.search(text)
    if block is None:
        return text, []
    calls, pos = [], block.end() if block.re is _DS_CALLS_BEGIN_RE else block.start()
    while True:
        begin = _DS_CALL_BEGIN_RE.match(text, pos)
        if begin is None:
            break
        call, end = _ds_call(text, begin.end())
        if call is None:
            break
        calls.append(call)
        pos = end
    if not calls:
        return text, []
    close = _DS_CALLS_END_RE.match(text, pos)
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
    end = _skip_blanks(text, end)
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
_RECIPIENT_RE = re.compile(r"([A-Za-z0-9_.\-]+)\n")
_NEXT_BLOCK_RE = re.compile(r">>>(?=[A-Za-z0-9_.\-]+\n)")


def parse_functionary_v32(fmt, text: str) -> tuple[str, list[ToolCall]]:
    """Functionary v3.2: blocks ``>>>RECIPIENT\\nBODY``; recipient ``all`` is text to the
    user, any other a function with JSON arguments. The prompt ends with the first ``>>>``,
    so the output opens with a recipient. Text without a recipient line, or whose first call
    is not JSON, is left as it is; after a call that is not JSON, the rest is content."""
    pos = 3 if text.startswith(">>>") else 0
    if _RECIPIENT_RE.match(text, pos) is None:
        return text, []
    content, calls = [], []
    while pos < len(text):
        head = _RECIPIENT_RE.match(text, pos)
        if head is None:
            content.append(text[pos:])
            break
        if head.group(1) == FUNCTIONARY_ALL:
            nxt = _NEXT_BLOCK_RE.search(text, head.end())
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
        pos = _skip_blanks(text, end)
        if text.startswith(">>>", pos):
            pos += 3
    joined = "".join(content)
    return (joined.strip() if calls else joined), calls


def functionary_v32_text(calls: list[ToolCall]) -> str:
    """The calls as Functionary v3.2 writes them after its prompt's opening ``>>>``."""
    return ">>>".join(f"{c.name}\n{json.dumps(arguments_value(c.arguments), ensure_ascii=False)}"
                      for c in calls)
