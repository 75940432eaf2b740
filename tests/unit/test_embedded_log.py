"""The embedded broker's kept log: frames read back as written, a torn last frame (a kill
in the middle of a write) is cut off, and the cluster file names the broker."""

from __future__ import annotations

import pytest

from stream.kafka.embedded_log import EmbeddedLog, LogRecord, encode_frame, is_log_entry, read_frames

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


def test_a_corrupt_frame_ends_the_file():
    frames = [encode_frame(r) for r in RECORDS]
    broken = bytearray(frames[1])
    broken[-1] ^= 0xFF
    assert read_frames(frames[0] + bytes(broken) + frames[2])[0] == RECORDS[:1]


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
