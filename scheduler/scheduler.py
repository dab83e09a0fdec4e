"""Continuous batching under one token budget.

Every request has ``num_computed_tokens`` catching up with ``num_tokens``; a step gives each
scheduled request a span of that gap. Prefill, chunked prefill, prefix-cache continuations,
recompute after preemption and decode are all the same rule, so there are no phases.

Order within a step: running requests first (oldest first; under the priority policy, most
urgent first), then swapped-out requests coming back, then waiting ones. When a running
request cannot get blocks, the least urgent running request (the tail of the running list)
is preempted, by swapping its K/V to host blocks or by freeing them for recompute. A step
that preempted admits nobody new, so a request is never preempted and re-admitted within the
same step.

Requests that can never fit end with ``FinishReason.CAPACITY`` instead of hanging:
  * at ``add_request``, when the prompt is longer than ``max_model_len`` or needs more blocks
    than the whole device pool has (the check is on the prompt only, not prompt+max_tokens,
    so short-prompt requests with a generous max_tokens are still served);
  * during a step, when a request that is alone on the device (no other request holds
    blocks) cannot get even one more token's block.
The engine learns of these through the next ``update_from_output`` (``has_unfinished_requests``
stays True until they are reported).
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.config import SchedulerConfig
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.outputs import RequestUpdate, ScheduledRequest, SchedulerOutput
from scheduler.queues import make_queue
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.stats import SchedulerStats

_RUNNING = RequestStatus.RUNNING


def _priority_key(r: Request) -> tuple[int, float]:
    return (r.priority, r.arrival_time)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config)
        self.waiting = make_queue(config.policy)
        self.swapped = make_queue(config.policy)
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        # Ended since the last schedule(): reported in the next SchedulerOutput.
        self._finished_ids: list[str] = []
        # Ended inside the scheduler (capacity): reported by the next update_from_output.
        self._pending_updates: list[RequestUpdate] = []
        self._preemptions = {"recompute": 0, "swap": 0}
        self._num_finished = {r.value: 0 for r in FinishReason}
        self._swap_enabled = config.preemption_mode == "swap" and config.num_host_blocks > 0

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, request: Request) -> None:
        """Queue a new request (``n == 1``; the engine fans out ``n > 1``).

        Raises ValueError for a duplicate id or a request that is not fresh. A prompt that
        can never fit ends at once with CAPACITY (reported by the next update_from_output).
        """
        rid = request.request_id
        if rid in self._requests:
            raise ValueError(f"duplicate request id {rid!r}")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} is not a fresh WAITING request")
        self._requests[rid] = request
        n = request.num_prompt_tokens
        if n > self.config.max_model_len or not self.kv.can_ever_fit(n):
            self._finish(request, FinishReason.CAPACITY)
            self._pending_updates.append(self._update_for(request, []))
            return
        self.waiting.push(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End requests the client gave up on; unknown or already finished ids are ignored."""
        self.finish_requests(request_ids, FinishReason.ABORT)

    def finish_requests(
        self,
        request_ids: Iterable[str] | str,
        reason: FinishReason = FinishReason.STOP,
        stop_reason: int | str | None = None,
    ) -> None:
        """End requests from outside (a stop string matched, or an abort) and free them."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            req = self._requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == _RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.SWAPPED:
                self.swapped.remove(req)
            else:
                self.waiting.remove(req)
            if stop_reason is not None:
                req.stop_reason = stop_reason
            self._finish(req, reason)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Mark finished and free its blocks. The caller removes it from its queue."""
        req.status = RequestStatus.for_finish_reason(reason)
        req.finish_reason = reason
        self.kv.free(req)
        self._finished_ids.append(req.request_id)
        self._num_finished[reason.value] += 1

    def get_request(self, request_id: str) -> Request | None:
        """The live request, or a finished one until the step after it was reported."""
        return self._requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.swapped or self._pending_updates)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.swapped)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        """Plan one step within ``max_num_batched_tokens`` and ``max_num_seqs``."""
        cfg = self.config
        kv = self.kv
        budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold
        max_seqs = cfg.max_num_seqs
        scheduled: list[ScheduledRequest] = []
        slots: list[int] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        preempted: list[str] = []

        for rid in self._finished_ids:
            self._requests.pop(rid, None)
        finished_ids, self._finished_ids = self._finished_ids, []

        running = self.running
        if cfg.policy == "priority":
            running.sort(key=_priority_key)

        # 1. Running requests: decodes and unfinished prefill chunks.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            all_ids = req.all_token_ids
            n = len(all_ids) - req.num_computed_tokens
            if n <= 0:
                i += 1
                continue
            if n > 1:
                if threshold and n > threshold:
                    n = threshold
                if n > budget:
                    n = budget
            new_ids = kv.allocate_slots(req, n)
            while new_ids is None:
                if n > 1:  # shrink a prefill chunk to the room left before preempting anyone
                    fit = kv.num_tokens_that_fit(req)
                    if 1 <= fit < n:
                        n = fit
                        new_ids = kv.allocate_slots(req, n)
                        continue
                victim = running.pop()
                if victim is req and i == 0:
                    # Alone on the device and still no room: it can never fit.
                    self._finish(req, FinishReason.CAPACITY)
                    self._pending_updates.append(self._update_for(req, []))
                    break
                self._preempt(victim, swap_out)
                preempted.append(victim.request_id)
                if victim is req:
                    break
                new_ids = kv.allocate_slots(req, n)
            if new_ids is None:
                break  # req left the running list, which now ends before it
            start = req.num_computed_tokens
            scheduled.append(
                ScheduledRequest(
                    req.request_id,
                    start,
                    n,
                    all_ids[start : start + n],
                    new_ids,
                    None,  # type: ignore[arg-type]  # filled below
                    start + n == len(all_ids),
                )
            )
            slots.append(kv.slot_of(req.request_id))
            budget -= n
            i += 1

        # 2. Swapped-out requests come back before new ones (they already hold host blocks).
        swapped = self.swapped
        while swapped and budget > 0 and len(running) < max_seqs and not preempted:
            req = swapped.peek()
            n = self._span_len(req, budget, threshold)
            res = kv.swap_in(req, n)
            if res is None and not running:
                res = kv.swap_in(req, 1)
                if res is None:
                    swapped.pop()
                    self._finish(req, FinishReason.CAPACITY)
                    self._pending_updates.append(self._update_for(req, []))
                    continue
                n = 1
            if res is None:
                break
            swapped.pop()
            mapping, new_ids = res
            swap_in.extend(mapping)
            req.status = _RUNNING
            running.append(req)
            self._append_scheduled(scheduled, slots, req, n, new_ids)
            budget -= n

        # 3. Waiting requests (new, or preempted by recompute), with prefix-cache hits.
        waiting = self.waiting
        while waiting and budget > 0 and len(running) < max_seqs and not preempted:
            req = waiting.peek()
            hits, num_hit = kv.get_computed_blocks(req)
            n = req.num_tokens - num_hit
            if threshold and n > threshold:
                n = threshold
            if n > budget:
                n = budget
            new_ids = kv.allocate_slots(req, n, hits, num_hit)
            if new_ids is None and not running:
                # Nothing else holds device blocks: take what fits, or give up for good.
                fit = kv.num_tokens_that_fit(req, hits)
                if 1 <= fit < n:
                    n = fit
                    new_ids = kv.allocate_slots(req, n, hits, num_hit)
                if new_ids is None:
                    waiting.pop()
                    self._finish(req, FinishReason.CAPACITY)
                    self._pending_updates.append(self._update_for(req, []))
                    continue
            if new_ids is None:
                break
            waiting.pop()
            req.num_computed_tokens = num_hit
            kv.record_prefix_query(req.num_tokens, num_hit)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.status = _RUNNING
            running.append(req)
            self._append_scheduled(scheduled, slots, req, n, new_ids)
            budget -= n

        tables = kv.gather_block_tables(slots)
        for k, sr in enumerate(scheduled):
            sr.block_table = tables[k]
        return SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            block_tables=tables,
            swap_out=swap_out,
            swap_in=swap_in,
            finished_request_ids=finished_ids,
            preempted_request_ids=preempted,
        )

    @staticmethod
    def _span_len(req: Request, budget: int, threshold: int) -> int:
        n = req.num_tokens - req.num_computed_tokens
        if threshold and n > threshold:
            n = threshold
        return min(n, budget)

    def _append_scheduled(
        self,
        scheduled: list[ScheduledRequest],
        slots: list[int],
        req: Request,
        n: int,
        new_ids: list[int],
    ) -> None:
        start = req.num_computed_tokens
        scheduled.append(
            ScheduledRequest(
                req.request_id,
                start,
                n,
                req.all_token_ids[start : start + n],
                new_ids,
                None,  # type: ignore[arg-type]
                start + n == req.num_tokens,
            )
        )
        slots.append(self.kv.slot_of(req.request_id))

    def _preempt(self, req: Request, swap_out: list[tuple[int, int]]) -> None:
        """Take a running request off the device (it is already out of ``self.running``)."""
        req.num_preemptions += 1
        if self._swap_enabled and req.num_computed_tokens > 0:
            mapping = self.kv.swap_out(req)
            if mapping is not None:
                swap_out.extend(mapping)
                req.status = RequestStatus.SWAPPED
                self.swapped.push_front(req)
                self._preemptions["swap"] += 1
                return
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.push_front(req)
        self._preemptions["recompute"] += 1

    # ------------------------------------------------------------------ results
    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[RequestUpdate]:
        """Apply a finished step: advance counts, append sampled tokens, stop, free, cache.

        ``sampled`` maps request id -> the token ids sampled for it (one, normally) and must
        hold every scheduled request whose span ``samples``. Requests finished or aborted
        after ``schedule()`` are skipped. Returns an update for each request that got tokens
        or ended (including capacity ends decided since the previous call).
        """
        updates, self._pending_updates = self._pending_updates, []
        max_model_len = self.config.max_model_len
        bs = self.config.block_size
        requests = self._requests
        kv = self.kv
        caching = kv.enable_caching
        any_finished = False
        for sr in scheduler_output.scheduled:
            rid = sr.request_id
            req = requests.get(rid)
            if req is None or req.status != _RUNNING:
                continue
            start = sr.start
            end = req.num_computed_tokens = start + sr.num_tokens
            if caching and end // bs > start // bs:
                kv.cache_computed_blocks(req)  # only when a block was completed
            if not sr.samples:
                continue
            tokens = sampled.get(rid)
            if not tokens:
                raise ValueError(f"no sampled token for request {rid!r}")
            reason = None
            if len(tokens) == 1:
                req.append_output_token(tokens[0])
                reason = req.check_stop(max_model_len)
            else:
                new_tokens: list[int] = []
                for t in tokens:
                    req.append_output_token(t)
                    new_tokens.append(t)
                    reason = req.check_stop(max_model_len)
                    if reason is not None:
                        break
                tokens = new_tokens
            if reason is not None:
                self._finish(req, reason)
                any_finished = True
            updates.append(
                RequestUpdate(
                    rid,
                    list(tokens),
                    reason is not None,
                    reason,
                    req.stop_reason,
                    len(req.prompt_token_ids),
                    len(req.output_token_ids),
                    req.num_cached_tokens if req.num_cached_tokens > 0 else 0,
                )
            )
        if any_finished:
            self.running = [r for r in self.running if r.status == _RUNNING]
        return updates

    @staticmethod
    def _update_for(req: Request, new_tokens: list[int]) -> RequestUpdate:
        return RequestUpdate(
            req.request_id,
            new_tokens,
            req.is_finished,
            req.finish_reason,
            req.stop_reason,
            req.num_prompt_tokens,
            req.num_output_tokens,
            max(req.num_cached_tokens, 0),
        )

    # ------------------------------------------------------------------ stats
    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        host = self.kv.host_pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            num_used_blocks=pool.num_used_blocks,
            num_cached_free_blocks=pool.num_cached_free,
            num_free_blocks=pool.num_free_blocks,
            num_total_blocks=pool.num_usable_blocks,
            num_host_blocks_used=host.num_blocks - host.num_free_blocks,
            num_host_blocks_total=host.num_blocks,
            preemptions=dict(self._preemptions),
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_finished=dict(self._num_finished),
        )

    def reset_prefix_cache(self) -> int:
        """Drop all cached free blocks (e.g. after a weight reload)."""
        return self.kv.reset_prefix_cache()
