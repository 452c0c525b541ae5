"""`llm embed` and `llm run --fim-prefix/--fim-suffix` as a user runs them, on synthetic
models, against the Python API's results."""

import json

import numpy as np
import pytest

import localllm
from localllm.testing import synthetic, synthetic_encoders as se
from support.cli import llm


@pytest.fixture(scope="module")
def files(tmp_path_factory, metas):
    d = tmp_path_factory.mktemp("cli_embed")
    return {"bert": se.write("bert", d / "bert.gguf", metas["smollm"]),
            "fim": synthetic.write("llama3", d / "fim.gguf", se.with_fim_tokens(metas["smollm"]))}


def test_embed_prints_one_json_vector_per_line(files, tmp_path):
    texts = ["first line of text", "second", "a third, longer line of text"]
    src = tmp_path / "in.txt"
    src.write_text(texts[0] + "\n\n" + "\n".join(texts[1:]) + "\n")
    r = llm("embed", str(files["bert"]), "-f", str(src), "-t", "1")
    assert r.returncode == 0, r.stderr
    got = [json.loads(line) for line in r.stdout.splitlines()]
    with localllm.load(files["bert"], threads=1) as m:
        want = m.embed(texts)
        raw = m.embed(texts[:1], normalize=False)[0]
    assert len(got) == 3
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-7)
    r = llm("embed", str(files["bert"]), "-p", texts[0], "--no-normalize", "-t", "1")
    np.testing.assert_allclose(json.loads(r.stdout), raw, rtol=1e-6, atol=1e-6)


def test_embed_and_run_refusals(files, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    r = llm("embed", str(files["bert"]), "-f", str(empty))
    assert r.returncode != 0 and "no input" in r.stderr
    r = llm("run", str(files["bert"]), "-p", "hello", "-n", "2")
    assert r.returncode == 3 and "embedding model" in r.stderr
    r = llm("run", str(files["bert"]), "--fim-prefix", "a", "--fim-suffix", "b", "-n", "2")
    assert r.returncode == 3 and "infill is not supported" in r.stderr


def test_run_fills_in_the_middle(files):
    with localllm.load(files["fim"], threads=1) as m:
        ids = m.infill_tokens("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n")
        want = "".join(m.generate(ids, max_tokens=6, temperature=0))
    r = llm("run", str(files["fim"]), "--fim-prefix", "def add(a, b):\n    ", "--fim-suffix",
            "\n\nprint(add(1, 2))\n", "-n", "6", "--temp", "0", "-t", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
