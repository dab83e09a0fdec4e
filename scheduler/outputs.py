"""What crosses the scheduler boundary: the step plan for the runner, and per-request updates.

Everything here is plain data. The runner gets copies (block tables are gathered into a
fresh array each step), never the scheduler's own objects, so nothing it does can corrupt
the scheduler's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduler.request import FinishReason, SamplingParams
from scheduler.structured_params import GrammarHandle


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """What the runner keeps for a request, sent once: on its first scheduling.

    ``sampling_params`` is the sequence's own (for an ``n > 1`` child, its seed already
    offset); the runner must not mutate it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    grammar: GrammarHandle | None = None  # compiled (the scheduler waited for it) or None
    lora_id: int = 0  # the LoRA adapter's load id (0: the base model)
    multimodal: Any = None  # the prompt's images (`Request.multimodal`), None for a text prompt


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute K/V for tokens ``[start, start + num_tokens)``.

    ``samples`` is True when the span reaches the end of the request's known tokens, so the
    runner must sample the next token from the span's last position; it is False for a
    non-final prefill chunk. ``block_table`` is a row of ``SchedulerOutput.block_tables``
    (width ``max_blocks_per_seq``, padded with the null block 0); ``new_block_ids`` are the
    blocks allocated for this request in this step (fresh blocks and swap-in targets).

    A decode with speculative drafts carries its last token and then ``num_draft_tokens``
    proposed tokens: the runner samples at each of those ``1 + num_draft_tokens`` positions
    and keeps the drafts the target agrees with (see ``Scheduler.update_from_output``).
    """

    request_id: str
    start: int
    num_tokens: int
    token_ids: list[int]
    new_block_ids: list[int]
    block_table: np.ndarray
    samples: bool
    num_draft_tokens: int = 0
    state_slot: int = 0  # hybrid models: the request's state slot (0 otherwise)

    @property
    def kv_len_after(self) -> int:
        return self.start + self.num_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens - self.num_draft_tokens > 1 or not self.samples

    @property
    def draft_token_ids(self) -> list[int]:
        """The span's speculative drafts: its last `num_draft_tokens` token ids."""
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:] if self.num_draft_tokens else []

    @property
    def num_sampled(self) -> int:
        """Positions the runner samples at: 1 + drafts, or 0 for a non-final prefill chunk."""
        return 1 + self.num_draft_tokens if self.samples else 0


@dataclass(frozen=True, slots=True)
class DraftCandidate:
    """A decoding sequence that may get speculative drafts this step: its whole token
    history (prompt and output, read-only) and how many drafts it can use (max_tokens and
    max_model_len leave room for them and the token sampled after them)."""

    request_id: str
    token_ids: list[int]
    max_drafts: int


@dataclass
class SchedulerOutput:
    """The plan of one engine step.

    The runner must first do every ``swap_out`` copy (device block -> host block), then every
    ``swap_in`` copy (host block -> device block), then run the step: device blocks freed by a
    swap-out may be reused for new K/V or as swap-in targets within the same step.
    """

    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    block_tables: np.ndarray  # [len(scheduled), max_blocks_per_seq] int32, batch order
    # Requests scheduled for the first time in this step (also in ``scheduled``).
    new_requests: list[NewRequestData] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Requests that ended (finished, aborted, capacity, error) since the previous step; the
    # runner drops any per-request state it keeps for them, before it reads ``new_requests``
    # (a finished id may come back at once as a new request).
    finished_request_ids: list[str] = field(default_factory=list)
    # Requests preempted in this step (recompute or swap); they are not in ``scheduled``.
    preempted_request_ids: list[str] = field(default_factory=list)
    # Hybrid models' state slots, copied in this order before the step's compute: snapshots
    # taken (state slot -> snapshot slot), swap-outs (state slot -> host state slot), swap-ins
    # (host state slot -> state slot), prefix hits restored (snapshot slot -> state slot).
    state_saves: list[tuple[int, int]] = field(default_factory=list)
    state_swap_out: list[tuple[int, int]] = field(default_factory=list)
    state_swap_in: list[tuple[int, int]] = field(default_factory=list)
    state_restores: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_requests(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return (not self.scheduled and not self.swap_out and not self.swap_in and not self.state_saves
                and not self.state_swap_out)


@dataclass(slots=True)
class RequestUpdate:
    """What changed for one request in ``update_from_output`` (or when it was ended)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    # Token id that triggered STOP (None for EOS), or the stop string given to finish_requests.
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
