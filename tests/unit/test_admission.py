"""The one rule for records of the event topic (``stream.core.admission.fold_record``): apply,
or skip with a reason, the same for the live keeper and for ``rebuild``."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.core.admission import Applied, Rejected, fold_record
from stream.core.cache import CacheState, Capacity
from stream.core.codec import encode_event
from stream.core.events import EndpointDeleted, EndpointsSynced, ItemsPlaced, Position
from stream.core.fold import Fold
from stream.core.items import Item
from stream.core.routing import key_partition

PARTS = 4
CAPACITY = Capacity("items", 3)
NAMES = [f"ns/pod-{i}" for i in range(6)]


def home(name: str) -> int:
    return key_partition(name.encode(), PARTS)


PLACED = ItemsPlaced(endpoint="ns/pod-0", items=[Item("h", 1, "image")])
KEY = b"ns/pod-0"
OTHER = next(p for p in range(PARTS) if p != home("ns/pod-0"))

REJECTED = {
    "not-json": (KEY, b"{oops", home("ns/pod-0"), "not_json"),
    "tombstone": (KEY, None, home("ns/pod-0"), "not_json"),
    "bad-schema": (KEY, b'{"v": 1, "type": "items_placed", "endpoint": "ns/pod-0"}',
                   home("ns/pod-0"), "bad_schema"),
    "version-99": (KEY, orjson.dumps({**orjson.loads(encode_event(PLACED)), "v": 99}),
                   home("ns/pod-0"), "unknown_version"),
    "other-endpoints-key": (b"ns/pod-1", encode_event(PLACED), home("ns/pod-1"), "wrong_key"),
    "no-key": (None, encode_event(PLACED), home("ns/pod-0"), "wrong_key"),
    "wrong-partition": (KEY, encode_event(PLACED), OTHER, "wrong_partition"),
    "deletion-wrong-partition": (KEY, encode_event(EndpointDeleted(endpoint="ns/pod-0")), OTHER,
                                 "wrong_partition"),
}


@pytest.mark.parametrize(("key", "value", "partition", "reason"), REJECTED.values(),
                         ids=REJECTED.keys())
def test_a_rejected_record_changes_nothing_but_its_applied_offset(key, value, partition, reason):
    state = CacheState(CAPACITY)
    outcome = fold_record(state, partition, 5, key, value, PARTS)
    assert isinstance(outcome, Rejected)
    assert outcome.reason == reason
    assert state.lrus.endpoints == {}
    assert state.lrus.applied == {partition: 5}
    assert fold_record(state, partition, 5, key, value, PARTS) is None  # redelivered


def test_a_record_in_its_place_is_applied():
    state = CacheState(CAPACITY)
    outcome = fold_record(state, home("ns/pod-0"), 0, KEY, encode_event(PLACED), PARTS)
    assert isinstance(outcome, Applied)
    assert outcome.event == PLACED
    assert set(state.lrus.endpoints) == {"ns/pod-0"}


def test_a_sync_applies_on_any_partition_without_a_key():
    state = CacheState(CAPACITY)
    for p in range(PARTS):
        assert isinstance(fold_record(state, p, 0, None, encode_event(EndpointsSynced(live=["x"])),
                                      PARTS), Applied)


class ExplodingFold(Fold):
    def _place(self, event, position, effects):
        raise RuntimeError("boom")


def exploding_state() -> CacheState:
    state = CacheState(CAPACITY)
    state.fold = ExplodingFold(state.lrus)
    return state


def test_a_fold_that_raises_is_rejected_as_apply_failed_and_the_next_record_applies():
    state = exploding_state()
    outcome = fold_record(state, home("ns/pod-0"), 3, KEY, encode_event(PLACED), PARTS)
    assert isinstance(outcome, Rejected)
    assert outcome.reason == "apply_failed"
    assert "boom" in outcome.detail
    assert state.lrus.applied == {home("ns/pod-0"): 3}
    deleted = encode_event(EndpointDeleted(endpoint="ns/pod-0"))
    assert isinstance(fold_record(state, home("ns/pod-0"), 4, KEY, deleted, PARTS), Applied)


def _good(name: str, draw_hash: int, deleted: bool) -> tuple[bytes, bytes, int]:
    event = (EndpointDeleted(endpoint=name) if deleted
             else ItemsPlaced(endpoint=name, items=[Item(f"h{draw_hash}", 1, "image")]))
    return name.encode(), encode_event(event), home(name)


def _spoil(record: tuple[bytes, bytes, int], how: int) -> tuple[bytes | None, bytes | None, int]:
    """The record as a foreign producer might get it wrong: not JSON, a future version,
    another partitioner, another key."""
    key, value, partition = record
    if how == 0:
        return key, b"\x00not json", partition
    if how == 1:
        return key, value.replace(b'"v":1', b'"v":99'), partition
    if how == 2:
        return key, value, (partition + 1) % PARTS
    return b"ns/elsewhere", value, partition


records = st.lists(st.tuples(st.sampled_from(NAMES), st.integers(0, 5), st.booleans(),
                             st.one_of(st.none(), st.integers(0, 3))), max_size=60)


@settings(max_examples=200, deadline=None)
@given(records)
def test_the_state_of_a_mixed_log_is_the_state_of_its_good_records_alone(drawn):
    """Any mix of good and bad records folds to what the good ones alone give, and every
    bad one is rejected: what ``rebuild`` and the live keeper both rely on."""
    mixed, good_only = CacheState(CAPACITY), CacheState(CAPACITY)
    offsets = dict.fromkeys(range(PARTS), 0)
    for name, h, deleted, spoil in drawn:
        record = _good(name, h, deleted)
        key, value, partition = record if spoil is None else _spoil(record, spoil)
        offset = offsets[partition]
        offsets[partition] += 1
        outcome = fold_record(mixed, partition, offset, key, value, PARTS)
        if spoil is None:
            assert isinstance(outcome, Applied)
            good_only.fold.apply(outcome.event, Position(partition, offset))
        else:
            assert isinstance(outcome, Rejected)
    assert mixed.digests.digest() == good_only.digests.digest()
    assert set(mixed.lrus.endpoints) == set(good_only.lrus.endpoints)
