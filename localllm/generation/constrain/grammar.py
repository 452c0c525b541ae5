"""A character-level grammar: rules of alternatives over code-point classes, rule calls and
counted repeats; its checks (productive rules, no left recursion, size bounds) and the
arrays the byte walker in kernels/grammar.py runs on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence, Union

import numpy as np

from localllm.errors import GrammarError
from localllm.kernels import grammar as kg

MAX_CP = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)


# ----------------------------------------------------------------------------- classes

Ranges = tuple[tuple[int, int], ...]


def ranges(spec: Iterable[tuple[int, int] | int | str]) -> Ranges:
    """Normalize code point ranges: sorted, merged, surrogates removed (UTF-8 cannot hold them).

    Args:
        spec: (lo, hi) pairs, single code points, or one-character strings.
    Returns:
        a tuple of disjoint (lo, hi) pairs.
    """
    items = []
    for x in spec:
        if isinstance(x, str):
            x = (ord(x), ord(x))
        elif isinstance(x, int):
            x = (x, x)
        lo, hi = x
        for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), min(hi, MAX_CP))):
            if a <= b:
                items.append((a, b))
    items.sort()
    out: list[list[int]] = []
    for a, b in items:
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def negate(r: Ranges) -> Ranges:
    """Returns: every code point not in r."""
    out, at = [], 0
    for a, b in r:
        if a > at:
            out.append((at, a - 1))
        at = b + 1
    if at <= MAX_CP:
        out.append((at, MAX_CP))
    return ranges(out)


def subtract(r: Ranges, s: Ranges) -> Ranges:
    """Returns: code points in r and not in s."""
    return intersect(r, negate(s))


def intersect(r: Ranges, s: Ranges) -> Ranges:
    """Returns: code points in both."""
    out, i, j = [], 0, 0
    while i < len(r) and j < len(s):
        a, b = max(r[i][0], s[j][0]), min(r[i][1], s[j][1])
        if a <= b:
            out.append((a, b))
        if r[i][1] < s[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def contains(r: Ranges, cp: int) -> bool:
    return any(a <= cp <= b for a, b in r)


# ----------------------------------------------------------------------------- elements

@dataclass(frozen=True)
class Chars:
    """One code point of a class, repeated lo..hi times (hi = -1: unbounded)."""
    cls: Ranges
    lo: int = 1
    hi: int = 1


@dataclass(frozen=True)
class Ref:
    """A call of rule ``rule``, repeated lo..hi times (hi = -1: unbounded)."""
    rule: int
    lo: int = 1
    hi: int = 1


Element = Union[Chars, Ref]
Alt = list  # a sequence of Elements


def char_trie(texts: Iterable[str]) -> dict:
    """Returns: nested dicts by character; key None marks where a text ends."""
    trie: dict = {}
    for t in texts:
        node = trie
        for c in t:
            node = node.setdefault(c, {})
        node[None] = True
    return trie


def lit(text: str) -> list[Element]:
    """Returns: the elements matching exactly ``text``."""
    return [Chars(((ord(c), ord(c)),)) for c in text]


@dataclass
class Limits:
    """Bounds that keep a hostile grammar (or schema) from exhausting memory or time."""
    max_elements: int = 200_000      # elements over all alternatives
    max_rules: int = 50_000
    max_repeat: int = 1_000_000      # a counted repeat's bound


class Grammar:
    """Rules under construction. Each rule is a list of alternatives; each alternative a list of
    elements (Chars, Ref). Rules may be declared first and defined later, for recursion."""

    # Said after "X refers to itself without consuming input" (what such a cycle means here).
    cycle_hint = " (a $ref cycle that does not nest inside an object or array)"
    subject = "the schema"   # what "no finite value can satisfy ..." names

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits()
        self.alts: list[list[Alt] | None] = []
        self.names: list[str] = []
        self.size = 0

    def declare(self, name: str = "") -> int:
        """Returns: the id of a new, not yet defined rule."""
        if len(self.alts) >= self.limits.max_rules:
            raise GrammarError(f"the grammar needs more than {self.limits.max_rules} rules")
        self.alts.append(None)
        self.names.append(name)
        return len(self.alts) - 1

    def define(self, rid: int, alts: Sequence[Sequence[Element]]) -> int:
        """Sets the alternatives of a declared rule. Returns: rid."""
        if self.alts[rid] is not None:
            raise GrammarError(f"rule {self.names[rid] or rid} defined twice")
        clean = []
        for a in alts:
            a = list(a)
            for e in a:
                for bound in (e.lo, e.hi):
                    if bound > self.limits.max_repeat:
                        raise GrammarError(f"a repeat bound of {bound} exceeds {self.limits.max_repeat}")
                if e.hi >= 0 and e.lo > e.hi:
                    raise GrammarError(f"a repeat of at least {e.lo} and at most {e.hi}")
            self.size += len(a) + 1
            clean.append(a)
        if self.size > self.limits.max_elements:
            raise GrammarError(f"the grammar is too large (more than {self.limits.max_elements} "
                               "elements); simplify the schema")
        self.alts[rid] = clean
        return rid

    def rule(self, alts: Sequence[Sequence[Element]], name: str = "") -> Ref:
        """Defines a new rule. Returns: a Ref calling it once."""
        return Ref(self.define(self.declare(name), alts))

    def seq(self, elements: Sequence[Element], lo: int = 1, hi: int = 1, name: str = "") -> Element:
        """Returns: one element matching ``elements`` in sequence, lo..hi times."""
        if lo == hi == 1 and len(elements) == 1:
            return elements[0]
        if len(elements) == 1 and isinstance(elements[0], Chars) and elements[0].lo == elements[0].hi == 1:
            return Chars(elements[0].cls, lo, hi)
        r = self.rule([elements], name)
        return Ref(r.rule, lo, hi)

    def choice(self, alts: Sequence[Sequence[Element]], name: str = "") -> Element:
        """Returns: one element matching any of the alternatives (itself when only one)."""
        if len(alts) == 1 and len(alts[0]) == 1:
            return alts[0][0]
        return self.rule(alts, name)

    def literal_set(self, texts: Iterable[str], name: str = "") -> list[Element]:
        """Returns: elements matching exactly one of ``texts``, as a character trie so that
        shared prefixes are one path (deterministic: one stack while matching)."""
        texts = list(texts)
        if sum(map(len, texts)) > self.limits.max_elements:
            raise GrammarError(f"the grammar is too large (literals of more than "
                               f"{self.limits.max_elements} characters); simplify the schema")
        trie = char_trie(texts)
        if not trie:
            raise GrammarError("an empty set of literals")

        def alts(node: dict, done: dict) -> list[Alt]:
            return ([[]] if None in node else []) + [
                lit(c) + done[id(child)] for c, child in sorted(
                    (k, v) for k, v in node.items() if k is not None)]
        return self.trie_rules(trie, alts, name)

    def trie_rules(self, trie: dict, alts, name: str = "") -> list[Element]:
        """Builds a character trie bottom up, without recursion (literals may be long).

        Args:
            trie: nested dicts by character; key None marks the end of a text.
            alts: alts(node, done) -> the node's alternatives, given done[id(child)], the
                elements of each child.
        Returns:
            the root's elements: its one alternative inline, or a call of a rule.
        """
        done: dict[int, list[Element]] = {}
        stack = [(trie, False)]
        while stack:
            node, ready = stack.pop()
            if not ready:
                stack.append((node, True))
                stack.extend((child, False) for k, child in node.items() if k is not None)
                continue
            a = alts(node, done)
            done[id(node)] = a[0] if len(a) == 1 else [self.rule(a, name)]
        return done[id(trie)]

    # ------------------------------------------------------------------ compile

    def compile(self, root: Element) -> "CompiledGrammar":
        """Checks the grammar and lays it out for the walker.

        Args:
            root: what a complete text must match.
        Returns:
            the CompiledGrammar.
        Raises:
            GrammarError: nothing finite matches, left recursion, or a rule never defined.
        """
        start = self.declare("start")
        self.alts[start] = [[root]]
        for i, a in enumerate(self.alts):
            if a is None:
                raise GrammarError(f"rule {self.names[i] or i} is used but never defined")
        alts = _prune(self.alts, _productive(self.alts))
        if not alts[start]:
            raise GrammarError(f"no finite value can satisfy {self.subject}")
        _check_left_recursion(alts, self.names, self.cycle_hint)
        return CompiledGrammar(_layout(alts, start))


def _nullable(alts: list[list[Alt]]) -> list[bool]:
    null = [False] * len(alts)
    changed = True
    while changed:
        changed = False
        for r, rule in enumerate(alts):
            if not null[r] and any(all(_elem_nullable(e, null) for e in a) for a in rule):
                null[r] = changed = True
    return null


def _elem_nullable(e: Element, null: list[bool]) -> bool:
    if e.lo == 0:
        return True
    return isinstance(e, Ref) and null[e.rule]


def _productive(alts: list[list[Alt]]) -> list[bool]:
    """Returns: per rule, whether some finite text matches it."""
    prod = [False] * len(alts)

    def ok(e: Element) -> bool:
        if e.lo == 0:
            return True
        return bool(e.cls) if isinstance(e, Chars) else prod[e.rule]
    changed = True
    while changed:
        changed = False
        for r, rule in enumerate(alts):
            if not prod[r] and any(all(ok(e) for e in a) for a in rule):
                prod[r] = changed = True
    return prod


def _prune(alts: list[list[Alt]], prod: list[bool]) -> list[list[Alt]]:
    """Drops alternatives that need an unproductive rule, and repeats of one that may be skipped."""
    out = []
    for rule in alts:
        keep = []
        for a in rule:
            dead = False
            new = []
            for e in a:
                empty = (not e.cls) if isinstance(e, Chars) else not prod[e.rule]
                if not empty:
                    new.append(e)
                elif e.lo > 0:
                    dead = True
                    break
            if not dead:
                keep.append(new)
        out.append(keep)
    return out


def _check_left_recursion(alts: list[list[Alt]], names: list[str], hint: str) -> None:
    """Raises GrammarError when a rule can call itself before consuming a character (the
    walker's closure would never end), e.g. a schema whose $ref leads back to itself."""
    null = _nullable(alts)
    first: list[set[int]] = []
    for rule in alts:
        calls = set()
        for a in rule:
            for e in a:
                if isinstance(e, Ref) and e.hi != 0:
                    calls.add(e.rule)
                if not _elem_nullable(e, null):
                    break
        first.append(calls)
    state = [0] * len(alts)  # 0 new, 1 on the path, 2 done
    for r0 in range(len(alts)):
        if state[r0]:
            continue
        stack = [(r0, iter(first[r0]))]
        state[r0] = 1
        while stack:
            r, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[r] = 2
                stack.pop()
            elif state[nxt] == 1:
                name = names[nxt] or f"rule {nxt}"
                raise GrammarError(f"{name} refers to itself without consuming input{hint}")
            elif state[nxt] == 0:
                state[nxt] = 1
                stack.append((nxt, iter(first[nxt])))


@dataclass
class CompiledGrammar:
    """A grammar laid out for the walker; element 0 calls the root and element 1 ends."""
    tables: kg.Tables

    @property
    def n_elements(self) -> int:
        return int(self.tables.elem.shape[0])

    def matches(self, text: str, complete: bool = True) -> bool:
        """Whether ``text`` matches the grammar, walking its UTF-8 bytes as constraints do.

        Args:
            text: the text to check.
            complete: True: the whole text must be a finished match; False: a prefix of one.
        Returns:
            the answer.
        """
        data = np.frombuffer(text.encode("utf-8"), np.uint8)
        st = kg.new_store()
        while (s := kg.start(self.tables, st)) == -1:
            st = kg.grow_store(st)
        lvl = kg.new_levels(data.size)
        lvl[0] = (s, 0, 0, 0)
        while (r := kg.walk_bytes(self.tables, st, lvl, data)) == -1:
            st = kg.grow_store(st)
        if r != 1:
            return False
        s, _, need, _ = (int(x) for x in lvl[data.size])
        return not complete or bool(need == 0 and st.set_buf[st.set_off[s]] == kg.ACCEPT)


def _layout(alts: list[list[Alt]], start: int) -> kg.Tables:
    kind, arg, lo, hi = [kg.REF, kg.END], [start, 0], [1, 0], [1, 0]
    classes: dict[Ranges, int] = {}
    alt_off, alt_pos = [0], []
    for rule in alts:
        for a in rule:
            alt_pos.append(len(kind))
            for e in a:
                if isinstance(e, Chars):
                    c = classes.setdefault(e.cls, len(classes))
                    kind.append(kg.CLS)
                    arg.append(c)
                else:
                    kind.append(kg.REF if e.lo == e.hi == 1 else kg.REP)
                    arg.append(e.rule)
                lo.append(e.lo)
                hi.append(e.hi)
            kind.append(kg.END)
            arg.append(0)
            lo.append(0)
            hi.append(0)
        alt_off.append(len(alt_pos))
    cls_off, cls_rng = [0], []
    ascii_tab = np.zeros((max(len(classes), 1), 128), np.uint8)
    for r, c in classes.items():
        for a, b in r:
            cls_rng.append((a, b))
            if a < 128:
                ascii_tab[c, a:min(b, 127) + 1] = 1
        cls_off.append(len(cls_rng))
    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    elem = np.stack([i32(kind), i32(arg), i32(lo), i32(hi)], axis=1)
    return kg.Tables(np.ascontiguousarray(elem), i32(alt_off), i32(alt_pos), i32(cls_off),
                     i32(cls_rng).reshape(-1, 2), ascii_tab)
