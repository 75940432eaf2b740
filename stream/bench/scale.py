"""Three workers at scale: 1,000 endpoints x 1,024 entries on one broker.

In order:

1. the workload's placements (600k events: every endpoint's LRU full) are produced in
   bulk onto a new event topic, and ``mmcache rebuild`` replays them into a seed dir;
2. worker 0 starts on the seed (it writes the changelog), then workers 1 and 2 join one
   after the other on empty data dirs: the time each new worker takes from start to
   ``/readyz`` 200 (it restores its partitions from the changelog and follows the
   others');
3. memory (RSS, and its peak) and disk (RocksDB files of the data dir) per worker;
4. match latency p50/p99 on each worker in turn, under a paced wrk load
   (``stream.bench.match``'s harness: wrk on core 1);
5. ``cycles`` times: placements and matches through workers 0 and 1, ``kill -9`` of
   worker 2, placements through 0 and 1 for ``after_kill_s`` more, then the time from
   the kill until both survivors' digests equal an offline rebuild of the log (counts
   of placements acknowledged and found on both, matches answered and failed); then
   worker 2 restarts on its kept data dir (after a crash it restores from the
   changelog) and the time until it is ready is one more join figure.

Run: ``python -m stream.bench.scale`` (about 4-5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import orjson

from stream.bench.failover import (
    PHASES,
    Client,
    DigestSampler,
    Traffic,
    _print_figures,
    found_on,
    phases_note,
    rebuild_digest,
    spread,
    stop_all,
    takeover_phases,
    wait_digest,
)
from stream.bench.figures import Figure
from stream.bench.match import wrk_paced_latency
from stream.bench.replay import produce_placements
from stream.bench.service import Worker
from stream.bench.workload import Workload

__all__ = ["scale_figures"]


def rss_bytes(pid: int) -> tuple[int, int]:
    """(resident, peak resident) bytes of a process, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":" in line)
    return (int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024)


def disk_bytes(root: Path) -> tuple[int, int]:
    """(apparent, allocated) bytes of every file under ``root``."""
    files = [f.stat() for f in root.rglob("*") if f.is_file()]
    return sum(s.st_size for s in files), sum(s.st_blocks * 512 for s in files)


def _held_bodies(path: Path, events: int, count: int = 500) -> None:
    """Match bodies of the workload (64 endpoints, 8 items, half held): the held hashes
    are taken from the workload's last events, which no LRU has evicted yet."""
    recent: list[str] = []
    for i, event in enumerate(Workload().placed_events(events)):
        if i >= events - 20_000:
            recent.extend(item.hash for item in event.items)
    workload = Workload(seed=11)
    held = list(dict.fromkeys(recent))
    path.write_bytes(b"\n".join(orjson.dumps(workload.match_body(held)) for _ in range(count)))


def _mib(value: float) -> float:
    return round(value / 2**20, 1)


def scale_figures(bootstrap: str, events: int = 600_000, cycles: int = 2, rate: float = 500,
                  seconds: int = 5, after_kill_s: float = 0.5,
                  keep: Path | None = None) -> list[Figure]:
    """Every figure of the module docstring, for 3 workers (their data dirs and logs
    under ``keep`` when given, else in a temporary dir)."""
    app_id = f"scale-{uuid.uuid4().hex[:10]}"
    topic = f"{app_id}-events"
    figures: list[Figure] = []
    with contextlib.ExitStack() as cleanup:
        root = Path(tempfile.mkdtemp(prefix="scale-", dir=keep))
        if keep is None:
            cleanup.callback(shutil.rmtree, root, ignore_errors=True)
        started = time.monotonic()
        asyncio.run(produce_placements(bootstrap, topic, events))
        produced = time.monotonic() - started
        for i in range(3):
            (root / f"w{i}").mkdir()
        started = time.monotonic()
        rebuild_digest(bootstrap, topic, root / "w0" / "data", app_id)
        rebuilt = time.monotonic() - started
        print(f"produced {events:,} events in {produced:.1f} s, rebuilt in {rebuilt:.1f} s")
        workers: list[Worker] = []
        try:
            workers.append(Worker(bootstrap, app_id, root / "w0" / "data", topic))
            seeded = workers[0].wait_ready(300)
            joins = []
            for i in (1, 2):
                workers.append(Worker(bootstrap, app_id, root / f"w{i}" / "data", topic))
                joins.append(workers[-1].wait_ready(300))
                for worker in workers:
                    worker.wait_ready(300)
            print(f"seeded worker ready in {seeded:.1f} s; joins {joins}")
            digests = {Client(w.port, 60).call("GET", "/v1/state?limit=0")[1]["digest"]
                       for w in workers}
            entries = [workers[i].metric("mmcache_entries") for i in range(3)]
            memory = [rss_bytes(w.process.pid) for w in workers]
            disk = [disk_bytes(root / f"w{i}" / "data") for i in range(3)]
            bodies = root / "bodies.jsonl"
            _held_bodies(bodies, events)
            latency = [wrk_paced_latency(f"http://127.0.0.1:{w.port}/v1/match", bodies, rate,
                                         seconds) for w in workers]
            takeovers, phases, cycles_taken, lost, errors, answered, equal = [], [], [], 0, 0, 0, 0
            for cycle in range(cycles):
                taken, counts, steps = _takeover(bootstrap, topic, root / f"replay-{cycle}",
                                                 workers, after_kill_s)
                print(f"cycle {cycle + 1}: takeover {taken}, counts {counts}, phases {steps}")
                phases.append(steps)
                if taken is not None:
                    takeovers.append(taken)
                    cycles_taken.append((taken, steps))
                lost += counts["acked"] * 2 - counts["found"]
                errors += counts["errors"]
                answered += counts["answered"]
                equal += counts["equal"]
                victim = workers[2]
                workers[2] = Worker(bootstrap, app_id, root / "w2" / "data", topic)
                victim.log.close()
                joins.append(workers[2].wait_ready(300))
                for worker in workers:
                    worker.wait_ready(300)
            memory_after = [rss_bytes(w.process.pid) for w in workers]
        finally:
            stop_all(workers)
    per_worker = ", ".join(
        f"w{i}: {_mib(memory[i][0])} MiB (peak {_mib(memory[i][1])}), disk "
        f"{_mib(disk[i][0])} MiB ({_mib(disk[i][1])} allocated), {int(entries[i]):,} entries"
        for i in range(3))
    figures.append(Figure("scale3_worker_rss_max", _mib(max(m[0] for m in memory)), "MiB",
                          "reported", True, note=per_worker + "; after the takeovers: "
                          + ", ".join(f"{_mib(m[0])} MiB" for m in memory_after)))
    figures.append(Figure("scale3_worker_disk_max", _mib(max(d[0] for d in disk)), "MiB",
                          "reported", True, note=per_worker))
    figures.append(Figure("scale3_join_to_ready", round(statistics.median(joins), 2), "s",
                          "reported", True,
                          note=f"{spread(joins)}: 2nd worker {joins[0]:.2f} s, 3rd {joins[1]:.2f} s, "
                          f"restarts after kill -9 (kept data dir) "
                          + ", ".join(f"{j:.2f} s" for j in joins[2:])
                          + f"; first worker on the rebuilt seed {seeded:.2f} s"))
    taken = statistics.median(takeovers) if takeovers else -1.0
    figures.append(Figure("scale3_takeover_kill_to_replay_equal", round(taken, 2), "s",
                          "<= 2 s; every cycle converges; 0 acknowledged placements lost; "
                          "0 match errors",
                          0 <= taken <= 2 and len(takeovers) == cycles and lost == 0
                          and errors == 0 and equal == cycles,
                          note=(spread(takeovers) if takeovers else "never equal")
                          + f"; both survivors; matches answered {answered}, errors {errors}, "
                          f"acknowledged placements missing {lost}; "
                          + phases_note(phases) + " (the later survivor's, each cycle)"))
    ours = [equal_at - steps["assigned"] for equal_at, steps in cycles_taken if "assigned" in steps]
    if ours and len(ours) == cycles:
        figures.append(Figure("scale3_takeover_assigned_to_replay_equal", round(statistics.median(ours), 2),
                              "s", "reported: the takeover less the broker's failure detection, "
                              "its join and Faust's ask for the changelog's ends", True,
                              note=f"{spread(ours)}; from the start of the survivors' recovery of "
                              "the new assignment to both digests equal to the replay"))
    for i, (p50, p99, achieved) in enumerate(latency):
        figures.append(Figure(f"scale3_match_latency_w{i}_p50", round(p50, 3), "ms", "reported",
                              True, note=f"p99 {p99:.3f} ms at {achieved:.0f} req/s paced, "
                              f"{seconds} s, 64 endpoints x 8 items"))
        figures.append(Figure(f"scale3_match_latency_w{i}_p99", round(p99, 3), "ms", "reported",
                              True))
    figures.append(Figure("scale3_views_equal", float(len(digests) == 1), "", "1 (the three "
                          "workers' digests are equal before the kills)", len(digests) == 1))
    return figures


def _takeover(bootstrap: str, topic: str, replay_dir: Path, workers: list[Worker],
              after_kill_s: float) -> tuple[float | None, dict[str, int], dict[str, float]]:
    """SIGKILL ``workers[2]`` under traffic through the other two (module docstring, 5);
    the takeover time, the counts, and the steps both survivors logged (``PHASES``, the
    later survivor's time of each)."""
    survivors = [w.port for w in workers[:2]]
    traffic = Traffic(list(survivors), list(survivors)).start()
    samplers: list[DigestSampler] = []
    logs = [Path(w.log.name) for w in workers[:2]]
    try:
        time.sleep(2.0)
        logged = [path.stat().st_size for path in logs]  # the survivors' logs before the kill
        workers[2].process.kill()
        t0, killed_at = time.monotonic(), time.time()
        samplers = [DigestSampler(port, t0) for port in survivors]
        time.sleep(after_kill_s)
        traffic.stop_placing()
        workers[2].process.wait(30)
        replay = rebuild_digest(bootstrap, topic, replay_dir)
        times = wait_digest(samplers, replay, timeout=120)
        time.sleep(0.5)
        traffic.stop()
        live = {Client(port, 60).call("GET", "/v1/state?limit=0")[1]["digest"] for port in survivors}
        found = sum(found_on(port, traffic.acked) for port in survivors)
    finally:
        traffic.stop()
        for sampler in samplers:
            sampler.stop()
    taken = None if None in times else max(t for t in times if t is not None)
    steps = [takeover_phases(path, start, killed_at) for path, start in zip(logs, logged, strict=True)]
    later = {name: max(step[name] for step in steps) for name, _, _ in PHASES
             if all(name in step for step in steps)}
    return taken, {"acked": len(traffic.acked), "found": found,
                   "answered": traffic.matches_ok, "errors": len(traffic.match_errors),
                   "equal": int(live == {replay})}, later


def main(argv: list[str] | None = None) -> None:
    """``python -m stream.bench.scale [--events N] [--cycles N] [--bootstrap-servers B]``."""
    parser = argparse.ArgumentParser(prog="python -m stream.bench.scale",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=600_000)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--rate", type=float, default=500, help="paced match load, req/s")
    parser.add_argument("--keep", type=Path, help="keep the data dirs and logs under this dir")
    parser.add_argument("--bootstrap-servers", help="a cluster instead of an embedded broker")
    args = parser.parse_args(argv)
    _print_figures(args.bootstrap_servers, lambda b: scale_figures(
        b, args.events, args.cycles, args.rate, keep=args.keep))


if __name__ == "__main__":
    main()
