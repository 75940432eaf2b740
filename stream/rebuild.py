"""Offline rebuild: replay the event topic from its first offset into a new data dir.

No consumer group and no changelog writes while replaying: a plain consumer reads
every partition up to the end offsets seen at the start (or ``until``), the pure fold
builds the state in memory, and the final entries are written to RocksDB in write
batches, with each partition's applied offset. The result is the same ``CacheState``
the live worker holds for the same log, so the digests are equal.

A rebuilt dir is marked ``SEED``: the first ``serve`` on it writes its entries to the
(new, empty) changelog and commits the recorded offsets for its consumer group, then
resumes from there.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass
from datetime import datetime

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import OffsetAndMetadata, TopicPartition
from rocksdict import WriteBatch

from stream.codec import MalformedEvent, decode_event
from stream.config import Settings
from stream.core.cache import CacheState
from stream.core.events import Position
from stream.datadir import TABLE_NAME, DataDir, StateMismatch
from stream.kafka.tansu import apply_remedies, is_tansu
from stream.kafka.topics import CHANGELOG_TOPIC_CONFIG, ensure_topic
from stream.store import APPLIED_KEY, decode_applied, encode_applied, encode_entry, entry_key

__all__ = ["Until", "rebuild", "seed_deployment"]

log = logging.getLogger(__name__)

WRITE_BATCH = 10_000
FETCH_RECORDS = 20_000


@dataclass(frozen=True)
class Until:
    """Where a replay stops: an offset (in every partition) or a record timestamp."""

    offset: int | None = None
    timestamp_ms: int | None = None

    @classmethod
    def parse(cls, text: str | None) -> Until:
        """An integer is an offset; anything else an ISO-8601 time (UTC if no zone)."""
        if text is None:
            return cls()
        if text.isdigit():
            return cls(offset=int(text))
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=datetime.now().astimezone().tzinfo)
        return cls(timestamp_ms=int(moment.timestamp() * 1000))

    def stops_before(self, offset: int, timestamp_ms: int) -> bool:
        """Whether a record lies past the point to rebuild."""
        if self.offset is not None and offset > self.offset:
            return True
        return self.timestamp_ms is not None and timestamp_ms > self.timestamp_ms


class Progress:
    """A progress bar on a terminal, plain lines every few seconds otherwise."""

    def __init__(self, total: int, every_s: float = 5.0) -> None:
        self.total = max(total, 1)
        self.every_s = every_s
        self.tty = sys.stderr.isatty()
        self.started = self._last = time.monotonic()

    def update(self, done: int, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < (0.2 if self.tty else self.every_s):
            return
        self._last = now
        rate = done / max(now - self.started, 1e-9)
        share = min(done / self.total, 1.0)
        if self.tty:
            bar = "#" * int(share * 30)
            sys.stderr.write(f"\rreplaying [{bar:<30}] {done}/{self.total} {rate:,.0f} ev/s")
            if final:
                sys.stderr.write("\n")
            sys.stderr.flush()
        else:
            log.info("replayed %d of %d events (%.0f%%, %.0f events/s)",
                     done, self.total, share * 100, rate)


async def replay(bootstrap_servers: str, topic: str, state: CacheState,
                 until: Until = Until()) -> dict[str, int]:
    """Fold the topic into ``state``; return counts of events, malformed records, partitions."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=8 * 1024 * 1024,
        fetch_max_bytes=64 * 1024 * 1024,
    )
    await consumer.start()
    counts = {"events": 0, "malformed": 0, "partitions": 0}
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        if not partitions:
            raise StateMismatch(f"topic {topic} not found on {bootstrap_servers}")
        counts["partitions"] = len(partitions)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        starts = await consumer.beginning_offsets(tps)
        remaining = {tp for tp in tps if ends[tp] > starts[tp]}
        progress = Progress(sum(ends[tp] - starts[tp] for tp in tps))
        done = 0
        while remaining:
            batches = await consumer.getmany(*remaining, timeout_ms=200, max_records=FETCH_RECORDS)
            for tp, records in batches.items():
                for record in records:
                    if record.offset >= ends[tp] or until.stops_before(record.offset, record.timestamp):
                        remaining.discard(tp)
                        break
                    done += 1
                    position = Position(tp.partition, record.offset)
                    try:
                        event = decode_event(record.value)
                    except MalformedEvent as exc:
                        state.advance(position)
                        counts["malformed"] += 1
                        log.warning("skipped malformed record at partition %d offset %d: %s",
                                    tp.partition, record.offset, exc)
                        continue
                    state.apply(event, position)
                    counts["events"] += 1
                if tp in remaining and records and records[-1].offset >= ends[tp] - 1:
                    remaining.discard(tp)
            progress.update(done)
        progress.update(done, final=True)
    finally:
        await consumer.stop()
    return counts


def write_state(datadir: DataDir, state: CacheState, partitions: int) -> None:
    """Write the state's entries and applied offsets to RocksDB, in write batches."""
    dbs = {p: datadir.open_partition(p) for p in range(partitions)}
    try:
        batches = {p: WriteBatch(raw_mode=True) for p in dbs}
        pending = 0
        for partition, entry in state.entries():
            batches[partition].put(entry_key(entry.endpoint, entry.hash), encode_entry(entry))
            pending += 1
            if pending >= WRITE_BATCH:
                for p, batch in batches.items():
                    dbs[p].write(batch)
                batches = {p: WriteBatch(raw_mode=True) for p in dbs}
                pending = 0
        for partition, offset in state.applied.items():
            batches[partition].put(APPLIED_KEY, encode_applied(offset))
        for p, batch in batches.items():
            dbs[p].write(batch)
    finally:
        for db in dbs.values():
            db.close()


async def rebuild(settings: Settings, until: Until = Until()) -> CacheState:
    """Replay ``settings.events_topic`` into a new ``settings.data_dir``; return the state."""
    datadir = DataDir(settings.data_dir)
    if datadir.root.exists() and any(datadir.root.iterdir()):
        raise StateMismatch(f"{datadir.root} is not empty: rebuild writes a new data dir")
    bootstrap = settings.bootstrap_servers or ""
    if await is_tansu(bootstrap):
        apply_remedies()
    state = CacheState(settings.capacity)
    started = time.monotonic()
    counts = await replay(bootstrap, settings.events_topic, state, until)
    elapsed = time.monotonic() - started
    log.info("replayed %d events (%d malformed skipped) in %.2f s: %.0f events/s",
             counts["events"], counts["malformed"], elapsed,
             (counts["events"] + counts["malformed"]) / max(elapsed, 1e-9))
    datadir.check(DataDir.identity(settings.app_id, settings.events_topic, settings.capacity))
    write_state(datadir, state, counts["partitions"])
    datadir.seed.touch()
    return state


async def seed_deployment(bootstrap: str, datadir: DataDir, app_id: str, topic: str) -> None:
    """Publish a rebuilt state to the app's (empty) changelog and commit its offsets.

    Afterwards the dir is an ordinary worker dir: the changelog can restore it, and
    the consumer group resumes right after the last replayed event.
    """
    changelog = f"{app_id}-{TABLE_NAME}-changelog"
    partitions = len(datadir.partitions())
    await ensure_topic(bootstrap, changelog, partitions, CHANGELOG_TOPIC_CONFIG)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=app_id,
                                enable_auto_commit=False)
    await producer.start()
    await consumer.start()
    try:
        existing = consumer.partitions_for_topic(changelog)
        if existing:
            tps = [TopicPartition(changelog, p) for p in existing]
            ends = await consumer.end_offsets(tps)
            if any(ends.values()):
                raise StateMismatch(
                    f"changelog {changelog} already holds records: seed a rebuilt state "
                    "into a new --app-id"
                )
        commits: dict[TopicPartition, OffsetAndMetadata] = {}
        acks = []
        for partition in datadir.partitions():
            db = datadir.open_partition(partition, read_only=True)
            try:
                for key, value in db.items():
                    acks.append(await producer.send(changelog, value, key=key, partition=partition))
                    if key == APPLIED_KEY:
                        commits[TopicPartition(topic, partition)] = OffsetAndMetadata(
                            decode_applied(value) + 1, ""
                        )
            finally:
                db.close()
        await asyncio.gather(*acks)
        if commits:
            consumer.assign(list(commits))
            await consumer.commit(commits)
    finally:
        await consumer.stop()
        await producer.stop()
    datadir.seed.unlink()
    log.info("seeded changelog %s with the rebuilt state; resuming %s at %s", changelog, topic,
             {tp.partition: o.offset for tp, o in sorted(commits.items())})
