"""The HTTP API of CONTRACT on aiohttp.

``/v1/match`` answers from the in-memory view and never touches Kafka. Writes go to
the event log and answer 202 only once the broker acknowledged them; they change the
view only when the worker applies them from the log, so the log stays the one source
of truth. Every bad body is refused before anything is written.

With a token file, writes and ``/v1/state`` (and, with its own file, ``/v1/match``) need
``Authorization: Bearer <token>``; the check runs before the body is read, and a route
whose file is not set is built without it, so open ``/v1/match`` pays nothing for it.
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
    ReadinessBody,
    check_limits,
    check_placement,
    read_match,
)
from stream.auth import TokenFile
from stream.codec import field_path
from stream.config import Limits
from stream.core.cache import CacheState
from stream.core.events import EndpointDeleted, EndpointsSynced, ItemsPlaced
from stream.core.items import MAX_ITEM_SIZE, InvalidField, Item, extract_items, unique_items
from stream.core.render import render_match
from stream.digest import digest_without_blocking
from stream.kafka.publisher import EventPublisher, LogUnavailable
from stream.metrics import Metrics
from stream.openapi import openapi_document

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


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def _error(status: int, code: str, message: str) -> web.Response:
    return _json({"error": {"code": code, "message": message}}, status)


_UNAUTHORIZED = orjson.dumps({"error": {
    "code": "unauthorized",
    "message": "missing or invalid bearer token: send 'Authorization: Bearer <token>'"}})
_INTERNAL = orjson.dumps({"error": {
    "code": "internal_error", "message": "the request failed inside the service; nothing was written"}})


def _invalid(exc: InvalidField) -> ApiError:
    return ApiError(400, "invalid_request", str(exc))


_TAGS = frozenset({"deleted", "sync"})  # EndpointEventRequest's discriminator values


def _parse(model: type[BaseModel] | TypeAdapter[Any], raw: bytes) -> Any:
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


class HttpApi:
    """Routes of the service, bound to one state view and one publisher."""

    def __init__(
        self,
        state: CacheState,
        publisher: EventPublisher,
        metrics: Metrics,
        limits: Limits,
        is_ready: Callable[[], bool | ReadinessBody],
        write_tokens: TokenFile | None = None,
        match_tokens: TokenFile | None = None,
    ) -> None:
        self.state = state
        self.publisher = publisher
        self.metrics = metrics
        self.limits = limits
        self.is_ready = is_ready
        metrics.readiness = self._ready_now
        self.write_tokens = write_tokens
        self.match_tokens = match_tokens

    def application(self) -> web.Application:
        """Build the aiohttp application with every route of CONTRACT.

        Errors and timing wrap each handler (``_route``) instead of being an aiohttp
        middleware: any middleware makes aiohttp run its chain, and one of its own, on
        every request. A catch-all route keeps 404 and 405 answers in CONTRACT's JSON.

        ``/healthz`` and ``/readyz`` are open (probes carry no token); so are ``/metrics``
        (Prometheus scrapes pods without credentials by default; it holds counts and pod
        names, never item hashes, and changes nothing) and ``/openapi.json`` (the public
        contract, the same for every deployment).
        """
        app = web.Application(client_max_size=self.limits.max_body_bytes)
        add_post, add_get, route = app.router.add_post, app.router.add_get, self._route
        writes, matches = self.write_tokens, self.match_tokens
        add_post("/v1/match", route("/v1/match", self.match, matches))
        add_post("/v1/placements", route("/v1/placements", self.placements, writes))
        add_post("/v1/endpoint-events", route("/v1/endpoint-events", self.endpoint_events, writes))
        add_get("/v1/state", route("/v1/state", self.state_summary, writes))
        add_get("/healthz", route("/healthz", self.healthz))
        add_get("/readyz", route("/readyz", self.readyz))
        add_get("/metrics", route("/metrics", self.metrics_text))
        add_get("/openapi.json", route("/openapi.json", self.openapi))
        known = list(app.router.resources())
        app.router.add_route("*", "/{path:.*}", self._route("unmatched", self._unrouted(known)))
        return app

    def _route(self, name: str, handler: Handler, tokens: TokenFile | None = None) -> Handler:
        """``handler`` answering every error as CONTRACT's JSON body, timed by route, and
        behind a bearer token when ``tokens`` is given (checked before anything is read)."""
        timer, count = self.metrics.request_timer(name), self.metrics.count_request
        too_large = f"body over {self.limits.max_body_bytes} bytes (max_body_bytes)"
        if tokens is not None:
            handler = self._guarded(handler, tokens)

        async def handle(request: web.Request) -> web.StreamResponse:
            started = time.perf_counter()
            try:
                response = await handler(request)
            except ApiError as exc:
                response = _error(exc.status, exc.code, exc.message)
            except web.HTTPRequestEntityTooLarge:
                response = _error(413, "body_too_large", too_large)
            except web.HTTPException as exc:
                response = _error(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason)
                if "Allow" in exc.headers:  # a 405 says which methods the path takes
                    response.headers["Allow"] = exc.headers["Allow"]
            except Exception:
                log.exception("unexpected error on %s", name)
                response = web.Response(body=_INTERNAL, status=500, content_type="application/json")
            timer.observe(time.perf_counter() - started)
            count(name, response.status)
            return response

        return handle

    @staticmethod
    def _guarded(handler: Handler, tokens: TokenFile) -> Handler:
        """401 with ``WWW-Authenticate: Bearer`` unless the request carries a valid token."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            if not tokens.allows(request.headers.get("Authorization")):
                return web.Response(body=_UNAUTHORIZED, status=401, content_type="application/json",
                                    headers={"WWW-Authenticate": 'Bearer realm="mmcache"'})
            return await handler(request)

        return guarded

    @staticmethod
    def _unrouted(known: list[web.AbstractResource]) -> Handler:
        """405 when a route has this path but not this method, else 404, as aiohttp's
        router decides when no route matches."""

        async def refuse(request: web.Request) -> web.StreamResponse:
            allowed: set[str] = set()
            for resource in known:
                allowed |= (await resource.resolve(request))[1]
            if allowed:
                raise web.HTTPMethodNotAllowed(request.method, allowed)
            raise web.HTTPNotFound()

        return refuse

    async def _body(self, request: web.Request) -> bytes:
        if (request.content_length or 0) > self.limits.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(
                max_size=self.limits.max_body_bytes, actual_size=request.content_length or 0
            )
        return await request.read()

    async def match(self, request: web.Request) -> web.Response:
        """Score candidate endpoints by the request items they probably hold.

        A request ``read_match`` takes in is served without pydantic; any other request,
        and any refused by a later check, goes through ``MatchRequest`` so that every
        error is worded as it always was.
        """
        raw = await self._body(request)
        query = read_match(raw, self.limits)
        items = None if query is None else self._body_items(query[1])
        if query is None or items is None:
            endpoints, items = self._match_query(raw)
        else:
            endpoints = query[0]
        requested, found = self.state.hits(items, endpoints)
        self.metrics.record_match(items, found)
        return web.Response(body=render_match(items, requested, found),
                            content_type="application/json")

    def _body_items(self, body: dict[str, Any]) -> list[Item] | None:
        """The items of a match body within the limits, or ``None`` if it breaks a rule."""
        try:
            items = extract_items(body)
            check_limits(self.limits, items=items, items_field="body items")
        except InvalidField:
            return None
        return items

    def _match_query(self, raw: bytes) -> tuple[list[str], list[Item]]:
        """Endpoints and items of a match body checked by ``MatchRequest``; the first
        problem is raised as an ``ApiError``."""
        query: MatchRequest = _parse(MatchRequest, raw)
        try:
            check_limits(self.limits, endpoints=query.endpoints)
            items = extract_items(query.body)
            check_limits(self.limits, items=items, items_field="body items")
        except InvalidField as exc:
            raise _invalid(exc) from None
        return query.endpoints, items

    async def placements(self, request: web.Request) -> web.Response:
        """Record that a request's items were sent to endpoints (one event per endpoint)."""
        placement: PlacementRequest = _parse(PlacementRequest, await self._body(request))
        try:
            items = self._placement_items(placement)
            check_limits(self.limits, endpoints=placement.endpoints, items=items)
            check_placement(self.limits, placement.endpoints, self.state.endpoints)
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

    async def _publish(self, publish: Awaitable[int]) -> int:
        """The publisher's count, or 503: ``log_unavailable`` (not acknowledged in time,
        may still be written) or ``overloaded`` (too many writes waiting, nothing sent).
        The publisher logs the failures, rate-limited."""
        try:
            return await publish
        except LogUnavailable as exc:
            self.metrics.write_failures.labels(exc.code).inc()
            raise ApiError(503, exc.code, str(exc)) from None

    async def state_summary(self, request: web.Request) -> web.Response:
        """Per-endpoint counts, the capacity and the digest of the whole state."""
        unknown = sorted(set(request.query) - {"limit"})
        if unknown:  # a mistyped parameter must not pass as the default
            raise ApiError(400, "invalid_request", f"unknown query parameter {unknown[0][:64]!r} "
                                                   "(only 'limit')")
        raw_limit = request.query.get("limit", "100")
        # ASCII digits only ("²" is a digit to str.isdigit but not to int), and short
        # enough for int() (which refuses over 4,300 digits)
        if not (raw_limit.isascii() and raw_limit.isdigit() and len(raw_limit) <= 18):
            raise ApiError(400, "invalid_request", "limit: must be a non-negative integer")
        # hashed in slices between turns of the loop; the rest is read after the last
        # slice, with no await in between, so it describes the same moment
        digest = await digest_without_blocking(self.state)
        capacity = self.state.capacity
        return _json(
            {
                "endpoints": [row._asdict() for row in self.state.summary(int(raw_limit))],
                "total_endpoints": len(self.state.endpoints),
                "capacity": {"mode": capacity.mode, "per_endpoint": capacity.per_endpoint},
                "digest": digest.value,
                "digest_settled": digest.settled,
            }
        )

    async def openapi(self, request: web.Request) -> web.Response:
        """The OpenAPI 3.1 document of this API, from the models of ``schemas/``."""
        document = openapi_document(self.write_tokens is not None, self.match_tokens is not None)
        return web.Response(body=document, content_type="application/json")

    def _ready_now(self) -> bool:
        """Whether /readyz would answer 200 now (the ``mmcache_ready`` gauge)."""
        body = self.is_ready()
        return body if isinstance(body, bool) else body.status == "ready"

    async def healthz(self, request: web.Request) -> web.Response:
        """The process is alive."""
        return _json({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """CONTRACT's readiness body: 200 when ready, else 503 (``is_ready`` gives the body,
        ``stream.readiness``; a plain bool gives one without lag figures)."""
        body = self.is_ready()
        if isinstance(body, bool):
            body = ReadinessBody(status="ready" if body else "not_ready",
                                 reason="ready" if body else "not ready",
                                 lag_events=None, staleness_seconds=None)
        return _json(body.model_dump(), 200 if body.status == "ready" else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        """Prometheus text exposition."""
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )
