"""Gemma 4 text (`Gemma4ForCausalLM`; the language model of `Gemma4ForConditionalGeneration`),
dense and with its MoE block, as a registry entry.

What sets it apart from Gemma 3:
- two kinds of attention layer with their own shapes: sliding-window layers (`head_dim`,
  `num_key_value_heads`, default RoPE) and full-attention layers (`global_head_dim`, their own KV
  heads, "proportional" RoPE rotating a quarter of each head; with `attention_k_eq_v` no
  v_proj: values are the keys' projection). So the params hold an attention stack per kind
  ([Ls] and [Lf]) and the cache a K/V pool per kind: (k, v) of the sliding layers, then (k, v)
  of the full ones, on the same pages (a page holds S tokens of every layer of both);
- attention logits unscaled (q and k are RMS-normed; v too, without a weight), plain (not
  1 + w) RMSNorm weights, and a learned scalar per layer on its output;
- the MoE block: routed experts beside the dense MLP in every layer, routed from the residual
  (RMS-normed, times a learned scale and E^-1/2), softmax top-k renormalised then times a
  learned per-expert scale, with their own pre/post norms.

E2B / E4B add per-layer inputs (a vector per token and layer: a table row plus a projection of
the embedding, gated into each layer's output) and KV sharing: the last `num_kv_shared_layers`
layers compute queries only and attend to the pages of their kind's last layer that holds K/V
(so the pools hold only the layers before them), with MLPs twice as wide when
`use_double_wide_mlp`. Those layers' attention and MLP weights are stacks of their own
(`reuse_*`, `wide_*`).

The layers repeat a pattern of p - 1 sliding layers then one full layer (5:1 in the released
models); one `lax.scan` runs the groups of p layers that hold K/V, a second the groups that
reuse it. Refused by name: a pattern that does not repeat (or KV sharing that is not whole
repeats of it), LoRA and quantized KV pages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import llama
from jaxserve.models.config import (
    ModelConfig,
    UnsupportedModelError,
    first_eos,
    language_model_config,
)
from jaxserve.models.deepseek import LayerStack
from jaxserve.models.fused import split_gate_up, split_qkv
from jaxserve.models.layers import (
    ACTIVATIONS,
    AttentionFn,
    KVUpdateFn,
    MoEFn,
    gated_activation,
    rms_norm,
)
from jaxserve.models.llama import LlamaForCausalLM, paged_pool_views, single_device_moe
from jaxserve.models.llama_family import HF_GLOBALS
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

ARCHITECTURE = "gemma4"
HF_ARCHITECTURES = {"Gemma4ForCausalLM": ARCHITECTURE, "Gemma4ForConditionalGeneration": ARCHITECTURE}
HF_MODEL_TYPES = {"gemma4_text": ARCHITECTURE, "gemma4": ARCHITECTURE}

# The full-attention layers' own stacks (the sliding layers' are Llama's names).
GLOBAL_ATTENTION = ("global_q_proj", "global_k_proj", "global_v_proj", "global_o_proj", "global_q_norm",
                    "global_k_norm")
LOCAL_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "qkv_proj")


# ---------------------------------------------------------------------- config
# transformers' RoPE for a config without `rope_parameters`.
_DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    hf = language_model_config(hf)  # Gemma4ForConditionalGeneration: its language model (text prompts only)
    n = int(hf["num_hidden_layers"])
    # "vision": image tokens see each other both ways; text stays causal, and this family serves
    # text only (as transformers masks a prompt without image tokens). "all" is not causal at all.
    if hf.get("use_bidirectional_attention") not in (None, "vision"):
        raise UnsupportedModelError(f"gemma4 with use_bidirectional_attention={hf['use_bidirectional_attention']!r} "
                                    "is not supported")
    shared = int(hf.get("num_kv_shared_layers") or 0)
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"gemma4 with hidden_activation={act!r} is not supported (gelu_pytorch_tanh)")
    types = list(hf.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                           for i in range(n)])
    types[-1] = "full_attention"  # as transformers forces it
    period = types.index("full_attention") + 1
    if n % period or types != (["sliding_attention"] * (period - 1) + ["full_attention"]) * (n // period):
        raise UnsupportedModelError(f"gemma4 layer_types {types} do not repeat p - 1 sliding layers then one full "
                                    "layer")
    if shared % period or shared >= n:
        raise UnsupportedModelError(f"gemma4 with num_kv_shared_layers={shared}: not whole repeats of its "
                                    f"{period}-layer pattern after at least one that holds K/V")
    rope = hf.get("rope_parameters") or _DEFAULT_ROPE
    local, full = rope.get("sliding_attention") or {}, rope.get("full_attention") or {}
    if local.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in (
            "default", "proportional"):
        raise UnsupportedModelError(f"gemma4 rope_parameters {rope} not supported (default on sliding layers, "
                                    "default or proportional on full layers)")
    if float(full.get("factor", 1.0)) != 1.0:
        raise UnsupportedModelError(f"gemma4 with scaled RoPE (factor {full['factor']}) is not supported")
    heads, kv_heads = int(hf["num_attention_heads"]), int(hf.get("num_key_value_heads") or hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or 256)
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    layer_config = {int(k): v for k, v in (hf.get("per_layer_config") or {}).items()}
    full_layer = layer_config.get(period - 1, {})
    global_dim = int(full_layer.get("head_dim") or hf.get("global_head_dim") or 512)
    global_kv = full_layer.get("num_key_value_heads") or (hf.get("num_global_key_value_heads") if k_eq_v else None)
    eos = first_eos(hf)
    moe: dict[str, Any] = {}
    if hf.get("enable_moe_block"):
        moe = dict(num_experts=int(hf["num_experts"]), num_experts_per_tok=int(hf["top_k_experts"]),
                   moe_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=True, moe_block=True)
    window = int(hf.get("sliding_window") or 0)
    per_layer = int(hf.get("hidden_size_per_layer_input") or 0)
    return ModelConfig(
        architecture=ARCHITECTURE,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(full.get("rope_theta") or 1e6),
        rope_local_theta=float(local.get("rope_theta") or 1e4),
        max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qk_norm=True,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        hidden_act="gelu_tanh",
        embed_scale=True,
        sandwich_norms=True,
        query_pre_attn_scalar=1.0,  # unscaled logits: q and k are normed
        final_logit_softcap=float(hf["final_logit_softcapping"]) if hf.get("final_logit_softcapping") else None,
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        global_head_dim=global_dim,
        global_num_kv_heads=int(global_kv) if global_kv else kv_heads,
        attention_k_eq_v=k_eq_v,
        global_rotary_fraction=float(full.get("partial_rotary_factor", 1.0))
        if full.get("rope_type") == "proportional" else 1.0,
        per_layer_input_size=per_layer,
        per_layer_vocab_size=int(hf.get("vocab_size_per_layer_input") or hf["vocab_size"]) if per_layer else 0,
        num_kv_shared_layers=shared,
        double_wide_mlp=bool(hf.get("use_double_wide_mlp")) and shared > 0,
        **moe,
    )


def period(cfg: ModelConfig) -> int:
    """Layers per repeat of the pattern (p - 1 sliding, then one full)."""
    return cfg.windows().index(0) + 1


def kv_layers(cfg: ModelConfig) -> int:
    """The first layers, which hold K/V; the rest (`num_kv_shared_layers`) read it."""
    return cfg.num_layers - cfg.num_kv_shared_layers


def local_config(cfg: ModelConfig) -> ModelConfig:
    """The sliding layers that hold K/V as a config of their own (their count, heads, width)."""
    p = period(cfg)
    n = kv_layers(cfg) // p * (p - 1)
    return dataclasses.replace(cfg, num_layers=n, layer_windows=(cfg.windows()[0],) * n, num_kv_shared_layers=0)


def global_config(cfg: ModelConfig) -> ModelConfig:
    """The full-attention layers that hold K/V as a config of their own."""
    n = kv_layers(cfg) // period(cfg)
    return dataclasses.replace(cfg, num_layers=n, layer_windows=(0,) * n, num_kv_heads=cfg.global_num_kv_heads,
                               head_dim=cfg.global_head_dim, num_kv_shared_layers=0)


def layer_ids(cfg: ModelConfig, name: str) -> list[int]:
    """The checkpoint layers a stacked weight holds: each attention stack its kind's layers
    that hold K/V (`reuse_` ones: that read it), the dense MLP every layer (without the
    double-wide ones: `wide_`), the rest every layer."""
    base = name.removesuffix("_scale")
    full = {i for i, w in enumerate(cfg.windows()) if w == 0}
    holds = set(range(kv_layers(cfg)))
    kinds = {"global_reuse_": full - holds, "global_": full & holds, "reuse_": set(range(cfg.num_layers)) - full - holds}
    for prefix, layers in kinds.items():
        if base.startswith(prefix):
            return sorted(layers)
    if base in LOCAL_ATTENTION:
        return sorted(holds - full)
    if base.startswith("wide_"):
        return sorted(set(range(cfg.num_layers)) - holds)
    if base in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") and cfg.double_wide_mlp:
        return sorted(holds)
    return list(range(cfg.num_layers))


def expected_param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    L, E, H = cfg.num_layers, cfg.hidden_size, cfg.num_heads
    loc, glo = local_config(cfg), global_config(cfg)
    Ls, Ds, Lf, Df = loc.num_layers, cfg.head_dim, glo.num_layers, cfg.global_head_dim
    layers: dict[str, tuple[int, ...]] = {
        "input_norm": (L, E), "post_attn_norm": (L, E), "post_norm": (L, E), "post_ffn_norm": (L, E),
        "layer_scalar": (L, 1),
        "gate_proj": (L, E, cfg.intermediate_size), "up_proj": (L, E, cfg.intermediate_size),
        "down_proj": (L, cfg.intermediate_size, E),
        "q_proj": (Ls, E, H * Ds), "k_proj": (Ls, E, loc.kv_size), "v_proj": (Ls, E, loc.kv_size),
        "o_proj": (Ls, H * Ds, E), "q_norm": (Ls, Ds), "k_norm": (Ls, Ds),
        "global_q_proj": (Lf, E, H * Df), "global_k_proj": (Lf, E, glo.kv_size), "global_o_proj": (Lf, H * Df, E),
        "global_q_norm": (Lf, Df), "global_k_norm": (Lf, Df),
    }
    if not cfg.attention_k_eq_v:
        layers["global_v_proj"] = (Lf, E, glo.kv_size)
    if cfg.num_kv_shared_layers:  # the layers that read K/V: only their queries and outputs
        p = period(cfg)
        Lr, Lrf = cfg.num_kv_shared_layers // p * (p - 1), cfg.num_kv_shared_layers // p
        layers.update(reuse_q_proj=(Lr, E, H * Ds), reuse_o_proj=(Lr, H * Ds, E), reuse_q_norm=(Lr, Ds),
                      global_reuse_q_proj=(Lrf, E, H * Df), global_reuse_o_proj=(Lrf, H * Df, E),
                      global_reuse_q_norm=(Lrf, Df))
    if cfg.double_wide_mlp:
        L0, Ls_, I = kv_layers(cfg), cfg.num_kv_shared_layers, cfg.intermediate_size  # noqa: E741
        layers.update(gate_proj=(L0, E, I), up_proj=(L0, E, I), down_proj=(L0, I, E),
                      wide_gate_proj=(Ls_, E, 2 * I), wide_up_proj=(Ls_, E, 2 * I), wide_down_proj=(Ls_, 2 * I, E))
    if cfg.per_layer_input_size:
        Pd = cfg.per_layer_input_size
        layers.update(ple_gate=(L, E, Pd), ple_proj=(L, Pd, E), ple_norm=(L, E))
    if cfg.moe_block:
        X, Im = cfg.num_experts, cfg.moe_intermediate_size
        layers.update(router=(L, E, X), router_scale=(L, E), router_expert_scale=(L, X),
                      expert_gate=(L, X, E, Im), expert_up=(L, X, E, Im), expert_down=(L, X, Im, E),
                      post_ffn_norm_1=(L, E), pre_ffn_norm_2=(L, E), post_ffn_norm_2=(L, E))
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, E), "layers": layers, "final_norm": (E,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (E, cfg.vocab_size)
    if cfg.per_layer_input_size:
        LP = L * cfg.per_layer_input_size
        shapes.update(ple_embed=(cfg.per_layer_vocab_size, LP), ple_model_projection=(E, LP),
                      ple_projection_norm=(cfg.per_layer_input_size,))
    return shapes


PLE_GLOBALS = ("ple_embed", "ple_model_projection", "ple_projection_norm")


def inv_freq(dim: int, theta: float, fraction: float = 1.0) -> np.ndarray:
    """[dim / 2] f32 inverse frequencies; "proportional" RoPE (`fraction` < 1) keeps the first
    int(fraction * dim / 2) of the full-width frequencies and zeroes the rest (those dims do
    not rotate)."""
    angles = int(fraction * dim // 2)
    out = np.zeros(dim // 2, np.float32)
    out[:angles] = 1.0 / theta ** (np.arange(0, 2 * angles, 2, dtype=np.float32) / dim)
    return out


# ---------------------------------------------------------------------- the cache
def kv_cache_shapes(cfg: ModelConfig, num_pages: int, page_size: int, layout: str = "heads",
                    tp: int = 1) -> tuple[tuple[int, ...], ...]:
    """(k, v) pools of the sliding layers, then of the full ones (`llama.kv_cache_shape` each)."""
    loc = llama.kv_cache_shape(local_config(cfg), num_pages, page_size, layout, tp)
    glo = llama.kv_cache_shape(global_config(cfg), num_pages, page_size, layout, tp)
    return loc, loc, glo, glo


def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int, layout: str = "heads", tp: int = 1):
    return kv_cache_shapes(cfg, num_pages, page_size, layout, tp)[0]


def kv_scales_shape(cfg: ModelConfig, num_pages: int, page_size: int, layout: str = "heads"):
    raise UnsupportedModelError("gemma4 does not support quantized KV pages yet")


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any, layout: str = "heads",
                  tp: int = 1) -> tuple[jax.Array, ...]:
    if jnp.dtype(dtype).itemsize == 1:
        kv_scales_shape(cfg, num_pages, page_size, layout)
    return tuple(jnp.zeros(s, dtype) for s in kv_cache_shapes(cfg, num_pages, page_size, layout, tp))


def kv_cache_bytes_per_page(cfg: ModelConfig, page_size: int, dtype: Any, layout: str = "heads", tp: int = 1) -> int:
    return sum(llama.kv_cache_bytes_per_page(c, page_size, dtype, layout, tp)
               for c in (local_config(cfg), global_config(cfg)))


# ---------------------------------------------------------------------- the model
class Gemma4ForCausalLM(LlamaForCausalLM):
    """`kv_cache` is (k, v) of the sliding layers that hold K/V, then (k, v) of the full ones."""

    def __init__(self, config: ModelConfig, params: dict[str, Any], **kwargs: Any):
        super().__init__(config, params, **kwargs)
        if config.global_num_kv_heads % self.shards or config.num_kv_heads % self.shards:
            raise ValueError(f"gemma4: tensor_parallel_size {self.shards} must divide both KV head counts "
                             f"({config.num_kv_heads} sliding, {config.global_num_kv_heads} full)")
        self._local_inv = inv_freq(config.head_dim, config.rope_local_theta)
        self._global_inv = inv_freq(config.global_head_dim, config.rope_theta, config.global_rotary_fraction)
        self._kinds = (local_config(config), global_config(config))  # the K/V-holding layers of each kind
        # Per-layer inputs (E2B / E4B): the table [Vp, L*Pd], the embedding's projection [E, L*Pd], its norm.
        self.ple = nnx.Dict({k: nnx.Param(params[k]) for k in PLE_GLOBALS}) if config.per_layer_input_size else None

    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        kv_cache: tuple[jax.Array, ...],  # (k, v) sliding [Ls, P, S, ...], (k, v) full [Lf, P, S, ...]
        md: AttentionMetadata,
        logits_indices: jax.Array,  # [R] int32
        *,
        attention_fn: AttentionFn,
        kv_update_fn: KVUpdateFn,
        moe_fn: MoEFn = single_device_moe,
        lora: LoRABatch | None = None,
    ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
        if lora is not None:
            raise ValueError("gemma4 does not take LoRA adapters")
        cfg, p = self.config, period(self.config)
        dtype = self.final_norm[...].dtype
        views = (paged_pool_views(self.kv_layout, kv_cache[0], 2), paged_pool_views(self.kv_layout, kv_cache[2], 2))
        pools = (views[0].to_carry(kv_cache[:2]), views[1].to_carry(kv_cache[2:4]))
        P = kv_cache[0].shape[1]
        h = self._embed(token_ids, dtype) * jnp.asarray(cfg.hidden_size ** 0.5, dtype)  # [T, E]
        ple = self._per_layer_inputs(token_ids, h)  # [L, T, Pd] or None
        ropes = (rope_tables(positions, self._local_inv), rope_tables(positions, self._global_inv))
        weights = {k: v[...] for k, v in self.layers.items()}
        live_rows = md.cu_q_lens[md.num_seqs[0]]
        held = tuple(c.num_layers for c in self._kinds)  # layers holding K/V, per kind

        def stack(i):
            return LayerStack(weights, i, self.matmul_precision, self.row_tile, live_rows)

        def sublayer(h, pools, layer, kind, index, reuse):
            """Layer `layer`: attention of `kind` (its stacks' row `index`), then the rest. A
            reusing layer reads the pool of its kind's last layer that holds K/V."""
            pool = views[kind].to_pages(pools[kind])
            page_index = held[kind] - 1 if reuse else index
            attn, pool = self._attention(h, stack(layer), stack(index), kind, reuse, ropes[kind], pool, md,
                                         page_index * P, views[kind].page_size, attention_fn, kv_update_fn)
            if not reuse:
                pools = tuple(views[kind].to_carry(pool) if j == kind else x for j, x in enumerate(pools))
            mlp = stack(layer - kv_layers(cfg)) if reuse and cfg.double_wide_mlp else stack(layer)
            return self._block(h, attn, stack(layer), mlp, "wide_" if reuse and cfg.double_wide_mlp else "", ple,
                               layer, moe_fn), pools

        def groups(first_group, reuse):
            def group(carry, g):
                h, pools = carry
                i = g - first_group  # the group's rows in its stacks
                for j in range(p - 1):
                    h, pools = sublayer(h, pools, g * p + j, 0, i * (p - 1) + j, reuse)
                h, pools = sublayer(h, pools, g * p + p - 1, 1, i, reuse)
                return (h, pools), None
            return group

        g0, g1 = kv_layers(cfg) // p, cfg.num_layers // p
        (h, pools), _ = jax.lax.scan(groups(0, False), (h, pools), jnp.arange(g0, dtype=jnp.int32))
        if g1 > g0:
            (h, pools), _ = jax.lax.scan(groups(g0, True), (h, pools), jnp.arange(g0, g1, dtype=jnp.int32))
        h_last = self.final_hidden(jnp.take(h, logits_indices, axis=0))
        out = (*pools[0], *pools[1])
        return h_last, h, tuple(x.reshape(c.shape) for x, c in zip(out, kv_cache))

    def _per_layer_inputs(self, token_ids: jax.Array, h: jax.Array) -> jax.Array | None:
        """Each token's per-layer input vectors [L, T, Pd]: its row of the table (times
        Pd^1/2) and the projection of its scaled embedding h (times E^-1/2, RMS-normed),
        averaged (times 2^-1/2)."""
        cfg = self.config
        if not cfg.per_layer_input_size:
            return None
        T, L, Pd, dtype = h.shape[0], cfg.num_layers, cfg.per_layer_input_size, h.dtype
        rows = jnp.take(self.ple["ple_embed"][...], token_ids, axis=0) * jnp.asarray(Pd ** 0.5, dtype)  # [T, L*Pd]
        proj = (h @ self.ple["ple_model_projection"][...]) * jnp.asarray(cfg.hidden_size ** -0.5, dtype)
        proj = self._norm(proj.reshape(T, L, Pd), self.ple["ple_projection_norm"][...])
        return jnp.swapaxes((proj + rows.reshape(T, L, Pd)) * jnp.asarray(2 ** -0.5, dtype), 0, 1)

    def _attention(self, h, w, w_kind, kind, reuse, rope, pool, md, page_offset, S, attention_fn, kv_update_fn):
        """One layer's attention (kind 0: sliding, 1: full): [T, E] output (before its norm) and
        the kind's pool. A reusing layer (`reuse`) computes its queries only and attends to the
        pages at `page_offset`, which an earlier layer wrote."""
        cfg = self.config
        c = self._kinds[kind]
        T, H, Hkv, D = h.shape[0], cfg.num_heads, c.num_kv_heads, c.head_dim
        x = self._norm(h, w["input_norm"])
        prefix = ("" if kind == 0 else "global_") + ("reuse_" if reuse else "")
        if reuse:
            q = w_kind.matmul(x, prefix + "q_proj")
        elif kind == 0:
            q, k, v = split_qkv(w_kind.matmul(x, "qkv_proj"), c, self.shards)
        else:
            q, k = w_kind.matmul(x, "global_q_proj"), w_kind.matmul(x, "global_k_proj")
            v = k if cfg.attention_k_eq_v else w_kind.matmul(x, "global_v_proj")
        q = apply_rope(self._norm(q.reshape(T, H, D), w_kind[prefix + "q_norm"]), *rope)
        if not reuse:
            k, v = k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
            k = apply_rope(self._norm(k, w_kind[prefix + "k_norm"]), *rope)
            v = rms_norm(v, jnp.ones((D,), v.dtype), cfg.rms_norm_eps, row_tile=self.row_tile)  # weightless
            pool = tuple(kv_update_fn(k, v, pool[0], pool[1], md.slot_mapping + page_offset * S))
        window = cfg.windows()[0] if kind == 0 else None
        attn = attention_fn(q, pool[0], pool[1], md.kv_lens, md.block_tables + page_offset, md.cu_q_lens,
                            md.num_seqs, sm_scale=1.0, num_kv_heads=Hkv, sliding_window=window)  # [T, H, D]
        out = w_kind.matmul(attn.reshape(T, H * D).astype(h.dtype), prefix + "o_proj")
        return out, pool

    def _block(self, h, attn, w, w_mlp, mlp_prefix, ple, layer, moe_fn):
        """The rest of a layer: the attention's norm and skip, the dense MLP (`w_mlp`'s
        `mlp_prefix` stack; and the MoE block beside it), their norms and skip, the per-layer
        input, the layer's scalar."""
        cfg = self.config
        h = h + self._norm(attn, w["post_attn_norm"])
        x = self._norm(h, w["post_norm"])
        act = ACTIVATIONS[cfg.hidden_act]
        if mlp_prefix:
            gate, up = w_mlp.matmul(x, mlp_prefix + "gate_proj"), w_mlp.matmul(x, mlp_prefix + "up_proj")
        else:
            gate, up = split_gate_up(w_mlp.matmul(x, "gate_up_proj"), self.shards)
        y = w_mlp.matmul(gated_activation(cfg.hidden_act, gate, up), mlp_prefix + "down_proj")
        if cfg.moe_block:
            y = self._norm(y, w["post_ffn_norm_1"]) + self._norm(self._experts(h, w, moe_fn), w["post_ffn_norm_2"])
        h = h + self._norm(y, w["post_ffn_norm"])
        if ple is not None:
            g = act(w.matmul(h, "ple_gate")) * jax.lax.dynamic_index_in_dim(ple, layer, keepdims=False)  # [T, Pd]
            h = h + self._norm(w.matmul(g, "ple_proj"), w["ple_norm"])
        return h * w["layer_scalar"].astype(h.dtype)

    def _experts(self, h, w, moe_fn):
        """The MoE block, routed from the residual h [T, E]."""
        cfg = self.config
        r = rms_norm(h, w["router_scale"], cfg.rms_norm_eps, row_tile=self.row_tile)  # weightless norm, then scale
        r = r * jnp.asarray(cfg.hidden_size ** -0.5, r.dtype)
        probs = jax.nn.softmax((r @ w["router"]).astype(jnp.float32), axis=-1)  # [T, X]
        weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights * jnp.take(w["router_expert_scale"].astype(jnp.float32), experts)
        extra = {}
        if "expert_gate_up_scale" in w:
            extra = {"gate_up_scale": w["expert_gate_up_scale"], "down_scale": w["expert_down_scale"]}
        x = self._norm(h, w["pre_ffn_norm_2"])
        return moe_fn(x, weights, experts.astype(jnp.int32), w["expert_gate_up"], w["expert_down"],
                      glu=lambda g, u: ACTIVATIONS[cfg.hidden_act](g) * u, **extra)


# ---------------------------------------------------------------------- registry entry
_HF_LAYERS = {
    "input_norm": "input_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_norm": "pre_feedforward_layernorm.weight",
    "post_ffn_norm": "post_feedforward_layernorm.weight",
    "layer_scalar": "layer_scalar",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight", "down_proj": "mlp.down_proj.weight",
    **{f"{prefix}{name}": f"self_attn.{name}.weight" for prefix in ("", "global_")
       for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")},
    **{f"{prefix}reuse_{name}": f"self_attn.{name}.weight" for prefix in ("", "global_")
       for name in ("q_proj", "o_proj", "q_norm")},
    **{f"wide_{name}": f"mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")},
    "ple_gate": "per_layer_input_gate.weight",
    "ple_proj": "per_layer_projection.weight",
    "ple_norm": "post_per_layer_input_norm.weight",
    "router_scale": "router.scale",
    "router_expert_scale": "router.per_expert_scale",
    "post_ffn_norm_1": "post_feedforward_layernorm_1.weight",
    "pre_ffn_norm_2": "pre_feedforward_layernorm_2.weight",
    "post_ffn_norm_2": "post_feedforward_layernorm_2.weight",
}
_HF_EXPERTS = ("router.proj.weight", "experts", "gate_proj", "up_proj", "down_proj")


_HF_PLE_GLOBALS = {"ple_embed": "model.embed_tokens_per_layer.weight",
                   "ple_model_projection": "model.per_layer_model_projection.weight",
                   "ple_projection_norm": "model.per_layer_projection_norm.weight"}


def hf_weight_names(cfg: ModelConfig) -> WeightNames:
    return WeightNames({**HF_GLOBALS, **_HF_PLE_GLOBALS}, _HF_LAYERS, _HF_EXPERTS)


GEMMA4 = add_builtin(ModelFamily(
    name="gemma4",
    architectures=(ARCHITECTURE,),
    hf_architectures=HF_ARCHITECTURES,
    hf_model_types=HF_MODEL_TYPES,
    config_from_hf=config_from_hf,
    model_class=Gemma4ForCausalLM,
    param_shapes=expected_param_shapes,
    hf_weight_names=hf_weight_names,
    layer_ids=layer_ids,
    kv_cache=KVCacheSpec(shape=kv_cache_shape, scales_shape=kv_scales_shape, bytes_per_page=kv_cache_bytes_per_page,
                         init=init_kv_cache, page_arrays=4, shapes=kv_cache_shapes),
    layer_sharding={**LLAMA_SHARDING,
                    "global_q_proj": (None, None, MODEL_AXIS), "global_k_proj": (None, None, MODEL_AXIS),
                    "global_v_proj": (None, None, MODEL_AXIS), "global_o_proj": (None, MODEL_AXIS, None),
                    "reuse_q_proj": (None, None, MODEL_AXIS), "reuse_o_proj": (None, MODEL_AXIS, None),
                    "global_reuse_q_proj": (None, None, MODEL_AXIS), "global_reuse_o_proj": (None, MODEL_AXIS, None),
                    "wide_gate_proj": (None, None, MODEL_AXIS), "wide_up_proj": (None, None, MODEL_AXIS),
                    "wide_down_proj": (None, MODEL_AXIS, None)},
    expert_parallel_sharding={"expert_gate_up": (None, MODEL_AXIS, None, None),
                              "expert_down": (None, MODEL_AXIS, None, None)},
    support=ModelSupport(lora=False, quantized_kv=False, spec_decode=True, tensor_parallel=True,
                         expert_parallel=True),
))
