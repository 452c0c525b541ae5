"""Shared inputs and references for the matmul kernel tests: random GGUF weight bytes, a numpy
re-implementation of the activation quantization, and the fixed workload the ISA tests compare.
Run as a script (``python kernel_data.py OUT.npz``) it computes that workload and saves it."""

from __future__ import annotations

import sys

import numpy as np

from localllm.formats import quants
from localllm.formats.dequant import dequantize

FORMATS = sorted(quants.SUPPORTED_TYPES)
FLOAT_FORMATS = ("F32", "F16", "BF16")
SUPERBLOCK_FORMATS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")

# Scale of the "min" field relative to d, so that the random weights are roughly centred
# (as a quantizer would make them) instead of all positive.
_MIN_CENTRE = {"Q4_1": -7.5, "Q5_1": -15.5, "Q2_K": 1.5, "Q4_K": 7.5, "Q5_K": 15.5}


def f16_fields(name: str) -> dict[str, int]:
    """Byte offset within a block of each f16 field ('d', 'm', 'dmin') of a quantized format."""
    offsets, off = {}, 0
    for field, nbytes in quants.BLOCK_LAYOUT[name]:
        if field in ("d", "m", "dmin"):
            offsets[field] = off
        off += nbytes
    return offsets


def random_weight(name: str, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Bytes of a random (N, K) GGUF tensor: random quant bytes with sane f16 scales.

    Returns:
        uint8 array of N * row_nbytes(name, K) bytes.
    """
    if name in FLOAT_FORMATS:
        w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
        if name == "F32":
            return w.view(np.uint8).reshape(-1)
        if name == "F16":
            return w.astype(np.float16).view(np.uint8).reshape(-1)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
    nb = N * K // quants.block_size(name)
    blocks = rng.integers(0, 256, (nb, quants.type_size(name)), dtype=np.uint8)
    if name == "MXFP4":  # E8M0 scales 2**-12 .. 2**-9: weights up to about 0.01
        blocks[:, 0] = rng.integers(116, 120, nb, dtype=np.uint8)
        return blocks.reshape(-1)
    d = rng.uniform(0.5, 1.5, nb) * 0.01
    fields = f16_fields(name)
    blocks[:, fields["d"]:fields["d"] + 2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
    for field in ("m", "dmin"):
        if field in fields:
            v = d * rng.uniform(0.5, 1.5, nb) * _MIN_CENTRE[name]
            o = fields[field]
            blocks[:, o:o + 2] = v.astype(np.float16).view(np.uint8).reshape(nb, 2)
    return blocks.reshape(-1)


def set_f16(raw: np.ndarray, name: str, K: int, row: int, block: int, field: str, value) -> None:
    """Overwrite one f16 scale field of block ``block`` of row ``row`` in place."""
    start = row * quants.row_nbytes(name, K) + block * quants.type_size(name) + f16_fields(name)[field]
    raw[start:start + 2] = np.array([value], np.float16).view(np.uint8)


def dequant64(name: str, raw: np.ndarray, N: int, K: int) -> np.ndarray:
    """The reference-dequantized weight (N, K) in float64."""
    return dequantize(np.ascontiguousarray(raw), name, (N, K)).astype(np.float64)


def round_f16(v: np.ndarray) -> np.ndarray:
    """float32 values rounded to float16 precision and range (nearest-even), as float32."""
    with np.errstate(over="ignore"):
        return np.asarray(v, np.float32).astype(np.float16).astype(np.float32)


def q8_blocks32(x: np.ndarray):
    """llama.cpp's Q8_0 / Q8_1 activation blocks, written out plainly in float32 numpy.

    Per 32-wide block: amax = max |x|, d = amax / 127, q = rint(x * (127 / amax)) (0 when amax
    is 0), scale = f16(d), sum = sum(q), scaled sum = f16(d * sum).
    Returns:
        (q int8 (n, K), scale float32, sum int32, scaled sum float32), the last three (n, K/32).
    """
    x = np.asarray(x, np.float32)
    n, K = x.shape
    xb = x.reshape(n, K // 32, 32)
    amax = np.abs(xb).max(axis=2)
    d = amax / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(xb * inv[:, :, None]).astype(np.int32)
    s = q.sum(axis=2, dtype=np.int32)
    return (q.astype(np.int8).reshape(n, K), round_f16(d), s,
            round_f16(d * s.astype(np.float32)))


def q8_blocks256(x: np.ndarray):
    """llama.cpp's Q8_K activation blocks, written out plainly in float32 numpy.

    Per 256-wide block: vmax = the first element of largest |x|, iscale = -127 / vmax,
    q = min(127, rint(iscale * x)), scale = 1 / iscale (a zero block: all 0).
    Returns:
        (q int8 (n, K), scale float32 (n, K/256), sums of 16 quants int32 (n, K/16)).
    """
    x = np.asarray(x, np.float32)
    n, K = x.shape
    xb = x.reshape(n, K // 256, 256)
    first = np.abs(xb).argmax(axis=2)  # argmax returns the first of equal maxima
    vmax = np.take_along_axis(xb, first[:, :, None], axis=2)[:, :, 0]
    zero = vmax == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, np.float32(0.0), np.float32(-127.0) / vmax).astype(np.float32)
        d = np.where(zero, np.float32(0.0), np.float32(1.0) / iscale).astype(np.float32)
    q = np.minimum(127, np.rint(xb * iscale[:, :, None])).astype(np.int32).reshape(n, K)
    return q.astype(np.int8), d, q.reshape(n, K // 16, 16).sum(axis=2, dtype=np.int32)


def q8_dequant(x: np.ndarray, width: int) -> np.ndarray:
    """x after the kernels' int8 quantize-dequantize round trip (32 or 256 wide), in float64."""
    q, d = (q8_blocks32(x) if width == 32 else q8_blocks256(x))[:2]
    n, K = q.shape
    return (q.reshape(n, K // width, width) * d[:, :, None].astype(np.float64)).reshape(n, K)


def block_mins(name: str, raw: np.ndarray, N: int, K: int) -> np.ndarray | None:
    """The per-block additive min m (N, K/32) of Q4_1 / Q5_1 in float64, else None."""
    if name not in ("Q4_1", "Q5_1"):
        return None
    blocks = np.ascontiguousarray(raw).reshape(-1, quants.type_size(name))
    return quants.half_field(blocks, name, "m").astype(np.float64).reshape(N, K // 32)


def assert_same_bits(actual: np.ndarray, expected: np.ndarray, what: str = "") -> None:
    """Assert two float32 arrays are identical bit for bit (NaN payloads and -0.0 included)."""
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    assert actual.dtype == expected.dtype == np.float32, (what, actual.dtype, expected.dtype)
    a = np.ascontiguousarray(actual).view(np.uint32)
    e = np.ascontiguousarray(expected).view(np.uint32)
    bad = np.argwhere(a != e)
    assert bad.size == 0, (f"{what}: {len(bad)} of {a.size} values differ; first at "
                           f"{tuple(bad[0])}: {actual[tuple(bad[0])]!r} != {expected[tuple(bad[0])]!r}")


def activation_width(name: str) -> int | None:
    """Block width the kernels quantize activations to for a weight format (None: floats)."""
    if name in FLOAT_FORMATS:
        return None
    return 256 if name in SUPERBLOCK_FORMATS else 32


# ----------------------------------------------------------------------------- ISA workload

ISA_N, ISA_K, ISA_SEED = 40, 512, 2024


def isa_inputs() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Fixed (weight bytes, activations (7, K)) per format; the same in every process."""
    rng = np.random.default_rng(ISA_SEED)
    out = {}
    for name in FORMATS:
        raw = random_weight(name, ISA_N, ISA_K, rng)
        x = rng.standard_normal((7, ISA_K)).astype(np.float32)
        x[1] = 1.0                                # every quant at +127: largest integer sums
        x[2] = np.where(np.arange(ISA_K) % 2, -3.0, 3.0)
        x[3, ::37] *= 50.0                        # outliers: most quants small
        x[4, 64:320] = 0.0                        # whole zero blocks
        out[name] = raw, x
    return out


def isa_results() -> dict[str, np.ndarray]:
    """Every format's matmul of the ISA workload for n = 7 and n = 1, keyed "NAME_nN"."""
    from localllm.kernels import matmul as M

    out = {}
    for name, (raw, x) in isa_inputs().items():
        w = M.pack(name, raw, ISA_N, ISA_K)
        out[f"{name}_n7"] = M.matmul(w, x)
        out[f"{name}_n1"] = M.matmul(w, x[5:6])
    return out


if __name__ == "__main__":
    from localllm import configure_process
    from localllm.kernels import simd

    configure_process()  # compile into NUMBA_CACHE_DIR's kernel cache (or the default one)
    results = isa_results()
    np.savez(sys.argv[1], isa=np.array(simd.ISA), **results)
    print(simd.ISA)
