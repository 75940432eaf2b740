"""The OpenAPI 3.1 document of the HTTP API, built from the pydantic models of
``stream.http.models`` (the ones ``schemas/`` is written from), so the two cannot drift.

A running service serves the document of its own configuration: a route behind a
token file declares the bearer scheme as required, an open one declares none. A unit
test checks that the document and the API's routes (``HttpApi.routes``) list the same routes.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import orjson
from pydantic import TypeAdapter

from stream.http import models as api_models

__all__ = ["ROUTES", "build_document", "openapi_document"]

_REF = "#/components/schemas/{model}"

MODELS: dict[str, Any] = {
    "MatchRequest": api_models.MatchRequest,
    "MatchResponse": api_models.MatchResponse,
    "PlacementRequest": api_models.PlacementRequest,
    "EndpointEventRequest": api_models.EndpointEventRequest,
    "EngineEventsRequest": api_models.EngineEventsRequest,
    "EventsAccepted": api_models.EventsAccepted,
    "StateResponse": api_models.StateResponse,
    "ErrorBody": api_models.ErrorBody,
    "ReadinessBody": api_models.ReadinessBody,
}

_ERRORS = {
    400: "Not valid JSON, not of the right shape, or over a limit (the message names the field "
         "or the limit); nothing was written",
    401: "Missing or wrong bearer token; nothing was written",
    413: "Body over max_body_bytes or max_body_values (code body_too_large), or an event that the "
         "event log could never take, over the producer's max_request_size (code event_too_large); "
         "nothing was written",
    503: "Not taken now, nothing was written: the event log did not acknowledge the write "
         "within produce_timeout_s (code log_unavailable: it may still be written, retry is "
         "safe), too many writes wait for it (code overloaded), the bodies in flight fill the "
         "server's budget (code server_busy, with Retry-After), no body reader took the body in "
         "time (code body_reader_unavailable), or the service is starting (code starting)",
}

# (method, path, summary, request model, success status, success model, error statuses, guard)
# guard: "writes" (--auth-token-file), "match" (--match-auth-token-file) or None (always open)
ROUTES: list[tuple[str, str, str, str | None, int, str | None, tuple[int, ...], str | None]] = [
    ("post", "/v1/match", "Score candidate endpoints by the request items they probably hold",
     "MatchRequest", 200, "MatchResponse", (400, 413, 503), "match"),
    ("post", "/v1/placements", "Record that a request's items were sent to endpoints",
     "PlacementRequest", 202, "EventsAccepted", (400, 413, 503), "writes"),
    ("post", "/v1/endpoint-events", "Record an endpoint deletion or a sync of the live set",
     "EndpointEventRequest", 202, "EventsAccepted", (400, 413, 503), "writes"),
    ("post", "/v1/engine-events", "Record what a model server reports its own encoder cache "
     "did (stored, removed, cleared, applied in order): its engine view", "EngineEventsRequest",
     202, "EventsAccepted", (400, 413, 503), "writes"),
    ("get", "/v1/state", "Per-endpoint counts, the capacity and the digest of the whole state",
     None, 200, "StateResponse", (400,), "writes"),
    ("get", "/healthz", "The process is alive", None, 200, None, (), None),
    ("get", "/readyz", "Ready to answer /v1/match: 503 until the view is loaded and caught up "
     "after start, or while it lags more than --max-lag-events; the body says why and how stale",
     None, 200, "ReadinessBody", (503,), None),
    ("get", "/metrics", "Prometheus text exposition", None, 200, None, (), None),
    ("get", "/openapi.json", "This document", None, 200, None, (), None),
]

_OBJECT = {"type": "object"}


def _components() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for name, model in MODELS.items():
        schema = TypeAdapter(model).json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[name] = schema
    return schemas


def _json_content(model: str | None) -> dict[str, Any]:
    schema = _OBJECT if model is None else {"$ref": _REF.format(model=model)}
    return {"application/json": {"schema": schema}}


def _operation(path: str, summary: str, request: str | None, status: int, response: str | None,
               errors: tuple[int, ...], guarded: bool) -> dict[str, Any]:
    success: dict[str, Any] = {"description": "OK" if status == 200 else "Accepted: durably in the log"}
    if path == "/metrics":
        success["content"] = {"text/plain": {"schema": {"type": "string"}}}
    else:
        success["content"] = _json_content(response)
    responses: dict[str, Any] = {str(status): success}
    for code in (*errors, *((401,) if guarded else ())):
        content = _json_content("ReadinessBody" if path == "/readyz" else "ErrorBody")
        responses[str(code)] = {"description": _ERRORS.get(code, "Not ready"), "content": content}
    responses = dict(sorted(responses.items()))
    if guarded:
        responses["401"]["headers"] = {
            "WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}}
    operation: dict[str, Any] = {"summary": summary, "operationId": _operation_id(path),
                                 "responses": responses, "security": [{"bearer": []}] if guarded else []}
    if request is not None:
        operation["requestBody"] = {"required": True, "content": _json_content(request)}
    if path == "/v1/state":
        operation["parameters"] = [{
            "name": "limit", "in": "query", "required": False,
            "description": "at most this many endpoints, most items first",
            "schema": {"type": "integer", "minimum": 0, "default": 100}}]
    return operation


def _operation_id(path: str) -> str:
    return path.strip("/").replace("/", "_").replace("-", "_").replace(".", "_")


def build_document(writes_need_token: bool, match_needs_token: bool) -> dict[str, Any]:
    """The document of a service whose writes (and ``/v1/state``) and whose match need a
    bearer token, or not."""
    guards = {"writes": writes_need_token, "match": match_needs_token, None: False}
    paths: dict[str, Any] = {}
    for method, path, summary, request, status, response, errors, guard in ROUTES:
        paths.setdefault(path, {})[method] = _operation(
            path, summary, request, status, response, errors, guards[guard])
    return {
        "openapi": "3.1.0",
        "info": {"title": "mmcache", "version": "1",
                 "description": "Shared, durable, replayable encoder-cache affinity index"},
        "paths": paths,
        "components": {
            "schemas": _components(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "a token of --auth-token-file "
                                                          "(or --match-auth-token-file for /v1/match)"}},
        },
    }


@lru_cache(maxsize=4)
def openapi_document(writes_need_token: bool = False, match_needs_token: bool = False) -> bytes:
    """``build_document`` as JSON bytes, built once per configuration."""
    return orjson.dumps(build_document(writes_need_token, match_needs_token))
