"""Tool calls out of streamed output: the text that is no call as it comes, and each call as
it is written (its name once known, then its arguments' JSON in fragments), for the server's
streams and Model.chat. A format says where a call's name and arguments are (LOCATORS)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from localllm.text import tool_formats as tf
from localllm.text.tool_calls import ToolCall, _args_text

from .partial_json import Node, PartialJSON
from .tool_use import ToolPlan, harmony_calls

# ----------------------------------------------------------------------------- formats

@dataclass
class CallSpan:
    """Where one call is in the output text so far.

    name: the function's name, once it is complete (None before).
    args_start / args_end: the span of the arguments' JSON text (None: not begun / open).
    done: the call's text is complete (no arguments by then: "{}").
    arguments: for formats whose arguments are no JSON text (XML parameters), the
        arguments' JSON as far as it is known, a prefix of the final text (None: a span).
    """
    name: str | None
    args_start: int | None = None
    args_end: int | None = None
    done: bool = False
    arguments: str | None = None


def _json_call(node: Node, keys=("arguments", "parameters"),
               name_key: str = "name") -> CallSpan | None:
    """The span of a call written as {"name": .., "arguments": ..} (or {"function": {..}})."""
    if node.kind != "object":
        return None
    inner = node.members.get("function")
    if inner is not None and inner.kind == "object":
        return _json_call(inner, keys, name_key)
    name = node.members.get(name_key)
    args = next((node.members[k] for k in keys if k in node.members), None)
    span = CallSpan(name.value if name is not None and name.end is not None else None,
                    args.start if args else None, args.end if args else None,
                    node.end is not None)
    if name is not None and name.end is not None and not isinstance(name.value, str):
        return None
    return span


def _calls_of(node: Node | None, as_list: bool, keys=("arguments", "parameters"),
              name_key: str = "name"):
    if node is None:
        return []
    items = node.items if as_list and node.kind == "array" else [node]
    return [s for s in (_json_call(v, keys, name_key) for v in items) if s is not None]


def _tagged(fmt, text: str, tools=None) -> list[CallSpan]:
    """hermes, mistral_nemo, granite: a JSON body (a list of them for Nemo and Granite)
    after each trigger."""
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


def _llama3(fmt, text: str, tools=None) -> list[CallSpan]:
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


def _mistral(fmt, text: str, tools=None) -> list[CallSpan]:
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


def _generic(fmt, text: str, tools=None) -> list[CallSpan]:
    """The generic answer: {"tool_calls": [..]} or {"tool_call": {..}}."""
    p = PartialJSON(text)
    if p.bad or p.root is None or p.root.kind != "object":
        return []
    calls = p.root.members.get("tool_calls")
    if calls is not None and calls.kind == "array":
        return _calls_of(calls, True)
    one = p.root.members.get("tool_call")
    return _calls_of(one, False) if one is not None else []


def _deepseek(fmt, text: str, tools=None) -> list[CallSpan]:
    """DeepSeek: calls in a <｜tool▁calls▁begin｜> block, each NAME and its JSON arguments
    (R1 / V3: after the type and in a ```json fence; V3.1: bare)."""
    block = tf.DS_CALLS_BEGIN_RE.search(text) or tf.DS_CALL_BEGIN_RE.search(text)
    if block is None:
        return []
    fenced = fmt.name == "deepseek_r1"
    pos = block.end() if block.re is tf.DS_CALLS_BEGIN_RE else block.start()
    out = []
    while True:
        begin = tf.DS_CALL_BEGIN_RE.match(text, pos)
        if begin is None:
            return out
        head = (tf.DS_R1_HEAD_RE if fenced else tf.DS_V31_HEAD_RE).match(text, begin.end())
        if head is None:
            return out
        p = PartialJSON(text, head.end())
        if p.bad or p.root is None:   # the name is certain once its arguments begin
            return out
        name = (head.group(2) if fenced else head.group(1)).strip()
        span = CallSpan(name, p.root.start, p.root.end)
        out.append(span)
        if p.root.end is None:
            return out
        end = p.root.end
        if fenced:
            fence = tf.FENCE_END_RE.match(text, end)
            if fence is None:
                return out
            end = fence.end()
        close = tf.DS_CALL_END_RE.match(text, end)
        if close is None:
            return out
        span.done, pos = True, close.end()


def _command_r7b(fmt, text: str, tools=None) -> list[CallSpan]:
    """Command R7B: a JSON list of {"tool_call_id", "tool_name", "parameters"} after
    <|START_ACTION|>."""
    at = text.find(fmt.trigger)
    if at < 0:
        return []
    p = PartialJSON(text, at + len(fmt.trigger))
    if p.bad or p.root is None or p.root.kind != "array":
        return []
    return _calls_of(p.root, True, (fmt.args_key,), fmt.name_key)


def _functionary_v32(fmt, text: str, tools=None) -> list[CallSpan]:
    """Functionary v3.2: blocks >>>RECIPIENT\nBODY from the output's start (the prompt wrote
    the first >>>); recipient "all" is text, any other a function and its JSON arguments."""
    pos = 3 if text.startswith(">>>") else 0
    out = []
    while True:
        head = tf.RECIPIENT_RE.match(text, pos)
        if head is None:
            return out
        if head.group(1) == tf.FUNCTIONARY_ALL:
            nxt = tf.NEXT_BLOCK_RE.search(text, head.end())
            if nxt is None:
                return out
            pos = nxt.end()
            continue
        p = PartialJSON(text, head.end())
        if p.bad or p.root is None:   # a name, once its arguments begin
            return out
        out.append(CallSpan(head.group(1), p.root.start, p.root.end, p.root.end is not None))
        if p.root.end is None:
            return out
        pos = tf.skip_blanks(text, p.root.end)
        if not text.startswith(">>>", pos):
            return out
        pos += 3


def _xml(style):
    def locate(fmt, text: str, tools=None) -> list[CallSpan]:
        """Qwen3-Coder's and GLM's XML calls: the arguments' JSON is built parameter by
        parameter (a string parameter's value as it comes)."""
        out, pos = [], 0
        while True:
            at = text.find(tf.XML_OPEN, pos)
            if at < 0:
                return out
            c = tf.scan_xml_call(style, text, at, tools)
            if c.name is None:
                return out
            out.append(CallSpan(c.name, done=c.done, arguments=c.arguments))
            if not c.done:
                return out
            pos = c.end
    return locate


# Formats whose calls stream as they are written; others (and harmony's raw channels) send
# each call whole at the end (harmony's calls split by channel arrive whole as parts).
# A locator takes (fmt, text so far, the request's tools) and gives the calls' CallSpans.
LOCATORS = {"hermes": _tagged, "mistral_nemo": _tagged, "granite": _tagged, "llama3": _llama3,
            "mistral": _mistral, "generic": _generic, "deepseek_r1": _deepseek,
            "deepseek_v31": _deepseek, "command_r7b": _command_r7b,
            "functionary_v32": _functionary_v32, "qwen3_coder": _xml(tf.QWEN3_CODER_XML),
            "glm": _xml(tf.GLM_XML)}


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
    if span.arguments is not None:
        return span.arguments, span.done
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
        # the request's tools (a native plan renders them): they type XML calls' values
        self.tools = plan_.template_kwargs.get("tools")
        self.text = ""
        self.sent = 0
        self.shown = ""   # the content given out so far
        self.held = plan_.buffers
        # starts_open: the output opens inside a call's prefix, so its first line (a
        # function's name, or Functionary's "all" before text) is held until it is known
        self.opening = plan_.fmt is not None and plan_.fmt.starts_open and not self.held
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
        self.shown += shown
        if self.held and self.plan.fmt is not None:
            self._locate()
        for c in harmony_calls(new):
            self._whole(c)
        return shown

    def _content(self) -> str:
        if self.opening and not self._open_line():
            return ""
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

    def _open_line(self) -> bool:
        """starts_open: whether the output's first line is known (then: text after "all"
        streams, a function's name holds the rest, and no recipient line is plain text)."""
        recipient, end = tf.functionary_opening(self.text)
        if recipient is None:
            return False
        if recipient == tf.FUNCTIONARY_ALL:
            self.sent = end
        elif recipient:
            self.held = True
        self.opening = False
        return True

    def _locate(self) -> None:
        """Events for what the held text now shows of its calls."""
        locate = LOCATORS.get(self.plan.fmt.name)
        if locate is None:
            return
        for i, span in enumerate(locate(self.plan.fmt, self.text, self.tools)):
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
        if self.plan.fmt is None:
            content, calls = self.text, []
        else:   # as plan.split, with the tools that typed the streamed arguments
            content, calls = self.plan.fmt.parse(self.text, self.tools)
            calls = calls + harmony_calls(self.parts)
        for i, c in enumerate(calls):
            if i >= len(self.started):
                self._start(c.name, c.id)
            c.id = self.started[i].id
            self._extend(i, c.arguments)
            if not self.finished[i]:
                self.started[i].arguments = c.arguments
                self._done(i)
        if calls:
            shown = self.shown
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
