"""Integer dot products of the matmul kernels: weight bytes (u8, one row per int32 lane) against
broadcast activation bytes (s8), optionally times a per-row integer scale, exact in int32.

One intrinsic per (vector count, largest weight byte) emits the instructions of the compile
target: vpdpbusd chains on VNNI; on AVX2, vpmaddubsw products summed in int16 for as long as
the bound on the weight bytes keeps the sum from overflowing, then one vpmaddwd (by ones, or by
the row's scale, so K-quant scales never leave the integer domain); sdot on arm64 with the
dot-product extension; portable IR elsewhere.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import (VI, _I8, _I32, _V8I32, _V16I16, _V16I32, _V32I8, _V64I8, _byte_ptr, _call,
                   _concat, _dpbusd, _halves, _splat, _typed_ptr, isa)

# Paths whose dot instructions take both operands signed: bytes above 127 go in as u - 128.
_SIGNED_PATHS = ("avx2", "neon-dot")
_ACT_BOUND = 128  # |activation byte|: quantized activations stay in [-127, 127]; -128 is safe too
_I16_MAX = 32767


def int16_group(max_value: int) -> int:
    """How many vpmaddubsw results (each a pair of u8 x s8 products) may be summed in int16
    without overflow, for weight bytes of at most ``max_value`` (0: the bytes may exceed 127,
    so vpmaddubsw itself could saturate and the sign trick is needed)."""
    if max_value > 127:
        return 0
    return _I16_MAX // (2 * _ACT_BOUND * max(1, max_value))


def _scale_pairs(builder, sc):
    """Per-lane int32 scales (each within int16) as two equal int16 halves, for vpmaddwd."""
    lo = builder.and_(sc, _splat(builder, ir.Constant(_I32, 0xFFFF), _V16I32))
    return builder.or_(lo, builder.shl(sc, _splat(builder, ir.Constant(_I32, 16), _V16I32)))


def _avx2_dot(builder, ws, xs, sc, max_value):
    """Σ_j ws[j]·xs[j] per int32 lane (times sc), AVX2. Per 256-bit half: groups of vpmaddubsw
    products summed in int16, each group widened by one vpmaddwd (by ones or by the scales).
    Bytes above 127 take the sign trick: sum(u x) = sum(|u-128| sign(x, u-128)) + 128 sum(x),
    whose last term the caller adds from its activation sums."""
    group = int16_group(max_value)
    mult = (_scale_pairs(builder, sc) if sc is not None
            else ir.Constant(_V16I32, [0x00010001] * 16))
    bias = ir.Constant(_V32I8, [-128] * 32)
    halves = []
    for q, m in enumerate(_halves(builder, mult, 16)):
        idx = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * q, 32 * q + 32)))
        m = builder.bitcast(m, _V16I16)
        total, part, count = None, None, 0
        for w, x in zip(ws, xs):
            w8 = builder.shuffle_vector(builder.bitcast(w, _V64I8), builder.bitcast(w, _V64I8), idx)
            x8 = builder.shuffle_vector(builder.bitcast(x, _V64I8), builder.bitcast(x, _V64I8), idx)
            if group == 0:
                s = builder.xor(w8, bias)
                w8 = _call(builder, "llvm.abs.v32i8", _V32I8, [_V32I8, ir.IntType(1)],
                           [s, ir.Constant(ir.IntType(1), 0)])  # |-128| stays 0x80 = 128
                x8 = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [_V32I8, _V32I8], [x8, s])
            p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [_V32I8, _V32I8], [w8, x8])
            part = p if part is None else builder.add(part, p)
            count += 1
            if count == max(group, 1):
                wide = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16], [part, m])
                total = wide if total is None else builder.add(total, wide)
                part, count = None, 0
        if part is not None:
            wide = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16], [part, m])
            total = wide if total is None else builder.add(total, wide)
        halves.append(total)
    return _concat(builder, halves[0], halves[1], 16)


def _neon_sdot(builder, acc, a, b):
    """acc + per-lane 4-byte dot of s8(a) and s8(b), as four 128-bit sdot instructions."""
    v16i8, v4i32 = ir.VectorType(_I8, 16), ir.VectorType(_I32, 4)
    a8, b8 = builder.bitcast(a, _V64I8), builder.bitcast(b, _V64I8)
    parts = []
    for q in range(4):
        bidx = ir.Constant(ir.VectorType(_I32, 16), list(range(16 * q, 16 * q + 16)))
        lidx = ir.Constant(ir.VectorType(_I32, 4), list(range(4 * q, 4 * q + 4)))
        parts.append(_call(builder, "llvm.aarch64.neon.sdot.v4i32.v16i8", v4i32, [v4i32, v16i8, v16i8],
                           [builder.shuffle_vector(acc, acc, lidx),
                            builder.shuffle_vector(a8, a8, bidx), builder.shuffle_vector(b8, b8, bidx)]))
    lo = _concat(builder, parts[0], parts[1], 8)
    hi = _concat(builder, parts[2], parts[3], 8)
    return _concat(builder, lo, hi, 16)


def _neon_dot(builder, ws, xs, max_value):
    """Σ_j ws[j]·xs[j] per int32 lane with sdot, in two chains. Bytes above 127 are taken as
    u - 128 (a sign-bit flip); the caller's activation sums restore the 128 * sum(x) term."""
    bias = ir.Constant(_V64I8, [-128] * 64)
    zero = ir.Constant(_V16I32, None)
    chains = [zero, zero]
    for j, (w, x) in enumerate(zip(ws, xs)):
        if int16_group(max_value) == 0:
            w = builder.bitcast(builder.xor(builder.bitcast(w, _V64I8), bias), _V16I32)
        chains[j % 2] = _neon_sdot(builder, chains[j % 2], w, x)
    return builder.add(chains[0], chains[1]) if len(ws) > 1 else chains[0]


def _chain_dot(builder, ws, xs):
    """Σ_j dpbusd(ws[j], xs[j]) in two interleaved chains (the sums are exact: any grouping
    gives the same integer; two chains halve the dependency latency)."""
    zero = ir.Constant(_V16I32, None)
    chains = [zero, zero]
    for j, (w, x) in enumerate(zip(ws, xs)):
        chains[j % 2] = _dpbusd(builder, chains[j % 2], w, x)
    return builder.add(chains[0], chains[1]) if len(ws) > 1 else chains[0]


_DOTS: dict[tuple[int, int], object] = {}


def dot_intrinsic(n: int, max_value: int):
    """The intrinsic ``f(ws, xq, xo, sc, xsum) -> VI`` for ``n`` weight vectors whose bytes are
    at most ``max_value``.

    Per int32 lane: sc * Σ_{j<n} Σ_{i<4} u8(ws[j] byte 4·lane+i) · s8(xq byte xo + 4j + i),
    exact. ``sc`` is a VI of per-row scales within int16, or None (1); ``xsum`` is a VI whose
    lanes hold the sum of those 4n activation bytes, needed by formats with bytes above 127
    (else None).
    """
    key = (n, max_value)
    if key in _DOTS:
        return _DOTS[key]

    @intrinsic
    def vi_dot(typingctx, ws, xq, xo, sc, xsum):
        has_sc = not isinstance(sc, types.NoneType)
        has_xsum = not isinstance(xsum, types.NoneType)
        if int16_group(max_value) == 0 and isa() in _SIGNED_PATHS and not has_xsum:
            raise TypeError("vi_dot: weight bytes above 127 need the activation sums")

        def cg(context, builder, sig, args):
            w_list = cgutils.unpack_tuple(builder, args[0], n)
            base = _byte_ptr(context, builder, sig.args[1], args[1], args[2])
            x_list = [_splat(builder, builder.load(_typed_ptr(
                builder, builder.gep(base, [ir.Constant(ir.IntType(64), 4 * j)]), _I32), align=1),
                _V16I32) for j in range(n)]
            scale = args[3] if has_sc else None
            if isa() == "avx2":
                r = _avx2_dot(builder, w_list, x_list, scale, max_value)
            else:
                r = (_neon_dot(builder, w_list, x_list, max_value) if isa() == "neon-dot"
                     else _chain_dot(builder, w_list, x_list))
                r = builder.mul(r, scale) if has_sc else r
            if isa() in _SIGNED_PATHS and int16_group(max_value) == 0:  # the 128 * sum(x) term
                fix = builder.shl(args[4], _splat(builder, ir.Constant(_I32, 7), _V16I32))
                r = builder.add(r, builder.mul(fix, scale) if has_sc else fix)
            return r
        return VI(ws, xq, xo, sc, xsum), cg

    vi_dot.__doc__ = dot_intrinsic.__doc__
    _DOTS[key] = vi_dot
    return vi_dot

