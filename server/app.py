"""The gRPC server: an asyncio (`grpc.aio`) front over one engine thread.

Life cycle: `start()` binds the port with health NOT_SERVING, `load()` builds the engine and
compiles every shape on a worker thread, then health turns SERVING. `drain()` (SIGTERM) turns
health NOT_SERVING, refuses new requests with UNAVAILABLE, waits for open streams (whose
output may not be fully read yet) up to the shutdown timeout, aborts the rest and stops. If
the engine thread stops on an error, health turns NOT_SERVING, every open stream ends at
once with UNAVAILABLE, and `serve()` returns a non-zero exit code after the drain.

A Generate call, in order: the interceptor checks the key (before the body is parsed); the
handler checks sizes and sampling fields, tokenizes on the front-end pool, reserves the
request's work with `Admission` (server-wide and per tenant), then hands it to the engine
thread under a tenant-scoped id, and streams merged deltas from its `StreamBuffer`, each write
bounded by `stream_idle_timeout`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import logging
import os
import time
import uuid
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.config import EngineConfig
from scheduler import SamplingParams
from server.admission import Admission, AdmissionRefused, request_work
from server.auth import AuthInterceptor
from server.convert import (
    MAX_REQUEST_ID_CHARS,
    check_input,
    output_to_proto,
    sampling_params_from_proto,
)
from server.engine_loop import EngineDead, EngineLoop, new_error_id
from server.errors import ErrorKind, ServeError, invalid
from server.frontend import FrontendBusy, FrontendPool
from server.generation import Generation
from server.metrics import ServerMetrics
from server.proto import jaxserve_pb2 as pb
from server.proto import jaxserve_pb2_grpc as pb_grpc
from server.streams import EngineFailed, StreamBuffer
from server.tenants import Authenticator, Tenant

logger = logging.getLogger("jaxserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name
VERSION = "0.2.0"
EXIT_ENGINE_FAILED = 1  # serve()'s exit code when the engine thread stopped on an error
EXIT_SECOND_SIGNAL = 130  # a second SIGTERM / SIGINT: exit at once, no drain
GRAMMAR_COMPILE_TIMEOUT_S = 30.0  # a structured-output grammar that compiles longer is refused


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: pick a free port
    metrics_host: str = "127.0.0.1"  # the metrics endpoint is for the operator, not for tenants
    metrics_port: int = 8001  # 0: pick a free port; -1: no metrics endpoint
    http_port: int = 8000  # the OpenAI-compatible HTTP API (same host); 0: pick a free port; -1: off
    served_model_name: tuple[str, ...] = ()  # names clients may give as `model`; the first is shown
    chat_template: str | None = None  # a Jinja chat template that replaces the model's
    tool_call_parser: str = "hermes"  # the model's own tool-call format, for tool_choice "auto"
    api_key: str | None = None  # one key (tenant "default"); or `tenants` for several
    tenants: tuple[tuple[Tenant, str], ...] = ()  # (tenant, key) pairs: --api-keys FILE
    shared_prefix_cache: bool = False  # tenants share cached prefixes (and learn of each other's)
    priority_range: tuple[int, int] = (0, 100)  # client priorities are clamped into it
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # set: clients must present a certificate (mTLS)
    max_queued_requests: int = 256  # requests allowed to wait beyond max_num_seqs
    max_queued_tokens: int | None = None  # work in flight (prompt + n x max_tokens); None: 4 x KV cache
    stream_idle_timeout: float = 60.0  # a stream whose client reads nothing for this long is aborted
    max_concurrent_streams: int = 128  # per HTTP/2 connection
    keepalive_time: float = 60.0  # seconds between server pings on an idle connection
    keepalive_timeout: float = 20.0  # a ping not acknowledged in this long closes the connection
    max_connection_idle: float | None = None  # close connections with no call for this long
    max_connection_age: float | None = None  # close connections older than this (load rebalancing)
    max_connection_age_grace: float = 30.0  # time calls get to finish once a connection is closed
    max_open_calls: int = 64  # health / reflection calls open at once (they need no key)
    http_max_head_bytes: int = 64 * 1024  # request line + headers; more: 431 and the connection closed
    http_head_timeout: float = 10.0  # seconds to send a request head; more: 408 and closed
    http_max_connections_per_peer: int = 64  # HTTP connections one address may hold; more: 503
    frontend_threads: int | None = None  # tokenization / chat-template workers; None: cores / 4 (1..4)
    tokenizer_backlog_chars: int = 1_000_000  # characters queued for tokenization; more: RESOURCE_EXHAUSTED
    shutdown_timeout: float = 30.0
    max_prompt_chars: int | None = None  # None: 32 x max_model_len
    max_message_bytes: int = 4 * 2**20
    log_interval: float = 1.0  # seconds between status lines; 0: off
    warmup: bool = True
    require_warm_cache: bool = False  # refuse to start when any planned shape missed the cache

    def grpc_options(self) -> list[tuple[str, int]]:
        ms = lambda s: int(s * 1000)  # noqa: E731
        opts = [
            # gRPC itself refuses (RESOURCE_EXHAUSTED) only far past the limit; up to there the
            # handlers answer INVALID_ARGUMENT naming the oversized field (`_check_size`).
            ("grpc.max_receive_message_length", 4 * self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.keepalive_time_ms", ms(self.keepalive_time)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout)),
            ("grpc.keepalive_permit_without_calls", 1),  # clients may keep idle connections alive
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),  # faster pings: GOAWAY
            ("grpc.http2.max_ping_strikes", 2),
        ]
        if self.max_connection_idle is not None:
            opts.append(("grpc.max_connection_idle_ms", ms(self.max_connection_idle)))
        if self.max_connection_age is not None:
            opts.append(("grpc.max_connection_age_ms", ms(self.max_connection_age)))
            opts.append(("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace)))
        return opts


class ServerState:
    LOADING, SERVING, DRAINING, STOPPED = "loading", "serving", "draining", "stopped"


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _internal_errors(rpc):
    """An unexpected exception in a handler answers INTERNAL with an error id (the log has the
    traceback under it), not gRPC's UNKNOWN carrying the Python exception's text."""

    @functools.wraps(rpc)
    async def handler(self, request, context):
        try:
            return await rpc(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception:
            error_id = new_error_id()
            logger.exception("%s failed [error id %s]", rpc.__name__, error_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error (error id {error_id})")

    return handler


class JaxServeServer(pb_grpc.JaxServeServicer):
    def __init__(self, engine_config: EngineConfig, options: ServerOptions | None = None, *, engine: Any = None):
        self.engine_config = engine_config
        self.options = o = options or ServerOptions()
        if o.api_key and o.tenants:
            raise ValueError("give one API key or a tenants file, not both")
        self.auth = Authenticator(list(o.tenants)) if o.tenants else (
            Authenticator.single_key(o.api_key) if o.api_key else Authenticator())
        self.engine = engine
        self.loop_runner: EngineLoop | None = None
        self.frontend: FrontendPool | None = None
        self.admission: Admission | None = None
        self.state = ServerState.LOADING
        self.metrics = ServerMetrics(snapshot=self._snapshot)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http: Any = None  # server.http_api.runner.HttpServer when the HTTP API is on
        self.http_port: int | None = None
        self._metrics_http: Any = None
        self.num_streams = 0  # open Generate streams (drain waits for these)
        self._buffers: set[StreamBuffer] = set()
        self._started = time.monotonic()
        self.started_wall = time.time()
        self._log_task: asyncio.Task | None = None
        self._health_task: asyncio.Task | None = None
        self._healthy = True
        self._idle = asyncio.Event()
        self._idle.set()
        self.stopped = asyncio.Event()
        self.engine_failed = asyncio.Event()  # the engine thread stopped on an error
        self.exit_code = 0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> int:
        """Binds the ports; health is NOT_SERVING until `load()` finishes. Returns the port."""
        o = self.options
        self.interceptor = AuthInterceptor(
            self.auth, o.max_open_calls, on_denied=self.metrics.auth_failures.inc,
            on_open_refused=self.metrics.requests_refused.labels(limit="max_open_calls").inc)
        self.server = grpc.aio.server(interceptors=[self.interceptor], options=o.grpc_options())
        pb_grpc.add_JaxServeServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        for svc in ("", SERVICE_NAME):
            await self.health.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)
        addr = f"{o.host}:{o.port}"
        if o.tls_cert_file:
            creds = grpc.ssl_server_credentials(
                [(_read(o.tls_key_file), _read(o.tls_cert_file))],
                root_certificates=_read(o.tls_client_ca_file) if o.tls_client_ca_file else None,
                require_client_auth=bool(o.tls_client_ca_file))
            bind = lambda: self.server.add_secure_port(addr, creds)  # noqa: E731
        else:
            bind = lambda: self.server.add_insecure_port(addr)  # noqa: E731
        try:
            self.port = bind()
        except RuntimeError as e:
            raise OSError(f"could not bind {addr}: {e}") from e
        if not self.port:
            raise OSError(f"could not bind {addr}")
        await self.server.start()
        if o.http_port >= 0:
            await self._start_http()
        if o.metrics_port >= 0:
            from prometheus_client import start_http_server
            self._metrics_http, _ = start_http_server(o.metrics_port, addr=o.metrics_host,
                                                      registry=self.metrics.registry)
            self.metrics_port = self._metrics_http.server_port
        logger.info("listening on %s:%d (%s)%s", o.host, self.port, "TLS" if o.tls_cert_file else "insecure",
                    f", metrics on http://{o.metrics_host}:{self.metrics_port}/metrics" if self.metrics_port else "")
        if self.auth.required and not o.tls_cert_file and not _is_loopback(o.host):
            logger.warning("API keys are accepted over plaintext on %s: anyone on the path can read them; "
                           "serve TLS (--tls-cert-file / --tls-key-file) or bind 127.0.0.1 behind a TLS proxy", o.host)
        if o.metrics_port >= 0 and not _is_loopback(o.metrics_host):
            logger.warning("the metrics endpoint on %s has no authentication", o.metrics_host)
        return self.port

    async def _start_http(self) -> None:
        from server.http_api.connection import ConnectionLimits
        from server.http_api.routes import OpenAIFront
        from server.http_api.runner import HttpServer

        o = self.options
        # Connections and calls open at once: every admissible request plus as many again
        # for refusals, health checks and tokenize calls.
        max_conns = 2 * (self.engine_config.max_num_seqs + o.max_queued_requests) + o.max_open_calls
        limits = ConnectionLimits(max_head_bytes=o.http_max_head_bytes, head_timeout=o.http_head_timeout,
                                  max_connections_per_peer=o.http_max_connections_per_peer,
                                  max_connections=max_conns)
        self.http = HttpServer(OpenAIFront(self).app, o.host, o.http_port, tls_cert_file=o.tls_cert_file,
                               tls_key_file=o.tls_key_file, tls_client_ca_file=o.tls_client_ca_file,
                               limits=limits)
        try:
            self.http_port = await self.http.start()
        except OSError:
            await self.server.stop(None)
            raise
        logger.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", "https" if o.tls_cert_file else "http",
                    o.host, self.http_port)

    async def load(self) -> None:
        """Builds the engine (unless given) and warms it up off the event loop, then serves."""
        t0 = time.perf_counter()
        if self.engine is None:
            from jaxserve.engine import Engine
            self.engine = await asyncio.to_thread(Engine, self.engine_config)
        t1 = time.perf_counter()
        logger.info("model loaded in %.1f s", t1 - t0)
        if self.options.warmup:
            report = await asyncio.to_thread(self.engine.warmup)
            logger.info("warmup done in %.1f s: %s", time.perf_counter() - t1, report.summary())
            if self.options.require_warm_cache and report.num_misses:
                missed = [r.name for r in report.records if r.cache == "miss"]
                raise RuntimeError(
                    f"--require-warm-cache: {len(missed)} of {report.num_shapes} shapes missed the "
                    f"compilation cache ({', '.join(missed[:5])}{', ...' if len(missed) > 5 else ''}); "
                    "fill it with `jaxserve warmup` using the same flags")
        o = self.options
        threads = o.frontend_threads or max(1, min(4, (os.cpu_count() or 1) // 4))
        self.frontend = FrontendPool(self.engine.tokenizer, threads, o.tokenizer_backlog_chars, o.chat_template)
        self.metrics.set_frontend(self.frontend)
        kv_tokens = self.engine.num_pages * self.engine_config.page_size
        self.admission = Admission(
            self.engine_config.max_num_seqs + o.max_queued_requests,
            o.max_queued_tokens if o.max_queued_tokens is not None else 4 * kv_tokens)
        self.loop_runner = EngineLoop(self.engine, asyncio.get_running_loop(), self.metrics,
                                      on_fatal=lambda: asyncio.ensure_future(self._on_engine_dead()))
        self.loop_runner.start()
        self.metrics.set_engine_thread(self.loop_runner.thread)
        self.state = ServerState.SERVING
        for svc in ("", SERVICE_NAME):
            await self.health.set(svc, health_pb2.HealthCheckResponse.SERVING)
        if self.options.log_interval > 0:
            self._log_task = asyncio.create_task(self._log_loop())
        self._health_task = asyncio.create_task(self._watch_engine_health())
        logger.info("serving %s (max_model_len %d, %d KV pages of %d tokens; %d tenant%s, work limit %d tokens)",
                    self.model_name, self.engine.max_model_len, self.engine.num_pages, self.engine_config.page_size,
                    len(self.auth.tenants), "" if len(self.auth.tenants) == 1 else "s", self.admission.max_tokens)

    async def drain(self, timeout: float | None = None) -> None:
        """Stops admitting, lets open streams finish up to `timeout`, aborts the rest, stops."""
        if self.state in (ServerState.DRAINING, ServerState.STOPPED):
            await self.stopped.wait()
            return
        timeout = self.options.shutdown_timeout if timeout is None else timeout
        self.state = ServerState.DRAINING
        await self.health.enter_graceful_shutdown()
        logger.info("draining: %d requests in flight, up to %.1f s", self.num_streams, timeout)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            if self.loop_runner is not None and not self.loop_runner.dead:
                n = await asyncio.wrap_future(self.loop_runner.abort_all("server shutting down"))
                logger.warning("drain timeout: aborted %d requests", n)
            try:
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except TimeoutError:
                pass
        await self.stop(grace=1.0)

    async def stop(self, grace: float | None = None) -> None:
        if self.state == ServerState.STOPPED:
            return
        self.state = ServerState.STOPPED
        for task in (self._log_task, self._health_task):
            if task is not None:
                task.cancel()
        if self.server is not None:
            await self.server.stop(grace)
        if self.http is not None:
            await self.http.stop(grace if grace is not None else 1.0)
        if self.loop_runner is not None:
            await asyncio.to_thread(self.loop_runner.stop)
        if self.frontend is not None:
            self.frontend.close()
        if self.engine is not None and hasattr(self.engine, "close"):
            try:  # multi-host leader: stops the followers' loops and the heartbeats
                await asyncio.to_thread(self.engine.close)
            except Exception:  # noqa: BLE001
                logger.exception("engine.close failed")
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        self.stopped.set()
        logger.info("stopped")

    # ------------------------------------------------------------------ helpers
    @property
    def model_name(self) -> str:
        return self.engine_config.model or "embedded:SmolLM2-135M-Instruct"

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return self.options.served_model_name or (self.model_name,)

    @property
    def num_in_flight(self) -> int:
        """Requests admitted and not yet done in the engine."""
        return self.admission.total.requests if self.admission is not None else 0

    @property
    def max_prompt_chars(self) -> int:
        if self.options.max_prompt_chars is not None:
            return self.options.max_prompt_chars
        return 32 * self.engine.max_model_len

    def _snapshot(self):
        return self.loop_runner.snapshot if self.loop_runner is not None else None

    def _check_size(self, request) -> None:
        size = request.ByteSize()
        limit = self.options.max_message_bytes
        if size > limit:
            fields = [(f.name, v.ByteSize() if hasattr(v, "ByteSize") else len(v.encode()) if isinstance(v, str)
                       else 0) for f, v in request.ListFields()]
            name = max(fields, key=lambda fv: fv[1])[0] if fields else "request"
            raise ValueError(f"{name}: the request is {size} bytes, over max_message_bytes {limit}")

    async def _caller(self, context) -> Tenant:
        """The calling tenant (the interceptor already refused calls without a valid key)."""
        tenant = self.auth.authenticate(context.invocation_metadata())
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
        return tenant

    def serving_error(self) -> ServeError | None:
        """Why new requests are refused now (UNAVAILABLE / 503), or None when serving."""
        if self.state == ServerState.LOADING:
            return ServeError(ErrorKind.UNAVAILABLE, "the server is loading the model", code="loading")
        if self.state != ServerState.SERVING:
            return ServeError(ErrorKind.UNAVAILABLE, "the server is shutting down", code="draining")
        if self.loop_runner.dead:
            return ServeError(ErrorKind.UNAVAILABLE, f"the engine stopped (error id {self.loop_runner.fatal_error_id}); "
                              "the server is going down", code="engine_stopped")
        if not getattr(self.engine, "healthy", True):
            reason = getattr(self.engine, "unhealthy_reason", None) or "unknown"
            return ServeError(ErrorKind.UNAVAILABLE, f"the engine is unhealthy: {reason}", code="unhealthy")
        return None

    async def _require_serving(self, context) -> None:
        err = self.serving_error()
        if err is not None:
            await _abort(context, err)

    async def _watch_engine_health(self, interval: float = 0.1) -> None:
        """Mirrors `engine.healthy` (a multi-host peer died, ...) and the engine thread's life
        into the health service."""
        while self.state == ServerState.SERVING:
            if self.loop_runner.dead:
                await self._on_engine_dead()
                return
            healthy = bool(getattr(self.engine, "healthy", True))
            if healthy != self._healthy:
                self._healthy = healthy
                await self._set_health(healthy)
                if healthy:
                    logger.info("engine healthy again: serving")
                else:
                    logger.error("engine unhealthy (%s): health NOT_SERVING, new requests refused",
                                 getattr(self.engine, "unhealthy_reason", None))
            await asyncio.sleep(interval)

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for svc in ("", SERVICE_NAME):
            await self.health.set(svc, status)

    async def _on_engine_dead(self) -> None:
        """The engine thread is gone: NOT_SERVING, every open stream ends now, exit non-zero."""
        if self.engine_failed.is_set():
            return
        self.engine_failed.set()
        error_id = self.loop_runner.fatal_error_id or new_error_id()
        if self.loop_runner.fatal is None:
            logger.critical("the engine thread is gone [error id %s]", error_id)
        await self._set_health(False)
        for buf in list(self._buffers):
            buf.push(EngineFailed(error_id, fatal=True))
        self.exit_code = EXIT_ENGINE_FAILED
        logger.critical("health NOT_SERVING: %d open streams ended; the server exits with status %d after the "
                        "drain so that a supervisor restarts it", len(self._buffers), EXIT_ENGINE_FAILED)

    def _enter(self, gen: Generation) -> None:
        self.num_streams += 1
        self._buffers.add(gen.buffer)
        self._idle.clear()

    def _leave(self, gen: Generation) -> None:
        """Called once per Generation, when its front is done with it."""
        self.admission.release(gen.reservation)
        self.num_streams -= 1
        self._buffers.discard(gen.buffer)
        if self.num_streams == 0:
            self._idle.set()

    def tenant_params(self, params: SamplingParams, tenant: Tenant) -> SamplingParams:
        """The client's parameters with its priority clamped to the tenant's range and its
        cache salt moved into the tenant's prefix-cache space."""
        lo, hi = tenant.priority_range or self.options.priority_range
        shared = self.options.shared_prefix_cache or len(self.auth.tenants) == 1
        return dataclasses.replace(params, priority=min(max(params.priority, lo), hi),
                                   cache_salt=tenant.cache_salt(params.cache_salt, shared))

    async def prompt_token_ids(self, tenant: Tenant, text: str | None, ids: list[int] | None,
                               chat: tuple[list[dict[str, Any]], bool] | None, param: str | None = None) -> list[int]:
        """The prompt's ids: given, or tokenized / chat-templated on the front-end pool."""
        if ids is not None:
            return ids
        try:
            if chat is not None:
                return await self.frontend.chat(*chat, owner=tenant.name)
            return await self.frontend.encode(text, owner=tenant.name)
        except ValueError as e:
            raise invalid(str(e), param) from e
        except FrontendBusy as e:
            self.metrics.requests_refused.labels(limit="tokenizer_backlog_chars").inc()
            raise ServeError(ErrorKind.EXHAUSTED, str(e), code="tokenizer_backlog_chars") from e

    async def check_grammar(self, params: SamplingParams, param: str | None = None) -> None:
        """Compiles a structured-output grammar off the event loop (cached for the engine);
        a spec that does not compile is INVALID_ARGUMENT / 400 naming the field."""
        try:
            await asyncio.to_thread(self.engine.validate_structured_outputs, params, GRAMMAR_COMPILE_TIMEOUT_S)
        except ValueError as e:
            raise invalid(str(e), param or "structured_outputs") from e

    async def start_generation(self, tenant: Tenant, request_id: str, params: SamplingParams, ids: list[int], *,
                               text: str | None = None, param: str | None = None,
                               structured_param: str | None = None) -> Generation:
        """Admits one request (reserving its work) and hands it to the engine thread; the
        caller iterates the returned `Generation` inside `async with`. Raises ServeError.
        `structured_param` names the client's field a grammar error is reported against."""
        # Imported with the engine, not with this module (which stays light to import).
        from jaxserve.engine import DuplicateRequestId

        err = self.serving_error()  # again: the drain may have begun while it tokenized
        if err is not None:
            raise err
        if len(ids) >= self.engine.max_model_len:  # refused here, not on the engine thread
            raise invalid(f"prompt is {len(ids)} tokens, which leaves no room for output within "
                          f"max_model_len {self.engine.max_model_len}", param, "context_length_exceeded")
        try:  # a request that can never run is 400 before admission, never a 429 meanwhile
            self.engine.validate(ids, params)
        except ValueError as e:
            raise invalid(str(e)) from e
        if params.structured_outputs is not None:
            await self.check_grammar(params, structured_param)
        try:
            work = request_work(len(ids), params.n, params.max_tokens, self.engine.max_model_len)
            reservation = self.admission.reserve(tenant, work)
        except AdmissionRefused as e:
            self.metrics.requests_refused.labels(limit=e.limit).inc()
            raise ServeError(ErrorKind.EXHAUSTED, str(e), code=e.limit) from e
        key = tenant.request_key(request_id)
        buffer = StreamBuffer(on_engine_done=lambda: self.admission.release(reservation))
        gen = Generation(key, params.n, buffer, reservation, on_close=self._leave,
                         abort=lambda k, ticket: self.loop_runner.abort(k, ticket=ticket),
                         structured_param=structured_param)
        self._enter(gen)
        try:
            await self.loop_runner.add_request(key, params, buffer, prompt=text, prompt_token_ids=ids,
                                               arrival_time=time.monotonic(), ticket=gen.ticket)
        except DuplicateRequestId as e:
            gen.close()
            raise invalid(str(e).replace(repr(key), repr(request_id)), "request_id") from e
        except ValueError as e:
            gen.close()
            raise invalid(str(e).replace(repr(key), repr(request_id))) from e
        except EngineDead as e:
            gen.close()
            raise ServeError(ErrorKind.UNAVAILABLE, str(e), code="engine_stopped") from e
        except Exception as e:
            gen.close()
            error_id = new_error_id()
            logger.exception("admitting %s failed [error id %s]", key, error_id)
            raise ServeError(ErrorKind.INTERNAL, f"could not admit the request (error id {error_id})") from e
        except BaseException:  # cancelled while being admitted: abort it once it is in
            gen.close()
            raise
        return gen

    async def _write(self, context, resp: pb.GenerateResponse, key: str) -> None:
        """Sends one response; a client that reads nothing for `stream_idle_timeout` (its
        HTTP/2 window full) loses the stream, and its request is aborted by the caller."""
        try:
            async with asyncio.timeout(self.options.stream_idle_timeout):
                await context.write(resp)
        except TimeoutError:
            self.metrics.stream_idle_aborts.inc()
            logger.warning("stream %s not read for %.0f s: aborted", key, self.options.stream_idle_timeout)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the stream was not read for {self.options.stream_idle_timeout:g} s "
                                "(stream_idle_timeout)")

    async def _log_loop(self) -> None:
        prev = self.loop_runner.snapshot
        idle_logged = False
        while True:
            await asyncio.sleep(self.options.log_interval)
            snap = self.loop_runner.snapshot
            busy = snap.num_steps != prev.num_steps or snap.num_streams > 0
            if not busy and idle_logged:
                prev = snap
                continue
            idle_logged = not busy
            dt = max(snap.time - prev.time, 1e-9) if busy else self.options.log_interval
            st = snap.stats
            logger.info(
                "gen %.1f tok/s, batched %.1f tok/s, %d finished | running %d, waiting %d, swapped %d | "
                "KV %.1f%% (%d cached free) | prefix hit %.1f%% | preemptions %d | compiles %d",
                (snap.generation_tokens - prev.generation_tokens) / dt,
                (snap.batched_tokens - prev.batched_tokens) / dt,
                snap.num_finished - prev.num_finished, st.num_running, st.num_waiting, st.num_swapped,
                100 * st.kv_usage, st.num_cached_free_blocks, 100 * st.prefix_cache_hit_rate,
                st.num_preemptions, self.metrics.num_compilations_after_warmup)
            prev = snap

    # ------------------------------------------------------------------ RPCs
    @_internal_errors
    async def Generate(self, request: pb.GenerateRequest, context) -> None:
        tenant = await self._caller(context)
        await self._require_serving(context)
        rid = request.request_id or uuid.uuid4().hex
        try:
            self._check_size(request)
            if len(request.request_id) > MAX_REQUEST_ID_CHARS:
                raise ValueError(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters")
            params = self.tenant_params(sampling_params_from_proto(request.sampling_params), tenant)
            text, ids, chat = check_input(request, self.max_prompt_chars, self.engine.max_model_len)
        except ValueError as e:
            await _abort(context, invalid(str(e)))
        try:
            ids = await self.prompt_token_ids(tenant, text, ids, chat)
            gen = await self.start_generation(tenant, rid, params, ids, text=text)
        except ServeError as e:
            await _abort(context, e)
        async with gen:
            reported: set[int] = set()
            try:
                async for out in gen:
                    await self._write(context, output_to_proto(out, reported, request_id=rid), gen.key)
            except ServeError as e:
                await _abort(context, e)

    @_internal_errors
    async def Tokenize(self, request: pb.TokenizeRequest, context):
        tenant = await self._caller(context)
        await self._require_serving(context)
        try:
            self._check_size(request)
            text, _, chat = check_input(request, self.max_prompt_chars, 1 << 62)
        except ValueError as e:
            await _abort(context, invalid(str(e)))
        try:
            ids = await self.prompt_token_ids(tenant, text, None, chat)
        except ServeError as e:
            await _abort(context, e)
        self.metrics.tokenize_requests.inc()
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    @_internal_errors
    async def GetModelInfo(self, request, context):
        await self._caller(context)
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading the model")
        e = self.engine
        mc = e.model_config
        return pb.ModelInfo(
            model=self.model_name, architecture=type(mc).__name__, vocab_size=mc.vocab_size,
            max_model_len=e.max_model_len, num_layers=getattr(mc, "num_layers", getattr(mc, "num_hidden_layers", 0)),
            hidden_size=getattr(mc, "hidden_size", getattr(mc, "embed_dim", 0)), dtype=e.dtype,
            eos_token_id=e.eos_token_id if e.eos_token_id is not None else -1,
            has_chat_template=bool(getattr(e.tokenizer, "chat_template", None)),
            max_logprobs=self.engine_config.max_logprobs, max_n=self.engine_config.max_n,
        )

    def _attention_info(self) -> dict[str, str]:
        """The attention implementation the engine runs (and why), once it is loaded."""
        attention = getattr(self.engine, "attention", None)
        return {"attention_implementation": f"{attention[0]} ({attention[1]})"} if attention else {}

    @_internal_errors
    async def GetServerInfo(self, request, context):
        """Server-wide engine state for admin tenants; others see the state and their own
        requests in flight only (the rest would tell them about the other tenants' load)."""
        tenant = await self._caller(context)
        info = pb.ServerInfo(version=VERSION, state=self.state, uptime_s=time.monotonic() - self._started,
                             max_queued_requests=self.options.max_queued_requests)
        if not tenant.admin:
            info.num_in_flight = self.admission.usage(tenant.name)[0] if self.admission is not None else 0
            return info
        info.engine_config.update({**{f.name: str(getattr(self.engine_config, f.name))
                                      for f in dataclasses.fields(self.engine_config)}, **self._attention_info()})
        info.num_in_flight = self.num_in_flight
        info.compilations_after_warmup = self.metrics.num_compilations_after_warmup
        snap = self._snapshot()
        if snap is not None:
            st = snap.stats
            info.num_running, info.num_waiting, info.num_swapped = st.num_running, st.num_waiting, st.num_swapped
            info.num_used_blocks, info.num_free_blocks = st.num_used_blocks, st.num_free_blocks
            info.num_cached_free_blocks, info.num_total_blocks = st.num_cached_free_blocks, st.num_total_blocks
            info.kv_cache_usage = st.kv_usage
            info.prefix_cache_queries, info.prefix_cache_hits = st.prefix_cache_queries, st.prefix_cache_hits
            info.num_preemptions = st.num_preemptions
        return info

    @_internal_errors
    async def Abort(self, request: pb.AbortRequest, context):
        """Aborts the caller's own request of that id (another tenant's is never found)."""
        tenant = await self._caller(context)
        await self._require_serving(context)
        found = await asyncio.wrap_future(
            self.loop_runner.abort(tenant.request_key(request.request_id), notify="aborted by client"))
        return pb.AbortResponse(found=found)


async def _abort(context, err: ServeError) -> None:
    await context.abort(getattr(grpc.StatusCode, err.kind.grpc_code_name), err.message)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


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
