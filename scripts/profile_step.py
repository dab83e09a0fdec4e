"""Where a CPU engine step's time goes: XLA's per-thunk trace of chosen steps, by operation.

Runs the embedded SmolLM2 (or `--model`) with the given engine options, brings the batch to
the state asked for, then records a few steps under `jax.profiler` and sums each XLA:CPU
thunk's time (a fusion, a dot, a custom call such as the native matmul or attention kernel)
over the recorded steps. Thunks of one kind are grouped by what they compute: the fusion's
name is XLA's, so the table also prints the largest thunks by their own names.

Workloads:
  decode1   one request decoding (batch 1): the steps after its prefill;
  mixed     `--decodes` requests decoding plus prompts that fill the rest of a
            `--budget`-token step (the default, 32 decodes in a 2048-token step, is the
            "2048-token mixed step"): one such step per repeat, its prefill prompts fresh;
  uniform   `--decodes` requests decoding together.

    .venv/bin/python scripts/profile_step.py --workload mixed [--dtype float32]
        [--quantization int8] [--repeats 5] [--top 25]

Figures are medians over the recorded steps of ms per step; `host + dispatch` is the step's
wall time outside the executable's thunks (scheduling, input building, launch, sampling
host work). Profiling adds some overhead per thunk (~1-2 us); compare runs of this script
with each other, not with bench_throughput's step times.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

# Thunks that wrap others or are the runtime's own bookkeeping, not work of their own.
_WRAPPERS = re.compile(r"^(PjitFunction|CommonPjRt|SlinkyThreadPool|AllocateOutput|Handle input|ParseArguments|"
                       r"PythonRefManager|end: |\$|ThunkExecutor|TfrtCpu|PjRt|Execute|Await)")


def op_kind(name: str) -> str:
    """A thunk's group: the native kernels by their call target, XLA's own by op kind."""
    n = name.lower()
    for key, label in (("attention", "attention kernel (native)"), ("ragged", "attention kernel (native)"),
                       ("quantized_matmul", "matmul (native)"), ("dense_matmul", "matmul (native)"),
                       ("kv_write", "KV write (native)"), ("kv_cache", "KV write (native)"),
                       ("custom-call", "other custom call"), ("ynn", "XLA dot (YNNPACK)"),
                       ("dot", "XLA dot"), ("scatter", "scatter"), ("gather", "gather"),
                       ("while", "loop control"), ("sort", "sort / top-k"), ("reduce", "reduction fusion"),
                       ("copy", "copy"), ("fusion", "elementwise fusion"), ("convert", "elementwise fusion")):
        if key in n:
            return label
    return "other"


def custom_call_targets(engine) -> dict[tuple[str, str], str]:
    """(HLO module, instruction) -> custom-call target, from the engine's compiled programs: a
    native kernel's thunk is named `ffi_call.N` in the trace."""
    out: dict[tuple[str, str], str] = {}
    for exe in engine.runner.executables.values():
        for one in exe if isinstance(exe, tuple) else (exe,):
            try:
                text = one.as_text()
            except Exception:  # noqa: BLE001 - a program without text (loaded serialized) is skipped
                continue
            module = re.search(r"HloModule (\S+?),", text)
            for m in re.finditer(r"%?([\w.\-]+) = [^\n]*custom_call_target=\"([^\"]+)\"", text):
                out[(module.group(1) if module else "", m.group(1))] = m.group(2)
    return out


def thunk_times(trace_dir: str, targets: dict[tuple[str, str], str]) -> tuple[dict[str, float], float]:
    """name -> summed exclusive microseconds of the executables' thunks (a loop's own time
    without the thunks of its body), and the executions' summed span. A custom call is named
    by its target."""
    path = glob.glob(os.path.join(trace_dir, "**", "*.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
        data = json.load(f)
    events = [e for e in (data["traceEvents"] if isinstance(data, dict) else data) if e.get("ph") == "X"]
    span = sum(e.get("dur", 0) for e in events if "ExecuteHelper" in e.get("name", ""))
    # XLA:CPU runs thunks on its client's and its intra-op pool's threads (tf_XLA...); the
    # Python thread only dispatches and waits.
    by_thread: dict[object, list[dict]] = collections.defaultdict(list)
    for e in events:
        by_thread[e.get("tid")].append(e)
    times: dict[str, float] = collections.defaultdict(float)
    for evs in by_thread.values():
        if any(e["name"].startswith("$") for e in evs):
            continue
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[list] = []  # [end, name, exclusive]
        for e in evs:
            ts, dur = e["ts"], e.get("dur", 0)
            _close(stack, ts, times)
            if stack and not _WRAPPERS.match(stack[-1][1]):
                stack[-1][2] -= dur  # the parent's exclusive time loses its child's
            name = e["name"]
            target = targets.get((e.get("args", {}).get("hlo_module", ""), name))
            stack.append([ts + dur, f"{target} ({name})" if target else name, dur])
        _close(stack, float("inf"), times)
    return times, span


def _close(stack: list[list], upto: float, times: dict[str, float]) -> None:
    """Pops the open events that ended by `upto`, adding their exclusive time."""
    while stack and stack[-1][0] <= upto:
        _, name, excl = stack.pop()
        if not _WRAPPERS.match(name):
            times[name] += excl


def build(args):
    from jaxserve import LLM

    kwargs = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget, dtype=args.dtype,
                  quantization=None if args.quantization == "none" else args.quantization,
                  kv_cache_dtype=args.kv_cache_dtype, quantize_lm_head=args.quantize_lm_head,
                  enable_prefix_caching=False)
    if args.model:
        kwargs["model"] = args.model
    llm = LLM(warmup=False, **kwargs)
    llm.warmup(progress=False)
    return llm


def add(engine, rng, n_prompt: int, max_tokens: int, rid: str) -> None:
    from jaxserve import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_prompt(None, sp, prompt_token_ids=rng.integers(1000, 40000, size=n_prompt).tolist(), request_id=rid)


def record(engine, steps: int, trace_dir: str, targets: dict[tuple[str, str], str]) -> tuple[list[float], dict[str, float], float, list[int]]:
    import jax

    walls, padded = [], []
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python events would add their own overhead to the host part
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True, profiler_options=options):
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
            padded.append(engine.last_step.padded_tokens)
    times, span = thunk_times(trace_dir, targets)
    return walls, times, span, padded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("decode1", "mixed", "uniform"), default="mixed")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantize-lm-head", action="store_true")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--decodes", type=int, default=32, help="requests decoding (mixed, uniform)")
    ap.add_argument("--prompt-len", type=int, default=1000, help="each prefill prompt's length (mixed)")
    ap.add_argument("--repeats", type=int, default=5, help="steps recorded")
    ap.add_argument("--top", type=int, default=20, help="largest thunks listed by name")
    args = ap.parse_args()

    import jax

    llm = build(args)
    engine = llm.engine
    rng = np.random.default_rng(0)
    n_dec = 1 if args.workload == "decode1" else args.decodes
    for i in range(n_dec):
        add(engine, rng, 100, 3000, f"d{i}")
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    targets = custom_call_targets(engine)
    per_step: list[dict[str, float]] = []
    walls, spans, padded = [], [], []
    for rep in range(args.repeats):
        if args.workload == "mixed":
            left = args.budget - n_dec
            k = 0
            while left > 0:  # prompts whose first chunks fill the step's budget
                add(engine, rng, args.prompt_len, 1, f"p{rep}-{k}")
                left -= args.prompt_len
                k += 1
        with tempfile.TemporaryDirectory() as td:
            w, times, span, pad = record(engine, 1, td, targets)
        walls += w
        spans.append(span)
        padded += pad
        per_step.append(times)
        if args.workload == "mixed":  # finish the prompts so the next repeat starts alike
            while len(engine.scheduler.running) > n_dec or engine.scheduler.waiting:
                engine.step()
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * len(per_step))
    names: dict[str, list[float]] = collections.defaultdict(lambda: [0.0] * len(per_step))
    for i, times in enumerate(per_step):
        for name, us in times.items():
            kinds[op_kind(name)][i] += us / 1e3
            names[name][i] += us / 1e3
    wall_ms = statistics.median(walls) * 1e3
    thunk_ms = [sum(t.values()) / 1e3 for t in per_step]
    print(f"{args.workload}: {len(walls)} steps recorded, padded tokens {sorted(set(padded))}, "
          f"dtype {engine.dtype}, quantization {args.quantization}, kv {args.kv_cache_dtype}; "
          f"jax {jax.__version__}")
    print(f"step wall median {wall_ms:.2f} ms; thunks {statistics.median(thunk_ms):.2f} ms; "
          f"executions {statistics.median(spans) / 1e3:.2f} ms")
    print(f"\n{'group':36s} {'ms/step':>9s} {'share':>7s}")
    rows = sorted(((statistics.median(v), k) for k, v in kinds.items()), reverse=True)
    for ms, k in rows:
        print(f"{k:36s} {ms:9.2f} {100 * ms / wall_ms:6.1f}%")
    other = wall_ms - statistics.median(thunk_ms)
    print(f"{'host + dispatch (outside thunks)':36s} {other:9.2f} {100 * other / wall_ms:6.1f}%")
    print(f"\nlargest thunks ({args.top}):")
    for ms, k in sorted(((statistics.median(v), k) for k, v in names.items()), reverse=True)[: args.top]:
        print(f"  {k[:70]:70s} {ms:8.3f} ms  [{op_kind(k)}]")


if __name__ == "__main__":
    main()
