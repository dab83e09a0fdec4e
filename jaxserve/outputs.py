"""What the engine hands back per step: vLLM-shaped `RequestOutput`s carrying deltas."""

from __future__ import annotations

import dataclasses
import enum


class OutputKind(enum.Enum):
    """What each `RequestOutput` of a request carries (vLLM's `RequestOutputKind`).

    CUMULATIVE: the whole text, token ids and logprobs so far plus this step's delta.
    DELTA: only this step's delta; cumulative fields stay empty and the prompt's ids come
    with the first output only. A streaming front uses DELTA, so no step copies a request's
    whole output (which would cost O(L^2) over a request of L tokens). FINAL_ONLY: one
    output, when the request finishes, with CUMULATIVE's fields; no step snapshots an
    unfinished request (the batch API, as vLLM's `LLM.generate`).
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """Logprob of one sampled token, its rank (1 = most likely) and the top-n alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), most likely first


@dataclasses.dataclass
class CompletionOutput:
    """One of the `n` sequences of a request; cumulative fields plus this step's delta."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclasses.dataclass
class RequestMetrics:
    """Monotonic-clock timestamps (seconds, `time.monotonic()`), for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    usage: Usage
    metrics: RequestMetrics
    # Set when the request ended with finish reason "error": why.
    error: str | None = None
    # The request field the error is due to (its structured-output spec failed while it ran),
    # so fronts answer as for bad input; None: the engine failed it (a device step failed).
    error_param: str | None = None
    # SamplingParams.prompt_logprobs: one entry per prompt token, None first (nothing comes
    # before it), then each token's logprob given the tokens before it, its rank and the top
    # alternatives (as `CompletionOutput.logprobs`). Sent with the prompt's ids (every output
    # when cumulative, the first one when DELTA); all entries are filled by then.
    prompt_logprobs: list[TokenLogprob | None] | None = None
