"""The KV block bookkeeping on its own: exact block ids, reference counts, the free queue's
order (LRU eviction of cached blocks), prefix hashes, copy-on-write, trimming, sliding
windows and their checkpoints."""

import pytest

from localllm.runtime.kv.blocks import BlockPool, PoolExhausted, chain_hashes, group_hash
from localllm.runtime.kv.cache import CacheGroup, PagedCache

BS = 16


def make_cache(n_blocks=8, windows=(0,), max_cached=-1):
    copies = []
    groups = [CacheGroup(i, [i], w, BlockPool(n_blocks, BS), bytes([i]), max_cached if w else -1)
              for i, w in enumerate(windows)]
    cache = PagedCache(groups, BS, lambda g, s, d: copies.append((g, s, d)))
    return cache, copies


def write(cache, st, tokens, n):
    """What a forward pass does for tokens[st.n:n]: reserve, then advance."""
    cache.reserve(st, n - st.n)
    cache.advance(st, tokens, n)


# ----------------------------------------------------------------------------- pool

def test_allocation_order_ref_counts_and_free_queue():
    pool = BlockPool(4, BS)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.free_order() == [3]
    pool.incref(1)
    assert pool.ref_cnt == [1, 2, 1, 0]
    pool.free(1)
    assert pool.ref_cnt[1] == 1 and pool.free_order() == [3]
    pool.free(0)                 # no hash: to the front, taken next
    assert pool.free_order() == [0, 3]
    pool.commit(2, b"h2")
    pool.free(2)                 # hashed: to the back, kept longest
    assert pool.free_order() == [0, 3, 2]
    assert pool.stats().cached == 1 and pool.lookup(b"h2") == 2
    assert pool.allocate() == 0 and pool.allocate() == 3
    assert pool.allocate() == 2  # the cached block is evicted last
    assert pool.lookup(b"h2") is None and pool.block_hash[2] is None
    with pytest.raises(PoolExhausted):
        pool.allocate()
    with pytest.raises(ValueError):
        BlockPool(2, BS).free(0)


def test_lru_eviction_order_and_cache_hits():
    pool = BlockPool(3, BS)
    ids = [pool.allocate() for _ in range(3)]
    for b, h in zip(ids, (b"a", b"b", b"c")):
        pool.commit(b, h)
    for b in (1, 0, 2):          # freed in this order: LRU order 1, 0, 2
        pool.free(b)
    assert pool.free_order() == [1, 0, 2]
    pool.incref(pool.lookup(b"a"))  # a hit takes block 0 out of the queue
    assert pool.free_order() == [1, 2] and pool.ref_cnt[0] == 1
    pool.free(0)                 # and back at the end: now the most recent
    assert pool.free_order() == [1, 2, 0]
    assert pool.allocate() == 1 and pool.lookup(b"b") is None
    pool.evict_cached(keep=1)    # the oldest cached blocks forgotten, to the front
    assert pool.free_order() == [2, 0] and pool.lookup(b"c") is None
    assert pool.lookup(b"a") == 0 and pool.stats().cached == 1


def test_commit_keeps_the_first_block_of_a_hash():
    pool = BlockPool(2, BS)
    a, b = pool.allocate(), pool.allocate()
    pool.commit(a, b"x")
    pool.commit(b, b"x")
    assert pool.lookup(b"x") == a and pool.block_hash[b] is None
    pool.uncommit(a)
    assert pool.lookup(b"x") is None


def test_chain_hashes_cover_every_earlier_token():
    t = list(range(50))
    h = chain_hashes(t, BS)
    assert len(h) == 3
    assert chain_hashes(t[:40], BS) == h[:2]
    u = [999] + t[1:]
    assert all(x != y for x, y in zip(chain_hashes(u, BS), h))  # block 0 changes all
    assert chain_hashes(t, BS, start=2, parents=h[:2]) == h
    assert group_hash(h[0], b"g0") != group_hash(h[0], b"g1")


# ----------------------------------------------------------------------------- tables

def test_reserve_allocates_on_demand_and_hashes_full_blocks():
    cache, _ = make_cache()
    st = cache.new_state()
    toks = list(range(40))
    write(cache, st, toks, 20)
    assert st.tables == [[0, 1]] and st.n == 20
    pool = cache.groups[0].pool
    assert pool.block_hash[0] is not None and pool.block_hash[1] is None
    write(cache, st, toks, 40)
    assert st.tables == [[0, 1, 2]] and pool.block_hash[1] is not None
    cache.release(st, toks)
    assert pool.stats().used == 0 and pool.stats().cached == 3  # the partial one too


def test_prefix_match_reuses_blocks_and_partial_tail():
    cache, _ = make_cache()
    toks = list(range(40))
    st = cache.new_state()
    write(cache, st, toks, 40)
    cache.release(st, toks)
    n, st2 = cache.match_prefix(toks + [7, 8], limit=41)
    assert n == 40 and st2.tables == [[0, 1, 2]]  # blocks 0, 1 by hash; 2 as a partial tail
    assert cache.groups[0].pool.ref_cnt[:3] == [1, 1, 1]
    # diverging inside the second block: only the first block is reusable
    cache.release(st2)
    n, st3 = cache.match_prefix(toks[:20] + [500] * 30, limit=49)
    assert n == 16 and st3.tables == [[0]]
    # limit: the last token must run
    cache.release(st3)
    n, _ = cache.match_prefix(toks[:32], limit=31)
    assert n == 16


def test_fork_shares_blocks_and_copies_on_write():
    cache, copies = make_cache()
    toks = list(range(40))
    a = cache.new_state()
    write(cache, a, toks, 24)                 # blocks 0 (full), 1 (8 tokens)
    b = cache.fork(a)
    pool = cache.groups[0].pool
    assert b.tables == a.tables and pool.ref_cnt[:2] == [2, 2]
    write(cache, b, toks[:24] + [1] * 16, 26)  # b writes into the shared partial block
    assert copies == [(0, 1, 2)] and b.tables == [[0, 2]] and pool.ref_cnt[:3] == [2, 1, 1]
    write(cache, a, toks, 26)                  # a now owns block 1 alone: written in place
    assert copies == [(0, 1, 2)] and a.tables == [[0, 1]]
    cache.trim(a, 10)                          # rollback: block 1 goes, block 0 stays
    assert a.tables == [[0]] and a.n == 10 and pool.ref_cnt[:3] == [2, 0, 1]
    write(cache, a, toks, 16)                  # block 0 is shared with b: copied first
    assert copies[-1] == (0, 0, 1) and a.tables == [[1]]


def test_trimming_into_a_full_block_drops_its_hash_on_write():
    cache, _ = make_cache()
    toks = list(range(32))
    st = cache.new_state()
    write(cache, st, toks, 32)
    pool = cache.groups[0].pool
    h1 = pool.block_hash[1]
    cache.trim(st, 20)
    assert pool.block_hash[1] == h1            # still valid until written
    write(cache, st, toks[:20] + [9] * 12, 21)
    assert pool.block_hash[1] is None and pool.lookup(h1) is None


def test_pool_exhaustion_is_an_error():
    cache, _ = make_cache(n_blocks=2)
    st = cache.new_state()
    with pytest.raises(PoolExhausted):
        cache.reserve(st, 40)


# ----------------------------------------------------------------------------- sliding windows

def test_sliding_group_releases_blocks_outside_the_window():
    cache, _ = make_cache(n_blocks=32, windows=(0, 32))
    toks = list(range(200))
    st = cache.new_state()
    write(cache, st, toks, 100)
    glob, slide = st.tables
    assert len(glob) == 7 and all(b >= 0 for b in glob)
    # window 32 at position 100 reads 69..100; one block of slack: 53.. -> blocks 3..6
    assert [b >= 0 for b in slide] == [False] * 3 + [True] * 4
    assert cache.groups[1].pool.stats().used == 4
    assert cache.groups[1].pool.stats().cached == 0  # released at once, not cached
    assert cache.resumable(st, 100) and cache.resumable(st, 90)
    assert not cache.resumable(st, 60)


def test_checkpoint_restores_a_window_that_moved_on():
    cache, _ = make_cache(n_blocks=32, windows=(0, 32))
    toks = list(range(300))
    st = cache.new_state()
    write(cache, st, toks, 70)
    cache.checkpoint(st)                       # a turn boundary at 70
    write(cache, st, toks, 200)
    assert not cache.resumable(st, 70)
    assert cache.restore(st, 70) and st.n == 70 and cache.resumable(st, 70)
    write(cache, st, toks, 71)                 # goes on from the checkpoint
    assert st.n == 71


def test_prefix_match_on_a_sliding_group_needs_only_the_window():
    cache, _ = make_cache(n_blocks=32, windows=(0, 32), max_cached=100)
    toks = list(range(300))
    st = cache.new_state()
    write(cache, st, toks, 160)
    cache.release(st, toks)                    # its last window stays cached
    n, st2 = cache.match_prefix(toks + [1], limit=200)
    assert n == 160
    assert cache.resumable(st2, 160)
    assert sum(b >= 0 for b in st2.tables[1]) <= 4


def test_sliding_cache_is_bounded():
    cache, _ = make_cache(n_blocks=64, windows=(0, 32), max_cached=5)
    for start in range(4):
        toks = [start * 1000 + i for i in range(150)]
        st = cache.new_state()
        write(cache, st, toks, 150)
        cache.checkpoint(st)
        cache.release(st, toks)
    assert cache.groups[1].pool.stats().cached <= 5
    assert cache.groups[0].pool.stats().cached == 4 * 10  # global blocks all kept
