"""Fill-in-the-middle prompts (text/fim.py) against llama-server's format_prompt_infill as
scripts/fixtures_embeddings.py rebuilt it with llama.cpp's tokenizer and FIM tokens:
suffix-first order (--spm-infill) with a BOS, and repo-level context without a file
separator token ("--- snippet ---" between chunks), on SmolLM2's vocabulary."""

import json
from pathlib import Path

import pytest

from localllm.testing import synthetic, synthetic_encoders as se
from localllm.text.fim import CHUNK_SEPARATOR, ExtraFile, infill_tokens
from localllm.text.tokenizer import Tokenizer

FIXTURES = Path(__file__).parents[1] / "fixtures" / "embeddings"
VARIANTS = json.loads((FIXTURES / "infill_variants.json").read_text())


def _tokenizer(metas, case: dict) -> Tokenizer:
    """The tokenizer of the synthetic llama3 file the fixture was made on (SmolLM2's vocabulary
    under llama3's pre-tokenizer name, with the case's FIM tokens and add_bos)."""
    meta = se.with_fim_tokens(metas["smollm"], drop=tuple(case["drop"]), add_bos=case["add_bos"])
    return Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": synthetic.SPECS["llama3"].pre})


def _ids(tok: Tokenizer, spm: bool) -> list[int]:
    req = VARIANTS["request"]
    extra = [ExtraFile(e["filename"], e["text"]) for e in req["input_extra"]]
    return infill_tokens(tok, req["input_prefix"], req["input_suffix"], extra, req["prompt"],
                         spm=spm)


@pytest.mark.parametrize("name", sorted(VARIANTS["cases"]))
def test_infill_prompt_matches_llama_server(metas, name):
    case = VARIANTS["cases"][name]
    assert _ids(_tokenizer(metas, case), case["spm"]) == case["ids"]


def test_spm_puts_the_suffix_first_after_bos(metas):
    case = VARIANTS["cases"]["spm_bos"]
    tok = _tokenizer(metas, case)
    ids = case["ids"]
    i = ids.index(se.FIM_IDS["fim_suf"])
    assert ids[i - 1] == tok.bos_id and ids[i - 2] != tok.bos_id
    assert ids.index(se.FIM_IDS["fim_pre"]) > i and ids[-1] == se.FIM_IDS["fim_mid"]
    # the same tokenizer in PSM order: the prefix part leads, after the same BOS
    psm = _ids(tok, spm=False)
    assert psm[i - 1] == tok.bos_id and psm[i] == se.FIM_IDS["fim_pre"]
    assert sorted(psm) == sorted(ids)


@pytest.mark.parametrize("name", ["no_sep", "no_sep_no_rep_spm"])
def test_chunks_without_a_file_separator_take_the_snippet_line(metas, name):
    case = VARIANTS["cases"][name]
    tok = _tokenizer(metas, case)
    assert tok.special_id("fim_sep") is None and tok.special_id("fim_rep") is not None
    snippet = tok.encode(CHUNK_SEPARATOR, add_special=False)
    ids, n = case["ids"], len(snippet)
    starts = [k for k in range(len(ids) - n + 1) if ids[k:k + n] == snippet]
    assert len(starts) == len(VARIANTS["request"]["input_extra"])
    assert ids[0] == tok.special_id("fim_rep")
