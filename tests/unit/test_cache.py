"""The per-endpoint LRU fold, matching, summary and digest (CONTRACT, "Per-endpoint LRU")."""

from __future__ import annotations

from collections import defaultdict

import pytest

from stream.core.cache import CacheState, Capacity, Effects, EndpointMatch, Entry, combine_digests
from stream.core.codec import decode_event, encode_event
from stream.core.events import EndpointDeleted, EndpointsSynced, ItemsPlaced, Position
from stream.core.items import Item


class Log:
    """Applies events to a state at increasing offsets per partition, like a consumer."""

    def __init__(self, state: CacheState) -> None:
        self.state = state
        self.next: dict[int, int] = defaultdict(int)

    def apply(self, event, partition: int = 0) -> Effects | None:
        offset = self.next[partition]
        self.next[partition] += 1
        return self.state.fold.apply(event, Position(partition, offset))

    def place(self, endpoint: str, *items, partition: int = 0) -> Effects | None:
        return self.apply(ItemsPlaced(endpoint=endpoint, items=list(_items(items))), partition)

    def delete(self, endpoint: str, partition: int = 0) -> Effects | None:
        return self.apply(EndpointDeleted(endpoint=endpoint), partition)

    def sync(self, live: list[str], partition: int = 0) -> Effects | None:
        return self.apply(EndpointsSynced(live=live), partition)


def _items(specs):
    for spec in specs:
        if isinstance(spec, Item):
            yield spec
        elif isinstance(spec, tuple):
            yield Item(spec[0], spec[1], "image")
        else:
            yield Item(spec, 1, "image")


def items_mode(n: int) -> CacheState:
    return CacheState(Capacity("items", n))


def size_mode(n: int) -> CacheState:
    return CacheState(Capacity("size", n))


def lru(state: CacheState, endpoint: str) -> list[str]:
    """An endpoint's hashes, least recent first."""
    cache = state.lrus.endpoints.get(endpoint)
    return list(cache.entries) if cache else []


def sized(state: CacheState, endpoint: str) -> list[tuple[str, int]]:
    cache = state.lrus.endpoints.get(endpoint)
    return list(cache.entries.items()) if cache else []


def check_holders(state: CacheState) -> None:
    """The inverted index is exactly the transpose of the LRUs."""
    expected: dict[str, set[str]] = {}
    for name, cache in state.lrus.endpoints.items():
        for digest in cache.entries:
            expected.setdefault(digest, set()).add(name)
    assert state.index.holders == expected


# -- capacity ---------------------------------------------------------------------------


def test_capacity_default_is_2048_mib_as_1024_entries():
    assert Capacity.from_params() == Capacity("items", 1024)
    assert Capacity.from_params(cache_size_mb=2048) == Capacity("items", 1024)


def test_capacity_4_mib_is_2_entries():
    assert Capacity.from_params(cache_size_mb=4) == Capacity("items", 2)


@pytest.mark.parametrize("mb", [0, -1, -2048])
def test_capacity_non_positive_means_default(mb):
    assert Capacity.from_params(cache_size_mb=mb) == Capacity("items", 1024)


@pytest.mark.parametrize("mb, entries", [(1, 1), (2, 1), (3, 1), (5, 2), (100, 50)])
def test_capacity_is_mib_over_two_and_at_least_one(mb, entries):
    assert Capacity.from_params(cache_size_mb=mb) == Capacity("items", entries)


def test_capacity_both_set_is_an_error():
    with pytest.raises(ValueError):
        Capacity.from_params(cache_size_mb=4, embeddings=10)


def test_capacity_size_mode():
    assert Capacity.from_params(embeddings=5000) == Capacity("size", 5000)


def test_capacity_size_mode_rejects_non_positive():
    with pytest.raises(ValueError):
        Capacity.from_params(embeddings=0)


# -- eviction and recency ----------------------------------------------------------------


def test_placement_inserts_items_in_order_on_endpoint():
    state = items_mode(10)
    Log(state).place("e", "a", "b", "c")
    assert lru(state, "e") == ["a", "b", "c"]
    check_holders(state)


def test_eviction_drops_least_recent_first():
    state = items_mode(3)
    log = Log(state)
    log.place("e", "a", "b", "c")
    effects = log.place("e", "d", "f")
    assert lru(state, "e") == ["c", "d", "f"]
    assert effects.removals == [("e", "a"), ("e", "b")]
    assert "a" not in state.index.holders and "b" not in state.index.holders
    check_holders(state)


def test_placement_larger_than_capacity_keeps_its_last_items():
    state = items_mode(2)
    Log(state).place("e", "a", "b", "c", "d")
    assert lru(state, "e") == ["c", "d"]
    check_holders(state)


def test_replacement_refreshes_recency_so_item_survives_eviction():
    state = items_mode(3)
    log = Log(state)
    log.place("e", "a", "b", "c")
    log.place("e", "a")
    assert lru(state, "e") == ["b", "c", "a"]
    log.place("e", "d")
    assert lru(state, "e") == ["c", "a", "d"]
    check_holders(state)


def test_eviction_is_per_endpoint():
    state = items_mode(2)
    log = Log(state)
    log.place("e1", "a", "b")
    log.place("e2", "a", "b")
    log.place("e1", "c")
    assert lru(state, "e1") == ["b", "c"]
    assert lru(state, "e2") == ["a", "b"]
    assert state.index.holders["a"] == {"e2"}
    check_holders(state)


def test_match_does_not_change_recency():
    state = items_mode(3)
    log = Log(state)
    log.place("e", "a", "b", "c")
    before_digest, before = state.digests.digest(), lru(state, "e")
    result = state.index.match([Item("a", 1, "image")], ["e"])
    assert result[0]["matched_items"] == [Item("a", 1, "image")]
    assert state.digests.digest() == before_digest
    assert lru(state, "e") == before == ["a", "b", "c"]
    # The matched item is still the least recent: the next insert evicts it.
    log.place("e", "d")
    assert lru(state, "e") == ["b", "c", "d"]


def test_duplicate_item_within_a_placement_counts_once():
    state = items_mode(3)
    Log(state).place("e", "a", "b", "a")
    assert lru(state, "e") == ["b", "a"]
    assert state.lrus.endpoints["e"].weight == 2
    check_holders(state)


def test_one_placement_touches_one_endpoint_only():
    state = items_mode(3)
    Log(state).place("e1", "a")
    assert set(state.lrus.endpoints) == {"e1"}


# -- size mode ----------------------------------------------------------------------------


def test_size_mode_keeps_sum_of_sizes_within_n():
    state = size_mode(10)
    log = Log(state)
    log.place("e", ("a", 4), ("b", 4))
    assert state.lrus.endpoints["e"].weight == 8
    effects = log.place("e", ("c", 3))
    assert sized(state, "e") == [("b", 4), ("c", 3)]
    assert state.lrus.endpoints["e"].weight == 7
    assert effects.removals == [("e", "a")]
    check_holders(state)


def test_size_mode_item_exactly_n_fits_and_evicts_everything_else():
    state = size_mode(10)
    log = Log(state)
    log.place("e", ("a", 2), ("b", 2))
    log.place("e", ("c", 10))
    assert sized(state, "e") == [("c", 10)]
    check_holders(state)


def test_size_mode_item_larger_than_n_is_not_recorded():
    state = size_mode(10)
    log = Log(state)
    log.place("e", ("a", 3))
    effects = log.place("e", ("big", 11), ("b", 2))
    assert sized(state, "e") == [("a", 3), ("b", 2)]
    assert "big" not in state.index.holders
    assert [u.hash for u in effects.upserts] == ["b"]
    assert effects.removals == []
    check_holders(state)


def test_size_mode_placement_of_only_oversized_items_records_no_endpoint():
    state = size_mode(5)
    effects = Log(state).place("e", ("big", 6))
    assert "e" not in state.lrus.endpoints
    assert state.index.holders == {}
    assert effects == Effects()
    assert state.index.summary(10) == []


def test_size_mode_evicts_oldest_until_it_fits():
    state = size_mode(10)
    log = Log(state)
    log.place("e", ("a", 1), ("b", 2), ("c", 3), ("d", 4))
    log.place("e", ("f", 6))
    # 10 + 6 = 16: evict a (15), b (13), c (10) -> fits.
    assert sized(state, "e") == [("d", 4), ("f", 6)]
    check_holders(state)


def test_size_mode_replacing_item_with_new_size_updates_weight():
    state = size_mode(10)
    log = Log(state)
    log.place("e", ("a", 2), ("b", 3))
    log.place("e", ("a", 5))
    assert sized(state, "e") == [("b", 3), ("a", 5)]
    assert state.lrus.endpoints["e"].weight == 8


def test_items_mode_counts_entries_not_sizes():
    state = items_mode(2)
    Log(state).place("e", ("a", 1000), ("b", 1000))
    assert sized(state, "e") == [("a", 1000), ("b", 1000)]
    assert state.lrus.endpoints["e"].weight == 2000


# -- delete and sync ------------------------------------------------------------------


def test_delete_drops_whole_lru_and_holders():
    state = items_mode(10)
    log = Log(state)
    log.place("e1", "a", "b")
    log.place("e2", "b", "c")
    effects = log.delete("e1")
    assert "e1" not in state.lrus.endpoints
    assert state.index.holders == {"b": {"e2"}, "c": {"e2"}}
    assert effects.removals == [("e1", "a"), ("e1", "b")]
    assert effects.upserts == []
    assert state.index.match([Item("a", 1, "image")], ["e1"])[0]["matched_items"] == []
    check_holders(state)


def test_delete_unknown_endpoint_changes_nothing_but_is_applied():
    state = items_mode(10)
    log = Log(state)
    log.place("e", "a")
    before = state.digests.digest()
    effects = log.delete("ghost")
    assert effects == Effects()
    assert state.digests.digest() == before
    assert state.lrus.applied == {0: 1}


def test_placement_after_delete_starts_fresh():
    state = items_mode(10)
    log = Log(state)
    log.place("e", "a", "b")
    log.delete("e")
    log.place("e", "c")
    assert lru(state, "e") == ["c"]
    check_holders(state)


def test_sync_drops_endpoints_not_in_live_set():
    state = items_mode(10)
    log = Log(state)
    log.place("e1", "a")
    log.place("e2", "b")
    log.place("e3", "a", "c")
    effects = log.sync(["e2", "other"])
    assert set(state.lrus.endpoints) == {"e2"}
    assert sorted(effects.removals) == [("e1", "a"), ("e3", "a"), ("e3", "c")]
    assert state.index.holders == {"b": {"e2"}}
    check_holders(state)


def test_sync_acts_only_on_endpoints_of_its_partition():
    state = items_mode(10)
    log = Log(state)
    log.place("p0-a", "x", partition=0)
    log.place("p0-b", "x", partition=0)
    log.place("p1-a", "x", partition=1)
    log.place("p1-b", "y", partition=1)
    effects = log.sync(["p0-a", "p1-a"], partition=0)
    assert set(state.lrus.endpoints) == {"p0-a", "p1-a", "p1-b"}
    assert effects.removals == [("p0-b", "x")]
    effects = log.sync(["p0-a", "p1-a"], partition=1)
    assert set(state.lrus.endpoints) == {"p0-a", "p1-a"}
    assert effects.removals == [("p1-b", "y")]
    check_holders(state)


def test_sync_with_empty_live_set_is_ignored():
    state = items_mode(10)
    log = Log(state)
    log.place("e", "a")
    before = state.digests.digest()
    effects = log.sync([])
    assert effects == Effects()
    assert state.digests.digest() == before
    assert lru(state, "e") == ["a"]
    assert state.lrus.applied[0] == 1


# -- redelivery ---------------------------------------------------------------------------


def test_apply_returns_none_at_or_below_applied_offset():
    state = items_mode(10)
    first = ItemsPlaced(endpoint="e", items=[Item("a", 1, "image")])
    assert state.fold.apply(first, Position(0, 5)) is not None
    digest = state.digests.digest()
    redelivered = [
        (first, Position(0, 5)),
        (ItemsPlaced(endpoint="e", items=[Item("b", 1, "image")]), Position(0, 3)),
        (EndpointDeleted(endpoint="e"), Position(0, 5)),
        (EndpointsSynced(live=["other"]), Position(0, 0)),
    ]
    for event, position in redelivered:
        assert state.fold.apply(event, position) is None
    assert state.digests.digest() == digest
    assert lru(state, "e") == ["a"]
    assert state.lrus.applied == {0: 5}


def test_applied_offset_is_per_partition():
    state = items_mode(10)
    state.fold.apply(ItemsPlaced(endpoint="e0", items=[Item("a", 1, "image")]), Position(0, 7))
    effects = state.fold.apply(ItemsPlaced(endpoint="e1", items=[Item("b", 1, "image")]), Position(1, 0))
    assert effects is not None
    assert state.lrus.applied == {0: 7, 1: 0}
    assert lru(state, "e1") == ["b"]


def test_offsets_may_have_gaps():
    state = items_mode(10)
    assert state.fold.apply(ItemsPlaced(endpoint="e", items=[Item("a", 1, "i")]), Position(0, 0))
    assert state.fold.apply(ItemsPlaced(endpoint="e", items=[Item("b", 1, "i")]), Position(0, 10))
    assert lru(state, "e") == ["a", "b"]


# -- matching -----------------------------------------------------------------------------


def test_match_scores_by_weight_and_keeps_request_item_order():
    state = items_mode(10)
    log = Log(state)
    log.place("e1", ("c", 1), ("a", 1))
    log.place("e2", ("b", 1))
    request = [Item("a", 2, "image"), Item("b", 3, "video"), Item("c", 5, "audio")]
    result = state.index.match(request, ["e1", "e2"])
    assert result == [
        EndpointMatch(endpoint="e1", matched_items=[Item("a", 2, "image"), Item("c", 5, "audio")], matched_weight=7, total_weight=10, score=0.7),
        EndpointMatch(endpoint="e2", matched_items=[Item("b", 3, "video")], matched_weight=3, total_weight=10, score=0.3),
    ]


def test_match_one_result_per_distinct_endpoint_in_request_order():
    state = items_mode(10)
    Log(state).place("e1", "a")
    result = state.index.match([Item("a", 1, "image")], ["e2", "e1", "e2", "e1", "e3"])
    assert [m["endpoint"] for m in result] == ["e2", "e1", "e3"]
    assert [m["score"] for m in result] == [0.0, 1.0, 0.0]


def test_match_unknown_endpoint_matches_nothing():
    state = items_mode(10)
    Log(state).place("e1", "a")
    [result] = state.index.match([Item("a", 4, "image")], ["nobody"])
    assert result == EndpointMatch(endpoint="nobody", matched_items=[], matched_weight=0, total_weight=4, score=0.0)


def test_match_no_items_gives_empty_list():
    state = items_mode(10)
    Log(state).place("e1", "a")
    assert state.index.match([], ["e1", "e2"]) == []


def test_match_no_endpoints_gives_empty_list():
    state = items_mode(10)
    Log(state).place("e1", "a")
    assert state.index.match([Item("a", 1, "image")], []) == []


def test_match_full_hit_scores_one():
    state = items_mode(10)
    Log(state).place("e", "a", "b")
    [result] = state.index.match([Item("b", 1, "image"), Item("a", 1, "image")], ["e"])
    assert result["matched_items"] == [Item("b", 1, "image"), Item("a", 1, "image")]
    assert (result["matched_weight"], result["total_weight"], result["score"]) == (2, 2, 1.0)


def test_match_accepts_any_iterable_of_endpoints():
    state = items_mode(10)
    Log(state).place("e", "a")
    result = state.index.match([Item("a", 1, "image")], iter(["e"]))
    assert [m["score"] for m in result] == [1.0]


def test_match_ignores_evicted_items():
    state = items_mode(1)
    log = Log(state)
    log.place("e", "a")
    log.place("e", "b")
    [result] = state.index.match([Item("a", 1, "image"), Item("b", 1, "image")], ["e"])
    assert result["matched_items"] == [Item("b", 1, "image")]
    assert result["score"] == 0.5


# -- summary ------------------------------------------------------------------------------


def test_summary_orders_by_items_desc_then_name_and_limits():
    state = size_mode(100)
    log = Log(state)
    log.place("b", ("x", 5))
    log.place("c", ("x", 1), ("y", 1))
    log.place("a", ("z", 7))
    log.place("d", ("x", 1), ("y", 1), ("z", 1))
    rows = state.index.summary(10)
    assert [(r.endpoint, r.items, r.weight) for r in rows] == [
        ("d", 3, 3),
        ("c", 2, 2),
        ("a", 1, 7),
        ("b", 1, 5),
    ]
    assert [r.endpoint for r in state.index.summary(2)] == ["d", "c"]
    assert state.index.summary(0) == []


def test_summary_of_empty_state_is_empty():
    assert items_mode(4).index.summary(100) == []


# -- digest -------------------------------------------------------------------------------


def test_digest_of_empty_states_is_equal():
    assert items_mode(4).digests.digest() == size_mode(9).digests.digest()


def test_digest_equal_for_equal_states_built_by_different_paths():
    s1 = items_mode(3)
    log1 = Log(s1)
    log1.place("e1", "a", "b", "c")
    log1.place("e2", "x")
    log1.place("e1", "d")  # evicts a -> b c d

    s2 = items_mode(3)
    log2 = Log(s2)
    log2.place("e2", "y", partition=1)
    log2.place("gone", "q", partition=1)
    log2.place("e1", "c", "b")
    log2.place("e1", "c", "d")  # c b -> b c d
    log2.delete("gone", partition=1)
    log2.place("e2", "x", partition=1)
    log2.place("e2", "x", partition=1)
    log2.sync(["e1", "e2"], partition=1)
    log2.place("e2", "z", partition=1)
    log2.place("e2", "x", partition=1)
    log2.delete("e2", partition=1)
    log2.place("e2", "x", partition=1)

    assert lru(s1, "e1") == lru(s2, "e1") == ["b", "c", "d"]
    assert lru(s1, "e2") == lru(s2, "e2") == ["x"]
    assert s1.digests.digest() == s2.digests.digest()


def test_digest_differs_when_recency_order_differs():
    s1, s2 = items_mode(5), items_mode(5)
    Log(s1).place("e", "a", "b")
    Log(s2).place("e", "b", "a")
    assert s1.digests.digest() != s2.digests.digest()


def test_digest_differs_when_sizes_differ():
    s1, s2 = size_mode(50), size_mode(50)
    Log(s1).place("e", ("a", 1))
    Log(s2).place("e", ("a", 2))
    assert s1.digests.digest() != s2.digests.digest()


def test_digest_differs_when_endpoint_differs():
    s1, s2 = items_mode(5), items_mode(5)
    Log(s1).place("e1", "a")
    Log(s2).place("e2", "a")
    assert s1.digests.digest() != s2.digests.digest()


def test_digest_is_not_fooled_by_string_boundaries():
    s1, s2 = items_mode(5), items_mode(5)
    Log(s1).place("e", "ab", "c")
    Log(s2).place("e", "a", "bc")
    assert s1.digests.digest() != s2.digests.digest()


def test_digest_ignores_applied_offsets():
    s1, s2 = items_mode(5), items_mode(5)
    s1.fold.apply(ItemsPlaced(endpoint="e", items=[Item("a", 1, "i")]), Position(0, 0))
    s2.fold.apply(ItemsPlaced(endpoint="e", items=[Item("a", 1, "i")]), Position(3, 99))
    assert s1.digests.digest() == s2.digests.digest()


# -- restore and effects ------------------------------------------------------------------


def build_sample(state: CacheState) -> Log:
    log = Log(state)
    log.place("e1", ("a", 2), ("b", 3), ("c", 1), partition=0)
    log.place("e2", ("b", 3), ("d", 4), partition=1)
    log.place("e1", ("a", 2), partition=0)
    log.place("e3", ("z", 1), partition=1)
    log.place("e2", ("f", 5), partition=1)
    log.delete("e3", partition=1)
    log.place("e4", ("q", 1), partition=2)
    return log


def restored_from(state: CacheState) -> CacheState:
    groups: dict[int, list[Entry]] = defaultdict(list)
    for partition, entry in state.loading.entries():
        groups[partition].append(entry)
    copy = CacheState(state.lrus.capacity)
    for partition in set(groups) | set(state.lrus.applied):
        copy.loading.restore(partition, state.lrus.applied.get(partition), reversed(groups[partition]))
    return copy


def test_restore_from_entries_gives_equal_state():
    state = size_mode(9)
    build_sample(state)
    copy = restored_from(state)
    assert copy.digests.digest() == state.digests.digest()
    assert copy.lrus.applied == state.lrus.applied
    assert {n: c.partition for n, c in copy.lrus.endpoints.items()} == {
        n: c.partition for n, c in state.lrus.endpoints.items()
    }
    for name in state.lrus.endpoints:
        assert sized(copy, name) == sized(state, name)
        assert copy.lrus.endpoints[name].weight == state.lrus.endpoints[name].weight
    check_holders(copy)
    assert copy.index.holders == state.index.holders


def test_restored_state_behaves_like_the_original():
    state = size_mode(9)
    log = build_sample(state)
    copy = restored_from(state)
    clone_log = Log(copy)
    clone_log.next = defaultdict(int, log.next)
    for target in (log, clone_log):
        target.place("e1", ("n", 4), partition=0)
        target.sync(["e1"], partition=1)
        assert target.apply(EndpointsSynced(live=["e1"]), partition=2) is not None
    assert copy.digests.digest() == state.digests.digest()
    assert set(copy.lrus.endpoints) == {"e1"}
    # Redelivering an already-applied offset is still skipped after restore.
    assert copy.fold.apply(EndpointDeleted(endpoint="e1"), Position(0, 0)) is None


def test_entries_yield_partition_and_recency_rank():
    state = items_mode(5)
    log = Log(state)
    log.place("e", "a", "b", partition=2)
    log.place("e", "a", partition=2)
    assert list(state.loading.entries()) == [
        (2, Entry("e", "b", 1, 0, 0)),
        (2, Entry("e", "a", 1, 0, 1)),
    ]


def mirror_apply(mirror: dict[tuple[str, str], Entry], effects: Effects) -> None:
    for entry in effects.upserts:
        mirror[(entry.endpoint, entry.hash)] = entry
    for key in effects.removals:
        del mirror[key]


def mirror_view(mirror: dict[tuple[str, str], Entry]) -> dict[str, list[tuple[str, int]]]:
    """Per endpoint, the mirrored entries in recency order (by offset, then index)."""
    by_endpoint: dict[str, list[Entry]] = defaultdict(list)
    for entry in mirror.values():
        by_endpoint[entry.endpoint].append(entry)
    return {
        name: [(e.hash, e.size) for e in sorted(group, key=lambda e: (e.offset, e.index))]
        for name, group in by_endpoint.items()
    }


def state_view(state: CacheState) -> dict[str, list[tuple[str, int]]]:
    return {name: list(cache.entries.items()) for name, cache in state.lrus.endpoints.items()}


def test_effects_replayed_into_a_dict_mirror_the_state():
    state = size_mode(8)
    log = Log(state)
    mirror: dict[tuple[str, str], Entry] = {}
    steps = [
        lambda: log.place("e1", ("a", 2), ("b", 3), ("c", 1)),
        lambda: log.place("e1", ("a", 2), ("d", 4)),  # evicts b
        lambda: log.place("e2", ("a", 1), ("a", 1), ("big", 9), partition=1),
        lambda: log.place("e1", ("x", 8)),  # evicts everything else
        lambda: log.place("e3", ("y", 1), ("y", 2), partition=1),
        lambda: log.delete("e2", partition=1),
        lambda: log.sync(["e1"], partition=1),
        lambda: log.place("e1", ("p", 1), ("q", 1)),
    ]
    for step in steps:
        effects = step()
        assert effects is not None
        mirror_apply(mirror, effects)
        assert mirror_view(mirror) == state_view(state)
    assert state_view(state) == {"e1": [("p", 1), ("q", 1)]}


def test_effects_upserts_carry_position_and_item_index():
    state = items_mode(5)
    effects = state.fold.apply(
        ItemsPlaced(endpoint="e", items=[Item("a", 3, "image"), Item("b", 1, "video")]),
        Position(4, 17),
    )
    assert effects.upserts == [Entry("e", "a", 3, 17, 0), Entry("e", "b", 1, 17, 1)]
    assert effects.removals == []


def test_restore_from_mirrored_effects_gives_equal_state():
    state = items_mode(3)
    log = Log(state)
    mirror: dict[tuple[str, str], Entry] = {}
    for step in [
        lambda: log.place("e", "a", "b", "c"),
        lambda: log.place("e", "a", "d"),
        lambda: log.place("f", "d", "a", partition=1),
        lambda: log.place("e", "b"),
    ]:
        mirror_apply(mirror, step())
    copy = CacheState(state.lrus.capacity)
    copy.loading.restore(0, state.lrus.applied[0], [e for e in mirror.values() if e.endpoint == "e"])
    copy.loading.restore(1, state.lrus.applied[1], [e for e in mirror.values() if e.endpoint == "f"])
    assert copy.digests.digest() == state.digests.digest()
    assert lru(copy, "e") == ["a", "d", "b"]


def test_follow_mirrors_another_workers_changes_in_order():
    owner = CacheState(Capacity("items", 2))
    follower = CacheState(Capacity("items", 2))
    log = [
        ItemsPlaced(endpoint="e", items=[Item("a", 1, "image"), Item("b", 2, "image")]),
        ItemsPlaced(endpoint="e", items=[Item("a", 1, "image"), Item("c", 3, "video")]),
        EndpointDeleted(endpoint="e"),
        ItemsPlaced(endpoint="f", items=[Item("d", 1, "image")]),
    ]
    for offset, event in enumerate(log):
        effects = owner.fold.apply(event, Position(3, offset))
        for entry in effects.upserts:
            follower.fold.follow(3, entry.endpoint, entry.hash, entry.size)
        for endpoint, digest in effects.removals:
            follower.fold.follow(3, endpoint, digest, None)
        assert follower.digests.digest() == owner.digests.digest()
        assert follower.index.holders == owner.index.holders
    assert follower.lrus.endpoints["f"].partition == 3


def test_drop_partition_forgets_only_that_partition():
    state = CacheState(Capacity("items", 4))
    state.fold.apply(ItemsPlaced(endpoint="e", items=[Item("a", 1, "image")]), Position(0, 0))
    state.fold.apply(ItemsPlaced(endpoint="f", items=[Item("a", 1, "image")]), Position(1, 0))
    state.loading.drop_partition(0)
    assert list(state.lrus.endpoints) == ["f"]
    assert state.index.holders == {"a": {"f"}}
    assert state.lrus.applied == {1: 0}


def test_merge_adds_the_endpoints_of_a_state_of_other_partitions():
    capacity = Capacity("items", 4)
    first, second = CacheState(capacity), CacheState(capacity)
    first.fold.apply(ItemsPlaced(endpoint="e", items=[Item("a", 1, "image")]), Position(0, 3))
    second.fold.apply(ItemsPlaced(endpoint="f", items=[Item("a", 1, "image"), Item("b", 1, "image")]),
                      Position(1, 9))
    whole = CacheState(capacity)
    whole.fold.apply(ItemsPlaced(endpoint="e", items=[Item("a", 1, "image")]), Position(0, 3))
    whole.fold.apply(ItemsPlaced(endpoint="f", items=[Item("a", 1, "image"), Item("b", 1, "image")]),
                     Position(1, 9))
    first.merge(second)
    assert first.digests.digest() == whole.digests.digest()
    assert first.index.holders == {"a": {"e", "f"}, "b": {"f"}}
    assert first.lrus.applied == {0: 3, 1: 9}


def test_merge_refuses_overlapping_partitions_and_other_capacities():
    state = CacheState(Capacity("items", 4))
    state.fold.apply(ItemsPlaced(endpoint="e", items=[Item("a", 1, "image")]), Position(0, 3))
    same = CacheState(Capacity("items", 4))
    same.fold.apply(ItemsPlaced(endpoint="g", items=[Item("a", 1, "image")]), Position(0, 5))
    with pytest.raises(ValueError, match="different partitions"):
        state.merge(same)
    with pytest.raises(ValueError, match="capacity"):
        CacheState(Capacity("size", 4)).merge(state)


def test_a_state_holds_its_parts_and_has_no_pass_through_methods():
    """Callers use the parts (issue 32): a state's own methods are those that take more
    than one part at once, so nothing can be done in two ways."""
    state = CacheState(Capacity("items", 4))
    public = {name for name in dir(state) if not name.startswith("_")}
    assert public == {"lrus", "fold", "index", "loading", "digests", "from_export", "merge"}
    assert all(part.lrus is state.lrus for part in (state.fold, state.index, state.loading, state.digests))


def test_merge_takes_the_digests_with_the_lrus():
    """Why ``merge`` is the state's and not ``Loading``'s: the LRUs merged alone are never
    hashed into the sliced digest, which then differs from the digest of the whole."""
    capacity = Capacity("items", 4)
    first, second = CacheState(capacity), CacheState(capacity)
    first.fold.apply(ItemsPlaced(endpoint="e", items=[Item("a", 1, "image")]), Position(0, 0))
    second.fold.apply(ItemsPlaced(endpoint="f", items=[Item("b", 1, "image")]), Position(1, 0))
    alone = CacheState(capacity)
    alone.fold.apply(ItemsPlaced(endpoint="e", items=[Item("a", 1, "image")]), Position(0, 0))
    alone.loading.merge(CacheState.from_export(capacity, second.loading.export()).lrus)
    first.merge(second)
    for state in (first, alone):
        state.digests.start_round()
        while not state.digests.refresh(100):
            pass
    assert first.digests.latest() == first.digests.digest() == alone.digests.digest()
    assert alone.digests.latest() != alone.digests.digest()


def test_export_then_from_export_gives_the_same_state():
    state = CacheState(Capacity("size", 10))
    state.fold.apply(ItemsPlaced(endpoint="e", items=[Item("a", 3, "image"), Item("b", 4, "audio")]),
                     Position(2, 5))
    state.fold.apply(ItemsPlaced(endpoint="f", items=[Item("a", 3, "image")]), Position(1, 0))
    copy = CacheState.from_export(state.lrus.capacity, state.loading.export())
    assert copy.digests.digest() == state.digests.digest()
    assert copy.lrus.endpoints == state.lrus.endpoints
    assert copy.index.holders == {"a": {"e", "f"}, "b": {"e"}}
    assert copy.lrus.applied == {2: 5, 1: 0}


# -- the digest per endpoint, in slices ------------------------------------------------------


def _filled(endpoints: int, entries: int) -> CacheState:
    state = items_mode(entries)
    for e in range(endpoints):
        items = [Item(f"h{e}-{i}", 1 + i % 3, "image") for i in range(entries)]
        state.fold.apply(ItemsPlaced(endpoint=f"ns/pod-{e}", items=items), Position(0, e))
    return state


class _HashCount:
    """Counts the strings the digest code feeds its hashes (one per entry hashed)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import stream.core.digests as cache_module

        self.count = 0
        real = cache_module._put

        def counting(h, text):
            self.count += 1
            real(h, text)

        monkeypatch.setattr(cache_module, "_put", counting)

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def _settle(state: CacheState, budget: int) -> list[bool]:
    state.digests.start_round()
    done = [state.digests.refresh(budget)]
    while not done[-1]:
        done.append(state.digests.refresh(budget))
    return done


def test_a_slice_hashes_at_most_its_budget_of_entries_even_inside_one_endpoint(monkeypatch):
    state = _filled(3, 10)
    hashed = _HashCount(monkeypatch)
    state.digests.start_round()
    counts = []
    while not state.digests.refresh(4):
        counts.append(hashed.take())
    counts.append(hashed.take())
    assert max(counts) <= 4 and sum(counts) == 30  # 30 entries, each hashed once
    assert state.digests.cached() == state.digests.digest()


def test_a_settled_digest_is_not_recomputed_and_a_change_rehashes_only_its_endpoint(monkeypatch):
    state = _filled(5, 8)
    _settle(state, 1000)
    hashed = _HashCount(monkeypatch)
    assert state.digests.cached() == state.digests.latest()
    assert _settle(state, 1000) == [True] and hashed.take() == 0
    state.fold.apply(ItemsPlaced(endpoint="ns/pod-2", items=[Item("new", 1, "image")]), Position(0, 9))
    assert state.digests.cached() is None  # a change is never answered from stale digests
    _settle(state, 1000)
    assert hashed.take() == 8  # ns/pod-2's 8 entries (capacity 8), no other endpoint's
    hashed.take()
    assert state.digests.cached() == state.digests.digest()


def test_every_mutation_path_makes_its_endpoint_pending():
    state = _filled(2, 4)
    changes = [
        lambda: state.fold.apply(ItemsPlaced(endpoint="ns/pod-0", items=[Item("x", 1, "image")]),
                                 Position(0, 10)),
        lambda: state.fold.apply(EndpointDeleted(endpoint="ns/pod-1"), Position(0, 11)),
        lambda: state.fold.apply(EndpointsSynced(live=["ns/other"]), Position(0, 12)),
        lambda: state.fold.follow(1, "ns/f", "y", 2),
        lambda: state.fold.follow(1, "ns/f", "y", None),
        lambda: state.loading.restore_lru(2, "ns/r", [("z", 1)]),
        lambda: state.loading.restore(3, 0, [Entry("ns/s", "w", 1, 0, 0)]),
        lambda: state.loading.drop_partition(2),
    ]
    for change in changes:
        _settle(state, 3)
        assert not state.digests.pending()
        change()
        assert state.digests.pending()
        _settle(state, 3)
        assert state.digests.cached() == state.digests.digest()


def test_an_endpoint_changed_while_hashed_half_way_is_hashed_again():
    state = _filled(1, 10)
    state.digests.start_round()
    assert not state.digests.refresh(4)  # ns/pod-0 is half hashed
    state.fold.apply(ItemsPlaced(endpoint="ns/pod-0", items=[Item("h0-0", 1, "image")]), Position(0, 5))
    while not state.digests.refresh(4):
        pass
    assert state.digests.cached() == state.digests.digest()
    state.fold.apply(ItemsPlaced(endpoint="ns/pod-0", items=[Item("h0-1", 1, "image")]), Position(0, 6))
    state.digests.start_round()
    assert not state.digests.refresh(4)  # half hashed again
    state.fold.apply(ItemsPlaced(endpoint="ns/pod-0", items=[Item("h0-2", 1, "image")]), Position(0, 7))
    state.digests.start_round()  # a new round begun while the changed endpoint is half done
    assert state.digests.cached() is None
    assert _settle(state, 4)[-1] and state.digests.cached() == state.digests.digest()


def test_combined_digest_from_cache_equals_combine_digests_of_endpoint_digests():
    state = _filled(7, 3)
    _settle(state, 2)
    digests = state.digests
    assert digests.cached() == combine_digests(digests.endpoint_digests()) == digests.digest()


def test_summary_ranks_by_items_then_name_for_any_limit():
    state = items_mode(5)
    for e, count in enumerate([3, 1, 3, 5, 2, 3]):
        items = [Item(f"h{i}", 2, "image") for i in range(count)]
        state.fold.apply(ItemsPlaced(endpoint=f"ns/p{e}", items=items), Position(0, e))
    full = [("ns/p3", 5, 10), ("ns/p0", 3, 6), ("ns/p2", 3, 6), ("ns/p5", 3, 6),
            ("ns/p4", 2, 4), ("ns/p1", 1, 2)]
    for limit in range(8):
        assert [tuple(row) for row in state.index.summary(limit)] == full[:limit]


def test_hashes_and_names_are_stored_once_whatever_carried_them():
    """Decoded events and store records bring their own string copies; the view keeps one
    object per hash and per endpoint name (a copy per entry was ~90 B of ~260 B)."""
    state = CacheState(Capacity("items", 8))

    def fresh(text: str) -> str:
        return "".join(list(text))  # an equal string, never the same object

    raw = encode_event(ItemsPlaced(endpoint="ns/a", items=[Item("h" * 64, 1, "image")]))
    state.fold.apply(decode_event(raw), Position(0, 0))
    state.fold.apply(decode_event(raw), Position(0, 1))
    state.fold.apply(ItemsPlaced(endpoint=fresh("ns/b"), items=[Item(fresh("h" * 64), 1, "image")]),
                     Position(1, 0))
    state.fold.follow(2, fresh("ns/c"), fresh("h" * 64), 1)
    state.loading.restore_lru(3, fresh("ns/d"), [(fresh("h" * 64), 1)])
    state.loading.replace_lru(4, fresh("ns/e"), [(fresh("h" * 64), 1)])
    keys = [next(iter(cache.entries)) for cache in state.lrus.endpoints.values()]
    assert len(keys) == 5 and all(key is keys[0] for key in keys)
    (held,) = state.index.holders.values()
    names = {id(name) for name in state.lrus.endpoints}
    assert {id(name) for name in held} == names


def test_placing_an_item_whose_stale_index_entry_names_the_endpoint_heals_it():
    """An index out of step with the LRUs (a restore over a live endpoint leaves its old
    hash indexed) must heal as a set's add did: the fold holds a name at most once."""
    state = CacheState(Capacity("items", 4))
    placed = iter(range(100))

    def place(endpoint: str, digest: str) -> None:
        state.fold.apply(ItemsPlaced(endpoint=endpoint, items=[Item(digest, 1, "image")]),
                         Position(0, next(placed)))

    place("a", "h0")
    place("b", "h0")
    state.loading.restore_lru(0, "a", [("h1", 1)])  # a's h0 stays indexed, stale
    place("a", "h0")
    assert state.index.hits([Item("h0", 1, "image")], ["a", "b"])[1] == {"a": [Item("h0", 1, "image")],
                                                                  "b": [Item("h0", 1, "image")]}
    for n in range(2, 6):  # evict h0 from a's LRU of 4
        place("a", f"h{n}")
    assert state.index.holders["h0"] == {"b"}
