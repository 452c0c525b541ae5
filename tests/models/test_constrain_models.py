"""Constrained generation with the real models and tokenizers: json_object output always
parses, json_schema output validates, and both vocabularies (byte-level BPE, SentencePiece
with byte fallback) give masks that agree with token-by-token checks."""

import json

import numpy as np
import pytest
from jsonschema import Draft202012Validator, FormatChecker

import localllm
from localllm.generation.constrain import TokenConstraint

ASK = [{"role": "user", "content": "Describe a cat as a JSON object with a name, an age and "
                                   "a list of favourite foods."}]


@pytest.fixture(scope="module")
def smollm(smollm_model):
    return smollm_model.with_kv("f16", "f16")  # the session's weights, a cache of its own


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return localllm.load(gemma_path, ctx_size=512, threads=2)


def test_vocab_pieces_are_the_decoder_bytes(smollm, gemma):
    for m in (smollm, gemma):
        v, tok = m.token_vocab, m.tokenizer
        assert m.token_vocab is v  # built once per model
        assert v.size == tok.vocab_size
        for t in range(0, v.size, 997):
            if v.usable[t]:
                assert v.token_bytes(t) == tok.token_to_piece(t)
        assert not v.usable[sorted(tok.eog_ids)].any()
        assert not any(v.usable[t] for t in range(v.size) if tok.is_special(t))


@pytest.mark.parametrize("seed", range(6))
def test_json_object_at_temperature_always_parses(smollm, seed):
    c = TokenConstraint.json_object(smollm.token_vocab)
    ask = [{"role": "user", "content": "Describe a cat in JSON with the keys name, age and color. "
                                       "Keep it short."}]
    text = "".join(smollm.chat(ask, constraint=c, temperature=0.8, seed=seed, max_tokens=200))
    assert smollm.last_stats.finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)
    assert c.is_complete()


SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "owner": {"type": "object", "properties": {"first": {"type": "string"},
                                                    "age": {"type": "integer", "minimum": 18,
                                                            "maximum": 99}},
                  "required": ["first", "age"], "additionalProperties": False}},
        "required": ["name", "owner"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {
        "foods": {"type": "array", "items": {"enum": ["fish", "chicken", "milk", "mice"]},
                  "minItems": 1, "maxItems": 3},
        "indoor": {"type": "boolean"}}, "required": ["foods", "indoor"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {
        "age": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 25}, {"type": "null"}]},
        "born": {"type": "string", "format": "date"}},
        "required": ["age", "born"], "additionalProperties": False},
    "recursive": {"$defs": {"toy": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12},
        "parts": {"type": "array", "items": {"$ref": "#/$defs/toy"}, "maxItems": 2}},
        "required": ["name"], "additionalProperties": False}},
        "type": "object", "properties": {"toys": {"type": "array", "items": {"$ref": "#/$defs/toy"},
                                                  "maxItems": 2}},
        "required": ["toys"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {
        "name": {"type": "string"}, "nickname": {"type": "string"}, "lives": {"const": 9}},
        "required": ["lives"], "additionalProperties": False},
}


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_schema_output_validates(smollm, name):
    schema = SCHEMAS[name]
    validator = Draft202012Validator(schema, format_checker=FormatChecker())
    for seed in (0, 1):
        # max_depth bounds how far the recursive schema unrolls (and so the output's length)
        c = TokenConstraint.json_schema(schema, smollm.token_vocab, max_depth=4)
        text = "".join(smollm.chat(ASK, constraint=c, temperature=0.7, seed=seed, max_tokens=300))
        assert smollm.last_stats.finish_reason == "stop", text
        validator.validate(json.loads(text))


def test_greedy_json_and_reproducible(smollm):
    outs = []
    for _ in range(2):
        c = TokenConstraint.json_schema(SCHEMAS["array_enum"], smollm.token_vocab)
        outs.append("".join(smollm.chat(ASK, constraint=c, temperature=0, max_tokens=100)))
    assert outs[0] == outs[1]
    assert json.loads(outs[0])["foods"]


def test_gemma_base_model_writes_schema_json(gemma):
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "maximum": 30},
        "color": {"enum": ["black", "white", "ginger", "grey"]}},
        "required": ["name", "age", "color"], "additionalProperties": False}
    c = TokenConstraint.json_schema(schema, gemma.token_vocab)
    text = "".join(gemma.generate("A JSON record of a cat:\n", constraint=c, temperature=0.8,
                                  seed=3, max_tokens=60))
    assert gemma.last_stats.finish_reason == "stop", text
    Draft202012Validator(schema).validate(json.loads(text))


@pytest.mark.parametrize("which", ["smollm", "gemma"])
def test_mask_matches_token_checks_on_real_vocabularies(smollm, gemma, which):
    m = {"smollm": smollm, "gemma": gemma}[which]
    v, tok = m.token_vocab, m.tokenizer
    c = TokenConstraint.json_object(v)
    for piece in ['{"na', "me\": \"Gr", "é", 'ü", "age": 1', '2, "tags": [', '"a"]}']:
        for t in tok.encode(piece, add_special=False):
            c.advance(t)
        mask = c.mask()
        ids = np.arange(v.size)
        sample = np.concatenate([np.flatnonzero(mask)[::max(1, int(mask.sum()) // 300)],
                                 ids[::max(1, v.size // 2000)]])
        assert all(mask[t] == c.allowed(int(t)) for t in sample)
    assert c.is_complete()
