"""DeepSeek-V3 / R1 (and Kimi-K2, the same architecture): multi-head latent attention over a
paged latent cache, and routed experts with sigmoid, group-limited routing and a shared expert.

Attention (MLA). Per token the cache holds one row `[c_kv | k_rope]` (W = kv_lora_rank +
qk_rope_head_dim; 576 in DeepSeek-V3), never per-head keys or values. The key and value
up-projections of `kv_b_proj` are absorbed: the query's no-RoPE part is mapped into the
latent (q_lat = q_nope . W_UK), attention runs over the latent rows as multi-query attention
(scores on all W lanes, values the first kv_lora_rank), and the output is mapped back per head
(o = o_lat . W_UV) before `o_proj`. Prefill uses the same absorbed form: see
`docs/architecture.md` ("Multi-head latent attention") for the measured choice.

Layers. The first `first_k_dense_replace` layers have a dense MLP, the rest routed experts plus
a shared expert, so the params hold three stacks (their leading axis in brackets):

    attention, all layers [L]:   input_norm, post_norm, q_a_proj, q_a_norm, q_b_proj (or
                                 q_head_proj without q LoRA), kv_a_proj, kv_a_norm, kv_b_proj,
                                 o_proj
    dense MLP, first k [k]:      gate_up_proj (fused), down_proj
    experts, the rest [L - k]:   router, router_bias, expert_gate_up, expert_down,
                                 shared_gate, shared_up, shared_down

and two `lax.scan`s run them (dense layers, then MoE layers), each reading its stacks by index.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve.models import moe
from jaxserve.models.config import (
    MLAConfig,
    ModelConfig,
    UnsupportedModelError,
    first_eos,
    parse_rope_scaling,
)
from jaxserve.models.fused import split_gate_up
from jaxserve.models.layers import (
    AttentionFn,
    KVUpdateFn,
    MoEFn,
    gated_activation,
    tiled_matmul,
)
from jaxserve.models.llama import LlamaForCausalLM, PoolViews, paged_pool_views, single_device_moe
from jaxserve.models.lora import LoRABatch
from jaxserve.models.metadata import AttentionMetadata
from jaxserve.models.quantization import scale_name
from jaxserve.models.rope import apply_rope, rope_attention_factor, rope_tables
from pallas_kernels.quantized_matmul.ops import quantized_matmul

ARCHITECTURES = ("deepseek_v3", "deepseek_v2")
HF_ARCHITECTURES = {"DeepseekV3ForCausalLM": "deepseek_v3", "DeepseekV2ForCausalLM": "deepseek_v2"}
HF_MODEL_TYPES = {"deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v2"}

# Which stack each layer weight belongs to (the others span every layer).
DENSE_MLP_WEIGHTS = ("gate_proj", "up_proj", "down_proj")
MTP_GLOBALS = ("mtp_enorm", "mtp_hnorm", "mtp_eh_proj", "mtp_head_norm")
EXPERT_LAYER_WEIGHTS = ("router", "router_bias", "expert_gate", "expert_up", "expert_down",
                        "shared_gate", "shared_up", "shared_down")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A DeepseekV3 (or V2) config.json. Refused by name: attention or MLP biases, routing
    other than each version's (V3: sigmoid scores, `noaux_tc`; V2: softmax, `greedy` or
    `group_limited_greedy`), an activation other than SiLU."""
    v2 = "DeepseekV2ForCausalLM" in (hf.get("architectures") or []) or hf.get("model_type") == "deepseek_v2"
    arch = "deepseek_v2" if v2 else "deepseek_v3"
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise UnsupportedModelError(f"{arch} with attention_bias or mlp_bias is not supported")
    scoring, method = hf.get("scoring_func"), hf.get("topk_method")
    if v2 and (scoring not in (None, "softmax") or method not in (None, "greedy", "group_limited_greedy")):
        raise UnsupportedModelError(f"deepseek_v2 with scoring_func={scoring!r}, topk_method={method!r} is not "
                                    "supported (softmax, greedy or group_limited_greedy)")
    if not v2 and (scoring not in (None, "sigmoid") or method not in (None, "noaux_tc")):
        raise UnsupportedModelError(f"deepseek_v3 with scoring_func={scoring!r}, topk_method={method!r} is not "
                                    "supported (sigmoid, noaux_tc)")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{arch} with hidden_act={hf.get('hidden_act')!r} is not supported (silu)")
    heads = int(hf["num_attention_heads"])
    mla = MLAConfig(kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
                    q_lora_rank=int(hf["q_lora_rank"]) if hf.get("q_lora_rank") else None,
                    rope_interleave=bool(hf.get("rope_interleave", True)))
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    max_pos = int(hf.get("max_position_embeddings", 4096))
    eos = first_eos(hf)
    experts = int(hf.get("n_routed_experts") or 0)
    moe_width = int(hf.get("moe_intermediate_size") or 0)
    routing: dict[str, Any] = {}
    grouped = not v2 or method == "group_limited_greedy"
    if experts:
        routing = dict(
            num_experts=experts, num_experts_per_tok=int(hf["num_experts_per_tok"]), moe_intermediate_size=moe_width,
            # V2's router never renormalises (whatever norm_topk_prob says); a V2 group scores by its best expert
            norm_topk_prob=not v2 and bool(hf.get("norm_topk_prob", True)),
            router_scoring="softmax" if v2 else "sigmoid", group_scoring="max" if v2 else "top2_sum",
            n_group=int(hf.get("n_group") or 1) if grouped else 1,
            topk_group=int(hf.get("topk_group") or 1) if grouped else 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            shared_expert_intermediate_size=moe_width * int(hf.get("n_shared_experts") or 0),
            first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
        )
    return ModelConfig(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=heads,  # what the expanded form would have; the cache holds one latent row
        head_dim=mla.qk_head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=parse_rope_scaling(rope, max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        mla=mla,
        num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers") or 0),
        **routing,
    )


def _mla(cfg: ModelConfig) -> MLAConfig:
    if cfg.mla is None:
        raise ValueError(f"{cfg.architecture} has no latent-attention config")
    return cfg.mla


def layer_ids(cfg: ModelConfig, name: str) -> range:
    """The checkpoint layers a stacked weight holds, in order (see the module docstring)."""
    if name.removesuffix("_scale") in DENSE_MLP_WEIGHTS + ("gate_up_proj",):
        return range(cfg.num_dense_layers)
    if name.removesuffix("_scale") in EXPERT_LAYER_WEIGHTS + ("expert_gate_up",):
        return range(cfg.num_dense_layers, cfg.num_stacked_layers)
    return range(cfg.num_stacked_layers)  # the served MTP layer is checkpoint layer num_layers


def expected_param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    m = _mla(cfg)
    L, E, H = cfg.num_stacked_layers, cfg.hidden_size, cfg.num_heads
    layers: dict[str, tuple[int, ...]] = {
        "input_norm": (L, E),
        "post_norm": (L, E),
        "kv_a_proj": (L, E, m.latent_width),
        "kv_a_norm": (L, m.kv_lora_rank),
        "kv_b_proj": (L, m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim)),
        "o_proj": (L, H * m.v_head_dim, E),
    }
    if m.q_lora_rank:
        layers.update(q_a_proj=(L, E, m.q_lora_rank), q_a_norm=(L, m.q_lora_rank),
                      q_b_proj=(L, m.q_lora_rank, H * m.qk_head_dim))
    else:
        layers["q_head_proj"] = (L, E, H * m.qk_head_dim)
    layers.update(mlp_param_shapes(cfg))
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, E), "layers": layers, "final_norm": (E,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (E, cfg.vocab_size)
    if cfg.mtp_layers:  # the MTP layer's own tensors; it shares the embedding and the head
        shapes.update(mtp_enorm=(E,), mtp_hnorm=(E,), mtp_eh_proj=(2 * E, E), mtp_head_norm=(E,))
    return shapes


def mtp_weight_names(cfg: ModelConfig) -> dict[str, str]:
    """Checkpoint names of the MTP layer's own tensors (layer `num_layers`; its attention and
    experts are named as any layer's). Its `embed_tokens` and `shared_head.head` copies are not
    read: the MTP modules share the main model's embedding and output head."""
    if not cfg.mtp_layers:
        return {}
    prefix = f"model.layers.{cfg.num_layers}."
    return {"mtp_enorm": prefix + "enorm.weight", "mtp_hnorm": prefix + "hnorm.weight",
            "mtp_eh_proj": prefix + "eh_proj.weight", "mtp_head_norm": prefix + "shared_head.norm.weight"}


def mlp_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The dense first layers' MLP [k, ...] and the MoE layers' experts [L - k, ...]."""
    E = cfg.hidden_size
    layers: dict[str, tuple[int, ...]] = {}
    k, n = cfg.num_dense_layers, cfg.num_stacked_layers - cfg.num_dense_layers
    if k:
        I = cfg.intermediate_size  # noqa: E741
        layers.update(gate_proj=(k, E, I), up_proj=(k, E, I), down_proj=(k, I, E))
    if n:
        X, Im = cfg.num_experts, cfg.moe_intermediate_size
        layers.update(router=(n, E, X), expert_gate=(n, X, E, Im), expert_up=(n, X, E, Im),
                      expert_down=(n, X, Im, E))
        if cfg.router_scoring == "sigmoid":  # the correction bias that chooses (V3); V2 has none
            layers["router_bias"] = (n, X)
        if cfg.shared_expert_intermediate_size:
            Is = cfg.shared_expert_intermediate_size
            layers.update(shared_gate=(n, E, Is), shared_up=(n, E, Is), shared_down=(n, Is, E))
    return layers


class LayerStack:
    """One layer's view of stacked weights inside a scan: `w[name]` is the layer's slice,
    `matmul(x, name)` runs the projection (a quantized one from the stack, by index)."""

    def __init__(self, weights: dict[str, jax.Array], index: jax.Array, precision: str, row_tile: int,
                 live_rows: jax.Array):
        self._w, self._i, self._precision, self._row_tile, self._rows = weights, index, precision, row_tile, live_rows

    def __getitem__(self, name: str) -> jax.Array:
        return jax.lax.dynamic_index_in_dim(self._w[name], self._i, keepdims=False)

    @property
    def index(self) -> jax.Array:
        """The stacked index this view reads."""
        return self._i

    def __contains__(self, name: str) -> bool:
        return name in self._w

    def matmul(self, x: jax.Array, name: str) -> jax.Array:
        scale = self._w.get(scale_name(name))
        if scale is not None:
            return quantized_matmul(x, self._w[name], scale, layer=self._i, precision=self._precision,
                                    rows=self._rows)
        return tiled_matmul(x, self[name], self._row_tile)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """The MLA decoder. Embedding, final norm, LM head and their quantized forms are the Llama
    module's; the layers and the cache differ. `kv_cache` is (pages [L, P, S, W],) or, for
    a quantized cache, (pages, scales); pages [L, P, S, C] in the lanes layout (TPU). With the
    MTP layer served (`cfg.mtp_layers`), L counts it: stacks and cache hold it last."""

    def __init__(self, config: ModelConfig, params: dict[str, Any], **kwargs: Any):
        super().__init__(config, params, **kwargs)
        self.mtp = (nnx.Dict({k: nnx.Param(params[k]) for k in MTP_GLOBALS}) if config.mtp_layers else None)

    def __call__(
        self,
        token_ids: jax.Array,  # [T] int32
        positions: jax.Array,  # [T] int32
        kv_cache: tuple[jax.Array, ...],
        md: AttentionMetadata,
        logits_indices: jax.Array,  # [R] int32
        *,
        attention_fn: AttentionFn,  # mla_paged_attention (per shard under a mesh)
        kv_update_fn: KVUpdateFn,  # update_latent_cache
        moe_fn: MoEFn = single_device_moe,
        lora: LoRABatch | None = None,
    ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
        if lora is not None:
            raise ValueError(f"{self.config.architecture} does not take LoRA adapters")
        cfg = self.config
        P = kv_cache[0].shape[1]
        pool, views = self._paged_pool(kv_cache)
        h = self._embed(token_ids, self.final_norm[...].dtype)  # [T, E]
        rope = rope_tables(positions, self._inv_freq, rope_attention_factor(cfg))  # [T, dr/2] each
        stack = self._stacks(md)

        def dense_layer(carry, i):
            h, pool = carry
            h, pool = self._attention(h, stack(i), rope, pool, md, i * P, views, attention_fn, kv_update_fn)
            x = self._norm(h, stack(i)["post_norm"])
            return (h + self._dense_mlp(x, stack(i)), pool), None

        def moe_layer(carry, i):
            h, pool = carry
            return self._moe_layer(h, i, stack, rope, pool, md, P, views, attention_fn, kv_update_fn, moe_fn), None

        k, L = cfg.num_dense_layers, cfg.num_layers  # (the MTP layer, stacked after them, runs in `mtp`)
        if k:
            (h, pool), _ = jax.lax.scan(dense_layer, (h, pool), jnp.arange(k, dtype=jnp.int32))
        if k < L:
            (h, pool), _ = jax.lax.scan(moe_layer, (h, pool), jnp.arange(k, L, dtype=jnp.int32))
        h_last = self.final_hidden(jnp.take(h, logits_indices, axis=0))
        return h_last, h, tuple(p.reshape(x.shape) for p, x in zip(pool, kv_cache))

    def mtp_forward(
        self,
        h_prev: jax.Array,  # [T, E]: the hidden state before each token (see `normalize_prev`)
        token_ids: jax.Array,  # [T] int32: the token after each position
        positions: jax.Array,  # [T] int32
        kv_cache: tuple[jax.Array, ...],
        md: AttentionMetadata,
        rows: jax.Array,  # [R] int32: the rows whose output leaves
        *,
        normalize_prev: bool,
        attention_fn: AttentionFn,
        kv_update_fn: KVUpdateFn,
        moe_fn: MoEFn = single_device_moe,
    ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """DeepSeek's multi-token-prediction layer: at position t it combines the hidden state
        that predicted token t+1 with that token's embedding, through one more decoder layer
        whose latent rows are cache layer `num_layers`, to predict token t+2. `h_prev` is the
        target's last-layer output (final-normed here, as the layer was trained on:
        `normalize_prev`) or this layer's own output for a chained draft. Returns the `rows`'
        outputs [R, E] (before the head's norm: `mtp_logits`) and the cache."""
        cfg, w = self.config, self.mtp
        P = kv_cache[0].shape[1]
        pool, views = self._paged_pool(kv_cache)
        dtype = self.final_norm[...].dtype
        if normalize_prev:
            h_prev = self.final_hidden(h_prev)
        e = self._norm(self._embed(token_ids, dtype), w["mtp_enorm"][...])
        x = jnp.concatenate([e, self._norm(h_prev.astype(dtype), w["mtp_hnorm"][...])], axis=-1)  # [T, 2E]
        h = tiled_matmul(x, w["mtp_eh_proj"][...], self.row_tile)  # [T, E]
        rope = rope_tables(positions, self._inv_freq, rope_attention_factor(cfg))
        h, pool = self._moe_layer(h, jnp.int32(cfg.num_layers), self._stacks(md), rope, pool, md, P, views,
                                  attention_fn, kv_update_fn, moe_fn)
        return jnp.take(h, rows, axis=0), tuple(p.reshape(x.shape) for p, x in zip(pool, kv_cache))

    def mtp_logits(self, h: jax.Array, live_rows: jax.Array | None = None) -> jax.Array:
        """The MTP layer's logits [R, V]: its own norm, then the shared head."""
        return self.compute_logits(self._norm(h, self.mtp["mtp_head_norm"][...]), live_rows)

    _page_arrays = 1  # the latent rows (GLM-4.5: K and V)

    def _paged_pool(self, kv_cache: tuple[jax.Array, ...]) -> tuple[tuple[jax.Array, ...], PoolViews]:
        """(every layer's cache in the form the layer loop carries, the views between that and
        the kernels' [L*P, S, ...] pages)."""
        views = paged_pool_views(self.kv_layout, kv_cache[0], self._page_arrays)
        return views.to_carry(kv_cache), views

    def _stacks(self, md: AttentionMetadata):
        """i -> layer i's view of the stacked weights."""
        weights = {k: v[...] for k, v in self.layers.items()}
        live_rows = md.cu_q_lens[md.num_seqs[0]]
        return lambda i: LayerStack(weights, i, self.matmul_precision, self.row_tile, live_rows)

    def _moe_layer(self, h, i, stack, rope, pool, md, P, views, attention_fn, kv_update_fn, moe_fn):
        """Decoder layer i (>= the dense ones): latent attention, then the routed and shared experts."""
        h, pool = self._attention(h, stack(i), rope, pool, md, i * P, views, attention_fn, kv_update_fn)
        x = self._norm(h, stack(i)["post_norm"])
        return h + self._experts(x, stack(i - self.config.num_dense_layers), moe_fn), pool

    def _attention(self, h, w: LayerStack, rope, pool, md, page_offset, views: PoolViews, attention_fn,
                   kv_update_fn):
        """One MLA layer: writes this step's latent rows, returns (h + attention, the pool).
        `views` turns the carried pool into the kernels' [L*P, S, 1, W] / [L*P, S, C] pages."""
        S = views.page_size
        pages = views.to_pages(pool)
        cfg, m = self.config, _mla(self.config)
        T, H, dn, dr, dv = h.shape[0], cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        x = self._norm(h, w["input_norm"])
        if m.q_lora_rank:
            q = w.matmul(self._norm(w.matmul(x, "q_a_proj"), w["q_a_norm"]), "q_b_proj")
        else:
            q = w.matmul(x, "q_head_proj")
        q = q.reshape(T, H, dn + dr)
        q_nope, q_rope = q[..., :dn], q[..., dn:]
        kv = w.matmul(x, "kv_a_proj")  # [T, Dl + dr]
        c_kv = self._norm(kv[:, :m.kv_lora_rank], w["kv_a_norm"])  # [T, Dl]
        k_rope = kv[:, None, m.kv_lora_rank:]  # [T, 1, dr]
        if m.rope_interleave:  # pairs (x0, x1), (x2, x3)...: evens then odds is rotate-half's order
            q_rope = jnp.concatenate([q_rope[..., 0::2], q_rope[..., 1::2]], axis=-1)
            k_rope = jnp.concatenate([k_rope[..., 0::2], k_rope[..., 1::2]], axis=-1)
        q_rope, k_rope = apply_rope(q_rope, *rope), apply_rope(k_rope, *rope)
        pages = tuple(kv_update_fn(jnp.concatenate([c_kv, k_rope[:, 0]], axis=-1), pages[0],
                                   md.slot_mapping + page_offset * S, *pages[1:]))
        kv_b = w["kv_b_proj"].reshape(m.kv_lora_rank, H, dn + dv)  # [Dl, H, dn + dv]: W_UK | W_UV per head
        q_lat = jnp.einsum("thd,lhd->thl", q_nope, kv_b[..., :dn])  # [T, H, Dl]
        o_lat = attention_fn(jnp.concatenate([q_lat, q_rope.astype(q_lat.dtype)], axis=-1),
                             pages[0], md.kv_lens,
                             md.block_tables + page_offset, md.cu_q_lens, md.num_seqs, sm_scale=cfg.sm_scale,
                             latent_dim=m.kv_lora_rank, scales=pages[1] if len(pages) > 1 else None)  # [T, H, Dl]
        o = jnp.einsum("thl,lhv->thv", o_lat.astype(h.dtype), kv_b[..., dn:]).reshape(T, H * dv)
        return h + w.matmul(o, "o_proj"), views.to_carry(pages)

    def _dense_mlp(self, x, w: LayerStack):
        gate, up = split_gate_up(w.matmul(x, "gate_up_proj"), self.shards)
        return w.matmul(gated_activation(self.config.hidden_act, gate, up), "down_proj")

    def _experts(self, x, w: LayerStack, moe_fn):
        """The routed experts plus the shared expert. x: [T, E] -> [T, E]."""
        cfg = self.config
        bias = w["router_bias"] if "router_bias" in w else None
        weights, experts = moe.route(x, w["router"], cfg, bias)  # [T, k] each
        scales = {}
        if "expert_gate_up_scale" in w:
            scales = {"gate_up_scale": w["expert_gate_up_scale"], "down_scale": w["expert_down_scale"]}
        if cfg.expert_input_scaling:
            scales["scale_inputs"] = True
        y = moe_fn(x, weights, experts, w["expert_gate_up"], w["expert_down"], **scales)
        if "shared_gate" in w:
            act = gated_activation(cfg.hidden_act, w.matmul(x, "shared_gate"), w.matmul(x, "shared_up"))
            y = y + w.matmul(act, "shared_down")
        return y


# ---------------------------------------------------------------------- the latent cache
def kv_cache_shape(cfg: ModelConfig, num_pages: int, page_size: int, layout: str = "heads",
                   tp: int = 1) -> tuple[int, ...]:
    """The latent pages: [L, P, S, W] (heads layout: one KV head, held without its size-1
    axis as `llama.kv_cache_shape` holds one head, and seen by the kernels as [P, S, 1, W]
    pages: `llama.paged_pool_views`) or [L, P, S, C] (lanes, C = W rounded up to 128 lanes);
    every tensor-parallel rank holds all of them (the latent serves every head)."""
    W = _mla(cfg).latent_width
    if layout == "lanes":
        from pallas_kernels.kv_layout import lanes_width

        return (cfg.num_stacked_layers, num_pages, page_size, lanes_width(1, W))
    return (cfg.num_stacked_layers, num_pages, page_size, W)


def kv_scales_pool_shape(cfg: ModelConfig, num_pages: int, page_size: int, layout: str = "heads") -> tuple[int, ...]:
    """A quantized latent cache's scales, one per token, for the pool of all layers' pages."""
    from pallas_kernels.kv_layout import kv_scales_shape

    return kv_scales_shape(cfg.num_stacked_layers * num_pages, page_size, 1, layout)


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype: Any, layout: str = "heads",
                  tp: int = 1) -> tuple[jax.Array, ...]:
    pages = jnp.zeros(kv_cache_shape(cfg, num_pages, page_size, layout), dtype)
    if jnp.dtype(dtype).itemsize == 1:
        return pages, jnp.zeros(kv_scales_pool_shape(cfg, num_pages, page_size, layout), jnp.float32)
    return (pages,)


def kv_cache_bytes_per_page(cfg: ModelConfig, page_size: int, dtype: Any, layout: str = "heads", tp: int = 1) -> int:
    """Bytes a page costs across all layers and devices: one row per token and layer (W lanes,
    or C in the lanes layout; plus its f32 scale when quantized), held whole by each of the
    `tp` ranks."""
    width = kv_cache_shape(cfg, 1, page_size, layout)[-1]
    per_token = width * np.dtype(dtype).itemsize + (4 if np.dtype(dtype).itemsize == 1 else 0)
    return tp * cfg.num_stacked_layers * page_size * per_token
