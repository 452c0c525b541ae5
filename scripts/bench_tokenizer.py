#!/usr/bin/env python3
"""Tokenizer encoding time on hostile inputs: one character repeated to a megabyte, a text
of every special token, mixed text; per model, with the ratio to a tenth of the size (10 is
linear, 100 quadratic). The tokenizer is pure Python: no kernel path is involved.

    python scripts/bench_tokenizer.py                  # both known models, 1 MiB inputs
    python scripts/bench_tokenizer.py model.gguf --size 262144
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

import bench  # noqa: E402  (the machine description shared with the other benchmarks)
from localllm.testing import fixture_texts  # noqa: E402

from localllm.formats.fetch import resolve_model_path  # noqa: E402
from localllm.formats.gguf import GGUFFile  # noqa: E402
from localllm.text.tokenizer import ATTR_CONTROL, ATTR_USER_DEFINED, Tokenizer  # noqa: E402

CHARS = ["a", " ", "\n", "1", "<", "é", "中", "🙂", "\u2581", "\x00", "ab", "a "]


def inputs(tok: Tokenizer, size: int) -> dict[str, str]:
    special = "x".join(tok.token_text(i) for i in range(tok.vocab_size)
                       if tok.token_attr(i) & (ATTR_CONTROL | ATTR_USER_DEFINED))
    corpus = fixture_texts.corpus()
    rng = random.Random(0)
    mixed = "".join(rng.choice(corpus) + " " for _ in range(size // 20))
    out = {f"{ch!r} repeated": (ch * size)[:size] for ch in CHARS}
    out["every special token"] = (special * (size // max(1, len(special)) + 1))[:size]
    out["mixed corpus text"] = (mixed * (size // max(1, len(mixed)) + 1))[:size]
    return out


def timed(tok: Tokenizer, text: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    ids = tok.encode(text, parse_special=True)
    return time.perf_counter() - t0, len(ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--size", type=int, default=1 << 20, help="characters per input")
    args = ap.parse_args(argv)
    print(f"CPU: {bench._cpu_name()}; Python {platform.python_version()}; "
          f"inputs of {args.size} characters, parse_special on")
    for name in args.models:
        path = resolve_model_path(name)
        with GGUFFile(path) as f:
            tok = Tokenizer.from_metadata(f.metadata)
        print(f"\n{Path(path).name}")
        print(f"  {'input':24} {'ids':>9} {'seconds':>8} {'vs 1/10 size':>13}")
        for label, text in inputs(tok, args.size).items():
            small, _ = timed(tok, text[: len(text) // 10])
            seconds, n = timed(tok, text)
            print(f"  {label:24} {n:9d} {seconds:8.2f} {seconds / max(small, 1e-6):12.1f}x",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
