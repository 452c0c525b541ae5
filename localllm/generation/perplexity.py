"""Perplexity as llama.cpp's perplexity tool measures it (windows of n_ctx tokens, the second
half of each scored, an estimate with its standard error), and the same windows scored under
a second KV type against f16: ΔPPL, mean KL divergence, top-1 agreement."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from localllm.errors import BadSetting
from localllm.runtime.sequence import StepItem

_ROWS = 32  # logit rows turned into log-probabilities at a time (bounded memory)


@dataclass
class Score:
    """Running sums over scored tokens: negative log-likelihoods and their squares."""
    count: int = 0
    nll: float = 0.0
    nll2: float = 0.0

    def add(self, nll: np.ndarray) -> None:
        self.count += nll.size
        self.nll += float(nll.sum())
        self.nll2 += float((nll * nll).sum())

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count) if self.count else float("nan")

    @property
    def ppl_err(self) -> float:
        """llama.cpp's uncertainty: PPL * std(nll) / sqrt(count - 1)."""
        if self.count < 2:
            return float("nan")
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        return self.ppl * math.sqrt(max(var, 0.0) / (self.count - 1))


@dataclass
class Comparison:
    """A second KV type against f16 over the same scored tokens."""
    kv_type: str
    score: Score = field(default_factory=Score)
    kl: list = field(default_factory=list)
    same_top: int = 0
    diff: list = field(default_factory=list)   # nll(type) - nll(f16) per token

    def summary(self, base: Score) -> dict:
        kl = np.concatenate(self.kl) if self.kl else np.zeros(0)
        d = np.concatenate(self.diff) if self.diff else np.zeros(0)
        n = max(d.size, 1)
        ratio_err = float(d.std() / math.sqrt(n)) if d.size > 1 else float("nan")
        return {"kv_type": self.kv_type, "ppl": self.score.ppl, "ppl_err": self.score.ppl_err,
                "delta_ppl": self.score.ppl - base.ppl,
                "ln_ppl_ratio": float(d.mean()) if d.size else float("nan"),
                "ln_ppl_ratio_err": ratio_err,
                "mean_kl": float(kl.mean()) if kl.size else float("nan"),
                "mean_kl_err": float(kl.std() / math.sqrt(n)) if kl.size > 1 else float("nan"),
                "top1_agreement": self.same_top / n}


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def _window_logits(model, toks: list[int], first: int):
    """Logits of positions first..len-2 of one window, run from an empty cache, in rows."""
    bs = model.settings.batch_size
    with model.new_sequence() as seq:
        for s in range(0, len(toks) - 1, bs):
            chunk = toks[s:min(s + bs, len(toks) - 1)]
            want = "all" if s + len(chunk) > first else "none"
            out = model.step([StepItem(seq, chunk, want)])[0]
            if out is not None:
                lo = max(first - s, 0)
                yield out[lo:], s + lo


def perplexity(model, ids: list[int], n_ctx: int, compare: list | None = None,
               progress: Callable[[int, int, float, float], None] | None = None) -> dict:
    """Score ``ids`` in windows of ``n_ctx`` tokens.

    Args:
        model: an engine.Model (its own KV types are the base).
        ids: the text's tokens (with BOS where the model adds one).
        n_ctx: window size; windows are whole, the rest of the text is left out.
        compare: other engine.Model views over the same weights (Model.with_kv) whose
            scores are compared with the base's on every token.
        progress: called after each window with (windows done, windows, tok/s, PPL so far).
    Returns:
        {"windows", "tokens_scored", "ppl", "ppl_err", "seconds", "compare": [...]}.
    """
    if n_ctx < 4 or n_ctx > model.ctx:
        raise BadSetting(f"window size {n_ctx} must be between 4 and the context {model.ctx}",
                         param="n_ctx")
    n_win = len(ids) // n_ctx
    if n_win == 0:
        raise BadSetting(f"the text has {len(ids)} tokens, fewer than one window of {n_ctx}; "
                         "use a smaller -c or a longer text", param="n_ctx")
    bos = model.tokenizer.bos_id if model.tokenizer.add_bos else None
    base = Score()
    comps = [Comparison(m.kv.k_type if m.kv.k_type == m.kv.v_type
                        else f"{m.kv.k_type}/{m.kv.v_type}") for m in compare or []]
    first = n_ctx // 2
    t0 = time.perf_counter()
    for w in range(n_win):
        toks = list(ids[w * n_ctx:(w + 1) * n_ctx])
        if bos is not None:
            toks[0] = bos
        streams = [_window_logits(model, toks, first)] + \
                  [_window_logits(m, toks, first) for m in compare or []]
        for parts in zip(*streams):
            z0, at = parts[0]
            for r in range(0, len(z0), _ROWS):
                targets = np.asarray(toks[at + r + 1:at + r + 1 + min(_ROWS, len(z0) - r)])
                lp0 = _log_softmax(z0[r:r + _ROWS])
                nll0 = -lp0[np.arange(len(targets)), targets]
                base.add(nll0)
                for c, (z, _) in zip(comps, parts[1:]):
                    lp = _log_softmax(z[r:r + _ROWS])
                    nll = -lp[np.arange(len(targets)), targets]
                    c.score.add(nll)
                    c.diff.append(nll - nll0)
                    c.kl.append((np.exp(lp0) * (lp0 - lp)).sum(axis=1))
                    c.same_top += int((lp.argmax(1) == lp0.argmax(1)).sum())
        if progress is not None:
            done = (w + 1) * n_ctx * (1 + len(comps))
            progress(w + 1, n_win, done / (time.perf_counter() - t0), base.ppl)
    return {"windows": n_win, "tokens_scored": base.count, "ppl": base.ppl,
            "ppl_err": base.ppl_err, "seconds": time.perf_counter() - t0,
            "compare": [c.summary(base) for c in comps]}
