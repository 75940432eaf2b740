"""The server's framing against h11, a maintained HTTP/1.1 implementation, as the oracle.

Hypothesis writes request streams (methods, targets, header sets, ``Content-Length`` and
chunked bodies, pipelined sequences, and malformed variants of each); the same bytes go
to the server's parsing side (a ``_Connection`` fed directly, its routes recording what
they were given) and to ``h11.Connection(h11.SERVER)``. Both must give the same requests
(method, target, the headers that matter, body), or both refuse. Where RFC 9112 lets them
differ, or the server keeps a leniency on purpose, the difference is named below and
pinned, so that it cannot grow unnoticed.
"""

from __future__ import annotations

import asyncio
import re
from urllib.parse import urlsplit

import h11
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stream.http import server as http_server

#: Header names whose values the routes or the framing read.
MATTER = ("host", "content-length", "transfer-encoding", "connection", "expect", "authorization",
          "content-type", "x-extra")
#: Those whose values are case-insensitive tokens (h11 gives them lower-cased).
TOKENS = ("transfer-encoding", "connection", "expect")


def _matter(headers: dict[str, bytes]) -> dict[str, bytes]:
    return {name: headers[name].lower() if name in TOKENS else headers[name] for name in MATTER if name in headers}


class _Transport:
    """What the server writes, and whether it closed."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return ("127.0.0.1", 1) if name == "peername" else default

    def write(self, data: bytes) -> None:
        self.written += data

    def writelines(self, parts: list[bytes]) -> None:
        for part in parts:
            self.written += part

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    abort = close

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Recording(http_server.Routes):
    """Every route answers 200 at once and records the request it was given."""

    max_body = 1 << 20

    def __init__(self) -> None:
        self.seen: list[tuple] = []

        def now(request: http_server.Request) -> http_server.Response:
            target = request.path + ("?" + request.query_string if request.query_string else "")
            self.seen.append((request.method, target.encode("utf-8", "surrogateescape"),
                              _matter({name: value.encode("utf-8", "surrogateescape")
                                       for name, value in request.headers.items()}), b"".join(request.chunks)))
            return http_server.Response(b"", 200)

        async def handle(request: http_server.Request) -> http_server.Response:
            return now(request)  # pragma: no cover - ``now`` always answers

        self.endpoint = http_server.Endpoint(handle, lambda request: http_server.Response(b"", 413), now=now)

    def resolve(self, method: str, path: str) -> http_server.Endpoint:
        return self.endpoint


def ours(raw: bytes) -> tuple[list[tuple], int | None]:
    """(the requests the routes were given, the status of the server's own refusal or None)."""
    routes = _Recording()

    async def feed() -> bytes:
        server = http_server.HttpServer(routes)
        server.loop = asyncio.get_running_loop()
        connection = http_server._Connection(server)
        transport = _Transport()
        connection.connection_made(transport)  # type: ignore[arg-type]
        connection.data_received(raw)
        for _ in range(10_000):  # sliced parsing goes on over turns of the loop
            if not connection._scheduled and not connection._backlog:
                break
            await asyncio.sleep(0)
        return bytes(transport.written)

    written = asyncio.run(feed())
    refusals = [int(status) for status in re.findall(rb"HTTP/1\.[01] (\d{3}) ", written) if int(status) >= 400]
    return routes.seen, (refusals[0] if refusals else None)


def theirs(raw: bytes) -> tuple[list[tuple], bool]:
    """(h11's requests, whether h11 refused); a request after one that ends the
    connection is not read, as the server does not."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(raw)
    seen: list[tuple] = []
    current: h11.Request | None = None
    body = bytearray()
    try:
        while True:
            event = connection.next_event()
            if event is h11.NEED_DATA or isinstance(event, h11.ConnectionClosed):
                return seen, False
            if isinstance(event, h11.Request):
                current, body = event, bytearray()
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                assert current is not None
                headers: dict[str, bytes] = {}
                for name, value in current.headers.raw_items():
                    headers.setdefault(name.decode("latin-1").lower(), value)
                target = current.target
                if not target.startswith(b"/"):  # absolute form: routed by its path and query
                    parts = urlsplit(target)
                    target = (parts.path or b"/") + (b"?" + parts.query if parts.query else b"")
                elif target.endswith(b"?") and target.count(b"?") == 1:  # an empty query: none
                    target = target[:-1]
                seen.append((current.method.decode(), target, _matter(headers), bytes(body)))
                connection.send(h11.Response(status_code=200, headers=[("Content-Length", "0")]))
                connection.send(h11.EndOfMessage())
                if connection.our_state is h11.MUST_CLOSE:
                    return seen, False
                connection.start_next_cycle()
    except h11.RemoteProtocolError:
        return seen, True


# -- what hypothesis writes ----------------------------------------------------------------

_TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-", min_size=1,
                 max_size=8)
_VALUE = st.text(alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=12)
_PATH = st.lists(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._~%", min_size=1, max_size=6),
                 max_size=3).map(lambda parts: "/" + "/".join(parts))
_QUERY = st.one_of(st.just(""), st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789=&", max_size=10)
                   .map(lambda q: "?" + q))


@st.composite
def _target(draw: st.DrawFn) -> bytes:
    path = draw(_PATH) + draw(_QUERY)
    if draw(st.booleans()) and draw(st.booleans()):  # absolute form now and then
        return (draw(st.sampled_from(["http", "https", "HTTP"])) + "://h.example:8080" + path).encode()
    return path.encode()


@st.composite
def request(draw: st.DrawFn, last: bool = False) -> bytes:
    """One well-formed HTTP/1.1 request (``last``: it may say ``Connection: close``)."""
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]))
    lines = [b"%s %s HTTP/1.1" % (method.encode(), draw(_target()))]
    headers = [(b"Host", draw(st.sampled_from([b"x", b"mmcache.example:8080", b"127.0.0.1"])))]
    for name, value in draw(st.lists(st.tuples(st.sampled_from(["X-Extra", "Authorization", "Content-Type",
                                                                "Accept", "User-Agent"]), _VALUE), max_size=3)):
        headers.append((name.encode(), value.encode()))
    if last and draw(st.booleans()):
        headers.append((b"Connection", b"close"))
    if draw(st.booleans()):
        headers.append((b"Expect", b"100-continue"))
    body = b""
    framing = draw(st.sampled_from(["none", "length", "chunked"])) if method != "HEAD" else "none"
    if framing != "none":
        body = draw(st.binary(max_size=64))
    if framing == "length":
        headers.append((b"Content-Length", b"%d" % len(body)))
    elif framing == "chunked":
        headers.append((b"Transfer-Encoding", draw(st.sampled_from([b"chunked", b"Chunked"]))))
    draw(st.randoms()).shuffle(headers)
    head = b"\r\n".join(lines + [name + b": " + value for name, value in headers]) + b"\r\n\r\n"
    if framing == "chunked":
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if b > a]
        ext = draw(st.sampled_from([b"", b";name=value"]))
        head += b"".join(b"%x%s\r\n%s\r\n" % (len(piece), ext, piece) for piece in pieces) + b"0\r\n"
        head += draw(st.sampled_from([b"", b"X-Trailer: t\r\n"])) + b"\r\n"
    else:
        head += body
    return head


#: Malformed variants, each a change of one well-formed request; both must refuse it.
MALFORMED = {
    "space before a header's colon": lambda raw: raw.replace(b"Host:", b"Host :", 1),
    "a NUL in a value": lambda raw: raw.replace(b"Host: ", b"Host: a\x00", 1),
    "a header line without colon": lambda raw: raw.replace(b"\r\nHost:", b"\r\nNoColon\r\nHost:", 1),
    "two different Content-Lengths": lambda raw: raw.replace(b"\r\nHost:", b"\r\nContent-Length: 1\r\n"
                                                             b"Content-Length: 2\r\nHost:", 1),
    "a Content-Length that is not a number": lambda raw: raw.replace(b"\r\nHost:", b"\r\nContent-Length: 1x"
                                                                     b"\r\nHost:", 1),
    "a transfer coding other than chunked": lambda raw: raw.replace(b"\r\nHost:", b"\r\nTransfer-Encoding: "
                                                                    b"gzip, chunked\r\nHost:", 1),
    "a second Host": lambda raw: raw.replace(b"\r\nHost:", b"\r\nHost: second\r\nHost:", 1),
    "no version": lambda raw: re.sub(rb" HTTP/1\.1\r\n", b"\r\n", raw, count=1),
    "a bad method": lambda raw: b"G(T" + raw[raw.index(b" "):],
}


def _chunked_garbage(raw: bytes) -> bytes:
    """A chunked request whose first chunk size is not hex."""
    head, _, _ = raw.partition(b"\r\n\r\n")
    return head + b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n"


def _same(raw: bytes) -> None:
    mine, refused = ours(raw)
    their, they_refused = theirs(raw)
    assert (refused is not None) == they_refused, (raw, mine, refused, their)
    if not they_refused and len(their) < len(mine):  # h11 ends an HTTP/1.0 connection after one request
        mine = mine[:len(their)]
    assert mine == their, raw


_SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(st.lists(request(), min_size=1, max_size=4), request(last=True))
def test_pipelined_well_formed_requests_parse_alike(first, last):
    _same(b"".join(first) + last)


@_SETTINGS
@given(request(), st.sampled_from(sorted(MALFORMED)), st.lists(request(), max_size=2))
def test_malformed_requests_are_refused_by_both(one, variant, before):
    raw = b"".join(before) + MALFORMED[variant](one)
    mine, refused = ours(raw)
    their, they_refused = theirs(raw)
    assert refused is not None and they_refused, (variant, raw, mine, refused, their)
    assert mine == their == [ours(part)[0][0] for part in before]


@_SETTINGS
@given(request())
def test_a_chunk_size_that_is_not_hex_is_refused_by_both(one):
    raw = _chunked_garbage(one.replace(b"Transfer-Encoding: chunked\r\n", b"").replace(
        b"Transfer-Encoding: Chunked\r\n", b""))
    if b"Content-Length" in raw.partition(b"\r\n\r\n")[0]:
        raw = re.sub(rb"Content-Length: \d+\r\n", b"", raw)
    assert ours(raw)[1] is not None and theirs(raw)[1]


# -- where the server and h11 differ, on purpose: pinned -----------------------------------

def test_where_the_server_refuses_what_h11_reads_as_rfc_9110_says():
    """h11 leaves an unknown expectation and a version it does not speak to its user: the
    server answers them itself (417, 505). And a request with both ``Content-Length`` and
    ``Transfer-Encoding``, which RFC 9112 section 6.1 lets a server refuse or read by the
    coding alone: h11 reads it chunked, the server refuses it (the smuggling shape)."""
    both = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    assert ours(both) == ([], 400)
    control = b"GET / HTTP/1.1\r\nHost: a\x01x\r\n\r\n"  # RFC 9110 section 5.5: no CTL in a value
    assert ours(control) == ([], 400) and theirs(control) == ([("GET", b"/", {"host": b"a\x01x"}, b"")], False)
    bare_lf = b"GET / HTTP/1.1\nHost: x\r\n\r\n"  # RFC 9112 section 2.2: a recipient MAY take a bare LF
    assert ours(bare_lf) == ([], 400) and theirs(bare_lf) == ([("GET", b"/", {"host": b"x"}, b"")], False)
    folded = b"GET / HTTP/1.1\r\nHost: x\r\nX-Extra: a\r\n b\r\n\r\n"  # RFC 9112 section 5.2: 400, or unfold
    assert ours(folded) == ([], 400)
    assert theirs(folded) == ([("GET", b"/", {"host": b"x", "x-extra": b"a b"}, b"")], False)
    assert theirs(both) == ([("POST", b"/", {"host": b"x", "content-length": b"3", "transfer-encoding": b"chunked"},
                              b"")], False)
    for raw, status in ((b"GET / HTTP/1.1\r\nHost: x\r\nExpect: gzip\r\n\r\n", 417),
                        (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505)):
        assert ours(raw) == ([], status)
        headers = {"host": b"x", "expect": b"gzip"} if status == 417 else {"host": b"x"}
        assert theirs(raw) == ([("GET", b"/", headers, b"")], False)


def test_where_the_server_is_more_lenient_than_h11():
    """An HTTP/1.1 request without ``Host`` is served (as it always was: probes and
    hand-written clients send none), where RFC 9112 says 400 and h11 refuses; and an
    HTTP/1.0 client's keep-alive is kept."""
    no_host = b"GET /healthz HTTP/1.1\r\n\r\n"
    assert ours(no_host) == ([("GET", b"/healthz", {}, b"")], None) and theirs(no_host) == ([], True)
    kept = b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /b HTTP/1.0\r\n\r\n"
    assert [seen[1] for seen in ours(kept)[0]] == [b"/a", b"/b"] and len(theirs(kept)[0]) == 1
