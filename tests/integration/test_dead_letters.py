"""Records that mmcache did not publish itself (finding 8): a foreign producer's good,
poison and misrouted records, written straight to the event topic, on the real broker
with a real `serve` and a real `rebuild`."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

from stream.core.cache import CacheState, Capacity
from stream.core.codec import encode_event
from stream.core.events import EndpointDeleted, EndpointsSynced, ItemsPlaced, Position
from stream.core.items import Item
from stream.core.routing import key_partition
from tests.integration.conftest import eventually

PARTITIONS = 4
PODS = [f"ns/dl-{i}" for i in range(5)]


def _placed(pod: str, *hashes: str) -> ItemsPlaced:
    return ItemsPlaced(endpoint=pod, items=[Item(h, 1, "image") for h in hashes])


def _home(pod: str) -> int:
    return key_partition(pod.encode(), PARTITIONS)


def _records() -> list[tuple[str | None, bytes | None, bytes | None, int]]:
    """``(reason or None for a good record, key, value, partition)``, in producing order."""
    good: list[tuple[str | None, bytes | None, bytes | None, int]] = []
    for i, pod in enumerate(PODS):
        good.append((None, pod.encode(), encode_event(_placed(pod, f"a{i}", "shared")), _home(pod)))
    good.append((None, PODS[0].encode(), encode_event(EndpointDeleted(endpoint=PODS[0])),
                 _home(PODS[0])))
    pod, other = PODS[1], next(p for p in PODS if _home(p) != _home(PODS[1]))
    wrong = (_home(pod) + 1) % PARTITIONS
    v99 = orjson.loads(encode_event(_placed(pod, "future")))
    v99["v"] = 99
    bad = [
        ("not_json", pod.encode(), b"\x00\x01 not json", _home(pod)),
        ("bad_schema", pod.encode(), orjson.dumps({"v": 1, "type": "items_placed",
                                                    "endpoint": pod}), _home(pod)),
        ("unknown_version", pod.encode(), orjson.dumps(v99), _home(pod)),
        # another partitioner put it elsewhere (librdkafka's crc32, round robin, ...)
        ("wrong_partition", pod.encode(), encode_event(_placed(pod, "stray")), wrong),
        # keyed by another endpoint, in that endpoint's partition
        ("wrong_key", other.encode(), encode_event(_placed(pod, "alien")), _home(other)),
    ]
    sync = encode_event(EndpointsSynced(live=PODS[1:4]))
    syncs = [(None, None, sync, p) for p in range(PARTITIONS)]
    return good[:3] + bad[:3] + good[3:] + bad[3:] + syncs


async def _produce(bootstrap: str, topic: str, records) -> list[tuple[int, int]]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        positions = []
        for _, key, value, partition in records:
            meta = await producer.send_and_wait(topic, value, key=key, partition=partition)
            positions.append((meta.partition, meta.offset))
        return positions
    finally:
        await producer.stop()


async def _dead_letters(bootstrap: str, topic: str, count: int) -> list:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        found: list = []
        async with asyncio.timeout(15):
            while len(found) < count:
                for batch in (await consumer.getmany(timeout_ms=200)).values():
                    found.extend(batch)
        found.extend(r for b in (await consumer.getmany(timeout_ms=500)).values() for r in b)
        return found
    finally:
        await consumer.stop()


def _metric(text: str, reason: str) -> float:
    match = re.search(rf'^mmcache_dead_letters_total\{{reason="{reason}"\}} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_foreign_records_not_applied_are_dead_lettered_and_live_equals_rebuild_equals_good_only(
        make_service, tmp_path: Path):
    service = make_service(extra=["--partitions", str(PARTITIONS)])
    topic = f"{service.app_id}-events"
    records = _records()
    positions = asyncio.run(_produce(service.bootstrap, topic, records))

    # the state of the good records alone, by the pure fold at their real positions
    expected = CacheState(Capacity.from_params())
    from stream.core.codec import decode_event
    for (reason, _, value, _), (partition, offset) in zip(records, positions, strict=True):
        if reason is None:
            expected.fold.apply(decode_event(value), Position(partition, offset))
    bad = {(p, o): r for (r, _, _, _), (p, o) in zip(records, positions, strict=True) if r}

    eventually(lambda: service.digest() == expected.digests.digest(), timeout=20)
    metrics = eventually(lambda: (lambda t: t if sum(_metric(t, r) for r in set(bad.values()))
                                  == len(bad) else None)(service.get("/metrics")[1]), timeout=20)
    for reason in set(bad.values()):
        assert _metric(metrics, reason) == 1, reason

    letters = asyncio.run(_dead_letters(service.bootstrap, f"{service.app_id}-dead-letters",
                                        len(bad)))
    seen = {}
    for letter in letters:
        headers = {k: v.decode() for k, v in letter.headers}
        source = (int(headers["mmcache.source.partition"]), int(headers["mmcache.source.offset"]))
        seen[source] = headers["mmcache.reason"]
        index = positions.index(source)
        assert (letter.key, letter.value) == records[index][1:3]  # copied as read
    assert seen == bad
    assert len(letters) == len(bad)

    done = subprocess.run(
        [sys.executable, "-m", "stream.cli", "rebuild", "--bootstrap-servers", service.bootstrap,
         "--data-dir", str(tmp_path / "rebuilt"), "--app-id", service.app_id],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == expected.digests.digest()
    assert service.digest() == expected.digests.digest()
