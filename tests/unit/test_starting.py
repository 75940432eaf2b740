"""The port during a start (stream.http.starting): probes answered with the start's
progress, and what clients may hold of it bounded (connections, time to send a head)."""

from __future__ import annotations

import asyncio
import re
import socket

import orjson

from stream.http.starting import StartingServer
from tests.unit.test_http_server_limits import exchange


def _closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (a read returns nothing, or a reset)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_probes_get_alive_and_not_ready_with_the_reason():
    async def run() -> tuple[bytes, bytes, bytes]:
        server = StartingServer()
        port = await server.start("127.0.0.1", 0)
        server.reason = "compacting the embedded broker's kept log"
        try:
            return tuple(await asyncio.gather(*(asyncio.to_thread(exchange, port, raw) for raw in (
                b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n",
                b"POST /v1/match HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"))))  # type: ignore[return-value]
        finally:
            server.close()

    health, ready, match = asyncio.run(run())
    assert health.startswith(b"HTTP/1.1 200 ")
    assert ready.startswith(b"HTTP/1.1 503 ")
    assert orjson.loads(ready.split(b"\r\n\r\n", 1)[1])["reason"] == "compacting the embedded broker's kept log"
    assert match.startswith(b"HTTP/1.1 503 ") and b'"starting"' in match and b"Retry-After: 1\r\n" in match
    assert all(re.search(rb"\r\nDate: \w{3}, \d{2} \w{3} \d{4} [\d:]{8} GMT\r\n", answer)
               for answer in (health, ready, match))  # RFC 9110 section 6.6.1, as the API's answers


async def _connect(port: int) -> socket.socket:
    sock = await asyncio.to_thread(socket.create_connection, ("127.0.0.1", port), 10)
    sock.settimeout(10)
    return sock


async def _accepted(server: StartingServer, count: int) -> None:
    for _ in range(3000):  # until accepted (a condition, not a time)
        if len(server._connections) == count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not accepted")


def test_a_connection_over_the_cap_is_closed_at_once():
    async def run() -> bool:
        server = StartingServer(max_probes=2, head_timeout_s=600)  # no head timeout here
        port = await server.start("127.0.0.1", 0)
        try:
            held = [await _connect(port) for _ in range(2)]
            await _accepted(server, 2)
            over = await _connect(port)
            refused = await asyncio.to_thread(_closed_by_server, over)
            for sock in [*held, over]:
                sock.close()
            return refused
        finally:
            server.close()

    assert asyncio.run(run())


def test_a_connection_that_sends_no_head_is_closed_after_the_head_timeout():
    async def run() -> bool:
        server = StartingServer(head_timeout_s=0.3)
        port = await server.start("127.0.0.1", 0)
        try:
            idle = await _connect(port)
            closed = await asyncio.to_thread(_closed_by_server, idle)
            idle.close()
            return closed
        finally:
            server.close()

    assert asyncio.run(run())
