"""Reasoning apart from the answer: a model's output text, fed piece by piece, split into
reasoning and content parts (``<think>...</think>`` tags, Mistral's ``[THINK]...[/THINK]``,
Command R7B's ``<|START_THINKING|>`` plan, or gpt-oss harmony channels),
holding back only what could still be the start of a marker."""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# the open and close tags of each tagged style: "think" (Qwen3, DeepSeek R1, SmolLM3),
# "mistral" (Magistral, Ministral 3 reasoning) and "cohere" (Command R7B's plan)
TAGS = {"think": (THINK_OPEN, THINK_CLOSE), "mistral": ("[THINK]", "[/THINK]"),
        "cohere": ("<|START_THINKING|>", "<|END_THINKING|>")}
# harmony (gpt-oss): <|start|>assistant<|channel|>analysis<|message|>...<|end|>
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_H_HEADER_MAX = 512          # a header longer than this is not one: the text is content
_H_HEADER_LEADS = ("assistant", "to=", H_CHANNEL, "<|constrain|>", H_START)
_H_CHANNEL_RE = re.compile(r"<\|channel\|>\s*([A-Za-z0-9_.-]+)")
_H_RECIPIENT_RE = re.compile(r"\bto=([^\s<]+)")

STYLES = ("think", "mistral", "cohere", "harmony")


@dataclass(frozen=True)
class Part:
    """A run of output text of one kind.

    Attributes:
        kind: "reasoning", "content", or "tool_call" (harmony: a message addressed to a
            function, ``to=functions.NAME``; its text is the call's arguments as written).
        text: the text.
        name: for a tool call, the recipient as written (``functions.get_weather``).
    """
    kind: str
    text: str
    name: str | None = None


def style_of_template(source: str) -> str:
    """The reasoning markers a chat template's model writes.

    Args:
        source: the jinja source of the template.
    Returns:
        "harmony" for templates with harmony channels (gpt-oss), "mistral" for those
        that write ``[THINK]`` and no ``<think>``, "cohere" for those that write
        ``<|START_THINKING|>`` and no ``<think>`` (Command R7B), else "think".
    """
    if H_CHANNEL in source:
        return "harmony"
    if TAGS["cohere"][0] in source and THINK_OPEN not in source:
        return "cohere"
    return "mistral" if TAGS["mistral"][0] in source and THINK_OPEN not in source else "think"


def _partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that begins one of the markers (held back)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class ReasoningSplitter:
    """Splits streamed output text into reasoning and content (and harmony tool calls).

    Feed each new piece of text with ``feed``; call ``finish`` at the end. The joined parts
    of each kind are the same however the text was cut into pieces.
    """

    def __init__(self, style: str = "think", prompt: str = ""):
        """Args:
            style: "think", "mistral", "cohere" or "harmony" (see style_of_template).
            prompt: the rendered prompt; a template that opens the reasoning itself (its
                generation prompt ends in its open tag, or in a harmony header) makes the
                output start inside it.
        Raises:
            ValueError: an unknown style.
        """
        if style not in STYLES:
            raise ValueError(f"unknown reasoning style {style!r} (one of {', '.join(STYLES)})")
        self.style = style
        self._tags = TAGS.get(style)   # None: harmony
        self._buf = ""
        self._out: list[Part] = []
        self.reasoning_chars = 0
        if self._tags:
            # start: before any text; reasoning; after: just past the close tag; content
            self._state = "reasoning" if prompt.rstrip().endswith(self._tags[0]) else "start"
            self._lead = True          # reasoning (or content after it) not begun: strip
        else:
            self._state, self._header, self._kind = "header", "", "content"
            self._pre = 0              # how much of the header came from the prompt
            self._name: str | None = None
            self._call = ""
            self._harmony_prompt(prompt)

    # ---- the interface -------------------------------------------------------------

    @property
    def in_reasoning(self) -> bool:
        """Whether text fed now would be reasoning."""
        if self._tags:
            return self._state == "reasoning"
        return self._state == "body" and self._kind == "reasoning"

    def feed(self, text: str) -> list[Part]:
        """Args:
            text: the next piece of output.
        Returns:
            the parts that are now certain, in order (adjacent ones of a kind merged).
        """
        self._buf += text
        if self._tags:
            self._think()
        else:
            self._harmony()
        return self._take()

    def finish(self) -> list[Part]:
        """Returns: the parts still held back, at the end of the output."""
        if self._tags:
            if self._state == "start":
                self._emit("content", self._buf)
            elif self._state == "reasoning":
                self._emit("reasoning", self._buf.rstrip())
            elif self._state == "content":
                self._emit("content", self._buf)
        else:
            if self._state == "header":
                # a header that never got its message: text, unless it looks like markup
                if not self._looks_like_header():
                    self._emit("content", self._header[self._pre:])
            else:
                self._body_text(self._buf)
                self._end_message()
        self._buf = ""
        return self._take()

    # ---- <think> (or [THINK]) tags --------------------------------------------------

    def _think(self) -> None:
        opening, closing = self._tags
        while True:
            b = self._buf
            if self._state == "start":
                s = b.lstrip()
                if s.startswith(opening):
                    self._buf = s[len(opening):]
                    self._state = "reasoning"
                    continue
                if opening.startswith(s):   # whitespace, or a part of the tag
                    return
                self._state = "content"
                continue
            if self._state == "reasoning":
                if self._lead:
                    b = self._buf = b.lstrip()
                    if not b:
                        return
                at = b.find(closing)
                if at >= 0:
                    self._emit("reasoning", b[:at].rstrip())
                    self._buf = b[at + len(closing):]
                    self._state, self._lead = "after", True
                    continue
                keep = _partial_suffix(b, (closing,))
                text = b[:len(b) - keep]
                body = text.rstrip()   # trailing space waits: it may end the reasoning
                self._emit("reasoning", body)
                self._lead = self._lead and not body
                self._buf = text[len(body):] + b[len(b) - keep:]
                return
            if self._state == "after":
                s = b.lstrip()
                if not s:
                    self._buf = ""
                    return
                self._buf, self._state = s, "content"
                continue
            self._emit("content", b)
            self._buf = ""
            return

    # ---- harmony channels ----------------------------------------------------------

    def _harmony_prompt(self, prompt: str) -> None:
        """Start where the prompt leaves off: inside an assistant header (the usual
        ``<|start|>assistant``), or inside a message the template opened."""
        at = prompt.rfind(H_START)
        if at < 0:
            return
        tail = prompt[at + len(H_START):]
        if any(e in tail for e in H_ENDS):
            return
        if H_MESSAGE in tail:
            self._open(tail[:tail.find(H_MESSAGE)])
        else:
            self._header, self._pre = tail, len(tail)

    def _open(self, header: str) -> None:
        """Begin the body of a message with this header."""
        header = header.strip()
        if header.startswith(H_START):
            header = header[len(H_START):]
        m = _H_RECIPIENT_RE.search(header)
        recipient = m.group(1) if m else None
        c = _H_CHANNEL_RE.search(header)
        channel = c.group(1) if c else "final"
        role = re.split(r"<\|| to=", header, maxsplit=1)[0].strip()
        if role and role != "assistant" and not role.startswith("functions."):
            # another role's turn (user, system): not the model's answer, dropped
            self._kind, self._name = "hidden", None
        elif recipient and recipient != "assistant":
            self._kind, self._name, self._call = "tool_call", recipient, ""
        else:
            self._kind = "reasoning" if channel == "analysis" else "content"
            self._name = None
        self._state = "body"

    def _harmony(self) -> None:
        while self._buf:
            if self._state == "header":
                self._header += self._buf
                self._buf = ""
                h = self._header
                at = h.find(H_MESSAGE)
                if at >= 0:
                    self._buf = h[at + len(H_MESSAGE):]
                    self._header = ""
                    self._open(h[:at])
                    continue
                if len(h) > _H_HEADER_MAX or not self._looks_like_header():
                    # no harmony here: plain text (a model that ignores the format)
                    self._buf, self._header, self._pre = h[self._pre:], "", 0
                    self._kind, self._name, self._state = "content", None, "body"
                    continue
                return
            b = self._buf
            ends = [(b.find(e), e) for e in H_ENDS + (H_START,) if e in b]
            if ends:
                at, marker = min(ends)
                self._body_text(b[:at])
                self._end_message()
                self._buf = b[at + len(marker):]
                # a header begun by <|start|> is one, whatever its role
                self._state, self._pre = "header", 0
                self._header = H_START if marker == H_START else ""
                continue
            keep = _partial_suffix(b, H_ENDS + (H_START,))
            self._body_text(b[:len(b) - keep])
            self._buf = b[len(b) - keep:]
            return

    def _looks_like_header(self) -> bool:
        """Whether the header text from the output can still be the start of a header."""
        h = self._header[self._pre:].lstrip()
        if h.startswith(H_START):
            return True
        return not h or any(a.startswith(h) or h.startswith(a) for a in _H_HEADER_LEADS)

    def _body_text(self, text: str) -> None:
        if self._kind == "tool_call":
            self._call += text
        elif self._kind != "hidden":
            self._emit(self._kind, text)

    def _end_message(self) -> None:
        if self._kind == "tool_call":
            self._out.append(Part("tool_call", self._call, self._name))
            self._call = ""
        self._kind, self._name = "content", None

    # ---- output --------------------------------------------------------------------

    def _emit(self, kind: str, text: str) -> None:
        if not text:
            return
        if kind == "reasoning":
            self.reasoning_chars += len(text)
        if self._out and self._out[-1].kind == kind and kind != "tool_call":
            self._out[-1] = Part(kind, self._out[-1].text + text)
        else:
            self._out.append(Part(kind, text))

    def _take(self) -> list[Part]:
        out, self._out = self._out, []
        return out


@dataclass
class SplitText:
    """A whole output, split: the reasoning, the answer, and harmony tool calls."""
    reasoning: str
    content: str
    tool_calls: list[Part]


def split_reasoning(text: str, style: str = "think", prompt: str = "") -> SplitText:
    """Split a whole output at once.

    Args:
        text: the output text.
        style, prompt: as for ReasoningSplitter.
    Returns:
        The reasoning and content texts and the tool-call parts.
    """
    sp = ReasoningSplitter(style, prompt)
    parts = sp.feed(text) + sp.finish()
    return SplitText("".join(p.text for p in parts if p.kind == "reasoning"),
                     "".join(p.text for p in parts if p.kind == "content"),
                     [p for p in parts if p.kind == "tool_call"])
