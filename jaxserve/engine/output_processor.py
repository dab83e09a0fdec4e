"""From scheduler updates to `RequestOutput`s: detokenization, stop strings, n > 1 gathering.

The engine hands each step's `RequestUpdate`s (and the runner's logprobs) to `process`, which
returns one `RequestOutput` per request that changed, plus the sequences a stop string ended
(the engine finishes those in the scheduler). Semantics follow vLLM:

- stop strings are looked for only once more than `min_tokens` tokens are out;
- a stop token's text (EOS or a `stop_token_ids` id) is not in the text unless
  `include_stop_str_in_output`; its id stays in `token_ids`;
- a stop string completed by the last allowed token ends with `stop`, not `length`.

Returned outputs are snapshots: their lists are never shared with state a later step changes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence

from jaxserve.engine.detokenizer import IncrementalDetokenizer, Tokenizer, TokenText
from jaxserve.engine.outputs import (
    CompletionOutput,
    OutputKind,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
    Usage,
    position_logprobs,
)
from scheduler import FinishReason, RequestUpdate, SamplingParams


@dataclasses.dataclass
class _Parent:
    """One user request: its `n` completions, accumulated step by step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    completions: list[CompletionOutput]
    num_unfinished: int
    num_cached_tokens: int = 0
    error: str | None = None
    error_param: str | None = None  # the request field that caused `error`, if any
    kind: OutputKind = OutputKind.CUMULATIVE
    num_completion_tokens: int = 0
    prompt_sent: bool = False  # DELTA: the prompt's ids went out with the first output
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # params.prompt_logprobs: filled as prefill runs


@dataclasses.dataclass
class _Child:
    parent: _Parent
    index: int
    detok: IncrementalDetokenizer | None


@dataclasses.dataclass(frozen=True)
class ProcessedOutputs:
    outputs: list[RequestOutput]
    # (sequence id, stop string) of sequences a stop string ended; the scheduler still runs them.
    stopped_by_string: list[tuple[str, str]]


def child_ids(request_id: str, n: int) -> list[str]:
    """Scheduler ids of a request's sequences: the id itself when n == 1."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._token_text = TokenText(tokenizer) if tokenizer is not None else None  # logprobs' decoded_token
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def __len__(self) -> int:
        return len(self._parents)

    def request_ids(self) -> list[str]:
        return list(self._parents)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float,
                    kind: OutputKind = OutputKind.CUMULATIVE) -> list[str]:
        """Registers a request; returns its sequences' scheduler ids."""
        with_lp = params.logprobs is not None
        parent = _Parent(request_id, prompt, list(prompt_token_ids), params, RequestMetrics(arrival_time),
                         [CompletionOutput(index=i, logprobs=[] if with_lp else None) for i in range(params.n)],
                         params.n, kind=kind)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None] * len(prompt_token_ids)
        self._parents[request_id] = parent
        ids = child_ids(request_id, params.n)
        for i, cid in enumerate(ids):
            self._children[cid] = _Child(parent, i, self._detokenizer(prompt_token_ids, params))
        return ids

    def _detokenizer(self, prompt_token_ids: list[int], p: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(
            self.tokenizer, prompt_token_ids, skip_special_tokens=p.skip_special_tokens, stop=p.stop,
            include_stop_str_in_output=p.include_stop_str_in_output, min_tokens=p.min_tokens)

    def abort(self, request_id: str) -> list[str] | None:
        """Forgets a request; returns its sequences' ids (None if unknown)."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return None
        ids = child_ids(request_id, parent.params.n)
        for cid in ids:
            self._children.pop(cid, None)
        return ids

    def record_scheduled(self, sequence_ids: Iterable[str], now: float) -> None:
        for cid in sequence_ids:
            child = self._children.get(cid)
            if child is not None and child.parent.metrics.first_scheduled_time is None:
                child.parent.metrics.first_scheduled_time = now

    # ------------------------------------------------------------------ one step
    def process(self, updates: Sequence[RequestUpdate], logprobs: dict[str, list[TokenLogprob]],
                prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] | None = None) -> ProcessedOutputs:
        """`logprobs`: one entry per new token id, for the sequences that asked;
        `prompt_logprobs`: entries from this step's prefill chunks (first index, entries)."""
        now = time.monotonic()
        for seq_id, (first, entries) in (prompt_logprobs or {}).items():
            child = self._children.get(seq_id)
            if child is not None and child.parent.prompt_logprobs is not None:
                child.parent.prompt_logprobs[first : first + len(entries)] = [
                    position_logprobs(e, self._token_text) for e in entries]
        touched: dict[str, _Parent] = {}
        stopped: list[tuple[str, str]] = []
        for up in updates:
            child = self._children.get(up.request_id)
            if child is None:
                continue
            _touch(child.parent, touched)
            lps = logprobs.get(up.request_id)
            if lps is not None:
                lps = [position_logprobs(lp, self._token_text) for lp in lps]
            if len(up.new_token_ids) > 1 and child.parent.params.stop and child.detok is not None:
                stop_str = self._apply_each(child, up, lps, now)
            else:
                stop_str = self._apply(child, up, lps, now)
            if stop_str is not None and not up.finished:
                stopped.append((up.request_id, stop_str))
        outputs = [self._snapshot(p, now) for p in touched.values()
                   if p.kind is not OutputKind.FINAL_ONLY or p.num_unfinished == 0]
        return ProcessedOutputs(outputs, stopped)

    def _apply_each(self, child: _Child, up: RequestUpdate, lps: list[PositionLogprobs] | None, now: float) -> str | None:
        """Several new tokens (verified speculative drafts) under stop strings: one at a
        time, so the output ends at the token that completed a stop string, as it would
        have token by token; the tokens after it are dropped."""
        last = len(up.new_token_ids) - 1
        for i, tok in enumerate(up.new_token_ids):
            one = (dataclasses.replace(up, new_token_ids=[tok]) if i == last else
                   dataclasses.replace(up, new_token_ids=[tok], finished=False, finish_reason=None, stop_reason=None))
            stop_str = self._apply(child, one, lps[i : i + 1] if lps is not None else None, now)
            if stop_str is not None:
                return stop_str
        return None

    def _apply(self, child: _Child, up: RequestUpdate, lps: list[PositionLogprobs] | None, now: float) -> str | None:
        """Adds one sequence's update to its completion; returns a stop string it matched."""
        parent = child.parent
        comp = parent.completions[child.index]
        if up.new_token_ids and parent.metrics.first_token_time is None:
            parent.metrics.first_token_time = now
        parent.num_cached_tokens = max(parent.num_cached_tokens, up.num_cached_tokens)
        cumulative = parent.kind is not OutputKind.DELTA
        parent.num_completion_tokens += len(up.new_token_ids)
        if cumulative:
            comp.token_ids.extend(up.new_token_ids)
        comp.delta_token_ids.extend(up.new_token_ids)
        if lps and comp.logprobs is not None:
            if cumulative:
                comp.logprobs.extend(lps)
            comp.delta_logprobs.extend(lps)
        finish_reason, stop_reason = up.finish_reason, up.stop_reason
        stop_str = None
        if child.detok is not None:
            text, stop_str = self._detokenize(child.detok, up, parent.params)
            if cumulative:
                comp.text += text
            comp.delta_text += text
            if stop_str is not None:
                finish_reason, stop_reason = FinishReason.STOP, stop_str
        if finish_reason is not None or stop_str is not None:
            comp.finish_reason = str(finish_reason)
            comp.stop_reason = stop_reason
            parent.num_unfinished -= 1
            self._children.pop(up.request_id, None)
        return stop_str

    @staticmethod
    def _detokenize(detok: IncrementalDetokenizer, up: RequestUpdate, p: SamplingParams) -> tuple[str, str | None]:
        ids = up.new_token_ids
        ended_by_token = up.finish_reason == FinishReason.STOP and not isinstance(up.stop_reason, str)
        if ended_by_token and ids and not p.include_stop_str_in_output:
            ids = ids[:-1]  # the stop token's own text is not output
        delta = detok.update(ids) if ids else None
        text = delta.text if delta is not None else ""
        if delta is not None and delta.stop_str is not None:
            return text, delta.stop_str
        if up.finished:
            flushed = detok.flush()
            return text + flushed.text, flushed.stop_str
        return text, None

    def fail(self, sequence_ids: Iterable[str], message: str, param: str | None = None) -> list[RequestOutput]:
        """Ends sequences whose step failed (finish reason `error`, `RequestOutput.error`);
        `param` names the request's field when the request's own input caused it."""
        now = time.monotonic()
        touched: dict[str, _Parent] = {}
        for cid in sequence_ids:
            child = self._children.pop(cid, None)
            if child is None:
                continue
            parent = child.parent
            _touch(parent, touched)
            comp = parent.completions[child.index]
            comp.finish_reason, comp.stop_reason = str(FinishReason.ERROR), None
            parent.num_unfinished -= 1
            parent.error = message
            parent.error_param = param
        return [self._snapshot(p, now) for p in touched.values()]

    def _snapshot(self, parent: _Parent, now: float) -> RequestOutput:
        finished = parent.num_unfinished == 0
        if finished:
            parent.metrics.finished_time = now
            self._parents.pop(parent.request_id, None)
        with_prompt = parent.kind is not OutputKind.DELTA or not parent.prompt_sent
        parent.prompt_sent = True
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt if with_prompt else None,
            prompt_token_ids=list(parent.prompt_token_ids) if with_prompt else [],
            outputs=[_copy_completion(c) for c in parent.completions],
            finished=finished,
            usage=Usage(len(parent.prompt_token_ids), parent.num_completion_tokens, parent.num_cached_tokens),
            metrics=dataclasses.replace(parent.metrics),
            error=parent.error,
            error_param=parent.error_param,
            prompt_logprobs=list(parent.prompt_logprobs) if with_prompt and parent.prompt_logprobs else None,
        )


def _touch(parent: _Parent, touched: dict[str, _Parent]) -> None:
    """First update of a request in this step: its deltas start empty."""
    if parent.request_id in touched:
        return
    touched[parent.request_id] = parent
    for c in parent.completions:
        c.delta_text, c.delta_token_ids = "", []
        c.delta_logprobs = [] if c.logprobs is not None else None


def _copy_completion(c: CompletionOutput) -> CompletionOutput:
    return dataclasses.replace(
        c,
        token_ids=list(c.token_ids),
        logprobs=None if c.logprobs is None else list(c.logprobs),
        delta_token_ids=list(c.delta_token_ids),
        delta_logprobs=None if c.delta_logprobs is None else list(c.delta_logprobs),
    )
