"""The fused repack kernels of `localllm.kernels.packing` against the slow numpy reference
(`localllm.testing.packing_reference`), byte for byte, on random blocks of every format."""

import zlib

import numpy as np
import pytest

from localllm.formats import quants as Q
from localllm.kernels import packing as P
from localllm.testing.packing_reference import pack_weight_reference

FORMATS = sorted(Q.SUPPORTED_TYPES)
# Row counts: one tile, a padded last tile, and slabs crossing the _ROW_STEP boundary
# (with and without a padded tail).
SHAPES = [(16, 256), (37, 512), (P._ROW_STEP + 16, 256), (P._ROW_STEP + 5, 256)]


def _raw(name: str, N: int, K: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=N * Q.row_nbytes(name, K), dtype=np.uint8)


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("name", FORMATS)
def test_pack_weight_matches_reference(name, N, K):
    raw = _raw(name, N, K, seed=zlib.crc32(f"{name}/{N}/{K}".encode()))
    got = P.pack_weight(name, raw, N, K)
    want = pack_weight_reference(name, raw, N, K)
    assert type(got) is type(want)
    for field in want._fields:
        a, e = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
        assert a.dtype == np.uint8 and a.shape == e.shape, field
        bad = np.flatnonzero(a != e)
        assert bad.size == 0, f"{name} {field}: {bad.size} bytes differ, first at {bad[0]}"


def test_reference_is_not_trivial():
    """Changing one weight byte changes the packed result (the comparison can fail)."""
    raw = _raw("Q4_K", 16, 256, seed=3)
    a = P.pack_weight("Q4_K", raw, 16, 256)
    raw[200] ^= 0x11
    b = pack_weight_reference("Q4_K", raw, 16, 256)
    assert not np.array_equal(a.qs, b.qs)


@pytest.mark.parametrize("name", ["Q4_0", "Q6_K", "F16"])
def test_done_reports_consumed_ranges(name):
    N, K = 2 * P._ROW_STEP + 7, 256
    row = Q.row_nbytes(name, K)
    ranges = []
    P.pack_weight(name, _raw(name, N, K, seed=1), N, K, done=lambda a, b: ranges.append((a, b)))
    step = P._ROW_STEP * row
    assert ranges == [(0, step), (step, 2 * step), (2 * step, N * row)]


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="multiple of 256"):
        P.pack_weight("Q4_K", np.zeros(16 * 144 // 2, np.uint8), 16, 128)
    with pytest.raises(ValueError, match="not supported"):
        P.pack_weight("Q1_0", np.zeros(16, np.uint8), 1, 32)
