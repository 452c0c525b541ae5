"""Pre-tokenizers and merge engines behind localllm.text.tokenizer, as llama.cpp runs them:
its `unicode_regex_split` (Unicode 15.1 classes, hand-written GPT-2 / Llama 3 / Qwen2
splitters), rank-ordered byte-level BPE and score-ordered SentencePiece merging."""

from __future__ import annotations

import heapq
import re
from collections import OrderedDict
from typing import Callable, Mapping, Sequence

import numpy as np

from localllm.text.tokenizer_unicode import N_CLASSES, class_table

# --------------------------------------------------------------------------- classes

# llama.cpp runs its regexes over a "collapsed" copy of the text: ASCII stays as it is,
# every other code point becomes one stand-in character per class (whitespace -> \v).
_STAND_IN = {0: 0xD0, 1: 0xD1, 2: 0xD2, 3: 0xD3, 4: 0xD4, 5: 0xD5, 6: 0xD0, 7: 0xD0, 8: 0x0B}
_LUT = np.array([_STAND_IN[k] for k in range(N_CLASSES)], dtype=np.uint32)


def collapse(text: str) -> str:
    """Returns: `text` with every non-ASCII code point replaced by its class stand-in."""
    if text.isascii():
        return text
    cps = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    out = np.where(cps < 128, cps, _LUT[class_table()[cps]])
    return out.astype("<u4").tobytes().decode("utf-32-le")


def _ascii_of(cls: int) -> str:
    table = class_table()
    return "".join(chr(c) for c in range(128) if table[c] == cls)


# Character-class bodies over the collapsed text.
_L = "A-Za-z\xd2"
_N = "0-9\xd1"
_W = "\t\n\x0b\x0c\r "
_CATEGORY_BODY = {
    "N": _N,
    "L": _L,
    "Lu": _L, "Ll": _L, "Lt": _L, "Lm": _L, "Lo": _L,
    "P": None,  # filled lazily from the table (ASCII punctuation + stand-in)
    "M": "\xd4",
    "S": None,
}


def _category_body(name: str) -> str:
    body = _CATEGORY_BODY[name]
    if body is None:
        cls, stand_in = {"P": (3, "\xd3"), "S": (5, "\xd5")}[name]
        body = re.escape(_ascii_of(cls)) + stand_in
    return body


def translate_regex(expr: str) -> str:
    """Returns: a Python regex over collapsed text equivalent to llama.cpp's std::regex `expr`.

    `\\p{X}` become stand-in classes as llama.cpp's collapsing does; `\\s`, `\\S`, `\\d`
    become their ASCII (C locale) meaning, which is what std::regex gives there.
    """
    out, i, inside = [], 0, False
    while i < len(expr):
        c = expr[i]
        if c == "\\" and i + 1 < len(expr):
            nxt = expr[i + 1]
            if nxt == "p" and expr.startswith("{", i + 2):
                j = expr.index("}", i)
                body = _category_body(expr[i + 3:j])
                out.append(body if inside else f"[{body}]")
                i = j + 1
                continue
            if nxt in "sSd":
                body = {"s": _W, "S": None, "d": "0-9"}[nxt]
                if nxt == "S":
                    if inside:
                        raise ValueError(f"\\S inside a class is not supported: {expr!r}")
                    out.append(f"[^{_W}]")
                else:
                    out.append(body if inside else f"[{body}]")
                i += 2
                continue
            out.append(expr[i:i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        out.append(c)
        i += 1
    return "".join(out)


# The hand-written splitters of llama.cpp (unicode.cpp), as regexes over collapsed text.
# Each alternative is one branch of the C++ scanner, in its order; `.` is its
# "no match: one code point" fallback.
GPT2_SPLIT = re.compile(
    rf"'[stmd]|'(?:re|ve|ll)| ?[{_L}]+| ?[{_N}]+| ?[^{_W}{_L}{_N}]+"
    rf"|[{_W}]+(?=[{_W}][^{_W}])|[{_W}]+|.",
    re.DOTALL,
)
_LLAMA3_HEAD = r"'(?:[sStTmMdD]|[rR][eE]|[vV][eE]|[lL][lL])" rf"|[^\r\n{_L}{_N}]?[{_L}]+"
_LLAMA3_TAIL = (
    rf"| ?[^{_W}{_L}{_N}]+[\r\n]*|[{_W}]*[\r\n]|[{_W}]+(?=[{_W}][^{_W}])|[{_W}]+|."
)
LLAMA3_SPLIT = re.compile(_LLAMA3_HEAD + rf"|[{_N}]{{1,3}}" + _LLAMA3_TAIL, re.DOTALL)
QWEN2_SPLIT = re.compile(_LLAMA3_HEAD + rf"|[{_N}]" + _LLAMA3_TAIL, re.DOTALL)
# Qwen 3.5: combining marks (stand-in \xd4) join letters and leave the punctuation runs.
QWEN35_SPLIT = re.compile(
    r"'(?:[sStTmMdD]|[rR][eE]|[vV][eE]|[lL][lL])" rf"|[^\r\n{_L}{_N}]?[{_L}\xd4]+|[{_N}]"
    + _LLAMA3_TAIL.replace(f"[^{_W}{_L}{_N}]", f"[^{_W}{_L}\xd4{_N}]"), re.DOTALL)

# llama.cpp's regex strings that it hands to its own scanners instead of std::regex.
_GPT2_EXPR = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_EXPR = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_EXPR = _LLAMA3_EXPR.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35_EXPR = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TRAILING_SPACE_EXPR = r"\s+$"
_CUSTOM = {_GPT2_EXPR: GPT2_SPLIT, _LLAMA3_EXPR: LLAMA3_SPLIT, _QWEN2_EXPR: QWEN2_SPLIT,
           _QWEN35_EXPR: QWEN35_SPLIT}

_DEFAULT_EXPRS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_EXPR, r"\p{N}+", r"[0-9][0-9][0-9]")
_STARCODER_EXPRS = (r"\p{N}", _GPT2_EXPR)
_FALCON_EXPRS = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_EXPR, r"[0-9][0-9][0-9]")
# DeepSeek's regexes name code point ranges literally: llama.cpp matches them over the
# text itself (non-ASCII whitespace folded to \v), not over the collapsed copy.
_DEEPSEEK_LLM_EXPRS = (
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
    _TRAILING_SPACE_EXPR,
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}+",
)
_DEEPSEEK_CODER_EXPRS = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-퟿]+", "\\p{N}")
# Gemma 4 is SentencePiece-like BPE over raw UTF-8: only newline runs are split off.
_NEWLINES_EXPR = "[^\\n]+|[\\n]+"

# tokenizer.ggml.pre -> (regexes, flags) for the byte-level BPE families supported.
# Flags follow llama.cpp's loader: clean_spaces defaults to True for BPE vocabularies.
_FAMILIES = {
    "default": ((_DEFAULT_EXPRS), {}),
    "gpt2": ((_GPT2_EXPR,), {}),
    "starcoder": (_STARCODER_EXPRS, {}),
    "llama3": ((_LLAMA3_EXPR,), {"ignore_merges": True, "add_bos": True}),
    "qwen2": ((_QWEN2_EXPR,), {"clean_spaces": False}),
    "qwen35": ((_QWEN35_EXPR,), {"clean_spaces": False}),
    "falcon": (_FALCON_EXPRS, {}),
    "deepseek-llm": (_DEEPSEEK_LLM_EXPRS, {"clean_spaces": False}),
    "deepseek-coder": (_DEEPSEEK_CODER_EXPRS, {"clean_spaces": False}),
    "gemma4": ((_NEWLINES_EXPR,), {"escape_spaces": True, "byte_encode": False,
                                   "add_bos": True}),
}
PRE_TYPES: dict[str, tuple[str, dict]] = {
    "default": ("default", {}),
    "": ("default", {}),
    **{n: ("gpt2", {}) for n in ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                                 "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo",
                                 "jais", "exaone4", "jina-v1-en", "jina-v2-code", "roberta-bpe")},
    **{n: ("gpt2", {"clean_spaces": False}) for n in ("trillion", "granite-docling")},
    **{n: ("starcoder", {}) for n in ("starcoder", "refact", "codeshell", "exaone",
                                      "minerva-7b", "mellum2")},
    **{n: ("starcoder", {"clean_spaces": False}) for n in ("smollm", "command-r")},
    **{n: ("llama3", {}) for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1",
                                   "pixtral", "midm-2.0", "lfm2", "jina-v5-nano")},
    **{n: ("llama3", {"ignore_merges": False, "add_bos": None}) for n in ("dbrx", "smaug-bpe")},
    **{n: ("qwen2", {}) for n in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan",
                                  "solar-open", "grok-2")},
    **{n: ("qwen2", {"clean_spaces": True}) for n in ("megrez", "stablelm2")},
    "qwen35": ("qwen35", {}),
    "falcon": ("falcon", {}),
    "deepseek-llm": ("deepseek-llm", {}),
    "deepseek-coder": ("deepseek-coder", {}),
    **{n: ("gemma4", {}) for n in ("gemma4", "granite-embed-multi-311m")},
}


def _fold_spaces(text: str) -> str:
    """Returns: `text` with non-ASCII whitespace as \\v (what llama.cpp gives std::wregex)."""
    if text.isascii():
        return text
    cps = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    out = np.where((cps >= 128) & (class_table()[cps] == 8), 0x0B, cps)
    return out.astype("<u4").tobytes().decode("utf-32-le")


class _TrailingSpace:
    """`\\s+$` (std::regex: `$` is the end of the piece): the piece's trailing whitespace
    run. A regex would retry the run from each of its positions (quadratic)."""

    _SPACE = frozenset(_W)

    def finditer(self, text: str, start: int, end: int):
        a = end
        while a > start and text[a - 1] in self._SPACE:
            a -= 1
        return [_Span(a, end)] if a < end else []


class _Span:
    __slots__ = ("_span",)

    def __init__(self, a: int, b: int):
        self._span = (a, b)

    def span(self) -> tuple[int, int]:
        return self._span


_UCATS = ("\\p{N}", "\\p{L}", "\\p{P}", "\\p{M}", "\\p{S}",
          "\\p{Lu}", "\\p{Ll}", "\\p{Lt}", "\\p{Lm}", "\\p{Lo}")


class PreTokenizer:
    """llama.cpp's `unicode_regex_split` for one `tokenizer.ggml.pre` value."""

    def __init__(self, exprs: Sequence[str]):
        self.patterns = []  # (finder, covers the whole piece, runs over the collapsed text)
        for e in exprs:
            if e in _CUSTOM:
                self.patterns.append((_CUSTOM[e], True, True))
            elif e == _TRAILING_SPACE_EXPR:
                self.patterns.append((_TrailingSpace(), False, False))
            else:
                collapsed = any(u in e for u in _UCATS)
                if not collapsed:  # `$` is the end of the piece, as std::regex has it
                    e = re.sub(r"(?<!\\)\$", r"\\Z", e)
                self.patterns.append((re.compile(translate_regex(e), re.DOTALL), False, collapsed))

    def split(self, text: str) -> list[str]:
        """Returns: the words of `text`, in order, joining back to `text`."""
        if not text:
            return []
        collapsed = folded = None
        bounds = [(0, len(text))]
        for pattern, covering, on_collapsed in self.patterns:
            if on_collapsed:
                subject = collapsed = collapse(text) if collapsed is None else collapsed
            else:
                subject = folded = _fold_spaces(text) if folded is None else folded
            nxt = []
            for start, end in bounds:
                pos = start
                for m in pattern.finditer(subject, start, end):
                    a, b = m.span()
                    if a == b:
                        continue
                    if a > pos and not covering:
                        nxt.append((pos, a))
                    nxt.append((a, b))
                    pos = b
                if pos < end:
                    nxt.append((pos, end))
            bounds = nxt
        return [text[a:b] for a, b in bounds]


def family_of(pre: str) -> tuple[tuple[str, ...], dict]:
    """Returns: (regexes, loader flags) for a `tokenizer.ggml.pre` value; KeyError if unknown."""
    fam, extra = PRE_TYPES[pre]
    exprs, flags = _FAMILIES[fam]
    merged = {"clean_spaces": True, "ignore_merges": False, "add_bos": None,
              "escape_spaces": False, "byte_encode": True, **flags, **extra}
    return tuple(exprs), merged


# --------------------------------------------------------------------------- byte level

def _byte_alphabet() -> list[str]:
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, n = {}, 0
    for b in keep:
        table[b] = chr(b)
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


BYTE_TO_CHAR = _byte_alphabet()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_TO_CHAR)}
_BYTE_TRANS = {b: c for b, c in enumerate(BYTE_TO_CHAR)}


def byte_encode(word: str) -> str:
    """Returns: GPT-2's printable-character spelling of the UTF-8 bytes of `word`."""
    return word.encode("utf-8").decode("latin-1").translate(_BYTE_TRANS)


# --------------------------------------------------------------------------- merging

# Words longer than this are merged afresh each time: a cache of 2^16 words of any length
# could hold gigabytes (a server sees many long distinct "words", e.g. runs of digits).
MAX_CACHED_WORD = 128


class _BoundedCache(OrderedDict):
    """A dict that forgets its oldest entries past `size`, and never keeps long words."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def put(self, key, value):
        if len(key) > MAX_CACHED_WORD:
            return
        self[key] = value
        if len(self) > self.size:
            self.popitem(last=False)


class BPEMerger:
    """llama.cpp's byte-level BPE over one pre-tokenized word (llm_tokenizer_bpe_session)."""

    def __init__(self, vocab: Mapping[str, int], ranks: Mapping[tuple[str, str], int],
                 ignore_merges: bool, cache_size: int = 1 << 16, byte_encoded: bool = True):
        self.vocab = vocab
        self.ranks = ranks
        self.ignore_merges = ignore_merges
        # A symbol outside the vocabulary falls back to one token per UTF-8 byte: the byte
        # as a one-character token (byte-level vocabularies) or "<0xHH>" (raw UTF-8 ones).
        self._byte_text = ((lambda b: chr(b) if b < 0x80 else None) if byte_encoded
                           else (lambda b: f"<0x{b:02X}>"))
        self._cache = _BoundedCache(cache_size)

    def word_ids(self, word: str) -> list[int]:
        """Returns: token ids of one byte-level-encoded word."""
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        if self.ignore_merges and word in self.vocab:
            ids = [self.vocab[word]]
        else:
            ids = self._finish(self._merge(word))
        self._cache.put(word, ids)
        return ids

    def _merge(self, word: str) -> list[str]:
        syms = list(word)
        n = len(syms)
        if n < 2:
            return syms
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        ranks = self.ranks
        heap = []
        for i in range(n - 1):
            r = ranks.get((syms[i], syms[i + 1]))
            if r is not None:
                heap.append((r, i, i + 1, syms[i] + syms[i + 1]))
        heapq.heapify(heap)
        while heap:
            _, left, right, text = heapq.heappop(heap)
            ls, rs = syms[left], syms[right]
            if not ls or not rs or ls + rs != text:
                continue
            syms[left] = text
            syms[right] = ""
            nxt[left] = nr = nxt[right]
            if nr >= 0:
                prv[nr] = left
            pl = prv[left]
            if pl >= 0:
                r = ranks.get((syms[pl], text))
                if r is not None:
                    heapq.heappush(heap, (r, pl, left, syms[pl] + text))
            if nr >= 0:
                r = ranks.get((text, syms[nr]))
                if r is not None:
                    heapq.heappush(heap, (r, left, nr, text + syms[nr]))
        return [s for s in syms if s]

    def _finish(self, syms: list[str]) -> list[int]:
        out = []
        vocab = self.vocab
        for s in syms:
            tid = vocab.get(s)
            if tid is not None:
                out.append(tid)
                continue
            # llama.cpp looks up every raw UTF-8 byte of the symbol as a byte token and
            # drops the bytes that have none.
            for b in s.encode("utf-8"):
                text = self._byte_text(b)
                tid = vocab.get(text) if text is not None else None
                if tid is not None:
                    out.append(tid)
        return out


class SPMMerger:
    """llama.cpp's SentencePiece-style merging (llm_tokenizer_spm_session).

    Adjacent symbols merge when their concatenation is any vocabulary token, highest
    score first, leftmost first on ties; leftover symbols fall back to byte tokens.
    """

    def __init__(self, vocab: Mapping[str, int], scores: Sequence[float],
                 byte_token: Callable[[int], int], glue: str, cache_size: int = 1 << 16):
        self.vocab = vocab
        self.scores = scores
        self.byte_token = byte_token
        self._cache = _BoundedCache(cache_size)
        # A merge can only cross a position before "▁" if some token holds the previous
        # character followed by "▁": split the text there into independent words.
        chars = "".join(sorted(set(glue) | {"\u2581"}))
        self._split = re.compile(rf"(?<=[^{re.escape(chars)}])(?=\u2581)")

    def encode(self, text: str) -> list[int]:
        """Returns: token ids of one whitespace-escaped raw fragment."""
        out = []
        for word in self._split.split(text):
            if word:
                out.extend(self.word_ids(word))
        return out

    def word_ids(self, word: str) -> list[int]:
        hit = self._cache.get(word)
        if hit is None:
            hit = self._resegment(self._merge(word))
            self._cache.put(word, hit)
        return hit

    def _merge(self, word: str) -> list[str]:
        syms = list(word)
        n = len(syms)
        if n < 2:
            return syms
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        vocab, scores = self.vocab, self.scores
        heap = []
        for i in range(n - 1):
            t = syms[i] + syms[i + 1]
            tid = vocab.get(t)
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, len(t)))
        heapq.heapify(heap)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            ls, rs = syms[left], syms[right]
            if not ls or not rs or len(ls) + len(rs) != size:
                continue
            syms[left] = text = ls + rs
            syms[right] = ""
            nxt[left] = nr = nxt[right]
            if nr >= 0:
                prv[nr] = left
            pl = prv[left]
            if pl >= 0:
                t = syms[pl] + text
                tid = vocab.get(t)
                if tid is not None:
                    heapq.heappush(heap, (-scores[tid], pl, left, len(t)))
            if nr >= 0:
                t = text + syms[nr]
                tid = vocab.get(t)
                if tid is not None:
                    heapq.heappush(heap, (-scores[tid], left, nr, len(t)))
        return [s for s in syms if s]

    def _resegment(self, syms: list[str]) -> list[int]:
        out = []
        for s in syms:
            tid = self.vocab.get(s)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self.byte_token(b) for b in s.encode("utf-8"))
        return out
