"""KV cache manager: allocate_slots / free / swap and the block-table rows it owns."""

from __future__ import annotations

from scheduler import Request, SamplingParams, SchedulerConfig
from scheduler.kv_cache_manager import KVCacheManager


def mgr(**kw) -> KVCacheManager:
    base = dict(block_size=4, num_blocks=9, max_model_len=32, max_num_seqs=2, num_host_blocks=4)
    base.update(kw)
    return KVCacheManager(SchedulerConfig(**base))


def req(rid: str, n: int, start: int = 1) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams())


def test_allocate_grows_by_blocks_and_returns_none_when_full():
    m = mgr()
    a = req("a", 10)
    ids = m.allocate_slots(a, 10)
    assert len(ids) == 3 and 0 not in ids
    a.num_computed_tokens = 10
    assert m.allocate_slots(a, 2) == []  # fits in the third block
    assert len(m.allocate_slots(a, 3)) == 1
    row = m.block_table_row("a")
    assert row.tolist()[:4] == m.get_block_ids("a") and not row[4:].any()
    b = req("b", 20)
    assert m.allocate_slots(b, 20) is None  # 5 blocks needed, 4 free: nothing changes
    assert m.pool.num_free_blocks == 4 and m.get_block_ids("b") == []
    assert m.num_tokens_that_fit(b) == 16
    m.free(a)
    assert m.pool.num_free_blocks == 8
    assert len(m.allocate_slots(b, 20)) == 5


def test_allocate_refuses_past_the_row_width():
    m = mgr(num_blocks=40, max_model_len=8)
    assert m.allocate_slots(req("a", 9), 9) is None


def test_table_rows_are_reused_and_zeroed():
    m = mgr(max_num_seqs=1)
    a, b, c = req("a", 8), req("b", 4), req("c", 4)
    m.allocate_slots(a, 8)
    m.allocate_slots(b, 4)  # grows the table beyond max_num_seqs rows
    assert m.tables.shape[0] >= 2
    m.free(a)
    m.allocate_slots(c, 4)
    row = m.block_table_row("c")
    assert row[0] != 0 and not row[1:].any()
    assert m.gather_block_tables([]).shape == (0, m.width)


def test_prefix_hits_are_touched_on_allocation():
    m = mgr()
    a = req("a", 9)
    m.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    m.cache_computed_blocks(a)
    assert len(m.pool.cached) == 2
    m.free(a)
    assert m.pool.num_cached_free == 2
    b = req("b", 9)
    hits = m.get_computed_blocks(b)
    n = hits.num_tokens
    assert n == 8 and len(hits) == 2
    ids = m.allocate_slots(b, 1, hits)
    assert len(ids) == 1 and m.get_block_ids("b")[:2] == m.get_block_ids("a")[:0] + [
        blk.block_id for blk in m.pool.blocks if blk.block_hash is not None][:2]
    u = m.usage()
    assert u.num_cached_free == 0 and u.num_used == 3 and u.num_used + u.num_free == u.num_total


def test_reset_prefix_cache_unhashes_held_blocks():
    m = mgr()
    a = req("a", 9)
    m.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    m.cache_computed_blocks(a)
    assert m.reset_prefix_cache() == 2
    assert not m.pool.cached and m.get_computed_blocks(req("b", 9)).num_tokens == 0
    # Blocks computed under the old allocation are never registered afterwards either.
    m.allocate_slots(a, 8)
    a.num_computed_tokens = 17
    m.cache_computed_blocks(a)
    assert not m.pool.cached
    m.free(a)
    u = m.usage()
    assert u.num_used == 0 and u.num_cached_free == 0


def test_swap_out_and_in_round_trip():
    m = mgr()
    a = req("a", 10)
    m.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    dev = m.get_block_ids("a")
    out = m.swap_out(a)
    assert [d for d, _ in out] == dev and m.pool.num_free_blocks == 8
    host = m.get_host_block_ids("a")
    assert [h for _, h in out] == host and m.host_pool.num_free_blocks == 1
    res = m.swap_in(a, 1)
    assert res is not None
    mapping, new_ids = res
    assert [h for h, _ in mapping] == host and [d for _, d in mapping] == new_ids[:3]
    assert len(new_ids) == 3  # 11 tokens still fit in 3 blocks
    assert m.host_pool.num_free_blocks == 4 and m.get_host_block_ids("a") == []
    # No host room: swap_out refuses and leaves the device blocks alone.
    b = req("b", 20, start=50)
    m.free(a)
    m.allocate_slots(b, 20)
    b.num_computed_tokens = 20
    assert m.swap_out(b) is None and len(m.get_block_ids("b")) == 5
