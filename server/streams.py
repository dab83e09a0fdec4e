"""Per-request output buffers between the engine thread and one streaming RPC.

The engine thread produces one `RequestOutput` delta per step; a client reads at its own pace.
A `StreamBuffer` merges every delta that arrives while the handler is still writing the
previous response into one pending delta per sequence, so an unread stream holds at most its
unread tokens and text once (never a queue of per-step copies), and the handler always sends
everything that is pending in one response. Terminal events (an abort, an engine failure)
replace nothing: they are delivered after the pending delta.

`push` and `take` run on the event loop's thread (the engine thread hands items over with
`loop.call_soon_threadsafe`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from jaxserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob


class Aborted:
    """Stream item: the request was aborted by the server (Abort RPC, drain timeout)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


class EngineFailed(Exception):
    """Stream item: the request cannot go on. `fatal`: the engine thread stopped (the server
    is going down, UNAVAILABLE); otherwise a step failed (INTERNAL). `error_id` is what the
    client sees; the log holds the exception under the same id."""

    def __init__(self, error_id: str, *, fatal: bool = False):
        super().__init__(error_id)
        self.error_id = error_id
        self.fatal = fatal

    @property
    def client_message(self) -> str:
        if self.fatal:
            return f"the engine stopped (error id {self.error_id}); the request was not completed, retry it"
        return f"engine failure (error id {self.error_id}); the request was not completed"


Terminal = Aborted | EngineFailed


@dataclasses.dataclass
class _SeqDelta:
    text: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class StreamBuffer:
    """One request's pending output: merged deltas plus at most one terminal event."""

    def __init__(self, on_engine_done: Callable[[], None] | None = None):
        self._seqs: dict[int, _SeqDelta] = {}
        self._latest: RequestOutput | None = None  # usage, finished, error, prompt of the merged deltas
        self._prompt_token_ids: list[int] | None = None
        self._prompt_logprobs: list | None = None  # the first output's, until taken
        self._terminal: Terminal | None = None
        self._ready = asyncio.Event()
        self._on_engine_done = on_engine_done
        self.engine_done = False  # the engine holds nothing more for this request
        self.closed = False  # the handler has taken the last item

    @property
    def pending_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self._seqs.values())

    def push(self, item: RequestOutput | Terminal) -> None:
        """Adds an engine output or a terminal event; anything after the request's end (its
        finished output or a terminal event) is dropped."""
        if self.engine_done:  # also true once the handler has taken the last item
            return
        if isinstance(item, RequestOutput):
            self._merge(item)
            if item.finished:
                self._done()
        else:
            self._terminal = item
            self._done()
        self._ready.set()

    def _merge(self, out: RequestOutput) -> None:
        if self._prompt_token_ids is None and out.prompt_token_ids:
            self._prompt_token_ids = list(out.prompt_token_ids)
        if out.prompt_logprobs is not None:
            self._prompt_logprobs = out.prompt_logprobs
        for c in out.outputs:
            s = self._seqs.get(c.index)
            if s is None:
                s = self._seqs[c.index] = _SeqDelta(logprobs=[] if c.delta_logprobs is not None else None)
            if c.delta_text:
                s.text.append(c.delta_text)
            s.token_ids.extend(c.delta_token_ids)
            if c.delta_logprobs and s.logprobs is not None:
                s.logprobs.extend(c.delta_logprobs)
            if c.finish_reason is not None:
                s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason
        self._latest = out

    def _done(self) -> None:
        if not self.engine_done:
            self.engine_done = True
            if self._on_engine_done is not None:
                self._on_engine_done()

    async def take(self) -> tuple[RequestOutput | None, Terminal | None]:
        """Waits for something; returns (merged delta or None, terminal event or None). After
        a finished delta or a terminal event the buffer is closed."""
        await self._ready.wait()
        self._ready.clear()
        out = self._take_delta()
        term, self._terminal = self._terminal, None
        if term is not None or (out is not None and out.finished):
            self.closed = True
        return out, term

    def _take_delta(self) -> RequestOutput | None:
        latest = self._latest
        if latest is None:
            return None
        outputs = []
        for c in latest.outputs:
            s = self._seqs.get(c.index) or _SeqDelta()
            outputs.append(CompletionOutput(
                index=c.index, finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                delta_text="".join(s.text), delta_token_ids=s.token_ids, delta_logprobs=s.logprobs))
        merged = dataclasses.replace(latest, outputs=outputs, prompt_token_ids=self._prompt_token_ids or [],
                                     prompt_logprobs=self._prompt_logprobs)
        self._seqs.clear()
        self._latest = None
        self._prompt_token_ids = []
        self._prompt_logprobs = None
        return merged
