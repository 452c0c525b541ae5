"""Continuous batching: requests that share forward passes give exactly the tokens they give
alone, join and leave between steps, and give their blocks back."""

import pytest

import localllm
from localllm.generation.batching import Batcher


@pytest.fixture(scope="module")
def model(smollm_path):
    return localllm.load(smollm_path, ctx_size=1024, threads=2, batch_size=64)


def alone(m, ids, **kw):
    g = m.generate(ids, **kw)
    return [t for c in g for t in c.tokens], g.stats.finish_reason


def test_batched_requests_equal_their_solo_runs(model):
    m = model
    passage = "The river ran under the old stone bridge, past the mill and the church. " * 6
    prompts = [m.tokenize(p) for p in ("Once upon a time", "def fib(n):", passage,
                                       "1, 2, 3, 4,", passage + " And then")]
    kws = [dict(temperature=0.9, seed=s, max_tokens=n, ignore_eos=True)
           for s, n in zip(range(5), (30, 12, 25, 40, 8))]
    kws[3].update(temperature=0, stop=[" 9"])  # ends on a stop string
    m.forget_cached()
    want = [alone(m, p, **k) for p, k in zip(prompts, kws)]
    m.forget_cached()
    b = Batcher(m, token_budget=48)  # long prompts go in chunks beside the decoding ones
    reqs = [b.add(prompts[i], **kws[i]) for i in range(3)]
    late = []
    steps = 0
    while b.active:
        b.step()
        steps += 1
        if steps == 5:  # two more join while the first are running
            late = [b.add(prompts[i], **kws[i]) for i in (3, 4)]
    got = [([t for c in r.chunks for t in c.tokens], r.chunks[-1].finish_reason)
           for r in reqs + late]
    assert got == want
    assert all(r.done and r.error is None for r in reqs + late)
    assert m.kv_stats().blocks_used == 0
    total = sum(len(t) for t, _ in want) + sum(len(p) for p in prompts)
    assert steps < total / 2  # they really shared the passes


def test_cancel_and_errors_leave_nothing_held(model):
    m = model
    b = Batcher(m)
    r1 = b.add(m.tokenize("Tell me a story"), temperature=0, max_tokens=100, ignore_eos=True)
    r2 = b.add(m.tokenize("Another one"), temperature=0, max_tokens=5)
    b.step()
    b.step()
    b.cancel(r1)
    assert r1.done and r1 not in b.active
    while b.active:
        b.step()
    assert r2.done and r2.chunks[-1].finish_reason in ("stop", "length")
    assert m.kv_stats().blocks_used == 0
    with pytest.raises(localllm.api.EngineError):
        b.add([], max_tokens=3)
    with pytest.raises(TypeError):
        b.add([1, 2], temprature=1)
