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
