"""Scheduler semantics a serving user relies on: id reuse, n > 1 prompt sharing, swapped
requests before new ones, prefix-cache resets and metrics, losing the device KV."""

from __future__ import annotations

from fakes import FakeModelRunner, check_invariants, reference_generate, run_all

from scheduler import (
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)


def step(s: Scheduler, runner: FakeModelRunner):
    out = s.schedule()
    ups = s.update_from_output(out, runner.execute(out))
    check_invariants(s)
    return out, ups


def test_finished_id_can_be_reused_at_once():
    cfg = SchedulerConfig(block_size=4, num_blocks=20, max_model_len=64)
    s, runner = Scheduler(cfg), FakeModelRunner(cfg)
    s.add_request(Request("x", [1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True)))
    _, ups = step(s, runner)
    assert ups[0].finished and s.get_request("x") is None
    s.add_request(Request("x", [4, 5], SamplingParams(max_tokens=2, ignore_eos=True)))  # no error
    out, _ = step(s, runner)
    # The runner hears of the old one's end before the new one with the same id.
    assert out.finished_request_ids == ["x"] and [n.request_id for n in out.new_requests] == ["x"]
    assert out.new_requests[0].prompt_token_ids == [4, 5]
    s.abort_requests(["x"])
    s.add_request(Request("x", [6], SamplingParams(max_tokens=1)))
    assert s.get_num_unfinished_requests() == 1


def test_new_request_data_is_sent_once():
    cfg = SchedulerConfig(block_size=4, num_blocks=4, max_model_len=32, max_num_batched_tokens=8)
    s, runner = Scheduler(cfg), FakeModelRunner(cfg)
    for rid in "ab":
        s.add_request(Request(rid, [1] * 6, SamplingParams(max_tokens=6, ignore_eos=True)))
    sent: list[str] = []
    while s.has_unfinished_requests():
        out, _ = step(s, runner)
        sent += [n.request_id for n in out.new_requests]
    assert sorted(sent) == ["a", "b"]  # preemptions (3 usable blocks) send nothing again
    assert s.stats().num_preemptions > 0


def test_siblings_compute_the_prompt_once():
    cfg = SchedulerConfig(block_size=4, num_blocks=200, max_model_len=128, max_num_batched_tokens=64)
    s, runner = Scheduler(cfg), FakeModelRunner(cfg)
    prompt = list(range(1, 42))  # 41 tokens: 10 full blocks
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    kids = [Request(f"p#{i}", prompt, sp) for i in range(4)]
    s.add_request(kids[0])
    for k in kids[1:]:
        s.add_request(k, share_prompt_with="p#0")
    assert s.get_num_unfinished_requests() == 4 and s.stats().num_waiting == 4
    out, _ = step(s, runner)
    assert [sr.request_id for sr in out.scheduled] == ["p#0"]  # siblings wait for the prompt
    got = run_all(s, runner)
    assert got == {}
    # The prompt once (41), each sibling only what the 10 cached blocks leave (1 token), and
    # 4 decodes per sequence after its first token.
    assert runner.num_tokens_computed == 41 + 3 * 1 + 4 * 4
    for k in kids:
        assert k.num_cached_tokens == (0 if k is kids[0] else 40)
        assert k.output_token_ids == reference_generate(prompt, sp, None, 128)[0]


def test_aborting_the_leader_releases_parked_siblings():
    cfg = SchedulerConfig(block_size=4, num_blocks=200, max_model_len=128)
    s, runner = Scheduler(cfg), FakeModelRunner(cfg)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    s.add_request(Request("a", list(range(1, 30)), sp))
    s.add_request(Request("b", list(range(1, 30)), sp), share_prompt_with="a")
    s.add_request(Request("c", list(range(1, 30)), sp), share_prompt_with="a")
    s.abort_requests(["a", "c"])
    got = run_all(s, runner)
    assert got == {} and not s.has_unfinished_requests()


def _swapped_request_steps(policy: str) -> tuple[int | None, int | None]:
    """"h" is swapped out at step 1 (the pool holds 12 blocks, "a" and "h" need 13); from
    step 2 on, two small requests arrive every step, less urgent under the priority policy.
    Returns the steps at which "h" came back and finished (None: never, within 300)."""
    cfg = SchedulerConfig(block_size=4, num_blocks=13, max_model_len=64, max_num_batched_tokens=64,
                          num_host_blocks=40, preemption_mode="swap", policy=policy)
    s, runner = Scheduler(cfg), FakeModelRunner(cfg)
    a = Request("a", [1] * 24, SamplingParams(max_tokens=20, ignore_eos=True), arrival_time=0.0)
    h = Request("h", [2] * 20, SamplingParams(max_tokens=30, ignore_eos=True), arrival_time=1.0)
    s.add_request(a)
    s.add_request(h)
    back = None
    for t in range(300):
        for j in range(2 if t >= 2 else 0):
            s.add_request(Request(f"s{t}.{j}", [3, 4], SamplingParams(max_tokens=8, ignore_eos=True, priority=5),
                                  arrival_time=2.0 + t))
        out, _ = step(s, runner)
        if t == 1:
            assert h.status == RequestStatus.SWAPPED
        if back is None and h.status == RequestStatus.RUNNING and t > 1:
            back = t
        if h.is_finished:
            return back, t
    return back, None


def test_swapped_request_is_not_starved_by_new_ones():
    # Before the fix: "h" never came back under either policy (new requests took every block
    # freed, and its swap-in needs 6 at once).
    for policy in ("fcfs", "priority"):
        back, done = _swapped_request_steps(policy)
        assert back is not None and done is not None, f"{policy}: swapped request starved"
        assert back <= 25, (policy, back)


def test_preempted_readmission_is_not_a_prefix_hit():
    cfg = SchedulerConfig(block_size=4, num_blocks=7, max_model_len=64, max_num_batched_tokens=32)
    s, runner = Scheduler(cfg), FakeModelRunner(cfg)
    for rid, tok in (("a", 1), ("b", 2)):
        s.add_request(Request(rid, [tok] * 9, SamplingParams(max_tokens=10, ignore_eos=True)))
    run_all(s, runner)
    st = s.stats()
    assert st.num_preemptions > 0
    assert st.prefix_cache_hits == 0 and st.prefix_cache_queries == 18


def test_reset_prefix_cache_leaves_no_running_block_hashed():
    cfg = SchedulerConfig(block_size=4, num_blocks=50, max_model_len=64)
    s, runner = Scheduler(cfg), FakeModelRunner(cfg)
    prompt = list(range(1, 14))
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    step(s, runner)
    assert s.kv.usage().num_used == 4 and s.kv.pool.cached
    s.reset_prefix_cache()
    assert not s.kv.pool.cached
    step(s, runner)  # decodes fill a block: still not registered
    s.add_request(Request("b", prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    out, _ = step(s, runner)
    assert next(sr for sr in out.scheduled if sr.request_id == "b").start == 0
    run_all(s, runner)


def test_drop_device_kv_requeues_running_for_recompute():
    cfg = SchedulerConfig(block_size=4, num_blocks=50, max_model_len=64)
    s, runner = Scheduler(cfg), FakeModelRunner(cfg)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    reqs = [Request(f"r{i}", [i + 1] * 7, sp) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    step(s, runner)
    step(s, runner)
    s.finish_requests(["r0"], FinishReason.ERROR)
    assert sorted(s.drop_device_kv()) == ["r1", "r2"]
    assert s.kv.usage().num_used == 0 and not s.kv.pool.cached
    assert all(r.status == RequestStatus.PREEMPTED for r in reqs[1:])
    runner.device[:] = -1  # the device contents are gone: a stale read would fail
    run_all(s, runner)
    assert reqs[0].finish_reason == FinishReason.ERROR
    for r in reqs[1:]:
        assert r.output_token_ids == reference_generate(r.prompt_token_ids, sp, None, 64)[0]


def test_fail_step_ends_its_requests_and_the_ones_it_swapped_out():
    cfg = SchedulerConfig(block_size=4, num_blocks=13, max_model_len=64, max_num_batched_tokens=64,
                          num_host_blocks=40, preemption_mode="swap")
    s, runner = Scheduler(cfg), FakeModelRunner(cfg)
    a = Request("a", [1] * 24, SamplingParams(max_tokens=20, ignore_eos=True))
    h = Request("h", [2] * 20, SamplingParams(max_tokens=30, ignore_eos=True))
    c = Request("c", [3] * 4, SamplingParams(max_tokens=2, ignore_eos=True))
    s.add_request(a)
    s.add_request(h)
    step(s, runner)
    out = s.schedule()  # "h" is swapped out to make room for "a"
    assert out.swap_out and h.status == RequestStatus.SWAPPED
    s.add_request(c)
    assert sorted(s.fail_step(out)) == ["a", "h"]
    assert a.finish_reason == h.finish_reason == FinishReason.ERROR
    check_invariants(s)
    got = run_all(s, runner)
    assert got == {} and c.output_token_ids == reference_generate(c.prompt_token_ids, c.sampling_params, None, 64)[0]
    assert s.kv.usage().num_host_used == 0
