"""The GGUF reader under structure-aware fuzzing and against the hostile corpus,
each file opened in a separate checker process with an address-space limit and a time
limit: a file either reads back with every invariant holding, or raises GGUFError."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import gguf_fuzz as F
from support import gguf_hostile as H

_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow, HealthCheck.data_too_large])
_names = itertools.count()


@pytest.fixture(scope="module")
def checker():
    c = F.Checker()
    yield c
    c.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def _check(checker, workdir, data: bytes) -> dict:
    # A fresh name per file: a mapping must never see its file rewritten under it.
    path = workdir / f"{next(_names)}.gguf"
    path.write_bytes(data)
    try:
        return checker.check(str(path))
    finally:
        path.unlink()


def _kept_promise(out: dict) -> None:
    assert out["status"] in ("ok", "gguf_error"), out
    assert not out["broken"], out


def test_checker_limits_are_in_force(checker, workdir):
    out = _check(checker, workdir, H.valid_file())
    assert out["status"] == "ok" and not out["broken"]
    assert checker.check(f"alloc {1 << 20}")["status"] == "ok"
    assert checker.check(f"alloc {F.MEMORY_BUDGET * 2}") == {"status": "error",
                                                             "type": "MemoryError"}


@settings(max_examples=100, **_SETTINGS)
@given(spec=F.specs())
def test_generated_files_read_back_exactly(checker, workdir, spec):
    built = F.build(spec)
    out = _check(checker, workdir, built.data)
    assert out["status"] == "ok" and not out["broken"], out
    want = F.expected(spec)
    for key in ("version", "alignment", "metadata", "tensors"):
        assert out[key] == want[key], key


@settings(max_examples=300, **_SETTINGS)
@given(data=st.data())
def test_mutated_files_read_or_raise_gguf_error(checker, workdir, data):
    built = F.build(data.draw(F.specs(), "spec"))
    ops = data.draw(F.mutations(built), "ops")
    _kept_promise(_check(checker, workdir, F.apply(built.data, ops)))


@settings(max_examples=60, **_SETTINGS)
@given(spec=F.specs(), levels=st.integers(1, 4), data=st.data())
def test_nesting_past_the_limit_is_refused(checker, workdir, spec, levels, data):
    arrays = [i for i, (_, v) in enumerate(spec.kvs) if v.vtype == H.ARRAY]
    if not arrays:
        return
    i = data.draw(st.sampled_from(arrays), "kv")
    key, v = spec.kvs[i]
    spec.kvs[i] = (key, F.nest(v, levels))
    out = _check(checker, workdir, F.build(spec).data)
    _kept_promise(out)
    too_deep = F.depth(spec.kvs[i][1]) > F.MAX_ARRAY_DEPTH
    assert (out["status"] == "gguf_error") == too_deep, out
    if too_deep:
        assert "nested deeper" in out["message"] and out["field"].startswith(f"kv[")


@settings(max_examples=60, **_SETTINGS)
@given(spec=F.specs(), data=st.data())
def test_duplicate_names_are_refused(checker, workdir, spec, data):
    kinds = ["key"] * bool(spec.kvs) + ["tensor"] * bool(spec.tensors)
    if not kinds:
        return
    if data.draw(st.sampled_from(kinds), "kind") == "key":
        key, _ = data.draw(st.sampled_from(spec.kvs), "kv")
        spec.kvs.append((key, data.draw(F.values(), "value")))
    else:
        name, _, _ = data.draw(st.sampled_from(spec.tensors), "tensor")
        ne, ggml_type = (32,), 0
        spec.tensors.append((name, ne, ggml_type))
        spec.gaps.append(0)
        spec.order.append(len(spec.tensors) - 1)
    out = _check(checker, workdir, F.build(spec).data)
    assert out["status"] == "gguf_error" and "duplicate" in out["message"], out


def _dense(kind: str, n: int) -> bytes:
    """A valid file packed with the smallest entries of one kind: the worst case for the
    memory a file's tables cost per byte."""
    g = H.Layout()
    if kind == "nested arrays":
        g.kv("k", H.ARRAY, H.arr(H.ARRAY, n, H.arr(H.U8, 0, b"") * n))
    elif kind == "short strings":
        g.kv("k", H.ARRAY, H.arr(H.STRING, n, H.gstr("ab") * n))
    elif kind == "metadata keys":
        for i in range(n // 4):
            g.kv(f"k{i}", H.U8, b"\x01")
    else:
        for i in range(n // 8):
            g.tensor(f"t{i}", (1,), H.T_F32, 32 * i)
        return g.build(b"\0" * (32 * (n // 8)))
    return g.build()


# Python objects for the smallest entries cost ~8-15x their bytes in the file (measured);
# the reader must stay linear in the file size, never in what the file claims.
MEMORY_PER_FILE_BYTE = 32


@pytest.mark.parametrize("kind", ["nested arrays", "short strings", "metadata keys", "tensors"])
def test_memory_grows_linearly_with_the_file(checker, workdir, kind):
    data = _dense(kind, 20_000)
    path = workdir / "dense.gguf"
    path.write_bytes(data)
    out = checker.check(f"measure {path}")
    assert out["status"] == "ok" and not out["broken"], out
    ratio = out["peak_bytes"] / len(data)
    print(f"{kind}: {len(data)} bytes, peak {out['peak_bytes']} bytes ({ratio:.1f}x), "
          f"{out['seconds']:.2f} s")
    assert ratio < MEMORY_PER_FILE_BYTE


# ---- the regression corpus ------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hostile")
    return directory, H.write_corpus(directory)


def test_corpus_has_one_distinct_file_per_case(corpus):
    directory, expected = corpus
    files = sorted(directory.glob("*.gguf"))
    assert {p.stem for p in files} == set(H.HOSTILE) == set(expected)
    assert len({p.read_bytes() for p in files}) == len(files)  # no two cases the same file


@pytest.mark.parametrize("name", sorted(H.HOSTILE))
def test_corpus_file_raises_gguf_error(checker, corpus, name):
    directory, expected = corpus
    want = expected[name]
    out = checker.check(str(directory / f"{name}.gguf"))
    assert out["status"] == "gguf_error", out
    assert (out["field"], out["offset"]) == (want["field"], want["offset"])
