"""A consumer that lags holds a bounded amount of fetched records (stream.kafka.tansu,
remedy 4).

aiokafka keeps one fetched answer per assigned partition until it is read. The embedded
broker does not apply the per-partition limit of a fetch, so each answer carried up to
about 6 MiB: found as serve's memory climbing while it lagged in the soak. With the cap,
an answer is at most ``FETCH_BYTES`` plus one record batch.
"""

from __future__ import annotations

import asyncio
import tracemalloc
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from stream.kafka import tansu

pytestmark = pytest.mark.integration

PARTITIONS = 8
BATCH = 1024 * 1024  # the largest batch mmcache's producers write (Faust's and the publisher's)
WRITTEN_PER_PARTITION = 4 * 1024 * 1024
VALUE = b"v" * 4000


async def _fill(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_batch_size=BATCH, linger_ms=50)
    await producer.start()
    try:
        sent = [await producer.send(topic, VALUE, partition=n % PARTITIONS)
                for n in range(PARTITIONS * WRITTEN_PER_PARTITION // len(VALUE))]
        await asyncio.gather(*sent)
    finally:
        await producer.stop()


async def _peak_while_reading(bootstrap: str, topic: str) -> int:
    """The most bytes allocated at once by a consumer (built as Faust builds its own: a
    1 MiB partition limit, no request limit) that reads the topic a few records at a time:
    the fetcher keeps an answer for each partition it can, waiting to be read."""
    records = PARTITIONS * (WRITTEN_PER_PARTITION // len(VALUE))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                                    auto_offset_reset="earliest",
                                    max_partition_fetch_bytes=1024 * 1024)
        await consumer.start()
        try:
            consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
            read = 0
            async with asyncio.timeout(120):
                while read < records:
                    batches = await consumer.getmany(timeout_ms=1000, max_records=16)
                    read += sum(len(batch) for batch in batches.values())
            return tracemalloc.get_traced_memory()[1] - before
        finally:
            await consumer.stop()
    finally:
        tracemalloc.stop()


def test_a_consumer_that_lags_holds_at_most_one_capped_answer_per_partition(bootstrap: str) -> None:
    if not asyncio.run(tansu.is_tansu(bootstrap)):
        pytest.skip("the remedy is the embedded broker's")
    tansu.apply_remedies()
    topic = f"fetch-bound-{uuid.uuid4().hex[:8]}"
    asyncio.run(_fill(bootstrap, topic))
    peak = asyncio.run(_peak_while_reading(bootstrap, topic))
    # + the client itself and the records of one read
    bound = PARTITIONS * (tansu.FETCH_BYTES + BATCH) + 2 * 1024 * 1024
    written = PARTITIONS * WRITTEN_PER_PARTITION
    assert peak <= bound, f"{peak / 2**20:.1f} MiB held at once of {written / 2**20:.0f} MiB written"
