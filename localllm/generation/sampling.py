"""Sampling: logits processors (penalties, bias, top-k, top-p, min-p, temperature) and a
seeded sampler. Same seed and settings, same tokens."""

from __future__ import annotations

import math
import secrets
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from localllm.errors import BadSetting, ConstraintError, TokenOutOfVocab

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Settings for choosing tokens; the defaults follow llama.cpp's command line."""
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    top_logprobs: int = 0        # also report this many most likely tokens per position

    def validate(self) -> None:
        """Raises:
            BadSetting: a setting that makes no sense, named in ``param``.
        """
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise BadSetting(f"temperature must be >= 0, got {self.temperature}",
                             param="temperature")
        if self.top_k < 0:
            raise BadSetting(f"top_k must be >= 0 (0 = off), got {self.top_k}", param="top_k")
        if not 0.0 <= self.top_p <= 1.0:
            raise BadSetting(f"top_p must be in [0, 1], got {self.top_p}", param="top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise BadSetting(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if not math.isfinite(self.repeat_penalty) or self.repeat_penalty <= 0:
            raise BadSetting(f"repeat_penalty must be > 0, got {self.repeat_penalty}",
                             param="repeat_penalty")
        if self.repeat_last_n < -1:
            raise BadSetting(f"repeat_last_n must be >= -1, got {self.repeat_last_n}",
                             param="repeat_last_n")
        if self.max_tokens < 0:
            raise BadSetting(f"max_tokens must be >= 0, got {self.max_tokens}",
                             param="max_tokens")
        if self.seed is not None and not 0 <= int(self.seed) < 2 ** 64:
            raise BadSetting(f"seed must be in [0, 2**64), got {self.seed}", param="seed")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise BadSetting("stop strings must be non-empty strings", param="stop")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise BadSetting(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.top_logprobs}", param="top_logprobs")


@dataclass
class Dist:
    """A distribution over tokens: candidate ids and their probabilities (summing to 1)."""
    ids: np.ndarray       # int, most likely first
    probs: np.ndarray     # float64

    @classmethod
    def one(cls, tok: int) -> "Dist":
        """Returns: all the mass on one token."""
        return cls(np.array([tok]), np.ones(1))

    def prob(self, tok: int) -> float:
        """Returns: the probability of ``tok`` (0 outside the candidates)."""
        at = np.flatnonzero(self.ids == tok)
        return float(self.probs[at[0]]) if at.size else 0.0


class Sampler:
    """Turns a row of logits into a token, given the tokens generated so far.

    With a constraint (localllm.generation.constrain.TokenConstraint), each token is drawn exactly from
    the processed distribution restricted to the tokens the constraint allows, renormalized:
    a first draw is kept when allowed (the common case, one cheap check), otherwise the draw
    is made again among the allowed candidates, which together gives p(t) / P(allowed). When
    no candidate is allowed (top-k, top-p or min-p kept none), the mask is applied before
    truncation instead. Greedy takes the best allowed token. The constraint is advanced past
    each chosen token.
    """

    def __init__(self, params: SamplingParams, vocab_size: int, logsumexp=None, constraint=None):
        """Args:
            params: the settings; vocab_size: logits width.
            logsumexp: optional fast log(sum(exp(z))) for the log-probabilities.
            constraint: optional TokenConstraint the chosen tokens must satisfy.
        """
        params.validate()
        self.constraint = constraint
        self._lse = logsumexp
        self.p = params
        self.vocab_size = vocab_size
        self.seed = int(params.seed) if params.seed is not None else secrets.randbits(63)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))
        for tok in params.logit_bias:
            if not 0 <= int(tok) < vocab_size:
                raise TokenOutOfVocab(f"logit_bias token {tok} is outside the vocabulary "
                                      f"(0..{vocab_size - 1})", param="logit_bias",
                                      token=int(tok), vocab_size=vocab_size)

    def _penalize(self, z: np.ndarray, history: list[int]) -> None:
        p = self.p
        if p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
            return
        n = len(history) if p.repeat_last_n == -1 else p.repeat_last_n
        recent = history[-n:] if n > 0 else []
        for tok, count in Counter(recent).items():
            if not 0 <= tok < len(z):
                continue
            v = z[tok]
            if p.repeat_penalty != 1.0:
                v = v / p.repeat_penalty if v > 0 else v * p.repeat_penalty
            v -= count * p.frequency_penalty + p.presence_penalty
            z[tok] = v

    def candidates(self, logits: np.ndarray, history: list[int],
                   allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Apply penalties, bias, top-k, top-p and min-p.

        Args:
            allowed: optional bool (vocab,) mask applied before truncation.
        Returns:
            (token ids, their processed logits), most likely first; ties keep id order.
        """
        p = self.p
        z = np.array(logits, dtype=np.float64)
        self._penalize(z, history)
        for tok, b in p.logit_bias.items():
            z[int(tok)] += b
        if allowed is not None:
            z[~allowed] = -np.inf
        finite = np.flatnonzero(np.isfinite(z))
        if finite.size == 0:
            raise ValueError("every token was removed (all logits are -inf or NaN)")
        if p.temperature == 0:
            best = finite[np.argmax(z[finite])]
            return np.array([best]), z[[best]]
        cand = finite
        if 0 < p.top_k < cand.size:
            part = np.argpartition(z[cand], -p.top_k)[-p.top_k:]
            cand = cand[part]
        order = np.lexsort((cand, -z[cand]))  # by logit descending, then id
        cand = cand[order]
        zc = z[cand]
        probs = np.exp(zc - zc[0])
        probs /= probs.sum()
        n = cand.size
        if p.top_p < 1.0:
            n = min(n, int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1)
        if p.min_p > 0.0:
            n = min(n, int(np.count_nonzero(probs[:n] >= p.min_p * probs[0])))
        n = max(n, 1)
        return cand[:n], zc[:n]

    def sample(self, logits: np.ndarray, history: list[int]) -> tuple[int, float, list]:
        """Choose the next token.

        Args:
            logits: float (vocab,) for the next position.
            history: tokens so far (prompt and generated), for the penalties.
        Returns:
            (token id, its log-probability under the model's raw distribution, the
            ``top_logprobs`` most likely (id, log-probability) pairs, or []).
        """
        con = self.constraint
        if self._plain_greedy():
            tok = self._greedy(logits, con)
        else:
            cand, zc = self.candidates(logits, history)
            tok = self._draw(cand, zc)
            if con is not None and not con.allowed(tok):
                allowed = self._allowed(con)
                keep = allowed[cand]
                if keep.any() and cand.size > 1:
                    tok = self._draw(cand[keep], zc[keep])
                else:
                    tok = self._draw(*self.candidates(logits, history, allowed))
        return (tok, *self.take(logits, tok))

    def take(self, logits: np.ndarray, tok: int) -> tuple[float, list]:
        """Move the constraint past a chosen token and report it.

        Returns:
            (its log-probability under the raw distribution, the ``top_logprobs`` pairs).
        """
        if self.constraint is not None:
            self.constraint.advance(tok)
        p = self.p
        lse = self._logsumexp(logits)
        top = []
        if p.top_logprobs:
            ids = np.argpartition(logits, -p.top_logprobs)[-p.top_logprobs:]
            ids = ids[np.lexsort((ids, -logits[ids]))]
            top = [(int(t), float(logits[t]) - lse) for t in ids]
        return float(logits[tok]) - lse, top

    def distribution(self, logits: np.ndarray, history: list[int], constraint=None) -> Dist:
        """The exact distribution ``sample`` draws the next token from (speculative
        decoding checks drafts against it).

        Args:
            logits: float (vocab,); history: tokens so far, for the penalties.
            constraint: the TokenConstraint in force at this position, or None.
        Returns:
            A Dist over the tokens that can be drawn.
        """
        if self._plain_greedy():
            return Dist.one(self._greedy(logits, constraint))
        cand, zc = self.candidates(logits, history)
        if constraint is not None:
            allowed = self._allowed(constraint)
            keep = allowed[cand]
            if keep.all():
                pass
            elif keep.any():  # a disallowed first draw is drawn again among the allowed
                cand, zc = cand[keep], zc[keep]
            else:
                cand, zc = self.candidates(logits, history, allowed)
        if cand.size == 1:
            return Dist.one(int(cand[0]))
        w = np.exp((zc - zc.max()) / self.p.temperature)
        return Dist(cand, w / w.sum())

    def draw(self, dist: "Dist") -> int:
        """Returns: a token drawn from ``dist`` with this sampler's generator (no draw at
        all when it has one token)."""
        if dist.ids.size == 1:
            return int(dist.ids[0])
        c = np.cumsum(dist.probs)
        i = int(np.searchsorted(c, self.rng.random() * c[-1], side="right"))
        return int(dist.ids[min(i, dist.ids.size - 1)])

    def _plain_greedy(self) -> bool:
        p = self.p
        return (p.temperature == 0 and not p.logit_bias and p.repeat_penalty == 1.0
                and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)

    def _greedy(self, logits: np.ndarray, con) -> int:
        tok = int(np.argmax(logits))  # plain greedy: no copy of the logits needed
        if con is not None and not con.allowed(tok):
            tok = int(np.argmax(np.where(self._allowed(con), logits, -np.inf)))
        return tok

    def _logsumexp(self, logits: np.ndarray) -> float:
        return self._lse(logits) if self._lse is not None else logsumexp(logits)

    def _draw(self, cand: np.ndarray, zc: np.ndarray) -> int:
        """Returns: a token drawn from candidates with processed logits zc (zc[0] the largest)."""
        if cand.size == 1:
            return int(cand[0])
        w = np.exp((zc - zc.max()) / self.p.temperature)
        c = np.cumsum(w)
        i = int(np.searchsorted(c, self.rng.random() * c[-1], side="right"))
        return int(cand[min(i, cand.size - 1)])

    def _allowed(self, con) -> np.ndarray:
        mask = con.mask()
        if not mask.any():
            raise ConstraintError("no token can continue the constrained output")
        if mask.size < self.vocab_size:  # logits padded past the tokenizer's vocabulary
            mask = np.concatenate([mask, np.zeros(self.vocab_size - mask.size, bool)])
        return mask

    def logprob(self, logits: np.ndarray, tok: int) -> float:
        """log softmax(logits)[tok] under the model's raw distribution."""
        return float(logits[tok]) - self._logsumexp(logits)


def logsumexp(logits: np.ndarray) -> float:
    """log(sum(exp(logits))) of one row."""
    z = np.asarray(logits, dtype=np.float32)
    m = float(z.max())
    return m + math.log(float(np.exp(z - m, dtype=np.float32).sum(dtype=np.float64)))


def token_logprob(logits: np.ndarray, tok: int) -> float:
    """log softmax(logits)[tok], computed in one pass."""
    return float(np.float32(logits[tok])) - logsumexp(logits)
