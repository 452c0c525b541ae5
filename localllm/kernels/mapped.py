"""y = x @ W.T for a weight left in the GGUF's own row layout (a view of the mapped file).

Each 16-row tile is repacked on the fly into a small per-thread tile (packing.py's layout)
and multiplied by matmul.py's tile kernel, so every output element is computed by exactly
the operations the packed path uses: the same bits, whichever path ran and however the
tokens were grouped. The file's bytes are read, never copied whole; the working memory is
one tile per thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from numba import prange

from localllm.formats import quants

from . import packing as P
from .jit import njit
from .matmul import _NO_Q32, _NO_Q256, QuantActivations, matmul_tile, matmul_tile_at, needs

# Quantized formats whose tiles can be formed on the fly (float weights are transposed by
# numpy at packing time, and stay packed).
MAPPABLE = frozenset(P._CODE)


@dataclass(frozen=True)
class MappedWeight:
    """A weight matrix W (N, K) read from the GGUF's blocks in place: ``rows`` is a
    read-only (N, row bytes) uint8 view of the mapped file."""
    type_name: str
    N: int
    K: int
    rows: np.ndarray

    @property
    def padded_rows(self) -> int:
        return -(-self.N // P.ROWS) * P.ROWS

    @property
    def nbytes(self) -> int:
        """Anonymous bytes held: none (the rows are the file's pages)."""
        return 0

    @property
    def file_nbytes(self) -> int:
        return int(self.rows.nbytes)


def can_map(type_name: str, N: int, K: int) -> bool:
    """Whether a (N, K) weight of this type is computed from the file in place: a quantized
    format and whole 16-row tiles (a padded last tile would need a copy of its rows)."""
    return type_name in MAPPABLE and N % P.ROWS == 0


def view(type_name: str, raw: np.ndarray, N: int, K: int) -> MappedWeight:
    """A MappedWeight over ``raw`` (the tensor's bytes, zero-copy).

    Raises:
        ValueError: a format or shape ``can_map`` refuses, or a byte count that does not
            match the shape.
    """
    if not can_map(type_name, N, K):
        raise ValueError(f"a ({N}, {K}) {type_name} weight cannot be read in place")
    if type_name in P.SUPERBLOCK_FORMATS and K % 256 or K % 32:
        raise ValueError(f"{type_name} rows of {K} elements are not whole blocks")
    rows = np.asarray(raw, np.uint8).reshape(N, quants.row_nbytes(type_name, K))
    if rows.flags.writeable:  # one compiled signature: the mapped file's views are read-only
        rows = rows.view()
        rows.flags.writeable = False
    return MappedWeight(type_name, N, K, rows)


@njit(inline="always")
def _mxfp4_scales(rows, r0, K, tile, d):
    """E8M0 bytes of rows r0..r0+15 -> float32 scales 2**(e - 128), [tile][block][row]
    (formats.quants.e8m0_half, bit for bit)."""
    nb = K // 32
    for b in range(nb):
        for r in range(P.ROWS):
            e = np.uint32(rows[r0 + r, b * 17])
            if e < 2:
                bits = np.uint32(0x00200000) << e
            else:
                bits = (e - np.uint32(1)) << np.uint32(23)
            o = ((tile * nb + b) * P.ROWS + r) * 4
            for i in range(4):
                d[o + i] = np.uint8((bits >> np.uint32(8 * i)) & np.uint32(255))


@njit(parallel=True, cache=True, nogil=True)
def mapped_kernel(code, rows, w, qs, hb, d, m, sc, mn, a32, a256, x, out, tmp):
    """out = x @ W.T for raw rows ``rows``: tile by tile, each repacked into slot s of the
    scratch weight ``w`` (whose arrays are qs, hb, d, m, sc, mn) and multiplied into slot
    s of ``tmp`` (n, 16 * slots), then copied to its columns of ``out``."""
    n = out.shape[0]
    K = x.shape[1]
    n_tiles = out.shape[1] // P.ROWS
    slots = tmp.shape[1] // P.ROWS
    for s in prange(slots):
        v = np.empty(8, np.int64)
        for tile in range(s, n_tiles, slots):
            r0 = tile * P.ROWS
            P.repack_tile_quants(code, rows, r0, K, s, qs, hb, v)
            if code == P._MXFP4:
                _mxfp4_scales(rows, r0, K, s, d)
            else:
                P.repack_tile_scales(code, rows, r0, K, s, d, m, sc, mn)
            matmul_tile(w, s, a32, a256, x, tmp)
            for t in range(n):
                for r in range(P.ROWS):
                    out[t, r0 + r] = tmp[t, s * P.ROWS + r]


def matmul_mapped(weight: MappedWeight, act: QuantActivations) -> np.ndarray:
    """y = x @ W.T, bit-identical to ``matmul.matmul`` on the packed weight.

    Args:
        weight: a MappedWeight (N, K).
        act: activations quantized in the form the weight's format reads.
    Returns:
        float32 (n, N).
    Raises:
        ValueError: mismatched shapes, or activations lacking the form the weight reads.
    """
    n, K = act.x.shape
    if K != weight.K:
        raise ValueError(f"matmul: x has {K} features, weight expects {weight.K}")
    kind = needs(weight)
    if getattr(act, kind) is None:
        raise ValueError(f"matmul: {weight.type_name} reads {kind} activations, "
                         "which were not made")
    name = weight.type_name
    slots = max(1, min(numba.get_num_threads(), weight.N // P.ROWS))
    fields = P._alloc(name, slots * P.ROWS, K)
    if name in ("IQ4_NL", "IQ4_XS"):
        fields["lut"] = P._IQ4_LUT
    elif name == "MXFP4":
        fields["lut"] = P._MXFP4_LUT
    w = P.packed_class(name)(**fields)
    empty = P._EMPTY
    out = np.empty((n, weight.N), np.float32)
    tmp = np.empty((n, slots * P.ROWS), np.float32)
    mapped_kernel(P._CODE[name], weight.rows, w, fields["qs"].view(np.uint32),
                  fields.get("hb", empty).view(np.uint32), fields["d"],
                  fields.get("m", fields.get("dmin", empty)), fields.get("sc", empty),
                  fields.get("mn", empty), act.q32 or _NO_Q32, act.q256 or _NO_Q256, act.x,
                  out, tmp)
    return out


@njit(parallel=True, cache=True, nogil=True)
def mapped_stack_kernel(code, rows3, ids, w, qs, hb, d, m, sc, mn, a32, a256, x, out, tmp):
    """out[j] = x[j] @ W[ids[j]].T (x[0] for every j when x has one row) for a stack of
    raw matrices ``rows3`` (n_experts, N, row bytes): all (j, tile) pairs in one parallel
    region, each tile formed and multiplied as ``mapped_kernel`` does."""
    K = x.shape[1]
    n_tiles = out.shape[1] // P.ROWS
    n_items = ids.shape[0] * n_tiles
    slots = tmp.shape[1] // P.ROWS
    for s in prange(slots):
        v = np.empty(8, np.int64)
        for item in range(s, n_items, slots):
            j = item // n_tiles
            r0 = (item % n_tiles) * P.ROWS
            rows = rows3[ids[j]]
            P.repack_tile_quants(code, rows, r0, K, s, qs, hb, v)
            if code == P._MXFP4:
                _mxfp4_scales(rows, r0, K, s, d)
            else:
                P.repack_tile_scales(code, rows, r0, K, s, d, m, sc, mn)
            r = 0 if x.shape[0] == 1 else j
            matmul_tile(w, s, (a32[0][r:r + 1], a32[1][r:r + 1], a32[2][r:r + 1],
                               a32[3][r:r + 1]),
                        (a256[0][r:r + 1], a256[1][r:r + 1], a256[2][r:r + 1]),
                        x[r:r + 1], tmp[j:j + 1])
            for q in range(P.ROWS):
                out[j, r0 + q] = tmp[j, s * P.ROWS + q]


def _scratch(name: str, slots: int, K: int):
    fields = P._alloc(name, slots * P.ROWS, K)
    if name in ("IQ4_NL", "IQ4_XS"):
        fields["lut"] = P._IQ4_LUT
    elif name == "MXFP4":
        fields["lut"] = P._MXFP4_LUT
    return P.packed_class(name)(**fields), fields


def matmul_stack(type_name: str, rows3: np.ndarray, ids: np.ndarray,
                 act: QuantActivations) -> np.ndarray:
    """out[j] = act row j (or its only row) @ W_{ids[j]}.T for a stack of raw matrices in one
    parallel region (a decode step's experts without a region per matrix); bit-identical
    to ``matmul_mapped`` on each expert's view.

    Args:
        type_name: GGML type; rows3: read-only uint8 (n_experts, N, row bytes), the file's.
        ids: int (m,) the experts; act: m rows, or one row shared by all.
    Returns:
        float32 (m, N).
    """
    E, N, _ = rows3.shape
    K = act.x.shape[1]
    n = act.x.shape[0]
    if rows3.shape[2] != quants.row_nbytes(type_name, K) or n not in (1, len(ids)):
        raise ValueError(f"matmul_stack: x is {act.x.shape} for {E} x ({N}, ?) {type_name}")
    kind = "q256" if type_name in P.SUPERBLOCK_FORMATS else "q32"
    if getattr(act, kind) is None:
        raise ValueError(f"matmul_stack: {type_name} reads {kind} activations")
    slots = max(1, min(numba.get_num_threads(), len(ids) * (N // P.ROWS)))
    w, fields = _scratch(type_name, slots, K)
    empty = P._EMPTY
    out = np.empty((len(ids), N), np.float32)
    tmp = np.empty((len(ids), slots * P.ROWS), np.float32)
    mapped_stack_kernel(P._CODE[type_name], rows3, np.ascontiguousarray(ids, np.int64), w,
                        fields["qs"].view(np.uint32), fields.get("hb", empty).view(np.uint32),
                        fields["d"], fields.get("m", fields.get("dmin", empty)),
                        fields.get("sc", empty), fields.get("mn", empty),
                        act.q32 or _NO_Q32, act.q256 or _NO_Q256, act.x, out, tmp)
    return out


# ----------------------------------------------------------------------------- expert pools

@njit(parallel=True, cache=True, nogil=True)
def pool_stack_kernel(pool_a, slots_a, pool_b, slots_b, n_tiles, a32, a256, x, out_a, out_b):
    """out_a[j] = x[j] (x[0] for every j when x has one row) @ W.T for the packed matrix of
    ``n_tiles`` tiles in slot ``slots_a[j]`` of ``pool_a`` (a packed weight of many such
    matrices, slot s from tile s * n_tiles), and out_b likewise from ``pool_b`` (a second
    pool of the same format and shape, such as a layer's up experts beside its gate; an
    empty ``slots_b`` for none): every (matrix, tile) pair in one parallel region."""
    n_a = np.int64(slots_a.shape[0] * n_tiles)
    n_b = np.int64(slots_b.shape[0] * n_tiles)
    for item in prange(n_a + n_b):
        it = np.int64(item)  # prange's index is unsigned: keep the arithmetic in int64
        second = it >= n_a
        i = it - n_a if second else it
        j = i // n_tiles
        t = i % n_tiles
        r = 0 if x.shape[0] == 1 else j
        pool = pool_b if second else pool_a
        slot = slots_b[j] if second else slots_a[j]
        out = out_b if second else out_a
        matmul_tile_at(pool, slot * n_tiles + t, t,
                       (a32[0][r:r + 1], a32[1][r:r + 1], a32[2][r:r + 1], a32[3][r:r + 1]),
                       (a256[0][r:r + 1], a256[1][r:r + 1], a256[2][r:r + 1]),
                       x[r:r + 1], out[j:j + 1])


@njit(parallel=True, cache=True, nogil=True)
def pool_matmul_kernel(pool, slot, n_tiles, a32, a256, x, out):
    """out = x @ W.T for the packed matrix in slot ``slot`` of ``pool`` (every row of x)."""
    for t in prange(n_tiles):
        matmul_tile_at(pool, slot * n_tiles + t, t, a32, a256, x, out)
