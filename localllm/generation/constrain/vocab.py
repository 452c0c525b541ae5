"""A model's vocabulary as the constraint sees it: each token's bytes, which tokens may never
appear inside constrained text (control, unknown, unused, empty), the end-of-generation
ids, and a byte trie of the rest so that shared prefixes are walked once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from localllm.kernels import grammar as kg


@dataclass(frozen=True)
class TokenVocab:
    """Token bytes and their trie; build once per model (``Model.token_vocab`` caches it).

    Attributes:
        size: vocabulary size (width of masks).
        flat, off: token t's bytes are flat[off[t]:off[t+1]] (empty for unusable tokens).
        usable: bool (size,): tokens that may be part of constrained text.
        eog: int32 ids that end generation (allowed only once the text is complete).
        trie: the usable tokens' byte trie.
    """
    size: int
    flat: np.ndarray
    off: np.ndarray
    usable: np.ndarray
    eog: np.ndarray
    trie: kg.Trie

    @property
    def max_len(self) -> int:
        return int(np.max(self.off[1:] - self.off[:-1], initial=0))

    def token_bytes(self, t: int) -> bytes:
        return self.flat[self.off[t]:self.off[t + 1]].tobytes()

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "TokenVocab":
        """Args:
            tokenizer: a localllm.text.tokenizer.Tokenizer. Pieces are what its decoder emits for
                each token (byte-level BPE bytes, SentencePiece text with byte fallback);
                control, unknown and unused tokens are excluded.
        Returns:
            the TokenVocab.
        """
        from localllm.text.tokenizer import ATTR_CONTROL, ATTR_UNKNOWN, ATTR_UNUSED
        bad = ATTR_CONTROL | ATTR_UNKNOWN | ATTR_UNUSED
        n = tokenizer.vocab_size
        excluded = [i for i in range(n) if tokenizer.token_attr(i) & bad]
        pieces = [tokenizer.token_to_piece(i) for i in range(n)]
        return cls.from_pieces(pieces, sorted(tokenizer.eog_ids), excluded)

    @classmethod
    def from_pieces(cls, pieces: Sequence[bytes], eog: Iterable[int],
                    excluded: Iterable[int] = ()) -> "TokenVocab":
        """Args:
            pieces: each token's bytes, by id.
            eog: end-of-generation ids.
            excluded: ids never allowed inside constrained text.
        Returns:
            the TokenVocab (tokens with empty pieces are excluded too).
        """
        n = len(pieces)
        eog = np.array(sorted(set(int(t) for t in eog)), np.int32)
        usable = np.array([len(p) > 0 for p in pieces], bool)
        usable[list(excluded)] = False
        usable[eog] = False
        lens = np.array([len(p) if u else 0 for p, u in zip(pieces, usable)], np.int64)
        off = np.zeros(n + 1, np.int64)
        np.cumsum(lens, out=off[1:])
        flat = np.frombuffer(b"".join(p for p, u in zip(pieces, usable) if u), np.uint8).copy()
        order = np.array(sorted(np.flatnonzero(usable).tolist(), key=lambda t: pieces[t]), np.int64)
        byte, depth, end, tok_node = kg.build_trie(flat, off, order)
        tok_off = np.searchsorted(tok_node, np.arange(byte.size + 1)).astype(np.int32)
        trie = kg.Trie(byte, depth, end, tok_off, order.astype(np.int32))
        return cls(n, flat, off, usable, eog, trie)
