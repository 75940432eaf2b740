"""Events to bytes and back: the one decoding boundary of the event log."""

from __future__ import annotations

import orjson
import pytest

from stream.core.codec import MalformedEvent, decode_event, encode_event
from stream.core.events import EVENT_VERSION, EndpointDeleted, EndpointsSynced, ItemsPlaced
from stream.core.items import Item

EVENTS = [
    ItemsPlaced(
        endpoint="default/pod-a",
        items=[Item("h1", 1, "image"), Item("h2", 576, "video"), Item("h3", 2**31 - 1, "x")],
        request_id="r-1",
    ),
    ItemsPlaced(endpoint="ns/p", items=[Item("h", 1, "audio")]),
    EndpointDeleted(endpoint="default/pod-a"),
    EndpointsSynced(live=["default/pod-a", "default/pod-b"]),
    EndpointsSynced(live=[]),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.type)
def test_round_trip(event):
    raw = encode_event(event)
    assert isinstance(raw, bytes)
    decoded = decode_event(raw)
    assert decoded == event
    assert type(decoded) is type(event)
    assert encode_event(decoded) == raw


def test_encoding_carries_version_and_type():
    doc = orjson.loads(encode_event(EndpointDeleted(endpoint="e")))
    assert doc == {"v": EVENT_VERSION, "type": "endpoint_deleted", "endpoint": "e"}
    assert EVENT_VERSION == 1


def test_encoding_omits_missing_request_id():
    doc = orjson.loads(encode_event(ItemsPlaced(endpoint="e", items=[Item("h", 2, "image")])))
    assert doc == {
        "v": 1,
        "type": "items_placed",
        "endpoint": "e",
        "items": [{"hash": "h", "size": 2, "modality": "image"}],
    }


def test_decoded_items_are_item_values():
    raw = (
        b'{"v":1,"type":"items_placed","endpoint":"e",'
        b'"items":[{"hash":"h","size":3,"modality":"video"}]}'
    )
    event = decode_event(raw)
    assert isinstance(event, ItemsPlaced)
    assert event.items == [Item("h", 3, "video")]


def _raw(**fields) -> bytes:
    return orjson.dumps(fields)


GOOD_ITEM = {"hash": "h", "size": 1, "modality": "image"}


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(None, id="none"),
        pytest.param(b"", id="empty"),
        pytest.param(b"not json", id="not-json"),
        pytest.param(b'{"v":1,"type":"endpoint_deleted",', id="truncated"),
        pytest.param(b"\xff\xfe\x00", id="not-utf8"),
        pytest.param(b"[]", id="array"),
        pytest.param(b'"endpoint_deleted"', id="string"),
        pytest.param(b"null", id="null"),
    ],
)
def test_rejects_non_json_and_non_objects(raw):
    with pytest.raises(MalformedEvent):
        decode_event(raw)


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(_raw(v=1, endpoint="e"), id="no-type"),
        pytest.param(_raw(v=1, type="endpoint_created", endpoint="e"), id="unknown-type"),
        pytest.param(_raw(v=1, type="", endpoint="e"), id="empty-type"),
        pytest.param(_raw(v=1, type=3, endpoint="e"), id="non-string-type"),
    ],
)
def test_rejects_unknown_type(raw):
    with pytest.raises(MalformedEvent):
        decode_event(raw)


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_rejects_wrong_version(version):
    raw = _raw(v=version, type="endpoint_deleted", endpoint="e")
    with pytest.raises(MalformedEvent) as info:
        decode_event(raw)
    assert "v" in str(info.value)


def test_rejects_version_two_for_every_type():
    for event in EVENTS:
        doc = orjson.loads(encode_event(event))
        doc["v"] = 2
        with pytest.raises(MalformedEvent):
            decode_event(orjson.dumps(doc))


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(_raw(v=1, type="endpoint_deleted"), id="deleted-no-endpoint"),
        pytest.param(_raw(v=1, type="endpoint_deleted", endpoint=""), id="empty-endpoint"),
        pytest.param(_raw(v=1, type="endpoint_deleted", endpoint="a\nb"), id="control-in-endpoint"),
        pytest.param(_raw(v=1, type="endpoint_deleted", endpoint="x" * 254), id="endpoint-254"),
        pytest.param(_raw(v=1, type="endpoint_deleted", endpoint=5), id="endpoint-int"),
        pytest.param(_raw(v=1, type="endpoint_deleted", endpoint="e", extra=1), id="extra-field"),
        pytest.param(_raw(v=1, type="endpoints_synced"), id="synced-no-live"),
        pytest.param(_raw(v=1, type="endpoints_synced", live="e"), id="live-not-list"),
        pytest.param(_raw(v=1, type="endpoints_synced", live=[""]), id="live-empty-name"),
        pytest.param(_raw(v=1, type="items_placed", endpoint="e"), id="placed-no-items"),
        pytest.param(_raw(v=1, type="items_placed", endpoint="e", items=[]), id="placed-0-items"),
        pytest.param(_raw(v=1, type="items_placed", items=[GOOD_ITEM]), id="placed-no-endpoint"),
        pytest.param(
            _raw(v=1, type="items_placed", endpoint="e", items=[{**GOOD_ITEM, "size": 0}]),
            id="size-0",
        ),
        pytest.param(
            _raw(v=1, type="items_placed", endpoint="e", items=[{**GOOD_ITEM, "size": 2**31}]),
            id="size-too-big",
        ),
        pytest.param(
            _raw(v=1, type="items_placed", endpoint="e", items=[{**GOOD_ITEM, "hash": ""}]),
            id="empty-hash",
        ),
        pytest.param(
            _raw(v=1, type="items_placed", endpoint="e", items=[{"hash": "h", "size": 1}]),
            id="no-modality",
        ),
        pytest.param(
            _raw(v=1, type="items_placed", endpoint="e", items=["h"]),
            id="item-not-object",
        ),
    ],
)
def test_rejects_wrong_schema(raw):
    with pytest.raises(MalformedEvent):
        decode_event(raw)


def test_malformed_event_is_a_value_error_naming_the_field():
    raw = _raw(v=1, type="items_placed", endpoint="e", items=[{**GOOD_ITEM, "size": 0}])
    with pytest.raises(ValueError) as info:
        decode_event(raw)
    assert isinstance(info.value, MalformedEvent)
    assert "size" in str(info.value)


def test_endpoint_of_253_printable_characters_round_trips():
    event = EndpointDeleted(endpoint="n/" + "x" * 251)
    assert decode_event(encode_event(event)) == event


REASONS = {
    b"not json {": "not_json",
    b"": "not_json",
    None: "not_json",
    b"\xff\xfe": "not_json",
    b"[1, 2]": "bad_schema",
    b'"text"': "bad_schema",
    b'{"type": "items_placed"}': "bad_schema",
    b'{"v": 1, "type": "items_evicted", "endpoint": "e"}': "bad_schema",
    b'{"v": 99, "type": "endpoint_deleted", "endpoint": "e"}': "unknown_version",
    b'{"v": 2, "type": "items_evicted"}': "unknown_version",
    b'{"v": "1", "type": "endpoint_deleted", "endpoint": "e"}': "unknown_version",
}


@pytest.mark.parametrize(("raw", "reason"), REASONS.items(), ids=[repr(r) for r in REASONS])
def test_malformed_event_says_why_in_a_dead_letter_reason(raw, reason):
    with pytest.raises(MalformedEvent) as caught:
        decode_event(raw)
    assert caught.value.reason == reason


@pytest.mark.parametrize("size", ['"1"', "true"])
def test_a_size_that_is_not_a_json_integer_is_a_bad_schema_record(size):
    # a record published directly with a string size is refused by live and rebuild alike
    raw = (b'{"v":1,"type":"items_placed","endpoint":"a","items":[{"hash":"h","size":'
           + size.encode() + b',"modality":"image"}]}')
    with pytest.raises(MalformedEvent) as caught:
        decode_event(raw)
    assert caught.value.reason == "bad_schema"
    assert str(caught.value) == "items[0].size: Input should be a valid integer"
