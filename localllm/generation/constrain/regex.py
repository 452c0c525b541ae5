"""JSON Schema ``pattern`` (an ECMAScript regular expression) compiled to a grammar of JSON
string content: literals, classes, groups, alternation, quantifiers, and ^/$ at the ends.

Unsupported, with an error naming it: backreferences, lookaround, word boundaries, Unicode
property escapes, and anchors anywhere but the start or end of a top-level alternative.
A pattern without ^ (or $) may have anything before (or after) its match, as in JSON Schema.
"""

from __future__ import annotations

from .grammar import MAX_CP, Chars, Element, GrammarError, Ranges, intersect, lit, negate, ranges, subtract
from .json_grammar import PLAIN, JsonGrammar, encode_char

MAX_PATTERN = 2000       # characters of one pattern
MAX_QUANTIFIER = 10_000  # a {n,m} bound

DIGITS = ranges([(0x30, 0x39)])
WORD = ranges([(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)])
SPACE = ranges([(9, 13), 0x20, 0xA0, 0x1680, (0x2000, 0x200A), 0x2028, 0x2029, 0x202F, 0x205F,
                0x3000, 0xFEFF])
DOT = negate(ranges([0x0A, 0x0D, 0x2028, 0x2029]))
_CLASS_ESCAPES = {"d": DIGITS, "D": negate(DIGITS), "w": WORD, "W": negate(WORD), "s": SPACE,
                  "S": negate(SPACE)}
_CHAR_ESCAPES = {"t": 9, "n": 10, "v": 11, "f": 12, "r": 13}
_SYNTAX = set("^$\\.*+?()[]{}|/-")


class _Parser:
    """Recursive descent over one pattern. Nodes: ("cls", Ranges), ("seq", [nodes]),
    ("alt", [nodes]), ("rep", node, lo, hi)."""

    def __init__(self, src: str):
        if len(src) > MAX_PATTERN:
            raise GrammarError(f"pattern longer than {MAX_PATTERN} characters")
        self.s, self.i = src, 0

    def fail(self, what: str):
        raise GrammarError(f"pattern {self.s!r}: {what} is not supported (at offset {self.i})")

    def peek(self) -> str:
        return self.s[self.i] if self.i < len(self.s) else ""

    def take(self) -> str:
        if self.i >= len(self.s):
            raise GrammarError(f"pattern {self.s!r} ends unexpectedly")
        c = self.s[self.i]
        self.i += 1
        return c

    def top(self) -> list[tuple[bool, tuple, bool]]:
        """Returns: the top-level alternatives as (anchored at start, node, anchored at end)."""
        out = []
        while True:
            start = self.peek() == "^"
            if start:
                self.i += 1
            node, end = self.sequence(top=True)
            out.append((start, node, end))
            if self.peek() != "|":
                break
            self.i += 1
        if self.i < len(self.s):
            raise GrammarError(f"pattern {self.s!r}: unmatched ')' at offset {self.i}")
        return out

    def alternation(self) -> tuple:
        alts = [self.sequence(top=False)[0]]
        while self.peek() == "|":
            self.i += 1
            alts.append(self.sequence(top=False)[0])
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def sequence(self, top: bool) -> tuple[tuple, bool]:
        items, end = [], False
        while self.i < len(self.s) and self.peek() not in "|)":
            if self.peek() == "$":
                self.i += 1
                if top and self.peek() in ("", "|"):
                    end = True
                    break
                self.fail("'$' inside the pattern")
            items.append(self.quantified(self.atom()))
        return ("seq", items), end

    def atom(self) -> tuple:
        c = self.take()
        if c == "(":
            if self.peek() == "?":
                self.i += 1
                kind = self.take()
                if kind == "<" and self.peek() not in ("=", "!"):
                    while self.take() != ">":
                        pass
                elif kind != ":":
                    self.fail("lookahead or lookbehind")
            node = self.alternation()
            if self.take() != ")":
                raise GrammarError(f"pattern {self.s!r}: missing ')'")
            return node
        if c == "[":
            return ("cls", self.char_class())
        if c == ".":
            return ("cls", DOT)
        if c == "\\":
            return ("cls", self.escape(in_class=False))
        if c == "^":
            self.fail("'^' inside the pattern")
        if c in "*+?":
            raise GrammarError(f"pattern {self.s!r}: nothing to repeat at offset {self.i - 1}")
        return ("cls", ranges([c]))

    def quantified(self, node: tuple) -> tuple:
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            lo, hi = {"*": (0, -1), "+": (1, -1), "?": (0, 1)}[c]
        elif c == "{" and self._counted():
            lo, hi = self._counted(consume=True)
        else:
            return node
        if self.peek() == "?":
            self.i += 1  # lazy: the same set of strings
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self._counted()):
            raise GrammarError(f"pattern {self.s!r}: nothing to repeat at offset {self.i}")
        return ("rep", node, lo, hi)

    def _counted(self, consume: bool = False):
        j = self.s.find("}", self.i)
        body = self.s[self.i + 1:j] if j > 0 else ""
        parts = body.split(",")
        if not body or len(parts) > 2 or not parts[0].isdigit() or (len(parts) == 2 and parts[1]
                                                                     and not parts[1].isdigit()):
            return None
        lo = int(parts[0])
        hi = lo if len(parts) == 1 else (int(parts[1]) if parts[1] else -1)
        if consume:
            if max(lo, hi) > MAX_QUANTIFIER:
                raise GrammarError(f"pattern {self.s!r}: a repeat bound above {MAX_QUANTIFIER}")
            if hi >= 0 and lo > hi:
                raise GrammarError(f"pattern {self.s!r}: repeat {{{body}}} has min > max")
            self.i = j + 1
        return lo, hi

    def escape(self, in_class: bool) -> Ranges:
        c = self.take()
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in _CHAR_ESCAPES:
            return ranges([_CHAR_ESCAPES[c]])
        if c == "b" and in_class:
            return ranges([8])
        if c in "bB":
            self.fail("a word boundary (\\b, \\B)")
        if c == "0" and not self.peek().isdigit():
            return ranges([0])
        if c.isdigit():
            self.fail("a backreference")
        if c in "pP":
            self.fail("a Unicode property escape")
        if c == "k":
            self.fail("a named backreference")
        if c == "c" and self.peek().isalpha():
            return ranges([ord(self.take()) % 32])
        if c in "xu":
            if c == "u" and self.peek() == "{":
                j = self.s.find("}", self.i)
                digits, self.i = self.s[self.i + 1:j], j + 1
            else:
                n = 2 if c == "x" else 4
                digits, self.i = self.s[self.i:self.i + n], self.i + n
            try:
                cp = int(digits, 16)
            except ValueError:
                raise GrammarError(f"pattern {self.s!r}: bad \\{c} escape") from None
            if cp > MAX_CP:
                raise GrammarError(f"pattern {self.s!r}: code point {digits} out of range")
            return ranges([cp])
        if c in _SYNTAX or not c.isalnum():
            return ranges([c])
        self.fail(f"the escape \\{c}")

    def char_class(self) -> Ranges:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        parts: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.take()
            if c == "]" and not first:
                break
            first = False
            lo = self._class_atom(c)
            if self.peek() == "-" and self.i + 1 < len(self.s) and self.s[self.i + 1] != "]":
                self.i += 1
                hi = self._class_atom(self.take())
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] or hi[0][0] != hi[0][1]:
                    self.fail("a range with a class escape at an end")
                if lo[0][0] > hi[0][0]:
                    raise GrammarError(f"pattern {self.s!r}: range out of order in a class")
                parts.append((lo[0][0], hi[0][0]))
            else:
                parts.extend(lo)
        r = ranges(parts)
        return negate(r) if negated else r

    def _class_atom(self, c: str) -> Ranges:
        return self.escape(in_class=True) if c == "\\" else ranges([c])


def pattern_element(g: JsonGrammar, pattern: str) -> Element:
    """Returns: a JSON string (quotes included) whose value matches ``pattern`` somewhere,
    as JSON Schema means it.

    Raises:
        GrammarError: syntax this compiler does not support, or a pattern too large.
    """
    if not isinstance(pattern, str):
        raise GrammarError("pattern must be a string")
    emit = _Emitter(g)
    anything = g.seq([g.char], 0, -1)
    alts = []
    for start, node, end in _Parser(pattern).top():
        alts.append(([] if start else [anything]) + emit.node(node) + ([] if end else [anything]))
    return g.rule([lit('"') + [g.choice(alts, "pattern")] + lit('"')], "pattern-string")


class _Emitter:
    """Turns parsed nodes into grammar elements over JSON-encoded characters: a class holding
    characters a JSON string must escape becomes its plain part plus those escapes."""

    def __init__(self, g: JsonGrammar):
        self.g = g
        self.classes: dict[Ranges, Element] = {}

    def char(self, r: Ranges) -> Element:
        if r in self.classes:
            return self.classes[r]
        plain = intersect(r, PLAIN)
        special = subtract(r, PLAIN)
        if not special:
            e: Element = Chars(plain)
        else:
            alts = [[Chars(plain)]] if plain else []
            for a, b in special:
                for cp in range(a, b + 1):
                    alts += [lit(text) for text in encode_char(cp)]
            if not alts:
                raise GrammarError("a pattern class that matches no character")
            e = self.g.rule(alts, "pattern-char")
        self.classes[r] = e
        return e

    def node(self, n: tuple) -> list[Element]:
        kind = n[0]
        if kind == "cls":
            if not n[1]:
                raise GrammarError("a pattern class that matches no character")
            return [self.char(n[1])]
        if kind == "seq":
            return [e for item in n[1] for e in self.node(item)]
        if kind == "alt":
            return [self.g.choice([self.node(a) for a in n[1]], "pattern-alt")]
        _, inner, lo, hi = n
        body = self.node(inner)
        if len(body) == 1 and isinstance(body[0], Chars) and body[0].lo == body[0].hi == 1:
            return [Chars(body[0].cls, lo, hi)]
        if not body:
            return []
        return [self.g.seq(body, lo, hi, "pattern-repeat")]


def raw_pattern_element(g: JsonGrammar, pattern: str, banned: Ranges) -> Element:
    """Returns: raw text (no quotes, no escapes) that matches ``pattern`` somewhere and holds
    none of the ``banned`` characters (an XML call's value, which must not hold its closing
    tag: '<' is banned there).

    Raises:
        GrammarError: as pattern_element, or a pattern that needs only banned characters.
    """
    if not isinstance(pattern, str):
        raise GrammarError("pattern must be a string")
    emit = _RawEmitter(g, banned)
    anything = Chars(negate(banned), 0, -1)
    alts = []
    for start, node, end in _Parser(pattern).top():
        alts.append(([] if start else [anything]) + emit.node(node) + ([] if end else [anything]))
    return g.choice(alts, "raw-pattern")


class _RawEmitter(_Emitter):
    """Nodes over raw characters: each class without the banned ones."""

    def __init__(self, g: JsonGrammar, banned: Ranges):
        super().__init__(g)
        self.banned = banned

    def char(self, r: Ranges) -> Element:
        return Chars(subtract(r, self.banned))
