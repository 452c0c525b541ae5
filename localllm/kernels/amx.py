"""Intel AMX tile operations for the prompt matmuls (Sapphire Rapids and later Xeons).

A tile register holds up to 16 rows of 64 bytes. ``tile_dot`` (TDPBSUD) adds to an int32
tile C (M x N) the products of a signed-byte tile A (M rows of K bytes) with an unsigned-byte
tile B (K/4 rows of N groups of 4 bytes): exactly the layout of a repacked chunk-tile, whose
eight vectors hold 16 rows x 4 consecutive elements each; ``tile_dot_signed`` (TDPBSSD) takes
signed bytes in B. The sums are exact in int32
(wrapping as the VNNI sums wrap), so a kernel using these gives the VNNI kernels' bits.

Tile registers are named by compile-time constants. The tile shapes come from a 64-byte
configuration loaded by ``tile_config`` on the thread that runs the tiles; ``tile_release``
frees the thread's tile state. The process must first have asked the OS for the tile data
state (``hostcpu.amx_permission``); kernels only use these where ``simd.amx()`` says so.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils, errors
from numba.extending import intrinsic

_I8 = ir.IntType(8)
_I64 = ir.IntType(64)
_P8 = ir.PointerType(_I8)
_VOID = ir.VoidType()


def _call(builder, name, args, argtys):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VOID, argtys), name)
    builder.call(fn, args)


def _ptr(context, builder, arrty, arr, off):
    data = context.make_array(arrty)(context, builder, arr).data
    return builder.gep(builder.bitcast(data, _P8), [off])


def _tile(t) -> ir.Constant:
    if not isinstance(t, types.IntegerLiteral):
        raise errors.RequireLiteralValue("a tile register must be a constant")
    if not 0 <= t.literal_value < 8:
        raise errors.TypingError("tile registers are 0..7")
    return ir.Constant(_I8, t.literal_value)


def config_bytes(shapes: dict[int, tuple[int, int]]) -> np.ndarray:
    """The 64-byte tile configuration (palette 1) for {tile: (rows, bytes per row)}."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    for t, (rows, colsb) in shapes.items():
        cfg[16 + 2 * t] = colsb & 0xFF
        cfg[17 + 2 * t] = colsb >> 8
        cfg[48 + t] = rows
    return cfg


@intrinsic
def tile_config(typingctx, cfg):
    """Load the tile shapes from a 64-byte configuration array (LDTILECFG)."""
    def cg(context, builder, sig, args):
        _call(builder, "llvm.x86.ldtilecfg", [_ptr(context, builder, sig.args[0], args[0],
                                                    ir.Constant(_I64, 0))], [_P8])
        return context.get_dummy_value()
    return types.void(cfg), cg


@intrinsic
def tile_release(typingctx):
    """Free this thread's tile state (TILERELEASE)."""
    def cg(context, builder, sig, args):
        _call(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()
    return types.void(), cg


@intrinsic
def tile_zero(typingctx, t):
    """Zero tile register ``t``."""
    reg = _tile(t)

    def cg(context, builder, sig, args):
        _call(builder, "llvm.x86.tilezero", [reg], [_I8])
        return context.get_dummy_value()
    return types.void(t), cg


@intrinsic
def tile_load(typingctx, t, arr, off, stride):
    """Load tile register ``t`` from byte ``off`` of ``arr``, rows ``stride`` bytes apart."""
    reg = _tile(t)

    def cg(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[1], args[1], args[2])
        s = context.cast(builder, args[3], sig.args[3], types.int64)
        _call(builder, "llvm.x86.tileloadd64", [reg, p, s], [_I8, _P8, _I64])
        return context.get_dummy_value()
    return types.void(t, arr, off, stride), cg


@intrinsic
def tile_store(typingctx, t, arr, off, stride):
    """Store tile register ``t`` at byte ``off`` of ``arr``, rows ``stride`` bytes apart."""
    reg = _tile(t)

    def cg(context, builder, sig, args):
        p = _ptr(context, builder, sig.args[1], args[1], args[2])
        s = context.cast(builder, args[3], sig.args[3], types.int64)
        _call(builder, "llvm.x86.tilestored64", [reg, p, s], [_I8, _P8, _I64])
        return context.get_dummy_value()
    return types.void(t, arr, off, stride), cg


def _dot(name):
    def typer(typingctx, c, a, b):
        regs = [_tile(c), _tile(a), _tile(b)]

        def cg(context, builder, sig, args):
            _call(builder, name, regs, [_I8, _I8, _I8])
            return context.get_dummy_value()
        return types.void(c, a, b), cg
    return typer


tile_dot = intrinsic(_dot("llvm.x86.tdpbsud"))
tile_dot.__doc__ = "C += A (signed bytes) . B (unsigned bytes), int32 sums (TDPBSUD)."
tile_dot_signed = intrinsic(_dot("llvm.x86.tdpbssd"))
tile_dot_signed.__doc__ = "C += A (signed bytes) . B (signed bytes), int32 sums (TDPBSSD)."
