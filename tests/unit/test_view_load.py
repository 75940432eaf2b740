"""Loading a partition into the live view (issue 9, item 3): the one path of reloads and
of the follower's re-read swaps each LRU whole, never removes an entry the new view
also has, orders entries by their stored rank, and ends equal to a fresh load."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from stream.core.cache import CacheState, Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.items import Item
from stream.state.store import effect_records, load_partition, load_partition_in_slices
from stream.state.view_load import load_partition_into_view
from stream.worker.follower import Reread

HEX = "ab" * 32


def placed(endpoint: str, hashes: list[str]) -> ItemsPlaced:
    return ItemsPlaced(endpoint=endpoint, items=[Item(h, 1, "image") for h in hashes])


def store_of(log: list[ItemsPlaced]) -> tuple[CacheState, dict[bytes, bytes]]:
    """The owner's fold of ``log`` into partition 0 and its store records."""
    state, store = CacheState(Capacity("items", 6)), {}
    for offset, event in enumerate(log):
        for key, value in effect_records(state.fold.apply(event, Position(0, offset)), offset):
            if value is None:
                store.pop(key, None)
            else:
                store[key] = value
    return state, store


def held(state: CacheState) -> set[tuple[str, str]]:
    return {(name, digest) for name, cache in state.lrus.endpoints.items() for digest in cache.entries}


def test_an_endpoint_with_hex_and_text_hashes_is_loaded_whole():
    """Its hex (sha256) keys sort apart from its text keys: two runs of one endpoint.
    (Before: the second run replaced the first, so the sliced reload lost entries.)"""
    owner, store = store_of([placed("ns/pod", ["text-1", HEX, "text-2"])])
    view = CacheState(owner.lrus.capacity)
    list(load_partition_in_slices(view, 0, sorted(store.items()), entries_per_slice=1))
    assert view.digests.digest() == owner.digests.digest()
    assert held(view) == {("ns/pod", "text-1"), ("ns/pod", HEX), ("ns/pod", "text-2")}


names = st.sampled_from(["ns/a", "ns/b", "ns/c", "ns/d"])
hashes = st.sampled_from(["h1", "h2", "h3", "h4", "h5", "h6", "h7", HEX, "cd" * 32])
logs = st.lists(st.builds(placed, names, st.lists(hashes, min_size=1, max_size=4, unique=True)),
                max_size=12)


@settings(max_examples=150, deadline=None)
@given(logs, logs, st.integers(1, 8))
def test_replacing_a_partition_never_removes_an_entry_the_new_view_has(old_log, new_log, budget):
    old, _ = store_of(old_log)
    new, store = store_of(new_log)
    view = CacheState(old.lrus.capacity)
    view.merge(old)
    other = CacheState(old.lrus.capacity)  # another partition's endpoint: untouched
    other.fold.apply(placed("ns/other", ["h1"]), Position(1, 0))
    view.merge(other)
    keep = held(old) & held(new)
    for _ in load_partition_in_slices(view, 0, sorted(store.items()), entries_per_slice=budget):
        assert keep <= held(view)  # a match between two steps finds every one of them
        assert ("ns/other", "h1") in held(view)
    fresh = CacheState(old.lrus.capacity)
    load_partition(fresh, 0, store.items())
    fresh.merge(CacheState.from_export(old.lrus.capacity, _other_export()))
    assert view.digests.digest() == fresh.digests.digest()
    assert view.index.holders == fresh.index.holders
    assert view.lrus.applied.get(0) == new.lrus.applied.get(0)


def _other_export():
    other = CacheState(Capacity("items", 6))
    other.fold.apply(placed("ns/other", ["h1"]), Position(1, 0))
    return other.loading.export()


def test_a_changelog_in_key_order_is_loaded_in_the_owner_recency_order():
    """A seeded start writes its entries in key order, not recency order: the re-read
    orders them by their stored rank. (Applied in arrival order, as the follower did,
    the digest differs from the owner's.)"""
    owner, store = store_of([placed("ns/pod", ["h1", "h3"]), placed("ns/pod", ["h2"]),
                             placed("ns/pod", ["h1"])])
    reread = Reread()
    for key, value in sorted(store.items()):
        reread.add(key, value)
    view = CacheState(owner.lrus.capacity)
    asyncio.run(load_partition_into_view(view, 0, reread.records()))
    assert list(view.lrus.endpoints["ns/pod"].entries) == ["h3", "h2", "h1"]
    assert view.digests.digest() == owner.digests.digest()
    assert view.lrus.applied == {0: 2}

    arrival = CacheState(owner.lrus.capacity)
    from stream.state.store import decode_change

    for key, value in sorted(store.items()):
        change = decode_change(key, value)
        if change is not None:
            arrival.fold.follow(0, *change)
    assert arrival.digests.digest() != owner.digests.digest()


def test_a_reread_keeps_the_latest_value_and_forgets_removed_keys():
    _, store = store_of([placed("ns/pod", ["h1", "h2"])])
    reread = Reread()
    for key, value in store.items():
        reread.add(key, value)
    key = next(k for k in store if k.endswith(b"h1"))
    reread.add(key, None)
    view = CacheState(Capacity("items", 6))
    asyncio.run(load_partition_into_view(view, 0, reread.records()))
    assert list(view.lrus.endpoints["ns/pod"].entries) == ["h2"]
