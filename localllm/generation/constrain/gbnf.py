"""GBNF, llama.cpp's grammar notation, parsed into the character-level Grammar: rules,
alternatives, groups, repeats (* + ? {m,n}), literals, character classes and '.', with
errors that give the line and column."""

from __future__ import annotations

from localllm.errors import GrammarError

from .grammar import MAX_CP, SURROGATES, Chars, CompiledGrammar, Element, Grammar, Limits, \
    Ref, negate, ranges

MAX_CHARS = 1 << 20     # longest grammar text accepted
MAX_NESTING = 128       # parentheses inside each other
_ESCAPES = {"t": "\t", "r": "\r", "n": "\n", "\\": "\\", '"': '"', "[": "[", "]": "]",
            "-": "-"}
_HEX = {"x": 2, "u": 4, "U": 8}
_ANY = ranges([(0, MAX_CP)])


def _word(c: str) -> bool:
    return c.isascii() and (c.isalnum() or c in "-_")


class _Parser:
    def __init__(self, text: str, limits: Limits | None):
        self.s = text
        self.i = 0
        self.g = Grammar(limits)
        self.g.cycle_hint = " (left recursion: the rule can call itself first)"
        self.g.subject = "the grammar (every way through root recurses forever or needs an empty class)"
        self.ids: dict[str, int] = {}
        self.used_at: dict[str, int] = {}
        self.defined: set[str] = set()
        self.depth = 0

    # ---- positions and errors ------------------------------------------------------

    def where(self, at: int | None = None) -> str:
        at = self.i if at is None else at
        line = self.s.count("\n", 0, at) + 1
        col = at - (self.s.rfind("\n", 0, at) + 1) + 1
        return f"line {line}, column {col}"

    def error(self, message: str, at: int | None = None) -> GrammarError:
        return GrammarError(f"GBNF {self.where(at)}: {message}")

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < len(self.s) else ""

    def found(self) -> str:
        c = self.peek()
        return "the end of the grammar" if not c else ("a newline" if c in "\r\n" else repr(c))

    def space(self, newline_ok: bool) -> None:
        """Skips blanks and comments (and newlines when newline_ok)."""
        s, n = self.s, len(self.s)
        while self.i < n:
            c = s[self.i]
            if c == "#":
                while self.i < n and s[self.i] not in "\r\n":
                    self.i += 1
            elif c in " \t" or (newline_ok and c in "\r\n"):
                self.i += 1
            else:
                return

    # ---- rules ---------------------------------------------------------------------

    def rule_id(self, name: str) -> int:
        rid = self.ids.get(name)
        if rid is None:
            rid = self.ids[name] = self.g.declare(name)
        return rid

    def name(self) -> str:
        start = self.i
        while self.i < len(self.s) and _word(self.s[self.i]):
            self.i += 1
        if self.i == start:
            raise self.error(f"expected a rule name, found {self.found()}")
        return self.s[start:self.i]

    def parse(self) -> CompiledGrammar:
        self.space(True)
        while self.i < len(self.s):
            self.rule()
        for name, at in self.used_at.items():
            if name not in self.defined:
                raise self.error(f"rule {name!r} is used but never defined", at)
        if "root" not in self.defined:
            raise GrammarError("GBNF: the grammar has no 'root' rule (what the whole output "
                               "must match)")
        return self.g.compile(Ref(self.ids["root"]))

    def rule(self) -> None:
        at = self.i
        name = self.name()
        self.space(False)
        if self.s.startswith("::=", self.i):
            self.i += 3
        else:
            raise self.error(f"expected '::=' after the rule name {name!r}, found {self.found()}")
        if name in self.defined:
            raise self.error(f"rule {name!r} is defined twice", at)
        self.defined.add(name)
        rid = self.rule_id(name)
        self.space(True)
        alts = self.alternates(name, nested=False)
        c = self.peek()
        if c == "\r":
            self.i += 2 if self.peek(1) == "\n" else 1
        elif c == "\n":
            self.i += 1
        elif c:
            raise self.error(f"expected a newline or the end of the grammar, found {self.found()}")
        self.g.define(rid, alts)
        self.space(True)

    def alternates(self, name: str, nested: bool) -> list[list[Element]]:
        alts = [self.sequence(name, nested)]
        while self.peek() == "|":
            self.i += 1
            self.space(True)
            alts.append(self.sequence(name, nested))
        return alts

    # ---- sequences -----------------------------------------------------------------

    def sequence(self, name: str, nested: bool) -> list[Element]:
        items: list[list[Element]] = []   # each item's elements (a literal has several)
        while True:
            c = self.peek()
            at = self.i
            if c == '"':
                self.i += 1
                items.append(self.literal())
            elif c == "[":
                self.i += 1
                items.append([Chars(self.char_class())])
            elif c == ".":
                self.i += 1
                items.append([Chars(_ANY)])
            elif c in ("<", "!"):
                raise self.error("token matches (<...>, !<...>) are not supported: this grammar "
                                 "works on characters")
            elif c and _word(c):
                ref = self.name()
                self.used_at.setdefault(ref, at)
                items.append([Ref(self.rule_id(ref))])
            elif c == "(":
                self.i += 1
                self.depth += 1
                if self.depth > MAX_NESTING:
                    raise self.error(f"groups nested more than {MAX_NESTING} deep")
                self.space(True)
                alts = self.alternates(name, nested=True)
                if self.peek() != ")":
                    raise self.error(f"expected ')' to close the group opened at "
                                     f"{self.where(at)}, found {self.found()}")
                self.i += 1
                self.depth -= 1
                items.append(alts[0] if len(alts) == 1 else [self.g.rule(alts, name + "-group")])
            elif c in "*+?{" and c:
                if not items:
                    raise self.error(f"{c!r} needs an item before it to repeat")
                self.i += 1
                lo, hi = {"*": (0, -1), "+": (1, -1), "?": (0, 1)}.get(c) or self.bounds(at)
                items[-1] = [self.repeat(items[-1], lo, hi, name)]
            else:
                break
            self.space(nested)
        return [e for item in items for e in item]

    def repeat(self, item: list[Element], lo: int, hi: int, name: str) -> Element:
        if len(item) == 1 and item[0].lo == item[0].hi == 1:
            e = item[0]
            return Chars(e.cls, lo, hi) if isinstance(e, Chars) else Ref(e.rule, lo, hi)
        rid = self.g.define(self.g.declare(name + "-repeat"), [item])
        return Ref(rid, lo, hi)

    def bounds(self, at: int) -> tuple[int, int]:
        """{m}, {m,} or {m,n} after the '{'. Returns: (lo, hi), hi -1 for unbounded."""
        self.space(True)
        lo = self.integer()
        self.space(True)
        hi = lo
        if self.peek() == ",":
            self.i += 1
            self.space(True)
            hi = self.integer() if self.peek().isdigit() else -1
            self.space(True)
        if self.peek() != "}":
            raise self.error(f"expected '}}' to close the repeat opened at {self.where(at)}, "
                             f"found {self.found()}")
        self.i += 1
        limit = self.g.limits.max_repeat
        if lo > limit or hi > limit:
            raise self.error(f"a repeat bound over {limit}", at)
        if hi >= 0 and lo > hi:
            raise self.error(f"a repeat of at least {lo} and at most {hi} times", at)
        return lo, hi

    def integer(self) -> int:
        start = self.i
        while self.peek().isascii() and self.peek().isdigit():
            self.i += 1
        if self.i == start:
            raise self.error(f"expected a number, found {self.found()}")
        if self.i - start > 9:
            raise self.error("a repeat bound too large", start)
        return int(self.s[start:self.i])

    # ---- characters ----------------------------------------------------------------

    def char(self) -> int:
        """One character of a literal or class, escapes decoded. Returns: its code point."""
        at = self.i
        c = self.peek()
        if not c:
            raise self.error("unexpected end of the grammar inside a literal or class")
        self.i += 1
        if c != "\\":
            return ord(c)
        e = self.peek()
        self.i += 1
        if e in _ESCAPES:
            return ord(_ESCAPES[e])
        if e in _HEX:
            digits = self.s[self.i:self.i + _HEX[e]]
            if len(digits) != _HEX[e] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"'\\{e}' needs {_HEX[e]} hex digits", at)
            self.i += _HEX[e]
            cp = int(digits, 16)
            if cp > MAX_CP:
                raise self.error(f"U+{cp:X} is beyond the last code point", at)
            if SURROGATES[0] <= cp <= SURROGATES[1]:
                raise self.error(f"U+{cp:X} is a surrogate, which UTF-8 cannot hold", at)
            return cp
        raise self.error(f"unknown escape '\\{e}'" if e else "unexpected end after '\\'", at)

    def literal(self) -> list[Element]:
        out = []
        while self.peek() != '"':
            if not self.peek():
                raise self.error("a literal is not closed (no '\"' before the end)")
            cp = self.char()
            out.append(Chars(((cp, cp),)))
        self.i += 1
        return out

    def char_class(self):
        at = self.i - 1
        neg = self.peek() == "^"
        if neg:
            self.i += 1
        spec = []
        while self.peek() != "]":
            if not self.peek():
                raise self.error(f"the class opened at {self.where(at)} is not closed")
            a = self.char()
            b = a
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                b = self.char()
                if b < a:
                    raise self.error(f"the range U+{a:X}-U+{b:X} runs backwards", at)
            spec.append((a, b))
        self.i += 1
        cls = ranges(spec)
        return negate(cls) if neg else cls


def parse_gbnf(text: str, limits: Limits | None = None) -> CompiledGrammar:
    """Parse a GBNF grammar (llama.cpp's notation) and compile it; ``root`` is what the whole
    text must match.

    Args:
        text: the grammar.
        limits: size bounds (rules, elements, repeat bounds); the defaults when None.
    Returns:
        the CompiledGrammar, for TokenConstraint or CompiledGrammar.matches.
    Raises:
        GrammarError: bad syntax (with its line and column), an undefined or twice-defined
            rule, no root, left recursion, token matches, or a grammar past the bounds.
    """
    if not isinstance(text, str):
        raise GrammarError("a GBNF grammar must be text")
    if len(text) > MAX_CHARS:
        raise GrammarError(f"the grammar is longer than {MAX_CHARS} characters")
    if not text.strip():
        raise GrammarError("the grammar is empty")
    return _Parser(text, limits).parse()
