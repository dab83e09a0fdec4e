"""Qwen3-Next and Qwen3.5 (`Qwen3NextForCausalLM`, `Qwen3_5MoeForCausalLM`, `Qwen3_5ForCausalLM`
and the language model of their `...ForConditionalGeneration`): hybrid linear attention.

Layers repeat a pattern of p - 1 Gated DeltaNet layers then one gated full-attention layer
(p = `full_attention_interval`, 4 in the released models):
- Gated DeltaNet (`models/gated_delta.py`): q, k, v through a causal depthwise conv (SiLU), the
  gated delta rule with per-head decay g = -exp(A_log) * softplus(a + dt_bias) and
  beta = sigmoid(b), then an RMSNorm gated by SiLU(z) and the output projection. Its state is
  a conv window and a [Hv, dk, dv] matrix per sequence, held in state slots, not pages.
- Gated full attention: the query projection also gives a gate per head (sigmoid on the
  output), zero-centred q/k norms, partial RoPE; K/V in pages as every family's.
- Every norm is zero-centred ((1 + w) scaling); the MLP is the routed experts (softmax top-k)
  plus a shared expert scaled by sigmoid(x . w_gate), or dense (Qwen3.5 dense).

The params hold a stack per layer kind: linear layers' `lin_*` [Ll, ...], full layers' `attn_*`
[Lf, ...], the rest every layer [L, ...]. One `lax.scan` runs the groups of p layers. The cache
is (k, v) of the full layers [Lf, P, S, ...], then the linear layers' state pools: conv
[Ll, N, K-1, C] and recurrent [Ll, N, Hv, dk, dv], both f32, N = the engine's state slots.
The conv's channels (its taps, Qwen3.5's fused q/k/v projection, the conv state) are grouped per
key head, [q_h | k_h | v of h's value heads] (`serving_layers`), so tensor parallelism splits
them by key head like every other projection: each device runs the conv and the delta rule of
its own heads (`parallel.per_shard_recurrent`). Refused by name: a layer pattern that does not
repeat, MoE on some layers only, LoRA, quantized KV pages, speculative decoding (its rejected
drafts would have to roll the states back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import llama, moe
from jaxserve.models.config import (
    LinearAttentionConfig,
    ModelConfig,
    UnsupportedModelError,
    first_eos,
    language_model_config,
    parse_rope_scaling,
)
from jaxserve.models.deepseek import LayerStack
from jaxserve.models.deepseek_family import LAYER_SHARDING as DEEPSEEK_SHARDING
from jaxserve.models.fused import split_gate_up
from jaxserve.models.gated_delta import linear_mixing
from jaxserve.models.layers import ACTIVATIONS, AttentionFn, KVUpdateFn, MoEFn
from jaxserve.models.llama import LlamaForCausalLM, paged_pool_views, single_device_moe
from jaxserve.models.llama_family import EXPERT_PARALLEL_SHARDING
from jaxserve.models.llama_family import LAYER_SHARDING as LLAMA_SHARDING
from jaxserve.models.lora import LoRABatch
from jaxserve.models.metadata import AttentionMetadata
from jaxserve.models.registry import (
    MODEL_AXIS,
    KVCacheSpec,
    ModelFamily,
    ModelSupport,
    WeightNames,
    add_builtin,
)
from jaxserve.models.rope import apply_rope, rope_tables

HF_ARCHITECTURES = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
}
HF_MODEL_TYPES = {"qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe", "qwen3_5_moe_text": "qwen3_5_moe",
                  "qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5"}
ARCHITECTURES = ("qwen3_next", "qwen3_5_moe", "qwen3_5")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    archs = hf.get("architectures") or []
    arch = next((HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES), None)
    arch = arch or HF_MODEL_TYPES[hf.get("model_type")]
    hf = language_model_config(hf)
    L = int(hf["num_hidden_layers"])
    interval = int(hf.get("full_attention_interval") or 4)
    kinds = list(hf.get("layer_types") or [])
    expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(L)]
    if kinds and kinds != expected:
        raise UnsupportedModelError(f"{arch}: layer_types must repeat {interval - 1} linear_attention layers then "
                                    f"one full_attention layer; got {kinds}")
    if L % interval:
        raise UnsupportedModelError(f"{arch}: {L} layers are not whole repeats of {interval}")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{arch} with hidden_act={hf.get('hidden_act')!r} is not supported (silu)")
    if hf.get("attention_bias"):
        raise UnsupportedModelError(f"{arch} with attention_bias is not supported")
    moe_args: dict[str, Any] = {}
    if arch != "qwen3_5":
        if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step") or 1) != 1:
            raise UnsupportedModelError(f"{arch}: experts on some layers only (mlp_only_layers, "
                                        "decoder_sparse_step) are not supported")
        moe_args = dict(num_experts=int(hf["num_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                        moe_intermediate_size=int(hf["moe_intermediate_size"]),
                        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
                        shared_expert_gate=True)
    linear = LinearAttentionConfig(
        num_key_heads=int(hf["linear_num_key_heads"]), num_value_heads=int(hf["linear_num_value_heads"]),
        key_head_dim=int(hf["linear_key_head_dim"]), value_head_dim=int(hf["linear_value_head_dim"]),
        conv_kernel=int(hf.get("linear_conv_kernel_dim") or 4), full_attention_interval=interval,
        grouped_projection=arch == "qwen3_next")
    if linear.num_value_heads % linear.num_key_heads:
        raise UnsupportedModelError(f"{arch}: linear_num_value_heads ({linear.num_value_heads}) must be a multiple "
                                    f"of linear_num_key_heads ({linear.num_key_heads})")
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    max_pos = int(hf.get("max_position_embeddings", 32768))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf.get("intermediate_size") or 1),
        num_layers=L,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0),
        rope_scaling=parse_rope_scaling(rope, max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=True,
        partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=first_eos(hf),
        norm_weight_offset=1.0,
        linear_attention=linear,
        **moe_args,
    )


def _lin(cfg: ModelConfig) -> LinearAttentionConfig:
    if cfg.linear_attention is None:
        raise ValueError(f"{cfg.architecture} has no linear-attention config")
    return cfg.linear_attention


def num_full_layers(cfg: ModelConfig) -> int:
    return cfg.num_layers // _lin(cfg).full_attention_interval


def num_linear_layers(cfg: ModelConfig) -> int:
    return cfg.num_layers - num_full_layers(cfg)


def layer_ids(cfg: ModelConfig, name: str) -> list[int]:
    """The checkpoint layers a stacked weight holds: `lin_*` the linear ones, `attn_*` the full
    ones, the rest every layer."""
    p = _lin(cfg).full_attention_interval
    full = [i for i in range(cfg.num_layers) if (i + 1) % p == 0]
    if name.startswith("lin_"):
        return [i for i in range(cfg.num_layers) if (i + 1) % p]
    if name.startswith("attn_"):
        return full
    return list(range(cfg.num_layers))


def expected_param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    la = _lin(cfg)
    L, E, Ll, Lf = cfg.num_layers, cfg.hidden_size, num_linear_layers(cfg), num_full_layers(cfg)
    Hv, Hk, dk, dv = la.num_value_heads, la.num_key_heads, la.key_head_dim, la.value_head_dim
    layers: dict[str, tuple[int, ...]] = {
        "input_norm": (L, E), "post_norm": (L, E),
        "attn_q": (Lf, E, 2 * cfg.q_size), "attn_k": (Lf, E, cfg.kv_size), "attn_v": (Lf, E, cfg.kv_size),
        "attn_o": (Lf, cfg.q_size, E), "attn_q_norm": (Lf, cfg.head_dim), "attn_k_norm": (Lf, cfg.head_dim),
        "lin_conv": (Ll, la.conv_dim, 1, la.conv_kernel), "lin_dt_bias": (Ll, Hv), "lin_a_log": (Ll, Hv),
        "lin_norm": (Ll, dv), "lin_out": (Ll, la.value_dim, E),
    }
    if la.grouped_projection:
        layers.update(lin_qkvz=(Ll, E, 2 * la.key_dim + 2 * la.value_dim), lin_ba=(Ll, E, 2 * Hv))
    else:
        layers.update(lin_qkv=(Ll, E, la.conv_dim), lin_z=(Ll, E, la.value_dim), lin_b=(Ll, E, Hv),
                      lin_a=(Ll, E, Hv))
    del Hk, dk
    if cfg.is_moe:
        X, Im, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        layers.update(router=(L, E, X), expert_gate=(L, X, E, Im), expert_up=(L, X, E, Im), expert_down=(L, X, Im, E))
        if Is:
            layers.update(shared_gate=(L, E, Is), shared_up=(L, E, Is), shared_down=(L, Is, E),
                          shared_expert_gate=(L, 1, E))
    else:
        I = cfg.intermediate_size  # noqa: E741
        layers.update(gate_proj=(L, E, I), up_proj=(L, E, I), down_proj=(L, I, E))
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, E), "layers": layers, "final_norm": (E,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (E, cfg.vocab_size)
    return shapes


# ---------------------------------------------------------------------- the cache
def _full_config(cfg: ModelConfig) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, num_layers=num_full_layers(cfg))


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int, layout: str = "heads", tp: int = 1):
    return llama.kv_cache_shape(_full_config(cfg), num_pages, page_size, layout, tp)


def kv_scales_shape(cfg: ModelConfig, num_pages: int, page_size: int, layout: str = "heads"):
    raise UnsupportedModelError(f"{cfg.architecture} does not support quantized KV pages yet")


def state_shapes(cfg: ModelConfig, num_slots: int) -> tuple[tuple[int, ...], ...]:
    """The linear layers' state pools: conv [Ll, N, K-1, C], recurrent [Ll, N, Hv, dk, dv]."""
    la, Ll = _lin(cfg), num_linear_layers(cfg)
    return ((Ll, num_slots, la.conv_kernel - 1, la.conv_dim),
            (Ll, num_slots, la.num_value_heads, la.key_head_dim, la.value_head_dim))


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any, layout: str = "heads",
                  tp: int = 1, state_slots: int = 1) -> tuple[jax.Array, ...]:
    if jnp.dtype(dtype).itemsize == 1:
        kv_scales_shape(cfg, num_pages, page_size, layout)
    shape = kv_cache_shape(cfg, num_pages, page_size, layout, tp)
    states = tuple(jnp.zeros(s, jnp.float32) for s in state_shapes(cfg, state_slots))
    return (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), *states)


def kv_cache_bytes_per_page(cfg: ModelConfig, page_size: int, dtype: Any, layout: str = "heads", tp: int = 1) -> int:
    return llama.kv_cache_bytes_per_page(_full_config(cfg), page_size, dtype, layout, tp)


# ---------------------------------------------------------------------- the model
class Qwen3NextForCausalLM(LlamaForCausalLM):
    """`kv_cache` is (k, v) of the full-attention layers, then the linear layers' conv and
    recurrent state pools; `md.recurrent` gives each row its state slot."""

    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        kv_cache: tuple[jax.Array, ...],  # k, v [Lf, P, S, ...]; conv [Ll, N, K-1, C]; rec [Ll, N, Hv, dk, dv]
        md: AttentionMetadata,
        logits_indices: jax.Array,  # [R] int32
        *,
        attention_fn: AttentionFn,
        kv_update_fn: KVUpdateFn,
        moe_fn: MoEFn = single_device_moe,
        recurrent_fn: Callable[..., tuple[jax.Array, jax.Array, jax.Array]] = linear_mixing,
        lora: LoRABatch | None = None,
    ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
        if lora is not None:
            raise ValueError(f"{self.config.architecture} does not take LoRA adapters")
        if md.recurrent is None:
            raise ValueError(f"{self.config.architecture} needs the step's recurrent metadata (state slots)")
        cfg = self.config
        p = _lin(cfg).full_attention_interval
        views = paged_pool_views(self.kv_layout, kv_cache[0], 2)
        P = kv_cache[0].shape[1]
        pages = views.to_carry(kv_cache[:2])
        states = kv_cache[2:4]
        h = self._embed(token_ids, self.final_norm[...].dtype)  # [T, E]
        rope = rope_tables(positions, self._inv_freq)  # [T, rotary/2] each
        weights = {k: v[...] for k, v in self.layers.items()}
        live_rows = md.cu_q_lens[md.num_seqs[0]]

        def stack(i):
            return LayerStack(weights, i, self.matmul_precision, self.row_tile, live_rows)

        def group(carry, g):
            h, pages, states = carry
            for j in range(p - 1):
                layer, lin = g * p + j, g * (p - 1) + j
                x = self._norm(h, stack(layer)["input_norm"])
                y, states = self._linear_attention(x, stack(lin), lin, states, md, recurrent_fn)
                h = self._mlp_block(h + y, stack(layer), moe_fn)
            layer = g * p + p - 1
            x = self._norm(h, stack(layer)["input_norm"])
            y, pages = self._full_attention(x, stack(g), rope, views.to_pages(pages), md, g * P, views.page_size,
                                            attention_fn, kv_update_fn)
            h = self._mlp_block(h + y, stack(layer), moe_fn)
            return (h, views.to_carry(pages), states), None

        (h, pages, states), _ = jax.lax.scan(group, (h, pages, states),
                                             jnp.arange(cfg.num_layers // p, dtype=jnp.int32))
        h_last = self.final_hidden(jnp.take(h, logits_indices, axis=0))
        out = tuple(x.reshape(c.shape) for x, c in zip(pages, kv_cache[:2]))
        return h_last, h, (*out, *states)

    def _full_attention(self, x, w: LayerStack, rope, pages, md, page_offset, S, attention_fn, kv_update_fn):
        """Gated attention of one full layer on the normed input x [T, E]: [T, E] and the pages."""
        cfg = self.config
        T, H, Hkv, D = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qg = w.matmul(x, "attn_q").reshape(T, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
        k = w.matmul(x, "attn_k").reshape(T, Hkv, D)
        v = w.matmul(x, "attn_v").reshape(T, Hkv, D)
        q = apply_rope(self._norm(q, w["attn_q_norm"]), *rope)
        k = apply_rope(self._norm(k, w["attn_k_norm"]), *rope)
        pages = tuple(kv_update_fn(k, v, pages[0], pages[1], md.slot_mapping + page_offset * S))
        attn = attention_fn(q, pages[0], pages[1], md.kv_lens, md.block_tables + page_offset, md.cu_q_lens,
                            md.num_seqs, sm_scale=cfg.sm_scale, num_kv_heads=Hkv, sliding_window=None)
        attn = attn.reshape(T, H * D).astype(x.dtype) * jax.nn.sigmoid(gate)
        return w.matmul(attn, "attn_o"), pages

    def _linear_attention(self, x, w: LayerStack, index, states, md, recurrent_fn):
        """Gated DeltaNet on the normed input x [T, E]: [T, E] and the (conv, recurrent) pools,
        this layer's slots updated."""
        la, T = _lin(self.config), x.shape[0]
        Hk, Hv, dk, dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
        r = Hv // Hk
        if la.grouped_projection:  # per key head: q, k, then its r value heads' v and z; b, a alike
            qkvz = w.matmul(x, "lin_qkvz").reshape(T, Hk, 2 * dk + 2 * r * dv)
            mixed = qkvz[..., :2 * dk + r * dv].reshape(T, -1)  # [T, C], grouped per key head
            z = qkvz[..., 2 * dk + r * dv:].reshape(T, Hv, dv)
            ba = w.matmul(x, "lin_ba").reshape(T, Hk, 2 * r)
            b, a = ba[..., :r].reshape(T, Hv), ba[..., r:].reshape(T, Hv)
        else:  # lin_qkv's columns grouped per key head at load (`serving_layers`)
            mixed = w.matmul(x, "lin_qkv")
            z = w.matmul(x, "lin_z").reshape(T, Hv, dv)
            b, a = w.matmul(x, "lin_b"), w.matmul(x, "lin_a")
        taps = w["lin_conv"][:, 0, :]  # [C, K], grouped per key head at load
        beta = jax.nn.sigmoid(b.astype(jnp.float32))
        g = -jnp.exp(w["lin_a_log"].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + w["lin_dt_bias"].astype(jnp.float32))
        conv_pool = jax.lax.dynamic_index_in_dim(states[0], index, keepdims=False)
        rec_pool = jax.lax.dynamic_index_in_dim(states[1], index, keepdims=False)
        out, conv_pool, rec_pool = recurrent_fn(mixed, taps, g, beta, conv_pool, rec_pool, md, key_head_dim=dk,
                                                value_head_dim=dv)  # [T, Hv, dv] f32
        states = (jax.lax.dynamic_update_index_in_dim(states[0], conv_pool, index, 0),
                  jax.lax.dynamic_update_index_in_dim(states[1], rec_pool, index, 0))
        out = self._gated_norm(out.astype(x.dtype), z, w["lin_norm"])
        return w.matmul(out.reshape(T, Hv * dv), "lin_out"), states

    def _gated_norm(self, x, z, weight):
        """RMSNorm of x [T, Hv, dv] (plain weight), times SiLU(z), as transformers rounds it."""
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.config.rms_norm_eps)
        y = weight * xf.astype(x.dtype)
        return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)

    def _mlp_block(self, h, w: LayerStack, moe_fn):
        """h + the MLP of its post-attention norm: experts and the gated shared expert, or dense."""
        cfg = self.config
        x = self._norm(h, w["post_norm"])
        act = ACTIVATIONS[cfg.hidden_act]
        if not cfg.is_moe:
            gate, up = split_gate_up(w.matmul(x, "gate_up_proj"), self.shards)
            return h + w.matmul(act(gate) * up, "down_proj")
        weights, experts = moe.route(x, w["router"], cfg)
        extra = {}
        if "expert_gate_up_scale" in w:
            extra = {"gate_up_scale": w["expert_gate_up_scale"], "down_scale": w["expert_down_scale"]}
        y = moe_fn(x, weights, experts, w["expert_gate_up"], w["expert_down"], **extra)
        if "shared_gate" in w:
            s = w.matmul(act(w.matmul(x, "shared_gate")) * w.matmul(x, "shared_up"), "shared_down")
            y = y + jax.nn.sigmoid(x @ w["shared_expert_gate"][0][:, None]) * s
        return h + y


# ---------------------------------------------------------------------- registry entry
_HF_GLOBALS = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight", "lm_head": "lm_head.weight"}
_HF_LAYERS = {
    "input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj.weight", "attn_k": "self_attn.k_proj.weight", "attn_v": "self_attn.v_proj.weight",
    "attn_o": "self_attn.o_proj.weight", "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "lin_qkvz": "linear_attn.in_proj_qkvz.weight", "lin_ba": "linear_attn.in_proj_ba.weight",
    "lin_qkv": "linear_attn.in_proj_qkv.weight", "lin_z": "linear_attn.in_proj_z.weight",
    "lin_b": "linear_attn.in_proj_b.weight", "lin_a": "linear_attn.in_proj_a.weight",
    "lin_conv": "linear_attn.conv1d.weight", "lin_dt_bias": "linear_attn.dt_bias", "lin_a_log": "linear_attn.A_log",
    "lin_norm": "linear_attn.norm.weight", "lin_out": "linear_attn.out_proj.weight",
    "shared_gate": "mlp.shared_expert.gate_proj.weight", "shared_up": "mlp.shared_expert.up_proj.weight",
    "shared_down": "mlp.shared_expert.down_proj.weight", "shared_expert_gate": "mlp.shared_expert_gate.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
}
_HF_EXPERTS = ("mlp.gate.weight", "mlp.experts", "gate_proj", "up_proj", "down_proj")
# The projections stored [in, out] (checkpoints hold [out, in]): `loading.params.TRANSPOSED` adds them.
TRANSPOSED_WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_o", "lin_qkvz", "lin_ba", "lin_qkv", "lin_z", "lin_b",
                      "lin_a", "lin_out")


def grouped_channels(cfg: ModelConfig) -> np.ndarray:
    """The permutation from the checkpoint's conv channel order [q | k | v] (all heads each) to
    the order grouped per key head, [q_h | k_h | v_h*r .. v_h*r+r-1] for h = 0 .. Hk-1."""
    la = _lin(cfg)
    Hk, dk, dv, r = la.num_key_heads, la.key_head_dim, la.value_head_dim, la.num_value_heads // la.num_key_heads
    key_dim = Hk * dk
    parts = [np.concatenate([np.arange(h * dk, (h + 1) * dk), key_dim + np.arange(h * dk, (h + 1) * dk),
                             2 * key_dim + np.arange(h * r * dv, (h + 1) * r * dv)]) for h in range(Hk)]
    return np.concatenate(parts)


def serving_layers(layers: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """The conv taps (and Qwen3.5's q/k/v projection and its scales) in grouped channel order."""
    perm = grouped_channels(cfg)
    out = dict(layers)
    out["lin_conv"] = np.asarray(layers["lin_conv"])[:, perm]  # [Ll, C, 1, K]
    for name in ("lin_qkv", "lin_qkv_scale"):  # [Ll, E, C] / [Ll, C]
        if name in layers:
            out[name] = np.ascontiguousarray(np.asarray(layers[name])[..., perm])
    return out


# Tensor parallelism: heads split, the row-parallel projections' rows split (GSPMD's
# all-reduce), the conv channels and per-head vectors with their heads.
LAYER_SHARDING = {
    **{k: v for k, v in LLAMA_SHARDING.items() if k in ("gate_up_proj", "down_proj", "expert_gate_up", "expert_down")},
    **{k: v for k, v in DEEPSEEK_SHARDING.items() if k.startswith("shared_")},
    "attn_q": (None, None, MODEL_AXIS), "attn_k": (None, None, MODEL_AXIS), "attn_v": (None, None, MODEL_AXIS),
    "attn_o": (None, MODEL_AXIS, None),
    "lin_qkvz": (None, None, MODEL_AXIS), "lin_ba": (None, None, MODEL_AXIS), "lin_qkv": (None, None, MODEL_AXIS),
    "lin_z": (None, None, MODEL_AXIS), "lin_b": (None, None, MODEL_AXIS), "lin_a": (None, None, MODEL_AXIS),
    "lin_conv": (None, MODEL_AXIS, None, None), "lin_dt_bias": (None, MODEL_AXIS), "lin_a_log": (None, MODEL_AXIS),
    "lin_out": (None, MODEL_AXIS, None),
}


def hf_weight_names(cfg: ModelConfig) -> WeightNames:
    return WeightNames(_HF_GLOBALS, _HF_LAYERS, _HF_EXPERTS)


QWEN3_NEXT = add_builtin(ModelFamily(
    name="qwen3_next",
    architectures=ARCHITECTURES,
    hf_architectures=HF_ARCHITECTURES,
    hf_model_types=HF_MODEL_TYPES,
    config_from_hf=config_from_hf,
    model_class=Qwen3NextForCausalLM,
    param_shapes=expected_param_shapes,
    hf_weight_names=hf_weight_names,
    layer_ids=layer_ids,
    kv_cache=KVCacheSpec(shape=kv_cache_shape, scales_shape=kv_scales_shape, bytes_per_page=kv_cache_bytes_per_page,
                         init=init_kv_cache, state_shapes=state_shapes, state_split_axes=(3, 2)),
    layer_sharding=LAYER_SHARDING,
    expert_parallel_sharding=EXPERT_PARALLEL_SHARDING,
    support=ModelSupport(lora=False, quantized_kv=False, spec_decode=False, tensor_parallel=True,
                         expert_parallel=True),
    serving_layers=serving_layers,
))
