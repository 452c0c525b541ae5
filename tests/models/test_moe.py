"""Mixture-of-experts architectures (Qwen3-MoE, Qwen2-MoE with its shared expert, OLMoE,
Mixtral as llama with experts, gpt-oss, Gemma 4's experts beside its dense FFN) on small
synthetic files, byte for byte the ones scripts/make_synthetic.py --moe sent through
llama.cpp: logits and greedy continuations against llama.cpp's, batch invariance, and the
torch and MLX stand-ins against the CPU."""

import json
from pathlib import Path

import numpy as np
import pytest

import localllm
from localllm.formats.gguf import GGUFFile
from localllm.testing import synthetic
from localllm.testing.compare import coarse_kl, log_softmax
from support.backends import device_agreement

FIXTURES = Path(__file__).parents[1] / "fixtures" / "synthetic"
KL_MAX = 0.01
TOP1_MARGIN = 0.015    # below llama.cpp's own token-by-token agreement with its batch
GREEDY_MIN = 0.95      # share of llama.cpp's greedy tokens we predict, teacher-forced
DEVICE_TOP1, DEVICE_KL = 0.95, 0.01   # torch and MLX (float activations) against the CPU
CASES = sorted(synthetic.MOE_CASES)
# Cases whose one detail moves the KL but not the top-1: Gemma 4's per-expert output scales
# (measured mean KL 2.0e-4 with them, 2.8e-3 with them left out)
KL_TIGHT = {"gemma4moe_fused": 1e-3}


def load_case(case: str) -> dict:
    with np.load(FIXTURES / f"{case}.npz") as z:
        fx = {k: z[k] for k in z.files}
    return {**fx, **json.loads(str(fx.pop("info")))}


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory, metas):
    d = tmp_path_factory.mktemp("moe")
    return {name: synthetic.write(name, d / f"{name}.gguf", metas["smollm"])
            for name in synthetic.MOE_SPECS}


@pytest.fixture(scope="module")
def moe_models(moe_files):
    models = {}
    yield lambda name: models.setdefault(name, localllm.load(
        moe_files[name], ctx_size=1024, threads=2, weight_cache=False))
    for m in models.values():
        m.close()


@pytest.mark.parametrize("case", CASES)
def test_file_is_the_one_llama_cpp_scored(moe_files, case):
    fx = load_case(case)
    assert synthetic.digest(moe_files[fx["model"]]) == fx["digest"], (
        "the synthetic model differs from the one the fixture was made on: "
        "rerun scripts/make_synthetic.py --reference PYTHON --moe")


@pytest.mark.parametrize("case", CASES)
def test_logits_agree_with_llama_cpp(moe_models, case):
    fx = load_case(case)
    m = moe_models(fx["model"])
    assert m.tokenize(fx["passage"]) == fx["ids"].tolist()
    lp = log_softmax(m.logits(fx["ids"].tolist()))
    kl = coarse_kl(fx, lp)
    top1 = float((lp.argmax(1) == fx["argmax"]).mean())
    print(f"{case}: {len(lp)} positions, top-1 {top1:.4f}, mean KL {kl.mean():.2e} "
          f"(llama.cpp token by token against its batch: top-1 {fx['self']['top1']:.4f}, "
          f"KL {fx['self']['kl_mean']:.2e})")
    assert top1 >= fx["self"]["top1"] - TOP1_MARGIN
    assert kl.mean() <= KL_TIGHT.get(case, KL_MAX)


@pytest.mark.parametrize("case", CASES)
def test_greedy_continuations_agree_with_llama_cpp(moe_models, case):
    fx = load_case(case)
    m = moe_models(fx["model"])
    hits = total = same = 0
    for g in fx["greedy"]:
        cont = g["continuation"]
        # llama.cpp's greedy text teacher-forced, as tests/models/test_engine.py scores it
        seq = g["prompt_ids"] + cont
        pred = m.logits(seq)[len(g["prompt_ids"]) - 1:len(seq) - 1].argmax(1)
        hits += int((pred == np.array(cont)).sum())
        total += len(cont)
        free = [t for c in m.generate(g["prompt_ids"], temperature=0, max_tokens=len(cont),
                                      ignore_eos=True) for t in c.tokens]
        same += free == cont
    print(f"{case}: greedy tokens predicted {hits}/{total}, free-running continuations "
          f"identical {same}/{len(fx['greedy'])}")
    assert hits / total >= GREEDY_MIN


@pytest.mark.parametrize("name,n", [("qwen2moe", 64), ("mixtral", 64), ("gptoss", 200)])
def test_logits_bit_identical_token_by_token_and_in_one_chunk(moe_models, name, n):
    """A token's experts see the same rows whichever other tokens share them (gpt-oss: past
    its 128-token windows, with its sinks)."""
    m = moe_models(name)
    ids = load_case(name)["ids"][:n].tolist()
    whole = m.logits(ids)
    for sizes in ([1] * len(ids), [5, 17, 1, 9, 32]):
        seq = m.new_sequence()
        parts, pos = [], 0
        for size in sizes + [len(ids) - sum(sizes)] * (sum(sizes) < len(ids)):
            parts.append(seq.feed(ids[pos:pos + size], all_logits=True))
            pos += size
        seq.release()
        chunked = np.concatenate(parts)
        assert np.array_equal(chunked.view(np.uint32), whole.view(np.uint32)), sizes[:5]


@pytest.mark.parametrize("name", ["qwen2moe", "mixtral", "olmoe"])
def test_native_attention_with_experts_gives_the_composed_bits(moe_files, moe_models, name,
                                                              monkeypatch):
    """An MoE block on the CPU runs its attention sublayer natively (one call) and its
    experts as moe_ffn does: the logits of the op-by-op blocks, bit for bit."""
    from localllm.backends import cpu as cpu_backend
    calls = []
    real = cpu_backend.CpuBackend.decoder_block
    monkeypatch.setattr(cpu_backend.CpuBackend, "decoder_block",
                        lambda self, x, w, *a: calls.append(w.moe is not None)
                        or real(self, x, w, *a))
    m = moe_models(name)
    ids = load_case(name)["ids"][:40].tolist()
    m.forget_cached()
    fused = m.logits(ids)
    assert calls and all(calls)
    ref = localllm.load(moe_files[name], ctx_size=1024, threads=2, weight_cache=False)
    try:
        ref.backend.fused_blocks = False
        assert np.array_equal(ref.logits(ids).view(np.uint32), fused.view(np.uint32))
        with m.new_sequence() as a, ref.new_sequence() as b:
            a.feed(ids[:9])
            b.feed(ids[:9])
            for t in ids[9:14]:
                assert np.array_equal(a.feed([t]).view(np.uint32), b.feed([t]).view(np.uint32))
    finally:
        ref.close()


@pytest.mark.parametrize("backend", ["torch", "mlx"])
@pytest.mark.parametrize("name", ["qwen2moe", "olmoe", "gptoss"])
def test_device_backends_agree_with_the_cpu(moe_files, moe_models, backend, name):
    ids = load_case(name)["ids"].tolist()
    want = log_softmax(moe_models(name).logits(ids))

    def check(m):
        assert all(la.backend is m.gpu_backend for la in m.net.layers)
    top1, kl = device_agreement(moe_files[name], want, ids, backend, check)
    print(f"{name} on {backend}: top-1 {top1:.4f}, mean KL {kl:.2e}")
    assert top1 >= DEVICE_TOP1
    assert kl <= DEVICE_KL


# ---------------------------------------------------------------------------- the split

SPLITS = [("torch", {"cpu_moe": True}, "qwen2moe"), ("torch", {"n_cpu_moe": 1}, "qwen2moe"),
          ("mlx", {"cpu_moe": True}, "qwen2moe"),
          ("torch", {"override_tensor": ("blk\\.1\\.ffn_.*_exps=CPU",)}, "qwen2moe"),
          ("torch", {"n_cpu_moe": 3}, "gptoss")]  # its router and expert biases follow


@pytest.mark.parametrize("backend, split, name", SPLITS)
def test_experts_kept_on_the_cpu_agree_with_the_cpu_backend(moe_files, moe_models, backend,
                                                            split, name):
    ids = load_case(name)["ids"].tolist()
    want = log_softmax(moe_models(name).logits(ids))

    def check(m):
        if "cpu_moe" in split:
            cpu_layers = set(range(len(m.net.layers)))
        elif "n_cpu_moe" in split:
            cpu_layers = set(range(split["n_cpu_moe"]))
        else:
            cpu_layers = {1}
        for la in m.net.layers:
            assert la.backend is m.gpu_backend  # attention and norms on the GPU backend
            home = la.weights.moe.backend
            assert (home is not None and home.name == "cpu") == (la.index in cpu_layers)
            mw = la.weights.moe
            if mw.gate_bias is not None:  # biases live with their experts
                on_cpu = [isinstance(v, np.ndarray)
                          for v in (mw.router_bias, mw.gate_bias[0], mw.down_bias[-1])]
                assert on_cpu == [la.index in cpu_layers] * 3
        # the ledger's expert bytes per device are what the backends hold
        for d in m.plan.devices:
            held = sum(d.backend.matrix_nbytes(x) for la in m.net.layers
                       for x in (la.weights.moe.gate, la.weights.moe.up, la.weights.moe.down)
                       if (la.weights.moe.backend or la.backend) is d.backend)
            assert abs(d.expert_bytes - held) <= 0.05 * max(held, 1), (d.label, d.expert_bytes)
    top1, kl = device_agreement(moe_files[name], want, ids, backend, check, **split)
    print(f"{name} on {backend} with {split}: top-1 {top1:.4f}, mean KL {kl:.2e}")
    assert top1 >= DEVICE_TOP1
    assert kl <= DEVICE_KL


def test_fused_gate_up_experts_are_read_in_place(moe_files, moe_models, monkeypatch):
    """Gemma 4's fused gate/up stack is mapped once (no anonymous copy of either half, the
    plan counts it as file pages) and both halves come from one matmul per expert: the
    logits of copying the halves out, bit for bit."""
    from localllm.backends import cpu as cpu_be
    from localllm.backends import cpu_moe
    from localllm.backends.host import copy_expert_halves
    name = "gemma4moe_fused"
    m = moe_models(name)
    ids = load_case(name)["ids"][:48].tolist()
    layers = [la for la in m.net.layers if la.weights.moe is not None]
    assert layers
    for la in layers:
        gate, up = la.weights.moe.gate, la.weights.moe.up
        assert cpu_moe.fused(gate, up) and gate.mapped and gate.nbytes == up.nbytes == 0
        assert gate.file_nbytes == up.file_nbytes > 0
    with GGUFFile(moe_files[name]) as f:
        fused_bytes = sum(int(t.nbytes) for n, t in f.tensors.items() if "gate_up_exps" in n)
    host = m.plan.devices[0]
    assert fused_bytes > 0 and host.file_bytes >= fused_bytes
    mapped_logits = m.logits(ids)
    monkeypatch.setattr(cpu_be.CpuBackend, "upload_expert_halves",
                        lambda be, *a, **k: copy_expert_halves(be, *a, **k))
    copied = localllm.load(moe_files[name], ctx_size=1024, threads=2, weight_cache=False)
    try:
        gate = next(la.weights.moe.gate for la in copied.net.layers
                    if la.weights.moe is not None)
        assert gate.half == -1 and gate.N == layers[0].weights.moe.gate.N
        np.testing.assert_array_equal(copied.logits(ids), mapped_logits)
    finally:
        copied.close()


def test_llm_inspect_plan_lists_expert_bytes_per_device(moe_files):
    pytest.importorskip("torch")
    from support.cli import llm
    r = llm("inspect", str(moe_files["mixtral"]), "--plan", "--backend", "torch", "-ngl", "all",
            "--n-cpu-moe", "1")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[0]: line.split() for line in r.stdout.splitlines()
            if line.strip().startswith(("cpu", "torch"))}
    assert "experts" in r.stdout
    experts = {k: float(v[v.index("MiB") + 1]) for k, v in rows.items()}
    assert experts["cpu"] > 0 and experts["torch"] > 0   # one layer's experts each


def test_tensor_rules_read_as_llama_cpps_options():
    from localllm.errors import BadSetting
    from localllm.models.common import tensor_override
    from localllm.runtime.placement import EXPERTS, tensor_rules
    rules = tensor_rules(("ffn_up_exps=CPU,attn=cuda0", "blk\\.7\\.=GPU"), True, 2)
    assert rules == (("ffn_up_exps", "cpu"), ("attn", "gpu"), ("blk\\.7\\.", "gpu"),
                     (EXPERTS, "cpu"), ("blk\\.0" + EXPERTS, "cpu"),
                     ("blk\\.1" + EXPERTS, "cpu"))
    # the first matching rule wins; a router and a shared expert go where their experts go
    assert tensor_override("blk.7.ffn_up_exps.weight", rules) == "cpu"
    assert tensor_override("blk.7.attn_q.weight", rules) == "gpu"
    assert tensor_override("blk.1.ffn_gate_inp.weight", rules) == "cpu"
    assert tensor_override("blk.1.ffn_down_shexp.weight", rules) == "cpu"
    assert tensor_override("blk.2.ffn_norm.weight", rules) is None
    for bad, needle in ((("exps",), "REGEX=BACKEND"), (("(=CPU",), "not a regular expression"),
                        (("exps=TPU",), "unknown backend")):
        with pytest.raises(BadSetting, match=needle):
            tensor_rules(bad)
    with pytest.raises(BadSetting, match="--n-cpu-moe"):
        tensor_rules((), False, -1)


def test_auto_fills_the_gpu_with_attention_first_then_experts(moe_files):
    """-ngl auto on a GPU too small for the whole model keeps every layer's attention, norms
    and KV there and moves experts to the CPU from the first layer on (as --n-cpu-moe N, the
    smallest N that fits); only when no expert fits do whole layers leave."""
    from localllm.backends.base import MemoryInfo
    from localllm.backends.cpu import CpuBackend
    from localllm.formats.gguf import GGUFFile
    from localllm.models import llama
    from localllm.runtime.placement import GPU_MARGIN, PlanRequest, plan_memory, tensor_rules

    class SeparateGpu(CpuBackend):
        """The CPU backend's sizes, allocated from a memory of its own (as a GPU's)."""
        name, device = "gpu", "gpu:0"

        def memory_info(self):
            return MemoryInfo("gpu:0", 0, 0)

    cpu, gpu = CpuBackend(), SeparateGpu()
    with GGUFFile(moe_files["mixtral"]) as f:
        args = llama.ModelArgs.from_gguf(f.metadata)
        assert args.n_layers == 2

        def plan(ngl, gpu_free, rules=()):
            return plan_memory(f.tensors, args, cpu, gpu,
                               PlanRequest(1024, gpu_layers=ngl, rules=rules),
                               {"host": 8 << 30, "gpu:0": gpu_free})

        def need(p):
            d = p.devices[1]
            return d.weight_bytes + 1024 * d.kv_per_token + d.scratch_bytes + GPU_MARGIN

        whole = need(plan("all", 8 << 30))
        first_out = need(plan("all", 8 << 30, tensor_rules(n_cpu_moe=1)))
        none_in = need(plan("all", 8 << 30, tensor_rules(cpu_moe=True)))
        one_layer = need(plan(1, 8 << 30, tensor_rules(cpu_moe=True)))
        assert whole > first_out > none_in > one_layer
        for room, layers, gpu_experts in ((whole, 2, 2), (whole - 1, 2, 1), (first_out, 2, 1),
                                          (first_out - 1, 2, 0), (none_in, 2, 0),
                                          (none_in - 1, 1, 0), (one_layer - 1, 0, 0)):
            p = plan("auto", room)
            assert p.gpu_layers == layers, (room, p.format())
            per_layer = p.devices[0].expert_bytes + p.devices[1].expert_bytes
            assert p.devices[1].expert_bytes * 2 == gpu_experts * per_layer, p.format()
            assert need(p) <= room or layers == 0
        # a rule the user gave still decides the tensors it names
        p = plan("auto", whole, tensor_rules(("blk\\.1\\.ffn_.*_exps=CPU",)))
        assert p.gpu_layers == 2 and p.devices[1].expert_bytes == p.devices[0].expert_bytes > 0


# ---------------------------------------------------------------------------- gpt-oss's windows

def test_gptoss_turns_reprocess_nothing_and_windows_stay_bounded(moe_files):
    """The KV machinery as it is, on gpt-oss's 128-token windows: each turn of a growing
    conversation runs only its new text, the sliding layers hold about a window of blocks,
    and the last answer regenerated (from its checkpoint) and from scratch is the same."""
    m = localllm.load(moe_files["gptoss"], ctx_size=1024, threads=2, weight_cache=False)
    try:
        passage = load_case("gptoss")["passage"]
        seq = m.new_sequence()
        conv = m.tokenize("A conversation.\n")
        bs = m.kv_stats().block_size
        window_blocks = 128 // bs + 2
        sliding = next(i for i, g in enumerate(m.kv.cache.groups) if g.window)
        assert m.kv.cache.groups[sliding].window == 128
        for turn in range(3):
            user = m.tokenize(f"\nQ{turn}: {passage[:300 + 100 * turn]}\nA:",
                              add_special=False)
            prompt = conv + user
            g = m.generate(prompt, seq=seq, temperature=0, max_tokens=150 if turn == 2 else 40,
                           ignore_eos=True)
            reply = [t for c in g for t in c.tokens]
            if turn:  # only the new text, and the reply's last token (sampled, never run)
                assert g.stats.prompt_tokens - g.stats.cached_tokens == len(user) + 1
            assert m.kv.cache.held_blocks(seq.kv, sliding) <= window_blocks
            conv = prompt + reply
        regen = m.generate(prompt, seq=seq, temperature=0, max_tokens=30, ignore_eos=True)
        again = [t for c in regen for t in c.tokens]
        assert regen.stats.cached_tokens == len(prompt) - 1
        assert again == reply[:30]
        seq.release()
        m.forget_cached()
        scratch = m.generate(prompt, temperature=0, max_tokens=30, ignore_eos=True)
        assert [t for c in scratch for t in c.tokens] == again
        assert scratch.stats.cached_tokens == 0
    finally:
        m.close()


def test_llm_run_on_gptoss_with_the_harmony_template(tmp_path, metas):
    """`llm run` end to end on the synthetic gpt-oss file carrying gpt-oss's own chat
    template (llama.cpp's models/templates/openai-gpt-oss-120b.jinja): the prompt is
    rendered in harmony's shape and the output split as harmony (this random model writes
    no channels, so all of it is the answer, on stdout)."""
    import os
    from localllm.formats.fetch import vocab_suite_dir
    from localllm.text.reasoning import style_of_template
    from support.cli import llm
    folder = Path(os.environ.get("LLAMA_CPP_TEMPLATES") or vocab_suite_dir() / "templates")
    src = folder / "openai-gpt-oss-120b.jinja"
    if not src.is_file():
        pytest.skip("no templates: `python scripts/fetch_models.py --vocab-suite`")
    path = synthetic.write("gptoss", tmp_path / "gptoss.gguf",
                           {**metas["smollm"], "tokenizer.chat_template": src.read_text()})
    m = localllm.load(path, ctx_size=1024, threads=2, weight_cache=False)
    try:
        assert style_of_template(m.template.source) == "harmony"
        prompt = m.template.render([{"role": "user", "content": "What is 5+5?"}], True)
        assert "<|start|>user<|message|>What is 5+5?<|end|>" in prompt
        assert prompt.endswith("<|start|>assistant")
    finally:
        m.close()
    r = llm("run", str(path), "-p", "What is 5+5?", "-n", "12", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_llm_run_takes_an_expert_cache_size(moe_files):
    """--expert-cache-mb 0 reads every expert from the file's layout, the default keeps
    packed copies: the same greedy text either way; a negative size is refused."""
    from support.cli import llm
    path = str(moe_files["qwen3moe"])
    outs = [llm("run", path, "-p", "Experts", "-n", "8", "--temp", "0", *extra)
            for extra in ((), ("--expert-cache-mb", "0"), ("--expert-cache-mb", "0.5"))]
    assert all(r.returncode == 0 for r in outs), [r.stderr for r in outs]
    assert outs[0].stdout == outs[1].stdout == outs[2].stdout and outs[0].stdout.strip()
    r = llm("run", path, "-p", "x", "--expert-cache-mb", "-1")
    assert r.returncode == 2 and "--expert-cache-mb must be >= 0" in r.stderr
