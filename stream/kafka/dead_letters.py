"""Copies of the event topic's records that were not applied, on ``<app-id>-dead-letters``.

A dead letter keeps the record's key and value as they were read, and says in headers
why and where it came from (CONTRACT): ``mmcache.reason``, ``mmcache.source.partition``
and ``mmcache.source.offset`` (decimal ASCII). It goes to the dead-letter partition of
the same number as its source partition (modulo the topic's count), so the letters of
one source partition stay in offset order.

``flush`` returns only once the broker acknowledged every letter, and the caller calls
it before the records' effects (their applied offsets) are written: a record whose
offset is acknowledged has its dead letter on the log.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DeadLetter", "DeadLetterWriter"]


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
        return [
            ("mmcache.reason", self.reason.encode()),
            ("mmcache.source.partition", str(self.partition).encode()),
            ("mmcache.source.offset", str(self.offset).encode()),
        ]


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
            await producer.send(self.topic, letter.value, key=letter.key,
                                partition=letter.partition % self._partitions,
                                headers=letter.headers())
            for letter in pending
        ]
        for ack in acks:
            await ack
