"""Gated DeltaNet (Qwen3.5's linear attention) over one sequence's new tokens: the short
causal convolution over its kept window of inputs, and the gated delta rule over its state.

Both run token after token with a fixed operation order per output element (16-lane vector
sums folded by one tree, as simd.py defines them), so a token's result is bit identical
however the sequence's tokens were split into calls (prompt chunks, decode steps) and on
every target. Heads go to threads whole. The states are updated in place. Head sizes are
multiples of 16 (ModelArgs checks it).
"""

import math

import numpy as np
from numba import prange

from .jit import njit
from .rowmath import vf_silu
from .simd import vf_load, vf_mul, vf_splat, vf_store, vf_zero
from .vmath import vf_fma, vf_hsum


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
    T, C = x.shape
    K = w.shape[1]
    H = K - 1
    if C % 16 or window.shape != (H, C) or out.shape != (T, C):
        raise ValueError("causal_conv_silu: C must be a multiple of 16, shapes to match")
    wt = np.ascontiguousarray(w.T)
    _conv_rows(x, window, wt, out)
    if T >= H:
        window[:, :] = x[T - H:]
    else:
        for i in range(H - T):
            window[i] = window[i + T]
        window[H - T:] = x


@njit(cache=True, inline="always")
def _l2_scale(x, eps):
    """1 / sqrt(sum(x^2) + eps) of a row, summed in float64 in order."""
    ss = 0.0
    for i in range(x.shape[0]):
        ss += np.float64(x[i]) * np.float64(x[i])
    return np.float32(1.0 / math.sqrt(ss + eps))


@njit(cache=True, inline="always")
def _row_dot(a, ab, b, bb, n):
    """Lane-wise fused sums of a[ab:] * b[bb:] over n floats (byte offsets), folded."""
    acc = vf_zero()
    for i in range(0, n * 4, 64):
        acc = vf_fma(vf_load(a, ab + i), vf_load(b, bb + i), acc)
    return vf_hsum(acc)


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
    for h in prange(Hv):
        hk = h % Hk
        for t in range(T):
            decay = np.float32(math.exp(g[t, h]))
            dv = vf_splat(decay)
            b = beta[t, h]
            kb = ((t * Hk + hk) * Sk) * 4
            for j in range(Sv):
                sb = ((h * Sv + j) * Sk) * 4
                sk = decay * _row_dot(state, sb, k, kb, Sk)
                dd = vf_splat((v[t, h, j] - sk) * b)
                acc = vf_zero()
                for i in range(0, Sk * 4, 64):
                    ki = vf_load(k, kb + i)
                    s = vf_fma(ki, dd, vf_mul(vf_load(state, sb + i), dv))
                    vf_store(state, sb + i, s)
                    acc = vf_fma(s, vf_load(q, kb + i), acc)
                out[t, h, j] = vf_hsum(acc) * scale


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
    T, C = qkv.shape
    Hv = alpha.shape[1]
    S = head_dim
    kd = n_k_heads * S
    if S % 16 or state.shape != (Hv, S, S) or out.shape != (T, Hv * S):
        raise ValueError("delta_net: the head size must be a multiple of 16, shapes to match")
    conv = np.empty((T, C), np.float32)
    causal_conv_silu(np.ascontiguousarray(qkv), window, conv_w, conv)
    q = np.empty((T, n_k_heads, S), np.float32)
    k = np.empty((T, n_k_heads, S), np.float32)
    v = np.empty((T, Hv, S), np.float32)
    g = np.empty((T, Hv), np.float32)
    beta = np.empty((T, Hv), np.float32)
    for t in range(T):
        for h in range(n_k_heads):
            sq = _l2_scale(conv[t, h * S:(h + 1) * S], eps)
            sk = _l2_scale(conv[t, kd + h * S:kd + (h + 1) * S], eps)
            for i in range(S):
                q[t, h, i] = conv[t, h * S + i] * sq
                k[t, h, i] = conv[t, kd + h * S + i] * sk
        for h in range(Hv):
            for i in range(S):
                v[t, h, i] = conv[t, 2 * kd + h * S + i]
            x = alpha[t, h] + dt_bias[h]
            sp = x if x > np.float32(20.0) else np.float32(math.log1p(math.exp(x)))
            g[t, h] = sp * a[h]
            beta[t, h] = np.float32(1.0) / (np.float32(1.0) + np.float32(math.exp(-beta_in[t, h])))
    gated_delta_rule(q, k, v, g, beta, state, out.reshape(T, Hv, S))
