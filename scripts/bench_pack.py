"""Repack throughput of pack_weight per format, on a 4096x4096 matrix of random blocks.

Usage: python scripts/bench_pack.py [FORMAT,FORMAT,...]; prints the best of 15 runs.
"""

import sys
import time

import numpy as np

from localllm.formats import quants
from localllm.kernels import packing as P

N = K = 4096
ALL = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
       "Q6_K", "IQ4_XS", "F16", "BF16", "F32"]


def main() -> None:
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ALL
    rng = np.random.default_rng(0)
    for name in names:
        row = quants.row_nbytes(name, K)
        raw = rng.integers(0, 256, size=N * row, dtype=np.uint8)
        P.pack_weight(name, raw[:16 * row], 16, K)  # compile
        best = 1e9
        for _ in range(15):
            t = time.perf_counter()
            P.pack_weight(name, raw, N, K)
            best = min(best, time.perf_counter() - t)
        print(f"{name:7s} {raw.nbytes / 1e6:7.1f} MB {best * 1e3:7.1f} ms "
              f"{raw.nbytes / best / 1e9:6.2f} GB/s", flush=True)


if __name__ == "__main__":
    main()
