"""`jaxserve tune --target`: does each candidate setting fit a TPU or GPU this host has not got?

Latency cannot be replayed without the device, but memory can be planned: for every
combination of the candidate token budgets, sequence counts and cache sizes, the compile
planner (`compile_for_target`) compiles the shapes that bound its memory (the largest
backbone, the logits and every sampler variant at the largest request bucket) for the
target and reports params + KV cache + temporaries against the chip's HBM, and the largest
cache that would fit beside them. The chunk threshold is left out: it changes no program.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from jaxserve.worker.compile_plan import CompilePlan, ShapeKey

# The knobs whose values change the compiled programs or the HBM they need.
MEMORY_KNOBS = ("max_num_batched_tokens", "max_num_seqs", "kv_cache_memory_gb", "num_pages")


@dataclasses.dataclass(frozen=True)
class FitResult:
    settings: dict[str, Any]
    fits: bool
    verdict: str
    total_bytes: int | None = None
    capacity_bytes: int | None = None
    temp_bytes: int | None = None
    max_num_pages: int | None = None
    seconds: float = 0.0


def bounding_shapes(plan: CompilePlan) -> list[str]:
    """The planned shapes with the largest temporaries: the biggest token bucket's backbone,
    and the logits and sampler variants of the biggest request bucket."""
    rows = max(plan.request_buckets)
    keys = [ShapeKey("backbone", max(plan.token_buckets)), ShapeKey("logits", rows)]
    keys += [ShapeKey("head", rows, f) for f in plan.sampler_variants]
    return [k.name for k in keys]


def candidates(space: dict[str, list]) -> list[dict[str, Any]]:
    """Every combination of the memory knobs' values (in the order given)."""
    knobs = [k for k in MEMORY_KNOBS if k in space]
    return [dict(zip(knobs, values)) for values in itertools.product(*(space[k] for k in knobs))]


def check_fits(model_config: Any, config: Any, target: Any, space: dict[str, list],
               on_result: Callable[[FitResult], None] | None = None) -> list[FitResult]:
    """One compile-planner run per candidate; a candidate that cannot even be configured
    (or whose shapes fail to compile) is reported as not fitting, with the reason."""
    from jaxserve.compilation.aot import compile_for_target

    results = []
    for settings in candidates(space):
        try:
            cfg = dataclasses.replace(config, **settings).with_platform_defaults(target.platform)
            plan = CompilePlan.from_config(cfg, swap_enabled=False, platform=target.platform)
            report = compile_for_target(model_config, cfg, target, shapes=bounding_shapes(plan))
            result = FitResult(settings, report.fits, report.verdict(), report.total_bytes, report.capacity_bytes,
                               report.temp_bytes, report.max_num_pages, round(report.wall_seconds, 1))
        except ValueError as e:
            result = FitResult(settings, False, f"cannot configure: {e}")
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def format_fit(r: FitResult) -> str:
    knobs = " ".join(f"{k}={v}" for k, v in r.settings.items())
    if r.total_bytes is None:
        return f"{knobs:<60} {r.verdict}"
    cap = f"{r.capacity_bytes / 2**30:.2f}" if r.capacity_bytes else "host"
    pages = "-" if r.max_num_pages is None else str(r.max_num_pages)
    return (f"{knobs:<60} {'fits' if r.fits else 'DOES NOT FIT':>12}  {r.total_bytes / 2**30:7.2f} of {cap} GiB  "
            f"temps {r.temp_bytes / 2**20:8.1f} MiB  largest --num-pages {pages:>8}  ({r.seconds:.0f} s)")
