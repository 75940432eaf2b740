"""Where the keeper writes what each applied event changed: the Faust table's RocksDB
files and its compacted changelog (``TableMirror``), or plain mappings (``MappingMirror``,
for tests and tools). Every worker recovers its partitions, and follows the others', from
that changelog.

A file that cannot be written (a full disk, any IO error of the data dir) stops nothing
but the applying: the batch's write is retried with backoff until it is stored, and its
events are acknowledged only then, while the view answers ``/v1/match`` from memory and
``StateWrites`` tells ``/readyz`` and ``/metrics`` why. A write that would not leave
``RESERVE_BYTES`` free is not given to RocksDB (``check_room``); one that RocksDB fails
all the same leaves its file refusing every later write ("Writer has previous error"),
so the file is closed and opened again (once there is room for its log) before the
next attempt, and each attempt builds its batch anew (a failed write consumes it).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from pathlib import Path
from typing import Any, Protocol

import faust
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from rocksdict import WriteBatch

from stream.core.cache import Effects
from stream.kafka.coordinator import LostMembership
from stream.state.datadir import DataDir
from stream.state.store import (
    APPLIED_KEY,
    FAUST_OFFSET_KEY,
    ChangelogGate,
    decode_applied,
    effect_records,
    encode_faust_offset,
    write_effects,
)
from stream.worker.view_marks import ViewMarks

__all__ = ["MappingMirror", "Mirror", "StateNotStored", "StateWrites", "TableMemory", "TableMirror",
           "closed_partitions", "gate_changelog_restore", "is_storage_error",
           "refuse_unwritable_state", "reopen_partition", "schedule_reopen"]

log = logging.getLogger(__name__)

#: Backoff between two attempts to write a batch the file refused: doubling, capped (a
#: stop is noticed within the cap).
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 1.0

#: Room kept free beside every write (RocksDB's own log and manifest need some). A write
#: that would not fit is not given to RocksDB at all: one that RocksDB fails leaves its
#: file refusing every other until it is reopened, and the reopen replays the file's log
#: holding the GIL (~1 s for 8 MB, every request waiting).
RESERVE_BYTES = 1 << 20

#: Changelog records a partition's catch-up writes at a time, the loop turning in
#: between (~2 µs a record: a few ms).
CATCH_UP_RECORDS = 2000
#: How long a recovery waits for a changelog that ends below its files (log_holds_files),
#: and how often it asks again.
LOG_BEHIND_FILES_S = 30.0
LOG_BEHIND_POLL_S = 0.5  # each ask logs Faust's table of ends


def check_room(path: Path, need: int) -> None:
    """Raise ENOSPC, as the disk would, unless ``need`` bytes and ``RESERVE_BYTES`` are
    free on the volume of ``path`` (its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    stat = os.statvfs(path)
    free = stat.f_bavail * stat.f_frsize
    if free < need + RESERVE_BYTES:
        raise OSError(errno.ENOSPC, f"No space left on device: {free} bytes free on the "
                      f"volume of {path}, {need} needed and {RESERVE_BYTES} kept free")


def _rows_size(rows: Iterable[tuple[bytes, bytes | None]]) -> int:
    """About what these rows take in RocksDB's log (their bytes, and a header each)."""
    return sum(len(key) + len(value or b"") + 16 for key, value in rows)


def is_storage_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the data dir failing (no space, a read-only or broken volume)
    rather than a bug: rocksdict raises a bare ``Exception`` whose text is RocksDB's
    status ("IO error: No space left on device: ...") or the OS error it got."""
    text = str(exc)
    return isinstance(exc, OSError) or text.startswith("IO error") or "(os error " in text


class StateNotStored(RuntimeError):
    """A batch's records could not be written to its file before the worker stopped: its
    events are not acknowledged (the changelog holds them for the next start)."""


class StateWrites:
    """Whether the partition files take writes: the partitions whose last write failed,
    with the error and since when, and the failed attempts in all. A prometheus_client
    collector (``mmcache_state_write_errors_total``, ``mmcache_state_writes_failing``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.errors_total = 0
        self.failing: dict[int, tuple[str, float]] = {}  # partition -> (error, since)

    def failed(self, partition: int, exc: BaseException) -> None:
        """A write to ``partition``'s file failed (logged once until it succeeds)."""
        self.errors_total += 1
        if partition not in self.failing:
            log.error("cannot write the state of partition %d (%s): its events are not "
                      "acknowledged, nor later ones applied, until they are stored; retrying, "
                      "/v1/match answers from memory", partition, exc)
            self.failing[partition] = (str(exc), self.clock())

    def stored(self, partition: int) -> None:
        """A write to ``partition``'s file succeeded."""
        failure = self.failing.pop(partition, None)
        if failure is not None:
            log.warning("the state of partition %d is written again, after %.1f s of failed "
                        "writes", partition, self.clock() - failure[1])

    def problem(self) -> str | None:
        """What ``/readyz`` says of the files while writes fail (``None``: they do not)."""
        if not self.failing:
            return None
        error, since = min(self.failing.values(), key=lambda failure: failure[1])
        return (f"state writes fail for partitions {sorted(self.failing)} for "
                f"{self.clock() - since:.0f} s ({error}): their events are not acknowledged, "
                "nor later ones applied, until stored (retrying)")

    def collect(self) -> Iterator[Metric]:
        """The two figures, for ``/metrics`` (register this on the service's registry)."""
        yield CounterMetricFamily("mmcache_state_write_errors_total", "Failed attempts to "
                                  "write the state's files (full disk, IO errors), each retried",
                                  value=self.errors_total)
        yield GaugeMetricFamily("mmcache_state_writes_failing", "Partitions whose state file "
                                "refuses writes now (0: all are written)", value=len(self.failing))


class TableMemory:
    """RocksDB's own memory for the table's open partition files, by kind, summed over the
    files (each has its own write buffers and cache, ``stream.worker.app.TABLE_FILE_OPTIONS``):
    what part of serve's RSS is RocksDB's. A prometheus_client collector
    (``mmcache_table_rocksdb_bytes{kind}``); each figure is a property RocksDB keeps."""

    PROPERTIES = {"memtables": "rocksdb.cur-size-all-mem-tables",
                  "block_cache": "rocksdb.block-cache-usage",
                  "table_readers": "rocksdb.estimate-table-readers-mem"}

    def __init__(self, store: Any) -> None:
        self.store = store  # Faust's RocksDB store of the table (``table.data``)

    def bytes(self) -> dict[str, int]:
        """Each kind's bytes over the files open now (a file being reopened counts 0)."""
        totals = dict.fromkeys(self.PROPERTIES, 0)
        for db in list(self.store._dbs.values()):
            for kind, name in self.PROPERTIES.items():
                try:
                    totals[kind] += db.property_int_value(name) or 0
                except Exception:  # noqa: BLE001, S112 - closed meanwhile: nothing held
                    continue
        return totals

    def collect(self) -> Iterator[Metric]:
        """The figures, for ``/metrics`` (register this on the service's registry)."""
        family = GaugeMetricFamily("mmcache_table_rocksdb_bytes", "RocksDB's memory for the "
                                   "table's open partition files, by kind: write buffers "
                                   "(memtables), block cache, index and filter blocks "
                                   "(table_readers)", labels=["kind"])
        for kind, value in self.bytes().items():
            family.add_metric([kind], value)
        yield family


class _Reopens:
    """One store's partitions closed after a failed write and not open again yet, and
    those being reopened now."""

    def __init__(self) -> None:
        self.closed: set[int] = set()
        self.running: set[int] = set()


_reopens: dict[int, _Reopens] = {}


def closed_partitions(store: Any) -> set[int]:
    """The partitions of ``store`` whose file was closed after a failed write and is not
    open again: not to be opened on the loop (``reopen_partition`` does it off the loop)."""
    return _reopens.setdefault(id(store), _Reopens()).closed


async def reopen_partition(store: Any, partition: int) -> None:
    """Close the partition's file, which refuses every write after a failed one, and open it
    again in Faust's store (``store._dbs``), or leave it in ``closed_partitions``; return
    at once if that is under way already (``schedule_reopen``).

    Both run in a thread: closing a file that failed took ~1 s, and opening one replays its
    log into a new table file (0.4-0.7 s for 8 MB, failing again while the disk is full);
    on the loop, either would hold every request that long."""
    reopens = _reopens.setdefault(id(store), _Reopens())
    if partition not in reopens.running:
        reopens.running.add(partition)
        reopens.closed.add(partition)
        await _reopen_now(store, partition, reopens)


def schedule_reopen(store: Any, partition: int) -> None:
    """``reopen_partition`` as a task, from code that cannot wait (Faust's restore)."""
    reopens = _reopens.setdefault(id(store), _Reopens())
    reopens.closed.add(partition)
    if partition not in reopens.running:
        reopens.running.add(partition)
        asyncio.ensure_future(_reopen_now(store, partition, reopens))


async def _reopen_now(store: Any, partition: int, reopens: _Reopens) -> None:
    db = store._dbs.pop(partition, None)
    try:
        opened = await asyncio.to_thread(_reopen, store, partition, db)
    finally:
        reopens.running.discard(partition)
    if opened is not None:
        if partition in store._dbs:  # opened meanwhile by Faust itself
            await asyncio.to_thread(opened.close)
        else:
            store._dbs[partition] = opened
    if partition in store._dbs:
        reopens.closed.discard(partition)


def _reopen(store: Any, partition: int, db: Any) -> Any:
    """``reopen_partition``'s work, off the loop: the file opened again, or ``None``."""
    if db is not None:
        try:
            db.close()
        except Exception as exc:  # noqa: BLE001 - "Writer has previous error": closed all the same
            log.debug("closing partition %d's file: %s", partition, exc)
    path = Path(store.partition_path(partition))
    try:
        # its log is replayed into a table file: not tried without room for that
        check_room(path, sum(f.stat().st_size for f in path.glob("*.log")))
        # as Faust's own open (``Store._open_for_partition``) of a writable store
        return store.rocksdb_options.open(path)
    except Exception as exc:
        if not is_storage_error(exc):
            raise
        return None


def refuse_unwritable_state(datadir: DataDir) -> None:
    """Open each partition file found for writing once, as Faust will (RocksDB writes a
    manifest and a log on open), and stop the start with one line if one cannot be: a
    worker without room to open its files can neither recover nor apply anything, and
    Faust's own open would crash it. When the disk fills later, it keeps running."""
    for partition in datadir.partitions():
        try:
            datadir.open_partition(partition).close()
        except Exception as exc:
            if not is_storage_error(exc):
                raise
            datadir.release()  # nothing was written: the next start is not a crash's
            raise SystemExit(f"--data-dir {datadir.root}: cannot open the state of partition "
                             f"{partition} for writing ({exc}): free space there (or give a "
                             "larger volume), then start again; nothing was changed") from None


class Mirror(Protocol):
    """Where the keeper writes what each applied event changed."""

    def write(self, partition: int, effects: Effects, applied_offset: int) -> None:
        """Record one event's changes in that partition's store."""


class MappingMirror:
    """A mirror into plain mappings, one per partition (a dict, or a rocksdict file)."""

    def __init__(self, stores: dict[int, MutableMapping[bytes, bytes]]) -> None:
        self.stores = stores

    def write(self, partition: int, effects: Effects, applied_offset: int) -> None:
        """Apply the records to the partition's mapping."""
        write_effects(self.stores.setdefault(partition, {}), effects, applied_offset)


class TableMirror:
    """A mirror into the Faust table's RocksDB files and its changelog topic.

    Faust's per-key table API was measured here at ~200 µs per key (a future, a buffer
    task and a callback per record), and even one producer ``send`` per record costs
    ~15 µs. So the records of a batch of events are gathered per partition into one
    RocksDB WriteBatch and into Kafka record batches (0.75 µs per record), sent and
    written at ``flush``, which returns once the broker holds them (so that the events'
    offsets are acknowledged only then). Like Faust, it stores in each partition's file
    the highest changelog offset written, so recovery reads only what came after.
    """

    def __init__(self, app: faust.App, table: Any, health: StateWrites | None = None,
                 marks: ViewMarks | None = None) -> None:
        self.app = app
        self.table = table
        self.health = health if health is not None else StateWrites()
        self.marks = marks
        self.changelog = table.changelog_topic.get_topic_name()
        self._pending: dict[int, _PartitionRecords] = {}

    def write(self, partition: int, effects: Effects, applied_offset: int) -> None:
        """Add one event's records to its partition's pending batches."""
        pending = self._pending.get(partition)
        if pending is None:
            pending = self._pending[partition] = _PartitionRecords(self._producer())
        pending.add(effect_records(effects, applied_offset))

    async def flush(self, keep_trying: Callable[[], bool] = lambda: True,
                    still_owner: Callable[[], Awaitable[None]] | None = None) -> bool:
        """Send the pending records to the changelog and wait for the broker's acks, then
        write them to the files with the changelog offset they reached, in one batch a
        partition; return whether the files hold them.

        Returning (true) only once the changelog and the files hold them is what lets the
        caller acknowledge the events: a send that aiokafka gives up on raises here, the
        events are not acknowledged, and the worker stops (its next start restores from the
        changelog and the events are delivered again). A file that refuses the write is
        retried with backoff while ``keep_trying()`` (false: the worker stops; the events
        are then not acknowledged, and the changelog holds them for the next start).
        """
        producer = self._producer()
        pending, self._pending = self._pending, {}
        sent = []
        for partition, records in pending.items():
            for builder in records.sealed():
                ack = await producer.send_batch(builder, self.changelog, partition=partition)
                sent.append((partition, builder.record_count() - 1, ack))
        reached: dict[int, int] = {}
        for partition, last, ack in sent:
            metadata = await ack  # of the batch's first record
            # The file records the changelog offset it holds everything up to. Records of
            # another writer between its offset and this batch are either its successor's,
            # when this worker is a zombie: they must not be skipped by the file, so nothing
            # of the batch goes to it (``still_owner`` raises LostMembership; the changelog's
            # readers skip the batch, stream.state.store.ChangelogGate); or a zombie's, written
            # after this owner's, which every reader skips: the owner goes on.
            after = reached.get(partition, self.persisted(partition))
            if after is not None and metadata.offset != after + 1:
                if still_owner is None:
                    raise LostMembership(f"changelog partition {partition}: this batch landed "
                                         f"at offset {metadata.offset}, the file holds it up to "
                                         f"{after}: another worker wrote the partition meanwhile")
                log.warning("changelog partition %d: records of another writer at offsets %d-%d, "
                            "before this batch's; checking that this worker still owns it",
                            partition, after + 1, metadata.offset - 1)
                if self.marks is not None:
                    self.marks.distrust(partition)
                await still_owner()
            reached[partition] = max(metadata.offset + last, reached.get(partition, -1))
        for partition, records in pending.items():
            if partition in reached:
                records.rows.append((FAUST_OFFSET_KEY, encode_faust_offset(reached[partition])))
            if not await self._store(partition, records.rows, keep_trying):
                return False
        return True

    async def _store(self, partition: int, rows: list[tuple[bytes, bytes | None]],
                     keep_trying: Callable[[], bool]) -> bool:
        """Write one partition's rows as one batch, retrying a file that refuses it."""
        store, delay = self.table.data, RETRY_FIRST_S
        while True:
            closed, checked = closed_partitions(store), False
            try:
                if partition in closed:
                    await reopen_partition(store, partition)
                    if partition in closed:
                        raise OSError(errno.EIO, f"the state file of partition {partition} "
                                      "cannot be opened again yet")
                check_room(Path(store.partition_path(partition)), _rows_size(rows))
                checked = True
                store._db_for_partition(partition).write(_batch(rows))
            except Exception as exc:
                if not is_storage_error(exc):
                    raise
                self.health.failed(partition, exc)
                if checked:  # RocksDB failed the write: its file refuses every other
                    await reopen_partition(store, partition)
                if not keep_trying():
                    return False
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            self.health.stored(partition)
            return True

    def _producer(self) -> AIOKafkaProducer:
        return self.app.producer._ensure_producer()  # type: ignore[attr-defined,no-any-return]

    def persisted(self, partition: int, absent: int | None = None) -> int | None:
        """The changelog offset the partition's file holds everything up to (Faust's offset
        record, which recovery resumes after); ``absent`` when the file has no such record,
        ``None`` when the file cannot be read."""
        store = self.table.data
        if partition in closed_partitions(store):
            return None
        try:
            raw = store._db_for_partition(partition).get(FAUST_OFFSET_KEY)
        except Exception:  # noqa: BLE001 - a file being reopened: not known
            return None
        return absent if raw is None else int(raw)


def _batch(rows: Iterable[tuple[bytes, bytes | None]]) -> WriteBatch:
    """A RocksDB batch of these rows (``None`` deletes): made anew for each attempt, as a
    failed write consumes its batch."""
    batch = WriteBatch(raw_mode=True)
    for key, value in rows:
        if value is None:
            batch.delete(key)
        else:
            batch.put(key, value)
    return batch


class _PartitionRecords:
    """One partition's records not yet written: the rows for its file, Kafka record batches."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self.rows: list[tuple[bytes, bytes | None]] = []
        self.builders = [producer.create_batch()]

    def add(self, records: Iterable[tuple[bytes, bytes | None]]) -> None:
        rows, builder = self.rows, self.builders[-1]
        for key, value in records:
            rows.append((key, value))
            if builder.append(key=key, value=value, timestamp=None) is None:  # full
                builder = self.producer.create_batch()
                self.builders.append(builder)
                builder.append(key=key, value=value, timestamp=None)

    def sealed(self) -> list[Any]:
        """The record batches that hold records."""
        return [b for b in self.builders if b.record_count()]


def gate_changelog_restore(table: Any, health: StateWrites | None = None,
                           open_consumer: Callable[[], AIOKafkaConsumer] | None = None,
                           ) -> None:
    """Make Faust's restore of the table from its changelog skip events written again
    after later ones (``ChangelogGate``), as the follower does, so that a worker that
    recovers a partition after a zombie owner's resent batch does not load its stale
    entries. Each partition's gate starts from the applied offset its file holds, made
    anew when a recovery starts.

    With ``open_consumer``, each recovery first catches the files that are behind their
    changelog up in bulk (``catch_up``), through gates of the same kind: Faust's restore
    takes a record at a time (a task and a queue each: ~200 µs a record, 100k entries in
    17 s), and then finds only what came after.

    A restore that a file refuses (``is_storage_error``) raises as before, and Faust keeps
    the batch and gives it again (with the next changelog record, or after 5 s idle): the
    gates go back to where they were before it, the files it touched are reopened, and
    ``health`` says so until a restore succeeds."""
    health = health if health is not None else StateWrites()
    store = table.data
    restore = store.apply_changelog_batch
    gates: dict[int, ChangelogGate] = {}

    def gate_of(partition: int) -> ChangelogGate:
        gate = gates.get(partition)
        if gate is None:
            raw = store._db_for_partition(partition).get(APPLIED_KEY)
            gate = gates[partition] = ChangelogGate(-1 if raw is None else decode_applied(raw))
        return gate

    def admitted(batch: Iterable[Any]) -> Iterator[Any]:
        for event in batch:
            message = event.message
            yield from gate_of(message.partition).admit([(message.key, message.value, event)])

    def apply_changelog_batch(batch: Iterable[Any], to_key: Any, to_value: Any) -> None:
        events = list(batch)
        if not events:  # Faust flushes its (empty) buffers when it stops: nothing to write
            restore(events, to_key, to_value)
            return
        touched = {event.message.partition for event in events}
        busy = touched & closed_partitions(store)
        if busy:  # being reopened, or closed by a failed write: reopened off the loop first
            for partition in busy:
                schedule_reopen(store, partition)
            raise OSError(errno.EAGAIN, f"the state files of partitions {sorted(busy)} are "
                          "being opened again after a failed write; the restore is retried")
        try:
            check_room(Path(store.partition_path(min(touched))),
                       _rows_size((e.message.key, e.message.value) for e in events))
        except OSError as exc:
            for partition in touched:
                health.failed(partition, exc)
            raise
        before = {partition: gate.copy() for partition, gate in gates.items()}
        try:
            restore(list(admitted(events)), to_key, to_value)
            # past the skipped records too: the file's offset is where it holds the
            # changelog up to (TableMirror.flush tells another writer's records by it),
            # but not past removals its gate holds back (an event read in part)
            highest: dict[Any, tuple[int, int]] = {}
            for event in events:
                message = event.message
                offset = max(message.offset, highest.get(message.tp, (0, -1))[1])
                highest[message.tp] = (message.partition, offset)
            for tp, (partition, offset) in highest.items():
                held = gate_of(partition).holding
                store.set_persisted_offset(tp, held[0].message.offset - 1 if held else offset)
        except Exception as exc:
            if not is_storage_error(exc):
                raise
            gates.clear()
            gates.update(before)
            for partition in sorted(touched):
                health.failed(partition, exc)
                schedule_reopen(store, partition)
            raise
        for partition in touched:
            health.stored(partition)

    store.apply_changelog_batch = apply_changelog_batch
    if open_consumer is None:
        return
    recovery = table.app.tables.recovery
    build_offsets = recovery._build_offsets

    async def caught_up_offsets(consumer: Any, tps: Any, destination: Any, title: str) -> None:
        # Faust's recovery, between the highwaters and the offsets it reads from (run in
        # its own task, outside the rebalance callback: the member's heartbeats go on; a
        # rebalance meanwhile cancels it, and a catch-up cut short leaves Faust the rest).
        # Each recovery's restore starts from the files as they are: the gates are made
        # anew here, after Faust applied what its buffers held of the one before (never
        # when the previous recovery's callbacks run: those may run during this restore,
        # and would drop removals a gate holds back for an event read in part)
        if title == "active":
            gates.clear()
            changelog, highwaters = table.changelog_topic.get_topic_name(), recovery.active_highwaters
            log.info("recovery after a rebalance: changelog partitions %s",  # the assignment came
                     sorted(tp.partition for tp in tps if tp.topic == changelog))
            await log_holds_files(consumer, tps, changelog, highwaters)
            behind = {}
            for tp in tps:
                if tp.topic == changelog and tp.partition in store._dbs:
                    held = store._db_for_partition(tp.partition).get(FAUST_OFFSET_KEY)
                    last = highwaters.get(tp)
                    if last is not None and last >= 0 and (held is None or int(held) < last):
                        behind[tp] = (None if held is None else int(held), last)
            if behind:
                try:
                    await catch_up(behind, destination)
                except Exception:  # noqa: BLE001 - Faust's restore reads what is left
                    log.warning("bulk catch-up of the changelog failed; Faust's restore reads "
                                "the rest", exc_info=True)
        await build_offsets(consumer, tps, destination, title)

    async def log_holds_files(consumer: Any, tps: Any, changelog: str, highwaters: Any) -> None:
        """Wait while a changelog partition ends below the offset its file holds, asking
        its end again, at most ``LOG_BEHIND_FILES_S``: Faust would take it for a lost log
        (``ConsistencyError``) and the worker would crash. The embedded broker shows it
        while a rebase gives it its log back, to a member that joined again first (its
        session expired meanwhile: seen under load); past the bound Faust decides."""
        deadline = time.monotonic() + LOG_BEHIND_FILES_S
        said: set[int] = set()
        while True:
            ahead = {}
            for tp in tps:
                if tp.topic == changelog and tp.partition in store._dbs:
                    held = store._db_for_partition(tp.partition).get(FAUST_OFFSET_KEY)
                    end = highwaters.get(tp, 0)
                    if held is not None and end and int(held) > end:  # Faust's own test
                        ahead[tp.partition] = (int(held), end)
            if not ahead or time.monotonic() > deadline:
                return
            if said != ahead.keys():
                said = set(ahead)
                log.info("changelog partitions end below what their files hold (partition: "
                         "(file, log)) %s: the log is being restored, waiting", ahead)
            await asyncio.sleep(LOG_BEHIND_POLL_S)
            await recovery._build_highwaters(consumer, tps, highwaters, "active")

    async def catch_up(behind: dict[Any, tuple[int | None, int]], destination: Any) -> None:
        """Read these changelog partitions from where their files hold them up to, to
        their last offset, into the files a slice at a time, each with the offset its file
        then holds (also Faust's ``destination``, where its restore resumes)."""
        started = time.monotonic()
        own: dict[int, ChangelogGate] = {}  # not the restore's: theirs hold Faust's events
        written = 0
        consumer = open_consumer()
        try:
            await consumer.start()
            pending = {TopicPartition(tp.topic, tp.partition): (tp, last)
                       for tp, (_, last) in behind.items()}
            consumer.assign(list(pending))
            for kafka_tp, (tp, _) in pending.items():
                held = behind[tp][0]
                if held is None:
                    await consumer.seek_to_beginning(kafka_tp)
                else:
                    consumer.seek(kafka_tp, held + 1)
            while pending:
                fetched = await consumer.getmany(*pending, timeout_ms=200,
                                                 max_records=CATCH_UP_RECORDS)
                for kafka_tp, records in fetched.items():
                    tp, last = pending[kafka_tp]
                    records = [r for r in records if r.offset <= last]
                    if not records:
                        continue
                    reached = store_caught_up(tp.partition, records, own)
                    if reached is None:  # a file that refuses it: Faust's restore retries it
                        del pending[kafka_tp]
                        continue
                    destination[tp] = reached
                    written += len(records)
                for kafka_tp, (_, last) in list(pending.items()):
                    if await consumer.position(kafka_tp) > last:
                        del pending[kafka_tp]
                await asyncio.sleep(0)
        finally:
            for tp in behind:  # the restore's next gate is made from the file
                gates.pop(tp.partition, None)
            await consumer.stop()
        if written:
            log.info("caught up %d changelog records of partitions %s in %.2f s", written,
                     sorted(tp.partition for tp in behind), time.monotonic() - started)

    def store_caught_up(partition: int, records: list[Any],
                        own: dict[int, ChangelogGate]) -> int | None:
        """Write one slice of a partition's changelog through its gate, with the offset its
        file then holds the changelog up to, and return it; ``None`` if the file refused."""
        gate = own.get(partition)
        db = store._db_for_partition(partition)
        if gate is None:
            raw = db.get(APPLIED_KEY)
            gate = own[partition] = ChangelogGate(-1 if raw is None else decode_applied(raw))
        before = gate.copy()
        rows = [(r.key, r.value) for r in gate.admit((r.key, r.value, r) for r in records)]
        # an event part-read holds its removals back until its applied record: the file
        # then holds the changelog only up to the record before them (read again by the
        # next slice's gate, or by Faust's restore)
        held = gate.holding
        reached = held[0].offset - 1 if held else records[-1].offset
        rows.append((FAUST_OFFSET_KEY, encode_faust_offset(reached)))
        try:
            check_room(Path(store.partition_path(partition)), _rows_size(rows))
            db.write(_batch(rows))
        except Exception as exc:
            if not is_storage_error(exc):
                raise
            own[partition] = before
            health.failed(partition, exc)  # the restore's own path reopens it, and retries
            return None
        health.stored(partition)
        return reached

    recovery._build_offsets = caught_up_offsets
