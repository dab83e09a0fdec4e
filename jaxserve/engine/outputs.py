"""What the engine hands back per step: vLLM-shaped `RequestOutput`s carrying deltas."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

from jaxserve.worker.runner_output import (
    TokenLogprob,  # the runner's compact form, turned into Logprob dicts here
)


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
class Logprob:
    """vLLM's `Logprob`: one token's log probability at a position, its rank among the
    vocabulary (1 = most likely) and its text decoded alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position, vLLM's shape: {token id: Logprob}, the position's own token first, then the
# top-k by rank (the token appears once when it is among them).
PositionLogprobs = dict[int, Logprob]


def position_logprobs(lp: TokenLogprob, decode: Callable[[int], str] | None = None) -> PositionLogprobs:
    """The compact form as vLLM's dict (`decode`: token id -> text, for `decoded_token`)."""
    text = decode or (lambda _: None)
    entry = {lp.token_id: Logprob(lp.logprob, lp.rank, text(lp.token_id))}
    for rank, (tid, value) in enumerate(lp.top, 1):
        if tid not in entry:
            entry[tid] = Logprob(value, rank, text(tid))
    return entry


def top_logprobs(entry: PositionLogprobs, num_top: int) -> list[tuple[int, Logprob]]:
    """The `num_top` most likely tokens of a position, best first (what the request asked
    for: its own token is among them only when its rank is within `num_top`)."""
    ranked = sorted(entry.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 62)
    return ranked[:num_top]


def compact_logprobs(token_id: int, entry: PositionLogprobs, num_top: int) -> TokenLogprob:
    """The inverse of `position_logprobs`, for renderers of wire formats (the fronts):
    `num_top` is what the request asked for (the dict alone cannot tell whether its own token
    one rank past the others is one of the top or beside them)."""
    own = entry[token_id]
    return TokenLogprob(token_id, own.logprob, own.rank if own.rank is not None else 0,
                        tuple((t, lp.logprob) for t, lp in top_logprobs(entry, num_top)))


@dataclasses.dataclass
class CompletionOutput:
    """One of the `n` sequences of a request; cumulative fields plus this step's delta.
    `logprobs` (when the request asked): one `PositionLogprobs` per token id, as vLLM's."""

    index: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = dataclasses.field(default_factory=list)
    delta_logprobs: list[PositionLogprobs] | None = None

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
    # before it), then {token id: Logprob} for the token given the tokens before it and the
    # top alternatives (as `CompletionOutput.logprobs`). Sent with the prompt's ids (every
    # output when cumulative, the first one when DELTA); all entries are filled by then.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
