"""Tests of localllm.formats.gguf: real models against gguf's GGUFReader, GGUFWriter round trips,
and hostile files that must each raise GGUFError naming the field and byte offset."""

from __future__ import annotations

import os
import pickle
import struct

import gguf
import numpy as np
import pytest
from gguf.constants import GGMLQuantizationType, GGUFValueType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support import gguf_hostile as hostile
from localllm.formats.gguf import GGUFError, GGUFFile, TensorInfo

_EXPECTED_DTYPE = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8,
    GGUFValueType.UINT16: np.uint16, GGUFValueType.INT16: np.int16,
    GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.UINT64: np.uint64, GGUFValueType.INT64: np.int64,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.FLOAT64: np.float64,
    GGUFValueType.BOOL: np.bool_,
}


def _write(tmp_path, data: bytes, name: str = "f.gguf") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


# ---- real models against GGUFReader --------------------------------------------------


def _compare_with_reader(ours: GGUFFile, reader: gguf.GGUFReader) -> None:
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    assert ours.version == reader.fields["GGUF.version"].contents()
    for key in keys:
        field, value = reader.fields[key], ours.metadata[key]
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING:
            assert isinstance(value, list) and value == field.contents(), key
        elif kind == GGUFValueType.ARRAY:
            assert isinstance(value, np.ndarray) and not value.flags.writeable, key
            assert value.dtype == _EXPECTED_DTYPE[field.types[-1]], key
            assert value.tolist() == field.contents(), key
        elif kind == GGUFValueType.STRING:
            assert value == field.contents(), key
        else:
            expected = field.contents()
            assert value == expected and type(value) is type(expected), key

    assert ours.data_offset == reader.data_offset
    assert ours.alignment == reader.alignment
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = ours.tensors[t.name]
        assert info.ne == tuple(int(d) for d in t.shape)
        assert info.shape == tuple(reversed(info.ne))
        assert info.ggml_type == int(t.tensor_type)
        assert info.type_name == t.tensor_type.name
        assert info.offset == t.data_offset
        assert (info.nbytes, info.n_elements) == (t.n_bytes, t.n_elements)

    by_type: dict[str, list] = {}
    for t in reader.tensors:
        by_type.setdefault(t.tensor_type.name, []).append(t)
    for tensors in by_type.values():  # first and last tensor of each type: bytes and rows
        for t in (tensors[0], tensors[-1]):
            raw = ours.raw(t.name)
            assert raw.dtype == np.uint8 and raw.shape == (t.n_bytes,) and not raw.flags.writeable
            assert np.array_equal(raw, np.asarray(t.data).reshape(-1).view(np.uint8))
            blocks = ours.blocks(t.name)
            assert blocks.shape[0] == int(np.prod(ours.tensors[t.name].shape[:-1]))
            assert np.array_equal(blocks.reshape(-1), raw)
    for t in by_type["F32"]:
        assert np.array_equal(ours.array(t.name), t.data)


@pytest.fixture(scope="module")
def smollm_reader(smollm_path):
    return gguf.GGUFReader(smollm_path)


def test_smollm_matches_gguf_reader(smollm_path, smollm_reader):
    with GGUFFile(smollm_path) as f:
        _compare_with_reader(f, smollm_reader)
        assert f.architecture == "llama"
        assert f.file_size == os.path.getsize(smollm_path)


def test_smollm_typed_views(smollm_path):
    with GGUFFile(smollm_path) as f:
        info = f.tensors["token_embd.weight"]
        assert info.type_name == "Q8_0" and info.shape == (49152, 576)
        assert f.blocks("token_embd.weight").shape == (49152, 576 // 32 * 34)
        with pytest.raises(GGUFError, match="quantized") as err:
            f.array("token_embd.weight")
        assert err.value.field.endswith(".type")
        norm = f.array("output_norm.weight")
        assert norm.dtype == np.float32 and norm.shape == (576,) and not norm.flags.writeable
        assert f.get("llama.block_count") == 30 and f.get("no.such.key", 7) == 7


@pytest.mark.slow
def test_gemma_matches_gguf_reader(gemma_path):
    # GGUFReader needs ~10 s on Gemma's 262k-token vocabulary, so Gemma is compared once.
    reader = gguf.GGUFReader(gemma_path)
    with GGUFFile(gemma_path) as f:
        _compare_with_reader(f, reader)
        assert f.architecture == "gemma3"
        assert len(f.metadata["tokenizer.ggml.tokens"]) == 262144


# ---- round trips through GGUFWriter -------------------------------------------------


def test_writer_round_trip(tmp_path):
    path = str(tmp_path / "w.gguf")
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_uint64("t.u64", 2**64 - 1)
    w.add_int64("t.i64", -(2**63))
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.true", True)
    w.add_bool("t.false", False)
    w.add_string("t.str", "héllo ▁wörld 🙂")
    w.add_array("t.strs", ["a", "ß", "<0x0A>", "▁the"])
    w.add_array("t.ints", [1, -2, 3])  # GGUFWriter stores Python ints as INT32
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.bools", [True, False, True])
    w.add_key_value("t.u8s", [1, 2, 255], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT8)
    w.add_key_value("t.u64s", [2**64 - 1, 0], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT64)
    w.add_key_value("t.f64s", [1e300, -0.0], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT64)
    w.add_array("t.nested", [[1, 2], ["x", "y"], [[True], [0.5]]])

    f32 = rng.standard_normal((3, 8)).astype(np.float32)
    f16 = rng.standard_normal(7).astype(np.float16)
    i8 = np.arange(-4, 4, dtype=np.int8).reshape(2, 2, 2)
    i16 = np.arange(6, dtype=np.int16)
    i32 = np.arange(4, dtype=np.int32).reshape(1, 1, 2, 2)
    i64 = np.array([-(2**62), 5], dtype=np.int64)
    f64 = np.array([np.pi], dtype=np.float64)
    bf16 = np.array([0x3F80, 0xC000], dtype=np.uint16)  # 1.0, -2.0
    q8 = rng.integers(0, 256, (4, 2 * 34), dtype=np.uint8)  # 4 rows of 64 elements
    q4k = rng.integers(0, 256, (2, 144), dtype=np.uint8)  # 2 rows of 256 elements
    for name, data, raw_dtype in [
        ("a.f32", f32, None), ("a.f16", f16, None), ("a.i8", i8, None), ("a.i16", i16, None),
        ("a.i32", i32, None), ("a.i64", i64, None), ("a.f64", f64, None),
        ("a.bf16", bf16, GGMLQuantizationType.BF16), ("a.q8", q8, GGMLQuantizationType.Q8_0),
        ("a.q4k", q4k, GGMLQuantizationType.Q4_K),
    ]:
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    with GGUFFile(path) as f:
        m = f.metadata
        assert f.version == 3 and f.architecture == "llama"
        expected_scalars = {
            "t.u8": 200, "t.i8": -100, "t.u16": 60000, "t.i16": -30000, "t.u32": 4_000_000_000,
            "t.i32": -2_000_000_000, "t.u64": 2**64 - 1, "t.i64": -(2**63),
            "t.f32": float(np.float32(0.1)), "t.f64": 0.1, "t.true": True, "t.false": False,
            "t.str": "héllo ▁wörld 🙂",
        }
        for key, value in expected_scalars.items():
            assert m[key] == value and type(m[key]) is type(value), key
        assert m["t.strs"] == ["a", "ß", "<0x0A>", "▁the"]
        for key, dtype, values in [
            ("t.ints", np.int32, [1, -2, 3]), ("t.floats", np.float32, [0.5, -1.25]),
            ("t.bools", np.bool_, [True, False, True]), ("t.u8s", np.uint8, [1, 2, 255]),
            ("t.u64s", np.uint64, [2**64 - 1, 0]), ("t.f64s", np.float64, [1e300, -0.0]),
        ]:
            assert m[key].dtype == dtype and m[key].tolist() == values, key
            assert not m[key].flags.writeable
        nested = m["t.nested"]
        assert isinstance(nested, list) and len(nested) == 3
        assert nested[0].tolist() == [1, 2] and nested[1] == ["x", "y"]
        assert nested[2][0].tolist() == [True] and nested[2][1].tolist() == [0.5]

        for name, data in [("a.f32", f32), ("a.f16", f16), ("a.i8", i8), ("a.i16", i16),
                           ("a.i32", i32), ("a.i64", i64), ("a.f64", f64), ("a.bf16", bf16)]:
            got = f.array(name)
            assert got.dtype == data.dtype and got.shape == data.shape, name
            assert np.array_equal(got, data), name
            assert f.tensors[name].shape == data.shape
        assert f.tensors["a.f32"].ne == (8, 3)
        assert f.tensors["a.i32"].ne == (2, 2, 1, 1)
        assert f.tensors["a.bf16"].type_name == "BF16"
        for name, data, ne in [("a.q8", q8, (64, 4)), ("a.q4k", q4k, (256, 2))]:
            info = f.tensors[name]
            assert info.ne == ne and info.nbytes == data.nbytes
            assert np.array_equal(f.blocks(name), data)
            with pytest.raises(GGUFError):
                f.array(name)
        offsets = [t.offset for t in f.tensors.values()]
        assert all((o - f.data_offset) % f.alignment == 0 for o in offsets)

    # The same file through gguf's own reader, for the flat values it can show.
    reader = gguf.GGUFReader(path)
    with GGUFFile(path) as f:
        assert [t.name for t in reader.tensors] == list(f.tensors)
        for t in reader.tensors:
            assert f.tensors[t.name].offset == t.data_offset
        assert f.data_offset == reader.data_offset


def test_custom_alignment_and_version_2(tmp_path):
    path = str(tmp_path / "a.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_custom_alignment(64)
    w.add_tensor("x", np.ones(3, np.float32))
    w.add_tensor("y", np.full(5, 2.0, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with GGUFFile(path) as f:
        assert f.alignment == 64 and f.data_offset % 64 == 0
        assert f.tensors["y"].offset - f.tensors["x"].offset == 64
        assert f.array("y").tolist() == [2.0] * 5
    data = bytearray(open(path, "rb").read())
    data[4:8] = struct.pack("<I", 2)  # v2 and v3 share the layout
    with GGUFFile(_write(tmp_path, bytes(data), "v2.gguf")) as f:
        assert f.version == 2 and f.array("x").tolist() == [1.0] * 3


# ---- the hand-built valid file ------------------------------------------------------


def test_valid_hand_built_file(tmp_path):
    with GGUFFile(_write(tmp_path, hostile.valid_file())) as f:
        m = f.metadata
        assert m["general.architecture"] == "llama" and m["test.u8"] == 7 and m["test.i64"] == -5
        assert m["test.f32"] == 0.5 and m["test.bool"] is True
        assert m["test.tokens"] == ["a", "", "é"]
        assert m["test.ids"].tolist() == [1, -2, 3] and m["test.flags"].tolist() == [False, True]
        assert m["test.nested"][0].tolist() == [9] and m["test.nested"][1] == ["x"]
        assert f.tensors["w_f32"] == TensorInfo("w_f32", (8, 2), (2, 8), 0, "F32", f.data_offset,
                                                64, 16)
        assert f.array("w_f32").tolist() == [list(range(8)), list(range(8, 16))]
        assert f.blocks("w_q8").shape == (2, 34)
        assert f.raw("w_q8").tolist() == list(range(68))
        assert f.array("v_f16").tolist() == [1.0, 2.0, -3.0, 0.25, 8.0]
        assert f.blocks("v_f16").shape == (1, 10)
        assert f.tensors["v_f16"].offset + 10 == f.file_size


def test_depth_four_nesting_is_accepted(tmp_path):
    inner = hostile.arr(hostile.U8, 1, b"\x05")
    for _ in range(3):
        inner = hostile.arr(hostile.ARRAY, 1, inner)
    g = hostile.Layout()
    g.kv("k", hostile.ARRAY, inner)
    with GGUFFile(_write(tmp_path, g.build())) as f:
        assert f.metadata["k"][0][0][0].tolist() == [5]


def test_invalid_utf8_is_replaced(tmp_path):
    g = hostile.Layout()
    g.kv("k", hostile.STRING, hostile.gstr(b"ok\xff"))
    strings = hostile.gstr("fine") + hostile.gstr(b"\xc3")
    g.kv("toks", hostile.ARRAY, hostile.arr(hostile.STRING, 2, strings))
    with GGUFFile(_write(tmp_path, g.build())) as f:
        assert f.metadata["k"] == "ok\ufffd"
        assert f.metadata["toks"] == ["fine", "\ufffd"]


def test_no_tensors_and_missing_architecture(tmp_path):
    g = hostile.Layout()
    g.kv("general.name", hostile.STRING, hostile.gstr("x"))
    with GGUFFile(_write(tmp_path, g.build())) as f:
        assert f.tensors == {} and f.get("general.name") == "x"
        with pytest.raises(GGUFError, match="general.architecture"):
            f.architecture
        with pytest.raises(KeyError):
            f.raw("nope")


def test_views_survive_close(tmp_path):
    f = GGUFFile(_write(tmp_path, hostile.valid_file()))
    view = f.array("w_f32")
    f.close()
    f.close()  # idempotent
    assert view[1, 7] == 15.0  # the mapping lives as long as a view does
    with pytest.raises(ValueError, match="closed"):
        f.raw("w_f32")
    assert f.metadata["test.tokens"] == ["a", "", "é"]


def test_error_pickles_and_formats():
    err = GGUFError("tensor 't': bad", "tensor_info[0].offset", 49)
    assert str(err) == "tensor 't': bad [field tensor_info[0].offset at byte 49]"
    back = pickle.loads(pickle.dumps(err))
    assert (back.field, back.offset, str(back)) == (err.field, err.offset, str(err))
    assert isinstance(err, ValueError)


# ---- hostile files ------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(hostile.HOSTILE))
def test_hostile_file_raises_gguf_error(tmp_path, case):
    data, field, offset = hostile.HOSTILE[case]()
    path = _write(tmp_path, data)
    with pytest.raises(GGUFError) as err:
        GGUFFile(path)
    assert type(err.value) is GGUFError
    assert (err.value.field, err.value.offset) == (field, offset)
    assert f"[field {field} at byte {offset}]" in str(err.value)


def test_every_truncation_raises(tmp_path):
    data = hostile.valid_file()  # the last tensor ends at EOF: every cut is invalid
    path = tmp_path / "cut.gguf"
    for cut in range(len(data)):
        path.write_bytes(data[:cut])
        try:
            GGUFFile(str(path)).close()
        except GGUFError as err:
            assert 0 <= err.offset <= len(data), cut
            assert err.field in str(err)
        else:
            pytest.fail(f"truncation to {cut} bytes was accepted")


def test_not_a_regular_file(tmp_path):
    with pytest.raises(GGUFError, match="regular file"):
        GGUFFile(str(tmp_path))
    if hasattr(os, "mkfifo"):
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        with pytest.raises(GGUFError, match="regular file"):  # and no wait for a writer
            GGUFFile(str(fifo))
    with pytest.raises(FileNotFoundError):
        GGUFFile(str(tmp_path / "missing.gguf"))


def _open_and_touch(path: str) -> None:
    """Opens a file and reads every view; only GGUFError may come out."""
    try:
        with GGUFFile(path) as f:
            for name, info in f.tensors.items():
                assert f.raw(name).nbytes == info.nbytes
                f.blocks(name)
                try:
                    f.array(name)
                except GGUFError:
                    pass
    except GGUFError:
        pass


_VALID = hostile.valid_file()
_FUZZ = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)),
                      min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, len(_VALID))))
def test_fuzzed_file_opens_or_raises_gguf_error(tmp_path_factory, flips, cut):
    data = bytearray(_VALID)
    for pos, byte in flips:
        data[pos] = byte
    if cut is not None:
        del data[cut:]
    # A fresh file per example: a mapping must never see its file rewritten under it.
    path = tmp_path_factory.mktemp("fuzz") / "f.gguf"
    path.write_bytes(bytes(data))
    _open_and_touch(str(path))
    path.unlink()


_EDGE_INTS = [0, 1, 2, 3, 5, 31, 32, 33, 255, 2**31, 2**32 - 1, 2**32, 2**62, 2**63, 2**64 - 1]


@_FUZZ
@given(writes=st.lists(st.tuples(st.integers(0, len(_VALID) - 8), st.sampled_from(_EDGE_INTS),
                                 st.sampled_from([4, 8])),
                       min_size=1, max_size=4))
def test_fuzzed_counts_and_lengths(tmp_path_factory, writes):
    # Overwrites whole u32/u64 words with edge values: counts, lengths, dims, types and
    # offsets all sit in such words.
    data = bytearray(_VALID)
    for pos, value, width in writes:
        data[pos:pos + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
    path = tmp_path_factory.mktemp("fuzz") / "f.gguf"
    path.write_bytes(bytes(data))
    _open_and_touch(str(path))
    path.unlink()


def test_release_keeps_the_data_readable(smollm_path):
    f = GGUFFile(smollm_path)
    name = "blk.0.ffn_up.weight"
    before = f.raw(name).copy()
    f.release(name, 100, 5000)
    f.release(name)
    f.release()
    assert np.array_equal(f.raw(name), before)
    f.close()
    f.release()  # a closed file: nothing to drop, no error
