#!/usr/bin/env python3
"""Speculative decoding against plain decoding: decode tok/s with and without drafts on the
same loaded model, the same thread count and the same greedy output (checked token for
token), with acceptance rates and tokens per model pass.

Cases: prompt lookup on input-copying text (a passage followed by its own beginning, and a
code edit), prompt lookup on free writing (what having it on by default costs), and
SmolLM2-135M at Q8_0 drafted by its Q4_1 file (the Q8_0 file is written from the Q4_1 one
with the gguf package). Run under the machine's benchmark lock:

    python scripts/bench_spec.py --threads 2 --reps 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Written for this benchmark (not a text the tests use).
PASSAGE = (
    "At the bend of the river stood an old water mill, its wheel turning slowly through "
    "every season. The miller rose before dawn to open the sluice gate, and the sound of "
    "falling water filled the valley. Farmers brought their grain in carts pulled by patient "
    "horses, and while the stones ground the wheat into flour, they sat on the bench outside "
    "and talked about the weather, the price of seed and the health of their animals. In "
    "winter the river froze at its edges, and the children of the village skated on the "
    "millpond while their parents watched from the bridge.")
CODE = '''def summarize(orders):
    total = 0
    count = 0
    for order in orders:
        if order["status"] == "paid":
            total += order["amount"]
            count += 1
    average = total / count if count else 0
    return {"total": total, "count": count, "average": average}
'''
CASES = {
    # name: (prompt, chat?)
    "copy": (PASSAGE + "\n\n" + PASSAGE[:80], False),
    "code-edit": ("Rename the variable `total` to `revenue` in this function and show the "
                  "whole function:\n\n```python\n" + CODE + "```", True),
    # Free writing: greedy decoding of models this small soon loops (and lookup then pays),
    # so a repeat penalty keeps the text from repeating itself.
    "free": ("Write a long story about a fox who learns to swim.", True),
}
PENALTY = {"free": dict(repeat_penalty=1.3, repeat_last_n=256)}


def copied_runs(output: str, source: str, n: int = 8) -> tuple[int, int]:
    """Returns: (the output's n-word runs found in ``source``, all its n-word runs)."""
    words, src = output.split(), " ".join(source.split())
    runs = [" ".join(words[i:i + n]) for i in range(len(words) - n + 1)]
    return sum(r in src for r in runs), len(runs)


def _ids(m, prompt: str, chat: bool) -> list[int]:
    if chat and m.template.from_file:
        return m.chat_tokens([{"role": "user", "content": prompt}])
    return m.tokenize(prompt)


def measure(m, ids: list[int], tokens: int, reps: int, **sampling) -> dict:
    """Greedy decoding of ``tokens`` tokens, plain and speculative, alternating; medians."""
    kw = dict(temperature=0, max_tokens=tokens, ignore_eos=True, **sampling)
    for speculate in (False, True):  # compiles the kernels for every batch shape used
        list(m.generate(ids, speculate=speculate, **kw))
    plain, spec, last = [], [], {}
    for _ in range(reps):
        for speculate, out in ((False, plain), (True, spec)):
            g = m.generate(ids, speculate=speculate, **kw)
            toks = [t for c in g for t in c.tokens]
            out.append(g.stats.generate_tps)
            last[speculate] = (toks, g.stats)
        if last[True][0] != last[False][0]:
            raise SystemExit("speculative output differs from plain decoding")
    st = last[True][1]
    plain_tps, spec_tps = statistics.median(plain), statistics.median(spec)
    # ratio: of the medians; best_ratio: of the fastest runs (least disturbed by other load)
    return {"plain_tps": plain_tps, "spec_tps": spec_tps, "ratio": spec_tps / plain_tps,
            "best_ratio": max(spec) / max(plain),
            "drafted": st.draft_tokens, "accepted": st.accepted_tokens,
            "acceptance": st.acceptance_rate, "tokens_per_pass": st.tokens_per_pass,
            "text": m.detokenize(last[True][0])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="alternating repetitions (median)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per run")
    ap.add_argument("--lookup", type=int, default=10, help="prompt lookup's longest draft")
    ap.add_argument("--draft-max", type=int, default=8, help="the draft model's longest draft")
    ap.add_argument("--models", nargs="*", default=["smollm2-135m", "gemma3-270m"],
                    help="models for the prompt lookup cases")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import localllm
    from bench import _cpu_name
    from localllm.testing.gguf_copy import copy_gguf
    from localllm.formats.fetch import resolve_model_path

    ISA = localllm.configure_process().isa
    kw = dict(threads=args.threads, ctx_size=1024)
    report = {"machine": {"cpu": _cpu_name(), "isa": ISA, "threads": args.threads,
                          "tokens": args.tokens, "reps": args.reps}, "results": []}
    for name in args.models:
        with localllm.load(name, lookup=args.lookup, **kw) as m:
            for case, (prompt, chat) in CASES.items():
                r = measure(m, _ids(m, prompt, chat), args.tokens, args.reps,
                            **PENALTY.get(case, {}))
                r.update(model=name, case=case, drafter=f"lookup {args.lookup}")
                if case == "copy":
                    r["copied_8word_runs"] = copied_runs(r["text"], PASSAGE)
                report["results"].append(r)
    with tempfile.TemporaryDirectory() as d:
        q41 = resolve_model_path("smollm2-135m")
        q8 = copy_gguf(q41, Path(d) / "smollm2-135m-q8_0.gguf", requant=("Q4_1", "Q8_0"))
        with localllm.load(str(q8), draft=str(q41), draft_max=args.draft_max, **kw) as m:
            for case in ("copy", "free"):
                prompt, chat = CASES[case]
                r = measure(m, _ids(m, prompt, chat), args.tokens, args.reps,
                            **PENALTY.get(case, {}))
                r.update(model="smollm2-135m Q8_0", case=case,
                         drafter=f"draft smollm2-135m Q4_1, k <= {args.draft_max}")
                report["results"].append(r)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    mm = report["machine"]
    print(f"machine: {mm['cpu']}, kernels {mm['isa']}, {mm['threads']} threads; greedy, "
          f"{mm['tokens']} tokens, medians of {mm['reps']} alternating runs")
    print(f"{'model':20} {'case':10} {'drafter':34} {'plain':>7} {'spec':>7} {'ratio':>6} "
          f"{'best':>6} {'accept':>7} {'tok/pass':>8}")
    for r in report["results"]:
        extra = ""
        if "copied_8word_runs" in r:
            extra = "  copied {}/{} 8-word runs".format(*r["copied_8word_runs"])
        print(f"{r['model']:20} {r['case']:10} {r['drafter']:34} {r['plain_tps']:7.1f} "
              f"{r['spec_tps']:7.1f} {r['ratio']:5.2f}x {r['best_ratio']:5.2f}x "
              f"{100 * r['acceptance']:6.0f}% "
              f"{r['tokens_per_pass']:8.2f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
