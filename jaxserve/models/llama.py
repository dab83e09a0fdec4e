"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) as a Flax NNX module over a paged KV cache.

The layers' weights are stacked along a leading [L] axis and run with `jax.lax.scan`, so the
compiled program holds one layer body whatever the depth. The forward takes a flat ragged batch
(any mix of prefill chunks and decodes) and writes K/V into the cache it carries, in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models.config import ModelConfig, rope_inv_freq
from jaxserve.models.fused import split_gate_up, split_qkv
from jaxserve.models.metadata import AttentionMetadata

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
QK_NORM_WEIGHTS = ("q_norm", "k_norm")  # [L, D] (Qwen3)


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
        "gate_proj": (L, E, I),
        "up_proj": (L, E, I),
        "down_proj": (L, I, E),
    }
    if cfg.attention_bias:
        layers.update(q_bias=(L, cfg.q_size), k_bias=(L, cfg.kv_size), v_bias=(L, cfg.kv_size))
    if cfg.qk_norm:
        layers.update(q_norm=(L, D), k_norm=(L, D))
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, E), "layers": layers, "final_norm": (E,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (E, cfg.vocab_size)
    return shapes


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in f32 (as HF does), cast back to the input dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * xf).astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention). x: [T, H, D]; cos, sin: [T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    xf1, xf2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    out = jnp.concatenate([xf1 * c - xf2 * s, xf2 * c + xf1 * s], axis=-1)
    return out.astype(x.dtype)


# attention_fn(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale,
#              sliding_window) -> [T, Hq, D]
AttentionFn = Callable[..., jax.Array]
# kv_update_fn(k_new, v_new, k_pages, v_pages, slot_mapping) -> (k_pages, v_pages)
KVUpdateFn = Callable[..., tuple[jax.Array, jax.Array]]


class LlamaForCausalLM(nnx.Module):
    """Holds the weights as nnx.Params; `__call__` is the ragged, paged forward.

    `params["layers"]` holds the fused projections (`fuse_projections(layers, shards)`),
    `shards` the tensor-parallel degree their columns are interleaved for.
    """

    def __init__(self, config: ModelConfig, params: dict[str, Any], shards: int = 1):
        self.config = config
        self.shards = shards
        self.embed = nnx.Param(params["embed"])  # [V, E]
        self.layers = nnx.Dict({k: nnx.Param(v) for k, v in params["layers"].items()})
        self.final_norm = nnx.Param(params["final_norm"])  # [E]
        self.lm_head = nnx.Param(params["lm_head"]) if "lm_head" in params else None  # [E, V]
        self._inv_freq = rope_inv_freq(config)  # numpy constant, [D/2]

    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        kv_cache: tuple[jax.Array, jax.Array],  # 2 x [L, P, S, Hkv, D] or 2 x [L, P, S, C] (lanes)
        md: AttentionMetadata,
        logits_indices: jax.Array,  # [R] int32
        *,
        attention_fn: AttentionFn,
        kv_update_fn: KVUpdateFn,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Returns the final-normed hidden states of rows `logits_indices` ([R, E]) and the cache."""
        cfg = self.config
        k_cache, v_cache = kv_cache
        L, P, S, *row = k_cache.shape
        Hkv, D = cfg.num_kv_heads, cfg.head_dim
        T = token_ids.shape[0]
        Hq = cfg.num_heads
        shards = self.shards
        dtype = self.embed[...].dtype

        h = jnp.take(self.embed[...], token_ids, axis=0)  # [T, E]
        angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(self._inv_freq)[None, :]
        cos, sin = jnp.cos(angles), jnp.sin(angles)  # [T, D/2]
        sm_scale = float(D) ** -0.5

        # The attention sees all layers' pages as one [L*P, S, ...] pool: layer l's pages are
        # offset by l*P, so no per-layer slice of the cache is ever copied.
        k_flat = k_cache.reshape(L * P, S, *row)
        v_flat = v_cache.reshape(L * P, S, *row)
        layer_params = {k: v[...] for k, v in self.layers.items()}

        def layer(carry, xs):
            h, k_flat, v_flat = carry
            lp, layer_id = xs
            x = rms_norm(h, lp["input_norm"], cfg.rms_norm_eps)
            qkv = x @ lp["qkv_proj"]  # [T, (Hq + 2 Hkv) * D], interleaved per shard
            if cfg.attention_bias:
                qkv = qkv + lp["qkv_bias"]
            q, k, v = split_qkv(qkv, cfg, shards)  # [T, Hq*D], [T, Hkv*D], [T, Hkv*D]
            q = q.reshape(T, Hq, D)
            k = k.reshape(T, Hkv, D)
            v = v.reshape(T, Hkv, D)
            if cfg.qk_norm:
                q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
                k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            page_offset = layer_id * P
            k_flat, v_flat = kv_update_fn(k, v, k_flat, v_flat, md.slot_mapping + page_offset * S)
            attn = attention_fn(
                q, k_flat, v_flat, md.kv_lens, md.block_tables + page_offset, md.cu_q_lens,
                md.num_seqs, sm_scale=sm_scale, num_kv_heads=Hkv, sliding_window=cfg.sliding_window,
            )  # [T, Hq, D]
            h = h + attn.reshape(T, Hq * D).astype(dtype) @ lp["o_proj"]
            x = rms_norm(h, lp["post_norm"], cfg.rms_norm_eps)
            gate, up = split_gate_up(x @ lp["gate_up_proj"], shards)  # [T, I] each
            h = h + (jax.nn.silu(gate) * up) @ lp["down_proj"]
            return (h, k_flat, v_flat), None

        layer_ids = jnp.arange(L, dtype=jnp.int32)
        (h, k_flat, v_flat), _ = jax.lax.scan(layer, (h, k_flat, v_flat), (layer_params, layer_ids))

        # Only the rows that are sampled leave the backbone: logits are computed later, for
        # those [R] rows only, never for all [T] tokens.
        h_last = rms_norm(jnp.take(h, logits_indices, axis=0), self.final_norm[...], cfg.rms_norm_eps)
        kv_cache = (k_flat.reshape(k_cache.shape), v_flat.reshape(v_cache.shape))
        return h_last, kv_cache

    def compute_logits(self, h: jax.Array) -> jax.Array:
        """h: [R, E] final-normed hidden states -> logits [R, V] in f32."""
        head = self.embed[...].T if self.lm_head is None else self.lm_head[...]  # [E, V]
        return (h @ head).astype(jnp.float32)


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int, layout: str = "heads",
                   tp: int = 1) -> tuple[int, ...]:
    """One of the K/V caches: [L, P, S, Hkv, D] (heads layout) or [L, P, S, C] (lanes layout;
    under tensor parallelism C holds `tp` rank rows of their own padded width)."""
    if layout == "lanes":
        from pallas_kernels.kv_layout import lanes_width

        return (cfg.num_layers, num_pages, page_size, tp * lanes_width(cfg.num_kv_heads // tp, cfg.head_dim))
    return (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any, layout: str = "heads",
                  tp: int = 1) -> tuple[jax.Array, jax.Array]:
    """Zeroed K and V caches (see `kv_cache_shape`)."""
    shape = kv_cache_shape(cfg, num_pages, page_size, layout, tp)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def kv_cache_bytes_per_page(cfg: ModelConfig, page_size: int, dtype: Any, layout: str = "heads", tp: int = 1) -> int:
    """Bytes one page costs across all layers and devices, K and V together (padding lanes
    of the lanes layout included)."""
    shape = kv_cache_shape(cfg, 1, page_size, layout, tp)
    return 2 * int(np.prod(shape)) * np.dtype(dtype).itemsize
