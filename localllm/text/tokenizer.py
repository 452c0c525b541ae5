"""Tokenizer from GGUF metadata (`tokenizer.ggml.*`), token for token what llama.cpp does:
vocabulary, special tokens, encoding, detokenization and streaming detokenization
(pre-tokenizers and merge engines are in `localllm.text.tokenizer_bpe`)."""

from __future__ import annotations

import bisect
import codecs
import os
import re
from array import array
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from localllm.errors import TokenizerError
from localllm.text.tokenizer_bpe import (
    CHAR_TO_BYTE,
    BPEMerger,
    PreTokenizer,
    SPMMerger,
    byte_encode,
    family_of,
)

# GGUF token types (tokenizer.ggml.token_type)
TYPE_UNDEFINED, TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL = 0, 1, 2, 3
TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = 4, 5, 6

# llama.cpp's token attribute bits (llama_token_attr)
ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL = 1, 2, 4, 8
ATTR_USER_DEFINED, ATTR_BYTE, ATTR_NORMALIZED = 16, 32, 64
ATTR_LSTRIP, ATTR_RSTRIP, ATTR_SINGLE_WORD = 128, 256, 512
_ATTR_OF_TYPE = {TYPE_UNKNOWN: ATTR_UNKNOWN, TYPE_UNUSED: ATTR_UNUSED, TYPE_NORMAL: ATTR_NORMAL,
                 TYPE_CONTROL: ATTR_CONTROL, TYPE_USER_DEFINED: ATTR_USER_DEFINED,
                 TYPE_BYTE: ATTR_BYTE}

# Token texts llama.cpp recognises at load time (llama-vocab.cpp). Each found token is
# forced to control type; the end-of-generation list adds to eog_ids.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")
_C_SPACE = " \t\n\x0b\x0c\r"  # isspace() in the C locale
_CLEAN_1 = re.compile(rb" (?=[?!.,])")
_CLEAN_2 = re.compile(rb" ' ")
_CLEAN_3 = re.compile(rb" (?='(?:[sm]|re|ve))")
_BYTE_TEXT = re.compile("<0x[0-9A-Fa-f]{2}>")


def _as_list(arr, n: int, conv) -> list:
    """Returns: the first n entries of a numpy array or sequence as Python numbers."""
    if hasattr(arr, "tolist"):
        return [conv(x) for x in arr[:n].tolist()]
    return [conv(x) for x in list(arr)[:n]]


def _key(meta: Mapping[str, Any], name: str, default=None):
    return meta.get("tokenizer.ggml." + name, default)


def _numbers(meta: Mapping[str, Any], name: str, n: int, kinds: str) -> np.ndarray | None:
    """Returns: a per-token numeric array (None if absent), checked to have n entries."""
    value = _key(meta, name)
    if value is None:
        return None
    arr = np.asarray(value) if isinstance(value, (list, np.ndarray)) else None
    if arr is None or arr.ndim != 1 or (arr.size and arr.dtype.kind not in kinds):
        raise TokenizerError(f"tokenizer.ggml.{name} is not an array of numbers")
    if len(arr) != n:
        raise TokenizerError(f"tokenizer.ggml.{name} has {len(arr)} entries for {n} tokens")
    return arr


class Tokenizer:
    """Encode and decode text exactly as llama.cpp does for the same GGUF file.

    Attributes:
        vocab_size: number of tokens.
        bos_id, eos_id, eot_id: special ids (None when the vocabulary has none).
        eog_ids: every id that ends generation (llama.cpp's `llama_vocab_is_eog`).
        add_bos, add_eos: whether `encode(add_special=True)` adds them.
        model, pre: `tokenizer.ggml.model` and `.pre`.
    """

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any],
                      cache_dir: str | os.PathLike | None = None) -> "Tokenizer":
        """Build the tokenizer from a GGUF metadata mapping.

        Args:
            meta: GGUF metadata: scalars, string lists, numeric arrays.
            cache_dir: accepted for derived data; nothing needs caching at present.
        Returns:
            the Tokenizer.
        Raises:
            TokenizerError: unsupported `tokenizer.ggml.model` / `.pre`, or bad arrays.
        """
        del cache_dir  # building is fast enough without a disk cache (see tests)
        return cls(meta)

    def __init__(self, meta: Mapping[str, Any]):
        if _key(meta, "model") is None:
            raise TokenizerError("metadata key 'tokenizer.ggml.model' is missing")
        self.model = str(_key(meta, "model"))
        tokens = _key(meta, "tokens")
        if tokens is None or not len(tokens):
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError("tokenizer.ggml.tokens is not an array of strings")
        n = len(tokens)
        self.vocab_size = n
        types = _numbers(meta, "token_type", n, "iu")
        scores = _numbers(meta, "scores", n, "fiu")
        if scores is not None and not np.isfinite(scores).all():
            i = int(np.flatnonzero(~np.isfinite(scores))[0])
            raise TokenizerError(f"tokenizer.ggml.scores[{i}] is {scores[i]}, not a finite number")
        # llama.cpp renames empty tokens; a later duplicate text wins the text->id map.
        self._text = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._vocab = {t: i for i, t in enumerate(self._text)}
        # Compact arrays (a 262k vocabulary as Python lists costs tens of MB); items read back
        # as Python ints and floats, float32 scores exactly.
        self._types = array("i", _as_list(types, n, int) if types is not None else [TYPE_NORMAL] * n)
        self._scores = array("f", np.asarray(scores, np.float32)[:n].tobytes()) \
            if scores is not None else array("f", bytes(4 * n))
        self._attr = array("i", [_ATTR_OF_TYPE.get(t, 0) for t in self._types])
        if types is not None:  # a byte token's text is decoded as hex on every use
            for i in np.flatnonzero(types == TYPE_BYTE).tolist():
                if not _BYTE_TEXT.fullmatch(self._text[i]):
                    raise TokenizerError(f"token {i} ({self._text[i]!r}) has the byte type but "
                                         "is not spelled <0xHH>")

        if self.model == "llama":
            self._spm = True
            defaults = {"bos": 1, "eos": 2, "unk": 0}
            self.add_space_prefix, self.clean_spaces, add_bos = True, False, True
            self.ignore_merges = False
            self.pre = str(_key(meta, "pre", "default"))
        elif self.model == "gpt2":
            self._spm = False
            defaults = {"bos": 11, "eos": 11, "unk": None}
            self.pre = str(_key(meta, "pre", ""))
            try:
                exprs, flags = family_of(self.pre)
            except KeyError:
                raise TokenizerError(
                    f"unsupported tokenizer.ggml.pre {self.pre!r} for a gpt2 tokenizer") from None
            self.add_space_prefix = False
            self.clean_spaces, self.ignore_merges = flags["clean_spaces"], flags["ignore_merges"]
            add_bos = bool(flags["add_bos"])
            self._pretok = PreTokenizer(exprs)
        else:
            raise TokenizerError(f"unsupported tokenizer.ggml.model {self.model!r} "
                                 "(supported: llama, gpt2)")
        self.add_space_prefix = bool(_key(meta, "add_space_prefix", self.add_space_prefix))
        self._special_ids(meta, defaults)
        self.add_bos = bool(_key(meta, "add_bos_token", add_bos))
        self.add_eos = bool(_key(meta, "add_eos_token", False))
        # llama.cpp appends SEP to rerank pairs for these pre-tokenizers (and WordPiece)
        sep_default = self.model == "bert" or self.pre in ("jina-v1-en", "jina-v2-code",
                                                           "roberta-bpe")
        self.add_sep = bool(_key(meta, "add_sep_token", sep_default))
        self._detect_by_text(meta)
        self._phi3_strip(meta)
        self._build_specials()
        self._pieces: dict[int, bytes] = {}  # filled on first use of each token
        if self._spm:
            glue = {t[i - 1] for t in self._vocab if "\u2581" in t[1:] for i in range(1, len(t))
                    if t[i] == "\u2581" and t[i - 1] != "\u2581"}
            self._spm_merger = SPMMerger(self._vocab, self._scores, self._spm_byte_token,
                                         "".join(glue))
        else:
            self._bpe = BPEMerger(self._vocab, self._ranks(_key(meta, "merges")), self.ignore_merges)

    # ------------------------------------------------------------------ loading

    def _special_ids(self, meta: Mapping[str, Any], defaults: dict) -> None:
        n = self.vocab_size
        ids = {}
        for name in ("bos", "eos", "eot", "eom", "unk", "sep", "pad", "mask", *_FIM_TEXTS):
            default = defaults.get(name)
            if default is not None and default >= n:
                default = None
            key = {"unk": "unknown", "pad": "padding", "sep": "seperator"}.get(name, name)
            value = _key(meta, f"{key}_token_id")
            if value is None and name in _FIM_TEXTS:  # deprecated names
                key = {"fim_pre": "prefix", "fim_suf": "suffix", "fim_mid": "middle"}.get(name)
                value = _key(meta, f"{key}_token_id") if key else None
            # llama.cpp warns and falls back to the default; a wrong id is refused here, so
            # it cannot surface as a bad token in the middle of a reply.
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value < n):
                raise TokenizerError(f"tokenizer.ggml.{key}_token_id is {value!r}, not a token "
                                     f"id of the {n}-token vocabulary")
            ids[name] = value if value is not None else default
        self._ids = ids
        self.bos_id, self.eos_id, self.unk_id = ids["bos"], ids["eos"], ids["unk"]

    def _force_control(self, tid: int) -> None:
        self._attr[tid] |= ATTR_CONTROL

    def _first_of(self, texts: Iterable[str]) -> int | None:
        # llama.cpp takes the first match in hash-map order; the lowest id is our stable pick.
        found = [self._vocab[t] for t in texts if t in self._vocab]
        return min(found) if found else None

    def _detect_by_text(self, meta: Mapping[str, Any]) -> None:
        ids = self._ids
        for name, texts in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), *_FIM_TEXTS.items()):
            if ids[name] is None:
                ids[name] = self._first_of(texts)
                if ids[name] is not None:
                    self._force_control(ids[name])
        for i, t in enumerate(self._text):  # control tokens named "unused" are unused
            if self._attr[i] & ATTR_CONTROL and "unused" in t:
                self._attr[i] |= ATTR_UNUSED
        eog = {ids[k] for k in ("fim_pad", "fim_rep", "fim_sep") if ids[k] is not None}
        for t in _EOG_TEXTS:
            tid = self._vocab.get(t)
            if tid is not None:
                eog.add(tid)
                self._force_control(tid)
        for t in _ALWAYS_RENDERED:
            if t in self._vocab:
                self._attr[self._vocab[t]] = ATTR_USER_DEFINED
        eog.update(ids[k] for k in ("eos", "eot", "eom") if ids[k] is not None)
        texts = {self._text[i]: i for i in eog}
        if "<|end|>" in texts and (("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
                                   or ("<|calls|>" in texts and "<|flush|>" in texts)):
            eog.discard(texts["<|end|>"])
            self._attr[texts["<|end|>"]] = ATTR_USER_DEFINED
        if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
            eog.discard(texts["</s>"])
            self._attr[texts["</s>"]] = ATTR_NORMAL
        self.eot_id = ids["eot"]
        self.eog_ids = frozenset(eog)

    def _phi3_strip(self, meta: Mapping[str, Any]) -> None:
        name = str(meta.get("general.name", "")).lower()
        if "phi-3" not in name and "phi3" not in name:
            return
        for i, a in enumerate(self._attr):
            if a & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN):
                self._attr[i] |= ATTR_RSTRIP
        for t, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
            if t in self._vocab:
                i = self._vocab[t]
                self._attr[i] = (self._attr[i] | ATTR_RSTRIP) if on else (self._attr[i] & ~ATTR_RSTRIP)

    def _build_specials(self) -> None:
        mask = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        ids = [i for i, a in enumerate(self._attr) if a & mask]
        # longest first (UTF-8 bytes), as llama.cpp's special-token cache is sorted
        ids.sort(key=lambda i: (-len(self._text[i].encode("utf-8")), i))
        self._special_order = {i: k for k, i in enumerate(ids)}
        self._special_prefixes = {self._text[i][:k] for i in ids for k in range(1, len(self._text[i]) + 1)}
        self._special_longest = max((len(self._text[i]) for i in ids), default=0)
        firsts = "".join(sorted({self._text[i][0] for i in ids}))
        self._special_first_re = re.compile("[" + re.escape(firsts) + "]") if firsts else None

    def _ranks(self, merges: Sequence[str] | None) -> dict[tuple[str, str], int]:
        if merges is None:
            raise TokenizerError("gpt2 tokenizer without tokenizer.ggml.merges")
        if not isinstance(merges, list):
            raise TokenizerError("tokenizer.ggml.merges is not an array of strings")
        ranks: dict[tuple[str, str], int] = {}
        vocab = self._vocab
        for i, m in enumerate(merges):
            pos = m.find(" ", 1) if isinstance(m, str) else -1
            pair = (m[:pos], m[pos + 1:]) if pos >= 0 else ("", "")
            # Each merge joins two tokens into a third; one naming text outside the
            # vocabulary means the merges belong to another vocabulary.
            if pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
                raise TokenizerError(f"tokenizer.ggml.merges[{i}] ({m!r}) is not two tokens "
                                     "of the vocabulary that join into a third")
            ranks.setdefault(pair, i)
        return ranks

    def _spm_byte_token(self, b: int) -> int:
        tid = self._vocab.get(f"<0x{b:02X}>")
        if tid is None:
            tid = self._vocab.get(chr(b)) if b < 0x80 else None
        if tid is None:
            raise TokenizerError(f"the vocabulary has no token for byte 0x{b:02X}")
        return tid

    def _make_piece(self, i: int) -> bytes:
        attr, text = self._attr[i], self._text[i]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            return text.encode("utf-8")
        if attr & ATTR_NORMAL:
            if self._spm:
                return text.replace("\u2581", " ").encode("utf-8")
            out = bytearray()
            for c in text:
                b = CHAR_TO_BYTE.get(c)
                if b is None:  # llama.cpp's marker for a character outside the byte alphabet
                    out += b"[UNK_BYTE_0x" + c.encode("utf-8").hex().encode() + text.encode() + b"]"
                else:
                    out.append(b)
            return bytes(out)
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""

    # ------------------------------------------------------------------ queries

    def token_text(self, id: int) -> str:
        """Returns: the vocabulary text of a token (as stored in the GGUF file)."""
        return self._text[id]

    def token_type(self, id: int) -> int:
        """Returns: the GGUF token type of a token (1 normal, 3 control, 4 user-defined, 6 byte...)."""
        return self._types[id]

    def token_attr(self, id: int) -> int:
        """Returns: llama.cpp's attribute bits for a token, after its load-time fixes."""
        return self._attr[id]

    def special_id(self, name: str) -> int | None:
        """A special token's id by llama.cpp's name (bos, eos, eot, sep, pad, fim_pre,
        fim_suf, fim_mid, fim_pad, fim_rep, fim_sep, ...), or None if the model has none."""
        return self._ids.get(name)

    def token_id(self, text: str) -> int | None:
        """Returns: the id of the token whose text is exactly `text`, or None."""
        return self._vocab.get(text)

    def is_eog(self, id: int) -> bool:
        """Returns: whether the token ends generation."""
        return id in self.eog_ids

    def is_special(self, id: int) -> bool:
        """Returns: whether the token is control or unknown (hidden by `skip_special`)."""
        return bool(self._attr[id] & (ATTR_CONTROL | ATTR_UNKNOWN))

    def token_to_piece(self, id: int, special: bool = True) -> bytes:
        """Returns: the bytes of one token, as llama.cpp's `llama_token_to_piece(lstrip=0)`.

        Control and unknown tokens give b"" unless `special`.
        """
        if not 0 <= id < self.vocab_size:
            raise TokenizerError(f"token id {id} out of range [0, {self.vocab_size})")
        if not special and self._attr[id] & (ATTR_CONTROL | ATTR_UNKNOWN):
            return b""
        piece = self._pieces.get(id)
        if piece is None:
            piece = self._pieces[id] = self._make_piece(id)
        return piece

    # ------------------------------------------------------------------ encode

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False,
               literal_spans: Sequence[tuple[int, int]] = ()) -> list[int]:
        """Tokenize text as llama.cpp's `llama_tokenize`.

        Args:
            text: the text.
            add_special: add BOS/EOS where the model asks for them (`add_bos`, `add_eos`).
            parse_special: match control tokens in the text (for rendered chat templates);
                off for user text, so typed "<|im_start|>" stays plain text. User-defined
                tokens are always matched, as in llama.cpp.
            literal_spans: (start, end) character ranges of `text` (the messages inside a
                rendered chat template, see ChatTemplate.render_with_spans) where control
                tokens are not matched even with parse_special. Text without control-token
                look-alikes in those ranges tokenizes exactly as without them.
        Returns:
            token ids.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"text must be a str, not {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TokenizerError(f"text is not encodable as UTF-8: {e}") from None
        out: list[int] = []
        if add_special and self.add_bos:
            if self.bos_id is None:
                raise TokenizerError("the model asks for BOS but has no BOS token")
            out.append(self.bos_id)
        prev_special = True
        for frag in self._partition(text, parse_special, literal_spans):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
                continue
            if self._spm:
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(self._spm_merger.encode(frag.replace(" ", "\u2581")))
            else:
                bpe = self._bpe
                for word in self._pretok.split(frag):
                    out.extend(bpe.word_ids(byte_encode(word)))
            prev_special = False
        if add_special and self.add_eos:
            if self.eos_id is None:
                raise TokenizerError("the model asks for EOS but has no EOS token")
            out.append(self.eos_id)
        return out

    def _candidates(self, text: str, parse_special: bool) -> list[int]:
        """Returns: the special tokens that occur in `text`, in llama.cpp's matching order."""
        if self._special_first_re is None:
            return []
        found: set[int] = set()
        skip = 0 if parse_special else (ATTR_CONTROL | ATTR_UNKNOWN)
        prefixes, order, n = self._special_prefixes, self._special_order, len(text)
        longest = self._special_longest
        seen: set[str] = set()  # windows already looked at: runs repeat them (" " * 10**6)
        for m in self._special_first_re.finditer(text):
            p = m.start()
            window = text[p:p + longest]
            if window in seen:
                continue
            if len(seen) >= 4096:
                seen.clear()
            seen.add(window)
            for end in range(p + 1, n + 1):  # every special token starting at p
                t = text[p:end]
                if t not in prefixes:
                    break
                tid = self._vocab.get(t)
                if tid is not None and tid in order and not self._attr[tid] & skip:
                    found.add(tid)
        return sorted(found, key=order.__getitem__)

    def _partition(self, text: str, parse_special: bool,
                   literal_spans: Sequence[tuple[int, int]] = ()) -> list[int | str]:
        """Split out special tokens as llama.cpp's `tokenizer_st_partition`.

        Tokens are taken longest first over the whole text (not leftmost first); each
        one is cut out of every remaining raw fragment, left to right. Only fragments
        where a token occurs are visited (llama.cpp walks every fragment for every
        token, which is quadratic in a text of many distinct special tokens).
        Returns: fragments: token ids and raw text pieces.
        """
        if not text:
            return []
        # frags[i] is a raw (start, end) range or a token id; starts[i] is where it begins.
        frags: list[int | tuple[int, int]] = [(0, len(text))]
        starts = [0]
        for tid in self._candidates(text, parse_special):
            tok, attr = self._text[tid], self._attr[tid]
            guarded = literal_spans if attr & (ATTR_CONTROL | ATTR_UNKNOWN) else ()
            p = text.find(tok)
            while p >= 0:
                i = bisect.bisect_right(starts, p) - 1
                frag = frags[i]
                nxt = starts[i + 1] if i + 1 < len(starts) else len(text)
                if not isinstance(frag, int) and p + len(tok) <= frag[1]:
                    pieces = _cut(text, frag[0], frag[1], tid, tok, attr, guarded)
                    frags[i:i + 1] = [f for f, _ in pieces]
                    starts[i:i + 1] = [at for _, at in pieces]
                # Whatever happened, no later occurrence in this fragment can be cut.
                p = text.find(tok, nxt)
        return [f if isinstance(f, int) else text[f[0]:f[1]] for f in frags]

    # ------------------------------------------------------------------ decode

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Detokenize as llama.cpp's `llama_detokenize(remove_special=skip_special,
        unparse_special=not skip_special)`.

        With `skip_special`, a leading BOS (when the model adds BOS) and a trailing EOS
        (when it adds EOS) are dropped and other control tokens render as nothing;
        without it, control tokens render as their text. Models with `add_space_prefix`
        lose one leading space of the first piece, unless a dropped BOS came first.
        Invalid UTF-8 (e.g. a lone byte token) becomes U+FFFD.
        """
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """Returns: the bytes `decode` decodes (llama_detokenize's raw output)."""
        ids = list(ids)
        remove_space = self.add_space_prefix
        if skip_special and self.add_bos and ids and ids[0] == self.bos_id:
            remove_space = False
            ids = ids[1:]
        if skip_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        parts = [self.token_to_piece(i, not skip_special) for i in ids]
        if parts and remove_space and parts[0][:1] == b" ":
            parts[0] = parts[0][1:]
        raw = b"".join(parts)
        return self._clean(raw) if self.clean_spaces else raw

    @staticmethod
    def _clean(raw: bytes) -> bytes:
        # llama.cpp's clean_up_tokenization_spaces: " ." -> ".", " ' " -> "'", " 's" -> "'s"
        return _CLEAN_3.sub(b"", _CLEAN_2.sub(b"'", _CLEAN_1.sub(b"", raw)))

    def stream(self, skip_special: bool = False, continuation: bool = False,
               clean_spaces: bool = True) -> "StreamDecoder":
        """Returns: an incremental detokenizer whose output joins to `decode(ids, skip_special)`.

        Args:
            skip_special: as in `decode`.
            continuation: the ids continue earlier ones (e.g. generated after a prompt): no
                leading BOS is dropped and no leading space stripped, so the text joins to
                `decode(prompt + ids)` minus `decode(prompt)` (for models without space cleaning).
            clean_spaces: False gives the pieces' bytes as they are, even for a model that
                cleans spaces (text produced under a grammar, checked byte for byte).
        """
        return StreamDecoder(self, skip_special, continuation, clean_spaces)


class StreamDecoder:
    """Incremental detokenization: `feed(id)` returns the text that is final so far.

    Never emits half a UTF-8 character; a trailing EOS the model adds is held until the
    next token (or dropped at `flush` with skip_special); with space cleaning, text is
    held until the characters after it are known. `"".join(feeds) + flush()` equals
    `Tokenizer.decode(all_ids, skip_special)`.
    """

    def __init__(self, tok: Tokenizer, skip_special: bool = False, continuation: bool = False,
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
            raw = Tokenizer._clean(buf[:cut])
        return self._utf8.decode(raw, final=final)


def _cut(text: str, start: int, end: int, tid: int, tok: str, attr: int,
         guarded: Sequence[tuple[int, int]]) -> list[tuple[int | tuple[int, int], int]]:
    """Cuts every occurrence of special token `tok` out of the raw fragment text[start:end],
    left to right, stripping neighbouring spaces as its attributes ask; occurrences that
    overlap a guarded span stay text.

    Returns: the pieces, each (raw (start, end) range or the token id, where it begins).
    """
    out: list[tuple[int | tuple[int, int], int]] = []
    search = start
    while True:
        at = text.find(tok, search, end)
        if at >= 0 and any(a < at + len(tok) and at < b for a, b in guarded):
            search = at + 1
            continue
        if at < 0:
            out.append(((start, end), start))
            break
        left_end = at
        if attr & ATTR_LSTRIP:
            while left_end > start and text[left_end - 1] in _C_SPACE:
                left_end -= 1
        if left_end > start:
            out.append(((start, left_end), start))
        out.append((tid, at))
        start = search = at + len(tok)
        if attr & ATTR_RSTRIP:
            while start < end and text[start] in _C_SPACE:
                start += 1
        if start >= end:
            break
    return out


def _clean_cut(buf: bytes) -> int:
    """Returns: the longest prefix length after which space cleaning cannot change.

    The cleaning rules look at most two bytes past a space or apostrophe; cutting after
    a byte that is none of " ", "'", "r", "v" keeps every rule on one side of the cut.
    """
    for k in range(len(buf), 0, -1):
        if buf[k - 1] not in b" 'rv":
            return k
    return 0
