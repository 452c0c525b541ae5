"""JSON as a grammar: whitespace, strings (plain characters and escapes, optionally counted),
numbers and integer ranges, literals, and any value nested to a bounded depth."""

from __future__ import annotations

import json
from functools import cached_property

from .grammar import (MAX_CP, Chars, Element, Grammar, GrammarError, Limits, Ref, char_trie,
                      contains, lit, ranges, subtract)

DIGIT = ((0x30, 0x39),)
NONZERO = ((0x31, 0x39),)
MINUS, ZERO = ((0x2D, 0x2D),), ((0x30, 0x30),)
HEX = ranges([(0x30, 0x39), (0x41, 0x46), (0x61, 0x66)])
# Characters a JSON string holds as themselves: anything but '"', '\' and controls.
PLAIN = ranges([(0x20, 0x21), (0x23, 0x5B), (0x5D, MAX_CP)])
SHORT_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
MAX_INT_DIGITS = 16   # integer part of an unbounded number, as llama.cpp's JSON grammar
MAX_FRAC_DIGITS = 20   # a float's shortest repr has at most 17
MAX_EXP_DIGITS = 2    # keeps every number finite as a float
MAX_INDENT = 32       # spaces or tabs after a newline between tokens


def encode_char(cp: int) -> list[str]:
    """Returns: the ways a JSON string writes code point cp that this grammar allows: itself
    when plain, else its short escape or \\u escape."""
    c = chr(cp)
    if c == '"' or c == "\\":
        return ["\\" + c]
    if cp < 0x20:
        short = {"\b": "b", "\f": "f", "\n": "n", "\r": "r", "\t": "t"}.get(c)
        return ["\\" + short] if short else [f"\\u{cp:04x}", f"\\u{cp:04X}"]
    return [c]


def digit_patterns(a: int, b: int) -> list[list[tuple[int, int]]]:
    """Returns: patterns (one digit range per position) whose strings are exactly the
    canonical decimal forms of a..b (0 <= a <= b)."""
    out = []
    for n in range(len(str(a)), len(str(b)) + 1):
        lo, hi = max(a, 10 ** (n - 1) if n > 1 else 0), min(b, 10 ** n - 1)
        if lo <= hi:
            out += _same_length(str(lo), str(hi))
    return out


def _same_length(lo: str, hi: str) -> list[list[tuple[int, int]]]:
    if not lo:
        return [[]]
    a, b = int(lo[0]), int(hi[0])
    if a == b:
        return [[(a, a)] + p for p in _same_length(lo[1:], hi[1:])]
    n = len(lo) - 1
    out = []
    if lo[1:] != "0" * n:
        out += [[(a, a)] + p for p in _same_length(lo[1:], "9" * n)]
        a += 1
    top = b if hi[1:] == "9" * n else b - 1
    if a <= top:
        out.append([(a, top)] + [(0, 9)] * n)
    if hi[1:] != "9" * n:
        out += [[(b, b)] + p for p in _same_length("0" * n, hi[1:])]
    return out


class JsonGrammar(Grammar):
    """A Grammar with JSON's building blocks, each rule made once on first use."""

    def __init__(self, limits: Limits | None = None, max_depth: int = 32):
        super().__init__(limits)
        self.max_depth = max_depth
        self._values: dict[int, Element] = {}

    # ---- lexical pieces ----------------------------------------------------------

    @cached_property
    def ws(self) -> Element:
        """Optional whitespace: nothing, one space, or a newline and an indent (bounded, so a
        model cannot loop on blank lines)."""
        return Ref(self.rule([[], lit(" "), lit("\n") + [Chars(((9, 9), (32, 32)), 0, MAX_INDENT)]],
                             "ws").rule)

    @cached_property
    def escape(self) -> Element:
        r"""A backslash escape: \" \\ \/ \b \f \n \r \t or \u with four hex digits (no surrogates,
        so every escape is one code point)."""
        not_d = ranges([(0x30, 0x39), (0x41, 0x43), (0x45, 0x46), (0x61, 0x63), (0x65, 0x66)])
        return self.rule([lit("\\") + [Chars(ranges(SHORT_ESCAPES))],
                          lit("\\u") + [Chars(not_d), Chars(HEX, 3, 3)],
                          lit("\\u") + [Chars(ranges("dD")), Chars(((0x30, 0x37),)), Chars(HEX, 2, 2)]],
                         "escape")

    @cached_property
    def char(self) -> Element:
        """One character of a string's content, plain or escaped."""
        return self.rule([[Chars(PLAIN)], [self.escape]], "char")

    @cached_property
    def string(self) -> Element:
        """Any JSON string. Plain runs are one repeated class (one stack while inside them)."""
        tail = self.declare("string-tail")
        run = Chars(PLAIN, 0, -1)
        self.define(tail, [lit('"'), [self.escape, run, Ref(tail)]])
        return self.rule([lit('"') + [run, Ref(tail)]], "string")

    def string_of_length(self, lo: int, hi: int) -> Element:
        """Returns: a string of lo..hi characters (hi = -1: no limit), as JSON counts them."""
        if lo == 0 and hi < 0:
            return self.string
        if hi >= 0 and lo > hi:
            raise GrammarError(f"minLength {lo} is greater than maxLength {hi}")
        return self.rule([lit('"') + [Ref(self.char.rule, lo, hi)] + lit('"')], "string")

    def key_except(self, names: list[str]) -> Element:
        """Returns: a string of plain characters (no escapes, so it reads as written) that is
        none of ``names``: a trie of the names where each step may also leave it."""
        trie = char_trie(n for n in names if all(contains(PLAIN, ord(c)) for c in n))
        run, close = Chars(PLAIN, 0, -1), lit('"')

        def alts(node: dict, done: dict) -> list[list[Element]]:
            kids = sorted(k for k in node if k is not None)
            out = [] if None in node else [close]
            others = subtract(PLAIN, ranges(kids))
            if others:
                out.append([Chars(others), run] + close)
            return out + [lit(c) + done[id(node[c])] for c in kids]
        return self.rule([lit('"') + self.trie_rules(trie, alts, "key")], "key")

    def literal_values(self, values: list) -> Element:
        """Returns: exactly these JSON values, each in its compact serialization."""
        texts = sorted({json.dumps(v, ensure_ascii=False) for v in values})
        return self.choice([self.literal_set(texts, "enum")])

    # ---- numbers -----------------------------------------------------------------

    @cached_property
    def number(self) -> Element:
        """Any JSON number, with at most 16 integer and 20 fraction digits and a 2-digit exponent."""
        exp = self.seq([Chars(ranges("eE")), Chars(ranges("+-"), 0, 1), Chars(DIGIT, 1, MAX_EXP_DIGITS)],
                       0, 1, "exponent")
        return self.rule([[Chars(MINUS, 0, 1), self.natural, self.fraction, exp]],
                         "number")

    @cached_property
    def natural(self) -> Element:
        return self.rule([lit("0"), [Chars(NONZERO), Chars(DIGIT, 0, MAX_INT_DIGITS - 1)]], "natural")

    @cached_property
    def fraction(self) -> Element:
        """An optional fraction part."""
        return self.seq(lit(".") + [Chars(DIGIT, 1, MAX_FRAC_DIGITS)], 0, 1, "fraction")

    @cached_property
    def integer(self) -> Element:
        return self.rule([[Chars(MINUS, 0, 1), self.natural]], "integer")

    def natural_range(self, a: int, b: int) -> list[list[Element]]:
        """Returns: alternatives matching the canonical decimal forms of a..b (0 <= a <= b)."""
        alts = []
        for pat in digit_patterns(a, b):
            seq: list[Element] = []
            for lo, hi in pat:
                cls = ((0x30 + lo, 0x30 + hi),)
                if seq and seq[-1].cls == cls and cls == DIGIT:
                    seq[-1] = Chars(cls, seq[-1].lo + 1, seq[-1].hi + 1)
                else:
                    seq.append(Chars(cls))
            alts.append(seq)
        return alts

    def integer_range(self, lo: int | None, hi: int | None) -> Element:
        """Returns: integers in [lo, hi] (None: unbounded, up to 16 digits), written canonically."""
        cap = 10 ** MAX_INT_DIGITS - 1
        lo = -cap if lo is None else lo
        hi = cap if hi is None else hi
        if lo > hi:
            raise GrammarError(f"no integer lies between {lo} and {hi}")
        alts = []
        if hi >= 0:
            alts += self.natural_range(max(lo, 0), hi)
        if lo < 0:
            alts += [lit("-") + a for a in self.natural_range(max(1, -hi), -lo)]
        return self.choice(alts, "integer-range")

    def number_range(self, lo: int | None, lo_excl: bool, hi: int | None, hi_excl: bool) -> Element:
        """Returns: numbers x with lo <= x <= hi (strict where *_excl), for integer bounds;
        written without an exponent."""
        alts = []
        if hi is None or hi > 0 or (hi == 0 and not hi_excl):
            low, low_excl = (0, False) if lo is None or lo < 0 else (lo, lo_excl)
            alts += self._unsigned_range(low, low_excl, hi, hi_excl)
        if lo is None or lo < 0:
            # x = -y with y > 0: -hi <= y <= -lo
            low, low_excl = (0, True) if hi is None or hi >= 0 else (-hi, hi_excl)
            alts += [lit("-") + a for a in self._unsigned_range(low, low_excl,
                                                               None if lo is None else -lo, lo_excl)]
        if not alts:
            raise GrammarError(f"no number lies between {lo} and {hi}")
        return self.choice(alts, "number-range")

    def _unsigned_range(self, lo: int, lo_excl: bool, hi: int | None,
                        hi_excl: bool) -> list[list[Element]]:
        """Alternatives for unsigned decimals I[.F] with lo <(=) value <(=) hi."""
        cap = 10 ** MAX_INT_DIGITS - 1
        top = cap if hi is None else hi
        nonzero = lit(".") + [Chars(ZERO, 0, MAX_FRAC_DIGITS - 1), Chars(NONZERO),
                              Chars(DIGIT, 0, MAX_FRAC_DIGITS - 1)]
        zero = [self.seq(lit(".") + [Chars(ZERO, 1, MAX_FRAC_DIGITS)], 0, 1)]
        alts: list[list[Element]] = []
        start = lo + 1 if lo_excl else lo
        if lo_excl and lo < top:
            alts += [a + nonzero for a in self.natural_range(lo, lo)]
        end = top - 1 if hi is not None else top
        if start <= end:
            alts += [a + [self.fraction] for a in self.natural_range(start, end)]
        if hi is not None and not hi_excl and (hi > lo or (hi == lo and not lo_excl)):
            alts += [a + zero for a in self.natural_range(hi, hi)]
        return alts

    # ---- values ------------------------------------------------------------------

    @cached_property
    def scalar(self) -> list[list[Element]]:
        return [[self.string], [self.number], lit("true"), lit("false"), lit("null")]

    def value(self, depth: int = 0) -> Element:
        """Returns: any JSON value whose objects and arrays nest at most max_depth - depth deep."""
        if depth in self._values:
            return self._values[depth]
        alts = list(self.scalar)
        if depth < self.max_depth:
            inner = self.value(depth + 1)
            alts.append([self.object_of(self.member([self.string], inner))])
            alts.append([self.array_of([inner])])
        v = self._values[depth] = self.rule(alts, f"value{depth}")
        return v

    def member(self, key: list[Element], value: Element) -> list[Element]:
        """Returns: the elements of one object member: key, colon, value."""
        return key + [self.ws] + lit(":") + [self.ws, value]

    def object_of(self, member: list[Element]) -> Element:
        """Returns: '{' members '}' with any number of ``member``, separated by commas."""
        sep = [self.ws] + lit(",") + [self.ws]
        more = self.seq(sep + member, 0, -1, "members")
        return self.rule([lit("{") + [self.ws] + lit("}"),
                          lit("{") + [self.ws] + member + [more, self.ws] + lit("}")], "object")

    def array_of(self, item: list[Element], lo: int = 0, hi: int = -1) -> Element:
        """Returns: '[' items ']' with lo..hi of ``item`` (hi = -1: no limit)."""
        if hi >= 0 and lo > hi:
            raise GrammarError(f"minItems {lo} is greater than maxItems {hi}")
        sep = [self.ws] + lit(",") + [self.ws]
        alts = []
        if lo == 0:
            alts.append(lit("[") + [self.ws] + lit("]"))
        if hi != 0:
            more = self.seq(sep + item, max(lo - 1, 0), hi - 1 if hi > 0 else -1, "items")
            alts.append(lit("[") + [self.ws] + item + [more, self.ws] + lit("]"))
        return self.rule(alts, "array")
