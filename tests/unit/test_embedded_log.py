"""The embedded broker's kept log: frames read back as written, a torn last frame (a kill
in the middle of a write) is cut off, and the cluster file names the broker."""

from __future__ import annotations

import pytest

from stream.core.lru import Entry
from stream.kafka.embedded_log import (
    CorruptLog,
    EmbeddedLog,
    LogRecord,
    applied_prefix,
    encode_frame,
    is_log_entry,
    read_frames,
    scan,
)
from stream.kafka.log_cleaner import Retention, compact
from stream.state.store import APPLIED_KEY, admit_changelog, applied_at, encode_applied, encode_entry

RECORDS = [
    LogRecord(0, 1_700_000_000_000, 0, b"ns/pod-a", b'{"v":1}', (("mmcache.reason", b"x"),)),
    LogRecord(1, 1_700_000_000_001, 0, None, b"", ()),
    LogRecord(2, 1_700_000_000_002, 1, b"", None, (("h", None), ("h2", b"\x00\xff"))),
]


def test_frames_read_back_as_written():
    data = b"".join(encode_frame(r) for r in RECORDS)
    assert read_frames(data) == (RECORDS, len(data))


@pytest.mark.parametrize("cut", [1, 4, 8, 12, 20])
def test_a_torn_last_frame_is_left_out(cut):
    whole = b"".join(encode_frame(r) for r in RECORDS[:2])
    last = encode_frame(RECORDS[2])
    assert read_frames(whole + last[:-cut]) == (RECORDS[:2], len(whole))


def _damaged(where: str) -> bytes:
    """The three records with the second one damaged: in its body (a wrong CRC) or in its
    length (the reader loses its place)."""
    frames = [encode_frame(r) for r in RECORDS]
    broken = bytearray(frames[1])
    broken[-1 if where == "body" else 3] ^= 0xFF
    return frames[0] + bytes(broken) + frames[2]


@pytest.mark.parametrize("where", ["body", "length"])
def test_a_damaged_frame_with_whole_frames_after_it_is_refused_not_cut(where):
    data = _damaged(where)
    at = len(encode_frame(RECORDS[0]))
    with pytest.raises(CorruptLog) as refused:
        read_frames(data)
    assert (refused.value.at, refused.value.following, refused.value.next_offset) == (
        at, at + len(encode_frame(RECORDS[1])), 2)
    with pytest.raises(CorruptLog):
        scan(data)


@pytest.mark.parametrize("where", ["body", "length"])
def test_a_damaged_last_frame_is_a_torn_tail_and_left_out(where):
    frames = [encode_frame(r) for r in RECORDS]
    broken = bytearray(frames[2])
    broken[-1 if where == "body" else 3] ^= 0xFF
    assert read_frames(frames[0] + frames[1] + bytes(broken)) == (RECORDS[:2], len(frames[0] + frames[1]))


@pytest.mark.parametrize("zeros", [1, 8, 29, 33, 4096])
def test_a_tail_of_zeros_is_a_torn_tail_and_left_out(zeros):
    """A filesystem after a crash often leaves zeros where a write was under way: eight zero
    bytes read as a frame of length 0 whose CRC (of nothing) is 0; they are no record."""
    whole = b"".join(encode_frame(r) for r in RECORDS)
    assert read_frames(whole + bytes(zeros)) == (RECORDS, len(whole))
    frames, length = scan(whole + bytes(zeros))
    assert (len(frames), length) == (3, len(whole))


def test_a_zeroed_block_with_whole_frames_after_it_is_refused():
    frames = [encode_frame(r) for r in RECORDS]
    data = frames[0] + bytes(4096) + frames[1] + frames[2]
    with pytest.raises(CorruptLog) as refused:
        read_frames(data)
    assert (refused.value.at, refused.value.following, refused.value.next_offset) == (
        len(frames[0]), len(frames[0]) + 4096, 1)


def test_a_long_tail_of_zeros_is_passed_over_a_run_at_a_time():
    """64 MiB of zeros after the last record (a preallocated or zero-filled file) is cut
    without trying every byte as a frame's start."""
    whole = b"".join(encode_frame(r) for r in RECORDS)
    assert read_frames(whole + bytes(64 * 2**20))[1] == len(whole)


def _one_partition(tmp_path, topic: str = "app-events") -> EmbeddedLog:
    files = EmbeddedLog(tmp_path / "log")
    files.create("mmcache-embedded-tansu-0123456789abcdef")
    files.record_topics({topic: (1, {"cleanup.policy": "delete"})})
    return files


def test_opening_a_damaged_file_for_append_refuses_naming_file_byte_and_what_to_do(tmp_path):
    files = _one_partition(tmp_path)
    path = files.partition_path("app-events", 0)
    path.write_bytes(_damaged("body"))
    before = path.read_bytes()
    for read in (lambda: files.open_for_append("app-events", 0), lambda: files.records("app-events", 0)):
        with pytest.raises(CorruptLog) as refused:
            read()
        message = str(refused.value)
        at = len(encode_frame(RECORDS[0]))
        assert str(path) in message and f"byte {at}" in message and f"truncate -s {at} {path}" in message
        assert "\n" not in message
        assert path.read_bytes() == before  # nothing cut


def test_compaction_refuses_a_damaged_file_and_rewrites_nothing(tmp_path):
    files = EmbeddedLog(tmp_path / "log")
    files.create("mmcache-embedded-tansu-0123456789abcdef")
    files.record_topics({"app-events": (1, {}), "app-lru-changelog": (1, {})},
                        changelogs={"app-lru-changelog": "app-events"})
    path = files.partition_path("app-events", 0)
    path.write_bytes(_damaged("body"))
    before = {p: p.read_bytes() for p in (tmp_path / "log").rglob("*.log")}
    with pytest.raises(CorruptLog, match=str(path)):
        compact(files, applied_at, admit_changelog, lambda partition: -1, Retention(1, 1), 2**62)
    assert {p: p.read_bytes() for p in (tmp_path / "log").rglob("*.log")} == before
    assert not list((tmp_path / "log").rglob("*.compacting"))


def test_opening_for_append_cuts_a_torn_tail_and_resumes_at_the_next_offset(tmp_path):
    files = EmbeddedLog(tmp_path / "log")
    files.create("mmcache-embedded-tansu-0123456789abcdef")
    files.record_topics({"app-events": (2, {"cleanup.policy": "delete"})})
    path = files.partition_path("app-events", 1)
    path.write_bytes(encode_frame(RECORDS[0]) + encode_frame(RECORDS[1])[:-3])
    handle, next_offset = files.open_for_append("app-events", 1)
    try:
        assert next_offset == 1
        handle.write(encode_frame(RECORDS[1]))
    finally:
        handle.close()
    assert files.records("app-events", 1) == RECORDS[:2]
    assert files.records("app-events", 0) == []
    assert files.cluster_id() == "mmcache-embedded-tansu-0123456789abcdef"
    assert files.topics() == {"app-events": {"partitions": 2,
                                             "config": {"cleanup.policy": "delete"}}}


def test_only_the_journals_own_names_are_recognised():
    assert is_log_entry(0, "cluster.json", False)
    assert is_log_entry(0, "app-events", True)
    assert is_log_entry(1, "0.log", False)
    assert not is_log_entry(0, "notes.txt", False)
    assert not is_log_entry(1, "0.log", True)
    assert not is_log_entry(1, "notes.txt", False)
    assert not is_log_entry(2, "0.log", False)


def _changelog(*applied: int) -> list[LogRecord]:
    """A changelog partition: per batch one entry record, then its applied-offset record."""
    records: list[LogRecord] = []
    for offset in applied:
        entry = encode_entry(Entry("ns/e", "h", 1, offset, 0))  # ranked by its event
        for key, value in ((b"\x01entry", entry), (APPLIED_KEY, encode_applied(offset))):
            records.append(LogRecord(len(records), 0, 0, key, value))
    return records


@pytest.mark.parametrize("end,keep", [(10, 6), (6, 6), (5, 4), (4, 4), (3, 2), (2, 2), (1, 0), (0, 0)])
def test_a_changelog_is_kept_up_to_its_last_applied_record_the_event_log_holds(end, keep):
    """Applied offsets 1, 3, 5: an event log ending below an applied offset cuts the
    changelog before that batch (its entries may be of events the kept log lost)."""
    assert applied_prefix(_changelog(1, 3, 5), end, applied_at) == keep


def test_an_unfinished_batch_after_the_last_applied_record_is_cut():
    records = _changelog(1, 3) + [LogRecord(4, 0, 0, b"\x01entry", b"e")]
    assert applied_prefix(records, 10, applied_at) == 4


def test_after_a_kill_the_changelog_is_cut_where_the_kept_events_end(tmp_path):
    files = EmbeddedLog(tmp_path / "log")
    files.create("mmcache-embedded-tansu-0123456789abcdef")
    files.record_topics({"app-events": (1, {}), "app-lru-changelog": (1, {})},
                        changelogs={"app-lru-changelog": "app-events"})
    events = [LogRecord(i, 0, 0, b"k", b"v") for i in range(4)]  # offsets 0..3 kept
    files.partition_path("app-events", 0).write_bytes(b"".join(map(encode_frame, events)))
    changelog = _changelog(1, 3, 5)  # event 5's batch reached the journal, event 5 did not
    files.partition_path("app-lru-changelog", 0).write_bytes(b"".join(map(encode_frame, changelog)))
    keep_all = Retention(ms=-1, bytes=-1)
    plans = compact(files, applied_at, admit_changelog, lambda partition: -1, keep_all, 0, killed=True)
    # cut after applied offset 3 (event 5 is not kept), then compacted (one entry key)
    assert files.records("app-lru-changelog", 0) == changelog[2:4]
    assert [f.offset for f in plans[("app-lru-changelog", 0)]] == [2, 3]
    assert files.records("app-events", 0) == events
    compact(files, applied_at, admit_changelog, lambda partition: -1, keep_all, 0, killed=True)
    assert files.records("app-lru-changelog", 0) == changelog[2:4]
