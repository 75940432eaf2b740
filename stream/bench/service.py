"""Figures of a whole `mmcache serve` worker on the broker: ingest, freshness, restart
and footprint."""

from __future__ import annotations

import asyncio
import http.client
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import orjson

from stream.bench.figures import Figure, span
from stream.bench.replay import produce_placements, raw_consume_rate
from stream.bench.stacks import cpu_seconds
from stream.bench.workload import Workload
from stream.config import Settings
from stream.core.cache import CacheState, Capacity
from stream.core.codec import decode_event, encode_event
from stream.core.events import Position
from stream.kafka.embedded import free_port
from stream.percentiles import percentile
from stream.state.datadir import DataDir
from stream.state.rebuild import rebuild

__all__ = ["footprint_figures", "freshness_figures", "ingest_figures", "naive_agent_rate",
           "restart_figures"]

#: The ingest rate the produced backlog is sized for (above the worker's, so it cannot run dry).
INGEST_HEADROOM_EVENTS_PER_S = 80_000


class Worker:
    """One `mmcache serve` child process with a persistent HTTP connection; with no
    ``bootstrap``, on its embedded default (its own broker, a child of it); with ``core``,
    it and its children run on that core only."""

    def __init__(self, bootstrap: str | None, app_id: str, data_dir: Path, topic: str | None = None,
                 core: str | None = None, env: dict[str, str] | None = None):
        self.port = free_port()
        command = [sys.executable, "-m", "stream.cli", "serve", "--host", "127.0.0.1",
                   "--port", str(self.port), "--app-id", app_id, "--data-dir", str(data_dir)]
        if bootstrap:
            command += ["--bootstrap-servers", bootstrap]
        if topic:
            command += ["--topic", topic]
        self.log_path = data_dir.parent / f"{app_id}.log"
        self.log = open(self.log_path, "ab")  # noqa: SIM115
        pin = None
        if core is not None and hasattr(os, "sched_setaffinity"):
            def pin() -> None:
                os.sched_setaffinity(0, {int(core)})
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})}, preexec_fn=pin)  # noqa: PLW1509 - only the affinity call
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One request on the kept-alive connection."""
        payload = None if body is None else orjson.dumps(body)
        self.conn.request(method, path, payload, {"Content-Type": "application/json"})
        response = self.conn.getresponse()
        data = response.read()
        return response.status, (orjson.loads(data) if path != "/metrics" else data.decode())

    def wait_ready(self, timeout: float = 600) -> float:
        """Seconds until /readyz answers 200."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError("the worker exited; see its log")
            try:
                if self.call("GET", "/readyz")[0] == 200:
                    return time.monotonic() - started
            except OSError:
                self.conn.close()
            time.sleep(0.05)
        raise RuntimeError("the worker did not get ready")

    def metric(self, name: str) -> float:
        """The sum of one metric's samples."""
        text = self.call("GET", "/metrics")[1]
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name))

    def stop(self, sig: int = signal.SIGTERM) -> None:
        self.conn.close()
        self.process.send_signal(sig)
        self.process.wait(60)
        self.log.close()


def freshness_figures(bootstrap: str, samples: int) -> list[Figure]:
    """Time from a placement's 202 to the first match that sees it."""
    with tempfile.TemporaryDirectory() as tmp:
        worker = Worker(bootstrap, f"bench-fresh-{time.time_ns()}", Path(tmp) / "data")
        try:
            worker.wait_ready(120)
            delays = []
            for i in range(samples):
                endpoint, digest = f"bench/fresh-{i % 16}", f"fresh-{i}"
                query = {"endpoints": [endpoint],
                         "body": {"generate": {"features": {"mm_hashes": {"image": [digest]}}}}}
                worker.call("POST", "/v1/placements", {
                    "endpoints": [endpoint], "items": [{"hash": digest, "size": 1, "modality": "image"}]})
                acked = time.perf_counter()
                while worker.call("POST", "/v1/match", query)[1]["endpoints"][0]["score"] != 1.0:
                    pass
                delays.append((time.perf_counter() - acked) * 1000)
        finally:
            worker.stop()
    p50, p99 = percentile(delays, 0.5), percentile(delays, 0.99)
    note = f"{samples} placements, one at a time, embedded broker"
    return [Figure("freshness_p50", round(p50, 2), "ms", "<= 10 ms", p50 <= 10, note=note),
            Figure("freshness_p99", round(p99, 2), "ms", "<= 50 ms", p99 <= 50, note=note)]


def ingest_figures(bootstrap: str, seconds: int, runs: int = 1,
                   headroom_events_per_s: int = INGEST_HEADROOM_EVENTS_PER_S) -> list[Figure]:
    """Placements applied per second by one worker from a full topic, against a raw
    aiokafka consume and a naive Faust agent of the same records; ``runs`` alternated runs
    of each on one topic (a fresh app id each), medians with their spread."""
    topic = f"bench-ingest-{time.time_ns()}-events"
    # enough that a worker at headroom_events_per_s does not drain the topic within the
    # window (2 s more for the events applied before it opens)
    events = headroom_events_per_s * (seconds + 2)
    asyncio.run(produce_placements(bootstrap, topic, events))
    items_per_event = statistics.mean(len(e.items) for e in Workload().placed_events(20_000))
    rates, busy, controls, naives, drained = [], [], [], [], False
    for _ in range(runs):
        controls.append(asyncio.run(raw_consume_rate(bootstrap, topic)))
        rate, share, drained_now = _ingest_rate(bootstrap, topic, seconds, events)
        rates.append(rate)
        busy.append(share)
        drained = drained or drained_now
        naives.append(naive_agent_rate(bootstrap, topic, min(seconds, 10)))
    rate, control, naive = (statistics.median(values) for values in (rates, controls, naives))
    items, naive_items = rate * items_per_event, naive * items_per_event
    runs_said = (f"{runs} runs, worker {span(rates)} events/s, raw consume {span(controls)}; "
                 f"the worker busy {100 * statistics.median(busy):.0f}% of a core")
    return [Figure("ingest_events_per_s", round(rate), "events/s",
                   ">= 50000 events/s and >= 0.2 x raw aiokafka consume (records/s)",
                   rate >= 50_000 and rate / control >= 0.2, round(control),
                   round(rate / control, 3),
                   f"{items:.0f} items/s ({items_per_event:.2f} an event), sustained {seconds} s; "
                   + runs_said + (" (topic drained: a lower bound)" if drained else "")),
            Figure("ingest_vs_naive_faust_agent", round(items), "items/s",
                   ">= 10 x a naive Faust agent (one table write per item)", items >= 10 * naive_items,
                   round(naive_items), round(items / naive_items, 3),
                   f"control: stream.bench.naive_agent on the same records; {runs} runs, naive "
                   f"{span([naive * items_per_event for naive in naives])} items/s")]


def _ingest_rate(bootstrap: str, topic: str, seconds: int, events: int) -> tuple[float, float, bool]:
    """Events per second one worker of a fresh app id applies from ``topic`` (``events``
    long) over ``seconds``, the share of a core it used meanwhile, and whether it drained
    the topic (then the rate is a floor)."""
    app_id = f"bench-ingest-{time.time_ns()}"
    with tempfile.TemporaryDirectory() as tmp:
        worker = Worker(bootstrap, app_id, Path(tmp) / "data", topic)
        try:
            while True:  # the HTTP API is up before Faust starts consuming
                try:
                    first = worker.metric("mmcache_events_processed_total")
                    break
                except OSError:
                    worker.conn.close()
                    time.sleep(0.2)
            while first == 0:
                time.sleep(0.2)
                first = worker.metric("mmcache_events_processed_total")
            started, cpu = time.monotonic(), cpu_seconds(worker.process.pid)
            time.sleep(seconds)
            total = worker.metric("mmcache_events_processed_total")
            elapsed = time.monotonic() - started
            cpu = cpu_seconds(worker.process.pid) - cpu
        finally:
            worker.stop()
    return (total - first) / elapsed, cpu / elapsed, total >= events


def naive_agent_rate(bootstrap: str, topic: str, seconds: float) -> float:
    """Events per second the naive Faust agent (``stream.bench.naive_agent``) applies."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rate"
        command = [sys.executable, "-m", "stream.bench.naive_agent", bootstrap, topic,
                   f"bench-naive-{time.time_ns()}", str(Path(tmp) / "data"), str(seconds), str(out)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 180)
        if not out.exists():
            raise RuntimeError(f"the naive agent measured nothing:\n{done.stderr[-2000:]}")
        return float(out.read_text())


def restart_figures(bootstrap: str, events: int, runs: int = 1) -> tuple[list[Figure], Path, Any]:
    """Time to ready after a clean restart on a kept data dir holding the workload's
    state, ``runs`` restarts one after the other (median, with the spread); returns the
    figures, the stopped worker's data dir and its temp dir."""
    app_id = f"bench-restart-{time.time_ns()}"
    topic = f"{app_id}-events"
    asyncio.run(produce_placements(bootstrap, topic, events))
    tmp = tempfile.TemporaryDirectory()
    data = Path(tmp.name) / "data"
    rebuild(Settings(bootstrap_servers=bootstrap, app_id=app_id, data_dir=data))
    worker = Worker(bootstrap, app_id, data)
    worker.wait_ready()  # seeds the changelog from the rebuilt state
    entries = worker.call("GET", "/v1/state?limit=100000")[1]["endpoints"]
    count = sum(row["items"] for row in entries)
    worker.stop()
    times = []
    for _ in range(runs):
        worker = Worker(bootstrap, app_id, data)
        try:
            times.append(worker.wait_ready())
        finally:
            worker.stop()
    seconds = statistics.median(times)
    return [Figure("restart_to_ready_with_local_state", round(seconds, 2), "s", "<= 2 s",
                   seconds <= 2, note=f"{count:,} entries; {runs} restarts, {span(times, 2)} s")], data, tmp


def footprint_figures(data: Path, events: int) -> list[Figure]:
    """Disk per entry of a stopped worker's compacted files; memory per entry of the view."""
    datadir = DataDir(data)
    entries = sum(len(c.entries) for c in datadir.load_state().lrus.endpoints.values())
    for partition in datadir.partitions():
        db = datadir.open_partition(partition)
        db.compact_range(None, None)
        db.close()
    disk = sum(f.stat().st_size for f in datadir.tables.rglob("*") if f.is_file()
               and not f.name.startswith(("LOG", "LOCK")))
    # from the records as the worker reads them: each decoded event brings its own
    # strings, which the view must not keep a copy of per entry (the workload's own
    # events share theirs, and would hide that)
    records = [encode_event(event) for event in Workload().placed_events(events)]
    tracemalloc.start()
    state = CacheState(Capacity.from_params())
    for offset, record in enumerate(records):
        state.fold.apply(decode_event(record), Position(0, offset))
    view = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    held = sum(len(c.entries) for c in state.lrus.endpoints.values())
    return [
        Figure("disk_per_entry", round(disk / entries, 1), "B", "<= 60 B after compaction",
               disk / entries <= 60, note=f"{entries:,} entries, RocksDB files of all partitions"),
        Figure("match_view_memory_per_entry", round(view / held, 1), "B", "<= 120 B",
               view / held <= 120, note=f"{held:,} entries from decoded records, Python heap (tracemalloc)"),
    ]


def restart_and_footprint(bootstrap: str, events: int, runs: int = 1) -> list[Figure]:
    """Restart time, then the footprint of the same data dir."""
    figures, data, tmp = restart_figures(bootstrap, events, runs)
    try:
        return figures + footprint_figures(data, events)
    finally:
        tmp.cleanup()
