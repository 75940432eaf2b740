"""Engine views in the pure core and every path state takes: the fold (facts in order,
``cleared``, deletion and sync drop both, the bound), apart from the LRU; the digest
(unchanged for a state without views); and the laws for any log with engine reports mixed
in: live equals a restart from the store, a reload in slices, a follower of the changelog,
a re-read, ``rebuild``'s files, and the preload's export."""

from __future__ import annotations

import random
import tempfile
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.core.cache import CacheState, Capacity, combine_digests
from stream.core.codec import decode_event, encode_event
from stream.core.engine import DIGEST_MARK, EngineChange
from stream.core.events import (
    EndpointDeleted,
    EndpointsSynced,
    EngineCleared,
    EngineEventsReported,
    EngineItemsRemoved,
    EngineItemsStored,
    ItemsPlaced,
    Position,
)
from stream.core.items import Item
from stream.state.datadir import DataDir
from stream.state.rebuild import write_state
from stream.state.store import (
    APPLIED_KEY,
    ChangelogGate,
    effect_records,
    engine_key,
    load_partition,
    load_partition_in_slices,
    read_partition,
    write_effects,
)
from stream.worker.follower import ChangelogFollower, Reread
from tests.unit.eventlogs import EventLogs, Record

ENDPOINTS = [f"ns/pod-{i}" for i in range(5)]
HASHES = [f"h{i}" for i in range(6)] + ["9f" * 32]  # a sha256-like hash is stored as raw bytes
LOGS = EventLogs(ENDPOINTS, HASHES)
CAPACITY = Capacity("items", 3)


def stored(*hashes: str, size: int = 1) -> EngineItemsStored:
    return EngineItemsStored(items=[Item(h, size, "image") for h in hashes])


def report(endpoint: str, *facts) -> EngineEventsReported:
    return EngineEventsReported(endpoint=endpoint, engine="vllm", events=list(facts))


def place(endpoint: str, *hashes: str) -> ItemsPlaced:
    return ItemsPlaced(endpoint=endpoint, items=[Item(h, 1, "image") for h in hashes])


def folded(events: list, engine_entries: int = 4, partition: int = 0) -> CacheState:
    state = CacheState(CAPACITY, engine_entries)
    for offset, event in enumerate(events):
        state.fold.apply(event, Position(partition, offset))
    return state


def views(state: CacheState) -> dict[str, list[tuple[str, int]]]:
    return {name: list(view.entries.items()) for name, view in state.lrus.engine.views.items()}


def lrus(state: CacheState) -> dict[str, list[tuple[str, int]]]:
    return {name: list(cache.entries.items()) for name, cache in state.lrus.endpoints.items()}


# -- the fold ------------------------------------------------------------------------------


def test_facts_apply_in_order():
    state = folded([report("e", stored("a", "b"), EngineItemsRemoved(hashes=["a"]), stored("c")),
                    report("f", EngineItemsRemoved(hashes=["x"]), stored("x"))])
    assert views(state) == {"e": [("b", 1), ("c", 1)], "f": [("x", 1)]}


def test_storing_again_moves_an_entry_to_the_recent_end_with_its_new_size():
    state = folded([report("e", stored("a", "b")), report("e", stored("a", size=7))])
    assert views(state) == {"e": [("b", 1), ("a", 7)]}
    assert state.lrus.engine.views["e"].weight == 8


def test_cleared_empties_the_view_which_stays():
    state = folded([report("e", stored("a", "b")), report("e", EngineCleared())])
    assert views(state) == {"e": []}
    assert state.lrus.engine.holders == {}
    assert state.lrus.engine.reporting(["e", "g"]) == ["e"]


def test_placements_never_change_a_view_and_reports_never_change_an_lru():
    log = [place("e", "a", "b"), report("e", stored("c")), place("e", "c"), report("e", EngineCleared()),
           place("e", "d")]
    state = folded(log)
    assert views(state) == {"e": []}
    assert lrus(state) == lrus(folded([event for event in log if isinstance(event, ItemsPlaced)]))
    assert state.index.holders == {"b": {"e"}, "c": {"e"}, "d": {"e"}}


def test_deleting_the_endpoint_drops_both():
    state = folded([place("e", "a"), report("e", stored("a")), report("f", stored("a")),
                    EndpointDeleted(endpoint="e")])
    assert lrus(state) == {} and views(state) == {"f": [("a", 1)]}
    assert state.lrus.engine.holders == {"a": {"f"}}
    only_view = folded([report("e", EngineCleared()), EndpointDeleted(endpoint="e")])
    assert views(only_view) == {}


def test_a_sync_drops_both_of_every_endpoint_of_its_partition_not_live():
    state = CacheState(CAPACITY)
    log = [(Position(0, 0), report("e", stored("a"))), (Position(0, 1), place("e", "a")),
           (Position(0, 2), report("f", stored("b"))), (Position(1, 0), report("g", stored("c"))),
           (Position(0, 3), EndpointsSynced(live=["f"])), (Position(1, 1), EndpointsSynced(live=[]))]
    for position, event in log:
        state.fold.apply(event, position)
    assert views(state) == {"f": [("b", 1)], "g": [("c", 1)]}  # g: another partition; [] is ignored
    assert lrus(state) == {}


def test_a_view_holds_at_most_its_bound_dropping_the_least_recently_stored():
    state = CacheState(CAPACITY, 3)
    state.fold.apply(report("e", stored("a")), Position(0, 0))
    effects = state.fold.apply(report("e", stored("b", "c", "d"), stored("b"), stored("x")), Position(0, 1))
    assert views(state) == {"e": [("d", 1), ("b", 1), ("x", 1)]}
    assert [(change.hash, change.size) for change in effects.engine] == [
        ("d", 1), ("b", 1), ("x", 1), ("a", None)]  # c came and went: nothing to store
    assert state.lrus.engine.bound_drops == 2
    with pytest.raises(ValueError):
        CacheState(CAPACITY, 0)


def test_a_redelivered_report_changes_nothing():
    state = folded([report("e", stored("a"))])
    digest = state.digests.digest()
    assert state.fold.apply(report("e", EngineCleared()), Position(0, 0)) is None
    assert state.digests.digest() == digest and views(state) == {"e": [("a", 1)]}


def test_the_effects_say_the_views_changes_in_the_folds_order():
    state = CacheState(CAPACITY, 4)
    state.fold.apply(report("e", stored("b", "c")), Position(0, 8))
    effects = state.fold.apply(report("e", stored("a"), EngineItemsRemoved(hashes=["a", "b"]),
                                      stored("a", size=2), EngineCleared(), stored("c", "a")),
                               Position(0, 9))
    assert views(state) == {"e": [("c", 1), ("a", 1)]}
    # net: once per key, every entry left stored in the order of its last store, then removals
    assert effects.engine == [EngineChange("e", "c", 1, 9, 2), EngineChange("e", "a", 1, 9, 3),
                              EngineChange("e", "b", None, 9, 0)]
    assert effects.upserts == [] and effects.removals == []
    created = CacheState(CAPACITY, 4).fold.apply(report("e", stored("a")), Position(0, 0))
    assert created.engine == [EngineChange("e", None, 0, 0, 0), EngineChange("e", "a", 1, 0, 0)]
    table: dict[bytes, bytes] = {}
    write_effects(table, created, 0)
    assert set(table) == {engine_key("e"), engine_key("e", "a"), APPLIED_KEY}


def test_the_event_round_trips_the_log():
    event = report("ns/a", stored("a", "b"), EngineItemsRemoved(hashes=["a"]), EngineCleared())
    assert decode_event(encode_event(event)) == event


# -- the digest ------------------------------------------------------------------------------


def test_a_state_without_views_has_the_digest_it_always_had():
    state = folded([place("e", "a", "b"), place("f", "c")])
    assert state.digests.digest() == combine_digests(
        {name: part for name, part in state.digests.endpoint_digests().items()})
    assert set(state.digests.endpoint_digests()) == {"e", "f"}


def test_the_digest_covers_the_views():
    base = [place("e", "a")]
    digests = {
        "none": folded(base).digests.digest(),
        "empty": folded(base + [report("e", EngineCleared())]).digests.digest(),
        "a": folded(base + [report("e", stored("a"))]).digests.digest(),
        "a2": folded(base + [report("e", stored("a", size=2))]).digests.digest(),
        "ab": folded(base + [report("e", stored("a", "b"))]).digests.digest(),
        "ba": folded(base + [report("e", stored("b", "a"))]).digests.digest(),
        "other": folded(base + [report("f", stored("a"))]).digests.digest(),
    }
    assert len(set(digests.values())) == len(digests)
    reported = folded(base + [report("e", stored("a"))])
    assert set(reported.digests.endpoint_digests()) == {"e", DIGEST_MARK + "e"}


def test_the_sliced_digest_covers_the_views_as_the_whole_one():
    state = folded([place("e", "a"), report("e", stored(*HASHES)), report("f", stored("a"))], 8)
    state.digests.start_round()
    while not state.digests.refresh(2):
        pass
    assert state.digests.cached() == state.digests.digest()
    state.fold.apply(report("e", EngineItemsRemoved(hashes=["h1"])), Position(0, 10))
    assert state.digests.cached() is None
    state.digests.start_round()
    while not state.digests.refresh(1):
        state.fold.apply(report("f", stored("z")), Position(0, 11))  # changes half-way
    state.digests.start_round()
    while not state.digests.refresh(3):
        pass
    assert state.digests.cached() == state.digests.digest()


# -- every path state takes, for any log --------------------------------------------------------


def engine_op(rng: random.Random) -> tuple:
    endpoint = rng.choice(ENDPOINTS)
    facts = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.6:
            facts.append(EngineItemsStored(items=[Item(rng.choice(HASHES), rng.randint(1, 4), "image")
                                                  for _ in range(rng.randint(0, 3))]))
        elif kind < 0.9:
            facts.append(EngineItemsRemoved(hashes=rng.sample(HASHES, rng.randint(0, 2))))
        else:
            facts.append(EngineCleared())
    return endpoint, report(endpoint, *facts)


@st.composite
def mixed_logs(draw) -> tuple[int, list[Record]]:
    """A log of placements, deletions and syncs (``EventLogs``) with engine reports mixed
    in, each event in its endpoint's partition, offsets increasing per partition."""
    scenario = draw(LOGS.scenarios(max_ops=20))
    rng = random.Random(draw(st.integers(0, 2**32)))
    records = list(scenario.log)
    for _ in range(draw(st.integers(0, 25))):
        endpoint, event = engine_op(rng)
        partition = LOGS.partition_of(endpoint, scenario.partitions)
        records.insert(rng.randint(0, len(records)), (Position(partition, -1), event))
    offsets = [0] * scenario.partitions
    log = []
    for position, event in records:
        offset = offsets[position.partition] + rng.choice((0, 0, 1, 3))
        offsets[position.partition] = offset + 1
        log.append((Position(position.partition, offset), event))
    return scenario.partitions, log


def live(log: list[Record], engine_entries: int = 3) -> tuple[CacheState, dict[int, list]]:
    """The live fold, and per partition the changelog records it wrote, in order."""
    state = CacheState(CAPACITY, engine_entries)
    changelog: dict[int, list] = defaultdict(list)
    for position, event in log:
        effects = state.fold.apply(event, position)
        changelog[position.partition].extend(effect_records(effects, position.offset))
    return state, changelog


def stores_of(changelog: dict[int, list]) -> dict[int, dict[bytes, bytes]]:
    stores: dict[int, dict[bytes, bytes]] = {}
    for partition, records in changelog.items():
        table = stores[partition] = {}
        for key, value in records:
            if value is None:
                table.pop(key, None)
            else:
                table[key] = value
    return stores


def assert_same(copy: CacheState, state: CacheState) -> None:
    assert views(copy) == views(state)
    assert lrus(copy) == lrus(state)
    assert copy.lrus.engine.holders == state.lrus.engine.holders
    assert copy.index.holders == state.index.holders
    assert copy.lrus.applied == state.lrus.applied
    assert copy.digests.digest() == state.digests.digest()
    assert {n: v.weight for n, v in copy.lrus.engine.views.items()} == {
        n: v.weight for n, v in state.lrus.engine.views.items()}
    assert {n: v.partition for n, v in copy.lrus.engine.views.items()} == {
        n: v.partition for n, v in state.lrus.engine.views.items()}


SETTINGS = settings(max_examples=150, deadline=None)


@SETTINGS
@given(mixed_logs())
def test_a_restart_from_the_store_equals_live(drawn):
    _, log = drawn
    state, changelog = live(log)
    copy = CacheState(CAPACITY, 3)
    for partition, table in sorted(stores_of(changelog).items()):
        load_partition(copy, partition, sorted(table.items()))  # a store iterates in key order
    assert_same(copy, state)


@SETTINGS
@given(mixed_logs(), mixed_logs(), st.integers(1, 5))
def test_a_reload_in_slices_over_a_stale_view_equals_live(drawn, stale, per_slice):
    _, log = drawn
    state, changelog = live(log)
    old, _ = live(stale[1])  # what the view held before: other views, other entries
    for partition, table in sorted(stores_of(changelog).items()):
        for _ in load_partition_in_slices(old, partition, sorted(table.items()), per_slice):
            pass
    for partition in set(old.lrus.applied) - set(changelog):
        old.loading.drop_partition(partition)
    assert_same(old, state)


@SETTINGS
@given(mixed_logs(), st.data())
def test_a_follower_of_the_changelog_and_a_re_read_equal_live(drawn, data):
    _, log = drawn
    state, changelog = live(log)
    follower = ChangelogFollower("127.0.0.1:1", "changelog", CacheState(CAPACITY, 3))
    rereads = CacheState(CAPACITY, 3)
    for partition, records in sorted(changelog.items()):
        fed = [SimpleNamespace(key=key, value=value, offset=at) for at, (key, value) in enumerate(records)]
        cut = data.draw(st.integers(0, len(fed)))
        follower._take(partition, fed[:cut])  # in batches, as fetched
        follower._take(partition, fed[cut:])
        reread, gate = Reread(), ChangelogGate()
        for key, value in gate.admit((r.key, r.value, (r.key, r.value)) for r in fed):
            reread.add(key, value)
        for _ in load_partition_in_slices(rereads, partition, reread.records(), 2):
            pass
    assert_same(follower.view, state)
    assert_same(rereads, state)


@SETTINGS
@given(mixed_logs(), st.data())
def test_a_partition_given_up_is_followed_on_from_the_owners_last_stored_batch(drawn, data):
    """An owner that gives its partitions up follows them on from its view's marks (the
    changelog offset of its last stored batch), not re-reading them, and ends equal to
    live; one it wrote nothing of has no mark and is not resumed (``follow`` re-reads it:
    here its whole changelog is taken into the empty part of the view instead)."""
    _, log = drawn
    state, changelog = live(log)
    stop = data.draw(st.integers(0, len(log)))
    owned, written = live(log[:stop])  # the owner's view, and what it wrote, at the handover
    follower = ChangelogFollower("127.0.0.1:1", "changelog", owned)
    for partition, records in written.items():
        if records:
            follower.marks.set(partition, len(records) - 1)
    follower._resume_from_marks(set(changelog))
    assert set(follower._next) == {p for p, records in written.items() if records}
    for partition, records in sorted(changelog.items()):
        start = follower._next.get(partition, 0)  # a re-read of one it held nothing of: all
        fed = [SimpleNamespace(key=key, value=value, offset=at) for at, (key, value) in enumerate(records)]
        follower._take(partition, fed[start:])
        assert follower.marks.through(partition) == len(records) - 1
    assert_same(follower.view, state)


@SETTINGS
@given(mixed_logs(), st.data())
def test_resuming_from_an_earlier_point_equals_one_pass(drawn, data):
    _, log = drawn
    stop = data.draw(st.integers(0, len(log)))
    resume = data.draw(st.integers(0, stop))
    state, _ = live(log[:stop])
    for position, event in log[resume:]:
        state.fold.apply(event, position)
    assert_same(state, live(log)[0])


@SETTINGS
@given(mixed_logs())
def test_a_changelog_written_again_by_a_zombie_changes_nothing(drawn):
    """Records of events written again after later ones (a resumed zombie owner) are
    skipped by the gate, engine records included."""
    _, log = drawn
    state, changelog = live(log)
    for partition, records in sorted(changelog.items()):
        again = records + records  # every event's records once more, after the later ones
        follower = ChangelogFollower("127.0.0.1:1", "changelog", CacheState(CAPACITY, 3))
        follower._take(partition, [SimpleNamespace(key=k, value=v, offset=i) for i, (k, v) in enumerate(again)])
        mine = CacheState(CAPACITY, 3)
        for position, event in log:
            if position.partition == partition:
                mine.fold.apply(event, position)
        assert views(follower.view) == views(mine) and lrus(follower.view) == lrus(mine)


@SETTINGS
@given(mixed_logs())
def test_the_preloads_export_and_merge_equal_live(drawn):
    partitions, log = drawn
    state, _ = live(log)
    merged = CacheState(CAPACITY, 3)
    for partition in range(partitions):
        part = CacheState(CAPACITY, 3)
        for position, event in log:
            if position.partition == partition:
                part.fold.apply(event, position)
        merged.merge(CacheState.from_export(CAPACITY, part.loading.export()))
    assert_same(merged, state)


@settings(max_examples=25, deadline=None)
@given(mixed_logs())
def test_rebuilds_files_load_as_live(drawn):
    partitions, log = drawn
    state, _ = live(log)
    with tempfile.TemporaryDirectory() as root:
        datadir = DataDir(Path(root) / "state")
        datadir.check(DataDir.identity("mmcache", "mmcache-events", CAPACITY))
        write_state(datadir, state, range(partitions))
        loaded = DataDir(datadir.root).load_state()
        for partition in range(partitions):  # the LRU reader skips the views' records
            db = datadir.open_partition(partition, read_only=True)
            try:
                _, entries = read_partition(db.items())
            finally:
                db.close()
            assert {(e.endpoint, e.hash) for e in entries} == {
                (n, h) for n, c in state.lrus.endpoints.items() if c.partition == partition for h in c.entries}
    assert views(loaded) == views(state)
    assert loaded.digests.digest() == state.digests.digest()


@SETTINGS
@given(mixed_logs(), st.integers(0, 2**16))
def test_any_interleaving_of_partitions_gives_the_same_state(drawn, seed):
    _, log = drawn
    queues: dict[int, list[Record]] = defaultdict(list)
    for record in log:
        queues[record[0].partition].append(record)
    order = [p for p, records in queues.items() for _ in records]
    random.Random(seed).shuffle(order)
    assert_same(live([queues[p].pop(0) for p in order])[0], live(log)[0])


@SETTINGS
@given(mixed_logs())
def test_the_lrus_are_those_of_the_log_without_its_engine_reports(drawn):
    _, log = drawn
    state, _ = live(log)
    without, _ = live([(p, e) for p, e in log if not isinstance(e, EngineEventsReported)])
    assert lrus(state) == lrus(without) and state.index.holders == without.index.holders
    parts = state.digests.endpoint_digests()
    assert {n: d for n, d in parts.items() if not n.startswith(DIGEST_MARK)} == without.digests.endpoint_digests()


# -- the answer's sources ---------------------------------------------------------------------

NAMES = [f"ns/pod-{i}" for i in range(12)] + ['ns/"quoted"', "ns/\\slash", "ns/ü"]


@settings(max_examples=300, deadline=None)
@given(requested=st.lists(st.sampled_from(NAMES), unique=True, max_size=14),
       holders=st.sets(st.sampled_from(NAMES)), engine=st.sets(st.sampled_from(NAMES)))
def test_the_answer_gives_each_endpoint_its_source_and_otherwise_the_domain_answer(requested, holders, engine):
    from stream.core.render import render_match

    items = [Item("h1", 2, "image"), Item("h2", 3, "audio")]
    found = {name: items[: 1 + (len(name) % 2)] for name in holders if name in requested}
    sourced = {name for name in engine if name in requested}
    rendered = orjson.loads(render_match(items, requested, found, sourced))
    total = 5
    assert rendered == {
        "request_items": [{"hash": i.hash, "size": i.size, "modality": i.modality} for i in items],
        "endpoints": [{"endpoint": name,
                       "matched_items": [{"hash": i.hash, "size": i.size, "modality": i.modality}
                                         for i in found.get(name, [])],
                       "matched_weight": sum(i.size for i in found.get(name, [])),
                       "total_weight": total,
                       "score": sum(i.size for i in found.get(name, [])) / total,
                       "source": "engine" if name in sourced else "estimate"} for name in requested]}
