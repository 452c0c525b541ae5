"""What the worker thread does for one request: tokenize and check its prompts, run its
choices as requests of the continuous batcher (n choices of a prompt forked from one
sequence that processed it once), and describe the progress as events."""

from __future__ import annotations

import math
import time

import numpy as np
from dataclasses import dataclass, field

from localllm.errors import LocalLLMError
from localllm.generation.constrain.calls import ToolGrammar
from localllm.text.reasoning import Part, ReasoningSplitter, style_of_template

from .errors import APIError, api_error
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
    template_kwargs: dict = field(default_factory=dict)   # further template variables


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
    output: "OutputFormat | None" = None   # JSON output, constrained token by token
    split_reasoning: bool = False   # chat prompts: reasoning apart from the content


@dataclass
class OutputFormat:
    """Constrained output: any JSON object ('json_object'), a value valid under a schema
    ('json_schema'), text a GBNF grammar matches ('grammar') or a template's own tool calls
    ('tool_calls': ``schema`` is a localllm.generation.constrain.calls.ToolGrammar)."""
    kind: str
    schema: "dict | ToolGrammar | None" = None
    param: str = "response_format"   # the request field it came from
    grammar: str | None = None


# ----------------------------------------------------------------------------- events

@dataclass
class Started:
    """A choice's prompt passed the checks and its generation begins."""
    index: int
    prompt_tokens: int
    prompt_text: str | None = None
    prompt_logprobs: "list[TokenLogprob] | None" = None   # echo with logprobs; first is None


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
    """Text of one choice, with the tokens that produced it. With split_reasoning, ``text``
    is the answer only, ``reasoning`` the model's thinking, and ``tool_calls`` holds the
    messages a harmony model addressed to functions (Part kind 'tool_call')."""
    index: int
    text: str
    tokens: tuple[int, ...]
    logprobs: list[TokenLogprob] | None = None
    reasoning: str = ""
    tool_calls: list[Part] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0     # of completion_tokens, those that wrote reasoning

    def add(self, other: "Usage") -> None:
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens
        self.reasoning_tokens += other.reasoning_tokens


@dataclass
class Finished:
    """A choice ended: 'stop' (end of text or a stop string) or 'length' (a limit)."""
    index: int
    finish_reason: str
    usage: Usage
    stop_sequence: str | None = None   # the stop string that ended it, if one did


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
    sampling: dict
    req: object = None            # its batching.Request while it runs
    seq: object = None            # a Sequence the server made for it (n > 1), released at the end
    started: bool = False
    finished: bool = False
    delivered: int = 0            # chunks passed on; a rerun after preemption skips as many
    skip: int = 0
    first_at: float | None = None
    last_at: float | None = None
    splitter: ReasoningSplitter | None = None
    reasoning_tokens: int = 0


@dataclass
class _Group:
    """One prompt and its n choices: the first unfinished one (the lead) processes the prompt
    in its own sequence, which the others fork once it has."""
    prompt: list[int]
    echo: str | None
    choices: list[_Choice]
    echo_logprobs: list | None = None
    lead: _Choice | None = None
    forks: list[_Choice] = field(default_factory=list)   # waiting for the lead's prompt


def _piece_from_parts(index: int, parts: list[Part], tokens: tuple, logprobs) -> Piece:
    return Piece(index, "".join(p.text for p in parts if p.kind == "content"), tokens, logprobs,
                 "".join(p.text for p in parts if p.kind == "reasoning"),
                 [p for p in parts if p.kind == "tool_call"])


def _finite(x: float) -> float:
    return float(x) if math.isfinite(x) else -9999.0  # JSON has no -inf; OpenAI's own floor


class JobRun:
    """A request's choices as requests of the worker's Batcher."""

    def __init__(self, model, spec: GenerationSpec, metrics: Metrics, submitted: float,
                 constraint=None):
        """Tokenizes and checks every prompt before any generation starts, so a bad prompt
        fails the whole request with an honest status.

        Args:
            model: the loaded engine Model (used on this thread only).
            spec: what to generate.
            metrics: where finished generations are counted.
            submitted: perf_counter time of the request's arrival (for time to first token).
            constraint: the TokenConstraint of spec.output, copied for each choice.
        Raises:
            APIError: a prompt that is empty, has unknown token ids, or does not fit the context.
        """
        self.model = model
        self.spec = spec
        self.metrics = metrics
        self.submitted = submitted
        self.constraint = constraint
        self.running = False
        seed = spec.sampling.get("seed")
        self._groups: list[_Group] = []
        style = style_of_template(model.template.source)
        for p, prompt in enumerate(spec.prompts):
            ids = self._tokens(prompt)
            rendered = None
            if spec.split_reasoning and prompt.messages is not None:
                # the prompt's end says whether the template opened the reasoning itself
                rendered = model.render_chat(prompt.messages, **prompt.template_kwargs)
            echo = None
            if spec.echo:
                echo = prompt.text if prompt.text is not None else model.detokenize(ids)
            choices = []
            for i in range(spec.n):
                sampling = dict(spec.sampling, top_logprobs=spec.top_logprobs)
                if seed is not None:  # each choice its own stream, all reproducible
                    sampling["seed"] = (seed + i) % SEED_SPACE
                choices.append(_Choice(p * spec.n + i, sampling, splitter=(
                    ReasoningSplitter(style, rendered) if rendered is not None else None)))
            self._groups.append(_Group(ids, echo, choices, self._prompt_logprobs(ids)))

    def _prompt_logprobs(self, ids: list[int]) -> "list[TokenLogprob] | None":
        """Each prompt token's log-probability given those before it (the first has none),
        with its most likely alternatives: what echo with logprobs reports."""
        if not (self.spec.echo and self.spec.logprobs):
            return None
        logits = np.asarray(self.model.logits(ids), np.float64)
        lse = np.logaddexp.reduce(logits, axis=1, keepdims=True)
        lp = logits - lse
        out = []
        k = self.spec.top_logprobs
        for i, t in enumerate(ids):
            text, raw = self._piece(t)
            if i == 0:
                out.append(TokenLogprob(text, raw, None, []))
                continue
            row = lp[i - 1]
            top = np.argsort(-row)[:k] if k else []
            out.append(TokenLogprob(text, raw, _finite(row[t]),
                                    [TopLogprob(*self._piece(int(j)), _finite(row[j]))
                                     for j in top]))
        return out

    def _tokens(self, prompt: Prompt) -> list[int]:
        m = self.model
        if prompt.messages is not None:
            ids = m.chat_tokens(prompt.messages, **prompt.template_kwargs)
        elif prompt.text is not None:
            ids = m.tokenize(prompt.text, add_special=self.spec.add_special)
        else:
            ids = list(prompt.ids or [])
        try:   # every prompt now, before any choice starts
            m.check_prompt(ids)
        except LocalLLMError as e:
            raise api_error(e, prompt.param) from None
        return ids

    @property
    def started(self) -> bool:
        """Whether any choice has begun (its client has seen the request accepted)."""
        return any(c.started for g in self._groups for c in g.choices)

    @property
    def done(self) -> bool:
        return all(c.finished for g in self._groups for c in g.choices)

    def blocks_needed(self, block_size: int) -> int:
        """KV blocks the request needs to start: its prompts once, a block or two a choice."""
        return sum(-(-len(g.prompt) // block_size) + 2 * len(g.choices) for g in self._groups)

    # ---- driving it -------------------------------------------------------------------

    def start(self, batcher) -> list[Event]:
        """Add each prompt's lead choice to the batcher (the others follow once it has
        processed the prompt); also after a preemption, for the choices not yet finished.

        Raises:
            ValueError, TypeError: the engine refuses the settings.
        """
        self.running = True
        events: list[Event] = []
        for g in self._groups:
            todo = [c for c in g.choices if not c.finished]
            if not todo:
                continue
            g.lead, g.forks = todo[0], todo[1:]
            seq = self.model.new_sequence() if g.forks else None
            events += self._add(batcher, g, g.lead, seq)
        return events

    def _add(self, batcher, g: _Group, c: _Choice, seq) -> list[Event]:
        constraint = self.constraint.copy() if self.constraint is not None else None
        try:
            c.req = batcher.add(g.prompt, seq=seq, constraint=constraint, **c.sampling)
        except BaseException:
            if seq is not None:
                seq.release()
            raise
        c.seq = seq
        c.skip = c.delivered
        if c.started:
            return []
        c.started = True
        return [Started(c.index, len(g.prompt), g.echo, g.echo_logprobs)]

    def advance(self, batcher) -> list[Event]:
        """After a step: the new text of every choice, forks of prompts just processed, and
        the end of finished choices.

        Raises:
            Exception: a choice's error (the caller ends the whole request).
        """
        events: list[Event] = []
        for g in self._groups:
            lead = g.lead
            if g.forks and lead.req is not None and lead.req.prompted:
                # The lead's sequence holds the prompt and nothing more yet: each other
                # choice shares its blocks (copy-on-write) and reruns only the last token.
                forks, g.forks = g.forks, []
                for c in forks:
                    events += self._add(batcher, g, c, lead.seq.fork())
            for c in g.choices:
                if c.req is not None and not c.finished:
                    events += self._take(c)
        if self.done:
            events.append(Done())
        return events

    def _take(self, c: _Choice) -> list[Event]:
        r = c.req
        events: list[Event] = []
        while r.chunks:
            chunk = r.chunks.popleft()
            if c.skip:   # already delivered before a preemption: the rerun is identical
                c.skip -= 1
                continue
            c.delivered += 1
            if chunk.tokens:
                now = time.perf_counter()
                c.first_at = c.first_at or now
                c.last_at = now
            events.append(self._piece_of(c, str(chunk), chunk.tokens, self._logprobs(chunk)))
        if r.error is not None:
            raise r.error
        if r.done:
            events += self._finish(c, FINISH_REASONS.get(r.stats.finish_reason, "length"))
        return events

    @staticmethod
    def _piece_of(c: _Choice, text: str, tokens: tuple, logprobs) -> Piece:
        """A choice's new text as a Piece, its reasoning split off when asked for."""
        if c.splitter is None:
            return Piece(c.index, text, tokens, logprobs)
        was = c.splitter.in_reasoning
        parts = c.splitter.feed(text)
        piece = _piece_from_parts(c.index, parts, tokens, logprobs)
        if was and c.splitter.in_reasoning:
            c.reasoning_tokens += len(tokens)
        elif piece.reasoning:   # a chunk of several tokens that ends or opens the reasoning
            share = round(len(tokens) * len(piece.reasoning) / max(len(text), 1))
            c.reasoning_tokens += max(share, 1)
        return piece

    def _finish(self, c: _Choice, finish_reason: str) -> list[Event]:
        c.finished = True
        events: list[Event] = []
        if c.splitter is not None:   # what the splitter held back, before the end
            rest = _piece_from_parts(c.index, c.splitter.finish(), (), None)
            if rest.text or rest.reasoning or rest.tool_calls:
                events.append(rest)
        if c.seq is not None:
            c.seq.release()
            c.seq = None
        s = c.req.stats if c.req is not None else None
        usage = (Usage(s.prompt_tokens, s.cached_tokens, s.generated_tokens,
                       min(c.reasoning_tokens, s.generated_tokens)) if s else Usage())
        ttft = c.first_at - self.submitted if c.first_at is not None and c.index == 0 else None
        tpot = ((c.last_at - c.first_at) / (usage.completion_tokens - 1)
                if c.first_at is not None and usage.completion_tokens > 1 else None)
        spec = (s.draft_tokens, s.accepted_tokens, s.decode_passes,
                s.plain_seconds / s.plain_passes if s.plain_passes else 0.0,
                s.generate_seconds) if s else ()
        self.metrics.record(RequestRecord(usage.prompt_tokens, usage.cached_tokens,
                                          usage.completion_tokens, ttft, tpot, *spec))
        return events + [Finished(c.index, finish_reason, usage, self._stop_string(c, s))]

    def _stop_string(self, c: _Choice, s) -> str | None:
        """The stop string that ended a choice: it ended 'stop' on a token that does not end
        generation, and the first stop string in its tokens' text is the one matched."""
        stops = c.sampling.get("stop") or []
        if not stops or s is None or s.finish_reason != "stop" or not s.tokens \
                or self.model.tokenizer.is_eog(s.tokens[-1]):
            return None
        text = self.model.detokenize(s.tokens)
        found = [(text.find(x), x) for x in stops if x in text]
        return min(found)[1] if found else None

    def _release(self, batcher, pin_seeds: bool) -> None:
        for g in self._groups:
            g.forks = []
            for c in g.choices:
                if c.finished:
                    continue
                if c.req is not None:
                    if pin_seeds and c.sampling.get("seed") is None:
                        c.sampling["seed"] = c.req.stats.seed   # the rerun draws the same
                    batcher.cancel(c.req)
                    if pin_seeds:
                        c.req = None
                if c.seq is not None:
                    c.seq.release()
                    c.seq = None
        self.running = False

    def cancel(self, batcher) -> None:
        """The client has gone: stop every choice now, without events."""
        self._release(batcher, pin_seeds=False)
        for g in self._groups:
            for c in g.choices:
                if not c.finished and c.req is not None:
                    self._finish(c, "length")   # counted in the metrics; nobody reads events
                c.finished = True

    def preempt(self, batcher) -> None:
        """Give the KV blocks back to let older requests go on; ``start`` later reruns the
        unfinished choices from their prompts with the same seeds, which gives the same
        tokens again (the kernels are batch-invariant), and skips what was delivered."""
        self._release(batcher, pin_seeds=True)

    def stop(self, batcher, finish_reason: str) -> list[Event]:
        """End every choice now (the server is shutting down), each with a final event."""
        self._release(batcher, pin_seeds=False)
        events: list[Event] = []
        for g in self._groups:
            for c in g.choices:
                if c.finished:
                    continue
                if not c.started:
                    c.started = True
                    events.append(Started(c.index, len(g.prompt), g.echo))
                events += self._finish(c, finish_reason)
        return events + [Done()]

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

