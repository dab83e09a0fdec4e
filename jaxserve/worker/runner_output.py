"""What `ModelRunner.execute` hands back for one step: plain host data, nothing on device."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """The runner's compact form of one position's logprobs (internal: the engine turns it into
    vLLM's `dict[int, Logprob]` for its outputs): the token's logprob, its rank (1 = most
    likely) and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first


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


@dataclasses.dataclass
class SpecDecodeCounts:
    """Speculative decoding in one step (vLLM's counters): sequences that carried drafts,
    drafts proposed, drafts kept, and kept drafts by position (the i-th draft of a sequence)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]

    @classmethod
    def zero(cls, k: int = 0) -> SpecDecodeCounts:
        return cls(0, 0, 0, [0] * k)

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position += [0] * (num_draft_tokens - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def copy(self) -> SpecDecodeCounts:
        return dataclasses.replace(self, accepted_per_position=list(self.accepted_per_position))

    def merge(self, other: SpecDecodeCounts) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.accepted_per_position):
            if i == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[i] += n


@dataclasses.dataclass(frozen=True)
class ModelRunnerOutput:
    """Sampled ids per request (only requests whose span samples) and, for requests that
    asked for logprobs, each sampled token's logprob, rank and top alternatives (one per id:
    a step that verified drafts yields several ids).

    `grammar_errors` names the structured-output requests whose grammar rejected the
    sampled token (it allowed none the sampler could pick): they must end with an error,
    and their token in `sampled_token_ids` is not part of the output."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprob]]
    timing: StepTiming
    grammar_errors: dict[str, str] = dataclasses.field(default_factory=dict)
    spec_decode: SpecDecodeCounts | None = None  # None: no sequence carried drafts
    # Requests that asked for prompt logprobs and prefilled this step: (index of the first
    # prompt-logprobs entry filled, the entries), see `jaxserve.worker.prompt_logprobs`.
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = dataclasses.field(default_factory=dict)

    @classmethod
    def empty(cls, timing: StepTiming | None = None) -> ModelRunnerOutput:
        return cls({}, {}, timing or StepTiming())
