"""Llama 4's published configs read as transformers reads them, and the patterns jaxserve cannot
serve refused by name. (Greedy parity, chunked prefill, prefix hits and TP/EP:
test_model_families; logits with Scout's all-MoE pattern: test_model_parity.)"""

from __future__ import annotations

import json
import pathlib

import pytest

from jaxserve.models.config import ModelConfig, UnsupportedModelError

DATA = pathlib.Path(__file__).parent / "data"


@pytest.mark.parametrize("name, experts, step, dense, qk_norm, rope", [
    ("scout", 16, 1, 0, True, "llama3"),
    ("maverick", 128, 2, 24, False, "default"),
])
def test_published_llama4_configs(name, experts, step, dense, qk_norm, rope):
    cfg = ModelConfig.from_hf_config(json.loads((DATA / f"llama4_{name}_config.json").read_text()))
    assert (cfg.architecture, cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok) == ("llama4", 48, experts, 1)
    assert (cfg.moe_layer_step, cfg.num_dense_layers, cfg.qk_l2_norm, cfg.rope_scaling.kind) == (step, dense, qk_norm,
                                                                                               rope)
    assert (cfg.intermediate_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (16384, 8192,
                                                                                                     8192)
    # every fourth layer NoPE and global, the others RoPE within 8192-token chunks
    assert cfg.layer_rope[:8] == (1, 1, 1, 0, 1, 1, 1, 0)
    assert cfg.layer_chunks[:4] == (8192, 8192, 8192, 0)
    assert cfg.eos_token_id == 200001 and cfg.attn_temperature_tuning


def test_llama4_moe_layers_off_the_interleave_pattern_are_refused():
    raw = json.loads((DATA / "llama4_maverick_config.json").read_text())
    raw["text_config"]["moe_layers"] = [0, 5, 9]
    with pytest.raises(UnsupportedModelError, match=r"moe_layers \[0, 5, 9\] are not every 2-th layer"):
        ModelConfig.from_hf_config(raw)
