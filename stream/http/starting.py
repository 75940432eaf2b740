"""The HTTP port from the first second of a start, before the API can answer.

A start can take a while before the worker serves its API: the embedded broker's kept
log is compacted and given back to the broker, the worker joins its group. A Kubernetes
liveness probe on ``/healthz`` must not kill the process meanwhile, and ``/readyz`` should
say what it waits for. So `serve` binds its port at once and this server answers on it:
``/healthz`` 200, ``/readyz`` 503 with the start's progress as its ``reason``, anything
else 503 ``starting``; one request a connection (``Connection: close``). When the API
starts it takes the very same listening socket (``handover``): no connection is refused
in between, and those waiting in the backlog are answered by the API.
"""

from __future__ import annotations

import asyncio
import socket
import ssl

import orjson

__all__ = ["StartingServer"]

#: A request head longer than this is answered 431 and closed (probes send ~100 bytes).
HEAD_BYTES = 8192

_REASONS = {200: "OK", 400: "Bad Request", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}


class StartingServer:
    """Answers probes on the service's port until the API takes the socket over."""

    def __init__(self) -> None:
        self.reason = "starting"
        self._socket: socket.socket | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Transport] = set()

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                    backlog: int = 1024) -> int:
        """Listen on ``host:port`` and answer; return the port (the one chosen for 0)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(backlog)
            sock.setblocking(False)
            # the server gets a duplicate: closing it at the handover leaves this one listening
            self._server = await asyncio.get_running_loop().create_server(
                lambda: _Probe(self), sock=sock.dup(), ssl=ssl_context)
        except BaseException:
            sock.close()
            raise
        self._socket = sock
        return int(sock.getsockname()[1])

    def handover(self) -> socket.socket | None:
        """Stop answering and give the listening socket to the API (None if not started)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for transport in list(self._connections):
            transport.close()
        sock, self._socket = self._socket, None
        return sock

    def close(self) -> None:
        """Stop answering and close the socket (a start that failed)."""
        sock = self.handover()
        if sock is not None:
            sock.close()

    def answer(self, head: bytes) -> bytes:
        """The whole response to one request head."""
        line = head.split(b"\r\n", 1)[0].split(b" ")
        if len(line) != 3 or not line[2].startswith(b"HTTP/1."):
            return _response(400, {"error": {"code": "bad_request", "message": "not an HTTP/1.x request"}})
        method, target = line[0], line[1]
        if b"://" in target:  # the absolute form (RFC 9112 section 3.2.2)
            target = b"/" + target.split(b"://", 1)[1].partition(b"/")[2]
        path = target.split(b"?", 1)[0]
        if method in (b"GET", b"HEAD") and path == b"/healthz":
            return _response(200, {"status": "ok"}, head_only=method == b"HEAD")
        if method in (b"GET", b"HEAD") and path == b"/readyz":
            return _response(503, {"status": "not_ready", "reason": self.reason, "lag_events": None,
                                   "staleness_seconds": None}, head_only=method == b"HEAD")
        message = f"mmcache is starting: {self.reason}"
        return _response(503, {"error": {"code": "starting", "message": message}}, retry_after=True)


def _response(status: int, body: object, head_only: bool = False, retry_after: bool = False) -> bytes:
    raw = orjson.dumps(body)
    retry = "Retry-After: 1\r\n" if retry_after else ""
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n{retry}Connection: close\r\n\r\n").encode()
    return head if head_only else head + raw


class _Probe(asyncio.Protocol):
    """One connection: its head, one answer, closed."""

    def __init__(self, server: StartingServer) -> None:
        self.server = server
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.server._connections.add(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.server._connections.discard(self.transport)

    def data_received(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.buffer += data
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0 and len(self.buffer) <= HEAD_BYTES:
            return
        answer = (self.server.answer(bytes(self.buffer[:end])) if 0 <= end <= HEAD_BYTES else
                  _response(431, {"error": {"code": "head_too_large", "message": "request head too large"}}))
        self.transport.write(answer)
        self.transport.close()
