"""Constrained generation: grammars over characters, JSON Schema compiled to them, and the
token-level constraint a sampler consults (see TokenConstraint)."""

from .constraint import TokenConstraint
from .grammar import GrammarError
from .vocab import TokenVocab

__all__ = ["TokenConstraint", "TokenVocab", "GrammarError"]
