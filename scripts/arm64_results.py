#!/usr/bin/env python3
"""The results scripts/check_arm64.sh compares across machines: every weight format's matmul
(tests/kernel_data.py's fixed workload) and one whole-model forward, with the kernel path
that computed them; and a small matmul timing per format.

    arm64_results.py compute OUT.npz MODEL.gguf   # results of this Python's kernel path
    arm64_results.py compare A.npz B.npz          # bit for bit; exit 1 on any difference
    arm64_results.py speed OUT.json               # prefill matmul timings per format
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from localllm.testing import kernel_data  # noqa: E402

# A few ordinary token ids of SmolLM2's vocabulary, scored teacher-forced (every row).
MODEL_TOKENS = [1, 504, 3458, 282, 4649, 314, 3557, 30, 378, 5354, 314]
SPEED_SHAPE = (256, 512, 32)  # N, K, tokens


def compute(out: str, model: str) -> None:
    from localllm.api import configure_process, load
    isa = configure_process().isa  # before the kernels below run
    t = time.perf_counter()
    results = kernel_data.isa_results()
    t_kernels = time.perf_counter() - t
    t = time.perf_counter()
    m = load(model, threads=2, ctx_size=64, weight_cache=False)  # packing runs here too
    results["model_logits"] = m.logits(MODEL_TOKENS)
    m.close()
    t_model = time.perf_counter() - t
    np.savez(out, isa=np.array(isa), **results)
    print(f"{isa}: {len(results) - 1} matmul results in {t_kernels:.0f} s, "
          f"model forward in {t_model:.0f} s (first use: compiling included)")


def compare(a: str, b: str) -> int:
    with np.load(a) as fa, np.load(b) as fb:
        keys = sorted(k for k in fa.files if k != "isa")
        if keys != sorted(k for k in fb.files if k != "isa"):
            print("the two result sets hold different keys")
            return 1
        bad = []
        for k in keys:
            x, y = fa[k], fb[k]
            if x.shape != y.shape or not np.array_equal(x.view(np.uint32), y.view(np.uint32)):
                bad.append(k)
        print(f"{fa['isa']} vs {fb['isa']}: {len(keys) - len(bad)} of {len(keys)} results "
              f"bit-identical ({len(keys) - 1} matmuls of {len(kernel_data.FORMATS)} formats "
              f"at n = 7 and n = 1, and a {len(MODEL_TOKENS)}-token SmolLM2 forward)")
        for k in bad:
            print(f"  DIFFERENT: {k}")
        return 1 if bad else 0


def speed(out: str) -> None:
    from localllm.api import configure_process
    from localllm.kernels import matmul as M
    isa = configure_process().isa
    N, K, n = SPEED_SHAPE
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, K)).astype(np.float32)
    times = {}
    for name in kernel_data.FORMATS:
        w = M.pack(name, kernel_data.random_weight(name, N, K, rng), N, K)
        kind = M.needs(w)
        act = M.quantize(x, need32=kind == "q32", need256=kind == "q256")
        y = np.empty((n, w.padded_rows), np.float32)
        M.matmul_into(w, act, y)  # compile or load
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            M.matmul_into(w, act, y)
            best = min(best, time.perf_counter() - t)
        times[name] = best
    Path(out).write_text(json.dumps({"isa": isa, "seconds": times}))
    print(f"{isa}: timed {len(times)} formats")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "compute":
        compute(*args)
    elif cmd == "compare":
        sys.exit(compare(*args))
    elif cmd == "speed":
        speed(*args)
    else:
        sys.exit(__doc__)
