"""Match throughput and latency: the service's /v1/match against its controls.

Servers run alone on core 0 and wrk on core 1, so the figures compare handlers, not
scheduling. Throughput is closed loop; latency is taken under a load paced by the clock
at half the measured peak. Two bare handlers (read the body, ``orjson.loads`` it, answer
the service's answer) are the HTTP controls: one on the service's own server
(``stream.http.server``: what the routes cost over it) and one on aiohttp (the stack
the service ran on before, ``stream.bench.stacks``). Two controls hold the same index in Redis
(``stream.bench.redis_control``): Redis asked directly by redis-benchmark, and the bare
handler's HTTP stack asking Redis. A per-stage cost breakdown (``stream.bench.costs``)
is taken in process on the same state and bodies once the servers are stopped.
"""

from __future__ import annotations

import asyncio
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from stream import event_loop
from stream.bench import stacks
from stream.bench.costs import cost_figures
from stream.bench.figures import Figure, span
from stream.bench.redis_control import (
    LOOKUPS_PER_REQUEST,
    DirectRate,
    RedisRoutes,
    RedisServer,
    index_keys,
    load_index,
    redis_benchmark_rate,
    without_hiredis,
)
from stream.bench.stacks import LOAD_CORE, SERVER_CORE, busy_rate, wrk_ms, wrk_paced_latency, wrk_rate
from stream.bench.workload import Workload
from stream.config import Limits
from stream.core.cache import CacheState, Capacity
from stream.core.engine import ENGINE_VIEW_ENTRIES
from stream.core.events import Position
from stream.core.index import Index
from stream.core.items import Item
from stream.http.api import HttpApi
from stream.http.server import HttpServer
from stream.kafka.embedded import free_port
from stream.kafka.publisher import EventPublisher
from stream.metrics import Metrics

__all__ = ["ReferenceIndex", "ReferenceState", "match_figures", "request_bodies", "wrk_paced_latency",
           "wrk_rate"]


class ReferenceIndex(Index):
    """The reference plugin's lookup: each candidate endpoint's own LRU is asked for
    each request item (a per-endpoint map), instead of the inverted index."""

    def hits(self, items: Any, endpoints: Any) -> tuple[list[str], dict[str, list[Item]]]:
        """Ask each endpoint's LRU about each item."""
        requested = list(dict.fromkeys(endpoints))
        found = {}
        lrus = self.lrus.endpoints
        for name in requested:
            lru = lrus.get(name)
            matched = [item for item in items if lru is not None and _contains(lru.entries, item)]
            if matched:
                found[name] = matched
        return requested, found


class ReferenceState(CacheState):
    """A state whose queries are the reference plugin's (``ReferenceIndex``)."""

    def __init__(self, capacity: Capacity, engine_entries: int = ENGINE_VIEW_ENTRIES) -> None:
        super().__init__(capacity, engine_entries)
        self.index = ReferenceIndex(self.lrus)


def _contains(entries: Any, item: Item) -> bool:
    """The plugin's ``lru.Contains(hash)``: a lookup that does not touch recency."""
    return item.hash in entries


def full_state(state: CacheState, events: int) -> CacheState:
    """Fill ``state`` from the workload (1,000 endpoints x 1,024 entries at 600k events)."""
    for offset, event in enumerate(Workload().placed_events(events)):
        state.fold.apply(event, Position(0, offset))
    return state


def request_bodies(state: CacheState, count: int) -> list[bytes]:
    """Match requests of the workload: 64 endpoints, 8 items, half of them held."""
    workload, held = Workload(seed=11), list(state.index.holders)
    return [orjson.dumps(workload.match_body(held)) for _ in range(count)]


def serve(kind: str, port: int, events: int, bodies_path: Path, redis_port: int = 0) -> None:
    """Run one server in this process: ``inverted`` / ``reference`` (the service's HTTP API
    over that lookup), ``stack`` (a bare orjson handler on the service's own server),
    ``control`` (a bare aiohttp+orjson handler) or ``redis`` / ``redis-python`` (the bare
    handler's shape on the service's server over the index in the Redis at
    ``redis_port``, its set names in the ``.keys`` file beside the bodies; redis-py
    parsing with hiredis, or in Python)."""
    api: HttpApi | None = None
    if kind == "stack":
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {int(SERVER_CORE)})
        stacks.serve("server", port, Path(f"{bodies_path}.answer"))
        return
    if kind in ("redis", "redis-python"):
        routes = RedisRoutes(redis_port, orjson.loads(Path(f"{bodies_path}.keys").read_bytes()))
        wanted = "hiredis" if kind == "redis" else "python"
        if routes.parser != wanted:
            raise RuntimeError(f"the {kind} control would parse with {routes.parser}, not {wanted}")
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {int(SERVER_CORE)})
        event_loop.run(_serve_routes(routes, port))
        return
    if kind == "control":
        answer = orjson.loads(Path(f"{bodies_path}.answer").read_bytes())

        async def handler(request: web.Request) -> web.Response:
            orjson.loads(await request.read())
            return web.Response(body=orjson.dumps(answer), content_type="application/json")

        app = web.Application()
        app.router.add_post("/v1/match", handler)
    else:
        state_class = ReferenceState if kind == "reference" else CacheState
        state = full_state(state_class(Capacity.from_params()), events)
        gc.freeze()  # as the worker does after loading its view
        if kind == "inverted":
            bodies_path.write_bytes(b"\n".join(request_bodies(state, 500)))
        api = HttpApi(state, EventPublisher("127.0.0.1:1", "unused", 1.0),
                      Metrics(state, dict), Limits(), lambda: True)
    if hasattr(os, "sched_setaffinity"):  # built on any core, served on the server core
        os.sched_setaffinity(0, {int(SERVER_CORE)})
    # every kind on the service's loop, so the ratios compare handlers
    event_loop.run(_serve_api(api, port) if api is not None else _serve_app(app, port))


async def _serve_api(api: HttpApi, port: int) -> None:
    """The service's server, inside the running loop, as the worker runs it."""
    await api.server().start("127.0.0.1", port)
    await asyncio.Event().wait()


async def _serve_routes(routes: RedisRoutes, port: int) -> None:
    """A control on the service's own server, inside the running loop."""
    await HttpServer(routes, on_close=routes.close).start("127.0.0.1", port)  # type: ignore[arg-type]
    await asyncio.Event().wait()


async def _serve_app(app: web.Application, port: int) -> None:
    """An aiohttp control, inside the running loop, without an access log."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


class Server:
    """A benchmark server in a child process pinned to the server core."""

    def __init__(self, kind: str, events: int, bodies: Path, redis_port: int = 0) -> None:
        self.kind = kind
        self.port = free_port()
        command = [sys.executable, "-m", "stream.bench.match", kind, str(self.port), str(events),
                   str(bodies), str(redis_port)]
        env = None if kind != "redis-python" else without_hiredis(os.environ, bodies.parent / "no-hiredis")
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env=env)
        self.url = f"http://127.0.0.1:{self.port}/v1/match"

    def wait(self) -> Server:
        """Block until the server answers."""
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(self.url, data=b"{}"), timeout=2)
            except urllib.error.HTTPError:
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"bench server {self.kind} did not start") from None
                time.sleep(0.2)
            else:
                break
        return self

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


_ms = wrk_ms  # the name tests/integration/test_bench.py reads


def _same_answers(url: str, expected_url: str, bodies: list[bytes]) -> None:
    """Refuse a control that answers these bodies otherwise than the service does."""
    for body in bodies:
        got, want = (urllib.request.urlopen(urllib.request.Request(u, data=body)).read()
                     for u in (url, expected_url))
        if orjson.loads(got) != orjson.loads(want):
            raise RuntimeError(f"the control at {url} answers {body[:80]!r} otherwise than the "
                               f"service: {got[:300]!r} against {want[:300]!r}")


def match_figures(events: int, seconds: int, runs: int, latency_seconds: int = 10) -> list[Figure]:
    """Throughput against the bare control, the reference lookup and the two Redis
    controls, then latency at half the measured peak, then the cost breakdown."""
    with tempfile.TemporaryDirectory() as tmp:
        bodies = Path(tmp) / "bodies.jsonl"
        rates: dict[str, list[float]] = {"inverted": [], "reference": [], "stack": [], "control": [],
                                         "redis": [], "redis-python": []}
        direct: list[DirectRate] = []
        busy: dict[str, list[float]] = {kind: [] for kind in rates}  # server core's share used
        # the two states are built side by side; each server then serves on the server core
        servers = {kind: Server(kind, events, bodies) for kind in ("inverted", "reference")}
        service = servers["inverted"]
        redis_server = RedisServer(SERVER_CORE)
        try:
            # this process's copy: loaded into Redis, then the cost breakdown's
            state = full_state(CacheState(Capacity.from_params()), events)
            service.wait()
            requests = bodies.read_bytes().splitlines()
            answer = urllib.request.urlopen(urllib.request.Request(service.url, data=requests[0])).read()
            Path(f"{bodies}.answer").write_bytes(answer)
            keys, lookups = index_keys(requests, state.index.holders)
            load_index(redis_server.start(), state.index.holders, keys)
            Path(f"{bodies}.keys").write_bytes(orjson.dumps(keys))
            servers["stack"] = Server("stack", events, bodies)
            servers["control"] = Server("control", events, bodies)
            servers["redis"] = Server("redis", events, bodies, redis_server.port)
            servers["redis-python"] = Server("redis-python", events, bodies, redis_server.port)
            for server in servers.values():
                server.wait()
            for kind in ("redis", "redis-python"):
                _same_answers(servers[kind].url, service.url, requests[:20])
            for kind in ("stack", "control"):  # the answer of the first body, as the service's
                _same_answers(servers[kind].url, service.url, requests[:1])
            for _ in range(runs):
                for kind, server in servers.items():
                    rate, share = busy_rate(server.process.pid,
                                            lambda url=server.url: wrk_rate(url, bodies, seconds), seconds)
                    rates[kind].append(rate)
                    busy[kind].append(share)
                direct.append(redis_benchmark_rate(redis_server, lookups, seconds, LOAD_CORE))
            peak = statistics.median(rates["inverted"])
            paced: dict[str, list[tuple[float, float, float]]] = {"service": [], "control": []}
            for run in range(runs):  # the same paced load on the bare aiohttp handler, in turn
                turn = {"service": service.url, "control": servers["control"].url}
                for who in sorted(turn, reverse=run % 2 == 1):  # each first in every other run
                    paced[who].append(wrk_paced_latency(turn[who], bodies, peak / 2, latency_seconds))
        finally:
            for server in servers.values():
                server.stop()
            redis_server.stop()
    service_rate, reference, stack, control, redis_http, redis_python = (
        statistics.median(rates[k]) for k in ("inverted", "reference", "stack", "control", "redis",
                                              "redis-python"))
    redis_direct, redis_busy, load_busy = (statistics.median(column) for column in zip(*direct, strict=True))
    used = {kind: f"{100 * statistics.median(shares):.0f}%" for kind, shares in busy.items()}
    (p50s, p99s, achieved), (bare_p50s, bare_p99s, _) = (
        [sorted(column) for column in zip(*paced[kind], strict=True)] for kind in ("service", "control"))
    p50, p99, bare_p50, bare_p99 = (statistics.median(c) for c in (p50s, p99s, bare_p50s, bare_p99s))

    def spread(service: list[float], control: list[float]) -> str:
        return (f"{len(service)} alternated runs of {latency_seconds} s, service "
                f"{span(service, 3)} ms, control {span(control, 3)} ms")

    def rates_spread(control: list[float]) -> str:  # a control's runs, beside the service's
        return (f"{len(control)} alternated runs of {seconds} s, service {span(rates['inverted'])}, "
                f"control {span(control)}")
    return [
        Figure("match_throughput_vs_bare_handler", round(service_rate), "req/s",
               ">= 0.75 x the bare orjson handler on the same server", service_rate / stack >= 0.75,
               round(stack), round(service_rate / stack, 3),
               "64 endpoints x 8 items per request; state 1,000 x 1,024; wrk -t1 -c32; control: "
               "a route that only orjson.loads the body and answers the service's answer, on "
               f"stream.http.server; server core busy: service {used['inverted']}, control "
               f"{used['stack']} (under 100%: the machine was shared, the rates are low by as much); "
               f"{rates_spread(rates['stack'])}"),
        Figure("match_throughput_vs_bare_aiohttp", round(service_rate), "req/s",
               ">= 13,000 req/s", service_rate >= 13_000, round(control), round(service_rate / control, 3),
               "control: the same bare handler on aiohttp (AppRunner + TCPSite, uvloop), the "
               f"stack the service ran on before; server core busy: {used['control']}; "
               f"{rates_spread(rates['control'])}"),
        Figure("match_throughput_vs_reference_lookup", round(service_rate), "req/s",
               ">= 1.8 x the per-endpoint-map lookup", service_rate / reference >= 1.8,
               round(reference), round(service_rate / reference, 3),
               "control: the service with the reference plugin's lookup (each candidate's LRU asked "
               "for each item); that lookup (stream.bench.match.ReferenceState) is not compiled, "
               f"the service's index walk is; {rates_spread(rates['reference'])}"),
        Figure("match_throughput_vs_redis_direct", round(service_rate), "req/s",
               ">= 0.15 x Redis asked directly", service_rate / redis_direct >= 0.15,
               round(redis_direct), round(service_rate / redis_direct, 3),
               f"control: the match lookups a gateway talking to Redis directly would get, "
               f"pipelines of {LOOKUPS_PER_REQUEST} SMEMBERS per second (redis-benchmark -P "
               f"{LOOKUPS_PER_REQUEST} -c32, keys drawn from the bodies' items) on the same index "
               f"as one set per hash; busy: Redis {100 * redis_busy:.0f}% of its core, "
               f"redis-benchmark {100 * load_busy:.0f}% of its own; {rates_spread([d[0] for d in direct])}"),
        Figure("match_throughput_vs_redis_backed_http", round(service_rate), "req/s",
               ">= 3 x the bare handler over Redis", service_rate / redis_http >= 3,
               round(redis_http), round(service_rate / redis_http, 3),
               "control: the bare handler on the service's own server, reading the body as the "
               f"service does, one pipeline of {LOOKUPS_PER_REQUEST} SMEMBERS (redis.asyncio, "
               "answers parsed by hiredis) per request, same answer; Redis on the server core "
               f"too; server core busy: {used['redis']}; {rates_spread(rates['redis'])}"),
        Figure("match_throughput_vs_redis_backed_http_python_parser", round(service_rate), "req/s",
               "reported", True, round(redis_python), round(service_rate / redis_python, 3),
               "control: the same, with redis-py parsing Redis's answers in Python (hiredis "
               f"hidden from it), as this control was measured before; busy: {used['redis-python']}; "
               f"{rates_spread(rates['redis-python'])}"),
        Figure("match_latency_p50_at_half_peak", round(p50, 3), "ms", "p50 <= the control's",
               round(p50 / bare_p50, 3) <= 1, round(bare_p50, 3), round(p50 / bare_p50, 3),
               f"paced at {statistics.median(achieved):.0f} req/s (half of the {peak:.0f} peak); "
               f"control: the bare aiohttp handler under the same paced load; {spread(p50s, bare_p50s)}"),
        Figure("match_latency_p99_at_half_peak", round(p99, 3), "ms", "p99 <= the control's",
               round(p99 / bare_p99, 3) <= 1, round(bare_p99, 3), round(p99 / bare_p99, 3),
               f"paced at {statistics.median(achieved):.0f} req/s; control: the bare aiohttp handler, "
               f"same load; {spread(p99s, bare_p99s)}"),
        *cost_figures(state, requests),
    ]


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]))
