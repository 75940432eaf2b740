"""Compaction and retention of the embedded broker's kept log (stream.kafka.log_cleaner):
the changelog keeps what a reader needs to reach the same table, the event topic keeps
its retention window and every unapplied event, every partition keeps its end offset,
and a rewrite a kill interrupted leaves the old file whole."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.core.lru import Entry
from stream.kafka.embedded_log import (
    COMPACTING_SUFFIX,
    CorruptLog,
    EmbeddedLog,
    LogRecord,
    encode_frame,
    scan,
)
from stream.kafka.log_cleaner import (
    Retention,
    compact,
    compact_changelog,
    plan_events,
    relocate,
    rewrite,
)
from stream.state.store import (
    APPLIED_KEY,
    ChangelogGate,
    admit_changelog,
    applied_at,
    encode_applied,
    encode_entry,
    entry_key,
)

CLUSTER = "mmcache-embedded-tansu-0123456789abcdef"
KEY = entry_key("ns/e", "h")


def _entry(event: int, index: int) -> bytes:
    """An LRU entry's value, ranked by the event that wrote it."""
    return encode_entry(Entry("ns/e", "h", 1, event, index))


def _file(records: list[LogRecord]) -> bytes:
    return b"".join(encode_frame(r) for r in records)


def _table(records, start=None):
    """The key -> value map a reader reaches by applying ``records`` to ``start``."""
    table = dict(start or {})
    for record in records:
        if record.value is None:
            table.pop(record.key, None)
        else:
            table[record.key] = record.value
    return table


# a changelog: keys from a small set, a value or a tombstone, offsets with gaps
changelogs = st.lists(st.tuples(st.sampled_from([b"a", b"b", b"c", b"d"]),
                                st.one_of(st.none(), st.binary(min_size=1, max_size=3)),
                                st.integers(1, 3)),
                      min_size=1, max_size=40)


def _records(spec) -> list[LogRecord]:
    records, offset = [], 0
    for key, value, gap in spec:
        offset += gap
        records.append(LogRecord(offset, 1_700_000_000_000 + offset, 0, key, value))
    return records


@settings(max_examples=300, deadline=None)
@given(changelogs, st.data())
def test_a_table_file_at_any_offset_reaches_the_same_table_from_the_compacted_changelog(spec, data):
    records = _records(spec)
    data_bytes = _file(records)
    frames, length = scan(data_bytes)
    assert length == len(data_bytes) and [f.offset for f in frames] == [r.offset for r in records]
    # the table file holds the changelog up to some offset (or nothing: no file)
    held = data.draw(st.sampled_from([-1] + [r.offset for r in records]))
    file_table = _table([r for r in records if r.offset <= held])
    kept = {f.offset for f in compact_changelog(frames, held)}
    compacted = [r for r in records if r.offset in kept]
    after = [r for r in compacted if r.offset > held]
    assert _table(after, file_table) == _table(records)
    assert records[-1].offset in kept  # the end offset survives
    # and from no file at all (all tombstones may go): the same table
    from_nothing = {f.offset for f in compact_changelog(frames, 2**62)}
    assert _table([r for r in records if r.offset in from_nothing]) == _table(records)


def test_compaction_keeps_the_latest_record_of_each_key_and_the_tombstones_a_file_may_need():
    records = _records([(b"a", b"1", 1), (b"b", b"1", 1), (b"a", b"2", 1), (b"b", None, 1),
                        (b"c", b"1", 1), (b"c", None, 1), (b"d", b"1", 1)])
    frames, _ = scan(_file(records))
    # a file holding offset 4 (b's tombstone at 4 is in it; c's at 6 is not)
    assert [f.offset for f in compact_changelog(frames, 4)] == [3, 6, 7]
    # no file: no tombstone is needed
    assert [f.offset for f in compact_changelog(frames, 2**62)] == [3, 7]
    # a file that cannot be read: every latest tombstone is kept
    assert [f.offset for f in compact_changelog(frames, -1)] == [3, 4, 6, 7]


def test_the_last_record_of_a_partition_is_kept_even_a_dropped_tombstone():
    records = _records([(b"a", b"1", 1), (b"a", None, 1)])
    frames, _ = scan(_file(records))
    assert [f.offset for f in compact_changelog(frames, 2**62)] == [2]


def _events(count: int, step_ms: int = 1000, size: int = 10) -> list[LogRecord]:
    return [LogRecord(i, 1_000_000 + i * step_ms, 0, b"k", b"x" * size) for i in range(count)]


def test_retention_by_age_keeps_the_young_events_and_every_unapplied_one():
    frames, _ = scan(_file(_events(10)))
    now = 1_000_000 + 9 * 1000
    young = plan_events(frames, Retention(ms=3500, bytes=-1), now, applied=9)
    assert [f.offset for f in young.kept] == [6, 7, 8, 9] and young.dropped == 6
    # events the state has not applied are kept whatever their age
    unapplied = plan_events(frames, Retention(ms=3500, bytes=-1), now, applied=2)
    assert [f.offset for f in unapplied.kept] == list(range(3, 10))
    # the broker gets only what is not applied yet, and the last event (its end offset)
    assert [f.offset for f in young.to_broker] == [9]
    assert [f.offset for f in unapplied.to_broker] == list(range(3, 10))


def test_retention_by_bytes_keeps_the_newest_frames_within_the_bound():
    frames, _ = scan(_file(_events(10)))
    size = frames[0].end - frames[0].start
    plan = plan_events(frames, Retention(ms=-1, bytes=3 * size), 0, applied=9)
    assert [f.offset for f in plan.kept] == [7, 8, 9]
    # a bound smaller than one frame still keeps the last one
    assert [f.offset for f in plan_events(frames, Retention(ms=-1, bytes=1), 0, 9).kept] == [9]


def test_keeping_everything_drops_nothing_and_dead_letters_go_to_the_broker_whole():
    frames, _ = scan(_file(_events(5)))
    everything = plan_events(frames, Retention(ms=-1, bytes=-1), 10**15, applied=None)
    assert everything.dropped == 0 and everything.to_broker == frames


@pytest.mark.parametrize("bad", [0, -2])
def test_a_retention_of_zero_or_below_minus_one_is_refused(bad):
    with pytest.raises(ValueError, match="-1"):
        Retention(ms=bad, bytes=-1)


def test_a_rewrite_keeps_the_frames_whole_where_relocate_says(tmp_path):
    records = _records([(b"a", b"1", 1), (b"a", b"2", 1), (b"b", b"1", 5)])
    path = tmp_path / "0.log"
    data = _file(records)
    path.write_bytes(data)
    frames, _ = scan(data)
    kept = compact_changelog(frames, 2**62)
    rewrite(path, data, kept)
    again, _ = scan(path.read_bytes())
    assert [(f.offset, f.key) for f in again] == [(2, b"a"), (7, b"b")]
    assert [(f.start, f.end) for f in relocate(kept, kept)] == [(f.start, f.end) for f in again]
    assert not path.with_name("0.log" + COMPACTING_SUFFIX).exists()


def _kept_log(tmp_path, changelog: list[LogRecord], events: list[LogRecord]) -> EmbeddedLog:
    files = EmbeddedLog(tmp_path / "log")
    files.create(CLUSTER)
    files.record_topics({"app-events": (1, {})})
    files.record_topics({"app-changelog": (1, {})}, changelogs={"app-changelog": "app-events"})
    files.partition_path("app-changelog", 0).write_bytes(_file(changelog))
    files.partition_path("app-events", 0).write_bytes(_file(events))
    return files


def test_compacting_the_kept_log_gives_the_broker_the_checkpoint_and_the_unapplied_events(tmp_path):
    events = _events(6)
    changelog = [LogRecord(0, 1, 0, KEY, _entry(1, 0)), LogRecord(1, 1, 0, APPLIED_KEY, encode_applied(1)),
                 LogRecord(2, 1, 0, KEY, _entry(3, 0)), LogRecord(3, 1, 0, APPLIED_KEY, encode_applied(3))]
    files = _kept_log(tmp_path, changelog, events)
    plans = compact(files, applied_at, admit_changelog, lambda partition: 2**62, Retention(ms=-1, bytes=-1),
                    10**15)
    assert [f.offset for f in plans[("app-changelog", 0)]] == [2, 3]
    assert [f.offset for f in plans[("app-events", 0)]] == [4, 5]  # after the applied offset 3
    assert [r.offset for r in files.records("app-changelog", 0)] == [2, 3]  # rewritten on disk
    assert [r.offset for r in files.records("app-events", 0)] == list(range(6))  # within retention
    # the planned positions are those of the rewritten files
    assert [files.records("app-changelog", 0)[i].value for i in range(2)] == [_entry(3, 0), encode_applied(3)]


def test_a_rewrite_a_kill_interrupted_is_removed_and_the_old_file_is_whole(tmp_path):
    events = _events(3)
    changelog = [LogRecord(0, 1, 0, KEY, _entry(1, 0)), LogRecord(1, 1, 0, KEY, _entry(2, 0)),
                 LogRecord(2, 1, 0, APPLIED_KEY, encode_applied(2))]
    files = _kept_log(tmp_path, changelog, events)
    path = files.partition_path("app-changelog", 0)
    torn = path.with_name(path.name + COMPACTING_SUFFIX)
    torn.write_bytes(_file(changelog[1:])[:-5])  # killed while writing the new file
    plans = compact(files, applied_at, admit_changelog, lambda partition: 2**62,
                    Retention(ms=-1, bytes=-1), 10**15)
    assert not torn.exists()
    assert [f.offset for f in plans[("app-changelog", 0)]] == [1, 2]
    assert [r.value for r in files.records("app-changelog", 0)] == [_entry(2, 0), encode_applied(2)]


def _gated_table(records: list[LogRecord]) -> dict:
    """What every reader of the changelog reaches: the records the gate admits, applied."""
    admitted = ChangelogGate().admit((r.key, r.value, r) for r in records)
    return _table(admitted)


def test_a_batch_written_again_after_later_ones_is_not_what_compaction_keeps():
    """A resent batch (a producer's retry, a zombie owner) is dropped by every reader
    (ChangelogGate); compaction must not make it a key's latest record."""
    k3 = entry_key("ns/e", "k3")
    other = entry_key("ns/e", "k")
    records = [
        LogRecord(8, 1, 0, other, _entry(4, 0)), LogRecord(9, 1, 0, APPLIED_KEY, encode_applied(4)),
        LogRecord(10, 1, 0, k3, None), LogRecord(11, 1, 0, APPLIED_KEY, encode_applied(5)),
        LogRecord(12, 1, 0, k3, _entry(6, 0)), LogRecord(13, 1, 0, APPLIED_KEY, encode_applied(6)),
        LogRecord(14, 1, 0, k3, None), LogRecord(15, 1, 0, APPLIED_KEY, encode_applied(5)),  # resent
        LogRecord(16, 1, 0, other, _entry(7, 0)), LogRecord(17, 1, 0, APPLIED_KEY, encode_applied(7)),
    ]
    frames, _ = scan(_file(records), lambda key: True)
    kept = {f.offset for f in compact_changelog(frames, 2**62, admit_changelog)}
    compacted = [r for r in records if r.offset in kept]
    assert _gated_table(compacted) == _gated_table(records)
    assert k3 in _gated_table(compacted)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([b"k1", b"k2", b"k3"]), st.booleans(), st.integers(0, 2)),
                min_size=1, max_size=12))
def test_compaction_keeps_what_the_gate_admits_whatever_is_written_again(batches):
    """Batches of events, some written again later (the gate drops them): a reader of the
    compacted changelog reaches the table a reader of the whole one reaches."""
    records, offset, event = [], 0, 0
    written: list[list[LogRecord]] = []
    for key, removes, again in batches:
        if again and written:  # a batch of an earlier event, written again
            batch = written[-1 - min(again, len(written)) + 1]
        else:
            event += 1
            hashed = entry_key("ns/e", key.decode())
            batch = [LogRecord(0, 1, 0, hashed, None if removes else _entry(event, 0)),
                     LogRecord(0, 1, 0, APPLIED_KEY, encode_applied(event))]
            written.append(batch)
        for record in batch:
            records.append(LogRecord(offset, 1, 0, record.key, record.value))
            offset += 1
    frames, _ = scan(_file(records), lambda key: True)
    for through in (-1, 2**62):
        kept = {f.offset for f in compact_changelog(frames, through, admit_changelog)}
        assert _gated_table([r for r in records if r.offset in kept]) == _gated_table(records)


def test_a_damaged_partition_refuses_the_compaction_before_any_file_is_rewritten(tmp_path):
    """CorruptLog says "nothing was changed": so a damaged file of a later partition must
    stop the compaction before an earlier partition (with a torn tail to cut, superseded
    changelog records and events past the retention) is rewritten."""
    files = EmbeddedLog(tmp_path / "log")
    files.create(CLUSTER)
    files.record_topics({"app-events": (2, {}), "app-dead-letters": (2, {})})
    files.record_topics({"app-changelog": (2, {})}, changelogs={"app-changelog": "app-events"})
    changelog = [LogRecord(0, 1, 0, KEY, _entry(1, 0)), LogRecord(1, 1, 0, APPLIED_KEY, encode_applied(1)),
                 LogRecord(2, 1, 0, KEY, _entry(3, 0)), LogRecord(3, 1, 0, APPLIED_KEY, encode_applied(3))]
    whole = _file(changelog)
    for partition in range(2):
        files.partition_path("app-events", partition).write_bytes(_file(_events(6)) + b"\x00\x00\x01")
        files.partition_path("app-dead-letters", partition).write_bytes(_file(_events(3)) + b"\x07")
    files.partition_path("app-changelog", 0).write_bytes(whole + b"\x00\x00\x00\x09torn")
    damaged = bytearray(whole)
    damaged[len(encode_frame(changelog[0])) + 20] ^= 0xFF  # the second record, whole ones after it
    files.partition_path("app-changelog", 1).write_bytes(bytes(damaged))
    before = {path: path.read_bytes() for path in files.root.glob("*/*.log")}
    assert len(before) == 6

    with pytest.raises(CorruptLog, match="nothing was changed"):
        compact(files, applied_at, admit_changelog, lambda partition: 2**62, Retention(ms=-1, bytes=1),
                10**15, killed=True)
    assert {path: path.read_bytes() for path in files.root.glob("*/*.log")} == before
    assert not list(files.root.glob(f"*/*{COMPACTING_SUFFIX}"))
