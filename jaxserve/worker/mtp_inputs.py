"""The MTP passes' host inputs (`ModelRunner._run_mtp`; the method is described in
`jaxserve.spec_decode.mtp`): the first pass's shifted tokens and output rows, and whether a
chained draft's position already has its page."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from scheduler import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class MTPSequence:
    """A sampling span's draft source after the first pass."""

    request_id: str
    row: int  # its output row of the pass (its index among the scheduled spans)
    next_position: int  # the position of the token just sampled (its history length - 1)
    block_table: np.ndarray  # [max_pages_per_seq] int32, the null page 0 past its allocation


@dataclasses.dataclass(frozen=True)
class MTPPass:
    """The first pass's host inputs: the token after each row's position, and the row each
    span's output leaves from (its last valid row)."""

    token_ids: np.ndarray  # [T] int32
    rows: np.ndarray  # [max_reqs] int32
    sequences: list[MTPSequence]


def first_pass(so: SchedulerOutput, num_tokens: int, max_reqs: int, sampled: dict[str, list[int]],
               token_at: Callable[[str, int], int | None]) -> MTPPass:
    """Shifts each span's tokens by one; `sampled` holds each sampling span's kept tokens (its
    accepted drafts, then the target's token after them), `token_at(request_id, position)` a
    request's known token (the prompt's next token after a prefill chunk; None: unknown)."""
    tokens = np.zeros(num_tokens, np.int32)
    rows = np.zeros(max_reqs, np.int32)
    seqs: list[MTPSequence] = []
    row = 0
    for i, sr in enumerate(so.scheduled):
        n = sr.num_tokens
        tokens[row : row + n - 1] = sr.token_ids[1:]
        if sr.samples:
            kept = sampled.get(sr.request_id)
            if kept:
                last = n - 1 - sr.num_draft_tokens + len(kept) - 1  # the span's last valid row
                tokens[row + last] = kept[-1]
                rows[i] = row + last
                seqs.append(MTPSequence(sr.request_id, i, sr.start + last + 1, sr.block_table))
        else:
            nxt = token_at(sr.request_id, sr.start + n)
            tokens[row + n - 1] = nxt if nxt is not None else 0
            rows[i] = row + n - 1
        row += n
    return MTPPass(tokens, rows, seqs)


def can_chain(seq: MTPSequence, position: int, page_size: int) -> bool:
    """Whether `position`'s page is already allocated to the sequence."""
    page = position // page_size
    return page < len(seq.block_table) and int(seq.block_table[page]) != 0
