#!/usr/bin/env python
"""MTP speculative decoding on this CPU: what DeepSeek's multi-token-prediction layer costs per
step, and what a step gains when its drafts are kept.

A random DeepSeek-V3-shaped checkpoint (`--layers` decoder layers plus one MTP layer, smaller
widths than the real model so a CPU runs it) is served three ways on the same requests (B
sequences, greedy, EOS ignored), median of `--rounds`:

  plain    no speculation;
  mtp      `speculative_config={"method": "mtp", "num_speculative_tokens": k}`: the MTP passes
           run after every step; with random weights its drafts are almost never kept, so this
           is the layer's pure cost;
  kept     the same engine, its proposer handed the plain run's own continuation as drafts
           (every draft kept: the ceiling a well-trained MTP layer approaches), with the MTP
           passes still running, so the cost side is real.

No trained MTP weights are at hand offline: the acceptance a real checkpoint reaches is not
measured here. Prints output tokens/s of each and the ratios to plain.

    .venv/bin/python scripts/bench_mtp.py [--layers 8] [--hidden 1024] [--batch 8] [--k 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def save_checkpoint(path: str, layers: int, hidden: int, vocab: int) -> None:
    """A random DeepseekV3 with `layers` layers and an MTP layer (layer `layers`)."""
    import numpy as np
    import torch
    import transformers
    from safetensors.numpy import load_file, save_file

    cfg = transformers.DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers + 1,
        num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=256, q_lora_rank=384, qk_rope_head_dim=32,
        qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=32, n_shared_experts=1, moe_intermediate_size=hidden // 4,
        num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    model.save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    rng = np.random.default_rng(0)
    prefix = f"model.layers.{layers}."
    tensors.update({prefix + "enorm.weight": np.ones(hidden, np.float32),
                    prefix + "hnorm.weight": np.ones(hidden, np.float32),
                    prefix + "shared_head.norm.weight": np.ones(hidden, np.float32),
                    prefix + "eh_proj.weight": (0.02 * rng.standard_normal((hidden, 2 * hidden))).astype(np.float32)})
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(path, "config.json")))
    config.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    json.dump(config, open(os.path.join(path, "config.json"), "w"))


def run(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    from jaxserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import numpy as np
    from bench_mla import cpu_name  # (this directory's: the CPU's name and matrix units)

    from jaxserve import LLM

    tmp = tempfile.mkdtemp()
    save_checkpoint(tmp, args.layers, args.hidden, args.vocab)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, args.vocab, args.prompt_len).tolist() for _ in range(args.batch)]
    settings = dict(model=tmp, dtype="float32", max_num_seqs=2 * args.batch, max_num_batched_tokens=256,
                    max_model_len=args.prompt_len + args.max_tokens + 8, structured_outputs=False,
                    compilation_cache_dir=None)
    plain = LLM(**settings)
    mtp = LLM(**settings, speculative_config={"method": "mtp", "num_speculative_tokens": args.k,
                                              "disable_by_batch_size": None})
    _, truth = run(plain, prompts, args.max_tokens)
    history = {tuple(p): p + t for p, t in zip(prompts, truth)}
    propose = mtp.engine.proposer.propose

    def kept_drafts(candidates):
        propose(candidates)  # (the MTP passes already ran in the step; this reads their drafts)
        out = {}
        for c in candidates:
            full = next(h for p, h in history.items() if list(c.token_ids[: len(p)]) == list(p))
            n = len(c.token_ids)
            out[c.request_id] = full[n : n + c.max_drafts]
        return {r: d for r, d in out.items() if d}

    rates: dict[str, list[float]] = {"plain": [], "mtp": [], "kept": []}
    accept: dict[str, float] = {}
    for _ in range(args.rounds):
        rates["plain"].append(run(plain, prompts, args.max_tokens)[0])
        for name in ("mtp", "kept"):
            mtp.engine.proposer.propose = kept_drafts if name == "kept" else propose
            before = mtp.engine.spec_decode.num_accepted_tokens, mtp.engine.spec_decode.num_draft_tokens
            rate, outs = run(mtp, prompts, args.max_tokens)
            assert outs == truth, f"{name}: outputs differ from the plain engine's"
            rates[name].append(rate)
            acc = mtp.engine.spec_decode.num_accepted_tokens - before[0]
            drafted = mtp.engine.spec_decode.num_draft_tokens - before[1]
            accept[name] = acc / max(drafted, 1)
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; DeepSeek-V3-shaped, {args.layers} layers + MTP, "
          f"hidden {args.hidden}, batch {args.batch}, k={args.k}, {args.prompt_len} -> {args.max_tokens} tokens")
    base = statistics.median(rates["plain"])
    for name, r in rates.items():
        med = statistics.median(r)
        extra = f", drafts kept {accept[name]:.0%}" if name in accept else ""
        print(f"  {name:6s} {med:8.1f} tok/s  {med / base:5.2f}x plain{extra}")


if __name__ == "__main__":
    main()
