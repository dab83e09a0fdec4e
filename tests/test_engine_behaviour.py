"""Engine behaviour on the embedded model: seeds, no recompilation, aborts, bad input."""

from __future__ import annotations

import random

import pytest

from jaxserve.worker.compile_cache import EVENTS
from scheduler import SamplingParams

SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, num_pages=64, max_model_len=256)



def drain(engine, wanted=None):
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done




def test_seeded_sampling_independent_of_batch(engine):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    engine.add_prompt("Tell me a story about a dragon", params, request_id="alone")
    alone = drain(engine)["alone"].outputs[0].token_ids
    rng = random.Random(0)
    for i in range(15):
        other = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.2]), top_k=rng.choice([0, 5, 50]),
                               seed=rng.randrange(1000), max_tokens=rng.randint(4, 16))
        engine.add_prompt(f"Other prompt number {i} about {'cats' * (i % 4 + 1)}", other, request_id=f"o{i}")
    engine.add_prompt("Tell me a story about a dragon", params, request_id="batched")
    batched = drain(engine)["batched"].outputs[0].token_ids
    assert alone == batched and len(alone) == 12


def test_no_compilation_after_warmup(engine):
    rng = random.Random(7)
    vocab = engine.model_config.vocab_size
    before = EVENTS.compiles
    ids = []
    for i in range(50):
        n = rng.choice([1, 3, 17, 40, 90, 150])
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.0, 0.8]), top_p=rng.choice([1.0, 0.9]),
            top_k=rng.choice([0, 20]), repetition_penalty=rng.choice([1.0, 1.0, 1.2]),
            presence_penalty=rng.choice([0.0, 0.5]), logprobs=rng.choice([None, None, 3]),
            max_tokens=rng.randint(1, 24), seed=rng.randrange(10**6), n=rng.choice([1, 1, 2]),
        )
        ids.append(engine.add_prompt(None, params, prompt_token_ids=[rng.randrange(vocab) for _ in range(n)],
                                      request_id=f"w{i}"))
        if i % 7 == 0:
            engine.step()
        if i % 11 == 5:
            engine.abort(rng.choice(ids))
    done = drain(engine)
    assert len(done) >= 40
    assert EVENTS.compiles == before, f"{EVENTS.compiles - before} compilations after warmup"
    st = engine.scheduler.stats()
    assert st.num_used_blocks == 0 and st.num_running == 0 and st.num_waiting == 0


def test_abort_frees_every_block(engine):
    for i in range(4):
        engine.add_prompt(None, SamplingParams(max_tokens=50, ignore_eos=True),
                           prompt_token_ids=list(range(10 + i, 60 + i)), request_id=f"a{i}")
    for _ in range(3):
        engine.step()
    assert engine.scheduler.stats().num_used_blocks > 0
    for i in range(4):
        assert engine.abort(f"a{i}")
    assert not engine.abort("a0")  # already gone
    assert engine.scheduler.stats().num_used_blocks == 0
    assert engine.num_unfinished_requests == 0
    engine.step()
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("bad,match", [
    (dict(prompt_token_ids=list(range(300))), "max_model_len"),
    (dict(prompt_token_ids=[5, 10**6]), "prompt_token_ids"),
    (dict(prompt_token_ids=[]), "empty"),
    (dict(prompt_token_ids=[5], params=SamplingParams(logprobs=50)), "logprobs"),
    (dict(prompt_token_ids=[5], params=SamplingParams(n=100)), "n must be"),
    (dict(prompt_token_ids=[5], params=SamplingParams(stop_token_ids=[10**7])), "stop_token_ids"),
])
def test_bad_requests_rejected_and_others_served(engine, bad, match):
    engine.add_prompt("Good request", SamplingParams(max_tokens=5, temperature=0), request_id="good")
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_prompt("Again", SamplingParams(max_tokens=5), request_id="good")
    params = bad.pop("params", SamplingParams())
    with pytest.raises(ValueError, match=match):
        engine.add_prompt(None, params, request_id="bad", **bad)
    done = drain(engine)
    assert set(done) == {"good"} and len(done["good"].outputs[0].token_ids) >= 1
    assert engine.scheduler.stats().num_used_blocks == 0
    engine.step()  # the scheduler forgets finished ids one step after reporting them


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -5), ("min_p", 2.0),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -3.0),
    ("max_tokens", 0), ("min_tokens", -1), ("n", 0), ("logprobs", -1),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_stop_string_and_n(engine):
    out = None
    engine.add_prompt("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=30, stop=[" 6"]),
                       request_id="stop")
    engine.add_prompt("Hello", SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=5, ignore_eos=True),
                       request_id="multi")
    done = drain(engine)
    out = done["stop"].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 6" and " 6" not in out.text
    multi = done["multi"]
    assert [c.index for c in multi.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in multi.outputs)
    assert multi.usage.completion_tokens == 18
