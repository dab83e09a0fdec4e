"""The server process: one `ServingCore` behind its two fronts (gRPC, and the OpenAI HTTP API
beside it) and the operator's metrics endpoint.

    gRPC client ──► GrpcFront (grpc_front.py) ──┐
                                                 ├─► ServingCore (core.py) ──► EngineLoop ──► Engine
    HTTP client ──► OpenAIFront (http_api/) ─────┘     admission, tenants,      (engine thread)
                                                       tokenizer pool, health

Life cycle: `start()` binds the ports with health NOT_SERVING, `load()` builds the engine and
compiles every shape on a worker thread, then health turns SERVING. `drain()` (SIGTERM) turns
health NOT_SERVING, refuses new requests with UNAVAILABLE / 503, waits for open streams (whose
output may not be fully read yet) up to the shutdown timeout, aborts the rest and stops. If
the engine thread stops on an error, health turns NOT_SERVING, every open stream ends at
once, and `serve()` returns a non-zero exit code after the drain.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
from typing import Any

from jaxserve.config.engine_config import SCHEDULING_DEFAULTS, EngineConfig
from server.core import EXIT_ENGINE_FAILED, ServingCore
from server.grpc_front import GrpcFront
from server.options import VERSION, ServerOptions, ServerState

logger = logging.getLogger("jaxserve.server")

EXIT_SECOND_SIGNAL = 130  # a second SIGTERM / SIGINT: exit at once, no drain

__all__ = ["EXIT_ENGINE_FAILED", "EXIT_SECOND_SIGNAL", "VERSION", "JaxServeServer", "ServerOptions", "serve"]


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class JaxServeServer:
    """Starts, drains and stops the core and its fronts, in that order of dependence."""

    def __init__(self, engine_config: EngineConfig, options: ServerOptions | None = None, *, engine: Any = None):
        self.core = ServingCore(engine_config, options, engine=engine)
        self.grpc = GrpcFront(self.core)
        self.http: Any = None  # server.http_api.runner.HttpServer when the HTTP API is on
        self.port: int | None = None
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_http: Any = None
        self._stopping = False
        self.stopped = asyncio.Event()

    # The core's state, for operators' scripts and tests.
    engine = property(lambda self: self.core.engine)
    loop_runner = property(lambda self: self.core.loop_runner)
    metrics = property(lambda self: self.core.metrics)
    admission = property(lambda self: self.core.admission)
    frontend = property(lambda self: self.core.frontend)
    options = property(lambda self: self.core.options)
    state = property(lambda self: self.core.state)
    num_in_flight = property(lambda self: self.core.num_in_flight)
    num_streams = property(lambda self: self.core.num_streams)
    served_model_names = property(lambda self: self.core.served_model_names)
    engine_failed = property(lambda self: self.core.engine_failed)
    exit_code = property(lambda self: self.core.exit_code)

    async def start(self) -> int:
        """Binds the ports; health is NOT_SERVING until `load()` finishes. Returns the gRPC port."""
        o = self.core.options
        self.port = await self.grpc.start()
        if o.http_port >= 0:
            try:
                await self._start_http()
            except OSError:
                await self.grpc.stop(None)
                raise
        if o.metrics_port >= 0:
            from prometheus_client import start_http_server
            self._metrics_http, _ = start_http_server(o.metrics_port, addr=o.metrics_host,
                                                      registry=self.core.metrics.registry)
            self.metrics_port = self._metrics_http.server_port
        logger.info("listening on %s:%d (%s)%s", o.host, self.port, "TLS" if o.tls_cert_file else "insecure",
                    f", metrics on http://{o.metrics_host}:{self.metrics_port}/metrics" if self.metrics_port else "")
        if self.core.auth.required and not o.tls_cert_file and not _is_loopback(o.host):
            logger.warning("API keys are accepted over plaintext on %s: anyone on the path can read them; "
                           "serve TLS (--tls-cert-file / --tls-key-file) or bind 127.0.0.1 behind a TLS proxy", o.host)
        if o.metrics_port >= 0 and not _is_loopback(o.metrics_host):
            logger.warning("the metrics endpoint on %s has no authentication", o.metrics_host)
        return self.port

    async def _start_http(self) -> None:
        from server.http_api.connection import ConnectionLimits
        from server.http_api.routes import OpenAIFront
        from server.http_api.runner import HttpServer

        o = self.core.options
        # Connections and calls open at once: every admissible request plus as many again
        # for refusals, health checks and tokenize calls.
        # (The engine is not built yet: an unset max_num_seqs counts as the largest default.)
        seqs = self.core.engine_config.max_num_seqs or max(s for _, s in SCHEDULING_DEFAULTS.values())
        max_conns = 2 * (seqs + o.max_queued_requests) + o.max_open_calls
        limits = ConnectionLimits(max_head_bytes=o.http_max_head_bytes, head_timeout=o.http_head_timeout,
                                  max_connections_per_peer=o.http_max_connections_per_peer,
                                  max_connections=max_conns, proves=self._proves_http_head)
        self.http = HttpServer(OpenAIFront(self.core).app, o.host, o.http_port, tls_cert_file=o.tls_cert_file,
                               tls_key_file=o.tls_key_file, tls_client_ca_file=o.tls_client_ca_file,
                               limits=limits)
        self.http_port = await self.http.start()
        logger.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if o.tls_cert_file else "http",
                    o.host, self.http_port)

    def _proves_http_head(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """A request head with a valid API key (any head when no keys are required)."""
        return self.core.auth.authenticate([(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]) is not None

    async def load(self) -> None:
        await self.core.load()

    async def drain(self, timeout: float | None = None) -> None:
        """Stops admitting, lets open streams finish up to `timeout`, aborts the rest, stops."""
        if self.core.state in (ServerState.DRAINING, ServerState.STOPPED):
            await self.stopped.wait()
            return
        self.core.begin_drain()
        await self.grpc.enter_graceful_shutdown()
        await self.core.drain(timeout)
        await self.stop(grace=1.0)

    async def stop(self, grace: float | None = None) -> None:
        if self._stopping:
            return
        self._stopping = True
        self.core.state = ServerState.STOPPED  # refuse new requests while the fronts close
        await self.grpc.stop(grace)
        if self.http is not None:
            await self.http.stop(grace if grace is not None else 1.0)
        await self.core.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        self.stopped.set()
        logger.info("stopped")


async def serve(engine_config: EngineConfig, options: ServerOptions, *, engine: Any = None) -> int:
    """Runs a server until SIGTERM / SIGINT (then drains) or until its engine thread stops on
    an error. Returns the exit code: 0 after a drain, EXIT_ENGINE_FAILED when the engine died.
    A second signal while draining exits the process at once (EXIT_SECOND_SIGNAL)."""
    import signal

    srv = JaxServeServer(engine_config, options, engine=engine)
    await srv.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            logger.warning("second signal: exiting now, without draining")
            logging.shutdown()
            os._exit(EXIT_SECOND_SIGNAL)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    load = asyncio.create_task(srv.load())
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({load, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        waiter.cancel()
        await srv.stop()
        raise load.exception()
    if not stop.is_set():
        failed = asyncio.create_task(srv.engine_failed.wait())
        await asyncio.wait({waiter, failed}, return_when=asyncio.FIRST_COMPLETED)
        failed.cancel()
    if not load.done():
        # Still loading / compiling on a worker thread that cannot be interrupted, and that
        # asyncio.run would wait for: nothing is in flight, so exit the process right here.
        logger.info("signal received while loading: exiting")
        await srv.stop()
        logging.shutdown()
        os._exit(0)
    if srv.engine_failed.is_set():
        logger.critical("the engine thread stopped: draining, then exiting with status %d", srv.exit_code)
        await srv.drain(timeout=min(5.0, options.shutdown_timeout))
    else:
        logger.info("signal received: shutting down")
        await srv.drain()
    waiter.cancel()
    return srv.exit_code
