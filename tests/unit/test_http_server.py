"""The API's HTTP server on the wire: keep-alive and pipelining answered in order, HEAD,
``Expect: 100-continue``, a refused body dropped (not kept), bodies over the limit with
and without a length, and connections that stall are closed rather than kept forever."""

from __future__ import annotations

import asyncio
import re
import socket
import time

import orjson
import pytest

from stream.config import Limits
from stream.http import server as http_server
from tests.unit.served import listening
from tests.unit.test_http_api import DEFAULT_LIMITS, make_api

MATCH = orjson.dumps({"endpoints": ["ns/a"], "body": {"tokenized": {"prompts": [{"mm_features": [
    {"hash": "h1", "modality": "image"}]}]}}})


def post(path: str, body: bytes, *extra: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s" % (
        path.encode(), len(body), b"".join(h + b"\r\n" for h in extra), body)


def answers_on_one_connection(raw: bytes, limits: Limits = DEFAULT_LIMITS, close_after: float = 5.0) -> bytes:
    """Everything the server sends back on one connection given ``raw`` (read until it
    closes, or ``close_after`` seconds of silence)."""
    api = make_api(limits)

    def talk(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=close_after) as sock:
            sock.sendall(raw)
            got = b""
            try:
                while chunk := sock.recv(65536):
                    got += chunk
            except TimeoutError:
                pass
        return got

    async def run() -> bytes:
        async with listening(api) as port:
            return await asyncio.get_running_loop().run_in_executor(None, talk, port)

    return asyncio.run(run())


def statuses(raw: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.[01] (\d{3}) ", raw)]


def test_pipelined_requests_are_answered_in_order_whether_at_once_or_in_a_task():
    raw = (post("/v1/match", MATCH) + b"GET /v1/state?limit=0 HTTP/1.1\r\nHost: x\r\n\r\n"
           + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n"
           + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answer = answers_on_one_connection(raw)
    assert statuses(answer) == [200, 200, 200, 404, 200]
    assert answer.index(b'"request_items"') < answer.index(b'"digest"') < answer.index(b'"status":"ok"')


def test_head_answers_the_length_of_get_without_the_body():
    answer = answers_on_one_connection(b"HEAD /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert statuses(answer) == [200] and body == b""
    assert b"Content-Length: %d" % len(orjson.dumps({"status": "ok"})) in head


def test_expect_100_continue_gets_its_interim_answer_before_the_body_is_sent():
    api = make_api()

    def talk(port: int) -> tuple[bytes, bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /v1/match HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(MATCH))
            interim = sock.recv(65536)
            sock.sendall(MATCH)
            rest = b""
            while chunk := sock.recv(65536):
                rest += chunk
        return interim, rest

    async def run() -> tuple[bytes, bytes]:
        async with listening(api) as port:
            return await asyncio.get_running_loop().run_in_executor(None, talk, port)

    interim, rest = asyncio.run(run())
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n" and statuses(rest) == [200]


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_body_over_the_limit_is_a_413_with_or_without_a_length(framing):
    body = b'{"pad": "' + b"x" * 300 + b'"}'
    if framing == "length":
        raw = post("/v1/match", body)
    else:
        raw = (b"POST /v1/match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               + b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 50]), body[i:i + 50]) for i in range(0, len(body), 50))
               + b"0\r\n\r\n")
    answer = answers_on_one_connection(raw + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                                       Limits(max_body_bytes=100))
    assert statuses(answer)[0] == 413 and b'"body_too_large"' in answer


def test_a_request_refused_before_its_body_keeps_nothing_of_it_and_the_connection_goes_on(tmp_path):
    from stream.http.auth import TokenFile

    tokens = tmp_path / "tokens"
    tokens.write_text("tok-1\n")
    kept: list[int] = []
    api = make_api()
    api.write_tokens = TokenFile(tokens)
    placements = api.placements

    async def spy(request):
        kept.append(request.size)
        return await placements(request)

    api.placements = spy

    def talk(port: int) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(post("/v1/placements", b"x" * 100_000)
                         + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
        return got

    async def run() -> bytes:
        async with listening(api) as port:
            return await asyncio.get_running_loop().run_in_executor(None, talk, port)

    answer = asyncio.run(run())
    assert statuses(answer) == [401, 200] and b"WWW-Authenticate: Bearer" in answer
    assert kept == []  # the route never saw the request, nor its body


def test_a_head_that_never_ends_and_an_idle_connection_are_closed(monkeypatch):
    monkeypatch.setattr(http_server, "HEAD_TIMEOUT_S", 0.3)
    monkeypatch.setattr(http_server, "KEEPALIVE_S", 0.3)
    api = make_api()

    def closed_after(port: int, raw: bytes) -> float:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(raw)
            while sock.recv(65536):
                pass
        return time.monotonic() - started

    async def run() -> tuple[float, float]:
        async with listening(api) as port:
            loop = asyncio.get_running_loop()
            slow = await loop.run_in_executor(None, closed_after, port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            idle = await loop.run_in_executor(None, closed_after, port,
                                              b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            return slow, idle

    slow, idle = asyncio.run(run())
    assert 0.25 < slow < 5 and 0.25 < idle < 5


def test_closing_the_server_lets_a_request_in_flight_finish():
    api = make_api()
    release = asyncio.Event()
    state_summary = api.state_summary

    async def slow(request):
        await release.wait()
        return await state_summary(request)

    api.state_summary = slow

    async def run() -> int:
        import aiohttp

        server = api.server()
        port = await server.start("127.0.0.1", 0)
        async with aiohttp.ClientSession() as client:
            pending = asyncio.create_task(client.get(f"http://127.0.0.1:{port}/v1/state"))
            while not server.tasks:
                await asyncio.sleep(0.01)
            closing = asyncio.create_task(server.close())
            while not server.stopping:  # closing, and waiting for the request in flight
                await asyncio.sleep(0)
            release.set()
            response = await pending
            await closing
            return response.status

    assert asyncio.run(run()) == 200
