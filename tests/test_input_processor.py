"""The one input processor: its checks name the client's field, and what it prepares (room
left, seeds, grammars) is what the engine runs. Tiny limits, a stub tokenizer, no model."""

from __future__ import annotations

import pytest

from jaxserve.engine.input_processor import (
    MAX_STOP_STRINGS,
    InputError,
    InputLimits,
    InputProcessor,
)
from scheduler import SamplingParams
from scheduler.request import wrap_seed

LIMITS = InputLimits(vocab_size=100, max_model_len=32, max_logprobs=5, max_n=4, max_prompt_chars=50)


class StubTokenizer:
    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) % 100 for c in text]}


@pytest.fixture
def proc() -> InputProcessor:
    return InputProcessor(LIMITS, StubTokenizer(), None, "structured outputs are off", seed=7)


@pytest.mark.parametrize("params,param", [
    (SamplingParams(logprobs=6), "logprobs"),
    (SamplingParams(n=5), "n"),
    (SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"),
    (SamplingParams(stop=["x" * 300]), "stop"),
    (SamplingParams(stop_token_ids=list(range(16))), "stop_token_ids"),
    (SamplingParams(stop_token_ids=[100]), "stop_token_ids"),
    (SamplingParams(logit_bias={100: 1.0}), "logit_bias"),
    (SamplingParams(structured_outputs={"regex": "a+"}), "structured_outputs"),
])
def test_each_cap_names_its_field(proc, params, param):
    with pytest.raises(InputError) as e:
        proc.process([1, 2, 3], params)
    assert e.value.param == param and str(e.value).startswith(param)


def test_the_clients_own_name_for_a_field(proc):
    with pytest.raises(InputError, match=r"^top_logprobs must be <= 5") as e:
        proc.check_params(SamplingParams(logprobs=6), {"logprobs": "top_logprobs"})
    assert e.value.param == "top_logprobs"


@pytest.mark.parametrize("ids,code", [([], None), ([1, 100], None), ([1, -1], None), ([1, True], None),
                                      ([1] * 32, "context_length_exceeded")])
def test_prompt_ids(proc, ids, code):
    with pytest.raises(InputError) as e:
        proc.process(ids, SamplingParams(), param="messages")
    assert e.value.param == "messages" and e.value.code == code


def test_prompt_text_and_conversations(proc):
    assert proc.encode("ab") == [1, 97, 98] and proc.encode("ab", add_special_tokens=False) == [97, 98]
    for bad, param in (("", "prompt"), ("x" * 51, "prompt")):
        with pytest.raises(InputError) as e:
            proc.encode(bad)
        assert e.value.param == param
    with pytest.raises(InputError) as e:
        proc.check_messages([{"role": "user", "content": "hi"}, {"role": "", "content": "x"}])
    assert e.value.param == "messages[1].role"
    with pytest.raises(InputError, match="max_prompt_chars"):
        proc.check_messages([{"role": "user", "content": "x" * 60}])


def test_max_tokens_past_the_room_left_is_the_clients_error(proc):
    """vLLM answers 400: prompt + max_tokens must fit within max_model_len (32 here); the
    client's own field name is the param; exactly the room left is fine."""
    assert proc.process([1, 2, 3], SamplingParams(max_tokens=29)).params.max_tokens == 29
    with pytest.raises(InputError, match=r"'max_tokens' is too large: 30\. .* 32 tokens .* 3 input tokens") as e:
        proc.process([1, 2, 3], SamplingParams(max_tokens=30))
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
    with pytest.raises(InputError) as e:
        proc.process([1, 2, 3], SamplingParams(max_tokens=40), field_names={"max_tokens": "max_completion_tokens"})
    assert e.value.param == "max_completion_tokens"


def test_room_left_and_seeds(proc):
    req = proc.process([1, 2, 3], SamplingParams(n=3, seed=2**63 - 2, max_tokens=1), fill_max_tokens=True)
    assert req.params.max_tokens == 32 - 3 and req.prompt_token_ids == (1, 2, 3)
    assert req.seeds == (2**63 - 2, 2**63 - 1, wrap_seed(2**63)) and req.seeds[2] == -(2**63)
    # Unseeded: drawn from the engine's generator, the same for the same EngineConfig.seed.
    a = [proc.process([1], SamplingParams(n=2)).seeds for _ in range(3)]
    other = InputProcessor(LIMITS, StubTokenizer(), seed=7)
    assert a == [other.process([1], SamplingParams(n=2)).seeds for _ in range(3)] and len(set(a)) == 3
    assert req.grammar is None
