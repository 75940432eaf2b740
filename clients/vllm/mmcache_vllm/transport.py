"""One kept-alive HTTP/1.1 connection to mmcache's ``/v1/engine-events``, reopened on error.

A new TCP (and TLS) connection per batch costs a handshake (a TLS one: a few round trips
and the key exchange's CPU) every ``interval_s``; the sender thread keeps one connection
instead (stdlib ``http.client``, as vLLM's image has nothing more). It is closed and opened
again after any error, a timeout (a late answer must not be read as the next POST's), an
answer not read to its end, or the server's ``Connection: close``; and before a POST when
it has been idle longer than ``MAX_IDLE_S``, under mmcache's keep-alive timeout (75 s), so
that the server rarely closes a connection just as a POST goes out on it.

A POST that fails on a connection that had already served one, before any byte of an
answer came, is sent once more on a new connection. Mostly the server had closed the
connection while it was idle and never read the POST; but a server that read it, applied
it and then went away without answering (killed, or its shutdown's grace ran out) fails
the same way, and then the service applies the batch twice, back to back. Engine events
applied twice back to back leave the view as applied once, except at the view's bound (a
full view may end different); closing idle connections early keeps that case rare.

Proxies are taken from the environment as urllib takes them (``HTTP_PROXY``,
``HTTPS_PROXY``, ``NO_PROXY``): a plain URL through the proxy, an ``https://`` one through
a CONNECT tunnel.
"""

from __future__ import annotations

import base64
import http.client
import socket
import ssl
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass

__all__ = ["Answer", "EventsConnection", "MAX_IDLE_S"]

# a kept connection idle longer is closed before the next POST: mmcache's server closes one
# idle for 75 s (KEEPALIVE_S), and a POST crossing that close is sent again (see above)
MAX_IDLE_S = 60.0

# errors of a kept connection the server closed: mostly while it was idle, the POST unread
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


@dataclass(frozen=True)
class Answer:
    """What the service answered: its status, its ``Location`` (a 3xx's) and the start of
    its body."""

    status: int
    location: str | None
    body: bytes


class EventsConnection:
    """POSTs to one URL over one connection kept alive between calls (one thread at a time)."""

    def __init__(self, url: str, timeout_s: float, context: ssl.SSLContext | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if self.https else 80)
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.url = url
        self.timeout_s = timeout_s
        self.context = context if context is not None or not self.https else ssl.create_default_context()
        self.opened = 0  # connections opened so far
        self.max_idle_s = MAX_IDLE_S
        self._connection: http.client.HTTPConnection | None = None
        self._served = 0  # answers read on the current connection
        self._answered_at = 0.0  # monotonic time of the current connection's last answer

    def post(self, body: bytes, headers: dict[str, str], max_answer_bytes: int) -> Answer:
        """The answer to one POST; raises ``OSError`` or ``http.client.HTTPException`` when
        there is none (the connection is then closed, the next POST opens another)."""
        if self._connection is not None and time.monotonic() - self._answered_at > self.max_idle_s:
            self.close()
        for attempt in (1, 2):
            reused = self._connection is not None and self._served > 0
            try:
                return self._exchange(body, headers, max_answer_bytes)
            except _STALE:
                self.close()
                if not reused or attempt == 2:
                    raise
            except BaseException:
                self.close()
                raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        """Closes the connection, if one is open."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _exchange(self, body: bytes, headers: dict[str, str], max_answer_bytes: int) -> Answer:
        connection = self._connection or self._open()
        target, extra = self._proxied
        connection.request("POST", target, body=body, headers={**headers, **extra})
        answer = connection.getresponse()
        data = answer.read(max_answer_bytes)
        self._served += 1
        self._answered_at = time.monotonic()
        if not answer.isclosed():  # more than we read: the connection cannot take another POST
            self.close()
        elif answer.will_close:
            self.close()
        return Answer(answer.status, answer.getheader("Location"), data)

    def _open(self) -> http.client.HTTPConnection:
        proxy = _proxy_for(self.https, self.host)
        connection: http.client.HTTPConnection
        if proxy is None:
            connection = (http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout_s,
                                                      context=self.context)
                          if self.https else http.client.HTTPConnection(self.host, self.port,
                                                                        timeout=self.timeout_s))
            self._proxied = (self.target, {})
        else:
            host, port, authorization = proxy
            credentials = {"Proxy-Authorization": authorization} if authorization else {}
            if self.https:
                connection = http.client.HTTPSConnection(host, port, timeout=self.timeout_s,
                                                         context=self.context)
                connection.set_tunnel(self.host, self.port, headers=credentials)
                self._proxied = (self.target, {})
            else:
                connection = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
                self._proxied = (self.url, credentials)
        self._connection = connection
        self._served = 0
        self.opened += 1
        connection.connect()
        # http.client sends a request's head and body in two writes: with Nagle's algorithm
        # the body waits for the server's delayed ACK of the head (~40 ms) on a kept connection
        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return connection

    _proxied: tuple[str, dict[str, str]] = ("/", {})


def _proxy_for(https: bool, host: str) -> tuple[str, int, str | None] | None:
    """The proxy the environment names for this URL (host, port, ``Proxy-Authorization``),
    or None: none set, or ``NO_PROXY`` names the host."""
    found = urllib.request.getproxies().get("https" if https else "http")
    if not found or urllib.request.proxy_bypass(host):
        return None
    parts = urllib.parse.urlsplit(found if "://" in found else f"http://{found}")
    authorization = None
    if parts.username is not None:
        pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        authorization = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
    return parts.hostname or "", parts.port or 80, authorization
