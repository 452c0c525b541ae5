"""The CPU backend's decoder blocks as one Numba call each: the same row and tile kernels that
the op-by-op path uses, in the same order, without a Python round trip between them. A
Llama-style attention block (``decoder_block``), and a Gated DeltaNet block with a dense FFN
(``delta_block``, Qwen3.5's linear-attention layers); a decode step's mixture of experts in two
calls (``moe_route_one``, then ``moe_experts_one`` once the caller has its experts' pool slots).

Absent optional tensors (biases, QK-norm, post-norms) are passed as empty arrays.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import prange
from numba.extending import overload

from localllm.kernels import attention as attn_k
from localllm.kernels import deltanet
from localllm.kernels import moe as moe_k
from localllm.kernels.mapped import pool_stack_kernel
from localllm.kernels import packing as P
from localllm.kernels.actquant import act_buffers, quantize_q8_32_row, quantize_q8_256_row
from localllm.kernels.jit import njit
from localllm.kernels.matmul import matmul_tile
from localllm.kernels.ops import add_row, glu, rms_norm_heads, rms_norm_row, rope_row

# A layer's tensors as the kernel takes them (packed weights, float32 vectors; absent ones
# empty), and the sizes that select its loops.
BlockArrays = namedtuple("BlockArrays", [
    "attn_norm", "wq", "wk", "wv", "bq", "bk", "bv", "q_norm", "k_norm", "wo",
    "post_attn_norm", "ffn_norm", "w_gate", "w_up", "w_down", "post_ffn_norm", "k_balance"])
# A DeltaNet block's tensors: the mixer's (conv_t: the conv kernel transposed, (K, C)) and
# its dense FFN's.
DeltaArrays = namedtuple("DeltaArrays", [
    "attn_norm", "wqkv", "wz", "wbeta", "walpha", "conv_t", "dt_bias", "a", "ssm_norm", "wout",
    "ffn_norm", "w_gate", "w_up", "w_down"])
# l2_eps: the q/k L2 norms' epsilon; n_k, n_v, hd: the DeltaNet's key and value heads and
# head size; gelu, hidden: the FFN's;
# *_rows: padded output widths of the projections to qkv, z, beta/alpha, the FFN's hidden
# layer and back to dim.
DeltaConfig = namedtuple("DeltaConfig", [
    "eps", "l2_eps", "n_k", "n_v", "hd", "gelu", "hidden", "qkv_rows", "z_rows", "h_rows", "f_rows",
    "d_rows"])
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
def linear4(w1, w2, w3, w4, a32, a256, h, o1, o2, o3, o4):
    """Four matmuls reading the same input, their tiles in one parallel loop."""
    n1 = o1.shape[1] // 16
    n2 = o2.shape[1] // 16
    n3 = o3.shape[1] // 16
    n4 = o4.shape[1] // 16
    for j in prange(n1 + n2 + n3 + n4):
        if j < n1:
            matmul_tile(w1, j, a32, a256, h, o1)
        elif j < n1 + n2:
            matmul_tile(w2, j - n1, a32, a256, h, o2)
        elif j < n1 + n2 + n3:
            matmul_tile(w3, j - n1 - n2, a32, a256, h, o3)
        else:
            matmul_tile(w4, j - n1 - n2 - n3, a32, a256, h, o4)


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
    # a norm weight as wide as all heads normalises them at once (OLMoE), else each head
    if q_norm.size > hd:
        rms_norm_row(q[t], q_norm, eps, q[t])
    for h in range(q.shape[1] // hd):
        qh = q[t, h * hd:(h + 1) * hd]
        if 0 < q_norm.size <= hd:
            rms_norm_row(qh, q_norm, eps, qh)
        rope_row(qh, cos[t], sin[t], neox)
    if k_norm.size > hd:
        rms_norm_row(k[t], k_norm, eps, k[t])
    for h in range(k.shape[1] // hd):
        kh = k[t, h * hd:(h + 1) * hd]
        if 0 < k_norm.size <= hd:
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


@njit(cache=True)
def _attention_half(x, attn_norm, wq, wk, wv, bq, bk, bv, q_norm, k_norm, wo, post_attn_norm,
                    k_balance, cfg, kv, positions, cos, sin, h):
    """x += the attention sublayer's output for x (h: scratch like x)."""
    eps, n_heads, n_kv, hd = cfg.eps, cfg.n_heads, cfg.n_kv, cfg.hd
    neox, window, scale = cfg.neox, cfg.window, cfg.scale
    q_rows, kv_rows, d_rows = cfg.q_rows, cfg.kv_rows, cfg.d_rows
    n, dim = x.shape
    r1, s1 = reads(wq)
    r2, s2 = reads(wk)
    r3, s3 = reads(wv)
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
                           positions, window, scale, k_balance, np.empty(0, np.float32), o2)
    r, s = reads(wo)
    b32, b256 = act_buffers(n, qd, r, s)
    prepare(o2, np.empty(0, np.float32), eps, o2, b32, b256)
    y = np.empty((n, d_rows), np.float32)
    linear1(wo, b32, b256, o2, y)
    y = y[:, :dim].copy() if d_rows != dim else y
    residual(x, y, post_attn_norm, eps)


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
    ffn_norm = w.ffn_norm
    w_gate, w_up, w_down, post_ffn_norm = w.w_gate, w.w_up, w.w_down, w.post_ffn_norm
    eps, gelu, hidden, f_rows, d_rows = cfg.eps, cfg.gelu, cfg.hidden, cfg.f_rows, cfg.d_rows
    n, dim = x.shape
    h = np.empty_like(x)
    _attention_half(x, w.attn_norm, w.wq, w.wk, w.wv, w.bq, w.bk, w.bv, w.q_norm, w.k_norm,
                    w.wo, w.post_attn_norm, w.k_balance, cfg, kv, positions, cos, sin, h)

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


# An attention sublayer's tensors and the norm of the FFN that follows it (a block whose FFN
# runs apart: a mixture of experts).
AttnArrays = namedtuple("AttnArrays", [
    "attn_norm", "wq", "wk", "wv", "bq", "bk", "bv", "q_norm", "k_norm", "wo",
    "post_attn_norm", "ffn_norm", "k_balance"])


@njit(cache=True, parallel=True, nogil=True)
def attention_block(x, w, cfg, kv, positions, cos, sin, h):
    """decoder_block's attention sublayer, in place on x, and h = rmsnorm(x) with the FFN's
    norm (the input of an FFN the caller runs: a mixture of experts). w: AttnArrays."""
    _attention_half(x, w.attn_norm, w.wq, w.wk, w.wv, w.bq, w.bk, w.bv, w.q_norm, w.k_norm,
                    w.wo, w.post_attn_norm, w.k_balance, cfg, kv, positions, cos, sin, h)
    # a parallel loop of its own (see decoder_block), reading no tuples (a tuple of packed
    # weights cannot be passed into a parallel loop's body)
    ffn_norm, eps = w.ffn_norm, cfg.eps
    for t in prange(x.shape[0]):
        rms_norm_row(x[t], ffn_norm, eps, h[t])


@njit(cache=True, inline="always")
def _cols(a, n_cols):
    """The first n_cols columns of a padded matmul output, contiguous."""
    return a[:, :n_cols].copy() if a.shape[1] != n_cols else a


@njit(cache=True)
def _dense_ffn(x, h, norm, w_gate, w_up, w_down, eps, gelu, hidden, f_rows, d_rows):
    """y = w_down(act(w_gate h) * (w_up h)), h = rmsnorm(x) (h: scratch like x)."""
    n, dim = x.shape
    r1, s1 = reads(w_gate)
    r2, s2 = reads(w_up)
    c32, c256 = act_buffers(n, dim, r1 or r2, s1 or s2)
    prepare(x, norm, eps, h, c32, c256)
    gate = np.empty((n, f_rows), np.float32)
    up = np.empty((n, f_rows), np.float32)
    linear2(w_gate, w_up, c32, c256, h, gate, up)
    act = np.empty((n, hidden), np.float32)
    glu(_cols(gate, hidden), _cols(up, hidden), act, gelu)
    r, s = reads(w_down)
    e32, e256 = act_buffers(n, hidden, r, s)
    prepare(act, np.empty(0, np.float32), eps, act, e32, e256)
    y = np.empty((n, d_rows), np.float32)
    linear1(w_down, e32, e256, act, y)
    return _cols(y, dim)


@njit(cache=True, parallel=True, nogil=True)
def delta_block(x, w, cfg, window, state):
    """One Gated DeltaNet block for n tokens of one sequence, in place on x (n, dim): x +=
    mixer(rmsnorm(x)), then x += ffn(rmsnorm(x)), with the bits of the op-by-op path
    (models/qwen35.py: delta_net_mixer, then the dense FFN).

    Args:
        x: float32 (n, dim), updated; w: DeltaArrays; cfg: DeltaConfig;
        window: float32 (K - 1, C) and state: float32 (n_v, hd, hd), the sequence's
        recurrent state, updated.
    """
    eps, n_k, n_v, hd = cfg.eps, cfg.n_k, cfg.n_v, cfg.hd
    n, dim = x.shape
    C = (2 * n_k + n_v) * hd
    vd = n_v * hd

    # the mixer: projections, the conv and delta rule, the per-head norm times silu(z)
    r1, s1 = reads(w.wqkv)
    r2, s2 = reads(w.wz)
    r3, s3 = reads(w.wbeta)
    r4, s4 = reads(w.walpha)
    h = np.empty_like(x)
    a32, a256 = act_buffers(n, dim, r1 or r2 or r3 or r4, s1 or s2 or s3 or s4)
    prepare(x, w.attn_norm, eps, h, a32, a256)
    qkv = np.empty((n, cfg.qkv_rows), np.float32)
    z = np.empty((n, cfg.z_rows), np.float32)
    beta = np.empty((n, cfg.h_rows), np.float32)
    alpha = np.empty((n, cfg.h_rows), np.float32)
    linear4(w.wqkv, w.wz, w.wbeta, w.walpha, a32, a256, h, qkv, z, beta, alpha)
    o = np.empty((n, vd), np.float32)
    deltanet.delta_net_t(_cols(qkv, C), _cols(alpha, n_v), _cols(beta, n_v), w.conv_t,
                         w.dt_bias, w.a, window, state, n_k, hd, cfg.l2_eps, o)
    rms_norm_heads(o.reshape(n, n_v, hd), w.ssm_norm, eps)
    g = np.empty((n, vd), np.float32)
    glu(_cols(z, vd), o, g, False)
    y2 = _out_and_ffn(x, h, g, w.wout, cfg.d_rows, w.ffn_norm, w.w_gate, w.w_up, w.w_down,
                      eps, cfg.gelu, cfg.hidden, cfg.f_rows)
    # a parallel loop of its own, as decoder_block's last residual (see there)
    for t in prange(n):
        add_row(x[t], y2[t])


@njit(cache=True)
def _out_and_ffn(x, h, g, wo, d_rows, ffn_norm, w_gate, w_up, w_down, eps, gelu, hidden,
                 f_rows):
    """x += wo g (g: the mixer's output, quantized here in place), then the dense FFN's
    output for x, which the caller adds (h: scratch like x)."""
    n, dim = x.shape
    r, s = reads(wo)
    b32, b256 = act_buffers(n, g.shape[1], r, s)
    prepare(g, np.empty(0, np.float32), eps, g, b32, b256)
    y = np.empty((n, d_rows), np.float32)
    linear1(wo, b32, b256, g, y)
    residual(x, _cols(y, dim), np.empty(0, np.float32), eps)
    return _dense_ffn(x, h, ffn_norm, w_gate, w_up, w_down, eps, gelu, hidden, f_rows, d_rows)


# A gated full-attention block's tensors (Qwen3.5: each query head has an output gate).
GatedArrays = namedtuple("GatedArrays", [
    "attn_norm", "wq", "wq_gate", "wk", "wv", "q_norm", "k_norm", "wo", "ffn_norm", "w_gate",
    "w_up", "w_down"])


@njit(cache=True, parallel=True, nogil=True)
def gated_attention_front(x, w, cfg, kv, positions, cos, sin):
    """A gated attention block up to its gate: the attention output o and the gate's
    pre-activation, each (n, n_heads * hd) (the block goes on with o * sigmoid(gate), which
    the backend takes as the op-by-op path does, then gated_attention_back). cfg: a
    BlockConfig (q_rows: the query's and gate's padded width; d_rows: the FFN's and output
    projection's; window 0, no biases)."""
    eps, n_heads, n_kv, hd = cfg.eps, cfg.n_heads, cfg.n_kv, cfg.hd
    n, dim = x.shape
    r1, s1 = reads(w.wq)
    r2, s2 = reads(w.wq_gate)
    r3, s3 = reads(w.wk)
    r4, s4 = reads(w.wv)
    h = np.empty_like(x)
    a32, a256 = act_buffers(n, dim, r1 or r2 or r3 or r4, s1 or s2 or s3 or s4)
    prepare(x, w.attn_norm, eps, h, a32, a256)
    q = np.empty((n, cfg.q_rows), np.float32)
    gp = np.empty((n, cfg.q_rows), np.float32)
    k = np.empty((n, cfg.kv_rows), np.float32)
    v = np.empty((n, cfg.kv_rows), np.float32)
    linear4(w.wq, w.wq_gate, w.wk, w.wv, a32, a256, h, q, gp, k, v)
    qd, kvd = n_heads * hd, n_kv * hd
    q, k, v = _cols(q, qd), _cols(k, kvd), _cols(v, kvd)
    empty = np.empty(0, np.float32)
    qk_prepare(q, k, v, empty, empty, empty, w.q_norm, w.k_norm, eps, cos, sin, cfg.neox, hd)
    o = np.empty((n, qd), np.float32)
    attn_k.paged_attention(q, k, v, kv.K, kv.V, kv.tables, kv.row_seq, kv.block_size, n_kv,
                           positions, 0, cfg.scale, empty, empty, o)
    gate = np.empty((n, qd), np.float32)
    for t in prange(n):  # a parallel loop of its own (see decoder_block)
        gate[t] = gp[t, :qd]
    return o, gate


@njit(cache=True, parallel=True, nogil=True)
def gated_attention_back(x, g, w, cfg):
    """The rest of a gated attention block, in place on x: x += wo g (g: the gated attention
    output, quantized in place), then x += ffn(rmsnorm(x))."""
    n = x.shape[0]
    h = np.empty_like(x)
    y2 = _out_and_ffn(x, h, g, w.wo, cfg.d_rows, w.ffn_norm, w.w_gate, w.w_up, w.w_down,
                      cfg.eps, cfg.gelu, cfg.hidden, cfg.f_rows)
    for t in prange(n):
        add_row(x[t], y2[t])


# ----------------------------------------------------------------------------- experts

_NO_SLOTS = np.zeros(0, np.int64)
_NO_SHARED = np.zeros((0, 0), np.float32)
_NO_GATE = np.zeros(0, np.float32)


@njit(cache=True, nogil=True)
def moe_route_one(x, router, router_rows, n_experts, need32, need256, gating, norm, scale,
                  down_scale, ids, weights):
    """A decode step's router, as backends/cpu_moe.py's moe_ffn takes it: x (1, dim), the
    normed hidden state, quantized once (``need32``/``need256``: the forms the router and
    the experts' gate and up matmuls read), the router's logits (router: its packed arrays,
    router_rows wide), the top-k (kernels/moe.py's route) into ids and weights (1, k), each
    weight times ``down_scale`` of its expert (an empty array: none). Returns: the quantized
    forms, for moe_experts_one."""
    a32, a256 = act_buffers(1, x.shape[1], need32, need256)
    prepare(x, np.empty(0, np.float32), 0.0, x, a32, a256)
    logits = np.empty((1, router_rows), np.float32)
    linear1(router, a32, a256, x, logits)
    moe_k.route(_cols(logits, n_experts), ids.shape[1], gating, norm, scale, ids, weights)
    if down_scale.shape[0] > 0:
        for j in range(ids.shape[1]):
            weights[0, j] = weights[0, j] * down_scale[ids[0, j]]
    return a32, a256


@njit(cache=True, parallel=True, nogil=True)
def moe_experts_one(pool_g, slots_g, pool_u, slots_u, pool_d, slots_d, tiles_gu, tiles_d,
                    a32, a256, x, weights, gelu, out):
    """A decode step's k experts from packed expert pools (cpu_moe.ExpertPool): gate and up
    in one parallel region, act(gate) * up, quantized row by row, down in a second region,
    and out (1, dim) = the weighted sum in slot order (kernels/moe.py's combine). slots_*:
    the pool slot of each chosen expert, by rank; tiles_*: tiles per expert matrix."""
    k = slots_g.shape[0]
    g = np.empty((k, tiles_gu * 16), np.float32)
    u = np.empty_like(g)
    pool_stack_kernel(pool_g, slots_g, pool_u, slots_u, tiles_gu, a32, a256, x, g, u)
    glu(g, u, g, gelu)
    r, s = reads(pool_d)
    b32, b256 = act_buffers(k, g.shape[1], r, s)
    prepare(g, np.empty(0, np.float32), 0.0, g, b32, b256)
    y = np.empty((k, tiles_d * 16), np.float32)
    pool_stack_kernel(pool_d, slots_d, pool_d, _NO_SLOTS, tiles_d, b32, b256, g, y, y)
    moe_k.combine(y, weights, _NO_SHARED, _NO_GATE, out)
