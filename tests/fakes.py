"""Test doubles for the scheduler: a fake model runner with a real (fake) paged KV store.

``FakeModelRunner`` executes a ``SchedulerOutput`` the way a real runner would, minus the
model: it does the swap copies, writes each scheduled token id into the slot its block table
says (block id, offset), and for every request that samples it reads the whole sequence back
*through the block table* and returns ``next_token(sequence)``. A scheduling bug that points
at a wrong, stale or shared-and-overwritten block therefore yields a wrong token, and the
end-to-end tests compare against ``reference_generate`` (one request alone, no cache).
"""

from __future__ import annotations

import numpy as np

from scheduler import (
    FinishReason,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from scheduler.kv_cache_manager import first_readable

VOCAB = 101
_MOD = 1_000_000_007
_MAX_LEN = 1 << 14
_POW = np.ones(_MAX_LEN, dtype=np.int64)
for _i in range(1, _MAX_LEN):
    _POW[_i] = (_POW[_i - 1] * 131) % _MOD


def next_token(seq: np.ndarray | list[int], vocab: int = VOCAB) -> int:
    """Deterministic 'model': a polynomial hash of the whole sequence, mod the vocab."""
    a = np.asarray(seq, dtype=np.int64)
    return int((int((a * _POW[: len(a)]).sum() % _MOD) + len(a)) % vocab)


def reference_generate(
    prompt: list[int],
    sp: SamplingParams,
    eos_token_id: int | None,
    max_model_len: int,
) -> tuple[list[int], FinishReason]:
    """What one request alone must produce (independent of the scheduler's stop code)."""
    seq = list(prompt)
    out: list[int] = []
    while True:
        t = next_token(seq)
        seq.append(t)
        out.append(t)
        if len(out) >= sp.min_tokens:
            if t == eos_token_id and not sp.ignore_eos:
                return out, FinishReason.STOP
            if t in sp.stop_token_ids:
                return out, FinishReason.STOP
        if len(out) >= sp.max_tokens or len(seq) >= max_model_len:
            return out, FinishReason.LENGTH


class FakeModelRunner:
    """Checks each step's plan and executes it on fake device/host KV stores."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.bs = config.block_size
        self.device = np.full((config.num_blocks, self.bs), -1, dtype=np.int64)
        self.host = np.full((max(config.num_host_blocks, 1), self.bs), -1, dtype=np.int64)
        self.num_steps = 0
        self.num_tokens_computed = 0
        self.max_step_tokens = 0
        self.num_swap_out_copies = 0
        self.num_swap_in_copies = 0

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        cfg = self.config
        bs = self.bs
        self.num_steps += 1
        total = sum(sr.num_tokens for sr in out.scheduled)
        assert total == out.num_scheduled_tokens
        self.num_tokens_computed += total
        assert total <= cfg.max_num_batched_tokens, "token budget exceeded"
        assert len(out.scheduled) <= cfg.max_num_seqs
        assert sum(1 + sr.num_draft_tokens for sr in out.scheduled) <= cfg.max_num_seqs, "too many logits rows"
        ids = [sr.request_id for sr in out.scheduled]
        assert len(set(ids)) == len(ids), "request scheduled twice in a step"
        assert out.block_tables.shape == (len(out.scheduled), cfg.num_kv_groups * cfg.max_blocks_per_seq)
        assert out.block_tables.dtype == np.int32
        self.max_step_tokens = max(self.max_step_tokens, total)

        # Swap copies first: out (reads device blocks before reuse), then in.
        for d, h in out.swap_out:
            assert d != 0, "swap out of the null block"
            self.host[h] = self.device[d]
            self.num_swap_out_copies += 1
        for h, d in out.swap_in:
            assert d != 0, "swap in to the null block"
            self.device[d] = self.host[h]
            self.host[h] = -1
            self.num_swap_in_copies += 1

        if cfg.kv_groups:
            return self._execute_grouped(out)
        written: set[tuple[int, int]] = set()
        for sr in out.scheduled:
            assert sr.num_tokens >= 1
            assert len(sr.token_ids) == sr.num_tokens
            assert sr.kv_len_after == sr.start + sr.num_tokens
            assert sr.kv_len_after <= cfg.max_model_len
            table = sr.block_table
            nb = -(-sr.kv_len_after // bs)
            assert (table[:nb] > 0).all(), f"{sr.request_id}: null block inside the table"
            assert (table[:nb] < cfg.num_blocks).all()
            assert (table[nb:] == 0).all(), f"{sr.request_id}: table not padded with 0"
            assert len(set(table[:nb].tolist())) == nb, "block used twice in one table"
            for b in sr.new_block_ids:
                assert b in table[:nb]
            pos = np.arange(sr.start, sr.kv_len_after)
            blocks = table[pos // bs]
            offs = pos % bs
            slots = set(zip(blocks.tolist(), offs.tolist(), strict=True))
            assert not (slots & written), "two requests write the same KV slot"
            written |= slots
            self.device[blocks, offs] = np.asarray(sr.token_ids, dtype=np.int64)

        sampled: dict[str, list[int]] = {}
        for sr in out.scheduled:
            if not sr.samples:
                continue
            # The model's token after each of the last 1 + k positions (k speculative drafts),
            # each read back through the block table; drafts kept while they agree.
            k = sr.num_draft_tokens
            assert k == 0 or sr.num_tokens > k, "drafts without the token they follow"
            targets = []
            for j in range(k + 1):
                pos = np.arange(sr.kv_len_after - k + j)
                seq = self.device[sr.block_table[pos // bs], pos % bs]
                assert (seq >= 0).all(), f"{sr.request_id}: read an unwritten KV slot"
                targets.append(next_token(seq))
            drafts = sr.token_ids[sr.num_tokens - k:]
            n = 1
            while n <= k and targets[n - 1] == drafts[n - 1]:
                n += 1
            sampled[sr.request_id] = targets[:n]
        return sampled


    def _execute_grouped(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Layer groups: each group's table segment holds its own pages of the one device
        store (a page is one group's at a time). Every token is written through every group;
        a sampled position reads back, through each group's table, exactly the positions that
        group's layers attend to (all of them for a full group, the window / chunk tail for
        a bounded one), which must hold the request's tokens; the 'model' then sees the
        whole sequence (kept here, as the layers' outputs carry it)."""
        cfg, bs, W = self.config, self.bs, self.config.max_blocks_per_seq
        if not hasattr(self, "seqs"):
            self.seqs: dict[str, list[int]] = {}
        for nr in out.new_requests:
            self.seqs[nr.request_id] = list(nr.prompt_token_ids)
        written: set[tuple[int, int]] = set()
        spans: dict[str, list[int]] = {}
        for sr in out.scheduled:
            assert sr.num_tokens >= 1 and len(sr.token_ids) == sr.num_tokens
            assert sr.kv_len_after == sr.start + sr.num_tokens <= cfg.max_model_len
            known = self.seqs[sr.request_id]  # its prompt and every token sampled for it
            assert len(known) >= sr.start, f"{sr.request_id}: a span starts past the known tokens"
            spans[sr.request_id] = known[:sr.start] + list(sr.token_ids)
            nb = -(-sr.kv_len_after // bs)
            mine: list[int] = []
            for g, (kind, size) in enumerate(cfg.kv_groups):
                table = sr.block_table[g * W:(g + 1) * W]
                lo = first_readable(kind, size, sr.start) // bs
                assert (table[lo:nb] > 0).all(), f"{sr.request_id}: group {g} lacks a block it reads or writes"
                assert (table[nb:] == 0).all(), f"{sr.request_id}: group {g}'s table not padded with 0"
                mine += [b for b in table[:nb].tolist() if b]
                pos = np.arange(sr.start, sr.kv_len_after)
                slots = set(zip(table[pos // bs].tolist(), (pos % bs).tolist(), strict=True))
                assert not (slots & written), "two writers of one KV slot in a step"
                written |= slots
                self.device[table[pos // bs], pos % bs] = np.asarray(sr.token_ids, dtype=np.int64)
            assert len(mine) == len(set(mine)), f"{sr.request_id}: one block in two places"
            for b in sr.new_block_ids:
                assert b in mine
        sampled: dict[str, list[int]] = {}
        for sr in out.scheduled:
            if not sr.samples:
                continue
            seq = spans[sr.request_id]
            k = sr.num_draft_tokens
            targets = []
            for j in range(k + 1):
                last = sr.kv_len_after - k + j - 1
                for g, (kind, size) in enumerate(cfg.kv_groups):
                    table = sr.block_table[g * W:(g + 1) * W]
                    pos = np.arange(first_readable(kind, size, last), last + 1)
                    got = self.device[table[pos // bs], pos % bs]
                    assert (got == np.asarray(seq)[pos]).all(), (
                        f"{sr.request_id}: group {g} ({kind} {size}) reads wrong K/V at position {last}")
                targets.append(next_token(seq[: last + 1]))
            drafts = sr.token_ids[sr.num_tokens - k:]
            n = 1
            while n <= k and targets[n - 1] == drafts[n - 1]:
                n += 1
            sampled[sr.request_id] = targets[:n]
            self.seqs[sr.request_id] += targets[:n]
        return sampled


def check_invariants(s: Scheduler) -> None:
    """Block accounting: ref counts == owners, free queue == unreferenced blocks, etc."""
    kv = s.kv
    pool = kv.pool
    owners = kv.num_owned_refs()
    assert 0 not in owners, "null block handed out"
    assert pool.null_block.ref_cnt == 0 and pool.null_block.prev is None
    free_ids = [b.block_id for b in pool.free_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    free_set = set(free_ids)
    assert 0 not in free_set
    for b in pool.blocks[1:]:
        assert b.ref_cnt == owners.get(b.block_id, 0), f"{b}: owners {owners.get(b.block_id)}"
        assert (b.ref_cnt == 0) == (b.block_id in free_set)
    assert pool.num_cached_free == sum(
        1 for b in pool.blocks[1:] if b.ref_cnt == 0 and b.block_hash is not None
    )
    for h, b in pool.cached.items():
        assert b.block_hash == h
    # Running requests hold blocks for their computed tokens; nobody else holds device blocks.
    holders = set(kv._reqs)
    assert holders == {r.request_id for r in s.running}
    for r in s.running:
        st = kv._reqs[r.request_id]
        n = -(-r.num_computed_tokens // kv.block_size)
        row = kv.tables[kv.slot_of(r.request_id)]
        for g, (kind, size) in enumerate(kv.kv_groups):
            ids = [b.block_id for b in st.groups[g]]
            assert len(ids) >= n
            seg = row[g * kv.width:(g + 1) * kv.width]
            assert seg[: len(ids)].tolist() == ids and not seg[len(ids):].any()
            # what the next token reads holds K/V; bounded groups hold nothing before it
            lo = first_readable(kind, size, r.num_computed_tokens) // kv.block_size
            assert all(ids[lo:n]), f"{r.request_id}: group {g} released a block still read"
            assert not any(ids[:st.released[g]]) and st.released[g] <= lo
    # Host blocks: exactly those of swapped requests, disjoint.
    host_owned = [h for rid in kv._host for h in kv.get_host_block_ids(rid)]
    assert len(host_owned) == len(set(host_owned))
    assert len(host_owned) == kv.host_pool.num_blocks - kv.host_pool.num_free_blocks
    assert set(kv._host) == {r.request_id for r in s.swapped}
    assert len(s.running) <= s.config.max_num_seqs


def run_all(
    s: Scheduler,
    runner: FakeModelRunner,
    arrivals: dict[int, list[Request]] | None = None,
    aborts: dict[int, list[str]] | None = None,
    max_steps: int = 20_000,
    check: bool = True,
    drafter=None,
) -> dict[str, tuple[list[int], FinishReason | None]]:
    """Drive the scheduler until every request ends; returns id -> (outputs, reason)."""
    arrivals = dict(arrivals or {})
    aborts = dict(aborts or {})
    results: dict[str, tuple[list[int], FinishReason | None]] = {}
    all_reqs: dict[str, Request] = {}
    step = 0
    while step < max_steps:
        for r in arrivals.pop(step, []):
            all_reqs[r.request_id] = r
            s.add_request(r)
        if step in aborts:
            s.abort_requests(aborts.pop(step))
        if not s.has_unfinished_requests() and not arrivals:
            break
        out = s.schedule(drafter(s) if drafter is not None else None)
        sampled = runner.execute(out)
        s.update_from_output(out, sampled)
        if check:
            check_invariants(s)
        step += 1
    else:
        raise AssertionError(f"not done after {max_steps} steps: {s.stats()}")
    for rid, r in all_reqs.items():
        assert r.is_finished, r
        results[rid] = (list(r.output_token_ids), r.finish_reason)
    return results
