"""The generation loop: prompt processing, one-token decode, stop strings held back until they
can no longer match, end-of-generation tokens, and the stream of text pieces it yields."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .sampling import Sampler, SamplingParams


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

    @property
    def prompt_tps(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def generate_tps(self) -> float:
        # The first token comes from prompt processing; the rest are decode steps.
        n = max(self.generated_tokens - 1, 0)
        return n / self.generate_seconds if self.generate_seconds > 0 else 0.0


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


class Decoder:
    """One generation, step by step: ``pending`` holds the tokens to run next (the prompt's
    uncached part, then each new token); ``push`` takes the logits of the last one run,
    chooses the next token and returns the text that became final. Callers run the tokens
    alone (run_generation) or batched with other sequences' (batching.Batcher)."""

    def __init__(self, prompt: Sequence[int], cached: int, room: int, params: SamplingParams,
                 vocab_size: int, stream, is_eog: Callable[[int], bool],
                 stats: GenerationStats, logsumexp=None,
                 after_prompt: Callable[[], None] | None = None,
                 shift: Callable[[list[int]], tuple[np.ndarray, int] | None] | None = None,
                 constraint=None):
        """Args:
            prompt: the prompt's token ids, of which the first ``cached`` are already run.
            room: how many tokens may still be added after the prompt (context left).
            params: sampling settings; vocab_size: logits width.
            stream: the tokenizer's incremental decoder for the output.
            is_eog: end-of-generation test.
            stats: filled in as generation proceeds.
            logsumexp: optional fast log-sum-exp for the log-probabilities.
            after_prompt: called once the prompt is processed (e.g. to checkpoint the cache).
            shift: when the context is full, may make room (given the tokens generated so
                far): returns the next logits and the new room, or None to end with 'length'.
            constraint: optional TokenConstraint (e.g. JSON) every token must satisfy;
                generation ends when it is complete and an end token is chosen, or nothing
                else may follow.
        """
        self.sampler = Sampler(params, vocab_size, logsumexp, constraint)
        self.params, self.stats, self.room = params, stats, room
        self._stream, self._is_eog = stream, is_eog
        self._after_prompt, self._shift, self._constraint = after_prompt, shift, constraint
        stats.seed = self.sampler.seed
        stats.prompt_tokens = len(prompt)
        stats.cached_tokens = cached
        self._stop = StopMatcher(params.stop)
        self._history = list(prompt)
        self.pending: list[int] = list(prompt[cached:])
        self.done = False
        self._prompt_done = False
        self._t0 = time.perf_counter()
        self._t_gen = self._t0
        self._toks: list[int] = []
        self._lps: list[float] = []
        self._tops: list = []
        stats.finish_reason = "length"

    def push(self, logits: np.ndarray) -> list[Chunk]:
        """The logits (vocab,) after the pending tokens ran: choose the next token.

        Returns:
            Chunks whose text is final (the last carries the finish reason once done).
        """
        st, p = self.stats, self.params
        if not self._prompt_done:
            self._prompt_done = True
            self._t_gen = time.perf_counter()
            st.prompt_seconds = self._t_gen - self._t0
            if self._after_prompt is not None:
                self._after_prompt()
        if st.generated_tokens >= p.max_tokens:  # max_tokens == 0
            return self._finish("", False)
        tok, lp, top = self.sampler.sample(logits, self._history)
        if st.generated_tokens == 0:
            st.time_to_first_token = time.perf_counter() - self._t0
        con = self._constraint
        if self._is_eog(tok) and (not p.ignore_eos or con is not None):
            st.finish_reason = "stop"
            return self._finish("", False)
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
            return self._finish(text, stopped)
        if st.generated_tokens == p.max_tokens:
            return self._finish(text, False)
        out = []
        if text:
            out.append(Chunk(text, self._toks, self._lps, None, self._tops))
            self._toks, self._lps, self._tops = [], [], []
        self.pending = [tok]
        if st.generated_tokens >= self.room:
            # The context is full: make room (context shift) or end here.
            made = self._shift(st.tokens) if self._shift is not None else None
            if made is None:
                return out + self._finish("", False)
            logits, more = made
            self.room = st.generated_tokens + more
            return out + self.push(logits)
        return out

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
        return [Chunk(text, self._toks, self._lps, st.finish_reason, self._tops)]


def run_generation(feed: Callable[[Sequence[int]], np.ndarray], decoder: Decoder
                   ) -> Iterator[Chunk]:
    """Drive one Decoder alone: ``feed`` runs tokens and returns the last one's logits.

    Yields:
        Chunk pieces of text; the last one carries the finish reason.
    """
    while not decoder.done:
        yield from decoder.push(feed(decoder.pending))
