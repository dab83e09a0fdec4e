"""Gemma 3 4B-27B with images: Gemma 3's decoder (`LlamaForCausalLM` with Gemma's blocks) fed
by a SigLIP tower and pooling projector (`models/gemma3_vision.py`) whose rows replace the
image soft tokens' embeddings. An image's tokens attend to each other in both directions
(`AttentionMetadata.multimodal.attend_until`), so the scheduler never splits an image across
prefill chunks (`SchedulerConfig.whole_images`). The decoder's weights are the text model's
(`language_model.*`); the tower's are loaded beside the params (`LoadedModel.vision`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.models.config import ModelConfig, llama_config_from_hf
from jaxserve.models.gemma3_vision import vision_config_from_hf
from jaxserve.models.llama_family import llama_decoder_family
from jaxserve.models.registry import ModelSupport, add_builtin


def _config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    base = llama_config_from_hf(hf)  # the text model's (a multimodal config's text_config)
    return dataclasses.replace(base, architecture="gemma3_vl", vision=vision_config_from_hf(hf, base.hidden_size))


# Tensor parallelism splits the decoder; the tower runs replicated. LoRA is not wired for the
# image families yet.
GEMMA3_VL = add_builtin(llama_decoder_family(
    "gemma3_vl", "Gemma3ForConditionalGeneration", _config_from_hf,
    ModelSupport(lora=False, quantized_kv=True, spec_decode=True, tensor_parallel=True)))
