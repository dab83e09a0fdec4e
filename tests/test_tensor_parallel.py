"""Tensor parallelism on 8 virtual CPU devices: same greedy tokens as TP=1, nothing compiled
after warmup, clear errors for head counts TP does not divide.

`jax_num_cpu_devices` must be set before JAX starts, so the checks run in a subprocess.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest
from logprob_checks import check_runs_close

_CHILD = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, TESTS_DIR)
    from jaxserve.loading import load_model
    from tp_greedy import greedy

    result = {}
    smol = load_model(None, "float32")
    prompts = [smol.tokenizer(p)["input_ids"] for p in ("The capital of France is", "def add(a, b):", "Hi")]
    for tp in (1, 3):
        result[f"smollm-tp{tp}"] = greedy(smol, tp, prompts)
    for arg in sys.argv[1:]:
        path, tps = arg.split("=")
        tiny = load_model(path, "float32")
        prompts = [[5, 9, 13, 2, 7], list(range(3, 40)), [1]]
        for tp in (1, *map(int, tps.split(","))):
            result[f"{path}-tp{tp}"] = greedy(tiny, tp, prompts)
    # int8 weights and KV: weight scales split with their columns, KV scales split by head
    for tp in (1, 4):
        result[f"int8-tp{tp}"] = greedy(tiny, tp, prompts, quantization="int8", kv_cache_dtype="int8")
    print(json.dumps(result))
""").replace("TESTS_DIR", repr(str(pathlib.Path(__file__).parent)))


def _tiny_model(path, num_kv_heads):
    pytest.importorskip("torch")
    from hf_reference import save_tiny_llama

    return save_tiny_llama(path, num_kv_heads)


# 8 query heads with (KV heads -> TP sizes): KV heads replicated 4x (2 KV heads at TP=8). The
# split case (tp <= Hkv) is SmolLM2's at TP=3 (3 KV heads), and 2x replication (TP=4) is
# tests/test_lora.py's TP check (base requests included).
TINY_CASES = {2: (8,)}


def test_tensor_parallel_matches_single_device(tmp_path):
    paths = {h: _tiny_model(tmp_path / f"kv{h}", h) for h in TINY_CASES}
    args = [f"{paths[h]}={','.join(map(str, tps))}" for h, tps in TINY_CASES.items()]
    res = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    # the layouts sum in other orders: tokens equal up to a near-tie (vLLM's rule)
    check_runs_close(result["smollm-tp1"], result["smollm-tp3"], name="smollm tp3")
    for h, path in paths.items():
        for tp in TINY_CASES[h]:
            check_runs_close(result[f"{path}-tp1"], result[f"{path}-tp{tp}"], name=f"{path} tp={tp}")
    check_runs_close(result["int8-tp1"], result["int8-tp4"], name="int8 tp4")
    assert all(compiles == 0 for *_, compiles in result.values())


def test_tp_that_does_not_divide_heads_is_a_clear_error(smollm):
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.engine.llm_engine import Engine
    from jaxserve.models.config import ModelConfig
    from jaxserve.worker.parallel import tp_model_config

    with pytest.raises(ValueError, match="does not divide the model's 9 attention heads"):
        Engine(EngineConfig(tensor_parallel_size=2, num_pages=16), loaded=smollm)
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=96, intermediate_size=96, num_layers=1,
                      num_heads=12, num_kv_heads=3, head_dim=8)
    with pytest.raises(ValueError, match="not a multiple of the model's 3 KV heads"):
        tp_model_config(cfg, 4)
    assert tp_model_config(cfg, 6).num_kv_heads == 6  # each KV head replicated twice
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineConfig(data_parallel_size=2)
