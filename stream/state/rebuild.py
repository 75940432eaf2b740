"""Offline rebuild: replay the event topic from its first offset into a new data dir.

When the topic no longer starts at offset 0 in a partition (retention trimmed its oldest
events; the offsets of the rest are kept), that partition starts from a checkpoint
instead: the state the app's changelog holds at its last applied offset A
(``stream.state.checkpoint``), then the events after A are folded as usual. That is exact
when A reaches the kept events (A >= the first kept offset - 1), and refused otherwise,
as is an ``until`` before A. ``from_checkpoint`` starts every partition that has a
checkpoint from it, trimmed or not (only the events after it are replayed).

No consumer group and no changelog writes while replaying: a plain consumer reads
every partition up to the end offsets seen at the start (or ``until``), the pure fold
builds the state in memory, and the final entries are written to RocksDB as one sorted
SST file per partition, with its applied offset. The result is the same ``CacheState``
the live worker holds for the same log, so the digests are equal.

A rebuilt dir is marked ``SEED``: the first ``serve`` on it writes its entries to the
(new, empty) changelog and commits the recorded offsets for its consumer group, then
resumes from there.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import OffsetAndMetadata, TopicPartition
from rocksdict import IngestExternalFileOptions, Options, SstFileWriter

from stream import event_loop
from stream.config import KafkaSecurity, Settings
from stream.core.admission import Rejected, fold_record
from stream.core.cache import CacheState, Capacity, combine_digests
from stream.kafka.clients import client_options
from stream.kafka.tansu import apply_remedies, cluster_id, is_tansu_id
from stream.kafka.topics import (
    CHANGELOG_TOPIC_CONFIG,
    changelog_topic,
    cluster_durability,
    ensure_topic,
)
from stream.state.checkpoint import CheckpointReader
from stream.state.datadir import DataDir, StateMismatch
from stream.state.store import (
    APPLIED_KEY,
    FAUST_OFFSET_KEY,
    decode_applied,
    encode_applied,
    endpoint_records,
    engine_records,
    load_partition,
)

__all__ = ["Extent", "NotRebuildable", "Until", "balanced_groups", "rebuild",
           "refuse_over_capacity", "resume_points", "seed_deployment", "seed_records"]

log = logging.getLogger(__name__)

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
            moment = moment.replace(tzinfo=UTC)
        return cls(timestamp_ms=int(moment.timestamp() * 1000))

    def stops_before(self, offset: int, timestamp_ms: int) -> bool:
        """Whether a record lies past the point to rebuild."""
        if self.offset is not None and offset > self.offset:
            return True
        return self.timestamp_ms is not None and timestamp_ms > self.timestamp_ms


def _iso(timestamp_ms: int) -> str:
    return datetime.fromtimestamp(timestamp_ms / 1000, UTC).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class Extent:
    """Where one partition's kept records lie: the offset of the first (``end`` when none
    is kept) and the end offset. Trimmed: records before the first were deleted (Kafka's
    retention keeps the offsets of the rest, so the first is then above 0)."""

    first: int
    end: int

    @property
    def trimmed(self) -> bool:
        """Whether the partition's oldest events are gone."""
        return self.first > 0


class NotRebuildable(SystemExit):
    """What is kept cannot give the state asked for; nothing was written."""


def resume_points(extents: dict[int, Extent], applied: dict[int, int], until: Until,
                  from_checkpoint: bool, changelog: str, topic: str,
                  kept_times: dict[int, int] | None = None) -> dict[int, int]:
    """The offset each partition's fold starts at: 0 from an empty state, or ``A + 1`` from
    the checkpoint at applied offset ``A`` (``applied``).

    A trimmed partition starts from its checkpoint, which must reach its first kept event
    (``A >= first - 1``) and lie at or before ``until``: an offset ``>= A``, a time at or
    after every kept record up to ``A`` (``kept_times``: the latest timestamp of the kept
    records at or below ``A``, absent when none is kept). Otherwise it is refused
    (``NotRebuildable``), naming the oldest point that can be rebuilt. A whole partition
    starts at 0, or from its checkpoint with ``from_checkpoint`` when the checkpoint
    lies at or before ``until``.
    """
    kept_times = kept_times or {}

    def before_until(partition: int) -> bool:
        if until.offset is not None and until.offset < applied[partition]:
            return False
        return until.timestamp_ms is None or kept_times.get(partition, -1) <= until.timestamp_ms

    starts: dict[int, int] = {}
    late: list[int] = []
    for partition, extent in sorted(extents.items()):
        if not extent.trimmed:
            usable = from_checkpoint and partition in applied and before_until(partition)
            starts[partition] = applied[partition] + 1 if usable else 0
            continue
        where = (f"partition {partition} of {topic} starts at offset {extent.first} (older "
                 "events were trimmed)")
        if partition not in applied:
            raise NotRebuildable(f"{where} and {changelog} holds no checkpoint of it: give the "
                                 "changelog of the service that consumed it with --checkpoint-topic")
        if applied[partition] < extent.first - 1:
            raise NotRebuildable(
                f"{where} but the checkpoint in {changelog} is the state after offset "
                f"{applied[partition]}: events {applied[partition] + 1}..{extent.first - 1} "
                "are gone, so the state cannot be rebuilt exactly")
        if not before_until(partition):
            late.append(partition)
        starts[partition] = applied[partition] + 1
    if late:
        if until.offset is not None and until.offset < max(applied[p] for p in late):
            oldest = max(applied[p] for p in extents if extents[p].trimmed)
            asked, point = str(until.offset), str(oldest)
        else:
            assert until.timestamp_ms is not None
            oldest = max(kept_times.get(p, -1) for p in extents if extents[p].trimmed)
            asked, point = _iso(until.timestamp_ms), _iso(oldest)
        raise NotRebuildable(
            f"--until {asked} lies before the checkpoint of partition {late[0]} in {changelog} "
            f"(the events before it were trimmed from {topic}): the oldest point rebuildable "
            f"from what is kept is --until {point}")
    return starts


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


async def replay(bootstrap_servers: str, topic: str, partitions: Sequence[int], state: CacheState,
                 until: Until = Until(), on_progress: Callable[[int], None] = lambda n: None,
                 *, topic_partitions: int | None = None, security: KafkaSecurity | None = None,
                 start_at: dict[int, int] | None = None) -> dict[str, int]:
    """Fold the given partitions of the topic (of ``topic_partitions`` partitions in all)
    into ``state``, from ``start_at`` (per partition; its first record where absent or 0)
    up to the end offsets seen at the start (or ``until``), by the live worker's rule
    (``stream.core.admission``); return counts of applied events and of skipped records,
    in all (``skipped``) and by reason.
    """
    start_at = start_at or {}
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        enable_auto_commit=False,
        max_partition_fetch_bytes=8 * 1024 * 1024,
        fetch_max_bytes=64 * 1024 * 1024,
        **client_options(security or KafkaSecurity()),
    )
    await consumer.start()
    counts = {"events": 0, "skipped": 0}
    try:
        if topic_partitions is None:
            topic_partitions = len(consumer.partitions_for_topic(topic) or ()) or len(partitions)
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        whole = [tp for tp in tps if not start_at.get(tp.partition)]
        if whole:  # (none given would seek every assigned partition)
            await consumer.seek_to_beginning(*whole)
        for tp in tps:
            if start_at.get(tp.partition):
                consumer.seek(tp, start_at[tp.partition])
        ends = await consumer.end_offsets(tps)
        starts = await consumer.beginning_offsets(tps)
        remaining = {tp for tp in tps if ends[tp] > max(starts[tp], start_at.get(tp.partition, 0))}
        bounded = until != Until()
        while remaining:
            batches = await consumer.getmany(*remaining, timeout_ms=200, max_records=FETCH_RECORDS)
            done = 0
            for tp, records in batches.items():
                partition, end = tp.partition, ends[tp]
                for record in records:
                    offset = record.offset
                    if offset >= end or (bounded and until.stops_before(offset, record.timestamp)):
                        remaining.discard(tp)
                        break
                    done += 1
                    outcome = fold_record(state, partition, offset, record.key, record.value,
                                          topic_partitions)
                    if isinstance(outcome, Rejected):
                        counts["skipped"] += 1
                        counts[outcome.reason] = counts.get(outcome.reason, 0) + 1
                        if counts[outcome.reason] <= 10:
                            log.warning("skipped record at partition %d offset %d (%s): %s",
                                        partition, offset, outcome.reason, outcome.detail)
                if tp in remaining and records and records[-1].offset >= end - 1:
                    remaining.discard(tp)
            counts["events"] += done
            on_progress(done)
        counts["events"] -= counts["skipped"]
    finally:
        await consumer.stop()
    return counts


def write_state(datadir: DataDir, state: CacheState, partitions: Iterable[int]) -> None:
    """Write the state's entries, engine views and applied offsets to RocksDB, one
    partition at a time.

    Each partition is written as one SST file in key order and ingested whole
    (RocksDB's bulk load): no memtable, no write-ahead log, no flush. Keys sort by
    kind (LRU entries, the applied offset, engine views), then by endpoint name, because
    a name's bytes are never control characters and the separator after it is one.
    """
    names: dict[int, list[tuple[bytes, str]]] = {p: [] for p in partitions}
    lrus = state.lrus
    for name, cache in lrus.endpoints.items():
        if cache.partition in names:
            names[cache.partition].append((name.encode(), name))
    views: dict[int, list[tuple[bytes, str]]] = {p: [] for p in partitions}
    for name, view in lrus.engine.views.items():
        if view.partition in views:
            views[view.partition].append((name.encode(), name))
    ingest = IngestExternalFileOptions()
    ingest.set_move_files(True)
    for partition, endpoints in names.items():
        db = datadir.open_partition(partition)
        try:
            if not endpoints and not views[partition] and partition not in lrus.applied:
                continue
            sst = str(datadir.partition_path(partition).with_suffix(".sst"))
            writer = SstFileWriter(Options(raw_mode=True))
            writer.open(sst)
            for _, name in sorted(endpoints):
                for key, value in sorted(endpoint_records(name, lrus.endpoints[name].entries.items())):
                    writer[key] = value
            if partition in lrus.applied:
                writer[APPLIED_KEY] = encode_applied(lrus.applied[partition])
            for _, name in sorted(views[partition]):
                view = lrus.engine.views[name]
                for key, value in sorted(engine_records(name, view.entries.items())):
                    writer[key] = value
            writer.finish()
            db.ingest_external_file([sst], ingest)
        finally:
            db.close()


@dataclass(frozen=True)
class _Part:
    """What one replay process hands back: counts and its endpoints' digests."""

    events: int
    skipped: dict[str, int]
    endpoint_digests: dict[str, bytes]


_progress_counter: Any = None
# The checkpoints read by the parent, per partition: a forked process inherits them.
_checkpoints: dict[int, CheckpointReader] = {}


def _init_replay_process(counter: Any, level: int,
                         checkpoints: dict[int, CheckpointReader]) -> None:
    global _progress_counter, _checkpoints
    _progress_counter, _checkpoints = counter, checkpoints
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _add_progress(done: int) -> None:
    with _progress_counter.get_lock():
        _progress_counter.value += done


def _replay_part(bootstrap: str, topic: str, partitions: list[int], capacity: Capacity,
                 until: Until, root: Path, tansu: bool, topic_partitions: int,
                 security: KafkaSecurity, engine_entries: int, start_at: dict[int, int]) -> _Part:
    """Replay some partitions and write their files (run in a process of its own): each
    from its checkpoint where ``start_at`` says so, else from its first record."""
    if tansu:
        apply_remedies()
    gc.disable()  # a batch job that makes no reference cycles: collections only cost time
    state = CacheState(capacity, engine_entries)
    started = time.monotonic()
    for partition in partitions:
        if start_at.get(partition):
            load_partition(state, partition, _checkpoints[partition].records())
    counts = event_loop.run(replay(bootstrap, topic, partitions, state, until, _add_progress,
                                topic_partitions=topic_partitions, security=security,
                                start_at=start_at))
    replayed = time.monotonic()
    write_state(DataDir(root), state, partitions)
    log.info("partitions %s: replayed %d records in %.2f s, wrote them in %.2f s", partitions,
             counts["events"] + counts["skipped"], replayed - started, time.monotonic() - replayed)
    skipped = {k: v for k, v in counts.items() if k not in ("events", "skipped")}
    return _Part(counts["events"], skipped, state.digests.endpoint_digests())


async def _topic_extents(bootstrap: str, topic: str, security: KafkaSecurity) -> dict[int, Extent]:
    """Where each partition's kept records lie. The first is read, not asked: a broker
    may answer 0 for a partition's beginning when its first record is further on (Tansu,
    whose log can start above 0 after a kept log was rebased)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                **client_options(security))
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not tps:
            return {}
        ends = await consumer.end_offsets(tps)
        starts = await consumer.beginning_offsets(tps)
        first = {tp: ends[tp] for tp in tps}
        waiting = {tp for tp in tps if ends[tp] > starts[tp]}
        if waiting:
            consumer.assign(list(waiting))
            await consumer.seek_to_beginning(*waiting)
        while waiting:
            for tp, records in (await consumer.getmany(*waiting, timeout_ms=200, max_records=1)).items():
                if records:
                    first[tp] = records[0].offset
                    waiting.discard(tp)
                    consumer.pause(tp)
            for tp in list(waiting):  # read to the end without a record (control batches only)
                if await consumer.position(tp) >= ends[tp]:
                    waiting.discard(tp)
        return {tp.partition: Extent(first[tp], ends[tp]) for tp in tps}
    finally:
        await consumer.stop()


async def _read_checkpoints(bootstrap: str, changelog: str, ends: dict[int, int],
                            security: KafkaSecurity) -> dict[int, CheckpointReader] | None:
    """The checkpoint in each partition of ``changelog`` for an event partition ending at
    ``ends[p]``; ``None`` when the changelog does not exist."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                max_partition_fetch_bytes=8 * 1024 * 1024,
                                fetch_max_bytes=64 * 1024 * 1024, **client_options(security))
    await consumer.start()
    try:
        found = consumer.partitions_for_topic(changelog)
        if not found:
            return None
        readers = {p: CheckpointReader(end) for p, end in ends.items() if p in found}
        tps = [TopicPartition(changelog, p) for p in sorted(readers)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        last = await consumer.end_offsets(tps)
        remaining = {tp for tp in tps if last[tp] > 0}
        while remaining:
            batches = await consumer.getmany(*remaining, timeout_ms=200, max_records=FETCH_RECORDS)
            for tp, records in batches.items():
                reader = readers[tp.partition]
                reader.feed(r for r in records if r.offset < last[tp])
                if reader.finished or (records and records[-1].offset >= last[tp] - 1):
                    remaining.discard(tp)
                    consumer.pause(tp)
        return readers
    finally:
        await consumer.stop()


async def _kept_times(bootstrap: str, topic: str, spans: dict[int, tuple[int, int]],
                      security: KafkaSecurity) -> dict[int, int]:
    """The latest record timestamp among each partition's records from ``spans[p][0]`` up
    to ``spans[p][1]`` (inclusive), for partitions with records there."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                max_partition_fetch_bytes=8 * 1024 * 1024,
                                fetch_max_bytes=64 * 1024 * 1024, **client_options(security))
    await consumer.start()
    latest: dict[int, int] = {}
    try:
        tps = {TopicPartition(topic, p): span for p, span in spans.items() if span[1] >= span[0]}
        if not tps:
            return latest
        consumer.assign(list(tps))
        for tp, (first, _) in tps.items():
            consumer.seek(tp, first)
        remaining = set(tps)
        while remaining:
            batches = await consumer.getmany(*remaining, timeout_ms=200, max_records=FETCH_RECORDS)
            for tp, records in batches.items():
                through = tps[tp][1]
                for record in records:
                    if record.offset > through:
                        break
                    latest[tp.partition] = max(latest.get(tp.partition, -1), record.timestamp)
                if records and records[-1].offset >= through:
                    remaining.discard(tp)
                    consumer.pause(tp)
        return latest
    finally:
        await consumer.stop()


def refuse_over_capacity(reader: CheckpointReader, capacity: Capacity, changelog: str) -> None:
    """A checkpoint is the state at the live service's capacity: one holding an LRU over
    ``capacity`` was made with a larger one, and folding on at this one would give neither
    state (a capacity is changed by replaying a whole log), so it is refused."""
    for name, group in reader.reread.endpoints.items():
        held = len(group) if capacity.mode == "items" else sum(
            int.from_bytes(value[12:16], "big") for value in group.values())
        if held > capacity.per_endpoint:
            raise NotRebuildable(
                f"the checkpoint in {changelog} holds {held} {capacity.mode} for endpoint "
                f"{name!r}, over the capacity given ({capacity.per_endpoint}): rebuild with the "
                "capacity of the service that wrote it (a checkpoint cannot change it)")


def _plan(settings: Settings, bootstrap: str, extents: dict[int, Extent],
          until: Until) -> tuple[dict[int, int], dict[int, CheckpointReader]]:
    """Where each partition starts (``resume_points``) and the checkpoints it needs;
    refuses (``NotRebuildable``) before anything is written."""
    topic, security = settings.events_topic, settings.kafka
    changelog = settings.checkpoint_topic or changelog_topic(settings.app_id)
    if not settings.from_checkpoint and not any(e.trimmed for e in extents.values()):
        return dict.fromkeys(extents, 0), {}
    read = asyncio.run(_read_checkpoints(bootstrap, changelog,
                                         {p: e.end for p, e in extents.items()}, security))
    if read is None:
        what = "--from-checkpoint" if settings.from_checkpoint else (
            f"{topic} no longer holds its first events")
        raise NotRebuildable(f"{what}: the checkpoint's changelog {changelog} does not exist on "
                             f"{bootstrap}: give the changelog of the service that consumed "
                             f"{topic} with --checkpoint-topic")
    applied = {p: r.applied for p, r in read.items() if r.applied is not None}
    kept: dict[int, int] = {}
    if until.timestamp_ms is not None:
        kept = asyncio.run(_kept_times(bootstrap, topic, {
            p: (extents[p].first, a) for p, a in applied.items() if p in extents}, security))
    starts = resume_points(extents, applied, until, settings.from_checkpoint, changelog, topic,
                           kept)
    used = {p: read[p] for p, start in starts.items() if start}
    for reader in used.values():
        refuse_over_capacity(reader, settings.capacity, changelog)
    if used:
        log.info("partitions %s start from the checkpoint in %s (the state after offsets %s); "
                 "the events after it are replayed", sorted(used), changelog,
                 [starts[p] - 1 for p in sorted(used)])
    return starts, used


def balanced_groups(sizes: dict[int, int], count: int) -> list[list[int]]:
    """Split partitions into ``count`` groups of about equal records, largest first into
    the lightest group, so that no replay process is left working alone at the end."""
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for partition in sorted(sizes, key=lambda p: (-sizes[p], p)):
        lightest = loads.index(min(loads))
        groups[lightest].append(partition)
        loads[lightest] += sizes[partition]
    return [sorted(group) for group in groups if group]


def rebuild(settings: Settings, until: Until = Until(), workers: int | None = None) -> str:
    """Replay ``settings.events_topic`` into a new ``settings.data_dir``; return its digest.

    Partitions are independent (every event of an endpoint is in one partition, a sync
    acts on its own partition's endpoints), so they are replayed by ``workers``
    processes side by side and their endpoint digests combined.
    """
    datadir = DataDir(settings.data_dir)
    if datadir.root.exists() and any(datadir.root.iterdir()):
        raise StateMismatch(f"{datadir.root} is not empty: rebuild writes a new data dir")
    bootstrap = settings.bootstrap_servers or ""
    cluster = asyncio.run(cluster_id(bootstrap, settings.kafka))
    tansu = is_tansu_id(cluster)
    if tansu:
        apply_remedies()
    extents = asyncio.run(_topic_extents(bootstrap, settings.events_topic, settings.kafka))
    if not extents:
        raise StateMismatch(f"topic {settings.events_topic} not found on {bootstrap}")
    starts, checkpoints = _plan(settings, bootstrap, extents, until)
    sizes = {p: max(0, e.end - max(e.first, starts[p])) for p, e in extents.items()}
    partitions, total = sorted(sizes), sum(sizes.values())
    datadir.root.mkdir(parents=True, exist_ok=True)
    datadir.lock()  # no serve may start on a dir being rebuilt
    try:
        datadir.check(DataDir.identity(settings.app_id, settings.events_topic, settings.capacity,
                                       settings.engine_view_max_entries), cluster)
        count = max(1, min(workers or os.cpu_count() or 1, len(partitions)))
        groups = balanced_groups(sizes, count)
        # fork: no threads run here yet, and a forked worker starts in milliseconds
        context = multiprocessing.get_context("fork")
        counter = context.Value("q", 0)
        progress = Progress(total)
        started = time.monotonic()
        with ProcessPoolExecutor(count, mp_context=context, initializer=_init_replay_process,
                                 initargs=(counter, logging.getLogger().level, checkpoints)) as pool:
            futures = [pool.submit(_replay_part, bootstrap, settings.events_topic, group,
                                   settings.capacity, until, datadir.root, tansu, len(partitions),
                                   settings.kafka, settings.engine_view_max_entries,
                                   {p: starts[p] for p in group})
                       for group in groups]
            while not all(f.done() for f in futures):
                progress.update(counter.value)
                time.sleep(0.1)
            parts = [f.result() for f in futures]
        progress.update(counter.value, final=True)
        elapsed = time.monotonic() - started
        events = sum(p.events for p in parts)
        skipped: dict[str, int] = {}
        for part in parts:
            for reason, n in part.skipped.items():
                skipped[reason] = skipped.get(reason, 0) + n
        log.info("replayed %d events (%d records skipped, as the live worker skips them: %s) in "
                 "%.2f s with %d processes: %.0f events/s", events, sum(skipped.values()),
                 skipped or "none", elapsed, count, (events + sum(skipped.values())) / max(elapsed, 1e-9))
        datadir.mark_seed()
    finally:
        datadir.unlock()
    return combine_digests({k: v for p in parts for k, v in p.endpoint_digests.items()})


def seed_records(records: Iterable[tuple[bytes, bytes]]) -> Iterator[tuple[bytes, bytes]]:
    """One rebuilt partition's records in the order its changelog gets them: the file's
    (key) order, the applied-offset record last.

    Every rebuilt record carries offset 0 in its rank, below the applied offset, and a
    reader of the changelog (``ChangelogGate``: the follower's re-read, Faust's restore,
    the embedded log's ``applied_prefix``) takes a ranked record that comes after an
    applied record at or above its offset for an event written again, and drops it.
    In key order the applied record (``0x02``) precedes the engine views' (``0x04``),
    which would all be dropped; sent last, it follows every record it covers.
    """
    applied: tuple[bytes, bytes] | None = None
    for key, value in records:
        if key == APPLIED_KEY:
            applied = (key, value)
        else:
            yield key, value
    if applied is not None:
        yield applied


async def seed_deployment(bootstrap: str, datadir: DataDir, app_id: str, topic: str,
                          settings: Settings | None = None) -> None:
    """Publish a rebuilt state to the app's (empty) changelog and commit its offsets.

    Afterwards the dir is an ordinary worker dir: the changelog can restore it, and
    the consumer group resumes right after the last replayed event. ``settings`` gives
    the Kafka security and the changelog's replication (``choose_durability``).
    """
    settings = settings or Settings(app_id=app_id, topic=topic)
    security = settings.kafka
    changelog = changelog_topic(app_id)
    partitions = len(datadir.partitions())
    durability = await cluster_durability(bootstrap, settings)
    await ensure_topic(bootstrap, changelog, partitions,
                       durability.topic_config(CHANGELOG_TOPIC_CONFIG),
                       durability.replication_factor, security)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20,
                                max_batch_size=1024 * 1024, **client_options(security))
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=app_id,
                                enable_auto_commit=False, **client_options(security))
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
                for key, value in seed_records(db.items()):
                    acks.append(await producer.send(changelog, value, key=key, partition=partition))
                    if key == APPLIED_KEY:
                        commits[TopicPartition(topic, partition)] = OffsetAndMetadata(
                            decode_applied(value) + 1, ""
                        )
            finally:
                db.close()
        written: dict[int, int] = {}
        for metadata in await asyncio.gather(*acks):
            written[metadata.partition] = max(metadata.offset, written.get(metadata.partition, -1))
        if commits:
            consumer.assign(list(commits))
            await consumer.commit(commits)
    finally:
        await consumer.stop()
        await producer.stop()
    for partition, offset in written.items():
        # What Faust records after writing a changelog record itself: recovery then
        # starts after the seeded records instead of reading them all back.
        db = datadir.open_partition(partition)
        try:
            db[FAUST_OFFSET_KEY] = str(offset).encode()
        finally:
            db.close()
    datadir.seed.unlink()
    log.info("seeded changelog %s with the rebuilt state; resuming %s at %s", changelog, topic,
             {tp.partition: o.offset for tp, o in sorted(commits.items())})
