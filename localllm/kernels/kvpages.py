"""KV cache pages in each KV type: the byte layout of keys and values, exact loads of them as
float32 vectors for the attention kernels, and the rounding that stores new ones.

A layer's pages are one flat byte array per K and per V, head by head: of ``n_pages`` pages
(blocks) of ``bs`` tokens, KV head ``h`` holds ``bs // 16`` key groups and ``bs`` value rows
in page ``p``:

  keys:   group (h, p, g) at byte ((h * n_pages + p) * (bs // 16) + g) * k_group_bytes; dim d
          of its 16 keys (lanes) is one 16-element vector, so a score loop reads keys lane-wise;
  values: row (h, p, s) at byte ((h * n_pages + p) * bs + s) * v_row_bytes, the head's hd dims.

Heads apart, a sequence whose pages follow each other is one stream of bytes per head, as in
a contiguous cache: with the heads of a page side by side instead, decode attention at 4,000
tokens read from DRAM ran 40 % slower (SmolLM2-135M's 3 KV heads, AMD EPYC Zen 5).

Quantized types (q8_0, q4_0) keep llama.cpp's blocks of 32 dims with an f16 scale each:
after a key group's 16 x hd quants come its (hd / 32) x 16 scales; after a value row's quants
its hd / 32 scales. Every load widens exactly (a stored value times its scale is exact in
float32), so the attention arithmetic is the same for every type.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from .jit import njit
from .simd import (VF, _F32, _I32, _V16I8, _V16I32, _V16F32, _byte_ptr, _splat, _typed_ptr,
                   vf_from_vi, vf_lane, vf_load, vf_load_bf16, vf_load_f16, vf_mul, vf_splat,
                   store_u16, vi_and, vi_load_i8, vi_load_u8, vi_splat, vi_srl, vi_sub)
from .vmath import f16_bits_to_f32, f32_to_f16_bits, vf_store_f16, vf_store_f16_strided

# One namedtuple per KV type, so that Numba compiles each loop for the type it reads; ``a``
# is the flat uint8 page array (padded by 64 bytes, so a 16-lane load may run past an end).
PagesF16 = namedtuple("PagesF16", ["a"])
PagesBF16 = namedtuple("PagesBF16", ["a"])
PagesFP8 = namedtuple("PagesFP8", ["a"])
PagesQ8_0 = namedtuple("PagesQ8_0", ["a"])
PagesQ4_0 = namedtuple("PagesQ4_0", ["a"])

PAGE_CLASSES = {"f16": PagesF16, "bf16": PagesBF16, "fp8": PagesFP8, "q8_0": PagesQ8_0,
                "q4_0": PagesQ4_0}
QUANT_BLOCK = 32  # dims per scale in q8_0 / q4_0
PAD = 64


def _kind(pages) -> str:
    return pages.instance_class.__name__[len("Pages"):]


# ----------------------------------------------------------------------------- sizes

def k_group_nbytes(kv_type: str, hd: int) -> int:
    """Bytes of one group of 16 keys of one head."""
    return {"f16": 32 * hd, "bf16": 32 * hd, "fp8": 16 * hd, "q8_0": 17 * hd,
            "q4_0": 9 * hd}[kv_type]


def v_row_nbytes(kv_type: str, hd: int) -> int:
    """Bytes of one head's value row (one token)."""
    return {"f16": 2 * hd, "bf16": 2 * hd, "fp8": hd, "q8_0": hd + hd // 16,
            "q4_0": hd // 2 + hd // 16}[kv_type]


def check_head_dim(kv_type: str, hd: int) -> None:
    """Raises ValueError when a KV type cannot hold heads of ``hd`` dims."""
    if kv_type not in PAGE_CLASSES:
        raise ValueError(f"unknown KV type {kv_type!r} (choose from {', '.join(PAGE_CLASSES)})")
    if kv_type in ("q8_0", "q4_0") and hd % QUANT_BLOCK:
        raise ValueError(f"KV type {kv_type} needs a head size that is a multiple of "
                         f"{QUANT_BLOCK}, this model's is {hd}")


# ----------------------------------------------------------------------------- loads

@intrinsic
def vf_load_e4m3(typingctx, arr, off):
    """16 FP8 E4M3 values from byte offset ``off``, widened exactly: the 7 magnitude bits moved
    into a float32's exponent and mantissa, scaled by 2**120 to rebias (subnormals included)."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        w = builder.zext(builder.load(_typed_ptr(builder, p, _V16I8), align=1), _V16I32)
        c = lambda x: _splat(builder, ir.Constant(_I32, x), _V16I32)  # noqa: E731
        mag = builder.bitcast(builder.shl(builder.and_(w, c(0x7F)), c(20)), _V16F32)
        scaled = builder.fmul(mag, _splat(builder, ir.Constant(_F32, 2.0 ** 120), _V16F32))
        sign = builder.shl(builder.and_(w, c(0x80)), c(24))
        return builder.bitcast(builder.or_(builder.bitcast(scaled, _V16I32), sign), _V16F32)
    return VF(arr, off), cg


def k_scale(pages, g, hd, d0):
    """Scales of key group ``g`` (byte offset) for dims d0..d0+31, one per key lane."""


@overload(k_scale, inline="always")
def _ol_k_scale(pages, g, hd, d0):
    kind = _kind(pages)
    if kind in ("Q8_0", "Q4_0"):
        per = 16 if kind == "Q8_0" else 8  # quant bytes per dim and 16 keys
        return lambda pages, g, hd, d0: vf_load_f16(pages.a, g + per * hd + (d0 // 32) * 32)
    return lambda pages, g, hd, d0: vf_splat(1.0)  # unused by the float types' loads


def k_dim(pages, g, d, sc):
    """Dim ``d`` of the 16 keys of group ``g`` (byte offset) as float32; ``sc`` from k_scale."""


@overload(k_dim, inline="always")
def _ol_k_dim(pages, g, d, sc):
    kind = _kind(pages)
    if kind == "F16":
        return lambda pages, g, d, sc: vf_load_f16(pages.a, g + d * 32)
    if kind == "BF16":
        return lambda pages, g, d, sc: vf_load_bf16(pages.a, g + d * 32)
    if kind == "FP8":
        return lambda pages, g, d, sc: vf_load_e4m3(pages.a, g + d * 16)
    if kind == "Q8_0":
        return lambda pages, g, d, sc: vf_mul(vf_from_vi(vi_load_i8(pages.a, g + d * 16)), sc)

    def q4(pages, g, d, sc):
        i = d % 32
        b = vi_load_u8(pages.a, g + ((d // 32) * 16 + i % 16) * 16)
        q = vi_sub(vi_and(vi_srl(b, (i // 16) * 4), vi_splat(15)), vi_splat(8))
        return vf_mul(vf_from_vi(q), sc)
    return q4


def v_dims(pages, row, hd, d):
    """Dims d..d+15 (d a multiple of 16) of the value row at byte offset ``row``, float32."""


@overload(v_dims, inline="always")
def _ol_v_dims(pages, row, hd, d):
    kind = _kind(pages)
    if kind == "F16":
        return lambda pages, row, hd, d: vf_load_f16(pages.a, row + d * 2)
    if kind == "BF16":
        return lambda pages, row, hd, d: vf_load_bf16(pages.a, row + d * 2)
    if kind == "FP8":
        return lambda pages, row, hd, d: vf_load_e4m3(pages.a, row + d)
    if kind == "Q8_0":
        def q8(pages, row, hd, d):
            s = vf_splat(vf_lane(vf_load_f16(pages.a, row + hd + (d // 32) * 2), 0))
            return vf_mul(vf_from_vi(vi_load_i8(pages.a, row + d)), s)
        return q8

    def q4(pages, row, hd, d):
        s = vf_splat(vf_lane(vf_load_f16(pages.a, row + hd // 2 + (d // 32) * 2), 0))
        b = vi_load_u8(pages.a, row + (d // 32) * 16)
        q = vi_sub(vi_and(vi_srl(b, (d % 32 // 16) * 4), vi_splat(15)), vi_splat(8))
        return vf_mul(vf_from_vi(q), s)
    return q4


def v_el(pages, row, d):
    """Dim ``d`` of a value row as float32 (the float types' head-size tails)."""


@overload(v_el, inline="always")
def _ol_v_el(pages, row, d):
    kind = _kind(pages)
    if kind == "F16":
        return lambda pages, row, d: vf_lane(vf_load_f16(pages.a, row + d * 2), 0)
    if kind == "BF16":
        return lambda pages, row, d: vf_lane(vf_load_bf16(pages.a, row + d * 2), 0)
    if kind == "FP8":
        return lambda pages, row, d: vf_lane(vf_load_e4m3(pages.a, row + d), 0)
    return lambda pages, row, d: np.float32(0.0)  # quantized heads are multiples of 32 dims


def group_nbytes(pages, hd):
    """k_group_nbytes for a page tuple, inside kernels."""


@overload(group_nbytes, inline="always")
def _ol_group_nbytes(pages, hd):
    per = {"F16": 32, "BF16": 32, "FP8": 16, "Q8_0": 17, "Q4_0": 9}[_kind(pages)]
    return lambda pages, hd: per * hd


def row_nbytes(pages, hd):
    """v_row_nbytes for a page tuple, inside kernels."""


@overload(row_nbytes, inline="always")
def _ol_row_nbytes(pages, hd):
    kind = _kind(pages)
    if kind in ("F16", "BF16"):
        return lambda pages, hd: 2 * hd
    if kind == "FP8":
        return lambda pages, hd: hd
    if kind == "Q8_0":
        return lambda pages, hd: hd + hd // 16
    return lambda pages, hd: hd // 2 + hd // 16


# ----------------------------------------------------------------------------- rotation

def rotated(pages):
    """Whether a KV type stores its vectors rotated (kernels: a compile-time constant)."""


@overload(rotated, inline="always")
def _ol_rotated(pages):
    r = _kind(pages) in ROTATED
    return lambda pages: r


# The block quantized types store keys and values in a Hadamard-rotated basis: an orthonormal
# rotation leaves q . k (and the weighted sum of values, rotated back) unchanged in exact
# arithmetic while it spreads a few outlier dims over the whole block, which the blocks'
# shared scales quantize far better (SmolLM2, q4_0: +23 % perplexity unrotated). Queries
# and keys turn together; values turn on the way in and the output on the way out.
ROTATED = frozenset({"Q8_0", "Q4_0"})


def key_balance(q_norm, k_norm, n_rot, neox):
    """Per-dim powers of two d with q . k = (q * d) . (k / d), for models whose queries and
    keys are RMS-normed per head (QK-norm); None without. Keys are stored divided by d
    (before the rotation) when their type is a rotated one, queries multiplied by it.

    The QK-norm weights set each dim's typical size: a few key dims with weights 5-20x the
    rest dominate the block scales after rotation. d = sqrt(g_k / g_q) per dim (g: the RMS of
    the norm weights over a RoPE pair, which post-RoPE dims mix) evens the error between the
    two sides; powers of two make both scalings exact. Gemma 3 270M, q4_0 keys: +13.0 % to
    +3.5 % perplexity against f16 keys.

    Args:
        q_norm, k_norm: float (hd,) host arrays of the layer's QK-norm weights, or None.
        n_rot: rotated dims per head; neox: RoPE pairs i, i + n_rot/2 (else 2i, 2i+1).
    Returns:
        A tuple of hd floats, or None.
    """
    if q_norm is None or k_norm is None:
        return None
    gq = np.abs(np.asarray(q_norm, np.float64))
    gk = np.abs(np.asarray(k_norm, np.float64))
    hd = gk.size
    partner = np.arange(hd)
    half = n_rot // 2
    if neox:
        partner[:half], partner[half:n_rot] = np.arange(half, n_rot), np.arange(half)
    else:
        partner[:n_rot] = np.arange(n_rot) ^ 1
    pair = lambda g: np.sqrt((g * g + g[partner] ** 2) / 2)  # noqa: E731
    ratio = np.maximum(pair(gk), 1e-3) / np.maximum(pair(gq), 1e-3)
    return tuple(float(x) for x in 2.0 ** np.round(np.log2(np.clip(np.sqrt(ratio), 1 / 16, 16))))


@njit(cache=True)
def balance_block(x, n_heads, hd, d, inverse):
    """In place on x (n, n_heads * hd): each head's dim c times d[c] (or divided by it)."""
    for t in range(x.shape[0]):
        for h in range(n_heads):
            for c in range(hd):
                if inverse:
                    x[t, h * hd + c] /= d[c]
                else:
                    x[t, h * hd + c] *= d[c]


@njit(cache=True)
def rotate_block(x, n_heads, hd):
    """In place on x (n, n_heads * hd): each head's dims, in blocks of the largest power of two
    dividing hd, through the normalized fast Walsh-Hadamard transform: orthonormal and its own
    inverse, so dot products are kept and turning twice gives the vector back."""
    blk = hd & -hd
    scale = np.float32(1.0 / np.sqrt(np.float64(blk)))
    for t in range(x.shape[0]):
        for b0 in range(0, n_heads * hd, blk):
            h = 1
            while h < blk:
                for i in range(b0, b0 + blk, 2 * h):
                    for j in range(i, i + h):
                        a = x[t, j]
                        c = x[t, j + h]
                        x[t, j] = a + c
                        x[t, j + h] = a - c
                h *= 2
            for j in range(b0, b0 + blk):
                x[t, j] *= scale


# ----------------------------------------------------------------------------- stores

@intrinsic
def _f32_bits(typingctx, x):
    """The bits of a float32 as uint32."""
    def cg(context, builder, sig, args):
        return builder.bitcast(context.cast(builder, args[0], sig.args[0], types.float32), _I32)
    return types.uint32(x), cg


@njit(cache=True, inline="always")
def bf16_bits(x):
    """float32 -> bfloat16 bits, nearest-even (NaN stays a quiet NaN)."""
    u = np.int64(_f32_bits(np.float32(x)))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return np.uint16((u >> 16) | 0x40)
    return np.uint16((u + 0x7FFF + ((u >> 16) & 1)) >> 16)


@njit(cache=True, inline="always")
def e4m3_bits(x):
    """float32 -> FP8 E4M3 bits, nearest-even, saturating at +-448 (no inf; NaN -> 0)."""
    v = np.float32(x)
    sign = 0x80 if v < 0 else 0
    a = abs(v)
    if not a < 448.0:  # also NaN
        return np.uint8(0 if a != a else sign | 0x7E)
    if a < 2.0 ** -6:  # subnormal: steps of 2**-9 (8 reaches the smallest normal, code 8)
        return np.uint8(sign | int(np.rint(a * 512.0)))
    u = np.int64(_f32_bits(a))
    m = u & 0x7FFFFF  # 23 mantissa bits to 3, nearest-even
    r = (m + 0x7FFFF + ((m >> 20) & 1)) >> 20
    code = (((u >> 23) - 127 + 7) << 3) + r  # r == 8 carries into the exponent
    return np.uint8(sign | min(code, 0x7E))


@njit(cache=True)
def _q8_block(x, out_q):
    """llama.cpp's q8_0 rounding of one 32-dim block: d = amax / 127, q = round(x / d) (ties
    away from zero); returns the f16 bits of d."""
    amax = np.float32(0.0)
    for i in range(32):
        amax = max(amax, abs(x[i]))
    d = np.float32(amax / np.float32(127.0))
    inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    for i in range(32):
        y = x[i] * inv
        out_q[i] = np.int8(np.floor(y + np.float32(0.5)) if y >= 0 else -np.floor(-y + np.float32(0.5)))
    return f32_to_f16_bits(d)


@njit(cache=True)
def _q4_block(x, out_q):
    """One 32-dim block in q4_0's form (d * (q - 8), q in 0..15), the scale chosen for the
    least squared error: llama.cpp's scale (the value of largest magnitude over -8) and a few
    wider and narrower ones, each refitted by least squares, compared with d rounded to f16
    as stored (the squared error from the sums, without a pass over the block). Returns the
    f16 bits of d; the quants go to out_q[:32] (out_q: 64 int32, the rest scratch)."""
    amax = np.float32(0.0)
    for i in range(32):
        amax = max(amax, abs(x[i]))
    if amax == 0:
        for i in range(32):
            out_q[i] = 8
        return f32_to_f16_bits(np.float32(0.0))
    best = np.inf
    best_bits = np.uint16(0)
    q = out_q[32:64]  # scratch: this candidate's quants
    for c in _Q4_STEPS:
        inv = np.float32(c) / amax
        for i in range(32):
            q[i] = min(7, max(-8, int(np.floor(x[i] * inv + np.float32(0.5)))))
        # sum x q in four interleaved partial sums (exact products; a short add chain)
        s0 = 0.0
        s1 = 0.0
        s2 = 0.0
        s3 = 0.0
        sll = 0
        for i in range(0, 32, 4):
            s0 += x[i] * np.float64(q[i])
            s1 += x[i + 1] * np.float64(q[i + 1])
            s2 += x[i + 2] * np.float64(q[i + 2])
            s3 += x[i + 3] * np.float64(q[i + 3])
            sll += q[i] * q[i] + q[i + 1] * q[i + 1] + q[i + 2] * q[i + 2] + q[i + 3] * q[i + 3]
        sxl = (s0 + s1) + (s2 + s3)
        if sll == 0:
            continue
        bits = f32_to_f16_bits(np.float32(sxl / sll))
        d = np.float64(f16_bits_to_f32(bits))
        err = d * (d * sll - 2.0 * sxl)  # sum of (x - d q)^2, less the sum of x^2
        if err < best:
            best = err
            best_bits = bits
            for i in range(32):
                out_q[i] = q[i] + 8
    return best_bits


# Scales tried for q4_0, as multiples of 1 / max|x|: the largest magnitude mapped to about
# -8 or +7 quanta and the neighbours of both (either sign of the extreme).
_Q4_STEPS = (-8.0, -8.5, -7.5, -7.0, 7.0, 7.5, 6.5, -9.0, 8.0)


def store_key(pages, g, lane, hd, x, tmp):
    """Store key vector ``x`` (hd float32) as lane ``lane`` of key group ``g`` (byte offset)."""


@overload(store_key)
def _ol_store_key(pages, g, lane, hd, x, tmp):
    kind = _kind(pages)
    if kind == "F16":
        def store16(pages, g, lane, hd, x, tmp):
            a = pages.a
            hd16 = hd - hd % 16
            for d in range(0, hd16, 16):  # dim d of the key is row d of the group: 32 bytes
                vf_store_f16_strided(a, g + (d * 16 + lane) * 2, 32, vf_load(x, d * 4))
            for d in range(hd16, hd):
                store_u16(a, g + (d * 16 + lane) * 2, f32_to_f16_bits(x[d]))
        return store16
    if kind in ("BF16", "FP8"):
        def store(pages, g, lane, hd, x, tmp):
            a = pages.a
            for d in range(hd):
                if kind == "BF16":
                    store_u16(a, g + (d * 16 + lane) * 2, bf16_bits(x[d]))
                else:
                    a[g + d * 16 + lane] = e4m3_bits(x[d])
        return store

    def store_q(pages, g, lane, hd, x, tmp):
        a = pages.a
        per = 16 if kind == "Q8_0" else 8
        for c in range(hd // 32):
            xs = x[c * 32:(c + 1) * 32]
            if kind == "Q8_0":
                s = _q8_block(xs, tmp)
                for i in range(32):
                    a[g + ((c * 32 + i) * 16 + lane)] = np.uint8(tmp[i] & 0xFF)
            else:
                s = _q4_block(xs, tmp)
                for i in range(16):
                    a[g + ((c * 16 + i) * 16 + lane)] = np.uint8(tmp[i] | (tmp[i + 16] << 4))
            store_u16(a, g + per * hd + (c * 16 + lane) * 2, s)
    return store_q


def store_value(pages, row, hd, x, tmp):
    """Store value vector ``x`` (hd float32) as the row at byte offset ``row``."""


@overload(store_value)
def _ol_store_value(pages, row, hd, x, tmp):
    kind = _kind(pages)
    if kind == "F16":
        def store16(pages, row, hd, x, tmp):
            hd16 = hd - hd % 16
            for d in range(0, hd16, 16):
                vf_store_f16(pages.a, row + d * 2, vf_load(x, d * 4))
            for d in range(hd16, hd):
                store_u16(pages.a, row + d * 2, f32_to_f16_bits(x[d]))
        return store16
    if kind in ("BF16", "FP8"):
        def store(pages, row, hd, x, tmp):
            a = pages.a
            for d in range(hd):
                if kind == "BF16":
                    store_u16(a, row + d * 2, bf16_bits(x[d]))
                else:
                    a[row + d] = e4m3_bits(x[d])
        return store

    def store_q(pages, row, hd, x, tmp):
        a = pages.a
        qbytes = hd if kind == "Q8_0" else hd // 2
        for c in range(hd // 32):
            xs = x[c * 32:(c + 1) * 32]
            if kind == "Q8_0":
                s = _q8_block(xs, tmp)
                for i in range(32):
                    a[row + c * 32 + i] = np.uint8(tmp[i] & 0xFF)
            else:
                s = _q4_block(xs, tmp)
                for i in range(16):
                    a[row + c * 16 + i] = np.uint8(tmp[i] | (tmp[i + 16] << 4))
            store_u16(a, row + qbytes + c * 2, s)
    return store_q
