"""WordPiece encoding for `tokenizer.ggml.model = "bert"` vocabularies, as llama.cpp's
llm_tokenizer_wpm: BERT's normalizer (optional lowercasing and accent stripping), split on
whitespace and punctuation, then greedy longest-match over "▁"-prefixed words."""

from __future__ import annotations

import unicodedata
from typing import Mapping

import numpy as np

from localllm.text.tokenizer_unicode import class_table

# Classes of localllm.text.tokenizer_unicode
_NUMBER, _LETTER, _PUNCT, _MARK, _SYMBOL, _SEP, _OTHER, _SPACE = 1, 2, 3, 4, 5, 6, 7, 8

# What the normalizer does with a code point: 0 append to the word, 1 end the word
# (whitespace), 2 drop it (NUL, U+FFFD, control/format/private/surrogate), 3 a word on
# its own (punctuation, ASCII symbols, CJK ideographs), 4 a mark (dropped when stripping).
_APPEND, _BREAK, _DROP, _ALONE, _MARK_ACT = 0, 1, 2, 3, 4

# The CJK ranges BERT isolates (llama.cpp keeps the Hugging Face bound 0x2B920 for Ext. E).
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))

_ACTIONS: np.ndarray | None = None


def _actions() -> np.ndarray:
    global _ACTIONS
    if _ACTIONS is None:
        cls = class_table()
        act = np.zeros(len(cls), dtype=np.uint8)
        act[cls == _SPACE] = _BREAK
        act[cls == _OTHER] = _DROP
        act[cls == _MARK] = _MARK_ACT
        act[cls == _PUNCT] = _ALONE
        sym = np.flatnonzero(cls[:0x7F] == _SYMBOL)
        act[sym] = _ALONE
        for lo, hi in _CJK:
            act[lo:hi + 1] = np.where(act[lo:hi + 1] == _APPEND, _ALONE, act[lo:hi + 1])
        act[0] = act[0xFFFD] = _DROP
        act.setflags(write=False)
        _ACTIONS = act
    return _ACTIONS


def _lower(c: str) -> str:
    # llama.cpp's unicode_tolower is the simple (one code point) mapping of UnicodeData.
    low = c.lower()
    if len(low) == 1:
        return low
    return "i" if c == "\u0130" else c


def _first_of_nfd(c: str) -> str:
    # llama.cpp keeps only the first code point of each character's decomposition.
    return unicodedata.normalize("NFD", c)[0]


def preprocess(text: str, lowercase: bool, strip_accents: bool) -> list[str]:
    """Split text into words as llama.cpp's WPM `preprocess`.

    Args:
        text: the raw text (one fragment between special tokens).
        lowercase: map every code point to its simple lowercase.
        strip_accents: reduce each code point to its decomposition's first code point and
            drop combining marks.
    Returns:
        the non-empty words, in order.
    """
    if strip_accents and not text.isascii():
        text = "".join(_first_of_nfd(c) for c in text)
    act = _actions()
    words: list[str] = []
    cur: list[str] = []
    for c in text:
        a = act[ord(c)]
        if a == _APPEND or (a == _MARK_ACT and not strip_accents):
            cur.append(_lower(c) if lowercase else c)
        elif a == _BREAK:
            if cur:
                words.append("".join(cur))
                cur = []
        elif a == _ALONE:
            if cur:
                words.append("".join(cur))
                cur = []
            words.append(_lower(c) if lowercase else c)
        # _DROP, or a mark while stripping accents: nothing
    if cur:
        words.append("".join(cur))
    return words


class WPMEncoder:
    """Greedy longest-match WordPiece over words prefixed with "▁" (llama.cpp's vocabulary
    spelling of a word start); a word with any unmatched position becomes one UNK."""

    def __init__(self, vocab: Mapping[str, int], unk_id: int | None, lowercase: bool,
                 strip_accents: bool):
        self.vocab = vocab
        self.unk_id = unk_id
        self.lowercase = lowercase
        self.strip_accents = strip_accents
        self.max_len = max((len(t) for t in vocab), default=1)

    def encode(self, text: str) -> list[int]:
        """Returns: token ids of one raw text fragment."""
        out: list[int] = []
        for word in preprocess(text, self.lowercase, self.strip_accents):
            out.extend(self.word_ids(word))
        return out

    def word_ids(self, word: str) -> list[int]:
        """Returns: the ids of one pre-processed word (UNK alone if it cannot be matched)."""
        w = "\u2581" + word
        n, vocab, longest = len(w), self.vocab, self.max_len
        ids: list[int] = []
        i = 0
        while i < n:
            for j in range(min(n, i + longest), i, -1):
                tid = vocab.get(w[i:j])
                if tid is not None:
                    ids.append(tid)
                    i = j
                    break
            else:
                ids = []
                break
        if not ids:
            # llama.cpp pushes its UNK id even when the vocabulary has none (-1); here a
            # vocabulary without UNK simply yields nothing for the word.
            return [self.unk_id] if self.unk_id is not None else []
        return ids
