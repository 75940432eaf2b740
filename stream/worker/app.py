"""Wiring of one `mmcache serve` process: the Faust app, its agent and table, the HTTP API.

Data flow: HTTP writes -> event topic (partitioned by endpoint) -> Faust's consumer, whole
fetched batches (``stream.worker.faust_batches``) -> ``StateKeeper`` (``stream.worker.keeper``: the
pure fold) -> in-memory view for ``/v1/match`` and, entry by entry, the Faust table's
RocksDB files and compacted changelog (``stream.worker.table_mirror``), from which any worker
recovers. After every recovery (start, rebalance) each owned partition the view does not
already hold as its file does (``stream.worker.view_marks``) is loaded from the table, and
the others are followed from the changelog (``stream.worker.follower``), both through
``stream.state.view_load``, so the view answers for every endpoint throughout;
``stream.worker.readiness`` tells ``/readyz`` and ``/metrics`` how far it lags the log
(``stream.kafka.log_probe``). Nothing here holds logic of its own.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import faust
import mode
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import IllegalStateError
from faust.types import TP

from stream import allocator
from stream.config import Settings
from stream.core.cache import CacheState
from stream.http.api import HttpApi
from stream.http.auth import open_token_file
from stream.http.server import HttpServer, tls_context
from stream.kafka import fetch_gate
from stream.kafka.clients import client_options, faust_credentials
from stream.kafka.dead_letters import DeadLetterWriter
from stream.kafka.embedded_log import CorruptLog
from stream.kafka.log_probe import EventLogProbe
from stream.kafka.publisher import EventPublisher
from stream.kafka.rebase import EmbeddedCluster, RebasedWorker
from stream.kafka.topics import ensure_dead_letter_topic
from stream.metrics import Metrics
from stream.state.datadir import TABLE_NAME, DataDir
from stream.state.preload import LocalPreload
from stream.worker.faust_batches import (
    PromptTableManager,
    committed_offset,
    confirm_owner,
    owner_generation,
    owner_member,
    seek,
)
from stream.worker.faust_batches import install as install_batch_path
from stream.worker.follower import ChangelogFollower
from stream.worker.keeper import StateKeeper
from stream.worker.readiness import Readiness
from stream.worker.stall_watch import StallWatch
from stream.worker.table_mirror import (
    MappingMirror,
    Mirror,
    StateNotStored,
    StateWrites,
    TableMemory,
    TableMirror,
    gate_changelog_restore,
    refuse_unwritable_state,
)
from stream.worker.view_marks import ViewMarks

__all__ = ["ChangelogFollower", "HttpService", "MappingMirror", "Mirror", "StateKeeper",
           "StartTask", "TABLE_FILE_OPTIONS", "TableMirror", "build_worker", "faust_settings",
           "lru_table", "rewind_stalled"]

# Events reach the handler in whole fetched batches (stream.worker.faust_batches) of at most
# MAX_POLL_RECORDS over all partitions; each partition's batch costs two round trips
# (the ownership check, the changelog's ack), so larger batches apply more events a
# second (one worker from a full topic: ~23k events/s at 1,000, ~30k at 4,000, no more
# at 10,000); the keeper applies them in slices, the loop turning in between.
MAX_POLL_RECORDS = 4000
# How often a restart looks for the log's end read after its preload (a probe sample).
PROBE_POLL_S = 0.02

# RocksDB's memory for the table, per partition file, bounded on purpose. Faust's defaults
# (write buffers of 64 MiB, up to 3 of them, and a 2 GiB block cache, each per file) let
# serve's RSS climb with the writes between flushes, by hundreds of MiB on 8 partitions,
# whatever the live state. The view is held in memory and the files are read at start only,
# so a small cache costs nothing; smaller buffers cost more frequent flushes. At most
# 2 x 8 + 8 MiB a partition: 192 MiB on the default 8 (tests/integration/test_table_memory.py).
TABLE_FILE_OPTIONS = {
    "write_buffer_size": 8 * 2**20,
    "max_write_buffer_number": 2,
    "block_cache_size": 8 * 2**20,
}

log = logging.getLogger(__name__)

#: After a rebase put off or failed, the next is tried this long after (doubling each time).
REBASE_RETRY_S = 30.0
REBASE_RETRY_MAX_S = 600.0


class StartTask(mode.Service):
    """Runs one coroutine from the worker's start, before the group join (Faust starts its
    own app tasks only once the table recovery is complete)."""

    def __init__(self, task: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._task = task

    async def on_start(self) -> None:
        """Start the coroutine; it is cancelled when the worker stops."""
        self.add_future(self._task())


class _RebasedWorker:
    """The worker as a rebase of the embedded broker sees it (``stream.kafka.rebase``)."""

    def __init__(self, app: faust.App, publisher: EventPublisher, state: CacheState,
                 lag: Callable[[], dict[int, int]], partitions: int,
                 persisted_offset: Callable[[int], int | None]) -> None:
        self.app = app
        self.publisher = publisher
        self.state = state
        self.lag = lag
        self.partitions = partitions
        self.persisted_offset = persisted_offset
        self.batches = 0  # event batches being handled (applied, written, acknowledged)

    def hold_writes(self) -> AbstractAsyncContextManager[None]:
        return self.publisher.held()

    async def settle(self, ends: dict[int, int]) -> None:
        applied = self.state.lrus.applied
        while self.batches or any(applied.get(p, -1) < end - 1 for p, end in ends.items()):
            await asyncio.sleep(0.02)
        await self.app.producer.flush()

    def tombstones_through(self, partition: int) -> int:
        try:
            held = self.persisted_offset(partition)
        except Exception:  # noqa: BLE001 - kept, for the next start's compaction
            return -1
        return -1 if held is None else int(held)

    def member(self) -> object:
        return owner_member(self.app)

    async def rejoined(self, before: object) -> None:
        while True:
            member, generation = owner_member(self.app)
            lag = self.lag()
            if ((member, generation) != before and member and generation != -1
                    and len(lag) == self.partitions and not any(lag.values())):
                return
            await asyncio.sleep(0.05)


class RebaseService(mode.Service):
    """Starts the embedded broker again on its compacted log whenever the journal has
    written ``every_bytes`` since the broker's last start (``stream.kafka.rebase``); a
    rebase put off or failed is tried again later, each time after twice the wait; one that
    met a damaged log (``CorruptLog``) is not: the operator must act (``problem`` says so)."""

    def __init__(self, cluster: EmbeddedCluster, every_bytes: int, worker: RebasedWorker,
                 check_s: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cluster = cluster
        self.every_bytes = every_bytes
        self.worker = worker
        self.check_s = check_s

    async def on_start(self) -> None:
        """Watch the journal's bytes; it is cancelled when the worker stops."""
        if self.every_bytes != -1:
            self.add_future(self._watch())

    async def _watch(self) -> None:
        backoff = REBASE_RETRY_S
        while True:
            await asyncio.sleep(self.check_s)
            try:
                if self.cluster.journal is None:  # a rebase could not start the broker again
                    await self.cluster.recover()
                    continue
                if self.cluster.appended_bytes() < self.every_bytes:
                    continue
                if await self.cluster.rebase(self.worker):
                    backoff = REBASE_RETRY_S
                    continue
            except CorruptLog as exc:  # damage does not heal: nothing is tried again
                log.error("the embedded broker was not started again on its kept log, and will not "
                          "be: %s", exc)
                return
            except Exception:  # writes get 503 and /readyz says why until it is recovered
                log.exception("the embedded broker could not be started again on its compacted log")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, REBASE_RETRY_MAX_S)


class HttpService(mode.Service):
    """Runs the HTTP API (``stream.http.server``, on this process's loop, over TLS when
    given a context) and the event publisher next to the Faust app."""

    def __init__(self, api: HttpApi, host: str, port: int, tls: ssl.SSLContext | None = None,
                 listening: Callable[[], list[socket.socket] | None] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.api = api
        self.host = host
        self.port = port
        self.tls = tls
        self.listening = listening  # the socket serve bound at start (stream.http.starting)
        self._server: HttpServer | None = None

    async def on_start(self) -> None:
        """Serve HTTP first, so /healthz and /readyz answer during recovery."""
        await self.api.publisher.start()
        self._server = self.api.server()
        await self._server.start(self.host, self.port, self.tls,
                                 sock=None if self.listening is None else self.listening())
        writes, matches = self.api.write_tokens, self.api.match_tokens
        log.info("HTTP API on %s://%s:%d (not ready yet: loading the view; /readyz says when); "
                 "auth for writes and /v1/state: %s; auth for /v1/match: %s",
                 "https" if self.tls else "http", self.host, self.port,
                 f"on ({len(writes)} tokens)" if writes else "off",
                 f"on ({len(matches)} tokens)" if matches else "off")

    async def on_stop(self) -> None:
        """Stop taking requests (those in flight finish), then flush the publisher."""
        if self._server is not None:
            await self._server.close()
        await self.api.publisher.stop()


def faust_settings(settings: Settings, bootstrap_servers: str, embedded: bool) -> dict[str, Any]:
    """Faust configuration; group timings tuned to how fast the broker forms groups."""
    timings = (
        # Tansu answers joins after about half the session timeout (README, "The embedded broker").
        {"broker_session_timeout": 2.0, "broker_heartbeat_interval": 0.5,
         "broker_rebalance_timeout": 20.0, "broker_commit_interval": 0.5}
        if embedded
        else {"broker_session_timeout": 10.0, "broker_heartbeat_interval": 1.0,
              "broker_rebalance_timeout": 60.0, "broker_commit_interval": 1.0}
    )
    return {
        "broker": f"kafka://{bootstrap_servers}",
        "broker_credentials": faust_credentials(settings.kafka),
        "store": "rocksdb://",
        "datadir": str(settings.data_dir),
        "web_enabled": False,
        "key_serializer": "raw",
        "value_serializer": "raw",
        "producer_acks": -1,
        # the changelog's records go out as whole record batches built by TableMirror, so a
        # linger only delays them: and every millisecond a sent batch waits to be written
        # is a window in which a frozen, then resumed, owner writes after its successor
        # (stream.kafka.coordinator)
        "producer_linger": 0.0,
        "producer_max_batch_size": 1024 * 1024,
        "consumer_auto_offset_reset": "earliest",
        "broker_max_poll_records": MAX_POLL_RECORDS,
        "table_standby_replicas": 0,
        "topic_disable_leader": True,
        "autodiscover": False,
        "TableManager": PromptTableManager,  # no 1 s sleep at start (stream.worker.faust_batches)
        "topic_replication_factor": settings.replication_factor or 1,
        **timings,
    }


async def rewind_stalled(app: faust.App, topic: str, applied: Mapping[int, int],
                         watch: StallWatch, now: float) -> list[int]:
    """Outside rebalances, fetch again each owned partition of ``topic`` that ``watch``
    finds stalled (behind the log's end, applied offset unmoved: ``stream.worker.stall_watch``)
    from the view's applied offset, or from the committed offset when that is lower (a
    batch handled but not acknowledged before a rebalance: its offsets must come again to
    be acknowledged); return those partitions. A rebalance starts the watch afresh."""
    consumer = app.consumer
    if app.rebalancing or not consumer.flow_active:
        watch.reset()
        return []
    figures = {}
    for tp in consumer.assignment():
        end = consumer.highwater(tp) if tp.topic == topic else None
        if end is not None:
            figures[tp.partition] = (applied.get(tp.partition, -1), end)
    stalled = watch.stalled(figures, now)
    for partition in stalled:
        done, end = figures[partition]
        tp = TP(topic, partition)
        committed = committed_offset(consumer, tp)
        offset = done + 1 if committed is None else min(done + 1, committed)
        log.warning("partition %d: %d events on the log not applied for %.0f s: fetching them "
                    "again from offset %d", partition, end - done - 1, watch.after_s, offset)
        try:
            await seek(consumer, tp, offset)
        except IllegalStateError:
            pass  # revoked meanwhile: its next owner starts from the committed offset
    return stalled


def lru_table(app: faust.App, partitions: int) -> Any:
    """The LRU table, its partition files opened with ``TABLE_FILE_OPTIONS``."""
    return app.Table(TABLE_NAME, key_type=bytes, value_type=bytes, partitions=partitions,
                     options=TABLE_FILE_OPTIONS)


def build_worker(
    settings: Settings, bootstrap_servers: str, partitions: int, *, embedded: bool,
    preload: LocalPreload | None = None,
    embedded_cluster: EmbeddedCluster | None = None,
    listening: Callable[[], list[socket.socket] | None] | None = None,
) -> tuple[faust.Worker, StateKeeper]:
    """Assemble the Faust worker with the HTTP service, the changelog follower and the
    event log probe, and return it with its keeper (which holds the view); nothing has
    started yet (but the ``preload`` of the local state, which the first recovery takes in)."""
    app = faust.App(settings.app_id, **faust_settings(settings, bootstrap_servers, embedded))
    topic = app.topic(
        settings.events_topic, key_type=bytes, value_type=bytes, partitions=partitions
    )
    table = lru_table(app, partitions)
    changelog = table.changelog_topic.get_topic_name()
    state = CacheState(settings.capacity, settings.engine_view_max_entries)
    client = client_options(settings.kafka)
    marks = ViewMarks()
    follower = ChangelogFollower(bootstrap_servers, changelog, state, client, marks)
    probe = EventLogProbe(bootstrap_servers, settings.events_topic, partitions,
                          lambda: state.lrus.applied, client)
    refuse_unwritable_state(DataDir(settings.data_dir))  # one line, not Faust's crash
    state_writes = StateWrites()

    def log_problem() -> str | None:
        return None if embedded_cluster is None else embedded_cluster.problem()

    readiness = Readiness(lambda: state.lrus.applied, probe, lambda: follower.caught_up,
                          settings.max_lag_events,
                          problem=lambda: "; ".join(filter(None, (state_writes.problem(),
                                                                   log_problem()))) or None)

    def consumer_lag() -> dict[int, int]:
        """Events not yet applied per owned partition, from Faust's own consumer."""
        consumer, result = app.consumer, {}
        for tp in consumer.assignment():
            highwater = consumer.highwater(tp) if tp.topic == settings.events_topic else None
            if highwater is not None:
                result[tp.partition] = max(0, highwater - state.lrus.applied.get(tp.partition, -1) - 1)
        return result

    metrics = Metrics(state, consumer_lag)
    if fetch_gate.installed():
        metrics.log_fetches = lambda: fetch_gate.GATE.sent
    metrics.registry.register(readiness)
    metrics.registry.register(state_writes)
    metrics.registry.register(TableMemory(table.data))
    if embedded_cluster is not None:
        metrics.registry.register(embedded_cluster)
    mirror = TableMirror(app, table, state_writes, marks)
    gate_changelog_restore(
        table, state_writes,
        lambda: AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False,
                                 auto_offset_reset="earliest", **client))

    async def prepare_dead_letters() -> int:
        # normally created at start (ensure_topics); made sure of here before the first letter
        return await ensure_dead_letter_topic(settings, bootstrap_servers)

    dead_letters = DeadLetterWriter(settings.dead_letter_topic, mirror._producer,
                                    prepare_dead_letters)
    keeper = StateKeeper(state, mirror, metrics, partitions, dead_letters, marks)

    publisher = EventPublisher(bootstrap_servers, settings.events_topic, settings.produce_timeout_s,
                               settings.max_writes_in_flight, settings.kafka,
                               None if embedded_cluster is None else embedded_cluster.wait_stored)
    rebased = None if embedded_cluster is None else _RebasedWorker(
        app, publisher, state, consumer_lag, partitions,
        lambda p: table.data.persisted_offset(TP(changelog, p)))

    async def apply_batch(partition: int, records: Sequence[Any]) -> None:
        # A worker resumed after its session expired must not write after the new owner:
        # ownership is checked when the batch arrives (a batch fetched before a freeze may
        # be handed over after the rejoin) and again right before its records are written
        # (a freeze in the middle of the batch); either raises, and the worker stops with
        # nothing of the batch written or acknowledged (its supervisor restarts it).
        tp = TP(settings.events_topic, partition)
        if records and records[-1].offset <= state.lrus.applied.get(partition, -1):
            return  # applied already (fetched again, e.g. after a rebase): nothing to write
        if rebased is None:
            return await handle_batch(tp, partition, records)
        rebased.batches += 1  # a rebase waits for the batches being handled (settle)
        try:
            return await handle_batch(tp, partition, records)
        finally:
            rebased.batches -= 1

    async def handle_batch(tp: TP, partition: int, records: Sequence[Any]) -> None:
        generation = owner_generation(app)
        await confirm_owner(app, generation, tp, ask=False)
        # the view's part stays what the file holds only if it was before and the file
        # holds this batch once it returns (stream.worker.view_marks)
        held = marks.forget(partition)
        held_before = held is not None and held == mirror.persisted(partition, absent=-1)
        await keeper.apply_in_slices(partition, records)
        # dead letters first: once the files hold a batch's applied offsets, its records are
        # never delivered again, so their letters must be on the log by then (a zombie's
        # letters are duplicates, told apart by their source partition and offset)
        await dead_letters.flush()
        await confirm_owner(app, generation, tp)
        # returns once the changelog and the files hold the batch: then it is acked; a file
        # that refuses it (a full disk) is retried meanwhile, until the worker stops
        # (a batch that lands after another writer's records is stored only if this worker
        # still owns the partition: the other was a zombie; else it stops, storing nothing)
        if not await mirror.flush(lambda: not app.should_stop,
                                  lambda: confirm_owner(app, generation, tp, strict=True)):
            raise StateNotStored(f"partition {partition}: stopped before its batch could be "
                                 "stored; not acknowledged, the changelog holds it")
        if held_before and keeper.view_is_stored:
            marks.set(partition, mirror.persisted(partition, absent=-1))

    install_batch_path(app, {settings.events_topic: apply_batch})

    # Declared so that Faust subscribes to the event topic and assigns its partitions
    # together with the table's; the batch path above takes all its records, so this body
    # receives nothing. Were one to reach it, Faust would acknowledge it even if this body
    # failed, so it refuses instead of applying it.
    @app.agent(topic, name="apply-events")
    async def apply_events(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            raise RuntimeError(f"event at partition {event.message.partition} offset "
                               f"{event.message.offset} reached the agent, not the batch path")

    stall_watch = StallWatch()

    @app.timer(interval=1.0, name="rewind-stalled-partitions")
    async def rewind_stalled_partitions() -> None:
        if state_writes.failing:  # not stalled: waiting for room to store a batch
            stall_watch.reset()
        else:
            await rewind_stalled(app, settings.events_topic, state.lrus.applied, stall_watch,
                                 time.monotonic())

    reload_turn = asyncio.Lock()
    recoveries = 0

    @table.on_recover
    async def reload_view() -> None:
        # Faust does not cancel a recovery's callbacks when a rebalance supersedes it, so
        # two may run at once: they take turns, and one superseded while it waited (for
        # the preload or its turn) leaves the loading to the later one, whose assignment
        # is current. The follower lets go of the partitions now owned before the keeper
        # loads them (it resumes those it now follows after the view's marks, or re-reads
        # them aside); neither empties the view, and neither reads again what the view
        # already holds as the files do (stream.worker.view_marks).
        nonlocal preload, recoveries
        recoveries += 1
        this = recoveries
        first, preload = preload, None  # only the first recovery can use it
        if first is not None:
            await first.wait()
        async with reload_turn:
            if this != recoveries:
                return
            owned = {tp.partition for tp in app.assignor.assigned_actives()
                     if tp.topic == changelog}
            await follower.follow(owned, partitions)
            await keeper.reload({p: db for p, db in table.data._dbs.items() if p in owned}, first)
            if first is not None:
                first.drop_snapshot()
            if this == recoveries:
                readiness.loaded()

    async def ready_from_local_files() -> None:
        # A restart whose files hold every event of the log (a clean stop, nothing written
        # since) answers at once: the preload's view is taken in before the group join and
        # the recovery (~1-2 s), which then find its partitions unchanged. Otherwise the
        # first recovery takes the preload in, as before. Only a shortcut: any failure
        # leaves that path to do it.
        local = preload
        if local is None:
            return
        try:
            await local.wait()
            if local.state is None or not local.marks:  # nothing read: not a restart
                return
            since = probe.begun  # ends read wholly after the files were
            while probe.samples <= since:
                if preload is not local or app.should_stop:
                    return
                await asyncio.sleep(PROBE_POLL_S)
            # the files must hold the changelog too: nobody wrote it after them
            holds = local.holds_changelog(await follower.ends(partitions))
            async with reload_turn:
                if holds and preload is local and readiness.loaded_whole(local.state.lrus.applied, since):
                    local.merge_into(state)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the recovery loads the view instead
            log.warning("the local state files could not answer before the group join (%s: %s); "
                        "the recovery loads them", type(exc).__name__, exc)

    api = HttpApi(state, publisher, metrics, settings.limits, readiness.report,
                  write_tokens=open_token_file(settings.auth_token_file, "--auth-token-file"),
                  match_tokens=open_token_file(settings.match_auth_token_file, "--match-auth-token-file"),
                  match_source=settings.match_source, body_readers=settings.body_readers,
                  body_read_timeout_s=settings.body_read_timeout_s)
    http = HttpService(api, settings.host, settings.port,
                       tls_context(settings.tls_cert, settings.tls_key), listening)
    services: list[mode.Service] = [http, follower, probe, StartTask(ready_from_local_files),
                                    StartTask(allocator.give_back_periodically)]
    if embedded_cluster is not None and rebased is not None:
        services.append(RebaseService(embedded_cluster, settings.embedded_rebase_bytes, rebased))
    worker = faust.Worker(app, *services, loglevel=settings.log_level, quiet=True)
    worker.spinner = None  # a terminal spinner only garbles service logs
    return worker, keeper
