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


def run_generation(feed: Callable[[Sequence[int]], np.ndarray], prompt: Sequence[int],
                   cached: int, room: int, params: SamplingParams, vocab_size: int,
                   stream, is_eog: Callable[[int], bool], stats: GenerationStats,
                   logsumexp=None, after_prompt: Callable[[], None] | None = None,
                   shift: Callable[[list[int]], tuple[np.ndarray, int] | None] | None = None,
                   constraint=None) -> Iterator[Chunk]:
    """Generate from a prompt.

    Args:
        feed: runs tokens (appended after what is cached) and returns the last position's logits.
        prompt: the prompt's token ids, of which the first ``cached`` are already in the cache.
        room: how many tokens may still be added after the prompt (context left).
        params: sampling settings; vocab_size: logits width.
        stream: the tokenizer's incremental decoder for the output.
        is_eog: end-of-generation test.
        stats: filled in as generation proceeds.
        logsumexp: optional fast log-sum-exp for the log-probabilities.
        after_prompt: called once the prompt is processed (e.g. to checkpoint the cache).
        shift: when the context is full, may make room (given the tokens generated so far):
            returns the next logits and the new room, or None to end with 'length'.
        constraint: optional TokenConstraint (e.g. JSON) every token must satisfy; generation
            ends when it is complete and an end token is chosen, or nothing else may follow.
    Yields:
        Chunk pieces of text; the last one carries the finish reason.
    """
    sampler = Sampler(params, vocab_size, logsumexp, constraint)
    stats.seed = sampler.seed
    stats.prompt_tokens = len(prompt)
    stats.cached_tokens = cached
    stop = StopMatcher(params.stop)
    history = list(prompt)
    t0 = time.perf_counter()
    logits = feed(prompt[cached:])
    stats.prompt_seconds = time.perf_counter() - t0
    if after_prompt is not None:
        after_prompt()
    t_gen = time.perf_counter()
    toks: list[int] = []
    lps: list[float] = []
    tops: list = []
    text, stopped = "", False
    stats.finish_reason = "length"
    for i in range(params.max_tokens):
        tok, lp, top = sampler.sample(logits, history)
        if i == 0:
            stats.time_to_first_token = time.perf_counter() - t0
        if is_eog(tok) and (not params.ignore_eos or constraint is not None):
            stats.finish_reason, text = "stop", ""
            break
        history.append(tok)
        stats.tokens.append(tok)
        stats.generated_tokens += 1
        toks.append(tok)
        lps.append(lp)
        if params.top_logprobs:
            tops.append(top)
        text, stopped = stop.push(stream.feed(tok))
        if stopped or (constraint is not None and constraint.must_end()):
            stats.finish_reason = "stop"
            break
        if i + 1 == params.max_tokens:
            break
        fed = False
        if stats.generated_tokens >= room:
            # The context is full: make room (context shift) or end here.
            made = shift(stats.tokens) if shift is not None else None
            if made is None:
                break
            logits, more = made
            room = stats.generated_tokens + more
            fed = True
        if text:
            yield Chunk(text, toks, lps, None, tops)
            toks, lps, tops = [], [], []
        if not fed:
            logits = feed([tok])
    stats.generate_seconds = time.perf_counter() - t_gen
    if not stopped:
        # Bytes held for an unfinished character, then text held for a possible stop string.
        more, stopped = stop.push(stream.flush())
        text += more
        if stopped:
            stats.finish_reason = "stop"
        else:
            text += stop.flush()
    yield Chunk(text, toks, lps, stats.finish_reason, tops)
