"""Tool calls as constraints: a call's text (literal prefix, a JSON body valid under a schema,
literal suffix), held from the first token, or lazily: free text until the output reaches
the format's trigger, the call constrained from there (as llama.cpp's lazy grammars do)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from localllm.errors import ConstraintError
from localllm.text.tool_formats import GLM_XML, QWEN3_CODER_XML

from .constraint import TokenConstraint
from .grammar import Limits, lit
from .schema import compile_wrapped, compile_wrapped_many
from .vocab import TokenVocab
from .xml_calls import text_without, xml_calls_grammar

_BLANKS = b" \t\r\n"


@dataclass(frozen=True)
class ToolGrammar:
    """The text of a format's tool calls.

    prefix / suffix: the literal text around each call's body (their inner blanks are
        flexible: none, a space, or a newline and an indent).
    body: the JSON schema of one body (the name inside it); unused when ``named`` is set.
    repeat: whether further calls may follow one another (blanks between them).
    trigger: "" to hold the output from its first token; else free text is allowed until
        this text appears, and the call is held from where it starts (it must begin the
        call's text, e.g. the prefix).
    anchored: the trigger counts only at the start of the output (after blanks), for
        formats whose calls carry no marker of their own (Llama 3's bare JSON).
    named: for formats that write the name as text: {function name: its parameters'
        schema}; a call is then prefix + NAME + name_sep + ARGUMENTS + suffix, an
        alternation over the functions.
    name_sep: the literal text between a name and its arguments (with ``named``).
    block_open / block_close: literal text once around all the calls (DeepSeek's).
    open_first: the first call comes without its prefix (the prompt ended with it).
    xml: the XML call syntax ("qwen3_coder", "glm") whose calls these are, with ``named``
        giving each function's parameters schema (one value per parameter; see
        xml_calls); "" for the other formats.
    lead: (open, end, after): an optional message before the calls, open + text without
        end + end + after (harmony's analysis: "<|channel|>analysis<|message|>", "<|end|>",
        "<|start|>assistant"); () for none.
    tail: optional literal text after the calls (harmony's <|call|>, which ends generation
        in gpt-oss's vocabulary but may be written as text in others).

    Where a literal piece of this text is one control token of the model's vocabulary
    (Mistral's "[TOOL_CALLS]", DeepSeek's markers), the grammar takes that token, as
    llama.cpp's grammars do, and the trigger is that token too.
    """
    prefix: str
    body: dict
    suffix: str = ""
    repeat: bool = False
    trigger: str = ""
    anchored: bool = False
    named: dict | None = None
    name_sep: str = ""
    block_open: str = ""
    block_close: str = ""
    open_first: bool = False
    xml: str = ""
    lead: tuple = ()
    tail: str = ""

    def key(self) -> str:
        """A text that identifies the grammar (for caches)."""
        return json.dumps(asdict(self), sort_keys=True)

    def _literals(self) -> list[str]:
        out = [self.trigger, self.prefix, self.suffix, self.name_sep, self.block_open,
               self.block_close, self.tail, *self.lead]
        if self.xml:
            out += [x for x in vars(_xml_style(self.xml)).values() if isinstance(x, str)]
        return out

    def constraint(self, vocab: TokenVocab, limits: Limits | None = None):
        """The constraint of these calls over a vocabulary.

        Returns:
            a TokenConstraint (no trigger) or a LazyConstraint; copy() it for each use.
        Raises:
            GrammarError: a body schema the compiler does not support, naming why.
        """
        ctl = control_pieces(vocab, self._literals())
        if ctl:
            vocab, stand = vocab.with_stand_ins(ctl.values())
            sub = {text: stand[t] for text, t in ctl.items()}
        else:
            sub = {}

        def L(text: str) -> list:
            return lit(_substitute(text, sub))
        pre, suf = self.prefix.rstrip(), self.suffix.lstrip()

        def calls(g, values: list) -> list:
            """The elements of the answer's calls: each value wrapped in its literals."""
            def one(value, name: str | None, with_prefix: bool):
                head = L(pre) if with_prefix else []
                if name is None:
                    head += [g.ws] if pre and with_prefix else []
                else:
                    head += lit(name) + L(self.name_sep) + [g.ws]
                return head + [value] + ([g.ws] + L(suf) if suf else [])
            names = list(self.named) if self.named is not None else [None]

            def alts(with_prefix: bool):
                return g.choice([one(v, n, with_prefix) for v, n in zip(values, names)],
                                name="call")
            first = alts(not self.open_first)
            out = [first]
            if self.repeat:
                later = alts(True) if self.open_first else first
                out.append(g.seq([g.ws, later], 0, -1, name="calls"))
            return out

        def wrap(g, values):
            root = calls(g, values)
            if self.block_open or self.block_close:
                root = L(self.block_open) + [g.ws] + root + [g.ws] + L(self.block_close)
            if suf or self.block_close:
                root.append(g.ws)
            if self.tail:
                root.append(g.seq(L(self.tail), 0, 1))
            if self.lead:
                opening, end, after = self.lead
                body = text_without(g, _substitute(end, sub))
                root = [g.seq(L(opening) + [body] + L(end) + L(after), 0, 1)] + root
            return g.seq(root, name="answer")
        if self.xml:
            grammar = xml_calls_grammar(_xml_style(self.xml), self.named or {}, self.repeat,
                                        L, limits)
        elif self.named is not None:
            grammar = compile_wrapped_many(list(self.named.values()), wrap, limits)
        else:
            grammar = compile_wrapped(self.body, lambda g, v: wrap(g, [v]), limits)
        start = TokenConstraint(grammar, vocab)
        if not self.trigger:
            return start
        trigger = _substitute(self.trigger, sub).encode("utf-8", "surrogatepass")
        if not start.accepts(trigger):
            raise ConstraintError(f"the trigger {self.trigger!r} does not begin a call")
        return LazyConstraint(start, trigger, self.anchored)


def _xml_style(name: str):
    return {"qwen3_coder": QWEN3_CODER_XML, "glm": GLM_XML}[name]


def control_pieces(vocab: TokenVocab, texts: list[str]) -> dict[str, int]:
    """{text: id} of the vocabulary's control tokens whose text is found in ``texts``."""
    return {text: t for text, t in vocab.controls if any(text in x for x in texts)}


def _substitute(text: str, sub: dict[str, str]) -> str:
    """``text`` with each control token's text replaced by its stand-in character (longest
    first, leftmost)."""
    if not sub or not text:
        return text
    out, i = [], 0
    keys = sorted(sub, key=len, reverse=True)
    while i < len(text):
        for k in keys:
            if text.startswith(k, i):
                out.append(sub[k])
                i += len(k)
                break
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def answer_constraint(spec, vocab: TokenVocab):
    """The constraint of a tool plan's answer: ``spec`` is a JSON schema (the generic
    format's whole answer) or a ToolGrammar. Returns: a constraint to copy() for each use."""
    if isinstance(spec, ToolGrammar):
        return spec.constraint(vocab)
    return TokenConstraint.json_schema(spec, vocab)


class _Shared:
    """What copies of one lazy constraint share: the call's constraint at its start (never
    advanced), the tokens that can complete the trigger, and free masks by match state."""

    def __init__(self, start: TokenConstraint, trigger: bytes):
        self.start = start
        v = start.vocab
        # A token that completes the trigger holds its last byte: only those are checked.
        at = np.flatnonzero(v.flat == trigger[-1])
        toks = np.unique(np.searchsorted(v.off, at, side="right") - 1)
        self.candidates = np.zeros(v.size, bool)
        self.candidates[toks] = True
        self.masks: dict[int, np.ndarray] = {}


class LazyConstraint:
    """Any token until the output holds the trigger, then the call's TokenConstraint from
    where the trigger starts. A trigger may be split across tokens, and a token may carry
    text before the trigger and the call's text after it (that text is checked too).

    The same interface as TokenConstraint (allowed, mask, advance, is_complete, must_end,
    copy), so the Decoder, the Sampler and speculative decoding use it unchanged.
    """

    def __init__(self, start: TokenConstraint, trigger: str | bytes, anchored: bool = False,
                 _shared: _Shared | None = None):
        self.vocab = start.vocab
        self._trigger = trigger.encode() if isinstance(trigger, str) else trigger
        self._anchored = anchored
        self._sh = _shared or _Shared(start, self._trigger)
        # Free text: how many trigger bytes the text ends with (anchored: has matched since
        # the start); -1 once an anchored trigger can no longer come.
        self._k = 0
        self._call: TokenConstraint | None = None
        self._done = False

    @property
    def triggered(self) -> bool:
        """Whether the output has reached the trigger (the call is held from there)."""
        return self._call is not None

    def _scan(self, data: bytes) -> tuple[bytes | None, int]:
        """(the call's text so far if ``data`` completes the trigger, else None; the match
        state after ``data``)."""
        trig, k = self._trigger, self._k
        if self._anchored:
            if k < 0:
                return None, -1
            s = data.lstrip(_BLANKS) if k == 0 else data
            need = trig[k:]
            if not s:
                return None, k
            if s.startswith(need):
                return trig + s[len(need):], k
            return (None, k + len(s)) if need.startswith(s) else (None, -1)
        s = trig[:k] + data
        at = s.find(trig)
        if at >= 0:
            return s[at:], k
        for j in range(min(len(trig) - 1, len(s)), 0, -1):
            if s.endswith(trig[:j]):
                return None, j
        return None, 0

    def _is_eog(self, t: int) -> bool:
        eog = self.vocab.eog
        i = np.searchsorted(eog, t)
        return i < eog.size and eog[i] == t

    def _free_allows(self, t: int) -> bool:
        if not self._sh.candidates[t]:
            return True
        text, _ = self._scan(self.vocab.token_bytes(t))
        return text is None or self._sh.start.accepts(text)

    # ---- the interface ----------------------------------------------------------------

    def is_complete(self) -> bool:
        """Returns: whether the output may end here (free text, or a whole call)."""
        return not self._done and (self._call is None or self._call.is_complete())

    def must_end(self) -> bool:
        """Returns: whether nothing but an end token may follow."""
        return self._done or (self._call is not None and self._call.must_end())

    def allowed(self, token_id: int) -> bool:
        """Returns: whether ``token_id`` may come next."""
        t = int(token_id)
        if self._call is not None:
            return self._call.allowed(t)
        if self._done or not 0 <= t < self.vocab.size:
            return False
        return self._is_eog(t) or self._free_allows(t)

    def mask(self) -> np.ndarray:
        """Returns: bool (vocab_size,), True for every token that may come next."""
        if self._call is not None:
            return self._call.mask()
        if self._done:
            return np.zeros(self.vocab.size, bool)
        out = self._sh.masks.get(self._k)
        if out is None:
            out = np.ones(self.vocab.size, bool)
            for t in np.flatnonzero(self._sh.candidates):
                out[t] = self._free_allows(int(t))
            out[self.vocab.eog] = True
            self._sh.masks[self._k] = out
        return out.copy()

    def advance(self, token_id: int) -> None:
        """Moves past ``token_id``. Raises: ConstraintError if it is not allowed."""
        t = int(token_id)
        if not self.allowed(t):
            raise ConstraintError(f"token {t} is not allowed by the constraint here")
        if self._call is not None:
            self._call.advance(t)
        elif self._is_eog(t):
            self._done = True
        else:
            text, self._k = self._scan(self.vocab.token_bytes(t))
            if text is not None:
                call = self._sh.start.copy()
                call.feed(text)
                self._call = call

    def copy(self) -> "LazyConstraint":
        """Returns: an independent constraint in the same state (sharing caches)."""
        c = LazyConstraint(self._sh.start, "", self._anchored, self._sh)
        c._trigger, c._k, c._done = self._trigger, self._k, self._done
        c._call = self._call.copy() if self._call is not None else None
        return c
