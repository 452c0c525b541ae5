"""The paged KV cache through the engine on both real models: the contiguous cache's bits,
batch invariance in every KV type, sequences that never disturb each other, prefix reuse
across turns (Gemma 3's sliding windows included), memory that grows on demand, and a full
context handled out loud."""

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import localllm
from localllm.api import EngineError

FIXTURES = Path(__file__).parents[1] / "fixtures" / "logits"
TYPES = ("f16", "bf16", "fp8", "q8_0", "q4_0")


def fixture(name, kind):
    return json.loads((FIXTURES / f"{name}_{kind}.json").read_text())


@pytest.fixture(scope="module")
def smollm(smollm_model):
    return {t: smollm_model.with_kv(t, t) for t in TYPES}  # the session's weights


@pytest.fixture(scope="module")
def gemma(gemma_model):
    return gemma_model.with_kv("f16", "f16")


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def text(gen):
    return "".join(gen)


# ----------------------------------------------------------------------------- bits

def test_paged_f16_logits_equal_the_contiguous_cache(smollm, gemma):
    """Hashes stored before the cache became paged (scripts/fixtures_bits.py)."""
    for name, m in (("smollm", smollm["f16"]), ("gemma", gemma)):
        ids = fixture(name, "logits")["ids"]
        rows = [hashlib.sha256(r.tobytes()).hexdigest()[:16] for r in m.logits(ids)]
        assert rows == fixture(name, "bits")["rows"], name


def chunked_logits(m, ids, sizes):
    with m.new_sequence() as seq:
        parts, pos = [], 0
        for size in sizes:
            if pos >= len(ids):
                break
            parts.append(seq.feed(ids[pos:pos + size], all_logits=True))
            pos += size
        return np.concatenate(parts)


@pytest.mark.parametrize("kind", TYPES)
def test_every_kv_type_is_batch_invariant(smollm, gemma, kind):
    rng = np.random.default_rng(3)
    cases = [(smollm[kind], fixture("smollm", "logits")["ids"][:90])]
    if kind in ("q8_0", "q4_0"):  # quantized sliding-window layers too
        g = localllm.load(gemma.path, ctx_size=1024, threads=2, ctk=kind, ctv=kind)
        cases.append((g, fixture("gemma", "logits")["ids"][:90]))
    for m, ids in cases:
        whole = m.logits(ids)
        for sizes in ([7] * 13, list(rng.integers(1, 30, size=20)), [1] * len(ids)):
            np.testing.assert_array_equal(bits(chunked_logits(m, ids, sizes)), bits(whole))


def test_kv_types_differ_from_f16_only_a_little(smollm):
    ids = fixture("smollm", "logits")["ids"][:200]
    ref = smollm["f16"].logits(ids).argmax(1)
    for kind, floor in (("bf16", 0.95), ("q8_0", 0.95), ("fp8", 0.8), ("q4_0", 0.7)):
        agree = (smollm[kind].logits(ids).argmax(1) == ref).mean()
        assert agree >= floor, (kind, agree)


def test_bytes_per_token_measured_from_the_pool(smollm):
    per = {t: m.kv_stats().bytes_per_token for t, m in smollm.items()}
    assert per["f16"] == 30 * 3 * 64 * 2 * 2  # layers x KV heads x head size x K,V x 2 bytes
    assert per["q8_0"] <= 0.55 * per["f16"]
    assert per["q4_0"] <= 0.30 * per["f16"]
    assert per["fp8"] == 0.5 * per["f16"]
    m = smollm["q4_0"]
    with m.new_sequence() as seq:
        seq.feed(list(range(1, 100)))
        s = m.kv_stats()
        assert s.blocks_used == 7 and s.used_bytes == 7 * 16 * per["q4_0"]


# ----------------------------------------------------------------------------- sequences

def test_interleaved_generators_equal_sequential_ones(smollm):
    m = smollm["f16"]
    kw = dict(temperature=0.9, top_k=40, max_tokens=20, seed=5, ignore_eos=True)
    prompts = ["The river", "Once upon a time there was", "def fib(n):"]
    m.forget_cached()
    alone = [text(m.generate(p, **kw)) for p in prompts]
    m.forget_cached()
    gens = [m.generate(p, **kw) for p in prompts]
    outs = ["", "", ""]
    done = [False] * 3
    while not all(done):
        for i, g in enumerate(gens):
            if not done[i]:
                try:
                    outs[i] += next(g)
                except StopIteration:
                    done[i] = True
    assert outs == alone
    assert m.kv_stats().blocks_used == 0  # every generation released its sequence


def test_fork_and_trim_keep_each_sequence_exact(smollm):
    m = smollm["f16"]
    ids = fixture("smollm", "logits")["ids"][:60]
    whole = m.logits(ids)
    with m.new_sequence() as a:
        a.feed(ids[:37])
        b = a.fork()
        np.testing.assert_array_equal(bits(b.feed(ids[37:60], all_logits=True)),
                                      bits(whole[37:60]))
        np.testing.assert_array_equal(bits(a.feed([5, 6, 7], all_logits=True)),
                                      bits(m.logits(ids[:37] + [5, 6, 7])[37:]))
        assert a.trim(37) == 37  # a rejected draft, rolled back
        np.testing.assert_array_equal(bits(a.feed(ids[37:45], all_logits=True)),
                                      bits(whole[37:45]))
        assert b.tokens == tuple(ids[:60])
        b.release()
        with pytest.raises(EngineError):
            b.feed([1])


def test_two_turn_chat_reuses_the_first_turn(smollm):
    m = smollm["f16"]
    m.forget_cached()
    msgs = [{"role": "user", "content": "Name three fruits."}]
    reply = text(m.chat(msgs, temperature=0, max_tokens=24))
    msgs += [{"role": "assistant", "content": reply},
             {"role": "user", "content": "Now three vegetables."}]
    second = m.chat(msgs, temperature=0, max_tokens=24)
    out = text(second)
    st = second.stats
    full = m.chat_tokens(msgs)
    new_msg = m.chat_tokens(msgs[-1:])
    assert st.prompt_tokens == len(full)
    assert st.cached_tokens >= len(full) - len(new_msg) - 16
    m.forget_cached()
    scratch = m.chat(msgs, temperature=0, max_tokens=24)
    assert text(scratch) == out and scratch.stats.cached_tokens == 0


def test_a_conversation_sequence_keeps_its_tokens(smollm):
    m = smollm["f16"]
    seq = m.new_sequence()
    msgs = [{"role": "user", "content": "Say hello."}]
    g = m.chat(msgs, seq=seq, temperature=0, max_tokens=8)
    first = text(g)
    assert len(seq) == g.stats.prompt_tokens + g.stats.generated_tokens - 1
    msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": "Again."}]
    g2 = m.chat(msgs, seq=seq, temperature=0, max_tokens=8)
    text(g2)
    assert g2.stats.cached_tokens > g.stats.prompt_tokens
    seq.release()


def test_gemma_five_turn_chat_and_regeneration_reprocess_nothing(gemma):
    """A base model's conversation as growing text: every turn processes only what is new,
    also on the sliding-window layers, whose blocks stay bounded; then the last answer is
    regenerated (long enough that the window moved past the prompt) from its checkpoint."""
    m = gemma
    m.forget_cached()
    passage = fixture("gemma", "logits")["passage"]
    seq = m.new_sequence()
    conv = m.tokenize("A conversation.\n")
    bs = m.kv_stats().block_size
    window_blocks = 512 // bs + 2
    sliding = next(i for i, g in enumerate(m.kv.cache.groups) if g.window)
    for turn in range(5):
        user = m.tokenize(f"\nQ{turn}: {passage}\nA:", add_special=False)
        prompt = conv + user
        g = m.generate(prompt, seq=seq, temperature=0, max_tokens=600 if turn == 4 else 100,
                       ignore_eos=True)
        reply = [t for c in g for t in c.tokens]
        if turn:  # only the new text, and the reply's last token (sampled, never run)
            assert g.stats.prompt_tokens - g.stats.cached_tokens == len(user) + 1
        held = m.kv.cache.held_blocks(seq.kv, sliding)
        assert held <= window_blocks  # the window, not the conversation
        ckpt = {b for cp in seq.kv.checkpoints for b in cp.blocks[sliding].values()}
        assert len(ckpt) <= m.kv.cache.max_checkpoints * window_blocks
        conv = prompt + reply
    assert len(conv) >= 3000
    last_prompt = prompt
    # Regenerate the last answer: the window at its prompt comes from the checkpoint.
    regen = m.generate(last_prompt, seq=seq, temperature=0, max_tokens=40, ignore_eos=True)
    again = [t for c in regen for t in c.tokens]
    assert regen.stats.cached_tokens == len(last_prompt) - 1
    assert again == reply[:40]
    seq.release()
    # The same from scratch: identical tokens.
    m.forget_cached()
    scratch = m.generate(last_prompt, temperature=0, max_tokens=40, ignore_eos=True)
    assert [t for c in scratch for t in c.tokens] == again
    assert scratch.stats.cached_tokens == 0
    # A new request continuing the conversation finds it in the prefix cache.
    more = m.generate(last_prompt + again[:10], temperature=0, max_tokens=2)
    list(more)
    assert more.stats.cached_tokens >= len(last_prompt) + 10 - bs
    stats = m.kv_stats().groups[sliding]
    assert stats.used == 0 and stats.cached <= m.kv.cache.groups[sliding].max_cached


# ----------------------------------------------------------------------------- context and memory

def test_a_full_context_is_said_not_cut(smollm_path):
    m = localllm.load(smollm_path, ctx_size=64, threads=2)
    with pytest.raises(EngineError, match="context"):
        m.generate("word " * 80)
    g = m.generate("Count: 1, 2, 3,", temperature=0, max_tokens=200, ignore_eos=True)
    chunks = list(g)
    assert chunks[-1].finish_reason == "length" and g.stats.finish_reason == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert g.stats.prompt_tokens + g.stats.generated_tokens == 64
    long_turns = [{"role": "user", "content": "Tell me about rivers and lakes. " * 3},
                  {"role": "assistant", "content": "Rivers flow; lakes stay. " * 3},
                  {"role": "user", "content": "And seas?"}]
    with pytest.raises(EngineError):
        m.chat(long_turns, max_tokens=4)
    shifted = m.chat(long_turns, temperature=0, max_tokens=4, context_shift=True)
    list(shifted)
    assert shifted.stats.dropped_messages >= 1  # the oldest turns made way for the question
    # A reply that fills the context: the oldest turns go, the reply goes on.
    m = localllm.load(smollm_path, ctx_size=160, threads=2)
    assert len(m.chat_tokens(long_turns)) < 100
    shifted = m.chat(long_turns, temperature=0, max_tokens=100, ignore_eos=True,
                     context_shift=True)
    out = list(shifted)
    assert shifted.stats.dropped_messages >= 1
    assert shifted.stats.generated_tokens == 100 and out[-1].finish_reason == "length"


def peak_mb(ctx: int, path: str) -> float:
    r = subprocess.run([sys.executable, "-m", "localllm.apps.cli", "run", path, "-c", str(ctx),
                        "-p", "hi", "-n", "8", "-v", "--threads", "2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return float(re.search(r"peak memory: (\d+) MB", r.stderr).group(1))


def test_memory_grows_on_demand_not_with_the_context(smollm_path):
    small, large = peak_mb(2048, smollm_path), peak_mb(32768, smollm_path)
    assert large - small <= 40, (small, large)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_prompt_scratch_stays_mapped_between_calls(smollm):
    """A prompt chunk's scratch (megabytes per layer) comes back from the heap on the next
    call: glibc would otherwise map it afresh each time and fault every page in again
    (some 32,000 faults for this chunk)."""
    import resource

    from localllm.runtime.process import keep_scratch_memory
    m = smollm["f16"]  # its load configured the allocator
    ids = fixture("smollm", "logits")["ids"]
    ids = (ids * (300 // len(ids) + 1))[:300]
    faults = []
    for _ in range(3):
        with m.new_sequence() as seq:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            seq.feed(ids)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert min(faults[1:]) < 1000, faults
    assert keep_scratch_memory()
    assert not keep_scratch_memory(system="Darwin")
