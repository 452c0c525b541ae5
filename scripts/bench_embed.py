#!/usr/bin/env python3
"""Embedding throughput (`scripts/bench.py --embed`): N texts of about L tokens on a synthetic
BERT-base-shaped encoder (12 layers, 768 wide, F16, random weights, SmolLM2's tokenizer;
written under /tmp), localllm against llama.cpp (llama-cpp-python), the same token ids, the
same threads, each engine in its own process, batches of up to --batch tokens.

    python scripts/bench.py --embed --threads 2 [--texts 256 --tokens 128 --rounds 2]

With --rounds N the engines alternate (the first goes first in odd rounds); the figures are
the medians over rounds, and the ratio the median of the rounds' ratios. Each run records
the machine's busy cores and its own, so the load of other processes shows.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_model(path: Path, type_name: str = "F16") -> Path:
    """The BERT-base-shaped file, matrices in ``type_name`` (written once; same seed, same
    bytes)."""
    if path.exists():
        return path
    from localllm.formats import fetch
    from localllm.formats.gguf import GGUFFile
    from localllm.testing import synthetic_encoders as se
    f = GGUFFile(fetch.resolve_model_path("smollm2-135m", download=False))
    meta = dict(f.metadata)
    f.close()
    tmp = path.with_suffix(".part")
    se.write("bert_base", tmp, meta, spec=se.BERT_BASE, matrix_type=type_name)
    tmp.rename(path)
    return path


def make_inputs(n: int, length: int, vocab: int) -> list[list[int]]:
    """n token lists of length-8 .. length+8 ids drawn from the ordinary tokens."""
    import numpy as np
    rng = np.random.default_rng(0)
    return [rng.integers(100, vocab, int(rng.integers(length - 8, length + 9))).tolist()
            for _ in range(n)]


def worker_localllm(path: str, inputs, threads: int, batch: int) -> dict:
    import localllm
    m = localllm.load(path, threads=threads, batch_size=batch)
    m.embed(inputs[:2])  # maps the compiled kernels in
    t = time.perf_counter()
    m.embed(inputs)
    return {"seconds": time.perf_counter() - t}


def worker_llama(path: str, inputs, threads: int, batch: int) -> dict:
    import llama_cpp
    llm = llama_cpp.Llama(path, embedding=True, n_ctx=batch, n_batch=batch, n_ubatch=batch,
                          n_threads=threads, n_threads_batch=threads, verbose=False,
                          pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN)
    dim = llm.n_embd()

    def run(group):
        llm._batch.reset()
        llm._ctx.kv_cache_clear()
        for s, ids in enumerate(group):
            llm._batch.add_sequence(ids, s, True)
        llm._ctx.decode(llm._batch)
        for s in range(len(group)):  # read each pooled vector, as a caller would
            ptr = llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, s)
            ctypes.string_at(ptr, 4 * dim)

    def groups():
        out, cur, used = [], [], 0
        for ids in inputs:
            if cur and used + len(ids) > batch:
                out.append(cur)
                cur, used = [], 0
            cur.append(ids)
            used += len(ids)
        return out + [cur]
    run(inputs[:2])
    t = time.perf_counter()
    for g in groups():
        run(g)
    return {"seconds": time.perf_counter() - t}


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


def run_worker(python: str, engine: str, path: Path, inputs, threads: int, batch: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(inputs, f)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [python, __file__, "--worker", engine, "--model", str(path), "--ids", f.name,
           "--threads", str(threads), "--batch", str(batch)]
    busy0, wall0 = _busy_seconds(), time.perf_counter()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        raise RuntimeError(f"{engine} failed: {r.stderr.strip()[-400:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # the whole machine's busy cores during the worker, its own threads included
    wall = time.perf_counter() - wall0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    out["machine_busy_cores"] = (_busy_seconds() - busy0) / wall
    out["worker_cores"] = own / wall
    out["other_cores"] = max(0.0, out["machine_busy_cores"] - out["worker_cores"])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--texts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=128, help="about this many tokens per text")
    ap.add_argument("--batch", type=int, default=1024, help="tokens per forward pass")
    ap.add_argument("--type", default="F16", help="GGML type of the weight matrices (F16, Q8_0, ...)")
    ap.add_argument("--model", default=None,
                    help="the encoder file (default: /tmp/localllm-bench/bert-base-TYPE.gguf)")
    ap.add_argument("--llama-python", default=sys.executable)
    ap.add_argument("--rounds", type=int, default=1, help="alternating runs of both engines")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        inputs = json.loads(Path(args.ids).read_text())
        fn = worker_localllm if args.worker == "localllm" else worker_llama
        print(json.dumps(fn(args.model, inputs, args.threads, args.batch)))
        return 0
    path = Path(args.model or f"/tmp/localllm-bench/bert-base-{args.type.lower()}.gguf")
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    make_model(path, args.type)
    inputs = make_inputs(args.texts, args.tokens, 49152)
    n_tokens = sum(map(len, inputs))
    report = {"texts": args.texts, "tokens": n_tokens, "threads": args.threads, "type": args.type,
              "batch": args.batch, "model": str(path)}
    engines = [("localllm", sys.executable), ("llama_cpp", args.llama_python)]
    rounds = []
    for r in range(args.rounds):
        res = {}
        for engine, py in (engines if r % 2 == 0 else engines[::-1]):
            w = run_worker(py, "localllm" if engine == "localllm" else "llama", path, inputs,
                           args.threads, args.batch)
            w["texts_per_s"] = args.texts / w["seconds"]
            w["tokens_per_s"] = n_tokens / w["seconds"]
            res[engine] = w
        res["ratio"] = res["llama_cpp"]["seconds"] / res["localllm"]["seconds"]
        rounds.append(res)
        if args.rounds > 1 and not args.json:
            print(f"  round {r + 1}: localllm {res['localllm']['tokens_per_s']:.0f} tok/s "
                  f"(others {res['localllm']['other_cores']:.2f} cores), llama.cpp "
                  f"{res['llama_cpp']['tokens_per_s']:.0f} tok/s "
                  f"(others {res['llama_cpp']['other_cores']:.2f}), {res['ratio']:.2f}x",
                  flush=True)
    for engine, _ in engines:
        report[engine] = {k: statistics.median(rd[engine][k] for rd in rounds)
                          for k in rounds[0][engine]}
    report["ratio"] = statistics.median(rd["ratio"] for rd in rounds)
    report["rounds"] = rounds
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"embeddings: {args.texts} texts, {n_tokens} tokens, BERT-base shape ({args.type}), "
          f"{args.threads} threads, batches of {args.batch} tokens, "
          f"{args.rounds} round(s) (medians)")
    for engine in ("localllm", "llama_cpp"):
        r = report[engine]
        print(f"  {engine:9s} {r['seconds']:7.2f} s  {r['texts_per_s']:7.1f} texts/s  "
              f"{r['tokens_per_s']:8.0f} tok/s  (machine busy {r['machine_busy_cores']:.2f} cores, "
              f"other processes {r['other_cores']:.2f})")
    print(f"  localllm / llama.cpp throughput: {report['ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
