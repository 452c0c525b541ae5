"""Vector math on simd.VF values for the attention kernels: fma, max, a deterministic exp2,
horizontal reductions, half <-> float loads and stores. Built only from IEEE add/mul/fma and
integer ops, so every target gives the same bits."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import (_MAGIC32, _MAGIC32_BITS, VF, _byte_ptr, _f16_bits_to_f32, _F32,
                   _fmax, _fold_halves, _I32, _splat, _typed_ptr, _V16F16, _V16F32, _V16I16,
                   _V16I32, has_f16c)

# 2**f on [-0.5, 0.5]: near-minimax degree-6 polynomial (relative error 2e-9 in exact
# arithmetic, under 8e-8 evaluated in float32 with FMA). c0 = 1 so that exp2(0) == 1 exactly.
EXP2_COEFS = tuple(float.fromhex(c) for c in (
    "0x1p0", "0x1.62e43p-1", "0x1.ebfbdcp-3", "0x1.c6aee8p-5", "0x1.3b2d4cp-7",
    "0x1.5f3e54p-10", "0x1.41fbbap-13"))


def _fc(builder, x):
    return _splat(builder, ir.Constant(_F32, x), _V16F32)


def _ic(builder, x):
    return _splat(builder, ir.Constant(_I32, x), _V16I32)


def _fma(builder, a, b, c):
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V16F32, [_V16F32] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


@intrinsic
def vf_fma(typingctx, a, b, c):
    """a * b + c per lane with a single rounding (llvm.fma)."""
    def cg(context, builder, sig, args):
        return _fma(builder, *args)
    return VF(a, b, c), cg


@intrinsic
def vf_max(typingctx, a, b):
    """Lane-wise a > b ? a : b."""
    def cg(context, builder, sig, args):
        return _fmax(builder, args[0], args[1])
    return VF(a, b), cg


@intrinsic
def vf_div(typingctx, a, b):
    """Lane-wise float32 division (correctly rounded)."""
    def cg(context, builder, sig, args):
        return builder.fdiv(args[0], args[1])
    return VF(a, b), cg


@intrinsic
def vf_bcast(typingctx, arr, off):
    """The float32 at byte offset ``off`` of ``arr`` in all 16 lanes."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        return _splat(builder, builder.load(_typed_ptr(builder, p, _F32), align=1), _V16F32)
    return VF(arr, off), cg


def _check_source(arr):
    if not (isinstance(arr, types.Array) and arr.dtype in (types.uint16, types.float32)):
        raise TypeError("expected a uint16 (half bits) or float32 array")


def _elem_ptr(context, builder, sig, args):
    """Pointer to element args[1] of array args[0], and the element size."""
    isz = 2 if sig.args[0].dtype == types.uint16 else 4
    idx = context.cast(builder, args[1], sig.args[1], types.int64)
    return _byte_ptr(context, builder, sig.args[0], args[0],
                     builder.mul(idx, ir.Constant(idx.type, isz))), isz


@intrinsic
def vf_load_el(typingctx, arr, i):
    """16 values from element index ``i`` of a uint16 (half bits) or float32 array, as float32
    (half widened exactly): one kernel source serves the half cache and float32 copies of it."""
    _check_source(arr)

    def cg(context, builder, sig, args):
        p, isz = _elem_ptr(context, builder, sig, args)
        if isz == 4:
            return builder.load(_typed_ptr(builder, p, _V16F32), align=1)
        if has_f16c():
            return builder.fpext(builder.load(_typed_ptr(builder, p, _V16F16), align=1), _V16F32)
        return _f16_bits_to_f32(builder, builder.load(_typed_ptr(builder, p, _V16I16), align=1))
    return VF(arr, i), cg


@intrinsic
def f32_load_el(typingctx, arr, i):
    """Element ``i`` of a uint16 (half bits) or float32 array as float32, like vf_load_el."""
    _check_source(arr)

    def cg(context, builder, sig, args):
        p, isz = _elem_ptr(context, builder, sig, args)
        if isz == 4:
            return builder.load(_typed_ptr(builder, p, _F32), align=1)
        if has_f16c():
            return builder.fpext(builder.load(_typed_ptr(builder, p, ir.HalfType()), align=1), _F32)
        h = _splat(builder, builder.load(_typed_ptr(builder, p, ir.IntType(16)), align=1), _V16I16)
        return builder.extract_element(_f16_bits_to_f32(builder, h), ir.Constant(_I32, 0))
    return types.float32(arr, i), cg


@intrinsic
def vf_keep(typingctx, v, first, last, fill):
    """Lanes first..last (inclusive) of ``v`` kept, the others replaced by ``fill``."""
    def cg(context, builder, sig, args):
        lane = ir.Constant(_V16I32, list(range(16)))
        lo = _splat(builder, context.cast(builder, args[1], sig.args[1], types.int32), _V16I32)
        hi = _splat(builder, context.cast(builder, args[2], sig.args[2], types.int32), _V16I32)
        inside = builder.and_(builder.icmp_signed(">=", lane, lo),
                              builder.icmp_signed("<=", lane, hi))
        f = _splat(builder, context.cast(builder, args[3], sig.args[3], types.float32), _V16F32)
        return builder.select(inside, args[0], f)
    return VF(v, first, last, fill), cg


def _exp2(b, x, fc, ic, ity, fma):
    """2**x: x = n + f with n = round(x) and f in [-0.5, 0.5] exact, 2**f by the polynomial
    (FMA Horner), times 2**n made from its exponent bits. Written once for vectors and
    scalars (fc, ic make constants, ity is the matching integer type)."""
    # Inputs below -126 (-inf included) become -126, so that 2**n stays a normal float.
    xc = b.select(b.fcmp_ordered(">", x, fc(-126.0)), x, fc(-126.0))
    magic = fc(_MAGIC32)  # adding it rounds to an integer (ties to even)
    t = b.fadd(xc, magic)
    n = b.fsub(t, magic)
    f = b.fsub(xc, n)
    p = fc(EXP2_COEFS[-1])
    for c in EXP2_COEFS[-2::-1]:
        p = fma(p, f, fc(c))
    # 2**n from the bits of t (n + 127 = bits(t) - bits(magic) + 127): no float -> int
    # conversion, which would be poison for NaN.
    pow2 = b.shl(b.sub(b.bitcast(t, ity), ic(_MAGIC32_BITS - 127)), ic(23))
    return b.fmul(p, b.bitcast(pow2, x.type))


@intrinsic
def vf_exp2(typingctx, x):
    """2**x per lane for x <= 127: relative error under 1e-7 down to x = -125 (results stay
    normal floats); inputs below -126, -inf included, give 2**-126."""
    def cg(context, builder, sig, args):
        return _exp2(builder, args[0], lambda v: _fc(builder, v), lambda v: _ic(builder, v),
                     _V16I32, lambda a, b_, c: _fma(builder, a, b_, c))
    return VF(x), cg


@intrinsic
def f32_exp2(typingctx, x):
    """Scalar 2**x: the same operations as vf_exp2, so the same bits as any of its lanes."""
    def cg(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        return _exp2(builder, v, lambda c: ir.Constant(_F32, c), lambda c: ir.Constant(_I32, c),
                     _I32, lambda a, b_, c: builder.call(fn, [a, b_, c]))
    return types.float32(x), cg


@intrinsic
def vf_hsum(typingctx, v):
    """Sum of the 16 lanes: ((l0+l8)+(l4+l12)) + ... by halving (a fixed tree)."""
    def cg(context, builder, sig, args):
        return _fold_halves(builder, args[0], builder.fadd)
    return types.float32(v), cg


@intrinsic
def vf_hmax(typingctx, v):
    """Maximum of the 16 lanes by the same halving tree as vf_hsum."""
    def cg(context, builder, sig, args):
        return _fold_halves(builder, args[0], lambda a, b: _fmax(builder, a, b))
    return types.float32(v), cg


def _f32_to_f16_bits(builder, x):
    """Round float32 lanes to IEEE half (nearest, ties to even) with integer ops; 16 x i16.

    Matches the hardware conversion: overflow -> inf, subnormals rounded, NaN kept quiet.
    """
    b = builder
    w = b.bitcast(x, _V16I32)
    sign = b.and_(b.lshr(w, _ic(b, 16)), _ic(b, 0x8000))
    a = b.and_(w, _ic(b, 0x7FFFFFFF))
    # Normal half range: rebias the exponent (127 -> 15) and round the 13 dropped bits.
    odd = b.and_(b.lshr(a, _ic(b, 13)), _ic(b, 1))
    rebiased = b.sub(a, _ic(b, (127 - 15) << 23))
    normal = b.lshr(b.add(rebiased, b.add(_ic(b, 0xFFF), odd)), _ic(b, 13))
    # Subnormal half (|x| < 2**-14): adding 0.5 as a float aligns the mantissa so the float
    # adder rounds it to nearest-even at the half's last subnormal bit (2**-24).
    half = _fc(b, 0.5)
    sub = b.sub(b.bitcast(b.fadd(b.bitcast(a, _V16F32), half), _V16I32), b.bitcast(half, _V16I32))
    infnan = b.or_(_ic(b, 0x7C00), b.select(b.icmp_unsigned(">", a, _ic(b, 0x7F800000)),
                                            b.or_(_ic(b, 0x200), b.and_(b.lshr(a, _ic(b, 13)),
                                                                        _ic(b, 0x3FF))),
                                            _ic(b, 0)))
    r = b.select(b.icmp_unsigned("<", a, _ic(b, 113 << 23)), sub, normal)
    r = b.select(b.icmp_unsigned(">=", a, _ic(b, 0x47800000 - 0x1000)), _ic(b, 0x7C00), r)
    r = b.select(b.icmp_unsigned(">=", a, _ic(b, 0x7F800000)), infnan, r)
    return b.trunc(b.or_(r, sign), _V16I16)


@intrinsic
def vf_store_f16(typingctx, arr, off, v):
    """Round a VF to IEEE half (nearest-even) and store its 32 bytes at byte offset ``off``."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(_half_bits(builder, args[2]), _typed_ptr(builder, p, _V16I16), align=1)
        return context.get_dummy_value()
    return types.void(arr, off, v), cg


def _half_bits(builder, v):
    """A VF rounded to IEEE half (nearest-even), as 16 x i16 bits."""
    if has_f16c():
        return builder.bitcast(builder.fptrunc(v, _V16F16), _V16I16)
    return _f32_to_f16_bits(builder, v)


@intrinsic
def vf_store_f16_strided(typingctx, arr, off, stride, v):
    """Round a VF to IEEE half like vf_store_f16 and store element i's 2 bytes at byte offset
    ``off + i * stride`` (a column of a transposed tile)."""
    def cg(context, builder, sig, args):
        base = _byte_ptr(context, builder, sig.args[0], args[0], ir.Constant(ir.IntType(64), 0))
        o = context.cast(builder, args[1], sig.args[1], types.int64)
        st = context.cast(builder, args[2], sig.args[2], types.int64)
        h = _half_bits(builder, args[3])
        for i in range(16):
            p = builder.gep(base, [o])
            builder.store(builder.extract_element(h, ir.Constant(ir.IntType(32), i)),
                          _typed_ptr(builder, p, ir.IntType(16)), align=1)
            o = builder.add(o, st)
        return context.get_dummy_value()
    return types.void(arr, off, stride, v), cg


@intrinsic
def f32_to_f16_bits(typingctx, x):
    """One float32 rounded to half (nearest-even) as uint16 bits, through the same code as
    vf_store_f16's portable path."""
    def cg(context, builder, sig, args):
        v = _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), _V16F32)
        h = _f32_to_f16_bits(builder, v)
        return builder.extract_element(h, ir.Constant(_I32, 0))
    return types.uint16(x), cg


@intrinsic
def f16_bits_to_f32(typingctx, bits):
    """IEEE half bits (an unsigned integer, its low 16 bits) as float32, exactly: the inverse
    of f32_to_f16_bits, through vf_load_f16's portable path."""
    if not isinstance(bits, types.Integer):
        return None

    def cg(context, builder, sig, args):
        h = args[0]
        if sig.args[0].bitwidth > 16:
            h = builder.trunc(h, ir.IntType(16))
        v = _f16_bits_to_f32(builder, _splat(builder, h, _V16I16))
        return builder.extract_element(v, ir.Constant(_I32, 0))
    return types.float32(bits), cg


@intrinsic
def f32_fma(typingctx, a, b, c):
    """Scalar float32 a * b + c with one rounding (llvm.fma.f32), the lane op of vf_fma."""
    def cg(context, builder, sig, args):
        vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args)]
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
        return builder.call(fn, vals)
    return types.float32(a, b, c), cg
