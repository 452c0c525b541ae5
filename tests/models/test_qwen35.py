"""Qwen3.5 on its synthetic file: the DeltaNet layers keep recurrent states per sequence (no
KV pages), logits are bit identical however the tokens are batched or chunked, prefixes
are reused through the states' checkpoints (a second turn and a regenerated answer run only
their new tokens, with the replies of a run from scratch), forks and rollbacks land on
exact states, and the GPU backends refuse the model in one line. Against llama.cpp (fixtures
of scripts/make_synthetic.py --hybrid): logits, greedy tokens and token ids, to the bars of
tests/models/test_synthetic.py."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

import localllm
from localllm.runtime.sequence import StepItem
from localllm.testing import synthetic
from localllm.testing.compare import coarse_kl, log_softmax

SPEC = synthetic.HYBRID_SPECS["qwen35"]
FIXTURES = Path(__file__).parents[1] / "fixtures" / "synthetic"
TOP1_MIN, TOP1_MARGIN, KL_MAX, NEAR_TIE = 0.99, 0.015, 0.01, 0.1  # test_synthetic.py's bars
GREEDY_MIN = 0.95
TEXT = ("The history of the printing press begins in the fifteenth century, when movable "
        "type changed how books were made and who could read them; within fifty years")


@pytest.fixture(scope="module")
def path(tmp_path_factory, metas):
    return synthetic.write("qwen35", tmp_path_factory.mktemp("qwen35") / "qwen35.gguf",
                           metas["smollm"])


@pytest.fixture(scope="module")
def model(path):
    m = localllm.load(path, ctx_size=1024, threads=2, weight_cache=False, kv_block_size=16)
    yield m
    m.close()


def test_fused_blocks_give_the_composed_bits(path, model, monkeypatch):
    """The blocks run natively (the CPU backend's delta_block, and its gated attention in two
    calls), with the bits of the op-by-op blocks: a prompt, decode steps and two sequences in
    one step."""
    from localllm.backends import cpu as cpu_backend
    calls = []
    real = cpu_backend.CpuBackend.decoder_block
    monkeypatch.setattr(cpu_backend.CpuBackend, "decoder_block",
                        lambda self, x, w, s, *a: calls.append(s.recurrent is not None)
                        or real(self, x, w, s, *a))
    ids = model.tokenize(TEXT)
    model.forget_cached()  # nothing reused: every layer runs
    fused = model.logits(ids)
    # every layer of the file (6 DeltaNet, 2 attention), once per chunk (chunks end at
    # checkpoint blocks)
    assert calls and len(calls) % 8 == 0 and sum(calls) == len(calls) // 8 * 6
    ref = localllm.load(path, ctx_size=1024, threads=2, weight_cache=False, kv_block_size=16)
    try:
        ref.backend.fused_blocks = False  # the composed block, op by op
        np.testing.assert_array_equal(ref.logits(ids).view(np.uint32), fused.view(np.uint32))
        with model.new_sequence() as a, ref.new_sequence() as b:
            a.feed(ids[:7])
            b.feed(ids[:7])
            for t in ids[7:12]:
                np.testing.assert_array_equal(a.feed([t]), b.feed([t]))
        with model.new_sequence() as a, model.new_sequence() as b:
            a.feed(ids[:9])
            out = model.step([StepItem(a, ids[9:20], "all"), StepItem(b, ids[:14], "all")])
        np.testing.assert_array_equal(out[0], fused[9:20])
        np.testing.assert_array_equal(out[1], fused[:14])
    finally:
        ref.close()


def test_linear_layers_keep_states_not_pages(model):
    space = model._runner.space
    full = [i for i in range(SPEC.n_layers) if (i + 1) % SPEC.full_every == 0]
    assert [g.layers for g in space.kv_groups] == [tuple(full)]
    assert [la.index for la in space.recurrent.layers] == \
        [i for i in range(SPEC.n_layers) if i not in full]
    Hk, Hv, S, K = SPEC.ssm
    per_seq = 6 * 4 * ((K - 1) * (2 * Hk + Hv) * S + Hv * S * S)
    assert space.recurrent.state_nbytes == per_seq
    before = model.kv_stats().recurrent_bytes
    with model.new_sequence() as seq:
        seq.feed(model.tokenize(TEXT))
        assert model.kv_stats().recurrent_bytes == before + per_seq
        assert model.kv_stats().checkpoint_bytes > 0
    assert model.kv_stats().recurrent_bytes == before


def test_logits_are_bit_identical_however_batched(model):
    ids = model.tokenize(TEXT)
    whole = model.logits(ids)
    with model.new_sequence() as seq:
        steps = np.stack([seq.feed([t]) for t in ids])
    np.testing.assert_array_equal(steps, whole)
    with model.new_sequence() as seq:
        parts = np.concatenate([seq.feed(ids[a:b], all_logits=True)
                                for a, b in ((0, 5), (5, 6), (6, 23), (23, len(ids)))])
    np.testing.assert_array_equal(parts, whole)
    # two sequences in one step, each with its own state
    with model.new_sequence() as a, model.new_sequence() as b:
        a.feed(ids[:9])
        out = model.step([StepItem(a, ids[9:20], "all"), StepItem(b, ids[:14], "all")])
    np.testing.assert_array_equal(out[0], whole[9:20])
    np.testing.assert_array_equal(out[1], whole[:14])


def _reply(m, ids, n=10):
    gen = m.generate(ids, temperature=0, max_tokens=n, ignore_eos=True)
    tokens = [t for c in gen for t in c.tokens]
    return tokens, gen.stats


def test_turns_and_regenerations_run_only_their_new_tokens(path, model):
    """A conversation at the token level: each turn's prompt is the previous prompt, its
    reply and a new message. The reused model runs only the new tokens; each reply is the
    one a fresh model gives from scratch."""
    fresh = localllm.load(path, ctx_size=1024, threads=2, weight_cache=False,
                          kv_block_size=16)
    model.forget_cached()
    ids = model.tokenize("Hello, who are you?")
    held = 0
    try:
        for turn in range(3):
            reply, st = _reply(model, ids)
            assert st.prompt_tokens - st.cached_tokens == len(ids) - held, turn
            fresh.forget_cached()
            want, st0 = _reply(fresh, ids)
            assert st0.cached_tokens == 0 and reply == want, turn
            again, st = _reply(model, ids)  # regenerated: only the last prompt token runs
            assert again == reply and st.prompt_tokens - st.cached_tokens == 1, turn
            held = len(ids) + len(reply) - 1  # the sequence held all but the last sampled
            ids = ids + reply + model.tokenize(f" And turn {turn}?", add_special=False)
    finally:
        fresh.close()


def test_chat_turns_reuse_the_previous_turn(model):
    """Through chat(): the second turn's prompt re-renders the first reply; at most a
    block's worth beyond the new tokens runs again (states are kept at block boundaries)."""
    model.forget_cached()
    msgs = [{"role": "user", "content": "Tell me about printing."}]
    gen = model.chat(msgs, temperature=0, max_tokens=12, ignore_eos=True)
    text = "".join(gen)
    first = model.chat_tokens(msgs)
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "More?"}]
    second = model.chat_tokens(msgs)
    held = first + gen.stats.tokens[:-1]
    common = next((i for i, (a, b) in enumerate(zip(held, second)) if a != b),
                  min(len(held), len(second)))
    gen = model.chat(msgs, temperature=0, max_tokens=4, ignore_eos=True)
    list(gen)
    ran = gen.stats.prompt_tokens - gen.stats.cached_tokens
    assert len(second) - common <= ran <= len(second) - common + 16


def test_fork_and_rollback_restore_exact_states(model):
    ids = model.tokenize(TEXT + " " + TEXT)
    whole = model.logits(ids)
    with model.new_sequence() as seq:
        seq.feed(ids[:20])
        child = seq.fork()
        for t in ids[20:24]:
            seq.feed([t])
        np.testing.assert_array_equal(child.feed(ids[20:30], all_logits=True), whole[20:30])
        child.release()
        # a rejected draft: back to 33 tokens, at the block-boundary snapshot of 32 and one
        # token run again
        seq.feed(ids[24:40])
        kept = seq.trim(33)
        assert kept == 32 and len(seq) == 32
        np.testing.assert_array_equal(seq.feed(ids[32:36], all_logits=True), whole[32:36])


def test_gpu_backends_keep_the_linear_layers_on_the_cpu(path):
    """-ngl auto runs the model on the CPU; layers on the GPU that take a DeltaNet layer are
    refused in one line before anything loads, naming how many could go; the last
    (attention) layer can."""
    pytest.importorskip("torch")
    from localllm.errors import BadSetting
    with pytest.raises(BadSetting) as err:
        localllm.load(path, ctx_size=256, threads=1, weight_cache=False, backend="torch",
                      gpu_layers="all")
    msg = str(err.value)
    assert "linear-attention" in msg and "the last 1 layers at most" in msg and "\n" not in msg
    m = localllm.load(path, ctx_size=256, threads=1, weight_cache=False, backend="torch",
                      gpu_layers="auto")
    try:
        assert m.plan.gpu_layers == 0 and m.plan.summary() == "cpu"
    finally:
        m.close()
    m = localllm.load(path, ctx_size=256, threads=1, weight_cache=False, backend="torch",
                      gpu_layers=1)
    try:
        assert m.plan.gpu_layers == 1
        assert len(list(m.generate("The", max_tokens=2, temperature=0))) > 0
    finally:
        m.close()


def test_unsupported_state_sizes_are_refused_naming_the_key(path):
    """A DeltaNet head size the kernels cannot run is a one-line error naming the key."""
    from dataclasses import replace

    from localllm.formats.gguf import GGUFFile
    from localllm.models import qwen35
    from localllm.models.common import ModelError
    with GGUFFile(path) as f:
        args = qwen35.ModelArgs.from_gguf(f.metadata)
    odd = replace(args, ssm_state=24, ssm_inner=24 * args.n_v_heads)
    with pytest.raises(ModelError, match="'qwen35.ssm.state_size' \\(24\\) is not a multiple"):
        odd.check_recurrent()
    with pytest.raises(ModelError, match="time_step_rank"):
        replace(args, n_v_heads=args.n_k_heads + 1).check_recurrent()


def test_plan_sizes_kv_for_attention_layers_and_room_for_states(model):
    """The ledger's KV is the full-attention layers' (what the pool holds), and the states'
    room is counted in the CPU's total: a live state and snapshots per sequence."""
    from localllm.runtime.placement import POOL_CONTEXTS
    from localllm.runtime.recurrent import states_held
    plan, space = model.plan, model._runner.space
    cpu = plan.devices[0]
    assert cpu.kv_per_token == space.bytes_per_token
    assert plan.states == states_held(POOL_CONTEXTS)
    assert cpu.state_bytes == plan.states * space.recurrent.state_nbytes
    assert plan.total(cpu) == cpu.weight_bytes + plan.kv_bytes(cpu) + cpu.scratch_bytes \
        + cpu.state_bytes
    assert f"room for {plan.states} recurrent states" in plan.format()


def test_speculative_drafts_roll_back_to_exact_states(path, model, tmp_path, metas):
    """Drafts of another Qwen3.5 file (the MTP one: same vocabulary, other weights), most
    of them rejected: each rollback lands on a snapshot and runs the kept tokens again, in
    the target and in the draft model, so the greedy text is the plain one."""
    draft = synthetic.write("qwen35_mtp", tmp_path / "draft.gguf", metas["smollm"])
    ids = model.tokenize(TEXT)
    plain, _ = _reply(model, ids, 24)
    spec = localllm.load(path, ctx_size=1024, threads=2, weight_cache=False, draft=str(draft),
                         draft_max=4)
    try:
        drafted, st = _reply(spec, ids, 24)
    finally:
        spec.close()
    assert st.draft_tokens - st.accepted_tokens >= 3  # drafts were rejected
    assert drafted == plain


# ---------------------------------------------------------------------- against llama.cpp

def load_case(case: str) -> dict:
    f = FIXTURES / f"{case}.npz"
    if not f.exists():
        pytest.skip(f"no llama.cpp fixture {f.name}: run scripts/make_synthetic.py --hybrid")
    with np.load(f) as z:
        fx = {k: z[k] for k in z.files}
    return {**fx, **json.loads(str(fx.pop("info")))}


@pytest.fixture(scope="module")
def hybrid_models(tmp_path_factory, metas):
    d = tmp_path_factory.mktemp("hybrid")
    loaded = {}

    def get(name):
        if name not in loaded:
            p = synthetic.write(name, d / f"{name}.gguf", metas["smollm"])
            loaded[name] = (p, localllm.load(p, ctx_size=1024, threads=2, weight_cache=False))
        return loaded[name]
    yield get
    for _, m in loaded.values():
        m.close()


@pytest.mark.parametrize("case", sorted(synthetic.HYBRID_CASES))
def test_logits_agree_with_llama_cpp(hybrid_models, case):
    fx = load_case(case)
    p, m = hybrid_models(fx["model"])
    assert synthetic.digest(p) == fx["digest"], "rerun scripts/make_synthetic.py --hybrid"
    lp = log_softmax(m.logits(fx["ids"].tolist()))
    kl = coarse_kl(fx, lp)
    top1 = float((lp.argmax(1) == fx["argmax"]).mean())
    print(f"{case}: {len(lp)} positions, top-1 {top1:.4f}, mean KL {kl.mean():.2e} "
          f"(llama.cpp token by token against its batch: top-1 {fx['self']['top1']:.4f}, "
          f"KL {fx['self']['kl_mean']:.2e})")
    assert top1 >= min(TOP1_MIN, fx["self"]["top1"] - TOP1_MARGIN)
    assert kl.mean() <= KL_MAX
    gap = fx["top_logprobs"][:, 0] - fx["top_logprobs"][:, 1]
    assert np.all(gap[lp.argmax(1) != fx["argmax"]] < NEAR_TIE)


@pytest.mark.parametrize("case", sorted(synthetic.HYBRID_CASES))
def test_greedy_and_token_ids_agree_with_llama_cpp(hybrid_models, case):
    """llama.cpp's greedy continuations (token by token, through the recurrent states):
    our argmax along them in one batch and our free-running greedy text; the tokenizer
    texts' ids under the qwen35 pre-tokenizer."""
    fx = load_case(case)
    _, m = hybrid_models(fx["model"])
    assert m.tokenize(fx["passage"]) == fx["ids"].tolist()
    bad = [t[:40] for t, ids in zip(fx["texts"], fx["text_ids"])
           if m.tokenize(t, add_special=False) != ids]
    assert not bad, f"{len(bad)} of {len(fx['texts'])} texts differ: {bad[:5]}"
    hits = total = identical = 0
    for g in fx["greedy"]:
        seq = g["prompt_ids"] + g["continuation"]
        pred = m.logits(seq)[len(g["prompt_ids"]) - 1:len(seq) - 1].argmax(1)
        hits += int((pred == np.array(g["continuation"])).sum())
        total += len(g["continuation"])
        free, _ = _reply(m, g["prompt_ids"], len(g["continuation"]))
        identical += free == g["continuation"]
    print(f"{case}: teacher-forced greedy agreement {hits / total:.4f} over {total} "
          f"positions, free-running identical {identical}/{len(fx['greedy'])}")
    assert hits / total >= GREEDY_MIN
    assert identical >= len(fx["greedy"]) // 2


def test_llm_inspect_and_run_show_the_recurrent_memory(path):
    """`llm inspect` counts KV for the full-attention layers only and shows the state per
    sequence; `llm run -v` the states' and checkpoints' memory."""
    from support.cli import llm
    r = llm("inspect", str(path))
    assert r.returncode == 0, r.stderr
    assert "KV cache:       1.0 MB per 1k tokens" in r.stdout
    assert "recurrent:      0.4 MB per sequence (6 linear-attention layers)" in r.stdout
    r = llm("run", str(path), "-p", "The history of the printing press", "-n", "8", "--temp",
            "0", "--ignore-eos", "-v")
    assert r.returncode == 0, r.stderr
    assert re.search(r"recurrent state: [\d.]+ MB held by sequences, [\d.]+ MB in "
                     r"checkpoints", r.stderr), r.stderr
