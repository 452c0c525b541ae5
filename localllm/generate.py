"""The generation loop: prompt processing, one-token decode, stop strings held back until they
can no longer match, end-of-generation tokens, and the stream of text pieces it yields."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from .sampling import Sampler, SamplingParams


class Chunk(str):
    """A piece of generated text (a ``str``) with the tokens that produced it."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]

    def __new__(cls, text: str, tokens=(), logprobs=()):
        obj = super().__new__(cls, text)
        obj.tokens = tuple(tokens)
        obj.logprobs = tuple(logprobs)
        return obj


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0        # prompt tokens whose KV was reused
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    time_to_first_token: float = 0.0
    finish_reason: str = ""      # 'stop', 'length' or 'context'
    seed: int = 0
    tokens: list[int] = field(default_factory=list)

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
                   logsumexp=None, constraint=None) -> Iterator[Chunk]:
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
        constraint: optional TokenConstraint (e.g. JSON) every token must satisfy; generation
            ends when it is complete and an end token is chosen, or nothing else may follow.
    Yields:
        Chunk pieces of text.
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
    t_gen = time.perf_counter()
    toks: list[int] = []
    lps: list[float] = []
    stats.finish_reason = "length"
    stopped = False
    for i in range(params.max_tokens):
        tok, lp = sampler.sample(logits, history)
        if i == 0:
            stats.time_to_first_token = time.perf_counter() - t0
        if is_eog(tok) and (not params.ignore_eos or constraint is not None):
            stats.finish_reason = "stop"
            break
        history.append(tok)
        stats.tokens.append(tok)
        stats.generated_tokens += 1
        toks.append(tok)
        lps.append(lp)
        text, stopped = stop.push(stream.feed(tok))
        if text or stopped:
            yield Chunk(text, toks, lps)
            toks, lps = [], []
        if stopped or (constraint is not None and constraint.must_end()):
            stats.finish_reason = "stop"
            break
        if i + 1 == params.max_tokens:
            break
        if stats.generated_tokens >= room:
            stats.finish_reason = "context"
            break
        logits = feed([tok])
    stats.generate_seconds = time.perf_counter() - t_gen
    if not stopped:
        # Bytes held for an unfinished character, then text held for a possible stop string.
        text, stopped = stop.push(stream.flush())
        if not stopped:
            text += stop.flush()
        if text or toks:
            yield Chunk(text, toks, lps)
