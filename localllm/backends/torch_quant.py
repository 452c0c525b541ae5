"""GGUF weight blocks dequantized by torch on the device that holds them: one function per
format, from a (n_blocks, type_size) uint8 tensor to float32 (n_blocks, block_size).

Each follows localllm.formats.dequant's float order (block scale times sub-block scale, times q, then
plus the min), so the result equals the numpy reference bit for bit.
"""

from __future__ import annotations

import torch

from localllm.formats.quants import BLOCK_LAYOUT, IQ4NL_VALUES, MXFP4_VALUES, type_size

_OFFSETS = {name: {} for name in BLOCK_LAYOUT}
for _name, _fields in BLOCK_LAYOUT.items():
    _at = 0
    for _f, _n in _fields:
        _OFFSETS[_name][_f] = (_at, _at + _n)
        _at += _n


def _field(b: torch.Tensor, kind: str, name: str) -> torch.Tensor:
    lo, hi = _OFFSETS[kind][name]
    return b[:, lo:hi]


def _half(b: torch.Tensor, kind: str, name: str = "d") -> torch.Tensor:
    """An f16 field widened to float32: (nb, 1)."""
    return _field(b, kind, name).contiguous().view(torch.float16).float()


def _shifts(b: torch.Tensor, values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=b.device)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """(nb, 16k) bytes -> (nb, 32k): per 16-byte group, low nibbles then high nibbles."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, 16) >> _shifts(qs, [0, 4]).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(nb, -1)


def _crumbs128(qs: torch.Tensor) -> torch.Tensor:
    """(nb, 32k) bytes -> (nb, 128k) 2-bit values: bit pair j of byte l is element 32j + l
    of each 32-byte group."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, 32) >> _shifts(qs, [0, 2, 4, 6]).reshape(1, 1, 4, 1)
    return (q & 0x03).reshape(nb, -1)


def _bits256(mask: torch.Tensor) -> torch.Tensor:
    """(nb, 32) bytes -> (nb, 256) bits: bit j of byte l is element 32j + l."""
    nb = mask.shape[0]
    q = mask.reshape(nb, 1, 32) >> _shifts(mask, range(8)).reshape(1, 8, 1)
    return (q & 0x01).reshape(nb, 256)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """(nb, 4) bytes of a little-endian uint32 -> (nb, 32): bit j is element j's."""
    nb = qh.shape[0]
    return ((qh.reshape(nb, 4, 1) >> _shifts(qh, range(8)).reshape(1, 1, 8)) & 1).reshape(nb, 32)


def _kquant_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(nb, 128) -> (nb, 256): per 32-byte group, 32 low nibbles then 32 high ones."""
    nb = qs.shape[0]
    q = qs.reshape(nb, 4, 1, 32) >> _shifts(qs, [0, 4]).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(nb, 256)


def _sub(x: torch.Tensor, n_sub: int) -> torch.Tensor:
    return x.reshape(x.shape[0], n_sub, 1)


def _f32(b):
    return b.contiguous().view(torch.float32)


def _f16(b):
    return b.contiguous().view(torch.float16).float()


def _bf16(b):
    return b.contiguous().view(torch.bfloat16).float()


def _q4_0(b):
    return _half(b, "Q4_0") * (_nibbles32(_field(b, "Q4_0", "qs")).float() - 8.0)


def _q4_1(b):
    q = _nibbles32(_field(b, "Q4_1", "qs")).float()
    return _half(b, "Q4_1") * q + _half(b, "Q4_1", "m")


def _q5(b, kind):
    return _nibbles32(_field(b, kind, "qs")) | (_bits32(_field(b, kind, "qh")) << 4)


def _q5_0(b):
    return _half(b, "Q5_0") * (_q5(b, "Q5_0").float() - 16.0)


def _q5_1(b):
    return _half(b, "Q5_1") * _q5(b, "Q5_1").float() + _half(b, "Q5_1", "m")


def _q8_0(b):
    return _half(b, "Q8_0") * _field(b, "Q8_0", "qs").contiguous().view(torch.int8).float()


def _q2_k(b):
    nb = b.shape[0]
    s = _field(b, "Q2_K", "scales")
    dl = _sub(_half(b, "Q2_K") * (s & 0x0F).float(), 16)
    ml = _sub(_half(b, "Q2_K", "dmin") * (s >> 4).float(), 16)
    q = _crumbs128(_field(b, "Q2_K", "qs")).reshape(nb, 16, 16).float()
    return (dl * q - ml).reshape(nb, 256)


def _q3_k(b):
    nb = b.shape[0]
    low = _crumbs128(_field(b, "Q3_K", "qs")).to(torch.int16)
    high = _bits256(_field(b, "Q3_K", "hmask")).to(torch.int16)
    q = (low - ((high ^ 1) << 2)).reshape(nb, 16, 16).float()
    s = _field(b, "Q3_K", "scales")
    lo = torch.cat([s[:, :8] & 0x0F, s[:, :8] >> 4], dim=1)
    hi = ((s[:, 8:12].reshape(nb, 1, 4) >> _shifts(s, [0, 2, 4, 6]).reshape(1, 4, 1)) & 3)
    sc = (lo | (hi.reshape(nb, 16) << 4)).float() - 32.0
    return (_sub(_half(b, "Q3_K") * sc, 16) * q).reshape(nb, 256)


def _kquant_scales(b, kind):
    s = _field(b, kind, "scales")
    lo_sc, lo_m, packed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo_sc & 0x3F, (packed & 0x0F) | ((lo_sc >> 6) << 4)], dim=1)
    m = torch.cat([lo_m & 0x3F, (packed >> 4) | ((lo_m >> 6) << 4)], dim=1)
    return sc.float(), m.float()


def _q45_k(b, kind, q):
    nb = b.shape[0]
    sc, m = _kquant_scales(b, kind)
    dl = _sub(_half(b, kind) * sc, 8)
    ml = _sub(_half(b, kind, "dmin") * m, 8)
    return (dl * q.reshape(nb, 8, 32).float() - ml).reshape(nb, 256)


def _q4_k(b):
    return _q45_k(b, "Q4_K", _kquant_nibbles(_field(b, "Q4_K", "qs")))


def _q5_k(b):
    q = _kquant_nibbles(_field(b, "Q5_K", "qs")) | (_bits256(_field(b, "Q5_K", "qh")) << 4)
    return _q45_k(b, "Q5_K", q)


def _q6_k(b):
    nb = b.shape[0]
    ql = _field(b, "Q6_K", "ql")
    low = (ql.reshape(nb, 2, 1, 2, 32) >> _shifts(b, [0, 4]).reshape(1, 1, 2, 1, 1)) & 0x0F
    q = (low.reshape(nb, 256) | (_crumbs128(_field(b, "Q6_K", "qh")) << 4)).float() - 32.0
    sc = _field(b, "Q6_K", "scales").contiguous().view(torch.int8).float()
    return (_sub(_half(b, "Q6_K") * sc, 16) * q.reshape(nb, 16, 16)).reshape(nb, 256)


def _levels(b):
    return torch.as_tensor(IQ4NL_VALUES.astype("float32"), device=b.device)


def _iq4_nl(b):
    idx = _nibbles32(_field(b, "IQ4_NL", "qs")).long()
    return _half(b, "IQ4_NL") * _levels(b)[idx]


def _iq4_xs(b):
    nb = b.shape[0]
    sl = _field(b, "IQ4_XS", "scales_l")
    sh = _field(b, "IQ4_XS", "scales_h").contiguous().view(torch.int16).to(torch.int32)
    low = ((sl.reshape(nb, 4, 1) >> _shifts(b, [0, 4]).reshape(1, 1, 2)) & 0x0F).reshape(nb, 8)
    two = torch.arange(0, 16, 2, dtype=torch.int32, device=b.device)
    high = (sh >> two) & 0x03
    sc = (low.to(torch.int32) | (high << 4)).float() - 32.0
    values = _levels(b)[_nibbles32(_field(b, "IQ4_XS", "qs")).long()].reshape(nb, 8, 32)
    return (_sub(_half(b, "IQ4_XS") * sc, 8) * values).reshape(nb, 256)


def _mxfp4(b):
    """2**(e - 128) times the doubled E2M1 value; the scale is built from its bits (e < 2:
    the subnormals 2**-128, 2**-127), so the product is exact as in the reference."""
    e = _field(b, "MXFP4", "e").to(torch.int32)
    bits = torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    values = torch.as_tensor(MXFP4_VALUES.astype("float32"), device=b.device)
    return d * values[_nibbles32(_field(b, "MXFP4", "qs")).long()]


DEQUANT = {
    "F32": _f32, "F16": _f16, "BF16": _bf16, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0,
    "Q5_1": _q5_1, "Q8_0": _q8_0, "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k,
    "Q6_K": _q6_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs, "MXFP4": _mxfp4,
}


def dequantize_rows(rows: torch.Tensor, type_name: str, K: int) -> torch.Tensor:
    """Rows of a weight matrix as float32.

    Args:
        rows: uint8 (n, row_bytes) GGUF rows on any device.
        type_name: their GGML format (a key of DEQUANT).
        K: elements per row.
    Returns:
        float32 (n, K) on the rows' device.
    """
    n = rows.shape[0]
    blocks = rows.reshape(-1, type_size(type_name))
    return DEQUANT[type_name](blocks).reshape(n, K)
