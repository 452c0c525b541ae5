"""Walking a compiled grammar over bytes: interned parse stacks and stack sets, a memoized
transition table between sets (a DFA built lazily, one hash lookup per byte once warm),
UTF-8 decoding byte by byte, and the vocabulary-trie walk that fills a token mask.

A parse state is a set of stacks. A stack is a node (element position, repeat count,
parent node); node 0 is the empty stack, reached when the whole value is complete. Nodes
are interned, so equal stacks are one id; a node's closure (the stacks whose top is a
character class, reached through rule calls, repeats and rule ends) is computed once. Sets
of stacks are interned too, and (set, code point) -> set is kept in a hash table, so a
state seen before (the inside of a string, say) costs one lookup per byte.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .jit import njit

# Element kinds. CLS matches a character class lo..hi times (hi < 0: unbounded); REF calls a
# rule once; REP calls a rule lo..hi times; END closes an alternative.
CLS, REF, REP, END = 0, 1, 2, 3
ACCEPT = 0   # node id of the empty stack
DEAD = -2    # the empty set of stacks: no continuation

# Store.meta slots, and what meta[M_FULL] says ran out of room
M_NODES, M_CLO, M_SEEN, M_MARK, M_FULL, M_SETS, M_SETBUF, M_TRANS = range(8)
FULL_NODES, FULL_CLOSURES, FULL_SETS, FULL_SETBUF, FULL_TRANS, FULL_TMP = range(1, 7)

# Levels columns: the set, and a started UTF-8 sequence (bits so far, bytes still
# expected, its length)
L_SET, L_CP, L_NEED, L_LEN = range(4)
_MIN_CP = (0, 0, 0x80, 0x800, 0x10000)  # smallest code point of a sequence of each length


class Tables(NamedTuple):
    """A compiled grammar. Element e: elem[e] = (kind, class or rule id, lo, hi)."""
    elem: np.ndarray      # int32 (E, 4)
    alt_off: np.ndarray   # int32 (R + 1,): rule r's alternatives are alt_pos[alt_off[r]:alt_off[r+1]]
    alt_pos: np.ndarray   # int32 (A,): first element of each alternative
    cls_off: np.ndarray   # int32 (C + 1,): class c's ranges are cls_rng[cls_off[c]:cls_off[c+1]]
    cls_rng: np.ndarray   # int32 (K, 2): sorted, disjoint code point ranges (lo, hi)
    ascii: np.ndarray     # uint8 (C, 128): membership of code points below 128


class Store(NamedTuple):
    """Interned stacks, closures, sets and transitions; grows by copying (ids are kept)."""
    node: np.ndarray      # int32 (cap, 7): pos, cnt, par, closure offset, closure size, 2 marks
    slots: np.ndarray     # int32 (2 cap,): hash of nodes, -1 empty
    clo: np.ndarray       # int32: closures back to back
    set_off: np.ndarray   # int32 (scap + 1,): set i is set_buf[set_off[i]:set_off[i+1]], sorted
    set_buf: np.ndarray   # int32
    set_slots: np.ndarray  # int32 (2 scap,): hash of sets, -1 empty
    tkey: np.ndarray      # int64 (tcap,): transition keys, -1 empty
    tval: np.ndarray      # int32 (tcap,): the set a transition leads to, or DEAD
    tmp: np.ndarray       # int32: a set being built
    meta: np.ndarray      # int64 (8,): M_* counters


class Trie(NamedTuple):
    """A vocabulary trie in preorder: node i's subtree is [i, end[i]); node 0 is the root."""
    byte: np.ndarray      # uint8 (N,)
    depth: np.ndarray     # int32 (N,)
    end: np.ndarray       # int32 (N,)
    tok_off: np.ndarray   # int32 (N + 1,): tokens whose bytes end at node i
    tok: np.ndarray       # int32


def new_store(cap: int = 1 << 12, clo_cap: int = 1 << 14, set_cap: int = 1 << 10,
              setbuf_cap: int = 1 << 13, trans_cap: int = 1 << 14, tmp_cap: int = 1 << 10) -> Store:
    """Returns: an empty Store (node 0, the empty stack, made)."""
    node = np.zeros((cap, 7), np.int32)
    node[:, 3] = -1
    node[0, 0] = -1
    st = Store(node, np.full(2 * cap, -1, np.int32), np.zeros(clo_cap, np.int32),
               np.zeros(set_cap + 1, np.int32), np.zeros(setbuf_cap, np.int32),
               np.full(2 * set_cap, -1, np.int32), np.full(trans_cap, -1, np.int64),
               np.zeros(trans_cap, np.int32), np.zeros(tmp_cap, np.int32), np.zeros(8, np.int64))
    st.meta[M_NODES] = 1
    return st


def grow_store(st: Store) -> Store:
    """Returns: a copy of ``st`` with twice the room for what ran out (ids are kept)."""
    full = int(st.meta[M_FULL])
    two = lambda f: 2 if full == f else 1  # noqa: E731
    new = new_store(st.node.shape[0] * two(FULL_NODES), st.clo.size * two(FULL_CLOSURES),
                    (st.set_off.size - 1) * two(FULL_SETS), st.set_buf.size * two(FULL_SETBUF),
                    st.tkey.size * two(FULL_TRANS), st.tmp.size * two(FULL_TMP))
    n, ns = int(st.meta[M_NODES]), int(st.meta[M_SETS])
    new.node[:n] = st.node[:n]
    new.clo[:st.clo.size] = st.clo
    new.set_off[:ns + 1] = st.set_off[:ns + 1]
    new.set_buf[:st.set_buf.size] = st.set_buf
    new.meta[:] = st.meta
    new.meta[M_FULL] = 0
    _rehash(new.node, new.slots, n, new.set_off, new.set_buf, new.set_slots, ns,
            st.tkey, st.tval, new.tkey, new.tval)
    return new


def new_levels(depth: int) -> np.ndarray:
    """Returns: walk scratch, int32 (depth + 1, 4), for byte strings up to ``depth`` bytes."""
    return np.zeros((depth + 1, 4), np.int32)


# The walk's helpers take arrays, not the NamedTuples: taking an array out of a tuple costs
# reference counting each time, which would dominate the per-byte cost.

@njit(cache=True, inline="always")
def _mix(key, mask):
    x = np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)
    return np.int64(x >> np.uint64(29)) & mask


@njit(cache=True, inline="always")
def _node_hash(pos, cnt, par, mask):
    return _mix((np.int64(pos) << 40) ^ (np.int64(cnt) << 20) ^ np.int64(par) ^ (np.int64(par) << 44), mask)


@njit(cache=True, inline="always")
def _set_hash(buf, a, b, mask):
    h = np.int64(b - a)
    for i in range(a, b):
        h = h * 1000003 + buf[i]
    return _mix(h, mask)


@njit(cache=True)
def _rehash(node, slots, n, set_off, set_buf, set_slots, ns, old_key, old_val, tkey, tval):
    mask = slots.size - 1
    for i in range(1, n):
        h = _node_hash(node[i, 0], node[i, 1], node[i, 2], mask)
        while slots[h] >= 0:
            h = (h + 1) & mask
        slots[h] = i
    mask = set_slots.size - 1
    for i in range(ns):
        h = _set_hash(set_buf, set_off[i], set_off[i + 1], mask)
        while set_slots[h] >= 0:
            h = (h + 1) & mask
        set_slots[h] = i
    mask = tkey.size - 1
    for i in range(old_key.size):
        if old_key[i] >= 0:
            h = _mix(old_key[i], mask)
            while tkey[h] >= 0:
                h = (h + 1) & mask
            tkey[h] = old_key[i]
            tval[h] = old_val[i]


@njit(cache=True, inline="always")
def _intern(node, slots, meta, pos, cnt, par):
    """Returns: the id of node (pos, cnt, par), made if new; -1 when the store is full."""
    mask = slots.size - 1
    h = _node_hash(pos, cnt, par, mask)
    while True:
        s = slots[h]
        if s < 0:
            n = meta[M_NODES]
            if 2 * (n + 1) > slots.size or n >= node.shape[0]:
                meta[M_FULL] = FULL_NODES
                return -1
            node[n, 0] = pos
            node[n, 1] = cnt
            node[n, 2] = par
            node[n, 3] = -1
            slots[h] = n
            meta[M_NODES] = n + 1
            return n
        if node[s, 0] == pos and node[s, 1] == cnt and node[s, 2] == par:
            return s
        h = (h + 1) & mask


@njit(cache=True, inline="always")
def _after(elem, node, slots, meta, pos, par):
    """Returns: the stack continuing at element ``pos`` above ``par`` (``par`` itself at an END)."""
    if elem[pos, 0] == END:
        return par
    return _intern(node, slots, meta, pos, 0, par)


@njit(cache=True, inline="always")
def _contains(cls_off, rng, asc, c, cp):
    if cp < 128:
        return asc[c, cp] != 0
    a, b = cls_off[c], cls_off[c + 1]
    while a < b:  # first range starting above cp
        m = (a + b) >> 1
        if rng[m, 0] <= cp:
            a = m + 1
        else:
            b = m
    return a > cls_off[c] and rng[a - 1, 1] >= cp


@njit(cache=True, inline="always")
def _intersects(cls_off, rng, c, lo, hi):
    a, b = cls_off[c], cls_off[c + 1]
    while a < b:  # first range ending at or above lo
        m = (a + b) >> 1
        if rng[m, 1] < lo:
            a = m + 1
        else:
            b = m
    return a < cls_off[c + 1] and rng[a, 0] <= hi


@njit(cache=True)
def _closure(elem, alt_off, alt_pos, node, slots, clo, meta, n):
    """Memoizes the closure of node n. Returns: its offset in clo, or -1 when full."""
    if node[n, 3] >= 0:
        return node[n, 3]
    meta[M_SEEN] += 1
    ep = meta[M_SEEN]
    work = np.empty(64, np.int32)
    out = np.empty(64, np.int32)
    nw, no = 1, 0
    work[0] = n
    while nw > 0:
        nw -= 1
        m = work[nw]
        if node[m, 5] == ep:
            continue
        node[m, 5] = ep
        if no + 1 > out.size:
            out = np.concatenate((out, np.empty(out.size, np.int32)))
        if m == ACCEPT:
            out[no] = m
            no += 1
            continue
        pos, c, par = node[m, 0], node[m, 1], node[m, 2]
        k, r, lo, hi = elem[pos, 0], elem[pos, 1], elem[pos, 2], elem[pos, 3]
        if k == CLS:
            if hi < 0 or c < hi:
                out[no] = m
                no += 1
            if c >= lo:
                x = _after(elem, node, slots, meta, pos + 1, par)
                if x < 0:
                    return -1
                work[nw] = x
                nw += 1
        elif k == END:
            work[nw] = par
            nw += 1
        else:
            while nw + 2 + alt_off[r + 1] - alt_off[r] > work.size:
                work = np.concatenate((work, np.empty(work.size, np.int32)))
            if k == REF or hi < 0 or c < hi:
                if k == REF:
                    cont = _after(elem, node, slots, meta, pos + 1, par)
                else:
                    nc = c + 1
                    if hi < 0 and nc > lo:
                        nc = lo  # past the minimum, counts of an unbounded repeat are alike
                    cont = _intern(node, slots, meta, pos, nc, par)
                if cont < 0:
                    return -1
                for a in range(alt_off[r + 1] - 1, alt_off[r] - 1, -1):
                    x = _after(elem, node, slots, meta, alt_pos[a], cont)
                    if x < 0:
                        return -1
                    work[nw] = x
                    nw += 1
            if k == REP and c >= lo:
                x = _after(elem, node, slots, meta, pos + 1, par)
                if x < 0:
                    return -1
                work[nw] = x
                nw += 1
    at = meta[M_CLO]
    if at + no > clo.size:
        meta[M_FULL] = FULL_CLOSURES
        return -1
    clo[at:at + no] = out[:no]
    meta[M_CLO] = at + no
    node[n, 3] = at
    node[n, 4] = no
    return at


@njit(cache=True)
def _intern_set(set_off, set_buf, set_slots, meta, tmp, k):
    """Returns: the id of the set tmp[:k] (sorted here), made if new; -1 when full."""
    if k > 16:
        tmp[:k] = np.sort(tmp[:k])
    else:
        for i in range(1, k):
            v = tmp[i]
            j = i - 1
            while j >= 0 and tmp[j] > v:
                tmp[j + 1] = tmp[j]
                j -= 1
            tmp[j + 1] = v
    mask = set_slots.size - 1
    h = _set_hash(tmp, 0, k, mask)
    while True:
        s = set_slots[h]
        if s < 0:
            n = meta[M_SETS]
            if 2 * (n + 1) > set_slots.size or n + 1 >= set_off.size:
                meta[M_FULL] = FULL_SETS
                return -1
            at = set_off[n]
            if at + k > set_buf.size:
                meta[M_FULL] = FULL_SETBUF
                return -1
            set_buf[at:at + k] = tmp[:k]
            set_off[n + 1] = at + k
            set_slots[h] = n
            meta[M_SETS] = n + 1
            meta[M_SETBUF] = at + k
            return n
        a, b = set_off[s], set_off[s + 1]
        if b - a == k:
            same = True
            for i in range(k):
                if set_buf[a + i] != tmp[i]:
                    same = False
                    break
            if same:
                return s
        h = (h + 1) & mask


@njit(cache=True, inline="always")
def _advance(elem, alt_off, alt_pos, cls_off, rng, asc, node, slots, clo, set_off, set_buf,
             set_slots, tmp, meta, s, cp):
    """Returns: the set after code point cp from set s, DEAD, or -1 when full."""
    meta[M_MARK] += 1
    ep = meta[M_MARK]
    k = 0
    for j in range(set_off[s], set_off[s + 1]):
        m = set_buf[j]
        if m == ACCEPT:
            continue
        pos, c = node[m, 0], node[m, 1]
        if not _contains(cls_off, rng, asc, elem[pos, 1], cp):
            continue
        lo, hi = elem[pos, 2], elem[pos, 3]
        nc = c + 1
        if hi < 0 and nc > lo:
            nc = lo
        if nc == hi:
            x = _after(elem, node, slots, meta, pos + 1, node[m, 2])
        elif nc == c:
            x = m
        else:
            x = _intern(node, slots, meta, pos, nc, node[m, 2])
        if x < 0:
            return -1
        off = node[x, 3]
        if off < 0:
            off = _closure(elem, alt_off, alt_pos, node, slots, clo, meta, x)
            if off < 0:
                return -1
        for i in range(off, off + node[x, 4]):
            y = clo[i]
            if node[y, 6] != ep:
                node[y, 6] = ep
                if k >= tmp.size:
                    meta[M_FULL] = FULL_TMP
                    return -1
                tmp[k] = y
                k += 1
    if k == 0:
        return DEAD
    return _intern_set(set_off, set_buf, set_slots, meta, tmp, k)


@njit(cache=True, inline="always")
def _viable(elem, cls_off, rng, node, set_off, set_buf, s, lo, hi):
    """Returns: set s, or DEAD when no stack of it takes a code point in [lo, hi]."""
    for j in range(set_off[s], set_off[s + 1]):
        m = set_buf[j]
        if m != ACCEPT and _intersects(cls_off, rng, elem[node[m, 0], 1], lo, hi):
            return s
    return DEAD


MISS = -3  # a transition not yet in the table
PARTIAL = 1 << 21  # key bit of a started (incomplete) character


@njit(cache=True, inline="always")
def _key(lvl, d, b):
    """Decodes byte b after level d - 1 and fills level d's UTF-8 columns.

    Returns: the transition key (set, code point or started sequence), or -1 for a byte
    that cannot come next in UTF-8.
    """
    p = d - 1
    s, cp, need, ln = lvl[p, L_SET], lvl[p, L_CP], lvl[p, L_NEED], lvl[p, L_LEN]
    if need == 0:
        if b < 0x80:
            cp, need, ln = b, 0, 1
        elif 0xC2 <= b <= 0xDF:
            cp, need, ln = b & 0x1F, 1, 2
        elif 0xE0 <= b <= 0xEF:
            cp, need, ln = b & 0x0F, 2, 3
        elif 0xF0 <= b <= 0xF4:
            cp, need, ln = b & 0x07, 3, 4
        else:
            return -1
    else:
        if b & 0xC0 != 0x80:
            return -1
        cp, need = (cp << 6) | (b & 0x3F), need - 1
    if need > 0:
        lvl[d, L_CP], lvl[d, L_NEED], lvl[d, L_LEN] = cp, need, ln
        return (np.int64(s) << 22) | PARTIAL | (np.int64(cp) << 5) | (ln << 2) | need
    if cp < _MIN_CP[ln] or cp > 0x10FFFF:
        return -1
    lvl[d, L_CP], lvl[d, L_NEED], lvl[d, L_LEN] = 0, 0, 0
    return (np.int64(s) << 22) | cp


@njit(cache=True, inline="always")
def _lookup(tkey, tval, key):
    """Returns: the set transition ``key`` leads to, DEAD, or MISS."""
    mask = tkey.size - 1
    h = _mix(key, mask)
    while True:
        k = tkey[h]
        if k == key:
            return tval[h]
        if k < 0:
            return MISS
        h = (h + 1) & mask


@njit(cache=True)
def _resolve(g, st, key):
    """Computes transition ``key`` and records it. Returns: its set, DEAD, or -1 when full."""
    elem, alt_off, alt_pos, cls_off, rng, asc = g
    node, slots, clo, set_off, set_buf, set_slots, tkey, tval, tmp, meta = st
    s = np.int32(key >> 22)
    if key & PARTIAL:
        # A started character lives while some stack takes a code point it may become.
        cp, ln, need = (key >> 5) & 0xFFFF, (key >> 2) & 7, key & 3
        lo = max(cp << (6 * need), _MIN_CP[ln])
        hi = min(((cp + 1) << (6 * need)) - 1, 0x10FFFF)
        v = DEAD if lo > hi else _viable(elem, cls_off, rng, node, set_off, set_buf, s, lo, hi)
    else:
        v = _advance(elem, alt_off, alt_pos, cls_off, rng, asc, node, slots, clo, set_off,
                     set_buf, set_slots, tmp, meta, s, key & 0x1FFFFF)
        if v == -1:
            return -1
    n = meta[M_TRANS]
    if 2 * (n + 1) > tkey.size:
        meta[M_FULL] = FULL_TRANS
        return -1
    mask = tkey.size - 1
    h = _mix(key, mask)
    while tkey[h] >= 0:
        h = (h + 1) & mask
    tkey[h] = key
    tval[h] = v
    meta[M_TRANS] = n + 1
    return v


# walk_bytes and fill_mask each write the byte step out: a shared inline helper taking the
# grammar and store tuples made the whole mask 15 times slower (reference counting again).

@njit(cache=True)
def walk_bytes(g, st, lvl, data):
    """Runs level 0 (set by the caller) through the bytes ``data``.

    Returns: 1 if the state after all of them is alive (it is then level len(data)), 0 if
    dead, -1 when something is full (grow and retry).
    """
    tkey, tval = st.tkey, st.tval
    for d in range(1, data.size + 1):
        key = _key(lvl, d, data[d - 1])
        if key < 0:
            return 0
        v = _lookup(tkey, tval, key)
        if v == MISS:
            v = _resolve(g, st, key)
            if v == -1:
                return -1
        if v == DEAD:
            return 0
        lvl[d, L_SET] = v
    return 1


@njit(cache=True)
def fill_mask(g, st, lvl, tr, out):
    """Sets out[t] for every token t of the trie whose bytes keep level 0's state alive.

    Returns: 0, or -1 when something is full (grow and retry).
    """
    tkey, tval = st.tkey, st.tval
    byte, depth, end, tok_off, tok = tr.byte, tr.depth, tr.end, tr.tok_off, tr.tok
    i = 1
    n = byte.size
    while i < n:
        d = depth[i]
        key = _key(lvl, d, byte[i])
        v = DEAD
        if key >= 0:
            v = _lookup(tkey, tval, key)
            if v == MISS:
                v = _resolve(g, st, key)
                if v == -1:
                    return -1
        if v == DEAD:
            i = end[i]  # no token below this prefix can be valid
            continue
        lvl[d, L_SET] = v
        for k in range(tok_off[i], tok_off[i + 1]):
            out[tok[k]] = True
        i += 1
    return 0


@njit(cache=True)
def start(g, st):
    """Returns: the id of the grammar's initial set, or -1 when full."""
    elem, alt_off, alt_pos = g.elem, g.alt_off, g.alt_pos
    node, slots, clo, meta, tmp = st.node, st.slots, st.clo, st.meta, st.tmp
    x = _intern(node, slots, meta, 0, 0, ACCEPT)
    if x < 0:
        return -1
    off = _closure(elem, alt_off, alt_pos, node, slots, clo, meta, x)
    if off < 0:
        return -1
    n = node[x, 4]
    if n > tmp.size:
        meta[M_FULL] = FULL_TMP
        return -1
    tmp[:n] = clo[off:off + n]
    return _intern_set(st.set_off, st.set_buf, st.set_slots, meta, tmp, n)


@njit(cache=True)
def build_trie(flat, off, order):
    """Builds the preorder trie of byte strings flat[off[t]:off[t+1]] taken in ``order``
    (sorted bytewise, empty strings excluded).

    Returns: (byte, depth, end, node of each string in order).
    """
    total = 1
    for t in order:
        total += off[t + 1] - off[t]
    byte = np.zeros(total, np.uint8)
    depth = np.zeros(total, np.int32)
    end = np.zeros(total, np.int32)
    tok_node = np.zeros(order.size, np.int32)
    path = np.zeros(1 + int(np.max(off[1:] - off[:-1])), np.int32)  # node at each depth
    n = 1
    plen = 0
    prev = -1
    for k in range(order.size):
        t = order[k]
        a, b = off[t], off[t + 1]
        lcp = 0
        if prev >= 0:
            pa, pb = off[prev], off[prev + 1]
            while lcp < b - a and lcp < pb - pa and flat[a + lcp] == flat[pa + lcp]:
                lcp += 1
        for d in range(plen, lcp, -1):  # close nodes not shared with this string
            end[path[d]] = n
        for d in range(lcp + 1, b - a + 1):
            byte[n] = flat[a + d - 1]
            depth[n] = d
            path[d] = n
            n += 1
        plen = b - a
        tok_node[k] = path[plen]
        prev = t
    for d in range(plen, 0, -1):
        end[path[d]] = n
    end[0] = n
    return byte[:n], depth[:n], end[:n], tok_node
