"""The gRPC server: an asyncio (`grpc.aio`) front over one engine thread.

Life cycle: `start()` binds the port with health NOT_SERVING, `load()` builds the engine and
compiles every shape on a worker thread, then health turns SERVING. `drain()` (SIGTERM) turns
health NOT_SERVING, refuses new requests with UNAVAILABLE, waits for in-flight requests up to
the shutdown timeout, aborts the rest and stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import os
import time
import uuid
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxserve.config import EngineConfig
from jaxserve.outputs import RequestOutput
from server.convert import (
    MAX_REQUEST_ID_CHARS,
    check_input,
    output_to_proto,
    sampling_params_from_proto,
)
from server.engine_loop import Aborted, EngineFailed, EngineLoop, apply_chat_template
from server.metrics import ServerMetrics
from server.proto import jaxserve_pb2 as pb
from server.proto import jaxserve_pb2_grpc as pb_grpc

logger = logging.getLogger("jaxserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name
VERSION = "0.1.0"


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: pick a free port
    metrics_port: int = 8001  # 0: pick a free port; -1: no metrics endpoint
    api_key: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # set: clients must present a certificate (mTLS)
    max_queued_requests: int = 256  # requests allowed to wait beyond max_num_seqs
    shutdown_timeout: float = 30.0
    max_prompt_chars: int | None = None  # None: 32 x max_model_len
    max_message_bytes: int = 4 * 2**20
    log_interval: float = 1.0  # seconds between status lines; 0: off
    warmup: bool = True
    require_warm_cache: bool = False  # refuse to start when any planned shape missed the cache


class ServerState:
    LOADING, SERVING, DRAINING, STOPPED = "loading", "serving", "draining", "stopped"


class _ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer KEY` (or `x-api-key: KEY`) metadata.
    Health checks and reflection stay open so load balancers can probe."""

    OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, key: str):
        self._key = key.encode()

    def _ok(self, metadata: Any) -> bool:
        for k, v in metadata or ():
            if isinstance(v, bytes):
                continue
            if k == "authorization" and v.startswith("Bearer "):
                v = v[len("Bearer "):]
            elif k != "x-api-key":
                continue
            if hmac.compare_digest(v.encode(), self._key):
                return True
        return False

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(self.OPEN) or self._ok(details.invocation_metadata):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")

        kind = ("unary_unary" if not handler.request_streaming and not handler.response_streaming else
                "unary_stream" if handler.response_streaming and not handler.request_streaming else
                "stream_unary" if not handler.response_streaming else "stream_stream")
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


class JaxServeServer(pb_grpc.JaxServeServicer):
    def __init__(self, engine_config: EngineConfig, options: ServerOptions | None = None, *, engine: Any = None):
        self.engine_config = engine_config
        self.options = options or ServerOptions()
        self.engine = engine
        self.loop_runner: EngineLoop | None = None
        self.state = ServerState.LOADING
        self.metrics = ServerMetrics(snapshot=self._snapshot)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._metrics_http: Any = None
        self.num_in_flight = 0
        self.max_queued_requests = self.options.max_queued_requests
        self._started = time.monotonic()
        self._log_task: asyncio.Task | None = None
        self._health_task: asyncio.Task | None = None
        self._healthy = True
        self._idle = asyncio.Event()
        self._idle.set()
        self.stopped = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> int:
        """Binds the ports; health is NOT_SERVING until `load()` finishes. Returns the port."""
        o = self.options
        interceptors = [_ApiKeyInterceptor(o.api_key)] if o.api_key else []
        self.server = grpc.aio.server(interceptors=interceptors, options=[
            # gRPC itself refuses (RESOURCE_EXHAUSTED) only far past the limit; up to there the
            # handlers answer INVALID_ARGUMENT naming the oversized field (`_check_size`).
            ("grpc.max_receive_message_length", 4 * o.max_message_bytes),
            ("grpc.max_send_message_length", o.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ])
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
        if o.metrics_port >= 0:
            from prometheus_client import start_http_server
            self._metrics_http, _ = start_http_server(o.metrics_port, addr=o.host, registry=self.metrics.registry)
            self.metrics_port = self._metrics_http.server_port
        logger.info("listening on %s:%d (%s)%s", o.host, self.port, "TLS" if o.tls_cert_file else "insecure",
                    f", metrics on http://{o.host}:{self.metrics_port}/metrics" if self.metrics_port else "")
        return self.port

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
        self.loop_runner = EngineLoop(self.engine, asyncio.get_running_loop(), self.metrics)
        self.loop_runner.start()
        self.metrics.set_engine_thread(self.loop_runner.thread)
        self.state = ServerState.SERVING
        for svc in ("", SERVICE_NAME):
            await self.health.set(svc, health_pb2.HealthCheckResponse.SERVING)
        if self.options.log_interval > 0:
            self._log_task = asyncio.create_task(self._log_loop())
        self._health_task = asyncio.create_task(self._watch_engine_health())
        logger.info("serving %s (max_model_len %d, %d KV pages of %d tokens)", self.model_name,
                    self.engine.max_model_len, self.engine.num_pages, self.engine_config.page_size)

    async def drain(self, timeout: float | None = None) -> None:
        """Stops admitting, lets in-flight requests finish up to `timeout`, aborts the rest, stops."""
        if self.state in (ServerState.DRAINING, ServerState.STOPPED):
            await self.stopped.wait()
            return
        timeout = self.options.shutdown_timeout if timeout is None else timeout
        self.state = ServerState.DRAINING
        await self.health.enter_graceful_shutdown()
        logger.info("draining: %d requests in flight, up to %.1f s", self.num_in_flight, timeout)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            if self.loop_runner is not None:
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
        if self.loop_runner is not None:
            await asyncio.to_thread(self.loop_runner.stop)
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
    def max_in_flight(self) -> int:
        return self.engine_config.max_num_seqs + self.max_queued_requests

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

    async def _require_serving(self, context) -> None:
        if self.state == ServerState.LOADING:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading the model")
        if self.state != ServerState.SERVING:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if not getattr(self.engine, "healthy", True):
            reason = getattr(self.engine, "unhealthy_reason", None) or "unknown"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine is unhealthy: {reason}")

    async def _watch_engine_health(self, interval: float = 0.25) -> None:
        """Mirrors `engine.healthy` (a multi-host peer died, ...) into the health service."""
        while self.state == ServerState.SERVING:
            healthy = bool(getattr(self.engine, "healthy", True))
            if healthy != self._healthy:
                self._healthy = healthy
                status = (health_pb2.HealthCheckResponse.SERVING if healthy
                          else health_pb2.HealthCheckResponse.NOT_SERVING)
                for svc in ("", SERVICE_NAME):
                    await self.health.set(svc, status)
                if healthy:
                    logger.info("engine healthy again: serving")
                else:
                    logger.error("engine unhealthy (%s): health NOT_SERVING, new requests refused",
                                 getattr(self.engine, "unhealthy_reason", None))
            await asyncio.sleep(interval)

    def _enter(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()

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
    async def Generate(self, request: pb.GenerateRequest, context):
        await self._require_serving(context)
        if self.num_in_flight >= self.max_in_flight:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"server queue is full ({self.num_in_flight} requests in flight, "
                                f"max_num_seqs + max_queued_requests = {self.max_in_flight})")
        try:
            self._check_size(request)
            if len(request.request_id) > MAX_REQUEST_ID_CHARS:
                raise ValueError(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters")
            params = sampling_params_from_proto(request.sampling_params)
            text, ids, chat = check_input(request, self.max_prompt_chars, self.engine.max_model_len)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id or uuid.uuid4().hex
        arrival = time.monotonic()
        self._enter()
        ticket = object()
        done = False
        try:
            try:
                q = await self.loop_runner.add_request(rid, params, prompt=text, prompt_token_ids=ids,
                                                       chat=chat, arrival_time=arrival, ticket=ticket)
            except ValueError as e:
                done = True
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except Exception as e:
                done = True
                logger.exception("add_request failed")
                await context.abort(grpc.StatusCode.INTERNAL, f"could not admit the request: {e}")
            reported: set[int] = set()
            while True:
                item = await q.get()
                if isinstance(item, RequestOutput):
                    if item.finished and item.error is not None:  # its device step failed
                        done = True
                        await context.abort(grpc.StatusCode.INTERNAL, f"engine failure: {item.error}")
                    resp = output_to_proto(item, reported)
                    if item.finished:
                        done = True
                    yield resp
                    if done:
                        return
                elif isinstance(item, Aborted):
                    done = True
                    resp = pb.GenerateResponse(request_id=rid, finished=True)
                    for i in range(params.n):
                        if i not in reported:
                            resp.outputs.add(index=i, finish_reason="abort")
                    yield resp
                    return
                elif isinstance(item, EngineFailed):
                    done = True
                    await context.abort(grpc.StatusCode.INTERNAL, f"engine failure: {item}")
        finally:
            self._leave()
            if not done:
                # Cancelled, disconnected or past its deadline (maybe while being admitted):
                # abort this RPC's request so its KV blocks are free by the next step.
                self.loop_runner.abort(rid, ticket=ticket)

    async def Tokenize(self, request: pb.TokenizeRequest, context):
        await self._require_serving(context)
        try:
            self._check_size(request)
            text, _, chat = check_input(request, self.max_prompt_chars, 1 << 62)
            if chat is not None:
                ids = await self.loop_runner.call(lambda e: apply_chat_template(e.tokenizer, chat[0], chat[1]))
            else:
                ids = await self.loop_runner.call(lambda e: e.tokenize(text))
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    async def GetModelInfo(self, request, context):
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

    async def GetServerInfo(self, request, context):
        info = pb.ServerInfo(
            version=VERSION, state=self.state, uptime_s=time.monotonic() - self._started,
            engine_config={**{f.name: str(getattr(self.engine_config, f.name))
                              for f in dataclasses.fields(self.engine_config)},
                           **self._attention_info()},
            num_in_flight=self.num_in_flight, max_queued_requests=self.max_queued_requests,
            compilations_after_warmup=self.metrics.num_compilations_after_warmup,
        )
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

    async def Abort(self, request: pb.AbortRequest, context):
        await self._require_serving(context)
        found = await asyncio.wrap_future(self.loop_runner.abort(request.request_id, notify="aborted by client"))
        return pb.AbortResponse(found=found)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def serve(engine_config: EngineConfig, options: ServerOptions) -> int:
    """Runs a server until SIGTERM / SIGINT, then drains. Returns the exit code."""
    import signal

    srv = JaxServeServer(engine_config, options)
    await srv.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    load = asyncio.create_task(srv.load())
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({load, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        waiter.cancel()
        await srv.stop()
        raise load.exception()
    if not stop.is_set():
        await stop.wait()
    logger.info("signal received: shutting down")
    if not load.done():
        # Still loading / compiling on a worker thread that cannot be interrupted, and that
        # asyncio.run would wait for: nothing is in flight, so exit the process right here.
        await srv.stop()
        logging.shutdown()
        os._exit(0)
    await srv.drain()
    return 0
