#!/usr/bin/env python3
"""KV cache types against f16: perplexity of a text (llama.cpp's windows: -c tokens, the
second half of each scored) for each KV type, ours and llama.cpp's side by side on the same
token ids, plus our mean KL divergence and top-1 agreement against f16.

    python scripts/kv_quality.py smollm2-135m gemma3-270m -f /usr/share/common-licenses/GPL-3 \
        --llama-python /path/to/venv-with-llama-cpp-python/bin/python

Not a test: it takes minutes. llama.cpp runs in its own process (``--llama-python``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TYPES = ("q8_0", "q4_0", "fp8")
LLAMA_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}  # ggml_type numbers; llama.cpp has no fp8 KV


def llama_worker(path: str, ids_file: str, n_ctx: int, kv: str, threads: int) -> None:
    """llama.cpp's perplexity over the given ids (run under the llama-cpp-python Python)."""
    import numpy as np
    import llama_cpp
    doc = json.loads(Path(ids_file).read_text())
    ids, bos = doc["ids"], doc["bos"]
    t = LLAMA_TYPES[kv]
    llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                          n_threads=threads, n_threads_batch=threads, type_k=t, type_v=t,
                          flash_attn=kv != "f16", verbose=False)
    nll, nll2, count = 0.0, 0.0, 0
    first = n_ctx // 2
    for w in range(len(ids) // n_ctx):
        toks = ids[w * n_ctx:(w + 1) * n_ctx]
        if bos is not None:
            toks[0] = bos
        llm.reset()
        llm.eval(toks)
        z = np.asarray(llm.scores[first:n_ctx - 1], np.float64)
        z -= z.max(1, keepdims=True)
        lp = z - np.log(np.exp(z).sum(1, keepdims=True))
        v = -lp[np.arange(len(z)), toks[first + 1:]]
        nll, nll2, count = nll + v.sum(), nll2 + (v * v).sum(), count + v.size
    mean = nll / count
    ppl = math.exp(mean)
    err = ppl * math.sqrt(max(nll2 / count - mean * mean, 0) / (count - 1))
    print(json.dumps({"ppl": ppl, "ppl_err": err, "tokens_scored": count}))


def ours(name: str, text: str, n_ctx: int, threads: int) -> tuple[dict, list, int | None]:
    import localllm
    from localllm.generation.perplexity import perplexity
    m = localllm.load(name, ctx_size=n_ctx, threads=threads, batch_size=n_ctx)
    ids = m.tokenize(text)
    r = perplexity(m, ids, n_ctx, [m.with_kv(t, t) for t in TYPES])
    bos = m.tokenizer.bos_id if m.tokenizer.add_bos else None
    return r, ids, bos


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("-f", "--file", required=True, help="the text (at least a few thousand tokens)")
    ap.add_argument("-c", "--ctx", type=int, default=512, help="window (llama.cpp's default 512)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-python", default=None, help="Python with llama-cpp-python")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        path, ids_file, n_ctx, kv = args.worker
        llama_worker(path, ids_file, int(n_ctx), kv, args.threads)
        return 0

    from localllm.formats.fetch import resolve_model_path
    text = Path(args.file).read_text(encoding="utf-8")
    for name in args.models:
        path = str(resolve_model_path(name))
        r, ids, bos = ours(path, text, args.ctx, args.threads)
        print(f"\n## {name}: {len(ids)} tokens, {r['windows']} windows of {args.ctx}, "
              f"{r['tokens_scored']} scored ({Path(args.file).name})\n")
        print("| KV type | PPL (localllm) | vs f16 | mean KL | top-1 agreement | "
              "PPL (llama.cpp) | vs f16 |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        ref = {}
        if args.llama_python:
            with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
                json.dump({"ids": ids, "bos": bos}, f)
            try:
                for kv in LLAMA_TYPES:
                    out = subprocess.run(
                        [args.llama_python, __file__, "--threads", str(args.threads),
                         "--worker", path, f.name, str(args.ctx), kv, "-f", args.file],
                        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
                    if out.returncode == 0:
                        ref[kv] = json.loads(out.stdout.strip().splitlines()[-1])
                    else:
                        print(f"llama.cpp {kv} failed: {out.stderr.strip()[-300:]}",
                              file=sys.stderr)
            finally:
                os.unlink(f.name)

        def ref_cols(kv):
            if kv not in ref:
                return "-", "-"
            p = ref[kv]["ppl"]
            rel = f"{100 * (p / ref['f16']['ppl'] - 1):+.2f}%" if "f16" in ref else "-"
            return f"{p:.4f} ± {ref[kv]['ppl_err']:.4f}", rel if kv != "f16" else ""
        a, b = ref_cols("f16")
        print(f"| f16 | {r['ppl']:.4f} ± {r['ppl_err']:.4f} | | | | {a} | {b} |")
        for c in r["compare"]:
            a, b = ref_cols(c["kv_type"])
            print(f"| {c['kv_type']} | {c['ppl']:.4f} ± {c['ppl_err']:.4f} | "
                  f"{100 * (c['ppl'] / r['ppl'] - 1):+.2f}% | {c['mean_kl']:.5f} | "
                  f"{100 * c['top1_agreement']:.2f}% | {a} | {b} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
