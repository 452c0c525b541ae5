"""Sampling and stop strings, without a model."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localllm.generation.decoder import StopMatcher
from localllm.generation.sampling import Sampler, SamplingParams, token_logprob


def logits(rng, n=50):
    return rng.standard_normal(n).astype(np.float32) * 3


def test_greedy_picks_the_argmax():
    z = logits(np.random.default_rng(0))
    tok, lp, top = Sampler(SamplingParams(temperature=0), len(z)).sample(z, [])
    assert tok == int(np.argmax(z))
    assert lp == pytest.approx(token_logprob(z, tok))
    assert lp < 0
    assert top == []


def test_top_logprobs_are_the_most_likely_tokens_in_order():
    z = logits(np.random.default_rng(5))
    z[7] = z[9] = z.max() + 1  # a tie: the lower id first
    _, _, top = Sampler(SamplingParams(temperature=0, top_logprobs=5), len(z)).sample(z, [])
    assert [t for t, _ in top] == [7, 9] + list(np.argsort(-z)[2:5])
    assert all(lp == pytest.approx(token_logprob(z, t)) for t, lp in top)
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=21).validate()


def test_top_k_1_is_greedy_at_any_temperature():
    z = logits(np.random.default_rng(1))
    s = Sampler(SamplingParams(temperature=5.0, top_k=1, seed=3), len(z))
    assert {s.sample(z, [])[0] for _ in range(20)} == {int(np.argmax(z))}


def test_same_seed_same_draws_and_different_seed_differs():
    z = logits(np.random.default_rng(2))
    p = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    a = [Sampler(SamplingParams(seed=11, **p), len(z)).sample(z, [])[0] for _ in range(3)]
    s1 = Sampler(SamplingParams(seed=11, **p), len(z))
    s2 = Sampler(SamplingParams(seed=11, **p), len(z))
    s3 = Sampler(SamplingParams(seed=12, **p), len(z))
    d1 = [s1.sample(z, [])[0] for _ in range(40)]
    assert d1 == [s2.sample(z, [])[0] for _ in range(40)]
    assert d1 != [s3.sample(z, [])[0] for _ in range(40)]
    assert len(set(a)) == 1


def test_sampling_follows_the_distribution():
    z = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5), 3)
    counts = np.bincount([s.sample(z, [])[0] for _ in range(4000)], minlength=3) / 4000
    assert np.allclose(counts, [0.5, 0.3, 0.2], atol=0.03)


def test_top_p_and_min_p_truncate():
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0), 4)
    assert sorted(s.candidates(z, [])[0].tolist()) == [0, 1]
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.25), 4)
    assert sorted(s.candidates(z, [])[0].tolist()) == [0, 1, 2]


def test_penalties_and_bias():
    z = np.array([2.0, 1.9, -1.0, 0.5], np.float32)
    greedy = dict(temperature=0)
    assert Sampler(SamplingParams(**greedy), 4).sample(z, [0])[0] == 0
    assert Sampler(SamplingParams(repeat_penalty=1.5, **greedy), 4).sample(z, [0])[0] == 1
    assert Sampler(SamplingParams(presence_penalty=0.5, **greedy), 4).sample(z, [0])[0] == 1
    assert Sampler(SamplingParams(frequency_penalty=0.06, **greedy), 4).sample(z, [0, 0])[0] == 1
    assert Sampler(SamplingParams(logit_bias={2: 10.0}, **greedy), 4).sample(z, [])[0] == 2
    # A negative logit is pushed further down by the repeat penalty, never up.
    c, zc = Sampler(SamplingParams(repeat_penalty=2.0, top_k=0, top_p=1, min_p=0), 4).candidates(z, [2])
    assert zc[list(c).index(2)] == pytest.approx(-2.0)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=1.5), dict(min_p=-0.1),
                                 dict(top_k=-2), dict(repeat_penalty=0), dict(max_tokens=-1),
                                 dict(stop=[""]), dict(seed=-1)])
def test_invalid_settings_raise(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad).validate()


def test_logit_bias_outside_vocab_raises():
    with pytest.raises(ValueError):
        Sampler(SamplingParams(logit_bias={99: 1.0}), 10)


def run_matcher(stops, pieces):
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, stopped = m.push(p)
        out.append(text)
        if stopped:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["</end>"])
    assert m.push("hello </") == ("hello ", False)
    assert m.push("en") == ("", False)
    assert m.push("d> tail") == ("", True)
    m = StopMatcher(["</end>"])
    assert m.push("a </e") == ("a ", False)
    assert m.push("x") == ("</ex", False)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab<>/ ", max_size=40), st.lists(st.sampled_from(["ab", "b>", "</", "a b"]),
                                                          max_size=3),
       st.data())
def test_stop_matcher_split_invariant(text, stops, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
    expected_hits = [text.find(s) for s in stops if s in text]
    got, stopped = run_matcher(stops, pieces)
    if expected_hits:
        # With pieces, a stop string is found as soon as it is complete, which can be
        # earlier in the text than a later-starting but earlier-completing one; the
        # emitted text never contains any stop string and is a prefix of the text.
        assert stopped
        assert text.startswith(got)
        assert not any(s in got for s in stops)
    else:
        assert (got, stopped) == (text, False)
