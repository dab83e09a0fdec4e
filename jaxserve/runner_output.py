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


@dataclasses.dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled ids per request (only requests whose span samples) and, for requests that
    asked for logprobs, the sampled token's logprob, rank and top alternatives."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, TokenLogprob]
    timing: StepTiming

    @classmethod
    def empty(cls, timing: StepTiming | None = None) -> ModelRunnerOutput:
        return cls({}, {}, timing or StepTiming())
