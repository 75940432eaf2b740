"""The HTTP API of CONTRACT on aiohttp.

``/v1/match`` answers from the in-memory view and never touches Kafka. Writes go to
the event log and answer 202 only once the broker acknowledged them; they change the
view only when the worker applies them from the log, so the log stays the one source
of truth. Every bad body is refused before anything is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, TypeAdapter, ValidationError

from stream.api_models import (
    EndpointDeletedRequest,
    EndpointEventRequest,
    MatchRequest,
    PlacementRequest,
    check_limits,
)
from stream.config import Limits
from stream.core.cache import CacheState
from stream.core.events import EndpointDeleted, EndpointsSynced, ItemsPlaced
from stream.core.items import InvalidField, Item, extract_items, unique_items
from stream.kafka.publisher import EventPublisher, LogUnavailable
from stream.metrics import Metrics

__all__ = ["HttpApi", "render_match"]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ENDPOINT_EVENT = TypeAdapter(EndpointEventRequest)


class ApiError(Exception):
    """An answer other than success, as CONTRACT's error body."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


_QUOTED: dict[str, bytes] = {}
_QUOTED_MAX = 100_000


def _quoted(name: str) -> bytes:
    """An endpoint name as a JSON string, cached: the same few thousand names recur."""
    quoted = _QUOTED.get(name)
    if quoted is None:
        if len(_QUOTED) >= _QUOTED_MAX:
            _QUOTED.clear()
        quoted = _QUOTED[name] = orjson.dumps(name)
    return quoted


def render_match(items: list[Item], requested: list[str], found: dict[str, list[Item]]) -> bytes:
    """The /v1/match answer as JSON bytes, equal to serializing ``CacheState.match``.

    Most candidates hold none of the request's items; their entries are one cached name
    and a tail shared by the whole answer, joined as bytes instead of built as objects
    (measured: dict building and serializing were a third of the request's cost).
    """
    if not items:
        return b'{"request_items":[],"endpoints":[]}'
    item_json = {  # orjson's own dataclass path was measured 4x slower than a dict
        id(item): orjson.dumps({"hash": item.hash, "size": item.size, "modality": item.modality})
        for item in items
    }
    total = sum(item.size for item in items)
    total_json = str(total).encode()
    no_match = b',"matched_items":[],"matched_weight":0,"total_weight":' + total_json + b',"score":0.0}'
    parts = []
    for name in requested:
        matched = found.get(name)
        if matched is None:
            parts.append(b'{"endpoint":' + _quoted(name) + no_match)
            continue
        weight = sum(item.size for item in matched)
        parts.append(b"".join((
            b'{"endpoint":', _quoted(name),
            b',"matched_items":[', b",".join(item_json[id(item)] for item in matched),
            b'],"matched_weight":', str(weight).encode(),
            b',"total_weight":', total_json,
            b',"score":', orjson.dumps(weight / total), b"}",
        )))
    return b"".join((b'{"request_items":[', b",".join(item_json.values()),
                     b'],"endpoints":[', b",".join(parts), b"]}"))


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def _error(status: int, code: str, message: str) -> web.Response:
    return _json({"error": {"code": code, "message": message}}, status)


def _invalid(exc: InvalidField) -> ApiError:
    return ApiError(400, "invalid_request", str(exc))


def _parse(model: type[BaseModel] | TypeAdapter[Any], raw: bytes) -> Any:
    """Validate a JSON body; the error message names the first bad field."""
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_json(raw)
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, "invalid_json", f"body is not valid JSON: {first['msg']}") from None
        where = ".".join(str(part) for part in first["loc"]) or "body"
        raise ApiError(400, "invalid_request", f"{where}: {first['msg']}") from None


class HttpApi:
    """Routes of the service, bound to one state view and one publisher."""

    def __init__(
        self,
        state: CacheState,
        publisher: EventPublisher,
        metrics: Metrics,
        limits: Limits,
        is_ready: Callable[[], bool],
    ) -> None:
        self.state = state
        self.publisher = publisher
        self.metrics = metrics
        self.limits = limits
        self.is_ready = is_ready

    def application(self) -> web.Application:
        """Build the aiohttp application with every route of CONTRACT."""
        app = web.Application(
            client_max_size=self.limits.max_body_bytes, middlewares=[self._errors_and_timing]
        )
        app.router.add_post("/v1/match", self.match)
        app.router.add_post("/v1/placements", self.placements)
        app.router.add_post("/v1/endpoint-events", self.endpoint_events)
        app.router.add_get("/v1/state", self.state_summary)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics_text)
        return app

    @web.middleware
    async def _errors_and_timing(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.perf_counter()
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        try:
            response = await handler(request)
        except ApiError as exc:
            response = _error(exc.status, exc.code, exc.message)
        except web.HTTPRequestEntityTooLarge:
            response = _error(
                413, "body_too_large", f"body over {self.limits.max_body_bytes} bytes (max_body_bytes)"
            )
        except web.HTTPException as exc:
            response = _error(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason)
        self.metrics.request_timer(name).observe(time.perf_counter() - started)
        return response

    async def _body(self, request: web.Request) -> bytes:
        if (request.content_length or 0) > self.limits.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(
                max_size=self.limits.max_body_bytes, actual_size=request.content_length or 0
            )
        return await request.read()

    async def match(self, request: web.Request) -> web.Response:
        """Score candidate endpoints by the request items they probably hold."""
        query: MatchRequest = _parse(MatchRequest, await self._body(request))
        try:
            check_limits(self.limits, endpoints=query.endpoints)
            items = extract_items(query.body)
            check_limits(self.limits, items=items, items_field="body items")
        except InvalidField as exc:
            raise _invalid(exc) from None
        requested, found = self.state.hits(items, query.endpoints)
        self.metrics.record_match(items, found)
        return web.Response(body=render_match(items, requested, found),
                            content_type="application/json")

    async def placements(self, request: web.Request) -> web.Response:
        """Record that a request's items were sent to endpoints (one event per endpoint)."""
        placement: PlacementRequest = _parse(PlacementRequest, await self._body(request))
        try:
            items = self._placement_items(placement)
            check_limits(self.limits, endpoints=placement.endpoints, items=items)
        except InvalidField as exc:
            raise _invalid(exc) from None
        if not items:
            return _json({"events": 0}, 202)
        events = [
            ItemsPlaced(endpoint=name, items=items, request_id=placement.request_id)
            for name in dict.fromkeys(placement.endpoints)
        ]
        return _json({"events": await self._publish(self.publisher.publish(events))}, 202)

    @staticmethod
    def _placement_items(placement: PlacementRequest) -> list[Item]:
        if (placement.items is None) == (placement.body is None):
            raise InvalidField("items", "give exactly one of 'items' or 'body'")
        if placement.items is not None:
            return unique_items(placement.items)
        return extract_items(placement.body)

    async def endpoint_events(self, request: web.Request) -> web.Response:
        """Record an endpoint deletion or a sync of the live set."""
        event = _parse(_ENDPOINT_EVENT, await self._body(request))
        try:
            if isinstance(event, EndpointDeletedRequest):
                check_limits(self.limits, endpoints=[event.endpoint], field="endpoint")
                publish = self.publisher.publish([EndpointDeleted(endpoint=event.endpoint)])
            else:
                check_limits(self.limits, endpoints=event.live, field="live")
                if not event.live:
                    return _json({"events": 0}, 202)
                publish = self.publisher.publish_sync(EndpointsSynced(live=event.live))
        except InvalidField as exc:
            raise _invalid(exc) from None
        return _json({"events": await self._publish(publish)}, 202)

    @staticmethod
    async def _publish(publish: Awaitable[int]) -> int:
        try:
            return await publish
        except LogUnavailable as exc:
            log.warning("%s", exc)
            raise ApiError(503, "log_unavailable", str(exc)) from None

    async def state_summary(self, request: web.Request) -> web.Response:
        """Per-endpoint counts, the capacity and the digest of the whole state."""
        raw_limit = request.query.get("limit", "100")
        if not raw_limit.isdigit():
            raise ApiError(400, "invalid_request", "limit: must be a non-negative integer")
        capacity = self.state.capacity
        return _json(
            {
                "endpoints": [row._asdict() for row in self.state.summary(int(raw_limit))],
                "total_endpoints": len(self.state.endpoints),
                "capacity": {"mode": capacity.mode, "per_endpoint": capacity.per_endpoint},
                "digest": self.state.digest(),
            }
        )

    async def healthz(self, request: web.Request) -> web.Response:
        """The process is alive."""
        return _json({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """200 only once the state is recovered and caught up with the log."""
        if self.is_ready():
            return _json({"status": "ready"})
        return _error(503, "not_ready", "state is recovering or catching up with the event log")

    async def metrics_text(self, request: web.Request) -> web.Response:
        """Prometheus text exposition."""
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )
