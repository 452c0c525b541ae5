#!/usr/bin/env python3
"""Write the synthetic models (one small GGUF per architecture with random weights and
SmolLM2's tokenizer, see tests/synthetic.py) and, with --reference, llama.cpp's logits on
them as the fixtures in tests/fixtures/synthetic/ (not run in CI: the tests regenerate the
same files and compare against those fixtures).

  python scripts/make_synthetic.py --dir DIR                        # the GGUF files only
  python scripts/make_synthetic.py --dir DIR --reference PYTHON     # and the fixtures
  python scripts/make_synthetic.py --dir DIR --reference PYTHON --moe   # the MoE ones only
  python scripts/make_synthetic.py --dir DIR --reference PYTHON --hybrid  # Qwen3.5's
  python scripts/make_synthetic.py --dir DIR --reference PYTHON --cases smollm3  # some

PYTHON is an interpreter with llama-cpp-python; it runs this script's ``--score`` step,
which needs only llama_cpp and numpy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "synthetic"
GREEDY_PROMPTS = 6  # llama.cpp's greedy continuations of the first prompts, 32 tokens each


def write_models(out: Path, moe: bool = False, only: list | None = None,
                 hybrid: bool = False) -> dict:
    """Write the synthetic models into ``out`` (``moe``: the mixture-of-experts ones,
    ``hybrid``: the linear-attention ones; of those, the cases ``only``, or all);
    returns the cases to score (also written as out/cases.json for the --score step)."""
    from localllm.testing import synthetic
    from make_fixtures import model_path
    from localllm.formats.gguf import GGUFFile

    out.mkdir(parents=True, exist_ok=True)
    src = GGUFFile(model_path("smollm"))
    digests = {}
    table = synthetic.HYBRID_CASES if hybrid else synthetic.MOE_CASES if moe else \
        synthetic.CASES
    wanted = table if not only else {c: table[c] for c in only}
    for name in sorted({m for m, _ in wanted.values()}):
        path = synthetic.write(name, out / f"{name}.gguf", src.metadata)
        digests[name] = synthetic.digest(path)
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB)")
    src.close()
    cases = {case: {"model": model, "n_ctx": n_ctx, "digest": digests[model],
                    "file": str(out / f"{model}.gguf")}
             for case, (model, n_ctx) in wanted.items()}
    (out / "cases.json").write_text(json.dumps(cases, indent=1))
    return cases


def score(out: Path) -> None:
    """(Under llama-cpp-python.) llama.cpp's top log-probabilities over the passage for each
    case, its own token-by-token agreement, and its token ids of the tokenizer texts."""
    import llama_cpp
    from localllm.testing.fixture_texts import corpus
    from fixtures_logits import (GREEDY_TOKENS, PASSAGE, PROMPTS, THREADS, TOPK, all_logits,
                                 coarse_kl, log_softmax)

    FIXTURES.mkdir(parents=True, exist_ok=True)
    texts = corpus()
    for case, c in json.loads((out / "cases.json").read_text()).items():
        llm = llama_cpp.Llama(c["file"], n_ctx=c["n_ctx"], n_threads=THREADS, verbose=False)
        ids = [int(i) for i in llm.tokenize(PASSAGE.encode(), add_bos=True, special=False)]
        text_ids = [[int(i) for i in llm.tokenize(t.encode(), add_bos=False, special=False)]
                    for t in texts]
        greedy = []
        for prompt in PROMPTS[:GREEDY_PROMPTS]:
            pids = [int(i) for i in llm.tokenize(prompt.encode(), add_bos=True, special=False)]
            out = []
            for t in llm.generate(pids, temp=0.0, top_k=1, reset=True):
                out.append(int(t))
                if len(out) >= GREEDY_TOKENS:
                    break
            greedy.append({"prompt_ids": pids, "continuation": out})
        llm.close()
        lp = log_softmax(all_logits(c["file"], ids, 512, c["n_ctx"]))
        top = np.argsort(-lp, axis=1, kind="stable")[:, :TOPK]
        top_lp = np.take_along_axis(lp, top, 1)
        seq = log_softmax(all_logits(c["file"], ids, 1, c["n_ctx"]))
        info = {
            "about": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, {THREADS} threads, "
                     f"n_ctx {c['n_ctx']}) on the synthetic {c['model']} model: top-{TOPK} "
                     "log-probs over the passage from one batch of 512; self: token by token "
                     "against that batch; text_ids: the tokenizer texts without BOS; greedy: "
                     "its greedy continuations of the first prompts",
            **c, "passage": PASSAGE, "texts": texts, "text_ids": text_ids, "greedy": greedy,
            "self": {"top1": float((seq.argmax(1) == lp.argmax(1)).mean()),
                     "kl_mean": float(coarse_kl(top, top_lp, seq).mean())},
        }
        del info["file"]
        path = FIXTURES / f"{case}.npz"
        np.savez_compressed(path, ids=np.array(ids, np.int32), top_ids=top.astype(np.int32),
                            top_logprobs=top_lp.astype(np.float32),
                            argmax=lp.argmax(1).astype(np.int32), info=np.array(json.dumps(info)))
        print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size / 1024:.0f} KiB): "
              f"{len(ids)} positions, llama.cpp self top-1 {info['self']['top1']:.4f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, required=True, help="where the GGUF files go")
    ap.add_argument("--reference", metavar="PYTHON",
                    help="an interpreter with llama-cpp-python: also write the fixtures")
    ap.add_argument("--moe", action="store_true", help="the mixture-of-experts models")
    ap.add_argument("--hybrid", action="store_true",
                    help="the linear-attention (Qwen3.5) models")
    ap.add_argument("--cases", nargs="+", metavar="CASE",
                    help="only these cases (default: all of synthetic.CASES, or MOE_CASES)")
    ap.add_argument("--score", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.score:
        score(args.dir)
        return 0
    write_models(args.dir, args.moe, args.cases, args.hybrid)
    if args.reference:
        return subprocess.call([args.reference, __file__, "--dir", str(args.dir), "--score"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
