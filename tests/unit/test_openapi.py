"""The OpenAPI document lists exactly the routes of the server, with CONTRACT's
error answers and the bearer scheme where a token file guards the route."""

from __future__ import annotations

import orjson
import pytest

from stream.config import Limits
from stream.core.cache import CacheState, Capacity
from stream.http.api import HttpApi
from stream.http.openapi import build_document, openapi_document
from stream.kafka.publisher import EventPublisher
from stream.metrics import Metrics


def app_routes() -> set[tuple[str, str]]:
    state = CacheState(Capacity.from_params())
    api = HttpApi(state, EventPublisher("127.0.0.1:1", "unused", 1.0), Metrics(state, dict),
                  Limits(), lambda: True)
    return {(method.lower(), path) for method, path in api.routes().routes()}


def documented(document: dict) -> set[tuple[str, str]]:
    return {(method, path) for path, methods in document["paths"].items() for method in methods}


def test_every_route_is_documented_and_every_documented_route_exists():
    assert documented(build_document(False, False)) == app_routes()


@pytest.mark.parametrize("writes,match", [(False, False), (True, False), (True, True)])
def test_guarded_routes_declare_the_bearer_scheme_and_401(writes, match):
    document = build_document(writes, match)
    assert document["openapi"].startswith("3.1")
    assert document["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": document["components"]["securitySchemes"]["bearer"]["description"]}
    guarded = {"/v1/placements": writes, "/v1/endpoint-events": writes, "/v1/engine-events": writes,
                   "/v1/state": writes, "/v1/match": match}
    for path, methods in document["paths"].items():
        for operation in methods.values():
            needs = guarded.get(path, False)
            assert operation["security"] == ([{"bearer": []}] if needs else [])
            assert ("401" in operation["responses"]) == needs


def test_writes_document_their_bodies_and_every_error_answer():
    paths = build_document(True, True)["paths"]
    error = {"$ref": "#/components/schemas/ErrorBody"}
    for path, ok in [("/v1/placements", "202"), ("/v1/endpoint-events", "202")]:
        operation = paths[path]["post"]
        assert operation["requestBody"]["required"] is True
        assert set(operation["responses"]) == {ok, "400", "401", "413", "503"}
        for code in ("400", "401", "413", "503"):
            assert operation["responses"][code]["content"]["application/json"]["schema"] == error
    # a match is refused 503 too: the body budget (server_busy), the body readers, the start
    assert set(paths["/v1/match"]["post"]["responses"]) == {"200", "400", "401", "413", "503"}


def test_every_reference_resolves():
    document = build_document(True, True)
    schemas = document["components"]["schemas"]
    raw = orjson.dumps(document).decode()
    import re
    for name in re.findall(r'"#/components/schemas/([^"]+)"', raw):
        assert name in schemas


def test_the_served_document_is_the_built_one():
    assert orjson.loads(openapi_document(True, False)) == build_document(True, False)
