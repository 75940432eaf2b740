"""``read_match`` takes in only match bodies that ``MatchRequest`` and the endpoint limits
accept, with the same values; everything else is left to pydantic's errors."""

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from stream.config import Limits
from stream.core.items import InvalidField
from stream.http.models import MatchRequest, check_limits, read_match

LIMITS = Limits()


def validated(raw: bytes, limits: Limits = LIMITS) -> tuple[list[str], dict] | None:
    """What the pydantic path makes of ``raw``, or ``None`` if it refuses it."""
    try:
        query = MatchRequest.model_validate_json(raw)
        check_limits(limits, endpoints=query.endpoints)
    except (ValidationError, InvalidField):
        return None
    return query.endpoints, query.body


def test_the_common_body_is_read():
    raw = orjson.dumps({"endpoints": ["ns/a", "ns/b", "ns/a"], "request_id": "r",
                        "body": {"tokenized": {"prompts": [{"mm_features": []}]}}})
    assert read_match(raw, LIMITS) == validated(raw) == (
        ["ns/a", "ns/b", "ns/a"], {"tokenized": {"prompts": [{"mm_features": []}]}})


@pytest.mark.parametrize("raw", [
    b"{not json", b"", b"[]", b"null", b'{"endpoints": "x", "body": {}}', b'{"body": {}}',
    b'{"endpoints": ["a"]}', b'{"endpoints": ["a"], "body": {}, "extra": 1}',
    b'{"endpoints": ["a"], "body": []}', b'{"endpoints": ["a"], "body": {}, "request_id": 5}',
    b'{"endpoints": [""], "body": {}}', b'{"endpoints": [1], "body": {}}',
    b'{"endpoints": ["a\\u0001"], "body": {}}', b'{"endpoints": ["a\\n"], "body": {}}',
    b'{"endpoints": ["a\x7f"], "body": {}}', b'{"endpoints": ["a\\u007f"], "body": {}}',
    b'{"endpoints": ["' + b"e" * 254 + b'"], "body": {}}',
    b'{"endpoints": ["\\u00e9' + b"e" * 253 + b'"], "body": {}}',
    b'{"endpoints": ["a"], "body": {"x": ' + b"[" * 260 + b"]" * 260 + b"}}",  # too deep for pydantic
    b'{"endpoints": ["a"], "body": {"x": 1e400}}',  # inf: pydantic takes it, orjson does not
])
def test_bodies_pydantic_refuses_or_reads_differently_are_left_to_it(raw):
    assert read_match(raw, LIMITS) is None


def test_endpoint_limits_are_left_to_check_limits():
    raw = orjson.dumps({"endpoints": ["a", "bbb"], "body": {}})
    assert read_match(raw, Limits(max_endpoints=1)) is None
    assert read_match(raw, Limits(max_endpoint_chars=2)) is None
    assert read_match(raw, Limits(max_endpoints=2, max_endpoint_chars=3)) == (["a", "bbb"], {})


def test_printable_unicode_names_are_read():
    raw = json.dumps({"endpoints": ["ns/ünï", 'ns/"q"', "ns/\\s", "é" * 253], "body": {}}).encode()
    assert read_match(raw, LIMITS) == validated(raw)


names = st.text(st.characters(codec="utf-8"), max_size=6) | st.sampled_from(["ns/a", "x" * 254])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=8,
)
queries = st.fixed_dictionaries(
    {"endpoints": st.lists(names, max_size=4) | json_values},
    optional={"body": st.dictionaries(st.text(max_size=3), json_values, max_size=3) | json_values,
              "request_id": st.none() | st.text(max_size=3) | st.integers(),
              "other": json_values},
)


@settings(max_examples=400, deadline=None)
@given(query=queries | json_values, ascii_only=st.booleans())
def test_whatever_is_read_is_what_pydantic_reads(query, ascii_only):
    try:
        raw = json.dumps(query, ensure_ascii=ascii_only).encode()
    except UnicodeEncodeError:  # a lone surrogate: not a body anyone can send as UTF-8
        return
    read = read_match(raw, LIMITS)
    if read is not None:
        assert read == validated(raw)


def test_a_modality_over_max_modality_chars_is_refused_naming_the_limit():
    from stream.core.items import Item
    items = [Item("h1", 1, "image"), Item("h2", 1, "m" * 65)]
    with pytest.raises(InvalidField) as info:
        check_limits(LIMITS, items=items, items_field="body items")
    assert str(info.value) == "body items[1].modality: at most 64 characters (max_modality_chars)"
    check_limits(Limits(max_modality_chars=65), items=items)


def test_max_references_may_not_be_below_max_items():
    with pytest.raises(ValidationError, match="MMCACHE_MAX_REFERENCES .* must be at least MMCACHE_MAX_ITEMS"):
        Limits(max_items=5000)
    assert Limits(max_items=5000, max_references=5000).max_references == 5000
