"""Records written to a partition at offsets chosen by the writer, gaps allowed.

A producer cannot choose offsets: the broker gives a batch its base offset. But a batch's
records carry offset deltas, and a compacted Kafka log has batches whose deltas leave gaps;
Tansu keeps them as given (the batch's base is the partition's end, the next end is the
base plus the last record's delta plus one; ``tests/integration/test_log_compaction.py``).
So a kept log is given back to a new broker with every record at its own offset, whatever
compaction and retention removed between them: the first batch of a partition starts at
the broker's end (0 for a new topic) and each record's delta is its offset minus that.

aiokafka's record-batch builder and produce request are used directly (listed in
``stream.internals``): its producer numbers records one after another.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, Protocol

from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.structs import TopicPartition

__all__ = ["BATCH_BYTES", "RawPartitionWriter"]

#: A batch's size before the next is started (a record larger than this is a batch alone).
BATCH_BYTES = 1024 * 1024
_ACKS_ALL = -1
_TIMEOUT_MS = 30_000


class _Record(Protocol):
    offset: int
    timestamp_ms: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]


class RawPartitionWriter:
    """Writes records to partitions of a new broker at their own offsets; refuses (with
    ``ValueError``) a record whose offset is not above the partition's end, and a broker
    that does not put a batch where it was meant to go."""

    def __init__(self, bootstrap_servers: str) -> None:
        self._client = AIOKafkaClient(bootstrap_servers=bootstrap_servers)
        self._ends: dict[TopicPartition, int] = {}

    async def __aenter__(self) -> RawPartitionWriter:
        await self._client.bootstrap()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._client.close()

    def end(self, topic: str, partition: int) -> int:
        """The partition's end offset after what this writer wrote (0 before)."""
        return self._ends.get(TopicPartition(topic, partition), 0)

    async def write(self, topic: str, partition: int, records: Sequence[_Record]) -> None:
        """Write ``records`` (offsets increasing, above the partition's end) in batches."""
        tp = TopicPartition(topic, partition)
        builder, base = None, self._ends.get(tp, 0)
        for record in records:
            if record.offset < self._ends.get(tp, 0):
                raise ValueError(f"offset {record.offset} is below the partition's end")
            headers = [(name, value) for name, value in record.headers]
            while True:
                if builder is None:
                    builder, base = _builder(), self._ends.get(tp, 0)
                if builder.append(record.offset - base, record.timestamp_ms, record.key,
                                  record.value, headers) is not None:
                    self._ends[tp] = record.offset + 1  # where the broker's end will be
                    break
                await self._send(tp, builder, base)
                builder = None
        if builder is not None:
            await self._send(tp, builder, base)

    async def _send(self, tp: TopicPartition, builder: Any, base: int) -> None:
        node = await self._leader(tp)
        request = ProduceRequest(None, _ACKS_ALL, _TIMEOUT_MS,
                                 [(tp.topic, [(tp.partition, bytes(builder.build()))])])
        response = await self._client.send(node, request)
        for topic, partitions in response.topics:
            for found in partitions:
                error, offset = found[1], found[2]
                if error:
                    raise ValueError(f"{topic}[{found[0]}]: the broker refused a batch (error {error})")
                if offset != base:
                    raise ValueError(f"the broker put the batch meant for offset {base} at {offset}")

    async def _leader(self, tp: TopicPartition) -> int:
        node = self._client.cluster.leader_for_partition(tp)
        if node is None or node == -1:
            self._client.add_topic(tp.topic)
            await self._client.force_metadata_update()
            node = self._client.cluster.leader_for_partition(tp)
        if node is None or node == -1:
            raise ValueError(f"no leader for {tp.topic}[{tp.partition}]")
        return int(node)


def _builder() -> Any:
    return DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=0,
                                     producer_id=-1, producer_epoch=-1, base_sequence=-1,
                                     batch_size=BATCH_BYTES)
