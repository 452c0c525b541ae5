"""Builds small GGUF files byte by byte, valid and hostile, for the reader's tests.

Each hostile case returns the file's bytes with the field and byte offset the reader must
name in its GGUFError; offsets come from the builder's own layout bookkeeping. Together
they are the regression corpus, written afresh by the tests (a file the fuzzer finds
becomes a builder here, so no model file is committed)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Callable

# Metadata value types (GGUF spec).
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
# GGML type ids used here: F32, F16, Q8_0 (block 32, 34 bytes).
T_F32, T_F16, T_Q8_0 = 0, 1, 8
HEADER = 24


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def arr(item_type: int, count: int, payload: bytes) -> bytes:
    """An array value: item type, length, then the items as given."""
    return u32(item_type) + u64(count) + payload


class Layout:
    """A GGUF file under construction that knows where each of its fields lands."""

    def __init__(self, *, magic: bytes = b"GGUF", version: int = 3, alignment: int = 32):
        self.magic, self.version, self.alignment = magic, version, alignment
        self.kvs: list[tuple[bytes, int, bytes]] = []
        self.infos: list[tuple[bytes, tuple[int, ...], int, int]] = []

    def kv(self, key: str | bytes, vtype: int, payload: bytes) -> int:
        self.kvs.append((key.encode() if isinstance(key, str) else key, vtype, payload))
        return len(self.kvs) - 1

    def tensor(self, name: str | bytes, ne: tuple[int, ...], ggml_type: int, offset: int) -> int:
        self.infos.append((name.encode() if isinstance(name, str) else name, ne, ggml_type, offset))
        return len(self.infos) - 1

    @staticmethod
    def _kv_bytes(entry: tuple[bytes, int, bytes]) -> bytes:
        key, vtype, payload = entry
        return gstr(key) + u32(vtype) + payload

    @staticmethod
    def _info_bytes(entry: tuple[bytes, tuple[int, ...], int, int]) -> bytes:
        name, ne, ggml_type, offset = entry
        dims = b"".join(u64(d) for d in ne)
        return gstr(name) + u32(len(ne)) + dims + u32(ggml_type) + u64(offset)

    def kv_pos(self, i: int) -> int:
        return HEADER + sum(len(self._kv_bytes(e)) for e in self.kvs[:i])

    def value_pos(self, i: int) -> int:
        return self.kv_pos(i) + 8 + len(self.kvs[i][0]) + 4

    def info_pos(self, i: int) -> int:
        kv_end = HEADER + sum(len(self._kv_bytes(e)) for e in self.kvs)
        return kv_end + sum(len(self._info_bytes(e)) for e in self.infos[:i])

    def dims_pos(self, i: int) -> int:
        return self.info_pos(i) + 8 + len(self.infos[i][0]) + 4

    def type_pos(self, i: int) -> int:
        return self.dims_pos(i) + 8 * len(self.infos[i][1])

    def offset_pos(self, i: int) -> int:
        return self.type_pos(i) + 4

    def header_bytes(self, tensor_count: int | None = None, kv_count: int | None = None) -> bytes:
        """Everything before the data section, padded to the alignment."""
        head = (self.magic + u32(self.version)
                + u64(len(self.infos) if tensor_count is None else tensor_count)
                + u64(len(self.kvs) if kv_count is None else kv_count))
        body = (head + b"".join(map(self._kv_bytes, self.kvs))
                + b"".join(map(self._info_bytes, self.infos)))
        return body + b"\0" * (-len(body) % self.alignment)

    def build(self, data: bytes = b"", **counts: int) -> bytes:
        return self.header_bytes(**counts) + data


def valid_layout() -> Layout:
    """A small valid file: every metadata kind and three tensors, the last ending at EOF."""
    g = Layout()
    g.kv("general.architecture", STRING, gstr("llama"))
    g.kv("general.alignment", U32, u32(32))
    g.kv("test.u8", U8, b"\x07")
    g.kv("test.i64", I64, struct.pack("<q", -5))
    g.kv("test.f32", F32, struct.pack("<f", 0.5))
    g.kv("test.bool", BOOL, b"\x01")
    g.kv("test.tokens", ARRAY, arr(STRING, 3, gstr("a") + gstr("") + gstr("é")))
    g.kv("test.ids", ARRAY, arr(I32, 3, struct.pack("<3i", 1, -2, 3)))
    g.kv("test.flags", ARRAY, arr(BOOL, 2, b"\x00\x01"))
    inner = arr(U16, 1, struct.pack("<H", 9)) + arr(STRING, 1, gstr("x"))
    g.kv("test.nested", ARRAY, arr(ARRAY, 2, inner))
    g.tensor("w_f32", (8, 2), T_F32, 0)      # 64 bytes at 0
    g.tensor("w_q8", (32, 2), T_Q8_0, 64)    # 68 bytes at 64
    g.tensor("v_f16", (5,), T_F16, 160)      # 10 bytes at 160
    return g


def valid_data() -> bytes:
    f32 = struct.pack("<16f", *range(16))
    q8 = bytes(range(68))
    f16 = struct.pack("<5e", 1.0, 2.0, -3.0, 0.25, 8.0)
    return f32 + q8 + b"\0" * (160 - 64 - 68) + f16


def valid_file() -> bytes:
    return valid_layout().build(valid_data())


Case = tuple[bytes, str, int]


def _one_kv(vtype: int, payload: bytes, key: str = "k") -> tuple[Layout, int]:
    g = Layout()
    return g, g.kv(key, vtype, payload)


def _one_tensor(ne: tuple[int, ...], ggml_type: int = T_F32, offset: int = 0,
                data_len: int = 4096) -> tuple[Layout, bytes]:
    g = Layout()
    g.tensor("t", ne, ggml_type, offset)
    return g, g.build(b"\0" * data_len)


def bad_magic() -> Case:
    return Layout(magic=b"GGUX").build(), "magic", 0


def version_1() -> Case:
    return Layout(version=1).build(), "version", 4


def version_999() -> Case:
    return Layout(version=999).build(), "version", 4


def big_endian() -> Case:
    return b"GGUF" + struct.pack(">I", 3) + struct.pack(">QQ", 0, 0), "version", 4


def huge_tensor_count() -> Case:
    return Layout().build(tensor_count=2**63), "tensor_count", 8


def huge_kv_count() -> Case:
    return Layout().build(kv_count=2**64 - 1), "kv_count", 16


def kv_count_past_eof() -> Case:
    g, _ = _one_kv(U8, b"\x01")
    return g.build(kv_count=3), "kv_count", 16


def key_length_past_eof() -> Case:
    data = Layout().build(kv_count=1)[:HEADER] + u64(10_000) + b"abc" + b"\0" * 40
    return data, "kv[0].key", HEADER


def empty_key() -> Case:
    g, _ = _one_kv(U8, b"\x01", key="")
    return g.build(), "kv[0].key", HEADER


def string_value_past_eof() -> Case:
    g, i = _one_kv(STRING, u64(2**40) + b"short")
    return g.build(), "kv[0].value", g.value_pos(i)


def array_length_past_eof() -> Case:
    g, i = _one_kv(ARRAY, arr(U32, 1000, b"\0" * 40))
    return g.build(), "kv[0].value.length", g.value_pos(i) + 4


def array_claims_2_62() -> Case:
    g, i = _one_kv(ARRAY, arr(U8, 2**62, b"\0" * 40))
    return g.build(), "kv[0].value.length", g.value_pos(i) + 4


def string_array_claims_2_62() -> Case:
    g, i = _one_kv(ARRAY, arr(STRING, 2**62, gstr("a") * 4))
    return g.build(), "kv[0].value.length", g.value_pos(i) + 4


def nested_array_claims_2_62() -> Case:
    g, i = _one_kv(ARRAY, arr(ARRAY, 2**62, arr(U8, 0, b"") * 4))
    return g.build(), "kv[0].value.length", g.value_pos(i) + 4


def string_in_array_past_eof() -> Case:
    # The array count fits; its second string claims more bytes than are left.
    g, i = _one_kv(ARRAY, arr(STRING, 2, gstr("ok") + u64(500) + b"xy"))
    return g.build(), "kv[0].value[1]", g.value_pos(i) + 12 + 10


def string_in_array_huge_length() -> Case:
    # A length near 2^64 pushes any unchecked position past what C can index.
    g, i = _one_kv(ARRAY, arr(STRING, 3, u64(2**64 - 1) + gstr("b") + gstr("c")))
    return g.build(), "kv[0].value[0]", g.value_pos(i) + 12


def unknown_value_type() -> Case:
    g, i = _one_kv(13, b"\0" * 16)
    return g.build(), "kv[0].value_type", g.value_pos(i) - 4


def unknown_array_item_type() -> Case:
    g, i = _one_kv(ARRAY, arr(99, 1, b"\0" * 16))
    return g.build(), "kv[0].value.item_type", g.value_pos(i)


def nesting_too_deep() -> Case:
    inner = arr(U8, 1, b"\x05")
    for _ in range(4):  # five levels in all
        inner = arr(ARRAY, 1, inner)
    g, i = _one_kv(ARRAY, inner)
    return g.build(), "kv[0].value[0][0][0][0]", g.value_pos(i) + 4 * 12


def duplicate_key() -> Case:
    g = Layout()
    g.kv("a.b", U8, b"\x01")
    g.kv("a.b", U8, b"\x02")
    return g.build(), "kv[1].key", g.kv_pos(1)


def bad_bool() -> Case:
    g, i = _one_kv(BOOL, b"\x02")
    return g.build(), "kv[0].value", g.value_pos(i)


def bad_bool_in_array() -> Case:
    g, i = _one_kv(ARRAY, arr(BOOL, 3, b"\x00\x01\x07"))
    return g.build(), "kv[0].value[2]", g.value_pos(i) + 12 + 2


def alignment_zero() -> Case:
    g, i = _one_kv(U32, u32(0), key="general.alignment")
    return g.build(), "kv[0].value", g.value_pos(i)


def alignment_three() -> Case:
    g, i = _one_kv(U32, u32(3), key="general.alignment")
    return g.build(), "kv[0].value", g.value_pos(i)


def alignment_not_uint32() -> Case:
    g, i = _one_kv(U64, u64(64), key="general.alignment")
    return g.build(), "kv[0].value_type", g.value_pos(i) - 4


def n_dims_zero() -> Case:
    g, data = _one_tensor(())
    return data, "tensor_info[0].n_dims", g.dims_pos(0) - 4


def n_dims_five() -> Case:
    g, data = _one_tensor((1, 1, 1, 1, 1))
    return data, "tensor_info[0].n_dims", g.dims_pos(0) - 4


def zero_dim() -> Case:
    g, data = _one_tensor((4, 0))
    return data, "tensor_info[0].ne[1]", g.dims_pos(0) + 8


def dims_overflow_int64() -> Case:
    g, data = _one_tensor((2**32, 2**32))
    return data, "tensor_info[0].ne", g.dims_pos(0)


def dim_past_int64() -> Case:
    g, data = _one_tensor((2**64 - 1,))
    return data, "tensor_info[0].ne", g.dims_pos(0)


def unknown_ggml_type() -> Case:
    g, data = _one_tensor((4,), ggml_type=4)  # 4 was Q4_2, removed from the format
    return data, "tensor_info[0].type", g.type_pos(0)


def huge_ggml_type() -> Case:
    g, data = _one_tensor((4,), ggml_type=2**32 - 1)
    return data, "tensor_info[0].type", g.type_pos(0)


def row_not_multiple_of_block() -> Case:
    g, data = _one_tensor((33, 2), ggml_type=T_Q8_0)
    return data, "tensor_info[0].ne[0]", g.dims_pos(0)


def misaligned_offset() -> Case:
    g, data = _one_tensor((4,), offset=8)
    return data, "tensor_info[0].offset", g.offset_pos(0)


def offset_past_eof() -> Case:
    g, data = _one_tensor((4,), offset=2**63, data_len=64)
    return data, "tensor_info[0].offset", g.offset_pos(0)


def data_past_eof() -> Case:
    g, data = _one_tensor((1024,), data_len=4095)  # needs 4096 bytes
    return data, "tensor_info[0].offset", g.offset_pos(0)


def overlapping_tensors() -> Case:
    g = Layout()
    g.tensor("a", (32,), T_F32, 0)    # bytes 0..128
    g.tensor("b", (8,), T_F32, 64)    # bytes 64..96, inside a
    return g.build(b"\0" * 256), "tensor_info[1].offset", g.offset_pos(1)


def same_offset_tensors() -> Case:
    # Of two overlapping tensors, the later one in the table is the one named.
    g = Layout()
    g.tensor("a", (8,), T_F32, 32)
    g.tensor("b", (16,), T_F32, 64)
    g.tensor("c", (8,), T_F32, 32)
    return g.build(b"\0" * 256), "tensor_info[2].offset", g.offset_pos(2)


def duplicate_tensor_name() -> Case:
    g = Layout()
    g.tensor("t", (8,), T_F32, 0)
    g.tensor("t", (8,), T_F32, 32)
    return g.build(b"\0" * 64), "tensor_info[1].name", g.info_pos(1)


def empty_tensor_name() -> Case:
    g = Layout()
    g.tensor("", (8,), T_F32, 0)
    return g.build(b"\0" * 64), "tensor_info[0].name", g.info_pos(0)


def tensor_name_past_eof() -> Case:
    g = Layout()
    head = g.build(tensor_count=1)[:HEADER]
    return head + u64(2**63) + b"x" * 40, "tensor_info[0].name", HEADER


def empty_file() -> Case:
    return b"", "magic", 0


def three_bytes() -> Case:
    return b"GGU", "magic", 0


def ten_bytes() -> Case:
    return b"GGUF" + u32(3) + b"\0\0", "tensor_count", 8


def header_only_counts_past_eof() -> Case:
    # A header promising one KV and one tensor, and nothing after it.
    return Layout().build(tensor_count=1, kv_count=1), "tensor_count", 8


HOSTILE: dict[str, Callable[[], Case]] = {
    f.__name__: f for f in (
        bad_magic, version_1, version_999, big_endian, huge_tensor_count, huge_kv_count,
        kv_count_past_eof, key_length_past_eof, empty_key, string_value_past_eof,
        array_length_past_eof, array_claims_2_62, string_array_claims_2_62,
        nested_array_claims_2_62, string_in_array_past_eof, string_in_array_huge_length,
        unknown_value_type,
        unknown_array_item_type, nesting_too_deep, duplicate_key, bad_bool, bad_bool_in_array,
        alignment_zero, alignment_three, alignment_not_uint32, n_dims_zero, n_dims_five,
        zero_dim, dims_overflow_int64, dim_past_int64, unknown_ggml_type, huge_ggml_type,
        row_not_multiple_of_block, misaligned_offset, offset_past_eof, data_past_eof,
        overlapping_tensors, same_offset_tensors, duplicate_tensor_name, empty_tensor_name,
        tensor_name_past_eof, empty_file, three_bytes, ten_bytes, header_only_counts_past_eof,
    )
}


# ---- the regression corpus ----------------------------------------------------------

def write_corpus(directory: Path) -> dict:
    """Writes one file per hostile case into ``directory``.

    Returns:
        {case name: {"field": ..., "offset": ...}}, what each file's GGUFError must name.
    """
    directory.mkdir(parents=True, exist_ok=True)
    expected = {}
    for name, case in HOSTILE.items():
        data, field, offset = case()
        (directory / f"{name}.gguf").write_bytes(data)
        expected[name] = {"field": field, "offset": offset}
    return expected
