"""Offline rebuild pieces and the data dir rules: ``Until``, ``write_state``, ``DataDir``."""

from __future__ import annotations

import itertools
import os
import time
from datetime import UTC, datetime

import orjson
import pytest
from hypothesis import HealthCheck, given, settings

from stream.core.cache import CacheState, Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.items import Item
from stream.state.datadir import STATE_FORMAT, DataDir, StateMismatch
from stream.state.rebuild import Until, balanced_groups, write_state
from tests.unit.test_store import Scenario, scenarios, view

APP, TOPIC = "mmcache", "mmcache-events"


def utc_ms(*args) -> int:
    return int(datetime(*args, tzinfo=UTC).timestamp() * 1000)


# -- Until --------------------------------------------------------------------------------


def test_until_none_means_no_limit():
    until = Until.parse(None)
    assert until == Until(offset=None, timestamp_ms=None)
    assert not until.stops_before(10**12, 2**62)


@pytest.mark.parametrize("text, offset", [("42", 42), ("0", 0), ("007", 7)])
def test_until_integer_is_an_offset(text, offset):
    assert Until.parse(text) == Until(offset=offset)


def test_until_offset_is_inclusive_in_every_partition():
    until = Until.parse("42")
    assert not until.stops_before(0, 0)
    assert not until.stops_before(42, 2**62)
    assert until.stops_before(43, 0)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2024-01-01T00:00:00Z", utc_ms(2024, 1, 1)),
        ("2024-01-01T00:00:00+00:00", utc_ms(2024, 1, 1)),
        ("2024-01-01T02:00:00+02:00", utc_ms(2024, 1, 1)),
        ("2023-12-31T19:00:00-05:00", utc_ms(2024, 1, 1)),
        ("2024-01-01T00:00:00.250Z", utc_ms(2024, 1, 1) + 250),
        ("2024-01-01 00:00:00Z", utc_ms(2024, 1, 1)),
    ],
)
def test_until_iso_time_with_a_zone_is_a_timestamp(text, expected):
    assert Until.parse(text) == Until(timestamp_ms=expected)


@pytest.fixture
def new_york_time(monkeypatch):
    """Run with a local zone that is not UTC (and has daylight saving time)."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2024-01-01T00:00:00", utc_ms(2024, 1, 1)),
        ("2024-07-01T12:30:00", utc_ms(2024, 7, 1, 12, 30)),
    ],
)
def test_until_naive_iso_time_is_utc(new_york_time, text, expected):
    assert os.environ["TZ"] == "America/New_York"
    assert Until.parse(text) == Until(timestamp_ms=expected)


def test_until_naive_iso_time_is_utc_when_the_machine_runs_on_utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    try:
        assert Until.parse("2024-01-01T00:00:00") == Until(timestamp_ms=utc_ms(2024, 1, 1))
    finally:
        monkeypatch.undo()
        time.tzset()


def test_until_timestamp_is_inclusive_and_ignores_offsets():
    until = Until.parse("2024-01-01T00:00:00Z")
    limit = utc_ms(2024, 1, 1)
    assert not until.stops_before(10**9, limit)
    assert not until.stops_before(0, limit - 1)
    assert until.stops_before(0, limit + 1)


def test_until_with_both_limits_stops_at_either():
    until = Until(offset=10, timestamp_ms=1000)
    assert not until.stops_before(10, 1000)
    assert until.stops_before(11, 0)
    assert until.stops_before(0, 1001)


@pytest.mark.parametrize("text", ["yesterday", "-1", "", "2024-13-01"])
def test_until_rejects_what_is_neither_offset_nor_time(text):
    with pytest.raises(ValueError):
        Until.parse(text)


# -- write_state / load_state -----------------------------------------------------------------


def folded(scenario: Scenario) -> CacheState:
    state = CacheState(scenario.capacity)
    for position, event in scenario.log:
        state.fold.apply(event, position)
    return state


_fresh = itertools.count()


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(scenarios())
def test_write_state_then_load_state_gives_the_same_state(tmp_path, scenario):
    datadir = DataDir(tmp_path / f"example-{next(_fresh)}")  # one dir per example
    state = folded(scenario)
    datadir.check(DataDir.identity(APP, TOPIC, state.lrus.capacity))
    write_state(datadir, state, range(scenario.partitions))
    loaded = DataDir(datadir.root).load_state()
    assert loaded.lrus.capacity == state.lrus.capacity
    assert loaded.digests.digest() == state.digests.digest()
    assert view(loaded) == view(state)
    assert loaded.lrus.applied == state.lrus.applied
    assert loaded.index.holders == state.index.holders
    assert datadir.partitions() == list(range(scenario.partitions))


def big_state(partitions: int) -> CacheState:
    state = CacheState(Capacity("items", 5))
    for offset in range(12):
        for partition in range(partitions):
            endpoint = f"ns/pod-{partition}-{offset % 3}"
            items = [Item(f"h{offset}-{i}", i + 1, "image") for i in range(3)]
            state.fold.apply(ItemsPlaced(endpoint=endpoint, items=items), Position(partition, offset))
    return state


def test_write_state_orders_keys_of_lookalike_endpoints_and_hashes(tmp_path):
    """An SST file takes keys in strictly increasing order only: names that are prefixes
    of each other, non-ASCII names, and raw and text hashes side by side must all fit.
    """
    state = CacheState(Capacity("items", 8))
    names = ["ns/a", "ns/ab", "ns/a b", "ns/a~", "ns/\u00e9", "ns/A", "n"]
    digests = ["ff" * 32, "00" * 32, "text", "Upper" * 4, "a\x00b", "ab" * 32]
    for offset, name in enumerate(names):
        items = [Item(d, offset + 1, "image") for d in digests]
        state.fold.apply(ItemsPlaced(endpoint=name, items=items), Position(offset % 2, offset))
    datadir = DataDir(tmp_path)
    datadir.check(DataDir.identity(APP, TOPIC, state.lrus.capacity))
    write_state(datadir, state, range(2))
    loaded = datadir.load_state()
    assert loaded.digests.digest() == state.digests.digest()
    assert view(loaded) == view(state)
    assert loaded.lrus.applied == state.lrus.applied == {0: 6, 1: 5}
    assert sorted(p.name for p in datadir.tables.iterdir()) == ["lru-0.db", "lru-1.db"]


def test_states_of_partition_groups_written_side_by_side_load_as_one(tmp_path):
    """What a parallel rebuild does: each process folds and writes its own partitions."""
    whole = big_state(3)
    datadir = DataDir(tmp_path)
    datadir.check(DataDir.identity(APP, TOPIC, whole.lrus.capacity))
    for group in ([0, 2], [1]):
        part = CacheState(whole.lrus.capacity)
        for offset in range(12):
            for partition in group:
                endpoint = f"ns/pod-{partition}-{offset % 3}"
                items = [Item(f"h{offset}-{i}", i + 1, "image") for i in range(3)]
                event = ItemsPlaced(endpoint=endpoint, items=items)
                part.fold.apply(event, Position(partition, offset))
        write_state(datadir, part, group)
    loaded = datadir.load_state()
    assert datadir.partitions() == [0, 1, 2]
    assert loaded.digests.digest() == whole.digests.digest()
    assert view(loaded) == view(whole)
    assert loaded.lrus.applied == whole.lrus.applied


def test_write_state_of_an_empty_state_loads_empty(tmp_path):
    state = CacheState(Capacity("size", 9))
    datadir = DataDir(tmp_path)
    datadir.check(DataDir.identity(APP, TOPIC, state.lrus.capacity))
    write_state(datadir, state, range(2))
    loaded = datadir.load_state()
    assert loaded.lrus.capacity == Capacity("size", 9)
    assert loaded.lrus.endpoints == {} and loaded.lrus.applied == {}
    assert loaded.digests.digest() == state.digests.digest()


def test_load_state_of_a_dir_without_identity_is_refused(tmp_path):
    with pytest.raises(StateMismatch):
        DataDir(tmp_path).load_state()


# -- DataDir identity ------------------------------------------------------------------------


CAPACITY = Capacity("items", 1024)
IDENTITY = DataDir.identity(APP, TOPIC, CAPACITY)


def test_check_marks_an_empty_dir_and_accepts_the_same_identity(tmp_path):
    datadir = DataDir(tmp_path / "new")
    datadir.check(IDENTITY)
    assert orjson.loads(datadir.marker.read_bytes()) == IDENTITY
    assert datadir.read_identity() == IDENTITY
    assert IDENTITY["format"] == STATE_FORMAT
    DataDir(datadir.root).check(DataDir.identity(APP, TOPIC, Capacity("items", 1024)))


@pytest.mark.parametrize(
    "other",
    [
        DataDir.identity("other-app", TOPIC, CAPACITY),
        DataDir.identity(APP, "other-topic", CAPACITY),
        DataDir.identity(APP, TOPIC, Capacity("items", 512)),
        DataDir.identity(APP, TOPIC, Capacity("size", 1024)),
        DataDir.identity(APP, TOPIC, CAPACITY, 1024),
        {**IDENTITY, "format": STATE_FORMAT + 1},
    ],
    ids=["app-id", "topic", "capacity", "capacity-mode", "engine-view-bound", "format"],
)
def test_check_refuses_a_dir_built_for_something_else(tmp_path, other):
    DataDir(tmp_path).check(IDENTITY)
    with pytest.raises(StateMismatch):
        DataDir(tmp_path).check(other)
    with pytest.raises(StateMismatch):
        DataDir(tmp_path).claim(other)
    assert DataDir(tmp_path).read_identity() == IDENTITY


# -- DataDir claim / release -------------------------------------------------------------------


def populated(root) -> tuple[DataDir, str]:
    """A worker dir with one partition file, as a worker leaves it while running."""
    state = big_state(1)
    datadir = DataDir(root)
    datadir.claim(IDENTITY)
    write_state(datadir, state, [0])
    return datadir, state.digests.digest()


def test_claim_after_a_crash_drops_the_tables_but_keeps_the_identity(tmp_path):
    datadir, _ = populated(tmp_path)
    assert datadir.running.exists()  # the worker never released it
    DataDir(tmp_path).claim(IDENTITY)
    assert not datadir.tables.exists()
    assert datadir.partitions() == []
    assert datadir.read_identity() == IDENTITY
    assert datadir.running.exists()
    assert datadir.load_state().lrus.endpoints == {}


def test_claim_after_a_clean_release_keeps_the_tables(tmp_path):
    datadir, digest = populated(tmp_path)
    datadir.release()
    assert not datadir.running.exists()
    again = DataDir(tmp_path)
    again.claim(IDENTITY)
    assert again.running.exists()
    assert again.partitions() == [0]
    assert again.load_state().digests.digest() == digest


def test_claim_keeps_a_rebuilt_seed_even_with_a_running_marker(tmp_path):
    datadir, digest = populated(tmp_path)
    datadir.mark_seed()
    DataDir(tmp_path).claim(IDENTITY)
    assert datadir.load_state().digests.digest() == digest


def test_claim_never_clears_a_state_of_another_identity(tmp_path):
    datadir, digest = populated(tmp_path)
    datadir.release()
    other = DataDir.identity("other-app", TOPIC, CAPACITY)
    with pytest.raises(StateMismatch):
        DataDir(tmp_path).claim(other)
    assert datadir.read_identity() == IDENTITY
    assert datadir.load_state().digests.digest() == digest


def test_release_twice_is_harmless(tmp_path):
    datadir = DataDir(tmp_path)
    datadir.claim(IDENTITY)
    datadir.release()
    datadir.release()
    assert not datadir.running.exists()


# -- partitions ---------------------------------------------------------------------------


def test_partitions_lists_the_partition_files_in_order(tmp_path):
    datadir = DataDir(tmp_path)
    assert datadir.partitions() == []
    for partition in (10, 2, 0):
        datadir.open_partition(partition).close()
    (datadir.tables / "lru-x.db").mkdir()
    (datadir.tables / "other-3.db").mkdir()
    (datadir.tables / "lru-4.db.bak").mkdir()
    assert datadir.partitions() == [0, 2, 10]
    assert datadir.partition_path(2) == tmp_path / "v1" / "tables" / "lru-2.db"


# -- balanced_groups ---------------------------------------------------------------------------


def test_balanced_groups_even_out_the_records_of_uneven_partitions():
    sizes = {0: 520, 1: 480, 2: 100, 3: 90, 4: 10, 5: 0}
    groups = balanced_groups(sizes, 2)
    assert sorted(p for group in groups for p in group) == list(sizes)
    assert sorted(sum(sizes[p] for p in group) for group in groups) == [590, 610]


def test_balanced_groups_leave_out_groups_with_nothing_to_do():
    assert balanced_groups({0: 5}, 3) == [[0]]
    assert balanced_groups({0: 5, 1: 5, 2: 5, 3: 5}, 2) == [[0, 2], [1, 3]]
