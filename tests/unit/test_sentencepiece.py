"""Gemma 3's SentencePiece-family tokenizer against the `sentencepiece` package, loaded with
a model built from the same GGUF vocabulary, scores and token types, on the fixture corpus
and generated texts. Where the two differ, llama.cpp is the judge: each difference belongs
to one of the named cases below, and there our ids are llama.cpp's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sentencepiece import sentencepiece_model_pb2 as pb

from localllm.text.tokenizer import ATTR_CONTROL, TYPE_USER_DEFINED, Tokenizer

from localllm.testing import fixture_texts  # noqa: E402

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "tokenizer" / "gemma_ids.json")
                     .read_text(encoding="utf-8"))
SPACE_MARK = "\u2581"

# Where sentencepiece and llama.cpp part ways on the same vocabulary, and why. Each case
# names the texts it can touch; `llama_cpp_model` below undoes the first two in the model
# given to sentencepiece, after which only texts of the third case may still differ.
CASES = {
    "whitespace runs": (
        "Gemma's 60 user-defined tokens for runs of 2-31 spaces are spelled with ASCII "
        "spaces. llama.cpp matches user-defined tokens in the raw text, before spaces become "
        "U+2581; sentencepiece matches them after, so it never emits them and spells a run "
        "as single U+2581 pieces.",
        lambda text: "  " in text),
    "</s> is a control token": (
        "'</s>' is user-defined in the file; llama.cpp makes every end-of-generation text "
        "a control token at load, and control tokens are not matched in plain text, so it "
        "spells '</s>' from its characters where sentencepiece emits the one piece.",
        lambda text: "</s>" in text),
    "typed U+2581": (
        "A U+2581 typed in the text is a space to sentencepiece's model but not to "
        "llama.cpp's user-defined matching, so next to a space or another U+2581 the two "
        "group the run differently.",
        lambda text: SPACE_MARK in text),
}


@pytest.fixture(scope="module")
def gemma(metas):
    return metas["gemma"], Tokenizer.from_metadata(metas["gemma"])


def _processor(meta, tok: Tokenizer, as_llama_cpp: bool) -> sentencepiece.SentencePieceProcessor:
    """A SentencePiece BPE model of the GGUF's vocabulary: its pieces, scores and types,
    normalization off (Gemma 3's own), no dummy prefix (the file's add_space_prefix).
    With `as_llama_cpp`, the two vocabulary cases above are undone: whitespace-run pieces
    are spelled with U+2581 and tokens llama.cpp made control are control."""
    m = pb.ModelProto()
    t = m.trainer_spec
    t.model_type = pb.TrainerSpec.BPE
    t.vocab_size = tok.vocab_size
    t.byte_fallback = True
    t.unk_id, t.bos_id, t.eos_id = tok.unk_id, tok.bos_id, tok.eos_id
    t.pad_id = meta["tokenizer.ggml.padding_token_id"]
    n = m.normalizer_spec
    n.name = "identity"
    n.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    n.remove_extra_whitespaces = False
    n.escape_whitespaces = True
    types = meta["tokenizer.ggml.token_type"].tolist()
    for i, (text, score) in enumerate(zip(meta["tokenizer.ggml.tokens"],
                                          meta["tokenizer.ggml.scores"].tolist())):
        kind = types[i]
        if as_llama_cpp:
            if kind == TYPE_USER_DEFINED and not text.strip(" "):
                text = text.replace(" ", SPACE_MARK)
            if tok.token_attr(i) & ATTR_CONTROL:
                kind = pb.ModelProto.SentencePiece.CONTROL
        piece = m.pieces.add()
        piece.piece, piece.score, piece.type = text, score, kind
    return sentencepiece.SentencePieceProcessor(model_proto=m.SerializeToString())


@pytest.fixture(scope="module")
def processors(gemma):
    meta, tok = gemma
    return {"plain": _processor(meta, tok, False), "as llama.cpp": _processor(meta, tok, True)}


def _corpus() -> list[tuple[str, list[int] | None]]:
    """The fixture's corpus and fuzz texts with llama.cpp's ids, and 3000 generated texts."""
    texts = [(c["text"], c["p"]) for c in FIXTURE["cases"]]
    return texts + [(t, None) for t in fixture_texts.fuzz(20_250, 3000)]


def test_the_model_is_the_files_vocabulary(gemma, processors):
    meta, tok = gemma
    sp = processors["plain"]
    assert sp.get_piece_size() == tok.vocab_size == len(meta["tokenizer.ggml.tokens"])
    for i in (0, 2, 106, 255, 4000, tok.vocab_size - 1):
        assert sp.id_to_piece(i) == meta["tokenizer.ggml.tokens"][i]
        assert sp.get_score(i) == pytest.approx(float(meta["tokenizer.ggml.scores"][i]))


def test_every_difference_is_a_named_case_and_llama_cpp_agrees_with_us(gemma, processors):
    _, tok = gemma
    sp = processors["plain"]
    counts = dict.fromkeys(CASES, 0)
    unexplained, judged = [], 0
    corpus = _corpus()
    for text, llama_ids in corpus:
        ours = tok.encode(text, add_special=False)
        if sp.encode(text) == ours:
            continue
        cases = [name for name, (_, touches) in CASES.items() if touches(text)]
        if not cases:
            unexplained.append(text)
        for name in cases:
            counts[name] += 1
        if llama_ids is not None:
            assert ours == llama_ids, text
            judged += 1
    differ = sum(1 for text, _ in corpus if sp.encode(text) != tok.encode(text, add_special=False))
    print(f"{len(corpus)} texts, {differ} differ from sentencepiece ({judged} judged by "
          f"llama.cpp's ids); by case: {counts}")
    assert not unexplained, f"{len(unexplained)} differences no case explains: {unexplained[:5]}"
    assert all(counts.values())  # each case is real on this corpus


def test_with_llama_cpps_vocabulary_handling_only_typed_space_marks_differ(gemma, processors):
    _, tok = gemma
    sp = processors["as llama.cpp"]
    touched = CASES["typed U+2581"][1]
    bad = [text for text, _ in _corpus()
           if sp.encode(text) != tok.encode(text, add_special=False) and not touched(text)]
    assert not bad, f"{len(bad)} differ: {bad[:5]}"


_PIECES = [" ", "  ", "   ", "\n", "\n\n", "\t", "a", "ab", "the", "The", "Hello", "world",
           "123", "3.14", "'s", ",", ".", "!", "?", "-", "_", "<", ">", "</s>", "<s>", "<bos>",
           "<start_of_turn>", "[multimodal]", "é", "ü", "中文", "日本語", "한국어", "مرحبا",
           "नमस्ते", "😀", "👩‍💻", "\u200d", "\x00", "\x7f", "\u00a0", "\u3000", "\U0010fffd"]


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(st.sampled_from(_PIECES),
                                st.characters(codec="utf-8", exclude_characters=SPACE_MARK)),
                      max_size=40))
def test_generated_text_matches_sentencepiece(gemma, processors, parts):
    """Outside the named cases, our merges are sentencepiece's BPE, id for id."""
    _, tok = gemma
    text = "".join(parts)
    assert processors["as llama.cpp"].encode(text) == tok.encode(text, add_special=False)
