"""From a request's bytes to checked values, one reader per route.

Pure (no HTTP server, no state, nothing shared between calls): the same reader runs on the
event loop for a small body and in the body reader's child process for a big one
(``stream.http.body_reader``), so every refusal is worded alike wherever the body was read.
What needs the view (``check_placement``) is checked by the caller. Each reader stops at
the first problem, and the work it does before follows the limits: extraction stops at
the item and reference limits, a match at its endpoint x item limit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from stream.config import Limits
from stream.core.codec import field_path
from stream.core.events import EngineItemsRemoved, EngineItemsStored
from stream.core.items import MAX_ITEM_SIZE, InvalidField, Item, extract_items, unique_items
from stream.http.models import (
    EndpointDeletedRequest,
    EndpointEventRequest,
    EngineEventsRequest,
    MatchRequest,
    PlacementRequest,
    check_limits,
    read_match,
)

__all__ = ["READERS", "ApiError", "MatchQuery", "Placement", "check_values", "checked_match_query",
           "endpoint_event", "engine_events", "invalid", "match_query", "parse", "placement"]

_ENDPOINT_EVENT = TypeAdapter(EndpointEventRequest)
# the discriminator values of EndpointEventRequest and of an engine report's facts
_TAGS = frozenset({"deleted", "sync", "stored", "removed", "cleared"})


class ApiError(Exception):
    """An answer other than success, as CONTRACT's error body."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return ApiError, (self.status, self.code, self.message)


def invalid(exc: InvalidField) -> ApiError:
    """A broken rule, as a 400 naming the field."""
    return ApiError(400, "invalid_request", str(exc))


@dataclass(frozen=True, slots=True)
class MatchQuery:
    """A match request within the limits: the candidates, and the body's items."""

    endpoints: list[str]
    items: list[Item]


@dataclass(frozen=True, slots=True)
class Placement:
    """A placement request within the limits (``check_placement`` is the caller's)."""

    request_id: str | None
    endpoints: list[str]
    items: list[Item]


def parse(model: type[BaseModel] | TypeAdapter[Any], raw: bytes) -> Any:
    """Validate a JSON body strictly (the schema's integer is not ``"1"`` nor ``true``, as
    on ``read_match``'s path); the message names the first bad field as ``items[0].size``
    and the limit it broke."""
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_json(raw, strict=True)
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, "invalid_json", f"body is not valid JSON: {first['msg']}") from None
        where = field_path(first["loc"], _TAGS) or "body"
        raise ApiError(400, "invalid_request", f"{where}: {_message(first)}") from None


def _message(error: Any) -> str:
    """Pydantic's message, with the name of the bound it hit: the endpoint name length
    (CONTRACT's 253, which ``max_endpoint_chars`` may only lower) and the item size."""
    loc, kind = error["loc"], error["type"]
    if kind == "string_too_long" and any(part in ("endpoints", "endpoint", "live") for part in loc):
        return f"{error['msg']} (max_endpoint_chars)"
    if loc and loc[-1] == "size" and kind in ("less_than_equal", "greater_than_equal"):
        return f"must be from 1 to {MAX_ITEM_SIZE} (the item size bound)"
    return str(error["msg"])


def check_values(raw: bytes, limits: Limits) -> None:
    """Refuse, before any parse, a body of more JSON values than ``max_body_values``: a
    parse costs up to ~80 bytes a value, so its bytes alone do not bound it (16 MiB of
    ``{"a":1}`` builds ~2M objects). Counted from the bytes, in C: every value but the
    document's first follows a ``,``, ``:``, ``[`` or ``{``; separators inside strings (a
    long prompt's commas) are no values, so a body over the limit by that count is counted
    again with its strings taken out, unless its strings alone are over it (each is a
    value: that also keeps the second count to a bounded number of strings)."""
    limit = limits.max_body_values
    if len(raw) <= limit or _separators(raw) <= limit:
        return  # every small body: fewer bytes than the limit, fewer separators too
    strings = (raw.count(b'"') - raw.count(b'\\"')) // 2
    if strings > limit or _separators(_STRING.sub(b'""', raw)) > limit:
        raise ApiError(413, "body_too_large",
                       f"body: more than {limit:,} JSON values (max_body_values)")


def _separators(raw: bytes) -> int:
    return raw.count(b",") + raw.count(b":") + raw.count(b"[") + raw.count(b"{")


#: A JSON string, escapes included, or an unterminated one to the end (so that no quote
#: is tried twice as a string's start: one pass over the body, whatever it holds).
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*+(?:"|\\?\Z)', re.DOTALL)


def _body_items(body: Any, limits: Limits, items_field: str) -> list[Item]:
    items = extract_items(body, max_items=limits.max_items, max_references=limits.max_references,
                          items_field=items_field)
    check_limits(limits, items=items, items_field=items_field)
    return items


def match_query(raw: bytes, limits: Limits) -> MatchQuery:
    """A ``/v1/match`` body, checked; its endpoints x items within ``max_match_pairs``.

    A request ``read_match`` takes in is read without pydantic; any other request, and
    any refused by a later check, is read again by ``checked_match_query``, so that
    every error is worded as it always was.
    """
    check_values(raw, limits)
    query = read_match(raw, limits)
    if query is None:
        return checked_match_query(raw, limits)
    try:
        items = _body_items(query[1], limits, "body items")
    except InvalidField:
        return checked_match_query(raw, limits)
    return _within_pairs(query[0], items, limits)


def checked_match_query(raw: bytes, limits: Limits) -> MatchQuery:
    """``match_query`` through ``MatchRequest``: the reference wording of every error."""
    checked: MatchRequest = parse(MatchRequest, raw)
    try:
        check_limits(limits, endpoints=checked.endpoints)
        items = _body_items(checked.body, limits, "body items")
    except InvalidField as exc:
        raise invalid(exc) from None
    return _within_pairs(checked.endpoints, items, limits)


def _within_pairs(endpoints: list[str], items: list[Item], limits: Limits) -> MatchQuery:
    if len(endpoints) * len(items) > limits.max_match_pairs:
        raise ApiError(400, "invalid_request",
                       f"endpoints x body items: {len(endpoints)} x {len(items)} pairs, at most "
                       f"{limits.max_match_pairs} (max_match_pairs): name fewer endpoints")
    return MatchQuery(endpoints, items)


def placement(raw: bytes, limits: Limits) -> Placement:
    """A ``/v1/placements`` body, checked: exactly one of ``items`` and ``body``."""
    check_values(raw, limits)
    request: PlacementRequest = parse(PlacementRequest, raw)
    try:
        if (request.items is None) == (request.body is None):
            raise InvalidField("items", "give exactly one of 'items' or 'body'")
        check_limits(limits, endpoints=request.endpoints)
        if request.items is not None:
            items = unique_items(request.items, limits.max_items)
            check_limits(limits, items=items)
        else:
            items = _body_items(request.body, limits, "items")
    except InvalidField as exc:
        raise invalid(exc) from None
    return Placement(request.request_id, request.endpoints, items)


def endpoint_event(raw: bytes, limits: Limits) -> Any:
    """A ``/v1/endpoint-events`` body, checked: a deletion or a sync."""
    check_values(raw, limits)
    event = parse(_ENDPOINT_EVENT, raw)
    try:
        if isinstance(event, EndpointDeletedRequest):
            check_limits(limits, endpoints=[event.endpoint], field="endpoint")
        else:
            check_limits(limits, endpoints=event.live, field="live")
    except InvalidField as exc:
        raise invalid(exc) from None
    return event


def engine_events(raw: bytes, limits: Limits) -> EngineEventsRequest:
    """A ``/v1/engine-events`` body, checked: at most ``max_engine_events`` facts, and
    over all of them at most ``max_items`` stored items and ``max_items`` removed hashes,
    each within the hash and modality lengths."""
    check_values(raw, limits)
    request: EngineEventsRequest = parse(EngineEventsRequest, raw)
    try:
        check_limits(limits, endpoints=[request.endpoint], field="endpoint")
        if len(request.events) > limits.max_engine_events:
            raise InvalidField("events", f"at most {limits.max_engine_events} events (max_engine_events)")
        stored = removed = 0
        for at, fact in enumerate(request.events):
            if isinstance(fact, EngineItemsStored):
                stored += len(fact.items)
                if stored > limits.max_items:
                    raise InvalidField(f"events[{at}].items", f"at most {limits.max_items} stored "
                                       "items over all events (max_items)")
                check_limits(limits, items=fact.items, items_field=f"events[{at}].items")
            elif isinstance(fact, EngineItemsRemoved):
                removed += len(fact.hashes)
                if removed > limits.max_items:
                    raise InvalidField(f"events[{at}].hashes", f"at most {limits.max_items} removed "
                                       "hashes over all events (max_items)")
                too_long = next((i for i, digest in enumerate(fact.hashes)
                                 if len(digest) > limits.max_hash_chars), None)
                if too_long is not None:
                    raise InvalidField(f"events[{at}].hashes[{too_long}]", f"at most "
                                       f"{limits.max_hash_chars} characters (max_hash_chars)")
    except InvalidField as exc:
        raise invalid(exc) from None
    return request


#: Every reader by name, as the body reader's child knows them.
READERS = {"match_query": match_query, "placement": placement, "endpoint_event": endpoint_event,
           "engine_events": engine_events}
