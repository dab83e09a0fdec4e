"""Accuracy of the quantized modes against the f32 engine, on the embedded SmolLM2 (or --model).

For each mode (bf16 as the yardstick every peer ships, int8 / fp8 weights, int8 / fp8 KV
cache, and combinations) it prints:

- greedy prefix agreement with the f32 engine: per prompt, the share of the f32 engine's
  greedy tokens reproduced before the first difference, averaged over prompts;
- teacher-forced top-1 agreement: the share of positions of the f32 engine's greedy
  continuations where the mode's most likely next token is f32's (every position of prompt +
  continuation in one prefill, so the quantized KV cache is written and read as it is when
  serving);
- the mean per-token KL divergence KL(f32 || mode) of the same next-token distributions.

Greedy prefix agreement collapses at the first near-tie, so it moves with the CPU's rounding
(an Intel Xeon and an AMD EPYC give other values for the same mode); the teacher-forced
figures judge every position on its own and stay put.

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
    top1: float  # teacher-forced share of positions whose argmax is f32's, in [0, 1]
    kl: float  # mean per-token KL(f32 || mode), nats
    tokens: list[list[int]]
    seconds: float


def make_engine(loaded, settings: dict):
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.engine.llm_engine import Engine

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
    from jaxserve.models.metadata import AttentionMetadata

    r = engine.runner
    T, S = len(ids), r.page_size
    padded = -(-T // 64) * 64  # a few shapes, so a mode compiles once or twice, not per prompt
    n = -(-padded // S)
    G = r.num_kv_groups  # a layer-grouped cache: each group's own pages and table
    W = r.max_pages_per_seq // G
    if G * n + 1 > r.num_pages or n > W:
        raise ValueError(f"{T} tokens need {G * n} pages: raise num_pages / max_model_len")
    table = np.zeros((1, G * W), np.int32)
    for g in range(G):
        table[0, g * W: g * W + n] = np.arange(1 + g * n, 1 + (g + 1) * n)
    slots = np.concatenate([np.arange(padded) + (1 + g * n) * S for g in range(G)])
    # causal: the padded tail (token 0 at the next positions) changes no real row
    md = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32), cu_q_lens=jnp.asarray([0, padded], jnp.int32),
        kv_lens=jnp.asarray([padded], jnp.int32), block_tables=jnp.asarray(table),
        num_seqs=jnp.asarray([1], jnp.int32))
    tokens = np.zeros(padded, np.int32)
    tokens[:T] = ids
    positions = jnp.arange(padded, dtype=jnp.int32)
    h, _, _ = _BACKBONE(r.graphdef, r.attention_backend, r.mesh, r.state, r.kv_cache, jnp.asarray(tokens),
                        positions, md, positions)
    logits = _LOGITS(r.graphdef, r.mesh, r.state, h, jnp.asarray(T, jnp.int32), num_rows=padded)
    return np.asarray(logits, np.float32)[:T]


def top1_agreement(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """Per row, whether the two [N, V] logits share their most likely token."""
    return p_logits.argmax(-1) == q_logits.argmax(-1)


def _jits():
    from jaxserve.worker.step_programs import _backbone, _logits

    return (jax.jit(_backbone, static_argnums=(0, 1, 2)),
            jax.jit(_logits, static_argnums=(0, 1), static_argnames=("num_rows",)))


_BACKBONE, _LOGITS = _jits()


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


def evaluate(load, modes: list[str], prompts: list[list[int]], max_tokens: int, *,
             greedy_modes: bool = True) -> list[ModeResult]:
    """f32 first (the reference), then each mode: agreement and KL as the module docstring says.
    `load(dtype)` gives the model loaded in "float32" or "bfloat16". Without `greedy_modes` only
    the f32 engine decodes (the modes' greedy prefix agreement is then nan)."""
    results: list[ModeResult] = []
    ref_tokens: list[list[int]] = []
    ref_logits: list[np.ndarray] = []
    for mode in ["f32", *[m for m in modes if m != "f32"]]:
        t0 = time.perf_counter()
        settings = MODES[mode]
        engine = make_engine(load(settings.get("dtype", "float32")), settings)
        try:
            tokens = greedy(engine, prompts, max_tokens) if greedy_modes or mode == "f32" else []
            if mode == "f32":
                ref_tokens = tokens
            logits = [position_logits(engine, p + c)[len(p) - 1:-1] for p, c in zip(prompts, ref_tokens)]
        finally:
            engine.close()
        if mode == "f32":
            ref_logits = logits
        kl = float(np.mean(np.concatenate([kl_divergence(a, b) for a, b in zip(ref_logits, logits)])))
        top1 = float(np.mean(np.concatenate([top1_agreement(a, b) for a, b in zip(ref_logits, logits)])))
        agreement = prefix_agreement(ref_tokens, tokens) if tokens else float("nan")
        results.append(ModeResult(mode, agreement, top1, kl, tokens,
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
    print(f"{'mode':<16}{'greedy prefix':>14}{'top-1 (forced)':>15}{'KL (nats)':>12}{'seconds':>9}")
    for r in evaluate(load, modes, prompts, args.max_tokens):
        print(f"{r.mode:<16}{r.agreement:>14.3f}{r.top1:>15.3f}{r.kl:>12.5f}{r.seconds:>9.1f}")


if __name__ == "__main__":
    main()
