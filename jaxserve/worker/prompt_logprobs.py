"""Prompt logprobs: which positions of a step score which prompt tokens, and their results.

Entry `i` of a request's prompt logprobs (i >= 1; entry 0 is None, as in vLLM) is the
logprob of prompt token `i` given the tokens before it, read from the hidden state at
position `i - 1`. A prefill chunk over positions [start, start + n) therefore fills entries
start + 1 .. start + n (capped at the prompt's end). The positions of every asking request
in a step are gathered into one list and scored in fixed slices of `prompt_logprob_rows(T)`
rows (one compiled program per token bucket).

Each request's state remembers how many entries it has, so a prefill recomputed after a
preemption is not scored twice. Requests that do not ask add nothing to a step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from jaxserve.worker.runner_output import TokenLogprob
from scheduler import ScheduledRequest


@dataclasses.dataclass(frozen=True)
class PromptLogprobRows:
    """One step's scoring work: flat step rows, the prompt token each one scores, and per
    request (id, first entry index, number of entries), in row order."""

    rows: np.ndarray  # [N] int32: token index within the step
    targets: np.ndarray  # [N] int32: the prompt token that follows that position
    owners: list[tuple[str, int, int]]


def plan_rows(scheduled: Sequence[ScheduledRequest], states: Mapping[str, object]) -> PromptLogprobRows | None:
    """The positions of this step whose prompt logprobs are still owed (None: none).
    `states`: the runner's `CachedRequestState`s (prompt ids, params, entries so far)."""
    rows: list[np.ndarray] = []
    targets: list[list[int]] = []
    owners: list[tuple[str, int, int]] = []
    offset = 0
    for sr in scheduled:
        st = states.get(sr.request_id)
        if st is not None and st.params.prompt_logprobs is not None:
            prompt = st.prompt_token_ids
            first = max(sr.start, st.num_prompt_logprobs)  # positions already scored are skipped
            end = min(sr.start + sr.num_tokens, len(prompt) - 1)  # the last prompt token scores nothing
            if end > first:
                rows.append(np.arange(offset + first - sr.start, offset + end - sr.start, dtype=np.int32))
                targets.append(prompt[first + 1 : end + 1])
                owners.append((sr.request_id, first + 1, end - first))
                st.num_prompt_logprobs = end
        offset += sr.num_tokens
    if not owners:
        return None
    return PromptLogprobRows(np.concatenate(rows), np.asarray(sum(targets, []), np.int32), owners)


def score(plan: PromptLogprobRows, slice_rows: int, run_slice: Callable, top_n: Mapping[str, int]
          ) -> dict[str, tuple[int, list[TokenLogprob]]]:
    """Runs `run_slice(rows [P], targets [P]) -> (logprob [P], rank [P], top logprobs [P, K],
    top ids [P, K])` over the plan in slices of `slice_rows` (the last one padded with row 0)
    and returns per request (first entry index, entries), each with its top `top_n[id]`."""
    n = len(plan.rows)
    parts = []
    for i in range(0, n, slice_rows):
        rows = np.zeros(slice_rows, np.int32)
        tgts = np.zeros(slice_rows, np.int32)
        m = min(slice_rows, n - i)
        rows[:m], tgts[:m] = plan.rows[i : i + m], plan.targets[i : i + m]
        parts.append(run_slice(rows, tgts))  # dispatched; fetched below, all at once
    chosen, rank, top_lp, top_ids = (np.concatenate(x)[:n] for x in zip(*jax.device_get(parts)))
    out: dict[str, tuple[int, list[TokenLogprob]]] = {}
    i = 0
    for rid, first_entry, count in plan.owners:
        k = top_n[rid]
        out[rid] = (first_entry, [
            TokenLogprob(int(t), float(chosen[j]), int(rank[j]),
                         tuple(zip(top_ids[j, :k].tolist(), top_lp[j, :k].tolist())))
            for j, t in zip(range(i, i + count), plan.targets[i : i + count])])
        i += count
    return out
