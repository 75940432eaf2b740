"""Memory under the tiny-chunk body attack of issue 30 (section 2).

Sixteen connections each send 15.6 MB of a chunked ``POST /v1/match`` body in 2-byte
chunks (under the 16 MiB + 64 KiB one request may take on the wire) and keep it open.
When every chunk was kept as its own ``bytes`` this took the service from 386 MB to
3,040 MB, never given back. The server runs in a process of its own (the API's own
server on uvloop, with the default limits: a 64 MiB budget of body bytes), so that its
resident set is its own: read from ``/proc`` before, at its peak (sampled every 5 ms),
with the bodies open, and once every client has gone. Before the attack and after it the
process gives its freed memory back (glibc's ``malloc_trim``), as serve does every
``TRIM_EVERY_S``: the figure after is what serve keeps, not what glibc has not yet
returned. The control is the idle server.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import re
import select
import socket
import statistics
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import orjson

from stream import allocator
from stream.bench.figures import Figure, span
from stream.config import Limits

__all__ = ["Attack", "attack", "body_attack_figures", "metric", "rss_bytes", "serving_process"]

CHUNKED = b"POST /v1/match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
#: Bytes on the wire a connection sends, and the connections.
WIRE = 15_600_000
CONNECTIONS = 16
#: Growth of the resident set past which the attack stops (a server without bounds: the
#: machine's memory kept).
RUNAWAY = 1 << 30
#: ``TCP_CLOSE`` of Linux's ``include/net/tcp_states.h``: a socket reset by its peer.
_TCP_CLOSE = 7


def rss_bytes(pid: int) -> int:
    """The resident set of process ``pid``."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


@contextlib.contextmanager
def serving_process(**knobs: object) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """The API's server in a process of its own, given ``HttpServer``'s ``knobs``: the
    process and its port, until the block ends."""
    process = subprocess.Popen(
        [sys.executable, "-m", "stream.bench.body_attack", orjson.dumps(knobs).decode()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        port = int(process.stdout.readline())  # type: ignore[union-attr]
        yield process, port
    finally:
        with contextlib.suppress(BrokenPipeError):  # ended already
            process.stdin.close()  # type: ignore[union-attr]
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _ask(process: subprocess.Popen[bytes], command: bytes) -> bytes:
    """The served process's answer to ``command`` (one line each way)."""
    process.stdin.write(command + b"\n")  # type: ignore[union-attr]
    process.stdin.flush()  # type: ignore[union-attr]
    answer = process.stdout.readline()  # type: ignore[union-attr]
    if not answer:
        raise RuntimeError(f"the served process ended (exit {process.wait()}) when asked {command!r}")
    return answer.strip()


def _give_back(process: subprocess.Popen[bytes]) -> None:
    """Have the served process give its freed memory back, as serve does periodically
    (``stream.allocator``): the resident set after the attack is then what serve keeps."""
    _ask(process, b"give back")


def _exchange(port: int, raw: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        got = b""
        while chunk := sock.recv(1 << 16):
            got += chunk
        return got


def metric(port: int, name: str) -> float | None:
    """One unlabelled sample of the server's /metrics (None: not exported)."""
    raw = _exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    found = re.search(rb"^%s (\S+)$" % re.escape(name.encode()), raw, re.MULTILINE)
    return None if found is None else float(found.group(1))


def _unacknowledged(sock: socket.socket) -> int:
    """Bytes sent on ``sock`` that its peer has not acknowledged yet."""
    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)), sys.byteorder)


def _drained(socks: list[socket.socket], port: int, process: subprocess.Popen[bytes]) -> bool:
    """Whether every byte sent on ``socks`` was parsed by the server at ``port``: none is
    left unacknowledged here (Linux's ``TIOCOUTQ``; a socket the server reset takes no more),
    none unread in the server's socket (its receive queue in ``/proc/net/tcp``), and none
    read but not parsed yet in the server (``HttpServer.unparsed_bytes``), in that order."""
    if any(_unacknowledged(sock) for sock in socks if not _reset(sock)):
        return False
    ours = {sock.getsockname()[1] for sock in socks}
    with open("/proc/net/tcp") as table:
        next(table)
        for row in table:
            local, remote, _state, queues = row.split()[1:5]
            if int(local.split(":")[1], 16) == port and int(remote.split(":")[1], 16) in ours \
                    and int(queues.split(":")[1], 16):
                return False
    return _ask(process, b"unparsed") == b"0"


def _reset(sock: socket.socket) -> bool:
    """Whether ``sock`` was reset by its peer (Linux's ``TCP_INFO``: its state is CLOSE)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_CLOSE


def _until(condition: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@dataclass(frozen=True)
class Attack:
    """What one attack did to the server's resident set (bytes), and what it answered."""

    before: int
    peak: int
    during: int
    after: int
    runaway: bool
    refused: bool  # a body was refused for the budget once the server read what was sent
    refusals: int  # bodies refused for the budget, counted once the server read what was sent
    answered: bool  # each of them had its 503 read by its client
    closed: bool  # every attacking connection was gone from the server afterwards
    answers: list[bytes]


def attack(process: subprocess.Popen[bytes], port: int, connections: int = CONNECTIONS,
           wire: int = WIRE) -> Attack:
    """Run the attack on a served process; its figures once every client has gone."""
    one = b"2\r\nab\r\n"
    body = one * (wire // len(one))
    for _ in range(3):  # warm: what a first request loads stays loaded
        _exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        metric(port, "mmcache_http_connections")
    _give_back(process)
    before = rss_bytes(process.pid)
    peak, runaway, stop = before, threading.Event(), threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, rss_bytes(process.pid))
            if peak - before > RUNAWAY:
                runaway.set()
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(connections)]

    def send(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.sendall(CHUNKED)
            for start in range(0, len(body), 1 << 20):
                if runaway.is_set():
                    return
                sock.sendall(body[start:start + (1 << 20)])

    senders = [threading.Thread(target=send, args=(sock,)) for sock in socks]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    # the server has parsed everything sent once no attacking socket has bytes on their way
    # (unacknowledged here, unread or unparsed in the server); only then is the count of
    # refusals final (the bodies' own figures cannot tell: a body's bytes held count its
    # slack, so "every body not refused is whole" would be seen early)
    whole = not runaway.is_set() and _until(lambda: _drained(socks, port, process), 60)
    refusals = metric(port, "mmcache_http_body_budget_refusals_total") or 0
    refused = whole and refusals >= 1 and connections * len(body) * 2 // len(one) > Limits().body_budget
    during = rss_bytes(process.pid)
    answers = [b""] * len(socks)

    def read_answers() -> bool:
        """Whether every refusal counted has its answer read (each read as it comes)."""
        for at, sock in enumerate(socks):
            if select.select([sock], [], [], 0)[0]:
                with contextlib.suppress(OSError):
                    answers[at] += sock.recv(1 << 16)
        return sum(1 for answer in answers if answer.startswith(b"HTTP/1.1 503 ")) >= refusals

    answered = _until(read_answers, 60)  # a condition, bounded generously: a busy machine is slow, not wrong
    for sock in socks:
        sock.close()
    stop.set()
    sampler.join()
    closed = _until(lambda: metric(port, "mmcache_http_connections") == 1, 60)
    _give_back(process)
    return Attack(before, peak, during, rss_bytes(process.pid), runaway.is_set(), refused, int(refusals),
                  whole and answered, closed, answers)


def body_attack_figures(runs: int, connections: int = CONNECTIONS, wire: int = WIRE) -> list[Figure]:
    """RSS peak and RSS after the attack, against the idle server, over ``runs`` fresh
    servers."""
    attacks = []
    for _ in range(runs):
        with serving_process() as (process, port):
            attacks.append(attack(process, port, connections, wire))
    mib = 1 << 20
    before = statistics.median(a.before for a in attacks) / mib
    peak = statistics.median(a.peak for a in attacks) / mib
    after = statistics.median(a.after for a in attacks) / mib
    budget = 64
    what = (f"{connections} connections x {wire / 1e6:.1f} MB of 2-byte chunks kept open (the issue's "
            f"attack); {runs} fresh servers")
    return [
        Figure("body_attack_rss_peak", round(peak, 1), "MiB", f"<= idle + {budget} MiB budget + 48 MiB",
               peak <= before + budget + 48 and not any(a.runaway for a in attacks), round(before, 1),
               round(peak / before, 3),
               f"{what}; peak over runs {span([a.peak / mib for a in attacks], 1)} MiB; with the bodies "
               f"open {span([a.during / mib for a in attacks], 1)} MiB; a body refused 503 server_busy in "
               f"{sum(a.refused for a in attacks)} of {runs} runs; before the fix: 3,040 MB from 386 MB "
               "in the service"),
        Figure("body_attack_rss_after", round(after, 1), "MiB", "<= 1.1 x idle", after <= 1.1 * before
               and all(a.closed for a in attacks), round(before, 1), round(after / before, 3),
               f"once every attacking client closed and freed memory was given back (as serve does "
               f"every {allocator.TRIM_EVERY_S:.0f} s); over runs {span([a.after / mib for a in attacks], 1)}"
               " MiB (control: the idle server before the attack)"),
    ]


async def _serve(knobs: dict[str, object]) -> None:
    from stream.core.cache import CacheState, Capacity
    from stream.http.api import HttpApi
    from stream.kafka.publisher import EventPublisher
    from stream.metrics import Metrics

    state = CacheState(Capacity.from_params(None, None))
    api = HttpApi(state, EventPublisher("127.0.0.1:1", "unused", 1.0), Metrics(state, dict), Limits(),
                  lambda: True)
    server = api.server()
    for name, value in knobs.items():  # the tests' small timings
        setattr(server, name, value)
    port = await server.start("127.0.0.1", 0)
    print(port, flush=True)
    loop = asyncio.get_running_loop()
    while command := await loop.run_in_executor(None, sys.stdin.readline):  # the end: stop
        if command == "unparsed\n":
            print(server.unparsed_bytes(), flush=True)
        else:  # give freed memory back, as serve does every TRIM_EVERY_S (idle here)
            print(allocator.give_back(), flush=True)
    await server.close()


if __name__ == "__main__":
    from stream.event_loop import new_event_loop

    loop = new_event_loop()
    try:
        loop.run_until_complete(_serve(orjson.loads(sys.argv[1]) if len(sys.argv) > 1 else {}))
    finally:
        loop.close()
