"""Prefix caching: chained SHA-256 hashes, floors, salts, overlaps and eviction order."""

from __future__ import annotations

import hashlib

from fakes import FakeModelRunner, reference_generate, run_all

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.prefix_cache import ROOT_HASH, extend_block_hashes, hash_block

BS = 4


def test_hash_is_chained_sha256():
    h0 = hash_block(None, [1, 2, 3, 4])
    assert len(h0) == 32 and h0 == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert (
        h0
        == hashlib.sha256(
            ROOT_HASH + b"".join(t.to_bytes(8, "little") for t in [1, 2, 3, 4])
        ).digest()
    )
    assert hash_block(h0, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4], ("salt", "a")) != h0
    assert hash_block(None, [1, 2, 3, 4], ("salt", "a")) != hash_block(
        None, [1, 2, 3, 4], ("salt", "b")
    )


def test_incremental_hashing_only_full_blocks():
    hs: list[bytes] = []
    extend_block_hashes(hs, [1, 2, 3, 4, 5, 6], BS)
    assert len(hs) == 1
    first = hs[0]
    extend_block_hashes(hs, [1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    assert len(hs) == 2 and hs[0] is first
    assert hs[1] == hash_block(first, [5, 6, 7, 8])
    salted = extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7, 8], BS, cache_salt="t")
    assert salted[0] != hs[0] and salted[1] != hs[1]  # the chain carries the salt


def cfg(**kw) -> SchedulerConfig:
    base = dict(block_size=BS, num_blocks=64, max_model_len=128, max_num_batched_tokens=256)
    base.update(kw)
    return SchedulerConfig(**base)


def run_one(s: Scheduler, runner: FakeModelRunner, rid: str, prompt, salt=None, max_tokens=2):
    r = Request(
        rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, cache_salt=salt)
    )
    s.add_request(r)
    first = s.schedule()
    sr = next(x for x in first.scheduled if x.request_id == rid)
    s.update_from_output(first, runner.execute(first))
    while not r.is_finished:
        out = s.schedule()
        s.update_from_output(out, runner.execute(out))
    assert r.output_token_ids == reference_generate(prompt, r.sampling_params, None, 128)[0]
    return r, sr


def test_hit_floored_to_block_size_and_last_token_computed():
    c = cfg()
    s, runner = Scheduler(c), FakeModelRunner(c)
    prompt = list(range(1, 12))  # 11 tokens: 2 full blocks
    run_one(s, runner, "a", prompt)
    r, sr = run_one(s, runner, "b", prompt[:10] + [99])  # shares 10 tokens -> 2 blocks (8)
    assert r.num_cached_tokens == 8 and sr.start == 8 and sr.num_tokens == 3
    # Fully cached prompt of exactly 2 blocks: the last token is still computed.
    r, sr = run_one(s, runner, "c", prompt[:8])
    assert r.num_cached_tokens == 4 and sr.start == 4 and sr.num_tokens == 4 and sr.samples
    st = s.stats()
    assert st.prefix_cache_hits == 12 and st.prefix_cache_queries == 11 + 11 + 8


def test_generated_tokens_are_cached_too():
    c = cfg()
    s, runner = Scheduler(c), FakeModelRunner(c)
    a, _ = run_one(s, runner, "a", [1, 2, 3], max_tokens=9)  # 12 tokens total; 11 computed
    r, sr = run_one(s, runner, "b", a.all_token_ids)
    assert r.num_cached_tokens == 8 and sr.start == 8


def test_cache_salt_isolates_tenants():
    c = cfg()
    s, runner = Scheduler(c), FakeModelRunner(c)
    prompt = list(range(1, 14))
    run_one(s, runner, "a", prompt, salt="tenant-1")
    r, _ = run_one(s, runner, "b", prompt, salt="tenant-2")
    assert r.num_cached_tokens == 0
    r, _ = run_one(s, runner, "c", prompt)
    assert r.num_cached_tokens == 0
    r, _ = run_one(s, runner, "d", prompt, salt="tenant-1")
    assert r.num_cached_tokens == 12


def test_overlapping_prompts_share_blocks_while_running():
    c = cfg()
    s, runner = Scheduler(c), FakeModelRunner(c)
    base = list(range(1, 17))  # 4 blocks
    s.add_request(Request("a", base + [50, 51], SamplingParams(max_tokens=20, ignore_eos=True)))
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    s.add_request(Request("b", base[:12] + [60], SamplingParams(max_tokens=3, ignore_eos=True)))
    s.add_request(Request("c", base + [70, 71, 72], SamplingParams(max_tokens=3, ignore_eos=True)))
    out = s.schedule()
    spans = {x.request_id: x for x in out.scheduled}
    assert spans["b"].start == 12 and spans["c"].start == 16
    ta, tb, tc = (s.kv.get_block_ids(x) for x in "abc")
    assert ta[:3] == tb[:3] and ta[:4] == tc[:4]
    assert s.kv.pool.blocks[ta[0]].ref_cnt == 3 and s.kv.pool.blocks[ta[3]].ref_cnt == 2
    got = run_all(s, runner, {})
    assert got == {}
    for rid in "abc":
        r = s.get_request(rid)
        assert r is None or r.is_finished


def test_eviction_is_lru_tail_first():
    # 8 usable blocks; "a" and then "b" fill 3 full blocks each and are freed (a first).
    c = cfg(num_blocks=9)
    s, runner = Scheduler(c), FakeModelRunner(c)
    a, _ = run_one(s, runner, "a", list(range(1, 14)), max_tokens=1)
    b, _ = run_one(s, runner, "b", list(range(101, 114)), max_tokens=1)
    pool = s.kv.pool
    assert pool.num_cached_free == 6

    def cached(r):
        return [h in pool.cached for h in r.block_hashes[:3]]

    # A 13-token prompt needs 4 blocks: the 2 uncached free ones first, then 2 evictions from
    # the least recently freed request "a", its tail first, so "a"'s first block survives.
    run_one(s, runner, "c", list(range(201, 214)), max_tokens=1)
    assert cached(a) == [True, False, False]
    assert cached(b) == [True, True, True]
    r, _ = run_one(s, runner, "a2", a.prompt_token_ids, max_tokens=1)
    assert r.num_cached_tokens == 4


def test_prefix_caching_off_never_hits():
    c = cfg(enable_prefix_caching=False)
    s, runner = Scheduler(c), FakeModelRunner(c)
    run_one(s, runner, "a", list(range(1, 14)))
    r, _ = run_one(s, runner, "b", list(range(1, 14)))
    assert r.num_cached_tokens == 0 and s.kv.pool.num_cached_free == 0
    assert s.stats().prefix_cache_queries == 0
