"""Gated DeltaNet (Qwen3.5's linear attention) over one sequence's new tokens: the short
causal convolution over its kept window of inputs, and the gated delta rule over its state.

Both run token after token with a fixed operation order per output element (16-lane vector
sums folded by one tree, as simd.py defines them), so a token's result is bit identical
however the sequence's tokens were split into calls (prompt chunks, decode steps) and on
every target. Rows of a head's state go to threads in blocks. The states are updated in place. Head sizes are
multiples of 16 (ModelArgs checks it).
"""

import math

import numpy as np
from numba import prange

from .jit import njit
from .rowmath import vd_hsum, vd_sqacc, vd_zero, vf_silu
from .simd import prefetch, vf_load, vf_mul, vf_splat, vf_store, vf_zero
from .vmath import vf_fma, vf_hsum

# Bytes of state requested ahead of the first pass over a row group. A decode step reads
# each layer's state once from memory (2 MB a layer at Qwen3.5 4B's shape), after the
# weights between two layers have evicted it; the hardware prefetcher alone left the rule
# at ~40 % of the memory's read-and-write rate (24 layers 3.7 -> 2.4 ms a step measured
# alone, the states evicted between steps).
AHEAD = 8192
ROWS_PER_ITEM = 16  # state rows a thread takes through all of a call's tokens


@njit(cache=True, parallel=True)
def _conv_rows(x, window, wt, out):
    """out[t] = silu(sum_k in[t + k] * wt[k]) lane-wise, k in order (fused multiply-adds), with
    ``in`` = the window's rows followed by x's."""
    T, C = x.shape
    K = wt.shape[0]
    H = K - 1
    for t in prange(T):
        for c in range(0, C, 16):
            acc = vf_zero()
            for k in range(K):
                j = t + k - H
                if j >= 0:
                    v = vf_load(x, (j * C + c) * 4)
                else:
                    v = vf_load(window, ((H + j) * C + c) * 4)
                acc = vf_fma(v, vf_load(wt, (k * C + c) * 4), acc)
            vf_store(out, (t * C + c) * 4, vf_silu(acc))


@njit(cache=True)
def causal_conv_silu(x, window, w, out):
    """out[t, c] = silu(sum_k in[t + k, c] * w[c, k]) over the inputs ``in`` = the kept window
    followed by x; the window then holds the last K - 1 inputs.

    Args:
        x: float32 (T, C) new inputs, C a multiple of 16; window: float32 (K - 1, C), oldest
        first (updated); w: float32 (C, K) the kernel; out: float32 (T, C). All contiguous.
    """
    causal_conv_silu_t(x, window, np.ascontiguousarray(w.T), out)


@njit(cache=True)
def causal_conv_silu_t(x, window, wt, out):
    """causal_conv_silu with the kernel given transposed: wt float32 (K, C), contiguous (a
    layer's fused block keeps it so rather than transposing it every step)."""
    T, C = x.shape
    K = wt.shape[0]
    H = K - 1
    if C % 16 or wt.shape[1] != C or window.shape != (H, C) or out.shape != (T, C):
        raise ValueError("causal_conv_silu: C must be a multiple of 16, shapes to match")
    _conv_rows(x, window, wt, out)
    if T >= H:
        window[:, :] = x[T - H:]
    else:
        for i in range(H - T):
            window[i] = window[i + T]
        window[H - T:] = x


@njit(cache=True, inline="always")
def _l2_scale(x, off, n, eps):
    """1 / sqrt(sum(x^2) + eps) of n floats from byte ``off``: float64 squares summed in 16
    lanes in order, folded by one tree."""
    acc = vd_zero()
    for i in range(0, n * 4, 64):
        acc = vd_sqacc(acc, vf_load(x, off + i))
    return np.float32(1.0 / math.sqrt(vd_hsum(acc) + eps))


@njit(cache=True, parallel=True)
def _prepare(conv, alpha, beta_in, dt_bias, a, n_k_heads, S, eps, q, k, v, g, beta):
    """Per token: L2-normalised q and k heads, v, decays and write strengths."""
    T, C = conv.shape
    Hv = alpha.shape[1]
    kd = n_k_heads * S
    for t in prange(T):
        row = t * C * 4
        for h in range(n_k_heads):
            sq = vf_splat(_l2_scale(conv, row + h * S * 4, S, eps))
            sk = vf_splat(_l2_scale(conv, row + (kd + h * S) * 4, S, eps))
            qo = ((t * n_k_heads + h) * S) * 4
            for i in range(0, S * 4, 64):
                vf_store(q, qo + i, vf_mul(vf_load(conv, row + h * S * 4 + i), sq))
                vf_store(k, qo + i, vf_mul(vf_load(conv, row + (kd + h * S) * 4 + i), sk))
        for i in range(0, Hv * S * 4, 64):
            vf_store(v, t * Hv * S * 4 + i, vf_load(conv, row + 2 * kd * 4 + i))
        for h in range(Hv):
            x = alpha[t, h] + dt_bias[h]
            sp = x if x > np.float32(20.0) else np.float32(math.log1p(math.exp(x)))
            g[t, h] = sp * a[h]
            beta[t, h] = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-beta_in[t, h])))


@njit(cache=True, parallel=True)
def gated_delta_rule(q, k, v, g, beta, state, out):
    """The gated delta rule, token by token: per value head h, with S its (S_v, S_k) state,
    S *= exp(g); S += beta (v - S k) k^T; out = S q / sqrt(S_k). Key head h % H_k serves
    value head h (as llama.cpp maps them).

    Per state row s: sk = exp(g) (s . k); s' = s exp(g) + beta (v_j - sk) k; out_j = s' . q,
    each dot a 16-lane fused sum in index order folded by one tree.

    Args:
        q, k: float32 (T, H_k, S_k), already L2-normalised; v: float32 (T, H_v, S_v);
        g: float32 (T, H_v) log decays; beta: float32 (T, H_v) write strengths;
        state: float32 (H_v, S_v, S_k), updated; out: float32 (T, H_v, S_v). All contiguous,
        S_k a multiple of 16.
    """
    T, Hk, Sk = q.shape
    Hv, Sv = v.shape[1], v.shape[2]
    scale = np.float32(1.0 / math.sqrt(Sk))
    nblk = (Sv + ROWS_PER_ITEM - 1) // ROWS_PER_ITEM
    decays = np.empty((T, Hv), np.float32)
    for t in range(T):
        for h in range(Hv):
            decays[t, h] = np.float32(math.exp(g[t, h]))
    # A row of a head's state meets only its own row of the update, so each work item
    # takes a few rows (they stay in L1) through all the tokens.
    for item in prange(Hv * nblk):
        h = item // nblk
        j0 = (item % nblk) * ROWS_PER_ITEM
        j1 = min(Sv, j0 + ROWS_PER_ITEM)
        hk = h % Hk
        for t in range(T):
            decay = decays[t, h]
            dv = vf_splat(decay)
            b = beta[t, h]
            kb = ((t * Hk + hk) * Sk) * 4
            for j in range(j0, j1, 4):  # four rows at once: their chains overlap
                s0 = ((h * Sv + j) * Sk) * 4
                s1 = s0 + Sk * 4
                s2 = s1 + Sk * 4
                s3 = s2 + Sk * 4
                a0 = vf_zero()
                a1 = vf_zero()
                a2 = vf_zero()
                a3 = vf_zero()
                for i in range(0, Sk * 4, 64):
                    if t == 0:  # later tokens find the rows in cache
                        prefetch(state, s0 + i + AHEAD)
                        prefetch(state, s1 + i + AHEAD)
                        prefetch(state, s2 + i + AHEAD)
                        prefetch(state, s3 + i + AHEAD)
                    ki = vf_load(k, kb + i)
                    a0 = vf_fma(vf_load(state, s0 + i), ki, a0)
                    a1 = vf_fma(vf_load(state, s1 + i), ki, a1)
                    a2 = vf_fma(vf_load(state, s2 + i), ki, a2)
                    a3 = vf_fma(vf_load(state, s3 + i), ki, a3)
                d0 = vf_splat((v[t, h, j] - decay * vf_hsum(a0)) * b)
                d1 = vf_splat((v[t, h, j + 1] - decay * vf_hsum(a1)) * b)
                d2 = vf_splat((v[t, h, j + 2] - decay * vf_hsum(a2)) * b)
                d3 = vf_splat((v[t, h, j + 3] - decay * vf_hsum(a3)) * b)
                a0 = vf_zero()
                a1 = vf_zero()
                a2 = vf_zero()
                a3 = vf_zero()
                for i in range(0, Sk * 4, 64):
                    ki = vf_load(k, kb + i)
                    qi = vf_load(q, kb + i)
                    n0 = vf_fma(ki, d0, vf_mul(vf_load(state, s0 + i), dv))
                    n1 = vf_fma(ki, d1, vf_mul(vf_load(state, s1 + i), dv))
                    n2 = vf_fma(ki, d2, vf_mul(vf_load(state, s2 + i), dv))
                    n3 = vf_fma(ki, d3, vf_mul(vf_load(state, s3 + i), dv))
                    vf_store(state, s0 + i, n0)
                    vf_store(state, s1 + i, n1)
                    vf_store(state, s2 + i, n2)
                    vf_store(state, s3 + i, n3)
                    a0 = vf_fma(n0, qi, a0)
                    a1 = vf_fma(n1, qi, a1)
                    a2 = vf_fma(n2, qi, a2)
                    a3 = vf_fma(n3, qi, a3)
                out[t, h, j] = vf_hsum(a0) * scale
                out[t, h, j + 1] = vf_hsum(a1) * scale
                out[t, h, j + 2] = vf_hsum(a2) * scale
                out[t, h, j + 3] = vf_hsum(a3) * scale


@njit(cache=True)
def delta_net(qkv, alpha, beta_in, conv_w, dt_bias, a, window, state, n_k_heads, head_dim,
              eps, out):
    """One sequence's new tokens through a Gated DeltaNet mixer, up to its output norm:
    the causal conv and SiLU over the q, k, v channels, L2-normalised q and k heads, decays
    g = softplus(alpha + dt_bias) * a and strengths sigmoid(beta), the gated delta rule.

    Args:
        qkv: float32 (T, C) the mixed q, k, v projection (C = 2 H_k S + H_v S);
        alpha, beta_in: float32 (T, H_v); conv_w: float32 (C, K); dt_bias, a: float32 (H_v,);
        window: float32 (K - 1, C) and state: float32 (H_v, S, S), updated;
        n_k_heads: H_k; head_dim: S, a multiple of 16; eps: the L2 norm's epsilon;
        out: float32 (T, H_v * S).
    """
    delta_net_t(qkv, alpha, beta_in, np.ascontiguousarray(conv_w.T), dt_bias, a, window,
                state, n_k_heads, head_dim, eps, out)


@njit(cache=True)
def delta_net_t(qkv, alpha, beta_in, conv_t, dt_bias, a, window, state, n_k_heads, head_dim,
                eps, out):
    """delta_net with the conv kernel given transposed: conv_t float32 (K, C), contiguous."""
    T, C = qkv.shape
    Hv = alpha.shape[1]
    S = head_dim
    if (S % 16 or C != (2 * n_k_heads + Hv) * S or state.shape != (Hv, S, S)
            or out.shape != (T, Hv * S)):
        raise ValueError("delta_net: the head size must be a multiple of 16, shapes to match")
    conv = np.empty((T, C), np.float32)
    causal_conv_silu_t(np.ascontiguousarray(qkv), window, conv_t, conv)
    q = np.empty((T, n_k_heads, S), np.float32)
    k = np.empty((T, n_k_heads, S), np.float32)
    v = np.empty((T, Hv, S), np.float32)
    g = np.empty((T, Hv), np.float32)
    beta = np.empty((T, Hv), np.float32)
    _prepare(conv, np.ascontiguousarray(alpha), np.ascontiguousarray(beta_in), dt_bias, a,
             n_k_heads, S, eps, q, k, v, g, beta)
    gated_delta_rule(q, k, v, g, beta, state, out.reshape(T, Hv, S))
