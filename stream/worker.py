"""Wiring of one `mmcache serve` process: the Faust app, its agent and table, the HTTP API.

Data flow: HTTP writes -> event topic (partitioned by endpoint) -> Faust agent ->
``CacheState.apply`` (the pure fold) -> in-memory view for ``/v1/match`` and, entry by
entry, the RocksDB-backed Faust table whose compacted changelog lets any worker recover.
After every recovery (start, rebalance) the view is reloaded from the table's active
partitions, so the view always equals the durable state of the partitions this worker owns.
"""

from __future__ import annotations

import logging
from typing import Any

import faust
import mode
from aiohttp import web

from stream.codec import MalformedEvent, decode_event
from stream.config import Settings
from stream.core.cache import CacheState, Effects
from stream.core.events import Position
from stream.datadir import TABLE_NAME
from stream.http_api import HttpApi
from stream.kafka.publisher import EventPublisher
from stream.metrics import Metrics
from stream.store import read_partition, write_effects

__all__ = ["StateKeeper", "build_worker"]

log = logging.getLogger(__name__)


class StateKeeper:
    """The agent's logic: decode a record, fold it into the view, mirror it to the table."""

    def __init__(self, state: CacheState, table: Any, metrics: Metrics) -> None:
        self.state = state
        self.table = table
        self.metrics = metrics

    def apply_record(self, partition: int, offset: int, raw: bytes | None) -> None:
        """Apply one record of the event topic; malformed ones are counted and skipped."""
        position = Position(partition, offset)
        try:
            event = decode_event(raw)
        except MalformedEvent as exc:
            if self.state.advance(position):
                write_effects(self.table, Effects(), offset)
                self.metrics.malformed.inc()
                log.warning("skipped malformed record at partition %d offset %d: %s",
                            partition, offset, exc)
            return
        effects = self.state.apply(event, position)
        if effects is None:
            self.metrics.redelivered.inc()
            return
        write_effects(self.table, effects, offset)
        self.metrics.events.labels(event.type).inc()

    def reload(self, partitions: dict[int, Any]) -> None:
        """Replace the view with the durable entries of these partitions' stores."""
        self.state.clear()
        for partition, db in partitions.items():
            applied, entries = read_partition(db.items())
            self.state.restore(partition, applied, entries)
        log.info("state loaded: %d endpoints from partitions %s",
                 len(self.state.endpoints), sorted(partitions))


class HttpService(mode.Service):
    """Runs the HTTP API and the event publisher next to the Faust app."""

    def __init__(self, api: HttpApi, host: str, port: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.api = api
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    async def on_start(self) -> None:
        """Serve HTTP first, so /healthz and /readyz answer during recovery."""
        await self.api.publisher.start()
        self._runner = web.AppRunner(self.api.application(), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        log.info("HTTP API on http://%s:%d", self.host, self.port)

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
        """Latches to True once caught up after a recovery."""
        if not self.recovered:
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
        {"broker_session_timeout": 3.0, "broker_heartbeat_interval": 0.5,
         "broker_rebalance_timeout": 20.0, "broker_commit_interval": 0.5}
        if embedded
        else {"broker_session_timeout": 10.0, "broker_heartbeat_interval": 1.0,
              "broker_rebalance_timeout": 60.0, "broker_commit_interval": 1.0}
    )
    return {
        "broker": f"kafka://{bootstrap_servers}",
        "store": "rocksdb://",
        "datadir": str(settings.data_dir),
        "web_enabled": False,
        "key_serializer": "raw",
        "value_serializer": "raw",
        "producer_acks": -1,
        "consumer_auto_offset_reset": "earliest",
        "table_standby_replicas": 0,
        "topic_disable_leader": True,
        "autodiscover": False,
        "topic_replication_factor": settings.replication_factor,
        **timings,
    }


def build_worker(
    settings: Settings, bootstrap_servers: str, partitions: int, *, embedded: bool
) -> faust.Worker:
    """Assemble the Faust worker with the HTTP service; nothing has started yet."""
    app = faust.App(settings.app_id, **faust_settings(settings, bootstrap_servers, embedded))
    topic = app.topic(
        settings.events_topic, key_type=bytes, value_type=bytes, partitions=partitions
    )
    table = app.Table(TABLE_NAME, key_type=bytes, value_type=bytes, partitions=partitions)
    state = CacheState(settings.capacity)
    readiness = Readiness(app, settings.events_topic, state)
    metrics = Metrics(state, readiness.lag)
    keeper = StateKeeper(state, table, metrics)

    @app.agent(topic, name="apply-events")
    async def apply_events(stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            keeper.apply_record(event.message.partition, event.message.offset, event.value)

    @table.on_recover
    async def reload_view() -> None:
        changelog = table.changelog_topic.get_topic_name()
        actives = {tp.partition for tp in app.assignor.assigned_actives() if tp.topic == changelog}
        stores = {p: db for p, db in table.data._dbs.items() if p in actives}
        keeper.reload(stores)
        readiness.recovered = True

    @app.on_partitions_revoked.connect
    async def on_revoked(app: faust.App, revoked: Any, **kwargs: Any) -> None:
        readiness.reset()

    publisher = EventPublisher(bootstrap_servers, settings.events_topic, settings.produce_timeout_s)
    api = HttpApi(state, publisher, metrics, settings.limits, readiness.is_ready)
    http = HttpService(api, settings.host, settings.port)
    worker = faust.Worker(app, http, loglevel=settings.log_level, quiet=True)
    worker.spinner = None  # a terminal spinner only garbles service logs
    return worker
