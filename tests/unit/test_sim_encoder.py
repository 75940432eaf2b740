"""The vLLM-like encoder cache model (the simulator's truth), on hand-worked cases."""

from __future__ import annotations

import pytest

from stream.sim.encoder import EncoderCache


def test_a_new_request_is_encoded_and_pinned():
    cache = EncoderCache(10)
    admission = cache.admit(1, [("a", 4), ("b", 3)])
    assert admission.status == "admitted"
    assert admission.added == (("a", 4), ("b", 3)) and admission.hits == ()
    assert admission.pinned
    assert cache.free == 3 and cache.freeable_space == 0
    assert "a" in cache and "b" in cache


def test_eviction_takes_the_least_recently_freed_first_not_the_least_recently_added():
    cache = EncoderCache(10)
    cache.admit(1, [("a", 3)])
    cache.admit(2, [("b", 3)])
    cache.admit(3, [("c", 3)])
    # freed in the order c, a, b: a was added first but c was freed first
    cache.release(3, ["c"])
    cache.release(1, ["a"])
    cache.release(2, ["b"])
    admission = cache.admit(4, [("d", 4)])  # 1 free: needs 3 more, one entry of 3
    assert admission.evicted == ("c",)
    assert "a" in cache and "b" in cache and "c" not in cache
    admission = cache.admit(5, [("e", 3)])  # 0 free: the next freed is a
    assert admission.evicted == ("a",)
    assert list(cache.freeable) == ["b"]


def test_referenced_entries_are_never_evicted_the_request_waits():
    cache = EncoderCache(10)
    cache.admit(1, [("a", 6)])  # pinned by request 1
    cache.admit(2, [("b", 2)])
    cache.release(2, ["b"])  # b freeable; free 2 + freeable 2 = 4 < 5
    before = (dict(cache.sizes), dict(cache.freeable), cache.free, cache.freeable_space)
    assert cache.admit(3, [("c", 5)]).status == "waiting"
    assert (dict(cache.sizes), dict(cache.freeable), cache.free, cache.freeable_space) == before
    # once a's last reference drops it can go too, after b, which was freed before it
    cache.release(1, ["a"])
    admission = cache.admit(3, [("c", 5)])
    assert admission.status == "admitted"
    assert admission.evicted == ("b", "a")


def test_order_of_freeing_decides_even_with_pins_around():
    cache = EncoderCache(10)
    cache.admit(1, [("a", 2), ("b", 2)])
    cache.admit(2, [("c", 2)])
    cache.release(1, ["b"])  # b freed first, a still pinned by request 1
    cache.release(2, ["c"])  # then c
    admission = cache.admit(3, [("d", 6)])  # free 4: needs 2 more -> b goes, not a (pinned)
    assert admission.evicted == ("b",)
    assert "a" in cache and "c" in cache


def test_a_freeable_entry_is_reused_and_pinned_again():
    cache = EncoderCache(10)
    cache.admit(1, [("a", 6)])
    cache.release(1, ["a"])
    assert cache.freeable == {"a": 6}
    admission = cache.admit(2, [("a", 6), ("b", 4)])
    assert admission.status == "admitted"
    assert admission.hits == (("a", 6),) and admission.added == (("b", 4),)
    assert admission.evicted == ()
    assert cache.freeable == {} and cache.refs["a"] == {2}
    # pinned again: a third request needing space cannot take it
    assert cache.admit(3, [("c", 1)]).status == "waiting"


def test_a_hit_does_not_count_its_own_freeable_space_as_room():
    cache = EncoderCache(10)
    cache.admit(1, [("a", 6)])
    cache.release(1, ["a"])  # a freeable (6)
    cache.admit(2, [("c", 2)])  # c pinned; free 2
    # reusing a pins it, so only the 2 free are room for b's 3: wait, never evict a
    assert cache.admit(3, [("a", 6), ("b", 3)]).status == "waiting"
    assert "a" in cache and cache.freeable == {"a": 6}
    cache.release(2, ["c"])
    admission = cache.admit(3, [("a", 6), ("b", 3)])
    assert admission.status == "admitted" and admission.evicted == ("c",)


def test_an_item_over_the_per_step_budget_can_never_be_scheduled():
    cache = EncoderCache(100, budget=50)
    assert cache.admit(1, [("a", 51)]).status == "too_large"
    assert len(cache) == 0 and cache.free == 100
    assert cache.admit(2, [("b", 50)]).status == "admitted"


def test_an_item_larger_than_the_cache_is_too_large_whatever_the_budget():
    cache = EncoderCache(10, budget=50)
    assert cache.admit(1, [("a", 11)]).status == "too_large"
    assert cache.free == 10


def test_a_request_larger_than_the_cache_goes_in_item_by_item_unpinned():
    cache = EncoderCache(10)
    admission = cache.admit(1, [("a", 6), ("b", 6)])
    assert admission.status == "admitted" and not admission.pinned
    # a went in, was freed once stored, and was evicted to make room for b
    assert admission.evicted == ("a",) and admission.added == (("b", 6),)
    assert cache.freeable == {"b": 6} and cache.free == 4


def test_release_of_a_request_that_does_not_hold_the_entry_changes_nothing():
    cache = EncoderCache(10)
    cache.admit(1, [("a", 3)])
    cache.release(2, ["a", "zz"])
    assert cache.refs["a"] == {1} and cache.freeable == {}


def test_two_requests_share_an_entry_it_is_freeable_after_both_release():
    cache = EncoderCache(10)
    cache.admit(1, [("a", 3)])
    assert cache.admit(2, [("a", 3)]).hits == (("a", 3),)
    cache.release(1, ["a"])
    assert cache.freeable == {}
    cache.release(2, ["a"])
    assert cache.freeable == {"a": 3}


@pytest.mark.parametrize("size", [0, -5])
def test_the_cache_needs_a_positive_size(size):
    with pytest.raises(ValueError):
        EncoderCache(size)


# -- the item-level operations the engine's scheduler makes, as vLLM's makes them ------


def test_can_allocate_counts_the_budget_left_and_what_the_request_already_scheduled():
    cache = EncoderCache(10)
    assert not cache.can_allocate("r", 0, 6, compute_budget=5)  # over the step's budget
    assert cache.can_allocate("r", 0, 6, compute_budget=10)
    cache.allocate("r", 0, "a", 6)
    # 4 free, but the request already has 3 scheduled beside this input of 2
    assert not cache.can_allocate("r", 1, 2, compute_budget=10, scheduled=3)
    assert cache.can_allocate("r", 1, 2, compute_budget=10, scheduled=2)


def test_can_allocate_evicts_freeable_entries_only_when_they_make_it_fit():
    cache = EncoderCache(10)
    cache.allocate("r1", 0, "a", 4)
    cache.allocate("r2", 0, "b", 4)
    cache.free_request("r1")  # a freeable; 2 free + 4 freeable
    assert not cache.can_allocate("r3", 0, 7, compute_budget=10)
    assert "a" in cache and cache.take_freed() == []
    assert cache.can_allocate("r3", 0, 6, compute_budget=10)
    assert "a" not in cache and cache.take_freed() == ["a"]
    assert cache.take_freed() == []  # reported once


def test_an_entry_evicted_and_stored_again_in_the_same_step_is_not_reported():
    cache = EncoderCache(10)
    cache.allocate("r1", 0, "a", 10)
    cache.free_request("r1")
    assert cache.can_allocate("r2", 0, 10, compute_budget=10)  # evicts a
    cache.allocate("r2", 0, "a", 10)  # a is stored again before the step's report
    assert cache.take_freed() == []


def test_lookup_pins_a_freeable_entry_again():
    cache = EncoderCache(10)
    cache.allocate("r1", 0, "a", 4)
    cache.free_input("r1", 0)
    assert cache.freeable == {"a": 4}
    assert cache.lookup("r2", 3, "a") and cache.freeable == {} and cache.refs["a"] == {"r2"}
    assert not cache.lookup("r2", 4, "b")
    assert cache.cached_inputs("r2") == (3,)


def test_a_request_holds_an_item_it_repeats_until_its_last_input_of_it_is_freed():
    cache = EncoderCache(10)
    cache.allocate("r", 0, "a", 4)
    assert cache.lookup("r", 2, "a")  # a later turn shows a again
    cache.free_input("r", 0)
    assert cache.refs["a"] == {"r"} and cache.freeable == {}
    cache.free_input("r", 2)
    assert cache.refs["a"] == set() and cache.freeable == {"a": 4}
    assert cache.cached_inputs("r") == ()
