"""Gemma 4's config read as transformers reads it, what it cannot serve refused by name, and its
two K/V pools compiled for a TPU. (Greedy parity, chunked prefill, prefix hits, the MoE
block and TP/EP: test_model_families; the dense 5:1 pattern's logits: test_model_parity.)"""

from __future__ import annotations

import pytest

from jaxserve.models.config import ModelConfig, UnsupportedModelError

transformers = pytest.importorskip("transformers")


def _text_config(**overrides) -> dict:
    """transformers' default Gemma 4 text config (2304 wide, 30 layers, 5:1 sliding / full),
    as a multimodal checkpoint's config.json nests it."""
    text = transformers.Gemma4TextConfig(**overrides).to_dict()
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
            "eos_token_id": [1, 106]}


def test_gemma4_config_two_attention_kinds():
    cfg = ModelConfig.from_hf_config(_text_config(hidden_size_per_layer_input=0, attention_k_eq_v=True,
                                                  num_global_key_value_heads=2))
    assert (cfg.architecture, cfg.num_layers, cfg.head_dim, cfg.global_head_dim) == ("gemma4", 30, 256, 512)
    assert (cfg.num_kv_heads, cfg.global_num_kv_heads, cfg.attention_k_eq_v) == (4, 2, True)
    assert cfg.windows()[:6] == (512, 512, 512, 512, 512, 0) and cfg.global_rotary_fraction == 0.25
    assert cfg.eos_token_id == 1 and cfg.sm_scale == 1.0 and cfg.tie_word_embeddings


def test_gemma4_e_config_per_layer_inputs_and_shared_kv():
    cfg = ModelConfig.from_hf_config(_text_config(num_kv_shared_layers=12, use_double_wide_mlp=True))
    assert (cfg.per_layer_input_size, cfg.per_layer_vocab_size) == (256, 262144)
    assert (cfg.num_kv_shared_layers, cfg.double_wide_mlp) == (12, True)


@pytest.mark.parametrize("overrides, message", [
    ({"num_kv_shared_layers": 10}, "num_kv_shared_layers=10: not whole repeats of its 6-layer pattern"),
    ({"num_hidden_layers": 4,
      "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]},
     "do not repeat"),
])
def test_gemma4_features_not_served_yet_are_refused_by_name(overrides, message):
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_config(_text_config(**overrides))


@pytest.mark.usefixtures("no_persistent_cache_writes")
def test_gemma4_step_compiles_for_tpu_with_both_kv_pools(tmp_path):
    """Both attention kinds (256-wide sliding heads, 512-wide full heads) through the Mosaic
    kernel, their pools read in place, on one v6e in bf16 (abstract weights)."""
    import json

    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    path = tmp_path / "config.json"
    path.write_text(json.dumps(_text_config(hidden_size_per_layer_input=0)))  # (per-layer inputs: CPU-tested)
    mc = load_model_config(str(path))
    settings = dict(max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16,), num_pages=256,
                    max_model_len=2048, dtype="bfloat16")
    report = compile_for_target(mc, EngineConfig(**settings), Target.parse("tpu:v6e-1"), shapes=["backbone[T=16]"])
    backbone = report.shapes[0]
    assert backbone.compiled, backbone.error
    assert backbone.attention == "pallas" and report.attention[0] == "pallas"
    assert report.fits, report.verdict()
    assert backbone.cache_copies == 0
    # Known, reported: XLA:TPU relays out the sliding layers' fused qkv [2304, 4096] into VMEM
    # (S(1), transposed tiling) once per sliding layer; every other weight is read in place.
    assert backbone.weight_copies <= 1
