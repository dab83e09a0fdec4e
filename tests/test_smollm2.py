"""The embedded SmolLM2-135M (real weights) against transformers' load of the same GGUF file."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hf_reference import HF_MAX_NEW, PROMPTS, assert_greedy_match  # noqa: E402

from jaxserve.worker.batch import BatchBuilder, SequenceSpan  # noqa: E402
from jaxserve.worker.runner import ModelRunner  # noqa: E402


def test_gguf_tensors_equal_transformers_dequantized(smollm, hf_smollm):
    sd = {k: v.float().numpy() for k, v in hf_smollm.state_dict().items()}
    p = smollm.params
    np.testing.assert_array_equal(p["embed"], sd["model.embed_tokens.weight"])
    np.testing.assert_array_equal(p["final_norm"], sd["model.norm.weight"])
    names = {"q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
             "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
             "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
             "down_proj": "mlp.down_proj.weight"}
    for layer in (0, 13, 29):
        for ours, theirs in names.items():
            np.testing.assert_array_equal(p["layers"][ours][layer], sd[f"model.layers.{layer}.{theirs}"].T,
                                          err_msg=f"layer {layer} {ours}")
        np.testing.assert_array_equal(p["layers"]["input_norm"][layer],
                                      sd[f"model.layers.{layer}.input_layernorm.weight"])


def greedy_generate_paged(loaded, prompts_ids: list[list[int]], max_new: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """All prompts prefilled together, then batched decode steps; returns tokens and logprobs."""
    page = 16
    per_seq = (max(map(len, prompts_ids)) + max_new + page - 1) // page
    runner = ModelRunner(loaded, num_pages=1 + per_seq * len(prompts_ids), page_size=page,
                         attention_backend="reference")
    tables = [np.arange(1 + i * per_seq, 1 + (i + 1) * per_seq, dtype=np.int32) for i in range(len(prompts_ids))]
    builder = BatchBuilder(256, 8, per_seq, page)
    seqs = [list(p) for p in prompts_ids]
    outs: list[list[int]] = [[] for _ in seqs]
    logps: list[list[np.ndarray]] = [[] for _ in seqs]
    spans = [SequenceSpan(np.array(s, np.int32), 0, t) for s, t in zip(seqs, tables)]
    for _ in range(max_new):
        logits = runner.forward_numpy(builder.build(spans, 256, 8))
        spans = []
        for i, row in enumerate(logits):
            tok = int(np.argmax(row))
            logps[i].append(row - np.logaddexp.reduce(row))
            spans.append(SequenceSpan(np.array([tok], np.int32), len(seqs[i]), tables[i]))
            seqs[i].append(tok)
            outs[i].append(tok)
    return outs, [np.stack(lp) for lp in logps]


def test_greedy_continuations_match_transformers(smollm, hf_greedy_refs):
    tok = smollm.tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    ours, ours_logp = greedy_generate_paged(smollm, prompts, HF_MAX_NEW)
    exact = 0
    for i, (theirs, theirs_logp) in enumerate(hf_greedy_refs):
        assert_greedy_match(ours[i], ours_logp[i], theirs, theirs_logp)
        exact += ours[i] == theirs
    assert exact >= 6, f"only {exact}/8 continuations identical"
