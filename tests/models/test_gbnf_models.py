"""Every llama.cpp grammar constrains SmolLM2 to text it matches: constrained sampling, then
(when the budget ran out first) the same constraint continued with end-of-text favoured, and
the output checked by the grammar's own walker (a finished match) and, for JSON, json.loads."""

import json
from pathlib import Path

import pytest

from localllm.generation.constrain import TokenConstraint
from localllm.generation.constrain.gbnf import parse_gbnf

GRAMMARS = Path(__file__).parent.parent / "fixtures" / "grammars"
ASK = {"arithmetic": "Write some arithmetic equations.", "c": "Write a C function.",
       "chess": "Write the moves of a chess game.", "english": "Say hello in English.",
       "japanese": "Say hello in Japanese.", "json": "Describe a cat as JSON.",
       "json_arr": "List three cats as a JSON array.", "list": "List three fruits."}
# (temperature, seed) of each try: greedy first, then sampled
TRIES = [(0.0, None), (0.7, 1), (0.7, 2), (0.7, 3), (0.9, 4), (0.9, 5)]


@pytest.fixture(scope="module")
def smollm(smollm_model):
    return smollm_model.with_kv("f16", "f16")


def _sample(m, grammar: str, ids: list[int], temperature: float, seed) -> tuple[str, str]:
    """Up to 40 free tokens, then up to 160 with the end favoured as soon as it is allowed.
    Returns: the text (decoded whole, so a character split at the seam stays whole) and the
    finish reason."""
    c = TokenConstraint.gbnf(grammar, m.token_vocab)
    kw = dict(constraint=c, temperature=temperature, seed=seed, frequency_penalty=0.5)
    toks: list[int] = []
    for ch in m.generate(ids, max_tokens=40, **kw):
        toks += ch.tokens
    if m.last_stats.finish_reason != "stop":
        bias = {e: 30.0 for e in m.tokenizer.eog_ids}
        for ch in m.generate(ids + toks, max_tokens=160, logit_bias=bias, **kw):
            toks += ch.tokens
    toks = [t for t in toks if t not in m.tokenizer.eog_ids]
    return m.detokenize(toks), m.last_stats.finish_reason


@pytest.mark.parametrize("name", sorted(ASK))
def test_constrained_output_matches_the_grammar(smollm, name):
    text = (GRAMMARS / f"{name}.gbnf").read_text()
    g = parse_gbnf(text)
    ids = smollm.chat_tokens([{"role": "user", "content": ASK[name]}])
    finished = []
    for temperature, seed in TRIES:
        out, reason = _sample(smollm, text, ids, temperature, seed)
        assert g.matches(out, complete=False), (temperature, seed, out)   # never off the grammar
        if reason == "stop":
            assert g.matches(out), out
            finished.append(out)
            if len(finished) == 2:
                break
    assert finished, f"no try of {name} ended within its budget"
    if name.startswith("json"):
        for out in finished:
            value = json.loads(out)
            assert isinstance(value, list if name == "json_arr" else dict)
