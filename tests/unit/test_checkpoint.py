"""`rebuild` from what is kept: the checkpoint a (compacted) changelog holds, plus the
events after it, is the live state for any log; and the rules for when the checkpoint is
used, or the rebuild refused, are the documented ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.core.cache import CacheState, Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.items import Item
from stream.state.checkpoint import CheckpointReader
from stream.state.rebuild import Extent, NotRebuildable, Until, refuse_over_capacity, resume_points
from stream.state.store import (
    APPLIED_KEY,
    applied_at,
    effect_records,
    encode_applied,
    load_partition,
)
from tests.unit.test_engine_views import CAPACITY, assert_same, mixed_logs


def compacted(records: list[tuple[bytes, bytes | None]],
              keep_tombstones: bool) -> list[tuple[bytes, bytes | None]]:
    """Kafka's compaction of a log: the latest record of each key, in log order (a
    tombstone is kept for a while, then dropped too)."""
    last = {key: at for at, (key, _) in enumerate(records)}
    return [(key, value) for at, (key, value) in enumerate(records)
            if last[key] == at and (value is not None or keep_tombstones)]


@st.composite
def kept_logs(draw):
    """A log, its live state, and per partition what is kept of it: the changelog as the
    live worker writes it (each event's records, its applied offset last:
    ``TableMirror.write``) up to any record (what follows the last applied record is an
    event written in part), compacted from its start up to any point (Kafka's cleaner
    stops where the active segment begins, wherever that is); and the events from some
    offset on, the checkpoint's applied offset reaching them."""
    partitions, log = draw(mixed_logs())
    # the kept event log may have lost its last events (a kill between the broker's
    # acknowledgement and the journal's write) while the changelog holds their records:
    # the live state to rebuild is then that of the events it holds
    ends = {p: draw(st.integers(0, sum(1 for q, _ in log if q.partition == p)))
            for p in range(partitions)}
    ahead = CacheState(CAPACITY, 3)
    state = CacheState(CAPACITY, 3)
    written: dict[int, list[tuple[bytes, bytes | None]]] = {p: [] for p in range(partitions)}
    of_event: dict[int, list[int]] = {p: [] for p in range(partitions)}  # each record's event
    held = {p: 0 for p in range(partitions)}
    for position, event in log:
        records = list(effect_records(ahead.fold.apply(event, position), position.offset))
        written[position.partition] += records
        of_event[position.partition] += [position.offset] * len(records)
        held[position.partition] += 1
        if held[position.partition] <= ends[position.partition]:
            state.fold.apply(event, position)
    kept = {}
    for partition, records in written.items():
        events = [(position, event) for position, event in log
                  if position.partition == partition][:ends[partition]]
        records = records[:draw(st.integers(0, len(records)))]  # the changelog's end
        end = events[-1][0].offset + 1 if events else 0
        checkpoint = max((applied_at(k, v) for k, v in records if k == APPLIED_KEY
                          and applied_at(k, v) < end), default=-1)
        # how far the cleaner has gone: not past the records of lost events (the kept log
        # holds a changelog record only once it holds the events before it, and is cut
        # after its last applied record whose event it holds before it is compacted)
        reach = sum(1 for offset in of_event[partition][:len(records)] if offset < end)
        cleaned = draw(st.integers(0, reach))
        changelog = compacted(records[:cleaned], draw(st.booleans())) + records[cleaned:]
        first = draw(st.integers(0, checkpoint + 1))  # the first kept event's offset
        suffix = [(p, e) for p, e in events if p.offset >= first]
        kept[partition] = (changelog, suffix, end, checkpoint)
    return state, kept


@settings(max_examples=500, deadline=None)
@given(kept_logs(), st.data())
def test_the_checkpoint_plus_the_events_after_it_is_the_live_state(drawn, data):
    live, kept = drawn
    rebuilt = CacheState(CAPACITY, 3)
    for partition, (changelog, suffix, end, checkpoint) in kept.items():
        reader = CheckpointReader(end)
        fed = [SimpleNamespace(key=k, value=v) for k, v in changelog]
        cuts = sorted(data.draw(st.lists(st.integers(0, len(fed)), max_size=3)))
        for start, stop in zip([0, *cuts], [*cuts, len(fed)], strict=True):
            reader.feed(fed[start:stop])  # in fetches
        assert reader.applied == (None if checkpoint < 0 else checkpoint)
        load_partition(rebuilt, partition, reader.records())
        for position, event in suffix:
            if position.offset > checkpoint:
                rebuilt.fold.apply(event, position)
    assert_same(rebuilt, live)


def test_an_applied_record_past_the_events_ends_the_checkpoint():
    """Records of events the log does not hold (the kept log lost them in a kill) are not
    part of the checkpoint, nor is anything after them."""
    def applied(offset):
        return SimpleNamespace(key=APPLIED_KEY, value=encode_applied(offset))

    entry = SimpleNamespace(key=b"\x01ns/a\x00h", value=(0).to_bytes(8, "big") + bytes(8))
    reader = CheckpointReader(end=5)
    reader.feed([entry, applied(3), entry])
    assert reader.applied == 3 and not reader.finished
    reader.feed([applied(7)])
    assert reader.finished
    reader.feed([applied(4)])  # after the one past the end: not read
    assert reader.applied == 3
    assert [k for k, _ in reader.records()] == [entry.key, APPLIED_KEY]


# -- when the checkpoint is used, and when the rebuild is refused --------------------------


CHANGELOG, TOPIC = "app-lru-changelog", "app-events"


def plan(extents, applied, until=None, forced=False, kept_times=None):
    return resume_points(extents, applied, until or Until(), forced, CHANGELOG, TOPIC, kept_times)


def test_a_whole_topic_is_replayed_from_its_first_event_whatever_the_changelog_holds():
    extents = {0: Extent(0, 10), 1: Extent(0, 0)}
    assert plan(extents, {0: 9}) == {0: 0, 1: 0}


def test_a_trimmed_partition_starts_after_its_checkpoint_the_others_at_their_first():
    extents = {0: Extent(1000, 1010), 1: Extent(0, 7), 2: Extent(50, 50)}
    assert plan(extents, {0: 999, 1: 3, 2: 60 - 11}) == {0: 1000, 1: 0, 2: 50}
    assert plan(extents, {0: 1004, 1: 3, 2: 49}) == {0: 1005, 1: 0, 2: 50}


def test_from_checkpoint_starts_every_partition_with_a_checkpoint_from_it():
    extents = {0: Extent(0, 10), 1: Extent(0, 5), 2: Extent(0, 3)}
    assert plan(extents, {0: 6, 1: 4}, forced=True) == {0: 7, 1: 5, 2: 0}
    # one whose checkpoint lies past --until is replayed whole instead
    assert plan(extents, {0: 6, 1: 4}, Until(offset=5), forced=True) == {0: 0, 1: 5, 2: 0}


def test_a_trimmed_partition_without_a_checkpoint_is_refused_naming_the_flag():
    with pytest.raises(NotRebuildable, match=r"partition 0 of app-events starts at offset 1000 "
                       r"\(older events were trimmed\) and app-lru-changelog holds no "
                       r"checkpoint of it: .*--checkpoint-topic"):
        plan({0: Extent(1000, 1010)}, {})


def test_a_checkpoint_that_does_not_reach_the_kept_events_is_refused_naming_the_lost_ones():
    with pytest.raises(NotRebuildable, match=r"after offset 900: events 901..999 are gone"):
        plan({0: Extent(1000, 1010)}, {0: 900})


def test_an_until_offset_before_the_checkpoint_is_refused_naming_the_oldest_point():
    extents = {0: Extent(1000, 1010), 1: Extent(20, 30), 2: Extent(0, 30)}
    with pytest.raises(NotRebuildable, match=r"--until 1001 lies before the checkpoint of "
                       r"partition 0 .* the oldest point rebuildable from what is kept is "
                       r"--until 1003$"):
        plan(extents, {0: 1003, 1: 25, 2: 29}, Until(offset=1001))
    assert plan(extents, {0: 1003, 1: 25, 2: 29}, Until(offset=1003)) == {0: 1004, 1: 26, 2: 0}


def test_an_until_time_before_a_kept_event_under_the_checkpoint_is_refused_naming_the_oldest():
    extents = {0: Extent(1000, 1010), 1: Extent(20, 30)}
    applied = {0: 1003, 1: 19}  # partition 1's checkpoint lies before its first kept event
    times = {0: 1_700_000_000_500}
    with pytest.raises(NotRebuildable, match=r"--until 2023-11-14T22:13:20.499\+00:00 .* "
                       r"--until 2023-11-14T22:13:20.500\+00:00$"):
        plan(extents, applied, Until(timestamp_ms=1_700_000_000_499), kept_times=times)
    assert plan(extents, applied, Until(timestamp_ms=1_700_000_000_500),
                kept_times=times) == {0: 1004, 1: 20}


def test_a_checkpoint_made_at_a_larger_capacity_is_refused_naming_it():
    state = CacheState(Capacity("items", 4))
    effects = state.fold.apply(ItemsPlaced(endpoint="ns/a", items=[Item(f"h{i}", 1, "image")
                                                                   for i in range(4)]), Position(0, 0))
    reader = CheckpointReader(end=1)
    reader.feed(SimpleNamespace(key=k, value=v) for k, v in effect_records(effects, 0))
    refuse_over_capacity(reader, Capacity("items", 4), CHANGELOG)
    with pytest.raises(NotRebuildable, match=r"holds 4 items for endpoint 'ns/a', over the "
                       r"capacity given \(3\): rebuild with the capacity of the service"):
        refuse_over_capacity(reader, Capacity("items", 3), CHANGELOG)
    with pytest.raises(NotRebuildable, match=r"holds 4 size .* over the capacity given \(3\)"):
        refuse_over_capacity(reader, Capacity("size", 3), CHANGELOG)
