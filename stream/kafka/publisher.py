"""Writes events to the log and returns only once the broker acknowledged them (acks=all)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from stream.codec import encode_event
from stream.core.events import EndpointDeleted, EndpointsSynced, ItemsPlaced

__all__ = ["EventPublisher", "LogUnavailable"]


class LogUnavailable(RuntimeError):
    """The event log did not acknowledge a write in time; the caller may retry."""


class EventPublisher:
    """Keyed by endpoint so that every event of an endpoint lands in one partition."""

    def __init__(self, bootstrap_servers: str, topic: str, timeout_s: float) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.timeout_s = timeout_s
        self._producer: AIOKafkaProducer

    async def start(self) -> None:
        """Connect to the cluster (aiokafka needs a running loop to build its producer)."""
        self._producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap_servers,
            acks="all",
            linger_ms=0,
            request_timeout_ms=int(self.timeout_s * 1000),
        )
        await self._producer.start()

    async def stop(self) -> None:
        """Flush and disconnect."""
        await self._producer.stop()

    async def publish(self, events: Sequence[ItemsPlaced | EndpointDeleted]) -> int:
        """Append endpoint-keyed events; return how many were acknowledged."""
        return await self._send(
            [(event.endpoint.encode(), None, encode_event(event)) for event in events]
        )

    async def publish_sync(self, event: EndpointsSynced) -> int:
        """Append one copy of a sync to every partition, so each partition's endpoints see it."""
        partitions = await self._producer.partitions_for(self.topic)
        value = encode_event(event)
        return await self._send([(None, partition, value) for partition in sorted(partitions)])

    async def _send(self, records: list[tuple[bytes | None, int | None, bytes]]) -> int:
        try:
            async with asyncio.timeout(self.timeout_s):
                acks = [
                    await self._producer.send(self.topic, value, key=key, partition=partition)
                    for key, partition, value in records
                ]
                await asyncio.gather(*acks)
        except (KafkaError, TimeoutError) as exc:
            raise LogUnavailable(f"event log did not acknowledge the write: {exc!r}") from exc
        return len(records)
