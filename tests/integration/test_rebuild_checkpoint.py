"""`rebuild` from what is kept: on a broker whose event topic lost its oldest events
(retention; the offsets of the rest kept) and whose changelog is compacted, the
changelog's checkpoint plus the events after it give the live digest, and the rebuilt
dir is one `serve` takes over.

Tansu has no DeleteRecords and never compacts, so the trimmed copy of a live service's
log is written to a fresh broker as raw record batches whose offset deltas leave the
gaps: Tansu keeps the deltas (base offset = its high watermark)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.structs import TopicPartition

from stream.kafka.embedded import EmbeddedBroker
from stream.kafka.tansu import apply_remedies, is_tansu
from stream.kafka.topics import CHANGELOG_TOPIC_CONFIG, changelog_topic, ensure_topic
from stream.state.store import APPLIED_KEY, decode_applied
from tests.integration.conftest import Service, eventually

pytestmark = pytest.mark.integration

CAPACITY = ["--cache-size-mb-per-server", "6"]  # 3 entries an endpoint: evictions
PARTITIONS = 2


@dataclass(frozen=True)
class Kept:
    """One record as the broker holds it."""

    offset: int
    timestamp: int
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


async def _produce_at_offsets(bootstrap: str, topic: str, records: dict[int, list[Kept]]) -> None:
    """Write each partition's records to an empty partition at their own offsets: one
    raw batch whose offset deltas are the offsets (Tansu gives it base offset 0, its high
    watermark, and keeps the deltas)."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        await client.force_metadata_update()
        for partition, kept in records.items():
            if not kept:
                continue
            batch = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=0,
                                              producer_id=-1, producer_epoch=-1,
                                              base_sequence=-1, batch_size=1 << 24)
            for record in kept:
                assert batch.append(record.offset, record.timestamp, record.key, record.value,
                                    list(record.headers)) is not None
            node = client.cluster.leader_for_partition(TopicPartition(topic, partition))
            answer = await client.send(node, ProduceRequest(
                None, -1, 5000, [(topic, [(partition, bytes(batch.build()))])]))
            (_, [(_, error, base, *_)]), = answer.topics
            assert (error, base) == (0, 0), answer
    finally:
        await client.close()


def compacted(records: list[Kept]) -> list[Kept]:
    """Kafka's compaction: the latest record of each key, in log order, at its offset."""
    last = {r.key: r.offset for r in records}
    return [r for r in records if last[r.key] == r.offset]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stream.cli", *args], capture_output=True,
                          text=True, timeout=180)


def _rebuild(bootstrap: str, target: Path, *extra: str) -> str:
    done = _cli("rebuild", "--bootstrap-servers", bootstrap, "--data-dir", str(target), *CAPACITY,
                *extra)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _traffic(service: Service) -> None:
    """Placements with evictions, engine reports (stored, removed, cleared), deletions and
    syncs, one request at a time (each its own batch: one applied record an event)."""
    pods = [f"ns/kept-{i}" for i in range(6)]
    for round_ in range(6):
        for i, pod in enumerate(pods):
            items = [{"hash": f"r{round_}-{i}-{j}", "size": 1, "modality": "image"}
                     for j in range(2)] + [{"hash": f"shared-{(i + round_) % 4}", "size": 1,
                                            "modality": "image"}]
            assert service.post("/v1/placements", {"endpoints": [pod], "items": items})[0] == 202
            stored = [{"hash": f"e{round_}-{i}", "size": 2 + i, "modality": "image"}]
            events = [{"type": "stored", "items": stored}]
            if round_ % 2:
                events.append({"type": "removed", "hashes": [f"e{round_ - 1}-{i}"]})
            if round_ == 3 and i == 2:
                events = [{"type": "cleared"}]
            assert service.post("/v1/engine-events", {"endpoint": pod, "engine": "vllm",
                                                      "events": events})[0] == 202
        if round_ == 2:
            assert service.post("/v1/endpoint-events",
                                {"type": "deleted", "endpoint": pods[round_]})[0] == 202
        if round_ == 4:
            assert service.post("/v1/endpoint-events",
                                {"type": "sync", "live": pods[:5]})[0] == 202


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
    _traffic(live)
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
            await _produce_at_offsets(bootstrap, topic, kept_events)
            await _produce_at_offsets(bootstrap, changelog, kept_changelog)

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
