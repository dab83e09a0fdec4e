"""Property tests: random arrivals, lengths, aborts and tiny pools.

Every step the fake runner checks the plan (budget, spans, tables, KV read-back) and
``check_invariants`` checks the block accounting (no leak, no double free, ref counts equal
owners). At the end every request has ended, the pool is whole again, and every request that
was neither aborted nor cut short for capacity produced exactly the reference tokens.
"""

from __future__ import annotations

import numpy as np
from fakes import VOCAB, FakeModelRunner, next_token, reference_generate, run_all
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from scheduler import FinishReason, Request, SamplingParams, Scheduler, SchedulerConfig

EOS = 3


@st.composite
def scenarios(draw, pressure: bool = False, groups: bool = False):
    bs = draw(st.sampled_from([1, 2, 4, 8]))
    kv_groups: tuple = ()
    if groups:  # layer groups: windowed / chunked ones beside full ones, or alone
        bounded = draw(st.lists(st.tuples(st.sampled_from(["window", "chunk"]), st.integers(1, 20)),
                                min_size=1, max_size=2))
        kv_groups = tuple(draw(st.permutations([("full", 0)] * draw(st.integers(0, 2)) + bounded)))
    max_model_len = draw(st.integers(8, 96))
    mode = "swap" if pressure else draw(st.sampled_from(["swap", "recompute"]))
    cfg = SchedulerConfig(
        block_size=bs,
        num_blocks=draw(st.integers(6, 16) if pressure else st.integers(2, 30)) * max(1, len(kv_groups)),
        max_model_len=max_model_len,
        max_num_seqs=draw(st.integers(4, 12) if pressure else st.integers(1, 12)),
        max_num_batched_tokens=draw(st.integers(1, 64)),
        num_host_blocks=draw(st.integers(0 if not pressure else 8, 40)) if mode == "swap" else 0,
        enable_prefix_caching=draw(st.booleans()),
        preemption_mode=mode,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 16])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        kv_groups=kv_groups,
    )
    n = draw(st.integers(1, 12))
    arrivals: dict[int, list[Request]] = {}
    aborts: dict[int, list[str]] = {}
    reqs = []
    for i in range(n):
        # Tiny alphabet and shared stems so prefixes collide often.
        stem = draw(st.sampled_from([[], [1, 2, 1, 2, 1, 2, 1, 2], [4] * 12]))
        tail = draw(st.lists(st.integers(1, 5), min_size=0 if stem else 1, max_size=20))
        max_tokens = draw(st.integers(1, 20))
        sp = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(0, 100), max_size=6)),
            cache_salt=draw(st.sampled_from([None, None, "t"])),
            priority=draw(st.integers(0, 2)),
        )
        r = Request(f"r{i}", stem + tail, sp, EOS, arrival_time=float(i))
        reqs.append(r)
        arrivals.setdefault(draw(st.integers(0, 15)), []).append(r)
        if draw(st.integers(0, 5)) == 0:
            aborts.setdefault(draw(st.integers(0, 40)), []).append(r.request_id)
    return cfg, reqs, arrivals, aborts


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_random_schedules_keep_every_invariant(scenario):
    check_scenario(scenario)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios(groups=True), st.booleans(), st.integers(0, 2**16))
def test_random_schedules_with_bounded_layer_groups(scenario, drafting, seed):
    """Windowed and chunked layer groups release the blocks no later token reads: every
    sampled position still reads, through each group's table, exactly the K/V its layers
    attend to (the fake runner checks it), across prefix hits, preemption (swap and
    recompute), speculative drafts and aborts, with no block leaked."""
    check_scenario(scenario, drafter=_drafter(scenario[0], 3, 0.5, seed) if drafting else None)


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios(pressure=True))
def test_random_schedules_under_swap_pressure(scenario):
    check_scenario(scenario)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios(), st.integers(1, 5), st.sampled_from([0.0, 0.5, 0.8, 1.0]), st.integers(0, 2**16))
def test_random_schedules_with_speculative_drafts(scenario, k, p_right, seed):
    """Drafts right with probability p_right (else random), verified by the fake runner
    through the block tables: outputs equal the reference, no block leaks, rejected drafts
    leave no block behind, and no block hash covers a draft that was not kept."""
    check_scenario(scenario, drafter=_drafter(scenario[0], k, p_right, seed))


def _drafter(cfg, k: int, p_right: float, seed: int):
    rng = np.random.default_rng(seed)
    bs = cfg.block_size

    def drafts(s: Scheduler) -> dict[str, list[int]]:
        kv = s.kv
        for r in s.running:  # after every update: exactly the computed tokens' blocks
            assert len(kv.get_block_ids(r.request_id)) == -(-r.num_computed_tokens // bs), r
            assert kv._reqs[r.request_id].num_registered * bs <= r.num_computed_tokens
        out = {}
        for c in s.draft_candidates(k):
            assert 0 < c.max_drafts <= k
            seq, d = list(c.token_ids), []
            for _ in range(int(rng.integers(0, c.max_drafts + 1))):
                t = next_token(seq) if rng.random() < p_right else int(rng.integers(0, VOCAB))
                seq.append(t)
                d.append(t)
            if d:
                out[c.request_id] = d
        event(f"drafts: {'yes' if out else 'no'}")
        return out

    return drafts


def check_scenario(scenario, drafter=None):
    cfg, reqs, arrivals, aborts = scenario
    s = Scheduler(cfg)
    runner = FakeModelRunner(cfg)
    prompts = {r.request_id: list(r.prompt_token_ids) for r in reqs}
    got = run_all(s, runner, arrivals, aborts, max_steps=5000, drafter=drafter)
    st_ = s.stats()
    assert st_.num_used_blocks == 0 and st_.num_free_blocks == cfg.num_blocks - 1
    assert st_.num_host_blocks_used == 0
    assert st_.num_running == st_.num_waiting == st_.num_swapped == 0
    assert runner.max_step_tokens <= cfg.max_num_batched_tokens
    event(f"preemptions: {'yes' if st_.num_preemptions else 'no'}")
    event(f"swaps: {'yes' if st_.preemptions['swap'] else 'no'}")
    event(f"prefix hits: {'yes' if st_.prefix_cache_hits else 'no'}")
    for k, v in st_.num_finished.items():
        if v:
            event(f"finished {k}")
    for r in reqs:
        out, reason = got[r.request_id]
        ref, ref_reason = reference_generate(
            prompts[r.request_id], r.sampling_params, EOS, cfg.max_model_len
        )
        if reason in (FinishReason.ABORT, FinishReason.CAPACITY):
            assert out == ref[: len(out)]
        else:
            assert (out, reason) == (ref, ref_reason)
        if reason == FinishReason.CAPACITY:
            # Only when it truly cannot fit: prompt past max_model_len, or more K/V than the
            # whole device pool holds.
            usable_tokens = (cfg.num_blocks - 1) * cfg.block_size
            plen = len(prompts[r.request_id])
            if cfg.kv_groups:  # blocks in every group: bounded ones at most a span's reach
                n = -(-(plen + len(out)) // cfg.block_size)
                reach = [-(-(size + cfg.max_num_batched_tokens) // cfg.block_size) + 1 for _, size in cfg.kv_groups]
                need = sum(n if kind == "full" else min(n, r_) for (kind, _), r_ in zip(cfg.kv_groups, reach))
                assert plen > cfg.max_model_len or need > cfg.num_blocks - 1
            else:
                assert plen > cfg.max_model_len or plen + len(out) > usable_tokens
