"""Engine views through the recovery paths the review found broken: a seeded changelog
read back (the follower's re-read, the follower resuming, the gate of Faust's restore),
a restart with another view bound (refused, as another capacity is), and a reload or
re-read that turns the loop every slice of engine records as it does for LRUs."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.core.cache import CacheState, Capacity
from stream.core.engine import ENGINE_VIEW_ENTRIES
from stream.core.events import Position
from stream.kafka.embedded_log import applied_prefix
from stream.state.datadir import DataDir, StateMismatch
from stream.state.rebuild import seed_records, write_state
from stream.state.store import (
    APPLIED_KEY,
    ChangelogGate,
    applied_at,
    endpoint_records,
    engine_records,
    load_partition_in_slices,
)
from stream.state.view_load import load_partition_into_view
from stream.worker.follower import ChangelogFollower, Reread
from tests.unit.test_engine_views import (
    CAPACITY,
    assert_same,
    live,
    mixed_logs,
    place,
    report,
    stored,
)

APP, TOPIC = "mmcache", "mmcache-events"


# -- 1. a seeded changelog keeps every engine view -------------------------------------------


def seeded_changelog(state: CacheState, partitions: int) -> dict[int, list[tuple[bytes, bytes]]]:
    """What ``seed_deployment`` sends to each changelog partition, in order, for the
    files ``rebuild`` writes of ``state``."""
    with tempfile.TemporaryDirectory() as root:
        datadir = DataDir(Path(root) / "state")
        datadir.check(DataDir.identity(APP, TOPIC, CAPACITY, 3))
        write_state(datadir, state, range(partitions))
        sent = {}
        for partition in datadir.partitions():
            db = datadir.open_partition(partition, read_only=True)
            try:
                sent[partition] = list(seed_records(db.items()))
            finally:
                db.close()
        return sent


def test_a_seeded_partition_sends_its_applied_record_last():
    state = CacheState(CAPACITY, 3)
    state.fold.apply(place("e", "a"), Position(0, 0))
    state.fold.apply(report("e", stored("h1", "9f" * 32)), Position(0, 4))
    records = seeded_changelog(state, 1)[0]
    assert records[-1][0] == APPLIED_KEY
    assert [key[:1] for key, _ in records] == [b"\x01", b"\x04", b"\x04", b"\x04", b"\x02"]


@settings(max_examples=40, deadline=None)
@given(mixed_logs(), st.data())
def test_a_seeded_changelog_read_back_equals_live(drawn, data):
    """Through the gate into a re-read, through the follower's own re-read (fed in two
    fetches), and through the embedded log's recovery cut: the views, LRUs and digest of
    the live state."""
    partitions, log = drawn
    state, _ = live(log)
    changelog = seeded_changelog(state, partitions)
    rereads = CacheState(CAPACITY, 3)
    follower = ChangelogFollower("127.0.0.1:1", "changelog", CacheState(CAPACITY, 3))
    resuming = ChangelogFollower("127.0.0.1:1", "changelog", CacheState(CAPACITY, 3))
    for partition, records in sorted(changelog.items()):
        gate, reread = ChangelogGate(), Reread()
        for key, value in gate.admit((key, value, (key, value)) for key, value in records):
            reread.add(key, value)
        assert gate.dropped == 0
        for _ in load_partition_in_slices(rereads, partition, reread.records(), 2):
            pass
        fed = [SimpleNamespace(key=key, value=value, offset=at) for at, (key, value) in enumerate(records)]
        follower.rereads[partition], follower._gates[partition] = Reread(), ChangelogGate()  # as _reread
        cut = data.draw(st.integers(0, len(fed)))
        follower._take(partition, fed[:cut])
        follower._take(partition, fed[cut:])
        asyncio.run(load_partition_into_view(follower.view, partition,
                                             follower.rereads.pop(partition).records()))
        resuming._take(partition, fed)
        if partition in state.lrus.applied:  # a kept log cut at the applied record keeps them all
            assert applied_prefix(fed, state.lrus.applied[partition] + 1, applied_at) == len(fed)
    assert_same(rereads, state)
    assert_same(follower.view, state)
    # a follower already past its re-read applies them as they come, in key order: the
    # same entries (their order is the rank's only through a re-read, for LRUs as well)
    assert {n: set(v.entries.items()) for n, v in resuming.view.lrus.engine.views.items()} == {
        n: set(v.entries.items()) for n, v in state.lrus.engine.views.items()}
    assert resuming.view.lrus.engine.holders == state.lrus.engine.holders


def test_the_gate_counts_the_records_it_drops():
    """Records ranked at or below the applied offset that come after it are dropped, and
    counted: what the key order lost unseen before the applied record went last."""
    state = CacheState(CAPACITY, 3)
    state.fold.apply(report("e", stored("h1", "h2")), Position(0, 0))
    records = seeded_changelog(state, 1)[0]
    key_order = sorted(records)  # the file's order, the applied record before the views'
    gate = ChangelogGate()
    admitted = gate.admit((key, value, key) for key, value in key_order)
    assert admitted == [APPLIED_KEY] and gate.dropped == 3  # the view's record, its 2 entries


# -- 2. the view bound is part of the data dir's identity -------------------------------------


def test_a_restart_with_another_view_bound_is_refused_naming_it(tmp_path):
    DataDir(tmp_path).claim(DataDir.identity(APP, TOPIC, CAPACITY, 1024))
    DataDir(tmp_path).release()
    again = DataDir(tmp_path)
    with pytest.raises(StateMismatch, match="engine_view_max_entries 1024 here, 2048 given.*"
                                            "mmcache rebuild"):
        again.claim(DataDir.identity(APP, TOPIC, CAPACITY, 2048))
    again.claim(DataDir.identity(APP, TOPIC, CAPACITY, 1024))  # the same bound is taken
    assert again.read_identity()["engine_view_max_entries"] == 1024


def test_an_old_marker_without_the_bound_reads_as_the_default(tmp_path):
    old = {"format": 1, "app_id": APP, "topic": TOPIC, "capacity": list(CAPACITY)}
    tmp_path.joinpath("mmcache-state.json").write_bytes(orjson.dumps(old))
    datadir = DataDir(tmp_path)
    with pytest.raises(StateMismatch, match=f"engine_view_max_entries {ENGINE_VIEW_ENTRIES} here, 16 given"):
        datadir.check(DataDir.identity(APP, TOPIC, CAPACITY, 16))
    datadir.check(DataDir.identity(APP, TOPIC, CAPACITY))
    assert DataDir.identity(APP, TOPIC, CAPACITY)["engine_view_max_entries"] == ENGINE_VIEW_ENTRIES
    assert datadir.read_identity() == DataDir.identity(APP, TOPIC, CAPACITY)
    assert datadir.load_state().lrus.engine.max_entries == ENGINE_VIEW_ENTRIES


def test_a_dir_loads_with_the_bound_it_was_folded_with(tmp_path):
    state = CacheState(CAPACITY, 2)
    state.fold.apply(report("e", stored("a", "b", "c")), Position(0, 0))
    datadir = DataDir(tmp_path)
    datadir.check(DataDir.identity(APP, TOPIC, CAPACITY, 2))
    write_state(datadir, state, [0])
    loaded = DataDir(tmp_path).load_state()
    assert loaded.lrus.engine.max_entries == 2
    loaded.fold.apply(report("e", stored("d")), Position(0, 1))
    state.fold.apply(report("e", stored("d")), Position(0, 1))
    assert list(loaded.lrus.engine.views["e"].entries) == list(state.lrus.engine.views["e"].entries) == ["c", "d"]
    assert loaded.digests.digest() == state.digests.digest()


# -- 3. a reload or re-read turns the loop within engine records too -------------------------


def per_step(records: list[tuple[bytes, bytes]], state: CacheState, per_slice: int) -> list[int]:
    """How many records ``load_partition_in_slices`` reads in each of its steps."""
    pulled = 0

    def counted():
        nonlocal pulled
        for record in records:
            pulled += 1
            yield record

    steps, before = [], 0
    for _ in load_partition_in_slices(state, 0, counted(), per_slice):
        steps.append(pulled - before)
        before = pulled
    return steps


@pytest.mark.parametrize("source", ["store", "re-read"])
def test_no_step_of_a_load_reads_more_than_a_slice_and_one_endpoint(source):
    """50 endpoints, each an LRU of 8 and a view of 40 (with hex and text hashes): a step
    reads at most the slice, one endpoint's records and the one that ends its run."""
    hashes = [f"{i:064x}" if i % 2 else f"h{i}" for i in range(40)]
    records = []
    for e in range(50):
        records += endpoint_records(f"ns/pod-{e}", [(h, 1) for h in hashes[:8]])
        records += engine_records(f"ns/pod-{e}", [(h, 2) for h in hashes])
    records.append((APPLIED_KEY, b"\x00" * 7 + b"\x09"))
    records.sort()
    if source == "re-read":
        reread = Reread()
        for key, value in records:
            reread.add(key, value)
        records = list(reread.records())
    state = CacheState(Capacity("items", 8), 40)
    steps = per_step(records, state, 32)
    assert sum(steps) == len(records)
    assert max(steps) <= 32 + 41 + 2  # the slice, one view and its own record, the next key, the applied one
    assert len(state.lrus.engine.views) == 50 and len(state.lrus.endpoints) == 50
    assert list(state.lrus.engine.views["ns/pod-7"].entries) == hashes  # ranked as stored
    assert state.lrus.applied == {0: 9}


# -- 4. a dropped view is one change, written as one record per entry ------------------------


@pytest.mark.parametrize("drop", ["deleted", "synced away"])
def test_a_dropped_view_is_one_change_whose_records_remove_each_entry_then_the_view(drop):
    from stream.core.engine import EngineChange
    from stream.core.events import EndpointDeleted, EndpointsSynced
    from stream.state.store import effect_records, engine_key, write_effects

    state, table = CacheState(CAPACITY, 8), {}
    for offset, event in enumerate([report("e", stored("a", "9f" * 32, "c")), report("f", stored("a"))]):
        write_effects(table, state.fold.apply(event, Position(0, offset)), offset)
    gone = EndpointDeleted(endpoint="e") if drop == "deleted" else EndpointsSynced(live=["f"])
    effects = state.fold.apply(gone, Position(0, 2))
    assert effects.engine == [EngineChange("e", None, None, 0, 0, ("a", "9f" * 32, "c"))]
    assert list(effect_records(effects, 2)) == [
        (engine_key("e", "a"), None), (engine_key("e", "9f" * 32), None), (engine_key("e", "c"), None),
        (engine_key("e"), None), (APPLIED_KEY, b"\x00" * 7 + b"\x02")]
    write_effects(table, effects, 2)
    assert sorted(table) == sorted([engine_key("f"), engine_key("f", "a"), APPLIED_KEY])
    assert state.lrus.engine.holders == {"a": {"f"}}


def test_a_slice_of_the_keepers_apply_ends_once_its_store_records_reach_the_bound(monkeypatch):
    """Reports of 40 items each (41 records) and deletions of those views (41 records,
    one change each): no slice makes more than the bound and the event that crossed it,
    and the batch ends as one ``apply_batch`` of it would."""
    from stream.core.codec import encode_event
    from stream.core.events import EndpointDeleted
    from stream.metrics import Metrics
    from stream.worker import keeper as keepers
    from stream.worker.table_mirror import MappingMirror

    monkeypatch.setattr(keepers, "APPLY_SLICE_RECORDS", 100)
    events = [report(f"ns/pod-{n}", stored(*(f"h{n}-{i}" for i in range(40)))) for n in range(30)]
    events += [EndpointDeleted(endpoint=f"ns/pod-{n}") for n in range(30)]
    records = [SimpleNamespace(offset=n, key=event.endpoint.encode(), value=encode_event(event))
               for n, event in enumerate(events)]

    def keeper() -> keepers.StateKeeper:
        state = CacheState(CAPACITY, 64)
        return keepers.StateKeeper(state, MappingMirror({0: {}}), Metrics(state, lambda: {}))

    sliced, whole = keeper(), keeper()
    assert whole.apply_batch(0, records) == len(records)

    async def apply_while_ticking() -> list[int]:
        seen, done = [], False

        async def tick() -> None:
            while not done:
                seen.append(sliced.state.lrus.applied.get(0, -1))
                await asyncio.sleep(0)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        await sliced.apply_in_slices(0, records)
        done = True
        await ticker
        return seen

    seen = asyncio.run(apply_while_ticking())
    steps = [b - a for a, b in zip(seen, seen[1:], strict=False) if b != a]
    assert max(steps) == 3 and len(steps) >= len(records) // 3 - 1  # 3 x 41 records reach 100
    assert sliced.state.digests.digest() == whole.state.digests.digest()
    assert sliced.mirror.stores == whole.mirror.stores
