"""Write llama.cpp's embeddings and rank scores as reference fixtures (tests/fixtures/embeddings/).

Synthetic `bert`, `nomic-bert` and reranker GGUFs (localllm/testing/synthetic_encoders.py,
SmolLM2's tokenizer), a synthetic Qwen3-Embedding-like decoder (pooling from its file) and the
real SmolLM2 file and an F32 copy of its weights (its Q4_1 tensors dequantized) under mean
and last pooling, each run through llama-cpp-python with embedding=True on our own token ids (so the fixture checks the model, not the tokenizer; the
decoder embedder's ids are checked against llama.cpp's tokenizer here), raw (unnormalised)
vectors stored with the file's digest. Then llama-server's /infill prompts for a few
vocabularies and orders (infill.json, infill_variants.json).

    python scripts/fixtures_embeddings.py [--models-dir DIR] [--only CASE ...]
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
from localllm.testing.gguf_copy import copy_gguf  # noqa: E402
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
         "smollm_mean": ("smollm", "mean"), "smollm_last": ("smollm", "last"),
         "smollm_f32_mean": ("smollm_f32", "mean"), "smollm_f32_last": ("smollm_f32", "last"),
         "qwen3_embed_last": ("qwen3_embed", "last")}
# cases llama.cpp runs with the pooling its file names (LLAMA_POOLING_TYPE_UNSPECIFIED),
# checking that it is the one given above
FILE_POOLING = {"qwen3_embed_last"}


def rank_pairs(tok: Tokenizer) -> list[list[int]]:
    """llama-server's rerank input without a template: [BOS] query [EOS] [SEP] doc [EOS],
    each part where the tokenizer adds it (SmolLM2's adds none)."""
    q = tok.encode(QUERY, add_special=False)
    out = []
    for d in DOCS:
        ids = ([tok.bos_id] if tok.add_bos else []) + q + ([tok.eos_id] if tok.add_eos else [])
        out.append(ids + tok.encode(d, add_special=False) + ([tok.eos_id] if tok.add_eos else []))
    return out


def reference(path: Path, pooling: str, inputs: list[list[int]],
              from_file: bool = False) -> list[np.ndarray]:
    """llama.cpp's pooled output for each token list, each decoded alone (2 threads); with
    from_file, under the file's own pooling (which must be ``pooling``)."""
    import llama_cpp
    n = max(len(x) for x in inputs)
    llm = llama_cpp.Llama(str(path), embedding=True, n_ctx=512, n_batch=512, n_ubatch=512,
                          n_threads=2, n_threads_batch=2, verbose=False,
                          pooling_type=(llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED if from_file
                                        else se.POOL_IDS[pooling]))
    assert llama_cpp.llama_pooling_type(llm._ctx.ctx) == se.POOL_IDS[pooling]
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


# /infill variants on SmolLM2's vocabulary with FIM_IDS named: case -> (FIM_IDS names left
# unnamed, add_bos_token to set or None, llama-server's --spm-infill). Without a fim_sep
# token the extra chunks are joined by llama-server's "--- snippet ---" separator; without
# the fim_rep key, <reponame> is found by its text.
INFILL_VARIANTS = {"spm_bos": ((), True, True), "no_sep": (("fim_sep",), None, False),
                   "no_sep_no_rep_spm": (("fim_sep", "fim_rep"), None, True)}


def infill_reference(path: Path, request: dict, spm: bool = False, n_ctx: int = 4096,
                     n_batch: int = 2048, n_predict: int = -1) -> list[int]:
    """llama-server's format_prompt_infill for an /infill request, in its order, with the
    FIM tokens, add_bos and BOS that llama.cpp's vocabulary reports and every part tokenized
    by llama.cpp: [FIM_REP] "myproject\\n" (if the model has FIM_REP), per extra file
    [FIM_SEP] "name\\n" (or, without FIM_SEP, "\\n\\n--- snippet ---\\n\\n") text,
    [FIM_SEP] "filename\\n" (if FIM_SEP), then the prefix part [FIM_PRE] prefix prompt and the
    suffix part [FIM_SUF] suffix, in that order (PSM) or suffix first (SPM), [BOS] before the
    first where the vocabulary adds BOS, the extra context before it all, [FIM_MID] last;
    prefix, suffix and extra context cut as llama-server cuts them."""
    import llama_cpp
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    null = llama_cpp.LLAMA_TOKEN_NULL
    rep, sep = llama_cpp.llama_vocab_fim_rep(vocab), llama_cpp.llama_vocab_fim_sep(vocab)
    pre, suf = llama_cpp.llama_vocab_fim_pre(vocab), llama_cpp.llama_vocab_fim_suf(vocab)
    mid = llama_cpp.llama_vocab_fim_mid(vocab)
    enc = lambda t, special=False: llm.tokenize(t.encode(), add_bos=False, special=special)  # noqa: E731
    extra: list[int] = []
    if rep != null:
        extra += [rep] + enc("myproject\n")
    for e in request.get("input_extra", []):
        if sep != null:
            extra += [sep] + enc(e.get("filename", "tmp") + "\n")
        else:
            extra += enc("\n\n--- snippet ---\n\n")  # its k_chunk_prefix_str, byte for byte
        extra += enc(e["text"])
    if sep != null:
        extra += [sep] + enc("filename\n")
    prefix, suffix = enc(request["input_prefix"]), enc(request["input_suffix"])
    prompt = enc(request["prompt"], True) if request.get("prompt") else []
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    prefix_part = [pre] + prefix[len(prefix) - n_prefix:] + prompt
    suffix_part = [suf] + suffix[:n_suffix]
    first, second = (suffix_part, prefix_part) if spm else (prefix_part, suffix_part)
    if llama_cpp.llama_vocab_get_add_bos(vocab):
        first = [llama_cpp.llama_vocab_bos(vocab)] + first
    out = extra[len(extra) - n_extra:] + first + second + [mid]
    llm.close()
    return out


def write_embeddings(case: str, d: Path, smollm: Path, meta: dict, tok: Tokenizer) -> None:
    """One case of CASES: its model, inputs, llama.cpp's vectors, into OUT/{case}.npz."""
    model, pooling = CASES[case]
    if model == "smollm":
        path = smollm
    elif model == "smollm_f32":
        path = d / "smollm_f32.gguf"
        if not path.exists():
            copy_gguf(smollm, path, requant=("Q4_1", "F32"))
    elif model == "qwen3_embed":
        path = se.write_qwen3_embedding(d / "qwen3_embed.gguf", meta)
    else:
        path = se.write(model, d / f"{model}.gguf", meta)
    if model == "qwen3_embed":  # its own tokenizer (EOS appended), as llama.cpp's tokenizes
        import llama_cpp
        f = GGUFFile(path)
        tok = Tokenizer.from_metadata(dict(f.metadata))
        f.close()
        vocab_llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
        for t in TEXTS:
            assert tok.encode(t) == vocab_llm.tokenize(t.encode(), add_bos=True), t
            assert tok.encode(t)[-1] == tok.eos_id
        vocab_llm.close()
    inputs = rank_pairs(tok) if pooling == "rank" else [tok.encode(t) for t in TEXTS]
    vecs = reference(path, pooling, inputs, from_file=case in FILE_POOLING)
    info = {"model": model, "pooling": pooling, "digest": synthetic.digest(path),
            "inputs": inputs, "texts": TEXTS, "query": QUERY, "documents": DOCS}
    np.savez_compressed(OUT / f"{case}.npz", vectors=np.stack(vecs).astype(np.float32),
                        info=json.dumps(info))
    print(case, pooling, np.stack(vecs).shape)


def write_infill(d: Path, meta: dict) -> None:
    """infill.json (every FIM token, PSM) and infill_variants.json (INFILL_VARIANTS)."""
    fim = synthetic.write("llama3", d / "fim.gguf", se.with_fim_tokens(meta))
    ids = infill_reference(fim, INFILL)
    assert ids[0] == se.FIM_IDS["fim_rep"]
    (OUT / "infill.json").write_text(json.dumps({"request": INFILL, "ids": ids}, indent=1) + "\n")
    print("infill", len(ids), "ids")
    cases = {}
    for name, (drop, add_bos, spm) in INFILL_VARIANTS.items():
        path = synthetic.write("llama3", d / f"fim_{name}.gguf",
                               se.with_fim_tokens(meta, drop=drop, add_bos=add_bos))
        cases[name] = {"drop": list(drop), "add_bos": add_bos, "spm": spm,
                       "ids": infill_reference(path, INFILL, spm=spm)}
        print("infill", name, len(cases[name]["ids"]), "ids")
    (OUT / "infill_variants.json").write_text(
        json.dumps({"request": INFILL, "cases": cases}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--models-dir", default=None)
    ap.add_argument("--only", nargs="+", choices=[*CASES, "infill"],
                    help="write only these cases (default: all)")
    args = ap.parse_args()
    smollm = fetch.resolve_model_path("smollm2-135m", args.models_dir, download=False)
    f = GGUFFile(smollm)
    meta = dict(f.metadata)
    tok = Tokenizer.from_metadata(meta)
    f.close()
    OUT.mkdir(parents=True, exist_ok=True)
    only = set(args.only or [*CASES, "infill"])
    with tempfile.TemporaryDirectory() as d:
        for case in CASES:
            if case in only:
                write_embeddings(case, Path(d), smollm, meta, tok)
        if "infill" in only:
            write_infill(Path(d), meta)


if __name__ == "__main__":
    main()
