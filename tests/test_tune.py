"""`jaxserve tune`: traces, goals, the bounded search, and a recommendation that, replayed,
meets its goal (the embedded model on small settings, in simulated step-cost time so the
latencies do not depend on this machine's noise)."""

from __future__ import annotations

import json

import pytest

from jaxserve.tuning.replay import ReplayReport, StepCostClock, replay
from jaxserve.tuning.search import Goal, coordinate_search, recommend
from jaxserve.tuning.workload import (
    TraceError,
    TraceRequest,
    load_trace,
    random_workload,
    write_trace,
)


def test_a_malformed_trace_line_is_named(tmp_path):
    good = {"arrival_s": 0.5, "prompt_token_ids": [1, 2], "max_tokens": 3}
    for bad, why in (("{", "not JSON"), ("[1]", "JSON object"), (json.dumps({**good, "max_tokens": 0}), "max_tokens"),
                     (json.dumps({**good, "arrival_s": -1}), "arrival_s"),
                     (json.dumps({**good, "prompt": "x"}), "exactly one"),
                     (json.dumps({**good, "prompt_token_ids": [1, "a"]}), "prompt_token_ids")):
        path = tmp_path / "t.jsonl"
        path.write_text(json.dumps(good) + "\n\n" + bad + "\n")
        with pytest.raises(TraceError, match=rf"t.jsonl:3: .*{why}"):
            load_trace(str(path))
    reqs = [TraceRequest(1.0, 4, prompt="hi"), TraceRequest(0.0, 2, prompt_token_ids=(5, 6))]
    write_trace(str(path), reqs)
    assert load_trace(str(path)) == sorted(reqs, key=lambda r: r.arrival_s)


def test_goals():
    assert Goal.parse("throughput") == Goal("throughput")
    assert Goal.parse("ttft-p99=2s") == Goal("ttft-p99", 2.0)
    assert Goal.parse("TPOT-P50 = 50ms") == Goal("tpot-p50", 0.05)
    for bad in ("latency", "ttft-p99=2", "ttft-p98=2s", "ttft-p99=0s"):
        with pytest.raises(ValueError, match="--goal"):
            Goal.parse(bad)


def _report(ttft_p99: float, throughput: float) -> ReplayReport:
    return ReplayReport(num_requests=1, duration_s=1.0, output_tokens=int(throughput), ttft_p50=ttft_p99,
                        ttft_p99=ttft_p99, tpot_p50=0.01, tpot_p99=0.01, e2e_p50=1.0, e2e_p99=1.0,
                        preemptions=0, prefix_hit_rate=0.0, num_steps=1)


def test_the_search_goes_knob_by_knob_within_its_budget():
    # A made-up landscape: a bigger budget is faster to first token, more rows more throughput.
    def evaluate(s):
        if s["max_num_seqs"] > 64:
            raise ValueError("does not fit")
        return _report(ttft_p99=4096 / s["max_num_batched_tokens"], throughput=10 * s["max_num_seqs"])

    space = {"max_num_batched_tokens": [256, 1024, 2048], "max_num_seqs": [32, 128]}
    trials = coordinate_search({"max_num_batched_tokens": 512, "max_num_seqs": 16}, space, evaluate,
                               Goal("ttft-p99", 3.0), budget_s=1e9)
    chosen, _ = recommend(trials, Goal("ttft-p99", 3.0))
    assert chosen.settings == {"max_num_batched_tokens": 2048, "max_num_seqs": 32}
    assert [t.error for t in trials if t.error] == ["does not fit"] and len(trials) == 6
    chosen, closest = recommend(trials, Goal("ttft-p99", 0.5))  # no candidate is that fast
    assert chosen is None and closest.settings["max_num_batched_tokens"] == 2048
    ticks = iter(range(100))
    cut = coordinate_search({"max_num_batched_tokens": 512, "max_num_seqs": 16}, space, evaluate,
                            Goal("throughput"), budget_s=3.5, clock=lambda: next(ticks))  # a trial: 3 ticks
    assert [t.skipped for t in cut] == [False, False, True, True, True, True]


def test_the_recommendation_replayed_meets_the_goal(smollm):
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.tuning.command import make_evaluator

    trace = random_workload(8, input_len=40, output_len=4, request_rate=float("inf"), vocab_size=1000, seed=1)
    # Power-of-two buckets: the step-cost clock charges padded tokens, and the 0.2 s goal below
    # separates the two candidates under that ladder (with midpoints the first one's TTFT p99 is
    # 0.198 s: it would meet the goal too).
    base = EngineConfig(max_model_len=128, num_pages=48, page_size=16, structured_outputs=False, max_logprobs=0,
                        max_num_seqs=2, max_num_batched_tokens=128, compilation_cache_dir=None,
                        midpoint_buckets_from=0)
    evaluate = make_evaluator(base, smollm, trace, clock="step-cost", warmup=False)
    goal = Goal("ttft-p99", 0.2)
    trials = coordinate_search({"max_num_seqs": 2}, {"max_num_seqs": [8]}, evaluate, goal, 1e9)
    assert len(trials) == 2 and not goal.met(trials[0].report)  # the goal separates the candidates
    chosen, _ = recommend(trials, goal)
    assert chosen is trials[1] and chosen.settings == {"max_num_seqs": 8}
    again = evaluate(chosen.settings)
    assert goal.met(again) and again == chosen.report  # the same replay in step-cost time
    assert again.output_tokens == 8 * 4 and again.num_requests == 8


def test_replay_measures_what_a_client_sees():
    """Step-cost time: TTFT of a lone request is its prefill steps; TPOT one decode step each."""
    class OneTokenEngine:  # a fake: one step prefills, then one token per step
        def __init__(self):
            from scheduler.stats import SchedulerStats

            self.reqs, self.last_step = {}, None
            self.scheduler = type("S", (), {"stats": lambda _: SchedulerStats(0, 0, 0, 0, 0, 0, 0, 0, 0)})()

        def add_prompt(self, prompt, params, *, prompt_token_ids, request_id, output_kind):
            self.reqs[request_id] = params.max_tokens

        def has_unfinished_requests(self):
            return bool(self.reqs)

        def step(self):
            from jaxserve.engine.outputs import (
                CompletionOutput,
                RequestMetrics,
                RequestOutput,
                Usage,
            )
            from jaxserve.worker.runner_output import StepTiming

            self.last_step = StepTiming(num_tokens=1, padded_tokens=4, num_rows=len(self.reqs))
            outs = []
            for rid, left in list(self.reqs.items()):
                self.reqs[rid] = left - 1
                if not self.reqs[rid]:
                    del self.reqs[rid]
                outs.append(RequestOutput(rid, None, [], [CompletionOutput(0, delta_token_ids=[1])], rid not in self.reqs,
                                          Usage(0, 0, 0), RequestMetrics(0, 0, 0, None)))
            return outs

    clock = StepCostClock(fixed_s=0.1, token_s=0.0, row_s=0.0)
    r = replay(OneTokenEngine(), [TraceRequest(0.0, 3, prompt_token_ids=(1,)), TraceRequest(1.0, 2, prompt_token_ids=(1,))],
               clock)
    assert r.output_tokens == 5 and r.num_steps == 5
    assert r.ttft_p50 == pytest.approx(0.1) and r.tpot_p50 == pytest.approx(0.1)
    assert r.duration_s == pytest.approx(1.2) and r.output_throughput == pytest.approx(5 / 1.2)


def test_the_tradeoff_plot_marks_the_choice(tmp_path, monkeypatch):
    import sys
    import zlib

    import numpy as np

    from jaxserve.tuning.plot import ORANGE, RED, save_tradeoff_plot
    from jaxserve.tuning.search import Trial

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the library-free picture, whatever is installed
    trials = [Trial({"max_num_seqs": s}, _report(ttft_p99=t, throughput=q)) for s, t, q in ((8, 1.0, 50), (16, 3.0, 80))]
    for goal, chosen, closest, color in ((Goal("ttft-p99", 2.0), trials[0], trials[0], RED),
                                         (Goal("ttft-p99", 0.5), None, trials[0], ORANGE)):
        path = tmp_path / "p.png"
        save_tradeoff_plot(str(path), trials, goal, chosen, closest)
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        idat = data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8]
        img = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)[:, 1:].reshape(h, w, 3)
        assert (img == color).all(-1).sum() == 11 * 11  # the marked point, and only it
