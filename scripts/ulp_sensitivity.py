#!/usr/bin/env python3
"""How far a one-ulp change travels through a quantized model.

Runs the logits fixtures' passage through localllm twice, the second time with every
embedding value moved to the next float32 up (a relative change of ~6e-8), and prints how
often the argmax changes and the mean KL between the two runs, next to the same figures
for localllm against llama.cpp and llama.cpp against itself (from the fixtures). Then the
same along localllm's own greedy continuations of the fixtures' prompts (unnudged, they
agree 100%: the engine is batch-invariant), nudged on every row or only after the prompt. It shows
the floor under any agreement figure between two implementations that are not
bit-identical: every matmul re-quantizes its input to 8 bits, so the smallest difference
sometimes crosses a rounding boundary and grows from there.

With --embed, the same floor for SmolLM2's pooled embeddings (the fixtures' texts, mean and
last pooling): the cosine of localllm against itself nudged, of llama.cpp against itself
with flash attention on and off and with an F32 instead of an F16 KV cache, of localllm
against llama.cpp, and of the two on an F32 copy of the same weights, where no activation
is rounded to 8 bits (needs llama-cpp-python).

  python scripts/ulp_sensitivity.py [--threads N] [--embed]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

import localllm  # noqa: E402
from fixtures_logits import coarse_kl, log_softmax  # noqa: E402  (run as a script, scripts/ is on the path)

MODELS = {"smollm": "smollm2-135m", "gemma": "gemma3-270m"}


def nudge(m):
    """Make the model's embeddings one float32 ulp larger; returns the undo."""
    embed = m.net.embed
    m.net.embed = lambda t: np.nextafter(np.asarray(embed(t), np.float32), np.float32(1e30))
    return lambda: setattr(m.net, "embed", embed)


def greedy_agreement(m, prompts, nudged_rows: str) -> float:
    """Our greedy continuations, scored teacher-forced with embeddings nudged on
    ``nudged_rows`` ('all' or 'continuation': the prompt's state then stays shared)."""
    hits = total = 0
    for prompt in prompts:
        cont = [t for c in m.generate(prompt, temperature=0, max_tokens=32, ignore_eos=True)
                for t in c.tokens]
        seq = m.new_sequence()
        if nudged_rows == "continuation":
            seq.feed(prompt)
            undo = nudge(m)
        else:
            undo = nudge(m)
            seq.feed(prompt[:-1])
            cont = [prompt[-1]] + cont
        z = seq.feed(cont[:-1], all_logits=True)
        seq.release()
        undo()
        hits += int((z.argmax(1) == np.array(cont[1:])).sum())
        total += len(cont) - 1
    return hits / total


def llama_cpp_pooled(path, inputs: list[list[int]], pooling: str, threads: int,
                     **params) -> np.ndarray:
    """llama.cpp's raw pooled vectors, each input decoded alone (as the fixtures are)."""
    import ctypes

    import llama_cpp
    llm = llama_cpp.Llama(str(path), embedding=True, n_ctx=512, n_batch=512, n_ubatch=512,
                          n_threads=threads, n_threads_batch=threads, verbose=False,
                          pooling_type={"mean": 1, "last": 3}[pooling], **params)
    out = []
    for ids in inputs:
        llm._batch.reset()
        llm._ctx.kv_cache_clear()
        llm._batch.add_sequence(ids, 0, True)
        llm._ctx.decode(llm._batch)
        ptr = llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, 0)
        out.append(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                         shape=(llm.n_embd(),)).copy())
    llm.close()
    return np.stack(out)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def embedding_floor(threads: int) -> None:
    import tempfile

    from localllm.formats import fetch
    from localllm.testing.gguf_copy import copy_gguf
    path = fetch.resolve_model_path(MODELS["smollm"], None, download=False)
    fixtures = ROOT / "tests" / "fixtures" / "embeddings"
    print("| SmolLM2 Q4_1, cosine over the fixtures' texts | pooling | lowest | mean |")
    print("|---|---|---:|---:|")
    with tempfile.TemporaryDirectory() as d:
        f32 = copy_gguf(path, Path(d) / "smollm_f32.gguf", requant=("Q4_1", "F32"))
        m = localllm.load(path, ctx_size=512, threads=threads)
        m32 = localllm.load(f32, ctx_size=512, threads=threads)
        for pooling in ("mean", "last"):
            with np.load(fixtures / f"smollm_{pooling}.npz") as z:
                inputs = json.loads(str(z["info"]))["inputs"]
            ours = np.stack(m.embed(inputs, pooling=pooling, normalize=False))
            undo = nudge(m)
            nudged = np.stack(m.embed(inputs, pooling=pooling, normalize=False))
            undo()
            ref = llama_cpp_pooled(path, inputs, pooling, threads)
            rows = [
                ("localllm vs localllm with embeddings +1 ulp", cosines(ours, nudged)),
                ("llama.cpp vs llama.cpp with flash attention",
                 cosines(ref, llama_cpp_pooled(path, inputs, pooling, threads,
                                               flash_attn=True))),
                ("llama.cpp vs llama.cpp with an F32 KV cache",
                 cosines(ref, llama_cpp_pooled(path, inputs, pooling, threads,
                                               type_k=0, type_v=0))),
                ("localllm vs llama.cpp", cosines(ours, ref)),
                ("localllm vs llama.cpp, the weights in F32",
                 cosines(np.stack(m32.embed(inputs, pooling=pooling, normalize=False)),
                         llama_cpp_pooled(f32, inputs, pooling, threads))),
            ]
            for label, c in rows:
                print(f"| {label} | {pooling} | {c.min():.7f} | {c.mean():.7f} |")
        m.close()
        m32.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--embed", action="store_true",
                    help="the floor under embedding cosines instead (SmolLM2, mean and last)")
    args = ap.parse_args(argv)
    if args.embed:
        embedding_floor(args.threads)
        return 0
    greedy = {}
    print("| | top-1 same | mean KL, nats |\n|---|---:|---:|")
    for name, model in MODELS.items():
        fx = json.loads((ROOT / "tests" / "fixtures" / "logits" / f"{name}_logits.json")
                        .read_text())
        m = localllm.load(model, ctx_size=1024, threads=args.threads)
        ids = fx["ids"]
        base = log_softmax(m.logits(ids))
        undo = nudge(m)
        nudged = log_softmax(m.logits(ids))
        undo()
        top = np.argsort(-base, axis=1, kind="stable")[:, :64]
        ref_top, ref_lp = np.array(fx["top_ids"]), np.array(fx["top_logprobs"])
        rows = [
            ("localllm vs localllm with embeddings +1 ulp", (base.argmax(1) == nudged.argmax(1)),
             coarse_kl(top, np.take_along_axis(base, top, 1), nudged).mean()),
            ("localllm vs llama.cpp", base.argmax(1) == np.array(fx["argmax"]),
             coarse_kl(ref_top, ref_lp, base).mean()),
        ]
        for label, same, kl in rows:
            print(f"| {name}: {label} | {same.mean():.1%} | {kl:.4f} |")
        print(f"| {name}: llama.cpp token by token vs batched | {fx['self']['top1']:.1%} "
              f"| {fx['self']['kl_mean']:.4f} |")
        prompts = [g["prompt_ids"] for g in fx["greedy"]]
        greedy[name] = (greedy_agreement(m, prompts, "all"),
                        greedy_agreement(m, prompts, "continuation"), fx["self"]["greedy"])
    print("\nNext-token agreement along greedy text (teacher-forced, one batch):\n")
    print("| | nudged everywhere | nudged after the prompt | llama.cpp batched on its own |")
    print("|---|---:|---:|---:|")
    for name, (everywhere, after, own) in greedy.items():
        print(f"| {name} | {everywhere:.1%} | {after:.1%} | {own:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
