#!/usr/bin/env python3
"""The GPU backends on real models: parity with the CPU backend (teacher-forced top-1 and KL
on the fixture passage, argmax along the CPU backend's greedy continuations) fully offloaded
and split, then prompt and decode speed, beside llama.cpp (llama-cpp-python) offloaded the
same way when --llama-python names a Python with a GPU build of it.

    python scripts/gpu_check.py smollm2-135m gemma3-270m --backend torch
    python scripts/gpu_check.py gemma3-270m --llama-python /path/to/venv/bin/python --json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
from localllm.testing.compare import (GREEDY_MIN, GREEDY_PROMPTS, KL_MAX, TOP1_MIN, compare,
                                      greedy_rows)

FIXTURE = {"smollm2-135m": "smollm", "gemma3-270m": "gemma"}
PROMPT_TOKENS = 512
DECODE_TOKENS = 128
_LLAMA = """
import json, sys, time, llama_cpp
path, ngl, ids = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
if not llama_cpp.llama_supports_gpu_offload():
    sys.exit("this llama-cpp-python has no GPU offload")
llm = llama_cpp.Llama(path, n_gpu_layers=ngl, n_ctx=2048, n_batch=512, n_ubatch=512,
                      verbose=False)
llm.eval(ids[:8]); llm.reset()
t = time.perf_counter(); llm.eval(ids); pp = len(ids) / (time.perf_counter() - t)
tok = 0
t = time.perf_counter()
for _ in range(int(sys.argv[4])):
    llm.eval([tok])
tg = int(sys.argv[4]) / (time.perf_counter() - t)
print(json.dumps({"prompt_tps": pp, "decode_tps": tg}))
"""


def parity(path, fx, ref, backend: str, ngl, threads: int) -> dict:
    import localllm
    m = localllm.load(path, ctx_size=2048, threads=threads, backend=backend, gpu_layers=ngl)
    top1, kl = compare(ref["logits"], m.logits(fx["ids"]))
    hits = total = 0
    for (p, c), pred in zip(ref["greedy"], greedy_rows(m, ref["greedy"])):
        hits += int((pred == np.array(c)).sum())
        total += len(c)
    out = {"gpu_layers": m.plan.gpu_layers, "device": m.gpu_backend.device, "top1": top1,
           "kl_mean": kl, "greedy": hits / total}
    out.update(speed(m, fx["ids"]))
    m.close()
    return out


def speed(m, ids) -> dict:
    """Prompt tok/s over PROMPT_TOKENS and decode tok/s over DECODE_TOKENS, after a warm-up."""
    ids = (ids * (PROMPT_TOKENS // len(ids) + 1))[:PROMPT_TOKENS]
    m.logits(ids[:16])
    t = time.perf_counter()
    with m.new_sequence() as seq:
        seq.feed(ids)
    pp = len(ids) / (time.perf_counter() - t)
    gen = m.generate(ids[:16], temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    for _ in gen:
        pass
    return {"prompt_tps": pp, "decode_tps": gen.stats.generate_tps}


def machine() -> str:
    """The CPU's model name, and the CUDA device's where torch sees one."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        import torch
        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} beside {cpu}"
    except ImportError:
        pass
    return cpu


def llama_speed(python: str, path, ngl: int, ids) -> dict | None:
    ids = (ids * (PROMPT_TOKENS // len(ids) + 1))[:PROMPT_TOKENS]
    r = subprocess.run([python, "-c", _LLAMA, str(path), str(ngl), json.dumps(ids),
                        str(DECODE_TOKENS)], capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        print(f"llama.cpp: {(r.stderr.strip().splitlines() or ['failed'])[-1]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", default=list(FIXTURE))
    ap.add_argument("--backend", default="torch", choices=("torch", "mlx"))
    ap.add_argument("--split", type=int, default=0,
                    help="layers on the GPU in the split run (default: half)")
    ap.add_argument("--llama-python", default=None,
                    help="a Python whose llama-cpp-python has GPU offload (CUDA build)")
    ap.add_argument("-t", "--threads", type=int, default=0,
                    help="CPU threads (default: the physical cores)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import localllm
    from localllm.formats.fetch import resolve_model_path
    results, failed = [], False
    ISA = localllm.configure_process().isa
    print(f"machine: {machine()}, {args.threads or 'all physical'} CPU threads, CPU backend's "
          f"kernel path {ISA}", flush=True)
    for name in args.models:
        path = resolve_model_path(name)
        fx = json.loads((ROOT / f"tests/fixtures/logits/{FIXTURE[name]}_logits.json").read_text())
        cpu = localllm.load(path, ctx_size=2048, threads=args.threads, backend="cpu")
        seqs = []
        for g in fx["greedy"][:GREEDY_PROMPTS]:
            cont = [t for c in cpu.generate(g["prompt_ids"], temperature=0, max_tokens=32,
                                            ignore_eos=True) for t in c.tokens]
            seqs.append((g["prompt_ids"], cont))
        ref = {"logits": cpu.logits(fx["ids"]), "greedy": seqs}
        n = cpu.args.n_layers
        base = {"model": name, "backend": "cpu", "gpu_layers": 0, **speed(cpu, fx["ids"])}
        cpu.close()
        print(f"{name} cpu backend: prompt {base['prompt_tps']:.0f} tok/s, decode "
              f"{base['decode_tps']:.1f} tok/s", flush=True)
        results.append(base)
        for ngl in ("all", args.split or n // 2):
            r = {"model": name, "backend": args.backend, **parity(path, fx, ref, args.backend, ngl,
                                                                args.threads)}
            if args.llama_python:
                # llama.cpp offloads its output layer only past the last repeating layer
                # (-ngl n_layers + 1); ours goes with the last GPU layer.
                lngl = 999 if r["gpu_layers"] == n else r["gpu_layers"]
                r["llama_cpp"] = llama_speed(args.llama_python, path, lngl, fx["ids"])
            ok = (r["top1"] >= TOP1_MIN[FIXTURE[name]] and r["kl_mean"] <= KL_MAX
                  and r["greedy"] >= GREEDY_MIN)
            failed |= not ok
            lc = r.get("llama_cpp") or {}
            print(f"{name} {args.backend} ({r['device']}) {r['gpu_layers']}/{n} layers: "
                  f"top-1 {r['top1']:.4f}, KL {r['kl_mean']:.5f}, greedy {r['greedy']:.4f} "
                  f"[{'ok' if ok else 'FAIL'}]; prompt {r['prompt_tps']:.0f} tok/s, decode "
                  f"{r['decode_tps']:.1f} tok/s"
                  + (f"; llama.cpp prompt {lc['prompt_tps']:.0f}, decode {lc['decode_tps']:.1f}"
                     if lc else ""), flush=True)
            results.append(r)
    if args.json:
        print(json.dumps({"machine": machine(), "threads": args.threads, "results": results},
                         indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
