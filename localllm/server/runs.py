"""What the worker thread does for one request: tokenize and check its prompts, generate its
choices chunk by chunk through the engine, and describe the progress as events."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from .errors import APIError
from .metrics import Metrics, RequestRecord

SEED_SPACE = 2 ** 64
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}


# ----------------------------------------------------------------------------- what is asked

@dataclass
class Prompt:
    """One prompt: a conversation (rendered with the chat template), a text, or token ids."""
    messages: list[dict] | None = None
    text: str | None = None
    ids: list[int] | None = None
    param: str = "messages"     # the request field it came from, for error messages


@dataclass
class GenerationSpec:
    """A request as the worker runs it: every prompt gets ``n`` choices."""
    prompts: list[Prompt]
    sampling: dict              # SamplingParams fields, validated by the caller
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0       # alternatives reported per position (with logprobs)
    add_special: bool = True    # BOS for text prompts, as the model's file asks
    echo: bool = False          # Started carries the prompt's text


# ----------------------------------------------------------------------------- events

@dataclass
class Started:
    """A choice's prompt passed the checks and its generation begins."""
    index: int
    prompt_tokens: int
    prompt_text: str | None = None


@dataclass
class TopLogprob:
    token: str
    bytes: list[int]
    logprob: float


@dataclass
class TokenLogprob:
    token: str
    bytes: list[int]
    logprob: float
    top: list[TopLogprob]       # the most likely tokens at this position, best first


@dataclass
class Piece:
    """Text of one choice, with the tokens that produced it."""
    index: int
    text: str
    tokens: tuple[int, ...]
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, other: "Usage") -> None:
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens


@dataclass
class Finished:
    """A choice ended: 'stop' (end of text or a stop string) or 'length' (a limit)."""
    index: int
    finish_reason: str
    usage: Usage


@dataclass
class Failed:
    error: APIError


@dataclass
class Done:
    """Every choice of the request has finished."""


Event = Started | Piece | Finished | Failed | Done


# ----------------------------------------------------------------------------- the work

@dataclass
class _Choice:
    index: int
    prompt: list[int]
    sampling: dict
    echo: str | None = None
    gen: Iterator | None = None
    stats: object = None          # the engine's GenerationStats of this generation
    first_at: float | None = None
    last_at: float | None = None


def _finite(x: float) -> float:
    return float(x) if math.isfinite(x) else -9999.0  # JSON has no -inf; OpenAI's own floor


class JobRun:
    """A request's choices, generated one after another on the worker thread."""

    def __init__(self, model, spec: GenerationSpec, metrics: Metrics, submitted: float):
        """Tokenizes and checks every prompt before any generation starts, so a bad prompt
        fails the whole request with an honest status.

        Args:
            model: the loaded engine Model (used on this thread only).
            spec: what to generate.
            metrics: where finished generations are counted.
            submitted: perf_counter time of the request's arrival (for time to first token).
        Raises:
            APIError: a prompt that is empty, has unknown token ids, or does not fit the context.
        """
        self.model = model
        self.spec = spec
        self.metrics = metrics
        self.submitted = submitted
        self._choices: deque[_Choice] = deque()
        self._check_bias(spec.sampling.get("logit_bias") or {})
        seed = spec.sampling.get("seed")
        for p, prompt in enumerate(spec.prompts):
            ids = self._tokens(prompt)
            echo = None
            if spec.echo:
                echo = prompt.text if prompt.text is not None else model.detokenize(ids)
            for i in range(spec.n):
                sampling = dict(spec.sampling, top_logprobs=spec.top_logprobs)
                if seed is not None:  # each choice its own stream, all reproducible
                    sampling["seed"] = (seed + i) % SEED_SPACE
                self._choices.append(_Choice(p * spec.n + i, ids, sampling, echo))

    def _tokens(self, prompt: Prompt) -> list[int]:
        m = self.model
        if prompt.messages is not None:
            ids = m.chat_tokens(prompt.messages)
        elif prompt.text is not None:
            ids = m.tokenize(prompt.text, add_special=self.spec.add_special)
        else:
            ids = list(prompt.ids or [])
            bad = next((t for t in ids if not 0 <= t < m.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"token id {bad} is outside the vocabulary "
                                    f"(0..{m.vocab_size - 1})", "invalid_value", prompt.param)
        if not ids:
            raise APIError(400, "the prompt is empty", "invalid_value", prompt.param)
        if len(ids) >= m.ctx:
            raise APIError(400, f"the prompt has {len(ids)} tokens but the context holds "
                                f"{m.ctx}; shorten it, or restart the server with a larger "
                                "--ctx-size", "context_length_exceeded", prompt.param)
        return ids

    def _check_bias(self, bias: dict) -> None:
        bad = next((t for t in bias if not 0 <= t < self.model.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"logit_bias names token {bad}, outside the vocabulary "
                                f"(0..{self.model.vocab_size - 1})", "invalid_value", "logit_bias")

    @property
    def done(self) -> bool:
        return not self._choices

    def step(self) -> list[Event]:
        """Advance the current choice by one chunk of text (one token, unless the text of a
        token is held back for a stop string or an unfinished character).

        Returns:
            the events to deliver, in order.
        """
        c = self._choices[0]
        if c.gen is None:
            c.gen = self.model.generate(c.prompt, **c.sampling)
            c.stats = c.gen.stats
            return [Started(c.index, len(c.prompt), c.echo)]
        try:
            chunk = next(c.gen)
        except StopIteration:  # the last chunk carried the finish reason
            return self._finish(FINISH_REASONS.get(c.stats.finish_reason, "length"))
        now = time.perf_counter()
        if chunk.tokens:
            c.first_at = c.first_at or now
            c.last_at = now
        return [Piece(c.index, str(chunk), chunk.tokens, self._logprobs(chunk))]

    def stop(self, finish_reason: str | None) -> list[Event]:
        """End every choice now (a disconnect, or the server shutting down).

        Args:
            finish_reason: what the current choice reports, or None for no events (the
                client is gone).
        """
        events: list[Event] = []
        if self._choices and self._choices[0].gen is not None:
            events = self._finish(finish_reason or "length")
        self._choices.clear()
        return events if finish_reason else []

    def _finish(self, finish_reason: str) -> list[Event]:
        c = self._choices.popleft()
        c.gen.close()
        s = c.stats
        usage = Usage(s.prompt_tokens, s.cached_tokens, s.generated_tokens)
        ttft = c.first_at - self.submitted if c.first_at is not None and c.index == 0 else None
        tpot = ((c.last_at - c.first_at) / (s.generated_tokens - 1)
                if c.first_at is not None and s.generated_tokens > 1 else None)
        self.metrics.record(RequestRecord(
            usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens, ttft, tpot,
            s.draft_tokens, s.accepted_tokens, s.decode_passes,
            s.plain_seconds / s.plain_passes if s.plain_passes else 0.0, s.generate_seconds))
        events: list[Event] = [Finished(c.index, finish_reason, usage)]
        if not self._choices:
            events.append(Done())
        return events

    def _logprobs(self, chunk) -> list[TokenLogprob] | None:
        if not self.spec.logprobs:
            return None
        tops = chunk.top_logprobs or [()] * len(chunk.tokens)
        out = []
        for t, lp, top in zip(chunk.tokens, chunk.logprobs, tops):
            text, raw = self._piece(t)
            out.append(TokenLogprob(text, raw, _finite(lp),
                                    [TopLogprob(*self._piece(i), _finite(v)) for i, v in top]))
        return out

    def _piece(self, token: int) -> tuple[str, list[int]]:
        """A token's text (bytes of an unfinished character escaped) and its bytes."""
        piece = self.model.tokenizer.token_to_piece(token)
        return piece.decode("utf-8", errors="backslashreplace"), list(piece)
