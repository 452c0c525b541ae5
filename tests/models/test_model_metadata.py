"""Metadata and tensors that are well-formed GGUF but wrong for the model they describe:
each is a one-line error at load naming the key or tensor, never a failure at token 500.
Every case is a tiny llama model written by gguf.GGUFWriter with one thing changed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from gguf.constants import GGUFValueType as V

import localllm
from localllm.testing import tiny_model as T
from localllm.api import EngineError
from localllm.models import ModelError
from localllm.text.tokenizer import TokenizerError

P = "llama."
_nan_at_3 = np.ones(T.DIM, np.float32)
_nan_at_3[3] = np.nan
_inf_at_0 = np.ones(T.DIM, np.float32)
_inf_at_0[0] = np.inf
_tokens = T.vocabulary()[0]
_n = len(_tokens)

# label -> (metadata changes, tensor changes, error type, text the message must hold)
CASES = {
    "block_count above the blocks present": (
        {P + "block_count": 3}, {}, ModelError, "'llama.block_count' is 3 but the file has "
        "tensors for blocks 0..1 (block 2 is missing)"),
    "block_count far above the blocks present": (
        {P + "block_count": 2**31}, {}, ModelError, "block 2 is missing"),
    "block_count below the blocks present": (
        {P + "block_count": 1}, {}, ModelError, "'llama.block_count' is 1 but the file has "
        "tensors for block 1"),
    "a block's tensors missing": (
        {}, {"blk.1.ffn_up.weight": None}, ModelError,
        "tensor 'blk.1.ffn_up.weight' is missing"),
    "head count does not divide the width": (
        {P + "attention.head_count": 3, P + "attention.head_count_kv": 3}, {}, ModelError,
        "'llama.embedding_length' (64) is not a multiple of 'llama.attention.head_count' (3)"),
    "KV heads do not divide the heads": (
        {P + "attention.head_count_kv": 3}, {}, ModelError,
        "'llama.attention.head_count' (4) is not a multiple of 'llama.attention.head_count_kv' (3)"),
    "zero KV heads": (
        {P + "attention.head_count_kv": 0}, {}, ModelError,
        "'llama.attention.head_count_kv' must be positive, got 0"),
    "per-layer head counts that differ": (
        {P + "attention.head_count_kv": ([2, 1], V.ARRAY, V.UINT32)}, {}, ModelError,
        "'llama.attention.head_count_kv' varies per layer"),
    "key length disagrees with the q tensor": (
        {P + "attention.key_length": 24, P + "rope.dimension_count": 24}, {}, ModelError,
        "tensor 'blk.0.attn_q.weight' has shape (64, 64), expected (96, 64)"),
    "value length differs from the key length": (
        {P + "attention.value_length": 8}, {}, ModelError,
        "'llama.attention.value_length' (8) differs from the key length (16)"),
    "feed-forward length disagrees with the tensors": (
        {P + "feed_forward_length": 96}, {}, ModelError,
        "tensor 'blk.0.ffn_gate.weight' has shape (128, 64), expected (96, 64)"),
    "embedding rows disagree with the vocabulary": (
        {}, {"token_embd.weight": np.zeros((_n - 4, T.DIM), np.float32)}, ModelError,
        f"tensor 'token_embd.weight' has shape ({_n - 4}, 64), expected ({_n}, 64)"),
    "vocab_size disagrees with the tokens": (
        {P + "vocab_size": _n + 32}, {}, ModelError,
        f"'llama.vocab_size' is {_n + 32} but 'tokenizer.ggml.tokens' has {_n} entries"),
    "odd rope dimension": (
        {P + "rope.dimension_count": 15}, {}, ModelError,
        "'llama.rope.dimension_count' (15) must be even and at most the head size 16"),
    "rope dimension past the head": (
        {P + "rope.dimension_count": 32}, {}, ModelError, "'llama.rope.dimension_count' (32)"),
    "NaN norm epsilon": (
        {P + "attention.layer_norm_rms_epsilon": float("nan")}, {}, ModelError,
        "'llama.attention.layer_norm_rms_epsilon' is nan, not a finite number"),
    "zero rope base": (
        {P + "rope.freq_base": 0.0}, {}, ModelError,
        "'llama.rope.freq_base' must be positive, got 0.0"),
    "infinite rope base": (
        {P + "rope.freq_base": float("inf")}, {}, ModelError,
        "'llama.rope.freq_base' is inf, not a finite number"),
    "longrope rope scaling": (
        {P + "rope.scaling.type": ("longrope", V.STRING, None), P + "rope.scaling.factor": 4.0},
        {}, ModelError, "'llama.rope.scaling.type' is 'longrope', not supported for llama "
        "(supported: none, linear, yarn)"),
    "zero rope attention factor": (
        {P + "rope.scaling.attn_factor": 0.0}, {}, ModelError,
        "'llama.rope.scaling.attn_factor' must be positive, got 0.0"),
    "zero context length": (
        {P + "context_length": 0}, {}, ModelError, "'llama.context_length' must be positive"),
    "width stored as a string": (
        {P + "embedding_length": ("64", V.STRING, None)}, {}, ModelError,
        "'llama.embedding_length' should be an integer"),
    "missing embedding_length": (
        {P + "embedding_length": None}, {}, ModelError,
        "metadata key 'llama.embedding_length' is missing"),
    "missing block_count": (
        {P + "block_count": None}, {}, ModelError, "metadata key 'llama.block_count' is missing"),
    "missing head_count": (
        {P + "attention.head_count": None}, {}, ModelError,
        "metadata key 'llama.attention.head_count' is missing"),
    "missing feed_forward_length": (
        {P + "feed_forward_length": None}, {}, ModelError,
        "metadata key 'llama.feed_forward_length' is missing"),
    "missing tokens and vocab_size": (
        {"tokenizer.ggml.tokens": None, P + "vocab_size": None}, {}, ModelError,
        "metadata key 'tokenizer.ggml.tokens' is missing"),
    "missing tokenizer model": (
        {"tokenizer.ggml.model": None}, {}, TokenizerError,
        "metadata key 'tokenizer.ggml.model' is missing"),
    "missing tokens": (
        {"tokenizer.ggml.tokens": None}, {}, TokenizerError, "no tokenizer.ggml.tokens"),
    "BOS id past the vocabulary": (
        {"tokenizer.ggml.bos_token_id": _n}, {}, TokenizerError,
        f"tokenizer.ggml.bos_token_id is {_n}, not a token id of the {_n}-token vocabulary"),
    "EOS id far past the vocabulary": (
        {"tokenizer.ggml.eos_token_id": 2**32 - 1}, {}, TokenizerError,
        "tokenizer.ggml.eos_token_id is 4294967295"),
    "EOT id past the vocabulary": (
        {"tokenizer.ggml.eot_token_id": (_n + 5, V.UINT32, None)}, {}, TokenizerError,
        f"tokenizer.ggml.eot_token_id is {_n + 5}"),
    "padding id past the vocabulary": (
        {"tokenizer.ggml.padding_token_id": 100_000}, {}, TokenizerError,
        "tokenizer.ggml.padding_token_id is 100000"),
    "negative id": (
        {"tokenizer.ggml.unknown_token_id": (-1, V.INT32, None)}, {}, TokenizerError,
        "tokenizer.ggml.unknown_token_id is -1"),
    "id stored as a string": (
        {"tokenizer.ggml.bos_token_id": ("1", V.STRING, None)}, {}, TokenizerError,
        "tokenizer.ggml.bos_token_id is '1'"),
    "token types shorter than the tokens": (
        {"tokenizer.ggml.token_type": ([1] * 10, V.ARRAY, V.INT32)}, {}, TokenizerError,
        f"tokenizer.ggml.token_type has 10 entries for {_n} tokens"),
    "token types longer than the tokens": (
        {"tokenizer.ggml.token_type": ([1] * (_n + 1), V.ARRAY, V.INT32)}, {}, TokenizerError,
        f"tokenizer.ggml.token_type has {_n + 1} entries for {_n} tokens"),
    "scores shorter than the tokens": (
        {"tokenizer.ggml.scores": ([0.0] * (_n - 1), V.ARRAY, V.FLOAT32)}, {}, TokenizerError,
        f"tokenizer.ggml.scores has {_n - 1} entries for {_n} tokens"),
    "NaN score": (
        {"tokenizer.ggml.scores": ([0.0] * 7 + [float("nan")] + [0.0] * (_n - 8), V.ARRAY,
                                   V.FLOAT32)}, {}, TokenizerError,
        "tokenizer.ggml.scores[7] is nan, not a finite number"),
    "scores stored as strings": (
        {"tokenizer.ggml.scores": (["0"] * _n, V.ARRAY, V.STRING)}, {}, TokenizerError,
        "tokenizer.ggml.scores is not an array of numbers"),
    "tokens stored as numbers": (
        {"tokenizer.ggml.tokens": (list(range(_n)), V.ARRAY, V.INT32)}, {}, TokenizerError,
        "tokenizer.ggml.tokens is not an array of strings"),
    "a merge naming a missing token": (
        {"tokenizer.ggml.merges": (T.vocabulary()[2] + ["Ġwor q"], V.ARRAY, V.STRING)}, {},
        TokenizerError, "tokenizer.ggml.merges[9] ('Ġwor q') is not two tokens of the "
        "vocabulary that join into a third"),
    "a merge whose result is missing": (
        {"tokenizer.ggml.merges": (["h e", "e h"], V.ARRAY, V.STRING)}, {}, TokenizerError,
        "tokenizer.ggml.merges[1] ('e h')"),
    "a merge without a space": (
        {"tokenizer.ggml.merges": (["he"], V.ARRAY, V.STRING)}, {}, TokenizerError,
        "tokenizer.ggml.merges[0] ('he')"),
    "a byte token not spelled <0xHH>": (
        {"tokenizer.ggml.token_type": ([3] * 3 + [6] + [1] * (_n - 4), V.ARRAY, V.INT32)}, {},
        TokenizerError, f"token 3 ({_tokens[3]!r}) has the byte type but is not spelled <0xHH>"),
    "NaN in a norm weight": (
        {}, {"blk.1.attn_norm.weight": _nan_at_3}, ModelError,
        "tensor 'blk.1.attn_norm.weight' holds nan at index 3 (1 non-finite values)"),
    "Inf in the output norm": (
        {}, {"output_norm.weight": _inf_at_0}, ModelError,
        "tensor 'output_norm.weight' holds inf at index 0"),
}


def _load(path):
    return localllm.load(str(path), weight_cache=False, download=False, threads=1, ctx_size=64)


def test_the_unchanged_tiny_model_runs(tmp_path):
    with _load(T.write(tmp_path / "tiny.gguf")) as m:
        ids = m.tokenize("hello world")
        assert [m.tokenizer.token_text(i) for i in ids] == ["hello", "Ġworld"]
        out = list(m.generate(ids, max_tokens=4, temperature=0))
        assert len(out) >= 1 and m.logits(ids).shape == (2, m.vocab_size)


@pytest.mark.parametrize("label", sorted(CASES))
def test_wrong_metadata_is_a_clear_error_at_load(tmp_path, label):
    meta, weights, kind, needle = CASES[label]
    path = T.write(tmp_path / "bad.gguf", meta, weights)
    with pytest.raises((ModelError, TokenizerError, EngineError)) as err:
        _load(path)
    assert type(err.value) is kind
    message = str(err.value)
    assert needle in message and "\n" not in message


@pytest.mark.parametrize("label", ["block_count far above the blocks present",
                                   "BOS id past the vocabulary", "NaN in a norm weight"])
def test_the_command_says_it_in_one_line(tmp_path, label):
    meta, weights, _, needle = CASES[label]
    path = T.write(tmp_path / "bad.gguf", meta, weights)
    r = subprocess.run([sys.executable, "-m", "localllm.apps.cli", "run", str(path), "-p", "hi"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
