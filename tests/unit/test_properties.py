"""Laws of the fold that must hold for any event log.

A log is generated the way the service writes it: every event about an endpoint is
keyed by that endpoint, so it lands in the endpoint's partition (a fixed function of
its name); a sync is written once to every partition. Offsets increase within a
partition, possibly with gaps.
"""

from __future__ import annotations

import random
from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from stream.core.cache import CacheState, Capacity, Effects, Entry
from stream.core.codec import decode_event, encode_event
from stream.core.events import EndpointDeleted, EndpointsSynced, ItemsPlaced, Position
from stream.core.holders import TUPLE_MAX
from stream.core.items import Item
from tests.unit.eventlogs import EventLogs, Scenario, fold, view

SETTINGS = settings(max_examples=200, deadline=None)

ENDPOINTS = [f"ns/pod-{i}" for i in range(5)]
HASHES = [f"h{i}" for i in range(6)]


LOGS = EventLogs(ENDPOINTS, HASHES)
scenarios = LOGS.scenarios
partition_of = LOGS.partition_of


def restore_copy(state: CacheState) -> CacheState:
    groups: dict[int, list[Entry]] = defaultdict(list)
    for partition, entry in state.loading.entries():
        groups[partition].append(entry)
    copy = CacheState(state.lrus.capacity)
    for partition in sorted(set(groups) | set(state.lrus.applied)):
        copy.loading.restore(partition, state.lrus.applied.get(partition), groups[partition])
    return copy


# (a) determinism ------------------------------------------------------------------------


@SETTINGS
@given(scenarios())
def test_replaying_the_log_twice_gives_the_same_state(scenario):
    first = fold(scenario.capacity, scenario.log)
    second = fold(scenario.capacity, scenario.log)
    assert first.digests.digest() == second.digests.digest()
    assert view(first) == view(second)
    assert first.lrus.applied == second.lrus.applied
    assert first.index.holders == second.index.holders


# (b) redelivery -------------------------------------------------------------------------


@SETTINGS
@given(scenarios(), st.data())
def test_replaying_a_suffix_changes_nothing(scenario, data):
    state = fold(scenario.capacity, scenario.log)
    digest, before, applied = state.digests.digest(), view(state), dict(state.lrus.applied)
    start = data.draw(st.integers(0, len(scenario.log)), label="start")
    for position, event in scenario.log[start:]:
        assert state.fold.apply(event, position) is None
    assert state.digests.digest() == digest
    assert view(state) == before
    assert state.lrus.applied == applied


@SETTINGS
@given(scenarios(), st.data())
def test_resuming_from_an_earlier_point_equals_one_pass(scenario, data):
    """Crash after ``stop`` records, resume from ``resume <= stop``: same as no crash."""
    stop = data.draw(st.integers(0, len(scenario.log)), label="stop")
    resume = data.draw(st.integers(0, stop), label="resume")
    state = fold(scenario.capacity, scenario.log[:stop])
    for position, event in scenario.log[resume:]:
        state.fold.apply(event, position)
    once = fold(scenario.capacity, scenario.log)
    assert state.digests.digest() == once.digests.digest()
    assert view(state) == view(once)
    assert state.lrus.applied == once.lrus.applied


# (c) partition interleaving -------------------------------------------------------------


@SETTINGS
@given(scenarios(), st.integers(0, 2**16))
def test_any_interleaving_of_partitions_gives_the_same_state(scenario, seed):
    queues = {p: list(records) for p, records in scenario.by_partition().items()}
    order = [p for p, records in queues.items() for _ in records]
    random.Random(seed).shuffle(order)
    merged = [queues[p].pop(0) for p in order]
    assert sorted(merged, key=lambda r: r[0]) == sorted(scenario.log, key=lambda r: r[0])
    original = fold(scenario.capacity, scenario.log)
    shuffled = fold(scenario.capacity, merged)
    assert shuffled.digests.digest() == original.digests.digest()
    assert view(shuffled) == view(original)
    assert shuffled.lrus.applied == original.lrus.applied


# (d) restore --------------------------------------------------------------------------------


@SETTINGS
@given(scenarios(), st.data())
def test_restore_from_entries_equals_the_state_and_continues_alike(scenario, data):
    split = data.draw(st.integers(0, len(scenario.log)), label="split")
    state = fold(scenario.capacity, scenario.log[:split])
    copy = restore_copy(state)
    assert copy.digests.digest() == state.digests.digest()
    assert view(copy) == view(state)
    assert copy.lrus.applied == state.lrus.applied
    assert copy.index.holders == state.index.holders
    for position, event in scenario.log:  # redelivers the prefix, then the rest
        a = state.fold.apply(event, position)
        b = copy.fold.apply(event, position)
        assert (a is None) == (b is None)
    assert copy.digests.digest() == state.digests.digest()
    assert view(copy) == view(state)


# (e) codec ----------------------------------------------------------------------------------

endpoint_names = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=253
)
any_items = st.lists(
    st.builds(
        Item,
        hash=st.text(min_size=1, max_size=80),
        size=st.integers(1, 2**31 - 1),
        modality=st.text(max_size=12),
    ),
    min_size=1,
    max_size=6,
)
events_st = st.one_of(
    st.builds(
        ItemsPlaced,
        endpoint=endpoint_names,
        items=any_items,
        request_id=st.one_of(st.none(), st.text(max_size=40)),
    ),
    st.builds(EndpointDeleted, endpoint=endpoint_names),
    st.builds(EndpointsSynced, live=st.lists(endpoint_names, max_size=5)),
)


@SETTINGS
@given(events_st)
def test_codec_round_trip(event):
    raw = encode_event(event)
    decoded = decode_event(raw)
    assert decoded == event
    assert type(decoded) is type(event)
    assert encode_event(decoded) == raw


@SETTINGS
@given(scenarios(max_ops=10))
def test_folding_decoded_log_equals_folding_the_log(scenario):
    decoded = [(position, decode_event(encode_event(event))) for position, event in scenario.log]
    assert (
        fold(scenario.capacity, decoded).digests.digest() == fold(scenario.capacity, scenario.log).digests.digest()
    )


# (f) effects mirror and invariants ------------------------------------------------------


def mirror_view(mirror: dict[tuple[str, str], Entry]) -> dict[str, list[tuple[str, int]]]:
    groups: dict[str, list[Entry]] = defaultdict(list)
    for entry in mirror.values():
        groups[entry.endpoint].append(entry)
    return {
        name: [(e.hash, e.size) for e in sorted(group, key=lambda e: (e.offset, e.index))]
        for name, group in groups.items()
    }


def check_invariants(state: CacheState, partitions: int) -> None:
    transpose: dict[str, set[str]] = {}
    for name, cache in state.lrus.endpoints.items():
        assert cache.entries, "an endpoint with no entries is not kept"
        assert cache.weight == sum(cache.entries.values())
        assert cache.partition == partition_of(name, partitions)
        used = len(cache.entries) if state.lrus.capacity.mode == "items" else cache.weight
        assert used <= state.lrus.capacity.per_endpoint
        for digest in cache.entries:
            transpose.setdefault(digest, set()).add(name)
    assert state.index.holders == transpose


@SETTINGS
@given(scenarios())
def test_effects_mirror_always_equals_the_state(scenario):
    state = CacheState(scenario.capacity)
    mirror: dict[tuple[str, str], Entry] = {}
    for position, event in scenario.log:
        effects = state.fold.apply(event, position)
        assert isinstance(effects, Effects)
        for entry in effects.upserts:
            assert (entry.offset, entry.endpoint) == (
                position.offset,
                getattr(event, "endpoint", None),
            )
            mirror[(entry.endpoint, entry.hash)] = entry
        for key in effects.removals:
            assert key in mirror
            del mirror[key]
        assert mirror_view(mirror) == view(state)
        check_invariants(state, scenario.partitions)
    # A store holding exactly the mirror restores to the same state.
    copy = CacheState(scenario.capacity)
    for partition in range(scenario.partitions):
        entries = [
            e for e in mirror.values() if partition_of(e.endpoint, scenario.partitions) == partition
        ]
        copy.loading.restore(partition, state.lrus.applied.get(partition), entries)
    assert copy.digests.digest() == state.digests.digest()
    assert view(copy) == view(state)


@SETTINGS
@given(scenarios(), st.lists(st.sampled_from(HASHES), unique=True, max_size=4))
def test_match_never_changes_state_and_scores_are_consistent(scenario, hashes):
    state = fold(scenario.capacity, scenario.log)
    digest = state.digests.digest()
    request = [Item(h, i + 1, "image") for i, h in enumerate(hashes)]
    results = state.index.match(request, ENDPOINTS + ["ns/unknown"])
    assert state.digests.digest() == digest
    if not request:
        assert results == []
        return
    total = sum(item.size for item in request)
    assert [r["endpoint"] for r in results] == ENDPOINTS + ["ns/unknown"]
    for result in results:
        held = state.lrus.endpoints.get(result["endpoint"])
        expected = [item for item in request if held and item.hash in held.entries]
        assert result["matched_items"] == expected
        assert result["matched_weight"] == sum(item.size for item in expected)
        assert result["total_weight"] == total
        assert result["score"] == result["matched_weight"] / total


# (g) a naive model ----------------------------------------------------------------------


def model_fold(scenario: Scenario) -> dict[str, list[tuple[str, int]]]:
    """The contract's LRU rules written as plainly as possible, over lists."""
    mode, limit = scenario.capacity
    lrus: dict[str, list[tuple[str, int]]] = {}

    def used(entries: list[tuple[str, int]]) -> int:
        return len(entries) if mode == "items" else sum(size for _, size in entries)

    for position, event in scenario.log:
        if isinstance(event, ItemsPlaced):
            entries = lrus.get(event.endpoint, [])
            for item in event.items:
                if mode == "size" and item.size > limit:
                    continue
                entries = [e for e in entries if e[0] != item.hash] + [(item.hash, item.size)]
            while used(entries) > limit:
                entries = entries[1:]
            if entries:
                lrus[event.endpoint] = entries
            else:
                lrus.pop(event.endpoint, None)
        elif isinstance(event, EndpointDeleted):
            lrus.pop(event.endpoint, None)
        elif event.live:
            for name in list(lrus):
                mine = partition_of(name, scenario.partitions) == position.partition
                if mine and name not in event.live:
                    del lrus[name]
    return lrus


@SETTINGS
@given(scenarios())
def test_fold_equals_a_naive_model_of_the_contract(scenario):
    assert view(fold(scenario.capacity, scenario.log)) == model_fold(scenario)


# (h) the digest kept per endpoint and hashed in slices --------------------------------------


def settle(state: CacheState, budget: int) -> str | None:
    """Run digest rounds of ``budget`` entries per slice until nothing is pending."""
    while state.digests.pending():
        state.digests.start_round()
        while not state.digests.refresh(budget):
            pass
    return state.digests.cached()


@SETTINGS
@given(scenarios(), st.data())
def test_digest_in_slices_between_any_events_equals_the_digest_from_scratch(scenario, data):
    """Slices of any size, and rounds begun at any point, interleaved with the fold, with
    a restore of a copy and the mirror of its effects: the cached digest always ends
    equal to ``digest()``."""
    state = CacheState(scenario.capacity)
    mirror = CacheState(scenario.capacity)
    for position, event in scenario.log:
        effects = state.fold.apply(event, position)
        for entry in effects.upserts if effects else ():  # a placement's touches, then evictions
            mirror.fold.follow(position.partition, entry.endpoint, entry.hash, entry.size)
        for name, digest in effects.removals if effects else ():
            mirror.fold.follow(position.partition, name, digest, None)
        for target in (state, mirror):
            step = data.draw(st.integers(0, 3), label="step")
            if step == 1:
                target.digests.start_round()
            elif step >= 2:
                target.digests.refresh(data.draw(st.integers(1, 5), label="budget"))
    budget = data.draw(st.integers(1, 5), label="final budget")
    assert settle(state, budget) == state.digests.digest()
    assert settle(mirror, budget) == mirror.digests.digest() == state.digests.digest()
    copy = restore_copy(state)
    assert settle(copy, budget) == state.digests.digest()


@SETTINGS
@given(scenarios(partitions=2), st.data())
def test_digest_survives_export_merge_and_partition_reloads(scenario, data):
    """The preload's path (export, from_export, merge) and a reload (drop_partition, then
    restore) keep the cached digest equal to the one from scratch, even with slices
    taken half-way."""
    parts = scenario.by_partition()
    states = [fold(scenario.capacity, parts.get(p, [])) for p in range(2)]
    for part in states:
        part.digests.start_round()
        part.digests.refresh(data.draw(st.integers(1, 5), label="budget"))
    merged = CacheState.from_export(scenario.capacity, states[0].loading.export())
    merged.digests.refresh(data.draw(st.integers(1, 5), label="budget"))
    merged.merge(states[1])
    whole = fold(scenario.capacity, scenario.log)
    assert settle(merged, 3) == whole.digests.digest()
    partition = data.draw(st.integers(0, 1), label="partition")
    entries = [e for p, e in whole.loading.entries() if p == partition]
    merged.loading.drop_partition(partition)
    assert settle(merged, 2) == merged.digests.digest()
    merged.loading.restore(partition, whole.lrus.applied.get(partition), entries)
    assert settle(merged, 4) == whole.digests.digest()


# (h) the index's compact forms ----------------------------------------------------------

CROWD = EventLogs([f"ns/pod-{i}" for i in range(24)], ["h0", "h1", "h2"])


def check_compact(state: CacheState, partitions: int) -> None:
    """Every hash's holders are in the form ``stream.core.holders`` says for their count
    (a name alone, a tuple up to ``TUPLE_MAX``, else a set), with no name twice."""
    transpose: dict[str, set[str]] = {}
    for name, cache in state.lrus.endpoints.items():
        assert cache.partition == CROWD.partition_of(name, partitions)
        for digest in cache.entries:
            transpose.setdefault(digest, set()).add(name)
    assert state.index.holders == transpose
    for held in state.lrus.holders.values():
        if type(held) is tuple:
            assert 2 <= len(held) <= TUPLE_MAX and len(set(held)) == len(held)
        else:
            assert type(held) is str or (type(held) is set and len(held) >= 2)


@st.composite
def crowded_logs(draw) -> Scenario:
    """Placements of three hashes on up to 24 endpoints of two partitions, some deletes:
    a hash is soon held by more than ``TUPLE_MAX`` endpoints, then by fewer again."""
    capacity = Capacity("items", draw(st.integers(1, 3)))
    ops = draw(st.lists(st.tuples(st.integers(0, 11), st.integers(0, 23),
                                  st.sampled_from([0, 0, 0, 1, 2])), min_size=40, max_size=150))
    offsets = [0, 0]
    log = []
    for kind, endpoint, digest in ops:
        name = CROWD.endpoints[endpoint]
        partition = CROWD.partition_of(name, 2)
        event = (EndpointDeleted(endpoint=name) if kind == 0 else
                 ItemsPlaced(endpoint=name, items=[Item(CROWD.hashes[digest], 1, "image")]))
        log.append((Position(partition, offsets[partition]), event))
        offsets[partition] += 1
    return Scenario(capacity, 2, log)


@SETTINGS
@given(crowded_logs(), st.data())
def test_crowded_hashes_keep_compact_holders_through_every_path(scenario, data):
    """Up to 24 endpoints over three hashes, so that holders cross the tuple-to-set bound
    both ways: the fold, a follower, a restore, export and merge, and LRUs swapped whole
    all keep the index the exact transpose of the LRUs, in its compact form (no name
    twice: a frozenset view would hide that)."""
    state, follower = CacheState(scenario.capacity), CacheState(scenario.capacity)
    for position, event in scenario.log:
        effects = state.fold.apply(event, position)
        for entry in effects.upserts if effects else ():
            follower.fold.follow(position.partition, entry.endpoint, entry.hash, entry.size)
        for endpoint, digest in effects.removals if effects else ():
            follower.fold.follow(position.partition, endpoint, digest, None)
        check_compact(state, 2)
    check_compact(follower, 2)
    assert follower.index.holders == state.index.holders
    copy = restore_copy(state)
    check_compact(copy, 2)
    assert copy.index.holders == state.index.holders
    halves = []
    for partition in range(2):
        half = CacheState(scenario.capacity)
        for position, event in scenario.log:
            if position.partition == partition:
                half.fold.apply(event, position)
        halves.append(half)
    merged = CacheState.from_export(scenario.capacity, halves[0].loading.export())
    merged.merge(halves[1])
    check_compact(merged, 2)
    assert merged.index.holders == state.index.holders
    # a reload swaps LRUs whole (the entries both hold are held again): each endpoint's
    # LRU swapped for another endpoint's, then back
    swapped = restore_copy(state)
    names = sorted(state.lrus.endpoints)
    for name, other in zip(names, names[1:] + names[:1], strict=True):
        swapped.loading.replace_lru(state.lrus.endpoints[name].partition, name,
                                    list(state.lrus.endpoints[other].entries.items()))
        check_compact(swapped, 2)
    for name in names:
        swapped.loading.replace_lru(state.lrus.endpoints[name].partition, name,
                                    list(state.lrus.endpoints[name].entries.items()))
    check_compact(swapped, 2)
    assert swapped.index.holders == state.index.holders
    requested = data.draw(st.lists(st.sampled_from(CROWD.endpoints), unique=True), label="requested")
    items = [Item("h0", 1, "image"), Item("h2", 2, "image"), Item("h9", 1, "image")]
    _, found = state.index.hits(items, requested)
    assert {name: [item.hash for item in held] for name, held in found.items()} == {
        name: [item.hash for item in items if name in state.index.holders.get(item.hash, ())]
        for name in requested if any(name in state.index.holders.get(item.hash, ()) for item in items)}


@SETTINGS
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 29)), max_size=200))
def test_hold_and_release_keep_the_compact_form_of_a_set(ops):
    """``stream.core.holders``' own hold and release (the engine views' index) against a
    plain set, through every form; and ``union`` of two disjoint holders."""
    from stream.core.holders import HolderSets, hold, release, union

    index: dict = {}
    model: set[str] = set()
    for adding, number in ops:
        name = f"e{number}"
        if adding:  # holding a name again changes nothing, as a set's add
            hold(index, "h", name)
            model.add(name)
        elif not adding and name in model:
            release(index, "h", name)
            model.discard(name)
        assert HolderSets(index) == ({"h": model} if model else {})
        if model:
            held = index["h"]
            assert (type(held) is str) == (len(model) == 1)
            assert type(held) is not tuple or len(held) <= TUPLE_MAX
    if model:
        other = {f"x{number}" for number in range(len(ops) % 20 + 1)}
        other_index: dict = {}
        for name in other:
            hold(other_index, "h", name)
        merged = union(index["h"], other_index["h"])
        assert HolderSets({"h": merged}) == {"h": model | other}
        assert type(merged) is (tuple if len(model | other) <= TUPLE_MAX else set)
