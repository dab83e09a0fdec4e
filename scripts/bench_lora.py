#!/usr/bin/env python
"""Multi-LoRA throughput against the base model, same process, same weights.

Three engines on the embedded SmolLM2 (warmed up, same settings) run, in alternating rounds,
the same batch of `--batch` requests (random prompts of `--prompt-len` tokens, `--max-tokens`
greedy tokens each, EOS ignored):

- `base`: an engine without LoRA;
- `lora-off`: an engine with `enable_lora` (max_loras slots of rank max_lora_rank) whose
  requests name no adapter (what enabling LoRA costs the base requests);
- `lora-mixed`: the same engine, the requests spread round-robin over `--adapters` random
  adapters of rank `--rank` on every target (q, k, v, o, gate, up, down).

Prints output tokens/s (median of the rounds) and each ratio to `base`; the adapters are
written into their slots in the first round (the loads are counted).

    .venv/bin/python scripts/bench_lora.py [--batch 64] [--adapters 4] [--rank 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxserve.config.engine_config import EngineConfig  # noqa: E402
from jaxserve.engine.llm_engine import Engine  # noqa: E402
from jaxserve.loading import load_model  # noqa: E402
from jaxserve.lora import LoRARequest  # noqa: E402
from jaxserve.lora.adapter import target_dims  # noqa: E402
from scheduler import SamplingParams  # noqa: E402


def write_adapter(path: str, cfg, rank: int, seed: int) -> str:
    """A random PEFT adapter (safetensors as published) on every target module."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for target, (fin, fout) in target_dims(cfg).items():
            kind = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{kind}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, fin)) / np.sqrt(fin)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((fout, rank)) * 0.01).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": list(target_dims(cfg))}, f)
    return path


def run_batch(engine: Engine, prompts, params, loras) -> tuple[float, int]:
    for p, lr in zip(prompts, loras):
        engine.add_prompt(None, params, prompt_token_ids=p, lora_request=lr)
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    loaded = load_model(None, "float32")
    common = dict(max_num_seqs=args.batch, max_num_batched_tokens=2048, max_model_len=512,
                  compilation_cache_dir=None, structured_outputs=False, max_logprobs=0)
    engines = {"base": Engine(EngineConfig(**common), loaded=loaded)}
    lora_engine = Engine(EngineConfig(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **common),
                         loaded=loaded)
    for e in (engines["base"], lora_engine):
        e.warmup()
    tmp = tempfile.mkdtemp(prefix="bench_lora_")
    adapters = [LoRARequest(f"a{i}", i + 1, write_adapter(os.path.join(tmp, f"a{i}"), loaded.config, args.rank, i))
                for i in range(args.adapters)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, args.prompt_len).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    cases = {"base": (engines["base"], [None] * args.batch),
             "lora-off": (lora_engine, [None] * args.batch),
             "lora-mixed": (lora_engine, [adapters[i % args.adapters] for i in range(args.batch)])}
    rates: dict[str, list[float]] = {k: [] for k in cases}
    run_batch(lora_engine, prompts[:args.adapters], params, adapters)  # adapters read and placed once
    for _ in range(args.rounds):
        for name, (engine, loras) in cases.items():
            seconds, tokens = run_batch(engine, prompts, params, loras)
            rates[name].append(tokens / seconds)
    base = statistics.median(rates["base"])
    print(f"batch {args.batch}, {args.adapters} adapters of rank {args.rank} on 7 targets, prompts of "
          f"{args.prompt_len} tokens, {args.max_tokens} output tokens, median of {args.rounds} rounds")
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"  {name:<11} {med:8.1f} tok/s  {med / base:5.2f}x base   rounds: "
              + " ".join(f"{x:.1f}" for x in r))
    print(f"adapter loads into slots: {lora_engine.runner.lora.num_loads}; slot memory "
          f"{lora_engine.runner.lora.nbytes / 2**20:.1f} MiB; compilations after warmup: "
          f"{lora_engine.runner.guard.compiles_after_warmup}")


if __name__ == "__main__":
    main()
