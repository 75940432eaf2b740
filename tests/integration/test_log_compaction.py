"""The embedded default bounds its kept log (stream.kafka.log_cleaner): each start compacts
the changelog and applies the retention, the new broker gets the log back at its own
offsets (gaps and all), the port answers probes from the start, and a kill -9 at any
point of that loses nothing."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from stream.core.admission import fold_record
from stream.core.cache import CacheState
from stream.core.engine import ENGINE_VIEW_ENTRIES
from stream.core.lru import Capacity, Entry
from stream.core.routing import key_partition
from stream.kafka.batches import RawPartitionWriter
from stream.kafka.embedded import EmbeddedBroker
from stream.kafka.embedded_log import EmbeddedLog, LogRecord, encode_frame
from stream.kafka.log_cleaner import scan
from stream.kafka.tansu import apply_remedies
from stream.kafka.topics import ensure_topic
from stream.state.store import applied_at, encode_applied, encode_entry, entry_key
from tests.integration.conftest import READY_TIMEOUT_S, eventually, http
from tests.integration.test_embedded_log import EmbeddedServe as Serve
from tests.integration.test_embedded_log import serves  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration

PARTITIONS = 8  # serve's default


async def _written_and_read(bootstrap: str, offsets: list[int]) -> tuple[list[int], int]:
    await ensure_topic(bootstrap, "gaps", 1, {})
    records = [LogRecord(o, 1_700_000_000_000 + o, 0, b"k", str(o).encode()) for o in offsets]
    async with RawPartitionWriter(bootstrap) as writer:
        await writer.write("gaps", 0, records[:2])
        await writer.write("gaps", 0, records[2:])
        with pytest.raises(ValueError, match="below the partition's end"):
            await writer.write("gaps", 0, records[:1])
    apply_remedies()  # the end offset from a fetch (Tansu's ListOffsets is wrong)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                auto_offset_reset="earliest")
    await consumer.start()
    try:
        tp = TopicPartition("gaps", 0)
        consumer.assign([tp])
        read: list[int] = []
        async with asyncio.timeout(15):
            while len(read) < len(offsets):
                for batch in (await consumer.getmany(timeout_ms=200)).values():
                    read += [r.offset for r in batch if r.value == str(r.offset).encode()]
        return read, (await consumer.end_offsets([tp]))[tp]
    finally:
        await consumer.stop()


def test_the_broker_keeps_each_record_at_its_own_offset_gaps_and_all():
    """What giving a compacted log back relies on (Tansu 0.6.0 keeps a batch's offset deltas)."""
    offsets = [5, 9, 10, 1000, 1003]
    with EmbeddedBroker() as broker:
        read, end = asyncio.run(_written_and_read(broker.bootstrap_servers, offsets))
    assert read == offsets
    assert end == 1004


def _place(service: Serve, endpoint: str, digest: str) -> None:
    body = {"request_id": digest, "endpoints": [endpoint],
            "items": [{"hash": digest, "size": 1, "modality": "image"}]}
    assert http("POST", service.url + "/v1/placements", body)[0] == 202


def _held(service: Serve, endpoint: str, hashes: list[str]) -> list[str]:
    body = {"endpoints": [endpoint], "body": {"generate": {"features": {"mm_hashes": {"image": hashes}}}}}
    status, answer = http("POST", service.url + "/v1/match", body)
    assert status == 200, answer
    return [item["hash"] for item in answer["endpoints"][0]["matched_items"]]


def _metrics(service: Serve) -> dict[str, float]:
    """The unlabelled samples of /metrics (documented in docs/metrics.md)."""
    import urllib.request

    with urllib.request.urlopen(service.url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {name: float(value) for name, value in
            re.findall(r"^([a-z_]+) ([0-9.e+-]+)$", text, re.MULTILINE)}


class _Writers:
    """Threads placing one item at a time, each on endpoints of its own (so an endpoint's
    writes are in the log in the order they were acknowledged); every 202 is remembered,
    and any answer but 202 and 503 (not acknowledged) too."""

    def __init__(self, service: Serve, endpoint: Callable[[int, int], str], threads: int = 3) -> None:
        self.service = service
        self.endpoint = endpoint
        self.acknowledged: list[tuple[str, str]] = []
        self.unexpected: list[int] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._place, args=(w,)) for w in range(threads)]

    def __enter__(self) -> _Writers:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def _place(self, worker: int) -> None:
        n = 0
        while not self.stop.is_set():
            endpoint, digest = self.endpoint(worker, n), f"w{worker}-{n}"
            body = {"request_id": digest, "endpoints": [endpoint],
                    "items": [{"hash": digest, "size": 1, "modality": "image"}]}
            try:
                status = http("POST", self.service.url + "/v1/placements", body)[0]
            except OSError:
                return  # killed
            if status == 202:
                self.acknowledged.append((endpoint, digest))
            elif status != 503:
                self.unexpected.append(status)
            n += 1

    def by_endpoint(self) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for endpoint, digest in self.acknowledged:
            found.setdefault(endpoint, []).append(digest)
        return found


def test_a_kill_9_during_a_rebase_loses_no_acknowledged_write(serves, tmp_path):  # noqa: F811
    """Killed while a rebase holds writes (its broker stopped, its log being compacted or
    given back): every write answered 202 is there after the next start."""
    data = tmp_path / "data"
    service = serves(data, env={"MMCACHE_EMBEDDED_REBASE_BYTES": "30000"})
    with _Writers(service, lambda worker, n: f"ns/kill-{worker}-{n // 500}") as writers:
        eventually(lambda: _metrics(service).get("mmcache_embedded_rebase_in_progress") == 1,
                   timeout=120, interval=0.01)
        service.stop(signal.SIGKILL)
    again = serves(data)
    by_endpoint = writers.by_endpoint()
    # each endpoint got at most 500 placements: none evicted
    assert all(len(hashes) < 1024 for hashes in by_endpoint.values()) and not writers.unexpected
    eventually(lambda: all(sorted(_held(again, e, h)) == sorted(h) for e, h in by_endpoint.items()),
               timeout=READY_TIMEOUT_S)


def _replayed_digest(data: Path, capacity_mb: int | None = None) -> str:
    """The digest of the kept event log folded offline by the pure core: what the live
    state must be once it applied every acknowledged event (all still kept)."""
    state = CacheState(Capacity.from_params(capacity_mb), ENGINE_VIEW_ENTRIES)
    kept = EmbeddedLog(data / "v1" / "log")
    for partition in range(PARTITIONS):
        for record in kept.records("mmcache-events", partition):
            fold_record(state, partition, record.offset, record.key, record.value, PARTITIONS)
    return state.digests.digest()


def _records(log: EmbeddedLog, topic: str) -> int:
    return sum(len(log.records(topic, p)) for p in range(PARTITIONS))


def test_a_restart_compacts_the_changelog_and_keeps_every_entry_and_the_state(serves, tmp_path):  # noqa: F811
    data = tmp_path / "data"
    small = ("--cache-size-mb-per-server", "20")  # 10 entries an endpoint: evictions, tombstones
    first = serves(data, *small)
    endpoints = [f"ns/pod-{i}" for i in range(6)]
    for round_ in range(5):  # the same items placed again and again: superseded records
        for e, endpoint in enumerate(endpoints):
            for i in range(14):
                _place(first, endpoint, f"h-{e}-{(i + round_ * 3) % 20}")
    assert first.stop(signal.SIGTERM) == 0
    kept = EmbeddedLog(data / "v1" / "log")
    written = _records(kept, "mmcache-lru-changelog")
    events = _records(kept, "mmcache-events")
    digest = _replayed_digest(data, 20)

    again = serves(data, *small)
    assert "embedded broker's log compacted" in again.log()
    eventually(lambda: again.settled_digest() == digest, timeout=READY_TIMEOUT_S)
    compacted = _records(kept, "mmcache-lru-changelog")
    # at most one record a key (6 x 10 entries, an applied record and a view key a partition)
    assert compacted < written and compacted <= 6 * 10 + 2 * PARTITIONS
    assert _records(kept, "mmcache-events") == events  # within the default retention
    last = {endpoint: [f"h-{e}-{(i + 12) % 20}" for i in range(4, 14)] for e, endpoint in enumerate(endpoints)}
    for endpoint, hashes in last.items():
        assert sorted(_held(again, endpoint, hashes)) == sorted(hashes)
    # a write after the restart lands after the kept offsets, and a kill keeps it too
    _place(again, endpoints[0], "h-after")
    eventually(lambda: _held(again, endpoints[0], ["h-after"]) == ["h-after"], timeout=READY_TIMEOUT_S)
    again.stop(signal.SIGKILL)
    after = _replayed_digest(data, 20)
    third = serves(data, *small)
    eventually(lambda: third.settled_digest() == after, timeout=READY_TIMEOUT_S)


def test_retention_drops_old_events_from_disk_and_the_state_stays(serves, tmp_path):  # noqa: F811
    data = tmp_path / "data"
    first = serves(data)
    for i in range(200):
        _place(first, f"ns/pod-{i % 4}", f"h-{i}")
    assert first.stop(signal.SIGTERM) == 0
    kept = EmbeddedLog(data / "v1" / "log")
    assert _records(kept, "mmcache-events") == 200
    digest = _replayed_digest(data)

    # a retention of one byte keeps the last event of each partition (its end offset)
    again = serves(data, env={"MMCACHE_EMBEDDED_RETENTION_BYTES": "1"})
    eventually(lambda: again.settled_digest() == digest, timeout=READY_TIMEOUT_S)
    written = [p for p in range(PARTITIONS) if kept.records("mmcache-events", p)]
    assert _records(kept, "mmcache-events") == len(written)
    for i in range(4):
        hashes = [f"h-{n}" for n in range(i, 200, 4)]
        assert sorted(_held(again, f"ns/pod-{i}", hashes)) == sorted(hashes)


def _synthetic_history(data: Path, entries_per_partition: int) -> None:
    """Append to a stopped serve's kept changelog two versions of each of many entries
    and an applied record per partition: a history that takes a while to compact and to
    give back, valid for the state's readers."""
    log = EmbeddedLog(data / "v1" / "log")
    for partition in range(PARTITIONS):
        with open(log.partition_path("mmcache-events", partition), "rb") as handle:
            events = scan(handle.read())[0]
        applied = events[-1].offset if events else -1
        path = log.partition_path("mmcache-lru-changelog", partition)
        frames = scan(path.read_bytes())[0]
        offset = frames[-1].offset + 1 if frames else 0
        endpoints, e = [], 0
        while len(endpoints) < 200:  # endpoints routed to this partition
            name = f"ns/synthetic-{e}"
            if key_partition(name.encode(), PARTITIONS) == partition:
                endpoints.append(name)
            e += 1
        chunk = []
        for version in range(2):
            for i in range(entries_per_partition):
                endpoint = endpoints[i % len(endpoints)]
                key = entry_key(endpoint, f"s{partition}-{i}")
                chunk.append(encode_frame(LogRecord(offset, 1_700_000_000_000, 0, key, encode_entry(
                    Entry(endpoint, f"s{partition}-{i}", 1, max(applied, 0), i * 2 + version)))))
                offset += 1
        chunk.append(encode_frame(LogRecord(offset, 1_700_000_000_000, 0, b"\x02applied",
                                            encode_applied(applied))))
        assert applied_at(b"\x02applied", encode_applied(applied)) == applied
        with open(path, "ab") as handle:
            handle.write(b"".join(chunk))
    snapshot = data / "v1" / "view.snapshot"
    if snapshot.exists():
        snapshot.unlink()


def _history_dir(serves, tmp_path: Path, entries_per_partition: int) -> Path:  # noqa: F811
    data = tmp_path / "history"
    first = serves(data)
    for i in range(64):
        _place(first, f"ns/pod-{i}", f"h-{i}")
    assert first.stop(signal.SIGTERM) == 0
    _synthetic_history(data, entries_per_partition)
    return data


def test_the_port_answers_probes_from_the_start_and_readyz_says_why(serves, tmp_path):  # noqa: F811
    data = _history_dir(serves, tmp_path, 20_000)
    service = serves(data, wait=False)
    seen: list[tuple[int, int, str]] = []

    def answered() -> bool:
        assert service.process is not None and service.process.poll() is None, service.tail()
        health, ready = service.probe("/healthz"), service.probe("/readyz")
        if health is None or ready is None:
            return False
        seen.append((health[0], ready[0], ready[1].get("reason", "")))
        return ready[0] == 200

    eventually(answered, timeout=READY_TIMEOUT_S, interval=0.02)
    # before it was ready, the port answered: alive, not ready, and what it was doing
    waiting = [reason for health, ready, reason in seen if ready == 503]
    assert all(health == 200 for health, _, _ in seen)
    assert any("the embedded broker's" in reason for reason in waiting), seen  # compacting or restoring


@pytest.mark.parametrize("phase", ["compacting", "restoring"])
def test_a_kill_9_while_compacting_or_restoring_loses_nothing(serves, tmp_path, phase):  # noqa: F811
    data = _history_dir(serves, tmp_path, 20_000)
    control = tmp_path / "control"
    shutil.copytree(data, control)
    expected = serves(control)
    digest = expected.settled_digest()
    expected.stop(signal.SIGKILL)

    victim = serves(data, wait=False)

    def in_phase() -> bool:
        assert victim.process is not None and victim.process.poll() is None, victim.tail()
        ready = victim.probe("/readyz")
        return ready is not None and phase in ready[1].get("reason", "")

    eventually(in_phase, timeout=READY_TIMEOUT_S, interval=0.005)
    victim.stop(signal.SIGKILL)
    started = time.monotonic()
    again = serves(data)
    assert again.settled_digest() == digest, time.monotonic() - started


def test_the_broker_is_started_again_on_its_compacted_log_while_writes_go_on(serves, tmp_path):  # noqa: F811
    """A rebase (stream.kafka.rebase) under writes: each write is acknowledged (202) or
    refused (503, not acknowledged), none answered 202 is lost, through the rebases and a
    kill -9 after them."""
    data = tmp_path / "data"
    service = serves(data, "--cache-size-mb-per-server", "20",
                     env={"MMCACHE_EMBEDDED_REBASE_BYTES": "40000"})
    with _Writers(service, lambda worker, n: f"ns/rebase-{worker}-{n % 2}") as writers:
        eventually(lambda: service.log().count("started again on its compacted log") >= 2, timeout=120)
    assert not writers.unexpected
    # the last 10 acknowledged placements of each endpoint are what it holds
    expected = {endpoint: sorted(hashes[-10:]) for endpoint, hashes in writers.by_endpoint().items()}

    def held_all(target: Serve) -> bool:
        return all(sorted(_held(target, e, hashes)) == hashes for e, hashes in expected.items())

    eventually(lambda: held_all(service), timeout=READY_TIMEOUT_S)
    metrics = _metrics(service)
    assert metrics["mmcache_embedded_rebases_total"] >= 2
    assert metrics["mmcache_embedded_rebase_in_progress"] in (0, 1)
    assert 0 < metrics["mmcache_embedded_rebase_last_seconds"]
    assert 0 <= metrics["mmcache_embedded_log_appended_bytes"]
    service.stop(signal.SIGKILL)
    again = serves(data, "--cache-size-mb-per-server", "20")
    eventually(lambda: held_all(again), timeout=READY_TIMEOUT_S)
    # the kept events fold to the live state (the retention kept them all)
    digest = _replayed_digest(data, 20)
    eventually(lambda: again.settled_digest() == digest, timeout=READY_TIMEOUT_S)


def test_a_rebase_that_meets_a_damaged_log_says_so_in_readyz_and_is_not_tried_again(serves, tmp_path):  # noqa: F811
    """A record damaged in the middle of a kept file (not a kill's torn tail) while serve
    runs: the next rebase leaves the broker stopped; /readyz's reason is the one line naming
    the file, the byte and what to do; matches are answered, writes get 503; and damage
    not healing, nothing is tried again (the retry would come REBASE_RETRY_S later)."""
    from stream.kafka.embedded_log import mapped
    from stream.worker.app import REBASE_RETRY_S

    service = serves(tmp_path / "data", env={"MMCACHE_EMBEDDED_REBASE_BYTES": "20000"})
    early = [f"h-early-{i}" for i in range(5)]
    for digest in early:
        _place(service, "ns/pod-0", digest)
    root = tmp_path / "data" / "v1" / "log"
    path = next(p for p in sorted((root / "mmcache-events").glob("*.log")) if p.stat().st_size)
    with mapped(path) as data:
        frames, _ = scan(data)
    assert len(frames) >= 3
    with open(path, "r+b") as handle:  # the second record's last byte: its CRC no longer holds
        handle.seek(frames[1].end - 1)
        last = handle.read(1)
        handle.seek(frames[1].end - 1)
        handle.write(bytes([last[0] ^ 0xFF]))
    at = frames[1].start

    def reason() -> str:  # whatever the status: the view still answers /v1/match
        answer = service.probe("/readyz")
        return "" if answer is None else str(answer[1].get("reason", ""))

    for n in range(2000):  # until a rebase meets the damage
        body = {"request_id": f"later-{n}", "endpoints": [f"ns/pod-{1 + n % 7}"],
                "items": [{"hash": f"later-{n}", "size": 1, "modality": "image"}]}
        if http("POST", service.url + "/v1/placements", body)[0] == 503:
            break
    eventually(lambda: "is damaged" in reason(), timeout=READY_TIMEOUT_S, interval=0.2)
    said = reason()
    assert "\n" not in said and str(path) in said and f"byte {at}" in said, said
    assert "nothing is tried again" in said and f"truncate -s {at} {path}" in said, said
    assert sorted(_held(service, "ns/pod-0", early)) == sorted(early)  # matches answered
    body = {"request_id": "refused", "endpoints": ["ns/pod-0"],
            "items": [{"hash": "refused", "size": 1, "modality": "image"}]}
    assert http("POST", service.url + "/v1/placements", body)[0] == 503
    time.sleep(REBASE_RETRY_S + 5)  # past the first retry of a failed rebase
    assert "is damaged" in reason()
    tries = [line for line in service.log().splitlines() if "ERROR stream.worker.app" in line]
    assert len(tries) == 1 and "is damaged" in tries[0], tries  # one rebase, in one line
    assert _metrics(service).get("mmcache_embedded_rebases_total") == 0
