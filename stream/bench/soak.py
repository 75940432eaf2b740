"""The soak: a compressed month of production-shaped traffic on the embedded default.

One `mmcache serve` with no ``--bootstrap-servers`` (its own broker, its log kept in a data
dir of its own) takes, through its HTTP API, as fast as it acknowledges them:

- placements of 1-3 items drawn from a Zipf catalogue, each to one of 64 endpoints (a
  request names up to 16 placements' endpoints at once, as many events, to reach a month's
  volume in minutes);
- 8 model servers reporting their encoder caches (``/v1/engine-events``: items stored,
  removed, now and then cleared);
- now and then an endpoint deleted, and a sync of the live set;
- sentinel placements, each acknowledged one remembered, to endpoints no other traffic
  touches and few enough never to be evicted;

and is restarted every few minutes in the first half (SIGTERM, then SIGKILL, in turn), never
in the second. Every ``SAMPLE_S`` the RSS of `serve` and of its broker, the bytes of the
data dir and the view's lag are sampled.
The figures: each resource's slope over the second half (flat: bounded by the live state,
not the history), the restart time at the end, and the acknowledged sentinels lost (0).
The series go to ``bench/soak.json`` and a plot to ``bench/soak.svg``.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import aiohttp
import orjson

from stream.bench.figures import Figure, span
from stream.kafka.embedded import free_port

__all__ = ["soak_figures"]

SAMPLE_S = 2.0
ENDPOINTS = [f"soak/pod-{i}" for i in range(64)]
SERVERS = ENDPOINTS[:8]  # the model servers that report their caches
SENTINELS = [f"soak/sentinel-{i}" for i in range(64)]
CATALOGUE = 50_000
#: The full soak's events: past the 10M of the history a restart is measured on.
TARGET_EVENTS = 10_500_000
_READY_S = 300.0
TITLE = "mmcache soak: memory and disk over time"


@dataclass
class Soak:
    """One soak's state: the serve process, its samples, its writes."""

    data_dir: Path
    port: int
    log_path: Path
    rebase_bytes: int
    process: subprocess.Popen[bytes] | None = None
    started_at: float = field(default_factory=time.monotonic)
    samples: list[dict[str, float]] = field(default_factory=list)
    restarts: list[dict[str, float]] = field(default_factory=list)
    events: int = 0
    engine_items: int = 0
    refused: int = 0
    sentinels: dict[str, list[str]] = field(default_factory=dict)
    exits: list[dict[str, Any]] = field(default_factory=list)  # serve ended on its own

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> float:
        """Start serve; return the seconds to ``/readyz`` 200."""
        env = {k: v for k, v in os.environ.items() if k != "MMCACHE_BOOTSTRAP_SERVERS"}
        env["MMCACHE_EMBEDDED_REBASE_BYTES"] = str(self.rebase_bytes)
        began = time.monotonic()
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "stream.cli", "serve", "--port", str(self.port),
                 "--data-dir", str(self.data_dir), "--log-level", "info"],
                stdout=out, stderr=subprocess.STDOUT, env=env)
        import urllib.request

        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited with {self.process.returncode}: see {self.log_path}")
            if time.monotonic() - began > _READY_S:
                raise RuntimeError(f"serve not ready within {_READY_S:.0f} s: see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as answer:
                    if answer.status == 200:
                        return time.monotonic() - began
            except OSError:
                pass
            time.sleep(0.05)

    def stop(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def exited(self) -> bool:
        """Whether serve ended on its own since it started: then its exit and the tail of its
        log are recorded, and it is started again (the soak goes on; the figure counts it)."""
        assert self.process is not None
        if self.process.poll() is None:
            return False
        tail = self.log_path.read_text(errors="replace").splitlines()[-40:]
        at = time.monotonic() - self.started_at
        self.exits.append({"t": at, "returncode": self.process.returncode, "log_tail": tail})
        self.process = None
        self.restarts.append({"t": at, "ready_s": self.start(), "signal": 0})
        return True

    def sample(self, lag: int | None) -> None:
        assert self.process is not None
        pid = self.process.pid
        self.samples.append({
            "t": time.monotonic() - self.started_at,
            "serve_rss_mib": _rss_mib(pid),
            "broker_rss_mib": sum(_rss_mib(child) for child in _children(pid) if _is_broker(child)),
            "data_dir_mib": _tree_bytes(self.data_dir) / 2**20,
            "lag_events": -1 if lag is None else lag,
            "events": self.events,
        })


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _is_broker(pid: int) -> bool:
    try:
        return "tansu" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def _tree_bytes(root: Path) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


class _Zipf:
    """Item numbers of a catalogue drawn with Zipf's law (s = 1)."""

    def __init__(self, size: int, seed: int) -> None:
        weights = [1.0 / (rank + 1) for rank in range(size)]
        total = sum(weights)
        self.cumulative = []
        running = 0.0
        for w in weights:
            running += w / total
            self.cumulative.append(running)
        self.random = random.Random(seed)

    def items(self, count: int) -> list[dict[str, Any]]:
        import bisect

        drawn = {min(bisect.bisect(self.cumulative, self.random.random()), len(self.cumulative) - 1)
                 for _ in range(count)}
        return [{"hash": f"img-{n}", "size": 1 + n % 3, "modality": "image"} for n in drawn]


async def _traffic(soak: Soak, done: asyncio.Event, seed: int) -> None:
    """Writers until ``done`` is set, each retrying through restarts."""
    zipf = _Zipf(CATALOGUE, seed)
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=10)
    sentinel_n = 0

    async def post(session: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> bool:
        try:
            async with session.post(soak.url + path, data=orjson.dumps(body),
                                    headers={"Content-Type": "application/json"}) as answer:
                await answer.read()
                if answer.status == 202:
                    return True
                soak.refused += 1
        except (TimeoutError, aiohttp.ClientError, OSError):
            soak.refused += 1
            await asyncio.sleep(0.2)  # restarting
        return False

    async def placements(session: aiohttp.ClientSession) -> None:
        nonlocal sentinel_n
        while not done.is_set():
            targets = rng.sample(ENDPOINTS, 16)
            body = {"request_id": f"p-{rng.random()}", "endpoints": targets,
                    "items": zipf.items(rng.randint(1, 3))}
            if await post(session, "/v1/placements", body):
                soak.events += len(targets)
            sentinel_n += 1
            if sentinel_n % 50 == 0:  # a remembered write, never evicted (< capacity each)
                endpoint, digest = SENTINELS[sentinel_n % len(SENTINELS)], f"sentinel-{sentinel_n}"
                body = {"request_id": digest, "endpoints": [endpoint],
                        "items": [{"hash": digest, "size": 1, "modality": "image"}]}
                if await post(session, "/v1/placements", body):
                    soak.events += 1
                    soak.sentinels.setdefault(endpoint, []).append(digest)

    async def engines(session: aiohttp.ClientSession) -> None:
        while not done.is_set():
            server = rng.choice(SERVERS)
            events: list[dict[str, Any]] = [{"type": "stored", "items": zipf.items(rng.randint(1, 3))}
                                            for _ in range(32)]
            events.append({"type": "removed", "hashes": [i["hash"] for i in zipf.items(8)]})
            if rng.random() < 0.01:
                events.append({"type": "cleared"})
            if await post(session, "/v1/engine-events", {"endpoint": server, "engine": "vllm",
                                                         "events": events}):
                soak.events += 1
                soak.engine_items += sum(len(e.get("items", ())) for e in events)
            await asyncio.sleep(0.005)

    async def lifecycle(session: aiohttp.ClientSession) -> None:
        while not done.is_set():
            await asyncio.sleep(1.0)
            if await post(session, "/v1/endpoint-events", {"type": "deleted",
                                                           "endpoint": rng.choice(ENDPOINTS[8:])}):
                soak.events += 1
            if rng.random() < 0.2 and await post(session, "/v1/endpoint-events",
                                                 {"type": "sync", "live": ENDPOINTS + SENTINELS}):
                soak.events += 1

    connector = aiohttp.TCPConnector(limit=64)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(placements(session) for _ in range(24)),
                             *(engines(session) for _ in range(2)), lifecycle(session))


def _lag(soak: Soak) -> int | None:
    import urllib.request

    try:
        with urllib.request.urlopen(soak.url + "/readyz", timeout=2) as answer:
            return orjson.loads(answer.read()).get("lag_events")
    except Exception:  # noqa: BLE001 - a restart in progress
        return None


def _missing_sentinels(soak: Soak) -> int:
    import urllib.request

    missing = 0
    for endpoint, hashes in soak.sentinels.items():
        body = orjson.dumps({"endpoints": [endpoint],
                             "body": {"generate": {"features": {"mm_hashes": {"image": hashes}}}}})
        request = urllib.request.Request(soak.url + "/v1/match", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            found = orjson.loads(answer.read())["endpoints"][0]["matched_items"]
        missing += len(hashes) - len(found)
    return missing


def _slope_per_hour(samples: list[dict[str, float]], key: str, since: float) -> tuple[float, float]:
    """Least-squares slope of ``key`` from ``since`` on (per hour) and its mean there."""
    half = [s for s in samples if s["t"] >= since]
    if len(half) < 3:
        return 0.0, half[-1][key] if half else 0.0
    slope = statistics.linear_regression([s["t"] for s in half], [s[key] for s in half]).slope
    return slope * 3600, statistics.fmean(s[key] for s in half)


def soak_figures(quick: bool, scale: float | None, out_dir: Path = Path("bench")) -> list[Figure]:
    """Run the soak; write ``soak.json`` and ``soak.svg`` beside the results.

    Two halves. In the first, serve is restarted every few minutes; in the second, never (a
    restart hides a climb: the second half's slopes are those of one long-running serve,
    its broker rebased as it goes). The first half lasts at least ``minutes / 2`` and until
    half the target of events is acknowledged; the second as long again (the full run: at
    least 25 minutes), and until the target is reached; neither past ``max_minutes / 2``."""
    minutes, target, max_minutes = ((0.5, 0, 2.0) if scale else (2.0, 0, 6.0) if quick
                                    else (12.0, TARGET_EVENTS, 60.0))
    restart_every_s = 20.0 if scale else 30.0 if quick else 120.0
    # long enough to tell a climb from a warm-up after the last restart (a 12-minute one
    # could not: its serve RSS moved 285 to 320 MiB, slowing)
    second_half_min_s = 0.0 if (scale or quick) else 25 * 60.0
    rebase_bytes = 16 * 2**20 if scale else 64 * 2**20  # the default
    with tempfile.TemporaryDirectory(prefix="mmcache-soak-") as tmp:
        soak = Soak(Path(tmp) / "data", free_port(), Path(tmp) / "serve.log", rebase_bytes)
        soak.restarts.append({"t": 0.0, "ready_s": soak.start(), "signal": 0})
        soak.started_at = time.monotonic()
        signals = [signal.SIGTERM, signal.SIGKILL]

        def elapsed() -> float:
            return time.monotonic() - soak.started_at

        def half_done(since: float, at_least_s: float, events: int) -> bool:
            took = elapsed() - since
            return took >= max_minutes * 30 or (took >= at_least_s and soak.events >= events)

        async def run() -> float:
            done = asyncio.Event()
            traffic = asyncio.ensure_future(_traffic(soak, done, seed=7))
            next_restart = restart_every_s
            while not half_done(0.0, minutes * 30, target // 2):
                await asyncio.sleep(SAMPLE_S)
                await asyncio.to_thread(soak.exited)
                soak.sample(await asyncio.to_thread(_lag, soak))
                if elapsed() >= next_restart:
                    sig = signals[len(soak.restarts) % 2]
                    at = elapsed()
                    await asyncio.to_thread(soak.stop, sig)
                    ready = await asyncio.to_thread(soak.start)
                    soak.restarts.append({"t": at, "ready_s": ready, "signal": int(sig)})
                    next_restart = elapsed() + restart_every_s
            second_half = elapsed()
            while not half_done(second_half, max(second_half, second_half_min_s), target):
                await asyncio.sleep(SAMPLE_S)
                await asyncio.to_thread(soak.exited)
                soak.sample(await asyncio.to_thread(_lag, soak))
            done.set()
            await traffic
            return second_half

        try:
            second_half = asyncio.run(run())
            # the restart at the end, on the whole history, then every sentinel looked for
            soak.stop(signal.SIGKILL)
            final = soak.start()
            soak.restarts.append({"t": elapsed(), "ready_s": final, "signal": int(signal.SIGKILL)})
            missing = _missing_sentinels(soak)
            log_text = soak.log_path.read_text(errors="replace")
        finally:
            if soak.process is not None:
                soak.stop(signal.SIGTERM)
    rebases = log_text.count("started again on its compacted log")
    dropped = sum(int(n) for n in re.findall(r"mmcache-lru-changelog (\d+) records", log_text))
    series = {"samples": soak.samples, "restarts": soak.restarts, "exits": soak.exits, "rebases": rebases,
              "events_acknowledged": soak.events, "engine_items_reported": soak.engine_items,
              "writes_refused": soak.refused, "minutes": round(soak.samples[-1]["t"] / 60, 2),
              "second_half_from_s": round(second_half, 1)}
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "soak" if not (quick or scale) else "soak-quick"
    (out_dir / f"{name}.json").write_bytes(orjson.dumps(series, option=orjson.OPT_INDENT_2))
    (out_dir / f"{name}.svg").write_text(soak_svg(soak.samples, soak.restarts))
    ready = [r["ready_s"] for r in soak.restarts[1:]]
    planned = sum(1 for r in soak.restarts[1:-1] if r["signal"])
    shape = (f"{series['minutes']:g} min compressed: {soak.events:,} events acknowledged (placements "
             f"of 1-3 Zipf items to 64 endpoints, 8 servers' engine reports with {soak.engine_items:,} "
             f"items, deletions, syncs), {planned} restarts in the first half (SIGTERM "
             f"and SIGKILL in turn), none in the second, {rebases} rebases of the broker, "
             f"{soak.refused:,} writes refused (503 or no connection while restarting; never "
             f"acknowledged); series in bench/{name}.json, "
             f"plot bench/{name}.svg")
    figures = []
    for key, label in (("serve_rss_mib", "serve RSS"), ("broker_rss_mib", "broker RSS"),
                       ("data_dir_mib", "data dir")):
        slope, mean = _slope_per_hour(soak.samples, key, second_half)
        half_span_h = (soak.samples[-1]["t"] - second_half) / 3600
        drift = abs(slope) * half_span_h
        figures.append(Figure(
            f"soak_{key.removesuffix('_mib')}_slope", round(slope, 1), "MiB/h",
            "~0: over the second half (no restart) it moves less than 25% of its mean there",
            drift <= 0.25 * mean,
            note=f"{label} over the second half, from minute {second_half / 60:.1f} on, serve "
                 f"never restarted: mean {mean:,.1f} MiB, trend {slope:+,.1f} MiB/h "
                 f"({drift:,.1f} MiB over that half); {shape}"))
    figures.append(Figure("soak_restart_to_ready_at_end", round(final, 2), "s",
                          "<= 10 s whatever the history", final <= 10.0,
                          note=f"SIGKILL then serve on the whole data dir; restarts on the way "
                               f"{span(ready, 2) if ready else '-'} s; changelog records dropped by "
                               f"compaction over the run {dropped:,}; {shape}"))
    figures.append(Figure("soak_serve_exits", len(soak.exits), "exits", "0: serve never ends on its own",
                          not soak.exits,
                          note="; ".join(f"minute {e['t'] / 60:.1f}: exit {e['returncode']}, last line "
                                         f"{e['log_tail'][-1] if e['log_tail'] else '-'}" for e in soak.exits)
                          or f"serve ran through; {shape}"))
    figures.append(Figure("soak_acknowledged_writes_lost", missing, "writes", "0", missing == 0,
                          note=f"{sum(len(h) for h in soak.sentinels.values()):,} acknowledged "
                               f"sentinel placements looked for after the last restart"))
    return figures


def soak_svg(samples: list[dict[str, float]], restarts: list[dict[str, float]]) -> str:
    """RSS of serve and of its broker and the data dir's size over time, restarts marked."""
    width, height, left, right, top, bottom = 760, 340, 60, 20, 30, 40
    series = [("serve_rss_mib", "serve RSS", "#1f77b4"), ("broker_rss_mib", "broker RSS", "#d62728"),
              ("data_dir_mib", "data dir", "#2ca02c")]
    t_max = max((s["t"] for s in samples), default=1.0) or 1.0
    y_max = max((s[key] for s in samples for key, _, _ in series), default=1.0) * 1.1 or 1.0

    def x(t: float) -> float:
        return left + (width - left - right) * t / t_max

    def y(v: float) -> float:
        return height - bottom - (height - top - bottom) * v / y_max

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{left}" y="18" font-size="13">{escape(TITLE)}</text>',
             f'<line x1="{left}" y1="{y(0)}" x2="{width - right}" y2="{y(0)}" stroke="black"/>',
             f'<line x1="{left}" y1="{top}" x2="{left}" y2="{y(0)}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle">minutes</text>',
             f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" '
             f'text-anchor="middle">MiB</text>']
    for step in range(6):
        v = y_max * step / 5
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4}" text-anchor="end">{v:,.0f}</text>')
        t = t_max * step / 5
        parts.append(f'<text x="{x(t)}" y="{y(0) + 16}" text-anchor="middle">{t / 60:.1f}</text>')
    for restart in (r for r in restarts[1:] if r["t"] <= t_max):
        parts.append(f'<line x1="{x(restart["t"])}" y1="{top}" x2="{x(restart["t"])}" y2="{y(0)}" '
                     'stroke="#999" stroke-dasharray="3,3"/>')
    for index, (key, label, colour) in enumerate(series):
        points = " ".join(f"{x(s['t']):.1f},{y(s[key]):.1f}" for s in samples)
        parts.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}"/>')
        parts.append(f'<text x="{width - right - 150}" y="{top + 14 * index + 10}" fill="{colour}">'
                     f'{escape(label)}</text>')
    parts.append(f'<text x="{width - right - 150}" y="{top + 14 * len(series) + 10}" fill="#999">'
                 'restarts (dashed)</text>')
    parts.append("</svg>")
    return "\n".join(parts)
