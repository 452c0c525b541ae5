"""The GGML format table and the numpy reference dequantizers, held bit-exact to
`gguf.quants.dequantize` on random blocks, gguf-quantized data and the real models."""

import warnings

import gguf
import gguf.quants
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.formats import dequant as D
from localllm.formats import quants as Q
from localllm.formats.gguf import GGUFFile

# Byte offsets of the f16 fields (d, m / dmin) in each block, from ggml-common.h's
# block_* structs; written out here so the tests do not lean on Q.BLOCK_LAYOUT.
F16_OFFSETS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ4_NL": [0], "IQ4_XS": [0], "MXFP4": [],
}
# MXFP4's scale is one E8M0 byte (offset 0): a power of two, kept to a sane range here.
E8M0_OFFSETS = {"MXFP4": 0}
QUANT_TYPES = sorted(F16_OFFSETS)
FLOAT_TYPES = ["F32", "F16", "BF16"]
GGUF_QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4", "F16", "BF16"]
DEQUANT_FN = {name: getattr(D, "dequant_" + name.lower()) for name in Q.SUPPORTED_TYPES}


def assert_bits_equal(actual, expected):
    assert actual.dtype == np.float32 and expected.dtype == np.float32
    assert actual.shape == expected.shape
    a, e = actual.view(np.uint32), expected.view(np.uint32)
    bad = np.flatnonzero(a != e)
    assert bad.size == 0, (
        f"{bad.size} of {a.size} values differ; first at {bad[0]}: "
        f"{actual.flat[bad[0]]!r} != {expected.flat[bad[0]]!r}")


def gguf_dequant(data: np.ndarray, name: str) -> np.ndarray:
    return np.asarray(gguf.quants.dequantize(data, GGMLQuantizationType[name]), dtype=np.float32)


def random_blocks(name: str, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of whole blocks; f16/bf16/f32 values made finite and of sane size."""
    if name in FLOAT_TYPES:
        x = (rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-6, 4, n_blocks)).astype(np.float32)
        if name == "F32":
            return x.view(np.uint8).reshape(n_blocks, 4)
        if name == "F16":
            return x.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, 2)
    blocks = rng.integers(0, 256, (n_blocks, Q.type_size(name)), dtype=np.uint8)
    for off in F16_OFFSETS[name]:
        scale = (rng.standard_normal((n_blocks, 1)) * 10.0 ** rng.integers(-5, 1, (n_blocks, 1)))
        blocks[:, off:off + 2] = scale.astype(np.float16).view(np.uint8)
    if name in E8M0_OFFSETS:
        blocks[:, E8M0_OFFSETS[name]] = rng.integers(110, 131, n_blocks, dtype=np.uint8)
    return blocks


# ---------------------------------------------------------------------------- random blocks

@pytest.mark.parametrize("name", sorted(Q.SUPPORTED_TYPES))
def test_random_blocks_bit_exact(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    n_blocks = 300
    blocks = random_blocks(name, n_blocks, rng)
    expected = gguf_dequant(blocks, name).reshape(n_blocks, -1)
    per_format = DEQUANT_FN[name](blocks)
    assert per_format.shape == (n_blocks, Q.block_size(name))
    assert_bits_equal(per_format, expected)
    # Through the dispatcher, as 3 rows of 100 blocks.
    shape = (3, 100 * Q.block_size(name))
    assert_bits_equal(D.dequantize(blocks, name, shape), expected.reshape(shape))
    assert np.isfinite(expected).all() and np.count_nonzero(expected) > expected.size // 2


@pytest.mark.parametrize("name", GGUF_QUANTIZABLE)
def test_gguf_quantized_bit_exact(name):
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((6, 512)) * np.logspace(-2, 1, 6)[:, None]).astype(np.float32)
    x[0, :64] = 0.0  # all-zero blocks: d == 0
    packed = np.asarray(gguf.quants.quantize(x, GGMLQuantizationType[name]))
    data = np.ascontiguousarray(packed).view(np.uint8)
    out = D.dequantize(data, name, x.shape)
    assert_bits_equal(out, gguf_dequant(packed, name).reshape(x.shape))
    # And the values are the ones quantized, to the format's precision.
    step = {"F16": 1e-3, "BF16": 1e-2, "Q8_0": 1e-2, "MXFP4": 0.3}.get(name, 0.15)
    assert np.all(np.abs(out - x) <= step * np.abs(x).max(axis=1, keepdims=True))


def test_dispatcher_chunks_large_tensors():
    # More blocks than one dequantization step, so the chunk boundaries are exercised.
    rng = np.random.default_rng(3)
    n_blocks = (1 << 14) * 2 + 5
    blocks = random_blocks("Q4_0", n_blocks, rng)
    shape = (n_blocks, 32)
    assert_bits_equal(D.dequantize(blocks, "Q4_0", shape), gguf_dequant(blocks, "Q4_0"))


# ---------------------------------------------------------------------------- the tests can fail

@pytest.mark.parametrize("name", QUANT_TYPES)
def test_every_byte_matters(name):
    """Flip one bit of each non-scale byte in the odd blocks: they change, the even ones
    do not, and gguf still agrees bit for bit, so a misread byte cannot go unseen."""
    rng = np.random.default_rng(11)
    blocks = random_blocks(name, 32, rng)
    base = DEQUANT_FN[name](blocks)
    scale_bytes = {o + k for o in F16_OFFSETS[name] for k in (0, 1)}
    for j in range(Q.type_size(name)):
        if j in scale_bytes:
            continue
        flipped = blocks.copy()
        flipped[1::2, j] ^= np.uint8(1 << (j % 8))
        out = DEQUANT_FN[name](flipped)
        assert_bits_equal(out, gguf_dequant(flipped, name))
        assert_bits_equal(out[0::2], base[0::2])
        # A single block can mask a flip (a zero sub-block scale); sixteen cannot.
        assert not np.array_equal(out[1::2], base[1::2]), f"byte {j} is ignored"


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_bit_comparison_detects_one_ulp(name):
    blocks = random_blocks(name, 4, np.random.default_rng(5))
    out = DEQUANT_FN[name](blocks)
    nudged = out.copy()
    nudged[2, 3] = np.nextafter(nudged[2, 3], np.float32(np.inf))
    with pytest.raises(AssertionError):
        assert_bits_equal(nudged, gguf_dequant(blocks, name).reshape(out.shape))


@pytest.mark.parametrize("name", QUANT_TYPES)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_nonfinite_scales_do_not_crash(name, bad):
    rng = np.random.default_rng(9)
    blocks = random_blocks(name, 8, rng)
    for k, off in enumerate(F16_OFFSETS[name]):
        blocks[k::2, off:off + 2] = np.array([bad], dtype=np.float16).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = D.dequantize(blocks, name, (8 * Q.block_size(name),)).reshape(8, -1)
    with np.errstate(all="ignore"):
        expected = gguf_dequant(blocks, name).reshape(8, -1)
    # NaN payloads may differ between numpy's conversion paths; compare classes and values.
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    finite = ~np.isnan(expected)
    assert_bits_equal(out[finite], expected[finite])
    if len(F16_OFFSETS[name]) == 1:
        assert np.isfinite(out[1::2]).all()  # the untouched blocks


# ---------------------------------------------------------------------------- unpackers

def _reconstruct(name: str, b: np.ndarray) -> np.ndarray:
    """Weights rebuilt from the public unpackers, in the documented float order."""
    f32 = lambda a: np.asarray(a, dtype=np.float32)  # noqa: E731
    d = Q.half_field(b, name, "d") if F16_OFFSETS[name] else None
    if name == "Q4_0":
        return d * f32(Q.q4_0_quants(b))
    if name == "Q4_1":
        return d * f32(Q.q4_1_quants(b)) + Q.half_field(b, name, "m")
    if name == "Q5_0":
        return d * f32(Q.q5_0_quants(b))
    if name == "Q5_1":
        return d * f32(Q.q5_1_quants(b)) + Q.half_field(b, name, "m")
    if name == "Q8_0":
        return d * f32(Q.q8_0_quants(b))
    if name == "IQ4_NL":
        return d * f32(Q.IQ4NL_VALUES[Q.iq4nl_indices(b)])
    if name == "MXFP4":
        return Q.mxfp4_scales(b) * f32(Q.MXFP4_VALUES[Q.mxfp4_indices(b)])
    if name == "Q2_K":
        sc, m = Q.q2k_scales_mins(b)
        q, sc, mn = f32(Q.q2k_quants(b)), np.repeat(f32(sc), 16, 1), np.repeat(f32(m), 16, 1)
        return (d * sc) * q - Q.half_field(b, name, "dmin") * mn
    if name in ("Q4_K", "Q5_K"):
        sc, m = Q.kquant_scales_mins(b)
        q = f32(Q.q4k_quants(b) if name == "Q4_K" else Q.q5k_quants(b))
        sc, mn = np.repeat(f32(sc), 32, 1), np.repeat(f32(m), 32, 1)
        return (d * sc) * q - Q.half_field(b, name, "dmin") * mn
    if name == "Q3_K":
        return (d * np.repeat(f32(Q.q3k_scales(b)), 16, 1)) * f32(Q.q3k_quants(b))
    if name == "Q6_K":
        return (d * np.repeat(f32(Q.q6k_scales(b)), 16, 1)) * f32(Q.q6k_quants(b))
    if name == "IQ4_XS":
        v = f32(Q.IQ4NL_VALUES[Q.iq4xs_indices(b)])
        return (d * np.repeat(f32(Q.iq4xs_scales(b)), 32, 1)) * v
    raise AssertionError(f"no reconstruction for {name}")


@pytest.mark.parametrize("name", QUANT_TYPES)
def test_unpackers_rebuild_the_weights(name):
    blocks = random_blocks(name, 50, np.random.default_rng(13))
    assert_bits_equal(_reconstruct(name, blocks), gguf_dequant(blocks, name).reshape(50, -1))


@pytest.mark.parametrize("name, lo, hi", [
    ("q4_0_quants", -8, 7), ("q4_1_quants", 0, 15), ("q5_0_quants", -16, 15),
    ("q5_1_quants", 0, 31), ("q8_0_quants", -128, 127), ("q2k_quants", 0, 3),
    ("q3k_quants", -4, 3), ("q4k_quants", 0, 15), ("q5k_quants", 0, 31),
    ("q6k_quants", -32, 31), ("iq4nl_indices", 0, 15), ("iq4xs_indices", 0, 15),
    ("q3k_scales", -32, 31), ("q6k_scales", -128, 127), ("iq4xs_scales", -32, 31),
    ("mxfp4_indices", 0, 15),
])
def test_unpacker_ranges(name, lo, hi):
    fmt = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "q8_0": "Q8_0",
           "q2k": "Q2_K", "q3k": "Q3_K", "q4k": "Q4_K", "q5k": "Q5_K", "q6k": "Q6_K",
           "iq4nl": "IQ4_NL", "iq4xs": "IQ4_XS", "mxfp4": "MXFP4"}[name.rsplit("_", 1)[0]]
    blocks = random_blocks(fmt, 400, np.random.default_rng(17))
    q = getattr(Q, name)(blocks)
    assert q.dtype == (np.uint8 if lo == 0 else np.int8)
    # Random bytes reach every value of the range.
    assert q.min() == lo and q.max() == hi


def _kquant_scales_scalar(s: bytes) -> tuple[list[int], list[int]]:
    # get_scale_min_k4 of ggml-quants.c, one sub-block at a time.
    sc, mn = [], []
    for j in range(8):
        if j < 4:
            sc.append(s[j] & 63)
            mn.append(s[j + 4] & 63)
        else:
            sc.append((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4))
            mn.append((s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    return sc, mn


def _q3k_scales_scalar(s: bytes) -> list[int]:
    out = []
    for j in range(16):
        low = (s[j] & 0xF) if j < 8 else (s[j - 8] >> 4)
        high = (s[8 + j % 4] >> (2 * (j // 4))) & 3
        out.append((low | (high << 4)) - 32)
    return out


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
def test_kquant_scales_mins_match_scalar_unpacking(name):
    blocks = random_blocks(name, 64, np.random.default_rng(19))
    sc, m = Q.kquant_scales_mins(blocks)
    assert sc.dtype == m.dtype == np.uint8 and sc.shape == m.shape == (64, 8)
    for i in range(64):
        want_sc, want_m = _kquant_scales_scalar(bytes(blocks[i, 4:16]))
        assert sc[i].tolist() == want_sc and m[i].tolist() == want_m
    with pytest.raises(ValueError):
        Q.kquant_scales_mins(random_blocks("Q6_K", 2, np.random.default_rng(0)))


def test_q3k_scales_match_scalar_unpacking():
    blocks = random_blocks("Q3_K", 64, np.random.default_rng(23))
    sc = Q.q3k_scales(blocks)
    assert sc.dtype == np.int8 and sc.shape == (64, 16)
    for i in range(64):
        assert sc[i].tolist() == _q3k_scales_scalar(bytes(blocks[i, 96:108]))


def test_iq4nl_values():
    assert Q.IQ4NL_VALUES.dtype == np.int8 and Q.IQ4NL_VALUES.shape == (16,)
    assert Q.IQ4NL_VALUES.tolist() == list(gguf.quants.IQ4_NL.kvalues)
    assert np.all(np.diff(Q.IQ4NL_VALUES.astype(int)) > 0)
    with pytest.raises(ValueError):
        Q.IQ4NL_VALUES[0] = 0


def test_mxfp4_values():
    assert Q.MXFP4_VALUES.dtype == np.int8 and Q.MXFP4_VALUES.shape == (16,)
    assert Q.MXFP4_VALUES.tolist() == list(gguf.quants.MXFP4.kvalues)
    with pytest.raises(ValueError):
        Q.MXFP4_VALUES[0] = 0


def test_mxfp4_every_exponent_bit_exact():
    """All 256 E8M0 bytes (subnormal scales at 0 and 1, overflow to inf at the top), each
    with every code, against gguf's dequantizer bit for bit."""
    codes = np.arange(16, dtype=np.uint8)
    qs = np.tile(codes[:8] | (codes[8:] << 4), 2)            # each code twice per block
    blocks = np.empty((256, 17), np.uint8)
    blocks[:, 0] = np.arange(256)
    blocks[:, 1:] = qs
    with np.errstate(over="ignore"):
        want = gguf_dequant(blocks, "MXFP4").reshape(256, 32)
    got = D.dequant_mxfp4(blocks)
    assert_bits_equal(got, want)
    # The scale itself: 2**(e - 128), exactly (ldexp of a double is exact here).
    scales = Q.e8m0_half(np.arange(256, dtype=np.uint8))
    assert scales.tolist() == [np.ldexp(1.0, e - 128) for e in range(256)]
    # e = 127 scales the doubled codes by one half: element 7 holds code 7 (6.0), element
    # 23 the high nibble of byte 7, code 15 (-6.0), element 16 code 8 (-0.0).
    assert got[127, 7] == 6.0 and got[127, 23] == -6.0 and got[127, 16] == 0.0
    assert np.isinf(got[255]).sum() > 0 and not np.isnan(got).any()


def test_hand_built_blocks():
    # Q4_0 with d = 0.5 and nibble i = i % 16: element j < 16 is the low nibble of byte j.
    qs = np.array([(i % 16) | ((15 - i % 16) << 4) for i in range(16)], dtype=np.uint8)
    block = np.concatenate([np.array([0.5], np.float16).view(np.uint8), qs])[None]
    want = 0.5 * (np.r_[np.arange(16), 15 - np.arange(16)] - 8)
    np.testing.assert_array_equal(D.dequant_q4_0(block)[0], want.astype(np.float32))
    # Q5_0: qh bit j is element j's fifth bit.
    qh = np.array([0b1, 0, 0, 0b10000000], dtype=np.uint8)  # elements 0 and 31
    block = np.concatenate([np.array([1.0], np.float16).view(np.uint8), qh,
                            np.zeros(16, np.uint8)])[None]
    want = np.full(32, -16.0, np.float32)
    want[[0, 31]] = 0.0
    np.testing.assert_array_equal(D.dequant_q5_0(block)[0], want)


# ---------------------------------------------------------------------------- table

def test_table_comes_from_gguf():
    for t, (bs, ts) in GGML_QUANT_SIZES.items():
        assert Q.block_size(t) == bs and Q.type_size(t) == ts
        assert Q.block_size(t.name) == bs and Q.type_size(int(t)) == ts
        assert Q.type_id(Q.type_name(int(t))) == int(t)
    assert Q.type_name(12) == "Q4_K" and Q.type_id("q6_k") == 14


def test_supported_types_and_layouts():
    assert Q.SUPPORTED_TYPES == frozenset(QUANT_TYPES + FLOAT_TYPES)
    assert set(Q.BLOCK_LAYOUT) == Q.SUPPORTED_TYPES
    for name, fields in Q.BLOCK_LAYOUT.items():
        assert sum(n for _, n in fields) == Q.type_size(name), name
        offsets, off = {}, 0
        for fname, n in fields:
            offsets[fname] = off
            off += n
        if name in F16_OFFSETS:
            halves = [offsets[f] for f in ("d", "m", "dmin") if f in offsets]
            assert sorted(halves) == F16_OFFSETS[name], name


@pytest.mark.parametrize("t, n, want", [
    ("F32", 7, 28), ("F16", 3, 6), ("BF16", 640, 1280), ("Q4_0", 64, 36),
    ("Q8_0", 576, 612), ("Q4_K", 4096, 16 * 144), ("Q6_K", 2048, 8 * 210),
    ("IQ4_XS", 256, 136), ("Q4_1", 0, 0),
])
def test_row_nbytes(t, n, want):
    assert Q.row_nbytes(t, n) == want
    assert Q.row_nbytes(Q.type_id(t), n) == want


@pytest.mark.parametrize("t, n", [("Q4_0", 33), ("Q4_K", 128), ("Q6_K", 255), ("F32", -1)])
def test_row_nbytes_rejects_partial_blocks(t, n):
    with pytest.raises(ValueError):
        Q.row_nbytes(t, n)


@pytest.mark.parametrize("bad", ["Q4_2", "nope", 4, 5, 9999, -1])
def test_unknown_types(bad):
    with pytest.raises(ValueError):
        Q.type_name(bad)
    with pytest.raises(ValueError):
        Q.block_size(bad)


def test_dequantize_rejects_bad_input():
    data = np.zeros(Q.row_nbytes("Q4_K", 512) * 2, dtype=np.uint8)
    assert D.dequantize(data, "Q4_K", (2, 512)).shape == (2, 512)
    with pytest.raises(ValueError, match="not supported"):
        D.dequantize(data, "IQ2_XXS", (2, 512))
    with pytest.raises(ValueError, match="not supported"):
        D.dequantize(data, "Q8_K", (2, 512))
    with pytest.raises(ValueError):
        D.dequantize(data, 12, (3, 512))           # byte count
    with pytest.raises(ValueError):
        D.dequantize(data[:-1], "Q4_K", (2, 512))  # one byte short
    with pytest.raises(ValueError):
        D.dequantize(data, "Q4_K", (4, 256 + 128))  # row is not whole blocks
    with pytest.raises(ValueError):
        D.dequantize(data.view(np.int8), "Q4_K", (2, 512))
    with pytest.raises(ValueError):
        D.dequantize(data, "Q4_K", ())
    with pytest.raises(ValueError):
        D.dequant_q4_k(data.reshape(-1, 16))
    with pytest.raises(ValueError):
        D.dequant_q4_0(data[:180].reshape(-1, 18).astype(np.int16))
    assert D.dequantize(np.zeros(0, np.uint8), "Q6_K", (0, 256)).shape == (0, 256)


# ---------------------------------------------------------------------------- real models

EXPECTED_TYPES = {
    "smollm": {"F32", "Q4_1", "Q8_0"},
    "gemma": {"F32", "Q5_0", "Q4_K", "Q6_K", "Q8_0"},
}
MAX_ELEMENTS = 30_000_000  # skips Gemma's 168M-element embedding, keeps SmolLM's 28M one


@pytest.fixture(scope="module", params=sorted(EXPECTED_TYPES))
def real_model(request):
    """(model key, [(name, type name, numpy shape, raw bytes)]) from the project's reader."""
    path = request.getfixturevalue(f"{request.param}_path")
    with GGUFFile(path) as f:
        yield request.param, [
            (info.name, Q.type_name(info.ggml_type), tuple(info.shape), f.raw(info.name))
            for info in f.tensors.values()
        ]


def test_real_model_types(real_model):
    key, tensors = real_model
    assert {tname for _, tname, _, _ in tensors} == EXPECTED_TYPES[key]


def test_real_tensors_bit_exact(real_model):
    key, tensors = real_model
    by_type = {}
    for tensor in tensors:
        by_type.setdefault(tensor[1], []).append(tensor)
    for tname, group in sorted(by_type.items()):
        group = sorted((t for t in group if np.prod(t[2]) <= MAX_ELEMENTS), key=lambda t: np.prod(t[2]))
        assert group, (key, tname)
        # Smallest, middle and largest of the type.
        for name, _, shape, raw in {id(t): t for t in (group[0], group[len(group) // 2], group[-1])}.values():
            out = D.dequantize(raw, tname, shape)
            assert out.shape == shape and np.isfinite(out).all(), name
            expected = gguf_dequant(raw.reshape(shape[:-1] + (-1,)), tname).reshape(shape)
            assert_bits_equal(out, expected)
