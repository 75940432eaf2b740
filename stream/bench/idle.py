"""`serve` on its embedded default (no --bootstrap-servers: its own broker, as `make run`
starts it): what it costs idle, how fresh a write is after idle, and /v1/match when the
broker shares the server's core.

Idle CPU is read from ``/proc/<pid>/stat`` of `serve` and of its broker over windows of
idle (nothing written or asked for). Freshness after idle is the time from a placement's
202 to the first match that sees it, each placement after an idle gap longer than the
idle poll (``--idle-poll-s``), so that no fetch is in flight when it comes; a few come
after a whole minute of idle. The match figure is ``stream.bench.match``'s throughput
row with `serve` and its broker pinned together to the server core, against the same
bare aiohttp handler alone on that core.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from stream.bench.figures import Figure, span
from stream.bench.match import Server, full_state, request_bodies
from stream.bench.replay import produce_placements
from stream.bench.service import Worker
from stream.bench.stacks import SERVER_CORE, cpu_seconds, wrk_rate
from stream.core.cache import CacheState, Capacity
from stream.kafka.fetch_gate import IDLE_POLL_S
from stream.percentiles import percentile

__all__ = ["idle_figures", "match_embedded_figures"]

_BROKER_LINE = re.compile(r"started an embedded Kafka-protocol broker \(Tansu\) on (\S+) ")


def _broker_pid(pid: int) -> int:
    """The embedded broker now: the one child of `serve` (Linux; a rebase of the kept log
    starts another)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    if len(children) != 1:
        raise RuntimeError(f"serve {pid} has children {children}, not one broker")
    return int(children[0])


def _bootstrap(worker: Worker) -> str:
    found = _BROKER_LINE.search(worker.log_path.read_text(errors="replace"))
    if found is None:
        raise RuntimeError(f"no embedded broker in {worker.log_path}")
    return found.group(1)


def _fresh_ms(worker: Worker, i: int) -> float:
    """Milliseconds from one placement's 202 to the first match that sees it."""
    endpoint, digest = f"bench/idle-{i % 16}", f"idle-{i}"
    query = {"endpoints": [endpoint], "body": {"generate": {"features": {"mm_hashes": {"image": [digest]}}}}}
    status, _ = worker.call("POST", "/v1/placements", {
        "endpoints": [endpoint], "items": [{"hash": digest, "size": 1, "modality": "image"}]})
    if status != 202:
        raise RuntimeError(f"placement answered {status}")
    acked = time.perf_counter()
    while worker.call("POST", "/v1/match", query)[1]["endpoints"][0]["score"] != 1.0:
        pass
    return (time.perf_counter() - acked) * 1000


def idle_figures(minutes: int, minute_s: float, window_s: float, samples: int) -> list[Figure]:
    """``minutes`` idle periods of ``minute_s`` each (CPU read over windows of
    ``window_s`` inside them), each ended by one placement whose freshness is taken; then
    ``samples`` placements, each after an idle gap just past the idle poll."""
    with tempfile.TemporaryDirectory() as tmp:
        worker = Worker(None, f"bench-idle-{time.time_ns()}", Path(tmp) / "data")
        try:
            worker.wait_ready(120)
            broker = _broker_pid(worker.process.pid)
            _fresh_ms(worker, 0)  # the first write of a new topic, not an idle one
            shares: list[tuple[float, float]] = []  # (serve, broker) share of one core per window
            after_minute: list[float] = []
            for m in range(minutes):
                ends = time.monotonic() + minute_s
                while time.monotonic() + window_s <= ends:
                    before = cpu_seconds(worker.process.pid), cpu_seconds(broker), time.monotonic()
                    time.sleep(window_s)  # the window measured: nothing is written or asked
                    took = time.monotonic() - before[2]
                    shares.append(((cpu_seconds(worker.process.pid) - before[0]) / took,
                                   (cpu_seconds(broker) - before[1]) / took))
                time.sleep(max(0.0, ends - time.monotonic()))
                after_minute.append(_fresh_ms(worker, 1 + m))
            delays = []
            for i in range(samples):
                time.sleep(random.uniform(IDLE_POLL_S + 0.1, IDLE_POLL_S + 0.6))  # idle: none in flight
                delays.append(_fresh_ms(worker, 1000 + i))
        finally:
            worker.stop()
    total = [100 * (s + b) for s, b in shares]
    served, brokered = (statistics.median(100 * x[k] for x in shares) for k in (0, 1))
    idle = statistics.median(total)
    p50, p99 = percentile(delays, 0.5), percentile(delays, 0.99)
    worst_minute = max(after_minute)
    return [
        Figure("idle_cpu_embedded", round(idle, 2), "% of a core", "<= 3% of a core", idle <= 3,
               note=f"serve {served:.2f}% + its broker {brokered:.2f}%, idle (nothing written or "
                    f"asked), /proc/<pid>/stat over {len(shares)} windows of {window_s:g} s, total "
                    f"{span(total, 2)}%; before the fetch gate (stream.kafka.fetch_gate) 17-18%"),
        Figure("freshness_after_idle_p99", round(p99, 2), "ms", "<= 10 ms", p99 <= 10,
               note=f"p50 {p50:.2f} ms; {samples} placements on the embedded default, each after "
                    f"{IDLE_POLL_S + 0.1:g}-{IDLE_POLL_S + 0.6:g} s of idle (past the "
                    f"{IDLE_POLL_S:g} s idle poll: no fetch in flight), 202 to the first match "
                    f"that sees it"),
        Figure("freshness_after_a_minute_idle", round(worst_minute, 2), "ms", "<= 10 ms",
               worst_minute <= 10,
               note=f"the worst of {minutes} placements each after {minute_s:g} s of idle: "
                    f"{', '.join(f'{d:.2f}' for d in after_minute)} ms"),
    ]


def match_embedded_figures(events: int, seconds: int, runs: int) -> list[Figure]:
    """/v1/match throughput of `serve` with its embedded broker on the server core, both
    idle otherwise, against the bare aiohttp handler alone on that core; ``runs``
    alternated runs of ``seconds``."""
    with tempfile.TemporaryDirectory() as tmp:
        bodies = Path(tmp) / "bodies.jsonl"
        # no rebase of the kept log while the events are produced straight to the broker:
        # one started meanwhile failed to restore the log (RestoreFailed, the serve of
        # 2026-12-06 06:31), and this figure is about matching, not the kept log
        worker = Worker(None, "mmcache", Path(tmp) / "data", core=SERVER_CORE,
                        env={"MMCACHE_EMBEDDED_REBASE_BYTES": "-1"})
        control: Server | None = None
        try:
            worker.wait_ready(120)
            asyncio.run(produce_placements(_bootstrap(worker), "mmcache-events", events))
            state = full_state(CacheState(Capacity.from_params()), events)
            entries = sum(len(lru.entries) for lru in state.lrus.endpoints.values())
            deadline = time.monotonic() + 600
            while worker.metric("mmcache_entries") < entries:
                if time.monotonic() > deadline:
                    raise RuntimeError("serve did not apply the produced events")
                time.sleep(0.5)  # paces the polls of the view's size
            requests = request_bodies(state, 500)
            bodies.write_bytes(b"\n".join(requests))
            url = f"http://127.0.0.1:{worker.port}/v1/match"
            answer = urllib.request.urlopen(urllib.request.Request(url, data=requests[0])).read()
            Path(f"{bodies}.answer").write_bytes(answer)
            control = Server("control", events, bodies).wait()
            rates: dict[str, list[float]] = {"service": [], "control": []}
            busy: list[float] = []
            for run in range(runs):
                for who in sorted(rates, reverse=run % 2 == 1):  # each first in every other run
                    if who == "control":
                        rates[who].append(wrk_rate(control.url, bodies, seconds))
                        continue
                    broker = _broker_pid(worker.process.pid)  # a rebase starts another one
                    before = cpu_seconds(worker.process.pid), cpu_seconds(broker)
                    rates[who].append(wrk_rate(url, bodies, seconds))
                    busy.append((cpu_seconds(worker.process.pid) - before[0]
                                 + cpu_seconds(broker) - before[1]) / seconds)
        finally:
            if control is not None:
                control.stop()
            worker.stop()
    service, bare = statistics.median(rates["service"]), statistics.median(rates["control"])
    ratio = service / bare
    return [Figure(
        "match_throughput_embedded_vs_bare_aiohttp", round(service), "req/s",
        ">= 0.5 x the bare aiohttp handler alone on the core", ratio >= 0.5, round(bare),
        round(ratio, 3),
        f"serve on its embedded default (its broker idle on the same core, pinned together), "
        f"{events:,} events applied; wrk -t1 -c32 on the other core; core busy "
        f"{100 * statistics.median(busy):.0f}% (serve + broker); {runs} alternated runs of "
        f"{seconds} s, service {span(rates['service'])}, "
        f"control {span(rates['control'])}; 0.35 (3,415 against 9,729) before the fetch gate")]
