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

  python scripts/ulp_sensitivity.py [--threads N]
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
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
