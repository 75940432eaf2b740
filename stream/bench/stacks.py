"""HTTP stacks measured bare: how fast each could serve /v1/match, before any route.

Each stack serves one bare handler (read the match body, ``orjson.loads`` it, answer a
fixed JSON of the size the service answers the bench's bodies with) from inside an
event loop that is already running, as the worker's server must (its view lives in
that process's memory). Servers run alone on the server core and ``wrk -t1 -c32`` on
the load core; rounds alternate the stacks, so a drift of the machine touches all of
them, and medians are quoted with their spread.

Stacks: ``aiohttp`` (AppRunner + TCPSite, the worker's server), ``uvicorn``
(``uvicorn.Server.serve`` with httptools, a raw ASGI callable), ``granian-rsgi`` and
``granian-asgi`` (``granian.server.embed.Server``, its Rust I/O thread pinned to the
same core), and ``protocol`` (an ``asyncio.Protocol`` over httptools' parser, made by
hand: an upper bound for any Python-side server on this loop), and ``server``, the bare
handler on ``stream.http.server``, the service's own server (the match benchmark's
same-stack control).

Run: ``python -m stream.bench.stacks [--seconds 10] [--rounds 5] [--latency]``.
The wrk harness here (``wrk_rate``, ``wrk_paced_latency``) is the one the match
benchmark uses.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from stream import event_loop
from stream.bench.redis_control import pinned
from stream.bench.workload import Workload
from stream.core.cache import CacheState, Capacity
from stream.core.events import Position
from stream.core.items import extract_items
from stream.core.render import render_match
from stream.kafka.embedded import free_port

__all__ = ["LOAD_CORE", "SERVER_CORE", "STACKS", "StackServer", "bench_inputs", "busy_rate", "cpu_seconds",
           "stack_figures", "wrk_paced_latency", "wrk_rate"]

SERVER_CORE, LOAD_CORE = "0", "1"
STACKS = ("aiohttp", "uvicorn", "granian-rsgi", "granian-asgi", "protocol", "server")
_JSON = "application/json"


# -- the bench's bodies and the answer's size -------------------------------------------------

def bench_inputs(directory: Path, events: int = 600_000, count: int = 500) -> tuple[Path, Path]:
    """Write the match benchmark's bodies (one per line) and the service's answer to the
    first one, computed on the same state as ``stream.bench.match`` builds; return
    both paths. The answer's bytes are what the bare handlers send back."""
    state = CacheState(Capacity.from_params())
    for offset, event in enumerate(Workload().placed_events(events)):
        state.fold.apply(event, Position(0, offset))
    workload, held = Workload(seed=11), list(state.index.holders)
    queries = [workload.match_body(held) for _ in range(count)]
    items = extract_items(queries[0]["body"])
    requested, found = state.index.hits(items, queries[0]["endpoints"])
    bodies, answer = directory / "bodies.jsonl", directory / "answer.json"
    bodies.write_bytes(b"\n".join(map(orjson.dumps, queries)))
    answer.write_bytes(render_match(items, requested, found))
    return bodies, answer


# -- the bare servers, each started inside a running loop --------------------------------------

def _asgi_app(answer: Any) -> Callable[..., Awaitable[None]]:
    """A raw ASGI callable: the bare handler, with lifespan accepted and ignored."""
    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        message = await receive()
        body = message.get("body", b"")
        while message.get("more_body"):
            message = await receive()
            body += message.get("body", b"")
        orjson.loads(body)
        payload = orjson.dumps(answer)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
    return app


async def _serve_aiohttp(port: int, answer: Any) -> None:
    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        orjson.loads(await request.read())
        return web.Response(body=orjson.dumps(answer), content_type=_JSON)

    app = web.Application()
    app.router.add_post("/v1/match", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


async def _serve_uvicorn(port: int, answer: Any) -> None:
    import uvicorn

    config = uvicorn.Config(_asgi_app(answer), host="127.0.0.1", port=port, loop="none",
                            http="httptools", lifespan="off", access_log=False,
                            log_level="warning", server_header=False, date_header=False)
    await uvicorn.Server(config).serve()


async def _serve_granian(port: int, answer: Any, interface: str) -> None:
    from granian.constants import Interfaces
    from granian.server.embed import Server

    if interface == "rsgi":
        async def target(scope: Any, protocol: Any) -> None:
            orjson.loads(await protocol())
            protocol.response_bytes(200, [("content-type", _JSON)], orjson.dumps(answer))
        kind = Interfaces.RSGI
    else:
        target, kind = _asgi_app(answer), Interfaces.ASGINL
    server = Server(target, address="127.0.0.1", port=port, interface=kind, runtime_threads=1,
                    websockets=False, log_enabled=False)
    await server.serve()


class _BareProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive over httptools, no routing, no headers kept: the least a
    Python server on this loop can do per request."""

    def __init__(self, answer: Any) -> None:
        import httptools

        self.answer = answer
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        import httptools

        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n"
                                 b"connection: close\r\n\r\n")
            self.transport.close()

    def on_body(self, body: bytes) -> None:
        """A piece of the body (httptools' callback)."""
        self.body.append(body)

    def on_message_complete(self) -> None:
        """The request came whole: answer it."""
        orjson.loads(b"".join(self.body))
        self.body.clear()
        payload = orjson.dumps(self.answer)
        assert self.transport is not None
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%b" % (len(payload), payload))


async def _serve_protocol(port: int, answer: Any) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _BareProtocol(answer), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


class _BareRoutes:
    """``stream.http.server``'s routes with one bare endpoint, answered at once."""

    max_body = 1 << 24

    def __init__(self, answer: Any) -> None:
        from stream.http.server import Endpoint, Response

        def now(request: Any) -> Any:
            orjson.loads(b"".join(request.chunks))
            return Response(orjson.dumps(answer))

        async def handle(request: Any) -> Any:
            return now(request)

        self.endpoint = Endpoint(handle, lambda request: Response(b"{}", 413), None, now)

    def resolve(self, method: str, path: str) -> Any:
        """The bare endpoint, whatever the path."""
        return self.endpoint


async def _serve_server(port: int, answer: Any) -> None:
    from stream.http.server import HttpServer

    await HttpServer(_BareRoutes(answer)).start("127.0.0.1", port)  # type: ignore[arg-type]
    await asyncio.Event().wait()


def serve(kind: str, port: int, answer_path: Path) -> None:
    """Run the bare server ``kind`` in this process on uvloop, as the worker runs."""
    answer = orjson.loads(answer_path.read_bytes())
    servers: dict[str, Callable[[], Awaitable[None]]] = {
        "aiohttp": lambda: _serve_aiohttp(port, answer),
        "uvicorn": lambda: _serve_uvicorn(port, answer),
        "granian-rsgi": lambda: _serve_granian(port, answer, "rsgi"),
        "granian-asgi": lambda: _serve_granian(port, answer, "asgi"),
        "protocol": lambda: _serve_protocol(port, answer),
        "server": lambda: _serve_server(port, answer),
    }
    event_loop.run(servers[kind]())


class StackServer:
    """A bare server in a child process, pinned (every thread) to the server core."""

    def __init__(self, kind: str, answer: Path) -> None:
        self.kind, self.port = kind, free_port()
        command = [sys.executable, "-m", "stream.bench.stacks", "serve", kind, str(self.port), str(answer)]
        self.process = subprocess.Popen(pinned(SERVER_CORE, command), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}/v1/match"

    def wait(self, body: bytes) -> StackServer:
        """Block until it answers ``body``."""
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(self.url, data=body), timeout=2).read()
                return self
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"bare server {self.kind} did not start") from None
                time.sleep(0.2)

    def stop(self) -> None:
        """End it (killed if it does not end within 10 s)."""
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# -- wrk ----------------------------------------------------------------------------------------

WRK_SCRIPT = """
local bodies = {}
for line in io.lines("%s") do bodies[#bodies + 1] = line end
local i = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  i = i %% #bodies + 1
  return wrk.format(nil, nil, nil, bodies[i])
end
"""


def wrk(url: str, script: str, seconds: int, connections: int, *flags: str) -> str:
    """Run wrk (one thread, on the load core) with a Lua script; return its report."""
    program = shutil.which("wrk")
    if program is None:
        raise RuntimeError("wrk is missing: install the Debian package 'wrk' (apt-get install wrk)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as file:
        file.write(script)
    command = pinned(LOAD_CORE, [program, "-t1", f"-c{connections}", f"-d{seconds}s", "-s", file.name,
                                 *flags, url])
    try:
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(file.name)
    if "Non-2xx" in out or "Socket errors" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    return out


def wrk_rate(url: str, bodies: Path, seconds: int, connections: int = 32) -> float:
    """Requests per second answered under closed-loop load."""
    out = wrk(url, WRK_SCRIPT % bodies, seconds, connections)
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) a process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_rate(pid: int, measure: Callable[[], float], seconds: int) -> tuple[float, float]:
    """``measure()`` (a wrk rate over ``seconds``) and the share of one core the server
    ``pid`` used meanwhile: under 1, the machine was shared and the rate is low by as much."""
    before = cpu_seconds(pid)
    rate = measure()
    return rate, (cpu_seconds(pid) - before) / seconds


def wrk_paced_latency(url: str, bodies: Path, rate: float, seconds: int) -> tuple[float, float, float]:
    """Latency (p50, p99 in ms) and achieved rate of a paced wrk run at about ``rate`` req/s.

    Each of C connections waits a random time of mean C/rate between its requests
    (wrk's ``delay`` hook; exponential, so arrivals are Poisson and not in lock-step
    bursts), so the load is set by the clock, not by the answers. (A Python open-loop
    generator was tried first: against a bare handler it alone showed p50 0.95 ms, p99
    8 ms at 1,000 req/s, too slow to measure this service; wrk2 is not packaged here.)
    """
    connections = max(1, round(rate / 100))  # 10 ms between a connection's requests
    pause_ms = 1000 * connections / rate
    script = WRK_SCRIPT % bodies + (
        f"delay = function() return math.floor(-math.log(1 - math.random()) * {pause_ms:.3f} + 0.5) end\n")
    out = wrk(url, script, seconds, connections, "--latency")
    p50, p99 = (wrk_ms(re.search(rf"\s{share}%\s+([\d.]+)(us|ms|s)\b", out)) for share in (50, 99))
    achieved = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    return p50, p99, achieved


def wrk_ms(found: re.Match[str] | None) -> float:
    """A wrk latency (``812.00us``, ``1.20ms``, ``2s``) in milliseconds."""
    assert found is not None, "wrk printed no latency distribution"
    return float(found[1]) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[found[2]]


# -- the comparison -----------------------------------------------------------------------------

@dataclass(frozen=True)
class StackFigure:
    """One stack's closed-loop rates over the rounds (and, if asked, paced latency)."""

    stack: str
    rates: list[float]
    latency: tuple[float, float, float] | None = None  # p50 ms, p99 ms, achieved req/s

    @property
    def median(self) -> float:
        """The quoted rate."""
        return statistics.median(self.rates)

    @property
    def spread(self) -> float:
        """(max - min) / median of the rounds."""
        return (max(self.rates) - min(self.rates)) / self.median

    def line(self, base: float) -> str:
        """One row of the table, its ratio to ``base`` (the aiohttp median)."""
        row = (f"| {self.stack} | {self.median:,.0f} | {min(self.rates):,.0f}-{max(self.rates):,.0f} "
               f"| {100 * self.spread:.1f}% | {self.median / base:.2f} |")
        if self.latency is not None:
            p50, p99, achieved = self.latency
            row += f" {p50:.3f} / {p99:.3f} @ {achieved:,.0f} |"
        return row


def stack_figures(stacks: tuple[str, ...], seconds: int, rounds: int, latency_at: float | None,
                  events: int = 600_000, log: Callable[[str], None] = print) -> list[StackFigure]:
    """Start every stack, measure ``rounds`` alternated closed-loop rounds of each, then
    (with ``latency_at``, a share of the aiohttp median such as 0.5) a paced run of each
    at that rate."""
    with tempfile.TemporaryDirectory(prefix="mmcache-stacks-") as tmp:
        bodies, answer = bench_inputs(Path(tmp), events)
        first = bodies.read_bytes().split(b"\n", 1)[0]
        servers: dict[str, StackServer] = {}
        try:
            for kind in stacks:
                servers[kind] = StackServer(kind, answer)
            expected = orjson.loads(answer.read_bytes())
            for server in servers.values():
                url = server.wait(first).url
                got = urllib.request.urlopen(urllib.request.Request(url, data=first)).read()
                if orjson.loads(got) != expected:
                    raise RuntimeError(f"{server.kind} answers otherwise than the others")
            rates: dict[str, list[float]] = {kind: [] for kind in stacks}
            for round_ in range(rounds):
                for kind, server in servers.items():
                    rates[kind].append(wrk_rate(server.url, bodies, seconds))
                    log(f"round {round_ + 1}: {kind} {rates[kind][-1]:,.0f} req/s")
            paced: dict[str, tuple[float, float, float]] = {}
            if latency_at is not None:
                rate = latency_at * statistics.median(rates[stacks[0]])
                for kind, server in servers.items():
                    paced[kind] = wrk_paced_latency(server.url, bodies, rate, max(seconds, 5))
                    log(f"paced: {kind} p50 {paced[kind][0]:.3f} ms p99 {paced[kind][1]:.3f} ms")
        finally:
            for server in servers.values():
                server.stop()
    return [StackFigure(kind, rates[kind], paced.get(kind)) for kind in stacks]


def render(figures: list[StackFigure], seconds: int, rounds: int) -> str:
    """The comparison as a Markdown table, with how it was measured."""
    base = figures[0].median
    head = "| stack | median req/s | min-max | spread | x aiohttp |"
    rule = "|---|---|---|---|---|"
    if any(f.latency for f in figures):
        head, rule = head + " paced p50 / p99 ms @ req/s |", rule + "---|"
    return "\n".join([
        f"bare /v1/match handlers, server on core {SERVER_CORE}, wrk -t1 -c32 -d{seconds}s on core "
        f"{LOAD_CORE}, {rounds} alternated rounds (uvloop {_version('uvloop')}, aiohttp "
        f"{_version('aiohttp')}, uvicorn {_version('uvicorn')}, httptools {_version('httptools')}, "
        f"granian {_version('granian')})", "", head, rule, *(f.line(base) for f in figures)])


def _version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "missing"


def main(argv: list[str] | None = None) -> None:
    """Measure the stacks and print the table."""
    parser = argparse.ArgumentParser(prog="python -m stream.bench.stacks", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--latency", action="store_true", help="also paced latency at half aiohttp's peak")
    parser.add_argument("--stacks", default=",".join(STACKS))
    parser.add_argument("--events", type=int, default=600_000, help="placements of the state (bench: 600k)")
    args = parser.parse_args(argv)
    stacks = tuple(args.stacks.split(","))
    figures = stack_figures(stacks, args.seconds, args.rounds, 0.5 if args.latency else None,
                            args.events, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(render(figures, args.seconds, args.rounds))


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
    else:
        main()
