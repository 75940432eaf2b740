"""The agent's logic (``StateKeeper``): records of the event topic -> view + table + metrics.

A plain dict plays the Faust table of one partition; the metrics are the real ones.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import weakref
from types import SimpleNamespace

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stream.core.cache import CacheState, Capacity
from stream.core.codec import MalformedEvent, decode_event, encode_event
from stream.core.events import EndpointDeleted, EndpointsSynced, ItemsPlaced, Position
from stream.core.items import Item
from stream.metrics import Metrics
from stream.state.datadir import DataDir
from stream.state.preload import LocalPreload
from stream.state.rebuild import write_state
from stream.state.store import APPLIED_KEY, FAUST_OFFSET_KEY, decode_applied, write_effects
from stream.worker.app import MappingMirror, StateKeeper
from stream.worker.keeper import APPLY_SLICE
from tests.unit.test_store import Scenario, scenarios, view


def apply_one(keeper: StateKeeper, partition: int, offset: int, raw: bytes | None,
              key: bytes | None = None) -> None:
    """One record of the event topic through the keeper's batch path, as Faust gives it."""
    keeper.apply_batch(partition, [SimpleNamespace(offset=offset, key=key, value=raw)])

SETTINGS = settings(max_examples=100, deadline=None)


def keeper_for(capacity: Capacity) -> StateKeeper:
    state = CacheState(capacity)
    return StateKeeper(state, MappingMirror({0: {}}), Metrics(state, lambda: {}))


def table_of(keeper: StateKeeper) -> dict:
    return keeper.mirror.stores[0]


def records_of(scenario: Scenario) -> list[tuple[int, bytes]]:
    return [(position.offset, encode_event(event)) for position, event in scenario.log]


def key_of(raw: bytes | None) -> bytes | None:
    """The key mmcache's publisher gives a record: its endpoint, if it has one."""
    try:
        return getattr(decode_event(raw), "endpoint", "").encode() or None
    except MalformedEvent:
        return None


def feed(keeper: StateKeeper, records) -> None:
    for offset, raw in records:
        apply_one(keeper, 0, offset, raw, key_of(raw))


def fold(scenario: Scenario) -> CacheState:
    state = CacheState(scenario.capacity)
    for position, event in scenario.log:
        state.fold.apply(event, position)
    return state


def sample(keeper: StateKeeper, name: str, labels: dict[str, str] | None = None) -> float:
    return keeper.metrics.registry.get_sample_value(name, labels or {}) or 0.0


def events_counted(keeper: StateKeeper) -> float:
    return sum(
        sample(keeper, "mmcache_events_processed_total", {"type": kind})
        for kind in ("items_placed", "endpoint_deleted", "endpoints_synced")
    )


def reload(keeper: StateKeeper, tables: dict, preload: LocalPreload | None = None) -> None:
    """``StateKeeper.reload`` of dict tables put in key order first, as RocksDB iterates
    (the sliced loader restores each endpoint when its keys end)."""
    for table in tables.values():
        ordered = sorted(dict.items(table))  # dict.items: not a counted read
        table.clear()
        table.update(ordered)
    asyncio.run(keeper.reload(tables, preload))


def reloaded(keeper: StateKeeper) -> CacheState:
    fresh = keeper_for(keeper.state.lrus.capacity)
    reload(fresh, {0: table_of(keeper)})
    return fresh.state


one_partition = scenarios(partitions=1)


@SETTINGS
@given(one_partition)
def test_applying_records_in_order_builds_the_state(scenario):
    keeper = keeper_for(scenario.capacity)
    feed(keeper, records_of(scenario))
    expected = fold(scenario)
    assert keeper.state.digests.digest() == expected.digests.digest()
    assert view(keeper.state) == view(expected)
    assert keeper.state.lrus.applied == expected.lrus.applied
    assert events_counted(keeper) == len(scenario.log)
    assert sample(keeper, "mmcache_redelivered_events_total") == 0
    assert sample(keeper, "mmcache_malformed_events_total") == 0
    if scenario.log:
        assert decode_applied(table_of(keeper)[APPLIED_KEY]) == scenario.log[-1][0].offset


@SETTINGS
@given(one_partition, st.data())
def test_redelivered_suffix_changes_neither_state_nor_table(scenario, data):
    keeper = keeper_for(scenario.capacity)
    records = records_of(scenario)
    feed(keeper, records)
    digest, applied, table = keeper.state.digests.digest(), dict(keeper.state.lrus.applied), dict(table_of(keeper))
    counted = events_counted(keeper)
    start = data.draw(st.integers(0, len(records)), label="start")
    feed(keeper, records[start:])
    assert keeper.state.digests.digest() == digest
    assert keeper.state.lrus.applied == applied
    assert table_of(keeper) == table
    assert sample(keeper, "mmcache_redelivered_events_total") == len(records) - start
    assert events_counted(keeper) == counted


@SETTINGS
@given(one_partition, st.data())
def test_crash_reload_and_redelivery_equals_one_pass(scenario, data):
    """The table after ``stop`` records is what survives; the consumer resumes earlier."""
    records = records_of(scenario)
    stop = data.draw(st.integers(0, len(records)), label="stop")
    resume = data.draw(st.integers(0, stop), label="resume")
    first = keeper_for(scenario.capacity)
    feed(first, records[:stop])
    second = keeper_for(scenario.capacity)
    second.mirror.stores[0] = first.mirror.stores[0]
    reload(second, {0: table_of(second)})
    feed(second, records[resume:])
    once = fold(scenario)
    assert second.state.digests.digest() == once.digests.digest()
    assert second.state.lrus.applied == once.lrus.applied
    assert sample(second, "mmcache_redelivered_events_total") == stop - resume


@SETTINGS
@given(one_partition)
def test_reload_from_the_table_gives_the_same_state(scenario):
    keeper = keeper_for(scenario.capacity)
    feed(keeper, records_of(scenario))
    copy = reloaded(keeper)
    assert copy.digests.digest() == keeper.state.digests.digest()
    assert view(copy) == view(keeper.state)
    assert copy.lrus.applied == keeper.state.lrus.applied
    assert copy.index.holders == keeper.state.index.holders


def test_reload_replaces_the_reloaded_partitions_and_keeps_the_others():
    keeper = keeper_for(Capacity("items", 4))
    feed(keeper, [(0, encode_event(ItemsPlaced(endpoint="e", items=[Item("a", 1, "image")])))])
    digest = keeper.state.digests.digest()
    stray = ItemsPlaced(endpoint="stray", items=[Item("z", 1, "image")])
    keeper.state.fold.apply(stray, Position(0, 7))  # in partition 0's view, not in its table
    other = ItemsPlaced(endpoint="other", items=[Item("o", 1, "image")])
    keeper.state.fold.apply(other, Position(5, 0))  # another partition, kept by the follower
    reload(keeper, {0: table_of(keeper)})
    assert keeper.state.lrus.applied == {0: 0, 5: 0}
    assert "z" not in keeper.state.index.holders
    assert keeper.state.index.holders["o"] == {"other"}
    keeper.state.loading.drop_partition(5)
    assert keeper.state.digests.digest() == digest


# -- preloading the local state -------------------------------------------------------------

class CountedReads(dict):
    """A table whose full reads are counted, to tell a reused preload from a reread."""

    reads = 0

    def items(self):
        self.reads += 1
        return super().items()


def written_datadir(tmp_path, scenario: Scenario) -> DataDir:
    """The scenario's state as a stopped worker leaves it: files plus Faust's offset record."""
    datadir = DataDir(tmp_path / f"dir-{next(_dirs)}")
    datadir.check(DataDir.identity("app", "topic", scenario.capacity))
    write_state(datadir, fold(scenario), range(scenario.partitions))
    for partition in range(scenario.partitions):
        db = datadir.open_partition(partition)
        db[FAUST_OFFSET_KEY] = b"41"
        db.close()
    return datadir


def tables_of(datadir: DataDir) -> dict[int, CountedReads]:
    tables = {}
    for partition in datadir.partitions():
        db = datadir.open_partition(partition, read_only=True)
        tables[partition] = CountedReads(db.items())
        db.close()
    return tables


_dirs = itertools.count()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenarios(partitions=3))
def test_a_preload_of_unchanged_partitions_is_taken_over_without_reading_them_again(
    tmp_path, scenario
):
    datadir = written_datadir(tmp_path, scenario)
    preload = asyncio.run(LocalPreload(datadir, scenario.capacity).start().wait())
    tables = tables_of(datadir)
    keeper = keeper_for(scenario.capacity)
    reload(keeper, tables, preload)
    expected = fold(scenario)
    assert keeper.state.digests.digest() == expected.digests.digest()
    assert keeper.state.lrus.applied == expected.lrus.applied
    assert keeper.state.index.holders == expected.index.holders
    assert [t.reads for t in tables.values()] == [0, 0, 0]


def test_a_preloaded_partition_that_recovery_changed_is_read_again_and_one_not_owned_is_kept(tmp_path):
    """A changed owned partition is read from the table; one that is not owned keeps
    answering from the preload until the follower's re-read replaces it."""
    placed = [ItemsPlaced(endpoint=f"ns/pod-{p}", items=[Item(f"h{p}", 1, "image")]) for p in range(3)]
    scenario = Scenario(Capacity("items", 4), 3, [(Position(p, 0), e) for p, e in enumerate(placed)])
    datadir = written_datadir(tmp_path, scenario)
    preload = asyncio.run(LocalPreload(datadir, scenario.capacity).start().wait())
    tables = tables_of(datadir)
    # after the preload, recovery wrote a changelog record to partition 1
    later = ItemsPlaced(endpoint="ns/pod-1", items=[Item("late", 1, "image")])
    expected = fold(scenario)
    write_effects(tables[1], expected.fold.apply(later, Position(1, 1)), 1)
    tables[1][FAUST_OFFSET_KEY] = b"42"
    keeper = keeper_for(scenario.capacity)
    reload(keeper, {0: tables[0], 1: tables[1]}, preload)  # partition 2 went to another worker
    assert keeper.state.digests.digest() == expected.digests.digest()
    assert keeper.state.lrus.applied == {0: 0, 1: 1, 2: 0}
    assert keeper.state.index.holders["h2"] == {"ns/pod-2"}
    assert (tables[0].reads, tables[1].reads) == (0, 1)


def test_a_preload_holds_the_changelog_only_up_to_each_files_offset_record(tmp_path):
    placed = [ItemsPlaced(endpoint=f"ns/pod-{p}", items=[Item(f"h{p}", 1, "image")]) for p in range(2)]
    scenario = Scenario(Capacity("items", 4), 2, [(Position(p, 0), e) for p, e in enumerate(placed)])
    preload = asyncio.run(LocalPreload(written_datadir(tmp_path, scenario), scenario.capacity)
                          .start().wait())
    assert preload.holds_changelog({0: 42, 1: 42})  # each file's offset record is 41
    assert preload.holds_changelog({0: 42, 1: 42, 2: 0})  # no file, an empty changelog
    assert not preload.holds_changelog({0: 42, 1: 43})  # a record written after the file
    assert not preload.holds_changelog({0: 42, 1: 42, 2: 1})  # a partition it has no file of


def test_a_preload_taken_in_before_the_recovery_is_not_merged_again(tmp_path):
    placed = [ItemsPlaced(endpoint=f"ns/pod-{p}", items=[Item(f"h{p}", 1, "image")]) for p in range(2)]
    scenario = Scenario(Capacity("items", 4), 2, [(Position(p, 0), e) for p, e in enumerate(placed)])
    datadir = written_datadir(tmp_path, scenario)
    preload = asyncio.run(LocalPreload(datadir, scenario.capacity).start().wait())
    keeper = keeper_for(scenario.capacity)
    preload.merge_into(keeper.state)  # the early readiness of a restart
    tables = tables_of(datadir)
    reload(keeper, tables, preload)  # the first recovery, after the group join
    assert keeper.state.digests.digest() == fold(scenario).digests.digest()
    assert [t.reads for t in tables.values()] == [0, 0]


def test_a_preload_that_failed_leaves_the_reading_to_the_keeper(tmp_path):
    scenario = Scenario(Capacity("items", 4), 1,
                        [(Position(0, 0), ItemsPlaced(endpoint="e", items=[Item("a", 1, "image")]))])
    datadir = written_datadir(tmp_path, scenario)
    tables = tables_of(datadir)
    (datadir.tables / "lru-1.db").mkdir()  # not a RocksDB: opening it fails
    preload = asyncio.run(LocalPreload(datadir, scenario.capacity).start().wait())
    assert preload.state is None
    keeper = keeper_for(scenario.capacity)
    reload(keeper, tables, preload)
    assert keeper.state.digests.digest() == fold(scenario).digests.digest()
    assert tables[0].reads == 1


# -- recoveries after the first: what the view already holds --------------------------------

def three_pods(tmp_path) -> tuple[Scenario, dict[int, CountedReads]]:
    placed = [ItemsPlaced(endpoint=f"ns/pod-{p}", items=[Item(f"h{p}", 1, "image")]) for p in range(3)]
    scenario = Scenario(Capacity("items", 4), 3, [(Position(p, 0), e) for p, e in enumerate(placed)])
    return scenario, tables_of(written_datadir(tmp_path, scenario))


def test_a_rebalance_reads_only_the_partitions_whose_files_moved_past_the_view(tmp_path):
    """Each recovery used to read every owned partition again; now only one whose file's
    offset record is not the one the view holds it up to."""
    scenario, tables = three_pods(tmp_path)
    keeper = keeper_for(scenario.capacity)
    reload(keeper, tables)
    assert [t.reads for t in tables.values()] == [1, 1, 1]
    reload(keeper, tables)  # a rebalance that changed nothing
    assert [t.reads for t in tables.values()] == [1, 1, 1]
    # the recovery restored a record another owner wrote to partition 1
    later = ItemsPlaced(endpoint="ns/pod-1", items=[Item("late", 1, "image")])
    expected = fold(scenario)
    write_effects(tables[1], expected.fold.apply(later, Position(1, 1)), 1)
    tables[1][FAUST_OFFSET_KEY] = b"42"
    reload(keeper, tables)
    assert [t.reads for t in tables.values()] == [1, 2, 1]
    assert keeper.state.digests.digest() == expected.digests.digest()
    assert keeper.state.index.holders["late"] == {"ns/pod-1"}


def test_a_partition_whose_mark_was_forgotten_or_a_view_not_stored_is_read_again(tmp_path):
    scenario, tables = three_pods(tmp_path)
    keeper = keeper_for(scenario.capacity)
    reload(keeper, tables)
    keeper.marks.forget(2)  # a batch of partition 2 that was not stored
    reload(keeper, tables)
    assert [t.reads for t in tables.values()] == [1, 1, 2]
    keeper.marks.distrust(0)  # a zombie's records between this worker's: never trusted again
    reload(keeper, tables)
    reload(keeper, tables)
    assert [t.reads for t in tables.values()] == [3, 1, 2]
    keeper._rejected["apply_failed"] = 1  # a fold failed part-way: the view is not its files'
    reload(keeper, tables)
    assert [t.reads for t in tables.values()] == [4, 2, 3]
    assert keeper.state.digests.digest() == fold(scenario).digests.digest()


def test_a_partition_the_follower_held_to_the_files_offset_is_taken_over_without_reading_it(tmp_path):
    """A takeover: partition 2 was followed up to the changelog offset its file now holds."""
    scenario, tables = three_pods(tmp_path)
    keeper = keeper_for(scenario.capacity)
    reload(keeper, {0: tables[0], 1: tables[1]})
    followed = CacheState(scenario.capacity)  # what the follower read of partition 2
    for position, event in scenario.log:
        if position.partition == 2:
            followed.fold.apply(event, position)
    keeper.state.merge(followed)
    keeper.marks.set(2, 41)
    reload(keeper, tables)
    assert [t.reads for t in tables.values()] == [1, 1, 0]
    keeper.marks.set(2, 40)  # followed only up to the record before: read
    reload(keeper, tables)
    assert [t.reads for t in tables.values()] == [1, 1, 1]
    assert keeper.state.digests.digest() == fold(scenario).digests.digest()


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self
        self.payload = bytearray(1 << 20)


def test_a_reload_that_reads_nothing_freezes_nothing(tmp_path):
    """The entries a reload reads are frozen, out of the collector's full passes
    (``freeze_the_view``); a reload that reads nothing (after each rebase of the embedded
    broker) freezes nothing, so that what is alive then and garbage later in a cycle is
    collected."""
    scenario, tables = three_pods(tmp_path)
    keeper = keeper_for(scenario.capacity)
    gc.unfreeze()
    try:
        reload(keeper, tables)
        frozen = gc.get_freeze_count()
        assert frozen > 0, "the entries read were not frozen"
        alive = _Cycle()
        garbage_later = weakref.ref(alive)
        reload(keeper, tables)
        assert [t.reads for t in tables.values()] == [1, 1, 1]  # nothing read again
        assert gc.get_freeze_count() <= frozen
        del alive
        gc.collect()
        assert garbage_later() is None, "an object of the time of a reload that read nothing was frozen"
        assert keeper.state.digests.digest() == fold(scenario).digests.digest()
    finally:
        gc.unfreeze()


# -- malformed records ----------------------------------------------------------------------

PLACE_A = ItemsPlaced(endpoint="ns/pod", items=[Item("a", 1, "image")])
PLACE_B = ItemsPlaced(endpoint="ns/pod", items=[Item("b", 2, "video")], request_id="r")
PLACE_C = ItemsPlaced(endpoint="ns/other", items=[Item("a", 1, "image")])


def _with(event, **changes) -> bytes:
    doc = orjson.loads(encode_event(event))
    doc.update(changes)
    return orjson.dumps(doc)


MALFORMED = {
    "not-json": b"not json {",
    "empty": b"",
    "tombstone": None,
    "version-2": _with(PLACE_A, v=2),
    "unknown-type": orjson.dumps({"v": 1, "type": "items_evicted", "endpoint": "ns/pod"}),
    "no-items": _with(PLACE_A, items=[]),
    "zero-size": _with(PLACE_A, items=[{"hash": "a", "size": 0, "modality": "image"}]),
    "extra-field": _with(EndpointDeleted(endpoint="ns/pod"), extra=1),
    "control-char-endpoint": _with(EndpointDeleted(endpoint="ns/pod"), endpoint="ns/\x00pod"),
    "array": b"[1, 2]",
    "live-not-list": _with(EndpointsSynced(live=["ns/pod"]), live="ns/pod"),
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_record_is_counted_skipped_and_later_records_apply(raw):
    keeper = keeper_for(Capacity("items", 4))
    feed(keeper, [(0, encode_event(PLACE_A)), (1, encode_event(PLACE_B))])
    digest, table = keeper.state.digests.digest(), dict(table_of(keeper))
    entries = {k: v for k, v in table.items() if k != APPLIED_KEY}

    apply_one(keeper, 0, 2, raw)
    assert sample(keeper, "mmcache_malformed_events_total") == 1
    assert keeper.state.lrus.applied == {0: 2}
    assert keeper.state.digests.digest() == digest
    assert {k: v for k, v in table_of(keeper).items() if k != APPLIED_KEY} == entries
    assert events_counted(keeper) == 2

    apply_one(keeper, 0, 2, raw)  # redelivered: not counted again
    assert sample(keeper, "mmcache_malformed_events_total") == 1
    assert keeper.state.digests.digest() == digest

    apply_one(keeper, 0, 3, encode_event(PLACE_C), b"ns/other")
    assert view(keeper.state) == {"ns/pod": [("a", 1), ("b", 2)], "ns/other": [("a", 1)]}
    assert keeper.state.lrus.applied == {0: 3}
    assert decode_applied(table_of(keeper)[APPLIED_KEY]) == 3
    assert events_counted(keeper) == 3
    assert sample(keeper, "mmcache_malformed_events_total") == 1
    assert reloaded(keeper).digests.digest() == keeper.state.digests.digest()


def test_version_field_defaults_to_1_so_a_record_without_it_applies():
    keeper = keeper_for(Capacity("items", 4))
    doc = orjson.loads(encode_event(PLACE_A))
    del doc["v"]
    apply_one(keeper, 0, 0, orjson.dumps(doc), b"ns/pod")
    assert sample(keeper, "mmcache_malformed_events_total") == 0
    assert view(keeper.state) == {"ns/pod": [("a", 1)]}


def test_malformed_record_at_an_old_offset_is_a_redelivery_not_malformed():
    keeper = keeper_for(Capacity("items", 4))
    feed(keeper, [(0, encode_event(PLACE_A)), (1, encode_event(PLACE_B))])
    apply_one(keeper, 0, 1, b"garbage")
    assert sample(keeper, "mmcache_malformed_events_total") == 0
    assert keeper.state.lrus.applied == {0: 1}


def test_applied_offset_of_a_trailing_malformed_record_survives_reload():
    keeper = keeper_for(Capacity("items", 4))
    feed(keeper, [(0, encode_event(PLACE_A)), (1, b"not json")])
    assert keeper.state.lrus.applied == {0: 1}
    assert reloaded(keeper).lrus.applied == {0: 1}


# -- dead letters ---------------------------------------------------------------------------

def test_records_not_applied_become_dead_letters_counted_by_reason_and_later_ones_apply():
    from stream.core.routing import key_partition

    parts = 4
    state = CacheState(Capacity("items", 4))
    keeper = StateKeeper(state, MappingMirror({}), Metrics(state, lambda: {}), parts)
    home = key_partition(b"ns/pod", parts)
    wrong = (home + 1) % parts
    placed = encode_event(PLACE_A)
    apply_one(keeper, home, 0, b"not json", b"ns/pod")
    apply_one(keeper, home, 1, _with(PLACE_A, v=99), b"ns/pod")
    apply_one(keeper, home, 2, placed, b"ns/other")
    apply_one(keeper, wrong, 0, placed, b"ns/pod")
    apply_one(keeper, home, 3, placed, b"ns/pod")
    assert view(keeper.state) == {"ns/pod": [("a", 1)]}
    assert [(d.partition, d.offset, d.key, d.reason) for d in keeper.dead_letters] == [
        (home, 0, b"ns/pod", "not_json"), (home, 1, b"ns/pod", "unknown_version"),
        (home, 2, b"ns/other", "wrong_key"), (wrong, 0, b"ns/pod", "wrong_partition"),
    ]
    assert keeper.dead_letters[2].value == placed  # copied as read
    assert keeper.dead_letters[3].headers() == [
        ("mmcache.reason", b"wrong_partition"),
        ("mmcache.source.partition", str(wrong).encode()),
        ("mmcache.source.offset", b"0"),
    ]
    for reason in ("not_json", "unknown_version", "wrong_key", "wrong_partition"):
        assert sample(keeper, "mmcache_dead_letters_total", {"reason": reason}) == 1
    assert keeper.state.lrus.applied == {home: 3, wrong: 0}
    # the skipped record's offset is durable too: a reload does not deliver it again
    assert decode_applied(keeper.mirror.stores[wrong][APPLIED_KEY]) == 0
    apply_one(keeper, wrong, 0, placed, b"ns/pod")  # redelivered
    assert len(keeper.dead_letters) == 4


def test_a_batch_of_records_uses_each_records_key():
    from types import SimpleNamespace

    keeper = keeper_for(Capacity("items", 4))
    keeper.apply_batch(0, [SimpleNamespace(offset=0, key=b"ns/pod", value=encode_event(PLACE_A)),
                           SimpleNamespace(offset=1, key=b"ns/pod", value=encode_event(PLACE_C))])
    assert view(keeper.state) == {"ns/pod": [("a", 1)]}
    assert [d.reason for d in keeper.dead_letters] == ["wrong_key"]


def test_reload_turns_the_loop_between_slices():
    """A reload of 16k entries lets other tasks (matches) run between its slices."""
    keeper = keeper_for(Capacity("items", 1024))
    for offset in range(16):
        items = [Item(f"h{offset}-{i}", 1, "image") for i in range(1024)]
        raw = encode_event(ItemsPlaced(endpoint=f"ns/pod-{offset}", items=items))
        apply_one(keeper, 0, offset, raw, key_of(raw))
    table = table_of(keeper)
    fresh = keeper_for(keeper.state.lrus.capacity)

    async def reload_while_ticking() -> int:
        ticks = 0
        done = False

        async def tick() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        ordered = dict(sorted(table.items()))
        await fresh.reload({0: ordered})
        done = True
        await ticker
        return ticks

    ticks = asyncio.run(reload_while_ticking())
    assert fresh.state.digests.digest() == keeper.state.digests.digest()
    assert ticks >= 16  # at least one turn per 1,024-entry slice


def test_a_large_batch_is_applied_in_slices_with_the_loop_turning_between():
    """A fetched batch of 1,000 events lets other tasks (matches) run between slices of
    APPLY_SLICE events, and ends as one apply_batch of the whole batch would."""
    raws = [encode_event(ItemsPlaced(endpoint=f"ns/pod-{n % 7}", items=[Item(f"h{n}", 1, "image")]))
            for n in range(1000)]
    records = [SimpleNamespace(offset=n, key=key_of(raw), value=raw) for n, raw in enumerate(raws)]
    sliced, whole = keeper_for(Capacity("items", 64)), keeper_for(Capacity("items", 64))
    whole.apply_batch(0, records)

    async def apply_while_ticking() -> list[int]:
        applied_at_tick: list[int] = []
        done = False

        async def tick() -> None:
            while not done:
                applied_at_tick.append(sliced.state.lrus.applied.get(0, -1))
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        await sliced.apply_in_slices(0, records)
        done = True
        await ticker
        return applied_at_tick

    seen = asyncio.run(apply_while_ticking())
    assert sliced.state.digests.digest() == whole.state.digests.digest()
    # the ticker saw the batch part-applied, never more than one slice further each turn
    steps = [b - a for a, b in zip(seen, seen[1:], strict=False) if b != a]
    assert len(steps) >= 1000 // APPLY_SLICE and max(steps) <= APPLY_SLICE
