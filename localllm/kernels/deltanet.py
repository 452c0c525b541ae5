"""Gated DeltaNet (Qwen3.5's linear attention) over one sequence's new tokens: the short
causal convolution over its kept window of inputs, and the gated delta rule over its state.

Both run token after token with a fixed operation order per output element, so a token's
result is bit identical however the sequence's tokens were split into calls (prompt chunks,
decode steps). The states are updated in place.
"""

import math

import numpy as np

from .jit import njit


@njit(cache=True)
def causal_conv_silu(x, window, w, out):
    """out[t, c] = silu(sum_k in[t + k, c] * w[c, k]) over the inputs ``in`` = the kept window
    followed by x; the window then holds the last K - 1 inputs.

    Args:
        x: float32 (T, C) new inputs; window: float32 (K - 1, C), oldest first (updated);
        w: float32 (C, K) the kernel; out: float32 (T, C).
    """
    T, C = x.shape
    K = w.shape[1]
    H = K - 1
    for t in range(T):
        for c in range(C):
            acc = np.float32(0.0)
            for k in range(K):
                j = t + k - H
                v = x[j, c] if j >= 0 else window[H + j, c]
                acc += v * w[c, k]
            out[t, c] = acc / (np.float32(1.0) + np.float32(math.exp(-acc)))
    if T >= H:
        for i in range(H):
            for c in range(C):
                window[i, c] = x[T - H + i, c]
    else:
        for i in range(H - T):
            for c in range(C):
                window[i, c] = window[i + T, c]
        for i in range(T):
            for c in range(C):
                window[H - T + i, c] = x[i, c]


@njit(cache=True, inline="always")
def _l2_scale(x, eps):
    """1 / sqrt(sum(x^2) + eps) of a row, summed in float64 in order."""
    ss = 0.0
    for i in range(x.shape[0]):
        ss += np.float64(x[i]) * np.float64(x[i])
    return np.float32(1.0 / math.sqrt(ss + eps))


@njit(cache=True)
def gated_delta_rule(q, k, v, g, beta, state, out):
    """The gated delta rule, token by token: per value head h, with S its (S_v, S_k) state,
    S *= exp(g); S += beta (v - S k) k^T; out = S q / sqrt(S_k). Key head h % H_k serves
    value head h (as llama.cpp maps them).

    Args:
        q, k: float32 (T, H_k, S_k), already L2-normalised; v: float32 (T, H_v, S_v);
        g: float32 (T, H_v) log decays; beta: float32 (T, H_v) write strengths;
        state: float32 (H_v, S_v, S_k), updated; out: float32 (T, H_v, S_v).
    """
    T, Hk, Sk = q.shape
    Hv, Sv = v.shape[1], v.shape[2]
    scale = np.float32(1.0 / math.sqrt(Sk))
    for h in range(Hv):
        hk = h % Hk
        s = state[h]
        for t in range(T):
            decay = np.float32(math.exp(g[t, h]))
            b = beta[t, h]
            for j in range(Sv):
                sk = np.float32(0.0)
                for i in range(Sk):
                    s[j, i] *= decay
                    sk += s[j, i] * k[t, hk, i]
                d = (v[t, h, j] - sk) * b
                o = np.float32(0.0)
                for i in range(Sk):
                    s[j, i] += d * k[t, hk, i]
                    o += s[j, i] * q[t, hk, i]
                out[t, h, j] = o * scale


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
        n_k_heads: H_k; head_dim: S; eps: the L2 norm's epsilon; out: float32 (T, H_v * S).
    """
    T, C = qkv.shape
    Hv = alpha.shape[1]
    S = head_dim
    kd = n_k_heads * S
    conv = np.empty((T, C), np.float32)
    causal_conv_silu(qkv, window, conv_w, conv)
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
