"""Conformance to the Backend protocol (localllm/backends/base.py): every backend (cpu, torch,
MLX; CUDA where present) has each attribute and method the protocol names, with its parameter
names, kinds and defaults, and runs every one of them on Gemma 3's first layer (real weight
bytes, real KV pages), each result held to the CPU backend at test_backend_ops' tolerances."""

from __future__ import annotations

import inspect
import math
import typing

import numpy as np
import pytest

from localllm.backends.base import (Backend, DeltaNetSpec, DeltaNetWeights, KVBatch,
                                    KVLayout, MemoryInfo, MoESpec, MoEWeights, RopeSpec)
from localllm.backends.cpu import CpuBackend
from localllm.errors import UnsupportedModel
from localllm.formats.gguf import GGUFFile
from localllm.models.block import BlockSpec, BlockWeights, compose_block
from localllm.testing.kernel_data import random_weight
from support.backends import (TOL_ATTENTION, TOL_CONVERTED, TOL_FLOAT_OP, TOL_LINEAR, _backends,
                              check, rnd)

ATTRIBUTES = typing.get_type_hints(Backend)          # name -> type
METHODS = {n: f for n, f in vars(Backend).items() if inspect.isfunction(f)
           and not n.startswith("_")}
MEMBERS = set(ATTRIBUTES) | set(METHODS)

BACKENDS = [pytest.param(lambda: CpuBackend(), id="cpu"), *_backends()]
VOCAB = 512                  # rows of the real embedding uploaded
DIM, H, N_KV, HD = 640, 4, 1, 256   # Gemma 3 270M
EPS = 1e-6
ROPE = RopeSpec(HD, 10000.0, True)
# (name in the file, BlockWeights field) of layer 0's matrices and vectors
MATRICES = {"attn_q": "wq", "attn_k": "wk", "attn_v": "wv", "attn_output": "wo",
            "ffn_gate": "w_gate", "ffn_up": "w_up", "ffn_down": "w_down"}
VECTORS = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm", "attn_q_norm": "q_norm",
           "attn_k_norm": "k_norm", "post_attention_norm": "post_attn_norm",
           "post_ffw_norm": "post_ffn_norm"}


def _params(fn, drop_self: bool) -> list[tuple]:
    ps = list(inspect.signature(fn).parameters.values())[1 if drop_self else 0:]
    return [(p.name, p.kind.name, p.default) for p in ps]


@pytest.fixture(scope="module", params=BACKENDS)
def be(request):
    return request.param()


@pytest.fixture(scope="module")
def cpu():
    return CpuBackend()


@pytest.fixture(scope="module")
def gemma(gemma_path):
    f = GGUFFile(gemma_path)
    yield f
    f.close()


def test_the_protocol_names_what_models_use():
    assert {"name", "device", "fused_blocks", "copies_weights"} <= set(ATTRIBUTES)
    assert {"upload_matrix", "linear", "attention", "decoder_block", "new_kv_pages",
            "copy_kv_block"} <= set(METHODS)


def test_implements_every_member_with_the_protocols_signature(be):
    for name, kind in ATTRIBUTES.items():
        assert isinstance(getattr(be, name, None), kind), f"{be.name}: attribute {name}"
    for name, proto in METHODS.items():
        impl = getattr(type(be), name, None)
        assert impl is not None and impl is not proto, f"{be.name} lacks {name}"
        # Bound: the protocol's `self` dropped; a staticmethod has none to drop.
        assert _params(getattr(be, name), False) == _params(proto, True), \
            f"{be.name}.{name}{inspect.signature(getattr(be, name))} differs from the " \
            f"protocol's {name}{inspect.signature(proto)}"


class Recorder:
    """A backend seen only through the protocol's names, recording which of them were used."""

    def __init__(self, backend):
        self._backend = backend
        self.used: set[str] = set()

    def __getattr__(self, name):
        if name not in MEMBERS:
            raise AttributeError(f"{name} is not a Backend protocol member")
        self.used.add(name)
        return getattr(self._backend, name)


def _upload(b, f: GGUFFile):
    """Layer 0 of the file and a slice of its embedding, on backend b: (BlockWeights, the
    embedding). Checks each matrix's bytes against the plan and its ``done`` ranges."""
    b.begin_model(f.path)
    w = {}
    for tensor, field in MATRICES.items():
        name = f"blk.0.{tensor}.weight"
        info = f.tensors[name]
        N, K = info.shape
        released = []
        m = b.upload_matrix(name, info.type_name, f.raw(name), N, K,
                            lambda a, e: released.append((a, e)))
        nbytes = f.raw(name).nbytes
        assert all(0 <= a <= e <= nbytes for a, e in released)
        assert b.matrix_nbytes(m) == b.plan_matrix_nbytes(info.type_name, N, K)
        w[field] = m
    for tensor, field in VECTORS.items():
        w[field] = b.upload_vector(np.array(f.raw(f"blk.0.{tensor}.weight").view(np.float32)))
    table = b.upload_embedding("Q8_0", f.blocks("token_embd.weight")[:VOCAB], DIM)
    b.end_model()
    return BlockWeights(**w), table


def _experts(b, seed: int = 3, fused: bool = False) -> MoEWeights:
    """A small mixture-of-experts FFN on backend b (4 Q8_0 experts of width 64, an F32
    router) with gpt-oss's router and expert biases; the same values on every backend.
    ``fused``: gate and up uploaded as one stack of 2 x 64 rows an expert (Gemma 4's
    ``ffn_gate_up_exps``) through ``upload_expert_halves``, the same weights."""
    rng = np.random.default_rng(seed)
    E, F = 4, 64
    router = (rng.standard_normal((E, DIM)) * 0.05).astype(np.float32)
    stack = {x: random_weight("Q8_0", E * n, k, rng)
             for x, n, k in (("gate", F, DIM), ("up", F, DIM), ("down", DIM, F))}
    bias = {x: (0.5 * rng.standard_normal((E, n))).astype(np.float32)
            for x, n in (("gate", F), ("up", F), ("down", DIM))}
    shape = {"gate": (F, DIM), "up": (F, DIM), "down": (DIM, F)}
    experts = {x: b.upload_experts(x, "Q8_0", stack[x], E, *shape[x]) for x in stack}
    for x, w in experts.items():  # the plan's bytes, anonymous and file-backed together
        assert b.matrix_nbytes(w) == sum(b.plan_experts_nbytes("Q8_0", E, *shape[x]))
    if fused:  # each expert's gate rows, then its up rows, in one stack
        both = np.concatenate([stack[x].reshape(E, -1) for x in ("gate", "up")], axis=1)
        experts["gate"], experts["up"] = b.upload_expert_halves(
            "gate_up", "Q8_0", both.reshape(-1), E, F, DIM)
    return MoEWeights(
        router=b.upload_matrix("r", "F32", router.view(np.uint8).reshape(-1), E, DIM),
        **experts,
        router_bias=b.upload_vector(rng.standard_normal(E).astype(np.float32)),
        **{f"{x}_bias": tuple(b.upload_vector(r) for r in bias[x]) for x in bias})


def _linear_tol(b, f: GGUFFile, tensor: str) -> float:
    fmt = f.tensors[f"blk.0.{tensor}.weight"].type_name
    return TOL_CONVERTED.get(fmt, TOL_LINEAR) if b.name == "mlx" else TOL_LINEAR


class Pair:
    """The backend under test and the CPU reference, each with its uploaded layer, each op
    given the same numpy inputs."""

    def __init__(self, b, w: BlockWeights, ref, wr: BlockWeights):
        self.b, self.w, self.ref, self.wr = b, w, ref, wr

    def both(self, fn, *arrays):
        """fn(backend, its weights, *arrays on it) as numpy: (under test, CPU)."""
        # copies: the CPU backend's from_numpy keeps the array, and some ops work in place
        got = fn(self.b, self.w, *[self.b.from_numpy(np.array(a, np.float32)) for a in arrays])
        want = fn(self.ref, self.wr, *[np.array(a, np.float32) for a in arrays])
        if isinstance(got, list):
            return [self.b.to_numpy(g) for g in got], want
        return self.b.to_numpy(got), want


def _attention_steps(p: Pair, kind: str, rng):
    """Two prompts in one batch, a decode step, and a forked sequence reading copied blocks
    (copy_kv_block), with keys and values from the layer's real projections."""
    b, ref = p.b, p.ref
    layout = KVLayout(N_KV, HD, 16, kind, kind)
    assert b.kv_block_nbytes(layout) == ref.kv_block_nbytes(layout)
    held = b.held_nbytes()
    pages = b.new_kv_pages(layout, 8)
    assert b.held_nbytes() - held >= 8 * b.kv_block_nbytes(layout)
    ref_pages = ref.new_kv_pages(layout, 8)
    bal = tuple(float(x) for x in 2.0 ** rng.integers(-2, 3, HD)) if kind == "q8_0" else None
    # attention sinks (gpt-oss) on the q8_0 pass
    sinks = (2 * rng.standard_normal(H)).astype(np.float32) if kind == "q8_0" else None
    window = 8 if kind == "q8_0" else 0
    tables = np.array([[3, 0], [5, -1]], np.int32)
    steps = [([0] * 20 + [1] * 7, list(range(20)) + list(range(7))), ([1, 0], [7, 20])]
    for i, (row_seq, pos) in enumerate(steps):
        n = len(pos)
        h = rnd(rng, n, DIM)
        q, k, v = ref.linear(h, [p.wr.wq, p.wr.wk, p.wr.wv])
        pos = np.array(pos, np.int64)
        rs = np.array(row_seq, np.int32)
        got = b.attention(b.from_numpy(q), b.from_numpy(k), b.from_numpy(v),
                          KVBatch(pages, tables, rs, 16), pos, H, 0.0625, window, bal, sinks)
        want = ref.attention(q, k, v, KVBatch(ref_pages, tables, rs, 16), pos, H, 0.0625,
                             window, bal, sinks)
        check(f"{b.name} attention {kind} step {i}", b.to_numpy(got), want, TOL_ATTENTION)
    # A fork of the first sequence: its two blocks copied, then the same token attends
    # through the copies and through the originals, with the same bits.
    b.copy_kv_block(pages, 3, 6)
    b.copy_kv_block(pages, 0, 7)
    q, k, v = rnd(rng, 1, H * HD), rnd(rng, 1, N_KV * HD), rnd(rng, 1, N_KV * HD)
    outs = [b.to_numpy(b.attention(b.from_numpy(q), b.from_numpy(k), b.from_numpy(v),
                                   KVBatch(pages, np.array([t], np.int32),
                                           np.zeros(1, np.int32), 16),
                                   np.array([21]), H, 0.0625, window, bal))
            for t in ([6, 7], [3, 0])]
    np.testing.assert_array_equal(outs[0], outs[1])


def _block(b, w: BlockWeights, x: np.ndarray, fused: bool) -> np.ndarray:
    """One decoder block over a two-sequence prompt, on fresh pages: natively or composed."""
    spec = BlockSpec(H, N_KV, HD, EPS, ROPE, 0.0625, activation="gelu_tanh")
    pages = b.new_kv_pages(KVLayout(N_KV, HD, 16, "f16", "f16"), 4)
    kv = KVBatch(pages, np.array([[1, 2], [0, -1]], np.int32),
                 np.array([0] * 18 + [1] * 5, np.int32), 16)
    pos = np.array(list(range(18)) + list(range(5)), np.int64)
    run = b.decoder_block if fused else (lambda *a: compose_block(b, *a))
    return b.to_numpy(run(b.from_numpy(x), w, spec, pos, kv))


def test_runs_every_protocol_method_against_the_cpu_backend(be, cpu, gemma):
    rec = Recorder(be)
    assert isinstance(rec.name, str) and isinstance(rec.device, str)
    assert isinstance(rec.copies_weights, bool)
    w, table = _upload(rec, gemma)
    wr, table_r = _upload(cpu, gemma)
    p = Pair(rec, w, cpu, wr)
    rng = np.random.default_rng(0)

    mem = rec.memory_info()
    assert isinstance(mem, MemoryInfo) and 0 <= mem.free <= mem.total and mem.pool
    assert rec.plan_scratch_nbytes(2048 * DIM) >= 0
    assert rec.held_nbytes() >= sum(rec.matrix_nbytes(getattr(w, f))
                                    for f in MATRICES.values())

    ids = [2, 105, 511, 2, 17, 300]
    for scale in (1.0, math.sqrt(DIM)):
        check(f"{be.name} embed x{scale:.3g}", rec.to_numpy(rec.embed(table, ids, scale)),
              cpu.embed(table_r, ids, scale), 0.0)
    x = cpu.embed(table_r, ids, math.sqrt(DIM))
    n = len(ids)

    got, want = p.both(lambda b, w, x: b.rms_norm(x, w.attn_norm, EPS), x)
    check(f"{be.name} rms_norm", got, want, TOL_FLOAT_OP)
    h = want
    got, want = p.both(lambda b, w, h: b.linear(h, [w.wq, w.wk, w.wv]), h)
    for tensor, g, r in zip(("attn_q", "attn_k", "attn_v"), got, want):
        check(f"{be.name} linear {tensor}", g, r, _linear_tol(be, gemma, tensor))
    q, k = want[0], want[1]
    bias = rnd(rng, N_KV * HD)
    got, want = p.both(lambda b, w, h, c: b.linear(h, [w.wk], [c]), h, bias)
    check(f"{be.name} linear with bias", got[0], want[0], _linear_tol(be, gemma, "attn_k"))
    got, want = p.both(lambda b, w, q: b.head_norm(q, H, w.q_norm, EPS), q)
    check(f"{be.name} head_norm", got, want, TOL_FLOAT_OP)
    got, want = p.both(lambda b, w, q: b.rope(q, H, np.arange(n), ROPE), want)
    check(f"{be.name} rope", got, want, TOL_FLOAT_OP)
    got, want = p.both(lambda b, w, k: b.rope(k, N_KV, np.arange(n), ROPE), k)
    check(f"{be.name} rope of keys", got, want, TOL_FLOAT_OP)

    for kind in ("f16", "q8_0"):
        _attention_steps(p, kind, rng)

    gate, up = rnd(rng, n, 2048, scale=3.0), rnd(rng, n, 2048)
    for act in ("silu", "gelu_tanh", "swiglu_oai", "sigmoid"):
        got, want = p.both(lambda b, w, g, u: b.glu(g, u, act), gate, up)
        check(f"{be.name} glu {act}", got, want, TOL_FLOAT_OP)
    moe, moe_r = _experts(rec), _experts(cpu)
    spec = MoESpec(4, 2, "softmax_weight", False, 0.0, "swiglu_oai")
    # unit-scale inputs: Gemma's hidden states have outlier dims that the CPU's 8-bit
    # activations for Q8_0 experts would blur far more than the backends' float ones
    xm = rnd(rng, 12, DIM)
    got = rec.to_numpy(rec.moe_ffn(rec.from_numpy(xm.copy()), moe, spec))
    check(f"{be.name} moe_ffn", got, cpu.moe_ffn(xm.copy(), moe_r, spec), 2 * TOL_LINEAR)
    fused = _experts(rec, fused=True)  # the halves of one stack compute what two stacks do
    for rows in (xm[:1], xm):  # one token (decode) and a chunk
        np.testing.assert_array_equal(
            rec.to_numpy(rec.moe_ffn(rec.from_numpy(rows.copy()), fused, spec)),
            rec.to_numpy(rec.moe_ffn(rec.from_numpy(rows.copy()), moe, spec)))
    # the encoders' operations (models/bert.py)
    nb = rnd(rng, DIM)
    got, want = p.both(lambda b, w, x, c: b.layer_norm(x, w.attn_norm, c, EPS), x, nb)
    check(f"{be.name} layer_norm", got, want, TOL_FLOAT_OP)
    got, want = p.both(lambda b, w, x: b.layer_norm(x, w.attn_norm, None, EPS), x)
    check(f"{be.name} layer_norm without bias", got, want, TOL_FLOAT_OP)
    for act in ("gelu_tanh", "tanh"):
        got, want = p.both(lambda b, w, g: b.act(g, act), gate)
        check(f"{be.name} act {act}", got, want, TOL_FLOAT_OP)
    eq, ek, ev = rnd(rng, 7, H * HD), rnd(rng, 7, N_KV * HD), rnd(rng, 7, N_KV * HD)
    got, want = p.both(lambda b, w, q, k, v: b.encoder_attention(q, k, v, [0, 5, 7], H, 0.0625),
                       eq, ek, ev)
    check(f"{be.name} encoder_attention", got, want, TOL_ATTENTION)
    y = rnd(rng, n, DIM)
    got, want = p.both(lambda b, w, x, y: b.add(x, y), x, y)
    np.testing.assert_array_equal(got, want)
    got, want = p.both(lambda b, w, x: b.select_rows(x, [5, 0, 5]), x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(rec.to_numpy(rec.from_numpy(x)), x)
    z = rnd(rng, 4096, scale=20.0)
    assert abs(rec.logsumexp(z) - cpu.logsumexp(z)) <= 1e-5 * abs(cpu.logsumexp(z))

    # A native block gives compose_block's bits; a backend without one refuses the call.
    xb = rnd(rng, 23, DIM, scale=4.0)
    if rec.fused_blocks:
        np.testing.assert_array_equal(_block(rec, w, xb, True), _block(be, w, xb, False))
    else:
        with pytest.raises(NotImplementedError):
            _block(rec, w, xb, True)

    _recurrent(rec, cpu, rng)
    assert rec.used == MEMBERS, f"not exercised: {sorted(MEMBERS - rec.used)}"


def _recurrent(b, cpu, rng) -> None:
    """DeltaNet layers: two sequences in one call give each sequence's own bits, states
    copy independently; a backend without them refuses with UnsupportedModel."""
    spec = DeltaNetSpec(2, 4, 16, 4, EPS)
    C, Hv = spec.conv_channels, spec.n_v_heads
    w = DeltaNetWeights(rnd(rng, C, 4, scale=0.5), rnd(rng, Hv), -np.exp(rnd(rng, Hv)))
    qkv, alpha, beta = rnd(rng, 9, C), rnd(rng, 9, Hv), rnd(rng, 9, Hv)
    rows = np.array([0] * 5 + [1] * 4, np.int32)
    if not b.recurrent:
        for call in (lambda: b.new_recurrent_state(spec), lambda: b.copy_recurrent_state(None),
                     lambda: b.recurrent_state_nbytes(spec),
                     lambda: b.delta_net(qkv, alpha, beta, w, spec, KVBatch(None, None, rows, 16))):
            with pytest.raises(UnsupportedModel):
                call()
        return
    assert b.recurrent_state_nbytes(spec) == 4 * (3 * C + Hv * 16 * 16)
    states = [b.new_recurrent_state(spec) for _ in range(2)]
    fork = b.copy_recurrent_state(states[0])
    both = b.to_numpy(b.delta_net(b.from_numpy(qkv), b.from_numpy(alpha), b.from_numpy(beta),
                                  w, spec, KVBatch(None, None, rows, 16, (), states)))
    for r, sl in ((0, slice(0, 5)), (1, slice(5, 9))):
        own = cpu.new_recurrent_state(spec)
        alone = cpu.delta_net(qkv[sl], alpha[sl], beta[sl], w, spec,
                              KVBatch(None, None, np.zeros(sl.stop - sl.start, np.int32), 16,
                                      (), [own]))
        np.testing.assert_array_equal(both[sl], alone)
    first = cpu.delta_net(qkv[:5], alpha[:5], beta[:5], w, spec,
                          KVBatch(None, None, np.zeros(5, np.int32), 16, (), [fork]))
    np.testing.assert_array_equal(first, both[:5])  # the copy did not move with the original
