"""The view snapshot of a clean stop (stream.state.snapshot): taken by the next start in
place of reading the files only while the files still hold what it was written with;
read once; written only when the files hold exactly the view; mmcache's own file."""

from __future__ import annotations

import asyncio
import logging

import pytest

from stream.core.cache import Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.items import Item
from stream.state.datadir import DataDir, StateMismatch
from stream.state.preload import LocalPreload
from stream.state.snapshot import write_snapshot
from stream.state.store import FAUST_OFFSET_KEY, write_effects
from tests.unit.test_keeper import fold, written_datadir
from tests.unit.test_store import Scenario

CAPACITY = Capacity("items", 4)


def _scenario() -> Scenario:
    placed = [ItemsPlaced(endpoint=f"ns/pod-{p}", items=[Item(f"h{p}", 1, "image")]) for p in range(3)]
    return Scenario(CAPACITY, 3, [(Position(p, 0), e) for p, e in enumerate(placed)])


def _preload(datadir: DataDir) -> LocalPreload:
    return asyncio.run(LocalPreload(datadir, CAPACITY).start().wait())


def test_a_clean_stops_snapshot_is_the_next_starts_view_until_dropped(tmp_path, caplog):
    scenario = _scenario()
    datadir = written_datadir(tmp_path, scenario)
    view = fold(scenario)
    assert write_snapshot(datadir, view)
    assert datadir.snapshot.exists()
    datadir.refuse_foreign()  # mmcache's own file
    with caplog.at_level(logging.INFO, logger="stream.state.preload"):
        preload = _preload(datadir)
    assert "from the view snapshot" in caplog.text
    assert preload.state is not None and preload.state.digests.digest() == view.digests.digest()
    assert preload.state.lrus.applied == view.lrus.applied
    assert preload.marks == {0: b"41", 1: b"41", 2: b"41"}
    assert datadir.snapshot.exists()  # until the files are open for writing: its room counts
    preload.drop_snapshot()
    assert not datadir.snapshot.exists()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="stream.state.preload"):
        again = _preload(datadir)
    assert "from partitions [0, 1, 2]" in caplog.text
    assert again.state is not None and again.state.digests.digest() == view.digests.digest()


def test_a_file_written_after_the_snapshot_is_read_instead_and_the_snapshot_dropped(tmp_path, caplog):
    scenario = _scenario()
    datadir = written_datadir(tmp_path, scenario)
    view = fold(scenario)
    assert write_snapshot(datadir, view)
    later = ItemsPlaced(endpoint="ns/pod-1", items=[Item("late", 1, "image")])
    expected = fold(scenario)
    db = datadir.open_partition(1)
    write_effects(db, expected.fold.apply(later, Position(1, 1)), 1)
    db[FAUST_OFFSET_KEY] = b"42"
    db.close()
    with caplog.at_level(logging.INFO, logger="stream.state.preload"):
        preload = _preload(datadir)
    assert "from partitions [0, 1, 2]" in caplog.text
    assert preload.state is not None and preload.state.digests.digest() == expected.digests.digest()
    assert not datadir.snapshot.exists()


def test_no_snapshot_when_the_view_holds_what_the_files_do_not(tmp_path):
    scenario = _scenario()
    datadir = written_datadir(tmp_path, scenario)
    view = fold(scenario)
    view.fold.apply(ItemsPlaced(endpoint="ns/pod-0", items=[Item("unstored", 1, "image")]), Position(0, 1))
    assert not write_snapshot(datadir, view)  # a batch the files did not store
    assert not datadir.snapshot.exists()


def test_a_view_snapshot_mmcache_did_not_write_is_refused_and_kept(tmp_path):
    datadir = written_datadir(tmp_path, _scenario())
    datadir.snapshot.write_bytes(b"my own file")
    with pytest.raises(StateMismatch, match="view.snapshot"):
        datadir.refuse_foreign()
    datadir.drop_snapshot()
    assert datadir.snapshot.read_bytes() == b"my own file"


def test_a_crash_drops_the_snapshot_with_the_table_files(tmp_path):
    scenario = _scenario()
    datadir = written_datadir(tmp_path, scenario)
    assert write_snapshot(datadir, fold(scenario))
    identity = DataDir.identity("app", "topic", scenario.capacity)
    datadir.claim(identity)  # writes RUNNING; the run "crashes": RUNNING stays
    datadir.unlock()
    DataDir(datadir.root).claim(identity)
    assert not datadir.snapshot.exists() and datadir.partitions() == []


def test_an_empty_snapshot_under_its_name_is_ours_and_dropped(tmp_path):
    datadir = written_datadir(tmp_path, _scenario())
    for path in (datadir.snapshot, datadir.snapshot.with_name("view.snapshot.tmp")):
        path.write_bytes(b"")  # a stop killed between creating it and writing it
    datadir.refuse_foreign()
    assert _preload(datadir).state is not None  # read from the files
    assert not datadir.snapshot.exists()
    datadir.drop_snapshot()
    assert not datadir.snapshot.with_name("view.snapshot.tmp").exists()


def test_a_keeper_whose_fold_failed_part_way_says_its_view_is_not_stored():
    from types import SimpleNamespace

    from stream.core.codec import encode_event
    from stream.core.routing import key_partition
    from tests.unit.test_admission import exploding_state
    from tests.unit.test_keeper import keeper_for

    keeper = keeper_for(CAPACITY)
    assert keeper.view_is_stored
    keeper.state = exploding_state()
    event = ItemsPlaced(endpoint="ns/pod-0", items=[Item("h", 1, "image")])
    keeper.apply_batch(key_partition(b"ns/pod-0", 1), [SimpleNamespace(offset=0, key=b"ns/pod-0",
                                                                     value=encode_event(event))])
    assert not keeper.view_is_stored  # a clean stop leaves no snapshot of it


def _taken_from_files(datadir: DataDir, caplog) -> bool:
    """Whether the next start read the partition files (not the snapshot), had the same
    view, and dropped the snapshot."""
    with caplog.at_level(logging.INFO, logger="stream.state.preload"):
        preload = _preload(datadir)
    return ("from partitions [0, 1, 2]" in caplog.text and preload.state is not None
            and preload.state.digests.digest() == fold(_scenario()).digests.digest() and not datadir.snapshot.exists())


def test_a_snapshot_another_marshal_version_wrote_is_no_snapshot(tmp_path, caplog, monkeypatch):
    from stream.state import snapshot

    datadir = written_datadir(tmp_path, _scenario())
    monkeypatch.setattr(snapshot.marshal, "version", snapshot.marshal.version + 1)  # another Python's
    assert write_snapshot(datadir, fold(_scenario()))
    monkeypatch.undo()
    assert _taken_from_files(datadir, caplog)


def test_a_snapshot_of_another_format_is_no_snapshot(tmp_path, caplog, monkeypatch):
    from stream.state import snapshot

    datadir = written_datadir(tmp_path, _scenario())
    monkeypatch.setattr(snapshot, "FORMAT", snapshot.FORMAT + 1)  # a later mmcache's
    assert write_snapshot(datadir, fold(_scenario()))
    monkeypatch.undo()
    datadir.refuse_foreign()  # still mmcache's own file
    assert _taken_from_files(datadir, caplog)


@pytest.mark.parametrize("where", ["header", "view"])
def test_a_snapshot_whose_crc_does_not_match_is_no_snapshot(tmp_path, caplog, where):
    datadir = written_datadir(tmp_path, _scenario())
    assert write_snapshot(datadir, fold(_scenario()))
    data = bytearray(datadir.snapshot.read_bytes())
    at = len(data) - 3 if where == "view" else data.index(b"41") + 1  # a Faust offset mark: 41 -> 40
    data[at] ^= 0x01
    datadir.snapshot.write_bytes(bytes(data))
    assert _taken_from_files(datadir, caplog)
