"""Streaming detokenization for localllm.text.tokenizer: text that is final token by
token, joining to the one-shot decode, and llama.cpp's space cleaning."""

from __future__ import annotations

import codecs
import re
from typing import Any

_CLEAN_1 = re.compile(rb" (?=[?!.,])")
_CLEAN_2 = re.compile(rb" ' ")
_CLEAN_3 = re.compile(rb" (?='(?:[sm]|re|ve))")


def clean_up_spaces(raw: bytes) -> bytes:
    """Returns: llama.cpp's clean_up_tokenization_spaces of raw bytes: " ." -> ".",
    " ' " -> "'", " 's" -> "'s"."""
    return _CLEAN_3.sub(b"", _CLEAN_2.sub(b"'", _CLEAN_1.sub(b"", raw)))


class StreamDecoder:
    """Incremental detokenization: `feed(id)` returns the text that is final so far.

    Never emits half a UTF-8 character; a trailing EOS the model adds is held until the
    next token (or dropped at `flush` with skip_special); with space cleaning, text is
    held until the characters after it are known. `"".join(feeds) + flush()` equals
    `Tokenizer.decode(all_ids, skip_special)`.
    """

    # `tok` is the localllm.text.tokenizer.Tokenizer (not imported: that module imports this)
    def __init__(self, tok: Any, skip_special: bool = False, continuation: bool = False,
                 clean_spaces: bool = True):
        self._tok = tok
        self._clean = tok.clean_spaces and clean_spaces
        self._skip = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = not continuation
        self._remove_space = tok.add_space_prefix and not continuation
        self._held_eos = False
        self._pending = b""  # raw bytes not yet through space cleaning

    def feed(self, id: int) -> str:
        """Add one token id. Returns: newly final text (possibly "")."""
        tok = self._tok
        out = b""
        if self._held_eos:
            self._held_eos = False
            out += self._piece(tok.eos_id)
        if self._first:
            self._first = False
            if self._skip and tok.add_bos and id == tok.bos_id:
                self._remove_space = False
                return ""
        if self._skip and tok.add_eos and id == tok.eos_id:
            self._held_eos = True
        else:
            out += self._piece(id)
        return self._emit(out, final=False)

    def flush(self) -> str:
        """Returns: whatever is still held (an incomplete UTF-8 tail becomes U+FFFD)."""
        self._held_eos = False  # a trailing EOS is dropped, as in one-shot decode
        return self._emit(b"", final=True)

    def _piece(self, id: int) -> bytes:
        piece = self._tok.token_to_piece(id, not self._skip)
        if self._remove_space:
            self._remove_space = False
            if piece[:1] == b" ":
                piece = piece[1:]
        return piece

    def _emit(self, raw: bytes, final: bool) -> str:
        if self._clean:
            buf = self._pending + raw
            cut = len(buf) if final else _clean_cut(buf)
            self._pending = buf[cut:]
            raw = clean_up_spaces(buf[:cut])
        return self._utf8.decode(raw, final=final)


def _clean_cut(buf: bytes) -> int:
    """Returns: the longest prefix length after which space cleaning cannot change.

    The cleaning rules look at most two bytes past a space or apostrophe; cutting after
    a byte that is none of " ", "'", "r", "v" keeps every rule on one side of the cut.
    """
    for k in range(len(buf), 0, -1):
        if buf[k - 1] not in b" 'rv":
            return k
    return 0
