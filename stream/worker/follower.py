"""Following the partitions other workers own, so every worker of an app id answers for
all endpoints: their changes are read from the table's changelog (no consumer group)
and mirrored into the view.

A partition this worker gives up after a rebalance, and holds in its view up to a known
changelog offset (``stream.worker.view_marks``: its last stored batch), is followed on from
the next record. Any other it starts to follow (at start, after a rebalance, or when its
position is out of range) is re-read from the changelog's first record into a store of
its own, aside, while the view keeps answering from what it held; once the re-read has
reached the changelog's end, the partition is loaded into the view in one pass
(``stream.state.view_load``: each LRU swapped whole, ordered by the rank stored with each
entry, so a changelog written in key order by a seeded start gives the owner's recency
order too). After that, changes are applied as they come, in the owner's fold order.
The owner's applied-offset record is mirrored into the view's applied offsets, from
which the view's lag on a followed partition is told. Engine views are followed the same
way, from their own records (``stream.state.store``: the view's, and its entries').
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import mode
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import NoOffsetForPartitionError, OffsetOutOfRangeError
from aiokafka.structs import TopicPartition

from stream.core.cache import CacheState
from stream.state.checkpoint import Reread
from stream.state.store import (
    APPLIED_KEY,
    ChangelogGate,
    decode_applied,
    decode_change,
    decode_engine_change,
    is_engine_key,
)
from stream.state.view_load import load_partition_into_view
from stream.worker.view_marks import ViewMarks

__all__ = ["ChangelogFollower", "Reread"]

# Changelog records taken per turn of the loop (~1-2 µs each).
FOLLOW_RECORDS = 2000

log = logging.getLogger(__name__)


class ChangelogFollower(mode.Service):
    """Keeps the view of the partitions this worker does not own; a single worker owns
    every partition and follows none.

    After each rebalance ``follow`` is told which partitions this worker owns. A lock
    keeps ``follow`` and the application of fetched records (a re-read's load included)
    from interleaving, so a partition that becomes owned is no longer written here once
    ``follow`` returns.
    """

    def __init__(self, bootstrap_servers: str, changelog: str, view: CacheState,
                 client: dict[str, Any] | None = None, marks: ViewMarks | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bootstrap_servers = bootstrap_servers
        self.client = client or {}
        self.changelog = changelog
        self.view = view
        self.marks = marks if marks is not None else ViewMarks()
        self.following: set[int] = set()
        self.rereads: dict[int, Reread] = {}
        self._gates: dict[int, ChangelogGate] = {}  # per followed partition
        self.loads = 0  # re-reads loaded into the view
        self._next: dict[int, int] = {}  # next changelog offset, per followed partition
        self._consumer: AIOKafkaConsumer | None = None
        self._assigned = asyncio.Event()
        self._lock = asyncio.Lock()

    @property
    def caught_up(self) -> bool:
        """Told what to follow, and no partition is being re-read."""
        return self._assigned.is_set() and not self.rereads

    async def on_start(self) -> None:
        """Connect; nothing is read until ``follow`` names the partitions.

        No reset policy: a position out of range raises, and that partition is re-read
        from its first record (never resumed from the latest, which would skip changes).
        """
        self._consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap_servers,
                                          enable_auto_commit=False, auto_offset_reset="none",
                                          **self.client)
        await self._consumer.start()

    async def on_stop(self) -> None:
        """Disconnect."""
        if self._consumer is not None:
            await self._consumer.stop()

    async def ends(self, partitions: int) -> dict[int, int]:
        """The changelog's end offset of each of ``partitions`` partitions."""
        consumer = self._consumer
        assert consumer is not None
        read = await consumer.end_offsets([self._tp(p) for p in range(partitions)])
        return {tp.partition: offset for tp, offset in read.items()}

    async def follow(self, owned: set[int], partitions: int) -> None:
        """Follow every partition this worker does not own (called after each recovery):
        a newly followed one resumes after the changelog offset up to which the view
        holds it (``ViewMarks``: the owner's last stored batch), or is re-read aside when
        that is not known; the others resume where they were."""
        consumer = self._consumer
        assert consumer is not None
        async with self._lock:
            following = set(range(partitions)) - owned
            for partition in self.following - following:
                self.rereads.pop(partition, None)
                self._next.pop(partition, None)
            self._resume_from_marks(following - self.following)
            self.following = following
            consumer.assign([self._tp(p) for p in sorted(following)])
            again = [p for p in following if p in self.rereads or p not in self._next]
            for partition in following - set(again):
                consumer.seek(self._tp(partition), self._next[partition])
            await self._reread(consumer, again)
            self._assigned.set()

    def _resume_from_marks(self, partitions: set[int]) -> None:
        """Of these newly followed partitions, those the view holds up to a known
        changelog offset resume after it, through a gate from the view's applied offset
        (as a file's restore starts from its own); the others are re-read."""
        for partition in partitions:
            through = self.marks.through(partition)
            if through is not None and partition not in self._next:
                self._next[partition] = through + 1
                self._gates[partition] = ChangelogGate(self.view.lrus.applied.get(partition, -1))

    async def _reread(self, consumer: AIOKafkaConsumer, partitions: list[int]) -> None:
        for partition in partitions:
            self.rereads[partition] = Reread()
            self._gates[partition] = ChangelogGate()
        if partitions:
            await consumer.seek_to_beginning(*(self._tp(p) for p in partitions))

    def _tp(self, partition: int) -> TopicPartition:
        return TopicPartition(self.changelog, partition)

    @mode.Service.task
    async def _mirror(self) -> None:
        await self._assigned.wait()
        consumer = self._consumer
        assert consumer is not None
        while not self.should_stop:
            if not self.following:
                await self.sleep(0.1)
                continue
            try:
                batches = await consumer.getmany(timeout_ms=100, max_records=FOLLOW_RECORDS)
            except (OffsetOutOfRangeError, NoOffsetForPartitionError) as exc:
                await self._out_of_range(consumer, exc)
                continue
            async with self._lock:
                for tp, records in batches.items():
                    if tp.partition in self.following:
                        self._take(tp.partition, records)
                await self._load_finished(consumer)

    async def _out_of_range(self, consumer: AIOKafkaConsumer, exc: Exception) -> None:
        found = exc.args[0] if exc.args else {}
        tps = list(found) if isinstance(found, dict) else [found]
        async with self._lock:
            partitions = [tp.partition for tp in tps if tp.partition in self.following]
            log.warning("changelog position out of range for partitions %s: re-reading them "
                        "from the first record", partitions)
            await self._reread(consumer, partitions)

    def _take(self, partition: int, records: list[Any]) -> None:
        gate = self._gates.get(partition)
        if gate is None:
            gate = self._gates[partition] = ChangelogGate(self.view.lrus.applied.get(partition, -1))
        dropped = gate.dropped
        admitted = gate.admit((r.key, r.value, r) for r in records)
        if gate.dropped > dropped:
            log.warning("changelog partition %d: skipped %d records of events written again "
                        "after later ones (a resumed zombie owner or a resent batch)", partition,
                        gate.dropped - dropped)
        reread = self.rereads.get(partition)
        if reread is not None:
            for record in admitted:
                reread.add(record.key, record.value)
        else:
            loading, fold, engine_views = self.view.loading, self.view.fold, self.view.lrus.engine
            for record in admitted:
                key, value = record.key, record.value
                if key == APPLIED_KEY:
                    loading.set_applied(partition, decode_applied(value))
                    continue
                change = decode_change(key, value)
                if change is not None:
                    fold.follow(partition, *change)
                elif is_engine_key(key):
                    engine = decode_engine_change(key, value)
                    assert engine is not None
                    engine_views.follow(partition, *engine)
        if records:
            self._next[partition] = records[-1].offset + 1
            if reread is None:
                self.marks.set(partition, self._held_through(partition, records[-1].offset))

    def _held_through(self, partition: int, last: int) -> int:
        """The changelog offset up to which the view holds ``partition`` once its records
        up to ``last`` are taken: before the removals its gate holds back (an event read
        in part), as a file's restore counts it."""
        held = self._gates[partition].holding
        return held[0].offset - 1 if held else last

    async def _load_finished(self, consumer: AIOKafkaConsumer) -> None:
        """Load every re-read that has reached the changelog's end into the view."""
        for partition in list(self.rereads):
            tp = self._tp(partition)
            highwater = consumer.highwater(tp)
            if highwater is None or await consumer.position(tp) < highwater:
                continue
            self._next[partition] = highwater
            reread = self.rereads.pop(partition)
            self.marks.forget(partition)
            await load_partition_into_view(self.view, partition, reread.records())
            self.marks.set(partition, self._held_through(partition, highwater - 1))
            self.loads += 1
