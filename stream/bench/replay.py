"""Rebuild replay speed against a raw aiokafka consume of the same topic, and a rebuild
from a changelog's checkpoint against the whole replay."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from stream.bench.figures import Figure, span
from stream.bench.workload import Workload
from stream.config import KafkaSecurity, Settings
from stream.core.codec import encode_event
from stream.kafka.clients import client_options
from stream.kafka.topics import EVENTS_TOPIC_CONFIG, ensure_topic
from stream.state.datadir import DataDir
from stream.state.rebuild import Until, rebuild, seed_deployment

__all__ = ["produce_placements", "raw_consume_rate", "replay_figures"]


async def produce_placements(bootstrap: str, topic: str, count: int, partitions: int = 8) -> None:
    """Write ``count`` workload events to a new topic, keyed by endpoint."""
    security = KafkaSecurity()  # MMCACHE_KAFKA_* of the environment, as serve reads them
    await ensure_topic(bootstrap, topic, partitions, EVENTS_TOPIC_CONFIG, security=security)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20,
                                max_batch_size=512 * 1024, **client_options(security))
    await producer.start()
    try:
        pending = []
        for event in Workload().placed_events(count):
            pending.append(await producer.send(topic, encode_event(event),
                                               key=event.endpoint.encode()))
            if len(pending) >= 20_000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


async def raw_consume_rate(bootstrap: str, topic: str) -> float:
    """Records per second a bare aiokafka consumer reads the whole topic at."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                max_partition_fetch_bytes=8 * 1024 * 1024,
                                fetch_max_bytes=64 * 1024 * 1024,
                                **client_options(KafkaSecurity()))
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        total, read = sum(ends.values()), 0
        started = time.perf_counter()
        while read < total:
            batches = await consumer.getmany(timeout_ms=200, max_records=20_000)
            read += sum(len(records) for records in batches.values())
        return read / (time.perf_counter() - started)
    finally:
        await consumer.stop()


def replay_figures(bootstrap: str, events: int, runs: int) -> list[Figure]:
    """Rebuild ``events`` events ``runs`` times; medians against the raw consume rate."""
    topic = f"bench-replay-{time.time_ns()}"
    asyncio.run(produce_placements(bootstrap, topic, events))
    controls = sorted(asyncio.run(raw_consume_rate(bootstrap, topic)) for _ in range(runs))
    control = controls[runs // 2]
    walls = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            settings = Settings(bootstrap_servers=bootstrap, topic=topic, app_id="bench",
                                data_dir=Path(tmp) / "state")
            started = time.perf_counter()
            digest = rebuild(settings)
            walls.append(time.perf_counter() - started)
    wall = sorted(walls)[runs // 2]
    rate = events / wall
    return [*_rate_figures(events, runs, rate, wall, walls, control, controls),
            checkpoint_figure(bootstrap, topic, events, runs, wall, digest)]


def checkpoint_figure(bootstrap: str, topic: str, events: int, runs: int, whole_wall: float,
                      digest: str, share: float = 0.9, partitions: int = 8) -> Figure:
    """`rebuild --from-checkpoint` of the topic, the changelog holding the state after the
    first ``share`` of each partition as a seeded deployment writes it (one record a key,
    as a compacted changelog): its wall time against the whole replay's."""
    app = f"bench-checkpoint-{time.time_ns()}"
    cut = max(0, int(events / partitions * share) - 1)
    with tempfile.TemporaryDirectory() as tmp:
        seed = Settings(bootstrap_servers=bootstrap, topic=topic, app_id=app,
                        data_dir=Path(tmp) / "seed")
        rebuild(seed, Until(offset=cut))
        asyncio.run(seed_deployment(bootstrap, DataDir(seed.data_dir), app, topic, seed))
    walls = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            settings = Settings(bootstrap_servers=bootstrap, topic=topic, app_id=app,
                                data_dir=Path(tmp) / "state", from_checkpoint=True)
            started = time.perf_counter()
            if rebuild(settings) != digest:
                raise AssertionError("rebuild from the checkpoint differs from the whole replay")
            walls.append(time.perf_counter() - started)
    wall = sorted(walls)[runs // 2]
    per_million = 1_000_000 / events
    return Figure("rebuild_from_checkpoint_wall_time_per_1m_events", round(wall * per_million, 2),
                  "s", "<= the whole replay's", wall <= whole_wall,
                  round(whole_wall * per_million, 2), round(wall / whole_wall, 3),
                  f"checkpoint in the changelog after offset {cut} of each of {partitions} "
                  f"partitions (the whole state, one record a key), then the events after it; "
                  f"digest equal to the whole replay's; {runs} runs, "
                  f"{span([w * per_million for w in walls], 2)} s")


def _rate_figures(events: int, runs: int, rate: float, wall: float, walls: list[float],
                  control: float, controls: list[float]) -> list[Figure]:
    return [
        Figure("rebuild_replay_rate", round(rate), "events/s",
               ">= 250000 events/s and >= 0.6 x raw aiokafka consume",
               rate >= 250_000 and rate / control >= 0.6, round(control), round(rate / control, 3),
               f"{events} events, 8 partitions, default capacity, wall time incl. RocksDB writes; "
               f"{runs} runs, replay {span([events / taken for taken in walls])}, raw consume "
               f"{span(controls)}"),
        Figure("rebuild_wall_time_per_1m_events", round(wall * 1_000_000 / events, 2), "s",
               "<= 10 s (>= 100000 events/s)", rate >= 100_000,
               note=f"{runs} runs, {span([taken * 1_000_000 / events for taken in walls], 2)} s"),
    ]
