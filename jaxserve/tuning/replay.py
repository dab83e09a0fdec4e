"""Replays a workload against an engine in this process and measures what a client would see.

Requests are added when their arrival time comes (scaled by `time_scale`), the engine steps
while anything is unfinished, and each request's first-token, last-token and finish times
are taken after the step that produced them. The clock is pluggable: `WallClock` (the real
run) or `StepCostClock`, simulated time in which a step costs a fixed amount plus a cost per
padded token and per sampled row, for deterministic tests and for quick what-ifs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from jaxserve.engine.outputs import OutputKind
from jaxserve.tuning.workload import TraceRequest
from scheduler import SamplingParams


class Clock(Protocol):
    def now(self) -> float: ...

    def wait_until(self, t: float) -> None: ...

    def after_step(self, timing: Any) -> None: ...


class WallClock:
    def now(self) -> float:
        return time.perf_counter()

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - time.perf_counter()))

    def after_step(self, timing: Any) -> None:
        pass


@dataclasses.dataclass
class StepCostClock:
    """Simulated seconds: a step costs `fixed_s + token_s * padded tokens + row_s * rows`."""

    fixed_s: float = 0.01
    token_s: float = 1e-4
    row_s: float = 1e-3
    t: float = 0.0

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def after_step(self, timing: Any) -> None:
        self.t += self.fixed_s + self.token_s * timing.padded_tokens + self.row_s * timing.num_rows


@dataclasses.dataclass
class _Track:
    arrival: float
    first: float | None = None
    last: float | None = None
    num_out: int = 0


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


@dataclasses.dataclass(frozen=True)
class ReplayReport:
    """What one replay measured; latencies in seconds."""

    num_requests: int
    duration_s: float
    output_tokens: int
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    e2e_p50: float
    e2e_p99: float
    preemptions: int
    prefix_hit_rate: float
    num_steps: int

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def metric(self, name: str) -> float:
        """`throughput`, or `ttft|tpot|e2e` `-p50|-p99`."""
        if name == "throughput":
            return self.output_throughput
        return getattr(self, name.replace("-", "_"))


def replay(engine: Any, trace: Sequence[TraceRequest], clock: Clock | None = None,
           time_scale: float = 1.0, seed: int = 0) -> ReplayReport:
    """Runs `trace` on `engine` (warmed up, idle) to the end. `time_scale` stretches (> 1) or
    compresses (< 1) the arrival times. Greedy sampling with EOS ignored, so every request
    produces exactly its max_tokens, as `vllm bench serve --ignore-eos` does."""
    clock = clock or WallClock()
    stats0 = engine.scheduler.stats()
    pending = sorted(trace, key=lambda r: r.arrival_s)
    tracks: dict[str, _Track] = {}
    t0 = clock.now()
    i = steps = 0
    while i < len(pending) or engine.has_unfinished_requests():
        now = clock.now() - t0
        while i < len(pending) and pending[i].arrival_s * time_scale <= now:
            r = pending[i]
            rid = f"tune-{i}"
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, seed=seed)
            engine.add_prompt(r.prompt, params, prompt_token_ids=r.prompt_token_ids, request_id=rid,
                              output_kind=OutputKind.DELTA)
            tracks[rid] = _Track(arrival=r.arrival_s * time_scale)
            i += 1
        if not engine.has_unfinished_requests():
            clock.wait_until(t0 + pending[i].arrival_s * time_scale)
            continue
        outs = engine.step()
        steps += 1
        clock.after_step(engine.last_step)
        t = clock.now() - t0
        for out in outs:
            tr = tracks.get(out.request_id)
            if tr is None:
                continue
            n = sum(len(c.delta_token_ids) for c in out.outputs)
            if n:
                tr.first = t if tr.first is None else tr.first
                tr.last = t
                tr.num_out += n
    duration = clock.now() - t0
    return _report(tracks, duration, steps, stats0, engine.scheduler.stats())


def _report(tracks: dict[str, _Track], duration: float, steps: int, before: Any, after: Any) -> ReplayReport:
    done = [tr for tr in tracks.values() if tr.first is not None]
    ttft = [tr.first - tr.arrival for tr in done]
    e2e = [tr.last - tr.arrival for tr in done]
    tpot = [(tr.last - tr.first) / (tr.num_out - 1) for tr in done if tr.num_out > 1]
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return ReplayReport(
        num_requests=len(tracks), duration_s=duration, output_tokens=sum(tr.num_out for tr in done),
        ttft_p50=_pct(ttft, 50), ttft_p99=_pct(ttft, 99), tpot_p50=_pct(tpot, 50), tpot_p99=_pct(tpot, 99),
        e2e_p50=_pct(e2e, 50), e2e_p99=_pct(e2e, 99),
        preemptions=sum(after.preemptions.values()) - sum(before.preemptions.values()),
        prefix_hit_rate=hits / queries if queries else 0.0, num_steps=steps)
