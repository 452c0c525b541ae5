"""Time the JSON constraint on the real vocabularies: building the token vocabulary, a full
mask in typical states (cold: transitions never seen; warm: seen before, cache of masks
cleared), one-token checks and advances, on an otherwise idle machine:

    python scripts/bench_constrain.py [--repeat N] [MODEL ...]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from localllm import configure_process
from localllm.generation.constrain import TokenConstraint, TokenVocab
from localllm.formats.fetch import fetch
from localllm.formats.gguf import GGUFFile
from localllm.text.tokenizer import Tokenizer

LIMITED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}},
           "required": ["name"], "additionalProperties": False}
STATES = [  # (label, schema or None for json_object, text so far)
    ("object start", None, ""),
    ("value start", None, '{"name": '),
    ("inside a string", None, '{"name": "Al'),
    ("after a number", None, '{"name": "Al", "age": 12'),
    ("string, maxLength 40", LIMITED, '{"name": "Al'),
]


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def best_ms(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def constraint_at(schema, text, tok, vocab) -> TokenConstraint:
    c = TokenConstraint.json_object(vocab) if schema is None else TokenConstraint.json_schema(schema, vocab)
    for t in tok.encode(text, add_special=False):
        c.advance(t)
    return c


def bench(name: str, repeat: int) -> None:
    tok = Tokenizer.from_metadata(GGUFFile(fetch(name, quiet=True)).metadata)
    t0 = time.perf_counter()
    vocab = TokenVocab.from_tokenizer(tok)
    build = time.perf_counter() - t0
    print(f"\n{name}: {vocab.size} tokens, trie of {vocab.trie.byte.size} nodes, "
          f"vocabulary built in {build * 1e3:.0f} ms")
    print(f"  {'state':24} {'cold ms':>8} {'warm ms':>8} {'allowed':>8}")
    for label, schema, text in STATES:
        c = constraint_at(schema, text, tok, vocab)
        t0 = time.perf_counter()
        mask = c.mask()
        cold = (time.perf_counter() - t0) * 1e3

        def warm():
            c._sh.masks.clear()
            c.mask()
        w = best_ms(warm, repeat)
        print(f"  {label:24} {cold:8.2f} {w:8.2f} {int(mask.sum()):8d}")
    c = constraint_at(None, '{"name": "Al', tok, vocab)
    ids = np.flatnonzero(c.mask())[:2000]
    per = best_ms(lambda: [c.allowed(int(t)) for t in ids], repeat) / ids.size * 1e3
    print(f"  allowed(): {per:.1f} us per token (from the allowed set of a string)")
    seq = tok.encode('{"name": "Alice", "age": 12, "tags": ["a", "b"]}', add_special=False)
    fresh = TokenConstraint.json_object(vocab)

    def advance_all():
        d = fresh.copy()
        for t in seq:
            d.advance(t)
    per = best_ms(advance_all, repeat) / len(seq) * 1e3
    print(f"  advance(): {per:.1f} us per token (a {len(seq)}-token object)")
    for label, schema in (("json_object", None), ("one-property schema", LIMITED)):
        ms = best_ms(lambda: constraint_at(schema, "", tok, vocab), repeat)
        print(f"  building the {label} constraint: {ms:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("models", nargs="*", default=["smollm2-135m", "gemma3-270m"])
    args = ap.parse_args()
    configure_process()  # the walker's kernel cache
    print(f"CPU: {cpu_name()}; one thread (the walker is sequential Numba code)")
    for name in args.models:
        bench(name, args.repeat)


if __name__ == "__main__":
    main()
