"""The search behind `jaxserve tune`: candidate settings, a goal, and a recommendation.

The knobs are the scheduler's: the token budget per step (`max_num_batched_tokens`), the
chunk a long prefill may take (`long_prefill_token_threshold`), the rows per step
(`max_num_seqs`) and the KV cache (`kv_cache_memory_gb` or `num_pages`). A full grid of four
knobs is too many engines to build and warm up, so the search goes one knob at a time
(coordinate search): starting from the user's settings, each value of the first knob is
replayed, the best setting so far (for the goal) is kept, then the next knob is varied
around it. The time budget bounds the whole search; trials it cuts are listed as skipped.

A goal is `throughput` (most output tokens/s), or a latency bound such as `ttft-p99=2s` or
`tpot-p50=50ms`: the candidate with the most throughput among those meeting the bound. When
none meets it, there is no recommendation and the closest candidate is named.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxserve.tuning.replay import ReplayReport

KNOBS = ("max_num_batched_tokens", "long_prefill_token_threshold", "max_num_seqs", "kv_cache_memory_gb",
         "num_pages")
LATENCY_METRICS = ("ttft-p50", "ttft-p99", "tpot-p50", "tpot-p99", "e2e-p50", "e2e-p99")


@dataclasses.dataclass(frozen=True)
class Goal:
    metric: str  # "throughput" or one of LATENCY_METRICS
    limit_s: float | None = None  # the latency bound

    @staticmethod
    def parse(text: str) -> Goal:
        text = text.strip().lower()
        if text == "throughput":
            return Goal("throughput")
        m = re.fullmatch(r"([a-z0-9-]+)\s*=\s*([0-9.]+)\s*(ms|s)", text)
        if not m or m.group(1) not in LATENCY_METRICS:
            raise ValueError(f"--goal: 'throughput' or METRIC=LIMIT with METRIC one of {', '.join(LATENCY_METRICS)} "
                             f"and LIMIT in s or ms (ttft-p99=2s, tpot-p50=50ms), got {text!r}")
        value = float(m.group(2)) / (1000.0 if m.group(3) == "ms" else 1.0)
        if not value > 0:
            raise ValueError(f"--goal: the limit must be > 0, got {text!r}")
        return Goal(m.group(1), value)

    def met(self, report: ReplayReport) -> bool:
        return self.limit_s is None or report.metric(self.metric) <= self.limit_s

    def __str__(self) -> str:
        return self.metric if self.limit_s is None else f"{self.metric} <= {self.limit_s * 1000:g} ms"


@dataclasses.dataclass
class Trial:
    settings: dict[str, Any]
    report: ReplayReport | None = None
    error: str | None = None  # the candidate could not run (it does not fit, say)
    seconds: float = 0.0  # wall time spent on it (engine build, warmup, replay)
    skipped: bool = False  # not run: the time budget was spent


def better(a: Trial, b: Trial | None, goal: Goal) -> bool:
    """Whether `a` is a better choice than `b` for `goal` (meeting it first, then throughput;
    among candidates missing a bound, the one closest to it)."""
    if a.report is None:
        return False
    if b is None or b.report is None:
        return True
    ma, mb = goal.met(a.report), goal.met(b.report)
    if ma != mb:
        return ma
    if ma:
        return a.report.output_throughput > b.report.output_throughput
    return a.report.metric(goal.metric) < b.report.metric(goal.metric)


def recommend(trials: Sequence[Trial], goal: Goal) -> tuple[Trial | None, Trial | None]:
    """(the recommendation or None when no candidate meets the goal, the best candidate)."""
    best = None
    for t in trials:
        if better(t, best, goal):
            best = t
    if best is None or not goal.met(best.report):
        return None, best
    return best, best


def coordinate_search(base: Mapping[str, Any], space: Mapping[str, Sequence[Any]],
                      evaluate: Callable[[dict[str, Any]], ReplayReport], goal: Goal, budget_s: float,
                      clock: Callable[[], float] = time.monotonic,
                      on_trial: Callable[[Trial], None] | None = None) -> list[Trial]:
    """Replays `base`, then each knob's values around the best setting so far. `evaluate`
    raises ValueError (or MemoryError) for a candidate that cannot run; that trial records it."""
    start = clock()
    trials: list[Trial] = []
    seen: dict[tuple, Trial] = {}

    def run(settings: dict[str, Any]) -> Trial:
        key = tuple(sorted(settings.items()))
        if key in seen:
            return seen[key]
        trial = Trial(dict(settings))
        if trials and clock() - start > budget_s:
            trial.skipped = True
        else:
            t0 = clock()
            try:
                trial.report = evaluate(dict(settings))
            except (ValueError, MemoryError) as e:
                trial.error = str(e)
            trial.seconds = clock() - t0
        seen[key] = trial
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
        return trial

    current = run(dict(base))
    for knob, values in space.items():
        best = current
        for v in values:
            trial = run({**current.settings, knob: v})
            if better(trial, best, goal):
                best = trial
        current = best
    return trials
