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


async def _peak_while_reading(bootstrap: str, topic: str, **sizes: int) -> int:
    """The most bytes allocated at once by a consumer that reads the topic a few records
    at a time: the fetcher keeps an answer for each partition it can, waiting to be read."""
    records = PARTITIONS * (WRITTEN_PER_PARTITION // len(VALUE))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None,
                                    auto_offset_reset="earliest", **sizes)
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


@pytest.fixture(scope="module")
def filled(bootstrap: str) -> str:
    """A topic of 8 partitions with 4 MiB each, on the embedded broker, remedies applied."""
    if not asyncio.run(tansu.is_tansu(bootstrap)):
        pytest.skip("the remedy is the embedded broker's")
    tansu.apply_remedies()
    topic = f"fetch-bound-{uuid.uuid4().hex[:8]}"
    asyncio.run(_fill(bootstrap, topic))
    return topic


# + the client itself and the records of one read
BOUND = PARTITIONS * (tansu.FETCH_BYTES + BATCH) + 2 * 1024 * 1024
WRITTEN = PARTITIONS * WRITTEN_PER_PARTITION


def test_a_consumer_that_lags_holds_at_most_one_capped_answer_per_partition(bootstrap: str,
                                                                            filled: str) -> None:
    """Built as Faust builds its own: a 1 MiB partition limit (aiokafka's default), none
    for the request."""
    peak = asyncio.run(_peak_while_reading(bootstrap, filled, max_partition_fetch_bytes=1024 * 1024))
    assert peak <= BOUND, f"{peak / 2**20:.1f} MiB held at once of {WRITTEN / 2**20:.0f} MiB written"


def test_a_bulk_reader_that_asks_for_its_own_sizes_keeps_them(bootstrap: str, filled: str) -> None:
    """``rebuild`` reads everything once and ends: its 8 MiB / 64 MiB fetches are its own,
    and it holds several times what a capped consumer does."""
    capped = asyncio.run(_peak_while_reading(bootstrap, filled))
    own = asyncio.run(_peak_while_reading(bootstrap, filled, max_partition_fetch_bytes=8 * 2**20,
                                          fetch_max_bytes=64 * 2**20))
    assert own > 3 * capped, f"{own / 2**20:.1f} MiB held at once against {capped / 2**20:.1f} capped"


def test_a_record_bigger_than_the_cap_comes_whole(bootstrap: str, filled: str) -> None:
    big = b"b" * (900 * 1024)

    async def round_trip() -> bytes:
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_request_size=2 * BATCH)
        await producer.start()
        try:
            sent = await producer.send_and_wait(filled, big, partition=0)
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
        await consumer.start()
        try:
            tp = TopicPartition(filled, 0)
            consumer.assign([tp])
            consumer.seek(tp, sent.offset)
            record = await asyncio.wait_for(consumer.getone(tp), 60)
            return bytes(record.value)
        finally:
            await consumer.stop()

    assert asyncio.run(round_trip()) == big
