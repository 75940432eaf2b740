"""Whole fetched batches of chosen topics go straight to a handler, bypassing Faust's
per-message pipeline.

Why: faust-streaming 0.15.3 spends ~150-190 µs of event-loop CPU per message before an
agent sees it (``Consumer._drain_messages`` races every message against ``suspend_flow``
with ``wait_first``: 4 tasks and an ``asyncio.wait``, ~42 µs; then the conductor, the
stream, the sensors and one ack each), which held a worker to ~3-4k events/s. Here a
fetched batch of a registered topic's partition is handed over as a list of aiokafka
records and acknowledged in bulk; every other topic (the table changelogs during recovery)
takes Faust's own per-message path, unchanged.

Invariants, in the order the drain loop keeps them:

1. A batch is handed over only while Faust would deliver it: the consumer's flow is
   active and the app's flow control is open (waiting for it, as the conductor does,
   unless the flow is suspended meanwhile), the partition is active (not paused for
   recovery), and the consumer generation is the one the batch was fetched in. When a
   rebalance or stop interrupts a fetch, or its partition was paused since, its unhandled
   records are given back (``_BatchDrain.give_back``: the partition seeks back to the
   first of them). Faust drops them and leaves it to its seek to the committed offsets,
   which moves nothing for a partition with no committed offset yet.
2. Records below the partition's read offset were read already and are dropped; offsets
   absent between read records (compaction, transaction markers) are registered as gaps
   with Faust's ``_add_gap``, so commits do not stall on them.
3. A batch's offsets are acknowledged only after the handler returned (the worker's
   returns once the broker acknowledged the batch's changelog records), and only if no
   rebalance began meanwhile (otherwise the records are redelivered; the handler must be
   idempotent under redelivery). Acks follow ``Consumer.ack``:
   only offsets at or above the committed one, each once.
4. While a batch is being handled it counts as an unacknowledged message, so a
   revocation (``wait_empty``) waits for it before Faust flushes the producer and hands
   the partition over; a cancelled drain (shutdown) lets the handler finish.
5. ``broker_commit_every`` is honoured between batches as between messages.

The patch replaces ``Consumer._drain_messages`` of the pinned releases only (``PINNED``:
faust-streaming, and mode-streaming whose ``Service`` internals the consumer and the
fetcher are made of), and only for apps given to ``install``; others keep Faust's original.
``install`` refuses any other installed release, and a consumer whose instance lacks one of
the names in ``CONSUMER_PRIVATE``/``CONSUMER_INTERNALS`` is refused when its drain starts.
Every internal this module touches is listed in ``stream.internals``, with those of the
rest of mmcache, and checked there against the pinned releases.

A zombie owner (a worker frozen past its session timeout whose partitions another worker
took over, then resumed) must not write a batch after the new owner. The batch handler
checks, when a batch arrives, that its partition is still assigned, and right before
writing asks the group coordinator whether the worker is still a member of the generation
the batch came in (``confirm_owner``, ``stream.kafka.coordinator``); when either says no,
the handler raises ``LostMembership``, which stops the worker like any handler failure
(rule 3): nothing of the batch is written or acknowledged, and its supervisor starts it
again from its files (dropping the batch and rejoining in place left the view behind
after the rejoin in one run of the zombie test, so the restart, which was shown to
converge, is the rule). What the check cannot stop (a freeze between the coordinator's
answer and the write, or the producer resending a batch sent just before the freeze) lands
after the successor's records: readers of the changelog skip such events
(``stream.state.store.ChangelogGate``), and the zombie, seeing its batch land after another
writer's records, stops without storing it in its files (``stream.worker.table_mirror``). The
embedded broker supports neither idempotent nor transactional producers; the answers the
check takes as lost are in ``stream.kafka.coordinator``. See
``tests/integration/test_zombie_owner.py``.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Awaitable, Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

import faust
from aiokafka.errors import IllegalStateError
from faust.tables import TableManager
from faust.transport.consumer import CONSUMER_FETCHING, Consumer
from faust.types import TP
from faust.types.tuples import ack_lock
from mode.utils.futures import notify

from stream import internals
from stream.kafka.coordinator import LostMembership, confirm_membership, generation_of, member_of
from stream.kafka.coordinator import check_version as check_coordinator_version

__all__ = ["CONSUMER_INTERNALS", "CONSUMER_PRIVATE", "PINNED", "BatchHandler", "BatchPlan",
           "PromptTableManager", "check_versions", "confirm_owner", "install",
           "committed_offset", "owner_generation", "owner_member", "plan_batch", "seek"]

log = logging.getLogger(__name__)

#: The releases whose internals this module mirrors (of stream.internals' pins); re-read
#: ``faust/transport/consumer.py`` and ``mode/services.py`` to upgrade either.
PINNED = {name: internals.PINNED[name] for name in ("faust-streaming", "mode-streaming")}
FAUST_VERSION = PINNED["faust-streaming"]

#: Every private name of Faust's ``Consumer`` (and of its mode ``Service`` base) this
#: module replaces, calls, reads or writes: stream.internals' entries for the consumer.
CONSUMER_PRIVATE = internals.names(internals.CONSUMER, private=True)
#: The public-looking but undocumented names used besides: the consumer's, the app's
#: (as ``app.<name>``) and the module-level ones imported below. The consumer thread's,
#: the table manager's and the rest are in stream.internals too.
CONSUMER_INTERNALS = (
    *internals.names(internals.CONSUMER, private=False),
    *(f"app.{name}" for name in internals.names(internals.APP)),
    *(f"{entry.owner}.{entry.name}" for entry in internals.INTERNALS
      if entry.used_by == "stream.worker.faust_batches" and entry.is_module),
)

#: ``handler(partition, records)``: records are aiokafka ``ConsumerRecord``s in offset order.
BatchHandler = Callable[[int, Sequence[Any]], Awaitable[None]]

# Faust's drain loop yields to the event loop every 100 messages of the per-message path.
_YIELD_EVERY = 100
#: How often a drain with no active partition looks for one (``wait_for_active_partitions``).
IDLE_POLL_S = 0.01

_handlers: weakref.WeakKeyDictionary[faust.App, dict[str, BatchHandler]] = (
    weakref.WeakKeyDictionary()
)
_original_drain: Callable[..., Awaitable[None]] | None = None


@dataclass
class BatchPlan:
    """What to do with one partition's fetched records."""

    records: list[Any] = field(default_factory=list)
    """The records to hand over: those at or above the read offset, in order."""
    acks: list[int] = field(default_factory=list)
    """Their offsets to acknowledge once handled: at or above the committed offset,
    not acknowledged already."""
    gaps: list[tuple[int, int]] = field(default_factory=list)
    """Inclusive ranges of offsets absent between the read offset and the records."""
    read_offset: int | None = None
    """The partition's read offset once the batch is handled."""


def plan_batch(records: Sequence[Any], read_offset: int | None, committed: int | None,
               acked: Container[int]) -> BatchPlan:
    """Sort one partition's fetched records (each with an ``offset``) as Faust's
    per-message path would.

    ``read_offset`` is Faust's ``_read_offset``: the committed offset after a seek, else
    the last offset read, so a record at it is still taken. Unlike Faust, a gap is
    registered after a read offset of 0 too (Faust tests it for truth), and it holds only
    the absent offsets, not the next record's (whose ack Faust's range would anticipate).
    """
    plan = BatchPlan(read_offset=read_offset)
    previous = read_offset
    for record in records:
        offset = record.offset
        if read_offset is not None and offset < read_offset:
            continue  # read already
        if previous is not None and offset - previous > 1:
            plan.gaps.append((previous + 1, offset - 1))
        plan.records.append(record)
        if (committed is None or offset >= committed) and offset not in acked:
            plan.acks.append(offset)
        previous = offset
    if plan.records:
        plan.read_offset = plan.records[-1].offset
    return plan


def install(app: faust.App, handlers: Mapping[str, BatchHandler]) -> None:
    """Deliver ``app``'s records of these topics to their handlers in whole batches.

    Call before the app starts. The topics must still be subscribed (by an agent), so
    Faust assigns their partitions together with the tables' ones.
    """
    global _original_drain
    check_versions()
    check_coordinator_version()
    missing = [name for name in ("_drain_messages", "_wait_next_records", "_to_message", "_add_gap")
               if not callable(getattr(Consumer, name, None))]
    if missing:
        raise RuntimeError(f"stream.worker.faust_batches: faust's Consumer lacks {missing}")
    _handlers[app] = dict(handlers)
    if _original_drain is None:
        _original_drain = Consumer._drain_messages
        Consumer._drain_messages = _drain_messages  # type: ignore[method-assign]


class PromptTableManager(TableManager):
    """Faust's table manager without the 1 s it sleeps when it starts (its ``on_start``),
    meant for tables still being declared: a worker declares its tables before it
    starts, and the second is a second more of every start to ready. Given to the app as
    its ``TableManager`` setting; the rest of ``on_start`` is Faust's, as pinned."""

    async def on_start(self) -> None:
        """Faust's start of the table manager, less the sleep."""
        if not self.should_stop:
            await self._update_channels()
            await self.recovery.start()


def check_versions(installed: Callable[[str], str] | None = None) -> None:
    """Refuse to patch anything unless every package in ``PINNED`` is at its release."""
    internals.check_versions(installed, "stream.worker.faust_batches", tuple(PINNED))


def owner_generation(app: faust.App) -> int:
    """The consumer group generation this worker is a member of now: taken by the batch
    handler when it starts, for ``confirm_owner``."""
    return generation_of(app.consumer._thread._ensure_consumer())  # type: ignore[attr-defined]


def owner_member(app: faust.App) -> tuple[str, int]:
    """The member id and generation this worker has in its group now (``member_of``)."""
    return member_of(app.consumer._thread._ensure_consumer())  # type: ignore[attr-defined]


async def confirm_owner(app: faust.App, generation: int, tp: TP, *, ask: bool = True,
                        strict: bool = False) -> None:
    """Return once the group coordinator confirmed that this worker is still a member of
    ``generation`` (the one its batch in flight was handed over in) and ``tp`` is still
    assigned to it; raise ``LostMembership`` if not. Called by the batch handler right
    before it writes a batch's changelog records: a zombie owner stops instead of writing
    after the new owner (``stream.kafka.coordinator``). aiokafka's consumer lives on
    Faust's consumer thread, so the question is asked there; ``ask=False`` checks only
    the assignment, which needs no round trip; ``strict`` takes no answer as a no."""
    if tp not in app.consumer.assignment():
        raise LostMembership(f"{tp.topic}[{tp.partition}] is no longer assigned to this worker")
    if not ask:
        return
    thread = app.consumer._thread  # type: ignore[attr-defined]
    await thread.call_thread(confirm_membership, thread._ensure_consumer(), generation, strict)


async def seek(consumer: Any, tp: TP, offset: int) -> None:
    """``Consumer.seek`` with aiokafka's seek run on Faust's consumer thread, where aiokafka
    and its fetcher live: Faust's own calls it from the caller's thread, where it races
    the fetcher over its buffered records and wakes the other thread's loop unsafely."""
    thread = consumer._thread
    await thread.call_thread(thread.seek, tp, offset)
    consumer._read_offset[tp] = offset if offset else None


def committed_offset(consumer: Any, tp: TP) -> int | None:
    """The offset Faust last committed for ``tp`` (``None``: none yet)."""
    return consumer._committed_offset.get(tp)  # type: ignore[no-any-return]


def check_consumer(consumer: Any) -> None:
    """Refuse a consumer instance that lacks a private name this module uses."""
    missing = [name for name in CONSUMER_PRIVATE if not hasattr(consumer, name)]
    missing += [name for name in CONSUMER_INTERNALS
                if "." not in name and not hasattr(consumer, name)]
    missing += [name for name in CONSUMER_INTERNALS
                if name.startswith("app.") and not hasattr(consumer.app, name[4:])]
    if missing:
        raise RuntimeError(f"stream.worker.faust_batches: {type(consumer).__name__} lacks {missing}: "
                           f"not the consumer of faust-streaming {FAUST_VERSION}")


class _BatchInFlight:
    """Stands for a batch being handled among the consumer's unacknowledged messages,
    which ``Consumer.wait_empty`` waits for (its warnings read ``refcount``)."""

    acked = False
    refcount = 1
    abandoned = False  # the drain was cancelled while the handler ran

    def __init__(self, tp: TP, count: int) -> None:
        self.tp = tp
        self.count = count

    def __repr__(self) -> str:
        return f"<batch of {self.count} records of {self.tp}>"


async def _drain_messages(self: Consumer, fetcher: Any) -> None:
    """``Consumer._drain_messages``, with the batch path for the app's chosen topics."""
    handlers = _handlers.get(self.app)
    if handlers is None:
        assert _original_drain is not None
        return await _original_drain(self, fetcher)
    await _BatchDrain(self, handlers).run(fetcher)


class _BatchDrain:
    """One run of the drain loop of one consumer."""

    def __init__(self, consumer: Consumer, handlers: Mapping[str, BatchHandler]) -> None:
        check_consumer(consumer)
        self.consumer = consumer
        self.app = consumer.app
        self.handlers = handlers
        self.generation: int = self.app.consumer_generation_id
        self.since_yield = 0

    def interrupted(self) -> bool:
        """A rebalance or stop began since the current fetch: leave its records."""
        consumer = self.consumer
        return (consumer.suspend_flow.is_set() or not consumer.flow_active
                or self.app.consumer_generation_id != self.generation
                or consumer.should_stop)

    async def run(self, fetcher: Any) -> None:
        consumer = self.consumer
        consumer_stopped = consumer._stopped.is_set  # type: ignore[attr-defined]
        fetcher_stopped = fetcher._stopped.is_set
        diag = consumer.diag  # type: ignore[attr-defined]
        try:
            while not (consumer_stopped() or fetcher_stopped()):
                diag.set_flag(CONSUMER_FETCHING)
                await self.fetch_once()
                diag.unset_flag(CONSUMER_FETCHING)
        except consumer.consumer_stopped_errors:
            if consumer.transport.app.should_stop:
                consumer.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if consumer.transport.app.should_stop:
                consumer.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            consumer.log.exception("Drain messages raised: %r", exc)
            raise
        finally:
            diag.unset_flag(CONSUMER_FETCHING)

    async def fetch_once(self) -> None:
        """One fetch: Faust's ``getmany`` checks, then the batches, then the rest."""
        consumer = self.consumer
        if not await self.wait_for_active_partitions():
            return  # the loop turns, and the stop flags are read again
        records, active = await consumer._wait_next_records(1.0)
        self.generation = self.app.consumer_generation_id
        await consumer.sleep(0)  # as Faust: a fetch loop must release the event loop
        if records is None or consumer.should_stop:
            return
        mine = {tp: batch for tp, batch in records.items() if tp.topic in self.handlers}
        if not consumer.flow_active:
            # as Faust's getmany: records fetched while the flow stopped are dropped and
            # the partitions go back to their committed offsets; ours go back to their
            # first dropped record too, which the committed offset may not reach
            try:
                await consumer.perform_seek()
            except Exception as exc:
                consumer.log.warning(f"exception performing seek when flow not active {exc}")
            await self.give_back(mine)
            return
        others = {tp: batch for tp, batch in records.items() if tp.topic not in self.handlers}
        pending = list(mine.items())
        for index, (tp, batch) in enumerate(pending):
            if self.interrupted():
                await self.give_back(dict(pending[index:]))
                return
            if active is None or tp in active or tp in consumer._buffered_partitions:
                await self.handle_batch(tp, batch, self.handlers[tp.topic])
            else:
                await self.give_back({tp: batch})  # paused since the fetch began
        if others:
            await self.deliver_messages(others, active)

    async def wait_for_active_partitions(self, longest: float = 1.0) -> bool:
        """Wait for the flow to resume, then up to ``longest`` s for a partition to be
        active; return whether one is.

        Faust's ``_wait_next_records`` sleeps a whole second when it finds no active
        partition. At the end of a recovery it resumes the flow a few ms before it resumes
        the partitions, so a drain waiting on the flow woke in between and slept: a
        takeover's first batch waited ~1 s after the partitions were ready. Here the wait
        is polled instead, so the fetch starts within ``IDLE_POLL_S`` of them, and a turn
        that found none active skips Faust's fetch (and its sleep) altogether.
        """
        consumer = self.consumer
        if not consumer.flow_active:
            await consumer.wait(consumer.can_resume_flow)
        loop = asyncio.get_running_loop()
        until = loop.time() + longest
        while not consumer._get_active_partitions():
            # a poll before every answer: a stopping or crashed consumer must not make the
            # drain loop call again without the event loop ever turning
            await asyncio.sleep(IDLE_POLL_S)
            if consumer.should_stop or loop.time() >= until:
                return bool(consumer._get_active_partitions())
        return True

    async def give_back(self, batches: Mapping[TP, Sequence[Any]]) -> None:
        """Seek each partition back to the first of its fetched records that no handler
        got, so that a later fetch delivers them again.

        Faust's getmany drops such records: those of a partition paused since the fetch
        began with no seek at all, those fetched while the flow stopped with a seek to
        the committed offsets, which moves nothing for a partition with no committed
        offset yet (aiokafka seeks only to an offset above 0). Either way they were never
        delivered: a survivor that took over a dead owner's partitions skipped their first
        events so (fetched as its recovery paused them) and never applied them. A
        partition no longer assigned is left alone: its next owner starts from its
        committed offset.
        """
        consumer = self.consumer
        for tp, records in batches.items():
            if not records:
                continue
            try:
                await seek(consumer, tp, records[0].offset)
            except IllegalStateError:
                pass  # not assigned any more
            except Exception as exc:  # noqa: BLE001 - as Faust's own seek on this path
                consumer.log.warning("could not seek %s back to %d: %r", tp, records[0].offset, exc)

    async def handle_batch(self, tp: TP, records: Sequence[Any], handler: BatchHandler) -> None:
        consumer, app = self.consumer, self.app
        if not app.flow_control.is_active():
            # the conductor would wait in flow_control.acquire, given up on a suspend
            await consumer.wait_first(app.flow_control.acquire(), consumer.suspend_flow.wait())
            if self.interrupted() or not app.flow_control.is_active():
                await self.give_back({tp: records})
                return
        await self.maybe_commit()
        if self.interrupted():
            await self.give_back({tp: records})
            return
        plan = plan_batch(records, consumer._read_offset[tp], consumer._committed_offset[tp],
                          consumer._acked_index[tp])
        if not plan.records:
            return
        app.monitor.track_tp_end_offset(tp, consumer.highwater(tp))
        app.monitor.stream_inbound_time[tp] = monotonic()  # for Faust's livelock warnings
        await self.run_handler(tp, plan.records, handler)
        if self.interrupted():
            return  # revoked meanwhile: redelivered after the rebalance
        if app.topics.acks_enabled_for(tp.topic):
            for first, last in plan.gaps:
                await consumer._add_gap(tp, first, last)
            if self.interrupted():
                return  # a revocation began while the gaps were added
            self.ack(tp, plan.acks)
        consumer._read_offset[tp] = plan.read_offset
        await asyncio.sleep(0)  # let requests in between batches

    async def run_handler(self, tp: TP, records: Sequence[Any], handler: BatchHandler) -> None:
        """Run the handler as an unacknowledged message; if the drain is cancelled, the
        handler still finishes (before ``wait_empty`` lets Faust go on)."""
        consumer = self.consumer
        in_flight = _BatchInFlight(tp, len(records))
        consumer._unacked_messages.add(in_flight)  # type: ignore[arg-type]
        task = asyncio.ensure_future(handler(tp.partition, records))

        def done(task: asyncio.Future[None]) -> None:
            in_flight.acked = True
            consumer._unacked_messages.discard(in_flight)  # type: ignore[arg-type]
            notify(consumer._waiting_for_ack)
            if in_flight.abandoned and not task.cancelled() and task.exception() is not None:
                log.error("batch handler failed after the drain was cancelled",
                          exc_info=task.exception())

        task.add_done_callback(done)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and current is not None and not current.cancelling():
                # the handler itself was cancelled, not the drain: Faust's fetcher would
                # swallow the cancellation and stop consuming, so fail loudly instead
                raise RuntimeError(f"the batch handler of {tp} was cancelled") from None
            in_flight.abandoned = not task.done()
            raise

    def ack(self, tp: TP, offsets: list[int]) -> None:
        """``Consumer.ack`` for a handled batch's offsets, at once."""
        if not offsets:
            return
        consumer = self.consumer
        with ack_lock:
            consumer._acked_index[tp].update(offsets)
            consumer._acked[tp].extend(offsets)
            consumer._n_acked += len(offsets)
        notify(consumer._waiting_for_ack)

    async def maybe_commit(self) -> None:
        consumer = self.consumer
        commit_every = consumer._commit_every
        if commit_every is not None and consumer._n_acked >= commit_every:
            consumer._n_acked = 0
            await consumer.commit()

    async def deliver_messages(self, records: Mapping[TP, list[Any]], active: Any) -> None:
        """Faust's per-message path (``getmany`` and the drain loop) for other topics."""
        consumer, app = self.consumer, self.app
        acks_enabled_for = app.topics.acks_enabled_for
        for tp, record in consumer.scheduler.iterate(records):
            if not consumer.flow_active or app.consumer_generation_id != self.generation:
                break
            if not (active is None or tp in active or tp in consumer._buffered_partitions):
                continue
            app.monitor.track_tp_end_offset(tp, consumer.highwater(tp))
            message = consumer._to_message(tp, record)
            self.since_yield += 1
            if self.since_yield > _YIELD_EVERY:
                await asyncio.sleep(0)
                self.since_yield = 0
            offset = message.offset
            read_offset = consumer._read_offset[tp]
            if read_offset is not None and offset < read_offset:
                continue  # read already
            if read_offset and offset - read_offset > 1 and acks_enabled_for(message.topic):
                await consumer._add_gap(tp, read_offset + 1, offset)
            await self.maybe_commit()
            await consumer.wait_first(consumer.callback(message), consumer.suspend_flow.wait())
            consumer._read_offset[tp] = offset
