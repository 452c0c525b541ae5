"""Structure-aware GGUF fuzzing: hypothesis strategies for valid files, mutations aimed at
the fields they were built from, and a checker process that opens each file under a memory
and time limit and reports whether the reader kept its promise.

Run as a script, this module is the checker: it reads file paths on stdin and writes one
JSON line per path (see `check_file`)."""

from __future__ import annotations

import json
import os
import random
import resource
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from . import gguf_hostile as H
from localllm.formats.gguf import MAX_ARRAY_DEPTH

# ---- building files with a map of their fields ---------------------------------------

# GGML types the generator uses: (id, block size, bytes per block).
GGML_TYPES = [(0, 1, 4), (1, 1, 2), (30, 1, 2), (28, 1, 8), (24, 1, 1), (26, 1, 4),
              (2, 32, 18), (8, 32, 34), (12, 256, 144), (14, 256, 210), (39, 32, 17)]
_SCALAR_FMT = {H.U8: "<B", H.I8: "<b", H.U16: "<H", H.I16: "<h", H.U32: "<I", H.I32: "<i",
               H.F32: "<f", H.BOOL: "<B", H.U64: "<Q", H.I64: "<q", H.F64: "<d"}


@dataclass
class Field:
    """A count, length, type, dimension or offset word in a built file."""
    pos: int
    width: int
    kind: str
    value: int


@dataclass
class Value:
    """A metadata value before serialization: a scalar, a string, or an array of Values."""
    vtype: int
    data: Any                      # scalar, str, or (item_type, [Value, ...])


@dataclass
class Spec:
    """A valid GGUF file, as the generator chose it."""
    version: int
    alignment: int | None          # None: no general.alignment key (default 32)
    kvs: list[tuple[str, Value]]
    tensors: list[tuple[str, tuple[int, ...], int]]   # name, ne, ggml type
    gaps: list[int]                # alignment units left free before each tensor
    order: list[int]               # data-section order of the tensors
    seed: int


@dataclass
class Built:
    data: bytes
    fields: list[Field] = field(default_factory=list)
    offsets: dict[str, int] = field(default_factory=dict)   # tensor -> relative offset


class _Writer:
    def __init__(self) -> None:
        self.buf = bytearray()
        self.fields: list[Field] = []

    def word(self, value: int, width: int, kind: str) -> None:
        self.fields.append(Field(len(self.buf), width, kind, value))
        self.buf += value.to_bytes(width, "little")

    def string(self, s: str, kind: str) -> None:
        raw = s.encode("utf-8")
        self.word(len(raw), 8, kind)
        self.buf += raw

    def value(self, v: Value) -> None:
        if v.vtype == H.STRING:
            self.string(v.data, "str_len")
        elif v.vtype == H.ARRAY:
            item_type, items = v.data
            self.word(item_type, 4, "item_type")
            self.word(len(items), 8, "array_len")
            for item in items:
                self.value(item)
        else:
            if v.vtype == H.BOOL:
                self.fields.append(Field(len(self.buf), 1, "bool", int(v.data)))
            self.buf += struct.pack(_SCALAR_FMT[v.vtype], v.data)


def tensor_nbytes(ne: tuple[int, ...], ggml_type: int) -> int:
    _, block, size = next(t for t in GGML_TYPES if t[0] == ggml_type)
    n = 1
    for d in ne:
        n *= d
    return n // block * size


def build(spec: Spec) -> Built:
    """Serializes a Spec, recording where each count, length, type, dim and offset sits."""
    w = _Writer()
    w.buf += b"GGUF"
    w.word(spec.version, 4, "version")
    w.word(len(spec.tensors), 8, "tensor_count")
    kvs = list(spec.kvs)
    if spec.alignment is not None:
        kvs.insert(0, ("general.alignment", Value(H.U32, spec.alignment)))
    w.word(len(kvs), 8, "kv_count")
    for key, v in kvs:
        w.string(key, "key_len")
        w.word(v.vtype, 4, "value_type")
        if key == "general.alignment":
            w.word(v.data, 4, "alignment")
        else:
            w.value(v)
    align = spec.alignment or 32
    offsets, pos = {}, 0
    for i in spec.order:
        name, ne, ggml_type = spec.tensors[i]
        pos = -(-pos // align) * align + spec.gaps[i] * align
        offsets[name] = pos
        pos += tensor_nbytes(ne, ggml_type)
    for name, ne, ggml_type in spec.tensors:
        w.string(name, "name_len")
        w.word(len(ne), 4, "n_dims")
        for d in ne:
            w.word(d, 8, "dim")
        w.word(ggml_type, 4, "ggml_type")
        w.word(offsets[name], 8, "offset")
    w.buf += b"\0" * (-len(w.buf) % align)
    w.buf += random.Random(spec.seed).randbytes(pos)
    return Built(bytes(w.buf), w.fields, offsets)


# ---- strategies ----------------------------------------------------------------------

_text = st.text(st.characters(codec="utf-8"), max_size=12)
_key = st.text(st.characters(codec="utf-8"), min_size=1, max_size=16)


def _scalar(vtype: int) -> st.SearchStrategy:
    fmt = _SCALAR_FMT[vtype]
    if vtype == H.BOOL:
        return st.booleans()
    if fmt[-1] in "fd":
        width = 32 if fmt[-1] == "f" else 64
        return st.floats(width=width, allow_nan=False)
    bits = struct.calcsize(fmt) * 8
    signed = fmt[-1].islower()
    lo, hi = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    return st.integers(lo, hi)


_SCALAR_TYPES = sorted(_SCALAR_FMT)


def _arrays(levels: int) -> st.SearchStrategy[Value]:
    """Arrays nested at most `levels` deep (a plain array is one level)."""
    def array_of(item_type: int) -> st.SearchStrategy[Value]:
        if item_type == H.ARRAY:
            items = st.lists(_arrays(levels - 1), max_size=3)
        elif item_type == H.STRING:
            items = st.lists(_text.map(lambda s: Value(H.STRING, s)), max_size=6)
        else:
            items = st.lists(_scalar(item_type).map(lambda x: Value(item_type, x)), max_size=6)
        return items.map(lambda xs: Value(H.ARRAY, (item_type, xs)))

    kinds = _SCALAR_TYPES + [H.STRING] + ([H.ARRAY] if levels > 1 else [])
    return st.sampled_from(kinds).flatmap(array_of)


def values(levels: int = MAX_ARRAY_DEPTH) -> st.SearchStrategy[Value]:
    """Any metadata value: scalars, strings, arrays nested at most `levels` deep."""
    leaf = st.one_of(
        st.sampled_from(_SCALAR_TYPES).flatmap(lambda t: _scalar(t).map(lambda x: Value(t, x))),
        _text.map(lambda s: Value(H.STRING, s)),
    )
    return st.one_of(leaf, _arrays(levels))


@st.composite
def _tensors(draw) -> list[tuple[str, tuple[int, ...], int]]:
    names = draw(st.lists(_key, max_size=5, unique=True))
    out = []
    for name in names:
        ggml_type, block, _ = draw(st.sampled_from(GGML_TYPES))
        n_dims = draw(st.integers(1, 4))
        ne = (block * draw(st.integers(1, 4)),) + tuple(
            draw(st.integers(1, 3)) for _ in range(n_dims - 1))
        out.append((name, ne, ggml_type))
    return out


@st.composite
def specs(draw) -> Spec:
    """A valid GGUF file: every value kind, arrays nested up to the reader's limit,
    tensors of several GGML types laid out in any order with gaps."""
    kvs = draw(st.lists(st.tuples(_key.filter(lambda k: k != "general.alignment"),
                                  values()),
                        max_size=6, unique_by=lambda kv: kv[0]))
    tensors = draw(_tensors())
    n = len(tensors)
    return Spec(
        version=draw(st.sampled_from([2, 3])),
        alignment=draw(st.sampled_from([None, 1, 8, 32, 64, 256])),
        kvs=kvs, tensors=tensors,
        gaps=draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)),
        order=draw(st.permutations(range(n))),
        seed=draw(st.integers(0, 2**32 - 1)))


EDGE = [0, 1, 2, 3, 4, 7, 8, 31, 32, 33, 63, 64, 255, 256, 2**16, 2**31 - 1, 2**31, 2**32 - 1,
        2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@st.composite
def mutations(draw, built: Built) -> list[tuple]:
    """One to three edits aimed at the built file's own fields: a count, length, type, dim,
    offset or alignment word set to an edge value or nudged, a bool byte changed, the file
    cut short, or bytes inserted or deleted."""
    ops = []
    size = len(built.data)
    # The magic and version have their own cases in the corpus; edits start past them.
    targets = [f for f in built.fields if f.kind != "version"]
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["word", "word", "word", "cut", "splice"]))
        if kind == "word" and targets:
            f = draw(st.sampled_from(targets))
            top = 2 ** (8 * f.width) - 1
            choice = draw(st.sampled_from(["edge", "nudge", "size", "random"]))
            if choice == "edge":
                value = draw(st.sampled_from(EDGE)) & top
            elif choice == "nudge":
                value = (f.value + draw(st.sampled_from([-33, -32, -1, 1, 31, 32, 64]))) & top
            elif choice == "size":
                value = (size + draw(st.integers(-40, 40))) & top
            else:
                value = draw(st.integers(0, top))
            ops.append(("word", f.pos, f.width, value))
        elif kind == "cut":
            ops.append(("cut", draw(st.integers(H.HEADER, max(H.HEADER, size - 1)))))
        else:
            ops.append(("splice", draw(st.integers(H.HEADER, size)), draw(st.integers(0, 16)),
                        draw(st.binary(max_size=16))))
    return ops


def apply(data: bytes, ops: list[tuple]) -> bytes:
    out = bytearray(data)
    for op in ops:
        if op[0] == "word":
            _, pos, width, value = op
            if pos + width <= len(out):
                out[pos:pos + width] = value.to_bytes(width, "little")
        elif op[0] == "cut":
            del out[op[1]:]
        else:
            _, pos, n_del, ins = op
            out[pos:pos + n_del] = ins
    return bytes(out)


def nest(v: Value, levels: int) -> Value:
    """`v` wrapped in `levels` more arrays of one element."""
    for _ in range(levels):
        v = Value(H.ARRAY, (H.ARRAY, [v]))
    return v


def depth(v: Value) -> int:
    if v.vtype != H.ARRAY:
        return 0
    # The reader counts a level only where it reads one: an empty array of arrays is one.
    return 1 + max((depth(i) for i in v.data[1]), default=0)


# ---- the expected reading of a valid file --------------------------------------------

def expected(spec: Spec) -> dict:
    """What a correct reader returns for `build(spec)`, in the checker's JSON form."""
    def plain(v: Value) -> Any:
        if v.vtype == H.ARRAY:
            item_type, items = v.data
            return [plain(i) for i in items]
        if v.vtype == H.F32:
            return struct.unpack("<f", struct.pack("<f", v.data))[0]
        return v.data

    built = build(spec)
    align = spec.alignment or 32
    meta = {k: plain(v) for k, v in spec.kvs}
    if spec.alignment is not None:
        meta = {"general.alignment": spec.alignment, **meta}
    return {"version": spec.version, "alignment": align,
            "metadata": meta,
            "tensors": {name: [list(ne), ggml_type, built.offsets[name],
                               tensor_nbytes(ne, ggml_type)]
                        for name, ne, ggml_type in spec.tensors}}


# ---- the checker process -------------------------------------------------------------

MEMORY_BUDGET = 256 << 20   # bytes of address space a file may cost beyond the interpreter
TIME_LIMIT = 30.0           # seconds per file before the checker counts as hung


def _jsonable(v: Any) -> Any:
    import numpy as np
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    return v


def _invariants(f, size: int) -> list[str]:
    """Everything a returned GGUFFile promises, checked; returns the broken promises."""
    import numpy as np
    from localllm.formats.gguf import GGUFError, MAX_DIMS
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    bad = []
    a = f.alignment
    if f.version not in (2, 3):
        bad.append(f"version {f.version}")
    if a <= 0 or a & (a - 1):
        bad.append(f"alignment {a}")
    if f.file_size != size:
        bad.append(f"file_size {f.file_size} != {size}")

    def check_value(key: str, v: Any, level: int) -> None:
        if level > MAX_ARRAY_DEPTH:
            bad.append(f"{key!r}: nested deeper than {MAX_ARRAY_DEPTH}")
        if isinstance(v, np.ndarray):
            if v.flags.writeable or v.ndim != 1:
                bad.append(f"{key!r}: array writeable or not 1-D")
        elif isinstance(v, list):
            for x in v:
                if isinstance(x, (list, np.ndarray)):
                    check_value(key, x, level + 1)
                elif not isinstance(x, str):
                    bad.append(f"{key!r}: list item of type {type(x).__name__}")
        elif not isinstance(v, (bool, int, float, str)):
            bad.append(f"{key!r}: value of type {type(v).__name__}")

    for key, v in f.metadata.items():
        if not isinstance(key, str) or not key:
            bad.append(f"key {key!r}")
        check_value(key, v, 1 if isinstance(v, (list, np.ndarray)) else 0)

    spans = []
    for name, t in f.tensors.items():
        if not name or t.name != name:
            bad.append(f"tensor name {name!r}")
        qtype = GGMLQuantizationType(t.ggml_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
        n = 1
        for d in t.ne:
            n *= d
        if not 1 <= len(t.ne) <= MAX_DIMS or min(t.ne) <= 0 or t.shape != tuple(reversed(t.ne)):
            bad.append(f"{name!r}: dims {t.ne} shape {t.shape}")
        if t.type_name != qtype.name or t.ne[0] % block or t.n_elements != n \
                or t.nbytes != n // block * type_size:
            bad.append(f"{name!r}: type {t.type_name} ne {t.ne} nbytes {t.nbytes}")
        if t.offset < f.data_offset or (t.offset - f.data_offset) % a or t.offset + t.nbytes > size:
            bad.append(f"{name!r}: offset {t.offset} (data at {f.data_offset}, size {size})")
        spans.append((t.offset, t.offset + t.nbytes, name))
        raw = f.raw(name)
        if raw.nbytes != t.nbytes or raw.flags.writeable:
            bad.append(f"{name!r}: raw view")
        int(raw.sum(dtype=np.uint64))  # touches every byte of the view
        if f.blocks(name).size != t.nbytes:
            bad.append(f"{name!r}: blocks view")
        try:
            arr = f.array(name)
            if arr.shape != t.shape:
                bad.append(f"{name!r}: array shape {arr.shape}")
        except GGUFError:
            if block == 1 and qtype.name in ("F32", "F16", "F64", "BF16", "I8", "I16", "I32", "I64"):
                bad.append(f"{name!r}: plain type refused by array()")
    spans.sort()
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            bad.append(f"tensors {n0!r} and {n1!r} overlap")
    if f.tensors and f.data_offset % a:
        bad.append(f"data_offset {f.data_offset} not aligned to {a}")
    return bad


def check_file(path: str) -> dict:
    """Opens one file; returns {"status": "ok" | "gguf_error" | "error", ...}. "ok" carries
    the reading (for valid files) and any broken invariant; "error" is any exception
    other than GGUFError, with its type and message."""
    from localllm.formats.gguf import GGUFError, GGUFFile

    t0 = time.perf_counter()
    size = os.path.getsize(path)
    try:
        with GGUFFile(path) as f:
            broken = _invariants(f, size)
            out = {"status": "ok", "broken": broken, "version": f.version,
                   "alignment": f.alignment,
                   "metadata": {k: _jsonable(v) for k, v in f.metadata.items()},
                   "tensors": {n: [list(t.ne), t.ggml_type, t.offset - f.data_offset, t.nbytes]
                               for n, t in f.tensors.items()}}
    except GGUFError as e:
        ok = type(e) is GGUFError and isinstance(e.field, str) and 0 <= e.offset <= max(size, 24)
        out = {"status": "gguf_error", "field": e.field, "offset": e.offset, "message": str(e),
               "broken": [] if ok else [f"malformed GGUFError: {e!r}"]}
    except BaseException as e:  # noqa: BLE001 - the property is that nothing else escapes
        import traceback
        out = {"status": "error", "type": type(e).__name__, "message": str(e)[:500],
               "traceback": traceback.format_exc()[-2000:]}
    out["seconds"] = time.perf_counter() - t0
    out["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out


def _serve() -> None:
    import localllm.formats.gguf  # noqa: F401  (imported before the limit is set)
    import numpy  # noqa: F401
    from gguf.constants import GGML_QUANT_SIZES  # noqa: F401
    with open("/proc/self/statm") as f:
        vm_pages = int(f.read().split()[0])
    limit = vm_pages * os.sysconf("SC_PAGE_SIZE") + MEMORY_BUDGET
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    print(json.dumps({"ready": True, "as_limit": limit}), flush=True)
    for line in sys.stdin:
        path = line.rstrip("\n")
        if path.startswith("alloc "):  # proves the limit is in force (see the tests)
            try:
                numpy.ones(int(path.split()[1]), numpy.uint8)
                out = {"status": "ok"}
            except MemoryError:
                out = {"status": "error", "type": "MemoryError"}
        elif path.startswith("measure "):  # the same check, with its peak allocation
            import tracemalloc
            tracemalloc.start()
            out = check_file(path[len("measure "):])
            out["peak_bytes"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        else:
            out = check_file(path)
        print(json.dumps(out), flush=True)


class Checker:
    """The checker process, started once and restarted if a file kills it."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.as_limit = 0

    def _start(self) -> None:
        # Run as `python -m support.gguf_fuzz` from the folder that holds support/.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "support.gguf_fuzz"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.as_limit = json.loads(self._read_line(120.0))["as_limit"]

    def _read_line(self, timeout: float) -> str:
        import selectors
        assert self.proc is not None and self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            raise TimeoutError(f"the checker did not answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.proc = None
            raise RuntimeError(f"the checker died (exit code {code})")
        return line

    def check(self, path: str) -> dict:
        if self.proc is None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(path + "\n")
        self.proc.stdin.flush()
        return json.loads(self._read_line(TIME_LIMIT))

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(10)
            self.proc = None


if __name__ == "__main__":
    _serve()
