"""The HTTP app's own answers: errors as CONTRACT's JSON for every route (no middleware),
and /v1/match refusing bad bodies with pydantic's wording even when read by orjson."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from stream.config import Limits
from stream.core.cache import CacheState, Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.index import Index
from stream.core.items import Item
from stream.core.render import render_match
from stream.http.api import ApiError, HttpApi
from stream.http.bodies import checked_match_query
from stream.kafka.publisher import EventPublisher
from stream.metrics import Metrics
from tests.unit.served import listening, served

DEFAULT_LIMITS = Limits()


def make_api(limits: Limits = DEFAULT_LIMITS) -> HttpApi:
    state = CacheState(Capacity.from_params(6))
    state.fold.apply(ItemsPlaced(endpoint="ns/a", items=[Item("h1", 1, "image")]), Position(0, 0))
    return HttpApi(state, EventPublisher("127.0.0.1:1", "unused", 1.0), Metrics(state, dict),
                   limits, lambda: True)


def requests(calls: list[tuple[str, str, bytes | None]], limits: Limits = DEFAULT_LIMITS) -> list[tuple]:
    """(status, JSON answer or raw bytes) of each call against a fresh app."""
    api = make_api(limits)

    async def run() -> list[tuple]:
        answers = []
        async with served(api) as client:
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
        checked_match_query(raw, DEFAULT_LIMITS)
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
        async with served(api) as client:
            response = await client.request("DELETE", "/v1/placements")
            return response.status, response.headers.get("Allow")

    status, allow = asyncio.run(run())
    assert status == 405 and allow == "POST"


def test_an_unexpected_failure_is_a_json_500_that_reveals_nothing(monkeypatch):
    api = make_api()

    def broken(index, limit):
        raise RuntimeError("internal detail /secret/path")

    monkeypatch.setattr(Index, "summary", broken)

    async def run():
        async with served(api) as client:
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
        async with served(api) as client:
            await client.post("/v1/match", data=b'{"endpoints": [], "body": {}}')
            await client.post("/v1/match", data=b"{bad")
            await client.get("/nope")
            return await (await client.get("/metrics")).text()

    text = asyncio.run(run())
    assert 'mmcache_http_requests_total{code="200",route="/v1/match"} 1.0' in text
    assert 'mmcache_http_requests_total{code="400",route="/v1/match"} 1.0' in text
    assert 'mmcache_http_requests_total{code="404",route="unmatched"} 1.0' in text
    assert "mmcache_ready 1.0" in text


# Issue 15, findings 2 and 3: no request holds the loop, no event the log cannot take is sent.

def wide_api(endpoints: int, held: dict[str, list[Item]], limits: Limits = DEFAULT_LIMITS) -> HttpApi:
    state = CacheState(Capacity.from_params(None, None))
    for offset, (name, items) in enumerate(held.items()):
        state.fold.apply(ItemsPlaced(endpoint=name, items=items), Position(0, offset))
    return HttpApi(state, EventPublisher("127.0.0.1:1", "unused", 1.0), Metrics(state, dict),
                   limits, lambda: True)


def answers_of(api: HttpApi, calls: list[tuple[str, str, bytes]]) -> list[tuple[int, bytes]]:
    async def run() -> list[tuple[int, bytes]]:
        async with served(api) as client:
            out = []
            for method, path, data in calls:
                response = await client.request(method, path, data=data)
                out.append((response.status, await response.read()))
            return out

    return asyncio.run(run())


def test_a_wide_match_is_answered_in_slices_with_the_bytes_of_the_one_go_answer(monkeypatch):
    import random

    import stream.http.api

    monkeypatch.setattr(stream.http.api, "_SLICE_PAIRS", 256)  # many slices of hits and entries

    rng = random.Random(7)
    items = [Item(f"h{i}", rng.randint(1, 9), rng.choice(["image", "video", "a\"b"])) for i in range(64)]
    names = [f"ns/pod-{i}" for i in range(200)] + ['ns/"quoted"', "ns/back\\slash", "ns/ünï"]
    held = {name: rng.sample(items, rng.randint(1, 40)) for name in names if rng.random() < 0.7}
    api = wide_api(len(names), held)
    asked = names + ["ns/unknown", names[3], names[5]]  # unknown and repeated names too
    rng.shuffle(asked)
    body = {"endpoints": asked, "body": {"generate": {"features": {"mm_hashes": {"image": [i.hash for i in items]}}}}}
    [(status, answer)] = answers_of(api, [("POST", "/v1/match", orjson.dumps(body))])
    request_items = [Item(i.hash, 1, "image") for i in items]
    assert status == 200 and len(asked) * len(items) > 1024  # the sliced path
    assert answer == render_match(request_items, *api.state.index.hits(request_items, asked))
    assert orjson.loads(answer)["endpoints"][0]["endpoint"] == asked[0]
    one_go = Metrics(api.state, dict)  # hits counted in slices: the same figures as in one go
    one_go.record_match(request_items, api.state.index.hits(request_items, asked)[1])
    assert api.metrics._hits == one_go._hits and sum(one_go._hits.values()) > 10 * 256
    assert api.metrics._queries == one_go._queries
    assert (api.metrics.hit_ratio.counts, api.metrics.hit_ratio.sum) == (one_go.hit_ratio.counts, one_go.hit_ratio.sum)


def test_a_match_over_max_match_pairs_is_refused_before_matching():
    body = {"endpoints": [f"e{i}" for i in range(5)],
            "body": {"generate": {"features": {"mm_hashes": {"image": ["a", "b", "c"]}}}}}
    [(status, answer)] = requests([("POST", "/v1/match", orjson.dumps(body))], Limits(max_match_pairs=14))
    assert (status, answer) == (400, error("invalid_request", "endpoints x body items: 5 x 3 pairs, at most "
                                           "14 (max_match_pairs): name fewer endpoints"))
    [(status, _)] = requests([("POST", "/v1/match", orjson.dumps(body))], Limits(max_match_pairs=15))
    assert status == 200


def test_the_default_limits_bound_the_widest_answer():
    limits = Limits()
    assert limits.max_match_pairs == 16_384  # 16 endpoints x 1,024 items, or 4,096 x 4: ~2 MB
    assert limits.max_references == 4 * limits.max_items and limits.max_modality_chars == 64


def test_a_modality_over_its_bound_is_refused_on_match_and_placement():
    feature = {"hash": "h1", "modality": "m" * 65}
    answers = requests([
        ("POST", "/v1/match", orjson.dumps({"endpoints": ["ns/a"], "body": {"tokenized": {"prompts": [{"mm_features": [feature]}]}}})),
        ("POST", "/v1/placements", orjson.dumps({"endpoints": ["ns/a"], "items": [{**feature, "size": 1}]})),
    ])
    assert [a[1]["error"]["message"] for a in answers] == [
        "body items[0].modality: at most 64 characters (max_modality_chars)",
        "items[0].modality: at most 64 characters (max_modality_chars)",
    ]


BODIES = [
    orjson.dumps({"endpoints": ["ns/a", "ns/b"], "body": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"u{i}"}} for i in range(20)]}]}}),
    orjson.dumps({"endpoints": ["ns/a"], "body": {"tokenized": {"prompts": [{"mm_features": [
        {"hash": "h1", "modality": "image", "length": 3}]}]}}}),
    orjson.dumps({"endpoints": ["ns/a"], "body": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"u{i}"}} for i in range(1100)]}]}}),
    orjson.dumps({"endpoints": ["ns/a"], "body": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "same"}}] * 5000}]}}),
    b"{not json",
    b'{"endpoints": ["a\\u0001"], "body": {}}',
    orjson.dumps({"endpoints": ["ns/a"], "body": {"x": 1}, "extra": 1}),
]


def test_a_body_read_in_the_child_process_gets_the_answer_it_gets_inline():
    from stream.http.body_reader import BodyReader

    calls = [("POST", "/v1/match", raw) for raw in BODIES] + [
        ("POST", "/v1/placements", orjson.dumps({"endpoints": ["ns/a"], "items": [{"hash": "h", "size": 0, "modality": "image"}]})),
        ("POST", "/v1/endpoint-events", orjson.dumps({"type": "sync", "live": ["ns/a", 3]})),
        ("POST", "/v1/placements", orjson.dumps({"endpoints": ["x" * 254], "body": {}})),
    ]
    inline = answers_of(make_api(), calls)
    api = make_api()
    api.bodies = BodyReader(api.limits, inline_bytes=0)  # every body goes to the child
    assert answers_of(api, calls) == inline
    assert [status for status, _ in inline] == [200, 200, 400, 400, 400, 400, 400, 400, 400, 400]


def test_bodies_queued_for_the_child_when_the_service_stops_get_a_503_not_a_wait():
    """A stop cuts the body being written and those waiting for a child never started: each
    is answered, and no child is left after the stop."""
    from stream.http import body_reader
    from stream.http.bodies import match_query

    big = orjson.dumps({"endpoints": ["ns/a"], "body": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * (8 << 20)}}]}]}})

    async def run() -> tuple[list, bool]:
        reader = body_reader.BodyReader(DEFAULT_LIMITS, inline_bytes=0, readers=1)
        await reader.read(match_query, [BODIES[1]])  # the child started
        (child,) = reader.children
        asks = [asyncio.create_task(reader.read(match_query, [big])) for _ in range(3)]
        await until_true(lambda: child._writing.locked() and reader.queued("match") == 2)
        await reader.close()
        done, waiting = await asyncio.wait(asks, timeout=10)
        for ask in waiting:
            ask.cancel()
        return [(ask.exception().status, ask.exception().code) for ask in done], not reader.children

    answers, no_child = asyncio.run(run())
    assert answers == [(503, "body_reader_unavailable")] * 3
    assert no_child


async def until_true(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.001)


def test_a_body_whose_child_died_is_read_by_a_new_one_and_a_503_only_if_that_dies_too(monkeypatch):
    from stream.http import body_reader
    from stream.http.bodies import match_query

    async def run() -> tuple[list, list, list]:
        reader = body_reader.BodyReader(DEFAULT_LIMITS, inline_bytes=0)
        try:
            first = await reader.read(match_query, [BODIES[1]])
            (old,) = reader.children
            old.process.kill()
            again = await reader.read(match_query, [BODIES[1][:20], BODIES[1][20:]])
            assert len(reader.children) == 1 and old not in reader.children
            assert old.process.wait(5) is not None

            async def ended(self, name, chunks):
                raise body_reader._ChildEnded()

            monkeypatch.setattr(body_reader._Child, "ask", ended)
            refused = []
            try:
                await reader.read(match_query, [BODIES[1]])
            except ApiError as exc:
                refused.append((exc.status, exc.code))
            return first.items, again.items, refused
        finally:
            await reader.close()

    first, again, refused = asyncio.run(run())
    assert first == again == [Item("h1", 3, "image")]
    assert refused == [(503, "body_reader_unavailable")]


def test_an_event_the_log_could_never_take_is_a_413_naming_the_limit_and_is_never_sent():
    api = make_api()
    sent = []

    async def publish(events):
        sent.append(events)
        return len(events)

    api.publisher.publish = publish
    api.publisher.publish_sync = publish
    live = [f"{i:04d}" + "n" * 249 for i in range(4096)]  # within every limit: 1,048,618 bytes
    answers = requests_with(api, [
        ("POST", "/v1/endpoint-events", orjson.dumps({"type": "sync", "live": live})),
        ("POST", "/v1/placements", orjson.dumps({"endpoints": ["ns/a"], "request_id": "r" * (1 << 20),
                                                 "items": [{"hash": "h", "size": 1, "modality": "image"}]})),
        ("POST", "/v1/placements", orjson.dumps({"endpoints": ["ns/a"], "request_id": "r" * 1000,
                                                 "items": [{"hash": "h", "size": 1, "modality": "image"}]})),
    ])
    assert [status for status, _ in answers] == [413, 413, 202]
    for _, answer in answers[:2]:
        assert answer["error"]["code"] == "event_too_large"
        assert "over the 1048576 bytes the event log takes (the producer's max_request_size)" in answer["error"]["message"]
    assert len(sent) == 1


def requests_with(api: HttpApi, calls: list[tuple[str, str, bytes]]) -> list[tuple[int, object]]:
    return [(status, orjson.loads(raw) if raw else raw) for status, raw in answers_of(api, calls)]


def test_the_record_size_check_is_the_producers_own():
    """``record_bytes`` against ``MAX_REQUEST_BYTES`` is what the real producer refuses
    (its default ``max_request_size``, which mmcache's producers keep)."""
    import inspect

    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import MessageSizeTooLargeError

    from stream.kafka.clients import MAX_REQUEST_BYTES, record_bytes

    assert inspect.signature(AIOKafkaProducer).parameters["max_request_size"].default == MAX_REQUEST_BYTES

    async def taken(value: bytes) -> bool:
        producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1")
        try:
            producer._serialize(b"key", value, [])  # the check send() makes first
        except MessageSizeTooLargeError:
            return False
        return True

    for size in (MAX_REQUEST_BYTES - 200, MAX_REQUEST_BYTES - 90, MAX_REQUEST_BYTES - 89, MAX_REQUEST_BYTES):
        value = b"x" * size
        assert (record_bytes(b"key", value) <= MAX_REQUEST_BYTES) == asyncio.run(taken(value)), size


TOKEN = "tok-" + "5ecret" * 4
MALFORMED = {
    "authorization over 8,190 bytes": b"GET /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"A" * 9000 + b"\r\n\r\n",
    "control character in authorization": b"GET /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\x01\r\n\r\n",
    "NUL in authorization": b"GET /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\x00\r\n\r\n",
    "folded authorization": b"GET /v1/state HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer\r\n " + TOKEN.encode() + b"\r\n\r\n",
    "header name with a control character": b"GET / HTTP/1.1\r\nHost: x\r\nAuth\x01orization: Bearer " + TOKEN.encode() + b"\r\n\r\n",
    "header line without a colon": b"GET / HTTP/1.1\r\nHost: x\r\nBearer " + TOKEN.encode() + b"\r\n\r\n",
    "another header over 8,190 bytes": b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode() + b"\r\nX-Pad: " + b"p" * 9000 + b"\r\n\r\n",
    "bad request line": b"GET /v1/state?" + TOKEN.encode() + b" HTTP/1.1 extra\r\nHost: x\r\n\r\n",
    "bad method": b"G\x01T /" + TOKEN.encode() + b" HTTP/1.1\r\n\r\n",
    "URL over 8,190 bytes": b"GET /" + TOKEN.encode() + b"x" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad version": b"GET / HTTP/9." + TOKEN.encode() + b"\r\n\r\n",
    "bad content length": b"POST /v1/match HTTP/1.1\r\nHost: x\r\nContent-Length: " + TOKEN.encode() + b"\r\n\r\n",
    "bad chunk size": b"POST /v1/match HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + TOKEN.encode() + b"\r\n",
    "too many headers": b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: Bearer %s\r\n" % (i, TOKEN.encode()) for i in range(200)) + b"\r\n",
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + TOKEN.encode(),
}


def raw_exchange(port: int, raw: bytes) -> bytes:
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_a_request_the_server_cannot_parse_is_answered_in_json_and_logged_without_what_it_held(caplog):
    import logging

    api = make_api()

    async def run() -> dict[str, bytes]:
        async with listening(api) as port:
            loop = asyncio.get_running_loop()
            return {name: await loop.run_in_executor(None, raw_exchange, port, raw)
                    for name, raw in MALFORMED.items()}

    with caplog.at_level(logging.DEBUG):
        answers = asyncio.run(run())
    for name, answer in answers.items():
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 400") and b"Content-Type: application/json" in head, (name, answer[:300])
        assert TOKEN.encode() not in answer and b"Bearer" not in answer, name
        assert orjson.loads(body)["error"]["code"] == "bad_request", name
    logged = "\n".join(caplog.text.splitlines() + [r.getMessage() for r in caplog.records])
    assert TOKEN not in logged and "Bearer" not in logged
    assert "refused a malformed HTTP request from 127.0.0.1 with 400: LineTooLong" in logged
    assert not [r for r in caplog.records if r.name == "aiohttp.server" or r.exc_info]
