"""Limits on rendering an untrusted chat template inside jinja2's sandbox: a time limit, caps
on the size of what it builds and outputs, and refusal, before they run, of the operations
that multiply sizes (long ranges, repetition, padding widths, huge powers)."""

from __future__ import annotations

import functools
import re
import string
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import jinja2
import jinja2.sandbox
from jinja2 import nodes
from jinja2.runtime import LoopContext
from jinja2.visitor import NodeTransformer


@dataclass(frozen=True)
class RenderLimits:
    """What one rendering may cost.

    Attributes:
        seconds: wall time for the whole rendering.
        max_chars: characters in any one string it builds or prints (a list counts its
            items plus the characters of the strings inside it), and in its output.
        max_total: characters built over the whole rendering, all strings together (so
            many strings each under max_chars cannot add up to any size).
        max_range: items in one range().
    """
    seconds: float = 5.0
    max_chars: int = 8 << 20
    max_total: int = 256 << 20
    max_range: int = 100_000


class LimitExceeded(Exception):
    """A rendering went past one of its RenderLimits."""


# Largest integer a template may build with * or ** (bits): far more than any real
# arithmetic, far less than the sizes whose computation alone takes seconds.
MAX_INT_BITS = 1 << 16
_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?.")
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[+\- ]?z?#?0?(\d*)[,_]?(?:\.(\d+))?[a-zA-Z%]?")
# Filters that return parts of their input rather than text made from it.
_STRUCTURAL_FILTERS = frozenset((
    "abs", "attr", "batch", "count", "d", "default", "dictsort", "first", "float", "groupby",
    "int", "items", "last", "length", "list", "map", "max", "min", "random", "reject",
    "rejectattr", "reverse", "round", "select", "selectattr", "slice", "sort", "sum", "unique"))


def _weight(value: Any, stop: int) -> int:
    """Characters `str(value)` would hold at least: strings count their length, every
    item of a list, tuple or dict one more. Stops counting past `stop`."""
    total, stack = 0, [value]
    while stack and total <= stop:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (list, tuple)):
            total += len(v)
            stack.extend(v)
        elif isinstance(v, dict):
            total += len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        else:
            total += 1
    return total


def _percent_width(fmt: str) -> int:
    """The padding a %-format asks for; refuses widths taken from the arguments."""
    total = 0
    for m in _PERCENT_SPEC.finditer(fmt):
        if "*" in (m.group(1) or "") + (m.group(2) or ""):
            raise LimitExceeded("a %-format with '*' widths is refused")
        total += int(m.group(1) or 0) + int(m.group(2) or 0)
    return total


def _format_width(fmt: str) -> int:
    """The padding a str.format string asks for; refuses nested replacement fields."""
    total = 0
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return 0  # the call itself raises
    for _, _, spec, _ in fields:
        if spec and "{" in spec:
            raise LimitExceeded("a format spec with nested fields is refused")
        m = _FORMAT_SPEC.fullmatch(spec or "")
        if m:
            total += int(m.group(1) or 0) + int(m.group(2) or 0)
    return total


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _num(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _replace_size(s: Any, old: Any, new: Any, count: Any) -> int:
    s, old, new = str(s), str(old), str(new)
    hits = s.count(old) if old else len(s) + 1
    if _num(count) > 0:
        hits = min(hits, count)
    return len(s) + max(0, len(new) - len(old)) * hits


def _indent_size(s: Any, width: Any) -> int:
    s = str(s)
    return len(s) + (s.count("\n") + 1) * (len(width) if isinstance(width, str) else _num(width))


def _wrap_size(s: Any, width: Any, wrapstring: Any) -> int:
    s = str(s)
    lines = len(s) // max(1, _num(width)) + s.count("\n") + 1
    return len(s) + lines * len(str(wrapstring or "\n"))


# Filters whose result can be far larger than their input: name -> the size they would
# build, from their arguments (after any context argument).
_FILTER_SIZES: dict[str, Callable[[tuple, dict], int]] = {
    "center": lambda a, k: _num(_arg(a, k, 1, "width", 80)),
    "indent": lambda a, k: _indent_size(a[0], _arg(a, k, 1, "width", 4)),
    "format": lambda a, k: len(str(a[0])) + _percent_width(str(a[0])),
    "replace": lambda a, k: _replace_size(a[0], a[1], a[2], _arg(a, k, 3, "count")),
    "wordwrap": lambda a, k: _wrap_size(a[0], _arg(a, k, 1, "width", 79),
                                        _arg(a, k, 3, "wrapstring")),
    "batch": lambda a, k: _num(_arg(a, k, 1, "linecount")),
    "slice": lambda a, k: _num(_arg(a, k, 1, "slices")),
    "tojson": lambda a, k: 256 * _num(_arg(a, k, 2, "indent", 0)),
}
# The same for methods of strings: name -> size, from (the string, args, kwargs).
_STR_METHOD_SIZES: dict[str, Callable[[str, tuple, dict], int]] = {
    "center": lambda s, a, k: _num(_arg(a, k, 0, "width")),
    "ljust": lambda s, a, k: _num(_arg(a, k, 0, "width")),
    "rjust": lambda s, a, k: _num(_arg(a, k, 0, "width")),
    "zfill": lambda s, a, k: _num(_arg(a, k, 0, "width")),
    "expandtabs": lambda s, a, k: len(s) + s.count("\t") * _num(_arg(a, k, 0, "tabsize", 8)),
    "replace": lambda s, a, k: _replace_size(s, a[0], a[1], _arg(a, k, 2, "count")),
    "format": lambda s, a, k: len(s) + _format_width(s),
    "format_map": lambda s, a, k: len(s) + _format_width(s),
}


class _Budget:
    """The limits of one rendering as it runs."""

    def __init__(self, limits: RenderLimits):
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.total = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise LimitExceeded(f"rendering took longer than {self.limits.seconds:g} s")

    def allow(self, n: int, what: str) -> None:
        """Refuses, before it is built, something of `n` characters or items."""
        if n > self.limits.max_chars:
            raise LimitExceeded(f"{what} would hold more than {self.limits.max_chars} "
                                f"characters (asked: {n})")

    def allow_str(self, values: Any, what: str) -> None:
        """Refuses to turn `values` into text when that text would be past the limit."""
        self.allow(_weight(values, self.limits.max_chars), what)

    def built(self, value: Any, what: str) -> None:
        """Counts something just built against the limits."""
        if isinstance(value, (str, list, tuple)):
            self.allow(len(value), what)
            self.total += len(value)
            if self.total > self.limits.max_total:
                raise LimitExceeded(f"the template built more than {self.limits.max_total} "
                                    "characters in all")


class _Guards(NodeTransformer):
    """Routes every for-loop's items and every `~` through the environment's guards."""

    def __init__(self, env: jinja2.Environment):
        self.env = env

    def _call(self, attr: str, arg: nodes.Expr, like: nodes.Node) -> nodes.Call:
        call = nodes.Call(nodes.EnvironmentAttribute(attr), [arg], [], None, None)
        call.set_lineno(like.lineno)
        call.set_environment(self.env)
        return call

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = self._call("guard_iter", node.iter, node)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        self.generic_visit(node)
        return self._call("guard_concat", nodes.Tuple(node.nodes, "load"), node)


class GuardedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with RenderLimits enforced.

    Every loop step, call, filter, printed value, `*`, `**`, `+`, `%` and `~` checks the
    time; those that can multiply a size check the size before they run. `lipsum` (a text
    generator) is removed, and reaching an unsafe attribute raises at once. Templates must
    be compiled with compile_template().
    """

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, limits: RenderLimits, **options: Any):
        super().__init__(finalize=self._finalize, **options)
        self.limits = limits
        self._local = threading.local()  # one budget per rendering thread
        self.globals["range"] = self._range
        self.globals.pop("lipsum", None)
        self.concat = self._join  # the buffers of macros, blocks and {% set %}...{% endset %}

    # list methods templates use on lists of their own (Kimi K2's queue of call ids); the
    # render's inputs are copies, each call checks the budget, and growth is one item a call
    LIST_METHODS = frozenset({"append", "pop"})

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if isinstance(obj, list) and attr in self.LIST_METHODS:
            return jinja2.sandbox.SandboxedEnvironment.is_safe_attribute(self, obj, attr, value)
        return super().is_safe_attribute(obj, attr, value)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # jinja hands back an Undefined that prints as ""; an attack is stopped with a
        # clear error instead (real templates never reach Python internals).
        raise jinja2.sandbox.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def guard_filters(self) -> None:
        """Wraps the filters registered so far (call once all of them are registered)."""
        for name, func in list(self.filters.items()):
            self.filters[name] = self._guarded_filter(name, func)

    def compile_template(self, source: str) -> jinja2.Template:
        """Compiles `source` with every loop and `~` routed through the guards."""
        return self.from_string(_Guards(self).visit(self.parse(source)))

    @contextmanager
    def rendering(self) -> Iterator[_Budget]:
        """A fresh budget for one rendering on this thread."""
        budget = self._local.budget = _Budget(self.limits)
        try:
            yield budget
        finally:
            self._local.budget = None

    @property
    def budget(self) -> _Budget:
        budget = getattr(self._local, "budget", None)
        # Outside rendering() (jinja folds constants at compile time) each check stands alone.
        return budget if budget is not None else _Budget(self.limits)

    # ---- the guards ----------------------------------------------------------------

    def guard_iter(self, iterable: Any) -> Iterator[Any]:
        budget = self.budget
        for item in iterable:
            budget.tick()
            yield item

    def guard_concat(self, items: tuple) -> str:
        self.budget.allow_str(items, "a '~' concatenation")
        return self._join([str(x) for x in items], "a '~' concatenation")

    def _join(self, parts: Any, what: str = "a block") -> str:
        parts = list(parts)
        budget = self.budget
        budget.tick()
        budget.allow(sum(len(p) for p in parts), what)
        out = "".join(parts)
        budget.built(out, what)
        return out

    def _finalize(self, value: Any) -> Any:
        # Every {{ expression }} passes here before str() turns it into output.
        budget = self.budget
        budget.tick()
        budget.allow_str(value, "a printed value")
        return value

    def _range(self, *args: int) -> range:
        r = range(*args)
        if len(r) > self.limits.max_range:
            raise LimitExceeded(f"range() of {len(r)} items is refused (the limit is "
                                f"{self.limits.max_range})")
        return r

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = self.budget
        budget.tick()
        seq = (str, list, tuple)
        if operator == "*":
            if isinstance(left, int) and isinstance(right, seq):
                left, right = right, left
            if isinstance(left, seq) and isinstance(right, int):
                budget.allow(_weight(left, budget.limits.max_chars) * max(right, 0),
                             "a repetition")
            elif _num(left) and _num(right):
                if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                    raise LimitExceeded(f"an integer of more than {MAX_INT_BITS} bits is refused")
            out = left * right
        elif operator == "**":
            if _num(left) and _num(right) > 0 and abs(left) > 1 \
                    and right * abs(left).bit_length() > MAX_INT_BITS:
                raise LimitExceeded(f"an integer of more than {MAX_INT_BITS} bits is refused")
            out = left ** right
        elif operator == "+":
            if isinstance(left, seq) and isinstance(right, seq):
                budget.allow(len(left) + len(right), "a concatenation")
            out = left + right
        else:  # "%"
            if isinstance(left, str):
                budget.allow(len(left) + _percent_width(left), "a %-format")
                budget.allow_str(right, "a %-format's arguments")
            out = left % right
        budget.built(out, f"the result of {operator!r}")
        return out

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = __self.budget
        budget.tick()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level
            args = (__self.guard_iter(args[0]),) + args[1:]
        method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        owner = getattr(method, "__self__", None)
        name = getattr(method, "__name__", "")
        if isinstance(owner, str):
            size = _STR_METHOD_SIZES.get(name)
            if size is not None:
                budget.allow(size(owner, args, kwargs), f"str.{name}()")
            if name in ("format", "format_map"):
                budget.allow_str((args, kwargs), f"str.{name}()'s arguments")
            elif name == "join" and args:  # the items may be a generator
                items = list(args[0])
                budget.allow(_weight(items, budget.limits.max_chars)
                             + len(owner) * len(items), "str.join()")
                args = (items,) + args[1:]
        out = super().call(__context, __obj, *args, **kwargs)
        budget.built(out, "a call's result")
        return out

    def _guarded_filter(self, name: str, func: Callable) -> Callable:
        skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
        size = _FILTER_SIZES.get(name)
        makes_text = name not in _STRUCTURAL_FILTERS

        @functools.wraps(func)  # keeps jinja_pass_arg, so jinja still passes the context
        def guarded(*args: Any, **kwargs: Any) -> Any:
            budget = self.budget
            budget.tick()
            if len(args) > skip:
                value = args[skip]
                if name == "join":  # the items may be a generator
                    value = list(value)
                    args = args[:skip] + (value,) + args[skip + 1:]
                    sep = str(_arg(args[skip + 1:], kwargs, 0, "d", ""))
                    budget.allow(len(sep) * len(value), "the join filter")
                if makes_text:
                    budget.allow_str(value, f"the {name} filter")
                if size is not None:
                    budget.allow(size(args[skip:], kwargs), f"the {name} filter")
            out = func(*args, **kwargs)
            budget.built(out, f"the {name} filter")
            return out

        return guarded
