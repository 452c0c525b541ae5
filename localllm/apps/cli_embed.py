"""`llm embed MODEL -f FILE`: one embedding per input line, printed as one JSON array per line
(the vectors of llama.cpp's embedding tool, pooled and normalised as Model.embed does)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

POOLINGS = ("none", "mean", "cls", "last", "rank")


def add_embed_parser(sub, add_model_options: Callable[[argparse.ArgumentParser], None]) -> None:
    """The `embed` subcommand's arguments.

    Args:
        sub: the subparsers of `llm`; add_model_options: adds the shared model options.
    """
    p = sub.add_parser("embed", help="embeddings of texts, one JSON vector per line")
    p.add_argument("model", nargs="?", default=None, help="GGUF path or known model name")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-f", "--file", help="texts, one per line ('-': standard input)")
    src.add_argument("-p", "--prompt", action="append", default=None,
                     help="a text to embed (repeatable)")
    p.add_argument("--pooling", choices=POOLINGS, default=None,
                   help="how token states become one vector (default: the file's, else mean "
                        "for encoders and last for decoders)")
    p.add_argument("--no-normalize", action="store_true", help="raw vectors, not unit length")
    add_model_options(p)


def read_texts(args) -> list[str]:
    """The texts to embed: -p texts, or the non-empty lines of -f FILE (or standard input)."""
    if args.prompt:
        return list(args.prompt)
    if args.file and args.file != "-":
        with open(args.file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    elif args.file == "-" or not sys.stdin.isatty():
        lines = sys.stdin.read().splitlines()
    else:
        raise ValueError("no input: give -f FILE (one text per line), -p TEXT, or pipe text")
    texts = [line for line in lines if line.strip()]
    if not texts:
        raise ValueError("no input: the file has no non-empty lines")
    return texts


def cmd_embed(args, settings: dict) -> int:
    """Run `llm embed`.

    Args:
        args: the parsed arguments; settings: LoadSettings fields from the model options.
    Returns:
        The exit status.
    """
    from localllm.api import load
    texts = read_texts(args)
    model = load(args.model, **settings)
    try:
        vectors = model.embed(texts, pooling=args.pooling, normalize=not args.no_normalize)
    finally:
        model.close()
    out = sys.stdout
    for v in vectors:
        out.write(json.dumps(v.tolist()) + "\n")
    out.flush()
    return 0
