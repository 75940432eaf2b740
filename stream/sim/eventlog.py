"""Recorded events, from the event topic or from a JSON-lines export of it.

Records are read as the live worker reads them: decoded by ``stream.core.codec`` and checked
by the routing rule of ``stream.core.routing``; what the worker would skip (a dead
letter) is skipped here too and counted.

An export line is ``{"partition": p, "offset": o, "timestamp_ms": t, "event": {...}}``
with the event as on the log (``schemas/``), lines ordered by timestamp, then partition
and offset. A line that is a bare event is read too, at partition 0 and its line number.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import orjson
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from stream.config import KafkaSecurity
from stream.core.codec import MalformedEvent, decode_event, encode_event
from stream.core.events import Event, ItemsPlaced, Position
from stream.core.items import Item
from stream.core.routing import misrouted

__all__ = ["Recorded", "placements", "read_jsonl", "read_topic", "read_topic_sync", "write_jsonl"]


@dataclass(frozen=True, slots=True)
class Recorded:
    """One applied event with its log position and record timestamp."""

    position: Position
    timestamp_ms: int | None
    event: Event


def placements(records: Iterable[Recorded]) -> Iterator[tuple[str | None, tuple[Item, ...], float | None]]:
    """``(request_id, items, timestamp_s)`` of each placement, for a simulator trace."""
    for record in records:
        if isinstance(record.event, ItemsPlaced):
            stamp = None if record.timestamp_ms is None else record.timestamp_ms / 1000
            yield record.event.request_id, tuple(record.event.items), stamp


def read_jsonl(path: Path, skipped: dict[str, int] | None = None) -> list[Recorded]:
    """The events of an export file, in its order; invalid lines counted in ``skipped``."""
    found: list[Recorded] = []
    with path.open("rb") as lines:
        for number, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                doc = orjson.loads(line)
                if isinstance(doc, dict) and "event" in doc:
                    position = Position(int(doc.get("partition", 0)), int(doc.get("offset", number)))
                    stamp = doc.get("timestamp_ms")
                    raw = orjson.dumps(doc["event"])
                else:
                    position, stamp, raw = Position(0, number), None, line
                event = decode_event(raw)
            except (orjson.JSONDecodeError, MalformedEvent, TypeError, ValueError) as exc:
                reason = getattr(exc, "reason", "not_json")
                if skipped is not None:
                    skipped[reason] = skipped.get(reason, 0) + 1
                continue
            found.append(Recorded(position, None if stamp is None else int(stamp), event))
    return found


def write_jsonl(records: Iterable[Recorded], out: IO[bytes]) -> int:
    """Write records as export lines; return how many."""
    count = 0
    for record in records:
        line = (b'{"partition":%d,"offset":%d,"timestamp_ms":%s,"event":' % (
            record.position.partition, record.position.offset,
            b"null" if record.timestamp_ms is None else str(record.timestamp_ms).encode()))
        out.write(line + encode_event(record.event) + b"}\n")
        count += 1
    return count


async def read_topic(bootstrap_servers: str, topic: str, security: KafkaSecurity | None = None,
                     on_progress: Callable[[int], None] | None = None,
                     skipped: dict[str, int] | None = None) -> list[Recorded]:
    """Every event of the topic from its first offset to the end seen at the start,
    partitions merged by timestamp, each in offset order."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap_servers, enable_auto_commit=False,
                                **_options(security or KafkaSecurity()))
    await consumer.start()
    found: dict[int, list[Recorded]] = {}
    partitions = sorted(consumer.partitions_for_topic(topic) or ())
    if not partitions:
        await asyncio.sleep(0.1)  # a stop right after the start is cancelled inside aiokafka
        await consumer.stop()
        raise LookupError(f"topic {topic} not found on {bootstrap_servers}")
    try:
        tps = [TopicPartition(topic, p) for p in partitions]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        starts = await consumer.beginning_offsets(tps)
        remaining = {tp for tp in tps if ends[tp] > starts[tp]}
        while remaining:
            batches = await consumer.getmany(*remaining, timeout_ms=200, max_records=20_000)
            for tp, records in batches.items():
                end = ends[tp]
                for record in records:
                    if record.offset >= end:
                        break
                    recorded = _decode(record, len(partitions), skipped)
                    if recorded is not None:
                        found.setdefault(tp.partition, []).append(recorded)
                if records and records[-1].offset >= end - 1:
                    remaining.discard(tp)
                if on_progress is not None:
                    on_progress(len(records))
    finally:
        await consumer.stop()
    # merged by timestamp, each partition kept in offset order (the fold needs it, and a
    # producer's own timestamps need not grow with the offset)
    return list(heapq.merge(*found.values(), key=lambda r: (r.timestamp_ms or 0, r.position)))


def read_topic_sync(bootstrap_servers: str, topic: str, security: KafkaSecurity | None = None,
                    on_progress: Callable[[int], None] | None = None,
                    skipped: dict[str, int] | None = None) -> list[Recorded]:
    """``read_topic`` from synchronous code, with the embedded broker's remedies applied
    when it is the peer."""
    from stream.kafka.tansu import apply_remedies, is_tansu

    async def run() -> list[Recorded]:
        if await is_tansu(bootstrap_servers, security):
            apply_remedies()
        return await read_topic(bootstrap_servers, topic, security, on_progress, skipped)

    return asyncio.run(run())


def _decode(record: object, partitions: int, skipped: dict[str, int] | None) -> Recorded | None:
    partition, offset = record.partition, record.offset  # type: ignore[attr-defined]
    try:
        event = decode_event(record.value)  # type: ignore[attr-defined]
    except MalformedEvent as exc:
        _count(skipped, exc.reason)
        return None
    wrong = misrouted(event, record.key, partition, partitions)  # type: ignore[attr-defined]
    if wrong is not None:
        _count(skipped, wrong)
        return None
    return Recorded(Position(partition, offset), record.timestamp, event)  # type: ignore[attr-defined]


def _count(skipped: dict[str, int] | None, reason: str) -> None:
    if skipped is not None:
        skipped[reason] = skipped.get(reason, 0) + 1


def _options(security: KafkaSecurity) -> dict[str, object]:
    from stream.kafka.clients import client_options  # imports Faust: only when a topic is read

    return client_options(security)
