"""GGUF reader: parses and validates a GGUF file's header, metadata and tensor table, and
hands out zero-copy numpy views of tensor data over a read-only mmap. The only module
that parses GGUF bytes; every malformed input raises GGUFError naming field and offset."""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from localllm.errors import GGUFError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
# A plain array is depth 1; an array of arrays is depth 2, and so on.
MAX_ARRAY_DEPTH = 4

_HEADER_SIZE = 24  # magic u32, version u32, tensor_count u64, kv_count u64
# The fewest bytes one entry can occupy (names and keys must be non-empty): these bound
# the counts in the header before any loop runs over them.
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, one key byte, value type, a 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name, n_dims, one dim, type, offset
_MIN_ARRAY_BYTES = 4 + 8  # item type and length of a nested array
_INT64_MAX = 2**63 - 1

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# Metadata scalar types: (struct format, numpy dtype). Little-endian, as the format is.
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    int(vtype): (struct.Struct("<" + fmt), np.dtype("<" + dt))
    for vtype, fmt, dt in (
        (GGUFValueType.UINT8, "B", "u1"),
        (GGUFValueType.INT8, "b", "i1"),
        (GGUFValueType.UINT16, "H", "u2"),
        (GGUFValueType.INT16, "h", "i2"),
        (GGUFValueType.UINT32, "I", "u4"),
        (GGUFValueType.INT32, "i", "i4"),
        (GGUFValueType.FLOAT32, "f", "f4"),
        (GGUFValueType.BOOL, "B", "u1"),  # read as a byte so values other than 0/1 are caught
        (GGUFValueType.UINT64, "Q", "u8"),
        (GGUFValueType.INT64, "q", "i8"),
        (GGUFValueType.FLOAT64, "d", "f8"),
    )
}
_BOOL = int(GGUFValueType.BOOL)
_STRING = int(GGUFValueType.STRING)
_ARRAY = int(GGUFValueType.ARRAY)

# GGML type id -> (name, block size in elements, bytes per block), derived from gguf's table.
_GGML_TYPES: dict[int, tuple[str, int, int]] = {
    int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES
}
# Unquantized types that array() can view directly; BF16 has no numpy dtype, so raw bits.
_PLAIN_DTYPES = {
    "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8"),
    "I8": np.dtype("i1"), "I16": np.dtype("<i2"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8"),
}


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table, validated against the file.

    Attributes:
        name: tensor name, e.g. "blk.0.attn_q.weight".
        ne: GGUF dimension order, ne[0] innermost (the row length).
        shape: numpy order, reversed(ne); a weight W with N outputs and K inputs is (N, K).
        ggml_type: GGML type id.
        type_name: GGML type name, e.g. "F32" or "Q4_K".
        offset: absolute byte offset of the data in the file.
        nbytes: size of the data in bytes.
        n_elements: number of elements, prod(ne).
    """

    name: str
    ne: tuple[int, ...]
    shape: tuple[int, ...]
    ggml_type: int
    type_name: str
    offset: int
    nbytes: int
    n_elements: int


def _decode(raw: bytes) -> str:
    # GGUF strings are UTF-8. An invalid one is kept readable rather than rejecting the
    # whole file; such bytes come back as U+FFFD.
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", "replace")


class _Parser:
    """Cursor over the file's bytes (the mmap, or the bytes of a tiny file)."""

    def __init__(self, buf: Any, size: int):
        self.buf = buf
        self.size = size
        self.pos = 0

    def need(self, n: int, what: str, field: str) -> None:
        if n > self.size - self.pos:
            raise GGUFError(
                f"{what}: needs {n} bytes but only {self.size - self.pos} are left "
                f"(file size {self.size}; truncated file?)", field, self.pos)

    def u32(self, what: str, field: str) -> int:
        self.need(4, what, field)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self, what: str, field: str) -> int:
        self.need(8, what, field)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def string(self, what: str, field: str) -> str:
        start = self.pos
        length = self.u64(what, field)
        if length > self.size - self.pos:
            raise GGUFError(
                f"{what}: string length {length} past end of file "
                f"({self.size - self.pos} bytes left)", field, start)
        raw = self.buf[self.pos:self.pos + length]
        self.pos += length
        return _decode(raw)

    def value(self, vtype: int, what: str, field: str, depth: int) -> Any:
        """Reads one metadata value of type `vtype` at the cursor."""
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            fmt = scalar[0]
            self.need(fmt.size, what, field)
            (value,) = fmt.unpack_from(self.buf, self.pos)
            if vtype == _BOOL:
                if value > 1:
                    raise GGUFError(f"{what}: bool byte is {value}, not 0 or 1", field, self.pos)
                value = bool(value)
            self.pos += fmt.size
            return value
        if vtype == _STRING:
            return self.string(what, field)
        if vtype == _ARRAY:
            return self.array(what, field, depth + 1)
        raise GGUFError(f"{what}: unknown metadata value type {vtype}", field, self.pos)

    def array(self, what: str, field: str, depth: int) -> Any:
        start = self.pos
        if depth > MAX_ARRAY_DEPTH:
            raise GGUFError(f"{what}: arrays nested deeper than {MAX_ARRAY_DEPTH}", field, start)
        item_type = self.u32(what, field + ".item_type")
        count = self.u64(what, field + ".length")
        scalar = _SCALARS.get(item_type)
        if scalar is not None:
            dtype = scalar[1]
            if count > (self.size - self.pos) // dtype.itemsize:
                raise GGUFError(
                    f"{what}: array of {count} x {dtype.itemsize}-byte items past end of file "
                    f"({self.size - self.pos} bytes left)", field + ".length", start + 4)
            # A copy, so metadata does not pin the mapping and outlives close().
            values = np.frombuffer(self.buf, dtype, count, self.pos).copy()
            if item_type == _BOOL:
                bad = np.flatnonzero(values > 1)
                if len(bad):
                    raise GGUFError(f"{what}: bool byte is {values[bad[0]]}, not 0 or 1",
                                    f"{field}[{bad[0]}]", self.pos + int(bad[0]))
                values = values.view(np.bool_)
            values.flags.writeable = False
            self.pos += count * dtype.itemsize
            return values
        if item_type == _STRING:
            if count > (self.size - self.pos) // 8:
                raise GGUFError(f"{what}: array of {count} strings past end of file "
                                f"({self.size - self.pos} bytes left)",
                                field + ".length", start + 4)
            return self.strings(count, what, field)
        if item_type == _ARRAY:
            if count > (self.size - self.pos) // _MIN_ARRAY_BYTES:
                raise GGUFError(f"{what}: array of {count} arrays past end of file "
                                f"({self.size - self.pos} bytes left)",
                                field + ".length", start + 4)
            return [self.array(what, f"{field}[{i}]", depth + 1) for i in range(count)]
        raise GGUFError(f"{what}: unknown array item type {item_type}", field + ".item_type", start)

    def strings(self, count: int, what: str, field: str) -> list[str]:
        # The hot loop of opening a model (a vocabulary is 10^5 strings), so it runs without
        # bounds checks: slices of the buffer stop at its end and never overlap, and reading
        # a length past the end raises struct.error (OverflowError once a bogus length has
        # pushed the position past 2^63). Only a file that fails the end check is walked
        # again, checked, to name the bad element.
        buf, unpack = self.buf, _U64.unpack_from
        pos = self.pos
        raw: list[bytes] = []
        append = raw.append
        try:
            for _ in range(count):
                end = pos + 8 + unpack(buf, pos)[0]
                append(buf[pos + 8:end])
                pos = end
        except (struct.error, OverflowError):
            pos = self.size + 1
        if pos > self.size:
            self._string_error(count, what, field)
        self.pos = pos
        try:
            return list(map(bytes.decode, raw))
        except UnicodeDecodeError:
            return [_decode(r) for r in raw]

    def _string_error(self, count: int, what: str, field: str) -> None:
        """Walks a string array that overruns the file and raises for the first bad length."""
        size, pos = self.size, self.pos
        for i in range(count):
            if pos > size - 8:
                raise GGUFError(f"{what}: string {i} of {count}: length past end of file",
                                f"{field}[{i}]", pos)
            (length,) = _U64.unpack_from(self.buf, pos)
            pos += 8
            if length > size - pos:
                raise GGUFError(f"{what}: string {i} of {count}: length {length} past end of "
                                f"file ({size - pos} bytes left)", f"{field}[{i}]", pos - 8)
            pos += length
        raise GGUFError(f"{what}: string array overruns the file", field, self.pos)


class GGUFFile:
    """A GGUF file, opened read-only and memory-mapped; header and tables fully validated.

    Attributes:
        path: the path as given (os.fspath of it).
        version: GGUF version (2 or 3).
        alignment: data alignment in bytes (general.alignment, default 32).
        data_offset: absolute offset where the tensor data section starts.
        file_size: size of the file in bytes.
        metadata: key -> value, in file order. Integers -> int, floats -> float, bool ->
            bool, string -> str (strict UTF-8; an invalid string decodes with U+FFFD in
            place of the bad bytes), array of strings -> list[str], array of numbers or
            bools -> read-only numpy array (little-endian, copied out of the file), array
            of arrays -> list of those.
        tensors: name -> TensorInfo, in file order.
    """

    def __init__(self, path: str | os.PathLike):
        """Opens, maps and validates a GGUF file.

        Args:
            path: the file to open.

        Raises:
            OSError: the file cannot be opened.
            GGUFError: the file is not a valid GGUF file (or not a regular file).
        """
        self.path = os.fspath(path)
        self._mm: mmap.mmap | None = None
        self.version = 0
        self.alignment = DEFAULT_ALIGNMENT
        self.data_offset = 0
        self.file_size = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        # Private: where fields sit, for errors raised after parsing.
        self._type_field: dict[str, tuple[str, int]] = {}
        self._value_pos: dict[str, int] = {}
        # O_NONBLOCK: opening a FIFO by mistake must not wait for a writer.
        flags = os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0)
        fd = os.open(self.path, flags)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise GGUFError(f"{self.path!r} is not a regular file", "file", 0)
            self.file_size = st.st_size
            if self.file_size < _HEADER_SIZE:
                # mmap refuses empty files; a file this small is parsed from its bytes and
                # fails with a precise message.
                buf: Any = os.read(fd, self.file_size)
                if len(buf) != self.file_size:
                    raise GGUFError("short read", "file", len(buf))
            else:
                self._mm = buf = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        try:
            self._parse(_Parser(buf, self.file_size))
        except BaseException:
            self.close()
            raise

    # ---- parsing -------------------------------------------------------------------

    def _parse(self, p: _Parser) -> None:
        p.need(4, "header", "magic")
        magic = bytes(p.buf[0:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"not a GGUF file: magic is {magic!r}, expected {GGUF_MAGIC!r}",
                            "magic", 0)
        p.pos = 4
        version = p.u32("header", "version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if version & 0xFFFF == 0 and swapped in SUPPORTED_VERSIONS:
                msg = f"big-endian GGUF (version {swapped}) is not supported"
            elif version == 1:
                msg = ("GGUF version 1 is not supported (obsolete 32-bit counts); "
                       "re-convert the model")
            else:
                msg = f"unsupported GGUF version {version} (supported: 2, 3)"
            raise GGUFError(msg, "version", 4)
        self.version = version
        tensor_count = p.u64("header", "tensor_count")
        kv_count = p.u64("header", "kv_count")
        left = p.size - p.pos
        if tensor_count > left // _MIN_TENSOR_INFO_BYTES:
            raise GGUFError(f"tensor_count {tensor_count} cannot fit in the {left} bytes after "
                            f"the header", "tensor_count", 8)
        if kv_count > (left - tensor_count * _MIN_TENSOR_INFO_BYTES) // _MIN_KV_BYTES:
            raise GGUFError(f"kv_count {kv_count} cannot fit in the {left} bytes after the header "
                            f"(with {tensor_count} tensor infos)", "kv_count", 16)
        for i in range(kv_count):
            self._parse_kv(p, i)
        pending = [self._parse_tensor_info(p, i) for i in range(tensor_count)]
        self.data_offset = -(-p.pos // self.alignment) * self.alignment
        self._check_tensor_data(pending)

    def _parse_kv(self, p: _Parser, i: int) -> None:
        start = p.pos
        key = p.string(f"metadata key #{i}", f"kv[{i}].key")
        if not key:
            raise GGUFError(f"metadata key #{i} is empty", f"kv[{i}].key", start)
        if key in self.metadata:
            raise GGUFError(f"duplicate metadata key {key!r}", f"kv[{i}].key", start)
        what = f"metadata {key!r}"
        vtype = p.u32(what, f"kv[{i}].value_type")
        value_pos = p.pos
        if vtype not in _SCALARS and vtype not in (_STRING, _ARRAY):
            raise GGUFError(f"{what}: unknown metadata value type {vtype}",
                            f"kv[{i}].value_type", value_pos - 4)
        value = p.value(vtype, what, f"kv[{i}].value", 0)
        if key == "general.alignment":
            if vtype != int(GGUFValueType.UINT32):
                raise GGUFError(f"{what} must be a uint32, got value type {vtype}",
                                f"kv[{i}].value_type", value_pos - 4)
            if value == 0 or value & (value - 1):
                raise GGUFError(f"{what} is {value}, not a power of two",
                                f"kv[{i}].value", value_pos)
            self.alignment = value
        self.metadata[key] = value
        self._value_pos[key] = value_pos

    def _parse_tensor_info(self, p: _Parser, i: int) -> tuple[TensorInfo, int, str]:
        """Reads tensor info #i; returns it with its relative offset's position and field."""
        field = f"tensor_info[{i}]"
        start = p.pos
        name = p.string(f"tensor #{i} name", field + ".name")
        if not name:
            raise GGUFError(f"tensor #{i} has an empty name", field + ".name", start)
        if name in self.tensors:
            raise GGUFError(f"duplicate tensor name {name!r}", field + ".name", start)
        what = f"tensor {name!r}"
        n_dims = p.u32(what, field + ".n_dims")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{what}: n_dims is {n_dims}, expected 1..{MAX_DIMS}",
                            field + ".n_dims", p.pos - 4)
        dims_pos = p.pos
        p.need(8 * n_dims, what, field + ".ne")
        ne = struct.unpack_from(f"<{n_dims}Q", p.buf, dims_pos)
        p.pos += 8 * n_dims
        n_elements = 1
        for d, size in enumerate(ne):
            if size == 0:
                raise GGUFError(f"{what}: dimension ne[{d}] is 0",
                                f"{field}.ne[{d}]", dims_pos + 8 * d)
            n_elements *= size
        if n_elements > _INT64_MAX:
            raise GGUFError(f"{what}: {n_elements} elements (ne={list(ne)}) overflows int64",
                            field + ".ne", dims_pos)
        ggml_type = p.u32(what, field + ".type")
        type_pos = p.pos - 4
        if ggml_type not in _GGML_TYPES:
            raise GGUFError(f"{what}: unknown GGML type {ggml_type}", field + ".type", type_pos)
        type_name, block_size, type_size = _GGML_TYPES[ggml_type]
        if ne[0] % block_size:
            raise GGUFError(f"{what}: row length ne[0]={ne[0]} is not a multiple of the "
                            f"{type_name} block size {block_size}", f"{field}.ne[0]", dims_pos)
        rel_offset = p.u64(what, field + ".offset")
        if rel_offset % self.alignment:
            raise GGUFError(f"{what}: offset {rel_offset} is not a multiple of the alignment "
                            f"{self.alignment}", field + ".offset", p.pos - 8)
        info = TensorInfo(
            name=name, ne=tuple(ne), shape=tuple(reversed(ne)), ggml_type=ggml_type,
            type_name=type_name, offset=rel_offset,  # made absolute once data_offset is known
            nbytes=n_elements // block_size * type_size, n_elements=n_elements)
        self.tensors[name] = info
        self._type_field[name] = (field + ".type", type_pos)
        return info, p.pos - 8, field + ".offset"

    def _check_tensor_data(self, pending: list[tuple[TensorInfo, int, str]]) -> None:
        # Offsets in tensor infos are relative to the data section, which starts after the
        # tensor infos; so bounds and overlaps can only be checked once all are read.
        spans = []
        for i, (info, field_pos, field) in enumerate(pending):
            start = self.data_offset + info.offset
            end = start + info.nbytes
            if end > self.file_size:
                raise GGUFError(f"tensor {info.name!r}: offset+nbytes {end} past end of file "
                                f"(size {self.file_size})", field, field_pos)
            info = TensorInfo(info.name, info.ne, info.shape, info.ggml_type, info.type_name,
                              start, info.nbytes, info.n_elements)
            self.tensors[info.name] = info
            spans.append((start, i, end, info.name, field, field_pos))
        # Sorted by start, any overlap shows up between neighbours; of the two, the one
        # later in the table is named.
        spans.sort()
        for a, b in zip(spans, spans[1:]):
            if b[0] < a[2]:
                first, later = (a, b) if a[1] < b[1] else (b, a)
                raise GGUFError(f"tensor {later[3]!r} (bytes {later[0]}..{later[2]}) overlaps "
                                f"tensor {first[3]!r} (bytes {first[0]}..{first[2]})",
                                later[4], later[5])

    # ---- access --------------------------------------------------------------------

    @property
    def architecture(self) -> str:
        """general.architecture; GGUFError if it is missing or not a non-empty string (the
        error points at the value, or at the start of the metadata section if absent)."""
        key = "general.architecture"
        value = self.metadata.get(key)
        if not isinstance(value, str) or not value:
            got = "missing" if value is None else f"{value!r}, not a non-empty string"
            raise GGUFError(f"metadata {key!r} is {got}", key,
                            self._value_pos.get(key, _HEADER_SIZE))
        return value

    def get(self, key: str, default: Any = None) -> Any:
        """Looks up a metadata value.

        Args:
            key: metadata key, e.g. "llama.block_count".
            default: returned when the key is absent.

        Returns:
            The value (see the module's type mapping) or `default`.
        """
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, zero-copy.

        Args:
            name: tensor name (KeyError if absent).

        Returns:
            Read-only uint8 array of shape (nbytes,) over the mapping.
        """
        info = self.tensors[name]
        if self._mm is None:
            raise ValueError(f"{self.path}: GGUF file is closed")
        return np.frombuffer(self._mm, np.uint8, info.nbytes, info.offset)

    def blocks(self, name: str) -> np.ndarray:
        """The tensor's bytes as rows, zero-copy; works for every type, quantized or not.

        Args:
            name: tensor name (KeyError if absent).

        Returns:
            Read-only uint8 array of shape (n_rows, row_bytes), n_rows = prod(shape[:-1]).
        """
        info = self.tensors[name]
        _, block_size, type_size = _GGML_TYPES[info.ggml_type]
        row_bytes = info.ne[0] // block_size * type_size
        return self.raw(name).reshape(info.n_elements // info.ne[0], row_bytes)

    def array(self, name: str) -> np.ndarray:
        """An unquantized tensor as a typed array, zero-copy.

        Args:
            name: tensor name (KeyError if absent) of type F32, F16, BF16, F64, I8, I16,
                I32 or I64.

        Returns:
            Read-only array in numpy shape; BF16 comes as its raw uint16 bits.

        Raises:
            GGUFError: the tensor is quantized (use blocks() or raw()).
        """
        info = self.tensors[name]
        dtype = _PLAIN_DTYPES.get(info.type_name)
        if dtype is None:
            field, pos = self._type_field[name]
            raise GGUFError(f"tensor {name!r} is {info.type_name}, a quantized type; "
                            f"use blocks() or raw()", field, pos)
        if self._mm is None:
            raise ValueError(f"{self.path}: GGUF file is closed")
        return np.frombuffer(self._mm, dtype, info.n_elements, info.offset).reshape(info.shape)

    def release(self, name: str | None = None, start: int = 0, end: int | None = None) -> None:
        """Drops pages of one tensor (or of the whole file) from this process's memory.

        The mapping stays valid: touched again, pages are read back from the file. Used after
        weights have been copied into another layout, so they are not held twice.

        Args:
            name: tensor name, or None for the whole file.
            start, end: byte range within the tensor (default: all of it).
        """
        if self._mm is None or not hasattr(self._mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        if name is None:
            base, size = 0, self.file_size
        else:
            info = self.tensors[name]
            base, size = info.offset, info.nbytes
        end = size if end is None else min(end, size)
        start, end = base + max(0, start), base + end
        page = mmap.PAGESIZE
        start -= start % page
        end = min(self.file_size, -(-end // page) * page)
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        """Releases the mapping. Views handed out earlier stay valid: the mapping is then
        unmapped when the last of them is freed."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # arrays still export it; dropping our reference is all we can do

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, version={self.version}, "
                f"tensors={len(self.tensors)}, metadata={len(self.metadata)})")


def _main(argv: list[str] | None = None) -> None:
    """Prints a summary and the open time of each file: `python -m localllm.formats.gguf FILE...`.

    The time is that of opening the file and reading all its metadata in this process;
    --fresh N also times N fresh interpreters doing the same, import included.
    """
    import argparse
    import statistics
    import subprocess
    import sys
    import time

    ap = argparse.ArgumentParser(prog="python -m localllm.formats.gguf", description=_main.__doc__)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--runs", type=int, default=5, help="in-process runs per file (median shown)")
    ap.add_argument("--fresh", type=int, default=0, help="also time N fresh processes per file")
    args = ap.parse_args(argv)
    for path in args.files:
        times = []
        for _ in range(max(1, args.runs)):
            t0 = time.perf_counter()
            with GGUFFile(path) as f:
                pass
            times.append(time.perf_counter() - t0)
        types: dict[str, int] = {}
        for info in f.tensors.values():
            types[info.type_name] = types.get(info.type_name, 0) + 1
        tokens = f.get("tokenizer.ggml.tokens")
        print(f"{path}\n  architecture {f.get('general.architecture')!r}, GGUF v{f.version}, "
              f"{len(f.metadata)} metadata keys, {len(f.tensors)} tensors "
              f"{dict(sorted(types.items()))}, vocab {len(tokens) if tokens is not None else '-'}, "
              f"{f.file_size / 2**20:.1f} MiB")
        print(f"  open + metadata, in process: median {statistics.median(times) * 1e3:.1f} ms "
              f"over {len(times)} runs")
        if args.fresh > 0:
            code = "import sys; from localllm.formats.gguf import GGUFFile; GGUFFile(sys.argv[1]).close()"
            walls = []
            for _ in range(args.fresh):
                t0 = time.perf_counter()
                subprocess.run([sys.executable, "-c", code, path], check=True)
                walls.append(time.perf_counter() - t0)
            print(f"  fresh process (interpreter start + import + open): median "
                  f"{statistics.median(walls) * 1e3:.1f} ms over {len(walls)} runs")


if __name__ == "__main__":
    _main()
