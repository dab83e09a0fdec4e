#!/usr/bin/env python
"""What batch-invariant mode costs: the default engine against `batch_invariant=True`, same
process, same weights (the embedded SmolLM2), same requests, run alternately.

Two workloads, greedy, EOS ignored:

- `batch`: `--batch` requests at once, random prompts of `--prompt-len` tokens, `--max-tokens`
  out (prefill chunks beside decodes, full token buckets);
- `single`: one request at a time (decode at batch 1).

Prints output tokens/s of each mode (median over `--rounds`) and the ratio, and checks the
invariant mode's outputs equal between the two workloads' first request (a sanity check,
not the test: tests/test_scoring.py has that).

    .venv/bin/python scripts/bench_batch_invariant.py [--batch 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--single-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.engine.llm_engine import Engine
    from jaxserve.loading import load_model
    from scheduler import SamplingParams

    loaded = load_model(None, "float32")
    engines = {}
    for name, invariant in (("default", False), ("batch_invariant", True)):
        t0 = time.perf_counter()
        e = Engine(EngineConfig(batch_invariant=invariant, max_model_len=args.prompt_len + args.max_tokens + 16),
                   loaded=loaded)
        e.warmup(progress=False)
        engines[name] = e
        print(f"{name}: warmup {time.perf_counter() - t0:.1f} s, attention {e.attention[0]}", flush=True)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, args.prompt_len).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    single = SamplingParams(max_tokens=args.single_tokens, temperature=0, ignore_eos=True)

    def run(engine, reqs) -> tuple[float, list]:
        t0 = time.perf_counter()
        ids = [engine.add_prompt(None, sp, prompt_token_ids=p) for p, sp in reqs]
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        wall = time.perf_counter() - t0
        toks = sum(len(done[i].outputs[0].token_ids) for i in ids)
        return toks / wall, [done[i].outputs[0].token_ids for i in ids]

    results: dict[str, dict[str, list[float]]] = {n: {"batch": [], "single": []} for n in engines}
    firsts = {}
    for _ in range(args.rounds):
        for name, e in engines.items():
            tps, outs = run(e, [(p, params) for p in prompts])
            results[name]["batch"].append(tps)
            tps1, outs1 = run(e, [(prompts[0], single)])
            results[name]["single"].append(tps1)
            firsts[name] = (outs[0][: args.single_tokens], outs1[0])
    print(f"\n{'workload':<10} {'default tok/s':>14} {'invariant tok/s':>16} {'ratio':>7}")
    for w in ("batch", "single"):
        d = statistics.median(results["default"][w])
        b = statistics.median(results["batch_invariant"][w])
        print(f"{w:<10} {d:>14.1f} {b:>16.1f} {b / d:>7.2f}")
    batch_out, single_out = firsts["batch_invariant"]
    print(f"\ninvariant mode: the first request's tokens in the batch equal its tokens alone: {batch_out == single_out}")


if __name__ == "__main__":
    main()
