"""The gRPC interceptor that decides, before any work, whether a call may run.

A call to the API without a valid key is answered UNAUTHENTICATED by a handler whose request
deserializer ignores the body: the message is never parsed. Health checks and reflection
stay open, so load balancers and grpcurl can probe, but at most `max_open_calls` of them run
at once (a flood of Health.Watch streams is refused with RESOURCE_EXHAUSTED). An authenticated
connection may have `max_streams_per_connection` API calls open; past it a call is refused with
RESOURCE_EXHAUSTED naming the limit (the HTTP/2 transport itself sets no stream limit, which
would reset streams without a reason).
"""

from __future__ import annotations

import inspect
from typing import Any

import grpc

from server.tenants import Authenticator

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _kind(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming:
        return "stream_stream" if handler.response_streaming else "stream_unary"
    return "unary_stream" if handler.response_streaming else "unary_unary"


def _ignore_body(_: bytes) -> None:
    return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, auth: Authenticator, max_open_calls: int = 64, on_denied: Any = None,
                 on_open_refused: Any = None, max_streams_per_connection: int = 128,
                 on_stream_refused: Any = None):
        self.auth = auth
        self.max_open_calls = max_open_calls
        self.open_calls = 0
        self.max_streams_per_connection = max_streams_per_connection
        self.connection_calls: dict[str, int] = {}  # peer (address:port, one per connection) -> open API calls
        self._on_stream_refused = on_stream_refused
        self._on_denied = on_denied  # called once per call refused for its key (metrics)
        self._on_open_refused = on_open_refused  # once per health / reflection call over the bound

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None:
            return None
        kind = _kind(handler)
        make = getattr(grpc, f"{kind}_rpc_method_handler")
        behaviour = getattr(handler, kind)
        if details.method.startswith(OPEN_PREFIXES):
            return make(self._bounded(behaviour), request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
        if self.auth.authenticate(details.invocation_metadata) is not None:
            return make(self._per_connection(behaviour), request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)
        if self._on_denied is not None:
            self._on_denied()

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")

        return make(deny, request_deserializer=_ignore_body, response_serializer=handler.response_serializer)

    def _bounded(self, behaviour: Any) -> Any:
        async def run(request, context):
            if self.open_calls >= self.max_open_calls:
                if self._on_open_refused is not None:
                    self._on_open_refused()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"{self.open_calls} health / reflection calls are open (max {self.max_open_calls})")
            self.open_calls += 1
            try:
                return await _run(behaviour, request, context)
            finally:
                self.open_calls -= 1

        return run

    def _per_connection(self, behaviour: Any) -> Any:
        async def run(request, context):
            peer = context.peer()
            open_calls = self.connection_calls.get(peer, 0)
            if open_calls >= self.max_streams_per_connection:
                if self._on_stream_refused is not None:
                    self._on_stream_refused()
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"{open_calls} calls are open on this connection (max "
                                    f"{self.max_streams_per_connection}, --max-concurrent-streams); "
                                    "open another connection or wait for one to end")
            self.connection_calls[peer] = open_calls + 1
            try:
                return await _run(behaviour, request, context)
            finally:
                left = self.connection_calls[peer] - 1
                if left:
                    self.connection_calls[peer] = left
                else:
                    del self.connection_calls[peer]

        return run


async def _run(behaviour: Any, request: Any, context: Any) -> Any:
    """One call of a handler's behaviour, whichever of the forms grpc.aio allows it has."""
    result = behaviour(request, context)
    if inspect.isasyncgen(result):
        async for item in result:
            await context.write(item)
        return None
    return await result if inspect.isawaitable(result) else result
