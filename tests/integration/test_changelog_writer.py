"""A partition's file never skips another writer's changelog records (TableMirror.flush).

A zombie owner whose batch lands in the changelog after its successor's records (the
check-then-write window of stream.kafka.coordinator) used to record in its file the
changelog offset its batch reached: the file then claimed to hold the changelog up to
there, so a later recovery of that file (the zombie given the partition back) resumed
after the successor's records and never loaded them, while the view said lag 0. Now the
batch's offsets must follow the file's own; otherwise nothing of it goes to the file and
the worker stops (LostMembership), to recover from the changelog like any zombie.
Real broker, real producer, real RocksDB file."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from rocksdict import Options, Rdict

from stream.core.cache import Effects
from stream.kafka.coordinator import LostMembership
from stream.state.store import APPLIED_KEY, FAUST_OFFSET_KEY, decode_applied, encode_applied
from stream.worker.table_mirror import TableMirror
from stream.worker.view_marks import ViewMarks

pytestmark = pytest.mark.integration


class _Store:
    """The part of Faust's RocksDB store that TableMirror writes through, on a real file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._dbs: dict[int, Rdict] = {}

    def partition_path(self, partition: int) -> Path:
        return self.path / f"lru-{partition}.db"

    def _db_for_partition(self, partition: int) -> Rdict:
        if partition not in self._dbs:
            self._dbs[partition] = Rdict(str(self.partition_path(partition)), Options(raw_mode=True))
        return self._dbs[partition]


def test_a_batch_landing_after_another_writers_records_is_not_stored_in_the_file(bootstrap, tmp_path):
    changelog = f"writer-{uuid.uuid4().hex[:10]}-changelog"
    store = _Store(tmp_path)

    async def run() -> tuple[str | None, int, Any]:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        await admin.create_topics([NewTopic(changelog, 1, 1)])
        await admin.close()
        mine = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
        other = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
        await mine.start()
        await other.start()
        try:
            app = SimpleNamespace(producer=SimpleNamespace(_ensure_producer=lambda: mine))
            table = SimpleNamespace(data=store, changelog_topic=SimpleNamespace(get_topic_name=lambda: changelog))
            mirror = TableMirror(app, table)  # type: ignore[arg-type]
            mirror.write(0, Effects(), 0)
            assert await mirror.flush()  # offset 0: the file holds the changelog up to 0
            # its own next batch follows its offsets: stored
            mirror.write(0, Effects(), 1)
            assert await mirror.flush()
            # another worker (the zombie's successor) writes the partition meanwhile
            await other.send_and_wait(changelog, b"\x01theirs", key=b"\x01theirs", partition=0)
            mirror.write(0, Effects(), 2)

            async def not_owner() -> None:
                raise LostMembership("the group coordinator no longer counts this worker")

            try:
                await mirror.flush(still_owner=not_owner)
            except LostMembership as exc:
                return str(exc), int(store._db_for_partition(0)[FAUST_OFFSET_KEY]), \
                    store._db_for_partition(0).get(APPLIED_KEY)
            return None, int(store._db_for_partition(0)[FAUST_OFFSET_KEY]), \
                store._db_for_partition(0).get(APPLIED_KEY)
        finally:
            await mine.stop()
            await other.stop()

    try:
        reason, offset, applied = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        for db in store._dbs.values():
            db.close()
    assert reason == "the group coordinator no longer counts this worker", (reason, offset)
    assert offset == 1  # still where its own records end: a recovery reads the other's record
    assert decode_applied(applied) == 1  # nothing of the batch in the file


def test_the_owner_goes_on_past_a_zombies_records(bootstrap, tmp_path):
    """Records a zombie wrote after the owner's (skipped by every reader) lie between the
    owner's file offset and its next batch: the owner, confirmed, stores the batch."""
    changelog = f"writer-{uuid.uuid4().hex[:10]}-changelog"
    store = _Store(tmp_path)
    asked: list[str] = []
    marks = ViewMarks()

    async def run() -> int:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        await admin.create_topics([NewTopic(changelog, 1, 1)])
        await admin.close()
        mine = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
        zombie = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
        await mine.start()
        await zombie.start()
        try:
            app = SimpleNamespace(producer=SimpleNamespace(_ensure_producer=lambda: mine))
            table = SimpleNamespace(data=store, changelog_topic=SimpleNamespace(get_topic_name=lambda: changelog))
            mirror = TableMirror(app, table, marks=marks)  # type: ignore[arg-type]
            mirror.write(0, Effects(), 5)
            assert await mirror.flush()  # offsets 0: the owner's applied record
            marks.set(0, 0)
            await zombie.send_and_wait(changelog, encode_applied(3), key=APPLIED_KEY, partition=0)

            async def owner() -> None:
                asked.append("still the owner")

            mirror.write(0, Effects(), 6)
            assert await mirror.flush(still_owner=owner)
            return int(store._db_for_partition(0)[FAUST_OFFSET_KEY])
        finally:
            await mine.stop()
            await zombie.stop()

    try:
        offset = asyncio.run(asyncio.wait_for(run(), 60))
        applied = decode_applied(store._db_for_partition(0)[APPLIED_KEY])
    finally:
        for db in store._dbs.values():
            db.close()
    assert asked == ["still the owner"]
    assert (offset, applied) == (2, 6)
    # a reader of the whole changelog may hold what the view does not: never marked again
    marks.set(0, offset)
    assert marks.through(0) is None and not marks.holds(0, offset)
