"""Gemma 3 4B-27B with images: Gemma 3's decoder (`LlamaForCausalLM` with Gemma's blocks) fed
by a SigLIP tower and pooling projector (`models/gemma3_vision.py`) whose rows replace the
image soft tokens' embeddings. An image's tokens attend to each other in both directions
(`AttentionMetadata.multimodal.attend_until`), so the scheduler never splits an image across
prefill chunks (`SchedulerConfig.whole_images`). The decoder's weights are the text model's
(`language_model.*`); the tower's are loaded beside the params (`LoadedModel.vision`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.models import llama
from jaxserve.models.config import ModelConfig, llama_config_from_hf
from jaxserve.models.gemma3_vision import vision_config_from_hf
from jaxserve.models.llama_family import EXPERT_PARALLEL_SHARDING, LAYER_SHARDING, hf_weight_names
from jaxserve.models.registry import KVCacheSpec, ModelFamily, ModelSupport, add_builtin


def _config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    base = llama_config_from_hf(hf)  # the text model's (a multimodal config's text_config)
    return dataclasses.replace(base, architecture="gemma3_vl", vision=vision_config_from_hf(hf, base.hidden_size))


GEMMA3_VL = add_builtin(ModelFamily(
    name="gemma3_vl",
    architectures=("gemma3_vl",),
    hf_architectures={"Gemma3ForConditionalGeneration": "gemma3_vl"},
    config_from_hf=_config_from_hf,
    model_class=llama.LlamaForCausalLM,
    param_shapes=llama.expected_param_shapes,
    hf_weight_names=hf_weight_names,
    kv_cache=KVCacheSpec(shape=llama.kv_cache_shape, scales_shape=llama.kv_scales_pool_shape,
                         bytes_per_page=llama.kv_cache_bytes_per_page, init=llama.init_kv_cache),
    layer_sharding=LAYER_SHARDING,
    expert_parallel_sharding=EXPERT_PARALLEL_SHARDING,
    # Tensor parallelism splits the decoder; the tower runs replicated. LoRA is not wired for
    # the image families yet.
    support=ModelSupport(lora=False, quantized_kv=True, spec_decode=True, tensor_parallel=True),
))
