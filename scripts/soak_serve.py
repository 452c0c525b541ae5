#!/usr/bin/env python3
"""Soak of `llm serve` on loopback, bounded in count and time: concurrent clients send chat
and completion requests, streaming and not, and cut a share of the streams off mid-way.
Afterwards the server's RSS must be within a bound of its start, the KV blocks in use back
at their baseline, and every completed response whole.

    python scripts/soak_serve.py smollm2-135m --requests 300 --clients 6
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Tally:
    whole: int = 0
    cut: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, error: str | None = None) -> None:
        with self.lock:
            if error is not None:
                self.errors.append(error)
            elif kind == "cut":
                self.cut += 1
            else:
                self.whole += 1


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def one(c: httpx.Client, rng: random.Random, i: int, cut_share: float) -> tuple[str, str | None]:
    """One request; returns ('whole' | 'cut', an error or None)."""
    chat = rng.random() < 0.5
    streaming = rng.random() < 0.6
    tokens = rng.randrange(1, 40)
    body = {"max_tokens": tokens, "seed": i, "stream": streaming,
            "temperature": rng.choice([0, 0.8])}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Tell me fact {i}."}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = f"Fact {i}:"
        path = "/v1/completions"
    if not streaming:
        r = c.post(path, json=body)
        if r.status_code != 200:
            return "whole", f"{r.status_code} {r.text[:120]}"
        ch = r.json()["choices"][0]
        if ch["finish_reason"] not in ("stop", "length") or \
                r.json()["usage"]["completion_tokens"] > tokens:
            return "whole", f"incomplete response: {r.text[:120]}"
        return "whole", None
    cut = rng.randrange(1, 20) if rng.random() < cut_share else None
    events = []
    with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return "whole", f"{r.status_code}"
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if cut is not None and len(events) == cut:
                    return "cut", None
    if events[-1] != "[DONE]":
        return "whole", "a stream without [DONE]"
    last = next(json.loads(e) for e in reversed(events[:-1]) if json.loads(e)["choices"])
    if last["choices"][0]["finish_reason"] not in ("stop", "length"):
        return "whole", "a stream without a finish reason"
    return "whole", None


def run_round(server, args, requests: int, tally: Tally) -> None:
    """``requests`` requests from ``args.clients`` concurrent clients (within the time limit)."""
    deadline = time.monotonic() + args.time_limit
    counter = iter(range(requests))
    counter_lock = threading.Lock()

    def client(k: int) -> None:
        rng = random.Random(k * 7919 + requests)
        with server.client() as c:
            while time.monotonic() < deadline:
                with counter_lock:
                    i = next(counter, None)
                if i is None:
                    return
                try:
                    kind, err = one(c, rng, i, args.cut_share)
                except Exception as e:  # noqa: BLE001 - counted as an error
                    kind, err = "whole", f"{type(e).__name__}: {e}"
                tally.add(kind, err)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=300, help="requests before the baseline")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cut-share", type=float, default=0.3, help="streams cut off mid-way")
    ap.add_argument("--time-limit", type=float, default=600, help="seconds at most")
    ap.add_argument("--rss-bound-mb", type=float, default=32)
    args = ap.parse_args(argv)

    from localllm.testing.server_process import ServerProcess
    server = ServerProcess(args.model, "-c", "2048", "-t", str(args.threads), "--parallel",
                           str(args.parallel), "--max-queue", str(args.clients * 2))
    try:
        server.wait_ready()
        # A first round touches what is allocated lazily (the KV pool's pages, compiled
        # kernels for each batch shape) before RSS and blocks are read as the baseline.
        run_round(server, args, args.warmup, Tally())
        time.sleep(0.5)
        rss0, m0 = rss_mb(server.proc.pid), server.metrics()
        tally = Tally()
        t0 = time.perf_counter()
        run_round(server, args, args.requests, tally)
        wall = time.perf_counter() - t0
        settle = time.monotonic() + 30
        while True:
            m1 = server.metrics()
            idle = m1["localllm_requests_running"] == m1["localllm_requests_waiting"] == 0
            if idle and m1["localllm_kv_blocks_used"] == m0["localllm_kv_blocks_used"] \
                    or time.monotonic() > settle:
                break
            time.sleep(0.1)
        rss1 = rss_mb(server.proc.pid)
    finally:
        server.stop()
    import localllm
    ISA = localllm.configure_process().isa  # what this host's kernels compile for
    from bench import _cpu_name
    done = tally.whole + tally.cut + len(tally.errors)
    print(f"{_cpu_name()}, kernels {ISA}, {args.threads} threads, {args.model}, "
          f"--parallel {args.parallel}, {args.clients} clients")
    print(f"requests {done} in {wall:.0f} s after {args.warmup} to warm up: {tally.whole} whole, {tally.cut} cut off "
          f"mid-stream, {len(tally.errors)} errors")
    print(f"RSS {rss0:.0f} MB -> {rss1:.0f} MB; KV blocks used "
          f"{m0['localllm_kv_blocks_used']:.0f} -> {m1['localllm_kv_blocks_used']:.0f} "
          f"(free {m0['localllm_kv_blocks_free']:.0f} -> {m1['localllm_kv_blocks_free']:.0f})")
    for e in tally.errors[:10]:
        print("  error:", e)
    ok = (not tally.errors and done == args.requests and rss1 - rss0 <= args.rss_bound_mb
          and m1["localllm_kv_blocks_used"] == m0["localllm_kv_blocks_used"])
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
