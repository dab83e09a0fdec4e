"""The DeepSeek-style MoE decoders as registry entries: DeepSeek-V3 / R1 and Kimi-K2 (latent
attention, `models/deepseek.py`) and GLM-4.5 MoE (grouped-query attention over the Llama cache,
`models/glm4_moe.py`), which share the expert layers: checkpoint names, sharding rules, caches."""

from __future__ import annotations

from jaxserve.models import deepseek, glm4_moe
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama_family import HF_GLOBALS, HF_LAYERS, LLAMA_KV_CACHE
from jaxserve.models.llama_family import LAYER_SHARDING as LLAMA_LAYER_SHARDING
from jaxserve.models.registry import (
    MODEL_AXIS,
    KVCacheSpec,
    ModelFamily,
    ModelSupport,
    WeightNames,
    add_builtin,
)

_HF_LAYERS = {
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "q_a_proj": "self_attn.q_a_proj.weight",
    "q_a_norm": "self_attn.q_a_layernorm.weight",
    "q_b_proj": "self_attn.q_b_proj.weight",
    "q_head_proj": "self_attn.q_proj.weight",
    "kv_a_proj": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "kv_b_proj": "self_attn.kv_b_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "router_bias": "mlp.gate.e_score_correction_bias",
    "shared_gate": "mlp.shared_experts.gate_proj.weight",
    "shared_up": "mlp.shared_experts.up_proj.weight",
    "shared_down": "mlp.shared_experts.down_proj.weight",
}
_HF_EXPERTS = ("mlp.gate.weight", "mlp.experts", "gate_proj", "up_proj", "down_proj")

# Heads split over the model axis: the query and kv_b columns (head-major) and o_proj's rows;
# the latent projections (q_a, kv_a) and the latent cache are replicated.
LAYER_SHARDING = {
    "q_b_proj": (None, None, MODEL_AXIS),
    "q_head_proj": (None, None, MODEL_AXIS),
    "kv_b_proj": (None, None, MODEL_AXIS),
    "o_proj": (None, MODEL_AXIS, None),
    "gate_up_proj": (None, None, MODEL_AXIS),
    "down_proj": (None, MODEL_AXIS, None),
    "shared_gate": (None, None, MODEL_AXIS),
    "shared_up": (None, None, MODEL_AXIS),
    "shared_down": (None, MODEL_AXIS, None),
    "expert_gate_up": (None, None, None, MODEL_AXIS),
    "expert_down": (None, None, MODEL_AXIS, None),
}
EXPERT_PARALLEL_SHARDING = {
    "expert_gate_up": (None, MODEL_AXIS, None, None),
    "expert_down": (None, MODEL_AXIS, None, None),
}


def hf_weight_names(cfg: ModelConfig) -> WeightNames:
    return WeightNames({**HF_GLOBALS, **deepseek.mtp_weight_names(cfg)}, _HF_LAYERS, _HF_EXPERTS)


DEEPSEEK = add_builtin(ModelFamily(
    name="deepseek",
    architectures=deepseek.ARCHITECTURES,
    hf_architectures=deepseek.HF_ARCHITECTURES,
    hf_model_types=deepseek.HF_MODEL_TYPES,
    config_from_hf=deepseek.config_from_hf,
    model_class=deepseek.DeepseekV3ForCausalLM,
    param_shapes=deepseek.expected_param_shapes,
    hf_weight_names=hf_weight_names,
    layer_ids=deepseek.layer_ids,
    kv_cache=KVCacheSpec(shape=deepseek.kv_cache_shape, scales_shape=deepseek.kv_scales_pool_shape,
                         bytes_per_page=deepseek.kv_cache_bytes_per_page, init=deepseek.init_kv_cache,
                         page_arrays=1, replicated=True),
    attention="latent",
    layer_sharding=LAYER_SHARDING,
    expert_parallel_sharding=EXPERT_PARALLEL_SHARDING,
    support=ModelSupport(lora=False, quantized_kv=True, spec_decode=True, tensor_parallel=True,
                         expert_parallel=True),
))


# Llama's attention names, DeepSeek's MLP and expert names.
_GLM_LAYERS = {
    **{k: v for k, v in _HF_LAYERS.items() if not k.startswith(("q_", "kv_"))},
    **{k: HF_LAYERS[k] for k in ("q_proj", "k_proj", "v_proj", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm")},
}


def glm_weight_names(cfg: ModelConfig) -> WeightNames:
    return WeightNames({**HF_GLOBALS, **deepseek.mtp_weight_names(cfg)}, _GLM_LAYERS, _HF_EXPERTS)


GLM4_MOE = add_builtin(ModelFamily(
    name="glm4_moe",
    architectures=glm4_moe.ARCHITECTURES,
    hf_architectures=glm4_moe.HF_ARCHITECTURES,
    hf_model_types=glm4_moe.HF_MODEL_TYPES,
    config_from_hf=glm4_moe.config_from_hf,
    model_class=glm4_moe.Glm4MoeForCausalLM,
    param_shapes=glm4_moe.expected_param_shapes,
    hf_weight_names=glm_weight_names,
    layer_ids=deepseek.layer_ids,
    kv_cache=LLAMA_KV_CACHE,
    layer_sharding={**LLAMA_LAYER_SHARDING, **{k: v for k, v in LAYER_SHARDING.items() if k.startswith("shared_")}},
    expert_parallel_sharding=EXPERT_PARALLEL_SHARDING,
    support=ModelSupport(lora=False, quantized_kv=True, spec_decode=True, tensor_parallel=True,
                         expert_parallel=True),
))
