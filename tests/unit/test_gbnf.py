"""The GBNF parser: every llama.cpp grammar parses and matches what it should, the syntax's
corners (escapes, classes, repeats, groups, comments, newlines), and bad grammars refused
with the line and column."""

import json
from pathlib import Path

import pytest

from localllm.generation.constrain import GrammarError
from localllm.generation.constrain.gbnf import parse_gbnf
from localllm.generation.constrain.grammar import Limits

GRAMMARS = Path(__file__).parent.parent / "fixtures" / "grammars"
SAMPLES = {
    "arithmetic": (["1+2= 3\n", "(x1 *y)= 4\n1=1\n"], ["1+2", "=3\n", "1+2=3"]),
    "c": (["", "int main(){return 0;}", "int f(int a){a = a+1;}"], ["int main(", "main(){}"]),
    "chess": (["1. e4 e5\n2. Nf3 Nc6\n"], ["1. e4 e5\n", "1. e9 e5\n2. a1 a2\n"]),
    "english": (["Hello, world!"], ["", " x", "héllo"]),
    "japanese": (["こんにちは 世界"], ["hello", ""]),
    "json": (['{"a": [1, 2.5, "x\\n", true, null], "b": {}}', "{}"], ["[1]", '{"a":}', '{"a" 1}']),
    "json_arr": (['[\n1,\n{"a": "b"}]', "[\n]"], ["{}", "[1]"]),
    "list": (["- one\n- two\n"], ["- one", "one\n"]),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_llama_cpp_grammars_parse_and_match(name):
    g = parse_gbnf((GRAMMARS / f"{name}.gbnf").read_text())
    good, bad = SAMPLES[name]
    for text in good:
        assert g.matches(text), text
        if name.startswith("json"):
            json.loads(text)
    for text in bad:
        assert not g.matches(text), text


def test_every_fixture_has_samples():
    assert {p.stem for p in GRAMMARS.glob("*.gbnf")} == set(SAMPLES)


def test_syntax_corners():
    g = parse_gbnf('# comment\nroot ::= "a"{2,3} x? (y | "z")+ . # trailing\n'
                   'x ::= [\\x41-\\u0043\\U0001F600] \ny ::= [^a-y\\]\\-]\n')
    assert g.matches("aaAz!") and g.matches("aa😀zz{z\n") and g.matches("aa~\u00e9")
    assert not g.matches("aAz!") and not g.matches("aaaaz!") and not g.matches("aaby!") and not g.matches("aa]!")
    alt = parse_gbnf('root ::= "a" |\n  "b"\n')          # a newline after | continues
    assert alt.matches("a") and alt.matches("b")
    grouped = parse_gbnf('root ::= ("a"\n  | "b")*\n')     # newlines inside groups
    assert grouped.matches("") and grouped.matches("abba")
    assert parse_gbnf('root ::= "ab"*').matches("abab")  # a repeat takes the whole literal
    assert not parse_gbnf('root ::= "ab"*').matches("abb")
    nullable = parse_gbnf('root ::= ("a"?)* "b"')          # a repeat of something empty
    assert nullable.matches("aab") and nullable.matches("b") and not nullable.matches("ba")
    assert parse_gbnf('root ::= "x" ws\nws ::= | " "').matches("x ")
    assert parse_gbnf('root ::= "ab"').matches("a", complete=False)


@pytest.mark.parametrize("text, words", [
    ("root ::= foo", "line 1, column 10: rule 'foo' is used but never defined"),
    ('root ::= "a', "not closed"),
    ("root ::= [a", "line 1, column 12: the class opened at line 1, column 10"),
    ('x ::= "a"', "no 'root' rule"),
    ('root ::= root "a" | "b"', "left recursion"),
    ('root ::= x\nx ::= "a" x', "no finite value"),
    ('root ::= "a" )', "line 1, column 14: expected a newline"),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "\\x4"', "needs 2 hex digits"),
    ('root ::= "\\uD800"', "surrogate"),
    ('root ::= "\\U00110000"', "beyond the last code point"),
    ("root ::= <think>", "token matches"),
    ('root := "a"', "expected '::='"),
    ('root ::= "a"{3,1}', "at least 3 and at most 1"),
    ('root ::= "a"{2', "expected '}'"),
    ('root ::= "a"\nroot ::= "b"', "line 2, column 1: rule 'root' is defined twice"),
    ("root ::= *", "needs an item before it"),
    ("root ::= [z-a]", "runs backwards"),
    ('root ::= ("a"', "expected ')'"),
    ("", "empty"),
])
def test_bad_grammars_name_the_problem(text, words):
    with pytest.raises(GrammarError, match=None) as e:
        parse_gbnf(text)
    assert words in str(e.value)


def test_bounds():
    with pytest.raises(GrammarError, match="nested more than"):
        parse_gbnf("root ::= " + "(" * 200 + '"a"' + ")" * 200)
    with pytest.raises(GrammarError, match="repeat bound"):
        parse_gbnf('root ::= "a"{0,2000000}')
    with pytest.raises(GrammarError, match="too large"):
        parse_gbnf("root ::= " + " ".join(f'"{i}"' for i in range(3000)),
                   Limits(max_elements=1000))
    with pytest.raises(GrammarError, match="longer than"):
        parse_gbnf('root ::= "' + "a" * (1 << 20) + '"')
