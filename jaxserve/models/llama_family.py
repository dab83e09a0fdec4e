"""The Llama-shaped decoders as one registry entry: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE,
Mixtral, Gemma 2 and Gemma 3 (text). They share `LlamaForCausalLM` with per-config switches
(`models/config.py`); this module says how their checkpoints name their weights and registers
them."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.models import llama
from jaxserve.models.config import (
    GGUF_ARCH_NAMES,
    HF_ARCH_NAMES,
    HF_MODEL_TYPES,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    llama_config_from_gguf,
    llama_config_from_hf,
)
from jaxserve.models.registry import (
    MODEL_AXIS,
    KVCacheSpec,
    ModelFamily,
    ModelSupport,
    WeightNames,
    add_builtin,
)

HF_GLOBALS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
HF_LAYERS = {
    "input_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
# Gemma 2/3 name their four norms after where they sit; jaxserve's pre-MLP norm is `post_norm`.
_HF_GEMMA_LAYERS = {
    **HF_LAYERS,
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_norm": "pre_feedforward_layernorm.weight",
    "post_ffn_norm": "post_feedforward_layernorm.weight",
}
# Routed experts, per expert as published checkpoints hold them: (router, expert module, gate,
# up, down) of each MoE family.
_HF_EXPERTS = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts", "w1", "w3", "w2"),
}

_GGUF_GLOBALS = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
_GGUF_LAYERS = {
    "input_norm": "attn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "post_norm": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    # routed experts (llama.cpp stacks each layer's experts in one tensor)
    "router": "ffn_gate_inp.weight",
    "expert_gate": "ffn_gate_exps.weight",
    "expert_up": "ffn_up_exps.weight",
    "expert_down": "ffn_down_exps.weight",
}

# The fused layer weights; the column-parallel ones are interleaved per shard
# (models/fused.py), so a plain split of the last axis gives each device its own heads.
LAYER_SHARDING = {
    "qkv_proj": (None, None, MODEL_AXIS),
    "qkv_bias": (None, MODEL_AXIS),
    "o_proj": (None, MODEL_AXIS, None),
    "gate_up_proj": (None, None, MODEL_AXIS),
    "down_proj": (None, MODEL_AXIS, None),
    "expert_gate_up": (None, None, None, MODEL_AXIS),  # [L, X, E, 2I]: width split
    "expert_down": (None, None, MODEL_AXIS, None),  # [L, X, I, E]
}
# Expert parallelism: whole experts per device.
EXPERT_PARALLEL_SHARDING = {
    "expert_gate_up": (None, MODEL_AXIS, None, None),
    "expert_down": (None, MODEL_AXIS, None, None),
}


def hf_weight_names(cfg: ModelConfig) -> WeightNames:
    return WeightNames(HF_GLOBALS, _HF_GEMMA_LAYERS if cfg.sandwich_norms else HF_LAYERS,
                       _HF_EXPERTS.get(cfg.architecture))


def gguf_weight_names(cfg: ModelConfig) -> WeightNames:
    return WeightNames(_GGUF_GLOBALS, _GGUF_LAYERS)


# The paged K/V pools of `LlamaForCausalLM` (every family whose attention is the Llama block's).
LLAMA_KV_CACHE = KVCacheSpec(shape=llama.kv_cache_shape, scales_shape=llama.kv_scales_pool_shape,
                             bytes_per_page=llama.kv_cache_bytes_per_page, init=llama.init_kv_cache)
# The same cache as `LlamaForCausalLM` lays it out: in layer groups when windowed layers sit
# beside full ones (gpt-oss, Gemma 2 / 3, Mistral's window), their old pages handed back.
LLAMA_DECODER_KV_CACHE = dataclasses.replace(LLAMA_KV_CACHE, layer_groups=True)


def llama_decoder_family(name: str, hf_architecture: str, config_from_hf: Any, support: ModelSupport,
                         hf_model_type: str | None = None) -> ModelFamily:
    """A family of its own whose decoder is `LlamaForCausalLM` with these checkpoint names (the
    vision-language families: their configs and encoders differ, their decoders do not)."""
    return ModelFamily(
        name=name,
        architectures=(name,),
        hf_architectures={hf_architecture: name},
        hf_model_types={hf_model_type: name} if hf_model_type else {},
        config_from_hf=config_from_hf,
        model_class=llama.LlamaForCausalLM,
        param_shapes=llama.expected_param_shapes,
        hf_weight_names=hf_weight_names,
        kv_cache=LLAMA_DECODER_KV_CACHE,
        layer_sharding=LAYER_SHARDING,
        expert_parallel_sharding=EXPERT_PARALLEL_SHARDING,
        support=support,
    )


LLAMA = add_builtin(ModelFamily(
    name="llama",
    architectures=SUPPORTED_ARCHITECTURES,
    hf_architectures=HF_ARCH_NAMES,  # (Gemma3ForConditionalGeneration: models/gemma3_vl.py)
    hf_model_types=HF_MODEL_TYPES,
    gguf_architectures=GGUF_ARCH_NAMES,
    config_from_hf=llama_config_from_hf,
    config_from_gguf=llama_config_from_gguf,
    model_class=llama.LlamaForCausalLM,
    param_shapes=llama.expected_param_shapes,
    hf_weight_names=hf_weight_names,
    gguf_weight_names=gguf_weight_names,
    # llama.cpp permutes Llama-family q/k rows (interleaved RoPE pairs); Qwen's files keep HF's order
    gguf_permuted_qk=lambda cfg: cfg.architecture in ("llama", "mistral", "mixtral"),
    kv_cache=LLAMA_DECODER_KV_CACHE,
    layer_sharding=LAYER_SHARDING,
    expert_parallel_sharding=EXPERT_PARALLEL_SHARDING,
    support=ModelSupport(lora=True, quantized_kv=True, spec_decode=True, tensor_parallel=True, expert_parallel=True),
))
