"""The HTTP/1.1 server of the API: an ``asyncio.Protocol`` over httptools' parser, on the
worker's own event loop.

Why not a framework: the view lives in the worker's memory, so the server must run in
that process's loop, and there the stacks that can (aiohttp, uvicorn, granian embedded)
spend most of a /v1/match on themselves: bare handlers on one core answered 12.5k
(aiohttp), 17k (uvicorn + httptools), 13k (granian RSGI) and 42k req/s (this protocol)
(``stream.bench.stacks``). The difference is per-request machinery: a task, a request
object with lazy everything, a response object and its writer. Here a request whose
route can answer at once (a small ``/v1/match``, the probes) is answered from
``data_received`` itself, with no task; only the others (writes, ``/v1/state``, bodies
read in the child process, wide matches) get one.

What it keeps of a server's duties, each here and nowhere else:

- limits: a request line or header over ``MAX_LINE`` bytes, more than ``MAX_HEADERS``
  headers, a head over ``MAX_HEAD`` bytes (however many reads it takes), a body over the
  API's ``max_body_bytes`` (by ``Content-Length`` before it is read, else as it comes:
  413), and every byte of a request (chunk extensions and trailers too) against
  ``max_body_bytes`` + ``MAX_HEAD``;
- what all clients together hold: a body is one buffer its chunks are joined into as
  they come (it costs about its bytes, however small its chunks), and the bodies in
  flight, from their first byte to their answer, hold at most ``body_budget`` bytes over
  the whole server (what each buffer holds, its slack too): a body that would go over is
  refused with 503 ``server_busy`` and ``Retry-After``, before it is read when its
  ``Content-Length`` says so, else as it comes; at most ``max_connections`` connections
  are open, a new one over it is closed at once; each is counted (``refusals``);
- RFC 9112's corners: an absolute-form target is routed by its path, a transfer coding
  other than ``chunked`` is 501, a second ``Host`` 400, an expectation other than
  ``100-continue`` 417, a major version other than 1 505;
- malformed requests: answered with CONTRACT's JSON 400 naming what was wrong by kind
  only, and a WARNING line without the request (a parser's message can hold the bytes
  it refused, an ``Authorization`` header's token among them), one per ``REFUSAL_LOG_S``
  at most; bytes after a request that ends the connection are ignored, not refused; a
  failure of this module or of a route's head step is a 500;
- routes answer before the body is read when they can (``Endpoint.head``: 401 without
  a valid token, 413 by ``Content-Length``, 404/405), and the body is then discarded;
- keep-alive, pipelining (answers in request order), ``Expect: 100-continue``, HEAD;
- time: a head must come whole within ``HEAD_TIMEOUT_S``, a body must not stall for
  ``BODY_IDLE_S`` nor come slower than ``BODY_MIN_RATE`` on the whole; after a refusal
  that ends the connection the server shuts its side and reads and drops what the client
  still sends, as nginx's lingering close, until the client closes, for ``LINGER_S`` at
  most and ``LINGER_IDLE_S`` without a byte (a client that sends its whole body before
  reading reads its 413 rather than a reset); a client that takes none of its answers for
  ``BODY_IDLE_S`` is cut off, an idle keep-alive connection is closed after ``KEEPALIVE_S``
  (the times are parameters of ``HttpServer``);
- backpressure: a client that does not read its answers is not read from, and one long
  read of pipelined requests is parsed across loop turns (``TURN_S``);
- TLS by the loop's own transport (``ssl_context``); no access log.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import logging
import resource
import socket
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from time import time as _clock
from typing import Any

import httptools
import orjson

__all__ = ["BODY_IDLE_S", "HEAD_TIMEOUT_S", "KEEPALIVE_S", "LINGER_IDLE_S", "LINGER_S", "MAX_CONNECTIONS",
           "MAX_HEAD", "MAX_HEADERS", "MAX_LINE", "RETRY_AFTER_S", "Endpoint", "HttpServer", "Request",
           "Response", "Routes", "date_header", "tls_context"]

log = logging.getLogger(__name__)

#: Longest request line or header line (name, colon, value), as aiohttp's default.
MAX_LINE = 8190
#: Most headers in one request.
MAX_HEADERS = 100
#: Longest head (request line and every header).
MAX_HEAD = 64 * 1024
#: Seconds a request's head may take to come whole (a slow sender holds no connection).
HEAD_TIMEOUT_S = 30.0
#: Seconds a body may go without a byte coming.
BODY_IDLE_S = 30.0
#: Seconds an idle keep-alive connection is kept (aiohttp's default).
KEEPALIVE_S = 75.0
#: Bytes a body must average per second after its first ``BODY_IDLE_S`` (a byte now and
#: then keeps no request open for ever).
BODY_MIN_RATE = 64 * 1024
#: Bytes of a refused body read (and dropped) to keep the connection for the next
#: request; past it the answer says ``Connection: close`` and the rest is lingered on.
LINGER_BYTES = 1 << 20
#: Seconds the server reads and drops what a client still sends after an answer that
#: closes the connection, at most, and without a byte: nginx's ``lingering_time`` and
#: ``lingering_timeout`` (64 MiB at 100 Mbit/s take ~5 s).
LINGER_S = 30.0
LINGER_IDLE_S = 5.0
#: Open connections at most (``MMCACHE_MAX_CONNECTIONS``).
MAX_CONNECTIONS = 4096
#: Seconds a client refused for the body budget is told to wait (``Retry-After``).
RETRY_AFTER_S = 1
#: Open files the process needs besides its HTTP connections (broker clients, RocksDB,
#: the kept log, the body reader's pipes).
OTHER_FILES = 512
#: Bytes of one read parsed at a time, the seconds one turn of the loop parses for and
#: the requests it answers at most, before the rest waits for the next turn (a burst of
#: pipelined requests holds the loop ~1 ms at a time).
FEED_SLICE = 4 * 1024
TURN_S = 0.001
ANSWERS_PER_TURN = 16
#: Bytes read from one connection before its reading waits a turn of the loop: a fast
#: client's big body is waiting in the socket, and libuv reads up to 32 times (8 MiB)
#: a wake-up, ~10 ms of copying that held the loop 20-40 ms on a busy machine.
READ_PER_TURN = 256 * 1024
#: Seconds between two warnings about refused requests (the ones between are counted).
REFUSAL_LOG_S = 5.0
#: Seconds ``close`` lets requests in flight finish.
SHUTDOWN_S = 5.0
#: Seconds between two looks at the connections' deadlines.
SWEEP_S = 1.0

_PHRASES = {status.value: status.phrase.encode() for status in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_date_line = b""
_date_expires = 0.0  # the wall-clock second after the one ``_date_line`` says


def date_header() -> bytes:
    """The ``Date`` header line of this second, which every answer carries (RFC 9110
    section 6.6.1: an origin server with a clock sends it); formatted once a second, not
    once an answer (a clock read and a comparison otherwise)."""
    global _date_line, _date_expires
    now = _clock()
    if now >= _date_expires or now < _date_expires - 1:  # the next second, or the clock set back
        second = int(now)
        _date_line = b"Date: %s\r\n" % email.utils.formatdate(second, usegmt=True).encode("ascii")
        _date_expires = second + 1.0
    return _date_line
_CLOSE = b"Connection: close\r\n"
_KEEP_ALIVE = b"Connection: keep-alive\r\n"
_JSON = "application/json"


class Request:
    """One request as the routes see it: method, path, query, headers, and the whole body
    in one buffer (its chunks joined as they came)."""

    __slots__ = ("_query", "body", "headers", "method", "path", "query_string", "remote", "scratch")

    def __init__(self, method: str, path: str, query_string: str, headers: dict[str, str],
                 remote: str | None) -> None:
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers  # lower-case names; a repeated header keeps its first value
        self.remote = remote
        self.body = bytearray()
        self.scratch: Any = None  # what a route's ``now`` leaves for its ``handle``
        self._query: dict[str, str] | None = None

    @property
    def chunks(self) -> list[bytearray]:
        """The body as a sequence of chunks (the body reader's interface): one, or none."""
        return [self.body] if self.body else []

    @property
    def size(self) -> int:
        """Bytes of the body so far."""
        return len(self.body)

    @property
    def query(self) -> dict[str, str]:
        """The query's parameters (the first value of a repeated one)."""
        if self._query is None:
            from urllib.parse import parse_qsl

            self._query = {}
            for name, value in parse_qsl(self.query_string, keep_blank_values=True):
                self._query.setdefault(name, value)
        return self._query

    @property
    def content_length(self) -> int | None:
        """The ``Content-Length`` the client announced, if any."""
        value = self.headers.get("content-length")
        return int(value) if value is not None and value.isdigit() else None


class Response:
    """An answer: status, headers and either one body or ``parts`` written one by one,
    the loop turning between them (a wide match's slices)."""

    __slots__ = ("body", "content_type", "headers", "parts", "status")

    def __init__(self, body: bytes = b"", status: int = 200, content_type: str = _JSON,
                 headers: dict[str, str] | None = None, parts: Sequence[bytes] | None = None) -> None:
        self.body = body
        self.status = status
        self.content_type = content_type
        self.headers = headers
        self.parts = parts

    def head(self, close: bool, keep_alive: bool = False) -> bytes:
        """The status line and headers (``keep_alive``: an HTTP/1.0 client's, announced)."""
        length = sum(map(len, self.parts)) if self.parts is not None else len(self.body)
        extra = b"".join(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
                         for name, value in self.headers.items()) if self.headers else b""
        return b"HTTP/1.1 %d %s\r\n%sContent-Type: %s\r\nContent-Length: %d\r\n%s%s\r\n" % (
            self.status, _PHRASES.get(self.status, b"Unknown"), date_header(),
            self.content_type.encode("latin-1"), length, extra,
            _CLOSE if close else _KEEP_ALIVE if keep_alive else b"")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """How one route answers, in up to three steps, each of which may answer.

    ``head`` once the headers came, before any of the body (a 401, a 413 by length, a
    404): its answer is sent and the body dropped; ``now``, synchronously, once the
    body came (``None``: not now, for instance a body to read in the child process);
    then ``handle``, in a task of its own. ``too_large`` answers a body that came over
    ``max_body`` bytes."""

    handle: Callable[[Request], Awaitable[Response]]
    too_large: Callable[[Request], Response]
    head: Callable[[Request], Response | None] | None = None
    now: Callable[[Request], Response | None] | None = None
    #: the share of the server's body budget this route's bodies may fill (the rest is kept
    #: for the others: a flood of big matches never refuses a write for want of room)
    budget_share: float = 1.0


class Routes:
    """What the server asks of the application: the endpoint of a method and path."""

    max_body: int = 1 << 24

    def resolve(self, method: str, path: str) -> Endpoint:  # pragma: no cover - an interface
        """The endpoint answering ``method`` on ``path`` (one answering 404 or 405 if none)."""
        raise NotImplementedError


class _Refused(Exception):
    """A request this server refuses before routing it; ``kind`` names it in the log,
    ``status`` and ``code`` are its answer's."""

    kind = "Refused"
    what = "the request is malformed"
    status = 400
    code = "bad_request"


class LineTooLong(_Refused):
    kind = "LineTooLong"
    what = f"a request line or header is over {MAX_LINE} bytes"


class TooManyHeaders(_Refused):
    kind = "TooManyHeaders"
    what = f"more than {MAX_HEADERS} headers"


class HeadTooLarge(_Refused):
    kind = "HeadTooLarge"
    what = f"the request's headers are over {MAX_HEAD} bytes"


class FramingTooLarge(_Refused):
    kind = "FramingTooLarge"
    what = f"over {MAX_HEAD} bytes of a body's framing (chunk extensions, trailers) in a row"


class UpgradeRefused(_Refused):
    kind = "HttpParserUpgrade"
    what = "protocol upgrades are not served"


class DuplicateHost(_Refused):  # RFC 9112 section 3.2
    kind = "DuplicateHost"
    what = "more than one Host header"


class CodingNotImplemented(_Refused):  # RFC 9112 section 6.1
    kind = "TransferCodingNotImplemented"
    what = "a transfer coding other than chunked (only chunked is served)"
    status = 501
    code = "not_implemented"


class ExpectationFailed(_Refused):  # RFC 9110 section 10.1.1
    kind = "ExpectationFailed"
    what = "an expectation other than 100-continue"
    status = 417
    code = "expectation_failed"


class VersionNotSupported(_Refused):  # RFC 9110 section 15.6.6
    kind = "HttpVersionNotSupported"
    what = "an HTTP major version other than 1 (HTTP/1.0 and HTTP/1.1 are served)"
    status = 505
    code = "http_version_not_supported"


# What was wrong, by the parser's exception class, most specific first: never its text.
_WHAT = (
    (httptools.HttpParserInvalidMethodError, "the request line has no valid method"),
    (httptools.HttpParserInvalidURLError, "the URL is malformed"),
    (httptools.HttpParserUpgrade, "protocol upgrades are not served"),
    (httptools.HttpParserError, "the request is malformed"),
)


def _describe(exc: BaseException) -> tuple[str, str]:
    """(kind, what was wrong) of a refused request, without anything it held."""
    if isinstance(exc, _Refused):
        return exc.kind, exc.what
    for kind, what in _WHAT:
        if isinstance(exc, kind):
            return type(exc).__name__, what
    return type(exc).__name__, "the request could not be read"


def _bad_body(what: str, kind: str, code: str = "bad_request") -> bytes:
    return orjson.dumps({"error": {"code": code, "message": f"{what} ({kind}); nothing was read"}})


def _refusal(what: str, kind: str, status: int = 400, code: str = "bad_request") -> bytes:
    body = _bad_body(what, kind, code)
    # a 400 says HTTP/1.0: the request's own version may be what could not be read
    version = b"HTTP/1.0" if status == 400 else b"HTTP/1.1"
    return b"%s %d %s\r\n%sContent-Type: application/json\r\nContent-Length: %d\r\n" \
           b"Connection: close\r\n\r\n%s" % (version, status, _PHRASES[status], date_header(),
                                                len(body), body)


_BUSY = orjson.dumps({"error": {"code": "server_busy", "message": "the server holds as many request bodies "
                                "as it may (body_budget_bytes); nothing was read, retry later"}})


def _busy() -> Response:
    """The answer to a body over the server's budget (a fresh one: its request's ``close``
    is its own)."""
    return Response(_BUSY, 503, headers={"Retry-After": str(RETRY_AFTER_S)})


_FAILED = orjson.dumps({"error": {"code": "internal_error",
                                  "message": "the request failed inside the service; nothing was written"}})
#: The answer to a request this module (or a route's head step) failed on.
_SERVER_ERROR = b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n" \
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(_FAILED), _FAILED)


class _Exchange:
    """One request from its first byte to its answer."""

    __slots__ = ("answer", "charged", "close", "dropped", "endpoint", "head_only", "keep_alive", "request")

    def __init__(self, request: Request, endpoint: Endpoint, close: bool, head_only: bool) -> None:
        self.request = request
        self.endpoint = endpoint
        self.close = close
        self.head_only = head_only
        self.keep_alive = False  # an HTTP/1.0 keep-alive, announced in the answer
        self.answer: Response | None = None  # answered before its body came
        self.dropped = 0  # bytes of a refused body dropped
        self.charged = 0  # bytes of its body counted against the server's budget


class _Stop(Exception):
    """Raised in a parser callback to stop parsing: nothing after the last request is read."""


class _Connection(asyncio.Protocol):
    """One client connection: parses requests and answers them in order.

    Reading pauses while a route answers in a task, while the socket does not take what
    was written (the transport's high-water mark: a client that does not read is not
    answered further), and while a long read is parsed in slices across loop turns."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.routes = server.routes
        self.loop = server.loop
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.remote: str | None = None
        self.queue: deque[_Exchange] = deque()  # whole requests waiting for their answer
        self.current: _Exchange | None = None   # the request whose body is coming
        self.busy: asyncio.Task[None] | None = None
        self.closing = False
        self.last: bytes | None = None  # sent once the answers before it are, then closed
        self._writable: asyncio.Future[None] | None = None
        self.deadline = 0.0  # the loop's time at which the connection is closed if idle
        self.write_by = 0.0  # while the socket takes nothing: the loop's time it is aborted at
        self._keepalive = server.keepalive_s
        self._body_limit = server.routes.max_body + MAX_HEAD  # raw bytes of a request, trailers too
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._raw = 0  # bytes of the request in progress, from the reads after the one it began in
        self._body_from = 0.0  # the loop's time its body was first waited for
        self._body_seen = 0  # bytes of its content at the last read
        self._stale = 0  # bytes read since without any of its content (framing, trailers)
        self._in_head = False
        self._reading = True
        self._read = 0  # bytes read since reading last waited a turn
        self._read_held = False  # reading waits for the next turn (READ_PER_TURN)
        self._write_paused = False
        self._backlog = b""  # read, not yet parsed (parsing goes on next turn)
        self._scheduled = False
        self._turn = 0  # requests answered this turn of the loop
        self._continue: _Exchange | None = None  # owed "100 Continue" once the answers before it are sent
        self._linger_until = 0.0  # lingering: the loop's time it ends at, at the latest (0: not lingering)
        self._linger_after = False  # ``last`` is a refusal: linger once it is sent
        self._answering: _Exchange | None = None  # the request a route answers in a task

    # -- the transport's side --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self.server
        if len(server.connections) >= server.max_connections:  # over the cap: closed at once
            server.refusals["connection_cap"] += 1
            self.closing = True
            transport.abort()
            return
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if isinstance(peer, tuple) else None
        server.connections.add(self)
        self._arm(self._keepalive)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self._linger_until = 0.0
        self._backlog = b""
        self.server.connections.discard(self)
        # what its bodies held is given back (a route answering gives its own back when it ends)
        if self.current is not None:
            self._release(self.current)
        for exchange in self.queue:
            self._release(exchange)
        # a route answering goes on (a write it began is not cut short); its answer is dropped
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True
        self.write_by = self.loop.time() + self.server.body_idle_s
        if self._writable is None or self._writable.done():
            self._writable = self.loop.create_future()
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self.write_by = 0.0
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._go_on_soon()

    def data_received(self, data: bytes, sliced: bool = False) -> None:
        if not sliced:  # (``sliced``: a slice of one read, from ``_feed_slices``)
            self._turn = 0
            self._read += len(data)
            if self._read > READ_PER_TURN and not self._read_held:
                self._read_held = True
                self.loop.call_soon(self._read_next_turn)
                self._update_reading()
            if self.closing:
                if self._linger_until:  # what a refused client still sends, dropped
                    self.deadline = min(self.loop.time() + self.server.linger_idle_s, self._linger_until)
                return
            if self.last is not None:
                return
            if self._backlog:  # parsed after what came before it
                self._backlog += data
                return
            if len(data) > FEED_SLICE:
                self._feed_slices(data)
                return
        if self._in_head or self.current is not None:  # counted whole: a head or trailer line without end
            self._raw += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if self.closing or self.last is not None:  # a stop, or bytes after the last request
                return
            if isinstance(exc.__context__, _Refused):
                self._refuse(exc.__context__)
            else:  # this module's or a route's own failure: logged by kind only, as a refusal is
                log.error("the HTTP server failed on a request from %s: %s (its text is not logged)",
                          self.remote, type(exc.__context__).__name__)
                self.current, self._in_head = None, False
                self._end_after_answers(_SERVER_ERROR)
            return
        except httptools.HttpParserUpgrade:
            if self.closing or self.last is not None:
                return
            if self.current is not None or self._in_head:  # upgrading before the body came
                self._refuse(httptools.HttpParserUpgrade())
            else:  # the request before it is answered; nothing after it is read
                self._end_after_answers(b"")
            return
        except Exception as exc:  # noqa: BLE001 - every refusal is answered alike
            if not (self.closing or self.last is not None):  # bytes after the last request: ignored
                self._refuse(exc)
            return
        if self._in_head:
            if self._raw > MAX_HEAD:
                self._refuse(HeadTooLarge())
        elif self.current is not None:  # a body (or its trailer) still coming
            current = self.current
            got = current.request.size + current.dropped
            if not self._body_from or got != self._body_seen:
                self._body_seen, self._stale = got, 0
            else:  # a trailer or a chunk extension without end is buffered by the parser
                self._stale += len(data)
            if self._raw > self._body_limit:
                self._too_large(current)
            elif self._stale > MAX_HEAD:
                self._framing_too_large(current)
            else:
                self._arm_body(current)

    def _feed_slices(self, data: bytes) -> None:
        """A long read parsed a slice at a time; past ``TURN_S`` (or once answering
        waits) the rest waits for the next turn, reading paused, so one read of many
        pipelined requests does not hold the loop."""
        until = self.loop.time() + TURN_S
        size, start = len(data), 0
        while start < size:
            step, current = FEED_SLICE, self.current
            if current is not None and not self._in_head:  # a body by length: fed whole
                length = current.request.content_length
                if length is not None:
                    step = max(step, length - current.request.size - current.dropped)
            rest = start + step
            self.data_received(data if start == 0 and rest >= size else data[start:rest], True)
            start = rest
            if self.closing or self.last is not None or rest >= size:
                return
            if self.busy is not None or self._write_paused or self.queue or self.loop.time() > until:
                self._backlog = data[rest:]
                self._update_reading()
                self._go_on_soon()
                return

    # -- the parser's callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.last is not None or self.closing:
            raise _Stop()
        self._in_head = True
        self._url = b""
        self._headers = []
        self._raw = 0
        self._body_from = 0.0
        self._arm(self.server.head_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > MAX_LINE:
            raise LineTooLong()

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + 2 + len(value) > MAX_LINE:
            raise LineTooLong()
        headers = self._headers
        if len(headers) >= MAX_HEADERS:
            raise TooManyHeaders()
        headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self.parser
        headers: dict[str, str] = {}
        url = self._url
        for name, value in self._headers:
            headers.setdefault(name.decode("latin-1").lower(), value.decode("utf-8", "surrogateescape"))
        if len(self._headers) * (MAX_LINE + 2) + len(url) > MAX_HEAD and len(url) + sum(  # else it cannot be
                len(name) + len(value) + 4 for name, value in self._headers) > MAX_HEAD:
            raise HeadTooLarge()  # the whole head, however many reads it came in
        if parser.get_http_version()[:2] != "1.":
            raise VersionNotSupported()
        _check_framing(self._headers)
        if url[:1] != b"/":
            url = _origin_form(url)
        path, _, query = url.partition(b"?")
        method = parser.get_method().decode("latin-1")
        if ("upgrade" in headers or method == "CONNECT") and parser.should_upgrade() and (
                "transfer-encoding" in headers or headers.get("content-length", "0") != "0"):
            raise UpgradeRefused()  # the parser would skip its body: answered without it
        request = Request(method, path.decode("utf-8", "surrogateescape"),
                          query.decode("utf-8", "surrogateescape"), headers, self.remote)
        routes = self.routes
        endpoint = routes.resolve(method, request.path)
        close = not parser.should_keep_alive()
        exchange = _Exchange(request, endpoint, close, method == "HEAD")
        if not close and "connection" in headers and parser.get_http_version() == "1.0":
            exchange.keep_alive = True
        self.current = exchange
        answer = endpoint.head(request) if endpoint.head is not None else None
        length = request.content_length
        if answer is None and length is not None:
            if length > routes.max_body:
                answer = endpoint.too_large(request)
            elif length and self.server.body_bytes + length > self.server.body_budget * endpoint.budget_share:
                answer = self._over_budget()
        expect = "expect" in headers and headers["expect"].lower() == "100-continue"
        if answer is not None:
            exchange.answer = answer
            if expect or (length is not None and length > LINGER_BYTES):
                exchange.close = True  # the body is not waited for (the client may not send it)
            if not self.queue and self.busy is None and not self._write_paused:  # nothing before it
                self._write(exchange, answer)
            elif expect:  # the client waits for this answer (or a 100) before its body
                self._cut(exchange)
        elif expect:
            if not self.queue and self.busy is None and not self._write_paused and self.transport:
                self.transport.write(_CONTINUE)
            else:  # sent once the answers before it are
                self._continue = exchange

    def on_body(self, body: bytes) -> None:
        exchange = self.current
        if exchange is None:
            return
        if exchange.answer is not None:  # refused before its body: dropped as it comes
            exchange.dropped += len(body)
            if exchange.dropped > LINGER_BYTES:
                self._cut(exchange)
            return
        request = exchange.request
        buffer = request.body
        buffer += body
        if len(buffer) > self.routes.max_body:
            self._refuse_body(exchange, exchange.endpoint.too_large(request))
            return
        server = self.server
        held = buffer.__alloc__()  # what it holds, its slack too
        server.body_bytes += held - exchange.charged
        exchange.charged = held
        if server.body_bytes > server.body_budget * exchange.endpoint.budget_share:
            self._refuse_body(exchange, self._over_budget())

    def _refuse_body(self, exchange: _Exchange, answer: Response) -> None:
        """A body refused as it comes: what it held is given back, the rest is dropped."""
        self._release(exchange)
        exchange.answer, exchange.close = answer, True
        if not self.queue and self.busy is None and not self._write_paused:
            self._write(exchange, answer)

    def _over_budget(self) -> Response:
        self.server.refusals["body_budget"] += 1
        return _busy()

    def _release(self, exchange: _Exchange) -> None:
        """Its body is no longer held here: dropped (never changed: a reader may still
        hold it) and no longer counted against the budget."""
        if exchange.charged:
            self.server.body_bytes -= exchange.charged
            exchange.charged = 0
        if exchange.request.body:
            exchange.request.body = bytearray()

    def on_message_complete(self) -> None:
        exchange, self.current = self.current, None
        if exchange is None:
            return
        if self._continue is exchange:  # its body came without waiting for the 100
            self._continue = None
        if exchange.request.scratch is _WRITTEN:  # answered before its body came
            if not self.queue and self.busy is None:
                self._arm(self._keepalive)
            return
        if exchange.close and self.last is None:  # nothing after it is read
            self.last = b""
        self.queue.append(exchange)
        if self.busy is None:
            self._answer_queue()

    # -- answering ---------------------------------------------------------------------------

    def _answer_queue(self) -> None:
        """Answer the waiting requests in order: at once where the route can, else in a
        task (reading pauses until it ends, so the answers stay in order); none while
        the socket does not take what was written."""
        queue = self.queue
        while queue and not self.closing:
            if self._write_paused:  # answered once the client reads (``resume_writing``)
                self._update_reading()
                return
            self._turn += 1
            if self._turn > ANSWERS_PER_TURN:  # the rest next turn
                self._update_reading()
                self._go_on_soon()
                return
            exchange = queue.popleft()
            answer = exchange.answer
            if answer is None and exchange.endpoint.now is not None:
                answer = exchange.endpoint.now(exchange.request)
            if answer is None:
                self.busy = task = self.loop.create_task(self._in_task(exchange))
                self.server.tasks.add(task)
                task.add_done_callback(self.server.tasks.discard)
                self._update_reading()
                return
            if exchange.request.scratch is not _WRITTEN:
                self._write(exchange, answer)
        if self.closing:
            return
        if self.last is not None:
            self._send_and_close(self.last)
        elif self._continue is not None:
            if self._continue is self.current and self.transport is not None:
                self.transport.write(_CONTINUE)
            self._continue = None

    def _go_on_soon(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._go_on)

    def _go_on(self) -> None:
        """Go on where answering or parsing stopped: the answers due, then what was
        read and not yet parsed, then reading."""
        self._scheduled = False
        self._turn = 0
        if self.closing:
            return
        if self.busy is None and not self._write_paused:
            if self.queue or self.last is not None or self._continue is not None:
                self._answer_queue()
            if self._backlog and self.busy is None and not self._write_paused and not self.closing \
                    and self.last is None and not self.queue:
                data, self._backlog = self._backlog, b""
                self._feed_slices(data)
        self._update_reading()

    def _read_next_turn(self) -> None:
        self._read, self._read_held = 0, False
        self._update_reading()

    def _update_reading(self) -> None:
        """Read while nothing holds reading back (a lingering close reads to drop)."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._read_held:
            want = False
        elif self.closing:
            want = self._linger_until > 0
        else:
            want = self.busy is None and not self._write_paused and not self._backlog and self.last is None \
                and not self.queue
        if want != self._reading:
            self._reading = want
            if want:
                transport.resume_reading()
            else:
                transport.pause_reading()

    async def _in_task(self, exchange: _Exchange) -> None:
        try:
            answer = await exchange.endpoint.handle(exchange.request)
            if answer.parts is not None and not exchange.head_only:
                await self._write_parts(exchange, answer)
            else:
                self._write(exchange, answer)
        except asyncio.CancelledError:
            return
        finally:
            self.busy = None
            self._release(exchange)
        if not self.closing:
            self._go_on()

    def _write(self, exchange: _Exchange, answer: Response) -> None:
        transport = self.transport
        exchange.request.scratch = _WRITTEN
        self._release(exchange)
        if transport is None or self.closing:
            return
        close = exchange.close or self.server.stopping
        head = answer.head(close, exchange.keep_alive)
        if exchange.head_only:
            transport.write(head)
        elif answer.parts is not None:
            transport.writelines([head, *answer.parts])
        elif len(answer.body) < 65536:
            transport.write(head + answer.body)
        else:  # not copied into one buffer
            transport.writelines([head, answer.body])
        if close:
            if exchange is self.current:  # its body still coming: some of it read, and dropped
                self._linger_out()
            else:
                self._close_after_answers()
        elif not self.queue and self.current is None:
            self._arm(self._keepalive)

    async def _write_parts(self, exchange: _Exchange, answer: Response) -> None:
        """A sliced answer: each part written once the socket took the last, the loop
        turning between parts (a socket that takes everything never makes us wait; one
        that takes nothing for ``body_idle_s`` is aborted by the sweep, which ends this)."""
        transport = self.transport
        exchange.request.scratch = _WRITTEN
        self._release(exchange)
        if transport is None or self.closing:
            return
        close = exchange.close or self.server.stopping
        transport.write(answer.head(close, exchange.keep_alive))
        for part in answer.parts or ():
            if self.closing:
                return
            transport.write(part)
            if self._writable is not None and not self._writable.done():
                await self._writable
            await asyncio.sleep(0)
        if close:
            self._close_after_answers()
        else:
            self._arm(self._keepalive)

    # -- refusing and closing -----------------------------------------------------------------

    def _refuse(self, exc: BaseException) -> None:
        """Answer a request the parser (or a limit) refused with the JSON 400, after the
        answers due before it; nothing it held is logged or echoed, and the warnings are
        one line per ``REFUSAL_LOG_S`` at most."""
        kind, what = _describe(exc)
        status, code = (exc.status, exc.code) if isinstance(exc, _Refused) else (400, "bad_request")
        self.server.refused(self.remote, kind, status)
        if self.current is not None:
            self._release(self.current)
        self.current, self._in_head = None, False
        self._end_after_answers(_refusal(what, kind, status, code), linger=True)

    def _too_large(self, exchange: _Exchange) -> None:
        """More bytes of one request than its body and head may hold (a trailer or a chunk
        extension without end counts): 413, and nothing more of it is read."""
        if exchange.answer is None:
            self._release(exchange)
            exchange.answer = exchange.endpoint.too_large(exchange.request)
        self._cut(exchange)

    def _framing_too_large(self, exchange: _Exchange) -> None:
        """A 400, and nothing more of the request is read."""
        self.server.refused(self.remote, FramingTooLarge.kind)
        if exchange.answer is None:
            self._release(exchange)
            exchange.answer = Response(_bad_body(FramingTooLarge.what, FramingTooLarge.kind), 400)
        self._cut(exchange)

    def _cut(self, exchange: _Exchange) -> None:
        """Nothing more of ``exchange`` (the request in progress) is parsed: its answer is
        the last, sent after the answers due, then the connection closes."""
        exchange.close = True
        self._in_head = False
        if exchange.request.scratch is _WRITTEN:
            self._linger_out()
        elif not self.queue and self.busy is None and not self._write_paused:
            self._write(exchange, exchange.answer)  # type: ignore[arg-type]
        else:
            self.current = None
            self.queue.append(exchange)
            self.last = b""
            self._linger_after = True
            self._update_reading()

    def _end_after_answers(self, last: bytes, linger: bool = False) -> None:
        """Read nothing more; send ``last`` once the answers due are, then close (after
        lingering on what the client still sends, for a refusal)."""
        self._linger_after = linger
        if self.busy is None and not self.queue:
            self._send_and_close(last)
        else:
            self.last = last
            self._update_reading()

    def _send_and_close(self, raw: bytes) -> None:
        if self.transport is not None and not self.closing:
            self.transport.write(raw)
        if self._linger_after:
            self._linger_out()
        else:
            self._close_after_answers()

    def _close_after_answers(self) -> None:
        """Close once what was written is sent (the transport flushes it first; a client
        that takes nothing of it for ``body_idle_s`` is cut off by the sweep)."""
        if self.transport is not None and not self.closing:
            self.closing = True
            self.deadline = self.loop.time() + self.server.body_idle_s
            self.transport.close()

    def _linger_out(self) -> None:
        """Close after an answer whose request's bytes may still come, as nginx's
        lingering close: the answer is sent and our side shut, and what still comes is
        read and dropped until the client closes, for ``linger_s`` at most and
        ``linger_idle_s`` without a byte, so that a client that sends its whole body
        before reading reads the answer rather than a reset."""
        if self.current is not None:
            self._release(self.current)
        self.current, self._in_head = None, False
        transport = self.transport
        if transport is None or self.closing:
            return
        self.closing = True
        now = self.loop.time()
        self._linger_until = now + self.server.linger_s
        self.deadline = min(now + self.server.linger_idle_s, self._linger_until)
        if transport.can_write_eof():
            transport.write_eof()
        self._update_reading()

    def _arm(self, seconds: float) -> None:
        """Close the connection if it is still idle ``seconds`` from now (the server's
        sweep looks every ``sweep_s``; no timer per request)."""
        self.deadline = self.loop.time() + seconds

    def _arm_body(self, exchange: _Exchange) -> None:
        """A body's deadline: ``body_idle_s`` without a byte, and its whole no later than
        ``body_idle_s`` plus its bytes at ``BODY_MIN_RATE``; a refused body is lingered on
        for ``linger_s`` at most."""
        server = self.server
        now = self.loop.time()
        if not self._body_from:
            self._body_from = now
        if exchange.answer is not None:
            whole = self._body_from + server.linger_s
        else:
            whole = self._body_from + server.body_idle_s + self._raw / BODY_MIN_RATE
        self.deadline = min(now + server.body_idle_s, whole)

    def expire(self, now: float) -> None:
        """A deadline passed: close (a request half-read is cut off, and so is a client
        that does not take what was written)."""
        transport = self.transport
        if transport is None:
            return
        if self.closing:  # lingering, or flushing a last answer: no longer
            if self._linger_until and not transport.get_write_buffer_size():
                if now >= self._linger_until:  # still sending when its time was up
                    self.server.refusals["linger_cut"] += 1
                self._linger_until = 0.0
                self.deadline = now + self.server.body_idle_s
                transport.close()
            else:
                transport.abort()
            return
        if 0.0 < self.write_by < now:  # the socket took nothing of what was written
            self.closing = True
            transport.abort()
            return
        if self.busy is not None:  # a route is answering: its own time is its own
            self._arm(self._keepalive)
            return
        current = self.current
        if transport.get_write_buffer_size() or self._in_head or (
                current is not None and current.request.scratch is not _WRITTEN):
            self.closing = True
            transport.abort()
        else:  # idle, or lingering on a refused body whose answer went out
            self._close_after_answers()

    def shutdown(self) -> None:
        """Close now if idle; else once the answer in flight is written."""
        if self.busy is None and not self.queue and self.current is None and not self._in_head:
            self._close_after_answers()
        elif self.last is None:
            self.last = b""  # answers due are sent, then the connection is closed


_WRITTEN = object()  # ``Request.scratch`` once the request's answer was written


def tls_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """The server TLS context of ``--tls-cert``/``--tls-key`` (``None``: plain HTTP);
    a pair that cannot be loaded stops the start with one line naming the flags."""
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise SystemExit(f"configuration error: --tls-cert {cert} / --tls-key {key}: "
                         f"cannot load them ({type(exc).__name__}: {exc.strerror or exc})") from None
    return context


def _open_files_for(connections: int) -> None:
    """Raise the soft open-files limit to what ``connections`` need, as Redis does for its
    ``maxclients`` (past the limit, accepting fails and the listener pauses); one warning
    when the hard limit is lower."""
    want = connections + OTHER_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    except (ValueError, OSError):
        new = soft
    if new < want:
        log.warning("the open files limit is %d, under the %d that %d HTTP connections need: raise it "
                    "(ulimit -n) or lower MMCACHE_MAX_CONNECTIONS", new, want, connections)


def _check_framing(headers: list[tuple[bytes, bytes]]) -> None:
    """RFC 9112's refusals by the header lines: a second ``Host`` (section 3.2), a
    transfer coding other than a single final ``chunked`` over every
    ``Transfer-Encoding`` line (section 6.1: 501; the parser reads ``gzip, chunked`` as
    chunked), an expectation other than ``100-continue`` (RFC 9110 section 10.1.1: 417)."""
    hosts = 0
    codings: list[bytes] = []
    for name, value in headers:
        size = len(name)
        if size != 4 and size != 6 and size != 17:  # noqa: PLR1714 - the common headers skip the rest
            continue
        lower = name.lower()
        if lower == b"host":
            hosts += 1
            if hosts > 1:
                raise DuplicateHost()
        elif lower == b"expect":
            if value.strip().lower() != b"100-continue":
                raise ExpectationFailed()
        elif lower == b"transfer-encoding":
            codings.extend(coding.strip().lower() for coding in value.split(b","))
    if codings and codings != [b"chunked"]:
        if any(coding != b"chunked" for coding in codings):
            raise CodingNotImplemented()
        raise _Refused()  # chunked twice


def _origin_form(url: bytes) -> bytes:
    """The path and query of an absolute-form target (RFC 9112 section 3.2.2), which a
    server must accept; any other target as it is."""
    scheme, sep, rest = url.partition(b"://")
    if not sep or scheme.lower() not in (b"http", b"https"):
        return url
    cut = len(rest)
    for mark in (b"/", b"?"):
        at = rest.find(mark)
        if 0 <= at < cut:
            cut = at
    target = rest[cut:]
    return target if target[:1] == b"/" else b"/" + target


class HttpServer:
    """Serves ``routes`` on a host and port of the running loop, over TLS when given a
    context; ``close`` stops taking connections and ends the open ones."""

    def __init__(self, routes: Routes, on_close: Callable[[], Awaitable[None]] | None = None, *,
                 keepalive_s: float | None = None, head_timeout_s: float | None = None,
                 body_idle_s: float | None = None, linger_s: float | None = None,
                 linger_idle_s: float | None = None, sweep_s: float | None = None,
                 max_connections: int | None = None, body_budget: int | None = None) -> None:
        self.routes = routes
        self.on_close = on_close
        # the module's figures unless given (tests give small ones)
        self.keepalive_s = KEEPALIVE_S if keepalive_s is None else keepalive_s
        self.head_timeout_s = HEAD_TIMEOUT_S if head_timeout_s is None else head_timeout_s
        self.body_idle_s = BODY_IDLE_S if body_idle_s is None else body_idle_s
        self.linger_s = LINGER_S if linger_s is None else linger_s
        self.linger_idle_s = LINGER_IDLE_S if linger_idle_s is None else linger_idle_s
        self.sweep_s = SWEEP_S if sweep_s is None else sweep_s
        self.max_connections = MAX_CONNECTIONS if max_connections is None else max_connections
        #: bytes the bodies in flight may hold together (default: four of the largest)
        self.body_budget = 4 * routes.max_body if body_budget is None else body_budget
        self.body_bytes = 0  # what they hold now
        #: what was refused for a bound: connections over the cap, bodies over the budget,
        #: lingering closes cut while the client still sent
        self.refusals = {"connection_cap": 0, "body_budget": 0, "linger_cut": 0}
        self._refusals_logged_at = -REFUSAL_LOG_S  # the loop's time of the last warning
        self._refusals_left_out = 0
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()  # routes answering in tasks of their own
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._more_servers: list[asyncio.AbstractServer] = []  # other addresses of the host
        self._sweeper: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                    backlog: int = 1024, sock: list[socket.socket] | None = None) -> int:
        """Listen (on ``sock`` when given sockets already listening: `serve` binds its port
        at start, ``stream.http.starting``); return the port (the one chosen for 0)."""
        _open_files_for(self.max_connections)
        self.loop = asyncio.get_running_loop()
        if sock:
            servers = [await self.loop.create_server(lambda: _Connection(self), sock=listening,
                                                     ssl=ssl_context, backlog=backlog)
                       for listening in sock]
            self._server, self._more_servers = servers[0], servers[1:]
        else:
            self._server = await self.loop.create_server(lambda: _Connection(self), host, port,
                                                         ssl=ssl_context, backlog=backlog,
                                                         reuse_address=True)
        self._sweeper = self.loop.call_later(self.sweep_s, self._sweep)
        return int(self._server.sockets[0].getsockname()[1])

    def unparsed_bytes(self) -> int:
        """Bytes read from the connections and not parsed yet (a turn of the loop parses
        for ``TURN_S``, the rest waits for the next)."""
        return sum(len(connection._backlog) for connection in self.connections)

    def _sweep(self) -> None:
        """Close the connections whose deadline passed (``_Connection._arm``), or whose
        socket took nothing for too long (``_Connection.write_by``)."""
        now = self.loop.time()
        for connection in [c for c in self.connections if c.deadline < now or 0.0 < c.write_by < now]:
            connection.expire(now)
        self._sweeper = self.loop.call_later(self.sweep_s, self._sweep)

    def refused(self, remote: str | None, kind: str, status: int = 400) -> None:
        """One WARNING line per ``REFUSAL_LOG_S`` about refused requests, the next one
        saying how many were left out (a client sending garbage floods no log)."""
        now = self.loop.time()
        if now - self._refusals_logged_at < REFUSAL_LOG_S:
            self._refusals_left_out += 1
            return
        left_out, self._refusals_left_out, self._refusals_logged_at = self._refusals_left_out, 0, now
        log.warning("refused a malformed HTTP request from %s with %d: %s (the request is not logged)%s",
                    remote, status, kind,
                    f"; {left_out} more refused before it, not logged" if left_out else "")

    async def close(self) -> None:
        """Stop listening, let requests in flight finish (at most ``SHUTDOWN_S``), close
        every connection, then the application's own cleanup."""
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for server in [self._server, *self._more_servers]:
            if server is not None:
                server.close()
        for connection in list(self.connections):
            connection.shutdown()
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=SHUTDOWN_S)
        for task in list(self.tasks):  # still answering after the grace: cancelled
            task.cancel()
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.closing = True
                connection.transport.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), SHUTDOWN_S)
        if self.on_close is not None:
            await self.on_close()
