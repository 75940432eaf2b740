"""A partition reload in slices (issue 8, finding 3: a reload after a rebalance held the
event loop for seconds at 1M entries): the same state as the one-go path, in steps of
a bounded number of entries."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from rocksdict import Options, Rdict

from stream.core.cache import CacheState, Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.items import Item
from stream.state.store import (
    APPLIED_KEY,
    encode_applied,
    endpoint_records,
    load_partition,
    load_partition_in_slices,
)


def filled(endpoints: int, entries: int) -> CacheState:
    state = CacheState(Capacity("items", entries))
    for e in range(endpoints):
        items = [Item(f"{e:03d}{i:03d}" * 8, 1 + i % 4, "image") for i in range(entries)]
        state.fold.apply(ItemsPlaced(endpoint=f"ns/pod-{e}", items=items), Position(0, e))
    return state


def store_of(state: CacheState, path) -> Rdict:
    db = Rdict(str(path), Options(raw_mode=True))
    for name, cache in state.lrus.endpoints.items():
        for key, value in endpoint_records(name, cache.entries.items()):
            db[key] = value
    db[APPLIED_KEY] = encode_applied(state.lrus.applied[0])
    return db


def test_sliced_load_equals_the_one_go_load_and_each_step_is_bounded(tmp_path):
    source = filled(30, 50)
    db = store_of(source, tmp_path / "p0")
    whole = CacheState(source.lrus.capacity)
    load_partition(whole, 0, db.items())
    sliced = CacheState(source.lrus.capacity)
    steps = list(load_partition_in_slices(sliced, 0, db.items(), entries_per_slice=120))
    db.close()
    assert sum(steps) == 30 * 50 and len(steps) > 5
    assert max(steps) <= 120 + 50  # the slice plus at most one endpoint's LRU
    assert sliced.digests.digest() == whole.digests.digest() == source.digests.digest()
    assert sliced.lrus.applied == whole.lrus.applied and sliced.index.holders == whole.index.holders


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.integers(1, 9), st.integers(1, 40))
def test_sliced_drop_releases_whole_endpoints_in_bounded_steps(endpoints, entries, budget):
    state = filled(endpoints, entries)
    other = CacheState(state.lrus.capacity)
    other.fold.apply(ItemsPlaced(endpoint="ns/other", items=[Item("x", 1, "image")]), Position(1, 0))
    state.merge(other)
    steps = list(state.loading.drop_partition_in_slices(0, budget))
    assert sum(steps) == endpoints * entries
    assert max(steps) <= budget + entries
    assert list(state.lrus.endpoints) == ["ns/other"] and state.lrus.applied == {1: 0}
    assert set(state.index.holders) == {"x"}
