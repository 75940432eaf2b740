"""What a dead letter's copy carries: the record as read, or without its value when too large."""

from __future__ import annotations

from stream.kafka.dead_letters import MAX_COPIED_BYTES, DeadLetter


def test_a_letter_carries_the_record_and_where_it_came_from():
    letter = DeadLetter(3, 41, b"ns/pod", b"not json", "not_json")
    assert letter.copied_value() == b"not json"
    assert dict(letter.headers()) == {"mmcache.reason": b"not_json",
                                      "mmcache.source.partition": b"3",
                                      "mmcache.source.offset": b"41"}


def test_a_record_too_large_to_copy_goes_without_its_value_and_says_its_length():
    value = b"x" * (MAX_COPIED_BYTES + 1)
    letter = DeadLetter(0, 7, b"k", value, "bad_schema")
    assert letter.copied_value() is None
    assert dict(letter.headers())["mmcache.truncated"] == str(len(value)).encode()
