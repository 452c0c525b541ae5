"""Compiling the CPU kernels a model needs before its first use, in parallel worker processes.

Each kernel group is compiled by a worker into Numba's on-disk cache, by calling the backend
on tiny inputs of the model's weight formats; the process that runs the model then loads
them. Groups: attention, the per-row operations, the repacking of quantized weights (one
set of kernels for every format), one matmul per weight format (these make up the op-by-op
path), and the fused decoder block of one model file (the path later runs take).
A first run waits only for the op-by-op groups, the slowest of which bounds it, and leaves the
fused block compiling at low priority for the runs after it.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from localllm.runtime.process import configure_process

Progress = Callable[[int, int], None]  # (groups done, groups in all)

# Rough single-core compile seconds per group (2-core Zen 5, each alone on an empty cache:
# attention 13-16 s, the row operations 5-7 s, the repacking kernels 5 s, a format's matmul
# and activation quantizers 6 s), to deal groups to workers.
_COST = {"attention": 16.0, "ops": 7.0, "pack": 5.0, "matmul": 6.0, "call": 14.0}


# ----------------------------------------------------------------------------- jobs

def _job_attention(be) -> None:
    """Attention over f16 KV pages (the default KV type; others compile on first use)."""
    from localllm.backends.base import KVBatch, KVLayout
    n_kv, hd, n_heads = 1, 64, 2
    pages = be.new_kv_pages(KVLayout(n_kv, hd, 16), 1)
    kv = KVBatch(pages, np.zeros((1, 1), np.int32), np.zeros(2, np.int32), 16)
    q = np.zeros((2, n_heads * hd), np.float32)
    k = np.zeros((2, n_kv * hd), np.float32)
    be.attention(q, k, k.copy(), kv, [0, 1], n_heads, 0.125, 0)


def _job_ops(be) -> None:
    from localllm.backends.base import RopeSpec
    x = np.ones((2, 64), np.float32)
    w = np.ones(64, np.float32)
    be.rms_norm(x, w, 1e-6)
    be.head_norm(x.copy(), 2, w[:32].copy(), 1e-6)
    for neox in (False, True):
        be.rope(x.copy(), 2, [0, 1], RopeSpec(32, 10000.0, neox))
    for act in ("silu", "gelu_tanh"):
        be.glu(x, x, act)
    be.add(x.copy(), x)
    be.logsumexp(x[0])


def _job_pack(be) -> None:
    """The repacking kernels, shared by every quantized format (the type code is an argument)."""
    from localllm.formats import quants
    N, K = 16, 256
    raw = np.zeros(N * quants.row_nbytes("Q4_K", K), np.uint8)
    be.upload_matrix("warm.pack", "Q4_K", raw, N, K)


def _job_matmul(be, type_name: str) -> None:
    """One format's matmul (prompt and decode) and the activation quantizers it reads, on a
    weight of zeros packed without the repacking kernels (the 'pack' group's)."""
    from localllm.kernels import matmul as mm
    from localllm.kernels import packing
    N, K = 16, 256
    w = mm.Weight(type_name, N, K, packing.zero_weight(type_name, N, K))
    be.linear(np.zeros((2, K), np.float32), [w])


def block_job(gguf_path) -> str:
    """The name of one model's fused-block group (compiled by the caller's block worker)."""
    return f"block:{os.fspath(gguf_path)}"


def run_job(job: str) -> None:
    """Run one kernel group: 'attention', 'ops', 'pack', 'matmul:Q4_K', or
    'call:MODULE:FUNCTION', a group a layer above this one names (a function that compiles
    its own kernels)."""
    kind, _, arg = job.partition(":")
    if kind == "call":
        module, _, function = arg.partition(":")
        getattr(importlib.import_module(module), function)()
        return
    from localllm.backends.cpu import CpuBackend
    be = CpuBackend()
    if kind == "attention":
        _job_attention(be)
    elif kind == "ops":
        _job_ops(be)
    elif kind == "pack":
        _job_pack(be)
    elif kind == "matmul":
        _job_matmul(be, arg)
    else:
        raise ValueError(f"unknown kernel group {job!r}")


# ----------------------------------------------------------------------------- bookkeeping

def _target() -> str:
    """What the kernels are compiled for: the path, Numba's CPU name and features."""
    import llvmlite.binding as llvm
    from numba.core import config

    from localllm.kernels import simd
    return f"{simd.isa()}|{config.CPU_NAME or llvm.get_host_cpu_name()}|" \
           f"{','.join(sorted(simd.target_features()))}"


def _marker(job: str) -> Path:
    """The file that says a group is in the current kernel cache for this target."""
    from localllm.kernels.jit import active_cache_dir
    key = job
    if job.startswith("block:"):
        from localllm.backends.cpu_store import model_key
        key = "block:" + model_key(job[len("block:"):])
    digest = hashlib.sha256(f"{key}|{_target()}".encode()).hexdigest()[:24]
    return Path(active_cache_dir()) / "warm" / digest


def _done(job: str) -> bool:
    return _marker(job).is_file()


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        pass  # a read-only cache: the group is simply built again next time


def model_formats(gguf_path) -> list[str]:
    """The weight formats of a GGUF file's matrices (the ones its matmuls read)."""
    from localllm.formats.gguf import GGUFFile
    with GGUFFile(gguf_path) as f:
        return sorted({t.type_name for t in f.tensors.values() if len(t.shape) == 2})


def model_jobs(gguf_path) -> list[str]:
    """The groups a model's op-by-op forward needs: attention, the row operations, the
    repacking kernels where a weight is quantized, and one matmul per weight format."""
    from localllm.kernels.packing import FLOAT_FORMATS
    formats = model_formats(gguf_path)
    quantized = any(t not in FLOAT_FORMATS for t in formats)
    return ["attention", "ops", *(["pack"] if quantized else []),
            *[f"matmul:{t}" for t in formats]]


def _deal(jobs: list[str], workers: int) -> list[list[str]]:
    """Longest first, each to the least loaded worker."""
    loads = [0.0] * workers
    shares: list[list[str]] = [[] for _ in range(workers)]
    for job in sorted(jobs, key=lambda j: -_COST[j.partition(":")[0]]):
        i = loads.index(min(loads))
        shares[i].append(job)
        loads[i] += _COST[job.partition(":")[0]]
    return [s for s in shares if s]


def _spawn(command: list[str], background: bool = False) -> subprocess.Popen:
    """A worker process; a background one runs at the lowest priority, in its own session
    (it may outlive this process), and reports nothing."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "1"}  # a worker compiles on one core
    return subprocess.Popen(
        command, env=env,
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL if background else subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True, start_new_session=background,
        preexec_fn=(lambda: os.nice(19)) if background and hasattr(os, "nice") else None)


def _wait(procs: list[subprocess.Popen], total: int, progress: Progress | None) -> None:
    """Wait for the workers, reporting progress from the moment one of them has to compile
    (where every group is already cached, nothing is shown)."""
    lines: queue.Queue = queue.Queue()

    def read(p):
        for line in p.stdout:
            lines.put(line.split()[0])
        p.wait()
        lines.put("exit")

    for p in procs:
        threading.Thread(target=read, args=(p,), daemon=True).start()
    done, running, shown = 0, len(procs), False
    while running:
        try:
            word = lines.get(timeout=1.0)
        except queue.Empty:  # once a second regardless, for a live elapsed time
            word = "tick"
        running -= word == "exit"
        done += word == "done"
        shown = shown or word == "compiling"
        if progress is not None and shown and word != "exit":
            progress(done, total)


def _block_running(job: str) -> bool:
    """Whether a low-priority worker is still building this block (its pid file is live)."""
    pid_file = _marker(job).with_suffix(".pid")
    try:
        os.kill(int(pid_file.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


def prepare(gguf_path, progress: Progress | None, block_command: list[str],
            workers: int | None = None, calls: tuple[str, ...] = ()) -> bool:
    """Compile what a model's op-by-op forward needs that the kernel cache lacks, in parallel
    workers; unless its fused decoder block is built (or building), start a low-priority
    worker on that.

    Args:
        gguf_path: the model file.
        progress: called with (groups done, groups in all), about once a second, from the
            moment a worker finds something to compile (never where all is cached).
        block_command: the command that compiles one model's fused block, given the model's
            path as its last argument (it runs ``main_for(block_job(path), ...)``).
        workers: parallel worker processes (None: one per CPU).
        calls: more groups to build with the model's, each 'call:MODULE:FUNCTION'.
    Returns:
        Whether the model should run its fused decoder block (else op by op, for now).
    """
    block = block_job(gguf_path)
    # A block whose worker failed is left to the model's own process, as without workers.
    block_ready = _done(block) or _marker(block).with_suffix(".failed").is_file()
    jobs = [j for j in [*model_jobs(gguf_path), *calls] if not _done(j)]
    if jobs:
        n = max(1, min(len(jobs), workers or os.cpu_count() or 1))
        worker = [sys.executable, "-m", "localllm.runtime.warm"]
        _wait([_spawn(worker + share) for share in _deal(jobs, n)], len(jobs), progress)
    if not block_ready and not _block_running(block):
        p = _spawn([*block_command, os.fspath(gguf_path)], background=True)
        _write(_marker(block).with_suffix(".pid"), str(p.pid))
    return block_ready


def _announce_compiling() -> None:
    """Print 'compiling' once, when this worker first has to compile rather than load."""
    from numba.core import event

    class First(event.Listener):
        said = False

        def on_start(self, ev):
            if not self.said:
                self.said = True
                print("compiling", flush=True)

        def on_end(self, ev):
            pass
    event.register("numba:compile", First())


def wait_for_block(gguf_path, timeout_s: float = 900.0) -> bool:
    """Wait while a background worker builds this model's fused block (for benchmarks that
    time later runs). Returns whether the block is built."""
    job = block_job(gguf_path)
    end = time.monotonic() + timeout_s
    while _block_running(job) and time.monotonic() < end:
        time.sleep(0.5)
    return _done(job)


def _run_marked(job: str, run: Callable[[], None]) -> bool:
    """Run one group and mark it done (or failed) in the kernel cache; says 'done JOB'."""
    t = time.perf_counter()
    ok = True
    try:
        run()
    except Exception as e:  # a failed group is compiled later where it is needed
        print(f"failed {job}: {e}", file=sys.stderr)
        ok = False
        _write(_marker(job).with_suffix(".failed"), f"{e}\n")
    else:
        _write(_marker(job), f"{time.perf_counter() - t:.1f} s\n")
    _marker(job).with_suffix(".pid").unlink(missing_ok=True)
    print("done", job, flush=True)
    return ok


def main_for(job: str, run: Callable[[], None]) -> int:
    """A worker's entry for one group run by ``run`` (the block worker's, above this layer).

    Returns:
        The process exit status (0: built)."""
    _announce_compiling()
    return 0 if _run_marked(job, run) else 1


def main(jobs: list[str]) -> int:
    """Worker: run each group and mark it done, saying on stdout 'compiling' when it first
    compiles and 'done JOB' after each group."""
    configure_process(threads=1)
    _announce_compiling()
    failed = sum(not _run_marked(job, lambda job=job: run_job(job)) for job in jobs)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--wait"]:  # python -m localllm.runtime.warm --wait MODEL.gguf
        configure_process()  # names the kernel cache the block is marked in
        sys.exit(0 if wait_for_block(sys.argv[2]) else 1)
    sys.exit(main(sys.argv[1:]))
