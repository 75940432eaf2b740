"""`serve`'s own embedded broker, its kept log and journal, and the rebase that bounds
the broker's memory while it runs.

Tansu's memory storage frees nothing (no compaction, no retention, no ``DeleteRecords``):
left alone, the broker would hold every record written since its start. So once the
journal has written ``rebase_bytes`` to the kept log since the last (re)start, the
broker is started again on the compacted log, which is what a start does
(``stream.kafka.log_cleaner``), without stopping `serve`:

1. writes are held (each waits within its own time budget: a rebase longer than
   ``--produce-timeout-s`` answers 503 to the writes it held, never loses one);
2. the worker is settled: every event on the log applied, its changelog flushed, and the
   journal holds everything the broker holds;
3. the journal and the broker are stopped; the kept log is compacted (tombstones kept
   above the offsets the live table files hold); a new broker is started on the same
   port with the same cluster id and given the log at its own offsets; a new journal
   starts; writes go on.

Records keep their offsets, so every client of the broker (Faust's consumer and producer,
the follower, the probe, the publisher) reconnects to "the same" log: the group is joined
again (the new broker has no group), and the consumer, whose committed offsets are gone,
starts at the first record the broker holds, at or after what the view has applied.
`/v1/match` answers from the view throughout.

A damaged kept log (``CorruptLog``: a bad record with whole ones after it) does not heal:
a rebase or recovery that meets it leaves the broker stopped and the files as they were,
keeps the error (``EmbeddedCluster.damaged``, said by ``problem``) and is not tried again;
matches are answered, writes get 503, until the operator stops `serve` and repairs the file.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from aiokafka.errors import KafkaError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from stream.kafka.embedded import EmbeddedBroker
from stream.kafka.embedded_log import AppliedAt, CorruptLog, EmbeddedLog, Journal, RestoreFailed
from stream.kafka.log_cleaner import Admit, Retention, compact_apart, now_ms

__all__ = ["EmbeddedCluster", "RebasedWorker"]

log = logging.getLogger(__name__)

#: How long a rebase may hold writes waiting for the worker and the journal to settle.
SETTLE_S = 5.0
#: How long the worker gets to join its group again on the new broker (writes held).
REJOIN_S = 30.0
#: Tries at giving the log back to a new broker before a rebase gives up.
RESTART_ATTEMPTS = 3


class RebasedWorker(Protocol):
    """What a rebase needs of the worker on the broker."""

    def hold_writes(self) -> AbstractAsyncContextManager[None]:
        """Hold new writes until the context ends; enter once none is in flight."""

    async def settle(self, ends: dict[int, int]) -> None:
        """Return once every event below ``ends`` (per partition) is applied and every
        batch's records are sent and acknowledged (no batch is being handled)."""

    def tombstones_through(self, partition: int) -> int:
        """The changelog offset the partition's live table file holds (-1: unknown)."""

    def member(self) -> object:
        """Who the worker is in its consumer group now."""

    async def rejoined(self, before: object) -> None:
        """Return once the worker is a member again, other than ``before``, with all its
        partitions."""


class EmbeddedCluster:
    """The broker child, its kept log's files and the journal that fills them; the
    journal's calls (``wait_stored``, ``problem``, ``drain``) go to the current one."""

    def __init__(self, broker: EmbeddedBroker, files: EmbeddedLog, topics: list[str],
                 retention: Retention, applied_at: AppliedAt, admit: Admit) -> None:
        self.broker = broker
        self.files = files
        self.topics = topics
        self.retention = retention
        self.applied_at = applied_at
        self.admit = admit
        self.journal: Journal | None = None
        self.rebases = 0
        self.last_rebase_s: float | None = None
        self.in_progress = False
        self._rebasing = False
        #: The damage a rebase met (the broker is left stopped; nothing is tried again).
        self.damaged: CorruptLog | None = None

    def start_journal(self) -> Journal:
        """Start tailing the broker into the files (``Journal``)."""
        self.journal = Journal(self.files, self.broker.bootstrap_servers, self.topics).start()
        return self.journal

    def collect(self) -> Iterator[Metric]:
        """``mmcache_embedded_log_appended_bytes``, ``mmcache_embedded_rebases_total``,
        ``mmcache_embedded_rebase_in_progress`` and ``mmcache_embedded_rebase_last_seconds``
        (a prometheus_client collector: register it on the service's registry)."""
        yield GaugeMetricFamily("mmcache_embedded_log_appended_bytes", "Bytes the journal wrote to "
                                "the embedded broker's kept log since the broker last started",
                                value=self.appended_bytes())
        yield CounterMetricFamily("mmcache_embedded_rebases", "Times the embedded broker was "
                                  "started again on its compacted log while serve ran",
                                  value=self.rebases)
        yield GaugeMetricFamily("mmcache_embedded_rebase_in_progress", "1 while a rebase holds "
                                "writes, else 0", value=1 if self.in_progress else 0)
        yield GaugeMetricFamily("mmcache_embedded_rebase_last_seconds", "How long the last "
                                "rebase held writes (0: none yet)", value=self.last_rebase_s or 0.0)

    def appended_bytes(self) -> int:
        """Bytes written to the kept log since the broker last started with it."""
        return 0 if self.journal is None else self.journal.appended_bytes

    async def wait_stored(self, topic: str, positions: list[tuple[int, int]]) -> None:
        """The current journal's ``Journal.wait_stored``."""
        if self.damaged is not None:
            raise OSError(self._damage())
        if self.journal is None:
            raise OSError("the embedded broker's log is not kept right now")
        await self.journal.wait_stored(topic, positions)

    def problem(self) -> str | None:
        """The current journal's ``Journal.problem`` (none while a rebase swaps it), or
        the damage a rebase met, in one line."""
        if self.damaged is not None:
            return self._damage()
        if self._rebasing:
            return None
        if self.journal is None:
            return "the embedded broker's log is not kept: its journal is not running"
        return self.journal.problem()

    def _damage(self) -> str:
        return (f"the embedded broker's kept log is damaged, so the broker was not started again "
                f"after a rebase; matches are answered, writes get 503 and nothing is tried again "
                f"until serve is stopped and the file repaired: {self.damaged}")

    def drain(self, timeout: float) -> bool:
        """The current journal's ``Journal.drain``."""
        return self.journal is not None and self.journal.drain(timeout)

    def stop(self) -> None:
        """Stop the journal, then the broker."""
        if self.journal is not None:
            self.journal.stop()
        self.broker.stop()

    async def rebase(self, worker: RebasedWorker, settle_s: float = SETTLE_S) -> bool:
        """Start the broker again on the compacted log (the module's steps); False (and
        nothing changed) when the worker or the journal did not settle within
        ``settle_s`` (writes are held that long at most: the caller tries again later).
        ``CorruptLog`` (kept in ``damaged``): the broker is left stopped, the files as they
        were; not to be tried again."""
        self.in_progress = True
        try:
            return await self._rebase(worker, settle_s)
        finally:
            self.in_progress = False

    async def _rebase(self, worker: RebasedWorker, settle_s: float) -> bool:
        started = time.monotonic()
        steps: dict[str, float] = {}

        def step(name: str) -> None:
            steps[name] = time.monotonic()

        async with worker.hold_writes():
            step("writes held")
            journal = self.journal
            assert journal is not None
            events = self._events_topic()
            try:
                async with asyncio.timeout(settle_s):
                    # the log's end is fixed now (writes held): the files reach it, then the
                    # worker applies up to it and writes all its batches' records, which the
                    # files reach in turn
                    await self._drained(journal, settle_s)
                    ends = {p: end for (topic, p), end in journal.stored_offsets().items()
                            if topic == events}
                    await worker.settle(ends)
                    await self._drained(journal, settle_s)
            except TimeoutError:
                log.warning("embedded broker rebase put off: the worker or the journal did not "
                            "settle within %.0f s (writes were held meanwhile)", settle_s)
                return False
            step("worker settled")
            member = worker.member()
            self._rebasing = True
            try:
                journal.stop()
                self.journal = None
                self.broker.fixed_cluster_id = self.broker.cluster_id  # "the same" cluster
                # its log is all in the files: no need to wait for its clients to go (Tansu
                # waits for open connections on SIGTERM, ~5 s)
                self.broker.stop(timeout=0.1)
                step("broker stopped")
                try:
                    plans = await asyncio.to_thread(compact_apart, self.files, self.applied_at, self.admit,
                                                    worker.tombstones_through, self.retention, now_ms())
                    step("log compacted")
                    restored = await self._restart_broker(plans)
                except CorruptLog as exc:
                    self.damaged = exc
                    raise
                step("log restored, journal started")
            finally:
                self._rebasing = False
            # a batch fetched in the old group's generation would be taken for a zombie's
            try:
                await asyncio.wait_for(worker.rejoined(member), REJOIN_S)
                step("group joined again")
            except TimeoutError:
                log.warning("after the embedded broker's rebase the worker did not join its group "
                            "again within %.0f s; writes go on", REJOIN_S)
        self.rebases += 1
        self.last_rebase_s = time.monotonic() - started
        split, before = [], started
        for name, at in steps.items():
            split.append(f"{name} +{at - before:.2f} s")
            before = at
        log.info("embedded broker started again on its compacted log in %.2f s (%s; %s); writes go on",
                 self.last_rebase_s, ", ".join(split),
                 ", ".join(f"{topic} {n} records" for topic, n in restored.items()))
        return True

    async def recover(self) -> None:
        """After a rebase that could not start the broker again: start it on the files
        (whole: compaction only renames whole files over them) and its journal. Not after
        damage (``damaged``): it does not heal; ``CorruptLog`` is kept there too."""
        if self.journal is not None or self.damaged is not None:
            return
        try:
            plans = await asyncio.to_thread(compact_apart, self.files, self.applied_at, self.admit,
                                            lambda partition: -1, self.retention, now_ms())
            await self._restart_broker(plans)
        except CorruptLog as exc:
            self.damaged = exc
            raise
        log.warning("the embedded broker runs again on its kept log; writes go on")

    async def _restart_broker(self, plans: dict[tuple[str, int], Any]) -> dict[str, int]:
        """A new broker on the same port given ``plans`` and a new journal; a failed try
        (a client of the old broker that got in first) is made again on a fresh broker."""
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            await asyncio.to_thread(self.broker.start)
            try:
                restored = await self.files.restore(self.broker.bootstrap_servers, plans)
            except (RestoreFailed, OSError, KafkaError) as exc:
                self.broker.stop(timeout=0.1)
                if attempt == RESTART_ATTEMPTS:
                    raise RuntimeError(f"the embedded broker could not be given its log back: "
                                       f"{exc}") from None
                log.warning("embedded broker: giving its log back failed (%s); trying again", exc)
                continue
            await asyncio.to_thread(self.start_journal)
            return restored
        raise AssertionError("unreachable")

    async def _drained(self, journal: Journal, timeout_s: float) -> None:
        if not await asyncio.to_thread(journal.drain, timeout_s):
            raise TimeoutError

    def _events_topic(self) -> str:
        return next(str(spec["applied_offsets_of"]) for spec in self.files.topics().values()
                    if spec.get("applied_offsets_of"))
