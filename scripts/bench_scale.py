"""The scale ladder side by side (`scripts/bench.py --scale DIR`): every GGUF in DIR through
localllm and llama.cpp, same token ids and threads, engines alternating over the rounds.

Per model: first load (the file evicted from the page cache and, for localllm, an empty
weight cache), warm load and ready-to-first-token, peak and resident memory split into
anonymous and file-backed pages, the extra disk a first load leaves, prompt 512 at depth 0
and after 4,000 tokens of context, and decode in tok/s and GB/s against the machine's
streaming read bandwidth measured in the same run.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import bench

DEPTH = 4000


def evict(path: str) -> None:
    """Drops the file's pages from the page cache (a first load reads it from disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def _engines(llama_python: str | None) -> list[tuple[str, str]]:
    out = [("localllm", sys.executable)]
    if llama_python:
        out.append(("llama", llama_python))
    return out


def one_model(path: str, args, llama_python: str | None, work: Path) -> dict:
    ids = bench.bench_ids(path, DEPTH + max(bench.PROMPT_SIZES))
    entry: dict = {"file_gb": os.path.getsize(path) / 1e9}
    for engine, python in _engines(llama_python):
        mdir = work / engine
        evict(path)
        # the weight cache, when on, lives beside the models folder: count all of mdir
        first = bench.run_worker(python, engine, path, ids, args.threads, 0, 0,
                                 retries=args.retries, models_dir=str(mdir / "models"))
        entry[engine] = {"first": first, "extra_disk_gb": du(mdir) / 1e9, "rounds": {}}
    for depth in (0, DEPTH):
        runs = {e: [] for e, _ in _engines(llama_python)}
        for _ in range(args.rounds):  # alternate, so drifts in machine speed hit both
            for engine, python in _engines(llama_python):
                runs[engine].append(bench.run_worker(python, engine, path, ids, args.threads,
                                                     args.reps, depth, retries=args.retries,
                                                     models_dir=str(work / engine / "models")))
        for engine in runs:
            entry[engine]["rounds"][depth] = bench._median_run(runs[engine])
    return entry


def _f(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def _rounds_by_depth(report: dict) -> None:
    """Depth keys as numbers again in a report read back from --json (JSON keys are text)."""
    for e in report["models"].values():
        for side in (e["localllm"], e.get("llama")):
            if side:
                side["rounds"] = {int(k): v for k, v in side["rounds"].items()}


def table(report: dict) -> str:
    """The ladder as a markdown table, from ``run``'s report or one read back from --json
    (whose depth keys it turns back into numbers, in place)."""
    _rounds_by_depth(report)
    bw = report["machine"]["read_gbps"]
    head = ("| model | file GB | prompt 512 ours / llama.cpp | after 4k | decode tok/s (GB/s, % of read) "
            "| first load | warm ready | peak RSS MB (anon+file) | extra disk GB |")
    lines = [head, "|" + "---|" * 9]
    for name, e in report["models"].items():
        o, l = e["localllm"], e.get("llama")

        def fig(side, depth, key):
            r = side and side["rounds"].get(depth)
            return r.get(key) if r else None

        def pair(key, depth, digits=0):
            a, b = fig(o, depth, key), fig(l, depth, key)
            ratio = f" ({a / b:.2f}x)" if a and b else ""
            return f"{_f(a, digits)} / {_f(b, digits)}{ratio}"

        def dec(side):
            r = side and side["rounds"].get(0)
            if not r:
                return "-"
            gbps = e["weight_bytes_per_token"] * r["tg_tps"] / 1e9 if e.get("weight_bytes_per_token") else None
            return f"{r['tg_tps']:.1f} ({_f(gbps)}, {_f(gbps and 100 * gbps / bw, 0)}%)"

        def start(key):
            a = o["first"] and o["first"].get(key) if key == "load_s" else fig(o, 0, key)
            b = (l["first"] and l["first"].get(key) if key == "load_s" else fig(l, 0, key)) if l else None
            return f"{_f(a, 2)} / {_f(b, 2)}"

        def mem(side):
            r = side and side["rounds"].get(0)
            return "-" if not r else f"{r['peak_rss_mb']:.0f} ({r['rss_anon_mb']:.0f}+{r['rss_file_mb']:.0f})"
        lines.append(f"| {name} | {e['file_gb']:.2f} | {pair('pp512_tps', 0)} | {pair('pp512_tps', DEPTH)} "
                     f"| {dec(o)} / {dec(l)} | {start('load_s')} | {start('ready_s')} "
                     f"| {mem(o)} / {mem(l)} | {o['extra_disk_gb']:.2f} / {l['extra_disk_gb'] if l else 0:.2f} |")
    return "\n".join(lines)


def run(args, llama_python: str | None) -> int:
    import localllm
    files = sorted(args.scale.glob("*.gguf"), key=lambda p: p.stat().st_size)
    files = [p for p in files if ".F16." not in p.name]
    if not files:
        print(f"no GGUF files in {args.scale}: write them with scripts/make_scale_models.py",
              file=sys.stderr)
        return 2
    report = {"machine": {"cpu": bench._cpu_name(), "kernel_path": localllm.configure_process().isa,
                          "threads": args.threads, "rounds": args.rounds,
                          "read_gbps": bench.machine_read_bandwidth()}, "models": {}}
    for p in files:
        with tempfile.TemporaryDirectory() as work:
            e = one_model(str(p), args, llama_python, Path(work))
        r = e["localllm"]["rounds"].get(0)
        e["weight_bytes_per_token"] = r and r.get("weight_bytes_per_token")
        report["models"][p.stem] = e
        print(f"{p.name}: done", file=sys.stderr, flush=True)
    m = report["machine"]
    others = [r.get("others_cores", 0.0) for e in report["models"].values()
              for side in (e["localllm"], e.get("llama")) if side
              for r in side["rounds"].values() if r]
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"machine: {m['cpu']}, kernel path {m['kernel_path']}, {m['threads']} threads, "
          f"read bandwidth {m['read_gbps']:.1f} GB/s; medians of {m['rounds']} alternating round(s); "
          f"other processes used up to {max(others or [0]):.2f} cores during a counted run")
    print()
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(bench.main(["--scale", *sys.argv[1:]]))
