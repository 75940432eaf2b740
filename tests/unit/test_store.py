"""The key-value layout of the LRU state (stream/state/store.py), as a contract every store meets.

The same suite runs against a plain ``dict`` and against bare ``rocksdict.Rdict`` files opened
with ``DataDir.open_partition`` (raw byte keys, as Faust opens them): folding an
event log and mirroring each event's effects into one store per partition, then reading
the stores back, must give the live state again, with the same applied offsets.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rocksdict import Rdict

from stream.core.cache import CacheState, Capacity, Effects, Entry
from stream.core.events import EndpointDeleted, EndpointsSynced, ItemsPlaced, Position
from stream.core.items import Item
from stream.state.datadir import DataDir
from stream.state.store import (
    APPLIED_KEY,
    decode_applied,
    encode_applied,
    encode_entry,
    entry_key,
    read_partition,
    write_effects,
)
from tests.unit.eventlogs import EventLogs, Record, Scenario, view

FAUST_OFFSET_KEY = b"__faust\x00offset__"

# Endpoint names and hashes that look like the store's own keys, next to ordinary ones.
ENDPOINTS = ["ns/pod-0", "ns/pod-1", "applied", "__faust", "ns/p\u00e9-2"]
HASHES = ["h0", "h1", "applied", "__faust", "offset__", "h\u00e9"]


LOGS = EventLogs(ENDPOINTS, HASHES)
scenarios = LOGS.scenarios
partition_of = LOGS.partition_of


# -- the two stores ------------------------------------------------------------------------


class DictStores:
    """One plain dict per partition."""

    def __init__(self, root: Path) -> None:
        self.tables: dict[int, dict[bytes, bytes]] = {}

    def table(self, partition: int) -> dict[bytes, bytes]:
        return self.tables.setdefault(partition, {})

    def records(self, partition: int) -> list[tuple[bytes, bytes]]:
        return list(self.tables.get(partition, {}).items())

    def close(self) -> None:
        pass


class RocksStores:
    """One RocksDB file per partition under a data dir; read back after closing them."""

    def __init__(self, root: Path) -> None:
        self.datadir = DataDir(root)
        self.open: dict[int, Rdict] = {}

    def table(self, partition: int) -> Rdict:
        if partition not in self.open:
            self.open[partition] = self.datadir.open_partition(partition)
        return self.open[partition]

    def records(self, partition: int) -> list[tuple[bytes, bytes]]:
        """Read from a fresh read-only handle: what is in the files, not in a cache."""
        self.close()
        if partition not in self.datadir.partitions():
            return []
        db = self.datadir.open_partition(partition, read_only=True)
        try:
            return list(db.items())
        finally:
            db.close()

    def close(self) -> None:
        for db in self.open.values():
            db.close()
        self.open.clear()


STORES = {"dict": DictStores, "rdict": RocksStores}
_fresh = itertools.count()


@contextmanager
def stores_in(kind: str, root: Path):
    """A store set in a new sub-directory (one per hypothesis example)."""
    stores = STORES[kind](root / f"example-{next(_fresh)}")
    try:
        yield stores
    finally:
        stores.close()


def mirror(stores, scenario: Scenario, records: list[Record] | None = None) -> CacheState:
    """Fold the log, writing each applied event's effects to its partition's store."""
    state = CacheState(scenario.capacity)
    for position, event in scenario.log if records is None else records:
        effects = state.fold.apply(event, position)
        if effects is not None:
            write_effects(stores.table(position.partition), effects, position.offset)
    return state


def restored(stores, scenario: Scenario) -> CacheState:
    state = CacheState(scenario.capacity)
    for partition in range(scenario.partitions):
        applied, entries = read_partition(stores.records(partition))
        state.loading.restore(partition, applied, entries)
    return state


def check_round_trip(stores, scenario: Scenario) -> None:
    live = mirror(stores, scenario)
    copy = restored(stores, scenario)
    assert copy.digests.digest() == live.digests.digest()
    assert view(copy) == view(live)
    assert copy.lrus.applied == live.lrus.applied
    assert copy.index.holders == live.index.holders
    # One record per live entry plus one applied record per partition that saw an event.
    entries = sum(len(cache.entries) for cache in live.lrus.endpoints.values())
    stored = sum(len(stores.records(p)) for p in range(scenario.partitions))
    assert stored == entries + len(live.lrus.applied)


# Each example makes its own sub-directory of tmp_path, so sharing the fixture is safe.
_SHARED_TMP = [HealthCheck.function_scoped_fixture]
SETTINGS = {
    "dict": settings(max_examples=150, deadline=None, suppress_health_check=_SHARED_TMP),
    "rdict": settings(max_examples=25, deadline=None, suppress_health_check=_SHARED_TMP),
}


def _property(kind: str) -> Callable:
    @SETTINGS[kind]
    @given(scenario=scenarios())
    def test(tmp_path, scenario):
        with stores_in(kind, tmp_path) as stores:
            check_round_trip(stores, scenario)

    return test


test_round_trip_through_a_dict_store_gives_the_live_state = _property("dict")
test_round_trip_through_rocksdb_files_gives_the_live_state = _property("rdict")


def _resume_property(kind: str) -> Callable:
    @SETTINGS[kind]
    @given(scenario=scenarios(), data=st.data())
    def test(tmp_path, scenario, data):
        """Crash after ``stop`` records, restore from the store, redeliver from ``resume``."""
        stop = data.draw(st.integers(0, len(scenario.log)), label="stop")
        resume = data.draw(st.integers(0, stop), label="resume")
        with stores_in(kind, tmp_path) as stores:
            mirror(stores, scenario, scenario.log[:stop])
            state = restored(stores, scenario)
            for position, event in scenario.log[resume:]:
                effects = state.fold.apply(event, position)
                if effects is not None:
                    write_effects(stores.table(position.partition), effects, position.offset)
            once = CacheState(scenario.capacity)
            for position, event in scenario.log:
                once.fold.apply(event, position)
            assert state.digests.digest() == once.digests.digest()
            assert state.lrus.applied == once.lrus.applied
            again = restored(stores, scenario)
            assert again.digests.digest() == once.digests.digest()
            assert again.lrus.applied == once.lrus.applied

    return test


test_restore_then_redelivery_through_a_dict_store = _resume_property("dict")
test_restore_then_redelivery_through_rocksdb_files = _resume_property("rdict")


@pytest.mark.parametrize("kind", sorted(STORES))
def test_fixed_log_with_eviction_delete_and_sync_round_trips(kind, tmp_path):
    log = [
        (Position(0, 0), ItemsPlaced(endpoint="applied", items=[Item("a", 1, "image")])),
        (Position(0, 1), ItemsPlaced(endpoint="ns/pod-0", items=[Item("a", 2, "video")])),
        (
            Position(0, 4),
            ItemsPlaced(endpoint="applied", items=[Item(h, 1, "image") for h in "bcd"]),
        ),
        (Position(1, 0), ItemsPlaced(endpoint="ns/pod-1", items=[Item("x", 1, "audio")])),
        (Position(0, 5), ItemsPlaced(endpoint="applied", items=[Item("b", 1, "image")])),
        (Position(1, 1), EndpointDeleted(endpoint="ns/pod-1")),
        (Position(0, 6), EndpointsSynced(live=["applied"])),
    ]
    scenario = Scenario(Capacity("items", 3), 2, log)
    with stores_in(kind, tmp_path) as stores:
        live = mirror(stores, scenario)
        assert view(live) == {"applied": [("c", 1), ("d", 1), ("b", 1)]}
        assert live.lrus.applied == {0: 6, 1: 1}
        copy = restored(stores, scenario)
        assert view(copy) == view(live)
        assert copy.digests.digest() == live.digests.digest()
        assert copy.lrus.applied == {0: 6, 1: 1}


def test_write_effects_on_a_bare_rocksdict_file_removes_evicted_entries(tmp_path):
    """Rdict has no ``pop``: removals must use what it has (regression)."""
    state = CacheState(Capacity("items", 1))
    db = DataDir(tmp_path).open_partition(0)
    try:
        for offset, digest in enumerate(["a", "b"]):
            effects = state.fold.apply(
                ItemsPlaced(endpoint="e", items=[Item(digest, 1, "image")]), Position(0, offset)
            )
            write_effects(db, effects, offset)
        applied, entries = read_partition(db.items())
    finally:
        db.close()
    assert applied == 1
    assert [(e.endpoint, e.hash) for e in entries] == [("e", "b")]


# -- key layout ------------------------------------------------------------------------------


LOOKALIKES = ["applied", "\x02applied", "\x01", "\x02", "__faust", "__faust\x00offset__", "a\x00b"]


@pytest.mark.parametrize("endpoint", LOOKALIKES)
@pytest.mark.parametrize("digest", ["applied", "", "offset__", "h"])
def test_entry_keys_never_equal_the_applied_key(endpoint, digest):
    assert entry_key(endpoint, digest) != APPLIED_KEY
    assert entry_key(endpoint, digest) != FAUST_OFFSET_KEY


@pytest.mark.parametrize("kind", sorted(STORES))
def test_entries_of_lookalike_endpoints_and_the_applied_record_coexist(kind, tmp_path):
    names = ["applied", "__faust", "_applied", "\u00e9applied"]
    effects = Effects(upserts=[Entry(name, "applied", 3, 7, i) for i, name in enumerate(names)])
    with stores_in(kind, tmp_path) as stores:
        write_effects(stores.table(0), effects, 7)
        applied, entries = read_partition(stores.records(0))
    assert applied == 7
    assert sorted(entries) == sorted(effects.upserts)


def test_keys_with_the_same_text_split_differently_stay_distinct():
    """Endpoint names are printable: the first 0x00 separates endpoint from hash."""
    a = Entry("ns/a", "b\x00c", 1, 0, 0)
    b = Entry("ns/ab", "c", 1, 0, 1)
    assert entry_key(a.endpoint, a.hash) != entry_key(b.endpoint, b.hash)
    records = [(entry_key(e.endpoint, e.hash), encode_entry(e)) for e in (a, b)]
    assert sorted(read_partition(records)[1]) == sorted([a, b])


SHA = "ab" * 32


@pytest.mark.parametrize(
    ("digest", "stored_as_raw_bytes"),
    [
        (SHA, True),
        (SHA.upper(), False),  # upper case would come back lower case from raw bytes
        ("ab " * 21 + "a", False),  # bytes.fromhex skips spaces
        ("zz" * 32, False),
        (SHA[:-2], False),
        (SHA + "ab", False),
    ],
)
def test_only_lower_case_sha256_hex_is_stored_as_raw_bytes_and_every_hash_round_trips(
    digest, stored_as_raw_bytes
):
    entry = Entry("ns/pod", digest, 1, 0, 0)
    key = entry_key(entry.endpoint, entry.hash)
    assert (len(key) == len(b"\x01ns/pod\x03") + 32) is stored_as_raw_bytes
    assert read_partition([(key, encode_entry(entry))]) == (None, [entry])


@pytest.mark.parametrize("kind", sorted(STORES))
def test_read_partition_ignores_foreign_keys(kind, tmp_path):
    state = CacheState(Capacity("items", 4))
    with stores_in(kind, tmp_path) as stores:
        table = stores.table(0)
        table[FAUST_OFFSET_KEY] = b"41"
        table[b""] = b"x"
        table[b"\x03applied"] = b"\x00" * 8
        table[b"applied"] = encode_applied(99)
        for offset, digests in enumerate([["a", "b"], ["c"]]):
            event = ItemsPlaced(endpoint="e", items=[Item(d, 1, "image") for d in digests])
            write_effects(table, state.fold.apply(event, Position(0, offset)), offset)
        records = stores.records(0)
    assert (FAUST_OFFSET_KEY, b"41") in records
    applied, entries = read_partition(records)
    assert applied == 1
    assert [(e.endpoint, e.hash) for e in sorted(entries, key=lambda e: (e.offset, e.index))] == [
        ("e", "a"),
        ("e", "b"),
        ("e", "c"),
    ]


def test_read_partition_of_an_empty_store_has_no_applied_offset():
    assert read_partition([]) == (None, [])
    assert read_partition([(FAUST_OFFSET_KEY, b"3")]) == (None, [])


@pytest.mark.parametrize("offset", [0, 1, 2**32, 2**64 - 1])
def test_applied_offset_round_trips(offset):
    assert decode_applied(encode_applied(offset)) == offset


def test_entry_value_round_trips_through_read_partition():
    entry = Entry("ns/pod", "h\u00e9", 2**31 - 1, 2**63, 2**32 - 1)
    assert read_partition([(entry_key(entry.endpoint, entry.hash), encode_entry(entry))]) == (
        None,
        [entry],
    )


def test_write_effects_applies_upserts_then_removals_then_applied():
    table = {entry_key("e", "old"): encode_entry(Entry("e", "old", 1, 0, 0))}
    effects = Effects(upserts=[Entry("e", "new", 2, 5, 0)], removals=[("e", "old")])
    write_effects(table, effects, 5)
    assert table == {
        entry_key("e", "new"): encode_entry(Entry("e", "new", 2, 5, 0)),
        APPLIED_KEY: encode_applied(5),
    }


def test_changelog_gate_drops_events_written_again_after_later_ones():
    from stream.core.cache import Entry
    from stream.state.store import APPLIED_KEY, ChangelogGate, encode_applied, encode_entry, entry_key

    def event(offset: int, upserts: list[str], removals: list[str] = ()) -> list[tuple]:
        records = [(entry_key("ns/a", h), encode_entry(Entry("ns/a", h, 1, offset, i)))
                   for i, h in enumerate(upserts)]
        records += [(entry_key("ns/a", h), None) for h in removals]
        records.append((APPLIED_KEY, encode_applied(offset)))
        return [(key, value, (key, value)) for key, value in records]

    def items(records: list[tuple]) -> list[tuple]:
        return [item for _, _, item in records]

    gate = ChangelogGate()
    first = event(5, ["a"]) + event(6, ["b", "c"], ["a"])
    assert gate.admit(first) == items(first)
    # a zombie's (or a resent) batch of older events lands after the successor's
    assert gate.admit(event(3, ["stale"], ["b"]) + event(4, ["stale2"])) == []
    assert gate.dropped == 5  # every record of both events: 2 upserts, a removal, 2 applied
    later = event(7, ["d"], ["c"])
    # upserts tell their event at once; a removal waits for its event's applied record
    assert gate.admit(later[:2]) == items(later[:1])
    assert gate.admit(later[2:]) == items(later[1:])
    assert gate.applied == 7
    # a seeded changelog (entries of many events, one applied record) passes as it comes
    seeded = ChangelogGate()
    seed = [(entry_key("ns/s", f"h{i}"), encode_entry(Entry("ns/s", f"h{i}", 1, i, 0)), i)
            for i in range(100)]
    assert seeded.admit(seed) == list(range(100))


def test_a_copy_of_a_changelog_gate_admits_again_what_the_gate_admitted_after_it():
    """A restore the file refused is given again from the copy taken before it."""
    from stream.core.cache import Entry
    from stream.state.store import APPLIED_KEY, ChangelogGate, encode_applied, encode_entry, entry_key

    def event(offset: int, upserts: list[str], removals: list[str] = ()) -> list[tuple]:
        records = [(entry_key("ns/a", h), encode_entry(Entry("ns/a", h, 1, offset, i)))
                   for i, h in enumerate(upserts)]
        records += [(entry_key("ns/a", h), None) for h in removals]
        records.append((APPLIED_KEY, encode_applied(offset)))
        return [(key, value, (offset, key)) for key, value in records]

    gate = ChangelogGate()
    gate.admit(event(5, ["a"]))
    gate.admit(event(6, ["b"], ["a"])[:2])  # its removal waits for its applied record
    before = gate.copy()
    batch = event(6, [], [])[-1:] + event(7, ["c"])  # 6's applied record, then 7
    first = gate.admit(batch)
    assert len(first) == 4 and gate.applied == 7  # 6's removal, 6's applied record, 7's two
    assert before.applied == 5
    assert before.admit(batch) == first  # the same items again, the held removal included
