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
import contextlib
import os
import socket
import ssl

import orjson

from stream.http.server import date_header

__all__ = ["StartingServer"]

#: A request head longer than this is answered 431 and closed (probes send ~100 bytes).
HEAD_BYTES = 8192
#: How long a probe connection open at the handover may still take to send its request.
HANDOVER_GRACE_S = 5.0
#: How long a connection may take to send its request head before it is closed.
HEAD_TIMEOUT_S = 5.0
#: Connections answered at once at most (a start is short; a client holding more gets closed).
MAX_PROBES = 256

_REASONS = {200: "OK", 400: "Bad Request", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}


class StartingServer:
    """Answers probes on the service's port until the API takes the sockets over."""

    def __init__(self, max_probes: int = MAX_PROBES, head_timeout_s: float = HEAD_TIMEOUT_S) -> None:
        self.reason = "starting"
        self.max_probes = max_probes
        self.head_timeout_s = head_timeout_s
        self._sockets: list[socket.socket] = []
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: set[asyncio.Transport] = set()
        os.register_at_fork(after_in_child=self._close_in_child)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                    backlog: int = 1024) -> int:
        """Listen on every address ``host`` names (as asyncio's ``create_server`` does) and
        answer; return the port (the one chosen for 0). One line, not a traceback, when it
        cannot listen."""
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                self._sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if port == 0 and len(self._sockets) > 1:  # the port the first one got
                    address = (address[0], self._sockets[0].getsockname()[1], *address[2:])
                sock.bind(address)
                sock.listen(backlog)
                sock.setblocking(False)
                # the server gets a duplicate: closing it at the handover leaves this one listening
                self._servers.append(await loop.create_server(
                    lambda: _Probe(self), sock=sock.dup(), ssl=ssl_context))
        except OSError as exc:
            self.close()
            raise SystemExit(f"--host {host} --port {port}: cannot listen there "
                             f"({exc.strerror or exc}): check --host and --port") from None
        return int(self._sockets[0].getsockname()[1])

    def handover(self) -> list[socket.socket] | None:
        """Stop taking connections and give the listening sockets to the API (None if not
        started); the probes being answered finish (those idle are closed after a while)."""
        for server in self._servers:
            server.close()
        self._servers = []
        if self._connections:
            loop = asyncio.get_running_loop()
            loop.call_later(HANDOVER_GRACE_S, lambda: [t.close() for t in list(self._connections)])
        sockets, self._sockets = self._sockets, []
        return sockets or None

    def close(self) -> None:
        """Stop answering and close the sockets (a start that failed)."""
        for sock in self.handover() or ():
            sock.close()

    def _close_in_child(self) -> None:
        """A forked child (the local state's readers) must not keep the port open."""
        for sock in self._sockets:
            sock.close()
        for server in self._servers:
            for sock in server.sockets:
                with contextlib.suppress(OSError):
                    os.close(sock.fileno())

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
    head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\n{date_header().decode()}Content-Type: "
            f"application/json\r\nContent-Length: {len(raw)}\r\n{retry}Connection: close\r\n\r\n").encode()
    return head if head_only else head + raw


class _Probe(asyncio.Protocol):
    """One connection: its head, one answer, closed."""

    def __init__(self, server: StartingServer) -> None:
        self.server = server
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        if len(self.server._connections) >= self.server.max_probes:
            transport.close()  # bounded: a client cannot hold the start's port open
            return
        self.server._connections.add(transport)  # type: ignore[arg-type]
        asyncio.get_running_loop().call_later(self.server.head_timeout_s, transport.close)

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
