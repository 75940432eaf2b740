"""Pydantic models of every HTTP body (requests and responses), per CONTRACT.

Shapes are checked here; the configurable limits (counts and lengths) are checked by
``check_limits`` so that one schema serves every deployment.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Annotated, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field

from stream.config import Limits
from stream.core.events import EndpointName, EngineEvent
from stream.core.items import InvalidField, Item

__all__ = [
    "EndpointDeletedRequest",
    "EndpointEventRequest",
    "EndpointMatchBody",
    "EndpointStateBody",
    "EndpointsSyncRequest",
    "EngineEventsRequest",
    "EngineViewStateBody",
    "ErrorBody",
    "EventsAccepted",
    "MatchRequest",
    "MatchResponse",
    "PlacementRequest",
    "ReadinessBody",
    "StateResponse",
    "check_limits",
    "check_placement",
    "read_match",
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MatchRequest(_Body):
    """The scheduler's produce call: which candidate endpoints hold this request's items."""

    endpoints: list[EndpointName]
    body: dict[str, Any]
    request_id: str | None = None


_MATCH_FIELDS = frozenset(MatchRequest.model_fields)
_NAME_MAX = 253  # EndpointName's max_length
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # what EndpointName's pattern refuses
# pydantic's JSON parser refuses nesting deeper than ~200 and orjson allows 1024, so
# bodies that might nest that deep (each level opens a bracket) take the pydantic path.
_FAST_BRACKETS = 192


def read_match(raw: bytes, limits: Limits) -> tuple[list[str], dict[str, Any]] | None:
    """``(endpoints, body)`` of a valid match request within the endpoint limits, or
    ``None`` for anything else, whose error the caller gets from ``MatchRequest``.

    The same checks as ``MatchRequest`` plus ``check_limits(endpoints=...)``, done in a
    few C-level passes over orjson's output (bench body: ~11 us with the parse, against
    ~16 us). It must accept nothing ``MatchRequest`` refuses, and when in doubt it says
    ``None``. Integers beyond 64 bits come back from orjson as floats, so a body that a
    later check refuses must be checked again through ``MatchRequest`` too.
    """
    if raw.count(b"[") + raw.count(b"{") > _FAST_BRACKETS:
        return None
    try:
        query = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if type(query) is not dict or not query.keys() <= _MATCH_FIELDS:
        return None
    endpoints, body = query.get("endpoints"), query.get("body")
    request_id = query.get("request_id")
    if (type(endpoints) is not list or type(body) is not dict
            or (request_id is not None and type(request_id) is not str)
            or len(endpoints) > limits.max_endpoints):
        return None
    if endpoints:
        try:
            joined = "".join(endpoints)  # raises if any is not a string
        except TypeError:
            return None
        if not all(endpoints) or max(map(len, endpoints)) > min(_NAME_MAX, limits.max_endpoint_chars):
            return None
        # JSON strings hold control characters only as escapes, and DEL also as itself
        if (b"\\" in raw or b"\x7f" in raw) and _CONTROL.search(joined):
            return None
    return endpoints, body


class PlacementRequest(_Body):
    """The gateway's pre-request call: the request was sent to ``endpoints``."""

    request_id: str | None = None
    endpoints: list[EndpointName] = Field(min_length=1)
    items: list[Item] | None = None
    body: dict[str, Any] | None = None


class EndpointDeletedRequest(_Body):
    """An endpoint is gone."""

    type: Literal["deleted"]
    endpoint: EndpointName


class EndpointsSyncRequest(_Body):
    """Only these endpoints are live."""

    type: Literal["sync"]
    live: list[EndpointName]


EndpointEventRequest = Annotated[
    EndpointDeletedRequest | EndpointsSyncRequest, Field(discriminator="type")
]


class EngineEventsRequest(_Body):
    """A model server reports changes of its own encoder cache, to apply in order."""

    endpoint: EndpointName
    engine: str = Field(min_length=1, max_length=64, description="the reporting engine, e.g. vllm")
    events: list[EngineEvent]


class EndpointMatchBody(_Body):
    """Match data for one endpoint (the plugin's EncoderCacheMatchInfo)."""

    endpoint: str
    matched_items: list[Item]
    matched_weight: int
    total_weight: int
    score: float
    source: Literal["engine", "estimate"] = Field(
        description="engine: matched against what the endpoint reported its cache holds; "
        "estimate: against its LRU estimated from placements")


class MatchResponse(_Body):
    """Answer to ``POST /v1/match``."""

    request_items: list[Item]
    endpoints: list[EndpointMatchBody]


class EventsAccepted(_Body):
    """202 answer: how many events the log acknowledged."""

    events: int


class EndpointStateBody(_Body):
    """Counts for one endpoint; hashes are never exposed."""

    endpoint: str
    items: int
    weight: int


class CapacityBody(_Body):
    """Per-endpoint capacity."""

    mode: Literal["items", "size"]
    per_endpoint: int


class EngineViewStateBody(_Body):
    """Counts of one endpoint's engine view (what it reported its cache holds)."""

    endpoint: str
    items: int
    weight: int


class StateResponse(_Body):
    """Answer to ``GET /v1/state``."""

    endpoints: list[EndpointStateBody]
    total_endpoints: int
    capacity: CapacityBody
    digest: str
    engine_views: list[EngineViewStateBody] | None = Field(
        None,
        description="endpoints that report their own cache, most items first, then by name "
        "(capped by ?limit= as endpoints is); only once some endpoint has reported")
    total_engine_views: int | None = Field(
        None, description="endpoints that report their own cache; only once some endpoint has reported")
    digest_settled: bool = Field(
        True,
        description="false when writes kept changing the state while it was hashed: the "
        "digest then belongs to no single moment; compare digests at rest",
    )


class ReadinessBody(_Body):
    """``/readyz``'s answer, 200 or 503: whether the view answers, why, and how far it is
    behind the event log (``null`` while not known)."""

    status: Literal["ready", "not_ready"]
    reason: str
    lag_events: int | None = Field(
        description="events on the log not yet in this worker's view, over every partition")
    staleness_seconds: float | None = Field(
        description="age of the oldest event on the log not yet in this worker's view")


class ErrorDetail(_Body):
    """What went wrong, naming the field or the limit."""

    code: str
    message: str


class ErrorBody(_Body):
    """Every 4xx/5xx answer."""

    error: ErrorDetail


def check_limits(
    limits: Limits,
    endpoints: list[str] | None = None,
    items: list[Item] | None = None,
    field: str = "endpoints",
    items_field: str = "items",
) -> None:
    """Raise ``InvalidField`` naming the first configured limit the request breaks."""
    if endpoints is not None:
        if len(endpoints) > limits.max_endpoints:
            raise InvalidField(field, f"at most {limits.max_endpoints} endpoints (max_endpoints)")
        i = _first_longer(endpoints, limits.max_endpoint_chars)
        if i is not None:
            raise InvalidField(f"{field}[{i}]",
                               f"at most {limits.max_endpoint_chars} characters (max_endpoint_chars)")
    if items is not None:
        if len(items) > limits.max_items:
            raise InvalidField(items_field, f"at most {limits.max_items} items (max_items)")
        i = _first_longer([item.hash for item in items], limits.max_hash_chars)
        if i is not None:
            raise InvalidField(f"{items_field}[{i}].hash",
                               f"at most {limits.max_hash_chars} characters (max_hash_chars)")
        i = _first_longer([item.modality for item in items], limits.max_modality_chars)
        if i is not None:
            raise InvalidField(f"{items_field}[{i}].modality",
                               f"at most {limits.max_modality_chars} characters (max_modality_chars)")


def check_placement(limits: Limits, endpoints: list[str], view: Collection[str]) -> None:
    """Raise ``InvalidField`` when a placement's fan-out breaks a limit.

    A placement is one event per distinct endpoint and each touches every item, so it
    names at most ``max_placement_endpoints`` of them; and it may not take the view past
    ``max_total_endpoints`` endpoints (``view`` is the container of names it holds). The
    view is eventual, so concurrent placements can pass that bound by what is in flight.
    """
    distinct = list(dict.fromkeys(endpoints))
    if len(distinct) > limits.max_placement_endpoints:
        raise InvalidField("endpoints", f"at most {limits.max_placement_endpoints} distinct endpoints "
                                        "per placement (max_placement_endpoints)")
    new = sum(1 for name in distinct if name not in view)
    if new and len(view) + new > limits.max_total_endpoints:
        raise InvalidField("endpoints", f"the view holds {len(view)} endpoints, at most "
                                        f"{limits.max_total_endpoints} (max_total_endpoints): "
                                        "delete or sync gone endpoints first")


def _first_longer(texts: list[str], limit: int) -> int | None:
    """Index of the first text over ``limit`` characters (one C-level pass when none is)."""
    if not texts or max(map(len, texts)) <= limit:
        return None
    return next(i for i, text in enumerate(texts) if len(text) > limit)
