#!/usr/bin/env python
"""N-gram speculative decoding against the plain engine, same process, same weights.

Two engines on the embedded SmolLM2 (warmed up, same settings, one with
`speculative_config={"method": "ngram", ...}`) run, alternately, the same requests:

- `copy`: chat prompts that ask to repeat or lightly edit a given text (code, a list, a
  paragraph), where the answer copies much of the prompt;
- `random`: prompts of random tokens (nothing to copy), greedy, EOS ignored (a small model's
  greedy output from noise soon repeats itself, which prompt lookup catches);
- `sampled`: the same prompts, sampled at temperature 1 with a seed per request, EOS
  ignored (seldom repeats: the drafts' cost when they rarely match);

at batch 1 (requests one after another) and at batch B (B requests at once), at most
`--max-tokens` tokens (the copy answers end at EOS, after the copy). Prints output tokens/s of each (median of the
rounds), the ratio, and the drafts' acceptance; then the proposer's own time per step at 64
sequences with 2,000-token histories.

    .venv/bin/python scripts/bench_spec_decode.py [--k 4] [--batch 64] [--rounds 3] \\
        [--quantization int8] [--max-tokens 96] [--draft-layers 8]

With `--draft-layers N` a third engine drafts with a draft model: the target's first N layers
(no small model with SmolLM2's tokenizer is at hand offline; a truncated copy is one).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxserve.config.engine_config import EngineConfig  # noqa: E402
from jaxserve.engine.input_processor import apply_chat_template  # noqa: E402
from jaxserve.engine.llm_engine import Engine  # noqa: E402
from jaxserve.loading import load_model  # noqa: E402
from jaxserve.spec_decode.ngram import NgramProposer  # noqa: E402
from scheduler import DraftCandidate, SamplingParams  # noqa: E402

TEXTS = [
    "def mean(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs)\n\n"
    "def variance(xs):\n    m = mean(xs)\n    return sum((x - m) ** 2 for x in xs) / len(xs)\n",
    "Shopping list: apples, bananas, carrots, dates, eggs, flour, grapes, honey, ice cream, jam, "
    "kale, lemons, milk, noodles, oranges, pears.",
    "The meeting is moved from Monday at 10 am to Tuesday at 2 pm in room 4B. Please bring the "
    "quarterly report, the budget draft and your laptop. Lunch will be provided after the meeting.",
    "<ul>\n  <li>Home</li>\n  <li>About us</li>\n  <li>Products</li>\n  <li>Contact</li>\n</ul>\n",
]
ASKS = ["Repeat the following text exactly, with nothing else:\n\n{}",
        "Rewrite the following text, changing as little as possible and fixing nothing:\n\n{}"]


def copy_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        msg = ASKS[i % 2].format(TEXTS[i % len(TEXTS)])
        out.append(apply_chat_template(tokenizer, [{"role": "user", "content": msg}], True))
    return out


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab, length).tolist() for _ in range(n)]


def run(engine: Engine, prompts: list[list[int]], max_tokens: int, batch: int, workload: str = "random",
        ) -> tuple[float, int]:
    """Wall seconds and output tokens for the prompts, `batch` at a time."""
    engine.reset_prefix_cache()
    out_tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        for j, p in enumerate(prompts[i : i + batch]):
            engine.add_prompt(None, workload_params(workload, max_tokens, i + j), prompt_token_ids=p)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out_tokens += len(o.outputs[0].token_ids)
    return time.perf_counter() - t0, out_tokens


def workload_params(workload: str, max_tokens: int, index: int) -> SamplingParams:
    """copy: greedy, ending at EOS; random: greedy, EOS ignored; sampled: temperature 1 with
    a seed per request, EOS ignored (the output seldom repeats itself)."""
    if workload == "sampled":
        return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=index, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=workload != "copy")


def layer_draft(hf_dir: str, num_layers: int, out_root: str) -> str:
    """An HF directory holding the model's first `num_layers` layers (and its embedding, final
    norm and head): a draft with the target's tokenizer, no training needed, weak but cheap."""
    from safetensors.numpy import load_file, save_file

    out = os.path.join(out_root, f"draft-{num_layers}")
    os.makedirs(out)
    for name in os.listdir(hf_dir):
        if name not in ("config.json", "model.safetensors"):
            shutil.copy(os.path.join(hf_dir, name), out)
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = num_layers
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    keep = {k: v for k, v in tensors.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(keep, os.path.join(out, "model.safetensors"))
    return out


def proposer_time(k: int, seqs: int = 64, length: int = 2000, calls: int = 200) -> float:
    """Median microseconds of one `propose` over `seqs` sequences, each growing by a token."""
    rng = np.random.default_rng(0)
    hist = [rng.integers(0, 2000, length).tolist() for _ in range(seqs)]
    p = NgramProposer(k, 2, 4)
    times = []
    for _ in range(calls):
        for h in hist:
            h.append(int(rng.integers(0, 2000)))
        cands = [DraftCandidate(f"r{i}", h, k) for i, h in enumerate(hist)]
        t0 = time.perf_counter()
        p.propose(cands)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batch1-prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--workloads", default="copy,random,sampled")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the platform's (128 on CPU)")
    ap.add_argument("--disable-by-batch-size", default="none",
                    help="none (drafts at every batch size: where the crossover is), auto (the default), or N")
    ap.add_argument("--batches", default=None, help="batch sizes (default: 1 and --batch)")
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="also a draft model: the target's first N layers (its own embedding, norm and head)")
    ap.add_argument("--hf-dir", default=os.path.join(ROOT, ".cache/smollm2-hf"),
                    help="the embedded model as an HF directory (scripts/make_vllm_venv.sh writes it)")
    args = ap.parse_args()

    limit = args.disable_by_batch_size
    args.disable_by_batch_size = None if limit == "none" else limit if limit == "auto" else int(limit)
    loaded = load_model(None, "float32", quantization=args.quantization)
    base = dict(max_model_len=2048, quantization=args.quantization, max_num_seqs=args.max_num_seqs)
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 4, "disable_by_batch_size": args.disable_by_batch_size}}
    tmp = tempfile.TemporaryDirectory()
    if args.draft_layers:
        specs["draft"] = {"model": layer_draft(args.hf_dir, args.draft_layers, tmp.name),
                          "num_speculative_tokens": args.k, "disable_by_batch_size": args.disable_by_batch_size}
    engines = {"plain": Engine(EngineConfig(**base), loaded=loaded)}
    engines.update({m: Engine(EngineConfig(**base, speculative_config=sp), loaded=loaded) for m, sp in specs.items()})
    for e in engines.values():
        e.warmup()
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [1, args.batch]
    tok = engines["plain"].tokenizer
    vocab = engines["plain"].model_config.vocab_size
    print(f"k={args.k}, at most {args.max_tokens} output tokens per request, {args.rounds} rounds (medians); "
          f"weights {args.quantization or 'f32'}" + (f"; draft: the first {args.draft_layers} layers" if
                                                     args.draft_layers else ""))
    print(f"{'workload':8} {'batch':>5} {'method':>6} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} "
          f"{'accept':>7} {'mean kept/step':>14}")
    for workload in args.workloads.split(","):
        for batch in batches:
            n = args.batch1_prompts if batch == 1 else batch
            prompts = (copy_prompts(tok, n) if workload == "copy" else random_prompts(vocab, n, 256, seed=batch))
            run(engines["plain"], prompts[:1], 4, 1)  # untimed: first-call costs
            rates: dict[str, list[float]] = {name: [] for name in engines}
            before = {m: engines[m].spec_decode.copy() for m in specs}
            for _ in range(args.rounds):
                for name, e in engines.items():
                    dt, toks = run(e, prompts, args.max_tokens, batch, workload)
                    rates[name].append(toks / dt)
            p = statistics.median(rates["plain"])
            for m in specs:
                c, b = engines[m].spec_decode, before[m]
                drafts, dtoks, acc = (c.num_drafts - b.num_drafts, c.num_draft_tokens - b.num_draft_tokens,
                                      c.num_accepted_tokens - b.num_accepted_tokens)
                s = statistics.median(rates[m])
                print(f"{workload:8} {batch:5d} {m:>6} {p:12.1f} {s:11.1f} {s / p:6.2f} "
                      f"{acc / dtoks if dtoks else 0:7.0%} {acc / drafts if drafts else 0:14.2f}", flush=True)
    print(f"\nn-gram proposer: {proposer_time(args.k):.0f} us per step at 64 sequences of ~2,000 tokens "
          "(median of 200 steps)")
    for e in engines.values():
        e.close()
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
