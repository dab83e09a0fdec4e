"""Drafts from DeepSeek's multi-token-prediction (MTP) layer, the speculative method "mtp".

The MTP layer is one more decoder layer that predicts the token after next: at position t it
takes the target's hidden state h_t (which predicted token t+1) and the embedding of token t+1,
and predicts token t+2. It runs inside the target's runner, right after each step is sampled
(`ModelRunner._run_mtp`), and its latent rows are one more layer of the target's cache, on the
same pages and block tables. So prefix caching, chunked prefill, swap and recompute carry its
cache as they carry the model's, and the planner counts it as one layer more.

Each step, for every scheduled span (vLLM's MTP/EAGLE scheme):

- **the pass** over the step's T tokens: row t pairs the target's h_t with token t+1, which is
  the span's next token, or, on the span's last valid row, the token sampled there (or the next
  prompt token for a prefill chunk that does not sample). Rows after a rejected draft write
  rows that a later step rewrites. The last valid row of a sampling span gives draft 1.
- **chained passes** for drafts 2..k: one token per sequence at the next position, pairing the
  MTP layer's own output with the draft before. A chained row needs its position's page to
  be allocated already (the scheduler allocated the verified span); a sequence whose next
  page is not stops chaining there, with fewer drafts.

Drafts are greedy (argmax of the MTP head), so the runner's acceptance rule stays exact:
outputs are the target's alone, whatever the drafts are. `MTPProposer` hands the drafts to
the scheduler for the sequences whose history is still the one they were drafted for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from scheduler import DraftCandidate, SchedulerOutput


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


class MTPProposer:
    """The engine's proposer for method "mtp": the drafts the runner's MTP passes left, for
    candidates whose history has the length they were drafted at (a sequence that was cut by
    a stop string, preempted or not scheduled last step gets none this step)."""

    def __init__(self, runner) -> None:
        self.runner = runner

    def propose(self, candidates: Sequence[DraftCandidate]) -> dict[str, list[int]]:
        stash = self.runner.mtp_drafts
        out = {}
        for c in candidates:
            entry = stash.get(c.request_id)
            if entry is not None and entry[0] == len(c.token_ids) and c.max_drafts > 0:
                out[c.request_id] = entry[1][: c.max_drafts]
        return out
