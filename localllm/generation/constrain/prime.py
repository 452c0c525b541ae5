"""Compiling the constrained-decoding kernels ahead of the first request that needs them.

A grammar's kernels (kernels/grammar.py) are compiled, or loaded from the kernel cache, the
first time any constraint runs: a server that waited for its first ``response_format`` or
``grammar`` request would make that request wait for the compiler. ``prime_kernels`` runs
every kernel a constraint uses on a toy vocabulary, so a model's load can do it first (in a
compile worker, see runtime/warm.py, and then in the serving process itself).
"""

from __future__ import annotations

from .constraint import TokenConstraint
from .vocab import TokenVocab

#: The warm-up job that compiles these kernels in a worker (runtime/warm.py's ``call:``).
WARM_JOB = "call:localllm.generation.constrain.prime:prime_kernels"

_PIECES = [b"{", b"}", b'"', b"a", b":", b"1", b",", b" ", b"true", b"[", b"]", b"</s>"]


def prime_kernels() -> None:
    """Run each kind of constraint (JSON object, JSON Schema, GBNF) a few steps on a toy
    vocabulary: this compiles the grammar kernels, or loads them from the kernel cache."""
    vocab = TokenVocab.from_pieces(_PIECES, eog=[len(_PIECES) - 1])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for c, steps in ((TokenConstraint.json_object(vocab), (0, 2, 3, 2, 4)),
                     (TokenConstraint.json_schema(schema, vocab), (0, 2, 3)),
                     (TokenConstraint.gbnf('root ::= "a" [0-9]+ ("," [a-z])*', vocab), (3, 5))):
        for t in steps:
            c.mask()
            c.advance(t)
        c.mask()
