"""The tokenizers on hostile input (hypothesis over all of Unicode, lone surrogates, NULs,
special-token look-alikes, megabyte strings): ids in range or a clear TokenizerError,
never another exception, and time linear in the input (figures: scripts/bench_tokenizer.py)."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localllm.formats.fetch import vocab_suite_dir
from localllm.formats.gguf import GGUFFile
from localllm.text.tokenizer import ATTR_CONTROL, ATTR_USER_DEFINED, Tokenizer, TokenizerError
from localllm.text.tokenizer_bpe import PreTokenizer, family_of

MODELS = ["smollm", "gemma"]
HANG = 60.0  # a guard against a hang or a quadratic path, not a speed assertion
_SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                     suppress_health_check=[HealthCheck.function_scoped_fixture,
                                            HealthCheck.too_slow])


@pytest.fixture(scope="module")
def toks(metas):
    return {k: Tokenizer.from_metadata(m) for k, m in metas.items()}


def _has_surrogate(text: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in text)


def _check(tok: Tokenizer, text: str, parse_special: bool) -> None:
    """Encodes text: ids in range, decodable, streamable; or a TokenizerError for text
    that is not UTF-8 (lone surrogates), and nothing else."""
    try:
        ids = tok.encode(text, add_special=True, parse_special=parse_special)
    except TokenizerError as e:
        assert _has_surrogate(text) and "UTF-8" in str(e) and "\n" not in str(e)
        return
    assert not _has_surrogate(text)
    assert all(type(i) is int and 0 <= i < tok.vocab_size for i in ids)
    text_out = tok.decode(ids)
    stream = tok.stream()
    assert "".join(stream.feed(i) for i in ids) + stream.flush() == text_out


_every_code_point = st.characters(min_codepoint=0, max_codepoint=0x10FFFF)


@pytest.mark.parametrize("model", MODELS)
@_SETTINGS
@given(text=st.text(_every_code_point, max_size=200), parse_special=st.booleans())
def test_any_unicode_encodes_or_raises_a_clear_error(toks, model, text, parse_special):
    _check(toks[model], text, parse_special)


@pytest.fixture(scope="module")
def pieces(toks):
    """Per model: its special tokens, halves of them, and characters that stress the
    pre-tokenizer and the merges (spaces, NUL, U+2581, a lone surrogate, combining marks)."""
    out = {}
    for name, tok in toks.items():
        rng = random.Random(0)
        special = [tok.token_text(i) for i in range(tok.vocab_size)
                   if tok.token_attr(i) & (ATTR_CONTROL | ATTR_USER_DEFINED)]
        special = rng.sample(special, min(40, len(special)))
        out[name] = special + [s[: len(s) // 2] for s in special] + [
            " ", "  ", "\n", "\r\n", "\t", "\x00", "\u2581", "\ud800", "e\u0301", "'s", "123",
            "a", "中", "🙂", "<", ">", "|"]
    return out


@pytest.mark.parametrize("model", MODELS)
@_SETTINGS
@given(data=st.data(), parse_special=st.booleans())
def test_special_token_look_alikes(toks, pieces, model, data, parse_special):
    parts = data.draw(st.lists(st.sampled_from(pieces[model]), max_size=30))
    _check(toks[model], "".join(parts), parse_special)


def test_input_errors_are_clear(toks):
    for tok in toks.values():
        for bad in ("lone \ud800 surrogate", "\udfff", "a\udc80b"):
            with pytest.raises(TokenizerError, match="not encodable as UTF-8"):
                tok.encode(bad)
        for bad in (b"bytes", None, 7):
            with pytest.raises(TokenizerError, match="text must be a str"):
                tok.encode(bad)
        assert tok.encode("\x00" * 10, add_special=False)  # NULs are text like any other


def _timed(tok: Tokenizer, text: str, parse_special: bool = False) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    ids = tok.encode(text, parse_special=parse_special)
    return ids, time.perf_counter() - t0


@pytest.mark.parametrize("model", MODELS)
def test_100k_repeated_characters(toks, model):
    tok = toks[model]
    for ch in ["a", " ", "\n", "1", "<", "é", "中", "🙂", "\u2581", "\x00", "ab", "a "]:
        ids, seconds = _timed(tok, ch * 100_000, parse_special=True)
        print(f"{model} {ch!r} x100k: {len(ids)} ids in {seconds:.2f} s")
        assert ids and seconds < HANG
        assert tok.decode(ids, skip_special=True).replace("\u2581", " ") \
            == (ch * 100_000).replace("\u2581", " ")


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_a_megabyte_of_one_character(toks, model):
    tok = toks[model]
    for ch in ["a", " "]:  # the costliest of the characters measured
        ids, seconds = _timed(tok, ch * (1 << 20))
        print(f"{model} {ch!r} x1M: {len(ids)} ids in {seconds:.2f} s")
        assert ids and seconds < HANG


@pytest.mark.slow
def test_many_distinct_special_tokens_are_linear(toks):
    """Gemma's 6,414 special tokens, each in the text 20 times (1.6 MB): splitting them
    out once walked every fragment for every token (~200 s at this size; 53 s at half)."""
    tok = toks["gemma"]
    special = [i for i in range(tok.vocab_size)
               if tok.token_attr(i) & (ATTR_CONTROL | ATTR_USER_DEFINED)]
    text = "x".join(tok.token_text(i) for i in special) * 20
    ids, seconds = _timed(tok, text, parse_special=True)
    print(f"gemma: {len(special)} special tokens x20, {len(text)} chars: {seconds:.2f} s")
    assert seconds < HANG and len(ids) > 20 * len(special)


# The pre-tokenizers and models added for llama.cpp's vocab suite: each splitter alone (no
# vocabulary needed), and the two new encoders on the suite's own files.
NEW_PRES = ["deepseek-llm", "deepseek-coder", "falcon", "qwen35", "gemma4"]
_RUNS = ["a", " ", "\n", "1", "é", "中", "\u3000", "a ", ". ", " \u3000"]


@pytest.mark.parametrize("pre", NEW_PRES)
def test_new_splitters_on_100k_runs(pre):
    # deepseek-llm's `\s+$` as a backtracking regex retried every run of spaces from each of
    # its positions: quadratic (a 100k-space run before a letter never ends).
    splitter = PreTokenizer(family_of(pre)[0])
    for ch in _RUNS:
        text = ch * 100_000 + "x"
        t0 = time.perf_counter()
        words = splitter.split(text)
        seconds = time.perf_counter() - t0
        print(f"{pre} {ch!r} x100k: {len(words)} words in {seconds:.2f} s")
        assert "".join(words) == text and seconds < HANG


@pytest.fixture(scope="module")
def suite_toks():
    d = vocab_suite_dir()
    if not d.is_dir():
        pytest.skip(f"llama.cpp's vocab suite is not in {d}: run "
                    "`python scripts/fetch_models.py --vocab-suite`")
    out = {}
    for name in ("bert-bge", "gemma-4"):
        with GGUFFile(d / f"ggml-vocab-{name}.gguf") as f:
            out[name] = Tokenizer.from_metadata(f.metadata)
    return out


@pytest.mark.parametrize("model", ["bert-bge", "gemma-4"])
def test_new_models_on_100k_runs(suite_toks, model):
    tok = suite_toks[model]
    for ch in _RUNS + ["🙂", "\u0301", "\x00"]:
        ids, seconds = _timed(tok, ch * 100_000 + "x", parse_special=True)
        print(f"{model} {ch!r} x100k: {len(ids)} ids in {seconds:.2f} s")
        assert ids and seconds < HANG


@pytest.mark.parametrize("model", ["bert-bge", "gemma-4"])
@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=st.text(_every_code_point, max_size=200), parse_special=st.booleans())
def test_new_models_on_any_unicode(suite_toks, model, text, parse_special):
    _check(suite_toks[model], text, parse_special)
