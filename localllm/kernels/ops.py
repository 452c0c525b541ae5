"""Elementwise and per-row kernels: RMSNorm, RoPE, gated activations, residual adds.

Each row is computed by one ``*_row`` function with a fixed operation order, so results never
depend on how many rows are processed together or on the thread split.
"""

import math

import numpy as np
from numba import prange

from .jit import njit
from .rowmath import (rows_contiguous, vd_hsum, vd_sqacc, vd_zero, vf_dup_hi, vf_dup_lo,
                      vf_gelu_tanh, vf_load_n, vf_neg_even, vf_silu, vf_store_n, vf_swap_pairs)
from .simd import vf_add, vf_load, vf_mul, vf_splat, vf_store, vf_sub
from .vmath import f32_exp2, vf_exp2, vf_hmax, vf_hsum, vf_max

# Below these many elements a call stays on one thread: a parallel region costs 2-30 us to
# start, more than the job itself (measured ~0.25 ns per element for the norms and RoPE,
# 0.6 for SiLU, 1.1 for GELU, memory-bound for the add).
PAR_MIN_ELEMS = 1 << 15
PAR_MIN_SILU = 1 << 14
PAR_MIN_GELU = 1 << 13
PAR_MIN_ADD = 1 << 17


@njit(cache=True, inline="always")
def _check_rows(a):
    if not rows_contiguous(a):
        raise ValueError("ops: rows must be contiguous")


@njit(cache=True, inline="always")
def _check_same_shape(a, b):
    if a.shape != b.shape:
        raise ValueError("ops: operand shapes differ")


# ----------------------------------------------------------------------------- RMSNorm

@njit(cache=True)
def rms_norm_row(x, w, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * w for one contiguous float32 row.

    The squares are summed in float64 over 16 lanes (lane j takes the elements i = j mod 16
    in order), the lanes then folded j + 8, + 4, + 2, + 1; then as in float64 math,
    inv = f32(1 / sqrt(ss / D + eps)), and out = (x * inv) * w in float32.
    """
    D = x.shape[0]
    D16 = D & ~15
    acc = vd_zero()
    for i in range(0, D16, 16):
        acc = vd_sqacc(acc, vf_load(x, 4 * i))
    if D16 < D:
        acc = vd_sqacc(acc, vf_load_n(x, 4 * D16, D - D16))
    inv = vf_splat(np.float32(1.0 / math.sqrt(vd_hsum(acc) / D + eps)))
    for i in range(0, D16, 16):
        vf_store(out, 4 * i, vf_mul(vf_mul(vf_load(x, 4 * i), inv), vf_load(w, 4 * i)))
    if D16 < D:
        r = D - D16
        v = vf_mul(vf_mul(vf_load_n(x, 4 * D16, r), inv), vf_load_n(w, 4 * D16, r))
        vf_store_n(out, 4 * D16, v, r)


@njit(cache=True, parallel=True)
def _rms_norm_par(x, w, eps, out):
    for t in prange(x.shape[0]):
        rms_norm_row(x[t], w, eps, out[t])


@njit(cache=True)
def rms_norm(x, w, eps, out):
    """out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, row by row (see rms_norm_row).

    Args:
        x: float32 (n, D); w: float32 (D,); eps: float; out: float32 (n, D) (may alias x).
    """
    n, D = x.shape
    _check_same_shape(x, out)
    if w.shape[0] != D:
        raise ValueError("rms_norm: weight length differs from the row length")
    _check_rows(x)
    _check_rows(out)
    _check_rows(w)
    if n > 1 and n * D >= PAR_MIN_ELEMS:
        _rms_norm_par(x, w, eps, out)
    else:
        for t in range(n):
            rms_norm_row(x[t], w, eps, out[t])


@njit(cache=True, parallel=True)
def _rms_norm_heads_par(x, w, eps):
    for t in prange(x.shape[0]):
        for h in range(x.shape[1]):
            rms_norm_row(x[t, h], w, eps, x[t, h])


@njit(cache=True)
def rms_norm_heads(x, w, eps):
    """In-place RMSNorm over the last axis of x (n, H, hd) with one weight (hd,) (QK-norm);
    each head is one rms_norm_row."""
    n, H, hd = x.shape
    if w.shape[0] != hd:
        raise ValueError("rms_norm_heads: weight length differs from head_dim")
    _check_rows(x)
    _check_rows(w)
    if n > 1 and n * H * hd >= PAR_MIN_ELEMS:
        _rms_norm_heads_par(x, w, eps)
    else:
        for t in range(n):
            for h in range(H):
                rms_norm_row(x[t, h], w, eps, x[t, h])


# ----------------------------------------------------------------------------- RoPE

def yarn_corr_dims(n_rot: int, n_ctx_orig: int, theta: float, beta_fast: float = 32.0,
                   beta_slow: float = 1.0) -> tuple[float, float]:
    """YaRN's correction range: the pair indices between which rotations blend from kept
    (extrapolated, fast ones) to interpolated (slow ones), in float32 as llama.cpp computes
    them (ggml_rope_yarn_corr_dims). A pair that turns ``beta`` times over the original
    context sits at n_rot * ln(n_ctx_orig / (2 pi beta)) / (2 ln theta).

    Returns:
        (low, high): floor of beta_fast's index (at least 0), ceil of beta_slow's (at most
        n_rot - 1), as floats.
    """
    f32 = np.float32

    def dim(beta):
        ratio = f32(f32(n_ctx_orig) / f32(f32(beta) * f32(2) * f32(np.pi)))
        return f32(f32(n_rot) * np.log(ratio)) / f32(f32(2) * np.log(f32(theta)))
    low = max(f32(0), np.floor(dim(beta_fast)))
    high = min(f32(n_rot - 1), np.ceil(dim(beta_slow)))
    return float(low), float(high)


def yarn_mscale(factor: float, attn_factor: float = 1.0) -> float:
    """The factor YaRN puts on cos and sin, in float32 as llama.cpp forms it: the context's
    attention factor (get_mscale(factor) / (1 + 0.1 ln factor) times the file's
    rope.scaling.attn_factor) times rope_yarn's own 1 + 0.1 ln(1 / freq_scale).

    Args:
        factor: rope.scaling.factor (positions are divided by it).
        attn_factor: rope.scaling.attn_factor.
    """
    f32 = np.float32
    freq_scale = f32(1) / f32(factor)
    fac = f32(1) / freq_scale
    a = f32(f32(0.1) * np.log(fac) + f32(1)) if fac > 1 else f32(1)
    a = f32(a * f32(f32(1) / f32(f32(1) + f32(0.1) * np.log(fac))))
    a = f32(a * f32(attn_factor))
    return float(f32(a * f32(f32(1) + f32(0.1) * np.log(f32(1) / freq_scale))))


def rope_tables(positions: np.ndarray, n_rot: int, theta: float, freq_factors=None,
                pos_scale: float = 1.0, mscale: float = 1.0, yarn=None,
                temp_scale: float = 0.0, temp_floor: int = 0):
    """cos/sin tables for rotary embeddings, with angles formed as llama.cpp forms them.

    The angle of pair i at position p is built in float32 the way llama.cpp's CPU backend
    builds it: start from p, multiply by ``theta ** (-2 / n_rot)`` once per pair, divide by
    the pair's frequency factor, scale by ``pos_scale``; cos and sin of that float32 angle
    are then rounded once (and multiplied by ``mscale`` in float32). Exact angles would differ from llama.cpp's by up to ~6e-5 rad
    below 512 tokens (~6e-4 at 4k), enough to shift quantized activations downstream.

    Args:
        positions: int (n,) token positions.
        n_rot: number of rotated dimensions (even).
        theta: frequency base.
        freq_factors: optional (n_rot // 2,) divisors of each frequency (rope_freqs tensor).
        pos_scale: linear position scaling (1 / scaling factor).
        mscale: a factor on cos and sin (LongRoPE's attention factor, YaRN's magnitude
            correction): it scales the rotated dims only, as llama.cpp applies it.
        yarn: None, or YaRN's (ext_factor, low, high) (see yarn_corr_dims): pair i's angle
            blends the scaled and the unscaled one, theta_s (1 - m) + theta m with
            m = ext_factor * (1 - clip((i - low) / max(0.001, high - low), 0, 1)), so the
            fast pairs below ``low`` keep their frequency and the slow ones past ``high``
            are interpolated by ``pos_scale``.
        temp_scale, temp_floor: for queries, llama 4's attention temperature: row p also
            times log(floor(p / temp_floor) + 1) * temp_scale + 1 (formed in float64 and
            rounded once, as llama.cpp forms it), when temp_scale is not 0.
    Returns:
        (cos, sin): float32 (n, n_rot // 2) each.
    """
    f32 = np.float32
    # (n_rot 0: a layer without RoPE, empty tables)
    step = f32(np.float64(f32(theta)) ** np.float64(f32(-2.0) / f32(max(n_rot, 1))))
    ff = (np.ones(n_rot // 2, f32) if freq_factors is None
          else np.asarray(freq_factors, f32).reshape(-1))
    scale = f32(pos_scale)
    t = np.asarray(positions, np.int64).astype(f32)
    ang = np.empty((t.shape[0], n_rot // 2), f32)
    for i in range(n_rot // 2):
        extrap = t / ff[i]
        ang[:, i] = scale * extrap
        if yarn is not None:
            ext, low, high = (f32(v) for v in yarn)
            y = f32(f32(i) - low) / max(f32(0.001), f32(high - low))
            mix = f32(f32(1) - min(f32(1), max(f32(0), y))) * ext
            ang[:, i] = ang[:, i] * (f32(1) - mix) + extrap * mix
        t = t * step
    a = ang.astype(np.float64)
    cos, sin = np.cos(a).astype(f32), np.sin(a).astype(f32)
    if mscale != 1.0:
        cos *= f32(mscale)
        sin *= f32(mscale)
    if temp_scale != 0.0:
        p = np.asarray(positions, np.float64)
        temp = (np.log(np.floor(p / temp_floor) + 1.0) * np.float64(f32(temp_scale))
                + 1.0).astype(f32)[:, None]
        cos *= temp
        sin *= temp
    return cos, sin


@njit(cache=True, inline="always")
def _rotate_pairs(v, c, s):
    """(a, b) -> (a c - b s, b c + a s) for the adjacent pairs of v, c and s repeated per pair
    (a c + -(b s) and b c + a s are exactly a c - b s and a s + b c)."""
    return vf_add(vf_mul(v, c), vf_neg_even(vf_mul(vf_swap_pairs(v), s)))


@njit(cache=True)
def rope_row(x, cos, sin, neox):
    """Rotate one head x (hd,) in place; the first 2 * len(cos) dims rotate.

    Per pair (a, b) with angle (c, s): a' = a c - b s, b' = a s + b c in float32, each product
    rounded (no FMA). neox pairs dim i with i + half, otherwise 2i with 2i + 1.
    """
    half = cos.shape[0]
    h16 = half & ~15
    r = half - h16
    if neox:
        for i in range(0, h16, 16):
            a = vf_load(x, 4 * i)
            b = vf_load(x, 4 * (i + half))
            c = vf_load(cos, 4 * i)
            s = vf_load(sin, 4 * i)
            vf_store(x, 4 * i, vf_sub(vf_mul(a, c), vf_mul(b, s)))
            vf_store(x, 4 * (i + half), vf_add(vf_mul(a, s), vf_mul(b, c)))
        if r > 0:
            a = vf_load_n(x, 4 * h16, r)
            b = vf_load_n(x, 4 * (h16 + half), r)
            c = vf_load_n(cos, 4 * h16, r)
            s = vf_load_n(sin, 4 * h16, r)
            vf_store_n(x, 4 * h16, vf_sub(vf_mul(a, c), vf_mul(b, s)), r)
            vf_store_n(x, 4 * (h16 + half), vf_add(vf_mul(a, s), vf_mul(b, c)), r)
    else:
        for i in range(0, h16, 16):  # 16 pairs: two vectors of x per vector of cos / sin
            c = vf_load(cos, 4 * i)
            s = vf_load(sin, 4 * i)
            vf_store(x, 8 * i, _rotate_pairs(vf_load(x, 8 * i), vf_dup_lo(c), vf_dup_lo(s)))
            vf_store(x, 8 * i + 64,
                     _rotate_pairs(vf_load(x, 8 * i + 64), vf_dup_hi(c), vf_dup_hi(s)))
        if r > 0:
            c = vf_load_n(cos, 4 * h16, r)
            s = vf_load_n(sin, 4 * h16, r)
            m = 2 * min(r, 8)
            v = _rotate_pairs(vf_load_n(x, 8 * h16, m), vf_dup_lo(c), vf_dup_lo(s))
            vf_store_n(x, 8 * h16, v, m)
            if r > 8:
                m = 2 * (r - 8)
                v = _rotate_pairs(vf_load_n(x, 8 * h16 + 64, m), vf_dup_hi(c), vf_dup_hi(s))
                vf_store_n(x, 8 * h16 + 64, v, m)


@njit(cache=True, parallel=True)
def _rope_par(x, cos, sin, neox):
    for t in prange(x.shape[0]):
        for h in range(x.shape[1]):
            rope_row(x[t, h], cos[t], sin[t], neox)


@njit(cache=True)
def rope(x, cos, sin, neox):
    """Rotate x (n, H, hd) in place by position; the first 2 * cos.shape[1] dims rotate.

    Args:
        cos, sin: float32 (n, n_rot // 2), row t for token t.
        neox: True pairs dim i with i + n_rot/2 (GPT-NeoX style); False pairs 2i with 2i+1.
    """
    n, H, hd = x.shape
    _check_rows(x)
    _check_rows(cos)
    _check_rows(sin)
    _check_same_shape(cos, sin)
    if 2 * cos.shape[1] > hd or cos.shape[0] != n:
        raise ValueError("rope: cos/sin must be (n, half) with 2 * half <= head_dim")
    if n > 1 and n * H * hd >= PAR_MIN_ELEMS:
        _rope_par(x, cos, sin, neox)
    else:
        for t in range(n):
            for h in range(H):
                rope_row(x[t, h], cos[t], sin[t], neox)


# ----------------------------------------------------------------------------- gated activations

@njit(cache=True)
def silu_mul_row(gate, up, out):
    """out = silu(gate) * up over one row: (g / (1 + exp(-g))) * u with rowmath's exp."""
    F = gate.shape[0]
    for i in range(0, F & ~15, 16):
        vf_store(out, 4 * i, vf_mul(vf_silu(vf_load(gate, 4 * i)), vf_load(up, 4 * i)))
    i = F & ~15
    if i < F:
        v = vf_mul(vf_silu(vf_load_n(gate, 4 * i, F - i)), vf_load_n(up, 4 * i, F - i))
        vf_store_n(out, 4 * i, v, F - i)


@njit(cache=True)
def gelu_tanh_mul_row(gate, up, out):
    """out = gelu_tanh(gate) * up over one row (see rowmath.vf_gelu_tanh)."""
    F = gate.shape[0]
    for i in range(0, F & ~15, 16):
        vf_store(out, 4 * i, vf_mul(vf_gelu_tanh(vf_load(gate, 4 * i)), vf_load(up, 4 * i)))
    i = F & ~15
    if i < F:
        v = vf_mul(vf_gelu_tanh(vf_load_n(gate, 4 * i, F - i)), vf_load_n(up, 4 * i, F - i))
        vf_store_n(out, 4 * i, v, F - i)


@njit(cache=True)
def glu_row(gate, up, out, gelu):
    """out = act(gate) * up over one row, act gelu_tanh or silu."""
    if gelu:
        gelu_tanh_mul_row(gate, up, out)
    else:
        silu_mul_row(gate, up, out)


@njit(cache=True, parallel=True)
def _glu_par(gate, up, out, gelu):
    for t in prange(gate.shape[0]):
        glu_row(gate[t], up[t], out[t], gelu)


@njit(cache=True)
def glu(gate, up, out, gelu):
    """out = (gelu_tanh if gelu else silu)(gate) * up, elementwise over (n, F) (out may
    alias gate or up)."""
    n, F = gate.shape
    _check_same_shape(gate, up)
    _check_same_shape(gate, out)
    _check_rows(gate)
    _check_rows(up)
    _check_rows(out)
    if n > 1 and n * F >= (PAR_MIN_GELU if gelu else PAR_MIN_SILU):
        _glu_par(gate, up, out, gelu)
    else:
        for t in range(n):
            glu_row(gate[t], up[t], out[t], gelu)


@njit(cache=True)
def silu_mul(gate, up, out):
    """out = silu(gate) * up, elementwise over (n, F) (out may alias gate or up)."""
    glu(gate, up, out, False)


@njit(cache=True)
def gelu_tanh_mul(gate, up, out):
    """out = gelu_tanh(gate) * up, elementwise over (n, F) (out may alias gate or up)."""
    glu(gate, up, out, True)


# gpt-oss's clamped SwiGLU (llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants)
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


@njit(cache=True)
def swiglu_oai_row(gate, up, out, alpha, limit):
    """gpt-oss's clamped SwiGLU over one row, as ggml's swiglu_oai computes it in float32:
    x = min(g, limit), y = clamp(u, -limit, limit), out = x / (1 + exp(-alpha x)) * (y + 1)."""
    a = np.float32(alpha)
    lim = np.float32(limit)
    one = np.float32(1.0)
    for i in range(gate.shape[0]):
        x = min(gate[i], lim)
        y = max(min(up[i], lim), -lim)
        out[i] = x / (one + np.float32(math.exp(a * -x))) * (y + one)


@njit(cache=True, parallel=True)
def swiglu_oai(gate, up, out, alpha, limit):
    """swiglu_oai_row over (n, F) rows (out may alias gate or up)."""
    _check_same_shape(gate, up)
    _check_same_shape(gate, out)
    for t in prange(gate.shape[0]):
        swiglu_oai_row(gate[t], up[t], out[t], alpha, limit)


# ----------------------------------------------------------------------------- residual add

@njit(cache=True)
def add_row(x, y):
    """x += y over one row."""
    for i in range(x.shape[0]):
        x[i] += y[i]


@njit(cache=True, parallel=True)
def _add_par(x, y):
    for t in prange(x.shape[0]):
        add_row(x[t], y[t])


@njit(cache=True)
def add_inplace(x, y):
    """x += y over (n, D)."""
    n, D = x.shape
    _check_same_shape(x, y)
    if n > 1 and n * D >= PAR_MIN_ADD:
        _add_par(x, y)
    else:
        for t in range(n):
            add_row(x[t], y[t])


# ----------------------------------------------------------------------------- log-sum-exp

@njit(cache=True)
def logsumexp(z):
    """log(sum(exp(z))) of a float32 vector, computed as max + log(sum(2^((z - max) log2 e)))
    in 16 lanes with a fixed order (deterministic). Used for the chosen token's log-probability."""
    n = z.shape[0]
    n16 = n - n % 16
    mv = vf_splat(np.float32(-np.inf))
    for i in range(0, n16, 16):
        mv = vf_max(mv, vf_load(z, 4 * i))
    m = vf_hmax(mv)
    for i in range(n16, n):
        m = max(m, z[i])
    if not np.isfinite(m):
        return np.float64(m)
    c = np.float32(1.4426950408889634)
    mneg = vf_splat(-m)
    acc = vf_splat(np.float32(0.0))
    for i in range(0, n16, 16):
        acc = vf_add(acc, vf_exp2(vf_mul(vf_add(vf_load(z, 4 * i), mneg), vf_splat(c))))
    total = np.float64(vf_hsum(acc))
    for i in range(n16, n):
        total += np.float64(f32_exp2((z[i] - m) * c))
    return np.float64(m) + math.log(total)
