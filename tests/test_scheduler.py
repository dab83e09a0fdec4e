"""End-to-end scheduling against the fake runner: same tokens whatever the configuration."""

from __future__ import annotations

import random

import pytest
from fakes import FakeModelRunner, check_invariants, reference_generate, run_all

from scheduler import (
    FinishReason,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)

EOS = 7


def make_requests(num: int, seed: int = 0, shared_prefix: int = 0, max_prompt: int = 40):
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 100) for _ in range(shared_prefix)]
    reqs = []
    for i in range(num):
        plen = rng.randint(1, max_prompt)
        prompt = prefix + [rng.randrange(1, 100) for _ in range(plen)]
        max_tokens = rng.randint(1, 24)
        sp = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=min(rng.choice([0, 0, 3]), max_tokens),
            stop_token_ids=rng.choice([[], [11], [11, 12]]),
            ignore_eos=rng.random() < 0.2,
        )
        reqs.append(Request(f"r{i}", prompt, sp, eos_token_id=EOS, arrival_time=float(i)))
    return reqs


def clone(reqs):
    return [
        Request(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_id, r.arrival_time)
        for r in reqs
    ]


def expected(reqs, max_model_len):
    return {
        r.request_id: reference_generate(
            r.prompt_token_ids, r.sampling_params, r.eos_token_id, max_model_len
        )
        for r in reqs
    }


CONFIGS = [
    dict(num_blocks=400, max_num_batched_tokens=512),
    dict(num_blocks=400, max_num_batched_tokens=7),  # tiny budget: everything chunked
    dict(num_blocks=400, max_num_batched_tokens=64, enable_prefix_caching=False),
    dict(num_blocks=30, max_num_batched_tokens=64),  # tiny pool: recompute preemption
    dict(num_blocks=30, max_num_batched_tokens=64, enable_prefix_caching=False),
    dict(num_blocks=30, max_num_batched_tokens=64, preemption_mode="swap", num_host_blocks=200),
    dict(num_blocks=30, max_num_batched_tokens=16, preemption_mode="swap", num_host_blocks=12),
    dict(num_blocks=60, max_num_batched_tokens=64, long_prefill_token_threshold=8),
    dict(num_blocks=60, max_num_batched_tokens=64, max_num_seqs=3, policy="priority"),
    dict(
        num_blocks=30,
        max_num_batched_tokens=40,
        policy="priority",
        preemption_mode="swap",
        num_host_blocks=40,
        block_size=8,
    ),
]


@pytest.mark.parametrize("overrides", CONFIGS)
@pytest.mark.parametrize("shared_prefix", [0, 20])
def test_same_tokens_whatever_the_config(overrides, shared_prefix):
    kw = dict(block_size=4, max_model_len=128, max_num_seqs=16)
    kw.update(overrides)
    cfg = SchedulerConfig(**kw)
    reqs = make_requests(24, seed=shared_prefix, shared_prefix=shared_prefix)
    # Staggered arrivals so prefill chunks share steps with decodes.
    arrivals: dict[int, list[Request]] = {}
    for i, r in enumerate(clone(reqs)):
        arrivals.setdefault(i // 3, []).append(r)
    s = Scheduler(cfg)
    runner = FakeModelRunner(cfg)
    got = run_all(s, runner, arrivals)
    assert got == expected(reqs, cfg.max_model_len)
    st = s.stats()
    assert st.num_used_blocks == 0 and st.num_free_blocks == cfg.num_blocks - 1
    assert st.num_running == st.num_waiting == st.num_swapped == 0


def tiny_pool_config(mode: str, **kw) -> SchedulerConfig:
    base = dict(
        block_size=4,
        num_blocks=13,  # 12 usable blocks = 48 tokens
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        preemption_mode=mode,
        num_host_blocks=64 if mode == "swap" else 0,
    )
    base.update(kw)
    return SchedulerConfig(**base)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_really_happens(mode):
    cfg = tiny_pool_config(mode)
    reqs = [
        Request(f"p{i}", [i + 1] * 10, SamplingParams(max_tokens=20, ignore_eos=True), EOS, i)
        for i in range(4)
    ]
    s = Scheduler(cfg)
    runner = FakeModelRunner(cfg)
    got = run_all(s, runner, {0: clone(reqs)})
    assert got == expected(reqs, cfg.max_model_len)
    st = s.stats()
    assert st.preemptions[mode] > 0, st
    if mode == "swap":
        assert runner.num_swap_out_copies > 0 and runner.num_swap_in_copies > 0
        assert runner.num_swap_in_copies == runner.num_swap_out_copies
        assert st.num_host_blocks_used == 0
    else:
        assert st.preemptions["swap"] == 0
    assert st.num_used_blocks == 0


def test_swap_falls_back_to_recompute_without_host_room():
    cfg = tiny_pool_config("swap", num_host_blocks=1)
    reqs = [
        Request(f"p{i}", [i + 1] * 10, SamplingParams(max_tokens=20, ignore_eos=True), EOS, i)
        for i in range(4)
    ]
    s = Scheduler(cfg)
    got = run_all(s, FakeModelRunner(cfg), {0: clone(reqs)})
    assert got == expected(reqs, cfg.max_model_len)
    assert s.stats().preemptions["recompute"] > 0


def test_swap_plan_names_blocks_and_swapped_state():
    cfg = tiny_pool_config("swap")
    s = Scheduler(cfg)
    runner = FakeModelRunner(cfg)
    for i in range(4):
        s.add_request(Request(f"p{i}", [i + 1] * 10, SamplingParams(max_tokens=30), None, i))
    saw_swap_out = False
    while s.has_unfinished_requests():
        out = s.schedule()
        if out.swap_out:
            saw_swap_out = True
            victim = s.get_request(out.preempted_request_ids[0])
            assert victim.status == RequestStatus.SWAPPED
            assert victim.request_id not in {sr.request_id for sr in out.scheduled}
            host = s.kv.get_host_block_ids(victim.request_id)
            assert len(host) == -(-victim.num_computed_tokens // cfg.block_size)
            assert s.stats().num_swapped >= 1
        s.update_from_output(out, runner.execute(out))
        check_invariants(s)
    assert saw_swap_out


def test_capacity_for_prompt_that_never_fits():
    cfg = tiny_pool_config("recompute")  # 48 tokens of KV in the whole pool
    s = Scheduler(cfg)
    big = Request("big", list(range(1, 50)), SamplingParams(max_tokens=4), EOS)
    ok = Request("ok", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True), EOS)
    s.add_request(big)
    s.add_request(ok)
    assert big.status == RequestStatus.FINISHED_CAPACITY
    assert big.finish_reason == FinishReason.CAPACITY == "capacity"
    got = run_all(s, FakeModelRunner(cfg))
    assert got == {}  # run_all only reports requests it added
    assert ok.finish_reason == FinishReason.LENGTH
    assert s.stats().num_finished["capacity"] == 1


def test_capacity_is_reported_by_update_from_output():
    cfg = tiny_pool_config("recompute")
    s = Scheduler(cfg)
    s.add_request(Request("big", list(range(1, 50)), SamplingParams(), EOS))
    assert s.has_unfinished_requests()
    out = s.schedule()
    assert out.scheduled == [] and out.finished_request_ids == ["big"]
    ups = s.update_from_output(out, {})
    assert [(u.request_id, u.finished, u.finish_reason) for u in ups] == [
        ("big", True, FinishReason.CAPACITY)
    ]
    assert not s.has_unfinished_requests()


def test_capacity_when_generation_outgrows_the_pool():
    # Prompt fits (40 of 48 tokens), but 40 + 20 outputs cannot: ends with CAPACITY, not hang.
    cfg = tiny_pool_config("recompute")
    s = Scheduler(cfg)
    r = Request("g", [5] * 40, SamplingParams(max_tokens=20, ignore_eos=True), EOS)
    run_all(s, FakeModelRunner(cfg), {0: [r]})
    assert r.finish_reason == FinishReason.CAPACITY
    assert r.num_output_tokens == 48 - 40 + 1  # 48 KV slots: the 49th token cannot be computed
    assert s.stats().num_used_blocks == 0


def test_prompt_longer_than_max_model_len_is_capacity():
    cfg = SchedulerConfig(block_size=4, num_blocks=100, max_model_len=16)
    s = Scheduler(cfg)
    r = Request("long", list(range(1, 18)), SamplingParams(), EOS)
    s.add_request(r)
    assert r.finish_reason == FinishReason.CAPACITY


def test_length_at_max_model_len():
    cfg = SchedulerConfig(block_size=4, num_blocks=100, max_model_len=16)
    s = Scheduler(cfg)
    r = Request("r", list(range(1, 11)), SamplingParams(max_tokens=100, ignore_eos=True), EOS)
    run_all(s, FakeModelRunner(cfg), {0: [r]})
    assert r.finish_reason == FinishReason.LENGTH
    assert r.num_tokens == 16


def test_chunked_prefill_shares_step_with_decodes_and_threshold():
    cfg = SchedulerConfig(
        block_size=4,
        num_blocks=200,
        max_model_len=256,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=12,
    )
    s = Scheduler(cfg)
    runner = FakeModelRunner(cfg)
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), EOS))
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    s.add_request(Request("b", list(range(1, 101)), SamplingParams(max_tokens=2), EOS))
    out = s.schedule()
    spans = {sr.request_id: (sr.start, sr.num_tokens, sr.samples) for sr in out.scheduled}
    assert spans["a"] == (3, 1, True)  # decode first
    assert spans["b"] == (0, 12, False)  # chunk capped by the threshold, no sample
    assert [sr.request_id for sr in out.scheduled] == ["a", "b"]
    s.update_from_output(out, runner.execute(out))
    assert s.get_request("b").num_computed_tokens == 12


def test_budget_and_max_num_seqs():
    cfg = SchedulerConfig(
        block_size=4, num_blocks=200, max_model_len=128, max_num_batched_tokens=10, max_num_seqs=2
    )
    s = Scheduler(cfg)
    for i in range(4):
        s.add_request(Request(f"r{i}", [1] * 8, SamplingParams(max_tokens=3), EOS, i))
    out = s.schedule()
    assert out.num_scheduled_tokens == 10
    assert [(sr.request_id, sr.num_tokens) for sr in out.scheduled] == [("r0", 8), ("r1", 2)]
    assert s.stats().num_running == 2 and s.stats().num_waiting == 2


def test_priority_policy_admits_urgent_first():
    cfg = SchedulerConfig(
        block_size=4, num_blocks=200, max_model_len=64, max_num_seqs=1, policy="priority"
    )
    s = Scheduler(cfg)
    s.add_request(Request("low", [1, 2], SamplingParams(max_tokens=1, priority=5), EOS, 0.0))
    s.add_request(Request("high", [1, 2], SamplingParams(max_tokens=1, priority=-1), EOS, 1.0))
    out = s.schedule()
    assert [sr.request_id for sr in out.scheduled] == ["high"]


def test_stop_conditions_and_min_tokens():
    cfg = SchedulerConfig(block_size=4, num_blocks=100, max_model_len=64)
    s = Scheduler(cfg)
    out = s.schedule()
    assert out.is_empty
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=2), eos_token_id=9)
    s.add_request(r)
    out = s.schedule()
    ups = s.update_from_output(out, {"r": [9]})  # EOS before min_tokens: ignored
    assert not ups[0].finished and ups[0].new_token_ids == [9]
    out = s.schedule()
    assert out.scheduled[0].start == 3 and out.scheduled[0].token_ids == [9]
    ups = s.update_from_output(out, {"r": [9]})
    assert ups[0].finished and ups[0].finish_reason == FinishReason.STOP
    assert r.stop_reason is None and r.status == RequestStatus.FINISHED_STOPPED
    out = s.schedule()
    assert out.finished_request_ids == ["r"]
    assert s.get_request("r") is None

    r2 = Request("r2", [1], SamplingParams(max_tokens=10, stop_token_ids=[42]), eos_token_id=9)
    s.add_request(r2)
    out = s.schedule()
    ups = s.update_from_output(out, {"r2": [42]})
    assert ups[0].finish_reason == FinishReason.STOP and ups[0].stop_reason == 42

    r3 = Request("r3", [1], SamplingParams(max_tokens=2, ignore_eos=True), eos_token_id=9)
    s.add_request(r3)
    for _ in range(2):
        out = s.schedule()
        ups = s.update_from_output(out, {"r3": [9]})
    assert ups[0].finish_reason == FinishReason.LENGTH and r3.output_token_ids == [9, 9]


def test_abort_and_finish_requests_free_everything():
    cfg = SchedulerConfig(block_size=4, num_blocks=50, max_model_len=64, max_num_batched_tokens=16)
    s = Scheduler(cfg)
    runner = FakeModelRunner(cfg)
    reqs = [Request(f"r{i}", [i + 1] * 10, SamplingParams(max_tokens=30), None, i) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    s.abort_requests(["r0", "r4", "nope"])
    s.finish_requests(["r1"], FinishReason.STOP, stop_reason="</s>")
    assert reqs[0].finish_reason == FinishReason.ABORT and s.get_request("r0") is None
    assert reqs[1].stop_reason == "</s>"
    check_invariants(s)
    out = s.schedule()
    assert set(out.finished_request_ids) == {"r0", "r4", "r1"}
    # Abort between schedule() and update_from_output(): the update skips it.
    s.abort_requests(["r2"])
    ups = s.update_from_output(out, runner.execute(out))
    assert "r2" not in {u.request_id for u in ups}
    s.abort_requests(["r3"])
    check_invariants(s)
    assert not s.has_unfinished_requests()
    assert s.stats().num_free_blocks == cfg.num_blocks - 1


def test_duplicate_id_rejected():
    s = Scheduler(SchedulerConfig(block_size=4, num_blocks=10, max_model_len=16))
    s.add_request(Request("x", [1], SamplingParams()))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(Request("x", [1], SamplingParams()))


def test_block_tables_are_copies():
    cfg = SchedulerConfig(block_size=4, num_blocks=50, max_model_len=64)
    s = Scheduler(cfg)
    s.add_request(Request("x", [1] * 9, SamplingParams(max_tokens=5)))
    out = s.schedule()
    row = out.scheduled[0].block_table
    assert row.shape == (cfg.max_blocks_per_seq,) and row.dtype.name == "int32"
    assert row[:3].all() and not row[3:].any()
    row[:] = 0
    assert s.kv.block_table_row("x")[:3].all()


def test_swapped_out_blocks_are_reused_within_the_same_step():
    """The runner must do swap-out copies before the step: the freed blocks get new data."""
    cfg = tiny_pool_config("swap")
    s = Scheduler(cfg)
    runner = FakeModelRunner(cfg)
    reqs = [
        Request(f"p{i}", [i + 1] * (6 + i), SamplingParams(max_tokens=24, ignore_eos=True), EOS, i)
        for i in range(5)
    ]
    live = clone(reqs)
    for r in live:
        s.add_request(r)
    reused = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        freed = {d for d, _ in out.swap_out}
        taken = {d for _, d in out.swap_in} | {b for sr in out.scheduled for b in sr.new_block_ids}
        reused += bool(freed & taken)
        s.update_from_output(out, runner.execute(out))
    assert reused > 0
    assert {r.request_id: (r.output_token_ids, r.finish_reason) for r in live} == expected(
        reqs, cfg.max_model_len
    )


class _FailedGrammar:
    """A grammar handle whose compile has already failed when the request is added."""

    def ready(self) -> bool:
        return True

    @property
    def error(self) -> str:
        return "structured_outputs.regex: invalid regex"

    def new_matcher(self):
        raise AssertionError("a failed grammar reached the runner")


def test_a_grammar_that_failed_before_the_request_was_added_ends_it_with_the_error():
    """The compile can fail before add_request (an invalid regex fails at once): the request
    must end with its error at the next schedule, never be scheduled (its step would fail and
    take the other requests with it)."""
    from scheduler import Request, Scheduler, SchedulerConfig

    s = Scheduler(SchedulerConfig(block_size=4, num_blocks=32, max_model_len=64, max_num_seqs=4,
                                  max_num_batched_tokens=32))
    s.add_request(Request("bad", [1, 2, 3], SamplingParams(max_tokens=2), grammar=_FailedGrammar()))
    s.add_request(Request("good", [4, 5], SamplingParams(max_tokens=2)))
    out = s.schedule()
    assert [sr.request_id for sr in out.scheduled] == ["good"] and not out.new_requests[1:]
    assert s.take_grammar_errors() == [("bad", "structured_outputs.regex: invalid regex")]
    assert s.get_request("bad") is None


class _Images:
    """A prompt's images as the scheduler sees them (`MultimodalPrompt.keys`)."""

    def __init__(self, *keys):
        self.keys = keys


def test_encoder_budget_stops_a_span_before_the_image_that_does_not_fit():
    """With 20 image tokens per step, the second prompt's 16-token image waits a step (its text
    before the image runs), an image larger than the budget still runs when it is the step's
    first, and image hashes never change what is scheduled otherwise."""
    cfg = SchedulerConfig(block_size=4, num_blocks=200, max_model_len=256, max_num_seqs=8,
                          max_num_batched_tokens=64, max_num_encoder_tokens=20)
    sched = Scheduler(cfg)
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    sched.add_request(Request("a", list(range(1, 41)), sp, multimodal=_Images((2, 16, "x"))))
    sched.add_request(Request("b", list(range(1, 41)), sp, multimodal=_Images((2, 16, "y"))))
    first = sched.schedule()
    assert [(s.request_id, s.start, s.num_tokens) for s in first.scheduled] == [("a", 0, 40), ("b", 0, 2)]
    sched.update_from_output(first, {"a": [5], "b": []})
    second = sched.schedule()
    assert [(s.request_id, s.start, s.num_tokens) for s in second.scheduled] == [("b", 2, 38)]
    sched.update_from_output(second, {"b": [5]})
    sched.add_request(Request("c", list(range(1, 41)), sp, multimodal=_Images((0, 30, "z"))))
    third = sched.schedule()
    assert [(s.request_id, s.num_tokens) for s in third.scheduled] == [("c", 40)]
    with pytest.raises(ValueError, match="max_num_encoder_tokens"):
        SchedulerConfig(max_num_encoder_tokens=-1)


def test_whole_images_never_end_a_span_inside_an_image():
    """Bidirectional images (Gemma 3): with 16 tokens per step, a chunk that would end inside
    the 10-token image at 12 stops before it; the image then runs whole with the text after
    it; a prefix hit that ends inside the image resumes with the image's whole rest; an image
    that does not fit the budget left waits while a decode runs."""
    cfg = SchedulerConfig(block_size=4, num_blocks=200, max_model_len=256, max_num_seqs=8,
                          max_num_batched_tokens=16, whole_images=True)
    sched = Scheduler(cfg)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    prompt = list(range(1, 31))
    sched.add_request(Request("a", prompt, sp, multimodal=_Images((12, 10, "x"))))
    spans = []
    for _ in range(3):
        out = sched.schedule()
        spans += [(s.request_id, s.start, s.num_tokens) for s in out.scheduled]
        sched.update_from_output(out, {s.request_id: [7] if s.start + s.num_tokens >= 30 else []
                                       for s in out.scheduled})
    assert spans == [("a", 0, 12), ("a", 12, 16), ("a", 28, 2)]
    # Same prompt and image: a prefix hit of whole blocks ends inside the image (at 20); the
    # image's rest runs in one span with what follows.
    sched.add_request(Request("b", prompt[:22] + list(range(100, 108)), sp, multimodal=_Images((12, 10, "x"))))
    out = sched.schedule()
    assert [(s.request_id, s.start, s.num_tokens) for s in out.scheduled][-1] == ("b", 20, 10)
    # Without the rule the budget cuts through the image.
    plain = Scheduler(SchedulerConfig(block_size=4, num_blocks=200, max_model_len=256, max_num_seqs=8,
                                      max_num_batched_tokens=16))
    plain.add_request(Request("c", prompt, sp, multimodal=_Images((12, 10, "x"))))
    assert [(s.start, s.num_tokens) for s in plain.schedule().scheduled] == [(0, 16)]
    # A 16-token image at the span's start with 15 tokens of budget left waits for the next step.
    tight = Scheduler(cfg)
    tight.add_request(Request("d", list(range(1, 5)), sp))
    tight.update_from_output(tight.schedule(), {"d": [9]})
    tight.add_request(Request("e", list(range(1, 19)), sp, multimodal=_Images((0, 16, "y"))))
    out = tight.schedule()
    assert [(s.request_id, s.num_tokens) for s in out.scheduled] == [("d", 1)]
