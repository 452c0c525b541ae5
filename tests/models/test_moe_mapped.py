"""Experts read from the mapped GGUF in place on the CPU: the backend holds views of the
file's pages rather than copies, computes the bits the packed kernels compute, and the
ledger counts those pages apart from anonymous memory and refuses what cannot fit."""

import dataclasses

import numpy as np
import pytest

import localllm
from localllm.backends import cpu_moe
from localllm.backends.cpu import CpuBackend
from localllm.errors import NotEnoughMemory
from localllm.kernels import mapped
from localllm.kernels import matmul as mm
from localllm.testing import synthetic
from localllm.testing.kernel_data import random_weight

MODEL = "qwen3moe"  # Q4_0 gate/up and Q6_K down experts
_GIB = 1 << 30


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory, metas):
    return synthetic.write(MODEL, tmp_path_factory.mktemp("mapped") / f"{MODEL}.gguf",
                           metas["smollm"])


@pytest.fixture(scope="module")
def model(moe_file):
    m = localllm.load(moe_file, ctx_size=256, threads=2, backend="cpu", weight_cache=False)
    yield m
    m.close()


def _expert_tensors(f):
    return {n: t for n, t in f.tensors.items() if len(t.shape) == 3}


def test_experts_are_views_of_the_mapped_file_and_the_ledger_says_so(model):
    f = model.file
    stacks = {}
    for la in model.net.layers:
        w = la.weights.moe
        for kind, stack in (("gate", w.gate), ("up", w.up), ("down", w.down)):
            stacks[f"blk.{la.index}.ffn_{kind}_exps.weight"] = stack
    assert stacks.keys() == _expert_tensors(f).keys()
    for name, stack in stacks.items():
        raw = f.raw(name)
        assert stack.mapped and stack.nbytes == 0, name
        for part in stack.parts:
            assert np.shares_memory(part.rows, raw), name  # the file's pages, not a copy
            assert not part.rows.flags.writeable
        assert stack.file_nbytes == raw.nbytes
    cpu = model.plan.devices[0]
    experts = sum(t.nbytes for t in _expert_tensors(f).values())
    assert cpu.expert_bytes == experts
    assert cpu.file_bytes == experts + f.tensors["token_embd.weight"].nbytes
    # the anonymous weights planned are those the backend holds: no expert among them
    held = model.backend.held_nbytes() - model.plan.kv_bytes(cpu)
    assert abs(cpu.weight_bytes - held) < experts / 4, (cpu.weight_bytes, held)
    assert "mapped" in model.plan.format()


def test_mapped_experts_give_the_packed_experts_bits(model):
    """Every token's FFN output, alone or among others, is the one the packed experts give."""
    la = model.net.layers[1]
    w = la.weights.moe
    f = model.file

    def packed(stack, kind):
        raw = f.raw(f"blk.{la.index}.ffn_{kind}_exps.weight")
        return cpu_moe.pack_experts(stack.type_name, raw, len(stack.parts), stack.N, stack.K)

    wp = dataclasses.replace(w, gate=packed(w.gate, "gate"), up=packed(w.up, "up"),
                             down=packed(w.down, "down"))
    assert not wp.gate.mapped and wp.gate.nbytes > 0
    x = np.random.default_rng(3).standard_normal((37, w.gate.K)).astype(np.float32)
    spec = la.spec.moe
    whole = cpu_moe.moe_ffn(x, w, spec)
    assert np.array_equal(whole.view(np.uint32), cpu_moe.moe_ffn(x, wp, spec).view(np.uint32))
    for t in (0, 20):
        alone = cpu_moe.moe_ffn(x[t:t + 1], w, spec)
        assert np.array_equal(alone.view(np.uint32), whole[t:t + 1].view(np.uint32))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K", "MXFP4"])
def test_mapped_matmul_is_the_packed_matmul_bit_for_bit(fmt):
    rng = np.random.default_rng(7)
    N, K = 48, 512
    raw = random_weight(fmt, N, K, rng).reshape(-1)
    packed, view = mm.pack(fmt, raw, N, K), mapped.view(fmt, raw, N, K)
    assert np.shares_memory(view.rows, raw)
    for n in (1, 5, 70):  # 70: more than one pass of tokens over a tile
        act = mm.quantize(rng.standard_normal((n, K)).astype(np.float32), True, True)
        want = mm.matmul(packed, act)
        assert np.array_equal(mapped.matmul_mapped(view, act).view(np.uint32),
                              want.view(np.uint32)), (fmt, n)


def test_shapes_that_cannot_be_read_in_place_are_packed():
    be = CpuBackend()
    assert be.plan_experts_nbytes("Q4_0", 4, 32, 64) == (0, 4 * 32 * 36)
    anon, file_backed = be.plan_experts_nbytes("F16", 4, 32, 64)  # floats are transposed
    assert anon == 4 * be.plan_matrix_nbytes("F16", 32, 64) and file_backed == 0
    assert be.plan_experts_nbytes("Q4_0", 4, 40, 64)[1] == 0  # a partial last tile
    with pytest.raises(ValueError, match="in place"):
        mapped.view("Q4_0", np.zeros(40 * 36, np.uint8), 40, 64)


def test_a_model_whose_own_memory_does_not_fit_is_refused_naming_the_numbers(moe_file):
    from localllm.api import LoadSettings, plan_model
    from localllm.formats.gguf import GGUFFile

    settings = LoadSettings(ctx_size=256, backend="cpu")
    with GGUFFile(moe_file) as f:
        plan = plan_model(f, settings).memory
        cpu = plan.devices[0]
        need = cpu.weight_bytes + 256 * cpu.kv_per_token + cpu.scratch_bytes
        assert cpu.file_bytes >= cpu.expert_bytes > 0
        # the file's pages need not fit beside the anonymous memory (they are page cache):
        # this much is free, less than the experts would take as copies beside the rest
        assert plan_model(f, settings, free={"host": need}).memory.pool_tokens == 256
        with pytest.raises(NotEnoughMemory) as err:
            plan_model(f, settings, free={"host": need - 1})
        msg = str(err.value)
        assert f"{cpu.weight_bytes / _GIB:.2f} GiB of its own for weights" in msg
        assert f"{cpu.file_bytes / _GIB:.2f} GiB read from the model file in place" in msg
        assert f"{(need - 1) / _GIB:.2f} GiB is available" in msg


def _pool_budget(w, capacity: int) -> int:
    """A budget whose share for each of the layer's stacks holds ``capacity`` experts
    (the stacks of one layer are registered alone, so the shares are exact)."""
    pools = cpu_moe.ExpertPools(0)
    return sum(capacity * pools._packed_nbytes(s) for s in (w.gate, w.up, w.down))


def test_pooled_experts_give_the_mapped_bits_and_evict_the_least_recent(model):
    """Packed copies of the experts in use compute the file's bits, prompt chunk or decode
    step, while the pool's slots are refilled in least-recently-used order."""
    la = model.net.layers[1]
    w = la.weights.moe
    spec = la.spec.moe
    k = spec.n_used
    released = []
    gate = dataclasses.replace(w.gate, release=lambda a, b: released.append((a, b)))
    w = dataclasses.replace(w, gate=gate)
    pools = cpu_moe.ExpertPools(_pool_budget(w, k + 1))
    for s in (w.gate, w.up, w.down):
        pools.register(s)
    x = np.random.default_rng(5).standard_normal((29, w.gate.K)).astype(np.float32)
    want = cpu_moe.moe_ffn(x, w, spec)
    assert np.array_equal(cpu_moe.moe_ffn(x, w, spec, pools).view(np.uint32),
                          want.view(np.uint32))
    pool = pools.pool(w.gate, k)
    assert pool.capacity == k + 1 and pools.nbytes > 0
    # gate and up share a format here: a decode step runs both in one region
    assert cpu_moe._pairable(pool, pools.pool(w.up, k))
    hits, misses = pools.stats()
    assert misses > 3 * (k + 1)  # the chunk used more experts than fit: slots were reused
    for t in range(12):  # decode steps, one token each, refilling and reusing slots
        one = cpu_moe.moe_ffn(x[t:t + 1], w, spec, pools)
        assert np.array_equal(one.view(np.uint32), want[t:t + 1].view(np.uint32)), t
    # those steps ran natively: the router, then the pooled experts, in two calls
    assert pools.native[id(w)].pools is not None and pools.native[id(w)].w is w
    before = pools.stats()
    again = cpu_moe.moe_ffn(x[11:12], w, spec, pools)  # the same experts: all held
    assert pools.stats()[1] == before[1] and pools.stats()[0] == before[0] + 3 * k
    assert np.array_equal(again.view(np.uint32), want[11:12].view(np.uint32))
    per = w.gate.stacked.shape[1] * w.gate.stacked.shape[2]
    assert released and all(b - a == per and a % per == 0 for a, b in released)


def test_a_pool_refills_its_least_recently_used_slot(model):
    w = model.net.layers[0].weights.moe.gate
    pool = cpu_moe.ExpertPool(w, 3)
    x = np.random.default_rng(8).standard_normal((1, w.K)).astype(np.float32)
    act = mm.quantize(x, True, w.K % 256 == 0)  # Q4_0 gate experts: 32-blocks

    def check(ids, hit):
        h, m = pool.hits, pool.misses
        got = cpu_moe._pool_matmul(pool, ids, act)
        assert (pool.hits - h, pool.misses - m) == (hit, len(ids) - hit), ids
        want = mapped.matmul_stack(w.type_name, w.stacked, np.asarray(ids), act)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), ids
    check([0, 1, 2], 0)
    check([0], 1)
    check([3], 0)     # 1 was used least recently: its slot takes 3
    check([1], 0)     # then 2's
    check([0, 3], 2)
    check([2, 1], 1)  # 2 comes back in place of 0
    check([0], 0)


def test_a_pool_share_below_a_tokens_experts_falls_back_to_the_file(model):
    la = model.net.layers[0]
    w = la.weights.moe
    k = la.spec.moe.n_used
    pools = cpu_moe.ExpertPools(_pool_budget(w, k - 1))
    for s in (w.gate, w.up, w.down):
        pools.register(s)
    assert pools.pool(w.gate, k) is None and pools.nbytes == 0
    x = np.random.default_rng(6).standard_normal((3, w.gate.K)).astype(np.float32)
    want = cpu_moe.moe_ffn(x, w, la.spec.moe)
    got = cpu_moe.moe_ffn(x, w, la.spec.moe, pools)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert cpu_moe.ExpertPools(0).resolve_budget() == 0


def test_the_model_decodes_from_its_pools(model):
    """A load's backend pools its mapped experts (budget from free memory): decoding the
    same text twice packs nothing the second time, and gives the same tokens."""
    pools = model.backend.expert_pools
    first = model.generate("The pool", max_tokens=6, temperature=0, speculate=False)
    a = [c.tokens for c in first]
    misses = pools.stats()[1]
    second = model.generate("The pool", max_tokens=6, temperature=0, speculate=False)
    assert [c.tokens for c in second] == a
    assert pools.stats()[1] == misses and pools.nbytes > 0
