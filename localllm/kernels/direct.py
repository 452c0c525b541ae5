"""Calls of a compiled kernel that skip Numba's per-call dispatch.

A Numba dispatcher finds the compiled version for every call anew: it fingerprints each
argument (every array inside every tuple), maps that to Numba types and looks the signature
up. For the fused decoder block, whose two named tuples hold some twenty arrays, that costs
about 8 us a call (AMD EPYC Zen 5): a tenth of a SmolLM2-135M decode step at short context.

``DirectCall`` remembers the compiled entry point per key, and calls it straight. The caller
names the key: it must change whenever the Numba type of any argument could (a fingerprint,
see ``fingerprint``, of the arguments that vary between calls, plus the identity of those
that do not). A key seen for the first time goes through the dispatcher, which compiles
what is missing and checks the arguments as usual.
"""

from __future__ import annotations

from numba._dispatcher import compute_fingerprint as fingerprint  # noqa: F401 (for callers)


class DirectCall:
    """A Numba dispatcher's compiled versions, called by caller-chosen key."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self._entries: dict = {}

    def __call__(self, key, *args):
        entry = self._entries.get(key)
        if entry is not None:
            return entry(*args)
        out = self.dispatcher(*args)
        self._entries[key] = self._resolve(args)
        return out

    def _resolve(self, args):
        """The entry point the dispatcher used for these arguments, or the dispatcher itself
        when it picked a version by conversion (then no exact signature is stored)."""
        d = self.dispatcher
        sig = tuple(d.typeof_pyval(a) for a in args)
        cres = d.overloads.get(sig)
        return d if cres is None else cres.entry_point
