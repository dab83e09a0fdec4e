"""The gRPC front: `grpc.aio` server, health and reflection services, and the JaxServe
servicer, a thin adapter over `ServingCore`.

Each RPC authenticates (the interceptor already refused calls without a valid key, before
the body was parsed), parses its message into the core's types (`server/convert.py`), calls
the core and renders the result, or a `ServeError` as the status of its kind. Streamed
writes are bounded by `stream_idle_timeout`: a client that reads nothing that long loses
the stream (DEADLINE_EXCEEDED) and its request is aborted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from server.auth import AuthInterceptor
from server.convert import output_to_proto, prompt_from_proto, sampling_params_from_proto
from server.core import ServingCore
from server.core_types import GenerateInput
from server.engine_loop import new_error_id
from server.errors import ServeError, invalid
from server.proto import jaxserve_pb2 as pb
from server.proto import jaxserve_pb2_grpc as pb_grpc
from server.tenants import Tenant

logger = logging.getLogger("jaxserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["JaxServe"].full_name


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


async def _abort(context, err: ServeError) -> None:
    await context.abort(getattr(grpc.StatusCode, err.kind.grpc_code_name), err.message)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class GrpcFront(pb_grpc.JaxServeServicer):
    def __init__(self, core: ServingCore):
        self.core = core
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        core.on_health_change(self.set_health)

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> int:
        """Binds the port with health NOT_SERVING (the core turns it SERVING once loaded)."""
        o = self.core.options
        self.interceptor = AuthInterceptor(
            self.core.auth, o.max_open_calls, on_denied=self.core.count_auth_failure,
            on_open_refused=lambda: self.core.count_refusal("max_open_calls"),
            max_streams_per_connection=o.max_concurrent_streams,
            on_stream_refused=lambda: self.core.count_refusal("max_concurrent_streams"))
        self.server = grpc.aio.server(interceptors=[self.interceptor], options=o.grpc_options())
        pb_grpc.add_JaxServeServicer_to_server(self, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server)
        await self.set_health(False)
        addr = f"{o.host}:{o.port}"
        try:
            if o.tls_cert_file:
                creds = grpc.ssl_server_credentials(
                    [(_read(o.tls_key_file), _read(o.tls_cert_file))],
                    root_certificates=_read(o.tls_client_ca_file) if o.tls_client_ca_file else None,
                    require_client_auth=bool(o.tls_client_ca_file))
                self.port = self.server.add_secure_port(addr, creds)
            else:
                self.port = self.server.add_insecure_port(addr)
        except RuntimeError as e:
            raise OSError(f"could not bind {addr}: {e}") from e
        if not self.port:
            raise OSError(f"could not bind {addr}")
        await self.server.start()
        return self.port

    async def set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for svc in ("", SERVICE_NAME):
            await self.health.set(svc, status)

    async def enter_graceful_shutdown(self) -> None:
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float | None) -> None:
        if self.server is not None:
            await self.server.stop(grace)

    # ------------------------------------------------------------------ helpers
    async def _caller(self, context) -> Tenant:
        """The calling tenant (the interceptor already refused calls without a valid key)."""
        tenant = self.core.auth.authenticate(context.invocation_metadata())
        if tenant is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
        return tenant

    async def _require_serving(self, context) -> None:
        err = self.core.serving_error()
        if err is not None:
            await _abort(context, err)

    def _check_size(self, request) -> None:
        size = request.ByteSize()
        limit = self.core.options.max_message_bytes
        if size > limit:
            fields = [(f.name, v.ByteSize() if hasattr(v, "ByteSize") else len(v.encode()) if isinstance(v, str)
                       else 0) for f, v in request.ListFields()]
            name = max(fields, key=lambda fv: fv[1])[0] if fields else "request"
            raise ValueError(f"{name}: the request is {size} bytes, over max_message_bytes {limit}")

    async def _write(self, context, resp: pb.GenerateResponse, key: str) -> None:
        """Sends one response; a client that reads nothing for `stream_idle_timeout` (its
        HTTP/2 window full) loses the stream, and its request is aborted by the caller."""
        timeout = self.core.options.stream_idle_timeout
        try:
            async with asyncio.timeout(timeout):
                await context.write(resp)
        except TimeoutError:
            self.core.count_stream_idle_abort()
            logger.warning("stream %s not read for %.0f s: aborted", key, timeout)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the stream was not read for {timeout:g} s (stream_idle_timeout)")

    # ------------------------------------------------------------------ RPCs
    @_internal_errors
    async def Generate(self, request: pb.GenerateRequest, context) -> None:
        tenant = await self._caller(context)
        await self._require_serving(context)
        rid = request.request_id or uuid.uuid4().hex
        try:
            self._check_size(request)
            req = GenerateInput(rid, prompt_from_proto(request), sampling_params_from_proto(request.sampling_params),
                                lora_name=request.lora_name or None)
        except ValueError as e:
            await _abort(context, invalid(str(e)))
        try:
            gen = await self.core.generate(tenant, req)
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
            prompt = prompt_from_proto(request)
        except ValueError as e:
            await _abort(context, invalid(str(e)))
        try:
            ids = await self.core.tokenize(tenant, prompt)
        except ServeError as e:
            await _abort(context, e)
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    @_internal_errors
    async def GetModelInfo(self, request, context):
        await self._caller(context)
        info = self.core.model_info()
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is loading the model")
        return pb.ModelInfo(**dataclasses.asdict(info))

    @_internal_errors
    async def GetServerInfo(self, request, context):
        tenant = await self._caller(context)
        info = self.core.server_info(tenant)
        return pb.ServerInfo(**{k: v for k, v in dataclasses.asdict(info).items() if v is not None})

    @_internal_errors
    async def Abort(self, request: pb.AbortRequest, context):
        tenant = await self._caller(context)
        try:
            found = await self.core.abort(tenant, request.request_id)
        except ServeError as e:
            await _abort(context, e)
        return pb.AbortResponse(found=found)

    @_internal_errors
    async def UpdateWeights(self, request: pb.UpdateWeightsRequest, context):
        tenant = await self._caller(context)
        try:
            version = await self.core.update_weights(tenant, request.path)
        except ServeError as e:
            await _abort(context, e)
        return pb.UpdateWeightsResponse(weights_version=version)

    @_internal_errors
    async def LoadLoRAAdapter(self, request: pb.LoadLoRAAdapterRequest, context):
        tenant = await self._caller(context)
        try:
            await self.core.load_lora(tenant, request.lora_name, request.lora_path)
        except ServeError as e:
            await _abort(context, e)
        return pb.LoRAAdapterResponse()

    @_internal_errors
    async def UnloadLoRAAdapter(self, request: pb.UnloadLoRAAdapterRequest, context):
        tenant = await self._caller(context)
        try:
            await self.core.unload_lora(tenant, request.lora_name)
        except ServeError as e:
            await _abort(context, e)
        return pb.LoRAAdapterResponse()

    @_internal_errors
    async def ListLoRAAdapters(self, request: pb.ListLoRAAdaptersRequest, context):
        tenant = await self._caller(context)
        return pb.ListLoRAAdaptersResponse(lora_names=[lr.lora_name for lr in self.core.lora_adapters(tenant)])
