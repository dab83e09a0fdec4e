"""Warmup compile time against the number of compile threads (`--warmup-threads`).

Each run is a fresh process that builds the engine (the embedded model unless `--model`) with
no compilation cache and no saved executables, then times `Engine.warmup()`: wall seconds,
the per-shape seconds summed and the longest shape, and the process's CPU seconds. From the
1-thread run's tracing and lowering seconds (they hold the GIL, so they stay serial) and its
CPU seconds it prints, as an estimate, what a host with more cores would take: the larger of
the GIL-bound seconds, the CPU seconds over the cores, and the longest shape.

    .venv/bin/python scripts/bench_compile_threads.py [--threads 1,2] [--repeats 1] [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import collections, json, resource, sys, time
import jax
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import Engine
threads, model = int(sys.argv[1]), sys.argv[2] or None
engine = Engine(EngineConfig(model=model, compilation_cache_dir=None, reuse_executables=False,
                             warmup_threads=threads))
durations = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(lambda event, secs, **kw: durations.update({event: secs}))
cpu0 = resource.getrusage(resource.RUSAGE_SELF)
report = engine.warmup()
cpu1 = resource.getrusage(resource.RUSAGE_SELF)
shapes = [r.seconds for r in report.records]
print(json.dumps({"wall": report.wall_seconds, "shapes": len(shapes), "sum": sum(shapes), "max": max(shapes),
                  "cpu": cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime,
                  "trace": durations["/jax/core/compile/jaxpr_trace_duration"],
                  "lower": durations["/jax/core/compile/jaxpr_to_mlir_module_duration"],
                  "backend": durations["/jax/core/compile/backend_compile_duration"]}))
engine.close()
"""


def run(threads: int, model: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(threads), model], capture_output=True, text=True,
                         timeout=1800)
    if out.returncode:
        raise SystemExit(f"warmup with {threads} threads failed:\n{out.stderr[-3000:]}")
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--model", default="")
    args = ap.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    print(f"{os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f}; model {args.model or 'embedded'}")
    walls: dict[int, float] = {}
    first: dict[int, dict] = {}
    longest = 0.0
    for t in counts:
        runs = [run(t, args.model) for _ in range(args.repeats)]
        walls[t] = statistics.median(r["wall"] for r in runs)
        r = first[t] = runs[0]
        longest = max(longest, r["max"])
        print(f"  {t} thread(s): warmup {walls[t]:.1f} s (median of {len(runs)}), {r['shapes']} shapes, "
              f"shape seconds summed {r['sum']:.1f}, longest {r['max']:.2f} s, CPU {r['cpu']:.1f} s")
    one = first.get(1)
    if one is not None and 2 in walls:
        print(f"  2 threads: {walls[1] / walls[2]:.2f}x the 1-thread wall")
    if one is not None:
        gil = one["trace"] + one["lower"]
        print(f"  1 thread: tracing {one['trace']:.1f} s + lowering {one['lower']:.1f} s (hold the GIL: "
              f"serial whatever the threads), backend compile {one['backend']:.1f} s")
        for n in (8, 32, 112):  # estimate: the GIL-bound part, or the CPU seconds spread over n cores
            est = max(gil, one["cpu"] / n, longest)
            print(f"  estimate for {n} host cores: {est:.1f} s ({walls[1] / est:.1f}x the 1-thread wall here)")


if __name__ == "__main__":
    main()
