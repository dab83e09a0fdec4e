"""Qwen2.5-VL and Qwen3-VL: the Qwen2 / Qwen3 decoder (`LlamaForCausalLM`) with multimodal
RoPE, fed by an image encoder (`models/qwen_vision.py`) whose output rows replace the image
placeholder tokens' embeddings (and, for Qwen3-VL, are added to their hidden states after the
first decoder layers: DeepStack). Each is its own family: the decoder's weights are named as
the text model's, the tower's (`visual.*`) are loaded beside the params (`LoadedModel.vision`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.models.config import (
    ModelConfig,
    UnsupportedModelError,
    VisionConfig,
    language_model_config,
    llama_config_from_hf,
)
from jaxserve.models.llama_family import llama_decoder_family
from jaxserve.models.registry import ModelFamily, ModelSupport, add_builtin

# Each family's text model as transformers names it, and its image processor's default
# normalisation (a checkpoint's preprocessor_config.json overrides it).
_TEXT_ARCH = {"qwen2_5_vl": ("Qwen2ForCausalLM", "qwen2"), "qwen3_vl": ("Qwen3ForCausalLM", "qwen3")}
_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
_NORMALISATION = {"qwen2_5_vl": (_CLIP_MEAN, _CLIP_STD), "qwen3_vl": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))}


def vision_config_from_hf(hf: dict[str, Any], kind: str) -> VisionConfig:
    v = hf.get("vision_config") or {}
    rope = v.get("rope_parameters") or {}
    image_token = hf.get("image_token_id", (hf.get("text_config") or {}).get("image_token_id"))
    if image_token is None:
        raise UnsupportedModelError(f"{kind} config: image_token_id is missing")
    pre = hf.get("preprocessor_config") or {}
    size = pre.get("size") or {}
    mean, std = _NORMALISATION[kind]
    depth, patch, merge = int(v["depth"]), int(v.get("patch_size", 14)), int(v.get("spatial_merge_size", 2))
    if kind == "qwen3_vl":  # every block attends over the whole image; windows only group its slots
        window, full = 4 * patch * merge, tuple(range(depth))
    else:
        window, full = int(v.get("window_size", 112)), tuple(int(i) for i in v.get("fullatt_block_indexes", ()))
    return VisionConfig(
        kind=kind,
        depth=depth,
        hidden_size=int(v["hidden_size"]),
        intermediate_size=int(v["intermediate_size"]),
        num_heads=int(v["num_heads"]),
        out_hidden_size=int(v["out_hidden_size"]),
        patch_size=patch,
        temporal_patch_size=int(v.get("temporal_patch_size", 2)),
        spatial_merge_size=merge,
        in_channels=int(v.get("in_channels", v.get("in_chans", 3))),
        window_size=window,
        fullatt_block_indexes=full,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        hidden_act=v.get("hidden_act", "silu"),
        image_token_id=int(image_token),
        vision_start_token_id=hf.get("vision_start_token_id"),
        vision_end_token_id=hf.get("vision_end_token_id"),
        tokens_per_second=int(v.get("tokens_per_second", 2)),
        min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
        max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
        image_mean=tuple(float(x) for x in pre.get("image_mean", mean)),
        image_std=tuple(float(x) for x in pre.get("image_std", std)),
        num_position_embeddings=int(v.get("num_position_embeddings", 0)),
        deepstack_visual_indexes=tuple(int(i) for i in v.get("deepstack_visual_indexes", ())),
    )


def _config_from_hf(hf: dict[str, Any], kind: str) -> ModelConfig:
    """The text model's config with the rotary frequencies split in (t, h, w) sections
    (`rope_scaling` "mrope" in Qwen2.5-VL's published files, `rope_parameters` with
    `mrope_section` in transformers 5's and Qwen3-VL's, interleaved for Qwen3-VL)."""
    text = language_model_config(hf)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or hf.get("rope_scaling") or {})
    section = rope.pop("mrope_section", None)
    if section is None:
        raise UnsupportedModelError(f"{kind} config: rope mrope_section is missing")
    interleaved = bool(rope.pop("mrope_interleaved", kind == "qwen3_vl"))
    if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
        rope = {k: v for k, v in rope.items() if k not in ("type", "rope_type")}
    theta = text.get("rope_theta") or rope.get("rope_theta") or 1000000.0
    tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    arch, model_type = _TEXT_ARCH[kind]
    text = {**text, "architectures": [arch], "model_type": model_type,
            "rope_parameters": rope, "rope_scaling": None, "rope_theta": theta, "tie_word_embeddings": tied}
    if kind == "qwen2_5_vl":
        text["attention_bias"] = True
    base = llama_config_from_hf(text)
    return dataclasses.replace(base, architecture=kind, mrope_section=tuple(section), mrope_interleaved=interleaved,
                               vision=vision_config_from_hf(hf, kind))


def _family(kind: str, hf_architecture: str) -> ModelFamily:
    # Tensor parallelism splits the decoder (the tower, image rows and 3-D positions run
    # replicated); LoRA is not wired for the image families yet; speculative decoding (n-gram)
    # and quantized KV pages see only the decoder.
    return llama_decoder_family(kind, hf_architecture, lambda hf: _config_from_hf(hf, kind),
                                ModelSupport(lora=False, quantized_kv=True, spec_decode=True, tensor_parallel=True),
                                hf_model_type=kind)


QWEN2_5_VL = add_builtin(_family("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"))
QWEN3_VL = add_builtin(_family("qwen3_vl", "Qwen3VLForConditionalGeneration"))
