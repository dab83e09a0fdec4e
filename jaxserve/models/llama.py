"""The decoder of every served family as a Flax NNX module over a paged KV cache: the Llama
family (Llama, Mistral, Qwen2, Qwen3), the routed-expert decoders (Qwen3-MoE, Mixtral) and
Gemma 2 / 3. What differs is data in `ModelConfig` (see its docstring), never a separate graph.

The layers' weights are stacked along a leading [L] axis and run with `jax.lax.scan`, so the
compiled program holds one layer body whatever the depth. What differs between layers (Gemma's
sliding windows and RoPE bases) is scanned per-layer data. The forward takes a flat ragged batch
(any mix of prefill chunks and decodes) and writes K/V into the cache it carries, in place.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import moe
from jaxserve.models.config import ModelConfig, RopeScaling
from jaxserve.models.fused import split_gate_up, split_qkv
from jaxserve.models.layers import (
    AttentionFn,
    KVUpdateFn,
    MoEFn,
    clamped_swiglu,
    gated_activation,
    rms_norm,
    soft_cap,
    tiled_matmul,
)
from jaxserve.models.lora import LoRABatch, lora_delta, num_slots
from jaxserve.models.metadata import AttentionMetadata
from jaxserve.models.quantization import SCALE_SUFFIX, scale_name
from jaxserve.models.rope import (
    apply_rope,
    mrope_tables,
    rope_attention_factor,
    rope_inv_freq,
    rope_tables,
)
from pallas_kernels.quantized_matmul.dense import dense_matmul
from pallas_kernels.quantized_matmul.ops import quantized_matmul
from pallas_kernels.quantized_matmul.reference import GLU_ACTIVATIONS

# Names of the stacked per-layer weights as checkpoints and loaders hold them, with their
# shapes (E hidden, I intermediate). The model itself runs them fused (`models/fused.py`).
LAYER_WEIGHTS = (
    "input_norm",  # [L, E]
    "q_proj",  # [L, E, Hq*D]
    "k_proj",  # [L, E, Hkv*D]
    "v_proj",  # [L, E, Hkv*D]
    "o_proj",  # [L, Hq*D, E]
    "post_norm",  # [L, E]
    "gate_proj",  # [L, E, I]
    "up_proj",  # [L, E, I]
    "down_proj",  # [L, I, E]
)
BIAS_WEIGHTS = ("q_bias", "k_bias", "v_bias")  # [L, Hq*D], [L, Hkv*D], [L, Hkv*D] (Qwen2)
QK_NORM_WEIGHTS = ("q_norm", "k_norm")  # [L, D] (Qwen3, Qwen3-MoE, Gemma 3)
# Gemma's sandwich norms: on the attention output and on the MLP output ([L, E] each); its
# pre-MLP norm is `post_norm`, as in every family.
SANDWICH_NORM_WEIGHTS = ("post_attn_norm", "post_ffn_norm")


def expected_param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The params tree the model expects, as shapes; loaders are checked against it."""
    L, E, I, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim  # noqa: E741
    layers = {
        "input_norm": (L, E),
        "q_proj": (L, E, cfg.q_size),
        "k_proj": (L, E, cfg.kv_size),
        "v_proj": (L, E, cfg.kv_size),
        "o_proj": (L, cfg.q_size, E),
        "post_norm": (L, E),
    }
    if cfg.is_moe:
        X, Im = cfg.num_experts, cfg.moe_intermediate_size
        layers.update(router=(L, E, X), expert_gate=(L, X, E, Im), expert_up=(L, X, E, Im),
                      expert_down=(L, X, Im, E))
    else:
        layers.update(gate_proj=(L, E, I), up_proj=(L, E, I), down_proj=(L, I, E))
    if cfg.sandwich_norms:
        layers.update(post_attn_norm=(L, E), post_ffn_norm=(L, E))
    if cfg.attention_bias:
        layers.update(q_bias=(L, cfg.q_size), k_bias=(L, cfg.kv_size), v_bias=(L, cfg.kv_size))
    if cfg.qk_norm:
        layers.update(q_norm=(L, D), k_norm=(L, D))
    layers.update(_gpt_oss_shapes(cfg))
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, E), "layers": layers, "final_norm": (E,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (E, cfg.vocab_size)
    return shapes


def _gpt_oss_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """gpt-oss's extra layer tensors: attention sinks, the output projection's bias, the
    router's logit bias and the experts' biases."""
    L, E = cfg.num_layers, cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.attention_sinks:
        shapes["sinks"] = (L, cfg.num_heads)
    if cfg.o_proj_bias:
        shapes["o_bias"] = (L, E)
    if cfg.is_moe and cfg.router_scoring == "topk_softmax":
        shapes["router_logit_bias"] = (L, cfg.num_experts)
    if cfg.is_moe and cfg.expert_bias:
        X, Im = cfg.num_experts, cfg.moe_intermediate_size
        shapes.update(expert_gate_bias=(L, X, Im), expert_up_bias=(L, X, Im), expert_down_bias=(L, X, E))
    return shapes


def single_device_moe(x, weights, experts, gate_up, down, gate_up_scale=None, down_scale=None, gate_up_bias=None,
                      down_bias=None, glu=None, scale_inputs=False):
    return moe.experts_forward(x, weights, experts, gate_up, down, 0, activation=jax.nn.silu,
                               gate_up_scale=gate_up_scale, down_scale=down_scale, gate_up_bias=gate_up_bias,
                               down_bias=down_bias, glu=glu, scale_inputs=scale_inputs)


class LlamaForCausalLM(nnx.Module):
    """Holds the weights as nnx.Params; `__call__` is the ragged, paged forward.

    `params["layers"]` holds the fused projections (`fuse_projections(layers, shards)`),
    `shards` the tensor-parallel degree their columns are interleaved for; `expert_parallel`
    whether routed experts are split whole over the devices (else by width, like the MLP).
    """

    def __init__(self, config: ModelConfig, params: dict[str, Any], shards: int = 1, expert_parallel: bool = False,
                 matmul_precision: str = "highest", row_tile: int = 0, embed_columns: bool = False,
                 kv_layout: str = "heads", native_dense: bool = False):
        self.config = config
        # The cache's page layout ("heads" | "lanes"): a heads-layout cache of one KV head comes
        # without its size-1 head axis (`kv_cache_shape`), and is viewed with it for the kernels.
        self.kv_layout = kv_layout
        # A quantized tied embedding held [E, V], a column per token (`embed_columns`): on CPU
        # the int8 head kernel reads [K, N] faster than [N, K], and the lookup gathers columns.
        self.embed_columns = embed_columns
        # Batch-invariant mode (> 0): every dense matmul runs over fixed tiles of `row_tile`
        # rows (`tiled_matmul`), so a row's result never depends on how many rows share it.
        self.row_tile = row_tile
        # The quantized matmuls' activation precision ("highest" | "bf16": activations rounded
        # to bf16 before the products, f32 sums; `pallas_kernels.quantized_matmul`).
        self.matmul_precision = matmul_precision
        # bf16 on one CPU device: the dense projections and the head stay stacked and are read
        # in place by the native CPU matmul (`pallas_kernels.quantized_matmul.dense`), like
        # quantized ones; XLA:CPU's bf16 dot of a decode step's few rows is 10-30x slower.
        self.native_dense = native_dense
        self.shards = shards
        self.expert_parallel = expert_parallel
        self.embed = nnx.Param(params["embed"])  # [V, E] ([E, V] with embed_columns)
        self.layers = nnx.Dict({k: nnx.Param(v) for k, v in params["layers"].items()})
        self.final_norm = nnx.Param(params["final_norm"])  # [E]
        self.lm_head = nnx.Param(params["lm_head"]) if "lm_head" in params else None  # [E, V]
        # Quantized weights (jaxserve/models/quantization.py): int8/fp8 values plus one f32 scale per
        # output channel; a quantized tied embedding has one scale per token row.
        self.embed_qscale = nnx.Param(params["embed_scale"]) if "embed_scale" in params else None  # [V]
        self.lm_head_qscale = nnx.Param(params["lm_head_scale"]) if "lm_head_scale" in params else None  # [V]
        self._inv_freq = rope_inv_freq(config)  # numpy constant, [D/2]
        # Sliding-window layers of Gemma 3 rotate with their own (unscaled) base.
        self._local_inv_freq = (rope_inv_freq(dataclasses.replace(
            config, rope_theta=config.rope_local_theta, rope_scaling=RopeScaling()))
            if config.rope_local_theta is not None else None)

    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        kv_cache: tuple[jax.Array, ...],  # (k, v): [L, P, S, Hkv, D] or [L, P, S, C] (lanes) each,
        # then (k_scales, v_scales) for quantized pages (`kv_scales_pool_shape`)
        md: AttentionMetadata,
        logits_indices: jax.Array,  # [R] int32
        *,
        attention_fn: AttentionFn,
        kv_update_fn: KVUpdateFn,
        moe_fn: MoEFn = single_device_moe,
        lora: LoRABatch | None = None,
    ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
        """Returns the final-normed hidden states of rows `logits_indices` ([R, E]), every
        token's hidden state before the final norm ([T, E], for prompt logprobs; the layers
        made it anyway, so it costs one output buffer) and the cache. `lora`: the adapter
        slots and each token's slot (none: the base model, no LoRA work traced)."""
        cfg = self.config
        k_cache, v_cache = kv_cache[:2]
        L, (P, S) = cfg.num_stacked_layers, k_cache.shape[1:3]
        dtype = self.final_norm[...].dtype  # the activations' dtype (the embedding may be int8)

        h = self._embed(token_ids, dtype)  # [T, E]
        if cfg.embed_scale:  # the normaliser is rounded to the params' dtype, as HF does
            h = h * jnp.asarray(cfg.hidden_size ** 0.5, dtype)
        mm = md.multimodal
        num_deepstack = 0
        if mm is not None:  # image tokens take the encoder's rows
            h = jnp.where(mm.is_embed[:, None], mm.embeds.astype(dtype), h)
            num_deepstack = mm.deepstack.shape[0]
        if cfg.mrope_section is not None:
            pos3 = mm.mrope_positions if mm is not None else jnp.broadcast_to(positions, (3, *positions.shape))
            rope = mrope_tables(pos3, self._inv_freq, cfg.mrope_section, rope_attention_factor(cfg),
                                cfg.mrope_interleaved)
        else:
            rope = rope_tables(positions, self._inv_freq, rope_attention_factor(cfg))  # cos, sin: [T, D/2] each
        local_rope = rope_tables(positions, self._local_inv_freq) if self._local_inv_freq is not None else None

        # The attention sees all layers' pages as one [L*P, S, ...] pool: layer l's pages are
        # offset by l*P, so no per-layer slice of the cache is ever copied.
        to_pages, to_carry, _ = paged_pool_views(self.kv_layout, k_cache, 2)
        pool = to_carry(kv_cache)
        # Quantized dense projections (and bf16 ones with `native_dense`) stay stacked [L, ...]
        # and are read in place by layer index (pallas_kernels.quantized_matmul); everything else
        # is sliced per layer by the scan.
        stacked = {k: v[...] for k, v in self.layers.items()
                   if _stacked_quantized(k, self.layers) or (self.native_dense and k in _DENSE_QUANTIZABLE)}
        layer_params = {k: v[...] for k, v in self.layers.items() if k not in stacked}
        windows = cfg.windows()
        per_layer = {"layer_id": jnp.arange(L, dtype=jnp.int32)}
        # One window for every layer is a compile-time constant; interleaved ones are data.
        uniform = len(set(windows)) == 1
        if not uniform:
            per_layer["window"] = jnp.asarray(windows, jnp.int32)  # [L], 0: global
        if local_rope is not None and uniform:  # every layer global, or every layer local
            rope, local_rope = (local_rope if windows[0] else rope), None
        # Layer groups (windowed layers beside full ones): layer l's pages are slot
        # cache_slot[l] of its group's pages, read through its group's block table.
        groups = cfg.kv_layer_groups
        if groups is not None:
            per_layer["cache_slot"] = jnp.asarray(groups.layer_slot, jnp.int32)
            if groups.num_groups > 1:
                per_layer["kv_group"] = jnp.asarray(groups.layer_group, jnp.int32)

        # The step's real tokens (the rest of the bucket is padding): quantized projections
        # skip the padded rows' work where the kernel can (the native CPU one).
        live_rows = md.cu_q_lens[md.num_seqs[0]]
        lora_weights = lora.weights if lora is not None else {}
        onehot = lora.onehot(num_slots(lora_weights), dtype) if lora is not None else None  # [T, N]

        def layer(carry, xs):
            h, pool = carry
            pool = to_pages(pool)
            lp, per, lora_lp = xs
            window = per["window"] if not uniform else (windows[0] or None)
            cos_sin = rope
            if local_rope is not None:  # Gemma 3: local base on the sliding-window layers
                cos_sin = jax.tree.map(lambda g, loc: jnp.where(per["window"] > 0, loc, g), rope, local_rope)
            page_offset = per.get("cache_slot", per["layer_id"]) * P
            lmd = group_metadata(md, per["kv_group"], groups.num_groups) if "kv_group" in per else md
            lp = _LayerWeights(lp, stacked, per["layer_id"], self.matmul_precision, self.row_tile,
                               lora_lp, onehot, live_rows)
            if cfg.sandwich_norms:  # the branch's output is normed before the skip connection
                attn, pool = self._attention(
                    h, lp, cos_sin, pool, lmd, page_offset, S, window, attention_fn, kv_update_fn)
                h = h + self._norm(attn, lp["post_attn_norm"])
                x = self._norm(h, lp["post_norm"])
                y = self._norm(self._mlp(x, lp, moe_fn), lp["post_ffn_norm"])
                return (h + y, to_carry(pool)), None
            # h + branch, handed to the branch's last projection (a quantized one adds it in
            # its epilogue on CPU; the same bits as the add).
            h, pool = self._attention(
                h, lp, cos_sin, pool, lmd, page_offset, S, window, attention_fn, kv_update_fn, residual=h)
            x = self._norm(h, lp["post_norm"])
            h = self._mlp(x, lp, moe_fn, residual=h)
            if num_deepstack:  # Qwen3-VL: the image tokens' DeepStack row after layer i < D
                i = per["layer_id"]
                row = jax.lax.dynamic_index_in_dim(mm.deepstack, jnp.minimum(i, num_deepstack - 1), 0, False)
                h = jnp.where((mm.is_embed & (i < num_deepstack))[:, None], h + row.astype(h.dtype), h)
            return (h, to_carry(pool)), None

        (h, pool), _ = jax.lax.scan(layer, (h, pool), (layer_params, per_layer, lora_weights))

        # Only the rows that are sampled leave the backbone: logits are computed later, for
        # those [R] rows only, never for all [T] tokens.
        h_last = self.final_hidden(jnp.take(h, logits_indices, axis=0))
        kv_cache = tuple(p.reshape(x.shape) for p, x in zip(pool, kv_cache))
        return h_last, h, kv_cache

    def final_hidden(self, h: jax.Array) -> jax.Array:
        """The final norm: [N, E] last-layer hidden states -> what `compute_logits` takes."""
        return self._norm(h, self.final_norm[...])

    def _norm(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        """The model's RMSNorm of x [T, ...] (row-tiled in batch-invariant mode)."""
        cfg = self.config
        return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_weight_offset, self.row_tile)

    def _attention(self, h, lp, cos_sin, pool, md, page_offset, S, window, attention_fn, kv_update_fn,
                   residual=None):
        """Self-attention of one layer: writes this step's K/V, returns ([T, E] output, plus
        `residual` when given; cache). `pool`: the flattened (k, v[, k_scales, v_scales]) of
        every layer."""
        cfg = self.config
        T = h.shape[0]
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = self._norm(h, lp["input_norm"])
        qkv = lp.matmul(x, "qkv_proj")  # [T, (Hq + 2 Hkv) * D], interleaved per shard
        if cfg.attention_bias:
            qkv = qkv + lp["qkv_bias"]
        q, k, v = split_qkv(qkv, cfg, self.shards)  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D]
        q, k, v = (lp.plus_lora(y, x, name) for y, name in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")))
        q = q.reshape(T, Hq, D)
        k = k.reshape(T, Hkv, D)
        v = v.reshape(T, Hkv, D)
        if cfg.qk_norm:
            q = self._norm(q, lp["q_norm"])
            k = self._norm(k, lp["k_norm"])
        q = apply_rope(q, *cos_sin)
        k = apply_rope(k, *cos_sin)
        pool = tuple(kv_update_fn(k, v, pool[0], pool[1], md.slot_mapping + page_offset * S, **_scales(pool)))
        extra = {"sinks": lp["sinks"].astype(jnp.float32)} if cfg.attention_sinks else {}
        if md.multimodal is not None and md.multimodal.attend_until is not None:  # Gemma 3's images: both ways
            extra["attend_until"] = md.multimodal.attend_until
        attn = attention_fn(
            q, pool[0], pool[1], md.kv_lens, md.block_tables + page_offset, md.cu_q_lens,
            md.num_seqs, sm_scale=cfg.sm_scale, num_kv_heads=Hkv, sliding_window=window,
            soft_cap=cfg.attn_logit_softcap, **_scales(pool), **extra,
        )  # [T, Hq, D]
        attn = attn.reshape(T, Hq * D).astype(h.dtype)
        if cfg.o_proj_bias:  # (the branch's bias first, then the residual, as HF adds them)
            out = lp.project(attn, "o_proj") + lp["o_bias"]
            return (out if residual is None else residual + out), pool
        return lp.project(attn, "o_proj", residual), pool

    def _mlp(self, x, lp, moe_fn, residual=None):
        """The dense gated MLP, or the routed experts. x: [T, E] -> [T, E] (plus `residual`
        when given)."""
        cfg = self.config
        if cfg.is_moe:
            weights, experts = moe.route(x, lp["router"], cfg, lp.get("router_logit_bias"))  # [T, k] each
            extra = {}
            if "expert_gate_up_scale" in lp:  # quantized experts: [X, 2I] and [X, E] scales
                extra = {"gate_up_scale": lp["expert_gate_up_scale"], "down_scale": lp["expert_down_scale"]}
            if cfg.expert_bias:  # gpt-oss: [X, 2I] and [X, E] biases
                extra.update(gate_up_bias=lp["expert_gate_up_bias"], down_bias=lp["expert_down_bias"])
            if cfg.swiglu_limit is not None:
                extra["glu"] = functools.partial(clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
            y = moe_fn(x, weights, experts, lp["expert_gate_up"], lp["expert_down"], **extra)
            return y if residual is None else residual + y
        if lp.takes_glu("gate_up_proj", cfg.hidden_act, x, self.shards):  # act(gate) * up in the matmul
            act = lp.matmul(x, "gate_up_proj", glu=cfg.hidden_act)  # [T, I]
        else:
            gate, up = split_gate_up(lp.matmul(x, "gate_up_proj"), self.shards)  # [T, I] each
            gate, up = lp.plus_lora(gate, x, "gate_proj"), lp.plus_lora(up, x, "up_proj")
            act = gated_activation(cfg.hidden_act, gate, up)
        return lp.project(act, "down_proj", residual)

    def _embed(self, token_ids: jax.Array, dtype: Any) -> jax.Array:
        """The embedding rows of `token_ids` [T] -> [T, E] in `dtype` (dequantized rows when the
        tied head is quantized)."""
        if self.embed_columns:
            rows = jnp.take(self.embed[...], token_ids, axis=1).T  # [E, T] -> [T, E]
        else:
            rows = jnp.take(self.embed[...], token_ids, axis=0)
        if self.embed_qscale is None:
            return rows
        scale = jnp.take(self.embed_qscale[...], token_ids, axis=0)  # [T]
        return (rows.astype(jnp.float32) * scale[:, None]).astype(dtype)

    def compute_logits(self, h: jax.Array, live_rows: jax.Array | None = None) -> jax.Array:
        """h: [R, E] final-normed hidden states -> logits [R, V] in f32. `live_rows` (int32
        []): h's first rows that are real; a quantized head may skip the rest (0 there)."""
        if self.native_dense and self.lm_head_qscale is None and self.embed_qscale is None:
            tied = self.lm_head is None  # the embedding as the head: [V, E], or [E, V] with embed_columns
            head = self.embed[...] if tied else self.lm_head[...]
            # f32 logits straight from the f32 sums (not rounded to bf16 first: near-ties)
            logits = dense_matmul(h, head, transposed=tied and not self.embed_columns, rows=live_rows,
                                  out_dtype=jnp.float32)
        elif self.lm_head_qscale is not None:
            logits = quantized_matmul(h, self.lm_head[...], self.lm_head_qscale[...], rows=live_rows,
                                      precision=self.matmul_precision).astype(jnp.float32)
        elif self.embed_qscale is not None:  # a quantized tied head: [V, E] rows (or [E, V]), a scale per token
            logits = quantized_matmul(h, self.embed[...], self.embed_qscale[...], transposed=not self.embed_columns,
                                      rows=live_rows, precision=self.matmul_precision).astype(jnp.float32)
        else:
            tied = self.lm_head is None  # the embedding [V, E] as the head
            head = self.embed[...] if tied else self.lm_head[...]  # [V, E] or [E, V]
            logits = tiled_matmul(h, head, self.row_tile, transposed=tied).astype(jnp.float32)
        return soft_cap(logits, self.config.final_logit_softcap)


def group_metadata(md: AttentionMetadata, group: jax.Array, num_groups: int) -> AttentionMetadata:
    """The step's metadata as one layer group's layers read it: the group's block tables
    ([R, G * W] holds the groups' side by side) and slots ([G * T] likewise)."""
    W = md.block_tables.shape[1] // num_groups
    T = md.slot_mapping.shape[0] // num_groups
    return dataclasses.replace(
        md, block_tables=jax.lax.dynamic_slice_in_dim(md.block_tables, group * W, W, axis=1),
        slot_mapping=jax.lax.dynamic_slice_in_dim(md.slot_mapping, group * T, T))


def page_dims(kv_layout: str, pages: jax.Array) -> tuple[int, ...]:
    """A page's shape as the kernels take it, from a cache array [L, P, S, ...]: (S, Hkv, D)
    or (S, 1, D) in the heads layout (a one-head cache is held without the head axis), (S, C)
    in the lanes layout."""
    if kv_layout == "heads" and pages.ndim == 4:
        return (pages.shape[2], 1, pages.shape[3])
    return tuple(pages.shape[2:])


class PoolViews(NamedTuple):
    to_pages: Callable[[tuple[jax.Array, ...]], tuple[jax.Array, ...]]
    to_carry: Callable[[tuple[jax.Array, ...]], tuple[jax.Array, ...]]
    page_size: int


def paged_pool_views(kv_layout: str, pages: jax.Array, num_page_arrays: int) -> PoolViews:
    """(to_pages, to_carry, page size): every layer's cache as the layer loop carries it, and back to the
    [L*P, S, ...] pools the kernels take (scales, pooled already, pass through). A one-head
    heads-layout cache is carried as [L*P*S, D] rows: carried with the size-1 head axis (or
    held with it), XLA:CPU relaid the whole cache out and copied it back on every step (4
    copies per step at one KV head; none with two or more)."""
    L, P, S = pages.shape[:3]
    dims = page_dims(kv_layout, pages)
    n = num_page_arrays
    if dims[1:2] == (1,) and len(dims) == 3:
        def to_pages(pool):
            return (*(x.reshape(L * P, *dims) for x in pool[:n]), *pool[n:])

        def to_carry(pool):
            return (*(x.reshape(L * P * S, dims[-1]) for x in pool[:n]), *pool[n:])
    else:
        def to_pages(pool):
            return (*(x.reshape(L * P, *dims) if x.ndim != len(dims) + 1 else x for x in pool[:n]), *pool[n:])

        to_carry = to_pages
    return PoolViews(to_pages, to_carry, S)


def _scales(pool: tuple[jax.Array, ...]) -> dict[str, jax.Array]:
    """The quantized cache's scales as the ops take them (none for a full-precision cache)."""
    return {"k_scales": pool[2], "v_scales": pool[3]} if len(pool) == 4 else {}


def _stacked_quantized(name: str, layers: Any) -> bool:
    """A quantized dense projection (or its scale), read in place by layer index."""
    base = name.removesuffix(SCALE_SUFFIX)
    return base in _DENSE_QUANTIZABLE and scale_name(base) in layers


_DENSE_QUANTIZABLE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class _LayerWeights(dict):
    """One layer's weights inside the scan: the sliced ones as a dict, plus `matmul(x, name)`
    that runs a quantized projection from the stacked weights by layer index, and
    `plus_lora(y, x, name)` that adds the adapters' delta of a target to its output.
    `live_rows` (traced): the step's real tokens; a quantized projection's rows past them are
    padding, which the native CPU kernel skips (zeros there)."""

    def __init__(self, sliced: dict[str, Any], stacked: dict[str, Any], layer: jax.Array, precision: str,
                 row_tile: int = 0, lora: dict[str, jax.Array] | None = None, onehot: jax.Array | None = None,
                 live_rows: jax.Array | None = None):
        super().__init__(sliced)
        self._stacked = stacked
        self._layer = layer
        self._precision = precision
        self._row_tile = row_tile
        self._lora = lora or {}  # "<target>.a" [in, N, r], "<target>.b" [N, r, out]
        self._onehot = onehot  # [T, N]
        self._live_rows = live_rows  # int32 []

    def plus_lora(self, y: jax.Array, x: jax.Array, target: str) -> jax.Array:
        """y [T, out] + the LoRA delta of `target` on its input x [T, in] (y itself when no
        adapter slots target it)."""
        a = self._lora.get(f"{target}.a")
        if a is None:
            return y
        matmul = functools.partial(_plain_or_tiled, row_tile=self._row_tile)
        return y + lora_delta(x, a, self._lora[f"{target}.b"], self._onehot, matmul).astype(y.dtype)

    def project(self, x: jax.Array, name: str, residual: jax.Array | None = None) -> jax.Array:
        """x @ W_name plus its LoRA delta, plus `residual` [T, out] when given: a quantized
        projection without adapters adds it in the matmul's epilogue (the native CPU kernel
        writes [T, out] once instead of twice), the same bits as `residual + y`."""
        if residual is not None and name in self._stacked and f"{name}.a" not in self._lora:
            return self.matmul(x, name, residual)
        y = self.plus_lora(self.matmul(x, name), x, name)
        return y if residual is None else residual + y

    def takes_glu(self, name: str, act: str, x: jax.Array, shards: int) -> bool:
        """Whether `matmul(x, name, glu=act)` may give a gated MLP's activation directly: a
        stacked projection (the native CPU kernel's, or the quantized op's) of one shard
        without adapters on its halves, SiLU, bf16 activations. f32 activations keep the
        separate activation (XLA's exponential: the f32 mode's bits stay as they were)."""
        return (name in self._stacked and shards == 1 and act in GLU_ACTIVATIONS and x.dtype == jnp.bfloat16
                and "gate_proj.a" not in self._lora and "up_proj.a" not in self._lora)

    def matmul(self, x: jax.Array, name: str, residual: jax.Array | None = None, glu: str | None = None) -> jax.Array:
        """x @ W_name (+ `residual`, which only a stacked projection takes: see `project`);
        with `glu` (a stacked projection: `takes_glu`) the gated activation of its two halves."""
        if name in self._stacked and scale_name(name) not in self._stacked:  # bf16, native CPU matmul
            return dense_matmul(x, self._stacked[name], layer=self._layer, residual=residual, rows=self._live_rows,
                                glu=glu)
        if name in self._stacked:
            return quantized_matmul(x, self._stacked[name], self._stacked[scale_name(name)], layer=self._layer,
                                    precision=self._precision, residual=residual, rows=self._live_rows, glu=glu)
        if residual is not None or glu is not None:
            raise ValueError(f"{name} is not a stacked projection: only those take a residual or a glu")
        return tiled_matmul(x, self[name], self._row_tile)


def _plain_or_tiled(x: jax.Array, w: jax.Array, row_tile: int) -> jax.Array:
    return tiled_matmul(x, w, row_tile)


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int, layout: str = "heads",
                   tp: int = 1) -> tuple[int, ...]:
    """One of the K/V caches: [L, P, S, Hkv, D] (heads layout; [L, P, S, D] for one KV head,
    see `paged_pool_views`) or [L, P, S, C] (lanes layout; under tensor parallelism C holds
    `tp` rank rows of their own padded width)."""
    if layout == "lanes":
        from pallas_kernels.kv_layout import lanes_width

        return (cfg.num_cache_layers, num_pages, page_size, tp * lanes_width(cfg.num_kv_heads // tp, cfg.head_dim))
    if cfg.num_kv_heads == 1:
        return (cfg.num_cache_layers, num_pages, page_size, cfg.head_dim)
    return (cfg.num_cache_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)


def kv_scales_pool_shape(cfg: ModelConfig, num_pages: int, page_size: int, layout: str = "heads") -> tuple[int, ...]:
    """One of a quantized cache's scale arrays, for the pool of all layers' pages the model
    flattens the cache into (`pallas_kernels.kv_layout.kv_scales_shape` of L * num_pages)."""
    from pallas_kernels.kv_layout import kv_scales_shape

    return kv_scales_shape(cfg.num_cache_layers * num_pages, page_size, cfg.num_kv_heads, layout)


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any, layout: str = "heads",
                  tp: int = 1) -> tuple[jax.Array, ...]:
    """Zeroed K and V caches (see `kv_cache_shape`); for a quantized (1-byte) dtype also their
    f32 scales (`kv_scales_pool_shape`)."""
    shape = kv_cache_shape(cfg, num_pages, page_size, layout, tp)
    caches = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    if jnp.dtype(dtype).itemsize == 1:
        scales = kv_scales_pool_shape(cfg, num_pages, page_size, layout)
        caches += (jnp.zeros(scales, jnp.float32), jnp.zeros(scales, jnp.float32))
    return caches


def kv_cache_bytes_per_page(cfg: ModelConfig, page_size: int, dtype: Any, layout: str = "heads", tp: int = 1) -> int:
    """Bytes one page costs across all layers and devices, K and V together (padding lanes
    of the lanes layout included)."""
    shape = kv_cache_shape(cfg, 1, page_size, layout, tp)
    total = 2 * int(np.prod(shape)) * np.dtype(dtype).itemsize
    if np.dtype(dtype).itemsize == 1:  # quantized pages: one f32 scale per token and KV head
        total += 2 * cfg.num_cache_layers * page_size * cfg.num_kv_heads * 4
    return total
