"""Failover, measured: two workers of one app id under steady traffic, ``kill -9`` of one.

One trial, in order:

1. start worker A, then worker B (same app id, own data dirs), both ready;
2. placements through both workers and matches through A, steadily, for a while;
3. ``kill -9`` B at t0; placements go on through A for ``after_kill_s`` (they land on
   B's partitions too, which nobody applies until A has taken them over), then stop,
   so the log is final;
4. ``mmcache rebuild`` of the log into a new dir, under a fresh app id, prints the
   replay's digest; meanwhile A's ``GET /v1/state?limit=0`` digest is sampled;
5. the takeover time is t0 to the first sample equal to the replay's digest; A's log
   says where it went (``takeover_phases``): when the group's rebalance reached A, when
   its recovery for the new assignment began, and when its view was whole again.

Counts, not times, are what the integration test asserts: placements acknowledged with
202 vs found on their endpoint through A, matches answered vs failed during the whole
trial. Since placements go on after the kill, a takeover shorter than ``after_kill_s``
is reported as ``after_kill_s`` (a floor; the trial says so).

Run: ``python -m stream.bench.failover --runs 5`` (an embedded broker unless
``--bootstrap-servers`` is given).
"""

from __future__ import annotations

import argparse
import http.client
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson

from stream.bench.figures import Figure, render_table, span
from stream.bench.service import Worker

__all__ = ["PHASES", "Client", "Takeover", "failover_figures", "phases_note", "rebuild_digest",
           "takeover_phases", "takeover_trial", "wait_digest"]

#: The steps of a takeover as a survivor logs them: each step's name, its line's text, and
#: what it says. The rebalance reached the survivor (aiokafka: a heartbeat refused), its
#: recovery for the new assignment began (``stream.worker.table_mirror``, once Faust asked
#: the broker for the changelog's ends), its view was whole again (``stream.worker.keeper``).
#: Until the first it is the broker's failure detection, then its join; from the second on
#: the time is mmcache's.
PHASES = (("noticed", "because it is rebalancing", "the rebalance reached the survivor"),
          ("assigned", "recovery after a rebalance:", "its recovery began"),
          ("loaded", "state loaded:", "its view was whole"))

ENDPOINTS = [f"failover/pod-{i:02d}" for i in range(64)]


class Client:
    """A kept-alive HTTP connection to one worker, for one thread; reconnects after an error."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.port = port
        self.timeout = timeout
        self.conn: http.client.HTTPConnection | None = None

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One request; raises OSError / HTTPException when the worker does not answer."""
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        payload = None if body is None else orjson.dumps(body)
        try:
            self.conn.request(method, path, payload, {"Content-Type": "application/json"})
            response = self.conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException):
            self.close()
            raise
        return response.status, orjson.loads(data) if data[:1] in (b"{", b"[") else data

    def close(self) -> None:
        """Drop the connection."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None


def _placement(endpoint: str, digest: str) -> dict[str, Any]:
    return {"request_id": digest, "endpoints": [endpoint],
            "items": [{"hash": digest, "size": 1, "modality": "image"}]}


def _match_body(endpoints: list[str], hashes: list[str]) -> dict[str, Any]:
    return {"endpoints": endpoints,
            "body": {"generate": {"features": {"mm_hashes": {"image": hashes}}}}}


@dataclass
class Traffic:
    """Placements through some workers and matches through others, on threads, counted."""

    placers: list[int]
    matchers: list[int]
    interval_s: float = 0.01
    acked: list[tuple[str, str]] = field(default_factory=list)
    placements_sent: int = 0
    placement_failures: int = 0
    matches_sent: int = 0
    matches_ok: int = 0
    match_errors: list[str] = field(default_factory=list)
    _stop_placing: threading.Event = field(default_factory=threading.Event)
    _stop_matching: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> Traffic:
        """Start one placing thread (round robin over ``placers``) and one matching
        thread per matcher port."""
        self._threads = [threading.Thread(target=self._place, daemon=True)]
        self._threads += [threading.Thread(target=self._match, args=(port,), daemon=True)
                          for port in self.matchers]
        for thread in self._threads:
            thread.start()
        return self

    def stop_placing(self, ports: list[int] | None = None) -> None:
        """Stop all placements, or (``ports``) go on through those only."""
        if ports is None:
            self._stop_placing.set()
        else:
            self.placers = ports

    def stop(self) -> None:
        """Stop everything and wait for the threads."""
        self._stop_placing.set()
        self._stop_matching.set()
        for thread in self._threads:
            thread.join(30)

    def _place(self) -> None:
        clients: dict[int, Client] = {}
        n = 0
        while not self._stop_placing.is_set():
            port = self.placers[n % len(self.placers)]
            client = clients.setdefault(port, Client(port))
            endpoint, digest = ENDPOINTS[n % len(ENDPOINTS)], f"fo-{uuid.uuid4().hex[:12]}-{n}"
            self.placements_sent += 1
            try:
                status = client.call("POST", "/v1/placements", _placement(endpoint, digest))[0]
            except (OSError, http.client.HTTPException):
                status = 0
            if status == 202:
                with self._lock:
                    self.acked.append((endpoint, digest))
            else:
                self.placement_failures += 1
            n += 1
            time.sleep(self.interval_s)

    def _match(self, port: int) -> None:
        client, rng = Client(port), random.Random(port)
        while not self._stop_matching.is_set():
            with self._lock:
                recent = [digest for _, digest in self.acked[-8:]]
            body = _match_body(rng.sample(ENDPOINTS, 16), recent or ["none"])
            self.matches_sent += 1
            try:
                status, answer = client.call("POST", "/v1/match", body)
            except (OSError, http.client.HTTPException) as exc:
                self.match_errors.append(f"{type(exc).__name__}: {exc}")
            else:
                if status == 200 and len(answer["endpoints"]) == 16:
                    self.matches_ok += 1
                else:
                    self.match_errors.append(f"HTTP {status}: {str(answer)[:200]}")
            time.sleep(self.interval_s)


def found_on(port: int, acked: list[tuple[str, str]]) -> int:
    """How many acknowledged (endpoint, hash) placements the worker's view holds."""
    by_endpoint: dict[str, list[str]] = {}
    for endpoint, digest in acked:
        by_endpoint.setdefault(endpoint, []).append(digest)
    client, found = Client(port, timeout=30), 0
    try:
        for endpoint, hashes in by_endpoint.items():
            for start in range(0, len(hashes), 1000):
                answer = client.call("POST", "/v1/match",
                                     _match_body([endpoint], hashes[start:start + 1000]))[1]
                found += len(answer["endpoints"][0]["matched_items"])
    finally:
        client.close()
    return found


def rebuild_digest(bootstrap: str, topic: str, data_dir: Path, app_id: str | None = None) -> str:
    """The digest ``mmcache rebuild`` prints for the whole topic, under a fresh app id
    (or ``app_id``: then the dir seeds that app's first worker)."""
    done = subprocess.run(
        [sys.executable, "-m", "stream.cli", "rebuild", "--bootstrap-servers", bootstrap,
         "--app-id", app_id or f"replay-{uuid.uuid4().hex[:10]}", "--topic", topic,
         "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"rebuild failed: {done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


class DigestSampler:
    """Samples one worker's state digest (and /readyz) on a thread, with times since t0."""

    def __init__(self, port: int, t0: float) -> None:
        self.client, self.t0 = Client(port, timeout=30), t0
        self.samples: list[tuple[float, str]] = []
        self.lags: list[tuple[float, int]] = []  # /readyz lag_events, where reported
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                _, state = self.client.call("GET", "/v1/state?limit=0")
                self.samples.append((time.monotonic() - self.t0, state["digest"]))
                _, ready = self.client.call("GET", "/readyz")
            except (OSError, http.client.HTTPException, KeyError, TypeError):
                self.errors += 1
                time.sleep(0.05)
                continue
            # the lag field of CONTRACT's /readyz body, where the worker reports it
            if isinstance(ready, dict) and isinstance(ready.get("lag_events"), int):
                self.lags.append((time.monotonic() - self.t0, ready["lag_events"]))
            time.sleep(0.02)

    @property
    def lag_zero_s(self) -> float | None:
        """Seconds from t0 to the first lag sample of 0 after which every sample is 0
        (None when lag is not reported or never settled at 0)."""
        settled = None
        for t, lag in self.lags:
            if lag == 0 and settled is None:
                settled = t
            elif lag:
                settled = None
        return settled

    @property
    def max_lag(self) -> int | None:
        """The largest lag reported after t0."""
        return max((lag for _, lag in self.lags), default=None)

    def first_equal(self, target: str) -> float | None:
        """Seconds from t0 to the first sample equal to ``target``."""
        return next((t for t, digest in self.samples if digest == target), None)

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join(30)
        self.client.close()


def wait_digest(samplers: list[DigestSampler], target: str, timeout: float) -> list[float | None]:
    """Wait until every sampler saw ``target``; the first time each did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        times = [s.first_equal(target) for s in samplers]
        if all(t is not None for t in times):
            return times
        time.sleep(0.05)
    return [s.first_equal(target) for s in samplers]


@dataclass
class Takeover:
    """What one trial counted and measured."""

    placements_sent: int
    placements_acked: int
    placements_found: int
    matches_sent: int
    matches_ok: int
    match_errors: list[str]
    takeover_s: float | None
    lag_zero_s: float | None
    max_lag: int | None
    after_kill_s: float
    live_digest: str
    replay_digest: str
    victim_exit: int | None
    #: partitions the survivor's last recovery after the kill read from its files (``None``:
    #: it logged no recovery after the kill)
    read_from_files: list[int] | None = None
    #: seconds from the kill to each step of ``PHASES`` the survivor logged
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def floored(self) -> bool:
        """The takeover was no longer than the placements after the kill: a floor."""
        return self.takeover_s is not None and self.takeover_s <= self.after_kill_s


def start_group(bootstrap: str, app_id: str, root: Path, count: int,
                topic: str | None = None) -> list[Worker]:
    """Start ``count`` workers of one app id one after the other, each with its own data
    dir under ``root``; return once all of them are ready."""
    workers: list[Worker] = []
    try:
        for i in range(count):
            (root / f"w{i}").mkdir(parents=True)
            workers.append(Worker(bootstrap, app_id, root / f"w{i}" / "data", topic))
            workers[-1].wait_ready(120)
        for worker in workers:
            worker.wait_ready(120)
    except BaseException:
        stop_all(workers)
        raise
    return workers


def stop_all(workers: list[Worker]) -> None:
    """SIGKILL every worker still running (by its own pid) and reap it."""
    for worker in workers:
        if worker.process.poll() is None:
            worker.process.kill()
        worker.process.wait(30)
        worker.conn.close()
        worker.log.close()


def takeover_trial(bootstrap: str, root: Path, steady_s: float = 2.0,
                   after_kill_s: float = 0.5, log: Callable[[str], None] = print,
                   sig: signal.Signals = signal.SIGKILL) -> Takeover:
    """One trial as the module docstring says (``sig`` SIGTERM: a clean stop, as in a
    rolling update, instead of ``kill -9``); every process it starts is stopped."""
    app_id = f"failover-{uuid.uuid4().hex[:10]}"
    workers = start_group(bootstrap, app_id, root, 2)
    survivor, victim = workers
    traffic = Traffic([survivor.port, victim.port], [survivor.port])
    samplers: list[DigestSampler] = []
    try:
        traffic.start()
        time.sleep(steady_s)
        logged = Path(survivor.log.name).stat().st_size  # the survivor's log before the kill
        victim.process.send_signal(sig)
        t0, killed_at = time.monotonic(), time.time()
        traffic.stop_placing([survivor.port])
        sampler = DigestSampler(survivor.port, t0)
        samplers.append(sampler)
        time.sleep(after_kill_s)
        traffic.stop_placing()
        victim_exit = victim.process.wait(30)
        replay = rebuild_digest(bootstrap, f"{app_id}-events", root / "replay")
        (equal,) = wait_digest(samplers, replay, timeout=90)
        time.sleep(0.5)  # matches go on a little past the takeover
        traffic.stop()
        sampler.stop()
        live = Client(survivor.port).call("GET", "/v1/state?limit=0")[1]["digest"]
        found = found_on(survivor.port, traffic.acked)
        log(f"takeover {equal if equal is None else round(equal, 2)} s; acked "
            f"{len(traffic.acked)}/{traffic.placements_sent}, found {found}; matches "
            f"{traffic.matches_ok}/{traffic.matches_sent}, errors {len(traffic.match_errors)}; "
            f"/readyz lag_events max {sampler.max_lag}, 0 for good after {sampler.lag_zero_s} s")
        return Takeover(traffic.placements_sent, len(traffic.acked), found, traffic.matches_sent,
                        traffic.matches_ok, traffic.match_errors, equal, sampler.lag_zero_s,
                        sampler.max_lag, after_kill_s, live, replay, victim_exit,
                        read_at_last_recovery(Path(survivor.log.name), logged),
                        takeover_phases(Path(survivor.log.name), logged, killed_at))
    finally:
        traffic.stop()
        for s in samplers:
            s.stop()
        stop_all(workers)


def read_at_last_recovery(log_path: Path, start: int = 0) -> list[int] | None:
    """The partitions a worker's last recovery read from its files, from its log from byte
    ``start`` on (the keeper's "state loaded" line); ``None`` when it logged none there."""
    found = None
    with open(log_path, "rb") as raw:
        raw.seek(start)
        lines = raw.read().decode(errors="replace").splitlines()
    for line in lines:
        if "state loaded:" in line and "(read from the files: [" in line:
            found = line.rsplit("[", 1)[1].split("]", 1)[0]
    if found is None:
        return None
    return [int(p) for p in found.split(",") if p.strip()]


def takeover_phases(log_path: Path, start: int, killed_at: float) -> dict[str, float]:
    """Seconds from the kill (``killed_at``, wall clock) to each step of ``PHASES``: its
    first line after the kill in a survivor's log from byte ``start`` on (the view whole:
    after its recovery began). A step not logged is left out (aiokafka's warning is one
    ``stream.logs.RepeatFilter`` may hold back when the same came less than 5 s before)."""
    with open(log_path, "rb") as raw:
        raw.seek(start)
        lines = raw.read().decode(errors="replace").splitlines()
    found: dict[str, float] = {}
    for line in lines:
        step = next((name for name, text, _ in PHASES if name not in found and text in line), None)
        if step is None or (step == "loaded" and "assigned" not in found):
            continue  # an earlier recovery's view, not the takeover's
        try:  # logging's default time: local, to the millisecond
            at = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        if at >= killed_at:
            found[step] = at - killed_at
    return found


def phases_note(trials: list[dict[str, float]]) -> str:
    """Where the takeovers' time went: for each step of ``PHASES`` that every one of
    ``trials`` (``takeover_phases`` of each) logged, the median and the spread."""
    said = []
    for name, _, words in PHASES:
        times = [trial[name] for trial in trials if name in trial]
        if times and len(times) == len(trials):  # the median of some trials would mislead
            said.append(f"{words} at {statistics.median(times):.2f} s ({span(times, 2)})")
    return "after the kill: " + ", ".join(said) if said else "no step of the takeover logged"


def spread(values: list[float]) -> str:
    """``median (min-max, n runs)`` of some seconds."""
    return (f"{statistics.median(values):.2f} s (min {min(values):.2f}, max {max(values):.2f}, "
            f"{len(values)} runs)")


def failover_figures(bootstrap: str, runs: int,
                     sig: signal.Signals = signal.SIGKILL) -> list[Figure]:
    """``runs`` trials; the median takeover time with its spread, and the counts."""
    trials = []
    for run in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            trials.append(takeover_trial(bootstrap, Path(tmp), sig=sig,
                                         log=lambda line, r=run: print(f"run {r + 1}: {line}")))
    how = "kill -9" if sig == signal.SIGKILL else f"{sig.name}"
    suffix = "" if sig == signal.SIGKILL else f"_{sig.name.lower()}"
    times = [t.takeover_s for t in trials if t.takeover_s is not None]
    lost = sum(t.placements_acked - t.placements_found for t in trials)
    errors = sum(len(t.match_errors) for t in trials)
    equal = sum(t.live_digest == t.replay_digest for t in trials)
    note = (f"2 workers, {how} of one under ~100 placements/s and ~100 matches/s; "
            f"{spread(times) if times else 'never equal'}; acked placements lost {lost}, "
            f"match errors {errors}, live == replay in {equal}/{runs}; "
            f"{phases_note([t.phases for t in trials])}"
            + ("; some runs at the after-kill floor" if any(t.floored for t in trials) else ""))
    figures = [Figure(f"failover_takeover_kill_to_replay_equal{suffix}",
                      round(statistics.median(times), 2) if times else -1.0, "s",
                      "every run converges; 0 acknowledged placements lost; 0 match errors",
                      len(times) == runs and lost == 0 and errors == 0 and equal == runs,
                      note=note)]
    lags = [t.lag_zero_s for t in trials if t.lag_zero_s is not None]
    if lags:
        peaks = [t.max_lag for t in trials if t.max_lag is not None]
        figures.append(Figure(f"failover_kill_to_survivor_lag_zero{suffix}",
                              round(statistics.median(lags), 2), "s",
                              "lag visible (> 0) after the kill, 0 once taken over",
                              len(lags) == runs and all(peaks),
                              note=f"{spread(lags)}; largest /readyz lag_events per run {peaks}"))
    return figures


def main(argv: list[str] | None = None) -> None:
    """``python -m stream.bench.failover [--runs N] [--bootstrap-servers B]``."""
    parser = argparse.ArgumentParser(prog="python -m stream.bench.failover",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--signal", choices=["KILL", "TERM"], default="KILL",
                        help="how the victim stops: kill -9, or a clean SIGTERM")
    parser.add_argument("--bootstrap-servers", help="a cluster instead of an embedded broker")
    args = parser.parse_args(argv)
    sig = signal.Signals[f"SIG{args.signal}"]
    _print_figures(args.bootstrap_servers, lambda b: failover_figures(b, args.runs, sig))


def _print_figures(bootstrap: str | None, measure: Callable[[str], list[Figure]]) -> None:
    from stream.kafka.embedded import EmbeddedBroker

    broker = None if bootstrap else EmbeddedBroker().start()
    try:
        figures = measure(bootstrap or broker.bootstrap_servers)  # type: ignore[union-attr]
    finally:
        if broker is not None:
            broker.stop()
    print(render_table(figures))
    for figure in figures:
        print(f"{figure.name}: {figure.note}")


if __name__ == "__main__":
    main()
