"""One admitted request's life on the server, shared by the gRPC and the HTTP front.

`Generation` is what a front holds between admission and the end of its stream: the
admission reservation, the `StreamBuffer` the engine thread fills and the ticket that lets the
front abort exactly its own request. Iterating it yields merged `RequestOutput` deltas; a
server abort (drain timeout, Abort RPC) ends the iteration with a final output whose
unfinished sequences have finish reason "abort"; an engine failure raises `ServeError`.
Leaving the `async with` block releases the reservation and, unless the engine is already
done with the request (it finished, or failed), aborts it: a client that disconnected,
cancelled or stopped reading frees its KV blocks by the next step.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from jaxserve.engine.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
    Usage,
    compact_logprobs,
)
from server.admission import Reservation
from server.engine_loop import new_error_id
from server.errors import ErrorKind, ServeError
from server.streams import Aborted, EngineFailed, StreamBuffer

logger = logging.getLogger("jaxserve.server")


class Generation:
    def __init__(self, key: str, n: int, buffer: StreamBuffer, reservation: Reservation,
                 on_close: Callable[[Generation], None], abort: Callable[[str, object], Any],
                 structured_param: str | None = None, num_logprobs: int = 0, num_prompt_logprobs: int = 0):
        self.key = key  # the engine's (tenant-scoped) id
        self.n = n
        self.num_logprobs, self.num_prompt_logprobs = num_logprobs, num_prompt_logprobs  # top-k asked for
        self.buffer = buffer
        self.reservation = reservation
        self.ticket = object()
        self.finished_indices: set[int] = set()
        self.last_usage = Usage(0, 0, 0)
        self.prompt_token_ids: list[int] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # when the request asked
        self._on_close = on_close
        self._abort = abort
        self._closed = False
        self.structured_param = structured_param  # the client's name for its grammar's field

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._on_close(self)
        if not self.buffer.engine_done:
            self._abort(self.key, self.ticket)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        while True:
            out, term = await self.buffer.take()
            if out is not None:
                if out.finished and out.error is not None:
                    if out.error_param is not None:  # the request's own input failed while it ran
                        raise self._bad_input(out.error, out.error_param)
                    raise self._failure(out.error)  # its device step failed
                out = self._compact(out)
                self._note(out)
                yield out
                if out.finished:
                    return
            if isinstance(term, Aborted):
                yield self._aborted_output()
                return
            if isinstance(term, EngineFailed):
                raise ServeError(ErrorKind.UNAVAILABLE if term.fatal else ErrorKind.INTERNAL, term.client_message,
                                 code="engine_stopped" if term.fatal else "engine_failure")

    def _compact(self, out: RequestOutput) -> RequestOutput:
        """The fronts render logprobs from the compact form (token, logprob, rank, top-k):
        the engine's vLLM-shaped dicts turned back, with the top-k the request asked for."""
        if out.prompt_logprobs is not None:
            out.prompt_logprobs = [None if e is None else compact_logprobs(t, e, self.num_prompt_logprobs)
                                   for t, e in zip(out.prompt_token_ids, out.prompt_logprobs)]
        for c in out.outputs:
            if c.delta_logprobs:
                c.delta_logprobs = [compact_logprobs(t, e, self.num_logprobs)
                                    for t, e in zip(c.delta_token_ids, c.delta_logprobs)]
        return out

    def _note(self, out: RequestOutput) -> None:
        self.last_usage = out.usage
        if out.prompt_token_ids and not self.prompt_token_ids:
            self.prompt_token_ids = list(out.prompt_token_ids)
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        for c in out.outputs:
            if c.finish_reason is not None:
                self.finished_indices.add(c.index)

    def _aborted_output(self) -> RequestOutput:
        outs = [CompletionOutput(index=i, finish_reason="abort") for i in range(self.n)
                if i not in self.finished_indices]
        self.finished_indices.update(range(self.n))
        return RequestOutput(self.key, None, [], outs, True, self.last_usage, RequestMetrics(0.0))

    def _bad_input(self, error: str, param: str) -> ServeError:
        if param == "structured_outputs" and self.structured_param is not None:
            param = self.structured_param
        logger.info("request %s ended by its input (%s): %s", self.key, param, error)
        return ServeError(ErrorKind.INVALID, f"{param}: {error}", param)

    def _failure(self, error: str) -> ServeError:
        error_id = new_error_id()
        logger.error("request %s failed [error id %s]: %s", self.key, error_id, error)
        return ServeError(ErrorKind.INTERNAL, f"engine failure (error id {error_id}); the request was not completed",
                          code="engine_failure")

