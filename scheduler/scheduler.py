"""Continuous batching under one token budget.

Every request has ``num_computed_tokens`` catching up with ``num_tokens``; a step gives each
scheduled request a span of that gap. Prefill, chunked prefill, prefix-cache continuations,
recompute after preemption and decode are all the same rule, so there are no phases.

A step has three phases, in order: running requests (oldest first; under the priority
policy, most urgent first), then swapped-out requests coming back, then waiting ones. When a
running request cannot get blocks, the least urgent running request (the tail of the running
list) is preempted, by swapping its K/V to host blocks or by freeing them for recompute. A
step that preempted admits nobody new, so a request is never preempted and re-admitted within
the same step. A swapped-out request that cannot come back yet blocks new admissions (under
the priority policy: admissions less urgent than it), so a steady stream of small new
requests cannot starve it.

Siblings of an ``n > 1`` request share their prompt: all but the first wait, parked, until
the first has computed the prompt (its full blocks are then in the prefix cache), and are
admitted with those blocks as prefix-cache hits.

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

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from scheduler.config import SchedulerConfig
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.outputs import (
    DraftCandidate,
    NewRequestData,
    RequestUpdate,
    ScheduledRequest,
    SchedulerOutput,
)
from scheduler.queues import make_queue
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.stats import SchedulerStats

_RUNNING = RequestStatus.RUNNING


def _priority_key(r: Request) -> tuple[int, float]:
    return (r.priority, r.arrival_time)


@dataclass
class _StepPlan:
    """What one ``schedule()`` call has decided so far; the three phases fill it in turn."""

    budget: int
    encoder_budget: int = 0  # the step's bound on image tokens whose encoding starts (max_num_encoder_tokens)
    encoder_spent: int = 0  # image tokens whose encoding starts in the spans scheduled so far
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    state_restores: list[tuple[int, int]] = field(default_factory=list)


# Steps a waiting request may be passed over for want of a LoRA slot before the adapters that
# hold the slots stop admitting new requests (so one of them drains and frees its slot).
LORA_STARVATION_STEPS = 32


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        # The step limits in force: the configured ones, or less while the engine is still
        # compiling the larger step shapes (`limit_steps`).
        self.step_tokens = config.max_num_batched_tokens
        self.step_seqs = config.max_num_seqs
        self.kv = KVCacheManager(config)
        self.waiting = make_queue(config.policy)
        self.swapped = make_queue(config.policy)
        self.running: list[Request] = []
        # Unfinished requests only: a finished id can be used again at once.
        self._requests: dict[str, Request] = {}
        # n > 1 siblings waiting for their first sibling's prompt: leader id -> siblings.
        self._parked: dict[str, list[Request]] = {}
        self._parked_under: dict[str, str] = {}  # sibling id -> leader id
        # Structured-output requests whose grammar is still compiling, in arrival order:
        # id -> (request, the sibling it shares its prompt with).
        self._awaiting_grammar: dict[str, tuple[Request, str | None]] = {}
        self._grammar_errors: list[tuple[str, str]] = []  # (id, why) since the last take
        # Ended since the last schedule(): reported in the next SchedulerOutput.
        self._finished_ids: list[str] = []
        # Ended inside the scheduler (capacity): reported by the next update_from_output.
        self._pending_updates: list[RequestUpdate] = []
        self._preemptions = {"recompute": 0, "swap": 0}
        self._num_finished = {r.value: 0 for r in FinishReason}
        self._swap_enabled = config.preemption_mode == "swap" and config.num_host_blocks > 0
        # Hybrid models: state snapshots taken at the last step's block boundaries, copied
        # before the next step (`SchedulerOutput.state_saves`).
        self._state_saves: list[tuple[int, int]] = []
        self._snapshots = config.recurrent_state and config.enable_prefix_caching and config.num_state_snapshots > 0

    # ------------------------------------------------------------------ requests in / out
    def add_request(self, request: Request, share_prompt_with: str | None = None) -> None:
        """Queue a new request (``n == 1``; the engine fans out ``n > 1``).

        ``share_prompt_with`` names an unfinished sibling with the same prompt: this request
        waits until that one has computed the prompt, then reuses its blocks through the
        prefix cache (no effect without prefix caching or for a prompt under one block).
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
            self._end_capacity(request)
            return
        if request.grammar is not None:
            # Even a grammar already compiled goes through the grammar queue: one that already
            # failed must end there with its error, never reach the runner.
            self._awaiting_grammar[rid] = (request, share_prompt_with)
            return
        self._enqueue(request, share_prompt_with)

    def _enqueue(self, request: Request, share_prompt_with: str | None) -> None:
        rid, n = request.request_id, request.num_prompt_tokens
        leader = self._requests.get(share_prompt_with) if share_prompt_with else None
        if (leader is not None and leader.num_output_tokens == 0 and self.kv.enable_caching
                and n > self.config.block_size):
            self._parked.setdefault(leader.request_id, []).append(request)
            self._parked_under[rid] = leader.request_id
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
        """End requests from outside (a stop string matched, an abort, a failed step) and
        free them."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            req = self._requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._dequeue(req)
            if stop_reason is not None:
                req.stop_reason = stop_reason
            self._finish(req, reason)

    def _dequeue(self, req: Request) -> None:
        """Take an unfinished request out of whichever queue holds it."""
        if req.status == _RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
        elif req.request_id in self._awaiting_grammar:
            del self._awaiting_grammar[req.request_id]
        elif req.request_id in self._parked_under:
            leader = self._parked_under.pop(req.request_id)
            self._parked[leader].remove(req)
        else:
            self.waiting.remove(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Mark finished and free its blocks. The caller removes it from its queue."""
        req.status = RequestStatus.for_finish_reason(reason)
        req.finish_reason = reason
        self.kv.free(req)
        self._requests.pop(req.request_id, None)
        self._finished_ids.append(req.request_id)
        self._num_finished[reason.value] += 1
        self._release_parked(req.request_id)

    def _end_capacity(self, req: Request) -> None:
        """End a request that can never fit (it is already out of its queue)."""
        self._finish(req, FinishReason.CAPACITY)
        self._pending_updates.append(self._update_for(req, []))

    def _release_parked(self, leader_id: str) -> None:
        """The leader's prompt is computed (or it left the device): its siblings go to the
        front of the waiting queue, in order."""
        siblings = self._parked.pop(leader_id, None)
        if not siblings:
            return
        for req in reversed(siblings):
            del self._parked_under[req.request_id]
            self.waiting.push_front(req)

    def _admit_compiled_grammars(self) -> None:
        """Requests whose grammar is ready join the waiting queue in arrival order; those
        whose grammar failed to compile end with ERROR (see `take_grammar_errors`)."""
        for rid, (req, share_with) in list(self._awaiting_grammar.items()):
            if not req.grammar.ready():
                continue
            del self._awaiting_grammar[rid]
            if req.grammar.error is not None:
                self._grammar_errors.append((rid, req.grammar.error))
                self._finish(req, FinishReason.ERROR)
            else:
                self._enqueue(req, share_with)

    def take_grammar_errors(self) -> list[tuple[str, str]]:
        """(request id, why) of the requests ended because their grammar did not compile."""
        out, self._grammar_errors = self._grammar_errors, []
        return out

    @property
    def num_awaiting_grammar(self) -> int:
        return len(self._awaiting_grammar)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    def num_requests_with_lora(self, lora_id: int) -> int:
        """Unfinished sequences that run under the LoRA adapter `lora_id`."""
        return sum(1 for r in self._requests.values() if r.lora_id == lora_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._pending_updates)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ scheduling
    def draft_candidates(self, max_drafts: int) -> list[DraftCandidate]:
        """The running sequences that decode next step and could use speculative drafts, and
        as many drafts as max_tokens and max_model_len leave room for."""
        out = []
        max_len = self.config.max_model_len
        for req in self.running:
            if req.num_tokens - req.num_computed_tokens != 1:
                continue
            room = min(max_drafts, req.sampling_params.max_tokens - req.num_output_tokens - 1,
                       max_len - req.num_tokens)
            if room > 0:
                out.append(DraftCandidate(req.request_id, req.all_token_ids, room))
        return out

    def limit_steps(self, max_tokens: int, max_seqs: int) -> None:
        """Steps of at most `max_tokens` tokens and `max_seqs` sequences from now on (capped
        by the configuration). The engine sets them low before it serves, while only its
        smaller step shapes are compiled, and only raises them as the rest become ready (a
        lower limit would not evict sequences already running)."""
        if max_tokens < 1 or max_seqs < 1:
            raise ValueError(f"step limits must be >= 1, got {max_tokens} tokens, {max_seqs} sequences")
        self.step_tokens = min(max_tokens, self.config.max_num_batched_tokens)
        self.step_seqs = min(max_seqs, self.config.max_num_seqs)

    def schedule(self, drafts: dict[str, list[int]] | None = None) -> SchedulerOutput:
        """Plan one step within ``max_num_batched_tokens`` and ``max_num_seqs``.

        ``drafts`` maps a decoding sequence to speculative tokens to verify this step. They
        only take what the step leaves over: token budget, sampled rows (at most
        ``max_num_seqs`` per step, drafts included) and free blocks; a draft never preempts
        or holds back anyone."""
        if self._awaiting_grammar:
            self._admit_compiled_grammars()
        finished_ids, self._finished_ids = self._finished_ids, []
        plan = _StepPlan(budget=self.step_tokens, encoder_budget=self.config.max_num_encoder_tokens or sys.maxsize)
        if self.config.policy == "priority":
            self.running.sort(key=_priority_key)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_swapped(plan)
            self._schedule_waiting(plan)
        if drafts:
            self._schedule_drafts(plan, drafts)
        tables = self.kv.gather_block_tables(plan.slots)
        for k, sr in enumerate(plan.scheduled):
            sr.block_table = tables[k]
        saves, self._state_saves = self._state_saves, []
        kv = self.kv
        swap_out, kv.state_swap_out = kv.state_swap_out, []
        swap_in, kv.state_swap_in = kv.state_swap_in, []
        return SchedulerOutput(
            scheduled=plan.scheduled,
            num_scheduled_tokens=self.step_tokens - plan.budget,
            block_tables=tables,
            new_requests=plan.new_requests,
            swap_out=plan.swap_out,
            swap_in=plan.swap_in,
            finished_request_ids=finished_ids,
            preempted_request_ids=plan.preempted,
            state_saves=saves,
            state_swap_out=swap_out,
            state_swap_in=swap_in,
            state_restores=plan.state_restores,
        )

    def _span_len(self, req: Request, plan: _StepPlan) -> int:
        """Tokens the request may compute this step (see ``_clamp`` and ``_encoder_cut``)."""
        start = req.num_computed_tokens
        n = self._encoder_cut(req, start, self._clamp(req.num_tokens - start, plan.budget), plan)
        return self._snapshot_aligned(req, start, self._whole_image_cut(req, start, n))

    def _whole_image_cut(self, req: Request, start: int, n: int) -> int:
        """With `whole_images`, a span that would end inside an image ends before it instead;
        0 when the span starts in (or at) that image and the image's rest does not fit."""
        if not self.config.whole_images or not req.mm_keys:
            return n
        end = start + n
        for offset, length, _ in req.mm_keys:
            if offset < end < offset + length:
                return max(offset - start, 0)
        return n

    @staticmethod
    def _encoder_cut(req: Request, start: int, n: int, plan: _StepPlan) -> int:
        """A span of a prompt with images ends before the first image starting in it whose
        tokens exceed the step's encoder budget left (the step's first image always fits, so
        no image waits for ever); 0 when that image is the span's first token."""
        if not req.mm_keys:
            return n
        spent = plan.encoder_spent
        for offset, length, _ in req.mm_keys:
            if start <= offset < start + n:
                if spent and spent + length > plan.encoder_budget:
                    return offset - start
                spent += length
        return n

    @staticmethod
    def _encoder_cost(req: Request, start: int, n: int) -> int:
        """Image tokens whose first token lies in [start, start + n)."""
        return sum(length for offset, length, _ in req.mm_keys if start <= offset < start + n)

    def _snapshot_aligned(self, req: Request, start: int, n: int) -> int:
        """A hybrid model with state snapshots: a multi-token span that would end inside a
        block ends at the last block boundary it crosses instead, so its state there can be
        kept for prefix hits (a chunk cut by the budget, or a prompt's prefill before its last,
        partial block, which follows in the next step)."""
        if not self._snapshots or n <= 1:
            return n
        bs = self.config.block_size
        cut = (start + n) // bs * bs
        return cut - start if start < cut < start + n else n

    def _clamp(self, n: int, budget: int) -> int:
        """The one budget rule: ``n`` tokens to compute, capped by the long-prefill threshold
        and the budget left (which is > 0 whenever this is called)."""
        threshold = self.config.long_prefill_token_threshold
        if threshold and n > threshold:
            n = threshold
        return min(n, budget)

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Phase 1: decodes and unfinished prefill chunks, preempting from the tail when
        blocks run out."""
        kv = self.kv
        running = self.running
        i = 0
        while i < len(running) and plan.budget > 0:
            req = running[i]
            n = self._span_len(req, plan)
            if n <= 0:
                i += 1
                continue
            new_ids = kv.allocate_slots(req, n)
            while new_ids is None:
                if n > 1:  # shrink a prefill chunk to the room left before preempting anyone
                    fit = self._whole_image_cut(req, req.num_computed_tokens, kv.num_tokens_that_fit(req))
                    if 1 <= fit < n:
                        n = fit
                        new_ids = kv.allocate_slots(req, n)
                        continue
                victim = running.pop()
                if victim is req and i == 0:
                    self._end_capacity(req)  # alone on the device and still no room
                    break
                self._preempt(victim, plan)
                if victim is req:
                    break
                new_ids = kv.allocate_slots(req, n)
            if new_ids is None:
                break  # req left the running list, which now ends before it
            self._append_scheduled(plan, req, n, new_ids)
            i += 1

    def _schedule_swapped(self, plan: _StepPlan) -> None:
        """Phase 2: swapped-out requests come back (they already hold host blocks)."""
        swapped, running = self.swapped, self.running
        while swapped and plan.budget > 0 and len(running) < self.step_seqs:
            req = swapped.peek()
            if not self._lora_fits(req):
                return
            n = self._span_len(req, plan)
            if n <= 0:
                return
            res = self.kv.swap_in(req, n)
            if res is None and not running:
                n = self._whole_image_cut(req, req.num_computed_tokens, 1)
                res = self.kv.swap_in(req, n) if n else None
                if res is None:
                    swapped.pop()
                    self._end_capacity(req)
                    continue
            if res is None:
                return
            swapped.pop()
            mapping, new_ids = res
            plan.swap_in.extend(mapping)
            req.status = _RUNNING
            running.append(req)
            self._append_scheduled(plan, req, n, new_ids)

    def _admission_blocked_by_swapped(self, req: Request) -> bool:
        """A swapped-out request still waiting to come back goes first: FCFS admits nobody
        new before it, the priority policy only more urgent requests."""
        if not self.swapped:
            return False
        if self.config.policy != "priority":
            return True
        return _priority_key(req) >= _priority_key(self.swapped.peek())

    def _lora_fits(self, req: Request) -> bool:
        """Whether the request's LoRA adapter can run beside the running requests' adapters:
        it is the base model, one of theirs, or a slot is still free."""
        if not req.lora_id:
            return True
        active = {r.lora_id for r in self.running if r.lora_id}
        return req.lora_id in active or len(active) < self.config.max_loras

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Phase 3: new requests and those preempted by recompute, with prefix-cache hits.
        Requests whose LoRA adapter finds no free slot are passed over and keep their place."""
        passed: list[Request] = []
        try:
            self._admit_waiting(plan, passed)
        finally:
            for req in reversed(passed):
                self.waiting.push_front(req)

    def _admit_waiting(self, plan: _StepPlan, passed: list[Request]) -> None:
        kv, waiting, running = self.kv, self.waiting, self.running
        starving = False  # a request ahead has waited LORA_STARVATION_STEPS for an adapter slot
        while waiting and plan.budget > 0 and len(running) < self.step_seqs:
            req = waiting.peek()
            if self._admission_blocked_by_swapped(req):
                return
            if not self._lora_fits(req):
                req.num_lora_passes += 1
                starving = starving or req.num_lora_passes > LORA_STARVATION_STEPS
                passed.append(waiting.pop())
                continue
            if starving and req.lora_id:
                # Hold back the adapters already running: their requests drain, a slot frees
                # and the starving adapter gets it (base-model requests hold no slot).
                passed.append(waiting.pop())
                continue
            hits = kv.get_computed_blocks(req)
            num_hit = hits.num_tokens
            n = self._encoder_cut(req, num_hit, self._clamp(req.num_tokens - num_hit, plan.budget), plan)
            n = self._whole_image_cut(req, num_hit, n)
            if n <= 0:  # its image waits for the next step's budgets; nobody overtakes it
                return
            n = self._snapshot_aligned(req, num_hit, n)
            new_ids = kv.allocate_slots(req, n, hits)
            if new_ids is None and not running:
                # Nothing else holds device blocks: take what fits, or give up for good.
                fit = self._whole_image_cut(req, num_hit, kv.num_tokens_that_fit(req, hits))
                if 1 <= fit < n:
                    n = fit
                    new_ids = kv.allocate_slots(req, n, hits)
                if new_ids is None:
                    waiting.pop()
                    self._end_capacity(req)
                    continue
            if new_ids is None:
                return
            waiting.pop()
            first_admission = req.num_cached_tokens < 0
            if first_admission:
                # Counted once per request: a preempted request re-admitted on its own
                # blocks is not a prefix-cache hit.
                kv.record_prefix_query(req.num_tokens, num_hit)
                req.num_cached_tokens = num_hit
                plan.new_requests.append(NewRequestData(
                    req.request_id, list(req.prompt_token_ids), req.sampling_params, req.eos_token_id,
                    req.grammar, req.lora_id, req.multimodal))
            req.num_computed_tokens = num_hit
            req.status = _RUNNING
            running.append(req)
            self._append_scheduled(plan, req, n, new_ids)
            if hits.snapshot:  # the linear layers resume from the state at the hit's end
                plan.state_restores.append((hits.snapshot, plan.scheduled[-1].state_slot))

    def _schedule_drafts(self, plan: _StepPlan, drafts: dict[str, list[int]]) -> None:
        """Extends scheduled decodes with their drafts, in batch order, while budget, rows
        and free blocks last."""
        rows_left = self.step_seqs - len(plan.scheduled)
        for sr in plan.scheduled:
            if rows_left <= 0 or plan.budget <= 0:
                return
            tokens = drafts.get(sr.request_id)
            if not tokens or not sr.samples or sr.num_tokens != 1:
                continue
            req = self._requests[sr.request_id]
            k = min(len(tokens), plan.budget, rows_left, self.config.max_model_len - req.num_tokens)
            new_ids = self.kv.allocate_slots(req, 1 + k) if k > 0 else None
            if new_ids is None:
                continue
            sr.token_ids = sr.token_ids + list(tokens[:k])
            sr.num_tokens += k
            sr.num_draft_tokens = k
            sr.new_block_ids = sr.new_block_ids + new_ids
            plan.budget -= k
            rows_left -= k

    def _append_scheduled(self, plan: _StepPlan, req: Request, n: int, new_ids: list[int]) -> None:
        start = req.num_computed_tokens
        end = start + n
        plan.scheduled.append(ScheduledRequest(
            req.request_id, start, n, req.all_token_ids[start:end], new_ids,
            None,  # type: ignore[arg-type]  # the block-table row, filled by schedule()
            end == req.num_tokens, state_slot=self.kv.state_slot_of(req.request_id),
        ))
        plan.slots.append(self.kv.slot_of(req.request_id))
        plan.budget -= n
        if req.mm_keys:
            plan.encoder_spent += self._encoder_cost(req, start, n)

    def _preempt(self, req: Request, plan: _StepPlan) -> None:
        """Take a running request off the device (it is already out of ``self.running``)."""
        req.num_preemptions += 1
        plan.preempted.append(req.request_id)
        self._release_parked(req.request_id)
        if self._swap_enabled and req.num_computed_tokens > 0:
            mapping = self.kv.swap_out(req)
            if mapping is not None:
                plan.swap_out.extend(mapping)
                req.status = RequestStatus.SWAPPED
                self.swapped.push_front(req)
                self._preemptions["swap"] += 1
                return
        self._requeue_for_recompute(req)
        self._preemptions["recompute"] += 1

    def _requeue_for_recompute(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.push_front(req)

    def fail_step(self, scheduler_output: SchedulerOutput) -> list[str]:
        """The runner failed to execute ``scheduler_output``: end (ERROR) every request it
        computed for, and those it was swapping out (their host copies may be partial).
        Returns their ids; requests preempted by recompute lose nothing and stay queued."""
        ids = [sr.request_id for sr in scheduler_output.scheduled]
        if scheduler_output.swap_out:
            ids += [rid for rid in scheduler_output.preempted_request_ids
                    if (r := self._requests.get(rid)) is not None and r.status == RequestStatus.SWAPPED]
        self.finish_requests(ids, FinishReason.ERROR)
        return ids

    def drop_device_kv(self) -> list[str]:
        """The device KV cache was lost (a failed step that had donated it): every running
        request goes back to the front of the waiting queue to recompute, and no block hash
        survives. Swapped-out requests keep their host copies. Returns the requeued ids."""
        lost = list(self.running)
        self.running = []
        self._state_saves = []
        for req in reversed(lost):
            self._requeue_for_recompute(req)
        self.kv.reset_prefix_cache()
        return [r.request_id for r in lost]

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
            if sr.num_draft_tokens:
                update = self._update_verified(req, sr, sampled.get(rid))
                any_finished |= update.finished
                updates.append(update)
                continue
            start = sr.start
            end = req.num_computed_tokens = start + sr.num_tokens
            if caching and end // bs > start // bs:
                kv.cache_computed_blocks(req)  # only when a block was completed
                if self._snapshots and sr.num_tokens > 1 and end % bs == 0:
                    save = kv.snapshot_state(req, end)
                    if save is not None:
                        self._state_saves.append(save)
            if not sr.samples:
                continue
            if self._parked:
                self._release_parked(rid)  # its prompt blocks are in the prefix cache now
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

    def _update_verified(self, req: Request, sr: ScheduledRequest, tokens: list[int] | None) -> RequestUpdate:
        """A decode that carried drafts: ``tokens`` are the drafts the target kept, then the
        token it sampled after them. Only the positions of kept tokens hold valid K/V: the
        computed count stops there, blocks past it are freed, and block hashes (computed
        positions only) never cover a rejected draft."""
        if not tokens or len(tokens) > 1 + sr.num_draft_tokens:
            raise ValueError(f"request {req.request_id!r}: {len(tokens or ())} verified tokens for "
                             f"{sr.num_draft_tokens} drafts")
        reason = None
        kept: list[int] = []
        for t in tokens:
            req.append_output_token(t)
            kept.append(t)
            reason = req.check_stop(self.config.max_model_len)
            if reason is not None:
                break
        start = sr.start
        end = req.num_computed_tokens = start + len(kept)
        if reason is not None:
            self._finish(req, reason)
        else:
            if self.kv.enable_caching and end // self.config.block_size > start // self.config.block_size:
                self.kv.cache_computed_blocks(req)
            self.kv.trim(req, end)
        if self._parked:
            self._release_parked(req.request_id)
        return RequestUpdate(req.request_id, kept, reason is not None, reason, req.stop_reason,
                             len(req.prompt_token_ids), len(req.output_token_ids),
                             req.num_cached_tokens if req.num_cached_tokens > 0 else 0)

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
        u = self.kv.usage()
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self._parked_under) + len(self._awaiting_grammar),
            num_swapped=len(self.swapped),
            num_used_blocks=u.num_used,
            num_cached_free_blocks=u.num_cached_free,
            num_free_blocks=u.num_free,
            num_total_blocks=u.num_total,
            num_host_blocks_used=u.num_host_used,
            num_host_blocks_total=u.num_host_total,
            preemptions=dict(self._preemptions),
            prefix_cache_queries=u.prefix_cache_queries,
            prefix_cache_hits=u.prefix_cache_hits,
            num_finished=dict(self._num_finished),
        )

    def reset_prefix_cache(self) -> int:
        """Forget every block hash (e.g. after a weight reload), those of blocks that running
        requests hold included: nothing computed before the reset is shared after it.
        Returns how many blocks lost their hash."""
        return self.kv.reset_prefix_cache()
