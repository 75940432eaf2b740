"""The HTTP app's own answers: errors as CONTRACT's JSON for every route (no middleware),
and /v1/match refusing bad bodies with pydantic's wording even when read by orjson."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from stream.config import Limits
from stream.core.cache import CacheState, Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.items import Item
from stream.http_api import ApiError, HttpApi
from stream.kafka.publisher import EventPublisher
from stream.metrics import Metrics

DEFAULT_LIMITS = Limits()


def make_api(limits: Limits = DEFAULT_LIMITS) -> HttpApi:
    state = CacheState(Capacity.from_params(6))
    state.apply(ItemsPlaced(endpoint="ns/a", items=[Item("h1", 1, "image")]), Position(0, 0))
    return HttpApi(state, EventPublisher("127.0.0.1:1", "unused", 1.0), Metrics(state, dict),
                   limits, lambda: True)


def requests(calls: list[tuple[str, str, bytes | None]], limits: Limits = DEFAULT_LIMITS) -> list[tuple]:
    """(status, JSON answer or raw bytes) of each call against a fresh app."""
    api = make_api(limits)

    async def run() -> list[tuple]:
        answers = []
        async with TestClient(TestServer(api.application())) as client:
            for method, path, data in calls:
                response = await client.request(method, path, data=data)
                raw = await response.read()
                answers.append((response.status, orjson.loads(raw) if raw else raw))
        return answers

    return asyncio.run(run())


def error(code: str, message: str) -> dict:
    return {"error": {"code": code, "message": message}}


def test_unrouted_requests_get_json_404_and_405():
    assert requests([("GET", "/nope", None), ("GET", "/v1/match", None),
                     ("DELETE", "/v1/state", None), ("HEAD", "/healthz", None)]) == [
        (404, error("not_found", "Not Found")),
        (405, error("method_not_allowed", "Method Not Allowed")),
        (405, error("method_not_allowed", "Method Not Allowed")),
        (200, b""),
    ]


def test_oversized_match_body_gets_413():
    [(status, answer)] = requests([("POST", "/v1/match", b'{"pad": "' + b"x" * 300 + b'"}')],
                                  Limits(max_body_bytes=100))
    assert (status, answer["error"]["code"]) == (413, "body_too_large")


def feature(**fields) -> bytes:
    return orjson.dumps({"endpoints": ["ns/a"],
                         "body": {"tokenized": {"prompts": [{"mm_features": [fields]}]}}})


@pytest.mark.parametrize("raw", [
    b"{not json", b'{"endpoints": "x", "body": {}}', b'{"endpoints": ["a\\u0001"], "body": {}}',
    b'{"endpoints": ["a"], "body": {"x": ' + b"[" * 260 + b"]" * 260 + b"}}",
    feature(hash="h1", modality="image", length=2**31),
    feature(hash="h1", modality="image", length=1.5),
    b'{"endpoints": ["ns/a"], "body": {"tokenized": {"prompts": [{"mm_features": [{"hash": "h1", '
    b'"length": 123456789012345678901234567890}]}]}}}',  # orjson reads it as a float
    feature(hash="h" * 300, modality="image"),
])
def test_bad_match_bodies_get_the_pydantic_paths_error(raw):
    [(status, answer)] = requests([("POST", "/v1/match", raw)])
    with pytest.raises(ApiError) as refused:
        make_api()._match_query(raw)
    assert (status, answer) == (400, error(refused.value.code, refused.value.message))


def test_a_huge_negative_length_is_read_as_an_integer():
    raw = (b'{"endpoints": ["ns/a"], "body": {"tokenized": {"prompts": [{"mm_features": '
           b'[{"hash": "h1", "modality": "image", "length": -123456789012345678901234567890}]}]}}}')
    [(status, answer)] = requests([("POST", "/v1/match", raw)])
    assert status == 200
    assert answer["endpoints"][0]["matched_items"] == [{"hash": "h1", "size": 1, "modality": "image"}]


@pytest.mark.parametrize("limit", ["²", "9" * 5000, "-1", "1.5", "x"])
def test_a_bad_state_limit_is_400_never_500(limit):
    [(status, answer)] = requests([("GET", f"/v1/state?limit={limit}", None)])
    assert (status, answer) == (400, error("invalid_request", "limit: must be a non-negative integer"))


def test_405_says_which_methods_the_path_takes():
    api = make_api()

    async def run():
        async with TestClient(TestServer(api.application())) as client:
            response = await client.request("DELETE", "/v1/placements")
            return response.status, response.headers.get("Allow")

    status, allow = asyncio.run(run())
    assert status == 405 and allow == "POST"


def test_an_unexpected_failure_is_a_json_500_that_reveals_nothing(monkeypatch):
    api = make_api()

    def broken(limit):
        raise RuntimeError("internal detail /secret/path")

    monkeypatch.setattr(api.state, "summary", broken)

    async def run():
        async with TestClient(TestServer(api.application())) as client:
            response = await client.get("/v1/state")
            return response.status, orjson.loads(await response.read())

    status, answer = asyncio.run(run())
    assert status == 500 and answer["error"]["code"] == "internal_error"
    assert "secret" not in answer["error"]["message"]


def test_an_unknown_state_parameter_is_400_not_ignored():
    [(status, answer)] = requests([("GET", "/v1/state?limt=5", None)])
    assert (status, answer["error"]["code"]) == (400, "invalid_request")
    assert "limt" in answer["error"]["message"]


# Issue 10, item 8: validation means what the schema says, on every path.

def _placement(**item) -> bytes:
    return orjson.dumps({"endpoints": ["ns/a"], "items": [{"hash": "h", "modality": "image", **item}]})


@pytest.mark.parametrize("size", ["1", True, 1.0, "x"])
def test_a_size_that_is_not_a_json_integer_is_refused(size):
    [(status, answer)] = requests([("POST", "/v1/placements", _placement(size=size))])
    assert status == 400
    assert answer["error"]["message"] == "items[0].size: Input should be a valid integer"


@pytest.mark.parametrize("length", ["1", True])
def test_a_feature_length_that_is_not_an_integer_is_refused_on_match_and_placement(length):
    body = {"tokenized": {"prompts": [{"mm_features": [{"hash": "h", "modality": "image",
                                                         "length": length}]}]}}
    answers = requests([("POST", "/v1/match", orjson.dumps({"endpoints": ["ns/a"], "body": body})),
                        ("POST", "/v1/placements", orjson.dumps({"endpoints": ["ns/a"], "body": body}))])
    where = "body.tokenized.prompts[0].mm_features[0].length: must be an integer"
    assert answers == [(400, error("invalid_request", where))] * 2


def test_request_id_and_endpoints_are_strict_on_the_fast_path_and_the_fallback():
    answers = requests([
        ("POST", "/v1/match", b'{"endpoints": ["ns/a"], "body": {}, "request_id": 7}'),
        ("POST", "/v1/placements", b'{"endpoints": ["ns/a"], "request_id": 7, "items": []}'),
        ("POST", "/v1/endpoint-events", b'{"type": "sync", "live": ["ns/a", 3]}'),
    ])
    assert [a[1]["error"]["message"] for a in answers] == [
        "request_id: Input should be a valid string",
        "request_id: Input should be a valid string",
        "live[1]: Input should be a valid string",
    ]


def test_every_error_location_is_written_with_brackets_and_every_bound_is_named():
    long_name = "n" * 254
    answers = requests([
        ("POST", "/v1/placements", _placement(size=2**31)),
        ("POST", "/v1/placements", _placement(size=0)),
        ("POST", "/v1/placements", orjson.dumps({"endpoints": [long_name], "items": []})),
        ("POST", "/v1/match", orjson.dumps({"endpoints": ["ok", long_name], "body": {}})),
        ("POST", "/v1/endpoint-events", orjson.dumps({"type": "deleted", "endpoint": long_name})),
        ("POST", "/v1/placements", orjson.dumps({"endpoints": ["ns/a"], "items": [
            {"hash": f"h{i}", "size": 1, "modality": "image"} for i in range(3)]})),
    ], Limits(max_items=2))
    messages = [a[1]["error"]["message"] for a in answers]
    assert messages[:2] == ["items[0].size: must be from 1 to 2147483647 (the item size bound)"] * 2
    assert messages[2] == "endpoints[0]: String should have at most 253 characters (max_endpoint_chars)"
    assert messages[3] == "endpoints[1]: String should have at most 253 characters (max_endpoint_chars)"
    assert messages[4] == "endpoint: String should have at most 253 characters (max_endpoint_chars)"
    assert messages[5] == "items: at most 2 items (max_items)"
    assert not any(".0" in m or ".1." in m for m in messages)


def test_answers_are_counted_by_route_and_code_and_readiness_is_a_gauge():
    api = make_api()

    async def run() -> str:
        async with TestClient(TestServer(api.application())) as client:
            await client.post("/v1/match", data=b'{"endpoints": [], "body": {}}')
            await client.post("/v1/match", data=b"{bad")
            await client.get("/nope")
            return await (await client.get("/metrics")).text()

    text = asyncio.run(run())
    assert 'mmcache_http_requests_total{code="200",route="/v1/match"} 1.0' in text
    assert 'mmcache_http_requests_total{code="400",route="/v1/match"} 1.0' in text
    assert 'mmcache_http_requests_total{code="404",route="unmatched"} 1.0' in text
    assert "mmcache_ready 1.0" in text
