"""Accuracy of the quantized modes against the f32 engine, on the embedded SmolLM2 (or --model).

For each mode (bf16 as the yardstick every peer ships, int8 / fp8 weights, int8 / fp8 KV
cache, and combinations) it prints:

- greedy prefix agreement with the f32 engine: per prompt, the share of the f32 engine's
  greedy tokens reproduced before the first difference, averaged over prompts;
- the mean per-token KL divergence KL(f32 || mode) of the next-token distributions, teacher
  forced on the f32 engine's greedy continuations (every position of prompt + continuation
  in one prefill, so the quantized KV cache is written and read as it is when serving).

    python scripts/eval_quantization.py [--max-tokens 32] [--modes int8,kv-int8,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
    "List three prime numbers:",
    "Translate 'good morning' into Spanish:",
    "The quick brown fox",
    "In 1969, the first person to walk on the moon was",
    "Give me a short recipe for pancakes.",
    "What is the difference between a list and a tuple in Python?",
    "Write a limerick about a cat.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "How many legs does a spider have?",
    "Suggest a name for a coffee shop.",
    "What does HTTP stand for?",
    "Describe the colour blue to someone who cannot see.",
]

# mode -> EngineConfig settings (f32 is the reference every mode is compared with)
MODES = {
    "f32": {},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
    "int8+lm-head": {"quantization": "int8", "quantize_lm_head": True},
    "kv-int8": {"kv_cache_dtype": "int8"},
    "kv-fp8": {"kv_cache_dtype": "fp8"},
    "kv-fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
    "int8+kv-int8": {"quantization": "int8", "kv_cache_dtype": "int8"},
}


@dataclasses.dataclass
class ModeResult:
    mode: str
    agreement: float  # mean greedy prefix agreement with f32, in [0, 1]
    kl: float  # mean per-token KL(f32 || mode), nats
    tokens: list[list[int]]
    seconds: float


def make_engine(loaded, settings: dict):
    from jaxserve.config import EngineConfig
    from jaxserve.engine import Engine

    return Engine(EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, num_pages=256, max_model_len=512,
                               compilation_cache_dir=None, structured_outputs=False, max_logprobs=0,
                               **settings), loaded=loaded)


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from scheduler import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_prompt(None, params, prompt_token_ids=ids, request_id=str(i))
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    return [outs[str(i)] for i in range(len(prompts))]


def position_logits(engine, ids: list[int]) -> np.ndarray:
    """[len(ids), V] f32 next-token logits at every position of `ids`, from one prefill of
    the engine's own step program (its params, KV cache dtype and attention), written into
    a copy of its cache (pages 1.. of the runner's cache are overwritten in the copy only)."""
    from jaxserve.compilation.step_programs import _backbone, _logits
    from jaxserve.models.metadata import AttentionMetadata

    r = engine.runner
    T, S = len(ids), r.page_size
    n = -(-T // S)
    if n + 1 > r.num_pages or n > r.max_pages_per_seq:
        raise ValueError(f"{T} tokens need {n} pages: raise num_pages / max_model_len")
    table = np.zeros((1, r.max_pages_per_seq), np.int32)
    table[0, :n] = np.arange(1, n + 1)
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(np.arange(T) + S, jnp.int32), cu_q_lens=jnp.asarray([0, T], jnp.int32),
        kv_lens=jnp.asarray([T], jnp.int32), block_tables=jnp.asarray(table), num_seqs=jnp.asarray([1], jnp.int32))
    backbone = jax.jit(_backbone, static_argnums=(0, 1, 2))
    h, _, _ = backbone(r.graphdef, r.attention_backend, r.mesh, r.state, r.kv_cache, jnp.asarray(ids, jnp.int32),
                       jnp.arange(T, dtype=jnp.int32), md, jnp.arange(T, dtype=jnp.int32))
    logits = jax.jit(_logits, static_argnums=(0, 1), static_argnames=("num_rows",))(
        r.graphdef, r.mesh, r.state, h, num_rows=T)
    return np.asarray(logits, np.float32)


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(p || q) per row, from logits [N, V]."""
    lp = p_logits - _logsumexp(p_logits)
    lq = q_logits - _logsumexp(q_logits)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def prefix_agreement(reference: list[list[int]], tokens: list[list[int]]) -> float:
    shares = []
    for a, b in zip(reference, tokens):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(same / max(len(a), 1))
    return float(np.mean(shares))


def evaluate(load, modes: list[str], prompts: list[list[int]], max_tokens: int) -> list[ModeResult]:
    """f32 first (the reference), then each mode: agreement and KL as the module docstring says.
    `load(dtype)` gives the model loaded in "float32" or "bfloat16"."""
    results: list[ModeResult] = []
    ref_tokens: list[list[int]] = []
    ref_logits: list[np.ndarray] = []
    for mode in ["f32", *[m for m in modes if m != "f32"]]:
        t0 = time.perf_counter()
        settings = MODES[mode]
        engine = make_engine(load(settings.get("dtype", "float32")), settings)
        try:
            tokens = greedy(engine, prompts, max_tokens)
            if mode == "f32":
                ref_tokens = tokens
            logits = [position_logits(engine, p + c)[len(p) - 1:-1] for p, c in zip(prompts, ref_tokens)]
        finally:
            engine.close()
        if mode == "f32":
            ref_logits = logits
        kl = float(np.mean(np.concatenate([kl_divergence(a, b) for a, b in zip(ref_logits, logits)])))
        results.append(ModeResult(mode, prefix_agreement(ref_tokens, tokens), kl, tokens,
                                  time.perf_counter() - t0))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--modes", default=",".join(m for m in MODES if m != "f32"))
    args = ap.parse_args()
    from jaxserve.loading import load_model

    cache: dict[str, object] = {}

    def load(dtype: str):
        if dtype not in cache:
            cache[dtype] = load_model(args.model, dtype)
        return cache[dtype]

    tok = load("float32").tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in PROMPTS[:args.prompts]]
    prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown modes {unknown}: one of {list(MODES)}")
    print(f"{len(prompts)} chat prompts, {args.max_tokens} greedy tokens each; reference: the f32 engine")
    print(f"{'mode':<16}{'agreement':>10}{'KL (nats)':>12}{'seconds':>9}")
    for r in evaluate(load, modes, prompts, args.max_tokens):
        print(f"{r.mode:<16}{r.agreement:>10.3f}{r.kl:>12.5f}{r.seconds:>9.1f}")


if __name__ == "__main__":
    main()
