"""The embedded SmolLM2 served quantized stays as close to the f32 engine as bf16 does: greedy
prefix agreement with f32 over chat prompts, for int8 weights and int8 / fp8 KV caches, is no
worse than the bf16 engine's minus 0.10 (bf16 is what every peer ships). The mean KL of each
mode is printed by scripts/eval_quantization.py."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

pytestmark = pytest.mark.slow

_SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "eval_quantization.py"
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "List three prime numbers:", "Explain why the sky is blue in one sentence."]
MAX_TOKENS = 16
SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=128, token_buckets=(128,), num_pages=64, max_model_len=256,
                compilation_cache_dir=None, structured_outputs=False, max_logprobs=0)


def _eval_module():
    spec = importlib.util.spec_from_file_location("eval_quantization", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_quantized_modes_agree_with_f32_as_well_as_bf16_does(smollm):
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jaxserve.config import EngineConfig
    from jaxserve.engine import Engine

    ev = _eval_module()
    tok = smollm.tokenizer
    prompts = [list(tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)["input_ids"])
               for p in PROMPTS]
    bf16 = dataclasses.replace(smollm, dtype="bfloat16", params=jax.tree.map(
        lambda x: jnp.asarray(x, jnp.bfloat16), smollm.params))
    runs = {"f32": (smollm, {}), "bf16": (bf16, {"dtype": "bfloat16"}),
            "int8": (smollm, {"quantization": "int8"}), "kv-int8": (smollm, {"kv_cache_dtype": "int8"}),
            "kv-fp8": (smollm, {"kv_cache_dtype": "fp8"})}
    tokens = {}
    for mode, (loaded, settings) in runs.items():
        engine = Engine(EngineConfig(**SETTINGS, **settings), loaded=loaded)
        try:
            tokens[mode] = ev.greedy(engine, prompts, MAX_TOKENS)
        finally:
            engine.close()
    agreement = {m: ev.prefix_agreement(tokens["f32"], t) for m, t in tokens.items()}
    print("greedy prefix agreement with f32:", agreement)
    for mode in ("int8", "kv-int8", "kv-fp8"):
        assert agreement[mode] >= agreement["bf16"] - 0.10, (mode, agreement)
