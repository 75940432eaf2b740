"""Writes events to the log and returns only once the broker acknowledged them (acks=all).

Every write is bounded twice: in time (``timeout_s``, which also bounds aiokafka's own
metadata wait and request timeout) and in number (``max_in_flight`` writes waiting for
the broker at once). A write over either bound raises ``LogUnavailable`` and was *not
acknowledged*: it may still reach the log, so the caller may retry (a placement or a
deletion written twice has the effect of one).

On `serve`'s own embedded broker, whose log is kept in the data dir by a journal
(``stream.kafka.embedded_log``), a write is acknowledged only once the journal has
stored its offsets too (``stored``), within the same time budget. Every write the broker
acknowledged wakes the process's idle consumers (``stream.kafka.fetch_gate``), the
journal's among them, before that wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from stream.config import KafkaSecurity
from stream.core.codec import encode_event
from stream.core.events import EndpointDeleted, EndpointsSynced, EngineEventsReported, ItemsPlaced
from stream.kafka import fetch_gate
from stream.kafka.clients import MAX_REQUEST_BYTES, client_options

__all__ = ["EventPublisher", "LogUnavailable", "Overloaded"]

log = logging.getLogger(__name__)

# One warning per this many seconds while writes fail, with the count of the others.
_WARN_EVERY_S = 10.0


class LogUnavailable(RuntimeError):
    """The event log did not acknowledge a write in time; the caller may retry."""

    code = "log_unavailable"


class Overloaded(LogUnavailable):
    """Refused before touching Kafka: ``max_in_flight`` writes already wait for the broker."""

    code = "overloaded"


class EventPublisher:
    """Keyed by endpoint so that every event of an endpoint lands in one partition."""

    def __init__(self, bootstrap_servers: str, topic: str, timeout_s: float,
                 max_in_flight: int = 256, security: KafkaSecurity | None = None,
                 stored: Callable[[str, list[tuple[int, int]]], Awaitable[None]] | None = None,
                 ) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.security = security or KafkaSecurity()
        self.stored = stored  # (topic, [(partition, offset)]): returns once those are kept
        self.in_flight = 0
        self.waiting = 0  # writes held by ``held``
        self._open = asyncio.Event()  # cleared while writes are held (``held``)
        self._open.set()
        self._idle = asyncio.Event()  # set while no write waits for the broker
        self._idle.set()
        self._producer: AIOKafkaProducer
        self._failures = 0
        self._warned_at = -_WARN_EVERY_S

    async def start(self) -> None:
        """Connect to the cluster (aiokafka needs a running loop to build its producer).

        ``request_timeout_ms`` bounds both a produce request and aiokafka's wait for
        metadata (``send`` and ``partitions_for``), so neither outlives a write's budget.
        """
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap_servers,
            acks="all",
            linger_ms=0,
            max_request_size=MAX_REQUEST_BYTES,  # what the HTTP API's event-size check holds to
            request_timeout_ms=max(1, int(self.timeout_s * 1000)),
            **client_options(self.security),
        )
        await self._producer.start()

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Hold new writes (each waits within its own time budget, then is not
        acknowledged) and return once none is in flight; let them go at the end."""
        self._open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._open.set()

    async def stop(self) -> None:
        """Flush and disconnect."""
        await self._producer.stop()

    async def publish(self, events: Sequence[ItemsPlaced | EndpointDeleted | EngineEventsReported]) -> int:
        """Append endpoint-keyed events (each to its endpoint's partition, by Kafka's default
        partitioner); return how many were acknowledged."""
        records = [(event.endpoint.encode(), None, encode_event(event)) for event in events]
        async with self._write():
            return await self._send(records)

    async def publish_sync(self, event: EndpointsSynced) -> int:
        """Append one copy of a sync to every partition, so each partition's endpoints see it.

        The partition count comes from metadata, which a hung or unreachable broker may
        not give: that is the same "not acknowledged" as a send that times out.
        """
        value = encode_event(event)
        async with self._write():
            partitions = await self._producer.partitions_for(self.topic)
            return await self._send([(None, partition, value) for partition in sorted(partitions)])

    @asynccontextmanager
    async def _write(self) -> AsyncIterator[None]:
        """One write's slot and time budget; every failure inside is ``LogUnavailable``."""
        if self.in_flight + self.waiting >= self.max_in_flight:
            raise Overloaded(f"{self.in_flight + self.waiting} writes already wait for the event log "
                             f"(max_writes_in_flight); the write was not sent, retry later")
        self.in_flight += 1
        self._idle.clear()
        try:
            async with asyncio.timeout(self.timeout_s):
                if not self._open.is_set():  # held (``held``): waiting, not in flight
                    self.in_flight -= 1
                    self.waiting += 1
                    self._idle_if_none()
                    try:
                        await self._open.wait()
                    finally:
                        self.waiting -= 1
                        self.in_flight += 1
                        self._idle.clear()
                yield
        except (KafkaError, TimeoutError, OSError) as exc:
            self._warn(exc)
            raise LogUnavailable(
                f"the event log did not acknowledge the write within {self.timeout_s:g} s "
                f"(produce_timeout_s): {type(exc).__name__}; it may still be written, retry is safe"
            ) from None
        finally:
            self.in_flight -= 1
            self._idle_if_none()

    def _idle_if_none(self) -> None:
        if self.in_flight == 0:
            self._idle.set()

    async def _send(self, records: list[tuple[bytes | None, int | None, bytes]]) -> int:
        if self.stored is not None:
            await self.stored(self.topic, [])  # refused before sending when it cannot be kept
        acks = [
            await self._producer.send(self.topic, value, key=key, partition=partition)
            for key, partition, value in records
        ]
        written = await asyncio.gather(*acks)
        fetch_gate.GATE.wake()  # this process's consumers (and journal) fetch it now
        if self.stored is not None:
            await self.stored(self.topic, [(m.partition, m.offset) for m in written])
        return len(records)

    def _warn(self, exc: BaseException) -> None:
        """Log failed writes at most once per ``_WARN_EVERY_S`` (a hung broker fails many)."""
        self._failures += 1
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            log.warning("event log did not acknowledge %d write(s) in %g s, last: %r",
                        self._failures, self.timeout_s, exc)
            self._failures, self._warned_at = 0, now
