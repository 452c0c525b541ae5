"""The grammar of XML tool calls (Qwen3-Coder's <function=NAME><parameter=P>, GLM's
<arg_key>/<arg_value>): per tool its name, then its parameters in the schema's order (the
required ones present), a string parameter's value as raw text without the closing tag and
any other's as JSON under its own schema."""

from __future__ import annotations

from localllm.text.tool_formats import XML_OPEN, param_types

from .grammar import Chars, Element, GrammarError, Limits, lit, negate, ranges
from .json_grammar import JsonGrammar
from .regex import raw_pattern_element
from .schema import ANNOTATIONS, FORMATS, compile_built


def raw_types(schema) -> set[str] | None:
    """The JSON types a parameter's schema allows, as the XML parser types its value (None:
    any). Only a value whose types are exactly {"string"} is read as raw text."""
    return param_types([{"name": "f", "parameters": {"properties": {"p": schema}}}], "f", "p")


def text_without(g: JsonGrammar, closer: str) -> Element:
    """Any text that does not hold ``closer`` (whose first character occurs only there).

    Runs of the first character are followed by a piece of the closer that breaks off
    before a character that continues it; the text may end inside such a piece.
    """
    c0 = closer[0]
    if len(closer) == 1 or c0 in closer[1:]:
        return Chars(negate(ranges([c0])), 0, -1)   # simpler, stricter: no such character
    first = ranges([c0])
    breaks = [[*lit(closer[1:k]), Chars(negate(ranges([closer[k], c0])))]
              for k in range(1, len(closer))]
    body = g.choice([[Chars(negate(first))], [Chars(first, 1, -1), g.choice(breaks, "xml-break")]],
                    "xml-char")
    tail = g.choice([lit(closer[1:k]) for k in range(1, len(closer))], "xml-tail")
    return g.seq([g.seq([body], 0, -1), g.seq([Chars(first, 1, -1), tail], 0, 1)], name="xml-text")


def raw_string(g: JsonGrammar, schema, closer: str) -> Element:
    """A string parameter's raw text valid under ``schema`` and without ``closer``.

    Raises:
        GrammarError: a string schema this form does not support (length with a pattern).
    """
    if schema is True or not isinstance(schema, dict):
        return text_without(g, closer)
    for kw in ("anyOf", "oneOf"):
        if kw in schema:
            return g.choice([[raw_string(g, s, closer)] for s in schema[kw]], "xml-any")
    no_open = ranges([closer[0]])
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        texts = [v for v in values if isinstance(v, str) and closer not in v]
        return g.choice([g.literal_set(texts, "xml-enum")]) if texts else Chars(())
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    pattern = schema.get("pattern")
    if schema.get("format") is not None:
        if schema["format"] not in FORMATS:
            raise GrammarError(f"string format {schema['format']!r} is not supported")
        pattern = FORMATS[schema["format"]]
    if pattern is not None:
        if lo is not None or hi is not None:
            raise GrammarError("a pattern together with minLength/maxLength is not supported")
        return raw_pattern_element(g, pattern, no_open)
    if lo is None and hi is None:
        return text_without(g, closer)
    # counted: characters other than the closer's first, so a count is a count of text
    return Chars(negate(no_open), int(lo or 0), -1 if hi is None else int(hi))


def xml_calls_grammar(style, tools: dict, repeat: bool, L, limits: Limits | None = None):
    """Compile the XML calls of these tools.

    Args:
        style: the XMLStyle (localllm.text.tool_formats).
        tools: {function name: its parameters' schema}.
        repeat: whether further calls may follow (each in its own <tool_call>).
        L: L(text) -> the elements of a literal piece (control tokens substituted).
    Returns:
        the CompiledGrammar of one or more calls.
    Raises:
        GrammarError: a parameter schema the compiler does not support.
    """
    def build(g: JsonGrammar, value) -> Element:
        def param(key: str, sub, root) -> list[Element]:
            if raw_types(sub) == {"string"}:
                v = raw_string(g, sub, style.value_close)
            else:
                v = value(sub, root)
            if style.trim:   # a newline each side of the value is layout
                v_part = L("\n") + [v] + L("\n")
            else:
                v_part = [v]
            head = L(style.key_open) + L(key) + L(style.key_close)
            if style.value_open:   # else the value's text starts right after the key
                head += [g.ws] + L(style.value_open)
            return head + v_part + L(style.value_close)

        def one(name: str, params) -> list[Element]:
            params = params if isinstance(params, dict) else {}
            props = params.get("properties") or {}
            req = [r for r in params.get("required") or [] if isinstance(r, str)]
            names = list(props) + [r for r in dict.fromkeys(req) if r not in props]
            out = L(XML_OPEN)
            if style.name_open:
                out += [g.ws] + L(style.name_open) + L(name) + L(style.name_close)
            else:
                out += L(name) + L("\n")
            out.append(g.ws)
            for key in names:
                p = g.seq(param(key, props.get(key, True), params) + [g.ws], name="xml-param")
                out.append(p if key in req else g.seq([p], 0, 1))
            out += [g.ws] + L(style.call_close)
            if style.outer_close:
                out += [g.ws] + L(style.outer_close)
            return out
        call = g.choice([one(n, p) for n, p in tools.items()], "xml-call")
        root = [call]
        if repeat:
            root.append(g.seq([g.ws, call], 0, -1, name="xml-calls"))
        return g.seq(root + [g.ws], name="xml-answer")
    unsupported = [k for p in tools.values() if isinstance(p, dict)
                   for k in p if k not in ANNOTATIONS
                   and k not in ("type", "properties", "required", "additionalProperties")]
    if unsupported:
        raise GrammarError(f"XML call parameters with {unsupported[0]!r} are not supported")
    return compile_built(build, limits)
