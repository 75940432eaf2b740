"""The batch path (``stream.worker.faust_batches``) on the real Faust consumer and the real broker,
for the rules it claims: commits advance past handled batches; a revocation waits for the
batch in flight, whose offsets are then not committed and whose records are delivered
again; a handler that fails (a changelog send the client refuses) stops the worker without
acknowledging, and a restart delivers the records again.

Each test builds a small Faust app in this process (a topic, an agent that subscribes to
it, the batch path with a handler the test controls), with the group timings of
``stream.worker.app.faust_settings`` and the Tansu remedies applied as ``serve`` applies them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import faust
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.structs import TopicPartition
from faust.exceptions import ProducerSendError
from faust.types import TP

from stream.kafka import tansu
from stream.worker import faust_batches
from stream.worker.app import rewind_stalled
from stream.worker.stall_watch import StallWatch

pytestmark = pytest.mark.integration

Handler = Callable[[int, Sequence[Any]], Awaitable[None]]


@pytest.fixture(autouse=True)
def remedies(bootstrap: str) -> None:
    if asyncio.run(tansu.is_tansu(bootstrap)):
        tansu.apply_remedies()


def make_app(bootstrap: str, app_id: str, topic_name: str, partitions: int, handler: Handler,
             data_dir: Path) -> faust.App:
    app = faust.App(
        app_id, broker=f"kafka://{bootstrap}", datadir=str(data_dir), web_enabled=False,
        autodiscover=False, key_serializer="raw", value_serializer="raw",
        consumer_auto_offset_reset="earliest", topic_disable_leader=True,
        broker_session_timeout=2.0, broker_heartbeat_interval=0.5,
        broker_rebalance_timeout=20.0, broker_commit_interval=0.5,
    )
    topic = app.topic(topic_name, key_type=bytes, value_type=bytes, partitions=partitions)

    @app.agent(topic, name="subscribe")
    async def subscribe(stream: faust.StreamT[bytes]) -> None:
        async for _ in stream.events():
            raise AssertionError("a record reached the agent, not the batch path")

    faust_batches.install(app, {topic_name: handler})
    return app


async def produce(bootstrap: str, topic: str, per_partition: int, partitions: int) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for p in range(partitions):
            for i in range(per_partition):
                await producer.send_and_wait(topic, f"{p}-{i}".encode(), partition=p)
    finally:
        await producer.stop()


async def committed(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int]:
    """The group's committed offsets (-1: none), read with a plain admin client."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        found = await admin.list_consumer_group_offsets(
            group, partitions=[TopicPartition(topic, p) for p in range(partitions)])
    finally:
        await admin.close()
    return {p: found[TopicPartition(topic, p)].offset if TopicPartition(topic, p) in found else -1
            for p in range(partitions)}


async def until(check: Callable[[], Any], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await _value(check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        await asyncio.sleep(0.1)


async def _value(result: Any) -> Any:
    return await result if asyncio.iscoroutine(result) else result


def names() -> tuple[str, str]:
    run = uuid.uuid4().hex[:10]
    return f"fb-{run}", f"fb-{run}-events"


async def stop(*apps: faust.App) -> None:
    for app in apps:
        await asyncio.wait_for(app.stop(), 30)


def test_commits_advance_past_handled_batches(bootstrap: str, tmp_path: Path) -> None:
    app_id, topic = names()
    handled: dict[int, list[int]] = {0: [], 1: []}

    async def handler(partition: int, records: Sequence[Any]) -> None:
        handled[partition].extend(r.offset for r in records)

    async def run() -> None:
        await produce(bootstrap, topic, 30, 2)
        app = make_app(bootstrap, app_id, topic, 2, handler, tmp_path)
        await app.start()
        try:
            await until(lambda: all(len(h) == 30 for h in handled.values()), 30, "all handled")
            await until(lambda: _eq(committed(bootstrap, app_id, topic, 2), {0: 30, 1: 30}),
                        10, "committed past the handled batches")
            assert handled == {0: list(range(30)), 1: list(range(30))}  # each once, in order
            await produce(bootstrap, topic, 5, 2)
            await until(lambda: _eq(committed(bootstrap, app_id, topic, 2), {0: 35, 1: 35}),
                        10, "committed past the next batches")
            assert handled == {0: list(range(35)), 1: list(range(35))}
        finally:
            await stop(app)

    asyncio.run(asyncio.wait_for(run(), 55))


async def _eq(found: Awaitable[dict[int, int]], expected: dict[int, int]) -> bool:
    return await found == expected


def test_a_revocation_waits_for_the_batch_in_flight_and_commits_none_of_it(
        bootstrap: str, tmp_path: Path) -> None:
    app_id, topic = names()
    events: list[tuple[str, Any]] = []
    in_flight: list[int] = []
    second_handled: dict[int, list[int]] = {0: [], 1: []}
    first_handled: dict[int, list[int]] = {0: [], 1: []}

    async def run() -> None:
        started = asyncio.Event()

        async def first_handler(partition: int, records: Sequence[Any]) -> None:
            offsets = [r.offset for r in records]
            if not in_flight:
                in_flight.extend(offsets)
                in_flight.insert(0, partition)
                events.append(("handler started", partition))
                started.set()
                # held until the second worker's join revokes the partitions: Faust's
                # revocation suspends the flow, then waits for this batch
                await until(lambda: first is not None and not first.flow_control.is_active(), 40,
                            "the second worker's join revokes the first's partitions")
                events.append(("handler finished", partition))
                return  # handled; whether it counts is what the test finds out
            first_handled[partition].extend(offsets)

        async def second_handler(partition: int, records: Sequence[Any]) -> None:
            second_handled[partition].extend(r.offset for r in records)

        await produce(bootstrap, topic, 20, 2)
        first = make_app(bootstrap, app_id, topic, 2, first_handler, tmp_path / "first")

        @first.on_partitions_revoked.connect
        async def revoked(app: faust.App, revoked: Any, **kwargs: Any) -> None:
            if started.is_set():
                offsets = await committed(bootstrap, app_id, topic, 2)
                events.append(("revocation done", offsets))

        await first.start()
        second = None
        try:
            await asyncio.wait_for(started.wait(), 20)
            second = make_app(bootstrap, app_id, topic, 2, second_handler, tmp_path / "second")
            await second.start()

            def everything_handled() -> bool:
                return all(set(first_handled[p]) | set(second_handled[p]) == set(range(20))
                           for p in (0, 1))

            await until(everything_handled, 40, "every record handled by one worker or the other")
            await until(lambda: _eq(committed(bootstrap, app_id, topic, 2), {0: 20, 1: 20}),
                        10, "committed to the end")
        finally:
            await stop(*(a for a in (second, first) if a is not None))

        kinds = [kind for kind, _ in events]
        assert kinds[:3] == ["handler started", "handler finished", "revocation done"], events
        partition, batch = in_flight[0], in_flight[1:]
        offsets_at_revocation = events[2][1]
        # the batch was not acknowledged (a rebalance began while it ran): not committed ...
        assert offsets_at_revocation[partition] <= batch[0], (offsets_at_revocation, batch)
        # ... and so delivered again after the rebalance, to whichever worker owns it now
        again = [o for o in first_handled[partition] + second_handled[partition] if o in batch]
        assert sorted(again) == batch, (first_handled, second_handled, batch)

    asyncio.run(asyncio.wait_for(run(), 58))


def test_records_of_a_partition_paused_since_their_fetch_are_delivered_when_it_resumes(
        bootstrap: str, tmp_path: Path) -> None:
    """Records fetched for a partition that Faust paused before they were handled (as its
    recovery does around a takeover) are given back, not skipped: the partition has no
    committed offset, so nothing else would move its position back (this lost a dead
    owner's events on a survivor, tests/integration/test_active_active.py)."""
    app_id, topic = names()
    handled: dict[int, list[int]] = {0: [], 1: []}
    paused: list[int] = []

    async def run() -> None:
        app: faust.App | None = None

        async def handler(partition: int, records: Sequence[Any]) -> None:
            handled[partition].extend(r.offset for r in records)
            if not paused:  # the first batch: pause the other partition, resume it soon
                other = TP(topic, 1 - partition)  # Faust's own kind of partition
                paused.append(other.partition)
                assert app is not None
                app.consumer.pause_partitions({other})
                asyncio.get_running_loop().call_later(1.0, app.consumer.resume_partitions, {other})

        await produce(bootstrap, topic, 20, 2)  # both partitions' records in the first fetch
        app = make_app(bootstrap, app_id, topic, 2, handler, tmp_path)
        await app.start()
        try:
            await until(lambda: all(set(h) == set(range(20)) for h in handled.values()), 20,
                        "every record of both partitions handled")
        finally:
            await stop(app)
        assert paused and handled[paused[0]] == list(range(20))  # each once, in order

    asyncio.run(asyncio.wait_for(run(), 40))


def test_a_stalled_partition_is_fetched_again_from_the_applied_offset(
        bootstrap: str, tmp_path: Path) -> None:
    """A partition whose position went past records nobody handled (as a drop that gives
    nothing back would leave it) is behind the log with its applied offset unmoved:
    ``rewind_stalled`` seeks it back and the records come."""
    app_id, topic = names()
    handled: list[int] = []
    tp = TP(topic, 0)

    async def handler(partition: int, records: Sequence[Any]) -> None:
        handled.extend(r.offset for r in records)

    async def run() -> None:
        await produce(bootstrap, topic, 10, 1)
        app = make_app(bootstrap, app_id, topic, 1, handler, tmp_path)
        await app.start()
        try:
            await until(lambda: handled == list(range(10)), 20, "the first records handled")
            app.consumer.pause_partitions({tp})
            await produce(bootstrap, topic, 5, 1)  # offsets 10-14, then lost by a seek past them
            await app.consumer.seek(tp, 15)
            app.consumer.resume_partitions({tp})
            watch = StallWatch(after_s=1.0)
            applied = {0: 9}  # the view's, as the keeper keeps it
            # a fetch answered after the resume (the end was 10 while paused): it was made
            # from offset 15, past the records nobody handled
            await until(lambda: app.consumer.highwater(tp) == 15, 10, "the log's end read")
            assert await rewind_stalled(app, topic, applied, watch, 0.0) == []  # behind: noted
            assert handled == list(range(10))  # nothing fetched past the seek
            assert await rewind_stalled(app, topic, applied, watch, 1.0) == [0]
            # from the applied offset, or the committed one when lower (re-taken ones are
            # skipped by the keeper)
            await until(lambda: set(handled) == set(range(15)), 10, "the lost records fetched again")
        finally:
            await stop(app)

    asyncio.run(asyncio.wait_for(run(), 40))


def test_a_failed_changelog_send_stops_the_worker_without_acknowledging(
        bootstrap: str, tmp_path: Path) -> None:
    app_id, topic = names()
    changelog = f"{topic}-changelog"
    failed: list[list[int]] = []
    again: list[int] = []

    async def run() -> None:
        await produce(bootstrap, topic, 10, 1)
        first: faust.App | None = None

        async def failing(partition: int, records: Sequence[Any]) -> None:
            assert first is not None
            failed.append([r.offset for r in records])
            # a record over the producer's max request size: aiokafka refuses the send
            await first.producer.send_and_wait(changelog, b"k", b"x" * (2 * 1024 * 1024), 0, None, None)

        first = make_app(bootstrap, app_id, topic, 1, failing, tmp_path / "first")
        await first.start()
        try:
            await until(lambda: first.crash_reason is not None, 30, "the worker crashed")
            reason = first.crash_reason
            assert isinstance(reason, ProducerSendError), repr(reason)
            assert isinstance(reason.__cause__, MessageSizeTooLargeError), repr(reason)
            assert failed and failed[0][0] == 0
        finally:
            await stop(first)
        # stopped: it commits nothing more, and it committed none of the failed batch
        assert await committed(bootstrap, app_id, topic, 1) == {0: -1}

        async def succeeding(partition: int, records: Sequence[Any]) -> None:
            again.extend(r.offset for r in records)

        restarted = make_app(bootstrap, app_id, topic, 1, succeeding, tmp_path / "restarted")
        await restarted.start()
        try:
            await until(lambda: len(again) >= 10, 30, "the records delivered again")
            assert again == list(range(10))
            await until(lambda: _eq(committed(bootstrap, app_id, topic, 1), {0: 10}), 10,
                        "committed once handled")
        finally:
            await stop(restarted)

    asyncio.run(asyncio.wait_for(run(), 58))
