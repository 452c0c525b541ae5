"""Tool calls out of streamed output: the text that is no call as it comes, and each call as
it is written (its name once known, then its arguments' JSON in fragments), for the server's
streams and Model.chat. A format says where a call's name and arguments are (LOCATORS)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from localllm.text.tool_calls import ToolCall, _args_text

from .tool_use import ToolPlan, harmony_calls

# ----------------------------------------------------------------------------- partial JSON

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")


class _Short(Exception):
    """The text ran out inside a value."""


class _Bad(Exception):
    """The text is not JSON."""


@dataclass
class Node:
    """A JSON value in text that may still be growing.

    kind: "object", "array", "string" or "scalar"; start / end: its span in the text (end
    None while open); members (objects, the last of a key wins as in json.loads), items
    (arrays), value (a string's, once closed).
    """
    kind: str
    start: int
    end: int | None = None
    members: dict = field(default_factory=dict)
    items: list = field(default_factory=list)
    value: object = None


class PartialJSON:
    """A JSON value parsed from the start of a text that may end anywhere, with its text in
    json.dumps's form (", " and ": " separators, strings re-escaped) as far as it is known.

    Args:
        text: the text; the value starts at ``pos`` (blanks before it skipped).
    Attributes:
        root: the value's Node (None when nothing of it is there yet).
        canonical: json.dumps(value, ensure_ascii=False) of the value so far: a prefix of
            that of every longer text, the whole of it once root.end is set.
        bad: the text is not JSON (what is before the fault stays).
    """

    def __init__(self, text: str, pos: int = 0):
        self.text, self.pos, self.out = text, pos, []
        self.root: Node | None = None
        self.bad = False
        holder: list[Node] = []
        try:
            self._blank()
            self._value(holder)
        except _Short:
            pass
        except _Bad:
            self.bad = True
        self.root = holder[0] if holder else None
        self.canonical = "".join(self.out)

    def _blank(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _WS:
            self.pos += 1
        if self.pos >= len(self.text):
            raise _Short

    def _value(self, into: list) -> Node:
        c = self.text[self.pos]
        node = Node("object" if c == "{" else "array" if c == "[" else
                    "string" if c == '"' else "scalar", self.pos)
        into.append(node)
        if c == "{" or c == "[":
            self._container(node)
        elif c == '"':
            node.value = self._string()
        else:
            self._scalar()
        node.end = self.pos
        return node

    def _container(self, node: Node) -> None:
        close = "}" if node.kind == "object" else "]"
        self.out.append(self.text[self.pos])
        self.pos += 1
        self._blank()
        if self.text[self.pos] == close:
            self.out.append(close)
            self.pos += 1
            return
        while True:
            if node.kind == "object":
                if self.text[self.pos] != '"':
                    raise _Bad
                key = self._string()
                self._blank()
                if self.text[self.pos] != ":":
                    raise _Bad
                self.out.append(": ")
                self.pos += 1
                self._blank()
                holder: list = []
                try:
                    self._value(holder)
                finally:
                    if holder:
                        node.members[key] = holder[0]
            else:
                self._value(node.items)
            self._blank()
            c = self.text[self.pos]
            self.pos += 1
            if c == close:
                self.out.append(close)
                return
            if c != ",":
                raise _Bad
            self.out.append(", ")
            self._blank()

    def _string(self) -> str:
        i = self.pos + 1
        while i < len(self.text):
            c = self.text[i]
            if c == "\\":
                i += 2
                continue
            if c == '"':
                try:
                    value = json.loads(self.text[self.pos:i + 1])
                except ValueError:
                    raise _Bad from None
                self.out.append(json.dumps(value, ensure_ascii=False))
                self.pos = i + 1
                return value
            i += 1
        self.out.append(_open_string(self.text[self.pos + 1:]))
        raise _Short

    def _scalar(self) -> None:
        rest = self.text[self.pos:]
        for lit in _LITERALS:
            if rest.startswith(lit):
                self.out.append(lit)
                self.pos += len(lit)
                return
            if lit.startswith(rest):
                raise _Short
        m = _NUMBER.match(rest)
        if not m:
            raise _Bad
        if m.end() == len(rest) or rest[m.end()] in ".eE+-":
            raise _Short   # more digits may come
        self.out.append(json.dumps(json.loads(m.group())))
        self.pos += m.end()


def _open_string(body: str) -> str:
    """The json.dumps form of a string's text so far (without its closing quote), up to
    where an escape or a surrogate pair may still be incomplete."""
    for _ in range(2):   # an open escape, then a high surrogate before it
        m = _OPEN_ESCAPE.search(body)
        if m and (m.start() - len(body[:m.start()].rstrip("\\"))) % 2 == 0:
            body = body[:m.start()]   # the backslash that starts it is not itself escaped
    try:
        return json.dumps(json.loads('"' + body + '"'), ensure_ascii=False)[:-1]
    except ValueError:
        return '"'


_OPEN_ESCAPE = re.compile(r"\\(?:u[0-9a-fA-F]{0,3}|u[dD][89abAB][0-9a-fA-F]{2})?$")


# ----------------------------------------------------------------------------- formats

@dataclass
class CallSpan:
    """Where one call is in the output text so far.

    name: the function's name, once it is complete (None before).
    args_start / args_end: the span of the arguments' JSON text (None: not begun / open).
    done: the call's text is complete (no arguments by then: "{}").
    """
    name: str | None
    args_start: int | None = None
    args_end: int | None = None
    done: bool = False


def _json_call(node: Node, keys=("arguments", "parameters")) -> CallSpan | None:
    """The span of a call written as {"name": .., "arguments": ..} (or {"function": {..}})."""
    if node.kind != "object":
        return None
    inner = node.members.get("function")
    if inner is not None and inner.kind == "object":
        return _json_call(inner, keys)
    name = node.members.get("name")
    args = next((node.members[k] for k in keys if k in node.members), None)
    span = CallSpan(name.value if name is not None and name.end is not None else None,
                    args.start if args else None, args.end if args else None,
                    node.end is not None)
    if name is not None and name.end is not None and not isinstance(name.value, str):
        return None
    return span


def _calls_of(node: Node | None, as_list: bool, keys=("arguments", "parameters")):
    if node is None:
        return []
    items = node.items if as_list and node.kind == "array" else [node]
    return [s for s in (_json_call(v, keys) for v in items) if s is not None]


def _tagged(fmt, text: str) -> list[CallSpan]:
    """hermes, mistral_nemo: a JSON body (a list of them for Nemo) after each trigger."""
    out, pos = [], 0
    while True:
        at = text.find(fmt.trigger, pos)
        if at < 0:
            return out
        p = PartialJSON(text, at + len(fmt.trigger))
        if p.bad:
            return out
        out += _calls_of(p.root, fmt.as_list)
        if p.root is None or p.root.end is None:
            return out
        pos = p.root.end


def _llama3(fmt, text: str) -> list[CallSpan]:
    """llama3: the whole answer is calls, separated by ';' or blanks."""
    pos = len(text) - len(text.lstrip())
    if text.startswith("<|python_tag|>", pos):
        pos += len("<|python_tag|>")
    out = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos >= len(text) or text[pos] != "{":
            return out
        p = PartialJSON(text, pos)
        if p.bad:
            return out
        out += _calls_of(p.root, False, ("parameters", "arguments"))
        if p.root is None or p.root.end is None:
            return out
        pos = p.root.end


_MISTRAL_CALL = re.compile(r"\s*(?:\[TOOL_CALLS\])?\s*([A-Za-z0-9_.-]+)\[ARGS\]")


def _mistral(fmt, text: str) -> list[CallSpan]:
    """Mistral: [TOOL_CALLS] then a JSON list of calls, or name[ARGS]{...} repeated."""
    at = text.find(fmt.trigger)
    if at < 0:
        return []
    pos = at + len(fmt.trigger)
    if text[pos:].lstrip().startswith("["):
        p = PartialJSON(text, pos)
        return [] if p.bad else _calls_of(p.root, True)
    out = []
    while True:
        m = _MISTRAL_CALL.match(text, pos)
        if not m:
            return out
        p = PartialJSON(text, m.end())
        if p.bad or p.root is None:
            return out
        out.append(CallSpan(m.group(1), p.root.start, p.root.end, p.root.end is not None))
        if p.root.end is None:
            return out
        pos = p.root.end


def _generic(fmt, text: str) -> list[CallSpan]:
    """The generic answer: {"tool_calls": [..]} or {"tool_call": {..}}."""
    p = PartialJSON(text)
    if p.bad or p.root is None or p.root.kind != "object":
        return []
    calls = p.root.members.get("tool_calls")
    if calls is not None and calls.kind == "array":
        return _calls_of(calls, True)
    one = p.root.members.get("tool_call")
    return _calls_of(one, False) if one is not None else []


# Formats whose calls stream as they are written; others (and harmony's raw channels) send
# each call whole at the end (harmony's calls split by channel arrive whole as parts).
LOCATORS = {"hermes": _tagged, "mistral_nemo": _tagged, "llama3": _llama3,
            "mistral": _mistral, "generic": _generic}


# ----------------------------------------------------------------------------- the stream

@dataclass
class CallStart:
    """A call begins: its index in the choice, id and name."""
    index: int
    id: str
    name: str


@dataclass
class CallArgs:
    """The next fragment of call ``index``'s arguments."""
    index: int
    fragment: str


@dataclass
class CallDone:
    """Call ``index`` is complete: the fragments sent make ``call.arguments``."""
    index: int
    call: ToolCall


def _arguments_so_far(text: str, span: CallSpan) -> tuple[str, bool]:
    """(the arguments' text as ToolCall.arguments will hold it, as far as it is known; whether
    that is all of it)."""
    if span.args_start is None:
        return ("{}", True) if span.done else ("", False)
    end = span.args_end if span.args_end is not None else len(text)
    p = PartialJSON(text[:end], span.args_start)
    if p.bad or p.root is None:
        return "", False
    if p.root.end is not None:
        return _args_text(json.loads(text[p.root.start:p.root.end])), True
    if p.root.kind in ("object", "array"):
        return p.canonical, False
    return "", False   # a string or scalar: its text is known only when it ends


class StreamSplitter:
    """Streams a choice's content while holding back what may start a tool call, and its
    calls as they are written (take())."""

    def __init__(self, plan_: ToolPlan):
        self.plan = plan_
        self.text = ""
        self.sent = 0
        self.held = plan_.buffers
        self.parts: list = []   # harmony calls the reasoning split took out of the text
        self.started: list[ToolCall] = []   # calls begun: name and id, arguments so far
        self.finished: list[bool] = []
        self._events: list = []

    def feed(self, piece: str, parts=()) -> str:
        """The content that can be shown now (the calls' events wait in take()).

        Args:
            piece: the next content text.
            parts: harmony "tool_call" Parts that came with it (see ToolPlan.split).
        """
        new = [p for p in parts if p.kind == "tool_call"]
        self.parts += new
        self.text += piece
        shown = self._content()
        if self.held and self.plan.fmt is not None:
            self._locate()
        for c in harmony_calls(new):
            self._whole(c)
        return shown

    def _content(self) -> str:
        if self.held or self.plan.fmt is None:
            if self.plan.fmt is None:
                out, self.sent = self.text[self.sent:], len(self.text)
                return out
            return ""
        trig = self.plan.fmt.trigger
        at = self.text.find(trig, self.sent)
        if at >= 0:
            self.held = True
            out, self.sent = self.text[self.sent:at], at
            return out
        keep = 0   # a tail that may be the trigger's start
        for k in range(min(len(trig) - 1, len(self.text) - self.sent), 0, -1):
            if self.text.endswith(trig[:k]):
                keep = k
                break
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], end
        return out

    def _locate(self) -> None:
        """Events for what the held text now shows of its calls."""
        locate = LOCATORS.get(self.plan.fmt.name)
        if locate is None:
            return
        for i, span in enumerate(locate(self.plan.fmt, self.text)):
            if i < len(self.started):
                if self.finished[i]:
                    continue
            elif span.name is None or i != len(self.started):
                return
            else:
                self._start(span.name)
            args, complete = _arguments_so_far(self.text, span)
            self._extend(i, args)
            if complete and span.done:
                self._done(i)

    def _start(self, name: str, call_id: str | None = None) -> int:
        c = ToolCall(name, "", **({"id": call_id} if call_id else {}))
        self.started.append(c)
        self.finished.append(False)
        self._events.append(CallStart(len(self.started) - 1, c.id, name))
        return len(self.started) - 1

    def _extend(self, i: int, args: str) -> None:
        sent = self.started[i].arguments
        if len(args) > len(sent) and args.startswith(sent):
            self._events.append(CallArgs(i, args[len(sent):]))
            self.started[i].arguments = args

    def _done(self, i: int) -> None:
        self.finished[i] = True
        self._events.append(CallDone(i, self.started[i]))

    def _whole(self, call: ToolCall) -> None:
        i = self._start(call.name, call.id)
        self._extend(i, call.arguments)
        self._done(i)

    def take(self) -> list:
        """The call events (CallStart, CallArgs, CallDone) since the last take, in order."""
        out, self._events = self._events, []
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet shown, calls) at the choice's end; take() then gives the events
        that complete the calls (the calls keep the ids their first events had)."""
        content, calls = self.plan.split(self.text)
        calls = calls + harmony_calls(self.parts) if self.plan.fmt is not None else calls
        for i, c in enumerate(calls):
            if i >= len(self.started):
                self._start(c.name, c.id)
            c.id = self.started[i].id
            self._extend(i, c.arguments)
            if not self.finished[i]:
                self.started[i].arguments = c.arguments
                self._done(i)
        if calls:
            shown = self.text[:self.sent]
            rest = content[len(shown.strip()):] if content.startswith(shown.strip()) else ""
            return rest.strip() if not shown else rest, calls
        return self.text[self.sent:] if not self.plan.buffers else content, calls


def stream_calls(chunks, plan_: ToolPlan):
    """A generation's pieces with its tool calls split off: the text that is no call as it
    comes, then each ToolCall once the generation ends.

    Args:
        chunks: an iterable of text pieces (a Generation; closed when this ends).
        plan_: the ToolPlan the prompt was made with.
    Returns:
        an iterator of str pieces and ToolCall objects.
    """
    split = StreamSplitter(plan_)
    try:
        for c in chunks:
            shown = split.feed(str(c))
            if shown:
                yield c if shown == str(c) else shown
        rest, calls = split.finish()
        if rest:
            yield rest
        yield from calls
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
