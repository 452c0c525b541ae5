#!/usr/bin/env python3
"""Benchmark of `llm serve` as a client sees it (a benchmark, not a test): the time to first
token and tok/s of one streaming request, a second turn's time to first token against the
first's, and the aggregate tok/s of 4 concurrent streams against one.

    python scripts/bench_serve.py smollm2-135m --threads 2
    python scripts/bench_serve.py --url http://127.0.0.1:8080 --api-key KEY
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent

# A long-ish system prompt, so that the first turn's prompt processing is visible.
SYSTEM = ("You are a careful assistant. " * 40).strip()


def stream(client: httpx.Client, messages: list[dict], max_tokens: int) -> dict:
    """One streaming chat request: client-side time to first token, decode rate, usage."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    text, usage = [], None
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                if c["delta"].get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(c["delta"]["content"])
    n = usage["completion_tokens"]
    return {"ttft_s": first - t0, "tok_s": (n - 1) / (last - first) if n > 1 else 0.0,
            "wall_s": last - t0, "tokens": n, "text": "".join(text),
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "prompt_tokens": usage["prompt_tokens"]}


def one_stream(client, tokens: int, reps: int) -> dict:
    runs = [stream(client, [{"role": "user", "content": f"Tell a story, number {i}."}], tokens)
            for i in range(reps)]
    return {"ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "tok_s": statistics.median(r["tok_s"] for r in runs)}


def second_turn(client, reps: int) -> dict:
    """The same conversation's second turn: its prompt starts with the first turn's, whose
    KV the prefix cache holds."""
    firsts, seconds, cached = [], [], []
    for i in range(reps):
        turn1 = [{"role": "system", "content": f"Session {i}. {SYSTEM}"},
                 {"role": "user", "content": "Name three rivers."}]
        a = stream(client, turn1, 24)
        turn2 = turn1 + [{"role": "assistant", "content": a["text"]},
                         {"role": "user", "content": "And three mountains?"}]
        b = stream(client, turn2, 8)
        firsts.append(a["ttft_s"])
        seconds.append(b["ttft_s"])
        cached.append((b["cached_tokens"], b["prompt_tokens"]))
    return {"first_ttft_s": statistics.median(firsts), "second_ttft_s": statistics.median(seconds),
            "second_cached_tokens": cached[-1][0], "second_prompt_tokens": cached[-1][1]}


def concurrent(client_factory, streams: int, tokens: int) -> dict:
    """``streams`` requests at once; aggregate generated tokens over the wall time."""
    results: list[dict] = []

    def run(i):
        with client_factory() as c:
            results.append(stream(c, [{"role": "user", "content": f"Story {i}, please."}],
                                  tokens))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"streams": streams, "aggregate_tok_s": sum(r["tokens"] for r in results) / wall,
            "wall_s": wall}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--url", help="bench a running server instead of starting one")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parallel", type=int, default=4, help="--parallel of the started server")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    server = None
    url = args.url
    if url is None:
        from localllm.testing.server_process import ServerProcess
        server = ServerProcess(args.model, "-c", "2048", "-t", str(args.threads),
                               "--parallel", str(args.parallel), api_key=args.api_key)
        server.wait_ready()
        url = server.url
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def client():
        return httpx.Client(base_url=url, headers=headers, timeout=600)

    try:
        with client() as c:
            stream(c, [{"role": "user", "content": "Warm up."}], 8)
            out = {"one_stream": one_stream(c, args.tokens, args.reps),
                   "second_turn": second_turn(c, args.reps)}
        out["one"] = concurrent(client, 1, args.tokens)
        out["four"] = concurrent(client, 4, args.tokens)
    finally:
        if server is not None:
            server.stop()
    import localllm
    ISA = localllm.configure_process().isa  # what this host's kernels compile for
    from bench import _cpu_name
    out["machine"] = {"cpu": _cpu_name(), "isa": ISA, "threads": args.threads,
                      "model": args.model, "url": args.url}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    o, t = out["one_stream"], out["second_turn"]
    print(f"{out['machine']['cpu']}, kernels {ISA}, {args.threads} threads, {args.model}")
    print(f"one stream: time to first token {o['ttft_s'] * 1000:.0f} ms, "
          f"{o['tok_s']:.1f} tok/s ({args.tokens} tokens, median of {args.reps})")
    print(f"second turn: time to first token {t['second_ttft_s'] * 1000:.0f} ms against "
          f"{t['first_ttft_s'] * 1000:.0f} ms for the first "
          f"({t['second_cached_tokens']} of {t['second_prompt_tokens']} prompt tokens cached)")
    ratio = out["four"]["aggregate_tok_s"] / out["one"]["aggregate_tok_s"]
    print(f"4 concurrent streams: {out['four']['aggregate_tok_s']:.1f} tok/s aggregate against "
          f"{out['one']['aggregate_tok_s']:.1f} for one ({ratio:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
