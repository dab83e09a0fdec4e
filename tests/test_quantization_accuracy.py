"""The embedded SmolLM2 served quantized stays as close to the f32 engine as bf16 does: greedy
prefix agreement with f32 over chat prompts, for int8 weights and an int8 KV cache, is no
worse than the bf16 engine's minus 0.10 (bf16 is what every peer ships). The run is
scripts/eval_quantization.py's (same engine settings, prompts and token count), without its
teacher-forced KL; docs/quantization.md has both for every mode."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

pytestmark = pytest.mark.slow

_SCRIPT = pathlib.Path(__file__).parents[1] / "scripts" / "eval_quantization.py"
NUM_PROMPTS, MAX_TOKENS = 16, 24


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

    ev = _eval_module()
    tok = smollm.tokenizer
    prompts = [list(tok(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                tokenize=False), add_special_tokens=False)["input_ids"])
               for p in ev.PROMPTS[:NUM_PROMPTS]]
    bf16 = dataclasses.replace(smollm, dtype="bfloat16", params=jax.tree.map(
        lambda x: jnp.asarray(x, jnp.bfloat16), smollm.params))
    tokens = {}
    for mode in ("f32", "bf16", "int8", "kv-int8", "kv-fp8"):
        engine = ev.make_engine(bf16 if mode == "bf16" else smollm, ev.MODES[mode])
        try:
            tokens[mode] = ev.greedy(engine, prompts, MAX_TOKENS)
        finally:
            engine.close()
    agreement = {m: ev.prefix_agreement(tokens["f32"], t) for m, t in tokens.items()}
    print("greedy prefix agreement with f32:", agreement)
    for mode in ("int8", "kv-int8"):
        assert agreement[mode] >= agreement["bf16"] - 0.10, (mode, agreement)
    # fp8 (e4m3) pages keep 3 mantissa bits: on this model their agreement sits at about
    # bf16's minus 0.1 (docs/quantization.md), so the bar checked here is minus 0.2.
    assert agreement["kv-fp8"] >= agreement["bf16"] - 0.20, agreement
