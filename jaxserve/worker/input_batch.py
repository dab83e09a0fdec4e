"""The runner's persistent per-request state and the sampling rows it fills each step.

The scheduler sends a request's parameters once (`SchedulerOutput.new_requests`, on its first
scheduling) and its end once (`finished_request_ids`); in between the runner keeps what the
sampler needs (seed, output count, penalty history, stop ids) here, keyed by request id, and
appends each token it samples. Nothing here reads a scheduler `Request`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxserve.structured import Matcher, StructuredOutputManager
from jaxserve.worker.compile_plan import sampler_variant
from jaxserve.worker.sampler import SAMPLING_EPS, SamplerFlags, SamplingTensors
from scheduler import NewRequestData, SamplingParams, ScheduledRequest
from scheduler.request import MAX_LOGIT_BIAS

MAX_STOP_TOKEN_IDS = 15  # per request, besides EOS: the sampler's stop-id table is [R, 16]
STOP_ID_WIDTH = MAX_STOP_TOKEN_IDS + 1


@dataclasses.dataclass
class CachedRequestState:
    """What the runner remembers of one sequence between steps."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the 64-bit seed as unsigned (two's complement of a negative one)
    stop_ids_row: np.ndarray  # [STOP_ID_WIDTH] int32, -1 padded: EOS (unless ignored) + stop ids
    output_token_ids: list[int] = dataclasses.field(default_factory=list)

    bias_ids_row: np.ndarray | None = None  # [MAX_LOGIT_BIAS] int32, -1 padded
    bias_values_row: np.ndarray | None = None  # [MAX_LOGIT_BIAS] f32
    matcher: Matcher | None = None  # structured output: the grammar state after the outputs
    num_prompt_logprobs: int = 0  # prompt positions scored so far (params.prompt_logprobs set)
    lora_id: int = 0  # the LoRA adapter's load id (0: the base model)
    multimodal: Any = None  # the prompt's images and 3-D positions (`multimodal.prompt.MultimodalPrompt`)

    @property
    def uses_penalties(self) -> bool:
        return self.params.uses_penalties


class InputBatch:
    """Per-request state plus one set of host sampling buffers per request bucket."""

    def __init__(self, request_buckets: Sequence[int], max_model_len: int, max_logprobs: int, seed: int,
                 vocab_size: int = 32, structured: StructuredOutputManager | None = None):
        """`vocab_size` sizes the token bitmasks; `structured` fills them (None: no request
        of this engine has a grammar)."""
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self.structured = structured
        self.requests: dict[str, CachedRequestState] = {}
        self.tensors = {r: SamplingTensors.neutral(r, STOP_ID_WIDTH, max_model_len, vocab_size=vocab_size)
                        for r in request_buckets}
        self._neutral = SamplingTensors.neutral(1, STOP_ID_WIDTH, max_model_len, vocab_size=vocab_size)
        self._rng = np.random.default_rng(seed)

    def update(self, finished_request_ids: Sequence[str], new_requests: Sequence[NewRequestData]) -> None:
        """Drop ended requests first: a finished id may come back as a new request."""
        for rid in finished_request_ids:
            self.requests.pop(rid, None)
        for nr in new_requests:
            self.requests[nr.request_id] = self._new_state(nr)

    def _new_state(self, nr: NewRequestData) -> CachedRequestState:
        p = nr.sampling_params
        seed = p.seed if p.seed is not None else int(self._rng.integers(0, 2**32))
        stops = [] if p.ignore_eos or nr.eos_token_id is None else [nr.eos_token_id]
        stops += list(p.stop_token_ids)
        row = np.full(STOP_ID_WIDTH, -1, np.int32)
        row[: len(stops)] = stops
        st = CachedRequestState(nr.request_id, nr.prompt_token_ids, p, seed & 0xFFFFFFFFFFFFFFFF, row,
                                lora_id=nr.lora_id, multimodal=nr.multimodal)
        if p.logit_bias:
            st.bias_ids_row = np.full(MAX_LOGIT_BIAS, -1, np.int32)
            st.bias_values_row = np.zeros(MAX_LOGIT_BIAS, np.float32)
            st.bias_ids_row[: len(p.logit_bias)] = list(p.logit_bias)
            st.bias_values_row[: len(p.logit_bias)] = list(p.logit_bias.values())
        if nr.grammar is not None:
            st.matcher = nr.grammar.new_matcher()
        return st

    def append_output(self, request_id: str, token_id: int) -> None:
        self.requests[request_id].output_token_ids.append(token_id)

    def sampling_rows(self, scheduled: Sequence[ScheduledRequest], num_rows: int) -> tuple[SamplingTensors, SamplerFlags]:
        """Fills the buffers of bucket `num_rows` in batch order, one row per logits row
        (`row_spans`); rows that do not sample (non-final prefill chunks) and padding rows
        are neutral. A draft position's row is the sequence's row as it will be if the drafts
        before it are kept: its output position (the seed's counter), min_tokens and penalty
        history count them."""
        t = self.tensors[num_rows]
        any_logprobs = any_penalties = any_sampling = any_top = any_mask = False
        i = -1
        for i, sr, j in row_spans(scheduled):
            st = self.requests.get(sr.request_id) if sr.samples else None
            if st is None:
                self._set_neutral_row(t, i)
                continue
            p = st.params
            t.temperature[i] = p.temperature
            t.top_k[i] = p.top_k
            t.top_p[i] = p.top_p
            t.min_p[i] = p.min_p
            t.repetition_penalty[i] = p.repetition_penalty
            t.presence_penalty[i] = p.presence_penalty
            t.frequency_penalty[i] = p.frequency_penalty
            t.seeds[i] = st.seed & 0xFFFFFFFF
            t.seeds_hi[i] = st.seed >> 32
            num_out = len(st.output_token_ids) + j
            t.output_pos[i] = num_out
            t.min_tokens_mask[i] = num_out < p.min_tokens
            t.stop_token_ids[i] = st.stop_ids_row
            if st.uses_penalties:
                self._fill_penalty_row(t, i, st, sr.draft_token_ids[:j])
                any_penalties = True
            elif t.bias_token_ids[i, 0] >= 0:  # a previous request's bias (biases fill from 0)
                t.bias_token_ids[i] = -1
                t.bias_values[i] = 0.0
            any_sampling |= p.temperature >= SAMPLING_EPS
            any_top |= p.top_k > 0 or p.top_p < 1.0
            any_logprobs |= p.logprobs is not None
            any_mask |= st.matcher is not None
        for pad in range(i + 1, num_rows):
            self._set_neutral_row(t, pad)
        return t, sampler_variant(any_sampling, any_top, any_penalties, any_logprobs, self.max_logprobs, any_mask)

    def fill_bitmask(self, scheduled: Sequence[ScheduledRequest], t: SamplingTensors) -> None:
        """The grammar's allowed next tokens into `t.token_bitmask` for each sampling row with
        a matcher; every other row allows all (the host work that overlaps the device step).
        A draft position's row is the grammar's state after the drafts before it: the
        matchers walk the drafts one position at a time and are rolled back after."""
        t.token_bitmask.fill(-1)
        layers: list[list[tuple[Matcher, int, int | None]]] = []  # by position: (matcher, row, draft before it)
        for i, sr, j in row_spans(scheduled):
            st = self.requests.get(sr.request_id) if sr.samples else None
            if st is None or st.matcher is None:
                continue
            while len(layers) <= j:
                layers.append([])
            layers[j].append((st.matcher, i, sr.draft_token_ids[j - 1] if j else None))
        walked: dict[int, tuple[Matcher, int]] = {}  # id -> (matcher, drafts it consumed)
        try:
            for j, layer in enumerate(layers):
                for matcher, _, draft in layer:
                    if draft is not None:
                        matcher.accept_token(draft)  # checked by valid_drafts before scheduling
                        walked[id(matcher)] = (matcher, j)
                self.structured.fill_bitmask([(m, row) for m, row, _ in layer], t.token_bitmask)
        finally:
            for matcher, n in walked.values():
                matcher.rollback(n)

    def valid_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the request's grammar would reject (all of them for
        a request without a grammar)."""
        st = self.requests.get(request_id)
        if st is None or st.matcher is None or not drafts:
            return drafts
        return drafts[: st.matcher.count_valid(drafts)]

    def _fill_penalty_row(self, t: SamplingTensors, i: int, st: CachedRequestState,
                          drafts: Sequence[int] = ()) -> None:
        """Prompt then output ids (then the drafts before this row's position), the most
        recent `max_model_len` of them."""
        width = self.max_model_len
        out = (st.output_token_ids + list(drafts) if drafts else st.output_token_ids)[-width:]
        room = width - len(out)
        prompt = st.prompt_token_ids[-room:] if room > 0 else []
        n = len(prompt) + len(out)
        t.penalty_token_ids[i, : len(prompt)] = prompt
        t.penalty_token_ids[i, len(prompt) : n] = out
        t.penalty_token_ids[i, n:] = -1
        t.penalty_prompt_len[i] = len(prompt)
        if st.bias_ids_row is not None:
            t.bias_token_ids[i] = st.bias_ids_row
            t.bias_values[i] = st.bias_values_row
        else:
            t.bias_token_ids[i] = -1
            t.bias_values[i] = 0.0

    def _set_neutral_row(self, t: SamplingTensors, i: int) -> None:
        for name in _ROW_FIELDS:  # the bitmask is rewritten whole by fill_bitmask
            getattr(t, name)[i] = getattr(self._neutral, name)[0]


def row_spans(scheduled: Sequence[ScheduledRequest]):
    """(logits row, span, position within the span's sampled positions) in batch order: one
    row per span, plus one per speculative draft (rows of a span are consecutive)."""
    i = 0
    for sr in scheduled:
        for j in range(1 + sr.num_draft_tokens):
            yield i, sr, j
            i += 1


_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingTensors) if f.name != "token_bitmask")
