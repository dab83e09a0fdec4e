"""Llama 4 text (`Llama4ForCausalLM`; the language model of `Llama4ForConditionalGeneration`:
Scout, Maverick) as a registry entry.

- Attention: grouped-query over the Llama decoder's paged K/V cache. RoPE layers rotate
  interleaved pairs, attend within their own `attention_chunk_size`-token chunk (the kernels'
  chunked mask) and, with `use_qk_norm`, L2-normalise q and k (a weightless RMS norm). Every
  fourth layer is NoPE: no rotation, global attention, and with `attn_temperature_tuning`
  the queries scaled up with the position (`ModelConfig` docs the formula). The layer kind is
  scanned per-layer data: one attention body for all layers.
- MLP: routed experts (sigmoid of the chosen logit scaling the expert's *input*; Scout and
  Maverick route to one expert) plus a shared expert, on every `interleave_moe_layer_step`-th
  layer; the others are dense SwiGLU of `intermediate_size_mlp`. The stacks and expert layers
  are DeepSeek's (`models/deepseek.py`): attention [L], dense MLPs [L - L/s], experts [L/s];
  one scan over groups of s layers (s - 1 dense, then one MoE) runs them.

Interleaved RoPE pairs (x0, x1), (x2, x3)... are put in rotate-half order (evens, then odds)
before rotating; q and k are permuted alike, so q.k, and so attention, is unchanged on the
NoPE layers too, and the cache holds keys in that order.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import (
    ModelConfig,
    UnsupportedModelError,
    first_eos,
    language_model_config,
    parse_rope_scaling,
)
from jaxserve.models.deepseek import LayerStack, mlp_param_shapes
from jaxserve.models.deepseek_family import EXPERT_PARALLEL_SHARDING
from jaxserve.models.deepseek_family import LAYER_SHARDING as DEEPSEEK_SHARDING
from jaxserve.models.fused import split_qkv
from jaxserve.models.glm4_moe import Glm4MoeForCausalLM
from jaxserve.models.layers import AttentionFn, KVUpdateFn, MoEFn, rms_norm
from jaxserve.models.llama import group_metadata, single_device_moe
from jaxserve.models.llama_family import HF_GLOBALS, HF_LAYERS, LLAMA_KV_CACHE
from jaxserve.models.llama_family import LAYER_SHARDING as LLAMA_SHARDING
from jaxserve.models.lora import LoRABatch
from jaxserve.models.metadata import AttentionMetadata
from jaxserve.models.registry import (
    ModelFamily,
    ModelSupport,
    WeightNames,
    add_builtin,
)
from jaxserve.models.rope import apply_rope, rope_attention_factor, rope_tables

ARCHITECTURE = "llama4"
HF_ARCHITECTURES = {"Llama4ForCausalLM": ARCHITECTURE, "Llama4ForConditionalGeneration": ARCHITECTURE}
HF_MODEL_TYPES = {"llama4_text": ARCHITECTURE, "llama4": ARCHITECTURE}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hf = language_model_config(hf)  # Llama4ForConditionalGeneration: its language model (text prompts only)
    n = int(hf["num_hidden_layers"])
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias"):
        raise UnsupportedModelError("llama4 with attention_bias or an activation other than silu is not supported")
    step = int(hf.get("interleave_moe_layer_step") or 1)
    moe_layers = hf.get("moe_layers")
    if moe_layers is not None and list(moe_layers) != list(range(step - 1, n, step)):
        raise UnsupportedModelError(f"llama4 moe_layers {list(moe_layers)} are not every {step}-th layer (only "
                                    "interleave_moe_layer_step patterns are supported)")
    if n % step:
        raise UnsupportedModelError(f"llama4 with {n} layers, not a multiple of interleave_moe_layer_step {step}")
    rope_flags = [int(x) for x in (hf.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(n)])]
    chunk = int(hf.get("attention_chunk_size") or 0)
    types = hf.get("layer_types") or ["chunked_attention" if r and chunk else "full_attention" for r in rope_flags]
    if set(types) - {"chunked_attention", "full_attention"} or len(types) != n or len(rope_flags) != n:
        raise UnsupportedModelError(f"llama4 layer_types {types} / no_rope_layers {rope_flags} not supported")
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    max_pos = int(hf.get("max_position_embeddings", 4096 * 32))
    eos = first_eos(hf)
    width = int(hf["intermediate_size"])
    return ModelConfig(
        architecture=ARCHITECTURE,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf.get("intermediate_size_mlp") or width),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 500000.0),
        rope_scaling=parse_rope_scaling(rope, max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        num_experts=int(hf["num_local_experts"]),
        num_experts_per_tok=int(hf.get("num_experts_per_tok") or 1),
        moe_intermediate_size=width,
        shared_expert_intermediate_size=width,
        router_scoring="topk_sigmoid",
        expert_input_scaling=True,
        moe_layer_step=step,
        layer_rope=tuple(rope_flags),
        layer_chunks=tuple(chunk if t == "chunked_attention" else 0 for t in types),
        qk_l2_norm=bool(hf.get("use_qk_norm", True)),
        attn_temperature_tuning=bool(hf.get("attn_temperature_tuning", True)),
        floor_scale=float(hf.get("floor_scale", 8192)),
        attn_scale=float(hf.get("attn_scale", 0.1)),
    )


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return (layer + 1) % cfg.moe_layer_step == 0


def layer_ids(cfg: ModelConfig, name: str) -> list[int]:
    """The checkpoint layers a stacked weight holds: the dense MLPs the non-MoE layers', the
    experts (and router, shared expert) the MoE layers', the rest every layer's."""
    base = name.removesuffix("_scale")
    if base in ("gate_proj", "up_proj", "down_proj", "gate_up_proj"):
        return [i for i in range(cfg.num_layers) if not is_moe_layer(cfg, i)]
    if base in ("router", "expert_gate", "expert_up", "expert_down", "expert_gate_up", "shared_gate", "shared_up",
                "shared_down"):
        return [i for i in range(cfg.num_layers) if is_moe_layer(cfg, i)]
    return list(range(cfg.num_layers))


def expected_param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    L, E = cfg.num_layers, cfg.hidden_size
    layers: dict[str, tuple[int, ...]] = {
        "input_norm": (L, E), "post_norm": (L, E),
        "q_proj": (L, E, cfg.q_size), "k_proj": (L, E, cfg.kv_size), "v_proj": (L, E, cfg.kv_size),
        "o_proj": (L, cfg.q_size, E),
    }
    layers.update(mlp_param_shapes(cfg))
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, E), "layers": layers, "final_norm": (E,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (E, cfg.vocab_size)
    return shapes


def temperature_scales(cfg: ModelConfig, positions: jax.Array) -> jax.Array:
    """[T] f32: the NoPE layers' query scale at each position (attention-temperature tuning)."""
    pos = positions.astype(jnp.float32)
    return jnp.log1p(jnp.floor((pos + 1.0) / cfg.floor_scale)) * cfg.attn_scale + 1.0


def rotate_half_order(x: jax.Array) -> jax.Array:
    """[..., D] interleaved pairs (x0, x1), (x2, x3)... -> (x0, x2, ..., x1, x3, ...)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class Llama4ForCausalLM(Glm4MoeForCausalLM):
    """DeepSeek's stacks and expert layers (shared expert, `scale_inputs` routing) with Llama 4's
    attention over per-head K/V pages."""

    def __init__(self, config: ModelConfig, params: dict[str, Any], **kwargs: Any):
        super().__init__(config, params, **kwargs)
        L = config.num_layers
        self._layer_rope = np.asarray(config.layer_rope or (1,) * L, np.int32)  # [L] numpy constants
        self._layer_chunks = np.asarray(config.layer_chunks or (0,) * L, np.int32)
        # Layer groups (chunked layers beside global ones): layer l's pages are slot
        # `_cache_slot[l]` of group `_kv_group[l]`'s pages, read through that group's table.
        groups = config.kv_layer_groups
        self._num_kv_groups = groups.num_groups if groups is not None else 1
        self._cache_slot = np.asarray(groups.layer_slot if groups is not None else range(L), np.int32)
        self._kv_group = np.asarray(groups.layer_group if groups is not None else (0,) * L, np.int32)

    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        kv_cache: tuple[jax.Array, ...],
        md: AttentionMetadata,
        logits_indices: jax.Array,  # [R] int32
        *,
        attention_fn: AttentionFn,
        kv_update_fn: KVUpdateFn,
        moe_fn: MoEFn = single_device_moe,
        lora: LoRABatch | None = None,
    ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
        if lora is not None:
            raise ValueError(f"{self.config.architecture} does not take LoRA adapters")
        cfg = self.config
        P = kv_cache[0].shape[1]
        pool, views = self._paged_pool(kv_cache)
        h = self._embed(token_ids, self.final_norm[...].dtype)  # [T, E]
        rope = (*rope_tables(positions, self._inv_freq, rope_attention_factor(cfg)),  # cos, sin [T, D/2]
                temperature_scales(cfg, positions))  # [T]
        stack, s = self._stacks(md), cfg.moe_layer_step
        layer_rope, layer_chunks = jnp.asarray(self._layer_rope), jnp.asarray(self._layer_chunks)
        cache_slot, kv_group = jnp.asarray(self._cache_slot), jnp.asarray(self._kv_group)

        def sublayer(h, pool, i, mlp):
            lmd = group_metadata(md, kv_group[i], self._num_kv_groups) if self._num_kv_groups > 1 else md
            h, pool = self._attention(h, stack(i), (*rope, layer_rope[i], layer_chunks[i]), pool, lmd,
                                      cache_slot[i] * P, views, attention_fn, kv_update_fn)
            return h + mlp(self._norm(h, stack(i)["post_norm"])), pool

        def group(carry, g):  # layers g*s .. g*s + s - 1: s - 1 dense, then one with experts
            h, pool = carry
            for j in range(s - 1):
                h, pool = sublayer(h, pool, g * s + j, lambda x, d=g * (s - 1) + j: self._dense_mlp(x, stack(d)))
            h, pool = sublayer(h, pool, g * s + s - 1, lambda x: self._experts(x, stack(g), moe_fn))
            return (h, pool), None

        (h, pool), _ = jax.lax.scan(group, (h, pool), jnp.arange(cfg.num_layers // s, dtype=jnp.int32))
        h_last = self.final_hidden(jnp.take(h, logits_indices, axis=0))
        return h_last, h, tuple(p.reshape(x.shape) for p, x in zip(pool, kv_cache))

    def _attention(self, h, w: LayerStack, rope, pool, md, page_offset, views, attention_fn, kv_update_fn):
        """One layer's attention; `rope` is (cos, sin, temperature scales, this layer's RoPE
        flag, its chunk size)."""
        cos, sin, temperature, use_rope, chunk = rope
        S = views.page_size
        pool = views.to_pages(pool)
        cfg = self.config
        T, Hq, Hkv, D = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = self._norm(h, w["input_norm"])
        q, k, v = split_qkv(w.matmul(x, "qkv_proj"), cfg, self.shards)
        q, k, v = rotate_half_order(q.reshape(T, Hq, D)), rotate_half_order(k.reshape(T, Hkv, D)), v.reshape(T, Hkv, D)
        q_rot, k_rot = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cfg.qk_l2_norm:
            q_rot, k_rot = (rms_norm(y, jnp.ones((D,), y.dtype), cfg.rms_norm_eps) for y in (q_rot, k_rot))
        if cfg.attn_temperature_tuning:
            q = (q * temperature[:, None, None]).astype(q.dtype)
        q, k = jnp.where(use_rope > 0, q_rot, q), jnp.where(use_rope > 0, k_rot, k)
        scales = {"k_scales": pool[2], "v_scales": pool[3]} if len(pool) == 4 else {}
        pool = tuple(kv_update_fn(k, v, pool[0], pool[1], md.slot_mapping + page_offset * S, **scales))
        scales = {"k_scales": pool[2], "v_scales": pool[3]} if len(pool) == 4 else {}
        attn = attention_fn(q, pool[0], pool[1], md.kv_lens, md.block_tables + page_offset, md.cu_q_lens,
                            md.num_seqs, sm_scale=cfg.sm_scale, num_kv_heads=Hkv, attention_chunk=chunk,
                            **scales)  # [T, Hq, D]
        return h + w.matmul(attn.reshape(T, Hq * D).astype(h.dtype), "o_proj"), views.to_carry(pool)


# ---------------------------------------------------------------------- registry entry
_HF_LAYERS = {
    **{k: HF_LAYERS[k] for k in ("input_norm", "post_norm", "q_proj", "k_proj", "v_proj", "o_proj")},
    **{k: "feed_forward." + HF_LAYERS[k].removeprefix("mlp.") for k in ("gate_proj", "up_proj", "down_proj")},
    "shared_gate": "feed_forward.shared_expert.gate_proj.weight",
    "shared_up": "feed_forward.shared_expert.up_proj.weight",
    "shared_down": "feed_forward.shared_expert.down_proj.weight",
}
# (router, expert module, gate, up, down): gate and up are the halves of the stacked `gate_up_proj`.
_HF_EXPERTS = ("feed_forward.router.weight", "feed_forward.experts", "gate_up_proj", "gate_up_proj", "down_proj")


def hf_weight_names(cfg: ModelConfig) -> WeightNames:
    return WeightNames(HF_GLOBALS, _HF_LAYERS, _HF_EXPERTS, stacked_experts="halves_in_out")


LLAMA4 = add_builtin(ModelFamily(
    name="llama4",
    architectures=(ARCHITECTURE,),
    hf_architectures=HF_ARCHITECTURES,
    hf_model_types=HF_MODEL_TYPES,
    config_from_hf=config_from_hf,
    model_class=Llama4ForCausalLM,
    param_shapes=expected_param_shapes,
    hf_weight_names=hf_weight_names,
    layer_ids=layer_ids,
    kv_cache=dataclasses.replace(LLAMA_KV_CACHE, layer_groups=True),  # chunked layers' old pages handed back
    layer_sharding={**LLAMA_SHARDING, **{k: v for k, v in DEEPSEEK_SHARDING.items() if k.startswith("shared_")}},
    expert_parallel_sharding=EXPERT_PARALLEL_SHARDING,
    support=ModelSupport(lora=False, quantized_kv=True, spec_decode=True, tensor_parallel=True, expert_parallel=True),
))
