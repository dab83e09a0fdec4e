"""Block pool: null block, ref counts, LRU free queue, eviction of cached blocks."""

from __future__ import annotations

import pytest

from scheduler.block_pool import BlockPool, FreeBlockQueue, HostBlockPool, KVBlock


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == pool.num_free_blocks == 4
    got = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in got) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 4
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        BlockPool(1)


def test_free_queue_o1_remove_and_order():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    q.appendleft(blocks[2])
    assert q.popleft() is blocks[2]
    with pytest.raises(ValueError):
        q.remove(blocks[2])


def test_ref_counts_and_double_free():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 3
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([b])


def test_cached_free_blocks_are_lru_and_uncached_reused_first():
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    assert pool.cache_block(a, b"A") and pool.cache_block(b, b"B")
    assert not pool.cache_block(c, b"A")  # duplicate hash: not registered
    pool.free_blocks([b])  # freed first -> evicted first
    pool.free_blocks([a])
    pool.free_blocks([c])  # uncached -> reused before any cached block
    assert pool.num_cached_free == 2 and pool.num_free_blocks == 5
    order = [blk.block_id for blk in pool.free_queue]
    assert order[0] == c.block_id  # at the head
    assert order[-2:] == [b.block_id, a.block_id]
    # A hit revives a cached free block without evicting it.
    assert pool.get_cached_block(b"A") is a
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_cached_free == 1
    got = pool.get_new_blocks(4)  # c, 4, 5, then b (evicted)
    assert got[-1] is b and b.block_hash is None and pool.get_cached_block(b"B") is None
    assert pool.num_cached_free == 0


def test_reset_prefix_cache_unhashes_live_blocks_too():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"A")
    pool.cache_block(b, b"B")
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() == 2
    assert pool.get_cached_block(b"A") is None and pool.get_cached_block(b"B") is None
    assert b.ref_cnt == 1 and b.block_hash is None and pool.num_cached_free == 0
    pool.free_blocks([b])  # an unhashed block goes to the head: reused first
    assert next(iter(pool.free_queue)) is b and pool.num_cached_free == 0


def test_host_pool():
    h = HostBlockPool(3)
    ids = h.allocate(2)
    assert ids is not None and len(set(ids)) == 2 and h.num_free_blocks == 1
    assert h.allocate(2) is None
    h.free(ids)
    with pytest.raises(AssertionError):
        h.free(ids[:1])
