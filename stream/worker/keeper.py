"""The agent's logic: each record of the event topic folded into the view (the same rule
as ``rebuild``, ``stream.core.admission``), mirrored to the store, or dead-lettered; and the
reload of owned partitions from their stores after a recovery.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from stream.core.admission import Applied, Rejected, fold_record
from stream.core.cache import CacheState, Effects
from stream.core.events import EngineEventsReported, Event
from stream.kafka.dead_letters import DeadLetter
from stream.metrics import Metrics
from stream.state.preload import LocalPreload
from stream.state.view_load import freeze_the_view, load_partition_into_view
from stream.worker.table_mirror import Mirror
from stream.worker.view_marks import ViewMarks, file_mark

__all__ = ["APPLY_SLICE", "DeadLetterSink", "StateKeeper"]

#: Records applied between two turns of the event loop (~25 us an event: a few ms).
APPLY_SLICE = 128
#: Store records (entries written or removed) after which a slice ends, with the event that
#: reached it, whatever its count of events: 128 reports each clearing a full 8,192-entry
#: engine view make 1M records (~1 s) in one slice of ``APPLY_SLICE`` events.
APPLY_SLICE_RECORDS = 8192

# the reasons the older ``mmcache_malformed_events_total`` counts too
_MALFORMED = frozenset({"not_json", "bad_schema", "unknown_version"})

log = logging.getLogger(__name__)


def _record_count(effects: Effects, event: Event) -> int:
    """How many store records one applied event makes, the applied offset's aside: one
    per change, and one per entry of an engine view a deletion or a sync dropped (only
    those carry ``removed``: a report's changes are not walked)."""
    count = len(effects.upserts) + len(effects.removals) + len(effects.engine)
    if not isinstance(event, EngineEventsReported):
        for change in effects.engine:
            count += len(change.removed)
    return count


class DeadLetterSink(Protocol):
    """Where the keeper puts the records it skips (a ``DeadLetterWriter``, or a list)."""

    def add(self, letter: DeadLetter) -> None:
        """Keep one letter until the batch is flushed."""


class _Letters(list[DeadLetter]):
    """The letters of a keeper without a writer (tests, tools): kept in a list."""

    def add(self, letter: DeadLetter) -> None:
        self.append(letter)


class StateKeeper:
    """The agent's logic: fold a record into the view (``stream.core.admission``, the same rule
    as ``rebuild``), mirror it to the store, dead-letter and count what is skipped.

    ``partitions`` is the event topic's partition count, against which an endpoint's
    key partition is checked.
    """

    def __init__(self, state: CacheState, mirror: Mirror, metrics: Metrics,
                 partitions: int = 1, dead_letters: DeadLetterSink | None = None,
                 marks: ViewMarks | None = None) -> None:
        self.state = state
        self.mirror = mirror
        self.metrics = metrics
        self.partitions = partitions
        self.dead_letters: DeadLetterSink = dead_letters if dead_letters is not None else _Letters()
        self.marks = marks if marks is not None else ViewMarks()
        self._rejected: dict[str, int] = {}

    @property
    def view_is_stored(self) -> bool:
        """Whether the view holds nothing its store lacks: not so once a fold failed
        part-way (``apply_failed``), whose changes are not mirrored."""
        return "apply_failed" not in self._rejected

    def apply_batch(self, partition: int, records: Iterable[Any],
                    records_per_slice: int | None = None) -> int:
        """Apply fetched records (with ``offset``, ``key`` and ``value``) of one partition,
        in order; one that is not applied is dead-lettered, counted and skipped, its offset
        applied all the same. Applied and redelivered events are counted once a batch (a
        labelled counter's increment per event was ~4% of the worker's ingest time).

        Returns how many it took: all, or with ``records_per_slice`` those up to the one
        whose store records (``stream.state.store.effect_records``) reached that many."""
        state, mirror, partitions = self.state, self.mirror, self.partitions
        applied: dict[str, int] = {}
        redelivered = taken = made = 0
        try:
            for record in records:
                taken += 1
                offset = record.offset
                outcome = fold_record(state, partition, offset, record.key, record.value, partitions)
                if outcome is None:
                    redelivered += 1
                elif type(outcome) is Applied:
                    effects = outcome.effects
                    mirror.write(partition, effects, offset)
                    kind = outcome.event.type
                    applied[kind] = applied.get(kind, 0) + 1
                    if records_per_slice is not None:
                        made += _record_count(effects, outcome.event)
                        if made >= records_per_slice:
                            break
                else:
                    self._reject(partition, record, outcome)
        finally:
            for kind, count in applied.items():
                self.metrics.events.labels(kind).inc(count)
            if redelivered:
                self.metrics.redelivered.inc(redelivered)
        return taken

    async def apply_in_slices(self, partition: int, records: Sequence[Any]) -> None:
        """``apply_batch`` of ``APPLY_SLICE`` records at a time, or fewer when their store
        records reach ``APPLY_SLICE_RECORDS``, the loop turning in between (a few ms a
        slice), so that requests never wait behind a large batch."""
        start = 0
        while start < len(records):
            if start:
                await asyncio.sleep(0)
            start += self.apply_batch(partition, records[start:start + APPLY_SLICE],
                                      APPLY_SLICE_RECORDS)

    def _reject(self, partition: int, record: Any, outcome: Rejected) -> None:
        """Dead-letter a record that is not applied, count it, and log the first ones."""
        offset = record.offset
        self.dead_letters.add(DeadLetter(partition, offset, record.key, record.value, outcome.reason))
        self.mirror.write(partition, Effects(), offset)
        self.metrics.dead_letters.labels(outcome.reason).inc()
        if outcome.reason in _MALFORMED:
            self.metrics.malformed.inc()
        seen = self._rejected[outcome.reason] = self._rejected.get(outcome.reason, 0) + 1
        if seen <= 10 or seen % 1000 == 0:  # a misconfigured producer must not flood the log
            log.warning("dead-lettered record at partition %d offset %d (%s, %d so far): %s",
                        partition, offset, outcome.reason, seen, outcome.detail)

    async def reload(self, partitions: dict[int, Any], preload: LocalPreload | None = None) -> None:
        """Make these partitions' part of the view their stores' durable entries (the
        other partitions' part is kept in step by the ``ChangelogFollower``).

        A finished ``preload`` (of a worker's first start) is taken in first (unless it
        was before the group join, ``LocalPreload.merge_into``): its
        partitions that are owned and unchanged since it read them are not read again;
        nor are those the view already holds as their files do (``ViewMarks``: owned
        before, or followed to where the recovery brought the file); the others are
        replaced from their stores. Each partition goes through
        ``load_partition_into_view``: the entries it held keep answering until replaced,
        and the loop turns between slices; Faust applies no event of these partitions
        until this returns. The collector is off meanwhile: its full passes over the
        growing view took 70-90 ms each.
        """
        gc.disable()
        loaded: list[int] = []
        try:
            reused: set[int] = set()
            if preload is not None and (preload.state is not None or preload.merged):
                preload.merge_into(self.state)
                reused = {p for p, db in partitions.items() if preload.unchanged(p, db)}
            for partition, db in partitions.items():
                through = file_mark(db)
                held = self.view_is_stored and self.marks.holds(partition, through)
                self.marks.forget(partition)
                if partition not in reused and not held:
                    await load_partition_into_view(self.state, partition, db.items())
                    loaded.append(partition)
                self.marks.set(partition, through)
        finally:
            if preload is not None:  # a worker's first start: its preload's entries are
                freeze_the_view()  # long-lived too (each partition read froze its own)
            gc.enable()
        log.info("state loaded: %d endpoints from partitions %s (read from the files: %s)",
                 len(self.state.lrus.endpoints), sorted(partitions), sorted(loaded))
