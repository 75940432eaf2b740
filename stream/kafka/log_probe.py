"""How far the event log is ahead of the view: the event topic's end offsets and the
append time of the first event not yet in the view, per partition, read every
``PROBE_INTERVAL_S`` by a consumer of its own (no group; every partition assigned and
paused, so it fetches nothing but what is asked for).

On the embedded broker ``end_offsets`` is the Fetch high watermark remedy
(``stream.kafka.tansu``), applied process-wide before the worker is built. A broker that
does not answer leaves the last figures in place (the view's lag cannot have shrunk).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import mode
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import ConsumerStoppedError, KafkaError
from aiokafka.structs import TopicPartition

__all__ = ["PROBE_INTERVAL_S", "EventLogProbe"]

PROBE_INTERVAL_S = 0.25
_ANSWER_TIMEOUT_S = 2.0

log = logging.getLogger(__name__)


class EventLogProbe(mode.Service):
    """Samples the event topic's end and, for each partition the view lags on, the
    timestamp (seconds since the epoch) of the first event it lacks.

    ``applied`` gives the view's applied offset per partition (owned or followed).
    Readings are numbered as they begin (``begun``); ``samples`` is the number of the one
    whose figures are published, so that a reader can wait for ends read wholly after a
    moment of its own: ``samples`` past the ``begun`` it noted then.
    """

    def __init__(self, bootstrap_servers: str, topic: str, partitions: int,
                 applied: Callable[[], Mapping[int, int]], client: dict[str, Any] | None = None,
                 interval_s: float = PROBE_INTERVAL_S, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bootstrap_servers = bootstrap_servers
        self.client = client or {}
        self.tps = [TopicPartition(topic, p) for p in range(partitions)]
        self.applied = applied
        self.interval_s = interval_s
        self.ends: dict[int, int] = {}
        self.first_missing: dict[int, tuple[int, float]] = {}  # partition -> (offset, timestamp)
        self.begun = 0
        self.samples = 0
        self._consumer: AIOKafkaConsumer | None = None
        self._failing = False

    async def on_start(self) -> None:
        """Connect, with every partition assigned and paused."""
        self._consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap_servers,
                                          enable_auto_commit=False, auto_offset_reset="earliest",
                                          **self.client)
        await self._consumer.start()
        self._consumer.assign(self.tps)
        self._consumer.pause(*self.tps)

    async def on_stop(self) -> None:
        """Disconnect."""
        if self._consumer is not None:
            await self._consumer.stop()

    @mode.Service.task
    async def _sample_forever(self) -> None:
        while not self.should_stop:
            try:
                await asyncio.wait_for(self.sample(), _ANSWER_TIMEOUT_S * 2)
                if self._failing:
                    log.info("event topic end offsets readable again")
                self._failing = False
            except ConsumerStoppedError:
                if self.should_stop:  # the service is stopping: its consumer went first
                    return
                raise
            except (KafkaError, TimeoutError, OSError) as exc:
                if not self._failing:
                    log.warning("cannot read the event topic's end offsets (%s): the view's "
                                "lag figures stay as last read", type(exc).__name__)
                self._failing = True
            await self.sleep(self.interval_s)

    async def sample(self) -> None:
        """Read the end offsets once, then the first missing event's time where needed."""
        consumer = self._consumer
        assert consumer is not None
        self.begun += 1
        number = self.begun
        read = await consumer.end_offsets(self.tps)
        ends = {tp.partition: offset for tp, offset in read.items()}
        applied = self.applied()
        for partition, end in ends.items():
            first = applied.get(partition, -1) + 1
            if first >= end:
                self.first_missing.pop(partition, None)
                continue
            known = self.first_missing.get(partition)
            if known is None or known[0] < first:
                found = await self._timestamp_at(partition, first)
                if found is not None:
                    self.first_missing[partition] = found
        # published after the times, so that a lag is never shown without its staleness
        self.ends = ends
        self.samples = number

    async def _timestamp_at(self, partition: int, offset: int) -> tuple[int, float] | None:
        """The (offset, timestamp) of the first record at or after ``offset``."""
        consumer = self._consumer
        assert consumer is not None
        tp = self.tps[partition]
        consumer.seek(tp, offset)
        consumer.resume(tp)
        try:
            batches = await consumer.getmany(tp, timeout_ms=int(_ANSWER_TIMEOUT_S * 1000),
                                             max_records=1)
        finally:
            consumer.pause(tp)
        for record in batches.get(tp, []):
            return record.offset, record.timestamp / 1000
        return None
