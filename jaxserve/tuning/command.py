"""`jaxserve tune`: the scheduler's knobs tuned on the user's own traffic.

    jaxserve tune --trace requests.jsonl --goal ttft-p99=2s --budget 10m
    jaxserve tune --num-prompts 96 --random-input-len 256 --random-output-len 128 \\
        --request-rate 4 --goal throughput --max-num-seqs-values 32,64,128

One engine is built per candidate (the weights are loaded once and shared), warmed up (the
persistent compilation cache makes repeated shapes cheap), and the workload replayed on it in
this process (`replay.py`); the search and the goal are in `search.py`. It prints one line
per candidate, then the flags to use (or, when no candidate meets the goal, the closest).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import re
import sys
import time
from typing import Any

from jaxserve.config.engine_args import add_engine_args, engine_config_from_args
from jaxserve.tuning.replay import ReplayReport, StepCostClock, WallClock, replay
from jaxserve.tuning.search import Goal, Trial, coordinate_search, recommend
from jaxserve.tuning.workload import TraceRequest, load_trace, random_workload


def parse_duration(text: str) -> float:
    """`90`, `90s`, `10m`, `1h` -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(s|m|h)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"a duration like 90s, 10m or 1h, got {text!r}")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]


def _values(kind: type):
    def parse(text: str) -> list:
        try:
            return [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"a comma-separated list of {kind.__name__}s, got {text!r}") from None

    return parse


def add_tune_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    w = p.add_argument_group("workload")
    w.add_argument("--trace", help="JSONL of requests (arrival_s, prompt_token_ids or prompt, max_tokens)")
    w.add_argument("--num-prompts", type=int, default=64)
    w.add_argument("--random-input-len", type=int, default=256)
    w.add_argument("--random-output-len", type=int, default=128)
    w.add_argument("--random-prefix-len", type=int, default=0, help="a shared prefix before each random prompt")
    w.add_argument("--random-num-prefixes", type=int, default=1)
    w.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    w.add_argument("--time-scale", type=float, default=1.0, help="stretch (>1) or compress (<1) arrival times")
    s = p.add_argument_group("search")
    s.add_argument("--goal", type=Goal.parse, default=Goal("throughput"),
                   help="throughput | ttft-p99=2s | tpot-p50=50ms | (ttft|tpot|e2e)-(p50|p99)=LIMIT")
    s.add_argument("--budget", type=parse_duration, default=600.0, help="time for the whole search (10m, 1h)")
    s.add_argument("--max-num-batched-tokens-values", type=_values(int), default=None)
    s.add_argument("--long-prefill-token-threshold-values", type=_values(int), default=None)
    s.add_argument("--max-num-seqs-values", type=_values(int), default=None)
    s.add_argument("--kv-cache-memory-gb-values", type=_values(float), default=None)
    s.add_argument("--num-pages-values", type=_values(int), default=None)
    s.add_argument("--clock", choices=["wall", "step-cost"], default="wall",
                   help="step-cost: simulated time from each step's padded tokens and rows (a quick what-if)")
    s.add_argument("--no-tune-warmup", dest="tune_warmup", action="store_false",
                   help="do not warm each candidate up first (its first steps then include compiles)")
    s.add_argument("--target", help="a dry run for a TPU/GPU (tpu:v5e-1, gpu:h100, ...): compile-plan each "
                   "candidate and say whether it fits the chip's HBM, instead of replaying the workload")
    s.add_argument("--model-config", help="with --target: an HF config.json to plan from without weights")
    s.add_argument("--plot", help="PNG of the trade-off, the recommendation marked")
    s.add_argument("--json", dest="json_out", help="write every trial as JSON")


def search_space(ns: argparse.Namespace, base: dict[str, Any]) -> dict[str, list]:
    """The values given, else a neighbourhood of the base settings (halved and doubled)."""
    budget, seqs = base["max_num_batched_tokens"], base["max_num_seqs"]
    space = {
        "max_num_batched_tokens": ns.max_num_batched_tokens_values or [max(16, budget // 2), budget, budget * 2],
        "long_prefill_token_threshold": ns.long_prefill_token_threshold_values or [0, max(16, budget // 4)],
        "max_num_seqs": ns.max_num_seqs_values or [max(1, seqs // 2), seqs, seqs * 2],
    }
    if ns.kv_cache_memory_gb_values:
        space["kv_cache_memory_gb"] = ns.kv_cache_memory_gb_values
    if ns.num_pages_values:
        space["num_pages"] = ns.num_pages_values
    return space


def workload(ns: argparse.Namespace, vocab_size: int) -> list[TraceRequest]:
    if ns.trace:
        return load_trace(ns.trace)
    return random_workload(ns.num_prompts, ns.random_input_len, ns.random_output_len, ns.request_rate, vocab_size,
                           seed=ns.seed, prefix_len=ns.random_prefix_len, num_prefixes=ns.random_num_prefixes)


def make_evaluator(config: Any, loaded: Any, trace: list[TraceRequest], *, clock: str = "wall",
                   time_scale: float = 1.0, warmup: bool = True):
    """settings -> ReplayReport: a fresh engine with those settings on the shared weights."""
    from jaxserve.engine.llm_engine import Engine

    def evaluate(settings: dict[str, Any]) -> ReplayReport:
        cfg = dataclasses.replace(config, **settings)  # ValueError for settings that do not go together
        engine = Engine(cfg, loaded=loaded)
        try:
            if warmup:
                engine.warmup()
            return replay(engine, trace, StepCostClock() if clock == "step-cost" else WallClock(), time_scale)
        finally:
            engine.close()
            del engine
            gc.collect()

    return evaluate


def format_trial(t: Trial) -> str:
    knobs = " ".join(f"{k}={v}" for k, v in t.settings.items())
    if t.skipped:
        return f"{knobs:<70} skipped (budget spent)"
    if t.report is None:
        return f"{knobs:<70} cannot run: {t.error}"
    r = t.report
    return (f"{knobs:<70} {r.output_throughput:8.1f} tok/s  TTFT {r.ttft_p50 * 1e3:7.0f}/{r.ttft_p99 * 1e3:7.0f} ms  "
            f"TPOT {r.tpot_p50 * 1e3:6.1f}/{r.tpot_p99 * 1e3:6.1f} ms  E2E p50 {r.e2e_p50:6.2f} s  "
            f"preempt {r.preemptions:4d}  prefix hit {100 * r.prefix_hit_rate:5.1f}%  ({t.seconds:.0f} s)")


def flags(settings: dict[str, Any]) -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings.items())


def cmd_tune_target(ns: argparse.Namespace) -> int:
    """The `--target` dry run: every candidate's HBM plan on the target (target_check.py)."""
    from jaxserve.compilation.targets import Target
    from jaxserve.loading import load_model_config
    from jaxserve.tuning.target_check import check_fits, format_fit

    target = Target.parse(ns.target)
    config = engine_config_from_args(ns).with_platform_defaults(target.platform)
    model_config = load_model_config(ns.model_config or config.model)
    space = search_space(ns, {k: getattr(config, k) for k in ("max_num_batched_tokens", "max_num_seqs")})
    print(f"dry run for {target.name}: each candidate's largest shapes compiled, its HBM plan checked "
          "(latency needs the device: run `jaxserve tune` there)")
    results = check_fits(model_config, config, target, space, on_result=lambda r: print(format_fit(r), flush=True))
    fitting = [r for r in results if r.fits]
    print(f"\n{len(fitting)} of {len(results)} candidates fit {target.name}")
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    return 0 if len(fitting) == len(results) else 4


def cmd_tune(ns: argparse.Namespace) -> int:
    from jaxserve.engine.llm_engine import Engine

    if ns.target:
        return cmd_tune_target(ns)
    config = engine_config_from_args(ns)
    print("loading the model ...", file=sys.stderr)
    first = Engine(config)  # loads the weights once; the candidates share them
    loaded, vocab = first.model, first.model_config.vocab_size
    config = first.config  # the platform's scheduling defaults filled in
    first.close()
    del first
    gc.collect()
    trace = workload(ns, vocab)
    base = {k: getattr(config, k) for k in ("max_num_batched_tokens", "long_prefill_token_threshold",
                                             "max_num_seqs")}
    space = search_space(ns, base)
    for k in space:
        base.setdefault(k, getattr(config, k))
    print(f"{len(trace)} requests, goal {ns.goal}, budget {ns.budget:.0f} s; header: settings, output tok/s, "
          "TTFT p50/p99, TPOT p50/p99, E2E p50, preemptions, prefix hit rate, seconds spent")
    evaluate = make_evaluator(config, loaded, trace, clock=ns.clock, time_scale=ns.time_scale,
                              warmup=ns.tune_warmup)
    trials = coordinate_search(base, space, evaluate, ns.goal, ns.budget,
                               on_trial=lambda t: print(format_trial(t), flush=True))
    chosen, best = recommend(trials, ns.goal)
    if chosen is not None:
        print(f"\nrecommended for {ns.goal}: {flags(chosen.settings)}")
    elif best is not None:
        print(f"\nno candidate meets {ns.goal}; the closest: {flags(best.settings)} "
              f"({ns.goal.metric} {best.report.metric(ns.goal.metric) * 1e3:.0f} ms)")
    else:
        print("\nno candidate could run")
    if ns.plot:
        from jaxserve.tuning.plot import save_tradeoff_plot

        print(save_tradeoff_plot(ns.plot, trials, ns.goal, chosen, best))
    if ns.json_out:
        with open(ns.json_out, "w") as f:
            json.dump({"goal": str(ns.goal), "recommended": chosen.settings if chosen else None,
                       "trials": [{"settings": t.settings, "skipped": t.skipped, "error": t.error,
                                   "seconds": t.seconds,
                                   "report": dataclasses.asdict(t.report) if t.report else None} for t in trials]},
                      f, indent=1)
    return 0 if chosen is not None else 3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_tune_args(p)
    t0 = time.perf_counter()
    rc = cmd_tune(p.parse_args(argv))
    print(f"# {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return rc
