"""gpt-oss (`GptOssForCausalLM`, 20b and 120b) as a registry entry over the Llama decoder.

Its layers are the Llama decoder's with switches set in `ModelConfig`:
- attention: grouped-query with q/k/v/o biases, learned sinks (one logit per query head in
  every softmax: `sinks` [L, Hq], handed to the attention kernels), and 128-token sliding
  windows on every other layer (`layer_windows`);
- RoPE: YaRN on the NeoX halves (`rope.py`);
- experts: a router with a logit bias whose top k logits are softmaxed among themselves
  (`moe.route_topk_softmax`), expert projections with biases, and the clamped SwiGLU
  (`layers.clamped_swiglu`).

Checkpoints hold each layer's experts stacked: `mlp.experts.gate_up_proj` [X, E, 2I] with gate
and up interleaved column by column, `down_proj` [X, I, E], and `*_bias`; the released
checkpoints store the two projections as MXFP4 `*_blocks` / `*_scales` instead
(`loading/mxfp4.py`), dequantized at load.
"""

from __future__ import annotations

from typing import Any

from jaxserve.models import llama
from jaxserve.models.config import ModelConfig, UnsupportedModelError, first_eos, parse_rope_scaling
from jaxserve.models.llama_family import (
    EXPERT_PARALLEL_SHARDING,
    HF_GLOBALS,
    HF_LAYERS,
    LAYER_SHARDING,
    LLAMA_DECODER_KV_CACHE,
)
from jaxserve.models.registry import (
    MODEL_AXIS,
    ModelFamily,
    ModelSupport,
    WeightNames,
    add_builtin,
)

ARCHITECTURE = "gpt_oss"

HF_LAYER_NAMES = {
    **{k: v for k, v in HF_LAYERS.items() if k not in ("gate_proj", "up_proj", "down_proj", "q_norm", "k_norm")},
    "o_bias": "self_attn.o_proj.bias",
    "sinks": "self_attn.sinks",
    "router_logit_bias": "mlp.router.bias",
}
# (router, expert module, gate, up, down): gate and up are the interleaved halves of the
# stacked `gate_up_proj` (`WeightNames.stacked_experts`).
HF_EXPERTS = ("mlp.router.weight", "mlp.experts", "gate_up_proj", "gate_up_proj", "down_proj")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    n = int(hf["num_hidden_layers"])
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    max_pos = int(hf.get("max_position_embeddings", 131072))
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != n:
        raise UnsupportedModelError(f"gpt_oss layer_types {sorted(unknown) or types} not supported")
    window = int(hf.get("sliding_window") or 0)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    eos = first_eos(hf)
    bias = bool(hf.get("attention_bias", True))
    return ModelConfig(
        architecture=ARCHITECTURE,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 150000.0),
        rope_scaling=parse_rope_scaling(rope, max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bias,
        o_proj_bias=bias,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        num_experts=int(hf["num_local_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["intermediate_size"]),
        router_scoring="topk_softmax",
        attention_sinks=True,
        expert_bias=True,
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
    )


def hf_weight_names(cfg: ModelConfig) -> WeightNames:
    return WeightNames(HF_GLOBALS, HF_LAYER_NAMES, HF_EXPERTS, stacked_experts="interleaved")


GPT_OSS = add_builtin(ModelFamily(
    name="gpt_oss",
    architectures=(ARCHITECTURE,),
    hf_architectures={"GptOssForCausalLM": ARCHITECTURE},
    hf_model_types={"gpt_oss": ARCHITECTURE},
    config_from_hf=config_from_hf,
    model_class=llama.LlamaForCausalLM,
    param_shapes=llama.expected_param_shapes,
    hf_weight_names=hf_weight_names,
    kv_cache=LLAMA_DECODER_KV_CACHE,
    layer_sharding={**LAYER_SHARDING,
                    "sinks": (None, MODEL_AXIS),  # [L, Hq]: each rank's heads
                    "expert_gate_up_bias": (None, None, MODEL_AXIS)},  # [L, X, 2I]: width split like the weight
    expert_parallel_sharding={**EXPERT_PARALLEL_SHARDING,
                              "expert_gate_up_bias": (None, MODEL_AXIS, None),
                              "expert_down_bias": (None, MODEL_AXIS, None)},
    support=ModelSupport(lora=True, quantized_kv=True, spec_decode=True, tensor_parallel=True, expert_parallel=True),
))
