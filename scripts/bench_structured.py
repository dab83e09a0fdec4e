"""Structured-output cost: N concurrent json_schema requests vs the same N unconstrained, one
engine, one run, alternating rounds (median of each).

Both sides generate exactly `--max-tokens` tokens per request, greedy, so the batches have
the same shapes: the unconstrained requests ignore EOS, and the schema (an array of at least
`--min-items` records) cannot be complete sooner. Prints output tokens/s of each side, the
ratio, the host time filling token bitmasks per masked step (median / p90; it overlaps the
device's layers), the grammar compile time and checks that nothing compiled in the
measured rounds.

    .venv/bin/python scripts/bench_structured.py --num-requests 64 --max-tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import Engine
from scheduler import SamplingParams

RECORD = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
    "name": {"type": "string", "maxLength": 16},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "score": {"type": "number"}}, "required": ["id", "name", "tags", "score"], "additionalProperties": False}


def run_round(engine: Engine, prompts: list[str], params: SamplingParams) -> tuple[float, int, list[float]]:
    """(seconds, output tokens, mask seconds of each masked step)."""
    for p in prompts:
        engine.add_prompt(p, params)
    tokens, masks = 0, []
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += sum(len(c.token_ids) for c in out.outputs)
        if engine.last_step.mask_s:
            masks.append(engine.last_step.mask_s)
    return time.perf_counter() - t0, tokens, masks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-items", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = args.num_requests
    engine = Engine(EngineConfig(max_num_seqs=n, max_num_batched_tokens=512, max_model_len=1024))
    schema = {"type": "array", "items": RECORD, "minItems": args.min_items}
    prompts = [f"Record set {i}: write the records as a JSON array.\n" for i in range(n)]
    free = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs={"json": schema})
    t0 = time.perf_counter()
    engine.structured.backend.prepare()  # once per engine (warmup starts it in the background)
    prepare_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    engine.input_processor.compile_grammar(constrained)
    compile_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    engine.input_processor.compile_grammar(constrained)
    cached_ms = (time.perf_counter() - t0) * 1e3
    for p in (free, constrained):  # compiles every shape the measured rounds meet
        run_round(engine, prompts, p)
    engine.runner.guard.arm()  # counts compilations from here on
    rates = {"unconstrained": [], "json_schema": []}
    masks: list[float] = []
    for _ in range(args.rounds):
        for name, p in (("unconstrained", free), ("json_schema", constrained)):
            secs, toks, m = run_round(engine, prompts, p)
            assert toks == n * args.max_tokens, (name, toks)
            rates[name].append(toks / secs)
            masks += m
    u, c = statistics.median(rates["unconstrained"]), statistics.median(rates["json_schema"])
    masks.sort()
    print(f"requests {n}, {args.max_tokens} output tokens each, greedy, {args.rounds} rounds per side")
    print(f"unconstrained  {u:8.1f} tok/s  (rounds: {', '.join(f'{r:.1f}' for r in rates['unconstrained'])})")
    print(f"json_schema    {c:8.1f} tok/s  (rounds: {', '.join(f'{r:.1f}' for r in rates['json_schema'])})")
    print(f"ratio constrained / unconstrained: {c / u:.3f}")
    print(f"bitmask fill per masked step: median {statistics.median(masks) * 1e3:.2f} ms, "
          f"p90 {masks[int(0.9 * (len(masks) - 1))] * 1e3:.2f} ms over {len(masks)} steps")
    print(f"grammar backend setup (once per engine, during warmup): {prepare_ms:.0f} ms")
    print(f"grammar compile: first request of the schema {compile_ms:.2f} ms, cached {cached_ms:.3f} ms")
    print(f"compiles in the measured rounds: {engine.runner.guard.compiles_after_warmup}")


if __name__ == "__main__":
    main()
