"""JSON read from the start of a text that may still be growing (a tool call's arguments
as they are generated): the values found so far, their spans, and the text of the value so
far in json.dumps's form."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

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
