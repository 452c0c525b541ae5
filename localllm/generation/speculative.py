"""Speculative decoding: drafters that propose tokens (prompt lookup, a draft model), their
adaptive draft length, and the acceptance rule (arXiv 2211.17192) that keeps the output
distribution exactly the target's at every temperature."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol, Sequence

import numpy as np

from .sampling import Dist, Sampler, SamplingParams
from localllm.errors import BadSetting, EngineError

# Rejected drafts are trimmed from the sequences; a rollback of up to one KV block is always
# exact (also on sliding-window layers), so no draft is longer.
MAX_DRAFT = 16
NGRAM_MAX = 4          # prompt lookup matches the last 4 tokens first, ...
NGRAM_MIN = 2          # ... down to the last 2
_MAX_PAUSE = 64        # steps without drafting, at most, after drafts keep failing


@dataclass
class Draft:
    """Proposed tokens and, for a sampling drafter, the distribution each was drawn from
    (None for a deterministic drafter such as prompt lookup)."""
    tokens: list[int]
    q: list[Dist] | None
    source: "Drafter"


class Drafter(Protocol):
    """What the Decoder asks of a drafter."""
    length: "DraftLength"

    def propose(self, history: list[int], k: int, constraint) -> Draft | None:
        """Up to ``k`` tokens to follow ``history`` (the prompt and the tokens chosen so far,
        the last of them not yet run by the target); None when it has nothing."""

    def close(self) -> None:
        """Give back what the drafter holds (a draft model's sequence)."""


# ----------------------------------------------------------------------------- the rule

def accept_probability(p_x: float, q_x: float) -> float:
    """The chance to keep a drafted token x: min(1, p(x) / q(x)), with p the target's
    distribution and q the drafter's (q(x) = 1 for a deterministic drafter)."""
    return 1.0 if p_x >= q_x else p_x / q_x


def verify(p: Dist, x: int, q: Dist | None, sampler: Sampler) -> tuple[int, bool]:
    """Speculative sampling for one drafted token: keep x with probability min(1, p/q),
    else draw from norm(max(0, p - q)); for a deterministic drafter (q one-hot at x) that
    is p with x removed. The token that comes out is distributed exactly as p.

    Args:
        p: the target's distribution at this position (every logits processor applied).
        x: the drafted token; q: the drafter's distribution it was drawn from, or None.
        sampler: the target's sampler (its generator makes the draws; none is made when the
            outcome is certain, so greedy decoding draws nothing).
    Returns:
        (the token for this position, whether it is the drafted one).
    """
    a = accept_probability(p.prob(x), 1.0 if q is None else q.prob(x))
    if a >= 1.0 or (a > 0.0 and sampler.rng.random() < a):
        return x, True
    return sampler.draw(residual(p, x, q)), False


def residual(p: Dist, x: int, q: Dist | None) -> Dist:
    """norm(max(0, p - q)), q one-hot at x when None."""
    if q is None:
        r = np.where(p.ids == x, 0.0, p.probs)
    else:
        order = np.argsort(q.ids)
        ids = q.ids[order]
        at = np.minimum(np.searchsorted(ids, p.ids), ids.size - 1)
        q_on_p = np.where(ids[at] == p.ids, q.probs[order][at], 0.0)
        r = np.maximum(p.probs - q_on_p, 0.0)
    total = r.sum()
    if not total > 0:  # p <= q everywhere: p == q up to rounding, and x was kept above
        return p
    keep = r > 0
    return Dist(p.ids[keep], r[keep] / total)


# ----------------------------------------------------------------------------- draft length

class DraftLength:
    """The adaptive draft length: doubles while whole drafts are accepted, falls to one more
    than what was accepted when a draft is cut short, and after drafts keep failing (none of
    their tokens accepted, twice running) pauses drafting for a stretch of steps that doubles
    with each further failure, up to 64. A step with nothing to propose costs no model pass
    and changes nothing."""

    def __init__(self, k_max: int, k_start: int = 4):
        self.k_max = max(1, min(k_max, MAX_DRAFT))
        self.k = min(self.k_max, k_start)
        self._pause = 0
        self._fails = 0

    def budget(self) -> int:
        """Returns: tokens to draft at this step (0 while paused)."""
        if self._pause > 0:
            self._pause -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        """Record a step's outcome: ``drafted`` proposed and checked (0: no proposal)."""
        if not drafted:
            return
        if accepted == drafted:
            self.k = min(self.k_max, 2 * self.k)
        else:
            self.k = max(1, accepted + 1)
        if accepted:
            self._fails = 0
            return
        self._fails += 1
        if self._fails >= 2:
            self._pause = min(_MAX_PAUSE, 1 << (self._fails - 2))


# ----------------------------------------------------------------------------- prompt lookup

class LookupDrafter:
    """Prompt lookup: finds the latest earlier place where the last tokens occurred (the
    longest of 4, 3 and 2 tokens that matches) and proposes what followed them there. The
    history searched is the whole prompt (a chat's whole conversation) and the reply so far;
    an index of every n-gram's latest occurrence keeps each look-up O(1)."""

    def __init__(self, k_max: int):
        self.length = DraftLength(k_max)
        self._index: dict[tuple, int] = {}   # n-gram -> where the token after it is
        self._indexed = 0                    # history positions indexed as continuations

    def _extend(self, history: Sequence[int]) -> None:
        # Every n-gram ending just before position c, for each c that has a token after it.
        # A generation's history only grows; a shorter one is a new history.
        if len(history) < self._indexed:
            self._index, self._indexed = {}, 0
        index = self._index
        for c in range(max(self._indexed, 1), len(history)):
            for n in range(NGRAM_MIN, min(NGRAM_MAX, c) + 1):
                index[tuple(history[c - n:c])] = c
        self._indexed = max(self._indexed, len(history))

    def propose(self, history: list[int], k: int, constraint=None) -> Draft | None:
        self._extend(history)
        end = len(history)
        for n in range(min(NGRAM_MAX, end - 1), NGRAM_MIN - 1, -1):
            c = self._index.get(tuple(history[end - n:]))
            if c is None:
                continue
            out: list[int] = []
            for i in range(k):  # past the end of the history, the draft repeats itself
                out.append(history[c + i] if c + i < end else out[c + i - end])
            return Draft(out, None, self)
        return None

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------- draft model

class ModelDrafter:
    """A smaller model with the same vocabulary drafts by sampling from its own distribution
    under the same logits processors. It runs its own Sequence, brought level with the
    target's tokens before each draft (rejected drafts are trimmed off its block tables; a
    new generation reuses its prefix cache)."""

    def __init__(self, model, context: Callable[[], Sequence[int]], params: SamplingParams,
                 seed: int, k_max: int, target_vocab: int, is_eog: Callable[[int], bool]):
        """Args:
            model: the draft engine.Model.
            context: the tokens the target's sequence holds now.
            params: the generation's sampling settings; seed: its seed (the draft's own
                stream is derived from it).
            k_max: most tokens per draft; target_vocab: the target's logits width (a draft
                stops before a token the target cannot take).
            is_eog: end-of-generation test (a draft stops after such a token).
        """
        self.model = model
        self.length = DraftLength(k_max)
        self._context = context
        bias = {t: b for t, b in params.logit_bias.items() if 0 <= int(t) < model.vocab_size}
        self.sampler = Sampler(replace(params, seed=(seed + 1) % (1 << 64), logit_bias=bias,
                                       top_logprobs=0), model.vocab_size)
        self._target_vocab = target_vocab
        self._stops = (lambda t: False) if params.ignore_eos else is_eog
        self.seq = model.new_sequence()
        self.failed = False

    def propose(self, history: list[int], k: int, constraint=None) -> Draft | None:
        if self.failed:
            return None
        want = list(self._context()) + [history[-1]]
        try:
            done = self.model.prepare(self.seq, want)
            logits = self.seq.feed(want[done:])
            con = constraint.copy() if constraint is not None else None
            hist = list(history)
            toks, qs = [], []
            for j in range(k):
                q = self.sampler.distribution(logits, hist, con)
                x = self.sampler.draw(q)
                if x >= self._target_vocab:
                    break
                toks.append(x)
                qs.append(q)
                hist.append(x)
                if con is not None:
                    con.advance(x)
                if j == k - 1 or self._stops(x):
                    break
                logits = self.seq.feed([x])
        except EngineError:  # e.g. the draft's KV pool is full: go on without drafts
            self.failed = True
            return None
        return Draft(toks, qs, self) if toks else None

    def close(self) -> None:
        self.seq.release()


# ----------------------------------------------------------------------------- together

class Speculator:
    """A generation's drafters, in order of preference (prompt lookup, which costs nothing,
    before a draft model): at each step the first that proposes something drafts."""

    def __init__(self, drafters: list):
        self.drafters = drafters

    def propose(self, history: list[int], limit: int, constraint) -> Draft | None:
        """Returns: a draft of at most ``limit`` tokens, or None."""
        for d in self.drafters:
            k = min(d.length.budget(), limit)
            if k <= 0:
                continue
            draft = d.propose(history, k, constraint)
            if draft is not None:
                return draft
            d.length.update(0, 0)
        return None

    def close(self) -> None:
        for d in self.drafters:
            d.close()


def check_vocabularies(target, draft, target_name: str, draft_name: str) -> None:
    """Raises BadSetting (``param`` "draft") naming the first difference that keeps ``draft``'s tokens from
    meaning the same as ``target``'s (tokenizers of two engine Models)."""
    if target.model != draft.model:
        raise BadSetting(f"draft model {draft_name} has a {draft.model!r} tokenizer, the target "
                         f"{target_name} a {target.model!r} one", param="draft")
    if abs(target.vocab_size - draft.vocab_size) > 128:
        raise BadSetting(f"draft model {draft_name} has {draft.vocab_size} tokens, the target "
                         f"{target_name} {target.vocab_size}", param="draft")
    for i in range(min(target.vocab_size, draft.vocab_size)):
        a, b = target.token_text(i), draft.token_text(i)
        if a != b:
            raise BadSetting(f"draft model {draft_name} does not share the vocabulary of "
                             f"{target_name}: token {i} is {b!r} in the draft, {a!r} in the "
                             "target", param="draft")
