"""vLLM semantics of the engine, each against what it did before (embedded model, greedy)."""

from __future__ import annotations

import pytest

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import Engine
from scheduler import SamplingParams

SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, num_pages=96, max_model_len=256)
PROMPT = "List ten fruits, separated by commas: apples, bananas,"



def run(engine, prompt, params, rid="r"):
    engine.add_prompt(prompt, params, request_id=rid)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].finished
    return outs


def greedy(**kw):
    return SamplingParams(temperature=0.0, **kw)


def test_min_tokens_holds_back_stop_strings(engine):
    free = run(engine, PROMPT, greedy(max_tokens=24))[-1].outputs[0]
    assert "," in free.text[:20], free.text  # the stop string comes early: the test can fail
    early = run(engine, PROMPT, greedy(max_tokens=24, stop=[","]))[-1].outputs[0]
    assert len(early.token_ids) <= 4 and early.stop_reason == ","
    held = run(engine, PROMPT, greedy(max_tokens=24, min_tokens=12, stop=[","]))[-1].outputs[0]
    assert len(held.token_ids) > 12, held  # before: ended after 2 tokens
    assert held.token_ids == free.token_ids[: len(held.token_ids)]
    if held.finish_reason == "stop":
        assert held.stop_reason == "," and "," not in engine.tokenizer.decode(held.token_ids[12:])[:-1]


def test_stop_token_text_is_not_output(engine):
    free = run(engine, PROMPT, greedy(max_tokens=8, skip_special_tokens=False))[-1].outputs[0]
    ids = free.token_ids
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])  # a token seen first at k
    stop_id = ids[k]
    for include in (False, True):
        out = run(engine, PROMPT, greedy(max_tokens=8, stop_token_ids=[stop_id], skip_special_tokens=False,
                                         include_stop_str_in_output=include))[-1].outputs[0]
        assert out.token_ids == ids[: k + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
        kept = out.token_ids if include else out.token_ids[:k]
        assert out.text == engine.tokenizer.decode(kept, skip_special_tokens=False)  # before: always appended


def test_stop_string_on_the_last_allowed_token_is_stop(engine):
    free = run(engine, PROMPT, greedy(max_tokens=8))[-1].outputs[0]
    assert free.finish_reason == "length"
    stop = free.text.strip()
    out = run(engine, PROMPT, greedy(max_tokens=8, stop=[stop]))[-1].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop  # before: "length"
    assert stop not in out.text and len(out.token_ids) == 8


def test_finished_id_is_reusable_at_once(engine):
    run(engine, PROMPT, greedy(max_tokens=2), rid="again")
    engine.add_prompt(PROMPT, greedy(max_tokens=2), request_id="again")  # before: "still in flight"
    engine.abort("again")


def test_outputs_are_snapshots(engine):
    engine.add_prompt(PROMPT, greedy(max_tokens=6, logprobs=2), request_id="snap")
    seen = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            c = o.outputs[0]
            seen.append((o, list(c.token_ids), len(c.logprobs)))
    for o, ids, nlp in seen:
        assert o.outputs[0].token_ids == ids and len(o.outputs[0].logprobs) == nlp


def test_n_siblings_compute_the_prompt_once(engine):
    prompt_ids = engine.input_processor.encode(PROMPT * 4)  # 48 tokens: all four would fit one 64-token step
    before = engine.scheduler.stats()
    computed = 0
    engine.add_prompt(None, SamplingParams(n=4, temperature=2.0, seed=3, max_tokens=3, ignore_eos=True),
                       prompt_token_ids=prompt_ids, request_id="fan")
    while engine.has_unfinished_requests():
        outs = engine.step()
        computed += engine.last_step.num_tokens
    out = outs[-1]
    assert out.finished and [len(c.token_ids) for c in out.outputs] == [3, 3, 3, 3]
    hit = (len(prompt_ids) - 1) // 16 * 16
    after = engine.scheduler.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * hit
    # The prompt once, then each sibling only what the cached blocks leave, plus 2 decodes each.
    assert computed == len(prompt_ids) + 3 * (len(prompt_ids) - hit) + 4 * 2
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds seed+i differ


def test_failed_step_fails_only_its_requests_and_recovers(engine, monkeypatch):
    ref = run(engine, PROMPT, greedy(max_tokens=5), rid="ref")[-1].outputs[0].token_ids
    real = engine.runner.run_backbone
    calls = []

    def fail_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            for buf in engine.runner.kv_cache:  # as if the donated cache were consumed
                buf.delete()
            raise RuntimeError("injected device failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "run_backbone", fail_once)
    for i in range(10):  # the first step takes what its budget allows, the rest wait
        engine.add_prompt(PROMPT, greedy(max_tokens=5), request_id=f"f{i}")
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    failed = {rid for rid, o in finished.items() if o.outputs[0].finish_reason == "error"}
    k = len(failed)
    assert 0 < k < 10 and failed == {f"f{i}" for i in range(k)}  # FCFS: the first k were in the step
    assert "failed" in finished["f0"].error and engine.healthy and len(finished) == 10
    assert finished["f0"].error_param is None  # the engine's failure, not the request's input
    for i in range(k, 10):  # served after the rebuild, on a cache with no stale prefix
        out = finished[f"f{i}"]
        assert out.outputs[0].token_ids == ref and out.error is None and out.outputs[0].finish_reason == "length"
    monkeypatch.undo()
    assert run(engine, PROMPT, greedy(max_tokens=5), rid="after")[-1].outputs[0].token_ids == ref


def test_degenerate_top_p_and_logprobs_zero_without_max_logprobs(smollm):
    e = Engine(EngineConfig(**{**SMALL, "num_pages": 16, "max_logprobs": 0, "max_num_seqs": 2}), loaded=smollm)
    vocab = e.model_config.vocab_size
    e.add_prompt(PROMPT, SamplingParams(temperature=1.0, top_p=5e-324, seed=1, max_tokens=4, logprobs=0),
                  request_id="x")
    while e.has_unfinished_requests():
        for o in e.step():
            last = o
    c = last.outputs[0]
    assert all(0 <= t < vocab for t in c.token_ids)
    assert len(c.logprobs) == 4 and all(list(e) == [t] and e[t].rank == 1 for t, e in zip(c.token_ids, c.logprobs))
    with pytest.raises(ValueError, match="logprobs must be <= 0"):
        e.add_prompt(PROMPT, SamplingParams(logprobs=1))
