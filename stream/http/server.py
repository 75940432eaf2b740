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
  headers, a head over ``MAX_HEAD`` bytes, a body over the API's ``max_body_bytes``
  (by ``Content-Length`` before it is read, else as it comes: 413);
- malformed requests: answered with CONTRACT's JSON 400 naming what was wrong by kind
  only, and one WARNING line without the request (a parser's message can hold the
  bytes it refused, an ``Authorization`` header's token among them);
- routes answer before the body is read when they can (``Endpoint.head``: 401 without
  a valid token, 413 by ``Content-Length``, 404/405), and the body is then discarded;
- keep-alive, pipelining (answers in request order), ``Expect: 100-continue``, HEAD;
- time: a head must come whole within ``HEAD_TIMEOUT_S``, a body must not stall for
  ``BODY_IDLE_S``, an idle keep-alive connection is closed after ``KEEPALIVE_S``;
- TLS by the loop's own transport (``ssl_context``); no access log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import httptools
import orjson

__all__ = ["BODY_IDLE_S", "HEAD_TIMEOUT_S", "KEEPALIVE_S", "MAX_HEAD", "MAX_HEADERS", "MAX_LINE",
           "Endpoint", "HttpServer", "Request", "Response", "Routes"]

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
#: Bytes of a refused body read (and dropped) before the connection is closed, so
#: that the client reads the answer rather than a reset.
LINGER_BYTES = 1 << 20
#: Seconds ``close`` lets requests in flight finish.
SHUTDOWN_S = 5.0
#: Seconds between two looks at the connections' deadlines.
SWEEP_S = 1.0

_PHRASES = {status.value: status.phrase.encode() for status in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_JSON = "application/json"


class Request:
    """One request as the routes see it: method, path, query, headers, and the whole body
    as the chunks it came in (never joined here)."""

    __slots__ = ("_query", "chunks", "headers", "method", "path", "query_string", "remote", "scratch",
                 "size")

    def __init__(self, method: str, path: str, query_string: str, headers: dict[str, str],
                 remote: str | None) -> None:
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers  # lower-case names; a repeated header keeps its first value
        self.remote = remote
        self.chunks: list[bytes] = []
        self.size = 0
        self.scratch: Any = None  # what a route's ``now`` leaves for its ``handle``
        self._query: dict[str, str] | None = None

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

    def head(self, close: bool) -> bytes:
        """The status line and headers."""
        length = sum(map(len, self.parts)) if self.parts is not None else len(self.body)
        extra = b"".join(b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
                         for name, value in self.headers.items()) if self.headers else b""
        return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s%s\r\n" % (
            self.status, _PHRASES.get(self.status, b"Unknown"), self.content_type.encode("latin-1"),
            length, extra, b"Connection: close\r\n" if close else b"")


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


class Routes:
    """What the server asks of the application: the endpoint of a method and path."""

    max_body: int = 1 << 24

    def resolve(self, method: str, path: str) -> Endpoint:  # pragma: no cover - an interface
        """The endpoint answering ``method`` on ``path`` (one answering 404 or 405 if none)."""
        raise NotImplementedError


class _Refused(Exception):
    """A request this server refuses before routing it; ``kind`` names it in the log."""

    kind = "Refused"
    what = "the request is malformed"


class LineTooLong(_Refused):
    kind = "LineTooLong"
    what = f"a request line or header is over {MAX_LINE} bytes"


class TooManyHeaders(_Refused):
    kind = "TooManyHeaders"
    what = f"more than {MAX_HEADERS} headers"


class HeadTooLarge(_Refused):
    kind = "HeadTooLarge"
    what = f"the request's headers are over {MAX_HEAD} bytes"


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


def _bad_request(what: str, kind: str) -> bytes:
    body = orjson.dumps({"error": {"code": "bad_request", "message": f"{what} ({kind}); nothing was read"}})
    # HTTP/1.0: the request's own version may be what could not be read
    return b"HTTP/1.0 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" \
           b"Connection: close\r\n\r\n%s" % (len(body), body)


class _Exchange:
    """One request from its first byte to its answer."""

    __slots__ = ("answer", "close", "dropped", "endpoint", "head_only", "request")

    def __init__(self, request: Request, endpoint: Endpoint, close: bool, head_only: bool) -> None:
        self.request = request
        self.endpoint = endpoint
        self.close = close
        self.head_only = head_only
        self.answer: Response | None = None  # answered before its body came
        self.dropped = 0  # bytes of a refused body dropped


class _Connection(asyncio.Protocol):
    """One client connection: parses requests and answers them in order."""

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
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head = 0  # bytes of the head so far
        self._in_head = False

    # -- the transport's side --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if isinstance(peer, tuple) else None
        self.server.connections.add(self)
        self._arm(KEEPALIVE_S)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)
        # a route answering goes on (a write it began is not cut short); its answer is dropped
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = self.loop.create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.closing or self.last is not None:
            return
        if self._in_head or self.current is None:
            self._head += len(data)
        try:
            self.parser.feed_data(data)
            if self._in_head and self._head > MAX_HEAD:
                raise HeadTooLarge()
        except httptools.HttpParserUpgrade:
            if self.current is not None or self._in_head:  # upgrading before the body came
                self._refuse(httptools.HttpParserUpgrade())
            else:  # the request before it is answered; nothing after it is read
                self._end_after_answers(b"")
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _Refused):
                self._refuse(exc.__context__)
            else:  # this module's own failure: logged by kind only, as a refusal is
                log.error("the HTTP server failed on a request from %s: %s (its text is not logged)",
                          self.remote, type(exc.__context__).__name__)
                self._refuse(exc, logged=True)
        except Exception as exc:  # noqa: BLE001 - every refusal is answered alike
            self._refuse(exc)
        else:
            if self.current is not None and not self._in_head:  # a head's time runs from its start
                self._arm(BODY_IDLE_S)

    # -- the parser's callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_head = True
        self._url = b""
        self._headers = []
        self._arm(HEAD_TIMEOUT_S)

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
        self._head = 0
        parser = self.parser
        headers: dict[str, str] = {}
        for name, value in self._headers:
            headers.setdefault(name.decode("latin-1").lower(), value.decode("utf-8", "surrogateescape"))
        url = self._url
        path, _, query = url.partition(b"?")
        method = parser.get_method().decode("latin-1")
        request = Request(method, path.decode("utf-8", "surrogateescape"),
                          query.decode("utf-8", "surrogateescape"), headers, self.remote)
        routes = self.routes
        endpoint = routes.resolve(method, request.path)
        exchange = _Exchange(request, endpoint, not parser.should_keep_alive(), method == "HEAD")
        self.current = exchange
        answer = endpoint.head(request) if endpoint.head is not None else None
        if answer is None:
            length = request.content_length
            if length is not None and length > routes.max_body:
                answer = endpoint.too_large(request)
        if answer is not None:
            exchange.answer = answer
            if not self.queue and self.busy is None:  # nothing before it: answered at once
                self._write(exchange, answer)
        elif "expect" in headers and headers["expect"].lower() == "100-continue" and self.transport:
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        exchange = self.current
        if exchange is None:
            return
        if exchange.answer is not None:  # refused before its body: dropped as it comes
            exchange.dropped += len(body)
            if exchange.dropped > LINGER_BYTES:
                exchange.close = True
                self._close_after_answers()
            return
        request = exchange.request
        request.size += len(body)
        if request.size > self.routes.max_body:
            request.chunks.clear()
            exchange.answer, exchange.close = exchange.endpoint.too_large(request), True
            if not self.queue and self.busy is None:
                self._write(exchange, exchange.answer)
            return
        request.chunks.append(body)

    def on_message_complete(self) -> None:
        exchange, self.current = self.current, None
        if exchange is None:
            return
        if exchange.request.scratch is _WRITTEN:  # answered before its body came
            if not self.queue and self.busy is None:
                self._arm(KEEPALIVE_S)
            return
        self.queue.append(exchange)
        if self.busy is None:
            self._answer_queue()

    # -- answering ---------------------------------------------------------------------------

    def _answer_queue(self) -> None:
        """Answer the waiting requests in order: at once where the route can, else in a
        task (reading pauses until it ends, so the answers stay in order)."""
        queue = self.queue
        while queue and not self.closing:
            exchange = queue.popleft()
            answer = exchange.answer
            if answer is None and exchange.endpoint.now is not None:
                answer = exchange.endpoint.now(exchange.request)
            if answer is None:
                if self.transport is not None:
                    self.transport.pause_reading()
                self.busy = task = self.loop.create_task(self._in_task(exchange))
                self.server.tasks.add(task)
                task.add_done_callback(self.server.tasks.discard)
                return
            if exchange.request.scratch is not _WRITTEN:
                self._write(exchange, answer)
        if self.last is not None and not queue and not self.closing:
            self._send_and_close(self.last)

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
        if not self.closing:
            if self.transport is not None:
                self.transport.resume_reading()
            self._answer_queue()

    def _write(self, exchange: _Exchange, answer: Response) -> None:
        transport = self.transport
        exchange.request.scratch = _WRITTEN
        if transport is None or self.closing:
            return
        close = exchange.close or self.server.stopping
        head = answer.head(close)
        if exchange.head_only:
            transport.write(head)
        elif answer.parts is not None:
            transport.writelines([head, *answer.parts])
        elif len(answer.body) < 65536:
            transport.write(head + answer.body)
        else:  # not copied into one buffer
            transport.writelines([head, answer.body])
        if close:
            self._close_after_answers()
        elif not self.queue and self.current is None:
            self._arm(KEEPALIVE_S)

    async def _write_parts(self, exchange: _Exchange, answer: Response) -> None:
        """A sliced answer: each part written once the socket took the last, the loop
        turning between parts (a socket that takes everything never makes us wait)."""
        transport = self.transport
        exchange.request.scratch = _WRITTEN
        if transport is None or self.closing:
            return
        close = exchange.close or self.server.stopping
        transport.write(answer.head(close))
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
            self._arm(KEEPALIVE_S)

    # -- refusing and closing -----------------------------------------------------------------

    def _refuse(self, exc: BaseException, logged: bool = False) -> None:
        """Answer a request the parser (or a limit) refused with the JSON 400, after the
        answers due before it; nothing it held is logged or echoed."""
        kind, what = _describe(exc)
        if not logged:
            log.warning("refused a malformed HTTP request from %s with 400: %s (the request is not "
                        "logged)", self.remote, kind)
        self.current, self._in_head = None, False
        self._end_after_answers(_bad_request(what, kind))

    def _end_after_answers(self, last: bytes) -> None:
        """Read nothing more; send ``last`` once the answers due are, then close."""
        if self.busy is None and not self.queue:
            self._send_and_close(last)
        else:
            self.last = last
            if self.transport is not None:
                self.transport.pause_reading()

    def _send_and_close(self, raw: bytes) -> None:
        if self.transport is not None and not self.closing:
            self.transport.write(raw)
        self._close_after_answers()

    def _close_after_answers(self) -> None:
        """Close once what was written is sent (the transport flushes it first)."""
        if self.transport is not None and not self.closing:
            self.closing = True
            self.transport.close()

    def _arm(self, seconds: float) -> None:
        """Close the connection if it is still idle ``seconds`` from now (the server's
        sweep looks every ``SWEEP_S``; no timer per request)."""
        self.deadline = self.loop.time() + seconds

    def expire(self) -> None:
        """The deadline passed: close (a request half-read is cut off)."""
        if self.busy is not None:  # a route is answering: its own time is its own
            self._arm(KEEPALIVE_S)
            return
        if self.transport is not None and not self.closing:
            self.closing = True
            self.transport.abort() if self.current is not None or self._in_head else self.transport.close()

    def shutdown(self) -> None:
        """Close now if idle; else once the answer in flight is written."""
        if self.busy is None and not self.queue and self.current is None and not self._in_head:
            self._close_after_answers()
        elif self.last is None:
            self.last = b""  # answers due are sent, then the connection is closed


_WRITTEN = object()  # ``Request.scratch`` once the request's answer was written


class HttpServer:
    """Serves ``routes`` on a host and port of the running loop, over TLS when given a
    context; ``close`` stops taking connections and ends the open ones."""

    def __init__(self, routes: Routes, on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        self.routes = routes
        self.on_close = on_close
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()  # routes answering in tasks of their own
        self.stopping = False
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
                    backlog: int = 1024) -> int:
        """Listen; return the port (the one chosen when ``port`` is 0)."""
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(lambda: _Connection(self), host, port,
                                                     ssl=ssl_context, backlog=backlog,
                                                     reuse_address=True)
        self._sweeper = self.loop.call_later(SWEEP_S, self._sweep)
        return int(self._server.sockets[0].getsockname()[1])

    def _sweep(self) -> None:
        """Close the connections whose deadline passed (``_Connection._arm``)."""
        now = self.loop.time()
        for connection in [c for c in self.connections if c.deadline < now]:
            connection.expire()
        self._sweeper = self.loop.call_later(SWEEP_S, self._sweep)

    async def close(self) -> None:
        """Stop listening, let requests in flight finish (at most ``SHUTDOWN_S``), close
        every connection, then the application's own cleanup."""
        self.stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
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
