"""The engine on the embedded SmolLM2 against transformers' greedy outputs, under every
scheduling regime: prefix caching on/off, small budgets (chunked prefill), preemption by
recompute and by swap, and a shared system prompt served from the prefix cache."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from hf_reference import PROMPTS, hf_greedy  # noqa: E402
from logprob_checks import check_greedy_close, top_from_array, top_k_of  # noqa: E402

from jaxserve.config.engine_config import EngineConfig  # noqa: E402
from jaxserve.engine.llm_engine import Engine  # noqa: E402
from scheduler import SamplingParams  # noqa: E402

MAX_NEW = 24
SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and never invent facts. "
          "If you do not know, say so.\n\n")


def run_engine(loaded, prompts_ids, *, stagger: bool = False, **cfg):
    engine = Engine(EngineConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 512, **cfg}), loaded=loaded)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    results = {}
    pending = [(f"r{i}", ids) for i, ids in enumerate(prompts_ids)]
    if stagger:  # the first request computes the shared prefix before the others arrive
        rid, ids = pending.pop(0)
        engine.add_prompt(None, params, prompt_token_ids=ids, request_id=rid)
        for out in engine.step():
            results[out.request_id] = out
    for rid, ids in pending:
        engine.add_prompt(None, params, prompt_token_ids=ids, request_id=rid)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    outs = [results[f"r{i}"] for i in range(len(prompts_ids))]
    return engine, outs


def check_against_hf(outs, refs):
    exact = 0
    for out, (theirs, theirs_logp) in zip(outs, refs):
        comp = out.outputs[0]
        assert len(comp.token_ids) == MAX_NEW
        # vLLM's rule: at the first difference, each is in the other's top-5
        diverged = check_greedy_close(theirs, top_from_array(theirs_logp), comp.token_ids, top_k_of(comp.logprobs),
                                      name=out.request_id, top_k=5)
        exact += diverged is None
    assert exact >= len(outs) - 2, f"only {exact}/{len(outs)} continuations identical"


@pytest.fixture(scope="module")
def prompt_ids(smollm):
    return [smollm.tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_refs(hf_greedy_refs):
    return [(toks[:MAX_NEW], logp[:MAX_NEW]) for toks, logp in hf_greedy_refs]


@pytest.fixture(scope="module")
def system_prompt_ids(smollm):
    return [smollm.tokenizer(SYSTEM + p)["input_ids"] for p in PROMPTS[:4]]


@pytest.fixture(scope="module")
def hf_system_refs(hf_smollm, system_prompt_ids):
    return [hf_greedy(hf_smollm, ids, MAX_NEW) for ids in system_prompt_ids]


@pytest.mark.parametrize("cfg", [
    dict(),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=64),
], ids=["default", "no-prefix-cache", "budget16", "budget64"])
def test_greedy_matches_transformers(smollm, prompt_ids, hf_refs, cfg):
    _, outs = run_engine(smollm, prompt_ids, **cfg)
    check_against_hf(outs, hf_refs)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_matches_transformers_under_preemption(smollm, prompt_ids, hf_refs, mode):
    # 8 sequences of up to ~50 tokens need ~24 pages of 16; 12 usable pages force preemption.
    extra = dict(num_host_pages=64) if mode == "swap" else {}
    engine, outs = run_engine(smollm, prompt_ids, num_pages=13, preemption_mode=mode, **extra)
    stats = engine.scheduler.stats()
    assert stats.preemptions[mode] > 0, f"no {mode} preemption happened: {stats.preemptions}"
    check_against_hf(outs, hf_refs)
    assert stats.num_used_blocks == 0


def test_shared_system_prompt_hits_prefix_cache(smollm, system_prompt_ids, hf_system_refs):
    engine, outs = run_engine(smollm, system_prompt_ids, stagger=True)
    page = engine.config.page_size
    shared = len(smollm.tokenizer(SYSTEM)["input_ids"])
    for out in outs[1:]:
        cached = out.usage.cached_tokens
        assert cached > 0 and cached % page == 0, f"cached {cached} tokens, not a positive page multiple"
        assert cached <= shared + page
    assert outs[0].usage.cached_tokens == 0
    check_against_hf(outs, hf_system_refs)
