#!/usr/bin/env python3
"""Side-by-side benchmark: the same GGUF through localllm and through llama.cpp
(llama-cpp-python, when importable), the same thread count, one table of figures and ratios.

Each engine runs in its own process (so load time and peak memory are its own), one after
the other. Prompt figures use the same token ids for both engines.

    python scripts/bench.py smollm2-135m gemma3-270m --threads 2
    python scripts/bench.py model.gguf --llama-python /path/to/venv/bin/python --json
    python scripts/bench.py --embed --threads 2     (embedding throughput: bench_embed.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT_SIZES = (256, 512)
DECODE_TOKENS = 128
ONESHOT_PROMPT = "What is the capital of France?"
ONESHOT_TOKENS = 32


# ----------------------------------------------------------------------------- workers

def _memory_mb() -> dict:
    """Peak resident memory and the resident split now: anonymous pages (the engine's own
    copies) and file-backed ones (the mapped GGUF), from /proc/self/status."""
    want = {"VmHWM:": "peak_rss_mb", "RssAnon:": "rss_anon_mb", "RssFile:": "rss_file_mb"}
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(None, 1)[0]
            if key in want:
                out[want[key]] = int(line.split()[1]) / 1024
    return out


def _median(xs):
    return statistics.median(xs)


def worker_localllm(path: str, ids: list[int], threads: int, reps: int, depth: int,
                    models_dir: str | None = None) -> dict:
    t0 = time.perf_counter()
    import localllm
    m = localllm.load(path, threads=threads, ctx_size=depth + 1024, batch_size=512,
                      models_dir=models_dir)
    load_s = time.perf_counter() - t0
    m.logits(ids[:8])  # first call maps the compiled kernels in
    out = {"load_s": load_s, "ready_s": time.perf_counter() - t0}
    if reps == 0:  # start-up figures only
        return {**out, **_memory_mb()}
    base = m.new_sequence()
    if depth:
        base.feed(ids[:depth])  # the context every figure starts from

    def done(seq):
        # Every repetition starts from the state llama.cpp's starts from: the context alone.
        # Left cached, the last prompt would be reused by the next one (the time to first
        # token would time a cache hit), and every repetition would write KV pages never
        # touched before (the pool keeps cached blocks longest), paying first-touch page
        # faults that the contiguous cache of earlier versions paid only once.
        seq.release()
        m.forget_cached()
    for n in PROMPT_SIZES:
        times = []
        for _ in range(reps):
            seq = base.fork()  # shares the context's blocks: nothing is recomputed
            t = time.perf_counter()
            seq.feed(ids[depth:depth + n])
            times.append(time.perf_counter() - t)
            done(seq)
        out[f"pp{n}_tps"] = n / _median(times)
    # time to first token on a 256-token prompt, then greedy decode; medians of reps
    ttfts, tps = [], []
    for _ in range(reps):
        seq = base.fork()
        t = time.perf_counter()
        chunks = m.generate(ids[:depth + 256], seq=seq, temperature=0,
                            max_tokens=DECODE_TOKENS + 1, ignore_eos=True)
        next(iter(chunks))
        ttfts.append(time.perf_counter() - t)
        list(chunks)
        tps.append(chunks.stats.generate_tps)
        done(seq)
    out["ttft_s"] = _median(ttfts)
    out["tg_tps"] = _median(tps)
    out["decode_tokens"] = m.last_stats.generated_tokens - 1
    out.update(_memory_mb())
    out["weight_bytes_per_token"] = decode_weight_bytes(m)
    return out


def decode_weight_bytes(m) -> int:
    """Bytes of weights one decode step reads: every layer matrix (copied or read from the
    mapped file) plus the output head; of a mixture-of-experts layer, the router, the shared
    expert and the top-k experts' share of the stacks (k / n_experts, the average over
    tokens). Layers of any kind (attention, DeltaNet) are walked field by field."""
    net = m.net
    return int(_weight_bytes(net.output) + sum(_weight_bytes(la.weights, la.spec.moe)
                                               for la in net.layers))


def _weight_bytes(obj, moe=None) -> int:
    import numpy as np
    if obj is None or isinstance(obj, (int, float, str, bool, np.ndarray)):
        return 0  # host vectors and tables are small
    if hasattr(obj, "router") and hasattr(obj, "gate"):  # MoEWeights
        rest = sum(_weight_bytes(getattr(obj, f, None)) for f in
                   ("router", "shared_gate", "shared_up", "shared_down", "shared_gate_inp"))
        stacks = sum(_weight_bytes(x) for x in (obj.gate, obj.up, obj.down))
        return rest + stacks * moe.n_used // moe.n_experts
    if hasattr(obj, "nbytes"):  # a matrix or a stack of experts
        return int(obj.nbytes) + int(getattr(obj, "file_nbytes", 0))
    if isinstance(obj, dict):
        return sum(_weight_bytes(v, moe) for v in obj.values())
    if dataclasses.is_dataclass(obj):
        return sum(_weight_bytes(getattr(obj, f.name), moe) for f in dataclasses.fields(obj))
    return 0


def worker_llama(path: str, ids: list[int], threads: int, reps: int, depth: int,
                 models_dir: str | None = None) -> dict:
    import numpy as np
    t0 = time.perf_counter()
    import llama_cpp
    llm = llama_cpp.Llama(path, n_ctx=depth + 1024, n_threads=threads, n_threads_batch=threads,
                          n_batch=512, n_ubatch=512, verbose=False)
    load_s = time.perf_counter() - t0
    out = {"load_s": load_s}
    llm.eval(ids[:8])
    out["ready_s"] = time.perf_counter() - t0
    if reps == 0:
        return {**out, **_memory_mb()}
    n_vocab = llm.n_vocab()

    def argmax_last() -> int:
        # Without logits_all, llama-cpp-python leaves llm.scores at zeros: read the context's
        # logits of the last evaluated token instead, so the decode really is greedy.
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    # The context is evaluated once and its state restored for every repetition, as
    # localllm's repetitions fork the context's cached blocks instead of recomputing them.
    context = None
    if depth:
        llm.reset()
        llm.eval(ids[:depth])
        context = llm.save_state()

    def at_depth():
        llm.reset()
        if context is not None:
            llm.load_state(context)
    for n in PROMPT_SIZES:
        times = []
        for _ in range(reps):
            at_depth()
            t = time.perf_counter()
            llm.eval(ids[depth:depth + n])
            times.append(time.perf_counter() - t)
        out[f"pp{n}_tps"] = n / _median(times)
    ttfts, tps = [], []
    for _ in range(reps):
        at_depth()
        t = time.perf_counter()
        llm.eval(ids[depth:depth + 256])
        tok = argmax_last()
        ttfts.append(time.perf_counter() - t)
        t = time.perf_counter()
        for _ in range(DECODE_TOKENS):
            llm.eval([tok])
            tok = argmax_last()
        tps.append(DECODE_TOKENS / (time.perf_counter() - t))
    out["ttft_s"] = _median(ttfts)
    out["tg_tps"] = _median(tps)
    out["decode_tokens"] = DECODE_TOKENS
    out.update(_memory_mb())
    return out


def oneshot_llama(path: str, threads: int, prompt: str) -> None:
    """What `llm run -n 32` does, through llama-cpp-python (timed from outside); ``prompt``
    is already rendered with the model's chat template where its file has one."""
    import llama_cpp
    llm = llama_cpp.Llama(path, n_ctx=4096, n_threads=threads, verbose=False)
    # Both engines generate exactly ONESHOT_TOKENS: end-of-generation tokens are banned here
    # as --ignore-eos does for localllm.
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    banned = {int(llama_cpp.llama_vocab_eos(vocab)), int(llama_cpp.llama_vocab_eot(vocab))}
    bias = {t: -100.0 for t in banned if t >= 0}
    r = llm.create_completion(prompt, max_tokens=ONESHOT_TOKENS, temperature=0.8, seed=1,
                              logit_bias=bias)
    if r["usage"]["completion_tokens"] != ONESHOT_TOKENS:
        raise SystemExit(f"llama.cpp generated {r['usage']['completion_tokens']} tokens")
    sys.stdout.write(r["choices"][0]["text"] + "\n")


# ----------------------------------------------------------------------------- driver

def bench_ids(path: str, n: int) -> list[int]:
    """n token ids of ordinary text for the model (its own tokenizer)."""
    from fixtures_logits import PASSAGE
    from localllm.formats.gguf import GGUFFile
    from localllm.text.tokenizer import Tokenizer
    with GGUFFile(path) as f:
        tok = Tokenizer.from_metadata(f.metadata)
    ids = tok.encode(PASSAGE)
    body = tok.encode(" " + PASSAGE, add_special=False)
    while len(ids) < n:
        ids += body
    return ids[:n]


def _busy_seconds() -> float | None:
    """CPU seconds the whole machine has been busy (Linux /proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_worker(python: str, engine: str, path: str, ids: list[int], threads: int, reps: int,
               depth: int = 0, env_extra: dict | None = None, retries: int = 0,
               models_dir: str | None = None) -> dict | None:
    """One worker's figures, run again (up to ``retries`` times) while other processes used
    more than 0.15 of a core during it; the result carries that share as 'others_cores'."""
    for attempt in range(retries + 1):
        busy0, own0, t0 = _busy_seconds(), _children_seconds(), time.perf_counter()
        out = _run_worker_once(python, engine, path, ids, threads, reps, depth, env_extra,
                               models_dir)
        busy1, own1, wall = _busy_seconds(), _children_seconds(), time.perf_counter() - t0
        if out is None or busy0 is None:
            return out
        out["others_cores"] = max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
        if out["others_cores"] <= 0.15:
            break
        if attempt < retries:
            print(f"[{engine}] other processes used {out['others_cores']:.2f} cores; again",
                  file=sys.stderr)
            time.sleep(5)
    return out


def _run_worker_once(python: str, engine: str, path: str, ids: list[int], threads: int,
                     reps: int, depth: int, env_extra: dict | None,
                     models_dir: str | None = None) -> dict | None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
        ids_file = f.name
    env = {**os.environ, **(env_extra or {})}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [python, __file__, "--worker", engine, path, "--ids", ids_file,
           "--threads", str(threads), "--reps", str(reps), "--depth", str(depth)]
    if models_dir:
        cmd += ["--models-dir", models_dir]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    finally:
        os.unlink(ids_file)
    if r.returncode != 0:
        print(f"[{engine}] failed: {r.stderr.strip().splitlines()[-1:] }", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def _median_run(runs: list) -> dict | None:
    """Per-figure medians over several worker results (None if every run failed)."""
    runs = [r for r in runs if r]
    if not runs:
        return None
    return {k: _median([r[k] for r in runs]) for k in runs[0]}


def time_command(cmd: list[str], env: dict, runs: int) -> tuple[float, str]:
    """Median wall seconds of ``runs`` runs of a command, and the last run's stderr."""
    times, err = [], ""
    for _ in range(runs):
        t = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
        times.append(time.perf_counter() - t)
        if r.returncode != 0:
            raise RuntimeError(f"{cmd[:4]} failed: {r.stderr.strip()[-300:]}")
        err = r.stderr
    return _median(times), err


def _stat(pattern: str, text: str) -> float | None:
    """The last number ``pattern`` (a regex with one group) finds in ``text``, or None."""
    found = re.findall(pattern, text)
    return float(found[-1]) if found else None


def cold_start(path: str, threads: int, env: dict, work: str) -> dict:
    """A first run as a new user has it: empty compile cache and no repacked weights (both
    under ``work``), `llm run -p Hi -n 4 -v`; then the wait for the fused block it leaves
    building. Returns wall seconds with their breakdown from the run's own statistics."""
    env = {**env, "NUMBA_CACHE_DIR": os.path.join(work, "numba")}
    imp = [sys.executable, "-c", "import localllm.api, localllm.backends.cpu"]
    out = {"import_s": time_command(imp, env, 1)[0]}
    cmd = [sys.executable, "-m", "localllm.apps.cli", "run", path, "-p", "Hi", "-n", "4",
           "--threads", str(threads), "--seed", "1", "--ignore-eos", "-v",
           "--models-dir", os.path.join(work, "models")]
    out["first_run_s"], err = time_command(cmd, env, 1)
    out["compile_s"] = _stat(r"first run only\): \d+/\d+, (\d+) s", err)
    out["load_s"] = _stat(r"load: ([\d.]+) s", err)  # includes the compile
    out["first_token_s"] = _stat(r"time to first token: ([\d.]+) s", err)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "localllm.runtime.warm", "--wait", path],
                   env=env, timeout=1800)
    out["block_wait_s"] = time.perf_counter() - t
    return out


def oneshot(path: str, threads: int, llama_python: str | None, runs: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = {}
    with tempfile.TemporaryDirectory() as work:
        out["cold"] = cold_start(path, threads, env, work)
        # The same command as llama.cpp's below, once everything of the first run is cached.
        ours = [sys.executable, "-m", "localllm.apps.cli", "run", path, "-p", ONESHOT_PROMPT,
                "-n", str(ONESHOT_TOKENS), "--threads", str(threads), "--seed", "1",
                "--ignore-eos", "--models-dir", os.path.join(work, "models")]
        warm_env = {**env, "NUMBA_CACHE_DIR": os.path.join(work, "numba")}
        out["localllm_warm_s"] = time_command(ours, warm_env, runs)[0]
    if llama_python:
        from localllm.text.chat_template import ChatTemplate
        from localllm.formats.gguf import GGUFFile
        with GGUFFile(path) as f:
            template = ChatTemplate.resolve(f.metadata)
        # as `llm run` does: the file's chat template if it has one, else the plain prompt
        rendered = (template.render([{"role": "user", "content": ONESHOT_PROMPT}])
                    if template.from_file else ONESHOT_PROMPT)
        cmd = [llama_python, __file__, "--oneshot-llama", path, "--threads", str(threads),
               "--prompt", rendered]
        out["llama_cpp_s"] = time_command(cmd, env, runs)[0]
    return out


def machine_read_bandwidth() -> float:
    """GB/s of a two-thread streaming read over 1 GiB (sum of int64 words)."""
    import numba
    import numpy as np
    from numba import njit, prange

    @njit(parallel=True)
    def stream(a):
        s = 0
        for i in prange(a.shape[0]):
            s += a[i]
        return s
    a = np.ones(1 << 27, np.int64)
    stream(a)
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        stream(a)
        best = max(best, a.nbytes / (time.perf_counter() - t) / 1e9)
    del numba
    return best


ROWS = [("load_s", "load (s)", False), ("pp256_tps", "prompt 256 (tok/s)", True),
        ("pp512_tps", "prompt 512 (tok/s)", True), ("tg_tps", "decode 128 (tok/s)", True),
        ("ttft_s", "time to first token (s)", False), ("peak_rss_mb", "peak RSS (MB)", False)]


def format_table(name: str, ours: dict | None, ref: dict | None) -> str:
    lines = [f"## {name}", "", "| | localllm | llama.cpp | ratio |", "|---|---:|---:|---:|"]
    for key, label, higher_better in ROWS:
        a = ours.get(key) if ours else None
        b = ref.get(key) if ref else None
        ratio = f"{a / b:.2f}x" if a and b else "-"
        fmt = (lambda v: "-" if v is None else (f"{v:.0f}" if v >= 100 else f"{v:.2f}"))
        lines.append(f"| {label} | {fmt(a)} | {fmt(b)} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--embed" in argv:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_embed
        return bench_embed.main([a for a in argv if a != "--embed"])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=["smollm2-135m", "gemma3-270m"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each prompt size and of the decode run (median)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run both engines this many times, alternating, and report medians "
                         "(0 with --oneshot: only the start-up figures)")
    ap.add_argument("--llama-python", default=None,
                    help="Python with llama-cpp-python (default: this one, if it imports)")
    ap.add_argument("--oneshot", action="store_true",
                    help="also time a first run on empty caches (with its breakdown) and warm "
                         "`llm run -n 32` processes against llama.cpp's")
    ap.add_argument("--bandwidth", action="store_true", help="also measure the machine's read bandwidth")
    ap.add_argument("--depth", type=int, default=0,
                    help="tokens of context already processed before each prompt and decode figure")
    ap.add_argument("--retries", type=int, default=3,
                    help="run a worker again, up to this many times, while other processes "
                         "used more than 0.15 of a core during it (Linux)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--scale", type=Path, default=None, metavar="DIR",
                    help="run the scale ladder: every GGUF in DIR (scripts/make_scale_models.py), "
                         "first and warm loads, prompt 512 at depth 0 and 4000, decode against "
                         "the measured read bandwidth")
    ap.add_argument("--models-dir", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--oneshot-llama", help=argparse.SUPPRESS)
    ap.add_argument("--prompt", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        ids = json.loads(Path(args.ids).read_text())
        fn = worker_localllm if args.worker == "localllm" else worker_llama
        print(json.dumps(fn(args.models[0], ids, args.threads, args.reps, args.depth,
                            args.models_dir)))
        return 0
    if args.oneshot_llama:
        oneshot_llama(args.oneshot_llama, args.threads, args.prompt)
        return 0

    from localllm.formats.fetch import resolve_model_path
    llama_python = args.llama_python
    if llama_python is None:
        probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True)
        llama_python = sys.executable if probe.returncode == 0 else None
    if args.scale:
        import bench_scale
        return bench_scale.run(args, llama_python)
    import localllm
    report = {"machine": {"cpu": _cpu_name(), "kernel_path": localllm.configure_process().isa, "threads": args.threads,
                          "python": platform.python_version(), "os": platform.platform()},
              "models": {}}
    if args.bandwidth:
        report["machine"]["read_gbps"] = machine_read_bandwidth()
    for name in args.models:
        path = str(resolve_model_path(name))
        ids = bench_ids(path, args.depth + max(PROMPT_SIZES))
        ours_runs, ref_runs = [], []
        for _ in range(args.rounds):  # alternate, so drifts in machine speed hit both
            ours_runs.append(run_worker(sys.executable, "localllm", path, ids, args.threads,
                                        args.reps, args.depth, retries=args.retries))
            if llama_python:
                ref_runs.append(run_worker(llama_python, "llama", path, ids, args.threads,
                                           args.reps, args.depth, retries=args.retries))
        entry = {"localllm": _median_run(ours_runs), "llama_cpp": _median_run(ref_runs),
                 "rounds": args.rounds, "per_round": _per_round(ours_runs, ref_runs)}
        if args.oneshot:
            entry["oneshot"] = oneshot(path, args.threads, llama_python, args.reps)
        ours = entry["localllm"]
        if ours and ours.get("tg_tps"):
            entry["decode_weight_gbps"] = ours["weight_bytes_per_token"] * ours["tg_tps"] / 1e9
        report["models"][name] = entry
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    m = report["machine"]
    print(f"machine: {m['cpu']}, kernel path {m['kernel_path']}, {m['threads']} threads, "
          f"Python {m['python']}; medians of {args.rounds} alternating round(s); "
          f"context depth {args.depth}")
    if "read_gbps" in m:
        print(f"measured read bandwidth: {m['read_gbps']:.1f} GB/s")
    for name, e in report["models"].items():
        print()
        if e["localllm"] or e["llama_cpp"]:
            print(format_table(name, e["localllm"], e["llama_cpp"]))
        else:
            print(f"## {name}")
        others = [r.get("others_cores", 0.0) for r in (e["localllm"], e["llama_cpp"]) if r]
        if others:
            print(f"\nother processes used {max(others):.2f} cores (median of rounds) meanwhile")
        for key, label in (("pp512_tps", "prompt 512"), ("tg_tps", "decode")):
            pairs = [r[key] for r in e.get("per_round", []) if key in r]
            if len(pairs) > 1:
                print(f"\n{label} ratio by round: "
                      + ", ".join(f"{a / b:.2f}x ({a:.4g} / {b:.4g})" for a, b in pairs))
        if "decode_weight_gbps" in e:
            print(f"\ndecode reads {e['localllm']['weight_bytes_per_token'] / 1e6:.0f} MB of weights "
                  f"per token: {e['decode_weight_gbps']:.1f} GB/s achieved")
        if "oneshot" in e:
            o, c = e["oneshot"], e["oneshot"]["cold"]
            print(f"first run (empty caches, `llm run -p Hi -n 4`): {c['first_run_s']:.1f} s, of "
                  f"which compiling {c['compile_s'] or 0:.0f} s, load {c['load_s']:.2f} s (with "
                  f"the compile), first token {c['first_token_s']:.2f} s; importing "
                  f"{c['import_s']:.2f} s; fused block built {c['block_wait_s']:.1f} s later")
            line = f"one-shot `llm run -n {ONESHOT_TOKENS}`, warm: {o['localllm_warm_s']:.2f} s"
            if "llama_cpp_s" in o:
                line += (f"; llama.cpp {o['llama_cpp_s']:.2f} s "
                         f"(ratio {o['localllm_warm_s'] / o['llama_cpp_s']:.2f}x)")
            print(line)
    return 0


def _per_round(ours_runs: list, ref_runs: list) -> list[dict]:
    """Each round's (ours, llama.cpp) prompt 512 and decode figures: the memory of some
    machines changes speed from minute to minute, and a round's pair ran minutes apart at
    most, where medians may pair figures from different rounds."""
    rounds = []
    for a, b in zip(ours_runs, ref_runs):
        rounds.append({k: (a[k], b[k]) for k in ("pp512_tps", "tg_tps")
                       if a and b and a.get(k) and b.get(k)})
    return rounds


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    sys.exit(main())
