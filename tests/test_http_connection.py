"""The HTTP front's connection limits (server/http_api/connection.py) on a small app: request
head size and time, connections per peer, HTTP/1.0 streams without chunked coding."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from server.http_api.connection import ConnectionLimits
from server.http_api.runner import HttpServer

LIMITS = ConnectionLimits(max_head_bytes=2048, head_timeout=0.5, max_connections_per_peer=4, pending_grace=0.2,
                          max_connections=64)


async def _json(request):
    return JSONResponse({"ok": True})


async def _stream(request):
    async def parts():
        for i in range(3):
            yield f"part {i}\n".encode()
            await asyncio.sleep(0.01)
    return StreamingResponse(parts(), media_type="text/plain")


@pytest.fixture(scope="module")
def server():
    app = Starlette(routes=[Route("/json", _json), Route("/stream", _stream)])
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    http = HttpServer(app, "127.0.0.1", 0, limits=LIMITS)
    port = asyncio.run_coroutine_threadsafe(http.start(), loop).result(10)
    yield port
    asyncio.run_coroutine_threadsafe(http.stop(0.1), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _raw(port: int, data: bytes, source: str = "127.0.0.1", wait: float = 5.0) -> bytes:
    """Sends `data` and reads until the server closes (or `wait` passes)."""
    out = b""
    with socket.create_connection(("127.0.0.1", port), source_address=(source, 0), timeout=wait) as s:
        try:
            s.sendall(data)
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        except (ConnectionResetError, BrokenPipeError):  # closed while we still sent: reset
            out += b"<reset>"
    return out


def _error(resp: bytes) -> tuple[int, dict]:
    head, _, body = resp.removesuffix(b"<reset>").partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)["error"]


def test_a_head_over_the_cap_is_431_json_and_closed(server):
    status, err = _error(_raw(server, b"GET /json HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 4000 + b"\r\n\r\n"))
    assert status == 431 and err["code"] == "request_head_too_large"
    # an endless header (no end of line ever) is cut off too, not buffered: the server
    # answers and closes while the client still sends (which may reach it as a reset)
    resp = _raw(server, b"GET /json HTTP/1.1\r\nx-big: " + b"a" * 2**22)
    assert resp.startswith(b"HTTP/1.1 431") or resp == b"<reset>", resp[:100]
    assert httpx.get(f"http://127.0.0.1:{server}/json").json() == {"ok": True}


def test_a_head_not_finished_in_time_is_408_and_closed(server):
    t0 = time.monotonic()
    status, err = _error(_raw(server, b"GET /json HTTP/1.1\r\nhost: x\r\n"))  # never ends
    assert status == 408 and err["code"] == "request_timeout"
    assert time.monotonic() - t0 < 3.0
    # an idle connection that sends nothing is closed as well
    assert _error(_raw(server, b""))[0] == 408


def test_stalled_connections_from_one_address_make_room_for_its_next_client(server):
    """Behind a proxy every client has one address: connections that never send a request
    cannot lock its next client out. Past the cap of pending connections the oldest pending one
    is closed (503 naming the limit) and the new client is served; a connection that has sent
    a request is not pending and is never closed for the address's sake."""
    with httpx.Client() as served:
        assert served.get(f"http://127.0.0.1:{server}/json").status_code == 200  # a kept-alive connection
        held = [socket.create_connection(("127.0.0.1", server), timeout=5)
                for _ in range(LIMITS.max_connections_per_peer)]
        try:
            time.sleep(0.05)
            resp = _raw(server, b"GET /json HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            assert resp.startswith(b"HTTP/1.1 200"), resp[:200]
            evicted = b""
            while chunk := held[0].recv(65536):
                evicted += chunk
            status, err = _error(evicted)
            assert status == 503 and err["code"] == "max_connections_per_peer"
            assert served.get(f"http://127.0.0.1:{server}/json").status_code == 200  # still open, never counted
        finally:
            for s in held:
                s.close()


def test_a_burst_of_clients_from_one_address_is_served_whole(server):
    """Clients that connect together and then send their requests (a benchmark client opening
    hundreds of connections at once, behind one address) are all served: a connection past the
    cap dooms the oldest pending one, which proves itself by sending its request in time."""
    socks = [socket.create_connection(("127.0.0.1", server), timeout=5)
             for _ in range(3 * LIMITS.max_connections_per_peer)]
    try:
        for s in socks:
            s.sendall(b"GET /json HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        answers = []
        for s in socks:
            resp = b""
            while chunk := s.recv(65536):
                resp += chunk
            answers.append(resp.split(b"\r\n", 1)[0])
        assert answers == [b"HTTP/1.1 200 OK"] * len(socks)
    finally:
        for s in socks:
            s.close()


def test_http10_streams_are_close_delimited(server):
    resp = _raw(server, b"GET /stream HTTP/1.0\r\n\r\n")
    head, _, body = resp.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    assert body == b"part 0\npart 1\npart 2\n"
    resp = _raw(server, b"GET /json HTTP/1.0\r\n\r\n")  # a sized body keeps its content-length
    assert b"content-length: 11" in resp.lower() and resp.endswith(b'{"ok":true}')
    with httpx.Client() as c:  # HTTP/1.1 keeps chunked streams and keep-alive
        r = c.get(f"http://127.0.0.1:{server}/stream")
        assert r.headers["transfer-encoding"] == "chunked" and r.text == "part 0\npart 1\npart 2\n"
