"""On the embedded broker a fetch wait is a poll (Tansu does not wake a waiting fetch when
data arrives): an idle `serve` spent 37-50% of a core polling at 10 ms. A fetcher whose
fetches brought nothing for ``IDLE_AFTER_S`` waits ``IDLE_WAIT_MS`` a fetch, and the short
wait again from the first fetch that brings records. Against the tests' real Tansu broker
and aiokafka's own consumer."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from stream.kafka import fetcher, tansu

pytestmark = pytest.mark.integration


def test_an_idle_consumer_fetches_less_often_and_a_record_brings_the_short_wait_back(bootstrap, monkeypatch):
    assert asyncio.run(tansu.is_tansu(bootstrap))
    monkeypatch.setattr(fetcher, "IDLE_AFTER_S", 0.5)
    tansu.apply_remedies()
    topic = f"idle-{uuid.uuid4().hex[:8]}"

    async def run() -> tuple[int, int, int, bytes, int]:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, 1, 1)])
        finally:
            await admin.close()
        consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
        await consumer.start()
        try:
            fetches = 0
            adapting = consumer._fetcher._proc_fetch_request

            async def counted(*args):  # every fetch request the consumer sends
                nonlocal fetches
                fetches += 1
                return await adapting(*args)

            consumer._fetcher._proc_fetch_request = counted
            short = consumer._fetcher._fetch_max_wait_ms
            deadline = time.monotonic() + 30
            while consumer._fetcher._fetch_max_wait_ms == short:  # idle for IDLE_AFTER_S
                assert time.monotonic() < deadline, "the fetch wait never grew"
                await asyncio.sleep(0.05)
            idle = consumer._fetcher._fetch_max_wait_ms
            fetches, began = 0, time.monotonic()
            await asyncio.sleep(2.0)  # a window to count the idle fetches in, not a wait for a condition
            idle_fetches = round(fetches / (time.monotonic() - began) * 2.0)
            producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
            await producer.start()
            try:
                await producer.send_and_wait(topic, b"after the quiet spell")
            finally:
                await producer.stop()
            record = await asyncio.wait_for(consumer.getone(), 30)
            return short, idle, idle_fetches, record.value, consumer._fetcher._fetch_max_wait_ms
        finally:
            await consumer.stop()

    short, idle, idle_fetches, value, after = asyncio.run(run())
    assert (short, idle) == (tansu.FETCH_WAIT_MS, fetcher.IDLE_WAIT_MS)
    # Tansu answers an idle fetch after about half its wait: ~20 fetches in 2 s at 100 ms
    # (~400 at 10 ms); a busy machine only makes fewer
    assert idle_fetches <= 2.0 / (fetcher.IDLE_WAIT_MS / 1000 / 2) * 1.5, idle_fetches
    assert value == b"after the quiet spell"
    assert after == short
