"""Copies of the event topic's records that were not applied, on ``<app-id>-dead-letters``.

A dead letter keeps the record's key and value as they were read, and says in headers
why and where it came from (CONTRACT): ``mmcache.reason``, ``mmcache.source.partition``
and ``mmcache.source.offset`` (decimal ASCII). It goes to the dead-letter partition of
the same number as its source partition (modulo the topic's count), so the letters of
one source partition stay in offset order.

A record too large to copy whole (over ``MAX_COPIED_BYTES``, under the producer's and
Kafka's default request limit of ~1 MB with room for headers) is copied without its
value and with ``mmcache.truncated`` set to the value's length: a copy the broker
refuses would stop its partition for good, redelivered and refused again.

``flush`` returns only once the broker acknowledged every letter, and the caller calls
it before the records' effects (their applied offsets) are written: a record whose
offset is acknowledged has its dead letter on the log.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_COPIED_BYTES", "DeadLetter", "DeadLetterWriter"]

MAX_COPIED_BYTES = 512 * 1024


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One skipped record and why it was skipped."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    reason: str

    def headers(self) -> list[tuple[str, bytes]]:
        """The record headers of its copy."""
        headers = [
            ("mmcache.reason", self.reason.encode()),
            ("mmcache.source.partition", str(self.partition).encode()),
            ("mmcache.source.offset", str(self.offset).encode()),
        ]
        if self.truncated:
            headers.append(("mmcache.truncated", str(len(self.value or b"")).encode()))
        return headers

    @property
    def truncated(self) -> bool:
        """Whether the copy goes without the value (too large to copy)."""
        return len(self.value or b"") + len(self.key or b"") > MAX_COPIED_BYTES

    def copied_value(self) -> bytes | None:
        """The value its copy carries."""
        return None if self.truncated else self.value


class DeadLetterWriter:
    """Gathers a batch's dead letters and writes them with an acks=all producer.

    ``producer`` returns the (started) aiokafka producer to write with; ``prepare``
    makes sure the topic exists and returns its partition count, once, before the
    first letter is sent.
    """

    def __init__(self, topic: str, producer: Callable[[], Any],
                 prepare: Callable[[], Awaitable[int]]) -> None:
        self.topic = topic
        self._producer = producer
        self._prepare = prepare
        self._partitions: int | None = None
        self._pending: list[DeadLetter] = []

    def add(self, letter: DeadLetter) -> None:
        """Queue a letter for the next ``flush``."""
        self._pending.append(letter)

    async def flush(self) -> None:
        """Send the queued letters and wait for the broker's acks; raises if it refuses."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        if self._partitions is None:
            self._partitions = await self._prepare()
        producer = self._producer()
        acks = [
            await producer.send(self.topic, letter.copied_value(), key=letter.key,
                                partition=letter.partition % self._partitions,
                                headers=letter.headers())
            for letter in pending
        ]
        for ack in acks:
            await ack
