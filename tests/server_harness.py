"""A real server in this process for end-to-end tests, and the clients the chaos tests use."""

from __future__ import annotations

import asyncio
import threading
import time

from jaxserve.config.engine_config import EngineConfig
from scheduler import SamplingParams
from server.app import JaxServeServer, ServerOptions


class ServerThread:
    """A JaxServeServer running on an event loop in a background thread."""

    def __init__(self, cfg: EngineConfig, opts: ServerOptions, engine=None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = JaxServeServer(cfg, opts, engine=engine)
        self.run(self.server.start(), 30)
        self.run(self.server.load(), 600)
        self.address = f"127.0.0.1:{self.server.port}"

    def run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.run(self.server.stop(grace=0.5), 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def batch_generate(srv: ServerThread, prompts, params: SamplingParams, lora_request=None):
    """The batch API (`LLM.generate`) on the server's own engine, run on the engine thread so
    nothing steps the engine concurrently (and no new shape is compiled)."""
    from jaxserve.llm import LLM

    def run(engine):
        llm = LLM.__new__(LLM)
        llm.engine, llm._counter = engine, 0
        return llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)

    return asyncio.run_coroutine_threadsafe(srv.server.loop_runner.call(run), srv.loop).result(120)


def free_port() -> int:
    """A port free now on 127.0.0.1 (for a child process that takes its port as a flag)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, timeout: float = 20.0, interval: float = 0.05, show=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"condition not met in {timeout} s" + (f": {show()}" if show else ""))



# ---------------------------------------------------------------------------- chaos clients
def rss_mib() -> float:
    """This process's resident memory (server and in-process clients together)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


class StreamResult:
    """What one streamed Generate call saw: tokens, the gaps between responses, its status."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.gaps: list[float] = []  # seconds between responses that carried tokens
        self.code = None  # grpc.StatusCode (OK when the stream ended normally)
        self.details = ""
        self.finish_reason = ""
        self.cached_tokens = 0


async def read_stream(call, *, cancel_after_tokens: int | None = None) -> StreamResult:
    import grpc

    r = StreamResult()
    last = None
    try:
        while (resp := await call.read()) is not grpc.aio.EOF:
            now = time.perf_counter()
            new = [t for d in resp.outputs for t in d.token_ids]
            if new:
                if last is not None:
                    r.gaps.append(now - last)
                last = now
            r.token_ids += new
            for d in resp.outputs:
                r.finish_reason = d.finish_reason or r.finish_reason
            r.cached_tokens = resp.usage.cached_tokens
            if cancel_after_tokens is not None and len(r.token_ids) >= cancel_after_tokens:
                call.cancel()
        r.code = grpc.StatusCode.OK
    except asyncio.CancelledError:
        r.code = grpc.StatusCode.CANCELLED
    except grpc.aio.AioRpcError as e:
        r.code, r.details = e.code(), e.details()
    return r
