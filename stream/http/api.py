"""The HTTP API of CONTRACT, served by ``stream.http.server`` on the worker's loop.

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
is read by a pool of child processes (``stream.http.body_reader``, writes before matches,
each body with a deadline), extraction stops at the limits (``stream.http.bodies``), a
match's answer is bounded (``max_match_pairs``) and a wide one is built in slices with
the loop turning between them; an event the log could never take
is refused before it is sent; and a request the server cannot parse is answered without
what it held (``stream.http.server``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from stream.config import Limits
from stream.core.cache import CacheState
from stream.core.codec import encode_event
from stream.core.events import EndpointDeleted, EndpointsSynced, EngineEventsReported, ItemsPlaced
from stream.core.items import InvalidField, Item
from stream.core.render import answer_ends, gather, held_by, match_entries, render_match
from stream.http.auth import TokenFile
from stream.http.bodies import (
    ApiError,
    MatchQuery,
    endpoint_event,
    engine_events,
    invalid,
    match_query,
    placement,
)
from stream.http.body_reader import DEADLINE_S, BodyReader
from stream.http.digest import digest_without_blocking
from stream.http.models import EndpointDeletedRequest, ReadinessBody, check_placement
from stream.http.openapi import openapi_document
from stream.http.server import Endpoint, HttpServer, Request, Response, Routes
from stream.kafka.clients import MAX_REQUEST_BYTES, record_bytes
from stream.kafka.publisher import EventPublisher, LogUnavailable
from stream.metrics import Metrics

__all__ = ["ApiError", "ApiRoutes", "HttpApi", "render_match"]

log = logging.getLogger(__name__)

#: Matches' bodies fill at most this share of the server's body budget: the rest is kept
#: for writes (placements, endpoint and engine events), which a flood of big matches (an
#: open route) must never get refused for want of room.
MATCH_BUDGET_SHARE = 0.75

Handler = Callable[[Request], Awaitable[Response]]
Now = Callable[[Request], Response | None]

# A match of at most this many endpoint x item pairs is answered in one go (~1 ms at
# most on the 2-core test machine, the bench's 64 x 8 ~0.1 ms); a wider one in slices
# of about these many pairs (~0.2 ms each) and answer bytes (~0.5 ms), the loop turning
# in between.
_ONE_GO_PAIRS = 1024
_SLICE_PAIRS = 4096
_SLICE_BYTES = 128 * 1024


def _json(payload: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status)


def _error(status: int, code: str, message: str) -> Response:
    return _json({"error": {"code": code, "message": message}}, status)


_UNAUTHORIZED = orjson.dumps({"error": {
    "code": "unauthorized",
    "message": "missing or invalid bearer token: send 'Authorization: Bearer <token>'"}})
_INTERNAL = orjson.dumps({"error": {
    "code": "internal_error", "message": "the request failed inside the service; nothing was written"}})
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="mmcache"'}


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


class ApiRoutes(Routes):
    """The routes as ``stream.http.server`` asks for them: ``{path: {method: endpoint}}``
    (a GET route takes HEAD too), and CONTRACT's JSON 404 or 405 (with ``Allow``) for
    every other request, counted and timed as the route ``unmatched``."""

    def __init__(self, table: dict[str, dict[str, Endpoint]], unmatched: Callable[[str], Endpoint],
                 max_body: int) -> None:
        self.table = table
        self.max_body = max_body
        self._not_found = unmatched("")
        self._not_allowed = {path: unmatched(", ".join(sorted(methods))) for path, methods in table.items()}

    def resolve(self, method: str, path: str) -> Endpoint:
        """The endpoint of ``method`` on ``path``, else the one answering 404 or 405."""
        methods = self.table.get(path)
        if methods is None:
            return self._not_found
        endpoint = methods.get(method)
        if endpoint is None and method == "HEAD":
            endpoint = methods.get("GET")
        return endpoint if endpoint is not None else self._not_allowed[path]

    def routes(self) -> set[tuple[str, str]]:
        """Every (method, path) served (HEAD aside: it mirrors GET)."""
        return {(method, path) for path, methods in self.table.items() for method in methods}


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
        body_readers: int | None = None,
        body_read_timeout_s: float = DEADLINE_S,
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
        self.bodies = BodyReader(limits, readers=body_readers, deadline_s=body_read_timeout_s)
        metrics.registry.register(self.bodies)

    def routes(self) -> ApiRoutes:
        """Every route of CONTRACT, each answering its errors as CONTRACT's JSON, timed
        and counted by route (``_endpoint``).

        ``/healthz`` and ``/readyz`` are open (probes carry no token); so are ``/metrics``
        (Prometheus scrapes pods without credentials by default; it holds counts and pod
        names, never item hashes, and changes nothing) and ``/openapi.json`` (the public
        contract, the same for every deployment).
        """
        endpoint, writes, matches = self._endpoint, self.write_tokens, self.match_tokens
        table = {
            "/v1/match": {"POST": endpoint("/v1/match", self.match, matches, now=self.match_now,
                                           budget_share=MATCH_BUDGET_SHARE)},
            "/v1/placements": {"POST": endpoint("/v1/placements", self.placements, writes)},
            "/v1/endpoint-events": {"POST": endpoint("/v1/endpoint-events", self.endpoint_events, writes)},
            "/v1/engine-events": {"POST": endpoint("/v1/engine-events", self.engine_events, writes)},
            "/v1/state": {"GET": endpoint("/v1/state", self.state_summary, writes)},
            "/healthz": {"GET": endpoint("/healthz", self.healthz, now=self.healthz_now)},
            "/readyz": {"GET": endpoint("/readyz", self.readyz, now=self.readyz_now)},
            "/metrics": {"GET": endpoint("/metrics", self.metrics_text)},
            "/openapi.json": {"GET": endpoint("/openapi.json", self.openapi)},
        }
        return ApiRoutes(table, self._unmatched, self.limits.max_body_bytes)

    def server(self) -> HttpServer:
        """The HTTP server of these routes, within the limits' connection cap and body
        budget (its figures exported with the metrics); closing it stops the body
        reader's child too."""
        server = HttpServer(self.routes(), on_close=self.bodies.close,
                            max_connections=self.limits.max_connections, body_budget=self.limits.body_budget)
        self.metrics.http_server = server
        return server

    def _endpoint(self, name: str, handler: Handler, tokens: TokenFile | None = None,
                  now: Now | None = None, budget_share: float = 1.0) -> Endpoint:
        """``handler`` (and its synchronous ``now``, tried first) answering every error as
        CONTRACT's JSON body, timed by route, and behind a bearer token when ``tokens`` is
        given (checked once the headers came, before anything of the body is read)."""
        timer, count = self.metrics.request_timer(name), self.metrics.count_request
        too_large_body = orjson.dumps({"error": {"code": "body_too_large", "message":
                                       f"body over {self.limits.max_body_bytes} bytes (max_body_bytes)"}})

        def answered(response: Response, started: float) -> Response:
            timer.observe(time.perf_counter() - started)
            count(name, response.status)
            return response

        def failed(exc: Exception) -> Response:
            if isinstance(exc, ApiError):
                return _error(exc.status, exc.code, exc.message)
            log.exception("unexpected error on %s", name)
            return Response(_INTERNAL, 500)

        async def handle(request: Request) -> Response:
            started = time.perf_counter()
            try:
                response = await handler(request)
            except Exception as exc:  # noqa: BLE001 - every failure is CONTRACT's JSON
                response = failed(exc)
            return answered(response, started)

        def at_once(request: Request) -> Response | None:
            started = time.perf_counter()
            try:
                response = now(request)  # type: ignore[misc]
            except Exception as exc:  # noqa: BLE001
                response = failed(exc)
            return None if response is None else answered(response, started)

        def too_large(request: Request) -> Response:
            return answered(Response(too_large_body, 413), time.perf_counter())

        def head(request: Request) -> Response | None:
            if tokens.allows(request.headers.get("authorization")):  # type: ignore[union-attr]
                return None
            return answered(Response(_UNAUTHORIZED, 401, headers=_CHALLENGE), time.perf_counter())

        return Endpoint(handle, too_large, head if tokens is not None else None,
                        at_once if now is not None else None, budget_share)

    def _unmatched(self, allow: str) -> Endpoint:
        """404 (``allow`` empty: no route has this path) or 405 naming the methods the
        path takes, answered once the headers came (the body is dropped)."""
        if allow:
            methods = set(allow.split(", "))
            if "GET" in methods:
                methods.add("HEAD")
            answer = orjson.dumps({"error": {"code": "method_not_allowed", "message": "Method Not Allowed"}})
            status, headers = 405, {"Allow": ",".join(sorted(methods))}
        else:
            answer = orjson.dumps({"error": {"code": "not_found", "message": "Not Found"}})
            status, headers = 404, None
        count = self.metrics.count_request
        timer = self.metrics.request_timer("unmatched")

        def refuse(request: Request) -> Response:
            started = time.perf_counter()
            response = Response(answer, status, headers=headers)
            timer.observe(time.perf_counter() - started)
            count("unmatched", status)
            return response

        async def handle(request: Request) -> Response:
            return refuse(request)

        return Endpoint(handle, refuse, refuse)

    def match_now(self, request: Request) -> Response | None:
        """A match answered at once: its body small enough to read on the loop and its
        answer narrow enough to build in one go; else ``None`` (``match`` answers it)."""
        raw = self.bodies.small(request.chunks)
        if raw is None:
            return None
        query = match_query(raw, self.limits)
        if len(query.items) * len(query.endpoints) > _ONE_GO_PAIRS:
            request.scratch = query
            return None
        return self._narrow_match(query)

    async def match(self, request: Request) -> Response:
        """Score candidate endpoints by the request items they probably hold.

        The body is read by ``stream.http.bodies.match_query`` (on the loop when small, else
        by the pool of child processes). A match of a few pairs is answered in one go; a wider
        one by ``_wide_match``.
        """
        query = request.scratch if isinstance(request.scratch, MatchQuery) else None
        if query is None:
            chunks = request.chunks
            raw = self.bodies.small(chunks)
            query = match_query(raw, self.limits) if raw is not None else \
                await self.bodies.in_child(match_query, chunks, request.remote)
        if len(query.items) * len(query.endpoints) > _ONE_GO_PAIRS:
            return await self._wide_match(query.items, query.endpoints)
        return self._narrow_match(query)

    def _narrow_match(self, query: MatchQuery) -> Response:
        items = query.items
        requested, found = self.state.index.hits(items, query.endpoints)
        if self.state.lrus.engine.views or self.match_source == "engine":
            found, engine = self._engine_answer(items, requested, found)
            body = render_match(items, requested, found, engine)
        else:  # nobody reports: the estimate answers, at no extra cost
            body = render_match(items, requested, found)
        self.metrics.record_match(items, found)
        return Response(body)

    def _engine_answer(self, items: list[Item], requested: list[str],
                       found: dict[str, list[Item]]) -> tuple[dict[str, list[Item]], set[str]]:
        """The hits to answer (``found``'s for the estimate's endpoints, the engine views'
        for the others) and the endpoints answered from their engine views; counts the
        estimate's checks against every reporting endpoint's view on the way."""
        views = self.state.lrus.engine
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

    async def _wide_match(self, items: list[Item], endpoints: list[str]) -> Response:
        """``render_match`` of ``Index.hits``, the same bytes, in slices.

        Which requested endpoints hold each item is read at one moment (``held_by``, in
        C); the per-endpoint lists and the answer are then built from that copy in
        slices of ~``_SLICE_PAIRS`` pairs and ~``_SLICE_BYTES`` bytes, the loop turning
        between them, so the view the worker goes on changing is never read half-way.
        The engine views' holders are read at the same moment and gathered, counted
        (the estimate's checks) and answered from the same way. The slices are sent as
        they are (the server writes them one by one, the loop turning in between), never
        joined into one answer.
        """
        requested = list(dict.fromkeys(endpoints))
        held = held_by(self.state.index.holders, items, requested)
        views = self.state.lrus.engine
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
        parts = [head, *(b"," + blob if index else blob for index, blob in enumerate(blobs)), tail]
        return Response(parts=parts)

    async def _read(self, reader: Callable[[bytes, Limits], Any], request: Request) -> Any:
        return await self.bodies.read(reader, request.chunks, request.remote)

    async def placements(self, request: Request) -> Response:
        """Record that a request's items were sent to endpoints (one event per endpoint)."""
        checked = await self._read(placement, request)
        try:
            check_placement(self.limits, checked.endpoints, self.state.lrus.endpoints)
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

    async def endpoint_events(self, request: Request) -> Response:
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

    async def engine_events(self, request: Request) -> Response:
        """Record what a model server reports its own encoder cache did, as one event on
        the log keyed by the endpoint (its facts apply in order)."""
        checked = await self._read(engine_events, request)
        if not checked.events:
            return _json({"events": 0}, 202)
        views, limit = self.state.lrus.engine.views, self.limits.max_total_endpoints
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

    async def state_summary(self, request: Request) -> Response:
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
        lrus, limit = self.state.lrus, int(raw_limit)
        capacity, views = lrus.capacity, lrus.engine
        body = {
            "endpoints": [row._asdict() for row in self.state.index.summary(limit)],
            "total_endpoints": len(lrus.endpoints),
            "capacity": {"mode": capacity.mode, "per_endpoint": capacity.per_endpoint},
            "digest": digest.value,
            "digest_settled": digest.settled,
        }
        if views.views:  # only once some endpoint reports its cache: the answer is as before
            body["engine_views"] = [{"endpoint": name, "items": items, "weight": weight}
                                    for name, items, weight in views.summary(limit)]
            body["total_engine_views"] = len(views.views)
        return _json(body)

    async def openapi(self, request: Request) -> Response:
        """The OpenAPI 3.1 document of this API, from the models of ``schemas/``."""
        document = openapi_document(self.write_tokens is not None, self.match_tokens is not None)
        return Response(document)

    def _ready_now(self) -> bool:
        """Whether /readyz would answer 200 now (the ``mmcache_ready`` gauge)."""
        body = self.is_ready()
        return body if isinstance(body, bool) else body.status == "ready"

    def healthz_now(self, request: Request) -> Response:
        """The process is alive."""
        return _HEALTHY

    async def healthz(self, request: Request) -> Response:
        """The process is alive."""
        return _HEALTHY

    def readyz_now(self, request: Request) -> Response:
        """CONTRACT's readiness body: 200 when ready, else 503 (``is_ready`` gives the body,
        ``stream.worker.readiness``; a plain bool gives one without lag figures)."""
        body = self.is_ready()
        if isinstance(body, bool):
            body = ReadinessBody(status="ready" if body else "not_ready",
                                 reason="ready" if body else "not ready",
                                 lag_events=None, staleness_seconds=None)
        return _json(body.model_dump(), 200 if body.status == "ready" else 503)

    async def readyz(self, request: Request) -> Response:
        """As ``readyz_now``."""
        return self.readyz_now(request)

    async def metrics_text(self, request: Request) -> Response:
        """Prometheus text exposition."""
        return Response(generate_latest(self.metrics.registry), content_type=CONTENT_TYPE_LATEST)


_HEALTHY = Response(orjson.dumps({"status": "ok"}))
