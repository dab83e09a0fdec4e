"""The HTTP/1 connection's own limits, before any route runs (uvicorn's httptools protocol,
extended).

uvicorn bounds neither the size of a request head nor the time a client may take to send
it (with httptools), and its one concurrency cap counts idle connections with requests and
answers in plain text: a few hundred connections that never finish a head (and never show a
key) would refuse every tenant. Here:

- **Request head**: at most `max_head_bytes` (request line and headers) and
  `head_timeout` seconds from the connection (or the previous response) to the end of the
  headers; past either the answer is 431 or 408 and the connection is closed.
- **Pending connections**: a connection is pending until it has sent a complete request head
  that `proves` accepts (one carrying a valid API key; any head when no keys are required).
  One address may hold `max_connections_per_peer` pending connections; a new one past that
  dooms the address's OLDEST pending connection: unless that one proves itself within
  `pending_grace` seconds of its own start, it is closed (503). Stalled or keyless connections
  behind a proxy or NAT thus make room for the proxy's next client instead of locking it out,
  while a burst of clients that all connect at once and then send their requests (a benchmark
  client opening hundreds of connections together) loses none: each proves itself in
  milliseconds. A
  connection that has proven itself is never counted per address: authenticated requests are
  bounded per tenant by admission (429), never by the address they come from. What one address
  can still do: hold `max_connections_per_peer` pending connections, each for at most
  `head_timeout` seconds, and more for `pending_grace` seconds each, up to `max_connections` (the head deadline, re-armed after every response, also ends idle
  keep-alive connections); that cannot refuse anyone else's request.
- **All connections**: at most `max_connections`; the next is answered 503 at once and closed.
- **HTTP/1.0**: a response without Content-Length (a stream) is sent as is and ended by
  closing the connection (RFC 9112 forbids chunked coding towards a 1.0 client).

Refusals are OpenAI's error JSON, like every other error of the HTTP front.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

_FIRST_READ = 256 * 1024  # asyncio's largest single read: a body may come in it with its head


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    max_head_bytes: int = 64 * 1024
    head_timeout: float = 10.0
    max_connections_per_peer: int = 64  # pending (not yet proven) connections one address may hold
    pending_grace: float = 2.0  # seconds a doomed pending connection has, from its start, to prove itself
    max_connections: int | None = None  # all peers together; None: no cap
    # A complete request head's (name, value) pairs (lower-case names) -> whether it proves its
    # connection (a valid API key); None: any complete head does.
    proves: Callable[[list[tuple[bytes, bytes]]], bool] | None = None


def refusal(status: int, reason: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 response carrying OpenAI's error JSON; the connection closes."""
    kind = "service_unavailable_error" if status == 503 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class _CloseDelimitedCycle(RequestResponseCycle):
    """An HTTP/1.0 request's cycle: a response without Content-Length goes out unframed and
    the connection closes at its end (uvicorn would use chunked coding)."""

    _close_delimited = False

    async def send(self, message: Any) -> None:
        if message["type"] == "http.response.start" and not self.response_started:
            names = {bytes(k).lower() for k, _ in message.get("headers", [])}
            if b"content-length" not in names and self.scope["method"] != "HEAD":
                self._close_delimited = True
                self.chunked_encoding = False  # uvicorn then writes no transfer-encoding header
                self.keep_alive = False
            return await super().send(message)
        if not self._close_delimited or message["type"] != "http.response.body" or self.response_complete:
            return await super().send(message)
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if message.get("body"):
            self.transport.write(message["body"])
        if not message.get("more_body", False):
            self.response_complete = True
            self.message_event.set()
            self.transport.close()
            self.on_response()


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `ConnectionLimits` (set by `with_limits`)."""

    limits = ConnectionLimits()
    # peer address -> its pending connections, oldest first (replaced per server by with_limits)
    _pending: dict[str, dict[LimitedHttpProtocol, None]] = {}

    @classmethod
    def with_limits(cls, limits: ConnectionLimits) -> type[LimitedHttpProtocol]:
        """A protocol class for one server: its limits and its own pending connections."""
        return type("LimitedHttpProtocol", (cls,), {"limits": limits, "_pending": {}})

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._peer = self.client[0] if self.client else None
        self._head_bytes = self._raw_head_bytes = 0
        self._head_timer = None
        self._refused = False
        self._doomed = False
        self._started = self.loop.time()
        cap = self.limits.max_connections
        if cap is not None and len(self.connections) > cap:
            return self._refuse(503, "Service Unavailable", f"the server has {cap} connections open; retry later",
                                "max_connections")
        if self._peer is not None:
            pending = self._pending.setdefault(self._peer, {})
            pending[self] = None
            if len(pending) > self.limits.max_connections_per_peer:
                self._doom_oldest(pending)
        self._arm_head_timer()

    def _doom_oldest(self, pending: dict[LimitedHttpProtocol, None]) -> None:
        """The oldest pending connection not yet doomed is closed unless it proves itself within
        `pending_grace` seconds of its start (a client that connected a moment ago and is sending
        its request is not closed for a newer one's sake)."""
        for conn in pending:
            if conn is not self and not conn._doomed:
                conn._doomed = True
                delay = max(0.0, conn._started + self.limits.pending_grace - self.loop.time())
                self.loop.call_later(delay, conn._evict_if_pending)
                return

    def _evict_if_pending(self) -> None:
        if self._peer is None or self not in self._pending.get(self._peer, {}) or self._refused:
            return  # proved itself, or gone
        self._refuse(503, "Service Unavailable",
                     f"closed to make room: this address holds more than {self.limits.max_connections_per_peer} "
                     "connections that have not sent an authenticated request", "max_connections_per_peer")
        self._leave_pending()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        self._leave_pending()
        self._peer = None
        super().connection_lost(exc)

    def _leave_pending(self) -> None:
        pending = self._pending.get(self._peer) if self._peer is not None else None
        if pending is not None:
            pending.pop(self, None)
            if not pending:
                del self._pending[self._peer]

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        # The parser keeps a header's bytes until the header ends, so the exact count
        # (on_header) alone would let one endless header grow: bound the raw bytes taken while
        # no request is in progress too (with room for a body sent along with its head).
        if self.cycle is None or self.cycle.response_complete:
            self._raw_head_bytes += len(data)
            if self._raw_head_bytes > 4 * self.limits.max_head_bytes + _FIRST_READ:
                return self._refuse(431, "Request Header Fields Too Large",
                                    f"the request head is over {self.limits.max_head_bytes} bytes",
                                    "request_head_too_large")
        else:
            self._raw_head_bytes = 0
        super().data_received(data)

    # The head's bytes as the parser hands them over (request line and headers).
    def on_message_begin(self) -> None:
        self._head_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        if not self._refused:
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)
        if not self._refused:
            super().on_header(name, value)

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self.limits.max_head_bytes and not self._refused:
            self._refuse(431, "Request Header Fields Too Large",
                         f"the request head is over {self.limits.max_head_bytes} bytes", "request_head_too_large")

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._cancel_head_timer()
        if self.limits.proves is None or self.limits.proves(self.headers):
            self._leave_pending()
        super().on_headers_complete()
        if self.scope.get("http_version") == "1.0" and type(self.cycle) is RequestResponseCycle:
            self.cycle.__class__ = _CloseDelimitedCycle  # before its task first runs

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        self._raw_head_bytes = 0
        super().on_response_complete()
        # The next request's head is timed from here, unless one is in progress (pipelined).
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self._refuse(408, "Request Timeout",
                         f"the request head did not arrive within {self.limits.head_timeout:g} s", "request_timeout")

    def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
        self._refused = True
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self.transport.write(refusal(status, reason, message, code))
            self.transport.close()
