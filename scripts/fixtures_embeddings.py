"""Write llama.cpp's embeddings and rank scores as reference fixtures (tests/fixtures/embeddings/).

Synthetic `bert`, `nomic-bert` and reranker GGUFs (localllm/testing/synthetic_encoders.py,
SmolLM2's tokenizer) and the real SmolLM2 file under mean and last pooling, each run through
llama-cpp-python with embedding=True on our own token ids (so the fixture checks the model,
not the tokenizer), raw (unnormalised) vectors stored with the file's digest.

    python scripts/fixtures_embeddings.py [--models-dir DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from localllm.formats import fetch  # noqa: E402
from localllm.formats.gguf import GGUFFile  # noqa: E402
from localllm.testing import synthetic, synthetic_encoders as se  # noqa: E402
from localllm.text.tokenizer import Tokenizer  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "embeddings"
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog.",
         "Embeddings map text to vectors; similar texts land close together.",
         "def add(a, b):\n    return a + b\n", "a"]
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and largest city of France.", "Bananas are yellow.",
        "France's capital city is Paris, on the Seine."]
# case -> (model file, pooling llama.cpp runs it with)
CASES = {"bert": ("bert", "mean"), "bert_cls": ("bert_cls", "cls"),
         "nomic_bert": ("nomic_bert", "mean"), "bert_q8": ("bert_q8", "last"), "bert_rank": ("bert_rank", "rank"),
         "smollm_mean": ("smollm", "mean"), "smollm_last": ("smollm", "last")}


def rank_pairs(tok: Tokenizer) -> list[list[int]]:
    """llama-server's rerank input without a template: [BOS] query [EOS] [SEP] doc [EOS],
    each part where the tokenizer adds it (SmolLM2's adds none)."""
    q = tok.encode(QUERY, add_special=False)
    out = []
    for d in DOCS:
        ids = ([tok.bos_id] if tok.add_bos else []) + q + ([tok.eos_id] if tok.add_eos else [])
        out.append(ids + tok.encode(d, add_special=False) + ([tok.eos_id] if tok.add_eos else []))
    return out


def reference(path: Path, pooling: str, inputs: list[list[int]]) -> list[np.ndarray]:
    """llama.cpp's pooled output for each token list, each decoded alone (2 threads)."""
    import llama_cpp
    n = max(len(x) for x in inputs)
    llm = llama_cpp.Llama(str(path), embedding=True, n_ctx=512, n_batch=512, n_ubatch=512,
                          n_threads=2, n_threads_batch=2, verbose=False,
                          pooling_type=se.POOL_IDS[pooling])
    assert n <= 512
    width = 1 if pooling == "rank" else llm.n_embd()
    out = []
    for ids in inputs:
        llm._batch.reset()
        llm._ctx.kv_cache_clear()
        llm._batch.add_sequence(ids, 0, True)
        llm._ctx.decode(llm._batch)
        ptr = llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)
        out.append(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                         shape=(width,)).copy())
    llm.close()
    return out


# An /infill request with repo-level context (a model with every FIM token).
INFILL = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n",
          "input_extra": [{"filename": "util.py", "text": "X = 1\n"},
                          {"filename": "b.py", "text": "import os\n"}],
          "prompt": "return"}


def infill_reference(path: Path) -> list[int]:
    """llama-server's format_prompt_infill for INFILL, its parts tokenized by llama.cpp:
    [FIM_REP] "myproject\\n", per extra file [FIM_SEP] "name\\n" text, [FIM_SEP]
    "filename\\n", then ([BOS]) [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID] (PSM;
    nothing cut at a 4096-token context: all parts are far under the default batch of
    2048, and the extra context fits in what the context has beyond a batch)."""
    import llama_cpp
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    ids = se.FIM_IDS
    enc = lambda t, special=False: llm.tokenize(t.encode(), add_bos=False, special=special)  # noqa: E731
    out = [ids["fim_rep"]] + enc("myproject\n")
    for e in INFILL["input_extra"]:
        out += [ids["fim_sep"]] + enc(e["filename"] + "\n") + enc(e["text"])
    out += [ids["fim_sep"]] + enc("filename\n")
    assert llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model)) is False
    assert llama_cpp.llama_vocab_fim_pre(llama_cpp.llama_model_get_vocab(llm.model)) == ids["fim_pre"]
    out += [ids["fim_pre"]] + enc(INFILL["input_prefix"]) + enc(INFILL["prompt"], True)
    out += [ids["fim_suf"]] + enc(INFILL["input_suffix"]) + [ids["fim_mid"]]
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models-dir", default=None)
    args = ap.parse_args()
    smollm = fetch.resolve_model_path("smollm2-135m", args.models_dir, download=False)
    f = GGUFFile(smollm)
    meta = dict(f.metadata)
    tok = Tokenizer.from_metadata(meta)
    f.close()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        for case, (model, pooling) in CASES.items():
            path = smollm if model == "smollm" else se.write(model, Path(d) / f"{model}.gguf", meta)
            inputs = rank_pairs(tok) if pooling == "rank" else [tok.encode(t) for t in TEXTS]
            vecs = reference(path, pooling, inputs)
            info = {"model": model, "pooling": pooling, "digest": synthetic.digest(path),
                    "inputs": inputs, "texts": TEXTS, "query": QUERY, "documents": DOCS}
            np.savez_compressed(OUT / f"{case}.npz", vectors=np.stack(vecs).astype(np.float32),
                                info=json.dumps(info))
            print(case, pooling, np.stack(vecs).shape)
        fim = synthetic.write("llama3", Path(d) / "fim.gguf", se.with_fim_tokens(meta))
        (OUT / "infill.json").write_text(json.dumps(
            {"request": INFILL, "ids": infill_reference(fim)}, indent=1) + "\n")
        print("infill", len(json.loads((OUT / "infill.json").read_text())["ids"]), "ids")


if __name__ == "__main__":
    main()
