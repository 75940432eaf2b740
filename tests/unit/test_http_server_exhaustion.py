"""No client exhausts the server (CONTRACT, "Over time and under aggregate load"): a body
costs about its bytes, the bytes of bodies in flight have a server-wide budget (503
``server_busy`` with ``Retry-After`` over it), open connections have a cap (a new one over
it is closed at once), memory is given back once the clients are gone, many tiny chunks
do not hold the loop, and a refused client that sends its whole body before reading
still reads its 413 (the lingering close).

The memory test runs the API's server in a process of its own
(``stream.bench.body_attack``) and reads its resident set from ``/proc``."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import select
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import orjson
import pytest
import requests

from stream.bench.body_attack import attack, metric, serving_process
from stream.config import Limits
from stream.http import server as http_server
from tests.unit.test_http_api import make_api
from tests.unit.test_http_server_limits import (
    connect,
    exchange,
    frozen_heap,  # noqa: F401 - a fixture
    in_thread,
    read_all,
    serving,
    statuses,
    until,
)

CHUNKED = b"POST /v1/match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_tiny_chunks_cost_about_their_bytes_the_budget_bites_and_memory_is_given_back():
    """The issue's attack (``stream.bench.body_attack``, also a bench row): 16 connections
    each send 15.6 MB of 2-byte chunks (under the 16 MiB + 64 KiB a request may take) and
    keep their bodies open. Every chunk kept as its own ``bytes`` took the server from
    386 MB to 3,040 MB, never given back."""
    with serving_process(sweep_s=0.05) as (process, port):
        got = attack(process, port)
        busy = [answer for answer in got.answers if statuses(answer) == [503]]
        refusals = metric(port, "mmcache_http_body_budget_refusals_total")
        held = metric(port, "mmcache_http_body_in_flight_bytes")
    mib = 1 << 20
    print(f"RSS before {got.before // mib} MiB, peak {got.peak // mib} MiB, with the bodies open "
          f"{got.during // mib} MiB, after {got.after // mib} MiB")
    assert not got.runaway, f"RSS grew {(got.peak - got.before) // mib} MiB"
    # the budget (64 MiB held by the bodies), and what reading costs
    assert got.peak - got.before < (64 + 48) * mib, f"RSS grew {(got.peak - got.before) // mib} MiB"
    # every refusal counted once the server read all that was sent has its 503 read, and
    # none is counted after
    assert got.refused and got.answered and busy and got.refusals == len(busy) == refusals, (
        got.refused, got.refusals, refusals, [statuses(a) for a in got.answers])
    assert all(b'"server_busy"' in answer and b"Retry-After: 1\r\n" in answer for answer in busy)
    assert got.closed and held == 0
    assert got.after < got.before * 1.1, f"RSS {got.before // mib} MiB before, {got.after // mib} MiB after"


def test_a_body_costs_about_its_bytes_however_small_its_chunks():
    api = make_api()
    kept: list[int] = []
    original = api.match_now

    def spy(request: http_server.Request) -> http_server.Response | None:
        kept.append(sum(map(sys.getsizeof, request.chunks)) + sys.getsizeof(request.chunks))
        return original(request)

    api.match_now = spy  # type: ignore[method-assign]
    content = orjson.dumps({"endpoints": ["ns/a"], "body": {"messages": [{"role": "user", "content": "x" * 20_000}]}})
    raw = CHUNKED + b"".join(b"1\r\n%s\r\n" % content[i:i + 1] for i in range(len(content))) + b"0\r\n\r\n"

    async def run() -> bytes:
        async with serving(api) as (_, port):
            return await in_thread(exchange, port, raw + b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")

    assert statuses(asyncio.run(run())) == [200, 200]
    assert kept and kept[0] < len(content) * 1.25 + 1024, f"{kept[0]} bytes held for a {len(content)}-byte body"


def test_many_tiny_chunks_do_not_hold_the_loop(frozen_heap):  # noqa: F811
    """Two million 1-byte chunks (12 MB on the wire) held the loop 331 ms in one turn."""
    api = make_api()
    content = orjson.dumps({"endpoints": ["ns/a"], "body": {"messages": [{"role": "user", "content": "x" * 1_999_900}]}})
    raw = CHUNKED + b"".join(b"1\r\n%s\r\n" % content[i:i + 1] for i in range(len(content))) + b"0\r\n\r\n"
    raw += b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"

    async def run() -> tuple[float, bytes]:
        async with serving(api) as (_, port):
            worst, done = 0.0, False
            watching = asyncio.Event()

            async def watch() -> None:
                nonlocal worst
                watching.set()
                while not done:
                    before = time.thread_time()
                    await asyncio.sleep(0.001)
                    worst = max(worst, time.thread_time() - before)

            watcher = asyncio.create_task(watch())
            await watching.wait()
            answers = await in_thread(exchange, port, raw)
            done = True
            await watcher
            return worst, answers

    worst, answers = asyncio.run(run())
    print(f"longest turn of the loop {worst * 1000:.1f} ms")
    assert statuses(answers) == [200, 200]
    assert worst < 0.02, f"the loop was held {worst * 1000:.0f} ms"


def test_bodies_over_the_server_wide_budget_get_503_server_busy_and_the_rest_goes_on():
    api = make_api(Limits(max_body_bytes=1 << 20))
    head = b"POST /v1/match HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
    size = 300_000

    async def run() -> tuple[list[bytes], bytes, int, int]:
        async with serving(api, body_budget=1 << 20) as (server, port):
            socks = [await in_thread(connect, port) for _ in range(3)]
            answers = []
            for sock in socks[:2]:  # two half-sent bodies hold 2 x 150 KB
                sock.sendall(head % size + b" " * (size // 2))
            assert await until(lambda: server.body_bytes >= size)
            socks[2].sendall(head % 800_000 + b" " * 800_000)  # cannot fit: refused before it is read
            socks[2].shutdown(socket.SHUT_WR)
            answers.append(await in_thread(read_all, socks[2]))
            for sock in socks[:2]:
                sock.sendall(b" " * (size // 2))  # whole: read, answered (400: not JSON)
                sock.shutdown(socket.SHUT_WR)
                answers.append(await in_thread(read_all, sock))
                sock.close()
            socks[2].close()
            assert await until(lambda: server.body_bytes == 0)
            after = await in_thread(exchange, port, b"POST /v1/match HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                                    b"Connection: close\r\n\r\n{}")
            return answers, after, server.refusals["body_budget"], server.body_bytes

    answers, after, refused, held = asyncio.run(run())
    assert statuses(answers[0]) == [503] and b'"server_busy"' in answers[0] and b"Retry-After: 1\r\n" in answers[0]
    assert [statuses(answer) for answer in answers[1:]] == [[400], [400]]
    assert statuses(after) == [400] and refused == 1 and held == 0


def test_matches_never_take_the_room_writes_need_in_the_budget():
    """A flood of big matches (an open route) fills at most its share of the budget
    (``MATCH_BUDGET_SHARE``): a placement's body still fits beside it."""
    api = make_api(Limits(max_body_bytes=1 << 20))
    size = 300_000
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"

    async def run() -> tuple[list[bytes], list[bytes]]:
        async with serving(api, body_budget=1 << 20) as (server, port):
            floods = [await in_thread(connect, port) for _ in range(4)]
            matches = []
            for sock in floods:  # each holds its body half sent, as long as it fits
                sock.sendall(head % (b"/v1/match", size) + b" " * (size // 2))
            assert await until(lambda: server.body_bytes >= 2 * size // 2)
            for sock in floods:
                sock.sendall(b" " * (size // 2))
            write = await in_thread(connect, port)
            write.sendall(head % (b"/v1/placements", 200_000) + b" " * 200_000)
            write.shutdown(socket.SHUT_WR)
            placement = [await in_thread(read_all, write)]
            for sock in floods:
                sock.shutdown(socket.SHUT_WR)
                matches.append(await in_thread(read_all, sock))
                sock.close()
            write.close()
            return matches, placement

    matches, placement = asyncio.run(run())
    assert [503] in [statuses(m) for m in matches]  # the flood was refused past its share
    assert statuses(placement[0]) == [400]  # read whole (not JSON): never refused for room


def test_a_chunked_body_that_takes_the_server_over_its_budget_is_refused_midway():
    api = make_api(Limits(max_body_bytes=1 << 20))

    async def run() -> tuple[bytes, int]:
        async with serving(api, body_budget=256 * 1024) as (server, port):
            answer = await in_thread(exchange, port, CHUNKED + (b"1000\r\n" + b" " * 4096 + b"\r\n") * 100
                                     + b"0\r\n\r\n")
            return answer, server.refusals["body_budget"]

    answer, refused = asyncio.run(run())
    assert statuses(answer) == [503] and b'"server_busy"' in answer and refused == 1


def test_a_connection_over_the_cap_is_closed_at_once_and_counted():
    api = make_api()

    async def run() -> tuple[list[bytes], bytes, int, int]:
        async with serving(api, max_connections=4) as (server, port):
            held = [await in_thread(connect, port) for _ in range(4)]
            assert await until(lambda: len(server.connections) == 4)
            over = await in_thread(connect, port)
            refused = await in_thread(read_all, over)  # closed without an answer
            over.close()
            for sock in held:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answers = [await in_thread(read_all, sock) for sock in held]
            for sock in held:
                sock.close()
            assert await until(lambda: not server.connections)
            again = await in_thread(exchange, port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            return answers, refused + again, server.refusals["connection_cap"], len(server.connections)

    answers, after, refused, left = asyncio.run(run())
    assert [statuses(answer) for answer in answers] == [[200]] * 4
    assert statuses(after) == [200] and refused == 1 and left == 0


def served_in_thread(limits: Limits, **knobs: object) -> tuple[int, asyncio.AbstractEventLoop, threading.Thread]:
    """The server on a loop of its own thread, for blocking clients of the test's thread."""
    loop = asyncio.new_event_loop()
    started: list[int] = []
    ready = threading.Event()
    api = make_api(limits)

    async def serve() -> None:
        server = http_server.HttpServer(api.routes(), on_close=api.bodies.close, **knobs)
        started.append(await server.start("127.0.0.1", 0))
        loop.stopping_server = server  # type: ignore[attr-defined]
        ready.set()

    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    asyncio.run_coroutine_threadsafe(serve(), loop).result(10)
    assert ready.wait(10)
    return started[0], loop, thread


@contextlib.contextmanager
def server_thread(limits: Limits, **knobs: object) -> Iterator[int]:
    port, loop, thread = served_in_thread(limits, **knobs)
    try:
        yield port
    finally:
        asyncio.run_coroutine_threadsafe(loop.stopping_server.close(), loop).result(30)  # type: ignore[attr-defined]
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


@pytest.mark.parametrize("mib", [17, 64])
def test_a_client_that_sends_its_whole_body_first_reads_its_413(mib):
    """urllib and requests send the whole body before they read: the server answers 413
    by the length at once, then reads and drops the rest (bounded in time) so that the
    client reads the 413 instead of a broken pipe."""
    body = b"x" * (mib << 20)
    got: dict[str, object] = {}
    with server_thread(Limits()) as port:
        url = f"http://127.0.0.1:{port}/v1/placements"
        try:
            urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=30)
            got["urllib"] = "no error"
        except urllib.error.HTTPError as exc:
            got["urllib"] = (exc.code, orjson.loads(exc.read())["error"]["code"])
        except (OSError, http.client.HTTPException) as exc:
            got["urllib"] = type(exc).__name__
        try:
            answer = requests.post(url, data=body, timeout=30)
            got["requests"] = (answer.status_code, answer.json()["error"]["code"])
        except requests.RequestException as exc:
            got["requests"] = type(exc).__name__
    assert got == {"urllib": (413, "body_too_large"), "requests": (413, "body_too_large")}


def test_a_chunked_body_over_the_limit_sent_whole_first_reads_its_413():
    """No length to refuse by: the 413 comes once the body passes the limit, and the rest
    of it is still read and dropped."""
    def chunks() -> Iterator[bytes]:
        for _ in range(20):
            yield b"x" * (1 << 20)

    with server_thread(Limits()) as port:
        answer = requests.post(f"http://127.0.0.1:{port}/v1/placements", data=chunks(), timeout=30)
    assert (answer.status_code, answer.json()["error"]["code"]) == (413, "body_too_large")


def test_a_lingering_close_ends_when_the_client_goes_quiet_or_its_time_is_up():
    api = make_api(Limits(max_body_bytes=100))

    def trickle(port: int) -> tuple[bytes, float]:
        """A refused client that keeps sending a little (1 KiB every 20 ms) for ever:
        cut once the linger's time is up (its sends then fail)."""
        started = time.monotonic()
        with connect(port, timeout=10) as sock:
            sock.sendall(b"POST /v1/match HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
            got, ended = b"", False
            while time.monotonic() - started < 8:
                try:
                    sock.sendall(b" " * 1024)
                    if select.select([] if ended else [sock], [], [], 0.02)[0]:
                        chunk = sock.recv(65536)
                        ended = not chunk  # the server shut its side: it still reads
                        got += chunk
                except OSError:
                    break
            return got, time.monotonic() - started

    async def run() -> tuple[bytes, float, int]:
        async with serving(api, linger_s=0.5, linger_idle_s=0.2, sweep_s=0.05) as (server, port):
            got, took = await in_thread(trickle, port)
            return got, took, server.refusals["linger_cut"]

    got, took, cut = asyncio.run(run())
    assert statuses(got) == [413] and took < 5 and cut == 1


def test_the_budget_defaults_to_four_bodies_and_may_not_be_below_one(monkeypatch):
    assert Limits().body_budget == 64 << 20 and Limits(max_body_bytes=1 << 20).body_budget == 4 << 20
    monkeypatch.setenv("MMCACHE_BODY_BUDGET_BYTES", str(1 << 20))
    with pytest.raises(ValueError, match="MMCACHE_BODY_BUDGET_BYTES .* must be at least MMCACHE_MAX_BODY_BYTES"):
        Limits()
    assert Limits(max_body_bytes=1 << 20).body_budget == 1 << 20


def test_the_api_serves_within_its_limits_bounds_and_exports_them():
    api = make_api(Limits(max_connections=7, body_budget_bytes=32 << 20))
    server = api.server()
    assert (server.max_connections, server.body_budget) == (7, 32 << 20)
    server.body_bytes, server.refusals["connection_cap"] = 1234, 5
    exported = api.metrics.registry.get_sample_value
    assert exported("mmcache_http_body_in_flight_bytes") == 1234
    assert exported("mmcache_http_connections_refused_total") == 5
    assert exported("mmcache_http_connections") == 0
    assert exported("mmcache_http_body_budget_refusals_total") == exported("mmcache_http_lingers_cut_total") == 0
