"""One layer's KV pages in a KV type, written and attended through the kernels, with what the
pages hold decoded independently of them (numpy), for the attention and backend tests."""

from __future__ import annotations

import numpy as np

from localllm.kernels import attention as attn
from localllm.kernels import kvpages

CTX = 320  # positions a test sequence can hold (a multiple of 16)


def _e4m3_table() -> np.ndarray:
    """The value of every FP8 E4M3 code (0x7F / 0xFF, NaN, never stored)."""
    c = np.arange(256)
    e, m = (c >> 3) & 15, (c & 7).astype(np.float64)
    mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7.0))
    return np.where(c >= 128, -mag, mag)


E4M3 = _e4m3_table()


class Cache:
    """One layer's pages in a KV type, with ``n_seqs`` sequences' blocks placed at random."""

    def __init__(self, kind, n_kv, hd, ctx=CTX, bs=16, n_seqs=1, seed=0):
        self.kind, self.n_kv, self.hd, self.bs = kind, n_kv, hd, bs
        nblk = -(-ctx // bs)
        self.n_pages = n_pages = nblk * n_seqs + 3
        cls = kvpages.PAGE_CLASSES[kind]
        self.K = cls(np.zeros(n_pages * n_kv * (bs // 16) * kvpages.k_group_nbytes(kind, hd)
                              + kvpages.PAD, np.uint8))
        self.V = cls(np.zeros(n_pages * n_kv * bs * kvpages.v_row_nbytes(kind, hd)
                              + kvpages.PAD, np.uint8))
        perm = np.random.default_rng(seed).permutation(n_pages)[:nblk * n_seqs]
        self.tables = perm.reshape(n_seqs, nblk).astype(np.int32)

    def write(self, k, v, pos, seq=0):
        rs = np.full(len(pos), seq, np.int32)
        attn.kv_write(self.K, self.V, self.tables, rs, self.bs, np.ascontiguousarray(k),
                      np.ascontiguousarray(v), np.asarray(pos, np.int64))

    def attend(self, q, pos, window, scale, seqs=None, sinks=None):
        q = np.ascontiguousarray(q, np.float32)
        rs = np.zeros(len(pos), np.int32) if seqs is None else np.asarray(seqs, np.int32)
        out = np.empty_like(q)
        sinks = np.zeros(0, np.float32) if sinks is None else np.asarray(sinks, np.float32)
        attn.attend(q, self.K, self.V, self.tables, rs, self.bs, self.n_kv,
                    np.asarray(pos, np.int64), window, scale, sinks, out)
        return out

    # ---- what the pages hold, decoded independently of the kernels

    def _key_group(self, seq, p, h):
        page = self.tables[seq, p // self.bs]
        g = (h * self.n_pages + page) * (self.bs // 16) + p % self.bs // 16
        nb = kvpages.k_group_nbytes(self.kind, self.hd)
        return self.K.a[g * nb:(g + 1) * nb], p % 16

    def _value_row(self, seq, p, h):
        page = self.tables[seq, p // self.bs]
        r = (h * self.n_pages + page) * self.bs + p % self.bs
        nb = kvpages.v_row_nbytes(self.kind, self.hd)
        return self.V.a[r * nb:(r + 1) * nb]

    def key(self, seq, p, h):
        raw, lane = self._key_group(seq, p, h)
        hd = self.hd
        if self.kind == "q8_0":
            q = raw[:16 * hd].view(np.int8).reshape(hd, 16)[:, lane].astype(np.float64)
            d = raw[16 * hd:].view(np.float16).reshape(hd // 32, 16)[:, lane]
            return q * np.repeat(d.astype(np.float64), 32)
        if self.kind == "q4_0":
            b = raw[:8 * hd].reshape(hd // 32, 16, 16)[:, :, lane]
            q = np.concatenate([b & 15, b >> 4], axis=1).reshape(-1).astype(np.float64) - 8
            d = raw[8 * hd:].view(np.float16).reshape(hd // 32, 16)[:, lane]
            return q * np.repeat(d.astype(np.float64), 32)
        width = 1 if self.kind == "fp8" else 2
        col = raw.reshape(hd, 16, width)[:, lane].copy()
        return self._floats(col.reshape(-1))

    def value(self, seq, p, h):
        raw, hd = self._value_row(seq, p, h), self.hd
        if self.kind in ("q8_0", "q4_0"):
            blocks = raw[:hd if self.kind == "q8_0" else hd // 2].reshape(hd // 32, -1)
            d = raw[-(hd // 16):].view(np.float16).astype(np.float64).reshape(-1, 1)
            if self.kind == "q8_0":
                return (blocks.view(np.int8) * d).reshape(-1)
            q = np.concatenate([blocks & 15, blocks >> 4], axis=1).astype(np.float64) - 8
            return (q * d).reshape(-1)
        return self._floats(raw)

    def _floats(self, raw):
        if self.kind == "fp8":
            return E4M3[raw]
        u = raw.view(np.uint16)
        if self.kind == "bf16":
            return (u.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return u.view(np.float16).astype(np.float64)

    def stored(self, n, seq=0):
        """(n_kv, n, hd) float64 keys and values of positions 0..n-1 as the pages hold them."""
        keys = np.array([[self.key(seq, p, h) for p in range(n)] for h in range(self.n_kv)])
        vals = np.array([[self.value(seq, p, h) for p in range(n)] for h in range(self.n_kv)])
        return keys, vals
