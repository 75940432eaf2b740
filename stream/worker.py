"""Wiring of one `mmcache serve` process: the Faust app, its agent and table, the HTTP API.

Data flow: HTTP writes -> event topic (partitioned by endpoint) -> Faust's consumer, whole
fetched batches (``stream.faust_batches``) -> ``CacheState.apply`` (the pure fold) ->
in-memory view for ``/v1/match`` and, entry by entry, the Faust table's RocksDB files and
compacted changelog, from which any worker recovers.
After every recovery (start, rebalance) the view is reloaded from the table's active
partitions, so the view always equals the durable state of the partitions this worker owns.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import ssl
from collections.abc import Iterable, MutableMapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import faust
import mode
from aiohttp import web
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition
from faust.types import TP
from rocksdict import WriteBatch

from stream.admission import Applied, fold_record
from stream.auth import open_token_file
from stream.config import Settings
from stream.core.cache import CacheState, Effects
from stream.datadir import TABLE_NAME
from stream.faust_batches import install as install_batch_path
from stream.http_api import HttpApi
from stream.kafka.clients import client_options, faust_credentials
from stream.kafka.dead_letters import DeadLetter, DeadLetterWriter
from stream.kafka.publisher import EventPublisher
from stream.kafka.topics import ensure_dead_letter_topic
from stream.metrics import Metrics
from stream.preload import LocalPreload
from stream.store import decode_change, effect_records, load_partition_in_slices, write_effects

__all__ = ["MappingMirror", "Mirror", "StateKeeper", "TableMirror", "build_worker"]

# Events reach the keeper in whole fetched batches (stream.faust_batches) of at most
# MAX_POLL_RECORDS, so one batch holds the event loop for a few tens of ms at most (~35 µs
# an event); their changelog records go to the producer once per batch.
MAX_POLL_RECORDS = 1000
# Entries dropped or loaded between two turns of the loop in a reload (~2 ms a slice).
RELOAD_SLICE_ENTRIES = 1024

# the reasons the older ``mmcache_malformed_events_total`` counts too
_MALFORMED = frozenset({"not_json", "bad_schema", "unknown_version"})

log = logging.getLogger(__name__)


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


class DeadLetterSink(Protocol):
    """Where the keeper puts the records it skips (a ``DeadLetterWriter``, or a list)."""

    def add(self, letter: DeadLetter) -> None:
        """Keep one letter until the batch is flushed."""


class _Letters(list[DeadLetter]):
    """The letters of a keeper without a writer (tests, tools): kept in a list."""

    def add(self, letter: DeadLetter) -> None:
        self.append(letter)


class StateKeeper:
    """The agent's logic: fold a record into the view (``stream.admission``, the same rule
    as ``rebuild``), mirror it to the store, dead-letter and count what is skipped.

    ``partitions`` is the event topic's partition count, against which an endpoint's
    key partition is checked.
    """

    def __init__(self, state: CacheState, mirror: Mirror, metrics: Metrics,
                 partitions: int = 1, dead_letters: DeadLetterSink | None = None) -> None:
        self.state = state
        self.mirror = mirror
        self.metrics = metrics
        self.partitions = partitions
        self.dead_letters: DeadLetterSink = dead_letters if dead_letters is not None else _Letters()
        self._rejected: dict[str, int] = {}

    def apply_record(self, partition: int, offset: int, raw: bytes | None,
                     key: bytes | None = None) -> None:
        """Apply one record of the event topic; one that is not applied is dead-lettered,
        counted and skipped, its offset applied all the same."""
        outcome = fold_record(self.state, partition, offset, key, raw, self.partitions)
        if outcome is None:
            self.metrics.redelivered.inc()
        elif isinstance(outcome, Applied):
            self.mirror.write(partition, outcome.effects, offset)
            self.metrics.events.labels(outcome.event.type).inc()
        else:
            self.dead_letters.add(DeadLetter(partition, offset, key, raw, outcome.reason))
            self.mirror.write(partition, Effects(), offset)
            self.metrics.dead_letters.labels(outcome.reason).inc()
            if outcome.reason in _MALFORMED:
                self.metrics.malformed.inc()
            seen = self._rejected[outcome.reason] = self._rejected.get(outcome.reason, 0) + 1
            if seen <= 10 or seen % 1000 == 0:  # a misconfigured producer must not flood the log
                log.warning("dead-lettered record at partition %d offset %d (%s, %d so far): %s",
                            partition, offset, outcome.reason, seen, outcome.detail)

    def apply_batch(self, partition: int, records: Iterable[Any]) -> None:
        """Apply fetched records (with ``offset``, ``key`` and ``value``) of one partition,
        in order."""
        apply = self.apply_record
        for record in records:
            apply(partition, record.offset, record.value, record.key)

    async def reload(self, partitions: dict[int, Any], preload: LocalPreload | None = None) -> None:
        """Replace these partitions' part of the view with their stores' durable entries
        (the other partitions' part is kept in step by the ``ChangelogFollower``).

        A finished ``preload`` (of a worker's first start) is taken in first: its
        partitions that are owned and unchanged since it read them are not read again.
        Dropping and loading run in slices of ``RELOAD_SLICE_ENTRIES`` with the loop
        turning in between (one go held it ~3.5 s at 1M entries); Faust applies no event
        of these partitions until this returns. The collector is off meanwhile: its full
        passes over the growing view took 70-90 ms each.
        """
        gc.disable()
        try:
            reused: set[int] = set()
            if preload is not None and preload.state is not None:
                self.state.merge(preload.state)
                reused = {p for p, db in partitions.items() if preload.unchanged(p, db)}
                for partition in set(preload.marks) - reused:
                    await drop_partition_in_slices(self.state, partition)
            for partition, db in partitions.items():
                if partition not in reused:
                    await drop_partition_in_slices(self.state, partition)
                    for _ in load_partition_in_slices(self.state, partition, db.items(),
                                                      RELOAD_SLICE_ENTRIES):
                        await asyncio.sleep(0)
        finally:
            # The view is long-lived: keep the collector from re-scanning it (a full pass
            # over a 1M-entry view stalled requests for ~80 ms in the latency benchmark).
            gc.freeze()
            gc.enable()
        log.info("state loaded: %d endpoints from partitions %s",
                 len(self.state.endpoints), sorted(partitions))


async def drop_partition_in_slices(state: CacheState, partition: int) -> None:
    """``CacheState.drop_partition`` with the loop turning every ``RELOAD_SLICE_ENTRIES``."""
    for _ in state.drop_partition_in_slices(partition, RELOAD_SLICE_ENTRIES):
        await asyncio.sleep(0)


class ChangelogFollower(mode.Service):
    """Keeps the view of the partitions other workers own, so every worker of an app id
    answers for all endpoints: reads those partitions of the table's changelog (no
    consumer group) and mirrors their entry changes into the view.

    After each rebalance ``follow`` is told which partitions this worker owns; a
    partition it starts to follow is dropped from the view and read again from its first
    record (compacted on Kafka), so no change made around the handover is missed. A
    single worker owns every partition and follows none.
    """

    def __init__(self, bootstrap_servers: str, changelog: str, view: CacheState,
                 client: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bootstrap_servers = bootstrap_servers
        self.client = client or {}
        self.changelog = changelog
        self.view = view
        self.following: set[int] = set()
        self.caught_up = False
        self._consumer: AIOKafkaConsumer | None = None
        self._assigned = asyncio.Event()

    async def on_start(self) -> None:
        """Connect; nothing is read until ``follow`` names the partitions."""
        self._consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap_servers,
                                          enable_auto_commit=False, **self.client)
        await self._consumer.start()

    async def on_stop(self) -> None:
        """Disconnect."""
        if self._consumer is not None:
            await self._consumer.stop()

    async def follow(self, owned: set[int], partitions: int) -> None:
        """Follow every partition this worker does not own (called after each recovery)."""
        consumer = self._consumer
        assert consumer is not None
        following = set(range(partitions)) - owned
        added = following - self.following
        for partition in added:
            await drop_partition_in_slices(self.view, partition)
        self.following = following
        tps = [TopicPartition(self.changelog, p) for p in sorted(following)]
        consumer.assign(tps)
        if added:
            await consumer.seek_to_beginning(*(TopicPartition(self.changelog, p) for p in added))
        self.caught_up = not following
        self._assigned.set()

    @mode.Service.task
    async def _mirror(self) -> None:
        await self._assigned.wait()
        consumer = self._consumer
        assert consumer is not None
        while not self.should_stop:
            if not self.following:
                await self.sleep(0.1)
                continue
            batches = await consumer.getmany(timeout_ms=100, max_records=10_000)
            for tp, records in batches.items():
                if tp.partition not in self.following:
                    continue
                for record in records:
                    change = decode_change(record.key, record.value)
                    if change is not None:
                        self.view.follow(tp.partition, *change)
            if not self.caught_up:
                self.caught_up = await self._behind(consumer) == 0

    async def _behind(self, consumer: AIOKafkaConsumer) -> int:
        behind = 0
        for partition in self.following:
            tp = TopicPartition(self.changelog, partition)
            highwater = consumer.highwater(tp)
            behind += 1 if highwater is None else max(0, highwater - await consumer.position(tp))
        return behind


class HttpService(mode.Service):
    """Runs the HTTP API (over TLS when given a context) and the event publisher next to
    the Faust app."""

    def __init__(self, api: HttpApi, host: str, port: int, tls: ssl.SSLContext | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.api = api
        self.host = host
        self.port = port
        self.tls = tls
        self._runner: web.AppRunner | None = None

    @staticmethod
    def tls_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
        """The server TLS context of ``--tls-cert``/``--tls-key`` (``None``: plain HTTP);
        a pair that cannot be loaded stops the start with one line naming the flags."""
        if cert is None or key is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise SystemExit(f"configuration error: --tls-cert {cert} / --tls-key {key}: "
                             f"cannot load them ({type(exc).__name__}: {exc.strerror or exc})") from None
        return context

    async def on_start(self) -> None:
        """Serve HTTP first, so /healthz and /readyz answer during recovery."""
        await self.api.publisher.start()
        self._runner = web.AppRunner(self.api.application(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port, ssl_context=self.tls).start()
        writes, matches = self.api.write_tokens, self.api.match_tokens
        log.info("HTTP API on %s://%s:%d; auth for writes and /v1/state: %s; auth for /v1/match: %s",
                 "https" if self.tls else "http", self.host, self.port,
                 f"on ({len(writes)} tokens)" if writes else "off",
                 f"on ({len(matches)} tokens)" if matches else "off")

    async def on_stop(self) -> None:
        """Stop taking requests, then flush the publisher."""
        if self._runner is not None:
            await self._runner.cleanup()
        await self.api.publisher.stop()


class Readiness:
    """Ready once the view is recovered and has applied everything on the log."""

    def __init__(self, app: faust.App, topic: str, state: CacheState) -> None:
        self.app = app
        self.topic = topic
        self.state = state
        self.recovered = False
        self._caught_up = False
        self.follower: ChangelogFollower | None = None

    def lag(self) -> dict[int, int]:
        """Events on the log not yet applied, per assigned partition (unknown ones left out)."""
        consumer = self.app.consumer
        result = {}
        for tp in consumer.assignment():
            if tp.topic != self.topic:
                continue
            highwater = consumer.highwater(tp)
            if highwater is not None:
                result[tp.partition] = max(0, highwater - self.state.applied.get(tp.partition, -1) - 1)
        return result

    def is_ready(self) -> bool:
        """Latches to True once caught up after a recovery (and with the other workers'
        changelog partitions)."""
        if not self.recovered or (self.follower is not None and not self.follower.caught_up):
            return False
        if not self._caught_up:
            assigned = [tp for tp in self.app.consumer.assignment() if tp.topic == self.topic]
            lag = self.lag()
            self._caught_up = len(lag) == len(assigned) and not any(lag.values())
        return self._caught_up

    def reset(self) -> None:
        """A rebalance started: not ready until recovered and caught up again."""
        self.recovered = False
        self._caught_up = False


def faust_settings(settings: Settings, bootstrap_servers: str, embedded: bool) -> dict[str, Any]:
    """Faust configuration; group timings tuned to how fast the broker forms groups."""
    timings = (
        # Tansu answers joins after about half the session timeout (BROKER.md, 4).
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
        # the changelog is written asynchronously and flushed before every commit:
        # batching its records costs no correctness and saves a request per record
        "producer_linger": 0.005,
        "producer_max_batch_size": 1024 * 1024,
        "consumer_auto_offset_reset": "earliest",
        "broker_max_poll_records": MAX_POLL_RECORDS,
        "table_standby_replicas": 0,
        "topic_disable_leader": True,
        "autodiscover": False,
        "topic_replication_factor": settings.replication_factor or 1,
        **timings,
    }


def build_worker(
    settings: Settings, bootstrap_servers: str, partitions: int, *, embedded: bool,
    preload: LocalPreload | None = None,
) -> faust.Worker:
    """Assemble the Faust worker with the HTTP service; nothing has started yet (but the
    ``preload`` of the local state, which the first recovery takes in)."""
    app = faust.App(settings.app_id, **faust_settings(settings, bootstrap_servers, embedded))
    topic = app.topic(
        settings.events_topic, key_type=bytes, value_type=bytes, partitions=partitions
    )
    table = app.Table(TABLE_NAME, key_type=bytes, value_type=bytes, partitions=partitions)
    state = CacheState(settings.capacity)
    readiness = Readiness(app, settings.events_topic, state)
    metrics = Metrics(state, readiness.lag)
    mirror = TableMirror(app, table)

    async def prepare_dead_letters() -> int:
        # normally created at start (ensure_topics); made sure of here before the first letter
        return await ensure_dead_letter_topic(settings, bootstrap_servers)

    dead_letters = DeadLetterWriter(settings.dead_letter_topic, mirror._producer,
                                    prepare_dead_letters)
    keeper = StateKeeper(state, mirror, metrics, partitions, dead_letters)

    async def flush() -> None:
        # dead letters first: once the files hold a batch's applied offsets, its records are
        # never delivered again, so their letters must be on the log by then
        await dead_letters.flush()
        await mirror.flush()  # returns once the changelog holds the batch: then it is acked

    async def apply_batch(partition: int, records: Sequence[Any]) -> None:
        keeper.apply_batch(partition, records)
        await flush()

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

    changelog = table.changelog_topic.get_topic_name()

    follower = ChangelogFollower(bootstrap_servers, changelog, state,
                                 client_options(settings.kafka))
    readiness.follower = follower

    @table.on_recover
    async def reload_view() -> None:
        nonlocal preload
        owned = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == changelog}
        first, preload = preload, None  # only the first recovery can use it
        if first is not None:
            await first.wait()
        await keeper.reload({p: db for p, db in table.data._dbs.items() if p in owned}, first)
        await follower.follow(owned, partitions)
        readiness.recovered = True

    @app.on_partitions_revoked.connect
    async def on_revoked(app: faust.App, revoked: Any, **kwargs: Any) -> None:
        readiness.reset()

    publisher = EventPublisher(bootstrap_servers, settings.events_topic, settings.produce_timeout_s,
                               settings.max_writes_in_flight, settings.kafka)
    api = HttpApi(state, publisher, metrics, settings.limits, readiness.is_ready,
                  write_tokens=open_token_file(settings.auth_token_file, "--auth-token-file"),
                  match_tokens=open_token_file(settings.match_auth_token_file, "--match-auth-token-file"))
    http = HttpService(api, settings.host, settings.port,
                       HttpService.tls_context(settings.tls_cert, settings.tls_key))
    worker = faust.Worker(app, http, follower, loglevel=settings.log_level, quiet=True)
    worker.spinner = None  # a terminal spinner only garbles service logs
    return worker
