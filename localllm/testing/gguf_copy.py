"""Copies of a real GGUF file made with the gguf package: the first few layers only (a cheap
draft model with the same vocabulary), or every tensor of one quant type requantized to
another (e.g. a Q8_0 target from a Q4_1 file, or an F32 one: the same weights without the
rounding of the activations a quantized matmul does)."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np

_BLOCK = re.compile(r"blk\.(\d+)\.")


def copy_gguf(src: str | Path, dst: str | Path, n_layers: int | None = None,
              requant: tuple[str, str] | None = None) -> Path:
    """Writes a copy of ``src``: with ``n_layers``, only the first that many blocks (the
    block count changed to match); with ``requant=(from, to)``, every ``from`` tensor
    dequantized and quantized again as ``to`` (GGML type names, e.g. ("Q4_1", "Q8_0"); "F32"
    or "F16" stores the dequantized values).

    Returns:
        The path written.
    """
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        value = f.contents()
        if n_layers is not None and k == f"{arch}.block_count":
            value = n_layers
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(k, value, vtype, sub_type=sub)
    src_type, dst_type = (gguf.GGMLQuantizationType[t] for t in requant) if requant else (None, None)
    for t in r.tensors:
        m = _BLOCK.match(t.name)
        if n_layers is not None and m and int(m.group(1)) >= n_layers:
            continue
        if t.tensor_type == src_type:
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            if dst_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                w.add_tensor(t.name, values.astype(np.float32 if dst_type.name == "F32"
                                                   else np.float16))
            else:
                w.add_tensor(t.name, gguf.quants.quantize(values, dst_type), raw_dtype=dst_type)
        elif t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            # numpy shape is the reverse of GGUF's dimension order
            w.add_tensor(t.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))))
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)
