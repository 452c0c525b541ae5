"""Speculative decoding on both real models: greedy output is token for token (and
log-probability for log-probability) plain decoding's with prompt lookup and with a draft
model, stop strings and max_tokens inside accepted runs, sequences left as plain decoding
leaves them, batched requests; the drafters, the adaptive length and the vocabulary check."""

import pytest

import localllm
from localllm.testing import tiny_model
from localllm.testing.gguf_copy import copy_gguf
from localllm.generation.batching import Batcher
from localllm.api import EngineError
from localllm.generation.speculative import DraftLength, LookupDrafter

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
           "can of oil and a cloth. He trimmed the wick, polished the great lens until it "
           "shone, and watched the first ships turn toward the harbour.")
# (prompt, chat?, settings): copying, lists, code, free writing (drafts rejected often),
# a stop string and penalties inside accepted runs, log-probabilities.
PROMPTS = [
    (PASSAGE + "\n\n" + PASSAGE[:60], False, {}),
    ("Count from 1 to 25, separated by commas.", True, {}),
    ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", False, {}),
    ("Write a short poem about a storm at sea.", True, {}),
    ("Once upon a time, in a small village by the mountains,", False,
     dict(repeat_penalty=1.15)),
    (PASSAGE + "\n\n" + PASSAGE[:60], False, dict(stop=["lens"])),
    ("Repeat this sentence three times: the quick brown fox jumps over the lazy dog.", True,
     dict(top_logprobs=3)),
    ("What is the capital of France? Answer in one sentence.", True, {}),
    ("Name: Alice\nAge: 30\nCity: Paris\n\nName: Bob\nAge: 41\nCity: Rome\n\nName:", False,
     dict(frequency_penalty=0.3)),
    ("Translate into French: Good morning, how are you today?", True, {}),
]
MAX_TOKENS = 28


def _layers(path):
    from localllm.formats.gguf import GGUFFile
    with GGUFFile(path) as f:
        m = f.metadata
        return int(m[f"{m['general.architecture']}.block_count"])


@pytest.fixture(scope="module")
def models(smollm_path, gemma_path, tmp_path_factory):
    """Per real model: one loaded with prompt lookup, one with a draft model. SmolLM2's
    target is its Q4_1 file requantized to Q8_0, drafted by the Q4_1 file (drafts mostly
    accepted); Gemma's draft is itself without its last 4 of 18 layers (drafts rejected
    often; with half the layers it writes nonsense)."""
    d = tmp_path_factory.mktemp("drafts")
    smol_q8 = copy_gguf(smollm_path, d / "smollm-q8_0.gguf", requant=("Q4_1", "Q8_0"))
    gemma_short = copy_gguf(gemma_path, d / "gemma-short.gguf",
                            n_layers=_layers(gemma_path) - 4)
    kw = dict(ctx_size=512, threads=2)
    return {
        ("smollm", "lookup"): localllm.load(smollm_path, lookup=10, **kw),
        ("smollm", "draft"): localllm.load(smol_q8, draft=str(smollm_path), draft_max=6, **kw),
        ("gemma", "lookup"): localllm.load(gemma_path, lookup=10, **kw),
        ("gemma", "draft"): localllm.load(gemma_path, draft=str(gemma_short), draft_max=4, **kw),
    }


def _run(m, prompt, chat, speculate, seq=None, **kw):
    kw = dict(dict(temperature=0, max_tokens=MAX_TOKENS), **kw)
    g = (m.chat([{"role": "user", "content": prompt}], seq=seq, speculate=speculate, **kw)
         if chat and m.template.from_file else m.generate(prompt, seq=seq, speculate=speculate,
                                                          **kw))
    chunks = list(g)
    out = ([t for c in chunks for t in c.tokens], [x for c in chunks for x in c.logprobs],
           [x for c in chunks for x in c.top_logprobs], "".join(chunks),
           chunks[-1].finish_reason)
    return out, g.stats


@pytest.mark.parametrize("name", ["smollm", "gemma"])
@pytest.mark.parametrize("how", ["lookup", "draft"])
def test_greedy_output_is_plain_decoding(models, name, how):
    m = models[(name, how)]
    drafted = accepted = 0
    for prompt, chat, kw in PROMPTS:
        with m.new_sequence() as a, m.new_sequence() as b:
            want, _ = _run(m, prompt, chat, False, seq=a, **kw)
            got, st = _run(m, prompt, chat, True, seq=b, **kw)
            assert got == want, prompt
            # Rejected drafts and tokens past a stop were trimmed: the sequence holds what
            # plain decoding leaves.
            assert b.tokens == a.tokens
        drafted += st.draft_tokens
        accepted += st.accepted_tokens
        assert st.decode_passes <= max(st.generated_tokens, 1)
    assert m.kv_stats().blocks_used == 0
    if m.draft is not None:
        assert m.draft.kv_stats().blocks_used == 0
    print(f"{name} {how}: {accepted}/{drafted} drafts accepted")
    assert 0 < accepted < drafted  # drafts were both accepted and rejected


def test_stop_inside_an_accepted_run(models):
    m = models[("smollm", "lookup")]
    prompt = PASSAGE + "\n\n" + PASSAGE[:60]
    want, _ = _run(m, prompt, False, False, max_tokens=60)
    # The model copies the passage on (skipping its middle sentence), and again.
    assert "harbour.\n\nThe lighthouse keeper climbed the spiral" in want[3]
    for stop in (["spiral"], ["keeper climbed"]):
        plain, _ = _run(m, prompt, False, False, max_tokens=60, stop=stop)
        got, st = _run(m, prompt, False, True, max_tokens=60, stop=stop)
        assert got == plain and got[4] == "stop" and stop[0] not in got[3]
        assert st.accepted_tokens > 5
    for n in (1, 2, 7, 13):  # max_tokens falling inside a draft
        plain, _ = _run(m, prompt, False, False, max_tokens=n)
        got, _ = _run(m, prompt, False, True, max_tokens=n)
        assert got == plain and len(got[0]) == n


def test_sampling_is_reproducible_and_batched_like_alone(models):
    m = models[("smollm", "lookup")]
    prompt = m.tokenize(PASSAGE + "\n\n" + PASSAGE[:60])
    kws = [dict(temperature=0.7, seed=s, max_tokens=30, ignore_eos=True) for s in range(3)]
    kws.append(dict(temperature=0, max_tokens=30))
    alone, drafted = [], []
    for kw in kws:
        runs = [m.generate(prompt, **kw) for _ in range(2)]
        toks = [[t for c in g for t in c.tokens] for g in runs]
        assert toks[0] == toks[1]  # same seed, same output
        alone.append(toks[0])
        drafted.append(runs[0].stats.draft_tokens)
    assert sum(d > 0 for d in drafted) >= 2  # (a sampled reply may wander off the passage)
    b = Batcher(m)
    reqs = [b.add(prompt, **kw) for kw in kws]
    while b.active:
        b.step()
    assert [[t for c in r.chunks for t in c.tokens] for r in reqs] == alone
    assert sum(r.stats.accepted_tokens for r in reqs) > 0
    assert m.kv_stats().blocks_used == 0


def test_batched_draft_model_requests(models):
    m = models[("smollm", "draft")]
    prompts = [m.tokenize(p) for p in ("The capital of France is", "def add(a, b):")]
    alone = [[t for c in m.generate(p, temperature=0, max_tokens=20, speculate=False)
              for t in c.tokens] for p in prompts]
    b = Batcher(m)
    reqs = [b.add(p, temperature=0, max_tokens=20) for p in prompts]
    while b.active:
        b.step()
    assert [[t for c in r.chunks for t in c.tokens] for r in reqs] == alone
    assert all(r.stats.accepted_tokens > 0 for r in reqs)
    assert m.kv_stats().blocks_used == 0 and m.draft.kv_stats().blocks_used == 0


def test_later_chat_turns_draft_from_the_conversation(models):
    m = models[("smollm", "lookup")]
    messages = [{"role": "user", "content": "Say: " + PASSAGE}]
    with m.new_sequence() as seq:
        first = "".join(m.chat(messages, seq=seq, temperature=0, max_tokens=50))
        messages += [{"role": "assistant", "content": first},
                     {"role": "user", "content": "Say that again, word for word."}]
        g = m.chat(messages, seq=seq, temperature=0, max_tokens=40)
        again = "".join(g)
    plain = "".join(m.chat(messages, temperature=0, max_tokens=40, speculate=False))
    assert again == plain
    assert g.stats.accepted_tokens >= 10 and g.stats.tokens_per_pass > 1.5


# ----------------------------------------------------------------------------- the parts

def test_lookup_matches_longest_then_latest():
    d = LookupDrafter(8)
    h = [1, 2, 3, 4, 9, 3, 4, 5, 7, 2, 3, 4]
    # (2, 3, 4) matches at the start: longer than the later (3, 4)
    assert d.propose(h, 8).tokens == [9, 3, 4, 5, 7, 2, 3, 4]
    h += [5]  # now (3, 4, 5) matched at 5..7 wins over nothing longer
    assert d.propose(h, 3).tokens == [7, 2, 3]
    assert LookupDrafter(8).propose([1, 2, 3, 4], 4) is None  # nothing repeats
    assert d.propose([1, 2, 3, 4], 4) is None  # a shorter history: a new index
    # A repeating tail goes on repeating past the end of the history.
    assert LookupDrafter(8).propose([8, 5, 6, 5, 6], 5).tokens == [5, 6, 5, 6, 5]


def test_draft_length_adapts_and_pauses():
    k = DraftLength(10)
    assert k.budget() == 4
    k.update(4, 4)
    assert k.budget() == 8
    k.update(8, 8)
    assert k.budget() == 10  # bounded
    k.update(10, 3)
    assert k.budget() == 4   # one more than was accepted
    k.update(0, 0)           # nothing proposed: nothing changes
    assert k.budget() == 4
    k.update(4, 0)
    k.update(1, 0)           # twice nothing accepted: a pause of 1, then 2, 4, ... 64 steps
    assert [k.budget() for _ in range(2)] == [0, 1]
    for _ in range(12):
        k.update(1, 0)
    assert sum(k.budget() == 0 for _ in range(70)) == 64
    k.update(1, 1)           # an accepted draft ends the pauses
    assert k.budget() > 0


def test_draft_vocabulary_is_checked(smollm_path, gemma_path, tmp_path):
    with pytest.raises(EngineError, match="tokenizer"):
        localllm.load(smollm_path, draft=str(gemma_path), ctx_size=64)
    tokens = tiny_model.vocabulary()[0]
    changed = tokens[:100] + ["Xx"] + tokens[101:]
    a = tiny_model.write(tmp_path / "a.gguf")
    b = tiny_model.write(tmp_path / "b.gguf", meta={"tokenizer.ggml.tokens": changed})
    with pytest.raises(EngineError, match=r"token 100 is 'Xx' in the draft"):
        localllm.load(a, draft=str(b), ctx_size=64, weight_cache=False)
    with pytest.raises(EngineError, match="lookup"):
        localllm.load(a, lookup=40, ctx_size=64, weight_cache=False)
