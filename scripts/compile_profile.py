"""Where a first run's compile time goes: each kernel group compiled alone on an empty cache.

A first run on an empty kernel cache waits for the groups of `localllm.runtime.warm`
(attention, the row operations, the repacking kernels, one matmul per weight format), which
worker processes compile. This script compiles each group as a worker would (one thread, a
fresh process, its own empty cache) and reports the group's seconds, the share of them spent
in LLVM (optimising and generating machine code) and the Numba functions compiled, each with
its exclusive seconds (its own typing, lowering and LLVM work) and inclusive ones (with the
functions it called that were compiled for it).

Usage:
    python scripts/compile_profile.py [GROUP ...] [--model FILE.gguf] [--top N] [--json]

    GROUP: attention, ops, pack, matmul:Q4_K, ... (default: those of --model, else
    attention, ops, pack, matmul:Q4_K, matmul:Q6_K).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

DEFAULT_GROUPS = ["attention", "ops", "pack", "matmul:Q4_K", "matmul:Q6_K"]


def profile_group(job: str) -> dict:
    """Compile one group in this process (its kernel cache empty) and time what compiled."""
    from numba.core import event

    compiled: list[dict] = []
    stack: list[list] = []

    class Compiles(event.Listener):
        def on_start(self, ev):
            disp = ev.data["dispatcher"]
            name = f"{disp.py_func.__module__}.{disp.py_func.__qualname__}"
            args = ", ".join(str(a) for a in ev.data["args"])
            stack.append([name, args, time.perf_counter(), 0.0])

        def on_end(self, ev):
            name, args, t0, inner = stack.pop()
            total = time.perf_counter() - t0
            if stack:
                stack[-1][3] += total
            compiled.append({"name": name, "args": args, "exclusive": total - inner,
                             "inclusive": total})

    class Llvm(event.Listener):
        """Seconds holding Numba's LLVM lock, outermost acquisitions only."""
        depth, start, seconds = 0, 0.0, 0.0

        def on_start(self, ev):
            if self.depth == 0:
                self.start = time.perf_counter()
            self.depth += 1

        def on_end(self, ev):
            self.depth -= 1
            if self.depth == 0:
                self.seconds += time.perf_counter() - self.start

    llvm = Llvm()
    event.register("numba:compile", Compiles())
    event.register("numba:llvm_lock", llvm)
    from localllm.runtime import warm
    from localllm.runtime.process import configure_process
    configure_process(threads=1)
    t = time.perf_counter()
    warm.run_job(job)
    seconds = time.perf_counter() - t
    compiled.sort(key=lambda r: -r["exclusive"])
    return {"group": job, "seconds": seconds, "llvm_seconds": llvm.seconds,
            "compiled": compiled}


def run_child(job: str) -> dict:
    """``profile_group`` in a fresh process on a fresh empty kernel cache."""
    with tempfile.TemporaryDirectory(prefix="compile-profile-") as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "NUMBA_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", job],
                             env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"group {job} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(results: list[dict], top: int) -> str:
    lines = []
    for r in results:
        share = r["llvm_seconds"] / r["seconds"] if r["seconds"] else 0.0
        lines.append(f"{r['group']}: {r['seconds']:.1f} s, LLVM {r['llvm_seconds']:.1f} s "
                     f"({share:.0%}), {len(r['compiled'])} functions compiled")
        for c in r["compiled"][:top]:
            lines.append(f"  {c['exclusive']:6.2f} {c['inclusive']:6.2f}  {c['name']}")
    total = sum(r["seconds"] for r in results)
    lines.append(f"all groups: {total:.1f} s of compiling on one core "
                 f"({total / 2:.1f} s at best on two workers)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("groups", nargs="*", help="kernel groups (see localllm.runtime.warm)")
    ap.add_argument("--model", help="take the groups a first run of this GGUF file waits for")
    ap.add_argument("--top", type=int, default=8, help="functions listed per group")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(profile_group(args.child)))
        return 0
    if not args.groups and args.model:
        from localllm.runtime.warm import model_jobs
        args.groups = model_jobs(args.model)
    groups = args.groups or DEFAULT_GROUPS
    results = [run_child(g) for g in groups]
    print(json.dumps(results, indent=1) if args.json else report(results, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
