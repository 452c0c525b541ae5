"""The runtime's and the orchestration's contracts: a step is a list of named StepItems,
a Sequence alone writes its tokens, the KV space owns the layer -> group mapping, the Decoder
takes its settings by keyword, and the Batcher sizes its own next step."""

import ast
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

import localllm
from localllm.api import StepItem
from localllm.generation.batching import Batcher
from localllm.generation.decoder import Decoder, DecoderHooks, run_generation
from localllm.generation.sampling import SamplingParams
from localllm.models.net import PlacedLayer
from localllm.runtime.sequence import kv_groups

PACKAGE = Path(localllm.__file__).resolve().parent


@pytest.fixture(scope="module")
def smollm(smollm_path):
    m = localllm.load(smollm_path, ctx_size=1024, threads=2, batch_size=64)
    yield m
    m.close()


# ---- StepItem ----------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [True, False, None, "every", "LAST", 1])
def test_a_step_item_refuses_a_bad_logits_value(bad):
    with pytest.raises(ValueError, match=re.escape(f"got {bad!r}")):
        StepItem(None, [1, 2], bad)


def test_step_takes_named_items_and_returns_what_each_asks(smollm):
    m = smollm
    ids = m.tokenize("The quick brown fox jumps over the lazy dog")
    whole = m.logits(ids)
    with m.new_sequence() as a, m.new_sequence() as b, m.new_sequence() as c:
        outs = m.step([StepItem(a, ids, "all"), StepItem(b, ids, "last"),
                       StepItem(c, ids[:4], "none")])
        assert outs[0].shape == whole.shape and np.array_equal(outs[0], whole)
        assert np.array_equal(outs[1], whole[-1])
        assert outs[2] is None
        assert len(c) == 4
        with pytest.raises(TypeError, match="StepItem"):
            m.step([(c, ids[4:], False)])   # the old positional tuple is refused


# ---- Sequence owns its tokens ------------------------------------------------------------

def test_no_module_writes_a_sequences_tokens_from_outside():
    """``_tokens`` is read or written only by Sequence's own methods."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        inside = set()
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef) and cls.name == "Sequence":
                inside |= {id(n) for n in ast.walk(cls)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == "_tokens"
                    and id(node) not in inside
                    and not (isinstance(node.value, ast.Name) and node.value.id == "self")):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []


def test_the_runner_changes_tokens_only_through_the_sequence(smollm):
    m = smollm
    ids = m.tokenize("A sequence holds the tokens whose keys and values it has, " * 4)
    assert len(ids) > 2 * m.settings.kv_block_size
    m.forget_cached()
    with m.new_sequence() as seq:
        seq.feed(ids[:20])
        toks = seq.tokens
        assert isinstance(toks, tuple) and toks == tuple(ids[:20])
        seq.feed(ids[20:30])
        assert toks == tuple(ids[:20])           # what was handed out never changes
        assert seq.tokens == tuple(ids[:30])
        assert seq.trim(25) == 25 and seq.tokens == tuple(ids[:25])
        # reuse keeps the common prefix with a new prompt, and nothing after it
        assert m.prepare(seq, ids[:22] + [7, 8, 9]) == 22
        assert seq.tokens == tuple(ids[:22])
    with m.new_sequence() as first:
        first.feed(ids)
    # a fresh sequence takes a longer prefix from the cache, its tokens with it
    with m.new_sequence() as seq:
        n = m.prepare(seq, ids)
        assert n >= 2 * m.settings.kv_block_size and seq.tokens == tuple(ids[:n])
        last = seq.feed(ids[n:])
        assert seq.tokens == tuple(ids)
    assert np.array_equal(last, m.logits(ids)[-1])


# ---- KV groups -------------------------------------------------------------------------

def test_the_kv_space_owns_each_layers_group(gemma_path):
    assert "group" not in {f.name for f in dataclasses.fields(PlacedLayer)}
    m = localllm.load(gemma_path, ctx_size=512, threads=2)
    try:
        layers = m.net.layers
        groups = kv_groups(layers)
        assert len(groups) == 2                     # sliding-window layers and global ones
        assert sorted(i for g in groups for i in g.layers) == list(range(len(layers)))
        for gi, g in enumerate(groups):
            for i in g.layers:
                assert m.kv.layer_group[i] == gi
                assert layers[i].spec.window == g.window
                assert m.kv.group_layers[gi][g.layers.index(i)] is layers[i]
        assert {g.window > 0 for g in groups} == {True, False}
        assert [g.layers for g in groups] == [tuple(c.layers) for c in m.kv.cache.groups]
        assert not any(hasattr(la, "group") for la in layers)   # nothing written into them
    finally:
        m.close()


# ---- Decoder -------------------------------------------------------------------------

def test_the_decoder_takes_settings_by_keyword_and_callbacks_as_hooks(smollm):
    m = smollm
    ids = m.tokenize("Once upon a time")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with pytest.raises(TypeError):
        Decoder(ids, 0, 100, params, m.vocab_size, m.tokenizer.stream(continuation=True),
                m.tokenizer.is_eog)
    with pytest.raises(ValueError, match="rollback"):
        DecoderHooks(speculate=lambda seed: None)
    calls = []
    with m.new_sequence() as seq:
        d = Decoder(ids, 0, m.ctx - len(ids), params, vocab_size=m.vocab_size,
                    stream=m.tokenizer.stream(continuation=True), is_eog=m.tokenizer.is_eog,
                    hooks=DecoderHooks(after_prompt=lambda: calls.append(len(seq))))
        text = "".join(run_generation(seq.feed, d))
    assert calls == [len(ids)]                   # once, when the prompt had run
    assert d.stats.generated_tokens == 8
    assert text == "".join(m.generate(ids, temperature=0, max_tokens=8, ignore_eos=True,
                                      speculate=False))


# ---- the Batcher's own bookkeeping ---------------------------------------------------

def old_scheduler_blocks(b: Batcher, block_size: int) -> int:
    """What the server's scheduler computed itself before the Batcher did."""
    decoding = sum(1 for r in b.active if r.prompted)
    prompts = [len(r.decoding.decoder.pending) for r in b.active if not r.prompted]
    chunk = min(sum(prompts), max(0, b.token_budget - decoding))
    return decoding + -(-chunk // block_size) + len(prompts)


def test_the_batcher_sizes_its_next_step_as_the_scheduler_did(smollm):
    m = smollm
    bs = m.settings.kv_block_size
    m.forget_cached()
    b = Batcher(m, token_budget=48)
    assert b.blocks_for_next_step() == 0
    words = "one two three four five six seven eight nine ten eleven twelve " * 8
    prompts = [m.tokenize(words)[:n] for n in (40, 30, 20)]
    reqs = [b.add(p, temperature=0, max_tokens=6, ignore_eos=True) for p in prompts]
    assert [b.pending_tokens(r) for r in reqs] == [40, 30, 20]
    # nothing decodes yet: 48 of the 90 prompt tokens, 3 blocks, plus one per prompt
    assert b.blocks_for_next_step() == 48 // bs + 3 == old_scheduler_blocks(b, bs)
    seen = set()
    while b.active:
        assert b.blocks_for_next_step() == old_scheduler_blocks(b, bs)
        seen.add(tuple(r.prompted for r in b.active))
        b.step()
    assert len(seen) >= 3                        # prompts, a mix, all decoding
    assert all(r.prompted and r.done and r.error is None for r in reqs)
    assert not any(hasattr(r.decoding, "prompted") for r in reqs)
    assert m.kv_stats().blocks_used == 0
