"""n > 1 against n = 1 on the same prompt: does the engine compute the shared prompt once?

Runs, alternately and in the same process, one request with n=1 and one with n=N on a
~240-token prompt (sampling, temperature 0.8, EOS ignored), each on an empty prefix cache,
and prints the median wall time of each, their ratio, and the prompt tokens each computed.
The ratio is what to compare between commits (run both in one session on one machine).

    python scripts/bench_n_sampling.py [--n 8] [--max-tokens 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's packages

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import Engine
from scheduler import SamplingParams

PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type "
          "changed how books were made, sold and read across Europe. ") * 8


def run_once(engine: Engine, prompt_ids: list[int], n: int, max_tokens: int, seed: int) -> tuple[float, int]:
    """Wall seconds for one request and the tokens the engine computed for it."""
    engine.scheduler.reset_prefix_cache()
    params = SamplingParams(n=n, temperature=0.8, seed=seed, max_tokens=max_tokens, ignore_eos=True)
    computed = 0
    t0 = time.perf_counter()
    engine.add_prompt(None, params, prompt_token_ids=prompt_ids, request_id=f"bench-{n}-{seed}")
    while engine.has_unfinished_requests():
        engine.step()
        computed += engine.last_step.num_tokens
    return time.perf_counter() - t0, computed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    engine = Engine(EngineConfig(max_num_seqs=16, max_num_batched_tokens=512, num_pages=512, max_model_len=1024))
    engine.warmup()
    prompt_ids = engine.input_processor.encode(PROMPT)[:240]
    run_once(engine, prompt_ids, 1, 4, 0)  # first-call costs outside the timing
    run_once(engine, prompt_ids, args.n, 4, 0)
    times: dict[int, list[float]] = {1: [], args.n: []}
    computed: dict[int, int] = {}
    for r in range(args.repeats):
        for n in (1, args.n):
            dt, tokens = run_once(engine, prompt_ids, n, args.max_tokens, 100 + r)
            times[n].append(dt)
            computed[n] = tokens
    m1, mn = statistics.median(times[1]), statistics.median(times[args.n])
    print(f"prompt {len(prompt_ids)} tokens, max_tokens {args.max_tokens}, {args.repeats} repeats")
    for n, m in ((1, m1), (args.n, mn)):
        decode = n * (args.max_tokens - 1)
        print(f"  n={n:<3d} median {m * 1e3:8.1f} ms   tokens computed {computed[n]:5d} "
              f"(prompt part {computed[n] - decode})")
    print(f"  ratio n={args.n} / n=1: {mn / m1:.2f}x")


if __name__ == "__main__":
    main()
