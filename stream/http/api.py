"""The HTTP API of CONTRACT on aiohttp.

``/v1/match`` answers from the in-memory view and never touches Kafka: each endpoint
from its engine view (what it reported its own cache holds) or from its LRU (the
estimate), as ``match_source`` says, and counts what the estimate got right against
each reporting endpoint's engine view (``mmcache_estimate_checks_total``). Writes go to
the event log and answer 202 only once the broker acknowledged them; they change the
view only when the worker applies them from the log, so the log stays the one source
of truth. Every bad body is refused before anything is written.

With a token file, writes and ``/v1/state`` (and, with its own file, ``/v1/match``) need
``Authorization: Bearer <token>``; the check runs before the body is read, and a route
whose file is not set is built without it, so open ``/v1/match`` pays nothing for it.

No request holds the event loop for more than a few milliseconds (CONTRACT): a big body
is read in a child process (``stream.http.body_reader``), extraction stops at the limits
(``stream.http.bodies``), a match's answer is bounded (``max_match_pairs``) and a wide one is
built in slices with the loop turning between them; an event the log could never take
is refused before it is sent; and a request aiohttp cannot parse is answered without
what it held (``stream.http.aiohttp_guard``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from stream.config import Limits
from stream.core.cache import CacheState
from stream.core.codec import encode_event
from stream.core.events import EndpointDeleted, EndpointsSynced, EngineEventsReported, ItemsPlaced
from stream.core.items import InvalidField, Item
from stream.core.render import answer_ends, gather, held_by, match_entries, render_match
from stream.http import aiohttp_guard
from stream.http.auth import TokenFile
from stream.http.bodies import ApiError, endpoint_event, engine_events, invalid, match_query, placement
from stream.http.body_reader import BodyReader
from stream.http.digest import digest_without_blocking
from stream.http.models import EndpointDeletedRequest, ReadinessBody, check_placement
from stream.http.openapi import openapi_document
from stream.kafka.clients import MAX_REQUEST_BYTES, record_bytes
from stream.kafka.publisher import EventPublisher, LogUnavailable
from stream.metrics import Metrics

__all__ = ["ApiError", "HttpApi", "render_match"]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# A match of at most this many endpoint x item pairs is answered in one go (~1 ms at
# most on the 2-core test machine, the bench's 64 x 8 ~0.1 ms); a wider one in slices
# of about these many pairs (~0.2 ms each) and answer bytes (~0.5 ms), the loop turning
# in between.
_ONE_GO_PAIRS = 1024
_SLICE_PAIRS = 4096
_SLICE_BYTES = 128 * 1024


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")


def _error(status: int, code: str, message: str) -> web.Response:
    return _json({"error": {"code": code, "message": message}}, status)


_UNAUTHORIZED = orjson.dumps({"error": {
    "code": "unauthorized",
    "message": "missing or invalid bearer token: send 'Authorization: Bearer <token>'"}})
_INTERNAL = orjson.dumps({"error": {
    "code": "internal_error", "message": "the request failed inside the service; nothing was written"}})


def check_record_size(event: ItemsPlaced | EndpointsSynced | EngineEventsReported) -> None:
    """Refuse with 413, before anything is sent, an event that the log could never take:
    a record over the producer's ``max_request_size`` fails every time it is sent (it
    was a 503 "retry is safe", forever). A deletion always fits (one name)."""
    key = None if isinstance(event, EndpointsSynced) else event.endpoint.encode()
    size = record_bytes(key, encode_event(event))
    if size > MAX_REQUEST_BYTES:
        raise ApiError(413, "event_too_large",
                       f"the event would be a {size}-byte Kafka record, over the {MAX_REQUEST_BYTES} "
                       "bytes the event log takes (the producer's max_request_size): send fewer "
                       "items or endpoints, or shorter hashes, modalities or request_id")


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
        match_source: str = "auto",
    ) -> None:
        self.state = state
        self.match_source = match_source
        self.publisher = publisher
        self.metrics = metrics
        self.limits = limits
        self.is_ready = is_ready
        metrics.readiness = self._ready_now
        self.write_tokens = write_tokens
        self.match_tokens = match_tokens
        self.bodies = BodyReader(limits)

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
        aiohttp_guard.install()
        app = web.Application(client_max_size=self.limits.max_body_bytes,
                              handler_args=aiohttp_guard.handler_args())
        app.on_cleanup.append(self._close)
        add_post, add_get, route = app.router.add_post, app.router.add_get, self._route
        writes, matches = self.write_tokens, self.match_tokens
        add_post("/v1/match", route("/v1/match", self.match, matches))
        add_post("/v1/placements", route("/v1/placements", self.placements, writes))
        add_post("/v1/endpoint-events", route("/v1/endpoint-events", self.endpoint_events, writes))
        add_post("/v1/engine-events", route("/v1/engine-events", self.engine_events, writes))
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

    async def _close(self, app: web.Application) -> None:
        await self.bodies.close()

    async def _body(self, request: web.Request) -> list[bytes]:
        """The body as the chunks it came in, within ``max_body_bytes``.

        Not ``request.read()``: that takes whatever is buffered without a turn of the
        loop and copies it twice (16 MiB: a ~45 ms hold); here the loop turns every
        ``_SLICE_BYTES`` and a big body is never joined (it goes to the child in chunks).
        """
        limit = self.limits.max_body_bytes
        if (request.content_length or 0) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length or 0)
        chunks: list[bytes] = []
        size = since = 0
        content = request.content
        try:
            while chunk := await content.readany():
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=size)
                since += len(chunk)
                if since >= _SLICE_BYTES:
                    since = 0
                    await asyncio.sleep(0)
        except HttpProcessingError as exc:  # its text holds the bytes it refused: never echoed
            raise ApiError(400, "bad_request", f"{aiohttp_guard.describe(exc)} "
                                               f"({type(exc).__name__}); nothing was read") from None
        except ConnectionResetError:  # nobody to answer, and nothing to log but the count
            raise ApiError(400, "bad_request", "the connection closed before the whole body "
                                               "came; nothing was read") from None
        return chunks

    async def match(self, request: web.Request) -> web.StreamResponse:
        """Score candidate endpoints by the request items they probably hold.

        The body is read by ``stream.http.bodies.match_query`` (on the loop when small, else
        in the child process). A match of a few pairs is answered in one go; a wider one
        by ``_wide_match``.
        """
        chunks = await self._body(request)
        raw = self.bodies.small(chunks)
        query = match_query(raw, self.limits) if raw is not None else \
            await self.bodies.in_child(match_query, chunks)
        items, endpoints = query.items, query.endpoints
        if len(items) * len(endpoints) > _ONE_GO_PAIRS:
            return await self._wide_match(request, items, endpoints)
        requested, found = self.state.hits(items, endpoints)
        if self.state.engine.views or self.match_source == "engine":
            found, engine = self._engine_answer(items, requested, found)
            body = render_match(items, requested, found, engine)
        else:  # nobody reports: the estimate answers, at no extra cost
            body = render_match(items, requested, found)
        self.metrics.record_match(items, found)
        return web.Response(body=body, content_type="application/json")

    def _engine_answer(self, items: list[Item], requested: list[str],
                       found: dict[str, list[Item]]) -> tuple[dict[str, list[Item]], set[str]]:
        """The hits to answer (``found``'s for the estimate's endpoints, the engine views'
        for the others) and the endpoints answered from their engine views; counts the
        estimate's checks against every reporting endpoint's view on the way."""
        views = self.state.engine
        reporting = set(views.reporting(requested))
        truth = views.hits(items, reporting) if reporting else {}
        if reporting:
            self.metrics.count_checks(len(items), reporting, found, truth)
        return self._answer(requested, reporting, found, truth)

    def _answer(self, requested: list[str], reporting: set[str], found: dict[str, list[Item]],
                truth: dict[str, list[Item]]) -> tuple[dict[str, list[Item]], set[str]]:
        """Each endpoint's hits from the source ``match_source`` gives it: ``auto`` the
        engine view where it reported one, ``engine`` always (an endpoint that never
        reported holds nothing), ``estimate`` never."""
        mode = self.match_source
        if mode == "estimate" or not (reporting or mode == "engine"):
            return found, set()
        engine = set(requested) if mode == "engine" else reporting
        answer = {name: matched for name, matched in found.items() if name not in engine}
        answer.update(truth)
        return answer, engine

    async def _wide_match(self, request: web.Request, items: list[Item],
                          endpoints: list[str]) -> web.StreamResponse:
        """``render_match`` of ``CacheState.hits``, the same bytes, in slices.

        Which requested endpoints hold each item is read at one moment (``held_by``, in
        C); the per-endpoint lists and the answer are then built from that copy in
        slices of ~``_SLICE_PAIRS`` pairs and ~``_SLICE_BYTES`` bytes, the loop turning
        between them, so the view the worker goes on changing is never read half-way.
        The engine views' holders are read at the same moment and gathered, counted
        (the estimate's checks) and answered from the same way. The slices are sent as
        they are, never joined into one answer.
        """
        requested = list(dict.fromkeys(endpoints))
        held = held_by(self.state.holders, items, requested)
        views = self.state.engine
        reporting = views.reporting(requested)
        held_truth = held_by(views.holders, items, reporting) if reporting else []
        found: dict[str, list[Item]] = {}
        start = 0
        while start < len(items):
            await asyncio.sleep(0)
            start = gather(items, held, found, start, _SLICE_PAIRS)
        engine: set[str] = set()
        if reporting or self.match_source == "engine":
            truth: dict[str, list[Item]] = {}
            start = 0
            while start < len(held_truth):
                await asyncio.sleep(0)
                start = gather(items, held_truth, truth, start, _SLICE_PAIRS)
            step = _SLICE_PAIRS // len(items) + 1
            for first in range(0, len(reporting), step):  # counted in slices of ~_SLICE_PAIRS
                await asyncio.sleep(0)
                self.metrics.count_checks(len(items), set(reporting[first:first + step]), found, truth)
            await asyncio.sleep(0)
            found, engine = self._answer(requested, set(reporting), found, truth)
        best, holders, pairs = 0, {}, 0
        for endpoint, matched in found.items():  # hits counted in slices of ~_SLICE_PAIRS
            holders[endpoint] = matched
            pairs += len(matched)
            if pairs >= _SLICE_PAIRS:
                await asyncio.sleep(0)
                best = max(best, self.metrics.count_hits(holders))
                holders, pairs = {}, 0
        await asyncio.sleep(0)
        self.metrics.record_queries(items, max(best, self.metrics.count_hits(holders)))
        await asyncio.sleep(0)
        head, tail = answer_ends(items)
        blobs, group, size = [], [], 0  # entries, comma-joined by ~_SLICE_BYTES
        for part in match_entries(items, requested, found, engine):
            group.append(part)
            size += len(part)
            if size >= _SLICE_BYTES:
                blobs.append(b",".join(group))
                group, size = [], 0
                await asyncio.sleep(0)
        if group:
            blobs.append(b",".join(group))
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(head) + sum(map(len, blobs)) + len(blobs) - 1 + len(tail)
        try:
            await response.prepare(request)
            await response.write(head)
            for index, blob in enumerate(blobs):
                await response.write(b"," + blob if index else blob)
                await asyncio.sleep(0)  # a socket that takes it all never makes write() wait
            await response.write(tail)
        except ConnectionError:  # the client went away: nothing to answer
            pass
        return response

    async def _read(self, reader: Callable[[bytes, Limits], Any], request: web.Request) -> Any:
        return await self.bodies.read(reader, await self._body(request))

    async def placements(self, request: web.Request) -> web.Response:
        """Record that a request's items were sent to endpoints (one event per endpoint)."""
        checked = await self._read(placement, request)
        try:
            check_placement(self.limits, checked.endpoints, self.state.endpoints)
        except InvalidField as exc:
            raise invalid(exc) from None
        if not checked.items:
            return _json({"events": 0}, 202)
        events = [
            ItemsPlaced(endpoint=name, items=checked.items, request_id=checked.request_id)
            for name in dict.fromkeys(checked.endpoints)
        ]
        # they differ only in the endpoint: the largest record is the longest name's
        check_record_size(max(events, key=lambda e: len(orjson.dumps(e.endpoint)) + len(e.endpoint.encode())))
        return _json({"events": await self._publish(self.publisher.publish(events))}, 202)

    async def endpoint_events(self, request: web.Request) -> web.Response:
        """Record an endpoint deletion or a sync of the live set."""
        event = await self._read(endpoint_event, request)
        if isinstance(event, EndpointDeletedRequest):
            publish = self.publisher.publish([EndpointDeleted(endpoint=event.endpoint)])
        else:
            if not event.live:
                return _json({"events": 0}, 202)
            synced = EndpointsSynced(live=event.live)
            check_record_size(synced)
            publish = self.publisher.publish_sync(synced)
        return _json({"events": await self._publish(publish)}, 202)

    async def engine_events(self, request: web.Request) -> web.Response:
        """Record what a model server reports its own encoder cache did, as one event on
        the log keyed by the endpoint (its facts apply in order)."""
        checked = await self._read(engine_events, request)
        if not checked.events:
            return _json({"events": 0}, 202)
        views, limit = self.state.engine.views, self.limits.max_total_endpoints
        if checked.endpoint not in views and len(views) >= limit:
            raise ApiError(400, "invalid_request", f"endpoint: the view holds {len(views)} engine "
                           f"views, at most {limit} (max_total_endpoints): delete or sync gone "
                           "endpoints first")
        event = EngineEventsReported(endpoint=checked.endpoint, engine=checked.engine,
                                     events=checked.events)
        check_record_size(event)
        return _json({"events": await self._publish(self.publisher.publish([event]))}, 202)

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
        capacity, limit, views = self.state.capacity, int(raw_limit), self.state.engine
        body = {
            "endpoints": [row._asdict() for row in self.state.summary(limit)],
            "total_endpoints": len(self.state.endpoints),
            "capacity": {"mode": capacity.mode, "per_endpoint": capacity.per_endpoint},
            "digest": digest.value,
            "digest_settled": digest.settled,
        }
        if views.views:  # only once some endpoint reports its cache: the answer is as before
            body["engine_views"] = [{"endpoint": name, "items": items, "weight": weight}
                                    for name, items, weight in views.summary(limit)]
            body["total_engine_views"] = len(views.views)
        return _json(body)

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
        ``stream.worker.readiness``; a plain bool gives one without lag figures)."""
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
