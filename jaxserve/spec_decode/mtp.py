"""Drafts from a checkpoint's multi-token-prediction (MTP) layer (DeepSeek-V3 / V2, GLM-4.5),
the speculative method "mtp".

The MTP layer is one more decoder layer that predicts the token after next: at position t it
takes the target's hidden state h_t (which predicted token t+1) and the embedding of token t+1,
and predicts token t+2. It runs inside the target's runner, right after each step is sampled
(`ModelRunner._run_mtp`, its inputs in `worker/mtp_inputs.py`), and its cache rows are one
more layer of the target's cache, on the same pages and block tables. So prefix caching, chunked prefill, swap and recompute carry its
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

from collections.abc import Sequence
from typing import TYPE_CHECKING

from scheduler import DraftCandidate

if TYPE_CHECKING:
    from jaxserve.worker.runner import ModelRunner


class MTPProposer:
    """The engine's proposer for method "mtp": the drafts the runner's MTP passes left, for
    candidates whose history has the length they were drafted at (a sequence that was cut by
    a stop string, preempted or not scheduled last step gets none this step)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def propose(self, candidates: Sequence[DraftCandidate]) -> dict[str, list[int]]:
        stash = self.runner.mtp_drafts
        out = {}
        for c in candidates:
            entry = stash.get(c.request_id)
            if entry is not None and entry[0] == len(c.token_ids) and c.max_drafts > 0:
                out[c.request_id] = entry[1][: c.max_drafts]
        return out
