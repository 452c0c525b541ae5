"""/v1/embeddings, /v1/rerank and /infill (and /v1/completions' suffix) as clients see them: real
server processes on synthetic models (a BERT encoder, a BERT reranker, a decoder with FIM
tokens), driven by the OpenAI Python client and raw httpx requests."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

import localllm  # noqa: E402
from localllm.testing import synthetic, synthetic_encoders as se  # noqa: E402
from localllm.testing.server_process import ServerProcess  # noqa: E402

FIXTURES = Path(__file__).parents[1] / "fixtures" / "embeddings"


def _serve(path, ctx: int = 512):
    s = ServerProcess(path, "-c", str(ctx), "--parallel", "1")
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def files(tmp_path_factory, metas):
    d = tmp_path_factory.mktemp("served")
    return {"bert": se.write("bert", d / "bert.gguf", metas["smollm"]),
            "rank": se.write("bert_rank", d / "bert_rank.gguf", metas["smollm"]),
            "fim": synthetic.write("llama3", d / "fim.gguf", se.with_fim_tokens(metas["smollm"]))}


@pytest.fixture(scope="module")
def bert_server(files):
    s = _serve(files["bert"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(bert_server):
    c = openai.OpenAI(base_url=bert_server.url + "/v1", api_key="none", max_retries=0,
                      timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def local_bert(files):
    m = localllm.load(files["bert"], threads=1, ctx_size=512)
    yield m
    m.close()


def test_single_and_batch_embeddings_are_the_models(client, local_bert):
    texts = ["Hello world", "The quick brown fox", "a"]
    one = client.embeddings.create(model="bert", input=texts[0], encoding_format="float")
    assert len(one.data) == 1 and one.data[0].index == 0
    want = local_bert.embed(texts)
    np.testing.assert_allclose(one.data[0].embedding, want[0], rtol=0, atol=1e-7)
    batch = client.embeddings.create(model="bert", input=texts, encoding_format="float")
    assert [d.index for d in batch.data] == [0, 1, 2]
    for d, w in zip(batch.data, want):
        np.testing.assert_allclose(d.embedding, w, rtol=0, atol=1e-7)
        assert abs(np.linalg.norm(d.embedding) - 1) < 1e-5
    n = sum(len(local_bert.tokenize(t)) for t in texts)
    assert batch.usage.prompt_tokens == n and batch.usage.total_tokens == n


def test_base64_and_token_id_inputs(client, bert_server, local_bert):
    text = "Embeddings map text to vectors"
    ids = local_bert.tokenize(text)
    # The client decodes base64 itself (it asks for base64 when no format is given).
    got = client.embeddings.create(model="bert", input=text)
    np.testing.assert_allclose(got.data[0].embedding, local_bert.embed([text])[0], atol=1e-7)
    with bert_server.client() as http:
        r = http.post("/v1/embeddings", json={"input": [ids, ids[:3]],
                                              "encoding_format": "base64"})
        assert r.status_code == 200, r.text
        vecs = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in r.json()["data"]]
    np.testing.assert_array_equal(vecs[0], local_bert.embed([ids])[0])
    np.testing.assert_array_equal(vecs[1], local_bert.embed([ids[:3]])[0])


def test_refusals(bert_server):
    with bert_server.client() as http:
        r = http.post("/v1/embeddings", json={"input": "x", "dimensions": 16})
        assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
        r = http.post("/v1/embeddings", json={"input": "x", "encoding_format": "int8"})
        assert r.status_code == 400
        r = http.post("/v1/embeddings", json={"input": []})
        assert r.status_code == 400
        r = http.post("/v1/embeddings", json={"input": [[999999]]})
        assert r.status_code == 400
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                  "content": "hi"}]})
        assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
        r = http.post("/v1/rerank", json={"query": "q", "documents": ["d"]})
        assert r.status_code == 400 and "not a reranker" in r.json()["error"]["message"]
        # no FIM tokens in this vocabulary
        r = http.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert r.status_code == 400 and "infill is not supported" in r.json()["error"]["message"]


def test_rerank_scores_and_orders(files):
    fx = json.loads(str(np.load(FIXTURES / "bert_rank.npz")["info"]))
    want = np.load(FIXTURES / "bert_rank.npz")["vectors"][:, 0]
    s = _serve(files["rank"])
    try:
        with s.client() as http:
            for path in ("/v1/rerank", "/rerank"):
                r = http.post(path, json={"query": fx["query"], "documents": fx["documents"],
                                          "top_n": 2, "return_documents": True})
                assert r.status_code == 200, r.text
                res = r.json()["results"]
                order = list(np.argsort(-want))[:2]
                assert [x["index"] for x in res] == order
                np.testing.assert_allclose([x["relevance_score"] for x in res], want[order],
                                           rtol=1e-3, atol=1e-3)
                assert res[0]["document"]["text"] == fx["documents"][order[0]]
            r = http.post("/v1/embeddings", json={"input": "x"})
            assert r.status_code == 400
    finally:
        s.stop()


def test_infill_and_suffix(files):
    fx = json.loads((FIXTURES / "infill.json").read_text())
    req = fx["request"]
    from localllm.text.fim import ExtraFile
    extra = [ExtraFile(e["filename"], e["text"]) for e in req["input_extra"]]
    # llama-server keeps extra context only where the context has room beyond a batch
    # (2048) and the reply: none at 512 tokens, all of it at 4096.
    small = localllm.load(files["fim"], threads=1, ctx_size=512)
    cut = small.infill_tokens(req["input_prefix"], req["input_suffix"], extra, req["prompt"])
    small.close()
    assert cut == fx["ids"][fx["ids"].index(7):]   # from FIM_PRE (id 7) on
    m = localllm.load(files["fim"], threads=1, ctx_size=4096)
    ids = m.infill_tokens(req["input_prefix"], req["input_suffix"], extra, req["prompt"])
    assert ids == fx["ids"], "the infill prompt differs from llama-server's order"
    plain = m.infill_tokens("def f():", "\n")
    want_text = "".join(m.generate(ids, max_tokens=8, temperature=0))
    want_suffix = "".join(m.generate(plain, max_tokens=8, temperature=0))
    m.close()
    s = _serve(files["fim"], 4096)
    try:
        with s.client() as http:
            r = http.post("/infill", json={**req, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["tokens_evaluated"] == len(fx["ids"])
            assert body["usage"]["prompt_tokens"] == len(fx["ids"])
            assert body["content"] == want_text
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        got = c.completions.create(model="fim", prompt="def f():", suffix="\n", max_tokens=8,
                                   temperature=0)
        assert got.choices[0].text == want_suffix
        assert got.usage.prompt_tokens == len(plain)
        c.close()
    finally:
        s.stop()


def test_matryoshka_dimensions_cut_and_renormalise():
    from localllm.apps.server.embeddings_api import APIError, _dimensions
    v = [np.array([3.0, 4.0, 12.0], np.float32)]
    np.testing.assert_allclose(_dimensions(v, 2, 3)[0], [0.6, 0.8], rtol=1e-6)
    assert _dimensions(v, None, 3)[0] is v[0]
    with pytest.raises(APIError):
        _dimensions(v, 4, 3)
