"""The API's HTTP server against clients that misbehave: ones that never read their
answers, send a request without end or too slowly, pipeline a burst that would hold the
loop, or use the corners of HTTP/1.x (upgrades, ``Expect``, HTTP/1.0 keep-alive, bytes
after ``Connection: close``). Each test runs the real server on a free port and talks to
it over a raw socket; the server's timing knobs are its parameters, made small here."""

from __future__ import annotations

import asyncio
import collections
import functools
import gc
import logging
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import orjson
import pytest

from stream.config import Limits
from stream.event_loop import new_event_loop
from stream.http import body_reader
from stream.http import server as http_server
from stream.http.api import HttpApi
from tests.unit.test_http_api import make_api

MATCH = orjson.dumps({"endpoints": ["ns/a"], "body": {"tokenized": {"prompts": [{"mm_features": [
    {"hash": "h1", "modality": "image"}]}]}}})
WIDE = orjson.dumps({"endpoints": [f"ns/pod-{i}" for i in range(1000)], "body": {"tokenized": {"prompts": [
    {"mm_features": [{"hash": f"h{i}", "modality": "image"} for i in range(16)]}]}}})
OPENAPI = b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n"
LAST = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
FAST = {"keepalive_s": 0.3, "head_timeout_s": 0.3, "body_idle_s": 0.3, "linger_s": 0.3, "sweep_s": 0.05}


def post(path: str, body: bytes, *extra: bytes, length: int | None = None) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n%s\r\n%s" % (
        path.encode(), len(body) if length is None else length, b"".join(h + b"\r\n" for h in extra), body)


def statuses(raw: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.[01] (\d{3}) ", raw)]


@asynccontextmanager
async def serving(api: HttpApi, **knobs: float) -> AsyncIterator[tuple[http_server.HttpServer, int]]:
    server = http_server.HttpServer(api.routes(), on_close=api.bodies.close, **knobs)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.close()


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Whether ``condition`` came true within ``timeout`` seconds (looked at every 10 ms)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


def in_thread(call: Callable, *args):
    return asyncio.get_running_loop().run_in_executor(None, call, *args)


def connect(port: int, timeout: float = 5.0, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:  # before connecting, so the window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    sock.connect(("127.0.0.1", port))
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (a reset counts as a close)."""
    got = b""
    try:
        while chunk := sock.recv(1 << 16):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def exchange(port: int, raw: bytes) -> bytes:
    with connect(port) as sock:
        sock.sendall(raw)
        return read_all(sock)


def test_a_client_that_never_reads_stops_the_server_reading_and_its_answers_stay_bounded():
    api = make_api()

    def flood(port: int) -> bool:
        with connect(port, timeout=2, rcvbuf=4096) as sock:
            try:
                sock.sendall(OPENAPI * 200_000)  # ~7.6 MB of requests, ~5.6 GB of answers
            except OSError:  # a timeout: the server stopped reading
                return False
            return True

    def pipelined(port: int, paused: threading.Event) -> bytes:
        with connect(port, rcvbuf=4096) as sock:
            sock.sendall(OPENAPI * 200 + LAST)
            assert paused.wait(5)
            return read_all(sock)

    async def run() -> tuple[bool, int, bytes]:
        async with serving(api) as (server, port):
            most, done = 0, False

            async def watch() -> None:
                nonlocal most
                while not done:
                    for connection in list(server.connections):
                        if connection.transport is not None:
                            size = connection.transport.get_write_buffer_size()
                            most = max(most, size)
                            if size > 32 << 20:  # a server without backpressure: the test's memory bounded
                                connection.transport.abort()
                    await asyncio.sleep(0.001)

            watcher = asyncio.create_task(watch())
            took_all = await in_thread(flood, port)
            done = True
            await watcher

            paused = threading.Event()
            talk = in_thread(pipelined, port, paused)

            def over_high_water() -> bool:
                return any(c.transport is not None and c.transport.get_write_buffer_size()
                           > c.transport.get_write_buffer_limits()[1] for c in server.connections)

            assert await until(over_high_water)
            paused.set()
            return took_all, most, await talk

    took_all, most, answers = asyncio.run(run())
    assert not took_all and most < 1 << 20
    assert statuses(answers) == [200] * 201  # once read, every answer comes, in order


def endless(port: int, head: bytes, block: bytes, most: int) -> tuple[int, bytes]:
    """(bytes sent, the answer) of ``head`` then ``block`` again and again until the
    server answers (or ``most`` bytes went)."""
    with connect(port) as sock:
        sock.sendall(head)
        sent = 0
        while sent < most and not select.select([sock], [], [], 0)[0]:
            try:
                sock.sendall(block)
            except OSError:
                break
            sent += len(block)
        return sent, read_all(sock)


def test_an_unfinished_trailer_or_chunk_extension_is_refused_once_over_the_head_limit():
    api = make_api(Limits(max_body_bytes=1 << 20))
    chunked = b"POST /v1/match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def run() -> list[tuple[int, bytes, float]]:
        async with serving(api) as (_, port):
            answers = []
            for head in (chunked + b"2\r\n{}\r\n0\r\nX-Trailer: ", chunked + b"2;x="):
                started = time.monotonic()
                sent, answer = await in_thread(endless, port, head, b"a" * 65536, 64 << 20)
                answers.append((sent, answer, time.monotonic() - started))
            return answers

    for sent, answer, seconds in asyncio.run(run()):
        assert statuses(answer) == [400] and b"FramingTooLarge" in answer and b"Connection: close" in answer
        assert sent < 4 << 20 and seconds < 5


def test_every_byte_of_a_request_counts_against_the_body_limit():
    api = make_api(Limits(max_body_bytes=200_000))
    one = b"1\r\na\r\n"  # 6 bytes a byte of content
    raw = (b"POST /v1/match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
           + one * 150_000)  # 900 KB: under the limit by content (150 KB), over it by bytes

    async def run() -> bytes:
        async with serving(api) as (_, port):
            return await in_thread(exchange, port, raw)  # the body never ends: only a 413 ends this

    answer = asyncio.run(run())
    assert statuses(answer) == [413] and b"Connection: close" in answer


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """The heap as the worker's, frozen (it freezes its own after loading the view): a
    timed test measures the server's turns, not a gen-2 collection of what the tests
    before it left in this process (~120 ms by the end of the unit suite)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def test_one_large_pipelined_write_of_small_matches_does_not_hold_the_loop(frozen_heap):
    api = make_api()
    one = post("/v1/match", MATCH)
    count = (256 * 1024) // len(one)

    async def run() -> tuple[float, bytes]:
        async with serving(api) as (_, port):
            worst, done = 0.0, False

            async def watch() -> None:
                """The loop's longest turn, in CPU time of its thread (a machine under load
                that preempts the process adds nothing to it, the client's thread neither)."""
                nonlocal worst
                while not done:
                    before = time.thread_time()
                    await asyncio.sleep(0.001)
                    worst = max(worst, time.thread_time() - before)

            watcher = asyncio.create_task(watch())
            await asyncio.sleep(0)
            answers = await in_thread(exchange, port, one * count + LAST)
            done = True
            await watcher
            return worst, answers

    worst, answers = asyncio.run(run())
    assert statuses(answers) == [200] * (count + 1)
    assert answers.count(b'"request_items"') == count
    assert worst < 0.02, f"the loop was held {worst * 1000:.0f} ms"


def test_a_connection_whose_answers_are_never_read_is_closed_once_it_expires():
    api = make_api()

    def talk(port: int, gone: threading.Event) -> None:
        with connect(port, rcvbuf=4096) as sock:
            sock.sendall(OPENAPI * 400 + LAST)  # ~11 MB of answers: more than the socket buffers take
            gone.wait(10)

    async def run() -> bool:
        async with serving(api, **FAST) as (server, port):
            gone = threading.Event()
            talk_done = in_thread(talk, port, gone)
            assert await until(lambda: bool(server.connections))
            closed = await until(lambda: not server.connections)
            gone.set()
            await talk_done
            return closed

    assert asyncio.run(run())


def test_a_wide_match_to_a_client_that_never_reads_ends_its_task_and_connection():
    api = make_api()

    def talk(port: int, gone: threading.Event) -> None:
        with connect(port, rcvbuf=4096) as sock:
            sock.sendall(post("/v1/match", WIDE) * 80)  # ~9 MB of answers
            gone.wait(10)

    async def run() -> tuple[bool, bool]:
        async with serving(api, **FAST) as (server, port):
            gone = threading.Event()
            talk_done = in_thread(talk, port, gone)
            began = await until(lambda: bool(server.tasks))
            ended = await until(lambda: not server.tasks and not server.connections)
            gone.set()
            await talk_done
            return began, ended

    assert asyncio.run(run()) == (True, True)


def test_a_body_that_comes_too_slowly_is_cut_off(tmp_path):
    from stream.http.auth import TokenFile

    tokens = tmp_path / "tokens"
    tokens.write_text("tok-1\n")
    api = make_api()
    api.write_tokens = TokenFile(tokens)

    def drip(port: int, head: bytes, byte: bytes) -> float | None:
        """Seconds until the server closed while a byte came every 50 ms (None: never)."""
        started = time.monotonic()
        with connect(port) as sock:
            sock.sendall(head)
            while time.monotonic() - started < 8:
                try:
                    sock.sendall(byte)
                    if select.select([sock], [], [], 0.05)[0] and not sock.recv(65536):  # an answer read on
                        return time.monotonic() - started
                except OSError:
                    return time.monotonic() - started
        return None

    heads = {
        "a body by length": (b"POST /v1/match HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n", b" "),
        "an endless chunk extension": (b"POST /v1/match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                                       b"\r\n\r\n1;", b"a"),
        "a refused body": (b"POST /v1/placements HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n", b" "),
    }

    async def run() -> dict[str, float | None]:
        async with serving(api, **FAST) as (_, port):
            took = await asyncio.gather(*(in_thread(drip, port, head, byte) for head, byte in heads.values()))
            return dict(zip(heads, took, strict=True))

    took = asyncio.run(run())
    assert all(seconds is not None and seconds < 5 for seconds in took.values()), took


def test_an_upgrade_with_a_body_is_refused_not_answered_without_its_body():
    api = make_api()

    async def run() -> bytes:
        async with serving(api) as (_, port):
            return await in_thread(exchange, port, post("/v1/match", MATCH, b"Connection: Upgrade", b"Upgrade: h2c"))

    answer = asyncio.run(run())
    assert statuses(answer) == [400] and b"protocol upgrades are not served" in answer


def test_100_continue_comes_after_the_answers_due_before_it():
    api = make_api()

    def talk(port: int) -> bytes:
        with connect(port) as sock:
            sock.sendall(OPENAPI + b"POST /v1/match HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                   b"Content-Length: %d\r\n\r\n" % len(MATCH))
            got = b""
            while b"100 Continue" not in got:
                got += sock.recv(65536)
            sock.sendall(MATCH + LAST)
            return got + read_all(sock)

    async def run() -> bytes:
        async with serving(api) as (_, port):
            return await in_thread(talk, port)

    assert statuses(asyncio.run(run())) == [200, 100, 200, 200]


def test_a_request_refused_before_the_body_it_was_told_to_send_closes_the_connection(tmp_path):
    from stream.http.auth import TokenFile

    tokens = tmp_path / "tokens"
    tokens.write_text("tok-1\n")
    api = make_api()
    api.write_tokens = TokenFile(tokens)

    def talk(port: int) -> bytes:
        with connect(port) as sock:  # the body is never sent: the client waits for 100 or an answer
            sock.sendall(b"POST /v1/placements HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                         b"Content-Length: 50\r\n\r\n")
            return read_all(sock)

    async def run() -> bytes:
        async with serving(api, **FAST) as (_, port):
            return await in_thread(talk, port)

    answer = asyncio.run(run())
    assert statuses(answer) == [401] and b"Connection: close" in answer


def test_a_413_by_length_over_what_is_lingered_on_says_the_connection_closes():
    api = make_api(Limits(max_body_bytes=100))

    def talk(port: int) -> bytes:
        with connect(port) as sock:
            sock.sendall(post("/v1/match", b"x" * 65536, length=2 << 20))
            return read_all(sock)

    async def run() -> bytes:
        async with serving(api, **FAST) as (_, port):
            return await in_thread(talk, port)

    answer = asyncio.run(run())
    assert statuses(answer) == [413] and b"Connection: close" in answer


def test_http_1_0_keep_alive_is_announced_and_kept():
    api = make_api()

    def talk(port: int) -> tuple[bytes, bytes]:
        with connect(port) as sock:
            sock.sendall(b"GET /healthz HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            first = b""
            while b'"ok"' not in first:
                first += sock.recv(65536)
            sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            return first, read_all(sock)

    async def run() -> tuple[bytes, bytes]:
        async with serving(api) as (_, port):
            return await in_thread(talk, port)

    first, second = asyncio.run(run())
    assert b"Connection: keep-alive\r\n" in first and statuses(second) == [200]


def test_bytes_after_connection_close_are_ignored_without_a_warning(caplog):
    api = make_api()

    async def run() -> bytes:
        async with serving(api) as (_, port):
            return await in_thread(exchange, port, LAST + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")

    with caplog.at_level(logging.WARNING, logger="stream.http.server"):
        answer = asyncio.run(run())
    assert statuses(answer) == [200]
    assert [r.getMessage() for r in caplog.records if r.name == "stream.http.server"] == []


def test_refusals_are_logged_one_line_per_window_not_one_per_request(caplog):
    api = make_api()

    async def run() -> list[bytes]:
        async with serving(api) as (_, port):
            return [await in_thread(exchange, port, b"GET /healthz HTTP/9.9\r\n\r\n") for _ in range(20)]

    with caplog.at_level(logging.WARNING, logger="stream.http.server"):
        answers = asyncio.run(run())
    assert all(statuses(answer) == [400] for answer in answers)
    assert 1 <= len([r for r in caplog.records if "refused" in r.getMessage()]) <= 2


def test_a_failure_in_the_head_step_is_a_500_not_a_400(tmp_path):
    from stream.http.auth import TokenFile

    tokens = tmp_path / "tokens"
    tokens.write_text("tok-1\n")
    api = make_api()
    api.write_tokens = TokenFile(tokens)

    def broken(header: str | None) -> bool:
        raise RuntimeError("the token file is broken")

    api.write_tokens.allows = broken  # type: ignore[method-assign]

    async def run() -> bytes:
        async with serving(api) as (_, port):
            return await in_thread(exchange, port, post("/v1/placements", b"{}") + LAST)

    answer = asyncio.run(run())
    assert statuses(answer) == [500] and b"internal_error" in answer


def test_the_head_limit_holds_for_a_head_that_came_in_one_read():
    api = make_api()
    head = b"GET /healthz HTTP/1.1\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 8000) for i in range(9)) + b"\r\n"

    async def run() -> bytes:
        async with serving(api) as (_, port):
            return await in_thread(exchange, port, head + LAST)

    answer = asyncio.run(run())
    assert statuses(answer) == [400] and b"HeadTooLarge" in answer


SEND_FILE = """
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1]))) as sock:
    sock.sendall(open(sys.argv[2], "rb").read())
    while data := sock.recv(1 << 16):
        sys.stdout.buffer.write(data)
"""


def test_the_largest_body_within_the_limits_is_read_and_handed_on_a_slice_a_turn(tmp_path, monkeypatch):
    """A fast client's 16 MiB body: libuv reads up to 32 times a wake-up (8 MiB), and the
    body went to the body reader's pipe in one write that copied as fast as the child
    drained it; in the service each held the loop ~10 ms (20-40 ms on a busy machine).
    Now one turn of the loop reads at most ``READ_PER_TURN`` (and one read more) of a
    connection and hands at most ``WRITE_SLICE`` to the child: counted here per turn."""
    api = make_api()
    url = "data:image/png;base64," + "A" * (16 * 1024 * 1024 - 300)
    body = orjson.dumps({"endpoints": ["ns/a"], "body": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}]}})
    assert len(body) <= Limits().max_body_bytes
    request = tmp_path / "request"
    request.write_bytes(post("/v1/match", body) + LAST)
    turn, done = 0, False
    read: dict[int, int] = collections.Counter()
    handed: dict[int, int] = collections.Counter()

    def tick() -> None:
        nonlocal turn
        turn += 1
        if not done:
            asyncio.get_running_loop().call_soon(tick)

    def reads(self, data: bytes, sliced: bool = False) -> None:
        if not sliced:
            read[turn] += len(data)
        original_read(self, data, sliced)

    def hands(self, data) -> None:
        if any(self is child.requests for child in api.bodies.children):  # a body reader's stdin
            handed[turn] += sum(map(len, data))
        original_hand(self, data)

    original_read = http_server._Connection.data_received
    original_hand = asyncio.StreamWriter.writelines
    monkeypatch.setattr(http_server._Connection, "data_received", reads)
    monkeypatch.setattr(asyncio.StreamWriter, "writelines", hands)

    async def run() -> list[bytes]:
        nonlocal done
        async with serving(api) as (_, port):
            asyncio.get_running_loop().call_soon(tick)
            answers = []
            for _ in range(3):  # sent by another process, as fast as the kernel takes it
                sent = await in_thread(functools.partial(
                    subprocess.run, [sys.executable, "-c", SEND_FILE, str(port), str(request)],
                    capture_output=True, check=True, timeout=60))
                answers.append(sent.stdout)
            done = True
            return answers

    loop = new_event_loop()  # the service's loop (uvloop), whose reads are libuv's
    try:
        answers = loop.run_until_complete(run())
    finally:
        loop.close()
    assert [statuses(answer) for answer in answers] == [[200, 200]] * 3
    assert all(b'"modality":"image"' in answer for answer in answers)
    assert sum(read.values()) >= 3 * len(body) and sum(handed.values()) == 3 * len(body)
    assert (http_server.READ_PER_TURN, body_reader.WRITE_SLICE) == (256 * 1024, 256 * 1024)
    one_read = 256 * 1024  # uvloop's read buffer
    assert max(read.values()) <= 256 * 1024 + one_read, sorted(read.values())[-3:]
    assert max(handed.values()) <= 256 * 1024, sorted(handed.values())[-3:]
