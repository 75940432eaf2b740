"""Findings 2 and 4 of issue 8 at the HTTP boundary: a placement's fan-out is bounded,
and a write to a hung or metadata-less broker answers 503 fast (never a bare 500), with
the writes in flight capped. The producer is a stand-in for aiokafka's (unit tier); the
real broker frozen with SIGSTOP is in tests/integration/test_api_safety.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiokafka.errors import UnknownTopicOrPartitionError

from stream.config import Limits
from stream.core.cache import CacheState, Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.items import Item
from stream.http.api import HttpApi
from stream.kafka.publisher import EventPublisher
from stream.metrics import Metrics
from tests.unit.served import served

ITEMS = [{"hash": "h1", "size": 1, "modality": "image"}]


class StandInProducer:
    """aiokafka's producer surface the publisher uses: acks at once, or never (hung)."""

    def __init__(self, hung: bool = False, partitions: set[int] | Exception | None = None) -> None:
        self.hung = hung
        self.partitions = {0, 1, 2} if partitions is None else partitions
        self.sent: list[tuple[bytes | None, int | None, bytes]] = []

    async def send(self, topic, value, key=None, partition=None):
        self.sent.append((key, partition, value))
        future = asyncio.get_running_loop().create_future()
        if not self.hung:
            future.set_result(None)
        return future

    async def partitions_for(self, topic):
        if isinstance(self.partitions, Exception):
            raise self.partitions
        if self.hung:
            await asyncio.Event().wait()
        return self.partitions


def make_api(producer: StandInProducer, limits: Limits | None = None, endpoints: int = 0,
             timeout_s: float = 0.3, in_flight: int | None = None) -> HttpApi:
    state = CacheState(Capacity.from_params(6))
    for i in range(endpoints):
        state.fold.apply(ItemsPlaced(endpoint=f"ns/{i}", items=[Item("h", 1, "image")]), Position(0, i))
    publisher = EventPublisher("127.0.0.1:1", "unused", timeout_s)
    if in_flight is not None:
        publisher.max_in_flight = in_flight
    publisher._producer = producer  # type: ignore[assignment]
    return HttpApi(state, publisher, Metrics(state, dict), limits or Limits(), lambda: True)


def call(api: HttpApi, bodies: list[tuple[str, dict]]) -> list[tuple[int, dict, float]]:
    """(status, answer, seconds) of POSTs sent at once (concurrently) to one app."""

    async def run() -> list[tuple[int, dict, float]]:
        arrived: list[str] = []

        def counted(handler: Any) -> Any:
            async def count(request: Any) -> Any:
                arrived.append(request.path)
                return await handler(request)
            return count

        for route in ("placements", "endpoint_events", "engine_events"):
            setattr(api, route, counted(getattr(api, route)))
        async with served(api) as client:
            async def one(path: str, body: dict) -> tuple[int, dict, float]:
                started = time.monotonic()
                response = await client.post(path, data=orjson.dumps(body))
                answer = orjson.loads(await response.read())
                return response.status, answer, time.monotonic() - started
            results = []
            tasks = []
            for path, body in bodies:
                tasks.append(asyncio.create_task(one(path, body)))
                while len(arrived) < len(tasks):  # in this order: each reached the server
                    await asyncio.sleep(0.001)
            for task in tasks:
                results.append(await task)
            return results

    return asyncio.run(run())


def placement(endpoints: list[str]) -> tuple[str, dict]:
    return "/v1/placements", {"endpoints": endpoints, "items": ITEMS}


# finding 2: fan-out

def test_a_placement_names_at_most_max_placement_endpoints_distinct_endpoints():
    producer = StandInProducer()
    api = make_api(producer)
    [(status, answer, _)] = call(api, [placement([f"ns/p{i}" for i in range(17)])])
    assert status == 400
    assert answer["error"]["code"] == "invalid_request"
    assert "max_placement_endpoints" in answer["error"]["message"]
    assert answer["error"]["message"].startswith("endpoints:")
    assert producer.sent == []


def test_a_placement_of_the_limit_and_repeated_names_is_accepted():
    producer = StandInProducer()
    api = make_api(producer)
    names = [f"ns/p{i}" for i in range(16)]
    [(status, answer, _)] = call(api, [placement(names + names)])
    assert (status, answer) == (202, {"events": 16})
    assert len(producer.sent) == 16


def test_the_4096_endpoint_placement_of_the_finding_is_refused():
    producer = StandInProducer()
    [(status, answer, _)] = call(make_api(producer), [placement([f"ns/p{i}" for i in range(4096)])])
    assert status == 400 and "max_placement_endpoints" in answer["error"]["message"]
    assert producer.sent == []


def test_a_full_view_refuses_new_endpoints_and_keeps_taking_known_ones():
    producer = StandInProducer()
    api = make_api(producer, Limits(max_total_endpoints=5), endpoints=5)
    (new, new_answer, _), (known, known_answer, _) = call(
        api, [placement(["ns/new"]), placement(["ns/0", "ns/4"])])
    assert new == 400 and "max_total_endpoints" in new_answer["error"]["message"]
    assert (known, known_answer) == (202, {"events": 2})
    assert [key for key, _, _ in producer.sent] == [b"ns/0", b"ns/4"]


def test_a_placement_that_would_pass_the_total_is_refused_whole():
    producer = StandInProducer()
    api = make_api(producer, Limits(max_total_endpoints=5), endpoints=4)
    [(status, answer, _)] = call(api, [placement(["ns/0", "ns/x", "ns/y"])])
    assert status == 400 and "max_total_endpoints" in answer["error"]["message"]
    assert producer.sent == []


# finding 4: hung broker

def test_a_write_to_a_hung_broker_answers_503_within_the_timeout():
    api = make_api(StandInProducer(hung=True), timeout_s=0.3)
    [(status, answer, seconds)] = call(api, [placement(["ns/a"])])
    assert status == 503
    assert answer["error"]["code"] == "log_unavailable"
    assert "not acknowledge" in answer["error"]["message"]
    assert "may still be written" in answer["error"]["message"]
    assert seconds < 0.3 + 5.0  # the stand-in never answers: the bound tells the timeout from a hang


def test_a_sync_without_metadata_answers_503_not_500():
    producer = StandInProducer(partitions=UnknownTopicOrPartitionError())
    [(status, answer, _)] = call(make_api(producer), [("/v1/endpoint-events", {"type": "sync", "live": ["ns/a"]})])
    assert (status, answer["error"]["code"]) == (503, "log_unavailable")
    assert producer.sent == []


def test_a_sync_whose_metadata_hangs_answers_503_within_the_timeout():
    api = make_api(StandInProducer(hung=True), timeout_s=0.3)
    [(status, answer, seconds)] = call(api, [("/v1/endpoint-events", {"type": "sync", "live": ["ns/a"]})])
    assert (status, answer["error"]["code"]) == (503, "log_unavailable")
    assert seconds < 0.3 + 5.0  # the stand-in never answers: the bound tells the timeout from a hang


def test_writes_over_the_cap_get_503_at_once_without_touching_kafka():
    producer = StandInProducer(hung=True)
    api = make_api(producer, timeout_s=1.5, in_flight=2)
    answers = call(api, [placement(["ns/a"]), placement(["ns/b"]), placement(["ns/c"]),
                         ("/v1/endpoint-events", {"type": "deleted", "endpoint": "ns/d"})])
    (s1, a1, t1), (s2, a2, _), (s3, a3, t3), (s4, a4, t4) = answers
    assert (s1, a1["error"]["code"]) == (503, "log_unavailable")
    assert (s2, a2["error"]["code"]) == (503, "log_unavailable")
    assert (s3, a3["error"]["code"], s4, a4["error"]["code"]) == (503, "overloaded", 503, "overloaded")
    assert t3 < t1 and t4 < t1  # answered at once: before the first ones' timeout fired
    assert [key for key, _, _ in producer.sent] == [b"ns/a", b"ns/b"]
    assert api.publisher.in_flight == 0
