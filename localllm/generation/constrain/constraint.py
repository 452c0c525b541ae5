"""TokenConstraint: which tokens may come next so that the text stays a prefix of the
grammar's language (JSON, or JSON matching a schema), and the state after each token."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from localllm.errors import ConstraintError
from localllm.kernels import grammar as kg

from .gbnf import parse_gbnf
from .grammar import CompiledGrammar, Limits
from .json_grammar import JsonGrammar
from .schema import compile_schema
from .vocab import TokenVocab

_MASK_CACHE = 8  # masks kept per grammar, by state (a string's content repeats one state)


class _Shared:
    """What copies of one constraint share: the grammar, the vocabulary, the interned stacks,
    sets and transitions (append-only, so ids stay valid for every copy) and walk scratch.
    Copies must not be used from several threads at once."""

    def __init__(self, grammar: CompiledGrammar, vocab: TokenVocab):
        self.g = grammar.tables
        self.vocab = vocab
        self.store = kg.new_store()
        self.levels = kg.new_levels(max(vocab.max_len, 8) + 1)
        self.masks: OrderedDict = OrderedDict()

    def run(self, fn, *args) -> int:
        """Calls a walker kernel, growing whatever ran out until it fits. Returns: its result."""
        while True:
            r = fn(self.g, self.store, *args)
            if r != -1:
                return r
            self.store = kg.grow_store(self.store)


class TokenConstraint:
    """The tokens a model may sample next, and the state they lead to.

    Build with ``json_object(vocab)``, ``json_schema(schema, vocab)`` or ``gbnf(text, vocab)``. End-of-generation
    tokens are allowed exactly when the text so far is a complete value; control and other
    special tokens never are.
    """

    def __init__(self, grammar: CompiledGrammar, vocab: TokenVocab, _shared: _Shared | None = None):
        self._sh = _shared or _Shared(grammar, vocab)
        self._grammar = grammar
        self.vocab = vocab
        self._done = False
        if _shared is None:
            self._state = (self._sh.run(kg.start), 0, 0, 0)

    @classmethod
    def json_object(cls, vocab: TokenVocab, max_depth: int = 32) -> "TokenConstraint":
        """Returns: a constraint to one JSON object (any keys and values, nested at most
        ``max_depth`` deep), without leading or trailing whitespace."""
        g = JsonGrammar(max_depth=max_depth)
        return cls(g.compile(g.object_of(g.member([g.string], g.value(1)))), vocab)

    @classmethod
    def json_schema(cls, schema, vocab: TokenVocab, limits: Limits | None = None,
                    max_depth: int = 32) -> "TokenConstraint":
        """Returns: a constraint to one JSON value valid under ``schema`` (see
        localllm.generation.constrain.schema for what is supported), without surrounding whitespace.

        Raises:
            GrammarError: the schema uses a keyword or form that is not supported, or is too
                large; the message names it.
        """
        return cls(compile_schema(schema, limits, max_depth), vocab)

    @classmethod
    def gbnf(cls, text: str, vocab: TokenVocab, limits: Limits | None = None) -> "TokenConstraint":
        """Returns: a constraint to the text a GBNF grammar (llama.cpp's notation) matches.

        Raises:
            GrammarError: the grammar does not parse or is unsupported; the message gives the
                line and column.
        """
        return cls(parse_gbnf(text, limits), vocab)

    def _walk(self, tok: int) -> bool:
        """Walks a token's bytes from the current state; the state after it is left in the
        scratch levels at depth len(bytes). Returns: whether it is allowed."""
        v, sh = self.vocab, self._sh
        data = v.flat[v.off[tok]:v.off[tok + 1]]
        if data.size >= sh.levels.shape[0]:
            return False  # longer than any usable token: not from this vocabulary
        sh.levels[0] = self._state
        return sh.run(kg.walk_bytes, sh.levels, data) == 1

    def _walk_text(self, data: bytes) -> tuple | None:
        """Returns: the state after ``data`` (any length, walked a scratch-level's worth at a
        time) from the current state, or None where the grammar refuses it."""
        sh, state = self._sh, self._state
        buf = np.frombuffer(data, np.uint8)
        step = sh.levels.shape[0] - 1
        for i in range(0, buf.size, step):
            part = buf[i:i + step]
            sh.levels[0] = state
            if sh.run(kg.walk_bytes, sh.levels, part) != 1:
                return None
            state = tuple(int(x) for x in sh.levels[part.size])
        return state

    def accepts(self, data: bytes) -> bool:
        """Returns: whether ``data`` may come next (text, not tokens; the state is kept)."""
        return not self._done and self._walk_text(data) is not None

    def feed(self, data: bytes) -> None:
        """Moves past the text ``data`` (a lazy constraint hands over what followed its
        trigger). Raises: ConstraintError if the grammar does not allow it."""
        state = None if self._done else self._walk_text(data)
        if state is None:
            raise ConstraintError(f"the text {data[:40]!r} is not allowed by the constraint here")
        self._state = state

    def _is_eog(self, tok: int) -> bool:
        i = np.searchsorted(self.vocab.eog, tok)
        return i < self.vocab.eog.size and self.vocab.eog[i] == tok

    # ---- the interface ----------------------------------------------------------------

    def is_complete(self) -> bool:
        """Returns: whether the text so far is a whole valid value (end of generation allowed)."""
        s, _, need, _ = self._state
        st = self._sh.store
        return need == 0 and st.set_buf[st.set_off[s]] == kg.ACCEPT

    def must_end(self) -> bool:
        """Returns: whether the value is complete and nothing but an end token may follow."""
        s, _, need, _ = self._state
        st = self._sh.store
        a, b = st.set_off[s], st.set_off[s + 1]
        return self._done or (need == 0 and b - a == 1 and st.set_buf[a] == kg.ACCEPT)

    def allowed(self, token_id: int) -> bool:
        """Returns: whether ``token_id`` may come next (one token's bytes are walked)."""
        t = int(token_id)
        if self._done or not 0 <= t < self.vocab.size:
            return False
        if self._is_eog(t):
            return self.is_complete()
        return bool(self.vocab.usable[t]) and self._walk(t)

    def mask(self) -> np.ndarray:
        """Returns: bool (vocab_size,), True for every token that may come next."""
        v, sh = self.vocab, self._sh
        if self._done:
            return np.zeros(v.size, bool)
        key = self._state
        out = sh.masks.get(key)
        if out is None:
            out = np.zeros(v.size, bool)
            sh.levels[0] = key
            sh.run(kg.fill_mask, sh.levels, v.trie, out)
            sh.masks[key] = out
            if len(sh.masks) > _MASK_CACHE:
                sh.masks.popitem(last=False)
        else:
            sh.masks.move_to_end(key)
        out = out.copy()
        out[v.eog] = self.is_complete()
        return out

    def advance(self, token_id: int) -> None:
        """Moves past ``token_id``. Raises: ConstraintError if it is not allowed."""
        t = int(token_id)
        if not self.allowed(t):
            raise ConstraintError(f"token {t} is not allowed by the constraint here")
        if self._is_eog(t):
            self._done = True
            return
        d = int(self.vocab.off[t + 1] - self.vocab.off[t])
        self._state = tuple(int(x) for x in self._sh.levels[d])

    def copy(self) -> "TokenConstraint":
        """Returns: an independent constraint in the same state (sharing caches)."""
        c = TokenConstraint(self._grammar, self.vocab, self._sh)
        c._state, c._done = self._state, self._done
        return c
