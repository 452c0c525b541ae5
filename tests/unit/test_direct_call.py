"""kernels/direct.py: calls by compiled entry point give the dispatcher's results, and a key
seen for the first time goes through the dispatcher (which compiles and checks)."""

from collections import namedtuple

import numpy as np
import pytest
from numba import njit

from localllm.kernels.direct import DirectCall, fingerprint

Pair = namedtuple("Pair", ["a", "b"])


@njit(cache=True)
def _scaled_sum(p, k):
    out = 0.0
    for i in range(p.a.size):
        out += p.a[i] * p.b[i]
    return out * k


def _key(p):
    return fingerprint((p.a, p.b))


def test_entry_point_gives_the_dispatchers_result():
    call = DirectCall(_scaled_sum)
    p = Pair(np.arange(5, dtype=np.float32), np.ones(5, np.float32))
    assert call(_key(p), p, 2.0) == _scaled_sum(p, 2.0) == 20.0
    entry = call._entries[_key(p)]
    assert entry is not _scaled_sum  # the compiled entry point, not the dispatcher
    q = Pair(np.full(3, 2.0, np.float32), np.full(3, 3.0, np.float32))
    assert call(_key(q), q, 0.5) == 9.0  # same types: same entry, new values
    assert call._entries[_key(q)] is entry


def test_new_types_take_a_new_key_through_the_dispatcher():
    call = DirectCall(_scaled_sum)
    p32 = Pair(np.ones(4, np.float32), np.ones(4, np.float32))
    p64 = Pair(np.ones(4, np.float64), np.ones(4, np.float64))
    assert _key(p32) != _key(p64)
    assert call(_key(p32), p32, 1.0) == 4.0
    assert call(_key(p64), p64, 1.0) == 4.0
    assert call._entries[_key(p32)] is not call._entries[_key(p64)]
    ro = np.ones(4, np.float32)
    ro.setflags(write=False)
    assert _key(Pair(ro, ro)) != _key(p32)  # read-only arrays are another Numba type


def test_bad_arguments_still_raise_on_a_new_key():
    call = DirectCall(_scaled_sum)
    with pytest.raises(Exception):
        call(("strings",), Pair("x", "y"), 1.0)
    assert ("strings",) not in call._entries
