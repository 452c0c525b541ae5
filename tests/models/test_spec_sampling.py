"""Speculative sampling is exact in distribution: the rule gives the target's distribution
analytically, and on a tiny synthetic model the first three tokens sampled with drafts (a
draft model, prompt lookup) follow plain sampling's distribution by chi-square, at T = 0.8
with top-k, top-p and a repeat penalty, while deliberately wrong rules fail the same test."""

import math
from collections import Counter

import numpy as np
import pytest

import localllm
from localllm.testing import tiny_model
from localllm.generation import speculative
from localllm.generation.sampling import Dist, Sampler, SamplingParams
from localllm.generation.speculative import accept_probability, residual

SETTINGS = dict(temperature=0.8, top_k=8, top_p=0.9, min_p=0.0, repeat_penalty=1.3,
                max_tokens=4, ignore_eos=True)
# Tokens the tiny model favours, in repeats that prompt lookup matches: after most first
# tokens it drafts one the model gives a fair chance (chosen by a search over such prompts).
PROMPT = [170, 151, 10, 41, 110, 151, 151, 39, 10, 151, 151]
SAMPLES = 3000
ALPHA = 1e-3          # a right rule must not be rejected at this level ...
WRONG = 1e-6          # ... and a wrong one must be, far beyond it


# ----------------------------------------------------------------------------- analytically

def _dist(rng, ids, vocab=40):
    ids = rng.choice(vocab, size=ids, replace=False)
    p = rng.random(ids.size) ** 3
    return Dist(ids, p / p.sum())


def _output(p: Dist, q: Dist | None, x_dist: Dist, rule=accept_probability) -> dict:
    """The exact distribution of verify()'s token, the draft drawn from x_dist."""
    out: Counter = Counter()
    for x, qx in zip(x_dist.ids, x_dist.probs):
        a = rule(p.prob(x), 1.0 if q is None else q.prob(x))
        a = min(max(a, 0.0), 1.0)
        out[int(x)] += qx * a
        r = residual(p, int(x), q)
        for t, rt in zip(r.ids, r.probs):
            out[int(t)] += qx * (1 - a) * rt
    return out


def test_rule_gives_the_target_distribution_exactly():
    rng = np.random.default_rng(0)
    for trial in range(200):
        p = _dist(rng, rng.integers(1, 12))
        q = _dist(rng, rng.integers(1, 12))
        want = {int(t): v for t, v in zip(p.ids, p.probs)}
        got = _output(p, q, q)
        assert all(abs(got.get(t, 0.0) - want.get(t, 0.0)) < 1e-12 for t in set(got) | set(want))
        x = int(rng.integers(40))  # a deterministic draft: q is one-hot at x
        got = _output(p, None, Dist.one(x))
        assert all(abs(got.get(t, 0.0) - want.get(t, 0.0)) < 1e-12 for t in set(got) | set(want))


def test_wrong_rule_does_not():
    rng = np.random.default_rng(1)
    p, q = _dist(rng, 6), _dist(rng, 6)
    got = _output(p, q, q, rule=lambda px, qx: 1.0 if qx >= px else 0.0)
    assert max(abs(got.get(int(t), 0.0) - v) for t, v in zip(p.ids, p.probs)) > 0.01


# ----------------------------------------------------------------------------- by sampling

def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X chi-square with ``dof`` degrees of freedom: the regularized upper
    incomplete gamma function Q(dof/2, x/2), by its series below a + 1, else by its
    continued fraction (modified Lentz)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    log_front = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1:
        term = total = 1.0 / a
        n = 0
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= z / (a + n)
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = z + 1 - a
    c, d = 1 / tiny, 1 / b
    f = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        f *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return f * math.exp(log_front)


def test_chi2_sf_known_values():
    # Quantiles of the chi-square distribution (table values).
    for x, dof, p in ((3.841, 1, 0.05), (18.307, 10, 0.05), (23.209, 10, 0.01),
                      (124.342, 100, 0.05), (0.1026, 2, 0.95)):
        assert abs(chi2_sf(x, dof) - p) < 2e-4


def chi_square_p(counts: Counter, expected: dict, n: int) -> float:
    """Pearson's goodness of fit of ``counts`` (n samples) to ``expected`` probabilities;
    cells expecting fewer than 5 are pooled, with anything observed outside them."""
    big = [c for c, p in expected.items() if p * n >= 5]
    stat = sum((counts.get(c, 0) - expected[c] * n) ** 2 / (expected[c] * n) for c in big)
    rest_e = n - sum(expected[c] * n for c in big)
    rest_o = n - sum(counts.get(c, 0) for c in big)
    cells = len(big)
    if rest_e > 1e-9:
        stat += (rest_o - rest_e) ** 2 / rest_e
        cells += 1
    elif rest_o:
        return 0.0  # tokens plain sampling can never give
    return chi2_sf(stat, cells - 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target (embeddings scaled so that its distributions are uneven), a draft that
    is the target with noise on every matrix, and the target loaded three ways."""
    d = tmp_path_factory.mktemp("spec")
    w = tiny_model.tensors(seed=0)
    w["token_embd.weight"] = w["token_embd.weight"] * 2
    rng = np.random.default_rng(7)
    wd = {k: v + (rng.standard_normal(v.shape) * 0.5 * v.std()).astype(np.float32)
          if v.ndim == 2 else v for k, v in w.items()}
    target = tiny_model.write(d / "target.gguf", weights=w)
    draft = tiny_model.write(d / "draft.gguf", weights=wd)
    kw = dict(threads=1, ctx_size=64, weight_cache=False, download=False)
    return {"plain": localllm.load(target, **kw),
            "lookup": localllm.load(target, lookup=4, **kw),
            "draft": localllm.load(target, draft=str(draft), draft_max=3, **kw)}


def exact_first3(m) -> dict:
    """The distribution of the first three tokens under plain sampling, from the sampler's
    own distribution at each of the prefixes."""
    s = Sampler(SamplingParams(**SETTINGS), m.vocab_size)

    def dist(ids):
        return s.distribution(m.logits(ids)[-1], ids)

    out = {}
    d1 = dist(PROMPT)
    for a, pa in zip(d1.ids.tolist(), d1.probs):
        d2 = dist(PROMPT + [a])
        for b, pb in zip(d2.ids.tolist(), d2.probs):
            d3 = dist(PROMPT + [a, b])
            for c, pc in zip(d3.ids.tolist(), d3.probs):
                out[(a, b, c)] = pa * pb * pc
    return out


def sample_first3(m, speculate=True) -> tuple[Counter, int, int]:
    counts: Counter = Counter()
    drafted = accepted = 0
    for seed in range(SAMPLES):
        g = m.generate(PROMPT, speculate=speculate, seed=seed, **SETTINGS)
        toks = tuple(t for c in g for t in c.tokens)
        counts[toks[:3]] += 1
        drafted += g.stats.draft_tokens
        accepted += g.stats.accepted_tokens
    return counts, drafted, accepted


@pytest.fixture(scope="module")
def expected(tiny):
    e = exact_first3(tiny["plain"])
    assert abs(sum(e.values()) - 1) < 1e-9 and len(e) > 20
    return e


def test_plain_sampling_follows_the_computed_distribution(tiny, expected):
    counts, drafted, _ = sample_first3(tiny["plain"])
    assert drafted == 0
    assert chi_square_p(counts, expected, SAMPLES) > ALPHA


@pytest.mark.parametrize("how", ["draft", "lookup"])
def test_speculative_sampling_follows_it(tiny, expected, how):
    counts, drafted, accepted = sample_first3(tiny[how])
    assert 0.1 * drafted < accepted < 0.9 * drafted  # both outcomes are exercised
    p = chi_square_p(counts, expected, SAMPLES)
    print(f"{how}: {accepted}/{drafted} drafts accepted, chi-square p = {p:.3g}")
    assert p > ALPHA


def _accept_if_q_at_least_p(p_x, q_x):
    return 1.0 if q_x >= p_x else 0.0


def _resample_from_p(p, x, q):
    return p


@pytest.mark.parametrize("how, name, wrong", [
    ("draft", "accept_probability", _accept_if_q_at_least_p),
    ("lookup", "accept_probability", _accept_if_q_at_least_p),
    ("draft", "residual", _resample_from_p),
])
def test_a_wrong_rule_fails(tiny, expected, monkeypatch, how, name, wrong):
    monkeypatch.setattr(speculative, name, wrong)
    counts, drafted, _ = sample_first3(tiny[how])
    p = chi_square_p(counts, expected, SAMPLES)
    print(f"{how} with {wrong.__name__}: chi-square p = {p:.3g}")
    assert p < WRONG
