"""Drafts from a smaller model with the target's tokenizer, decoded greedily.

The draft model runs on its own `ModelRunner`: its own params, its own paged KV cache and
its own page pool (a `KVCacheManager` keyed by the target's sequence ids, as many pages as
the target's cache), and its own compiled shapes (the target's token and request buckets,
the greedy sampler only), warmed up with the target's so nothing compiles while serving.

Each engine step, for every decoding sequence: a catch-up span feeds the draft cache the
tokens it has not seen (the whole prompt the first time, then the tokens the target kept,
always the last one), chunked to the token budget, and samples the first draft; then k - 1
one-token steps sample the rest. The draft cache is valid up to the longest prefix the
target kept, so rejected drafts cost nothing but their rewrite. Greedy drafts are
deterministic, which the runner's acceptance rule needs to be exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxserve.compilation.warmup import WarmupReport, compile_ahead
from jaxserve.worker.compile_plan import CompilePlan, sampler_variant
from jaxserve.worker.runner import ModelRunner, StepConfig
from scheduler import (
    DraftCandidate,
    KVCacheManager,
    NewRequestData,
    Request,
    SamplingParams,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)


def check_same_tokenizer(target: Any, draft: Any, target_vocab: int, draft_vocab: int, path: str) -> None:
    """The draft's token ids must mean what the target's mean."""
    if target_vocab != draft_vocab:
        raise ValueError(f"speculative_config: the draft model {path!r} has a vocabulary of {draft_vocab} tokens, "
                         f"the target {target_vocab}: a draft model must share the target's tokenizer")
    if target is not None and draft is not None and target.get_vocab() != draft.get_vocab():
        raise ValueError(f"speculative_config: the draft model {path!r} has a different tokenizer from the "
                         "target's (same size, other tokens): a draft model must share the target's tokenizer")


@dataclasses.dataclass
class _DraftSeq:
    request: Request  # the draft pool's view: num_computed_tokens = valid draft K/V positions
    num_verified: int = 0  # history length at the last proposal (tokens that never change)
    fed_drafts: tuple[int, ...] = ()  # the drafts fed to the draft model after that history


class DraftModelProposer:
    def __init__(self, loaded: Any, k: int, *, num_pages: int, page_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, plan: CompilePlan, attention_backend: str = "auto",
                 kv_layout: str = "heads", seed: int = 0):
        self.k = k
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        greedy = sampler_variant(False, False, False, False, 0, False)
        self.plan = dataclasses.replace(plan, sampler_variants=(greedy,), swap_sizes=(), prompt_logprobs_top=None)
        self.kv = KVCacheManager(SchedulerConfig(
            block_size=page_size, num_blocks=num_pages, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
            kv_groups=loaded.config.kv_group_kinds))
        steps = StepConfig(token_buckets=self.plan.token_buckets, request_buckets=self.plan.request_buckets,
                           max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           max_model_len=max_model_len, max_logprobs=0, seed=seed)
        self.runner = ModelRunner(loaded, num_pages=num_pages, page_size=page_size, attention_backend=attention_backend,
                                  max_pages_per_seq=self.kv.config.table_width, steps=steps, kv_layout=kv_layout)
        self._seqs: dict[str, _DraftSeq] = {}
        self._new: list[NewRequestData] = []
        self._gone: list[str] = []

    def warmup(self, *, workers: int = 0, cache_enabled: bool = True) -> WarmupReport:
        """Compiles the draft model's shapes (named `draft ...` in the report)."""
        report = compile_ahead(self.runner, self.plan, max_reqs=self.max_num_seqs,
                               tensors_by_rows=self.runner.input_batch.tensors, workers=workers, progress=False,
                               cache_enabled=cache_enabled)
        return dataclasses.replace(report, records=tuple(dataclasses.replace(r, name=f"draft {r.name}")
                                                         for r in report.records))

    # ------------------------------------------------------------------ proposing
    def propose(self, candidates: Sequence[DraftCandidate]) -> dict[str, list[int]]:
        self._drop_others({c.request_id for c in candidates})
        active = [c for c in candidates if self._catch_up_start(c) is not None]
        drafts: dict[str, list[int]] = {c.request_id: [] for c in active}
        want = {c.request_id: min(self.k, c.max_drafts) for c in active}
        # Catch-up: every unseen token, in budget-sized steps; a finished span samples draft 1.
        pending = [(c.request_id, c.token_ids) for c in active]
        while pending:
            spans, pending = self._take_budget(pending)
            sampled, dropped = self._step(spans)
            for rid, tok in sampled.items():
                drafts[rid].append(tok)
            pending = [(rid, toks) for rid, toks in pending if rid not in dropped]
        # Then one token at a time, for the sequences that still want drafts.
        for _ in range(self.k - 1):
            spans = [(rid, [d[-1]]) for rid, d in drafts.items() if d and len(d) < want[rid]]
            if not spans:
                break
            for rid, tok in self._step([(rid, toks, True) for rid, toks in spans])[0].items():
                drafts[rid].append(tok)
        for c in active:
            st = self._seqs[c.request_id]
            st.num_verified, st.fed_drafts = len(c.token_ids), tuple(drafts[c.request_id][:-1])
        return {rid: d[: want[rid]] for rid, d in drafts.items() if d}

    def _catch_up_start(self, c: DraftCandidate) -> int | None:
        """Rolls the sequence's draft K/V back to the prefix its history still shares with
        what the draft saw; returns where its catch-up span starts (None: no room)."""
        st = self._seqs.get(c.request_id)
        if st is None:
            st = self._seqs[c.request_id] = _DraftSeq(Request(c.request_id, [0], _GREEDY))
            self._new.append(NewRequestData(c.request_id, [], _GREEDY, None))
        toks = c.token_ids
        # The history before the last proposal never changes; of the drafts fed after it,
        # those the target kept are still valid.
        n = min(st.request.num_computed_tokens, len(toks) - 1)
        same = min(st.num_verified, n)
        for d in st.fed_drafts:
            if same >= n or toks[same] != d:
                break
            same += 1
        st.request.num_computed_tokens = same
        if self.kv.num_blocks_for(len(toks) + self.k) > self.kv.width:
            return None
        return same

    def _take_budget(self, pending: list[tuple[str, Sequence[int]]]):
        """This step's catch-up spans (rid, tokens, samples) within the budget and rows; the
        rest of each long span waits for the next step."""
        spans, rest, budget = [], [], self.budget
        for rid, toks in pending:
            start = self._seqs[rid].request.num_computed_tokens
            n = len(toks) - start
            if budget <= 0 or len(spans) >= self.max_num_seqs:
                rest.append((rid, toks))
                continue
            take = min(n, budget)
            spans.append((rid, toks[start : start + take], take == n))
            budget -= take
            if take < n:
                rest.append((rid, toks))
        return spans, rest

    def _step(self, spans: list[tuple[str, list[int], bool]]) -> tuple[dict[str, int], set[str]]:
        """One draft-model step over the spans; returns the greedy token of those that sample,
        and the spans dropped because their pages could not be had (no drafts for them)."""
        scheduled, slots, dropped = [], [], set()
        for rid, toks, samples in spans:
            req = self._seqs[rid].request
            new_ids = self.kv.allocate_slots(req, len(toks))
            if new_ids is None:
                dropped.add(rid)
                continue
            scheduled.append(ScheduledRequest(rid, req.num_computed_tokens, len(toks), list(toks), new_ids,
                                              None, samples))  # type: ignore[arg-type]
            slots.append(self.kv.slot_of(rid))
        if not scheduled:
            return {}, dropped
        tables = self.kv.gather_block_tables(slots)
        for sr, row in zip(scheduled, tables):
            sr.block_table = row
        new, self._new = self._new, []
        gone, self._gone = self._gone, []
        so = SchedulerOutput(scheduled=scheduled, num_scheduled_tokens=sum(s.num_tokens for s in scheduled),
                             block_tables=tables, new_requests=new, finished_request_ids=gone)
        out = self.runner.execute(so)
        for sr in scheduled:
            self._seqs[sr.request_id].request.num_computed_tokens += sr.num_tokens
        return {rid: toks[0] for rid, toks in out.sampled_token_ids.items()}, dropped

    def _drop_others(self, keep: set[str]) -> None:
        """Frees the draft pages of sequences that are not decoding candidates any more."""
        for rid in [r for r in self._seqs if r not in keep]:
            st = self._seqs.pop(rid)
            self.kv.free(st.request)
            self._gone.append(rid)
            self._new = [nr for nr in self._new if nr.request_id != rid]

    @property
    def num_used_pages(self) -> int:
        return self.kv.usage().num_used

