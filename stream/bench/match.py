"""Match throughput and latency: the service's /v1/match against its controls.

Servers run alone on core 0 and the load generator on core 1, so the figures compare
handlers, not scheduling. Throughput is closed loop (wrk); latency is open loop (a
fixed-rate generator that measures from each request's scheduled send time, so a slow
answer cannot hide the requests queued behind it).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
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

from stream.bench.figures import Figure
from stream.bench.workload import Workload
from stream.config import Limits
from stream.core.cache import CacheState, Capacity, EndpointMatch
from stream.core.events import Position
from stream.core.items import Item
from stream.http_api import HttpApi
from stream.kafka.embedded import free_port
from stream.kafka.publisher import EventPublisher
from stream.metrics import Metrics

__all__ = ["ReferenceState", "match_figures", "open_loop_latencies", "request_bodies"]

SERVER_CORE, LOAD_CORE = "0", "1"


class ReferenceState(CacheState):
    """The reference plugin's lookup: each candidate endpoint's own LRU is asked for
    each request item (a per-endpoint map), instead of the inverted index."""

    def match(self, items: Any, endpoints: Any) -> list[EndpointMatch]:
        if not items:
            return []
        total = sum(item.size for item in items)
        results = []
        for name in dict.fromkeys(endpoints):
            lru = self.endpoints.get(name)
            matched = [item for item in items if lru is not None and _contains(lru.entries, item)]
            weight = sum(item.size for item in matched)
            results.append(EndpointMatch(name, matched, weight, total, weight / total))
        return results


def _contains(entries: Any, item: Item) -> bool:
    """The plugin's ``lru.Contains(hash)``: a lookup that does not touch recency."""
    return item.hash in entries


def full_state(state: CacheState, events: int) -> CacheState:
    """Fill ``state`` from the workload (1,000 endpoints x 1,024 entries at 600k events)."""
    for offset, event in enumerate(Workload().placed_events(events)):
        state.apply(event, Position(0, offset))
    return state


def request_bodies(state: CacheState, count: int) -> list[bytes]:
    """Match requests of the workload: 64 endpoints, 8 items, half of them held."""
    workload, held = Workload(seed=11), list(state.holders)
    return [orjson.dumps(workload.match_body(held)) for _ in range(count)]


def serve(kind: str, port: int, events: int, bodies_path: Path) -> None:
    """Run one server in this process: ``inverted`` / ``reference`` (the service's HTTP API
    over that lookup) or ``control`` (a bare aiohttp+orjson handler)."""
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
        if not bodies_path.exists():
            bodies_path.write_bytes(b"\n".join(request_bodies(state, 500)))
        api = HttpApi(state, EventPublisher("127.0.0.1:1", "unused", 1.0),
                      Metrics(state, dict), Limits(), lambda: True)
        app = api.application()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


class Server:
    """A benchmark server in a child process pinned to the server core."""

    def __init__(self, kind: str, events: int, bodies: Path) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "stream.bench.match", kind, str(self.port), str(events),
                   str(bodies)]
        if shutil.which("taskset"):
            command = ["taskset", "-c", SERVER_CORE, *command]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}/v1/match"
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(self.url, data=b"{}"), timeout=2)
            except urllib.error.HTTPError:
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"bench server {kind} did not start") from None
                time.sleep(0.2)
            else:
                break

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


_WRK_SCRIPT = """
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


def wrk_rate(url: str, bodies: Path, seconds: int, connections: int = 32) -> float:
    """Requests per second that wrk (one thread, on the load core) gets answered."""
    wrk = shutil.which("wrk")
    if wrk is None:
        raise RuntimeError("wrk is missing: install the Debian package 'wrk' (apt-get install wrk)")
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(_WRK_SCRIPT % bodies)
    command = [wrk, "-t1", f"-c{connections}", f"-d{seconds}s", "-s", script.name, url]
    if shutil.which("taskset"):
        command = ["taskset", "-c", LOAD_CORE, *command]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    os.unlink(script.name)
    if "Non-2xx" in out:
        raise RuntimeError(f"wrk saw errors:\n{out}")
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]


async def _open_loop(host: str, port: int, path: str, bodies: list[bytes], rate: float,
                     seconds: float, connections: int) -> list[float]:
    """Send at a fixed rate; latency runs from each request's scheduled time to its answer."""
    requests = [
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body for body in bodies
    ]
    idle: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
    for _ in range(connections):
        idle.put_nowait(await asyncio.open_connection(host, port))
    latencies: list[float] = []
    loop = asyncio.get_running_loop()

    async def one(scheduled: float, request: bytes) -> None:
        reader, writer = await idle.get()
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"Content-Length: (\d+)", head, re.I).group(1))  # type: ignore[union-attr]
        await reader.readexactly(length)
        latencies.append(loop.time() - scheduled)
        idle.put_nowait((reader, writer))

    start, total = loop.time() + 0.1, int(rate * seconds)
    tasks = []
    for i in range(total):
        scheduled = start + i / rate
        delay = scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(scheduled, requests[i % len(requests)])))
    await asyncio.gather(*tasks)
    while not idle.empty():
        idle.get_nowait()[1].close()
    return latencies


def open_loop_latencies(url: str, bodies: list[bytes], rate: float, seconds: float) -> list[float]:
    """Latencies (s) of an open-loop run, generated on the load core."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(LOAD_CORE)})
    try:
        match = re.match(r"http://([^:/]+):(\d+)(/.*)", url)
        assert match is not None
        return asyncio.run(_open_loop(match[1], int(match[2]), match[3], bodies, rate, seconds, 64))
    finally:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def match_figures(events: int, seconds: int, runs: int) -> list[Figure]:
    """Throughput against the bare control and the reference lookup, then latency at half
    the measured peak."""
    with tempfile.TemporaryDirectory() as tmp:
        bodies = Path(tmp) / "bodies.jsonl"
        rates: dict[str, list[float]] = {"inverted": [], "reference": [], "control": []}
        service = Server("inverted", events, bodies)
        try:
            answer = urllib.request.urlopen(urllib.request.Request(
                service.url, data=bodies.read_bytes().splitlines()[0])).read()
            Path(f"{bodies}.answer").write_bytes(answer)
            servers = {"inverted": service, "reference": Server("reference", events, bodies),
                       "control": Server("control", events, bodies)}
            for _ in range(runs):
                for kind, server in servers.items():
                    rates[kind].append(wrk_rate(server.url, bodies, seconds))
            peak = statistics.median(rates["inverted"])
            latencies = open_loop_latencies(service.url, bodies.read_bytes().splitlines(),
                                            peak / 2, max(seconds, 5))
        finally:
            for server in locals().get("servers", {"inverted": service}).values():
                server.stop()
    service_rate, reference, control = (statistics.median(rates[k]) for k in
                                        ("inverted", "reference", "control"))
    p50, p99 = _percentile(latencies, 0.50) * 1000, _percentile(latencies, 0.99) * 1000
    return [
        Figure("match_throughput_vs_bare_handler", round(service_rate), "req/s",
               ">= 0.75 x bare aiohttp+orjson handler", service_rate / control >= 0.75,
               round(control), round(service_rate / control, 3),
               "64 endpoints x 8 items per request; state 1,000 x 1,024; wrk -t1 -c32"),
        Figure("match_throughput_vs_reference_lookup", round(service_rate), "req/s",
               ">= 1.8 x the per-endpoint-map lookup", service_rate / reference >= 1.8,
               round(reference), round(service_rate / reference, 3)),
        Figure("match_latency_p50_at_half_peak", round(p50, 3), "ms", "<= 0.5 ms", p50 <= 0.5,
               note=f"open loop at {peak / 2:.0f} req/s, {len(latencies)} requests"),
        Figure("match_latency_p99_at_half_peak", round(p99, 3), "ms", "<= 1.5 ms", p99 <= 1.5,
               note=f"open loop at {peak / 2:.0f} req/s"),
    ]


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
