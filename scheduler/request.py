"""Requests as the scheduler sees them: sampling parameters, status and finish reasons.

This is a leaf module (it imports only the leaf `structured_params`) so that the engine,
the server and the tests can all build requests without pulling in the scheduler.

A request is one sequence. The engine fans ``n > 1`` out into ``n`` child requests, so the
scheduler only ever sees one sequence per ``Request``; ``SamplingParams.n`` is validated here
and carried along only for the engine's benefit.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from scheduler.structured_params import GrammarHandle, StructuredOutputsParams

_PENALTY_RANGE = (-2.0, 2.0)
_INT32 = 2**31
SEED_RANGE = (-(2**63), 2**63)  # signed 64-bit; all 64 bits select the sampler's stream
# Largest temperature and repetition-penalty factor taken (and the smallest penalty): the
# sampler divides and multiplies f32 logits by them, so values near f32's range would give
# inf or NaN; past these the distribution no longer changes in a way anyone can use.
MAX_TEMPERATURE = 1e6
REPETITION_PENALTY_RANGE = (1e-6, 1e6)


def wrap_seed(seed: int) -> int:
    """`seed` wrapped into SEED_RANGE (two's complement), for derived seeds such as an
    n > 1 request's `seed + i`."""
    return (seed + 2**63) % 2**64 - 2**63
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range for logit_bias values
MAX_LOGIT_BIAS = 256  # entries per request: the sampler's bias table is [R, MAX_LOGIT_BIAS]


class FinishReason(enum.StrEnum):
    """Why a request ended. The value is the string used in APIs (OpenAI style)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the client went away or the engine aborted it
    CAPACITY = "capacity"  # can never fit in the KV cache (or past max_model_len at admission)
    ERROR = "error"  # the device step that computed it failed; the engine kept serving the rest


class RequestStatus(enum.IntEnum):
    """Life cycle of a request. Every status past ``SWAPPED`` is final."""

    WAITING = 0  # never scheduled yet
    RUNNING = 1  # in the running batch, holds device blocks
    PREEMPTED = 2  # preempted by recompute: blocks freed, back in the waiting queue
    SWAPPED = 3  # preempted by swap: its KV lives in host blocks until swapped back in
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6
    FINISHED_CAPACITY = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def for_finish_reason(reason: FinishReason) -> RequestStatus:
        return _STATUS_OF_REASON[reason]

    @property
    def finish_reason(self) -> FinishReason | None:
        return _REASON_OF_STATUS.get(self)


_STATUS_OF_REASON = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH_CAPPED,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.CAPACITY: RequestStatus.FINISHED_CAPACITY,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}
_REASON_OF_STATUS = {v: k for k, v in _STATUS_OF_REASON.items()}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    """What the engine must honour when sampling one sequence.

    Validated on construction: every error is a ``ValueError`` naming the field, its allowed
    range and the value received, so API front ends can pass the message straight to the
    client. ``temperature == 0`` means greedy; for greedy requests ``top_p``, ``top_k`` and
    ``min_p`` are reset to their neutral values so the sampler can batch them with others.
    ``top_k`` of 0 or -1 disables top-k (normalised to 0). Checking ``logprobs`` against the
    engine's ``max_logprobs`` is the engine's job, since only it knows the configuration.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    # Logprobs of every prompt token after the first (the actual token's and the top-k
    # alternatives'; 0: the actual token's only). Such a request skips the prefix cache:
    # a cached position's logits are never computed.
    prompt_logprobs: int | None = None
    cache_salt: str | None = None
    priority: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> value added to its logit before penalties and temperature (OpenAI's
    # logit_bias: -100 bans a token in practice, +100 all but forces it).
    logit_bias: dict[int, float] | None = None
    # Output constrained to a JSON schema, regex, choice or grammar (a dict of the same
    # fields is accepted and converted).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(
                self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams or a dict, "
                             f"got {type(self.structured_outputs).__name__}")
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}")
        if not self.logit_bias:
            self.logit_bias = None
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature == 0.0:
            # Greedy: the filters cannot change the argmax, so neutralise them.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def _verify(self) -> None:
        for name in ("n", "max_tokens", "min_tokens", "top_k", "priority", "logprobs",
                     "prompt_logprobs"):
            v = getattr(self, name)
            if _is_int(v) and not -_INT32 <= v < _INT32:  # they land in int32 device buffers
                raise ValueError(f"{name} must be in [-2**31, 2**31), got {v!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), "
                f"got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or an integer >= 1, got {self.top_k!r}"
            )
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not _is_number(self.repetition_penalty) or not lo <= self.repetition_penalty <= hi:
            raise ValueError(
                f"repetition_penalty must be a number in [{lo:g}, {hi:g}] (1 = off), "
                f"got {self.repetition_penalty!r}"
            )
        lo, hi = _PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not lo <= value <= hi:
                raise ValueError(f"{name} must be in [{lo}, {hi}], got {value!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**63), got {self.seed!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(
                    f"stop_token_ids must be integers >= 0, got {self.stop_token_ids!r}"
                )
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be None or an integer >= 0, got {self.prompt_logprobs!r}")
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt
        ):
            raise ValueError(
                f"cache_salt must be None or a non-empty string, got {self.cache_salt!r}"
            )
        if not _is_int(self.priority):
            raise ValueError(f"priority must be an integer, got {self.priority!r}")
        if self.logit_bias is not None:
            self._verify_logit_bias()
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _verify_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        lo, hi = LOGIT_BIAS_RANGE
        for k, v in self.logit_bias.items():
            if not _is_int(k) or k < 0:
                raise ValueError(f"logit_bias: keys must be token ids (integers >= 0), got {k!r}")
            if not _is_number(v) or not lo <= v <= hi:
                raise ValueError(f"logit_bias[{k}] must be in [{lo:g}, {hi:g}], got {v!r}")

    @property
    def uses_penalties(self) -> bool:
        """Needs the sampler's full variant (penalties and the logit bias run there)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or self.logit_bias is not None)


class Request:
    """One sequence being served: its tokens, progress and status.

    ``num_computed_tokens`` is the single progress counter: the scheduler schedules the span
    ``[num_computed_tokens, num_tokens)`` (or a chunk of it), which covers prefill, chunked
    prefill, prefix-cache continuations and decode alike. ``block_hashes`` holds the chained
    hashes of the request's full blocks; it is extended incrementally by the KV cache manager
    so each block is hashed once.

    A plain class with ``__slots__`` rather than a dataclass: the scheduler touches these
    fields hundreds of times per step, and the engine should not compare or copy requests.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "eos_token_id",
        "arrival_time",
        "priority",
        "all_token_ids",
        "output_token_ids",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "status",
        "finish_reason",
        "stop_reason",
        "block_hashes",
        "grammar",
        "lora_id",
        "num_lora_passes",
        "mm_keys",
        "multimodal",
        "_stop_ids",
        "__weakref__",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int | None = None,
        grammar: GrammarHandle | None = None,
        lora_id: int = 0,
        multimodal: Any = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: prompt_token_ids must not be empty")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.eos_token_id = eos_token_id
        self.arrival_time = float(arrival_time)
        self.priority = self.sampling_params.priority if priority is None else int(priority)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Prefix-cache hit tokens of the first scheduling; -1 until it is scheduled.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        # The stop token id that ended the request (None for EOS), or a stop string set by
        # the engine through Scheduler.finish_requests.
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []
        # The compiled grammar of a structured-output request (None: unconstrained); the
        # scheduler holds the request back until it is ready.
        self.grammar = grammar
        # The LoRA adapter the request runs under (a load id, never reused; 0: the base model).
        self.lora_id = int(lora_id)
        self.num_lora_passes = 0  # steps it was passed over for want of an adapter slot
        # A prompt with images (`jaxserve.multimodal.prompt.MultimodalPrompt`, opaque here): the
        # runner reads it; the scheduler hashes each image's (offset, num_tokens, hash) into the
        # prefix-cache blocks it covers.
        self.multimodal = multimodal
        self.mm_keys: tuple[tuple[int, int, str], ...] = tuple(multimodal.keys) if multimodal is not None else ()
        self._stop_ids = frozenset(self.sampling_params.stop_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def cache_salt(self) -> str | None:
        return self.sampling_params.cache_salt

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> FinishReason | None:
        """Why the request must stop after its newest output token, or None.

        EOS and stop token ids are ignored before ``min_tokens`` outputs; the length limits
        always apply. ``num_tokens >= max_model_len`` stops because the next token's position
        would be past the model's context.
        """
        sp = self.sampling_params
        num_out = len(self.output_token_ids)
        if num_out >= sp.min_tokens:
            last = self.output_token_ids[-1]
            if last == self.eos_token_id and not sp.ignore_eos:
                self.stop_reason = None
                return FinishReason.STOP
            if last in self._stop_ids:
                self.stop_reason = last
                return FinishReason.STOP
        if num_out >= sp.max_tokens or len(self.all_token_ids) >= max_model_len:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
