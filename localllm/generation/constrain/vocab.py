"""A model's vocabulary as the constraint sees it: each token's bytes, which tokens may never
appear inside constrained text (control, unknown, unused, empty), the end-of-generation
ids, and a byte trie of the rest so that shared prefixes are walked once."""

from __future__ import annotations

from dataclasses import dataclass, field
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
        controls: (text, id) of the control tokens that do not end generation (their text
            as the model's template writes it, e.g. "[TOOL_CALLS]"); excluded from
            ``usable`` unless a grammar names them (``with_stand_ins``).
    """
    size: int
    flat: np.ndarray
    off: np.ndarray
    usable: np.ndarray
    eog: np.ndarray
    trie: kg.Trie
    controls: tuple = ()
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

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
        eog = set(tokenizer.eog_ids)
        controls = tuple((pieces[i].decode("utf-8", "replace"), i) for i in excluded
                         if tokenizer.token_attr(i) & ATTR_CONTROL and pieces[i]
                         and i not in eog)
        return cls.from_pieces(pieces, sorted(eog), excluded, controls)

    @classmethod
    def from_pieces(cls, pieces: Sequence[bytes], eog: Iterable[int],
                    excluded: Iterable[int] = (), controls: Iterable = ()) -> "TokenVocab":
        """Args:
            pieces: each token's bytes, by id.
            eog: end-of-generation ids.
            excluded: ids never allowed inside constrained text.
            controls: (text, id) of control tokens a grammar may name (see ``controls``).
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
        return cls(n, flat, off, usable, eog, trie, tuple(controls))

    def with_stand_ins(self, ids: Iterable[int]) -> tuple["TokenVocab", dict[int, str]]:
        """This vocabulary with some control tokens usable, each as the text of one stand-in
        character, so that a grammar can name the token itself (a tool call's marker).

        Stand-ins are UTF-16 surrogates (U+D800 on): no text holds them and no grammar's
        character class does, so only the grammar's own literal matches one. Tokens that
        end in a lone 0xED byte (which could begin a surrogate's bytes) are left out.

        Args:
            ids: control token ids (from ``controls``).
        Returns:
            (the vocabulary, built once per set of ids; {id: its stand-in character}).
        """
        ids = tuple(sorted(set(int(i) for i in ids)))
        stand = {t: chr(0xD800 + k) for k, t in enumerate(ids)}
        got = self._derived.get(ids)
        if got is None:
            pieces = [self.token_bytes(t) for t in range(self.size)]
            excluded = [t for t in range(self.size) if not self.usable[t] and t not in stand
                        or pieces[t][-1:] == b"\xed"]
            for t, ch in stand.items():
                pieces[t] = ch.encode("utf-8", "surrogatepass")
            got = self._derived[ids] = TokenVocab.from_pieces(pieces, self.eog, excluded,
                                                              self.controls)
        return got, stand
