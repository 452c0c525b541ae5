"""Grammar-constrained tokens without a model: a small byte-level vocabulary, JSON and JSON
Schema grammars, masks against one-token checks, UTF-8 split across tokens, schema errors,
and constrained sampling against the exact masked distribution."""

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator, FormatChecker

from localllm.generation.constrain import GrammarError, TokenConstraint, TokenVocab
from localllm.generation.constrain.schema import compile_schema
from localllm.generation.sampling import Sampler, SamplingParams

# Every single byte is a token (so any text can be fed byte by byte), plus longer pieces that
# cross JSON's boundaries, invalid UTF-8, a control token and an end token.
PIECES = ([bytes([b]) for b in range(256)] + [
    "é".encode(), "😀".encode()[:2], b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b'{"',
    b'":', b'", "', b'"}', b"true", b"null", b"[]", b"{}", b"1.5", b"e+", b"\\u00e9", b"\\n", b"  ",
    b"\n  ", b'", ', b"<ctl>", b"<eos>"])
CTL, EOS = PIECES.index(b"<ctl>"), PIECES.index(b"<eos>")
CONTINUATION = list(range(0x80, 0xC0))


@pytest.fixture(scope="module")
def vocab():
    return TokenVocab.from_pieces(PIECES, eog=[EOS], excluded=[CTL])


def feed(c, text: bytes):
    """Advance byte by byte (token b is byte b)."""
    for b in text:
        c.advance(b)


def walk(c, rng, cap=2000):
    """Random allowed tokens until the value is complete (then end w.p. 0.7)."""
    out = []
    for _ in range(cap):
        m = c.mask()
        ok = np.flatnonzero(m)
        assert ok.size, f"dead end after {b''.join(out)!r}"
        if m[EOS] and (ok.size == 1 or rng.random() < 0.7):
            c.advance(EOS)
            return b"".join(out)
        t = int(rng.choice(ok[ok != EOS]))
        c.advance(t)
        out.append(PIECES[t])
    return None


def test_mask_equals_one_token_checks(vocab):
    c = TokenConstraint.json_object(vocab)
    rng = np.random.default_rng(0)
    for _ in range(60):
        m = c.mask()
        assert m.tolist() == [c.allowed(t) for t in range(vocab.size)]
        ok = np.flatnonzero(m & ~np.isin(np.arange(vocab.size), [EOS]))
        if not ok.size:
            break
        c.advance(int(rng.choice(ok)))


def test_json_object_steps(vocab):
    c = TokenConstraint.json_object(vocab)
    assert sorted(PIECES[t] for t in np.flatnonzero(c.mask())) == [b"{", b'{"', b"{}"]
    feed(c, b'{"a')
    assert c.allowed(PIECES.index("é".encode())) and c.allowed(PIECES.index(b'":'))
    assert not c.allowed(PIECES.index(b'"}')) and not c.allowed(EOS)
    feed(c, b'": [1, -2.5e+3, "x\\n", true, null]')
    assert not c.is_complete() and not c.allowed(EOS)
    c.advance(PIECES.index(b"}"))
    assert c.is_complete() and c.must_end()
    assert np.flatnonzero(c.mask()).tolist() == [EOS]
    c.advance(EOS)
    assert not c.mask().any()
    with pytest.raises(ValueError):
        c.advance(ord(" "))


def test_control_tokens_and_bad_utf8_never_allowed(vocab):
    c = TokenConstraint.json_object(vocab)
    feed(c, b'{"k": "')
    for bad in (b"<ctl>", b"\x00", b"\x1f", b"\xff", b"\xc0\x80", b"\xed\xa0\x80",
                b"\xf4\x90\x80\x80", b"\xa9", b"\xc0", b"\xf5"):
        assert not c.allowed(PIECES.index(bad)), bad
    assert c.allowed(PIECES.index("é".encode())) and c.allowed(0xF4) and c.allowed(0x7F)


def test_characters_split_across_tokens(vocab):
    c = TokenConstraint.json_object(vocab)
    feed(c, b'{"')
    c.advance(0xC3)  # first byte of é
    assert not c.is_complete()
    assert np.flatnonzero(c.mask()).tolist() == CONTINUATION
    c.advance(0xA9)
    c.advance(PIECES.index("😀".encode()[:2]))
    assert np.flatnonzero(c.mask()).tolist() == CONTINUATION
    c.advance(0x98)
    c.advance(0x80)
    feed(c, b'":1}')
    assert c.is_complete()
    # E0 must be followed by A0..BF (shorter forms are overlong); ED by 80..9F (no surrogates)
    for lead, ok in ((0xE0, range(0xA0, 0xC0)), (0xED, range(0x80, 0xA0))):
        d = TokenConstraint.json_object(vocab)
        feed(d, b'{"' + bytes([lead]))
        assert np.flatnonzero(d.mask()).tolist() == list(ok)
    # a pattern of ASCII letters refuses a character's first byte outright
    k = TokenConstraint.json_schema({"type": "string", "pattern": "^[a-zé]*$"}, vocab)
    feed(k, b'"')
    assert not k.allowed(0xE6) and k.allowed(0xC3) and k.allowed(ord("a"))
    k.advance(0xC3)
    assert np.flatnonzero(k.mask()).tolist() == [0xA9]


def test_copy_is_independent(vocab):
    c = TokenConstraint.json_object(vocab)
    feed(c, b'{"a":')
    d = c.copy()
    feed(d, b'1}')
    assert d.is_complete() and not c.is_complete()
    feed(c, b'"x"}')
    assert c.is_complete()


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10 ** 15, 10 ** 15)
    | st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x == 0 or 1e-90 < abs(x) < 1e90)
    | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids, max_size=4),
    max_leaves=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=st.dictionaries(st.text(max_size=5), _JSON, max_size=4), indent=st.sampled_from([None, 2]))
def test_any_serialized_object_is_accepted(vocab, value, indent):
    """Completeness: what json.dumps writes (within the documented bounds) is accepted whole."""
    text = json.dumps(value, indent=indent, ensure_ascii=False).encode()
    c = TokenConstraint.json_object(vocab)
    feed(c, text)
    assert c.is_complete() and c.allowed(EOS)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2 ** 32 - 1))
def test_completed_token_sequences_parse(vocab, seed):
    """Soundness: any token sequence the constraint accepts and completes is JSON."""
    text = walk(TokenConstraint.json_object(vocab), np.random.default_rng(seed))
    if text is not None:
        assert isinstance(json.loads(text.decode("utf-8")), dict)


SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 5},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
     "required": ["name", "age"], "additionalProperties": False},
    {"$defs": {"n": {"type": "object", "properties": {
        "v": {"type": "integer"},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 2}},
        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/n"},
    {"anyOf": [{"type": "string", "format": "date"}, {"type": "null"},
               {"type": "number", "minimum": -5, "exclusiveMaximum": 3}]},
    {"type": "string", "pattern": "^[a-z]+\\d{2}(-x)?$"},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"const": "k"}],
     "items": {"type": "integer", "exclusiveMinimum": -3, "maximum": 1000}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"k": {"const": 1}}, "additionalProperties": {"type": "boolean"}},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "number"}},
                "required": ["kind"]},
               {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"required": ["b"], "properties": {"b": {"type": "string", "format": "uuid"}}}]},
    {"type": ["string", "null"], "minLength": 2},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "email"},
    {"type": "string", "format": "ipv4"},
    {"type": "number", "minimum": 0, "maximum": 1},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
def test_schema_outputs_validate(vocab, schema):
    validator = Draft202012Validator(schema, format_checker=FormatChecker())
    c = TokenConstraint.json_schema(schema, vocab)
    rng = np.random.default_rng(1)
    done = 0
    for _ in range(20):
        text = walk(c.copy(), rng)
        if text is not None:
            validator.validate(json.loads(text.decode()))
            done += 1
    assert done >= 10


def test_schema_accepts_valid_documents(vocab):
    """Values the schema allows, written as the grammar writes them, are accepted whole."""
    for schema, doc in [(SCHEMAS[0], '{"name": "Bo", "age": 7, "tags": ["a", "c"]}'),
                        (SCHEMAS[0], '{"name": "", "age": 120}'),
                        (SCHEMAS[1], '{"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]}'),
                        (SCHEMAS[2], '"2024-02-28"'), (SCHEMAS[2], "-5"), (SCHEMAS[2], "2.999"),
                        (SCHEMAS[5], '{"k": 1, "x": true}'), (SCHEMAS[12], "1.000"),
                        ({"type": "object", "additionalProperties": {"type": "integer"},
                          "required": ["n"]}, '{"n": 4}')]:
        c = TokenConstraint.json_schema(schema, vocab)
        feed(c, doc.encode())
        assert c.is_complete(), (schema, doc)
    for schema, doc in [(SCHEMAS[0], '{"name": "Bo", "age": 121'), (SCHEMAS[0], '{"age"'),
                        (SCHEMAS[2], '"2024-02-30'), (SCHEMAS[2], "3"), (SCHEMAS[12], "1.01"),
                        (SCHEMAS[5], '{"k": 1, "k"')]:
        c = TokenConstraint.json_schema(schema, vocab)
        with pytest.raises(ValueError):
            feed(c, doc.encode())


@pytest.mark.parametrize("schema, words", [
    ({"not": {"type": "string"}}, "'not'"),
    ({"type": "object", "patternProperties": {"a": {}}}, "'patternProperties'"),
    ({"type": "number", "multipleOf": 3}, "'multipleOf'"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "pattern": "(a)\\1"}, "backreference"),
    ({"type": "string", "pattern": "a(?=b)"}, "lookahead"),
    ({"type": "string", "pattern": "\\bword"}, "word boundary"),
    ({"type": "string", "pattern": "a^b"}, "'^' inside"),
    ({"type": "string", "pattern": "[a-z]", "maxLength": 3}, "minLength/maxLength"),
    ({"type": "string", "format": "hostname"}, "'hostname'"),
    ({"$ref": "other.json#/x"}, "same schema"),
    ({"$ref": "#/$defs/missing"}, "points to nothing"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "may both match"),
    ({"type": "number", "minimum": 0.5}, "non-integer bound"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "greater than"),
    ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}, "$ref": "#/$defs/a"},
     "does not nest"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "no finite value"),
    ({"allOf": [{"type": "object", "properties": {"a": {}}, "additionalProperties": False},
                {"properties": {"b": {}}}]}, "different properties"),
    ({"allOf": [{"type": "object", "additionalProperties": False}, {"required": ["b"]}]},
     "additionalProperties is false"),
])
def test_unsupported_schemas_name_the_problem(vocab, schema, words):
    with pytest.raises(GrammarError) as e:
        compile_schema(schema)
    assert words in str(e.value)


def test_hostile_schemas_are_bounded():
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "array", "items": deep}
    compile_schema(deep)  # nesting past max_depth: the deep part is cut, not recursed into
    nested: dict = {"type": "null"}
    for _ in range(5000):
        nested = {"anyOf": [nested]}
    with pytest.raises(GrammarError, match="deep"):
        compile_schema(nested)
    with pytest.raises(GrammarError, match="too large"):
        compile_schema({"enum": [f"{i:04}" + "x" * 1000 for i in range(300)]})
    with pytest.raises(GrammarError, match="repeat bound"):
        compile_schema({"type": "string", "maxLength": 10 ** 9})
    # recursion unrolls once per nesting level, not once per path
    wide = {f"p{i}": {"$ref": "#"} for i in range(40)}
    assert compile_schema({"type": "object", "properties": wide}).n_elements < 50_000
    assert compile_schema({"type": "string", "maxLength": 100_000}).n_elements < 100


def test_deep_json_is_cut_at_max_depth(vocab):
    c = TokenConstraint.json_object(vocab, max_depth=3)
    feed(c, b'{"a": [{"b": ')
    assert not c.allowed(ord("[")) and c.allowed(ord("1"))


def _constrained_first_token(vocab, logits, params, seed):
    c = TokenConstraint.json_object(vocab)
    feed(c, b'{"a": ')
    s = Sampler(SamplingParams(seed=seed, **params), vocab.size, constraint=c)
    return s, c


def test_masked_sampling_is_the_masked_distribution(vocab):
    """Chi-square of draws against p(t) 1[allowed] / P(allowed), where most of the mass sits
    on tokens that are not allowed (so the second draw runs often)."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal(vocab.size).astype(np.float32)
    letters = list(b"abcdefgh")
    logits[letters] += 3.0  # likely but never valid after '{"a": '
    params = dict(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0)
    s, c = _constrained_first_token(vocab, logits, params, seed=7)
    allowed = c.mask()
    p = np.exp((logits.astype(np.float64) - logits.max()) / 0.9)
    p /= p.sum()
    assert p[allowed].sum() < 0.2
    expect = np.where(allowed, p, 0) / p[allowed].sum()
    n = 6000
    counts = np.zeros(vocab.size)
    for _ in range(n):
        d = c.copy()
        s.constraint = d
        counts[s.sample(logits, [])[0]] += 1
    assert counts[~allowed].sum() == 0
    ok = expect * n >= 5  # pool small cells
    obs = np.append(counts[ok], counts[~ok & allowed].sum())
    exp = np.append(expect[ok] * n, expect[~ok & allowed].sum() * n)
    chi2 = float(((obs - exp) ** 2 / np.maximum(exp, 1e-9)).sum())
    df = obs.size - 1
    # Wilson-Hilferty: the 99.9% point of chi-square with df degrees of freedom
    crit = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    assert chi2 < crit, (chi2, crit, df)


def test_greedy_takes_the_best_allowed(vocab):
    logits = np.zeros(vocab.size, np.float32)
    logits[ord("a")] = 9.0
    logits[ord("t")] = 5.0
    logits[ord("7")] = 4.0
    for params in (dict(temperature=0), dict(temperature=0, repeat_penalty=1.1),
                   dict(temperature=1.0, top_k=1)):
        s, c = _constrained_first_token(vocab, logits, params, seed=1)
        assert s.sample(logits, [])[0] == ord("t")
    # truncation kept nothing allowed: the mask applies before top-k
    s, c = _constrained_first_token(vocab, logits, dict(temperature=1.0, top_k=1), seed=1)
    logits[ord("t")] = -1.0
    assert s.sample(logits, [])[0] == ord("7")
