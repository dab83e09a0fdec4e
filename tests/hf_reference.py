"""transformers references shared by the end-to-end tests (greedy generation, near-tie rule)."""

from __future__ import annotations

import numpy as np
import torch

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
    """Equal tokens, or at the first difference each side's token is in the other's top-5."""
    for j, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            assert a in np.argsort(-theirs_logp[j])[:5] and b in np.argsort(-ours_logp[j])[:5], (
                f"token {j}: ours {a} vs transformers {b} is not a near-tie")
            return
    assert len(ours) == len(theirs)


def hf_greedy(hf_model, ids: list[int], max_new: int) -> tuple[list[int], np.ndarray]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                                output_scores=True, return_dict_in_generate=True,
                                eos_token_id=None, pad_token_id=0, min_new_tokens=max_new)
    toks = out.sequences[0, len(ids):].tolist()
    logp = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), -1).numpy()
    return toks, logp


def save_tiny_llama(path, num_kv_heads: int) -> str:
    """A random 8-query-head Llama saved as an HF directory; weights scaled up so logits are
    sharp and greedy picks are not near-ties (tensor-parallel and multi-host comparisons)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=num_kv_heads)
    torch.manual_seed(num_kv_heads)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(path)
    return str(path)
