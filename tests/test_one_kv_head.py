"""A cache of one KV head (multi-query attention: Gemma 3 1B, Gemma 2B, Falcon): held as
[L, P, S, D] without the size-1 head axis, seen by the kernels as [P, S, 1, D] pages. Greedy
tokens equal transformers' (an int8 cache under swap preemption too, with vLLM's near-tie
rule), and the step updates the cache in place: with the head axis, XLA:CPU copied the whole
cache four times a step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("kv_cache_dtype,preemption_mode", [("auto", "recompute"), ("int8", "swap")])
def test_one_kv_head_matches_transformers_with_the_cache_updated_in_place(tmp_path, kv_cache_dtype,
                                                                           preemption_mode):
    import transformers
    from hf_reference import hf_greedy, save_tiny_llama
    from logprob_checks import check_greedy_close, top_from_array, top_k_of

    from jaxserve import LLM, SamplingParams
    from jaxserve.compilation.aot import cache_copies

    path = save_tiny_llama(tmp_path / "mqa", 1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval().float()
    llm = LLM(model=path, dtype="float32", kv_cache_dtype=kv_cache_dtype, preemption_mode=preemption_mode,
              num_pages=14, page_size=4, max_num_seqs=3, max_num_batched_tokens=16, token_buckets=(16,),
              max_model_len=64, max_logprobs=5, structured_outputs=False, compilation_cache_dir=None)
    pages = llm.engine.runner.kv_cache[0].shape
    assert len(pages) == 4  # [L, P, S, D]
    prompts = [[1 + (5 * i + 7 * j) % 127 for j in range(9 + 3 * i)] for i in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5))
    assert sum(llm.engine.scheduler.stats().preemptions.values()) > 0, "no preemption: the pages were not scarce"
    for p, out in zip(prompts, outs):
        want, want_logp = hf_greedy(hf, p, 10)
        if kv_cache_dtype == "auto":
            assert out.outputs[0].token_ids == want
        else:
            check_greedy_close(want, top_from_array(want_logp), out.outputs[0].token_ids,
                               top_k_of(out.outputs[0].logprobs), name=f"int8, {len(p)} tokens", top_k=5)
    assert llm.engine.compiles_after_warmup == 0
    assert llm.engine.scheduler.stats().num_used_blocks == 0
    for key, exe in llm.engine.runner.executables.items():
        if key.kind == "backbone":
            assert cache_copies(exe.as_text(), pages[2:], pages[1] * pages[2] * pages[3]) == 0, key.name
