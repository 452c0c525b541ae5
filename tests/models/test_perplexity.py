"""`llm perplexity`: llama.cpp's windows and estimate, recomputed here from Model.logits, and
the KV-type comparison in one run."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import localllm
from localllm.generation.perplexity import perplexity

PASSAGE = json.loads((Path(__file__).parents[1] / "fixtures" / "logits" /
                      "smollm_logits.json").read_text())["passage"]


@pytest.fixture(scope="module")
def model(smollm_path):
    return localllm.load(smollm_path, ctx_size=128, threads=2, batch_size=48)


@pytest.mark.parametrize("name", ["smollm", "gemma"])
def test_windows_and_estimate_follow_llama_cpp(model, gemma_path, name):
    if name == "gemma":  # a model that adds BOS
        model = localllm.load(gemma_path, ctx_size=128, threads=2, batch_size=48)
        assert model.tokenizer.add_bos
    ids = model.tokenize(PASSAGE * 2)
    n_ctx = 128
    r = perplexity(model, ids, n_ctx)
    nll = []
    for w in range(len(ids) // n_ctx):
        toks = ids[w * n_ctx:(w + 1) * n_ctx]
        if model.tokenizer.add_bos:  # each window then starts with BOS, as llama.cpp's does
            toks[0] = model.tokenizer.bos_id
        z = model.logits(toks).astype(np.float64)
        lp = z - z.max(1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(1, keepdims=True))
        nll += [-lp[j, toks[j + 1]] for j in range(n_ctx // 2, n_ctx - 1)]
    nll = np.array(nll)
    assert r["windows"] == len(ids) // n_ctx and r["tokens_scored"] == nll.size
    assert r["ppl"] == pytest.approx(math.exp(nll.mean()), rel=1e-9)
    err = math.exp(nll.mean()) * math.sqrt(nll.var() / (nll.size - 1))
    assert r["ppl_err"] == pytest.approx(err, rel=1e-6)


def test_kv_compare_scores_the_same_tokens(model):
    ids = model.tokenize(PASSAGE * 2)
    same = perplexity(model, ids, 128, [model.with_kv("f16", "f16")])["compare"][0]
    assert same["mean_kl"] == 0 and same["top1_agreement"] == 1 and same["delta_ppl"] == 0
    q4 = perplexity(model, ids, 128, [model.with_kv("q4_0", "q4_0")])["compare"][0]
    assert 0 < q4["mean_kl"] < 0.5 and q4["top1_agreement"] > 0.6
    assert q4["kv_type"] == "q4_0"


def test_cli_reports_progress_and_estimate(smollm_path, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(PASSAGE * 2)
    r = subprocess.run([sys.executable, "-m", "localllm.apps.cli", "perplexity", smollm_path, "-f",
                        str(text), "-c", "128", "--kv-compare", "fp8", "--threads", "2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Final estimate: PPL = " in r.stdout and "KV fp8: PPL = " in r.stdout
    assert "[1/" in r.stderr and "PPL so far" in r.stderr
    bad = subprocess.run([sys.executable, "-m", "localllm.apps.cli", "perplexity", smollm_path,
                          "-f", str(text), "-c", "4096"], capture_output=True, text=True,
                         timeout=600)
    last = bad.stderr.strip().splitlines()[-1]
    assert bad.returncode == 2 and last.startswith("error:") and "fewer" in last  # a bad setting
