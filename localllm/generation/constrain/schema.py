"""JSON Schema compiled to a grammar whose every complete text is valid under the schema.

Supported: type (one or a list), enum, const, properties / required / additionalProperties
(false, true or a schema), items, prefixItems, minItems / maxItems, minLength / maxLength,
pattern, format (date, time, date-time, uuid, email, ipv4), integer bounds, number bounds
with integer values, anyOf, oneOf (alternatives must be disjoint), allOf of mergeable
schemas, $ref into the same document ($defs, definitions, any JSON pointer) with recursion.
Any other keyword is an error naming it, never ignored. Objects keep the schema's property
order; an object that declares properties gets no undeclared ones unless
additionalProperties is a schema.
"""

from __future__ import annotations

import json
import math
from urllib.parse import unquote

from .grammar import Chars, CompiledGrammar, Element, GrammarError, Limits, lit
from .json_grammar import JsonGrammar
from .regex import pattern_element

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
ANNOTATIONS = frozenset(("title", "description", "default", "examples", "$comment", "$schema",
                         "$id", "deprecated", "readOnly", "writeOnly", "discriminator",
                         "$defs", "definitions"))
BY_TYPE = {
    "object": frozenset(("properties", "required", "additionalProperties")),
    "array": frozenset(("items", "prefixItems", "minItems", "maxItems", "uniqueItems",
                        "additionalItems")),
    "string": frozenset(("minLength", "maxLength", "pattern", "format")),
    "number": frozenset(("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")),
}
COMBINING = frozenset(("type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref"))
KNOWN = ANNOTATIONS | COMBINING | frozenset().union(*BY_TYPE.values())
MAX_SCHEMA_NODES = 10_000   # schema objects visited while compiling
MAX_NESTING = 200           # schemas being compiled inside one another

_DATE = (r"\d{4}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)"
         r"|02-(?:0[1-9]|1\d|2[0-8]))")
_TIME = r"(?:[01]\d|2[0-3]):[0-5]\d:[0-5]\d(?:\.\d{1,6})?(?:Z|[+-](?:[01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
FORMATS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "uuid": r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    "email": r"^[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63})*\.[A-Za-z]{2,24}$",
    "ipv4": rf"^{_OCTET}(?:\.{_OCTET}){{3}}$",
}


def compile_schema(schema, limits: Limits | None = None, max_depth: int = 32) -> CompiledGrammar:
    """Compile a JSON Schema.

    Args:
        schema: the schema (a dict, or True for any value).
        limits: size bounds for the grammar (defaults: grammar.Limits()).
        max_depth: how deep objects and arrays may nest in a generated value; a recursive
            schema is unrolled that far.
    Returns:
        the CompiledGrammar of one JSON value, no surrounding whitespace.
    Raises:
        GrammarError: an unsupported keyword or form (named), a bad schema, or one too large.
    """
    return _Compiler(schema, limits, max_depth).compile()


def json_type_of(v) -> set[str]:
    """Returns: the JSON Schema types a Python JSON value has."""
    if v is None:
        return {"null"}
    if isinstance(v, bool):
        return {"boolean"}
    if isinstance(v, int):
        return {"integer", "number"}
    if isinstance(v, float):
        if not math.isfinite(v):
            raise GrammarError(f"{v} is not a JSON number")
        return {"integer", "number"} if v.is_integer() else {"number"}
    if isinstance(v, str):
        return {"string"}
    if isinstance(v, list):
        return {"array"}
    if isinstance(v, dict):
        return {"object"}
    raise GrammarError(f"{v!r} is not a JSON value")


def _type_values(t) -> set[str]:
    """Returns: the types a "type" keyword admits, integer included in number."""
    ts = {t} if isinstance(t, str) else set(t)
    return ts | {"integer"} if "number" in ts else ts


def _canon(v) -> str:
    return json.dumps(v, sort_keys=True, ensure_ascii=False)


def _nonneg_int(s: dict, key: str, path: str) -> int | None:
    v = s.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or int(v) != v:
        raise GrammarError(f"{path}: {key} must be a non-negative integer")
    return int(v)


class _Compiler:
    def __init__(self, root, limits: Limits | None, max_depth: int):
        self.root = root
        self.g = JsonGrammar(limits, max_depth)
        self.memo: dict[tuple[int, int], Element] = {}
        self.active: set[tuple[int, int]] = set()
        self.keep: list = []  # merged schemas, kept alive so their ids stay unique
        self.visits = 0
        self.merging = 0

    def compile(self) -> CompiledGrammar:
        return self.g.compile(self.value(self.root, 0, "#"))

    # ---- dispatch --------------------------------------------------------------------

    def value(self, s, depth: int, path: str) -> Element:
        """Returns: the element of a value valid under schema s at nesting ``depth``."""
        if s is True:
            return self.g.value(depth)
        if s is False:
            return Chars(())  # nothing; an optional place holding it is dropped
        if not isinstance(s, dict):
            raise GrammarError(f"{path}: a schema must be an object or a boolean")
        key = (id(s), depth)
        if key in self.memo:
            return self.memo[key]
        if key in self.active:
            raise GrammarError(f"{path}: a $ref cycle that does not nest inside an object or array")
        self.visits += 1
        if len(self.active) > MAX_NESTING:
            raise GrammarError(f"{path}: the schema nests (or cycles through combinations) more "
                               f"than {MAX_NESTING} deep")
        if self.visits > MAX_SCHEMA_NODES:
            raise GrammarError(f"the schema is too large (more than {MAX_SCHEMA_NODES} subschemas "
                               "after expanding references)")
        self.active.add(key)
        try:
            e = self._value(s, depth, path)
        finally:
            self.active.discard(key)
        self.memo[key] = e
        return e

    def _value(self, s: dict, depth: int, path: str) -> Element:
        for k in s:
            if k not in KNOWN:
                raise GrammarError(f"{path}: unsupported schema keyword {k!r}")
        if "$ref" in s:
            target, where = self.resolve(s["$ref"], path)
            rest = {k: v for k, v in s.items() if k != "$ref" and k not in ANNOTATIONS}
            if not rest:
                return self.value(target, depth, where)
            return self.value(self.merged([target, rest], path), depth, path)
        if "allOf" in s:
            parts = s["allOf"]
            if not isinstance(parts, list) or not parts:
                raise GrammarError(f"{path}: allOf must be a non-empty list")
            rest = {k: v for k, v in s.items() if k != "allOf"}
            return self.value(self.merged(parts + [rest], path), depth, path)
        if "anyOf" in s or "oneOf" in s:
            return self.alternatives(s, depth, path)
        if "enum" in s or "const" in s:
            return self.enum(s, path)
        types = self.types(s, path)
        if types is None:
            return self.g.value(depth)
        if not types:
            return Chars(())
        return self.g.choice([[self.typed(t, s, depth, path)] for t in types], "type")

    def types(self, s: dict, path: str) -> list[str] | None:
        """Returns: the types a value may take (declared, else implied by the keywords
        present; None for any)."""
        t = s.get("type")
        if t is None:
            implied = [k for k, words in BY_TYPE.items() if words & s.keys()]
            return implied or None
        ts = [t] if isinstance(t, str) else t
        if not isinstance(ts, list) or any(x not in TYPES for x in ts):
            raise GrammarError(f"{path}: type must be one of {', '.join(TYPES)} or a list of them")
        if "number" in ts and "integer" in ts:
            ts = [x for x in ts if x != "integer"]
        return list(dict.fromkeys(ts))

    def typed(self, t: str, s: dict, depth: int, path: str) -> Element:
        g = self.g
        if t == "null":
            return g.choice([lit("null")])
        if t == "boolean":
            return g.choice([lit("true"), lit("false")], "boolean")
        if t == "string":
            return self.string(s, path)
        if t in ("number", "integer"):
            return self.number(s, t == "integer", path)
        if depth >= g.max_depth:
            return Chars(())  # too deep: only scalars here
        return self.object(s, depth, path) if t == "object" else self.array(s, depth, path)

    # ---- references and combinations -------------------------------------------------

    def resolve(self, ref, path: str):
        """Returns: (the schema a same-document $ref points to, its path)."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise GrammarError(f"{path}: only $ref into the same schema ('#...') is supported, "
                               f"not {ref!r}")
        node = self.root
        if ref not in ("#", "#/"):
            if not ref.startswith("#/"):
                raise GrammarError(f"{path}: $ref {ref!r}: anchors are not supported")
            for part in ref[2:].split("/"):
                part = unquote(part).replace("~1", "/").replace("~0", "~")
                if isinstance(node, dict) and part in node:
                    node = node[part]
                elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                    node = node[int(part)]
                else:
                    raise GrammarError(f"{path}: $ref {ref!r} points to nothing")
        return node, ref

    def merged(self, parts: list, path: str) -> dict:
        """Returns: one schema equivalent to all of ``parts`` (allOf), for the cases where the
        keywords combine plainly; raises GrammarError otherwise."""
        out: dict = {}
        closed = []  # property names of the parts that limit additionalProperties
        flats = [self.flat(p, path) for p in parts]
        for p in flats:
            if p is False:
                return self._keep({"type": []})
            if p.get("additionalProperties", True) is not True:
                closed.append(set(p.get("properties", {})))
        if closed:
            # A part's additionalProperties judges names against its own properties only.
            names = set().union(*(p.get("properties", {}) for p in flats))
            if any(c != names for c in closed):
                raise GrammarError(f"{path}: allOf of objects with additionalProperties and "
                                   "different properties is not supported")
        for p in flats:
            for k, v in p.items():
                if k in ANNOTATIONS:
                    continue
                if k == "const":
                    k, v = "enum", [v]
                if k not in KNOWN:
                    raise GrammarError(f"{path}: unsupported schema keyword {k!r}")
                if k not in out:
                    out[k] = v
                    continue
                out[k] = self._merge_key(k, out[k], v, path)
        return self._keep(out)

    def flat(self, p, path: str):
        """Returns: p with its own $ref and allOf folded in (True becomes {})."""
        self.merging += 1
        try:
            return self._flat(p, path)
        finally:
            self.merging -= 1

    def _flat(self, p, path: str):
        if self.merging > MAX_NESTING // 4:
            raise GrammarError(f"{path}: $ref and allOf fold into each other too deeply (a cycle?)")
        if p is True:
            return {}
        if p is False:
            return False
        if not isinstance(p, dict):
            raise GrammarError(f"{path}: allOf entries must be schemas")
        if "$ref" in p:
            target, _ = self.resolve(p["$ref"], path)
            return self.merged([target, {k: v for k, v in p.items() if k != "$ref"}], path)
        if "allOf" in p:
            if not isinstance(p["allOf"], list):
                raise GrammarError(f"{path}: allOf must be a list")
            return self.merged(p["allOf"] + [{k: v for k, v in p.items() if k != "allOf"}], path)
        return p

    def _merge_key(self, k: str, a, b, path: str):
        if k == "type":
            both = _type_values(a) & _type_values(b)
            return sorted(both - {"integer"} if "number" in both else both)
        if k == "required":
            return list(dict.fromkeys(list(a) + list(b)))
        if k == "properties":
            merged = dict(a)
            for name, sub in b.items():
                merged[name] = {"allOf": [merged[name], sub]} if name in merged else sub
            return merged
        if k in ("additionalProperties", "items"):
            return {"allOf": [a, b]}
        if k in ("minLength", "minItems"):
            return max(a, b)
        if k in ("maxLength", "maxItems"):
            return min(a, b)
        if k in ("minimum", "exclusiveMinimum"):
            return max(a, b)
        if k in ("maximum", "exclusiveMaximum"):
            return min(a, b)
        if k == "enum":
            keep = {_canon(x) for x in b}
            return [x for x in a if _canon(x) in keep]
        if _canon(a) == _canon(b):
            return a
        raise GrammarError(f"{path}: allOf with two different {k!r} is not supported")

    def _keep(self, s: dict) -> dict:
        self.keep.append(s)
        return s

    def alternatives(self, s: dict, depth: int, path: str) -> Element:
        if "anyOf" in s and "oneOf" in s:
            raise GrammarError(f"{path}: anyOf together with oneOf is not supported")
        kw = "anyOf" if "anyOf" in s else "oneOf"
        alts = s[kw]
        if not isinstance(alts, list) or not alts:
            raise GrammarError(f"{path}: {kw} must be a non-empty list")
        rest = {k: v for k, v in s.items() if k != kw and k not in ANNOTATIONS}
        parts = [self.merged([a, rest], path) if rest else a for a in alts]
        if kw == "oneOf":
            self.check_disjoint([self.flat(p, path) for p in parts], path)
        return self.g.choice([[self.value(p, depth, f"{path}/{kw}/{i}")] for i, p in enumerate(parts)],
                             kw)

    def check_disjoint(self, parts: list, path: str) -> None:
        """oneOf is compiled as anyOf, which is exact only when no value matches two
        alternatives: accept alternatives of disjoint types, or objects told apart by a
        required property with different const/enum values; raise otherwise."""
        for i in range(len(parts)):
            for j in range(i + 1, len(parts)):
                if not self._disjoint(parts[i], parts[j]):
                    raise GrammarError(f"{path}: oneOf alternatives {i} and {j} may both match a "
                                       "value; use anyOf, or tell them apart by type or a const")

    def _disjoint(self, a, b) -> bool:
        if a is False or b is False:
            return True
        ta, tb = self._type_set(a), self._type_set(b)
        if not ta & tb:
            return True
        ca, cb = self._consts(a), self._consts(b)
        if ca is not None and cb is not None:
            return not ca & cb
        if ta | tb <= {"object"}:
            pa, pb = a.get("properties", {}), b.get("properties", {})
            for name in set(a.get("required", [])) & set(b.get("required", [])):
                va, vb = self._consts(self.flat(pa.get(name, True), "")), self._consts(
                    self.flat(pb.get(name, True), ""))
                if va is not None and vb is not None and not va & vb:
                    return True
        return False

    def _type_set(self, s: dict) -> set[str]:
        if "enum" in s or "const" in s:
            vals = s["enum"] if "enum" in s else [s["const"]]
            return set().union(*(json_type_of(v) for v in vals)) if vals else set()
        ts = self.types(s, "")
        if ts is None:
            return set(TYPES)
        out = set(ts)
        if "number" in out:
            out.add("integer")
        if "integer" in out:
            out.add("number")
        return out

    def _consts(self, s) -> set[str] | None:
        if isinstance(s, dict) and ("enum" in s or "const" in s):
            return {_canon(v) for v in (s["enum"] if "enum" in s else [s["const"]])}
        return None

    # ---- values ------------------------------------------------------------------------

    def enum(self, s: dict, path: str) -> Element:
        values = s["enum"] if "enum" in s else [s["const"]]
        if not isinstance(values, list):
            raise GrammarError(f"{path}: enum must be a list")
        if "enum" in s and "const" in s:
            keep = _canon(s["const"])
            values = [v for v in values if _canon(v) == keep]
        others = set(s) - ANNOTATIONS - {"enum", "const", "type"}
        if others:
            raise GrammarError(f"{path}: enum or const together with {sorted(others)[0]!r} "
                               "is not supported")
        types = self.types(s, path) if "type" in s else None
        if types is not None:
            allowed = set(types) | ({"integer"} if "number" in types else set())
            values = [v for v in values if json_type_of(v) & allowed]
        for v in values:
            json_type_of(v)  # raises for NaN, infinities and non-JSON values
        if not values:
            return Chars(())
        return self.g.literal_values(values)

    def string(self, s: dict, path: str) -> Element:
        lo = _nonneg_int(s, "minLength", path)
        hi = _nonneg_int(s, "maxLength", path)
        pattern, fmt = s.get("pattern"), s.get("format")
        if pattern is not None and fmt is not None:
            raise GrammarError(f"{path}: pattern together with format is not supported")
        if fmt is not None:
            if fmt not in FORMATS:
                raise GrammarError(f"{path}: string format {fmt!r} is not supported (supported: "
                                   f"{', '.join(FORMATS)})")
            pattern = FORMATS[fmt]
        if pattern is not None:
            if lo is not None or hi is not None:
                raise GrammarError(f"{path}: {'format' if fmt else 'pattern'} together with "
                                   "minLength/maxLength is not supported")
            return pattern_element(self.g, pattern)
        return self.g.string_of_length(lo or 0, -1 if hi is None else hi)

    def number(self, s: dict, integer: bool, path: str) -> Element:
        bounds = {}
        for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            v = s.get(k)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise GrammarError(f"{path}: {k} must be a finite number")
            bounds[k] = v
        lo, lo_x = self._bound(bounds, "minimum", "exclusiveMinimum", max)
        hi, hi_x = self._bound(bounds, "maximum", "exclusiveMaximum", min)
        g = self.g
        if integer:
            if lo is None and hi is None:
                return g.integer
            ilo = None if lo is None else (math.floor(lo) + 1 if lo_x else math.ceil(lo))
            ihi = None if hi is None else (math.ceil(hi) - 1 if hi_x else math.floor(hi))
            return g.integer_range(ilo, ihi)
        if lo is None and hi is None:
            return g.number
        for v in (lo, hi):
            if v is not None and int(v) != v:
                raise GrammarError(f"{path}: a non-integer bound ({v}) on a number is not "
                                   "supported; use an integer bound or type integer")
        return g.number_range(None if lo is None else int(lo), lo_x,
                              None if hi is None else int(hi), hi_x)

    @staticmethod
    def _bound(b: dict, incl: str, excl: str, stricter) -> tuple[float | None, bool]:
        """Returns: (the stricter of an inclusive and an exclusive bound, whether exclusive)."""
        if excl in b and (incl not in b or stricter(b[incl], b[excl]) == b[excl]):
            return b[excl], True
        return b.get(incl), False

    def object(self, s: dict, depth: int, path: str) -> Element:
        g = self.g
        props = s.get("properties", {})
        required = s.get("required", [])
        addl = s.get("additionalProperties")
        if not isinstance(props, dict):
            raise GrammarError(f"{path}: properties must be an object")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise GrammarError(f"{path}: required must be a list of strings")
        names = list(props) + [r for r in dict.fromkeys(required) if r not in props]
        members = []
        for name in names:
            if name in props:
                sub = props[name]
            elif addl is False:
                raise GrammarError(f"{path}: required property {name!r} is not in properties, "
                                   "and additionalProperties is false")
            else:
                sub = True if addl is None else addl  # a required additional property
            key = lit(json.dumps(name, ensure_ascii=False))
            val = self.value(sub, depth + 1, f"{path}/properties/{name}")
            members.append((g.member(key, val), name in required))
        if addl is False or (addl in (None, True) and names):
            extra = None
        else:
            value = g.value(depth + 1) if addl in (None, True) else \
                self.value(addl, depth + 1, f"{path}/additionalProperties")
            extra = g.member([g.key_except(names) if names else g.string], value)
        return self._object_body(members, extra)

    def _object_body(self, members: list[tuple[list[Element], bool]], extra) -> Element:
        """'{' members '}' in the given order, optional ones skippable, extra ones after."""
        g = self.g
        sep = [g.ws] + lit(",") + [g.ws]
        close = [g.ws] + lit("}")
        after = [close] if extra is None else [[g.seq(sep + extra, 0, -1)] + close]
        first = [lit("}")] if extra is None else [lit("}"), extra + after[0]]
        for member, req in reversed(members):
            a = g.rule(after, "after")
            f = g.rule(first, "first")
            after = [sep + member + [a]] + ([] if req else [[a]])
            first = [member + [a]] + ([] if req else [[f]])
        return g.rule([lit("{") + [g.ws, g.choice(first, "members")]], "object")

    def array(self, s: dict, depth: int, path: str) -> Element:
        g = self.g
        items, prefix = s.get("items"), s.get("prefixItems", [])
        if isinstance(items, list):  # the older tuple form
            if "prefixItems" in s:
                raise GrammarError(f"{path}: items as a list together with prefixItems")
            prefix, items = items, s.get("additionalItems")
        elif "additionalItems" in s:
            raise GrammarError(f"{path}: additionalItems needs items as a list")
        if not isinstance(prefix, list):
            raise GrammarError(f"{path}: prefixItems must be a list")
        if s.get("uniqueItems") not in (None, False):
            raise GrammarError(f"{path}: uniqueItems is not supported")
        lo = _nonneg_int(s, "minItems", path) or 0
        hi = _nonneg_int(s, "maxItems", path)
        hi = -1 if hi is None else hi
        if hi >= 0 and lo > hi:
            raise GrammarError(f"{path}: minItems {lo} is greater than maxItems {hi}")
        rest = None if items is False else self.value(True if items is None else items, depth + 1,
                                                      f"{path}/items")
        heads = [self.value(p, depth + 1, f"{path}/prefixItems/{i}") for i, p in enumerate(prefix)]
        if not heads:
            return g.array_of([rest], lo, hi) if rest is not None else \
                (g.choice([lit("[") + [g.ws] + lit("]")]) if lo == 0 else Chars(()))
        sep, close = [g.ws] + lit(",") + [g.ws], [g.ws] + lit("]")
        k = len(heads)
        tail: list[list[Element]] = [close] if k >= lo else []
        if rest is not None and (hi < 0 or k < hi):
            tail.append([g.seq(sep + [rest], max(lo - k, 0), hi - k if hi >= 0 else -1)] + close)
        for i in range(k - 1, 0, -1):  # after i items
            nxt = g.rule(tail, "prefix") if tail else Chars(())
            tail = ([close] if i >= lo else []) + ([sep + [heads[i], nxt]] if hi < 0 or i < hi else [])
        alts = [lit("[") + [g.ws] + lit("]")] if lo == 0 else []
        if hi != 0:
            alts.append(lit("[") + [g.ws, heads[0]] + ([g.rule(tail, "prefix")] if tail else [Chars(())]))
        return g.rule(alts, "array")


def compile_wrapped(schema, wrap, limits: Limits | None = None,
                    max_depth: int = 32) -> CompiledGrammar:
    """Compile a JSON Schema's value inside a larger text (a tool call's markers around it).

    Args:
        schema: the schema of the value, as for compile_schema.
        wrap: wrap(grammar, value) -> the root Element, built with the JsonGrammar's rules
            around ``value``, the Element of one value valid under ``schema``.
        limits, max_depth: as for compile_schema.
    Returns:
        the CompiledGrammar of the root.
    Raises:
        GrammarError: as compile_schema.
    """
    c = _Compiler(schema, limits, max_depth)
    return c.g.compile(wrap(c.g, c.value(c.root, 0, "#")))


def compile_wrapped_many(schemas: list, wrap, limits: Limits | None = None,
                         max_depth: int = 32) -> CompiledGrammar:
    """Compile several JSON Schemas' values inside one larger text (tool calls that each
    take their own tool's parameters).

    Args:
        schemas: the schemas; each one's $refs point into itself.
        wrap: wrap(grammar, values) -> the root Element, ``values`` holding one Element per
            schema, in order.
        limits, max_depth: as for compile_schema.
    Returns:
        the CompiledGrammar of the root.
    Raises:
        GrammarError: as compile_schema.
    """
    c = _Compiler(None, limits, max_depth)
    values = []
    for i, s in enumerate(schemas):
        c.root = s
        values.append(c.value(s, 0, f"#{i}"))
    return c.g.compile(wrap(c.g, values))


def compile_built(build, limits: Limits | None = None, max_depth: int = 32) -> CompiledGrammar:
    """Compile a text built around JSON Schema values chosen by the builder (the XML tool
    calls, one value per parameter).

    Args:
        build: build(grammar, value) -> the root Element, made with the JsonGrammar's rules;
            value(schema, root) is the Element of one value valid under ``schema``, whose
            $refs point into ``root`` (the tool's whole parameters schema).
        limits, max_depth: as for compile_schema.
    Returns:
        the CompiledGrammar of the root.
    Raises:
        GrammarError: as compile_schema.
    """
    c = _Compiler(None, limits, max_depth)

    def value(schema, root) -> Element:
        c.root = root
        return c.value(schema, 1, "#")
    return c.g.compile(build(c.g, value))
