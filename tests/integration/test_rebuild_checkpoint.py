"""`rebuild` from what is kept: on a broker whose event topic lost its oldest events
(retention; the offsets of the rest kept) and whose changelog is compacted, the
changelog's checkpoint plus the events after it give the live digest, and the rebuilt
dir is one `serve` takes over.

Tansu has no DeleteRecords and never compacts, so the trimmed copy of a live service's
log is written to a fresh broker as raw record batches whose offset deltas leave the
gaps (``stream.kafka.batches``): Tansu keeps them. The embedded default gives its broker
such a log itself after a restart (``stream.kafka.log_cleaner``)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from stream.kafka.batches import RawPartitionWriter
from stream.kafka.embedded import EmbeddedBroker
from stream.kafka.tansu import apply_remedies, is_tansu
from stream.kafka.topics import CHANGELOG_TOPIC_CONFIG, changelog_topic, ensure_topic
from stream.state.store import APPLIED_KEY, decode_applied
from tests.integration.conftest import Service, eventually, http
from tests.integration.test_log_compaction import Serve, serves  # noqa: F401 - a fixture

pytestmark = pytest.mark.integration

CAPACITY = ["--cache-size-mb-per-server", "6"]  # 3 entries an endpoint: evictions
PARTITIONS = 2


@dataclass(frozen=True)
class Kept:
    """One record as the broker holds it."""

    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]


async def _read_all(bootstrap: str, topic: str) -> dict[int, list[Kept]]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        out: dict[int, list[Kept]] = {tp.partition: [] for tp in tps}
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for tp, records in (await consumer.getmany(timeout_ms=200)).items():
                out[tp.partition] += [Kept(r.offset, r.timestamp, r.key, r.value,
                                           tuple(r.headers or ())) for r in records
                                      if r.offset < ends[tp]]
        return out
    finally:
        await consumer.stop()


def compacted(records: list[Kept]) -> list[Kept]:
    """Kafka's compaction: the latest record of each key, in log order, at its offset."""
    last = {r.key: r.offset for r in records}
    return [r for r in records if last[r.key] == r.offset]


def _iso(timestamp_ms: int) -> str:
    return datetime.fromtimestamp(timestamp_ms / 1000, UTC).isoformat(timespec="milliseconds")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stream.cli", *args], capture_output=True,
                          text=True, timeout=180)


def _rebuild(bootstrap: str, target: Path, *extra: str) -> str:
    done = _cli("rebuild", "--bootstrap-servers", bootstrap, "--data-dir", str(target), *CAPACITY,
                *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _traffic(url: str) -> None:
    """Placements with evictions, engine reports (stored, removed, cleared), deletions and
    syncs, one request at a time (each its own batch: one applied record an event)."""
    def post(path: str, body: object) -> int:
        return int(http("POST", url + path, body)[0])

    pods = [f"ns/kept-{i}" for i in range(6)]
    for round_ in range(6):
        for i, pod in enumerate(pods):
            items = [{"hash": f"r{round_}-{i}-{j}", "size": 1, "modality": "image"}
                     for j in range(2)] + [{"hash": f"shared-{(i + round_) % 4}", "size": 1,
                                            "modality": "image"}]
            assert post("/v1/placements", {"endpoints": [pod], "items": items}) == 202
            stored = [{"hash": f"e{round_}-{i}", "size": 2 + i, "modality": "image"}]
            events = [{"type": "stored", "items": stored}]
            if round_ % 2:
                events.append({"type": "removed", "hashes": [f"e{round_ - 1}-{i}"]})
            if round_ == 3 and i == 2:
                events = [{"type": "cleared"}]
            assert post("/v1/engine-events", {"endpoint": pod, "engine": "vllm",
                                              "events": events}) == 202
        if round_ == 2:
            assert post("/v1/endpoint-events", {"type": "deleted", "endpoint": pods[round_]}) == 202
        if round_ == 4:
            assert post("/v1/endpoint-events", {"type": "sync", "live": pods[:5]}) == 202


def _settled_digest(service: Service) -> str:
    def settled() -> str | None:
        state = service.get("/v1/state?limit=0")[1]
        return state["digest"] if state.get("digest_settled", True) else None

    return eventually(settled, timeout=30)


def _applied_all(bootstrap: str, topic: str, changelog: str
                 ) -> tuple[dict[int, list[Kept]], dict[int, list[Kept]]] | None:
    """The event topic and the changelog once the changelog's applied records reach the
    last event of every partition (the view applies an event before its records are
    written), else None."""
    events = asyncio.run(_read_all(bootstrap, topic))
    written = asyncio.run(_read_all(bootstrap, changelog))
    for partition, records in events.items():
        applied = [decode_applied(r.value) for r in written.get(partition, []) if r.key == APPLIED_KEY]
        if records and max(applied, default=-1) < records[-1].offset:
            return None
    return events, written


def _trim(events: dict[int, list[Kept]], changelog: dict[int, list[Kept]]
          ) -> tuple[dict[int, list[Kept]], dict[int, list[Kept]], dict[int, int]]:
    """What a retention and a compaction leave, per partition: the changelog up to the
    applied record of an event in the middle (compacted), the first records of the next
    event (written in part), and the events from two before that checkpoint on."""
    kept_events, kept_changelog, checkpoints = {}, {}, {}
    for partition, records in changelog.items():
        applied = [at for at, r in enumerate(records) if r.key == APPLIED_KEY]
        assert len(applied) >= 6, f"partition {partition}: too few events to trim"
        at = applied[len(applied) // 2]
        checkpoint = decode_applied(records[at].value)
        tail = records[at + 1:applied[applied.index(at) + 1]][:2]
        kept_changelog[partition] = compacted(records[:at + 1]) + tail
        checkpoints[partition] = checkpoint
        first = max(1, checkpoint - 1)
        kept_events[partition] = [r for r in events[partition] if r.offset >= first]
        assert kept_events[partition][0].offset > 0
        assert any(r.offset > checkpoint for r in kept_events[partition])
        assert len(kept_changelog[partition]) < at + 1  # compaction dropped something
    return kept_events, kept_changelog, checkpoints


def test_rebuild_from_a_trimmed_log_and_a_compacted_changelog_gives_the_live_digest(
        bootstrap, make_service, tmp_path):
    if asyncio.run(is_tansu(bootstrap)):
        apply_remedies()  # end offsets from a fetch, for this process's clients on Tansu
    live = make_service(extra=[*CAPACITY, "--partitions", str(PARTITIONS)])
    _traffic(live.url)
    topic, changelog = f"{live.app_id}-events", changelog_topic(live.app_id)
    events, written = eventually(lambda: _applied_all(live.bootstrap, topic, changelog), timeout=60)
    digest = _settled_digest(live)
    # the whole log, started from the changelog's checkpoint where it has one
    assert _rebuild(live.bootstrap, tmp_path / "whole", "--app-id", live.app_id,
                    "--from-checkpoint") == digest
    live.stop(signal.SIGKILL)  # done with: not left polling the session's broker
    kept_events, kept_changelog, checkpoints = _trim(events, written)

    with EmbeddedBroker(log_file=tmp_path / "kept-broker.log") as broker:
        bootstrap = broker.bootstrap_servers
        apply_remedies()  # this broker is Tansu whatever the session's is

        async def copy() -> None:
            await ensure_topic(bootstrap, topic, PARTITIONS, {})
            await ensure_topic(bootstrap, changelog, PARTITIONS, CHANGELOG_TOPIC_CONFIG)
            async with RawPartitionWriter(bootstrap) as writer:
                for partition in range(PARTITIONS):
                    await writer.write(topic, partition, kept_events[partition])
                    await writer.write(changelog, partition, kept_changelog[partition])

        asyncio.run(copy())
        assert asyncio.run(_read_all(bootstrap, topic)) == kept_events  # offsets preserved

        assert _rebuild(bootstrap, tmp_path / "kept", "--app-id", live.app_id) == digest

        # an --until before a checkpoint is refused, naming the oldest point; nothing written
        oldest = max(checkpoints.values())
        refused = _cli("rebuild", "--bootstrap-servers", bootstrap, "--app-id", live.app_id,
                       "--data-dir", str(tmp_path / "past"), *CAPACITY, "--until", str(oldest - 1))
        assert refused.returncode != 0
        assert refused.stderr.strip().splitlines()[-1].endswith(
            f"the oldest point rebuildable from what is kept is --until {oldest}"), refused.stderr
        assert not (tmp_path / "past").exists()
        assert _rebuild(bootstrap, tmp_path / "at-oldest", "--app-id", live.app_id,
                        "--until", str(oldest))
        # and by time: the latest kept event at or below a checkpoint is the oldest point
        latest = max(r.timestamp_ms for p, kept in kept_events.items() for r in kept
                     if r.offset <= checkpoints[p])
        refused = _cli("rebuild", "--bootstrap-servers", bootstrap, "--app-id", live.app_id,
                       "--data-dir", str(tmp_path / "past"), *CAPACITY, "--until", _iso(latest - 1))
        assert refused.returncode != 0
        assert refused.stderr.strip().splitlines()[-1].endswith(
            f"the oldest point rebuildable from what is kept is --until {_iso(latest)}"), refused.stderr
        assert not (tmp_path / "past").exists()

        # seeded into a new app id on that broker, serve takes it over and goes on
        new_app = f"it-{uuid.uuid4().hex[:10]}"
        seeded = tmp_path / "seeded"
        assert _rebuild(bootstrap, seeded, "--app-id", new_app, "--topic", topic,
                        "--checkpoint-topic", changelog) == digest
        new = Service(bootstrap, seeded, new_app, [*CAPACITY, "--topic", topic], {})
        try:
            new.start()
            assert _settled_digest(new) == digest
            items = [{"hash": "after-takeover", "size": 1, "modality": "image"}]
            assert new.post("/v1/placements", {"endpoints": ["ns/kept-0"], "items": items})[0] == 202
            eventually(lambda: _settled_digest(new) != digest)  # applied after the seeded state
        finally:
            if new.process is not None:
                new.stop(signal.SIGKILL)



def _caught_up_digest(service: Serve) -> str:
    """The digest once the view holds every event of the embedded broker's log."""
    bootstrap = service.bootstrap()
    apply_remedies()  # the embedded broker is Tansu
    eventually(lambda: _applied_all(bootstrap, "mmcache-events", "mmcache-lru-changelog"),
               timeout=60)
    return service.settled_digest()


def test_rebuild_of_the_embedded_default_after_a_restart_gives_the_live_digest(serves, tmp_path):  # noqa: F811
    """A restart gives the embedded broker the compacted changelog and only the events
    after the state's applied offset (``stream.kafka.log_cleaner``): `rebuild` against it
    starts each partition from the changelog's checkpoint and gives the live digest."""
    data = tmp_path / "data"
    first = serves(data, *CAPACITY)
    _traffic(first.url)
    _caught_up_digest(first)
    assert first.stop(signal.SIGTERM) == 0
    again = serves(data, *CAPACITY)
    for i in range(6):  # events after the restart, on top of the checkpoint
        items = [{"hash": f"late-{i}", "size": 1, "modality": "image"}]
        assert http("POST", again.url + "/v1/placements",
                    {"endpoints": [f"ns/kept-{i}"], "items": items})[0] == 202
    assert http("POST", again.url + "/v1/endpoint-events",
                {"type": "deleted", "endpoint": "ns/kept-1"})[0] == 202
    digest = _caught_up_digest(again)
    bootstrap = again.bootstrap()
    events = asyncio.run(_read_all(bootstrap, "mmcache-events"))
    assert any(records and records[0].offset > 0 for records in events.values())  # trimmed

    assert _rebuild(bootstrap, tmp_path / "rebuilt") == digest
