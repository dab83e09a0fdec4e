"""What `ModelRunner.execute` hands back for one step: plain host data, nothing on device."""

from __future__ import annotations

import dataclasses

from jaxserve.outputs import TokenLogprob


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """Wall time of one step (seconds), split into device work (the runner's calls, swap
    copies included) and host work (everything else the engine did), and its token counts."""

    device_s: float = 0.0
    host_s: float = 0.0
    num_tokens: int = 0  # real tokens computed
    padded_tokens: int = 0  # token bucket size
    num_rows: int = 0  # request bucket size (0: nothing was sampled)
    num_decode_tokens: int = 0  # of num_tokens, one per request that decodes (the rest are prefill chunks)
    mask_s: float = 0.0  # host time filling structured-output token bitmasks (part of device_s)


@dataclasses.dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled ids per request (only requests whose span samples) and, for requests that
    asked for logprobs, the sampled token's logprob, rank and top alternatives.

    `grammar_errors` names the structured-output requests whose grammar rejected the
    sampled token (it allowed none the sampler could pick): they must end with an error,
    and their token in `sampled_token_ids` is not part of the output."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, TokenLogprob]
    timing: StepTiming
    grammar_errors: dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def empty(cls, timing: StepTiming | None = None) -> ModelRunnerOutput:
        return cls({}, {}, timing or StepTiming())
