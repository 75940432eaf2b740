"""Where the keeper writes what each applied event changed: the Faust table's RocksDB
files and its compacted changelog (``TableMirror``), or plain mappings (``MappingMirror``,
for tests and tools). Every worker recovers its partitions, and follows the others', from
that changelog.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any, Protocol

import faust
from aiokafka import AIOKafkaProducer
from faust.types import TP
from rocksdict import WriteBatch

from stream.core.cache import Effects
from stream.store import APPLIED_KEY, ChangelogGate, decode_applied, effect_records, write_effects

__all__ = ["MappingMirror", "Mirror", "TableMirror", "gate_changelog_restore"]


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

    def __init__(self, app: faust.App, table: Any) -> None:
        self.app = app
        self.table = table
        self.changelog = table.changelog_topic.get_topic_name()
        self._pending: dict[int, _PartitionRecords] = {}

    def write(self, partition: int, effects: Effects, applied_offset: int) -> None:
        """Add one event's records to its partition's pending batches."""
        pending = self._pending.get(partition)
        if pending is None:
            pending = self._pending[partition] = _PartitionRecords(self._producer())
        pending.add(effect_records(effects, applied_offset))

    async def flush(self) -> None:
        """Send the pending records to the changelog and wait for the broker's acks, then
        write them to the files with the changelog offset they reached.

        Returning only once the changelog holds them is what lets the caller acknowledge
        the events: a send that aiokafka gives up on raises here, the events are not
        acknowledged, and the worker stops (its next start restores from the changelog
        and the events are delivered again).
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
            reached[partition] = max(metadata.offset + last, reached.get(partition, -1))
        for partition, records in pending.items():
            self.table.data._db_for_partition(partition).write(records.batch)
            if partition in reached:
                self.table.data.set_persisted_offset(TP(self.changelog, partition), reached[partition])

    def _producer(self) -> AIOKafkaProducer:
        return self.app.producer._ensure_producer()  # type: ignore[attr-defined,no-any-return]


class _PartitionRecords:
    """One partition's records not yet written: a RocksDB batch, Kafka record batches."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self.batch = WriteBatch(raw_mode=True)
        self.builders = [producer.create_batch()]

    def add(self, records: Iterable[tuple[bytes, bytes | None]]) -> None:
        batch, builder = self.batch, self.builders[-1]
        for key, value in records:
            if value is None:
                batch.delete(key)
            else:
                batch.put(key, value)
            if builder.append(key=key, value=value, timestamp=None) is None:  # full
                builder = self.producer.create_batch()
                self.builders.append(builder)
                builder.append(key=key, value=value, timestamp=None)

    def sealed(self) -> list[Any]:
        """The record batches that hold records."""
        return [b for b in self.builders if b.record_count()]


def gate_changelog_restore(table: Any) -> Callable[[], None]:
    """Make Faust's restore of the table from its changelog skip events written again
    after later ones (``ChangelogGate``), as the follower does, so that a worker that
    recovers a partition after a zombie owner's resent batch does not load its stale
    entries. Each partition's gate starts from the applied offset its file holds; the
    returned function forgets the gates, for the next recovery."""
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
        restore(list(admitted(batch)), to_key, to_value)

    store.apply_changelog_batch = apply_changelog_batch
    return gates.clear
