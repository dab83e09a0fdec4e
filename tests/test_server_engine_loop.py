"""The engine-thread bridge (`server/engine_loop.py`) against a fake engine: streaming, idle
blocking, validation errors, step failures, aborts by ticket. No model, no JAX work: fast."""

from __future__ import annotations

import asyncio
import time
import types

import pytest

from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, Usage
from scheduler import SamplingParams
from scheduler.stats import SchedulerStats
from server.engine_loop import Aborted, EngineFailed, EngineLoop
from server.metrics import ServerMetrics


class FakeEngine:
    """One token per step per request; `fail_next` makes the next step raise."""

    def __init__(self):
        self.reqs: dict[str, list] = {}
        self.steps = 0
        self.polls = 0  # has_unfinished_requests calls: a spinning loop makes many
        self.fail_next = False
        self.last_step = types.SimpleNamespace(num_tokens=0, host_s=0.0, device_s=0.0)
        self.scheduler = types.SimpleNamespace(stats=self._stats)
        self.tokenizer = None

    def _stats(self) -> SchedulerStats:
        n = len(self.reqs)
        return SchedulerStats(n, 0, 0, n, 0, 100 - n, 100, 0, 0)

    def add_request(self, prompt, params, *, prompt_token_ids=None, request_id=None, arrival_time=None):
        if request_id in self.reqs:
            raise ValueError(f"duplicate request_id {request_id!r}")
        if prompt == "bad":
            raise ValueError("prompt must not be bad")
        self.reqs[request_id] = [params.max_tokens, 0, arrival_time or time.monotonic()]
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
            self.fail_next = False
            raise RuntimeError("device on fire")
        outs = []
        now = time.monotonic()
        self.last_step.num_tokens = len(self.reqs)
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


async def _collect(q: asyncio.Queue, timeout: float = 5.0) -> list:
    items = []
    while True:
        item = await asyncio.wait_for(q.get(), timeout)
        items.append(item)
        if not isinstance(item, RequestOutput) or item.finished:
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
        q = await loop.add_request("a", SamplingParams(max_tokens=3), prompt="hi")
        items = await _collect(q)
        assert [len(i.outputs[0].delta_token_ids) for i in items] == [1, 1, 1] and items[-1].finished
        await asyncio.sleep(0.05)  # let the loop reach its idle wait
        steps, polls = engine.steps, engine.polls
        await asyncio.sleep(0.3)
        # Idle: blocked on the command queue, neither stepping nor polling the engine.
        assert engine.steps == steps and engine.polls - polls <= 1, engine.polls - polls
        assert loop.snapshot.generation_tokens == 3 and loop.snapshot.num_streams == 0
        assert sample(metrics, "jaxserve:generation_tokens_total") == 3
        assert sample(metrics, "jaxserve:request_success_total", finished_reason="length") == 1
        assert metrics.num_compilations_after_warmup == 0

    _run(body)


def test_validation_error_reaches_the_caller():
    async def body(engine, loop, metrics):
        with pytest.raises(ValueError, match="bad"):
            await loop.add_request("a", SamplingParams(), prompt="bad")
        q = await loop.add_request("b", SamplingParams(max_tokens=1), prompt="ok")
        assert (await _collect(q))[-1].finished

    _run(body)


def test_step_failure_fails_streams_and_keeps_serving():
    async def body(engine, loop, metrics):
        engine.fail_next = True
        q = await loop.add_request("a", SamplingParams(max_tokens=5), prompt="hi")
        items = await _collect(q)
        assert isinstance(items[-1], EngineFailed) and "fire" in str(items[-1])
        assert not engine.reqs  # aborted in the engine
        q = await loop.add_request("b", SamplingParams(max_tokens=2), prompt="hi")
        assert (await _collect(q))[-1].finished

    _run(body)


def test_abort_by_ticket_and_notify():
    async def body(engine, loop, metrics):
        mine = object()
        q = await loop.add_request("x", SamplingParams(max_tokens=10_000), prompt="hi", ticket=mine)
        await q.get()
        with pytest.raises(ValueError, match="duplicate"):
            await loop.add_request("x", SamplingParams(), prompt="hi", ticket=object())
        # the rejected duplicate's ticket must not abort the request that owns the id
        assert not await asyncio.wrap_future(loop.abort("x", ticket=object()))
        assert "x" in engine.reqs
        assert await asyncio.wrap_future(loop.abort("x", notify="bye", ticket=mine))
        assert "x" not in engine.reqs
        while True:
            item = await asyncio.wait_for(q.get(), 5)
            if isinstance(item, Aborted):
                assert item.reason == "bye"
                break
        assert sample(metrics, "jaxserve:request_success_total", finished_reason="abort") == 1

    _run(body)


def test_abort_queued_right_after_admission_still_aborts():
    async def body(engine, loop, metrics):
        ticket = object()
        task = asyncio.create_task(loop.add_request("y", SamplingParams(max_tokens=10_000), prompt="hi",
                                                    ticket=ticket))
        await asyncio.sleep(0)  # the add command is queued
        fut = loop.abort("y", ticket=ticket)  # as a cancelled RPC does in its finally block
        await task
        assert await asyncio.wrap_future(fut)
        assert not engine.reqs

    _run(body)
