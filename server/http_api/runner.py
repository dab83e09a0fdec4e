"""uvicorn inside the server's own event loop, beside the gRPC server.

One loop serves both fronts, so an HTTP handler reaches the engine thread, the admission
counters and the stream buffers exactly as a gRPC handler does (no cross-thread hops).
uvicorn normally owns the process's signals; here `serve()` owns them (SIGTERM drains both
fronts), so its signal capture is turned off. The socket is bound before uvicorn starts, so
the port is known (and a taken port fails) at `start()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn

from server.http_api.connection import ConnectionLimits, LimitedHttpProtocol

logger = logging.getLogger("jaxserve.server")


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the jaxserve server handles SIGTERM / SIGINT
        yield


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"could not bind HTTP {host}:{port}: {e.strerror or e}") from e
    sock.set_inheritable(True)
    return sock


class HttpServer:
    def __init__(self, app, host: str, port: int, *, tls_cert_file: str | None = None,
                 tls_key_file: str | None = None, tls_client_ca_file: str | None = None,
                 keepalive_timeout: float = 5.0, limits: ConnectionLimits | None = None):
        self.app, self.host, self.requested_port = app, host, port
        self.port: int | None = None
        self._tls = (tls_cert_file, tls_key_file, tls_client_ca_file)
        self._keepalive_timeout = keepalive_timeout
        self._limits = limits or ConnectionLimits()
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        sock = _bind(self.host, self.requested_port)
        self.port = sock.getsockname()[1]
        cert, key, ca = self._tls
        config = uvicorn.Config(
            self.app, log_config=None, access_log=False, lifespan="off", ws="none",
            timeout_keep_alive=max(1, int(self._keepalive_timeout)), server_header=False,
            http=LimitedHttpProtocol.with_limits(self._limits),  # head size and time, connection caps
            ssl_certfile=cert, ssl_keyfile=key, ssl_ca_certs=ca,
            ssl_cert_reqs=ssl.CERT_REQUIRED if ca else ssl.CERT_NONE)
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():  # failed to start: surface its error
                self._task.result()
                raise OSError(f"the HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self, grace: float = 1.0) -> None:
        """Closes the listener, gives open connections `grace` seconds, then closes them."""
        if self._server is None or self._task is None:
            return
        self._server.config.timeout_graceful_shutdown = max(grace, 0.01)
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), grace + 5.0)
        except TimeoutError:
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        except Exception:  # noqa: BLE001
            logger.exception("the HTTP server stopped with an error")
