"""transformers references shared by the end-to-end tests (greedy generation, near-tie rule)."""

from __future__ import annotations

import numpy as np
import torch
from logprob_checks import check_greedy_close, top_from_array

HF_MAX_NEW = 32  # tokens of each transformers reference continuation

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colors:",
    "Q: What is 12 times 7?\nA:",
    "The most important thing about machine learning is",
    "Translate to French: Good morning, how are you today? I hope the weather is nice where you live.",
    "Hi",
]


def assert_greedy_match(ours: list[int], ours_logp: np.ndarray, theirs: list[int], theirs_logp: np.ndarray):
    """Equal tokens, or at the first difference each side's token is in the other's top-5
    (`logprob_checks.check_greedy_close` on [N, V] logprob arrays)."""
    check_greedy_close(theirs, top_from_array(theirs_logp), ours, top_from_array(ours_logp),
                       name="ours vs transformers", top_k=5)


def hf_greedy(hf_model, ids: list[int], max_new: int) -> tuple[list[int], np.ndarray]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                output_scores=True, return_dict_in_generate=True,
                                eos_token_id=None, pad_token_id=0, min_new_tokens=max_new)
    toks = out.sequences[0, len(ids):].tolist()
    logp = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), -1).numpy()
    return toks, logp


def save_tiny_llama(path, num_kv_heads: int, seed: int | None = None) -> str:
    """A random 8-query-head Llama saved as an HF directory; weights scaled up so logits are
    sharp and greedy picks are not near-ties (tensor-parallel and multi-host comparisons).
    `seed` (default: `num_kv_heads`) draws other weights of the same shapes."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=num_kv_heads)
    torch.manual_seed(num_kv_heads if seed is None else seed)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(path)
    return str(path)


# Tiny random configs of the families beyond Llama (8 query heads, 2 KV heads, 3 layers, so
# tensor parallelism up to 8 splits heads and replicates KV heads; 8 experts, so expert
# parallelism up to 8 places whole experts).
FAMILY_CONFIGS = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0)),
    # MLA with q LoRA, YaRN (mscale_all_dim in the softmax scale), sigmoid routing over 4 groups
    # of 2 (2 groups kept), a shared expert, the first layer dense
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=8, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, num_experts_per_tok=2,
        n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 128})),
    # GQA with q/k/v bias, q/k norm and half the head rotated; DeepSeek's expert layers
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=16, attention_bias=True, use_qk_norm=True, n_routed_experts=8, n_shared_experts=1,
        moe_intermediate_size=32, num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        first_k_dense_replace=1)),
    # sinks, 8-token windows on alternate layers, YaRN on the NeoX halves, a biased router,
    # biased experts with the clamped SwiGLU
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 128})),
    # Maverick's pattern in 4 layers: dense and MoE layers alternating (one routed expert plus a
    # shared one), chunked attention (8 tokens) with L2 q/k norm on RoPE layers, the last layer
    # NoPE with temperature tuning (floor_scale 4, so its scale moves within the prompts)
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        head_dim=16, num_hidden_layers=4, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=8,
        num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8, no_rope_layers=[1, 1, 1, 0],
        floor_scale=4, attn_scale=0.5)),
    # two periods of (sliding, full): full layers 32 wide with their own KV heads, values equal
    # to keys, a quarter of each rotated; the MoE block beside the dense MLP
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        head_dim=16, global_head_dim=32, num_global_key_value_heads=2, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, num_kv_shared_layers=0, sliding_window=8, num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2, enable_moe_block=True, num_experts=4,
        top_k_experts=2, moe_intermediate_size=32, final_logit_softcapping=30.0)),
    # E2B / E4B's features: per-layer input embeddings, the last period reading the K/V of the
    # layers before it, with double-wide MLPs
    "gemma4_e": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        head_dim=16, global_head_dim=32, attention_k_eq_v=False, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=128, num_kv_shared_layers=2, use_double_wide_mlp=True, sliding_window=8,
        num_hidden_layers=6, layer_types=["sliding_attention", "full_attention"] * 3)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
}


def save_tiny_family(path, family: str, **overrides):
    """A random model of `family` saved as an HF directory (weights scaled up so greedy picks
    are not near-ties); returns the transformers model (f32, eager attention). `overrides`:
    config values in place of the family's."""
    import transformers

    cfg_cls, model_cls, extra = FAMILY_CONFIGS[family]
    kwargs = {**dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512), **extra,
              **overrides}
    cfg = getattr(transformers, cfg_cls)(**kwargs)
    cfg._attn_implementation = "eager"
    torch.manual_seed(1)
    model = getattr(transformers, model_cls)(cfg).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.mul_(4.0)
            if family == "gpt_oss":  # sinks and biases as large as trained ones (experts' start at zero)
                for name, p in model.named_parameters():
                    if name.endswith(("sinks", "bias")):
                        p.copy_(torch.randn_like(p))
            if family.startswith("gemma4"):  # learned scales that start at one
                for name, p in model.named_parameters():
                    if name.endswith(("router.scale", "per_expert_scale")):
                        p.copy_(1.0 + 0.3 * torch.randn_like(p))
                for name, b in model.named_buffers():
                    if name.endswith("layer_scalar"):
                        b.copy_(0.5 + torch.rand_like(b))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's routing bias (zero as initialised)
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path)
    return model
