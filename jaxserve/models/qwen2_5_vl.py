"""Qwen2.5-VL: the Qwen2 decoder (`LlamaForCausalLM`) with multimodal RoPE, fed by an image
encoder (`models/qwen_vision.py`) whose output rows replace the image placeholder tokens'
embeddings. Registered as its own family: the decoder's weights are named as Qwen2's, the
tower's (`visual.*`) are loaded beside the params (`LoadedModel.vision`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.models import llama
from jaxserve.models.config import (
    ModelConfig,
    UnsupportedModelError,
    VisionConfig,
    language_model_config,
    llama_config_from_hf,
)
from jaxserve.models.llama_family import EXPERT_PARALLEL_SHARDING, LAYER_SHARDING, hf_weight_names
from jaxserve.models.registry import KVCacheSpec, ModelFamily, ModelSupport, add_builtin

ARCHITECTURE = "qwen2_5_vl"


def vision_config_from_hf(hf: dict[str, Any]) -> VisionConfig:
    v = hf.get("vision_config") or {}
    rope = v.get("rope_parameters") or {}
    image_token = hf.get("image_token_id", (hf.get("text_config") or {}).get("image_token_id"))
    if image_token is None:
        raise UnsupportedModelError("Qwen2.5-VL config: image_token_id is missing")
    pre = hf.get("preprocessor_config") or {}
    size = pre.get("size") or {}
    return VisionConfig(
        min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
        max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
        image_mean=tuple(float(x) for x in pre.get("image_mean", (0.48145466, 0.4578275, 0.40821073))),
        image_std=tuple(float(x) for x in pre.get("image_std", (0.26862954, 0.26130258, 0.27577711))),
        kind="qwen2_5_vl",
        depth=int(v["depth"]),
        hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        num_heads=int(v["num_heads"]),
        out_hidden_size=int(v["out_hidden_size"]),
        patch_size=int(v.get("patch_size", 14)),
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=int(v.get("spatial_merge_size", 2)),
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        window_size=int(v.get("window_size", 112)),
        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", ())),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        hidden_act=v.get("hidden_act", "silu"),
        image_token_id=int(image_token),
        vision_start_token_id=hf.get("vision_start_token_id"),
        vision_end_token_id=hf.get("vision_end_token_id"),
        tokens_per_second=int(v.get("tokens_per_second", 2)),
    )


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A `Qwen2_5_VLForConditionalGeneration` config.json: its text model is Qwen2's with the
    rotary frequencies split in (t, h, w) sections (`rope_scaling` "mrope" in the published
    files, `rope_parameters` with `mrope_section` in transformers 5's)."""
    text = language_model_config(hf)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or hf.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    if section is None:
        raise UnsupportedModelError("Qwen2.5-VL config: rope mrope_section is missing")
    if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
        rope = {k: v for k, v in rope.items() if k not in ("type", "rope_type")}
    theta = text.get("rope_theta") or rope.get("rope_theta") or 1000000.0
    text = {**text, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "rope_parameters": rope,
            "rope_scaling": None, "rope_theta": theta, "attention_bias": True}
    base = llama_config_from_hf(text)
    return dataclasses.replace(base, architecture=ARCHITECTURE, mrope_section=tuple(section),
                               vision=vision_config_from_hf(hf))


QWEN2_5_VL = add_builtin(ModelFamily(
    name="qwen2_5_vl",
    architectures=(ARCHITECTURE,),
    hf_architectures={"Qwen2_5_VLForConditionalGeneration": ARCHITECTURE},
    hf_model_types={"qwen2_5_vl": ARCHITECTURE},
    config_from_hf=config_from_hf,
    model_class=llama.LlamaForCausalLM,
    param_shapes=llama.expected_param_shapes,
    hf_weight_names=hf_weight_names,
    kv_cache=KVCacheSpec(shape=llama.kv_cache_shape, scales_shape=llama.kv_scales_pool_shape,
                         bytes_per_page=llama.kv_cache_bytes_per_page, init=llama.init_kv_cache),
    layer_sharding=LAYER_SHARDING,
    expert_parallel_sharding=EXPERT_PARALLEL_SHARDING,
    # LoRA and tensor parallelism are not wired for the image tower yet; speculative decoding
    # (n-gram) and quantized KV pages see only the decoder.
    support=ModelSupport(lora=False, quantized_kv=True, spec_decode=True, tensor_parallel=False),
))
