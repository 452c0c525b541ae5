"""The generation loop: prompt processing, one-token decode, stop strings held back until they
can no longer match, end-of-generation tokens, and the stream of text pieces it yields."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .sampling import Sampler, SamplingParams
from .speculative import Draft, Speculator, verify


REFERENCE_PASS = 4   # a speculating generation's 4th pass is plain unless one was before


class Chunk(str):
    """A piece of generated text (a ``str``) with the tokens that produced it.

    ``finish_reason`` is None except on the last chunk of a stream: 'stop' (end of text or a
    stop string) or 'length' (max_tokens reached or the context full). ``top_logprobs`` has,
    when asked for, one list of (token id, log-probability) pairs per token.
    """

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None
    top_logprobs: tuple

    def __new__(cls, text: str, tokens=(), logprobs=(), finish_reason=None, top_logprobs=()):
        obj = super().__new__(cls, text)
        obj.tokens = tuple(tokens)
        obj.logprobs = tuple(logprobs)
        obj.finish_reason = finish_reason
        obj.top_logprobs = tuple(top_logprobs)
        return obj


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0        # prompt tokens whose KV was reused
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    time_to_first_token: float = 0.0
    finish_reason: str = ""      # 'stop' or 'length'
    seed: int = 0
    tokens: list[int] = field(default_factory=list)
    dropped_messages: int = 0    # oldest chat turns dropped to fit the context (context shift)
    # Speculative decoding: drafted tokens checked against the model and those accepted;
    # the model's forward passes after the prompt, and those run without a draft (their
    # time is what plain decoding would take per token).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_passes: int = 0
    plain_passes: int = 0
    plain_seconds: float = 0.0

    @property
    def prompt_tps(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def generate_tps(self) -> float:
        # The first token comes from prompt processing; the rest are decode steps.
        n = max(self.generated_tokens - 1, 0)
        return n / self.generate_seconds if self.generate_seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Drafted tokens accepted, as a fraction of those checked (0 without drafts)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens generated per forward pass of the model after the prompt's (1 for plain
        decoding; more when drafts are accepted)."""
        n = max(self.generated_tokens - 1, 0)
        return n / self.decode_passes if self.decode_passes else 0.0

    @property
    def speedup(self) -> float:
        """Decode speed over plain decoding's, the latter timed on this generation's passes
        that ran without a draft (0 when there were none)."""
        if not self.plain_passes or self.generate_seconds <= 0:
            return 0.0
        return self.generate_tps * self.plain_seconds / self.plain_passes


class StopMatcher:
    """Emits text as soon as it can no longer be the start of a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; returns (text safe to emit, whether a stop string was completed)."""
        self.buf += text
        if not self.stops:
            out, self.buf = self.buf, ""
            return out, False
        first = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if first >= 0:
            out, self.buf = self.buf[:first], ""
            return out, True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), hold, -1):
                if self.buf.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.buf) - hold
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


@dataclass(frozen=True)
class DecoderHooks:
    """What a Decoder calls back into at points of a generation (each optional).

    Attributes:
        after_prompt: called once the prompt is processed (e.g. to checkpoint the cache).
        shift: when the context is full, may make room (given the tokens generated so
            far): returns the next logits and the new room, or None to end with 'length'.
        speculate: makes this generation's Speculator, given the sampler's seed; None: no
            drafts.
        rollback: drops the last n tokens from the sequence the pending ones ran in
            (rejected drafts); needed with ``speculate``.
    """
    after_prompt: Callable[[], None] | None = None
    shift: Callable[[list[int]], tuple[np.ndarray, int] | None] | None = None
    speculate: Callable[[int], Speculator] | None = None
    rollback: Callable[[int], None] | None = None

    def __post_init__(self):
        if self.speculate is not None and self.rollback is None:
            raise ValueError("DecoderHooks: speculate needs rollback (to drop rejected drafts)")


class Decoder:
    """One generation, step by step: ``pending`` holds the tokens to run next (the prompt's
    uncached part, then each new token, followed by drafted ones when speculating);
    ``push`` takes the logits of what ran, chooses the next tokens and returns the text that
    became final. Callers run the tokens alone (run_generation) or batched with other
    sequences' (batching.Batcher); ``all_logits`` says when every pending token's logits
    are wanted (a draft to verify) rather than the last one's."""

    def __init__(self, prompt: Sequence[int], cached: int, room: int, params: SamplingParams,
                 *, vocab_size: int, stream, is_eog: Callable[[int], bool],
                 stats: GenerationStats | None = None, logsumexp=None, constraint=None,
                 hooks: DecoderHooks = DecoderHooks()):
        """Args:
            prompt: the prompt's token ids, of which the first ``cached`` are already run.
            room: how many tokens may still be added after the prompt (context left).
            params: sampling settings.
            vocab_size: logits width.
            stream: the tokenizer's incremental decoder for the output.
            is_eog: end-of-generation test.
            stats: filled in as generation proceeds (None: a fresh GenerationStats).
            logsumexp: optional fast log-sum-exp for the log-probabilities.
            constraint: optional TokenConstraint (e.g. JSON) every token must satisfy;
                generation ends when it is complete and an end token is chosen, or nothing
                else may follow.
            hooks: the callbacks (after the prompt, context shift, speculation, rollback).
        """
        stats = stats if stats is not None else GenerationStats()
        self.sampler = Sampler(params, vocab_size, logsumexp, constraint)
        self.params, self.stats, self.room = params, stats, room
        self._stream, self._is_eog = stream, is_eog
        self._after_prompt, self._shift = hooks.after_prompt, hooks.shift
        self._constraint = constraint
        stats.seed = self.sampler.seed
        stats.prompt_tokens = len(prompt)
        stats.cached_tokens = cached
        self._stop = StopMatcher(params.stop)
        self._history = list(prompt)
        self.pending: list[int] = list(prompt[cached:])
        self.done = False
        self._prompt_done = False
        self._t0 = time.perf_counter()
        self._t_gen = self._t_pass = self._t0
        self._toks: list[int] = []
        self._lps: list[float] = []
        self._tops: list = []
        self._spec = hooks.speculate(self.sampler.seed) if hooks.speculate is not None else None
        self._rollback = hooks.rollback
        self._draft: Draft | None = None
        stats.finish_reason = "length"

    @property
    def all_logits(self) -> bool:
        """Whether ``push`` wants every pending token's logits (a draft to verify)."""
        return self._draft is not None

    def push(self, logits: np.ndarray) -> list[Chunk]:
        """The logits after the pending tokens ran, (vocab,) for the last one or (n, vocab)
        for each when ``all_logits``: choose the next token(s).

        Returns:
            Chunks whose text is final (the last carries the finish reason once done).
        """
        st = self.stats
        now = time.perf_counter()
        if not self._prompt_done:
            self._prompt_done = True
            self._t_gen = now
            st.prompt_seconds = self._t_gen - self._t0
            if self._after_prompt is not None:
                self._after_prompt()
        else:
            st.decode_passes += 1
            if self._draft is None:  # a plain step: what speculation is measured against
                st.plain_passes += 1
                st.plain_seconds += now - self._t_pass
        self._t_pass = now
        return self._choose(np.asarray(logits))

    def _choose(self, rows: np.ndarray) -> list[Chunk]:
        st, p = self.stats, self.params
        if st.generated_tokens >= p.max_tokens:  # max_tokens == 0
            return self._finish("", False)
        if self._draft is not None:
            text, end = self._verify(rows)
        else:
            row = rows if rows.ndim == 1 else rows[-1]
            text, end = self._take(row, *self.sampler.sample(row, self._history))
        if end is not None:
            return self._finish(text, end)
        out = []
        if text:
            out.append(Chunk(text, self._toks, self._lps, None, self._tops))
            self._toks, self._lps, self._tops = [], [], []
        self.pending = [self._history[-1]]
        if st.generated_tokens >= self.room:
            # The context is full: make room (context shift) or end here.
            made = self._shift(st.tokens) if self._shift is not None else None
            if made is None:
                return out + self._finish("", False)
            logits, more = made
            self.room = st.generated_tokens + more
            return out + self._choose(np.asarray(logits))
        if self._spec is not None:
            # A draft never runs past max_tokens (the last token comes from the last row)
            # nor past the context.
            limit = min(p.max_tokens - st.generated_tokens - 1, self.room - st.generated_tokens)
            # One pass runs plain if none has, to time what plain decoding would take.
            timing = st.decode_passes + 1 == REFERENCE_PASS and not st.plain_passes
            if limit > 0 and not timing:
                self._draft = self._spec.propose(self._history, limit, self._constraint)
                if self._draft is not None:
                    self.pending += self._draft.tokens
        return out

    def _verify(self, rows: np.ndarray) -> tuple[str, bool | None]:
        """Check the draft against the target's logits: rows[i] follows pending[i]."""
        draft, self._draft = self._draft, None
        k = len(draft.tokens)
        text, end, accepted = "", None, 0
        for i, x in enumerate(draft.tokens):
            dist = self.sampler.distribution(rows[i], self._history, self._constraint)
            tok, ok = verify(dist, x, draft.q[i] if draft.q is not None else None,
                             self.sampler)
            accepted += ok
            piece, end = self._take(rows[i], tok, *self.sampler.take(rows[i], tok))
            text += piece
            if end is not None or not ok:
                self._rollback(k - i)  # the drafts after this position never happened
                break
        else:
            piece, end = self._take(rows[k], *self.sampler.sample(rows[k], self._history))
            text += piece
        verified = i + 1
        st = self.stats
        st.draft_tokens += verified
        st.accepted_tokens += accepted
        draft.source.length.update(verified, accepted)
        return text, end

    def _take(self, row: np.ndarray, tok: int, lp: float, top: list) -> tuple[str, bool | None]:
        """Add a chosen token to the output.

        Returns:
            (text that became final, None to go on or whether a stop string ended it).
        """
        st, p, con = self.stats, self.params, self._constraint
        if st.generated_tokens == 0:
            st.time_to_first_token = time.perf_counter() - self._t0
        if self._is_eog(tok) and (not p.ignore_eos or con is not None):
            st.finish_reason = "stop"
            return "", False
        self._history.append(tok)
        st.tokens.append(tok)
        st.generated_tokens += 1
        self._toks.append(tok)
        self._lps.append(lp)
        if p.top_logprobs:
            self._tops.append(top)
        text, stopped = self._stop.push(self._stream.feed(tok))
        if stopped or (con is not None and con.must_end()):
            st.finish_reason = "stop"
            return text, stopped
        if st.generated_tokens == p.max_tokens:
            return text, False
        return text, None

    def _finish(self, text: str, stopped: bool) -> list[Chunk]:
        st = self.stats
        st.generate_seconds = time.perf_counter() - self._t_gen
        if not stopped:
            # Bytes held for an unfinished character, then text held for a stop string.
            more, stopped = self._stop.push(self._stream.flush())
            text += more
            if stopped:
                st.finish_reason = "stop"
            else:
                text += self._stop.flush()
        self.done = True
        self.pending = []
        self.close()
        return [Chunk(text, self._toks, self._lps, st.finish_reason, self._tops)]

    def close(self) -> None:
        """Give back what the drafters hold (a draft model's sequence)."""
        if self._spec is not None:
            self._spec.close()
            self._spec = None


def run_generation(feed: Callable[[Sequence[int], bool], np.ndarray], decoder: Decoder
                   ) -> Iterator[Chunk]:
    """Drive one Decoder alone: ``feed(ids, all_logits)`` runs tokens and returns the last
    one's logits, or every one's.

    Yields:
        Chunk pieces of text; the last one carries the finish reason.
    """
    while not decoder.done:
        yield from decoder.push(feed(decoder.pending, decoder.all_logits))
