"""Match latency while an operator polls ``/v1/state`` (issue 8, finding 3).

The service's HTTP API over a 1M-entry view (1,000 endpoints x 1,024 entries), served on
the server core as in the match scenario, takes a paced match load twice per run: once
alone and once with ``GET /v1/state`` polled once a second; runs alternate so drift on
a shared machine hits both alike. The longest event-loop hold of one ``/v1/state`` call
is measured in this process with a ticker task on the same loop.
"""

from __future__ import annotations

import asyncio
import gc
import re
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp

from stream.bench.figures import Figure
from stream.bench.match import Server, full_state
from stream.bench.stacks import WRK_SCRIPT, wrk, wrk_ms
from stream.config import Limits
from stream.core.cache import CacheState, Capacity
from stream.http.api import HttpApi
from stream.kafka.publisher import EventPublisher
from stream.metrics import Metrics

__all__ = ["StatePoller", "longest_state_hold_ms", "paced_latency", "state_poll_figures"]

#: The paced match load (requests/s): well under the service's peak, so queueing
#: behind a /v1/state call shows, not overload.
RATE = 500.0


def paced_latency(url: str, bodies: Path, rate: float, seconds: int) -> tuple[float, float]:
    """p99 and max latency (ms) of a paced wrk run (see ``match.wrk_paced_latency``)."""
    connections = max(1, round(rate / 100))
    pause_ms = 1000 * connections / rate
    script = WRK_SCRIPT % bodies + (
        f"delay = function() return math.floor(-math.log(1 - math.random()) * {pause_ms:.3f} + 0.5) end\n")
    out = wrk(url, script, seconds, connections, "--latency")
    p99 = wrk_ms(re.search(r"\s99%\s+([\d.]+)(us|ms|s)\b", out))
    stats = re.search(r"Latency\s+[\d.]+(?:us|ms|s)\s+[\d.]+(?:us|ms|s)\s+([\d.]+)(us|ms|s)", out)
    return p99, wrk_ms(stats)


class StatePoller(threading.Thread):
    """GET ``url`` once a second until stopped; keeps each call's duration (ms)."""

    def __init__(self, url: str, every: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.url, self.every = url, every
        self.durations: list[float] = []
        self.digests: set[str] = set()
        self._halt = threading.Event()

    def run(self) -> None:
        """Poll until ``stop``."""
        while not self._halt.is_set():
            started = time.perf_counter()
            with urllib.request.urlopen(self.url, timeout=30) as answer:
                body = answer.read()
            self.durations.append((time.perf_counter() - started) * 1000)
            self.digests.add(body.rsplit(b'"digest":"', 1)[-1][:64].decode())
            self._halt.wait(max(0.0, self.every - (time.perf_counter() - started)))

    def stop(self) -> StatePoller:
        """Stop and wait for the last call."""
        self._halt.set()
        self.join(60)
        return self


def longest_state_hold_ms(events: int, calls: int = 3) -> tuple[float, float]:
    """(longest gap between two turns of the event loop during a ``GET /v1/state`` of a
    state just built, the same for a call right after) in ms, in this process."""
    state = full_state(CacheState(Capacity.from_params()), events)
    gc.freeze()
    api = HttpApi(state, EventPublisher("127.0.0.1:1", "unused", 1.0), Metrics(state, dict),
                  Limits(), lambda: True)

    async def measure() -> list[float]:
        holds = []
        server = api.server()
        port = await server.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as client:
                for _ in range(calls):
                    done = asyncio.Event()
                    longest = 0.0

                    async def tick(done: asyncio.Event = done) -> None:
                        nonlocal longest
                        last = time.perf_counter()
                        while not done.is_set():
                            await asyncio.sleep(0)
                            now = time.perf_counter()
                            longest, last = max(longest, now - last), now

                    ticker = asyncio.create_task(tick())
                    await asyncio.sleep(0)
                    response = await client.get("/v1/state")
                    await response.read()
                    done.set()
                    await ticker
                    holds.append(longest * 1000)
        finally:
            await server.close()
        return holds

    holds = asyncio.run(measure())
    gc.unfreeze()
    return holds[0], statistics.median(holds[1:]) if len(holds) > 1 else holds[0]


def state_poll_figures(events: int, seconds: int, runs: int) -> list[Figure]:
    """Match p99 and max with /v1/state polled once a second against unpolled, same
    server, alternating runs; then the longest loop hold of one /v1/state call."""
    quiet: list[tuple[float, float]] = []
    polled: list[tuple[float, float]] = []
    calls: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        bodies = Path(tmp) / "bodies.jsonl"
        server = Server("inverted", events, bodies).wait()
        state_url = server.url.replace("/v1/match", "/v1/state")
        try:
            urllib.request.urlopen(state_url, timeout=60).read()  # as an operator's first look
            for _ in range(runs):
                quiet.append(paced_latency(server.url, bodies, RATE, seconds))
                poller = StatePoller(state_url)
                poller.start()
                polled.append(paced_latency(server.url, bodies, RATE, seconds))
                calls += poller.stop().durations
        finally:
            server.stop()
    first_hold, warm_hold = longest_state_hold_ms(events)
    p99, worst = (statistics.median(run[i] for run in polled) for i in (0, 1))
    quiet_p99, quiet_worst = (statistics.median(run[i] for run in quiet) for i in (0, 1))
    spread = (f"{runs} alternating runs of {seconds} s at {RATE:.0f} req/s; p99 over runs "
              f"{min(r[0] for r in polled):.2f}-{max(r[0] for r in polled):.2f} ms polled, "
              f"{min(r[0] for r in quiet):.2f}-{max(r[0] for r in quiet):.2f} ms unpolled; max "
              f"{min(r[1] for r in polled):.1f}-{max(r[1] for r in polled):.1f} ms polled, "
              f"{min(r[1] for r in quiet):.1f}-{max(r[1] for r in quiet):.1f} ms unpolled")
    return [
        Figure("match_p99_with_state_polled", round(p99, 3), "ms",
               "<= 1.2 x unpolled p99", p99 <= 1.2 * quiet_p99, round(quiet_p99, 3),
               round(p99 / quiet_p99, 3),
               f"state of {events:,} placements (1,000 x 1,024 at 600k); GET /v1/state once a "
               "second; control: the same server unpolled; " + spread),
        Figure("match_max_with_state_polled", round(worst, 2), "ms",
               "<= unpolled max + 10 ms", worst <= quiet_worst + 10, round(quiet_worst, 2),
               round(worst / quiet_worst, 3),
               f"{len(calls)} /v1/state calls, median {statistics.median(calls):.1f} ms, "
               f"longest {max(calls):.1f} ms (wall time of the call, not a hold)"),
        Figure("state_call_longest_loop_hold", round(first_hold, 2), "ms", "<= 5 ms",
               first_hold <= 5, note="first GET /v1/state of a just-built 1M-entry view: the "
               f"longest gap between two turns of its event loop; a call at rest: {warm_hold:.2f} ms"),
    ]
