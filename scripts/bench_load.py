"""Time a whole model load with and without the repacked-weight store.

Usage: python scripts/bench_load.py MODEL.gguf [threads]. Each measurement runs in a fresh
process: load() and the first logits() of 8 tokens, for weight_cache=False, then
weight_cache=True writing the store, then reading it, then False again.
"""

import json
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import localllm
t1 = time.perf_counter()
m = localllm.load(sys.argv[1], threads=int(sys.argv[2]), weight_cache=sys.argv[3] == "1",
                  models_dir=sys.argv[4], ctx_size=256, download=False)
t2 = time.perf_counter()
ids = m.tokenize("The quick brown fox jumps over the lazy dog and runs away")
m.logits(ids[:8])
t3 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "first_logits": t3 - t2}))
"""


def main() -> None:
    path, threads = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "2"
    with tempfile.TemporaryDirectory() as tmp:
        models_dir = f"{tmp}/models"
        for label, cache in (("no cache", "0"), ("cache write", "1"), ("cache read", "1"),
                             ("no cache", "0")):
            out = subprocess.run([sys.executable, "-c", CHILD, path, threads, cache, models_dir],
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{label:12s} load {r['load']:6.2f} s  first logits {r['first_logits']:6.2f} s  "
                  f"total {r['load'] + r['first_logits']:6.2f} s", flush=True)


if __name__ == "__main__":
    main()
