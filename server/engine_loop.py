"""The bridge between the asyncio gRPC front and the single-threaded engine.

One dedicated thread owns the `Engine`: it is the only caller of `add_request`, `abort` and
`step`. The asyncio side hands it commands through a thread-safe queue and gets results back
through futures (one-shot calls such as `add_request`) and per-request `StreamBuffer`s
(streamed outputs), always via `loop.call_soon_threadsafe`. When no request is unfinished the
thread blocks on the command queue; it never spins. Tokenization and chat templates happen
before a command is sent (`server/frontend.py`), never on this thread.

Commands are drained before every step, so an abort (client cancel, disconnect, deadline)
takes effect before the next step is scheduled: its KV blocks are free within one step.

Failure policy. A step that raises fails the requests in flight (each stream gets an
`EngineFailed` with an error id; the log has the exception under that id) and the loop goes
on; `MAX_CONSECUTIVE_STEP_FAILURES` in a row, or an exception anywhere else in the loop
(output handling, a snapshot, an abort), stop the thread: `fatal` is set, every stream and
every queued or later command fails at once, and the server turns NOT_SERVING and exits
non-zero so that a supervisor restarts it. The thread never dies without saying so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from jaxserve.engine.input_processor import EngineRequest
from jaxserve.engine.interface import ServingEngine
from jaxserve.engine.outputs import OutputKind, RequestOutput
from jaxserve.worker.runner_output import SpecDecodeCounts
from scheduler.stats import SchedulerStats
from server.streams import Aborted, EngineFailed, StreamBuffer

logger = logging.getLogger(__name__)

_STOP = object()
MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDead(RuntimeError):
    """The engine thread has stopped; nothing more can run on it."""


def new_error_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclasses.dataclass(frozen=True)
class EngineSnapshot:
    """What the engine looked like after its latest step; published atomically for readers
    on other threads (metrics scrape, GetServerInfo, the once-a-second log)."""

    time: float
    stats: SchedulerStats
    num_streams: int
    num_steps: int
    batched_tokens: int  # cumulative tokens computed (prompt + decode)
    generation_tokens: int  # cumulative output tokens
    prompt_tokens: int  # cumulative prompt tokens of finished requests
    num_finished: int
    step_host_s: float
    step_device_s: float
    spec_decode: SpecDecodeCounts | None = None  # cumulative; None: speculative decoding is off
    lora: dict[str, Any] | None = None  # `Engine.lora_activity()`; None: LoRA is off
    encoder: dict[str, int] | None = None  # `Engine.encoder_activity()`; None: a text model


@dataclasses.dataclass
class _Stream:
    buffer: StreamBuffer
    ticket: object = None  # identifies the RPC that owns the request id
    last_token_time: float | None = None


class EngineLoop:
    """Runs `engine` on its own thread; every public method is safe to call from any thread."""

    def __init__(self, engine: ServingEngine, loop: asyncio.AbstractEventLoop, metrics: Any | None = None,
                 on_fatal: Callable[[], None] | None = None):
        self.engine = engine
        self.loop = loop
        self.metrics = metrics
        self._on_fatal = on_fatal  # run on the event loop when the thread stops on an error
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders `fatal` against commands being queued
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self.thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._num_steps = 0
        self._batched_tokens = 0
        self._generation_tokens = 0
        self._prompt_tokens = 0
        self._num_finished = 0
        self._step_failures = 0  # in a row
        self.snapshot = self._make_snapshot()
        self.failed: BaseException | None = None  # the latest step failure
        self.fatal: BaseException | None = None  # set once the thread has stopped on an error
        self.fatal_error_id: str | None = None
        self._stopped = False  # the loop returned because it was asked to

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the thread after the commands already queued; unfinished requests stay put."""
        if self.thread.is_alive():
            self._cmds.put(_STOP)
            self.thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    @property
    def dead(self) -> bool:
        """The thread stopped on an error, or is gone without having been asked to stop."""
        return self.fatal is not None or (self.thread.ident is not None and not self.thread.is_alive()
                                           and not self._stopped)

    # ------------------------------------------------------------------ API (any thread)
    def _put(self, cmd: tuple, fut: concurrent.futures.Future) -> concurrent.futures.Future:
        with self._lock:
            if self.fatal is None:
                self._cmds.put(cmd)
                return fut
        fut.set_exception(EngineDead(f"the engine thread has stopped (error id {self.fatal_error_id})"))
        return fut

    def submit(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Runs `fn(engine)` on the engine thread; the future holds its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        return self._put(("call", fn, fut), fut)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        return await asyncio.wrap_future(self.submit(fn))

    async def update_weights(self, source: str) -> int:
        """New weights between two steps: the requests in flight end first, with finish
        reason "abort" on their streams (none finishes on a mix of weights); requests that
        arrive meanwhile wait for the engine thread and run on the new weights."""
        def run(engine) -> int:
            self._abort_all("the weights were updated")
            return engine.update_weights(source)

        return await self.call(run)

    async def add_request(
        self,
        request_id: str,
        request: EngineRequest,
        buffer: StreamBuffer,
        *,
        arrival_time: float | None = None,
        ticket: object = None,
        lora_name: str | None = None,
    ) -> None:
        """Queues a processed request (`EngineRequest`) whose outputs (deltas) go to `buffer`;
        `lora_name` is a loaded adapter's (ValueError when it is not, or no longer, loaded).

        Raises DuplicateRequestId when the id is in flight. `ticket` (any object) lets the
        caller abort exactly this request later, even if it gives up before the admission
        completes: see `abort`.
        """

        def add(engine: ServingEngine) -> None:
            engine.add_request(request, request_id=request_id, arrival_time=arrival_time,
                               output_kind=OutputKind.DELTA, **({"lora_request": lora_name} if lora_name else {}))
            self._streams[request_id] = _Stream(buffer, ticket)

        await self.call(add)

    def abort(self, request_id: str, notify: str | None = None, ticket: object = None) -> concurrent.futures.Future:
        """Aborts a request; with `notify`, its stream gets an `Aborted(notify)` item. With a
        `ticket`, only the request admitted with that ticket is aborted (never another request
        that happens to use the same id). Commands run in order, so an abort sent while the
        admission is still queued takes effect right after it. The future holds True when the
        request was still in the engine."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        return self._put(("abort", request_id, notify, ticket, fut), fut)

    def abort_all(self, reason: str) -> concurrent.futures.Future:
        return self.submit(lambda engine: self._abort_all(reason))

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self._loop()
            self._stopped = True
        except BaseException as e:  # noqa: BLE001 - the thread must never die silently
            self._die(e)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished_requests():
                cmd = self._cmds.get()  # idle: block until there is something to do
                if cmd is _STOP or not self._do(cmd):
                    return
            while True:
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if cmd is _STOP or not self._do(cmd):
                    return
            if engine.has_unfinished_requests():
                self._step()
            else:
                self.snapshot = self._make_snapshot()

    def _step(self) -> None:
        engine = self.engine
        try:
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001 - fail these requests, keep serving whoever comes next
            self._step_failures += 1
            self.failed = e
            error_id = new_error_id()
            logger.error("engine step failed [error id %s] (%d in a row); failing %d requests",
                         error_id, self._step_failures, len(self._streams), exc_info=e)
            if self._step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                raise
            self._fail_all(error_id)
            return
        self._step_failures = 0
        self._num_steps += 1
        self._batched_tokens += engine.last_step.num_tokens
        if self.metrics is not None:
            self.metrics.observe_step(engine.last_step)
        items = self._process(outputs)
        # Publish the snapshot before the outputs go out: a client that sees its request
        # finish and then asks for stats sees that request's blocks freed.
        self.snapshot = self._make_snapshot()
        if items:
            self.loop.call_soon_threadsafe(_deliver, items)

    def _die(self, exc: BaseException) -> None:
        """The loop cannot go on: fail every stream and every command, now and later."""
        with self._lock:
            self.fatal_error_id = error_id = new_error_id()
            self.fatal = exc
        logger.critical("the engine thread stopped [error id %s]: %s: %s", error_id, type(exc).__name__, exc,
                        exc_info=exc)
        items = [(st.buffer, EngineFailed(error_id, fatal=True)) for st in self._streams.values()]
        self._streams.clear()
        dead = EngineDead(f"the engine thread has stopped (error id {error_id})")
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd is not _STOP and not cmd[-1].done():
                cmd[-1].set_exception(dead)
        try:
            if self._on_fatal is not None:  # before the streams fail: health is NOT_SERVING first
                self.loop.call_soon_threadsafe(self._on_fatal)
            self.loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    def _do(self, cmd: Any) -> bool:
        if cmd is _STOP:
            return False
        kind = cmd[0]
        if kind == "call":
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as e:  # noqa: BLE001 - delivered to the caller
                    fut.set_exception(e)
        elif kind == "abort":
            _, rid, notify, ticket, fut = cmd
            stream = self._streams.get(rid)
            if ticket is not None and (stream is None or stream.ticket is not ticket):
                found = False  # not admitted, already finished, or someone else's request
            else:
                found = self._abort_one(rid, notify)
            if not fut.done():
                fut.set_result(found)
        return True

    def _abort_one(self, rid: str, notify: str | None) -> bool:
        found = self.engine.abort(rid)
        stream = self._streams.pop(rid, None)
        if found:
            self._num_finished += 1
            if self.metrics is not None:
                self.metrics.request_success.labels(finished_reason="abort").inc()
        if stream is not None and notify is not None:
            self.loop.call_soon_threadsafe(stream.buffer.push, Aborted(notify))
        return found

    def _abort_all(self, reason: str) -> int:
        rids = list(self._streams)
        for rid in rids:
            self._abort_one(rid, reason)
        return len(rids)

    def _fail_all(self, error_id: str) -> None:
        items = []
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s after a failed step failed", rid)
            items.append((stream.buffer, EngineFailed(error_id)))
        self._streams.clear()
        self.loop.call_soon_threadsafe(_deliver, items)

    def _process(self, outputs: list[RequestOutput]) -> list[tuple[StreamBuffer, RequestOutput]]:
        """Metrics and bookkeeping for one step's outputs; returns what to deliver where."""
        now = time.monotonic()
        items = []
        m = self.metrics
        step_tokens = 0
        for out in outputs:
            stream = self._streams.get(out.request_id)
            new = sum(len(c.delta_token_ids) for c in out.outputs)
            step_tokens += new
            if stream is not None and new:
                if m is not None and stream.last_token_time is not None:
                    m.inter_token_latency.observe(now - stream.last_token_time)
                stream.last_token_time = now
            if out.finished:
                self._num_finished += 1
                self._prompt_tokens += out.usage.prompt_tokens
                if m is not None:
                    m.observe_finished(out)
                self._streams.pop(out.request_id, None)
            if stream is not None:
                items.append((stream.buffer, out))
        self._generation_tokens += step_tokens
        if m is not None and step_tokens:
            m.generation_tokens.inc(step_tokens)
        return items

    def _make_snapshot(self) -> EngineSnapshot:
        ls = self.engine.last_step
        return EngineSnapshot(
            time=time.monotonic(), stats=self.engine.scheduler.stats(),
            num_streams=len(self._streams), num_steps=self._num_steps,
            batched_tokens=self._batched_tokens, generation_tokens=self._generation_tokens,
            prompt_tokens=self._prompt_tokens, num_finished=self._num_finished,
            step_host_s=ls.host_s, step_device_s=ls.device_s,
            spec_decode=self._spec_copy(),
            lora=self.engine.lora_activity() if self.engine.lora_registry is not None else None,
            encoder=self.engine.encoder_activity(),
        )

    def _spec_copy(self) -> SpecDecodeCounts | None:
        if self.engine.proposer is None:
            return None
        return self.engine.spec_decode.copy()


def _deliver(items: list[tuple[StreamBuffer, Any]]) -> None:
    for buffer, item in items:
        buffer.push(item)
