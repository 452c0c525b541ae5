"""The CPU backend's decoder block as one Numba call: the same row and tile kernels that the
op-by-op path uses, in the same order, without a Python round trip between them.

Absent optional tensors (biases, QK-norm, post-norms) are passed as empty arrays.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import prange
from numba.extending import overload

from localllm.kernels import attention as attn_k
from localllm.kernels import packing as P
from localllm.kernels.actquant import act_buffers, quantize_q8_32_row, quantize_q8_256_row
from localllm.kernels.jit import njit
from localllm.kernels.matmul import matmul_tile
from localllm.kernels.ops import add_row, glu, rms_norm_row, rope_row

# A layer's tensors as the kernel takes them (packed weights, float32 vectors; absent ones
# empty), and the sizes that select its loops.
BlockArrays = namedtuple("BlockArrays", [
    "attn_norm", "wq", "wk", "wv", "bq", "bk", "bv", "q_norm", "k_norm", "wo",
    "post_attn_norm", "ffn_norm", "w_gate", "w_up", "w_down", "post_ffn_norm", "k_balance"])
# q_rows, kv_rows, f_rows, d_rows: padded output widths (whole 16-row tiles) of the
# projections to q, k/v, the hidden layer and back to dim.
BlockConfig = namedtuple("BlockConfig", [
    "eps", "n_heads", "n_kv", "hd", "neox", "window", "scale", "gelu", "hidden",
    "q_rows", "kv_rows", "f_rows", "d_rows"])


def reads(w):
    """(reads 32-block activations, reads 256-block activations) for a packed weight."""


@overload(reads, inline="always")
def _ol_reads(w):
    name = w.instance_class.__name__[len("Packed"):]
    r32 = name not in P.SUPERBLOCK_FORMATS and name not in P.FLOAT_FORMATS
    r256 = name in P.SUPERBLOCK_FORMATS
    return lambda w: (r32, r256)


@njit(cache=True, inline="always")
def _prep_row(t, x, norm_w, eps, h, a32, a256):
    """Row t: optional RMSNorm of x into h, then its quantized forms."""
    if norm_w.size > 0:
        rms_norm_row(x[t], norm_w, eps, h[t])
    if a32[0].shape[0] > 0:
        quantize_q8_32_row(h[t], a32[0][t], a32[1][t], a32[2][t], a32[3][t])
    if a256[0].shape[0] > 0:
        quantize_q8_256_row(h[t], a256[0][t], a256[1][t], a256[2][t])


@njit(cache=True, parallel=True)
def prepare(x, norm_w, eps, h, a32, a256):
    """h = rmsnorm(x) (or h as given when norm_w is empty), quantized for the matmuls."""
    n = x.shape[0]
    if n == 1:
        _prep_row(0, x, norm_w, eps, h, a32, a256)
    else:
        for t in prange(n):
            _prep_row(t, x, norm_w, eps, h, a32, a256)


@njit(cache=True, parallel=True)
def linear3(w1, w2, w3, a32, a256, h, o1, o2, o3):
    """Three matmuls reading the same input, their tiles in one parallel loop."""
    n1 = o1.shape[1] // 16
    n2 = o2.shape[1] // 16
    n3 = o3.shape[1] // 16
    for j in prange(n1 + n2 + n3):
        if j < n1:
            matmul_tile(w1, j, a32, a256, h, o1)
        elif j < n1 + n2:
            matmul_tile(w2, j - n1, a32, a256, h, o2)
        else:
            matmul_tile(w3, j - n1 - n2, a32, a256, h, o3)


@njit(cache=True, parallel=True)
def linear2(w1, w2, a32, a256, h, o1, o2):
    """Two matmuls reading the same input, their tiles in one parallel loop."""
    n1 = o1.shape[1] // 16
    n2 = o2.shape[1] // 16
    for j in prange(n1 + n2):
        if j < n1:
            matmul_tile(w1, j, a32, a256, h, o1)
        else:
            matmul_tile(w2, j - n1, a32, a256, h, o2)


@njit(cache=True, parallel=True)
def linear1(w, a32, a256, h, o):
    for j in prange(o.shape[1] // 16):
        matmul_tile(w, j, a32, a256, h, o)


@njit(cache=True, inline="always")
def _qk_row(t, q, k, v, bq, bk, bv, q_norm, k_norm, eps, cos, sin, neox, hd):
    if bq.size > 0:
        add_row(q[t], bq)
        add_row(k[t], bk)
        add_row(v[t], bv)
    for h in range(q.shape[1] // hd):
        qh = q[t, h * hd:(h + 1) * hd]
        if q_norm.size > 0:
            rms_norm_row(qh, q_norm, eps, qh)
        rope_row(qh, cos[t], sin[t], neox)
    for h in range(k.shape[1] // hd):
        kh = k[t, h * hd:(h + 1) * hd]
        if k_norm.size > 0:
            rms_norm_row(kh, k_norm, eps, kh)
        rope_row(kh, cos[t], sin[t], neox)


@njit(cache=True, parallel=True)
def qk_prepare(q, k, v, bq, bk, bv, q_norm, k_norm, eps, cos, sin, neox, hd):
    """Biases, QK-norm and rotary embedding of every head, in place."""
    n = q.shape[0]
    if n == 1:
        _qk_row(0, q, k, v, bq, bk, bv, q_norm, k_norm, eps, cos, sin, neox, hd)
    else:
        for t in prange(n):
            _qk_row(t, q, k, v, bq, bk, bv, q_norm, k_norm, eps, cos, sin, neox, hd)


@njit(cache=True, inline="always")
def _residual_row(t, x, y, post_norm, eps):
    if post_norm.size > 0:
        rms_norm_row(y[t], post_norm, eps, y[t])
    add_row(x[t], y[t])


@njit(cache=True, parallel=True)
def residual(x, y, post_norm, eps):
    """x += (post_norm ? rmsnorm(y) : y)."""
    n = x.shape[0]
    if n == 1:
        _residual_row(0, x, y, post_norm, eps)
    else:
        for t in prange(n):
            _residual_row(t, x, y, post_norm, eps)


# nogil: a server's event loop (or a UI) keeps running while a layer computes.
@njit(cache=True, parallel=True, nogil=True)
def decoder_block(x, w, cfg, kv, positions, cos, sin):
    """One decoder block for n tokens, in place on x (n, dim).

    Args:
        x: float32 (n, dim) hidden states, updated in place.
        w: BlockArrays; cfg: BlockConfig.
        kv: attention.PagedKV: this layer's pages and the batch's block tables.
        positions: int64 (n,); cos, sin: (n, n_rot // 2) tables.
    """
    attn_norm, wq, wk, wv = w.attn_norm, w.wq, w.wk, w.wv
    bq, bk, bv, q_norm, k_norm = w.bq, w.bk, w.bv, w.q_norm, w.k_norm
    wo, post_attn_norm, ffn_norm = w.wo, w.post_attn_norm, w.ffn_norm
    w_gate, w_up, w_down, post_ffn_norm = w.w_gate, w.w_up, w.w_down, w.post_ffn_norm
    eps, n_heads, n_kv, hd = cfg.eps, cfg.n_heads, cfg.n_kv, cfg.hd
    neox, window, scale, gelu, hidden = cfg.neox, cfg.window, cfg.scale, cfg.gelu, cfg.hidden
    q_rows, kv_rows, f_rows, d_rows = cfg.q_rows, cfg.kv_rows, cfg.f_rows, cfg.d_rows
    n, dim = x.shape

    # attention
    r1, s1 = reads(wq)
    r2, s2 = reads(wk)
    r3, s3 = reads(wv)
    h = np.empty_like(x)
    a32, a256 = act_buffers(n, dim, r1 or r2 or r3, s1 or s2 or s3)
    prepare(x, attn_norm, eps, h, a32, a256)
    q = np.empty((n, q_rows), np.float32)
    k = np.empty((n, kv_rows), np.float32)
    v = np.empty((n, kv_rows), np.float32)
    linear3(wq, wk, wv, a32, a256, h, q, k, v)
    qd, kvd = n_heads * hd, n_kv * hd
    q = q[:, :qd].copy() if q_rows != qd else q
    k = k[:, :kvd].copy() if kv_rows != kvd else k
    v = v[:, :kvd].copy() if kv_rows != kvd else v
    qk_prepare(q, k, v, bq, bk, bv, q_norm, k_norm, eps, cos, sin, neox, hd)
    o2 = np.empty((n, qd), np.float32)
    attn_k.paged_attention(q, k, v, kv.K, kv.V, kv.tables, kv.row_seq, kv.block_size, n_kv,
                           positions, window, scale, w.k_balance, np.empty(0, np.float32), o2)
    r, s = reads(wo)
    b32, b256 = act_buffers(n, qd, r, s)
    prepare(o2, np.empty(0, np.float32), eps, o2, b32, b256)
    y = np.empty((n, d_rows), np.float32)
    linear1(wo, b32, b256, o2, y)
    y = y[:, :dim].copy() if d_rows != dim else y
    residual(x, y, post_attn_norm, eps)

    # feed-forward
    r1, s1 = reads(w_gate)
    r2, s2 = reads(w_up)
    c32, c256 = act_buffers(n, dim, r1 or r2, s1 or s2)
    prepare(x, ffn_norm, eps, h, c32, c256)
    gate = np.empty((n, f_rows), np.float32)
    up = np.empty((n, f_rows), np.float32)
    linear2(w_gate, w_up, c32, c256, h, gate, up)
    if f_rows != hidden:
        gate = gate[:, :hidden].copy()
        up = up[:, :hidden].copy()
    act = np.empty((n, hidden), np.float32)
    glu(gate, up, act, gelu)
    r, s = reads(w_down)
    e32, e256 = act_buffers(n, hidden, r, s)
    prepare(act, np.empty(0, np.float32), eps, act, e32, e256)
    y2 = np.empty((n, d_rows), np.float32)
    linear1(w_down, e32, e256, act, y2)
    y2 = y2[:, :dim].copy() if d_rows != dim else y2
    # The last residual runs here (not through residual()) so that this function holds a
    # parallel loop itself: Numba then starts its thread pool whenever it loads this kernel
    # from the cache, which the parallel kernels it calls rely on.
    for t in prange(n):
        _residual_row(t, x, y2, post_ffn_norm, eps)
