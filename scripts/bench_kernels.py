"""Benchmark the CPU matmul kernels per weight format at the real models' shapes: decode
matvec (n=1) as GB/s of packed weight bytes, hot and optionally cache-cold, and n=256 prefill
as GFLOP/s, at a stated thread count."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

# Random weights of a sane scale, as the kernel tests make them.
from localllm.testing.kernel_data import random_weight  # noqa: E402

# name -> (N, K) of W; the models' output heads are the largest.
SHAPES = {
    "smollm.attn_q": (576, 576),
    "smollm.attn_k": (192, 576),
    "smollm.ffn_up": (1536, 576),
    "smollm.ffn_down": (576, 1536),
    "smollm.output": (49152, 576),
    "gemma.attn_q": (1024, 640),
    "gemma.attn_k": (256, 640),
    "gemma.attn_output": (640, 1024),
    "gemma.ffn_up": (2048, 640),
    "gemma.ffn_down": (640, 2048),
    "gemma.output": (262144, 640),
}
DEFAULT_SHAPES = ["smollm.attn_q", "smollm.ffn_up", "smollm.ffn_down", "smollm.output",
                  "gemma.attn_q", "gemma.attn_output", "gemma.ffn_up", "gemma.ffn_down"]
PREFILL_TOKENS = 256


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def l3_bytes() -> int | None:
    """Size of the last-level cache from sysfs (Linux), else None."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            s = f.read().strip().upper()
    except OSError:
        return None
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s.rstrip("KMG")) * mult


def _sample(fn, min_calls: int, min_seconds: float) -> tuple[float, float]:
    """(median, fastest) wall time of one call over at least ``min_calls`` calls and seconds."""
    times = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def median_time(fn, min_calls: int, min_seconds: float, threads: int,
                retries: int = 3) -> tuple[float, bool]:
    """Median wall time of one call at ``threads`` threads, retried while it looks disturbed.

    On a machine shared with other work, parallel calls wait for a busy core: the median then
    sits far above the fastest call, or above the time of the same call on one thread.
    Returns:
        (median seconds, whether the last attempt looked undisturbed).
    """
    import numba

    fn()  # first call loads the compiled kernel
    one_thread = None
    if threads > 1:
        numba.set_num_threads(1)
        one_thread, _ = _sample(fn, min_calls, min_seconds / 2)
        numba.set_num_threads(threads)
    for attempt in range(retries + 1):
        med, best = _sample(fn, min_calls, min_seconds)
        if med <= 3 * best and (one_thread is None or med <= 2 * one_thread):
            return med, True
        if attempt < retries:
            time.sleep(1.0)
    return med, False


def copy_weight(w):
    return type(w)(w.type_name, w.N, w.K, type(w.packed)(*(a.copy() for a in w.packed)))


def bench_one(M, name: str, N: int, K: int, args, rng) -> dict:
    w = M.pack(name, random_weight(name, N, K, rng), N, K)
    kind = M.needs(w)
    x1 = rng.standard_normal((1, K), np.float32)
    act1 = M.quantize(x1, need32=kind == "q32", need256=kind == "q256")
    out1 = np.empty((1, w.padded_rows), np.float32)
    hot, ok = median_time(lambda: M.matmul_into(w, act1, out1), 20, args.seconds, args.threads)
    row = {"format": name, "N": N, "K": K, "weight_mb": w.nbytes / 1e6,
           "decode_us": hot * 1e6, "decode_gbs": w.nbytes / hot / 1e9, "disturbed": []}
    if not ok:
        row["disturbed"].append("decode")

    if args.cold:
        # Enough copies of the weight that a pass over them does not fit in the cache.
        copies = [w] + [copy_weight(w) for _ in range(max(1, -(-args.cold_mb * 10**6 // w.nbytes)) - 1)]

        def one_pass():
            for c in copies:
                M.matmul_into(c, act1, out1)
        t, ok = median_time(one_pass, 3, args.seconds, args.threads)
        row["cold_gbs"] = w.nbytes / (t / len(copies)) / 1e9
        if not ok:
            row["disturbed"].append("cold")
        del copies

    xp = rng.standard_normal((PREFILL_TOKENS, K), np.float32)
    actp = M.quantize(xp, need32=kind == "q32", need256=kind == "q256")
    outp = np.empty((PREFILL_TOKENS, w.padded_rows), np.float32)
    t, ok = median_time(lambda: M.matmul_into(w, actp, outp), 3, args.seconds, args.threads)
    if not ok:
        row["disturbed"].append("prefill")
    row["prefill_ms"] = t * 1e3
    row["prefill_gflops"] = 2 * PREFILL_TOKENS * N * K / t / 1e9
    return row


def parse_args(argv=None):
    from localllm.formats import quants

    p = argparse.ArgumentParser(description=" ".join(__doc__.split()))
    p.add_argument("--formats", default=",".join(sorted(quants.SUPPORTED_TYPES)),
                   help="comma-separated GGML type names (default: all supported)")
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                   help=f"comma-separated names from {', '.join(SHAPES)}, NxK, or 'all'")
    p.add_argument("--threads", type=int, default=2, help="Numba threads (default 2)")
    p.add_argument("--cold", action="store_true",
                   help="also time decode cycling over copies of the weight larger than the cache")
    l3 = l3_bytes()
    p.add_argument("--cold-mb", type=int, default=max(300, 2 * (l3 or 0) // 10**6),
                   help="size of the cold working set in MB (default: 2x L3, at least 300)")
    p.add_argument("--seconds", type=float, default=0.3, help="minimum time per measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p.parse_args(argv)


def resolve_shapes(spec: str) -> list[tuple[str, int, int]]:
    names = list(SHAPES) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    out = []
    for s in names:
        if s in SHAPES:
            out.append((s, *SHAPES[s]))
        elif "x" in s and all(p.isdigit() for p in s.split("x", 1)):
            n, k = (int(p) for p in s.split("x", 1))
            out.append((s, n, k))
        else:
            raise SystemExit(f"unknown shape {s!r}; known: {', '.join(SHAPES)} or NxK")
    return out


def format_table(meta: dict, rows: list[dict], skipped: list[str]) -> str:
    lines = [f"CPU: {meta['cpu']} ({meta['llvm_cpu']}), ISA path: {meta['isa']}, "
             f"threads: {meta['threads']} of {meta['cores']} cores, numba {meta['numba']}, "
             f"load average before: {meta['load_before']}",
             "decode = one token (n=1), GB/s of packed weight bytes per call; "
             f"prefill = n={PREFILL_TOKENS}, GFLOP/s = 2*n*N*K/time; medians; activations "
             "quantized beforehand"]
    cold = any("cold_gbs" in r for r in rows)
    head = (f"{'format':7} {'shape':18} {'N x K':>12} {'MB':>8} {'decode us':>10} {'GB/s':>7}"
            + (f" {'cold GB/s':>9}" if cold else "") + f" {'prefill ms':>10} {'GFLOP/s':>8}")
    lines += [head, "-" * len(head)]
    for r in rows:
        mark = {k: "!" if k in r["disturbed"] else " " for k in ("decode", "cold", "prefill")}
        lines.append(
            f"{r['format']:7} {r['shape']:18} {str(r['N']) + 'x' + str(r['K']):>12} "
            f"{r['weight_mb']:8.2f} {r['decode_us']:10.1f} {r['decode_gbs']:7.1f}{mark['decode']}"
            + (f"{r['cold_gbs']:9.1f}{mark['cold']}" if cold else "")
            + f"{r['prefill_ms']:10.2f} {r['prefill_gflops']:8.1f}{mark['prefill']}")
    if skipped:
        by_shape: dict[str, list[str]] = {}
        for item in skipped:
            fmt, shape = item.split(" ", 1)
            by_shape.setdefault(shape, []).append(fmt)
        groups: dict[tuple, list[str]] = {}
        for shape, fmts in by_shape.items():
            groups.setdefault(tuple(fmts), []).append(shape)
        for fmts, shapes in groups.items():
            lines.append(f"not run (K not a multiple of the block size): {','.join(fmts)} "
                         f"at {', '.join(shapes)}")
    if any(r["disturbed"] for r in rows):
        lines.append("! = still disturbed after retries (median far above the fastest call or "
                     "the one-thread time): threads waited for a core busy with other work")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import numba
    import llvmlite.binding as llvm

    import localllm
    from localllm.formats import quants
    from localllm.kernels import matmul as M

    formats = [f.strip().upper() for f in args.formats.split(",") if f.strip()]
    bad = [f for f in formats if f not in quants.SUPPORTED_TYPES]
    if bad:
        raise SystemExit(f"unsupported formats: {', '.join(bad)}")
    shapes = resolve_shapes(args.shapes)
    if not 1 <= args.threads <= numba.config.NUMBA_NUM_THREADS:
        raise SystemExit(f"--threads must be 1..{numba.config.NUMBA_NUM_THREADS} "
                         "(raise NUMBA_NUM_THREADS for more)")
    cfg = localllm.configure_process(threads=args.threads)

    meta = {"cpu": cpu_model(), "llvm_cpu": llvm.get_host_cpu_name(), "isa": cfg.isa,
            "threads": args.threads, "numba": numba.__version__, "cores": os.cpu_count(),
            "prefill_tokens": PREFILL_TOKENS, "cold_mb": args.cold_mb if args.cold else None,
            "load_before": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
    rng = np.random.default_rng(args.seed)
    rows, skipped = [], []
    for name in formats:
        for shape, N, K in shapes:
            if K % quants.block_size(name) or K % 32:
                skipped.append(f"{name} {shape}")
                continue
            row = bench_one(M, name, N, K, args, rng)
            row["shape"] = shape
            rows.append(row)
            if not args.json:
                print(f"  {name} {shape} done", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"meta": meta, "results": rows, "skipped": skipped}, indent=1))
    else:
        print(format_table(meta, rows, skipped))
    return 0


if __name__ == "__main__":
    sys.exit(main())
