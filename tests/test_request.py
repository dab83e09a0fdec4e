"""SamplingParams validation, enums and Request bookkeeping."""

from __future__ import annotations

import pytest

from scheduler import FinishReason, Request, RequestStatus, SamplingParams


def test_defaults_and_normalisation():
    sp = SamplingParams(stop="###", top_k=-1)
    assert sp.stop == ["###"] and sp.top_k == 0 and sp.n == 1 and sp.max_tokens == 16
    g = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.2)
    assert g.is_greedy and (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(stop=None).stop == []


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(max_tokens=4, min_tokens=5), "min_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=1.1), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(seed=1.5), "seed"),
        (dict(seed=2**63), "seed"),
        (dict(seed=-(2**63) - 1), "seed"),
        (dict(temperature=1e300), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(repetition_penalty=1e300), "repetition_penalty"),
        (dict(repetition_penalty=1e-300), "repetition_penalty"),
        (dict(stop=["a", ""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs"),
        (dict(cache_salt=""), "cache_salt"),
        (dict(priority=1.5), "priority"),
        (dict(ignore_eos=1), "ignore_eos"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(logit_bias={5: 101.0}), "logit_bias[5]"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"5": 1.0}), "logit_bias"),
        (dict(logit_bias={i: 1.0 for i in range(257)}), "logit_bias"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(top_k=2**31), "top_k"),
        (dict(max_tokens=2**40), "max_tokens"),
    ],
)
def test_validation_names_field_and_range(kwargs, field):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    msg = str(e.value)
    assert msg.startswith(field), msg
    assert ("must be" in msg or "at most" in msg) and "got" in msg, msg


def test_accepts_edges():
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, logprobs=0)
    SamplingParams(max_tokens=3, min_tokens=3, seed=-5, stop_token_ids=[0], cache_salt="t1")
    SamplingParams(seed=2**63 - 1, temperature=1e6, repetition_penalty=1e-6)
    SamplingParams(seed=-(2**63), repetition_penalty=1e6)
    assert SamplingParams(logit_bias={3: -100, 4: 100.0}).uses_penalties
    assert SamplingParams(logit_bias={}).logit_bias is None and not SamplingParams().uses_penalties


def test_enums():
    assert FinishReason.STOP == "stop" and FinishReason.LENGTH.value == "length"
    assert str(FinishReason.ABORT) == "abort" and FinishReason("capacity") is FinishReason.CAPACITY
    assert not RequestStatus.SWAPPED.is_finished and RequestStatus.FINISHED_ABORTED.is_finished
    for reason in FinishReason:
        assert RequestStatus.for_finish_reason(reason).finish_reason is reason


def test_request_bookkeeping():
    r = Request("a", [1, 2, 3], SamplingParams(priority=3), eos_token_id=0, arrival_time=2)
    assert r.num_tokens == 3 and r.num_prompt_tokens == 3 and r.priority == 3
    assert r.status == RequestStatus.WAITING and r.num_cached_tokens == -1
    r.append_output_token(9)
    assert r.all_token_ids == [1, 2, 3, 9] and r.output_token_ids == [9] and r.num_tokens == 4
    assert r.prompt_token_ids == [1, 2, 3]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("b", [])


def test_check_stop():
    r = Request("a", [1], SamplingParams(max_tokens=5, min_tokens=1, stop_token_ids=[4]), 3)
    r.append_output_token(3)
    assert r.check_stop(100) == FinishReason.STOP and r.stop_reason is None
    r = Request("a", [1], SamplingParams(max_tokens=5, stop_token_ids=[4]), 3)
    r.append_output_token(4)
    assert r.check_stop(100) == FinishReason.STOP and r.stop_reason == 4
    r = Request("a", [1], SamplingParams(max_tokens=5, ignore_eos=True), 3)
    r.append_output_token(3)
    assert r.check_stop(100) is None
    assert r.check_stop(2) == FinishReason.LENGTH
