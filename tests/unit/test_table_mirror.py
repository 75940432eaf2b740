"""The state files refusing writes (a full disk): what counts as the data dir failing, what
``StateWrites`` reports, and the retries of the keeper's writes and of Faust's restore."""

from __future__ import annotations

import asyncio
import errno
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from faust.types import TP
from rocksdict import Options, Rdict, WriteBatch

from stream.core.cache import CacheState, Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.items import Item
from stream.state.store import (
    APPLIED_KEY,
    FAUST_OFFSET_KEY,
    decode_applied,
    effect_records,
    encode_applied,
    encode_faust_offset,
)
from stream.worker import table_mirror
from stream.worker.table_mirror import (
    StateWrites,
    TableMirror,
    check_room,
    closed_partitions,
    gate_changelog_restore,
    is_storage_error,
)

FULL = "IO error: No space left on device: While appending to file: lru-2.db/000004.log"


def test_storage_errors_are_the_data_dirs_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(Exception) as raised:  # noqa: PT011 - rocksdict raises a bare Exception
        Rdict(str(tmp_path / "file" / "db"), Options(raw_mode=True))
    assert is_storage_error(raised.value), raised.value
    assert is_storage_error(Exception(FULL))
    assert is_storage_error(Exception("No space left on device (os error 28)"))
    assert is_storage_error(OSError(28, "No space left on device"))
    assert not is_storage_error(Exception("Corruption: bad block"))
    assert not is_storage_error(ValueError("a bug"))


def test_a_write_that_would_not_leave_the_reserve_free_is_refused_as_by_the_disk(
        tmp_path: Path) -> None:
    check_room(tmp_path / "lru-0.db" / "not-yet", 0)  # its nearest existing parent
    with pytest.raises(OSError, match="No space left on device") as raised:
        check_room(tmp_path, 1 << 60)
    assert raised.value.errno == errno.ENOSPC and is_storage_error(raised.value)


def test_state_writes_report_the_failing_partitions_until_they_are_written(caplog) -> None:
    now = [100.0]
    writes = StateWrites(clock=lambda: now[-1])
    assert writes.problem() is None
    with caplog.at_level(logging.ERROR, "stream.worker.table_mirror"):
        writes.failed(2, Exception(FULL))
        now.append(103.0)
        writes.failed(2, Exception(FULL))
    assert len(caplog.records) == 1  # once until it is written
    assert writes.problem() == (f"state writes fail for partitions [2] for 3 s ({FULL}): their "
                                "events are not acknowledged, nor later ones applied, until stored (retrying)")
    figures = {m.name: m.samples[0].value for m in writes.collect()}
    assert figures == {"mmcache_state_write_errors": 2, "mmcache_state_writes_failing": 1}
    writes.stored(2)
    assert writes.problem() is None and writes.errors_total == 2


class _Refusing:
    """A partition file that refuses ``refusals`` writes, as RocksDB does on a full disk."""

    def __init__(self, db: Rdict, refusals: int) -> None:
        self.db, self.refusals, self.closed = db, refusals, False

    def write(self, batch: Any) -> None:
        if self.refusals:
            self.refusals -= 1
            raise Exception(FULL)  # noqa: TRY002 - what rocksdict raises
        self.db.write(batch)

    def get(self, key: bytes) -> bytes | None:
        return self.db.get(key)

    def close(self) -> None:
        self.closed = True
        raise Exception("IO error: Writer has previous error.")  # noqa: TRY002


class _Store:
    """What the mirror and the restore gate use of Faust's RocksDB store."""

    def __init__(self, db: Rdict, refusals: int) -> None:
        self.db, self.refusals = db, refusals
        self._dbs: dict[int, Any] = {}
        self.opened = 0
        self.restored: list[list[Any]] = []
        self.rocksdb_options = SimpleNamespace(open=self._open)

    def partition_path(self, partition: int) -> Path:
        return Path(f"lru-{partition}.db")

    def _db_for_partition(self, partition: int) -> Any:
        if partition not in self._dbs:
            self._dbs[partition] = self._open(self.partition_path(partition))
        return self._dbs[partition]

    def _open(self, path: Path) -> Any:
        self.opened += 1
        db, self.refusals = _Refusing(self.db, self.refusals), 0  # reopened: the space came back
        return db

    def set_persisted_offset(self, tp: Any, offset: int) -> None:
        self.persisted = offset

    def apply_changelog_batch(self, batch: Any, to_key: Any, to_value: Any) -> None:
        self.restored.append(list(batch))
        for event in batch:
            records = WriteBatch(raw_mode=True)
            if event.message.value is None:  # as Faust: a removal deletes the key
                records.delete(event.message.key)
            else:
                records.put(event.message.key, event.message.value)
            self._db_for_partition(event.message.partition).write(records)


def test_a_refused_write_is_retried_on_a_reopened_file_and_stored_whole(tmp_path: Path) -> None:
    db = Rdict(str(tmp_path / "db"), Options(raw_mode=True))
    store = _Store(db, refusals=1)
    table = SimpleNamespace(data=store, changelog_topic=SimpleNamespace(get_topic_name=lambda: "c"))
    writes = StateWrites()
    mirror = TableMirror(SimpleNamespace(), table, writes)
    rows = [(b"\x01k", b"v"), (APPLIED_KEY, encode_applied(9))]
    assert asyncio.run(mirror._store(3, rows, lambda: True))
    assert store.opened == 2 and writes.errors_total == 1 and not writes.failing
    assert db[b"\x01k"] == b"v" and db[APPLIED_KEY] == encode_applied(9)
    store._dbs.clear()
    store.refusals = 5
    assert not asyncio.run(mirror._store(3, [(b"\x01other", b"v")], lambda: False))
    assert db.get(b"\x01other") is None and writes.failing  # given up (the worker stops)
    db.close()


def test_a_restore_the_file_refused_is_gated_again_from_where_it_was(tmp_path: Path) -> None:
    db = Rdict(str(tmp_path / "db"), Options(raw_mode=True))
    store = _Store(db, refusals=1)
    writes = StateWrites()
    gate_changelog_restore(SimpleNamespace(data=store), writes)

    def event(key: bytes, value: bytes, offset: int) -> Any:
        return SimpleNamespace(message=SimpleNamespace(partition=0, key=key, value=value,
                                                       tp=("c", 0), offset=offset))

    batch = [event(APPLIED_KEY, encode_applied(4), 0), event(APPLIED_KEY, encode_applied(5), 1)]

    async def restore_twice() -> None:  # Faust keeps a batch that raised, and gives it again
        with pytest.raises(Exception, match="No space left"):
            store.apply_changelog_batch(batch, None, None)
        assert writes.failing
        with pytest.raises(OSError, match="being opened again"):  # closed: reopened off the loop
            store.apply_changelog_batch(batch, None, None)
        await eventually_open()
        store.apply_changelog_batch(batch, None, None)

    async def eventually_open() -> None:
        while closed_partitions(store):
            await asyncio.sleep(0.001)

    asyncio.run(restore_twice())
    assert store.opened == 2  # the refusing file closed, opened again
    assert store.restored[0] == store.restored[1] == batch  # not dropped as written again
    assert store.persisted == 1  # the file's offset: the last record read
    assert not writes.failing and writes.errors_total == 1
    assert db[APPLIED_KEY] == encode_applied(5)
    db.close()


def test_the_restore_gates_are_made_anew_only_when_a_recovery_starts(tmp_path: Path) -> None:
    """An event read in part keeps its removals held until its applied record, whatever
    runs between the two restore batches (the previous recovery's callbacks may): nothing
    is handed out to forget the gates. The next recovery's gates start from the file."""
    db = Rdict(str(tmp_path / "db"), Options(raw_mode=True))
    store = _Store(db, refusals=0)
    built: list[str] = []

    async def build_offsets(consumer: Any, tps: Any, destination: Any, title: str) -> None:
        built.append(title)

    recovery = SimpleNamespace(_build_offsets=build_offsets, active_highwaters={})
    table = SimpleNamespace(data=store, app=SimpleNamespace(tables=SimpleNamespace(recovery=recovery)),
                            changelog_topic=SimpleNamespace(get_topic_name=lambda: "c"))
    gate_changelog_restore(table, StateWrites(), lambda: None)

    state = CacheState(Capacity("items", 1))
    records = [*effect_records(state.fold.apply(ItemsPlaced(endpoint="e", items=[Item("a", 1, "image")]), Position(0, 0)), 0),
               *effect_records(state.fold.apply(ItemsPlaced(endpoint="e", items=[Item("b", 1, "image")]), Position(0, 1)), 1)]
    events = [SimpleNamespace(message=SimpleNamespace(partition=0, key=key, value=value, tp=("c", 0),
                                                      offset=offset))
              for offset, (key, value) in enumerate(records)]
    removal = next(i for i, (_, value) in enumerate(records) if value is None)
    store.apply_changelog_batch(events[:removal + 1], None, None)  # event 1 read in part
    assert store.persisted == removal - 1  # the file holds it up to before the held removal
    store.apply_changelog_batch(events[removal + 1:], None, None)
    assert db.get(records[removal][0]) is None and db.get(records[removal - 1][0]) is not None
    assert decode_applied(db[APPLIED_KEY]) == 1

    later = SimpleNamespace(message=SimpleNamespace(partition=0, key=APPLIED_KEY, value=encode_applied(5),
                                                    tp=("c", 0), offset=len(records)))
    db[APPLIED_KEY] = encode_applied(7)  # meanwhile the file got event 7 (the bulk catch-up)
    asyncio.run(recovery._build_offsets(None, [], {}, "active"))  # the next recovery
    assert built == ["active"]
    store.apply_changelog_batch([later], None, None)  # event 5, below the file's 7
    assert store.restored[-1] == []  # dropped by a gate made from the file, not the old one at 1
    db.close()


def _recovery_with_a_log_restored_late(tmp_path: Path, ends: list[int]) -> tuple[Any, list[str], Any]:
    """A store whose partition 0 file holds changelog offset 11398, and a recovery whose
    changelog end is asked again and again, giving ``ends`` in turn (then the last)."""
    db = Rdict(str(tmp_path / "db"), Options(raw_mode=True))
    db[FAUST_OFFSET_KEY] = encode_faust_offset(11398)
    store = _Store(db, refusals=0)
    store._dbs[0] = db
    tp = TP("c", 0)
    calls: list[str] = []

    async def build_highwaters(consumer: Any, tps: Any, destination: Any, title: str) -> None:
        calls.append("highwaters")
        destination[tp] = ends[min(calls.count("highwaters"), len(ends) - 1)]

    async def build_offsets(consumer: Any, tps: Any, destination: Any, title: str) -> None:
        calls.append(f"offsets at end {recovery.active_highwaters[tp]}")

    recovery = SimpleNamespace(_build_offsets=build_offsets, _build_highwaters=build_highwaters,
                               active_highwaters={tp: ends[0]})
    table = SimpleNamespace(data=store, app=SimpleNamespace(tables=SimpleNamespace(recovery=recovery)),
                            changelog_topic=SimpleNamespace(get_topic_name=lambda: "c"))
    gate_changelog_restore(table, StateWrites(), open_consumer=lambda: None)
    return recovery, calls, lambda: asyncio.run(recovery._build_offsets(None, {tp}, {}, "active"))


def test_a_recovery_waits_for_a_changelog_that_ends_below_its_files(tmp_path: Path, monkeypatch,
                                                                      caplog) -> None:
    """The embedded broker being given its log back in a rebase, to a member that joined
    again first: the end read was -1 (Faust's ConsistencyError, 11398 > -1, crashed serve)."""
    monkeypatch.setattr(table_mirror, "LOG_BEHIND_POLL_S", 0.001)
    recovery, calls, recover = _recovery_with_a_log_restored_late(tmp_path, [-1, -1, 5000, 11398])
    with caplog.at_level(logging.WARNING):
        recover()
    assert calls == ["highwaters"] * 3 + ["offsets at end 11398"]
    assert not caplog.records, caplog.text  # nothing behind: no catch-up tried


def test_past_the_bound_the_recovery_goes_on_and_faust_decides(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(table_mirror, "LOG_BEHIND_POLL_S", 0.001)
    monkeypatch.setattr(table_mirror, "LOG_BEHIND_FILES_S", 0.05)
    _, calls, recover = _recovery_with_a_log_restored_late(tmp_path, [-1])
    recover()
    assert calls[-1] == "offsets at end -1" and calls.count("highwaters") >= 1
