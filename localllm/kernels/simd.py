"""SIMD building blocks for the Numba kernels: 512-bit vector values and the operations on them.

Two vector types live in Numba code as plain SSA values: ``VI`` (16 x int32, also used as 64
bytes) and ``VF`` (16 x float32). Each operation is an ``@intrinsic`` that emits LLVM IR; the
integer dot product picks its instructions from the compile target (the features Numba builds
for), and every choice gives bit-identical results.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic, models, register_model

from .hostcpu import llvm_host_features

_I8, _I16, _I32, _F32, _F16 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType(), ir.HalfType()
_V64I8 = ir.VectorType(_I8, 64)
_V32I16 = ir.VectorType(_I16, 32)
_V16I32 = ir.VectorType(_I32, 16)
_V16F32 = ir.VectorType(_F32, 16)
_V16F16 = ir.VectorType(_F16, 16)
_V16I16 = ir.VectorType(_I16, 16)
_V16I8 = ir.VectorType(_I8, 16)
_V32I8 = ir.VectorType(_I8, 32)
_V8I32 = ir.VectorType(_I32, 8)

_MAGIC32 = 12582912.0  # 1.5 * 2**23: adding it rounds a float32 below 2**22 to an integer
_MAGIC32_BITS = 0x4B400000  # its bit pattern: the sum's bits minus this are that integer


def target_features() -> frozenset[str]:
    """The CPU features Numba compiles for (its NUMBA_CPU_FEATURES setting, else the host's),
    read when asked: the kernels' code generators ask while a kernel compiles, after
    ``configure_process`` may have set them."""
    feats = config.CPU_FEATURES
    if feats is None:
        feats = llvm_host_features()
    return frozenset(f[1:] for f in feats.split(",") if f.startswith("+"))


def select_isa(features: frozenset[str] | None = None, machine: str | None = None) -> str:
    """Name the dot-product path for a feature set.

    Returns:
        'avx512vnni', 'avxvnni', 'avx2', 'neon-dot' or 'generic'.
    """
    f = target_features() if features is None else features
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        if {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= f:
            return "avx512vnni"
        if {"avxvnni", "avx2"} <= f:
            return "avxvnni"
        if "avx2" in f:
            return "avx2"
    elif machine in ("arm64", "aarch64") and "dotprod" in f:
        return "neon-dot"  # sdot through its LLVM intrinsic (see dot.py)
    return "generic"


def isa() -> str:
    """The dot-product path of the current compile target (see select_isa)."""
    return select_isa()


def has_f16c() -> bool:
    """Whether the compile target converts halves in hardware: without F16C, LLVM lowers
    half->float to a runtime call the JIT does not provide."""
    return "f16c" in target_features() or platform.machine().lower() in ("arm64", "aarch64")


def __getattr__(name: str):
    # ``simd.ISA``, as reports and scripts name it: the path of the target as it is now.
    if name == "ISA":
        return isa()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class VecType(types.Type):
    """A 512-bit vector held in registers: 'i' = 16 x int32, 'f' = 16 x float32."""

    def __init__(self, kind: str):
        self.kind = kind
        super().__init__(name=f"simd.v{kind}x16")


VI = VecType("i")
VF = VecType("f")


@register_model(VecType)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _V16I32 if fe_type.kind == "i" else _V16F32)


# ----------------------------------------------------------------------------- helpers

def _byte_ptr(context, builder, arrty, arr, off):
    """i8* to byte offset ``off`` of an array's data (no bounds check: callers own the maths)."""
    data = context.make_array(arrty)(context, builder, arr).data
    p = builder.bitcast(data, ir.PointerType(_I8))
    return builder.gep(p, [off])


def _typed_ptr(builder, p, ty):
    return builder.bitcast(p, ir.PointerType(ty))


def _splat(builder, scalar, vecty):
    undef = ir.Constant(vecty, ir.Undefined)
    v = builder.insert_element(undef, scalar, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(_I32, vecty.count), None))


def _as_i32(context, builder, ty, val):
    return context.cast(builder, val, ty, types.int32)


def _call(builder, name, retty, argtys, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(retty, argtys), name)
    return builder.call(fn, args)


def _fmax(builder, a, b):
    """a > b ? a : b per lane (an IEEE compare: the same result on every target)."""
    return builder.select(builder.fcmp_ordered(">", a, b), a, b)


def _fold_halves(builder, v, combine):
    """Fold the lanes of ``v`` pairwise (lane j with lane j + half, halving) to a scalar: one
    fixed tree, so a horizontal sum or max has the same bits everywhere."""
    n = v.type.count
    while n > 1:
        n //= 2
        idx = ir.VectorType(_I32, n)
        v = combine(builder.shuffle_vector(v, v, ir.Constant(idx, list(range(n)))),
                    builder.shuffle_vector(v, v, ir.Constant(idx, list(range(n, 2 * n)))))
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _halves(builder, v, n):
    """Split an n-lane vector into its two n/2-lane halves."""
    lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n // 2), list(range(n // 2))))
    hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n // 2), list(range(n // 2, n))))
    return lo, hi


def _concat(builder, lo, hi, n):
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(_I32, n), list(range(n))))


def _dpbusd_generic(builder, acc, a, b):
    """acc + sum over each group of 4 bytes of u8(a) * s8(b), in portable IR (exact)."""
    a8 = builder.bitcast(a, _V64I8)
    b8 = builder.bitcast(b, _V64I8)
    v64i32 = ir.VectorType(_I32, 64)
    prod = builder.mul(builder.zext(a8, v64i32), builder.sext(b8, v64i32))
    # Lane j of the result sums bytes 4j..4j+3; gather those with four strided shuffles.
    parts = [builder.shuffle_vector(prod, prod, ir.Constant(ir.VectorType(_I32, 16),
                                                            [4 * j + i for j in range(16)]))
             for i in range(4)]
    s = builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))
    return builder.add(acc, s)


def _avx2_pmadd(builder, x, y):
    """vpmaddubsw then vpmaddwd by ones: per int32 lane, the 4-byte sum of u8(x) * s8(y)
    (exact while each pair of products fits in int16)."""
    p16 = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [_V32I8, _V32I8], [x, y])
    ones = ir.Constant(_V16I16, [1] * 16)
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [_V16I16, _V16I16], [p16, ones])


def _avx2_halves(builder, acc, a, b, half_dot):
    """acc + half_dot applied to each 256-bit half of the 512-bit byte vectors a and b."""
    a8 = builder.bitcast(a, _V64I8)
    b8 = builder.bitcast(b, _V64I8)
    halves = []
    for q in range(2):
        idx = ir.Constant(ir.VectorType(_I32, 32), list(range(32 * q, 32 * q + 32)))
        halves.append(half_dot(builder.shuffle_vector(a8, a8, idx),
                               builder.shuffle_vector(b8, b8, idx)))
    return builder.add(acc, _concat(builder, halves[0], halves[1], 16))


def _dpbusd_avx2(builder, acc, a, b):
    """Exact u8 x s8 dot on AVX2 for ``b`` bytes in [-127, 127] (all activation quantizations
    stay there). With w = a - 128 as signed bytes, sum(a*b) = sum(|w| * (b signed like w)) +
    128 * sum(b); both products pair up within int16, so vpmaddubsw never saturates."""
    bias = ir.Constant(_V32I8, [-128] * 32)

    def half_dot(pa, pb):
        w = builder.xor(pa, bias)
        mag = _call(builder, "llvm.abs.v32i8", _V32I8, [_V32I8, ir.IntType(1)],
                    [w, ir.Constant(ir.IntType(1), 0)])  # |-128| stays 0x80 = 128 unsigned
        signed = _call(builder, "llvm.x86.avx2.psign.b", _V32I8, [_V32I8, _V32I8], [pb, w])
        return builder.add(_avx2_pmadd(builder, mag, signed), _avx2_pmadd(builder, bias, pb))
    return _avx2_halves(builder, acc, a, b, half_dot)


def _dpbusd(builder, acc, a, b):
    if isa() == "avx512vnni":
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", _V16I32, [_V16I32] * 3, [acc, a, b])
    if isa() == "avxvnni":
        v8 = ir.VectorType(_I32, 8)
        alo, ahi = _halves(builder, a, 16)
        blo, bhi = _halves(builder, b, 16)
        clo, chi = _halves(builder, acc, 16)
        lo = _call(builder, "llvm.x86.avx512.vpdpbusd.256", v8, [v8] * 3, [clo, alo, blo])
        hi = _call(builder, "llvm.x86.avx512.vpdpbusd.256", v8, [v8] * 3, [chi, ahi, bhi])
        return _concat(builder, lo, hi, 16)
    if isa() == "avx2":
        return _dpbusd_avx2(builder, acc, a, b)
    return _dpbusd_generic(builder, acc, a, b)


# ----------------------------------------------------------------------------- loads / stores

@intrinsic
def vi_load(typingctx, arr, off):
    """64 bytes of ``arr`` from byte offset ``off`` as a VI (unaligned)."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.load(_typed_ptr(builder, p, _V16I32), align=1)
    return VI(arr, off), cg


@intrinsic
def vi_bcast4(typingctx, arr, off):
    """The 4 bytes at byte offset ``off`` repeated in all 16 lanes."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        v = builder.load(_typed_ptr(builder, p, _I32), align=1)
        return _splat(builder, v, _V16I32)
    return VI(arr, off), cg


@intrinsic
def vi_load_u8(typingctx, arr, off):
    """16 bytes from byte offset ``off``, zero-extended to 16 int32 lanes."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        v = builder.load(_typed_ptr(builder, p, _V16I8), align=1)
        return builder.zext(v, _V16I32)
    return VI(arr, off), cg


@intrinsic
def vi_load_i8(typingctx, arr, off):
    """16 bytes from byte offset ``off``, sign-extended to 16 int32 lanes."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        v = builder.load(_typed_ptr(builder, p, _V16I8), align=1)
        return builder.sext(v, _V16I32)
    return VI(arr, off), cg


@intrinsic
def vi_store(typingctx, arr, off, v):
    """Store a VI as 64 bytes at byte offset ``off``."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(args[2], _typed_ptr(builder, p, _V16I32), align=1)
        return context.get_dummy_value()
    return types.void(arr, off, v), cg


@intrinsic
def vf_load(typingctx, arr, off):
    """16 float32 from byte offset ``off``."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        return builder.load(_typed_ptr(builder, p, _V16F32), align=1)
    return VF(arr, off), cg


def _f16_bits_to_f32(builder, h):
    """Exact half -> float from 16 x i16 bits using integer ops (for targets without F16C)."""
    c = lambda x: _splat(builder, ir.Constant(_I32, x), _V16I32)  # noqa: E731
    w = builder.zext(h, _V16I32)
    sign = builder.shl(builder.and_(w, c(0x8000)), c(16))
    mag = builder.shl(builder.and_(w, c(0x7FFF)), c(13))
    # Scaling the shifted pattern by 2**112 rebiases the exponent and handles subnormals.
    scaled = builder.fmul(builder.bitcast(mag, _V16F32),
                          builder.bitcast(c(0x77800000), _V16F32))
    special = builder.icmp_unsigned(">=", mag, c(0x0F800000))  # exponent 31: inf / nan
    infnan = builder.bitcast(builder.or_(mag, c(0x7F800000)), _V16F32)
    mag_f = builder.select(special, infnan, scaled)
    return builder.bitcast(builder.or_(builder.bitcast(mag_f, _V16I32), sign), _V16F32)


@intrinsic
def vf_load_f16(typingctx, arr, off):
    """16 IEEE half floats from byte offset ``off``, widened exactly to float32."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        if has_f16c():
            v = builder.load(_typed_ptr(builder, p, _V16F16), align=1)
            return builder.fpext(v, _V16F32)
        return _f16_bits_to_f32(builder, builder.load(_typed_ptr(builder, p, _V16I16), align=1))
    return VF(arr, off), cg


@intrinsic
def vf_load_bf16(typingctx, arr, off):
    """16 bfloat16 from byte offset ``off``, widened exactly to float32."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        v = builder.load(_typed_ptr(builder, p, _V16I16), align=1)
        w = builder.shl(builder.zext(v, _V16I32), _splat(builder, ir.Constant(_I32, 16), _V16I32))
        return builder.bitcast(w, _V16F32)
    return VF(arr, off), cg


@intrinsic
def vf_store(typingctx, arr, off, v):
    """Store a VF as 16 float32 at byte offset ``off``."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        builder.store(args[2], _typed_ptr(builder, p, _V16F32), align=1)
        return context.get_dummy_value()
    return types.void(arr, off, v), cg


@intrinsic
def store_u16(typingctx, arr, off, bits):
    """Store the low 16 bits of an integer at byte offset ``off`` (one 2-byte store)."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        w = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store(builder.trunc(w, _I16), _typed_ptr(builder, p, _I16), align=1)
        return context.get_dummy_value()
    return types.void(arr, off, bits), cg


@intrinsic
def prefetch(typingctx, arr, off):
    """Hint that the cache line at byte ``off`` of ``arr`` will be read soon (no fault if past
    the end: prefetches never trap)."""
    def cg(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1])
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.PointerType(_I8), _I32, _I32, _I32]),
            "llvm.prefetch.p0")
        builder.call(fn, [p, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return types.void(arr, off), cg


# ----------------------------------------------------------------------------- integer ops

@intrinsic
def vi_splat(typingctx, c):
    """An int32 scalar in all lanes."""
    def cg(context, builder, sig, args):
        return _splat(builder, _as_i32(context, builder, sig.args[0], args[0]), _V16I32)
    return VI(c), cg


@intrinsic
def vi_zero(typingctx):
    def cg(context, builder, sig, args):
        return ir.Constant(_V16I32, None)
    return VI(), cg


def _binop(name):
    @intrinsic
    def op(typingctx, a, b):
        def cg(context, builder, sig, args):
            return getattr(builder, name)(args[0], args[1])
        return VI(a, b), cg
    return op


vi_add = _binop("add")
vi_sub = _binop("sub")
vi_mul = _binop("mul")
vi_and = _binop("and_")
vi_or = _binop("or_")
vi_add.__doc__ = "Lane-wise int32 add."
vi_sub.__doc__ = "Lane-wise int32 subtract."
vi_mul.__doc__ = "Lane-wise int32 multiply (low 32 bits)."
vi_and.__doc__ = "Bitwise and."
vi_or.__doc__ = "Bitwise or."


@intrinsic
def vi_srl(typingctx, a, n):
    """Logical right shift of each int32 lane by a scalar count."""
    def cg(context, builder, sig, args):
        s = _splat(builder, _as_i32(context, builder, sig.args[1], args[1]), _V16I32)
        return builder.lshr(args[0], s)
    return VI(a, n), cg


@intrinsic
def vi_sll(typingctx, a, n):
    """Left shift of each int32 lane by a scalar count."""
    def cg(context, builder, sig, args):
        s = _splat(builder, _as_i32(context, builder, sig.args[1], args[1]), _V16I32)
        return builder.shl(args[0], s)
    return VI(a, n), cg


@intrinsic
def vi_dpbusd(typingctx, acc, a, b):
    """acc + (sum of u8(a) * s8(b) over each lane's 4 bytes), exact, per the target's ISA."""
    def cg(context, builder, sig, args):
        return _dpbusd(builder, args[0], args[1], args[2])
    return VI(acc, a, b), cg


def _dpbusd_narrow(builder, acc, a, b):
    """As _dpbusd, for ``a`` bytes of at most 64 and ``b`` bytes of at least -127: then each
    pair of products fits in int16, so AVX2's saturating vpmaddubsw is exact on the bytes as
    they are (two instructions per 256 bits instead of the sign trick's six)."""
    if isa() != "avx2":
        return _dpbusd(builder, acc, a, b)
    return _avx2_halves(builder, acc, a, b, lambda pa, pb: _avx2_pmadd(builder, pa, pb))


@intrinsic
def vi_dpbusd_narrow(typingctx, acc, a, b):
    """vi_dpbusd for weight bytes ``a`` of at most 64 and activation bytes ``b`` in
    [-127, 127] (every format narrower than 7 bits): the same exact result, cheaper on AVX2."""
    def cg(context, builder, sig, args):
        return _dpbusd_narrow(builder, args[0], args[1], args[2])
    return VI(acc, a, b), cg


@intrinsic
def vi_lut16(typingctx, table, idx):
    """Byte lookup: each byte of ``idx`` (0..15) replaced by that byte of ``table``'s first
    16 bytes (the table must repeat in every 16-byte lane)."""
    def cg(context, builder, sig, args):
        t8 = builder.bitcast(args[0], _V64I8)
        i8 = builder.bitcast(args[1], _V64I8)
        if isa() == "avx512vnni":
            r = _call(builder, "llvm.x86.avx512.pshuf.b.512", _V64I8, [_V64I8, _V64I8], [t8, i8])
        elif isa() in ("avxvnni", "avx2"):
            v32 = ir.VectorType(_I8, 32)
            lo_idx = ir.Constant(ir.VectorType(_I32, 32), list(range(32)))
            hi_idx = ir.Constant(ir.VectorType(_I32, 32), list(range(32, 64)))
            parts = []
            for sel in (lo_idx, hi_idx):
                tt = builder.shuffle_vector(t8, t8, sel)
                ii = builder.shuffle_vector(i8, i8, sel)
                parts.append(_call(builder, "llvm.x86.avx2.pshuf.b", v32, [v32, v32], [tt, ii]))
            r = builder.shuffle_vector(parts[0], parts[1],
                                       ir.Constant(ir.VectorType(_I32, 64), list(range(64))))
        elif isa() == "neon-dot":  # tbl per 128 bits (indices 0..15 never reach its zero case)
            parts = []
            for q in range(4):
                sel = ir.Constant(ir.VectorType(_I32, 16), list(range(16 * q, 16 * q + 16)))
                parts.append(_call(builder, "llvm.aarch64.neon.tbl1.v16i8", _V16I8,
                                   [_V16I8, _V16I8], [builder.shuffle_vector(t8, t8, sel),
                                                      builder.shuffle_vector(i8, i8, sel)]))
            r = _concat(builder, _concat(builder, parts[0], parts[1], 32),
                        _concat(builder, parts[2], parts[3], 32), 64)
        else:
            # Portable: a chain of selects over the 16 table entries.
            r = ir.Constant(_V64I8, None)
            first16 = [builder.extract_element(t8, ir.Constant(_I32, j)) for j in range(16)]
            for j in range(16):
                hit = builder.icmp_unsigned("==", i8, _splat(builder, ir.Constant(_I8, j), _V64I8))
                r = builder.select(hit, _splat(builder, first16[j], _V64I8), r)
        return builder.bitcast(r, _V16I32)
    return VI(table, idx), cg


# ----------------------------------------------------------------------------- float ops

@intrinsic
def vf_splat(typingctx, x):
    """A float32 scalar in all lanes."""
    def cg(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        return _splat(builder, v, _V16F32)
    return VF(x), cg


@intrinsic
def vf_zero(typingctx):
    def cg(context, builder, sig, args):
        return ir.Constant(_V16F32, None)
    return VF(), cg


@intrinsic
def vf_from_vi(typingctx, a):
    """Convert int32 lanes to float32 (round to nearest even, exact below 2**24)."""
    def cg(context, builder, sig, args):
        return builder.sitofp(args[0], _V16F32)
    return VF(a), cg


def _fbinop(name):
    @intrinsic
    def op(typingctx, a, b):
        def cg(context, builder, sig, args):
            # No fast-math flags: each add and multiply rounds on its own (no FMA contraction).
            return getattr(builder, name)(args[0], args[1])
        return VF(a, b), cg
    return op


vf_add = _fbinop("fadd")
vf_sub = _fbinop("fsub")
vf_mul = _fbinop("fmul")
vf_add.__doc__ = "Lane-wise float32 add (rounded, never fused)."
vf_sub.__doc__ = "Lane-wise float32 subtract (rounded, never fused)."
vf_mul.__doc__ = "Lane-wise float32 multiply (rounded, never fused)."


@intrinsic
def vf_lane(typingctx, v, i):
    """Lane ``i`` of a VF as a float32 scalar."""
    def cg(context, builder, sig, args):
        return builder.extract_element(args[0], _as_i32(context, builder, sig.args[1], args[1]))
    return types.float32(v, i), cg
