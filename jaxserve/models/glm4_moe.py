"""GLM-4.5 / 4.6 MoE (`Glm4MoeForCausalLM`): grouped-query attention with q/k/v biases, optional
q/k norms and partial rotary (the first half of each head rotates), over the Llama decoder's
paged K/V cache; and DeepSeek-V3's expert layers: sigmoid routing with the correction bias,
a shared expert, the first `first_k_dense_replace` layers dense (`models/deepseek.py`, whose
stacks and scans it shares).
"""

from __future__ import annotations

from typing import Any

from jaxserve.models.config import ModelConfig, UnsupportedModelError, first_eos, parse_rope_scaling
from jaxserve.models.deepseek import DeepseekV3ForCausalLM, LayerStack, mlp_param_shapes
from jaxserve.models.fused import split_qkv
from jaxserve.models.rope import apply_rope

ARCHITECTURES = ("glm4_moe",)
HF_ARCHITECTURES = {"Glm4MoeForCausalLM": "glm4_moe"}
HF_MODEL_TYPES = {"glm4_moe": "glm4_moe"}


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"glm4_moe with hidden_act={hf.get('hidden_act')!r} is not supported (silu)")
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    max_pos = int(hf.get("max_position_embeddings", 131072))
    eos = first_eos(hf)
    moe_width = int(hf["moe_intermediate_size"])
    return ModelConfig(
        architecture="glm4_moe",
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rope_scaling=parse_rope_scaling(rope, max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=bool(hf.get("use_qk_norm", False)),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5))),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        num_experts=int(hf["n_routed_experts"]),
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=moe_width,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        router_scoring="sigmoid",
        n_group=int(hf.get("n_group") or 1),
        topk_group=int(hf.get("topk_group") or 1),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        shared_expert_intermediate_size=moe_width * int(hf.get("n_shared_experts") or 0),
        first_k_dense_replace=int(hf.get("first_k_dense_replace") or 0),
        num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers") or 0),
    )


def expected_param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    L, E, D = cfg.num_stacked_layers, cfg.hidden_size, cfg.head_dim  # (with the MTP layer when served)
    layers: dict[str, tuple[int, ...]] = {
        "input_norm": (L, E), "post_norm": (L, E),
        "q_proj": (L, E, cfg.q_size), "k_proj": (L, E, cfg.kv_size), "v_proj": (L, E, cfg.kv_size),
        "o_proj": (L, cfg.q_size, E),
    }
    if cfg.attention_bias:
        layers.update(q_bias=(L, cfg.q_size), k_bias=(L, cfg.kv_size), v_bias=(L, cfg.kv_size))
    if cfg.qk_norm:
        layers.update(q_norm=(L, D), k_norm=(L, D))
    layers.update(mlp_param_shapes(cfg))
    shapes: dict[str, Any] = {"embed": (cfg.vocab_size, E), "layers": layers, "final_norm": (E,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (E, cfg.vocab_size)
    if cfg.mtp_layers:  # the MTP layer's own tensors, as DeepSeek's (`deepseek.mtp_weight_names`)
        shapes.update(mtp_enorm=(E,), mtp_hnorm=(E,), mtp_eh_proj=(2 * E, E), mtp_head_norm=(E,))
    return shapes


class Glm4MoeForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3's layer scans and expert layers with grouped-query attention over per-head
    K/V pages: `kv_cache` is (k, v[, k_scales, v_scales]) as for the Llama decoder."""

    _page_arrays = 2

    def _attention(self, h, w: LayerStack, rope, pool, md, page_offset, views, attention_fn, kv_update_fn):
        S = views.page_size
        pool = views.to_pages(pool)
        cfg = self.config
        T, Hq, Hkv, D = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = self._norm(h, w["input_norm"])
        qkv = w.matmul(x, "qkv_proj")  # [T, (Hq + 2 Hkv) D], interleaved per shard
        if cfg.attention_bias:
            qkv = qkv + w["qkv_bias"]
        q, k, v = split_qkv(qkv, cfg, self.shards)
        q, k, v = q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
        if cfg.qk_norm:
            q, k = self._norm(q, w["q_norm"]), self._norm(k, w["k_norm"])
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)  # the first rotary_dim dims of each head
        scales = {"k_scales": pool[2], "v_scales": pool[3]} if len(pool) == 4 else {}
        pool = tuple(kv_update_fn(k, v, pool[0], pool[1], md.slot_mapping + page_offset * S, **scales))
        scales = {"k_scales": pool[2], "v_scales": pool[3]} if len(pool) == 4 else {}
        attn = attention_fn(q, pool[0], pool[1], md.kv_lens, md.block_tables + page_offset, md.cu_q_lens,
                            md.num_seqs, sm_scale=cfg.sm_scale, num_kv_heads=Hkv, **scales)  # [T, Hq, D]
        return h + w.matmul(attn.reshape(T, Hq * D).astype(h.dtype), "o_proj"), views.to_carry(pool)
