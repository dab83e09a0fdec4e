"""The engine-thread bridge (`server/engine_loop.py`) against a fake engine: streaming, idle
blocking, validation errors, step failures, a dying loop, aborts by ticket; the stream buffer's
merging and the output processor's delta mode. No model, no JAX work: fast."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
import types

import pytest

from jaxserve.engine.input_processor import EngineRequest
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.outputs import (
    CompletionOutput,
    OutputKind,
    RequestMetrics,
    RequestOutput,
    Usage,
)
from jaxserve.worker.runner_output import StepTiming
from scheduler import FinishReason, RequestUpdate, SamplingParams
from scheduler.stats import SchedulerStats
from server.engine_loop import MAX_CONSECUTIVE_STEP_FAILURES, EngineDead, EngineLoop
from server.metrics import ServerMetrics
from server.streams import Aborted, EngineFailed, StreamBuffer


class FakeEngine:
    """One token per step per request; `fail_next` makes the next step raise."""

    def __init__(self):
        self.reqs: dict[str, list] = {}
        self.steps = 0
        self.polls = 0  # has_unfinished_requests calls: a spinning loop makes many
        self.fail_next = 0  # steps left that raise
        self.last_step = StepTiming()
        self.scheduler = types.SimpleNamespace(stats=self._stats)
        self.tokenizer = None
        self.proposer = None  # the ServingEngine members the loop reads: no spec decode, no LoRA,
        self.lora_registry = None  # no image encoder

    def encoder_activity(self):
        return None

    def _stats(self) -> SchedulerStats:
        n = len(self.reqs)
        return SchedulerStats(n, 0, 0, n, 0, 100 - n, 100, 0, 0)

    def add_request(self, request: EngineRequest, *, request_id=None, arrival_time=None,
                    output_kind=OutputKind.CUMULATIVE):
        if request_id in self.reqs:
            raise ValueError(f"duplicate request_id {request_id!r}")
        if request.prompt == "bad":
            raise ValueError("prompt must not be bad")
        self.reqs[request_id] = [request.params.max_tokens, 0, arrival_time or time.monotonic()]
        return request_id

    def abort(self, request_id):
        return self.reqs.pop(request_id, None) is not None

    def has_unfinished_requests(self):
        self.polls += 1
        return bool(self.reqs)

    def step(self):
        self.steps += 1
        time.sleep(0.002)
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("device on fire")
        outs = []
        now = time.monotonic()
        # Every request decodes one token, in a padded bucket of 8.
        self.last_step = StepTiming(num_tokens=len(self.reqs), padded_tokens=8, num_decode_tokens=len(self.reqs))
        for rid, st in list(self.reqs.items()):
            st[1] += 1
            done = st[1] >= st[0]
            if done:
                del self.reqs[rid]
            comp = CompletionOutput(0, token_ids=[7] * st[1], delta_token_ids=[7],
                                    finish_reason="length" if done else None)
            outs.append(RequestOutput(rid, None, [1, 2], [comp], done, Usage(2, st[1], 0),
                                      RequestMetrics(st[2], st[2], st[2], now if done else None)))
        return outs


def sample(metrics: ServerMetrics, name: str, **labels: str) -> float | None:
    """A metric's value as the Prometheus registry exports it."""
    return metrics.registry.get_sample_value(name, labels)


async def add(loop: EngineLoop, rid: str, params: SamplingParams, prompt: str = "hi", **kw) -> StreamBuffer:
    buf = StreamBuffer()
    request = EngineRequest(prompt, (1, 2), params, seeds=(0,) * params.n)
    await loop.add_request(rid, request, buf, **kw)
    return buf


async def _collect(buf: StreamBuffer, timeout: float = 5.0) -> list:
    """Everything the stream delivers, as the handler takes it, to its end."""
    items = []
    while True:
        out, term = await asyncio.wait_for(buf.take(), timeout)
        items += [x for x in (out, term) if x is not None]
        if term is not None or (out is not None and out.finished):
            return items


def _run(coro_fn):
    async def main():
        engine = FakeEngine()
        metrics = ServerMetrics()
        loop = EngineLoop(engine, asyncio.get_running_loop(), metrics)
        loop.start()
        try:
            return await coro_fn(engine, loop, metrics)
        finally:
            loop.stop()

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_streams_outputs_and_blocks_when_idle():
    async def body(engine, loop, metrics):
        q = await add(loop, "a", SamplingParams(max_tokens=3), prompt="hi")
        items = await _collect(q)
        assert sum(len(i.outputs[0].delta_token_ids) for i in items) == 3 and items[-1].finished
        await asyncio.sleep(0.05)  # let the loop reach its idle wait
        steps, polls = engine.steps, engine.polls
        await asyncio.sleep(0.3)
        # Idle: blocked on the command queue, neither stepping nor polling the engine.
        assert engine.steps == steps and engine.polls - polls <= 1, engine.polls - polls
        assert loop.snapshot.generation_tokens == 3 and loop.snapshot.num_streams == 0
        assert sample(metrics, "jaxserve:generation_tokens_total") == 3
        assert sample(metrics, "jaxserve:request_success_total", finished_reason="length") == 1
        assert metrics.num_compilations_after_warmup == 0
        # Per-step metrics an operator tunes with: 3 steps of 1 decode token in a bucket of 8.
        assert sample(metrics, "jaxserve:iteration_tokens_total_count") == 3
        assert sample(metrics, "jaxserve:scheduled_tokens_total", phase="decode") == 3
        assert sample(metrics, "jaxserve:scheduled_tokens_total", phase="prefill") == 0
        assert sample(metrics, "jaxserve:step_token_fill_sum") == 3 * 1 / 8
        assert sample(metrics, "jaxserve:tenant_prompt_tokens_total", tenant="") == 2  # ids without a tenant

    _run(body)


def test_validation_error_reaches_the_caller():
    async def body(engine, loop, metrics):
        with pytest.raises(ValueError, match="bad"):
            await add(loop, "a", SamplingParams(), prompt="bad")
        q = await add(loop, "b", SamplingParams(max_tokens=1), prompt="ok")
        assert (await _collect(q))[-1].finished

    _run(body)


def test_step_failure_fails_streams_and_keeps_serving(caplog):
    async def body(engine, loop, metrics):
        engine.fail_next = 1
        q = await add(loop, "a", SamplingParams(max_tokens=5), prompt="hi")
        items = await _collect(q)
        failed = items[-1]
        assert isinstance(failed, EngineFailed) and not failed.fatal
        # the client gets an error id, never the exception's text; the log has both
        assert "fire" not in failed.client_message and failed.error_id in failed.client_message
        assert any(failed.error_id in r.getMessage() and "fire" in str(r.exc_info[1]) for r in caplog.records)
        assert not engine.reqs  # aborted in the engine
        q = await add(loop, "b", SamplingParams(max_tokens=2), prompt="hi")
        assert (await _collect(q))[-1].finished
        assert loop.alive and not loop.dead

    with caplog.at_level(logging.ERROR, logger="server.engine_loop"):
        _run(body)


def test_repeated_step_failures_stop_the_loop_loudly():
    async def body(engine, loop, metrics):
        engine.fail_next = MAX_CONSECUTIVE_STEP_FAILURES
        for i in range(MAX_CONSECUTIVE_STEP_FAILURES):
            items = await _collect(await add(loop, f"r{i}", SamplingParams(max_tokens=5), prompt="hi"))
            assert isinstance(items[-1], EngineFailed)
        assert items[-1].fatal and loop.dead and not loop.alive
        with pytest.raises(EngineDead, match=loop.fatal_error_id):
            await add(loop, "late", SamplingParams(), prompt="hi")

    _run(body)


def test_an_error_outside_the_step_fails_everyone_and_every_later_command():
    async def body(engine, loop, metrics):
        a = await add(loop, "a", SamplingParams(max_tokens=10_000), prompt="hi")
        await a.take()
        real = engine.has_unfinished_requests
        engine.has_unfinished_requests = lambda: (_ for _ in ()).throw(KeyError("scheduler state"))
        items = await _collect(a)
        assert isinstance(items[-1], EngineFailed) and items[-1].fatal
        engine.has_unfinished_requests = real
        await asyncio.sleep(0.05)
        assert loop.dead and isinstance(loop.fatal, KeyError)
        with pytest.raises(EngineDead):
            await loop.call(lambda e: 1)
        with pytest.raises(EngineDead):
            await asyncio.wrap_future(loop.abort("a"))

    _run(body)


def test_a_killed_engine_thread_is_noticed():
    """SystemExit raised inside the thread (as an injected kill does) still fails the streams."""
    async def body(engine, loop, metrics):
        a = await add(loop, "a", SamplingParams(max_tokens=10_000), prompt="hi")
        await a.take()
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(loop.thread.ident), ctypes.py_object(SystemExit))
        items = await _collect(a)
        assert isinstance(items[-1], EngineFailed) and items[-1].fatal
        assert loop.dead and isinstance(loop.fatal, SystemExit)

    _run(body)


def test_abort_by_ticket_and_notify():
    async def body(engine, loop, metrics):
        mine = object()
        q = await add(loop, "x", SamplingParams(max_tokens=10_000), prompt="hi", ticket=mine)
        await q.take()
        with pytest.raises(ValueError, match="duplicate"):
            await add(loop, "x", SamplingParams(), prompt="hi", ticket=object())
        # the rejected duplicate's ticket must not abort the request that owns the id
        assert not await asyncio.wrap_future(loop.abort("x", ticket=object()))
        assert "x" in engine.reqs
        assert await asyncio.wrap_future(loop.abort("x", notify="bye", ticket=mine))
        assert "x" not in engine.reqs
        items = await _collect(q)
        assert isinstance(items[-1], Aborted) and items[-1].reason == "bye"
        assert sample(metrics, "jaxserve:request_success_total", finished_reason="abort") == 1

    _run(body)


def test_abort_queued_right_after_admission_still_aborts():
    async def body(engine, loop, metrics):
        ticket = object()
        task = asyncio.create_task(add(loop, "y", SamplingParams(max_tokens=10_000), prompt="hi", ticket=ticket))
        await asyncio.sleep(0)  # the add command is queued
        fut = loop.abort("y", ticket=ticket)  # as a cancelled RPC does in its finally block
        await task
        assert await asyncio.wrap_future(fut)
        assert not engine.reqs

    _run(body)


# ---------------------------------------------------------------------------- stream buffer
def _delta(rid: str, tokens: list[int], text: str, finish: str | None = None, n_done: int = 0) -> RequestOutput:
    comp = CompletionOutput(0, delta_token_ids=tokens, delta_text=text, finish_reason=finish)
    return RequestOutput(rid, None, [], [comp], finish is not None, Usage(2, n_done, 0), RequestMetrics(0.0))


def test_stream_buffer_merges_unread_deltas():
    """A slow reader gets everything pending in one merged delta: the buffer holds each unread
    token once, not one per-step copy of the text so far."""
    async def body():
        released = []
        buf = StreamBuffer(on_engine_done=lambda: released.append(1))
        for i in range(500):
            buf.push(_delta("r", [i], f"t{i} ", n_done=i + 1))
        assert buf.pending_tokens == 500
        out, term = await buf.take()
        assert out.outputs[0].delta_token_ids == list(range(500)) and term is None
        assert out.outputs[0].delta_text == "".join(f"t{i} " for i in range(500))
        assert out.usage.completion_tokens == 500 and not out.finished and not released
        buf.push(_delta("r", [500], "end", finish="length", n_done=501))
        buf.push(Aborted("late"))  # after the finish: ignored
        out, term = await buf.take()
        assert out.finished and out.outputs[0].finish_reason == "length" and term is None
        assert released == [1] and buf.closed

    asyncio.run(body())


def test_output_processor_final_only_mode_outputs_once_with_the_whole_completion():
    """FINAL_ONLY (the batch API's kind): nothing while a request runs, then CUMULATIVE's
    final output; a request that fails still gets its one output."""
    proc = OutputProcessor(tokenizer=None)
    params = SamplingParams(max_tokens=3, logprobs=None)
    proc.add_request("f", None, [5, 6, 7], params, 0.0, OutputKind.FINAL_ONLY)
    proc.add_request("c", None, [5, 6, 7], params, 0.0)
    proc.add_request("x", None, [5], params, 0.0, OutputKind.FINAL_ONLY)
    outs = []
    for step in range(3):
        ups = [RequestUpdate(rid, [10 + step], finished=step == 2,
                             finish_reason=FinishReason.LENGTH if step == 2 else None) for rid in ("f", "c", "x")]
        outs.append({o.request_id: o for o in proc.process(ups[:2] if step == 2 else ups, {}).outputs})
    assert [sorted(o) for o in outs] == [["c"], ["c"], ["c", "f"]]
    f, c = outs[2]["f"], outs[2]["c"]
    assert f.finished and f.outputs[0].token_ids == [10, 11, 12] == c.outputs[0].token_ids
    assert f.prompt_token_ids == [5, 6, 7] and f.usage == c.usage and f.outputs[0].finish_reason == "length"
    (failed,) = proc.fail(["x"], "boom")
    assert failed.finished and failed.error == "boom" and failed.outputs[0].token_ids == [10, 11]


def test_output_processor_delta_mode_keeps_no_cumulative_copies():
    proc = OutputProcessor(tokenizer=None)
    params = SamplingParams(max_tokens=3, logprobs=None)
    proc.add_request("d", None, [5, 6, 7], params, 0.0, OutputKind.DELTA)
    proc.add_request("c", None, [5, 6, 7], params, 0.0)
    outs = []
    for step in range(3):
        ups = [RequestUpdate(rid, [10 + step], finished=step == 2,
                             finish_reason=FinishReason.LENGTH if step == 2 else None) for rid in ("d", "c")]
        outs.append({o.request_id: o for o in proc.process(ups, {}).outputs})
    d = [o["d"] for o in outs]
    c = [o["c"] for o in outs]
    assert [o.outputs[0].delta_token_ids for o in d] == [[10], [11], [12]]
    assert all(o.outputs[0].token_ids == [] for o in d)  # nothing cumulative is copied
    assert d[0].prompt_token_ids == [5, 6, 7] and d[1].prompt_token_ids == [] == d[2].prompt_token_ids
    assert [o.usage.completion_tokens for o in d] == [1, 2, 3] == [o.usage.completion_tokens for o in c]
    assert c[2].outputs[0].token_ids == [10, 11, 12] and c[2].prompt_token_ids == [5, 6, 7]
    assert d[2].finished and d[2].outputs[0].finish_reason == "length"
