"""Logits parity with HF transformers on tiny random configs of each supported family.

A ragged batch of three sequences runs through the paged cache: a first step with full and
partial prefills, a mixed step (decodes plus the rest of a chunked prefill), then decode steps;
pages are shuffled so no sequence's pages are contiguous.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxserve.loading import load_model  # noqa: E402
from jaxserve.worker.batch import BatchBuilder, SequenceSpan  # noqa: E402
from jaxserve.worker.runner import ModelRunner  # noqa: E402

PAGE = 4
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5)

CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama-llama3-rope-tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama-linear-rope-mha": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=4, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral-sliding": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=6, num_key_value_heads=2,
                                                       hidden_size=96)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    # Routed experts: 6 experts, 2 per token; widths unlike the dense MLP's so a mix-up fails.
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)),
    "qwen3-moe-unnormalised": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=3, moe_intermediate_size=40, norm_topk_prob=False)),
    "mixtral-sliding": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=5, num_experts_per_tok=2, intermediate_size=40, sliding_window=8)),
    # Gemma: window 6 on the sliding layers (contexts reach 22), soft-caps low enough to bite,
    # query_pre_attn_scalar unlike head_dim.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, num_hidden_layers=3, query_pre_attn_scalar=24, sliding_window=6,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, num_hidden_layers=4, query_pre_attn_scalar=20, sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
    # the language model of a multimodal checkpoint (Gemma 3 4B-27B are published so)
    "gemma3-multimodal": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
        text_config=dict(head_dim=16, query_pre_attn_scalar=20, sliding_window=6,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4)),
    # MLA without q LoRA (one q projection), default RoPE on interleaved pairs; 6 experts in 2
    # groups (one kept), two shared experts' width, the first layer dense
    "deepseek-v3-plain-q": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=24, n_routed_experts=6, n_shared_experts=2, moe_intermediate_size=40, num_experts_per_tok=2,
        n_group=2, topk_group=1, routed_scaling_factor=1.7, first_k_dense_replace=1)),
    # DeepSeek-V2(-Lite): softmax routing limited to the best 2 of 3 groups (by their best
    # expert), not renormalised, times routed_scaling_factor; no correction bias
    "deepseek-v2-grouped": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=6, n_shared_experts=1, moe_intermediate_size=40, num_experts_per_tok=2,
        topk_method="group_limited_greedy", n_group=3, topk_group=2, routed_scaling_factor=1.3,
        first_k_dense_replace=1)),
    # every layer MoE (no dense stack), q/k/v bias without q/k norm, half of each head rotated
    "glm4-moe-all-sparse": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=16, attention_bias=True, use_qk_norm=False, n_routed_experts=6, n_shared_experts=1,
        moe_intermediate_size=40, num_experts_per_tok=2, first_k_dense_replace=0)),
    # every layer of one type: the window and the RoPE base become compile-time constants
    # Scout's pattern: every layer MoE (one expert of 6 plus the shared one), llama3 RoPE, a
    # 4-token chunk on the RoPE layer, the NoPE layer with temperature tuning
    "llama4-scout-all-moe": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
        head_dim=16, intermediate_size=48, intermediate_size_mlp=96, num_local_experts=6, num_experts_per_tok=1,
        interleave_moe_layer_step=1, attention_chunk_size=4, no_rope_layers=[1, 0], floor_scale=2, attn_scale=0.3,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    # Gemma 4 dense in its released 5:1 pattern: full layers 32 wide with a v_proj of their own
    "gemma4-dense-5to1": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        head_dim=16, global_head_dim=32, attention_k_eq_v=False, hidden_size_per_layer_input=0,
        num_kv_shared_layers=0, sliding_window=4, num_hidden_layers=6, final_logit_softcapping=None)),
    "gemma3-all-sliding": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, sliding_window=5, layer_types=["sliding_attention"] * 2,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 300.0}})),
}


def _make_hf_model(tmp_path, case):
    cfg_cls, model_cls, extra = CASES[case]
    kwargs = {**COMMON, **extra}
    if "text_config" in extra:  # multimodal: the common fields describe its language model
        kwargs = {**extra, "text_config": {**COMMON, **extra["text_config"]}}
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**kwargs)
    cfg._attn_implementation = "eager"  # the path that applies Gemma 2's attention soft-cap
    model = getattr(transformers, model_cls)(cfg).eval().float()
    with torch.no_grad():  # random biases/norm weights so those code paths matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return model


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    return out.logits[0].float().numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_ragged_paged_logits_match_transformers(tmp_path, case):
    hf = _make_hf_model(tmp_path, case)
    loaded = load_model(str(tmp_path), dtype="float32")
    groups = loaded.config.kv_layer_groups  # windowed layers beside full ones: a table per group
    G = groups.num_groups if groups is not None else 1
    num_pages = 1 + 24 * G
    runner = ModelRunner(loaded, num_pages=num_pages, page_size=PAGE, attention_backend="reference",
                         max_pages_per_seq=8 * G)
    rng = np.random.default_rng(0)
    pages = rng.permutation(np.arange(1, num_pages))  # page 0 is the null page
    tables = [pages[8 * G * i: 8 * G * (i + 1)] for i in range(3)]  # each group's 8 pages side by side
    seqs = [list(rng.integers(0, 96, n)) for n in (5, 11, 17)]
    builder = BatchBuilder(max_tokens=64, max_reqs=4, max_pages_per_seq=8 * G, page_size=PAGE, num_kv_groups=G)
    computed = [0, 0, 0]
    # step 1: seq0 whole, seq1 first 6 tokens (chunked), seq2 whole; then mixed and decodes
    plans = [[5, 6, 17], [1, 5, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    max_err = 0.0
    for plan in plans:
        spans = []
        for i, n in enumerate(plan):
            spans.append(SequenceSpan(np.array(seqs[i][computed[i]: computed[i] + n], np.int32),
                                      computed[i], tables[i]))
        logits = runner.forward_numpy(builder.build(spans, 32, 4))
        for i, n in enumerate(plan):
            computed[i] += n
            want = _hf_logits(hf, seqs[i][: computed[i]])[-1]
            max_err = max(max_err, float(np.abs(logits[i] - want).max()))
            if computed[i] == len(seqs[i]):  # extend with the greedy token
                seqs[i].append(int(np.argmax(want)))
    assert max_err <= 1e-3, f"{case}: max abs logit difference {max_err}"
