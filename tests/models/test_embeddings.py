"""Embeddings and rank scores against llama.cpp's (tests/fixtures/embeddings/, made by
scripts/fixtures_embeddings.py on exactly these synthetic encoders, the synthetic
Qwen3-Embedding-like decoder and the SmolLM2 file), the batch invariance of Model.embed, the
file's pooling as the default, and the encoders' refusals."""

import json
from pathlib import Path

import numpy as np
import pytest

import localllm
from localllm.errors import BadSetting, UnsupportedModel
from localllm.testing import synthetic, synthetic_encoders as se
from localllm.testing.gguf_copy import copy_gguf

FIXTURES = Path(__file__).parents[1] / "fixtures" / "embeddings"
COS_MIN = 0.9999
# SmolLM2 is Q4_1 over 30 layers: every matmul rounds its input to 8 bits, so the last-ulp
# differences of any two float summation orders cross rounding boundaries and grow. Moving
# our own inputs by one ulp moves our vectors to cos 0.99974, and llama.cpp against itself
# with flash attention on and off gives 0.99950 (scripts/ulp_sensitivity.py --embed): below
# COS_MIN for any two engines that are not bit-identical. The same weights in F32
# (smollm_f32, the Q4_1 tensors dequantized) agree with llama.cpp to COS_MIN; the float-weight
# encoders too (the Q8_0 one, with the same rounding, to the other).
COS_MIN_QUANTIZED = 0.999
CASES = sorted(p.stem for p in FIXTURES.glob("*.npz"))


def load_case(case: str) -> dict:
    with np.load(FIXTURES / f"{case}.npz") as z:
        return {"vectors": z["vectors"], **json.loads(str(z["info"]))}


@pytest.fixture(scope="session")
def encoder_files(tmp_path_factory, metas):
    d = tmp_path_factory.mktemp("encoders")
    return {name: se.write(name, d / f"{name}.gguf", metas["smollm"]) for name in se.SPECS}


@pytest.fixture(scope="session")
def encoders(encoder_files):
    models = {name: localllm.load(p, threads=2, ctx_size=512)
              for name, p in encoder_files.items()}
    yield models
    for m in models.values():
        m.close()


@pytest.fixture(scope="session")
def qwen3_embed_file(tmp_path_factory, metas):
    return se.write_qwen3_embedding(tmp_path_factory.mktemp("qwen3_embed") / "qwen3_embed.gguf",
                                    metas["smollm"])


@pytest.fixture(scope="session")
def qwen3_embedder(qwen3_embed_file):
    m = localllm.load(qwen3_embed_file, threads=2, ctx_size=512)
    yield m
    m.close()


@pytest.fixture(scope="session")
def smollm_f32_file(tmp_path_factory, smollm_path):
    return copy_gguf(smollm_path, tmp_path_factory.mktemp("smollm_f32") / "smollm_f32.gguf",
                     requant=("Q4_1", "F32"))


@pytest.fixture(scope="session")
def smollm_f32_embedder(smollm_f32_file):
    m = localllm.load(smollm_f32_file, threads=2, ctx_size=512)
    yield m
    m.close()


@pytest.fixture(scope="session")
def smollm_embedder(smollm_path):
    m = localllm.load(smollm_path, threads=2, ctx_size=512)
    yield m
    m.close()


def _model(case, fx, encoders, smollm_embedder, encoder_files, smollm_path, request):
    if fx["model"] == "smollm":
        path, model = smollm_path, smollm_embedder
    elif fx["model"] == "qwen3_embed":
        path = request.getfixturevalue("qwen3_embed_file")
        model = request.getfixturevalue("qwen3_embedder")
    elif fx["model"] == "smollm_f32":
        path = request.getfixturevalue("smollm_f32_file")
        model = request.getfixturevalue("smollm_f32_embedder")
    else:
        path, model = encoder_files[fx["model"]], encoders[fx["model"]]
    return path, model


def test_fixtures_cover_every_architecture_and_pooling():
    pairs = {(load_case(c)["model"], load_case(c)["pooling"]) for c in CASES}
    assert {("bert", "mean"), ("bert_cls", "cls"), ("nomic_bert", "mean"),
            ("bert_rank", "rank"), ("bert_q8", "last"), ("smollm", "mean"),
            ("smollm", "last"), ("smollm_f32", "mean"), ("smollm_f32", "last"),
            ("qwen3_embed", "last")} <= pairs


@pytest.mark.parametrize("case", CASES)
def test_matches_llama_cpp(case, encoders, smollm_embedder, encoder_files, smollm_path, request):
    fx = load_case(case)
    path, model = _model(case, fx, encoders, smollm_embedder, encoder_files, smollm_path,
                         request)
    assert synthetic.digest(path) == fx["digest"], \
        "the model differs from the one the fixture was made on: rerun the script"
    got = np.stack(model.embed(fx["inputs"], pooling=fx["pooling"], normalize=False))
    want = fx["vectors"]
    assert got.shape == want.shape
    if fx["pooling"] == "rank":
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
        return
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    floor = COS_MIN_QUANTIZED if fx["model"] in ("smollm", "bert_q8") else COS_MIN
    assert cos.min() >= floor, f"cosines {cos}"
    # llama.cpp's vectors are raw; ours normalised by default are the same direction, unit.
    unit = np.stack(model.embed(fx["inputs"], pooling=fx["pooling"]))
    np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-5)


def test_decoder_embedder_pools_as_its_file_says(qwen3_embedder):
    """A Qwen3-Embedding-like file (pooling_type 3, add_eos_token): embed() with no pooling
    pools the last token, which is the EOS the tokenizer appends (llama.cpp appends it only
    through that flag, as we do); llama.cpp ran it with the file's pooling too."""
    m, fx = qwen3_embedder, load_case("qwen3_embed_last")
    assert m.pooling == "last"
    assert [m.tokenize(t) for t in fx["texts"]] == fx["inputs"]
    assert all(ids[-1] == m.tokenizer.eos_id for ids in fx["inputs"])
    got = np.stack(m.embed(fx["texts"], normalize=False))
    np.testing.assert_array_equal(got, np.stack(m.embed(fx["texts"], pooling="last",
                                                        normalize=False)))
    want = fx["vectors"]
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= COS_MIN, f"cosines {cos}"
    # the vectors tell the texts apart although all end in the same EOS
    unit = want / np.linalg.norm(want, axis=1, keepdims=True)
    assert (unit @ unit.T)[np.triu_indices(len(unit), 1)].max() < 0.99
    mean = np.stack(m.embed(fx["texts"], pooling="mean", normalize=False))
    assert not np.allclose(mean, got)


def test_no_eos_is_appended_where_the_tokenizer_adds_none(smollm_embedder):
    """SmolLM2's tokenizer sets no add_eos_token: last pooling reads the text's own last
    token, as llama.cpp's (which only warns, in its embedding example)."""
    tok = smollm_embedder.tokenizer
    assert not tok.add_eos
    assert smollm_embedder.tokenize("Hello world") == tok.encode("Hello world", add_special=False)


@pytest.mark.parametrize("name", ["bert", "nomic_bert"])
def test_a_vector_does_not_depend_on_its_batch(encoders, name):
    m = encoders[name]
    texts = ["alpha beta gamma", "one", "a longer sentence about nothing in particular " * 3,
             "short"]
    together = m.embed(texts)
    alone = [m.embed([t])[0] for t in texts]
    reordered = m.embed(texts[::-1])[::-1]
    for a, b, c in zip(together, alone, reordered):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


def test_decoder_vector_does_not_depend_on_its_batch(smollm_embedder):
    texts = ["alpha beta gamma", "one two three four five six", "x"]
    together = smollm_embedder.embed(texts, pooling="mean")
    for t, v in zip(texts, together):
        np.testing.assert_array_equal(smollm_embedder.embed([t], pooling="mean")[0], v)


def test_rerank_orders_by_the_head(encoders):
    """Model.rerank builds llama-server's pair tokens and scores them by cls, tanh,
    cls.output: llama.cpp's scores for the same pairs."""
    m = encoders["bert_rank"]
    fx = load_case("bert_rank")
    assert [m.rerank_tokens(fx["query"], d) for d in fx["documents"]] == fx["inputs"]
    scores = m.rerank(fx["query"], fx["documents"])
    np.testing.assert_allclose(scores, fx["vectors"][:, 0], rtol=1e-3, atol=1e-3)


def test_texts_tokenize_as_the_fixture_inputs(encoders):
    fx = load_case("bert")
    assert [encoders["bert"].tokenize(t) for t in fx["texts"]] == fx["inputs"]


def test_pooling_none_gives_one_unit_vector_per_token(encoders):
    m = encoders["bert"]
    ids = m.tokenize("three small words")
    per_token = m.embed(["three small words"], pooling="none")[0]
    assert per_token.shape == (len(ids), m.args.dim)
    np.testing.assert_allclose(np.linalg.norm(per_token, axis=1), 1.0, atol=1e-5)


def test_encoders_refuse_to_generate_and_unknown_pooling(encoders):
    m = encoders["bert"]
    with pytest.raises(UnsupportedModel, match="embedding model"):
        list(m.generate("hello", max_tokens=2))
    with pytest.raises(BadSetting, match="pooling"):
        m.embed(["x"], pooling="max")
    with pytest.raises(UnsupportedModel, match="not a reranker"):
        m.rerank("q", ["d"])


@pytest.mark.parametrize("backend,ngl", [("torch", "all"), ("torch", 1), ("mlx", "all")])
@pytest.mark.parametrize("name", ["bert", "nomic_bert", "bert_rank"])
def test_torch_and_mlx_backends_embed_as_the_cpu(encoder_files, encoders, backend, ngl, name):
    """The encoder code is backend-generic: the torch and MLX backends (their CPU builds
    standing in for CUDA and Metal), whole or split with the CPU, give the CPU's vectors."""
    pytest.importorskip({"torch": "torch", "mlx": "mlx.core"}[backend])
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog."]
    want = np.stack(encoders[name].embed(texts, normalize=False))
    with localllm.load(encoder_files[name], threads=2, ctx_size=512, backend=backend,
                       gpu_layers=ngl) as m:
        assert m.plan.gpu_layers == (2 if ngl == "all" else ngl)
        got = np.stack(m.embed(texts, normalize=False))
    if name == "bert_rank":
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
        return
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= COS_MIN, f"cosines {cos}"


def test_inputs_beyond_the_context_or_empty_are_refused(encoders):
    from localllm.errors import EmptyPrompt, PromptTooLong, TokenOutOfVocab
    m = encoders["bert"]
    with pytest.raises(PromptTooLong):
        m.embed([[5] * (m.ctx + 1)])
    with pytest.raises(EmptyPrompt):
        m.embed([[]])
    with pytest.raises(TokenOutOfVocab):
        m.embed([[m.vocab_size]])
