"""The state digest on an event loop (issue 8, finding 3): no call hashes more than one
slice of entries between two turns of the loop, and the value is ``digest()``'s.

Holds are counted in entries hashed between two turns of a ticker task, not in time, so
the tests do not depend on the machine's load.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

import stream.core.digests as cache_module
from stream.config import Limits
from stream.core.cache import CacheState, Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.items import Item
from stream.http.api import HttpApi
from stream.http.digest import ENTRIES_PER_SLICE, digest_without_blocking
from stream.kafka.publisher import EventPublisher
from stream.metrics import Metrics
from tests.unit.served import served


def filled(endpoints: int, entries: int) -> CacheState:
    state = CacheState(Capacity("items", entries))
    for e in range(endpoints):
        items = [Item(f"{e:04d}-{i:04d}" * 4, 1, "image") for i in range(entries)]
        state.fold.apply(ItemsPlaced(endpoint=f"ns/pod-{e:04d}", items=items), Position(0, e))
    return state


class LoopHolds:
    """The most entries hashed between two turns of the event loop."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.since_turn = 0
        self.longest = 0
        real = cache_module._put

        def counting(h, text):
            self.since_turn += 1
            real(h, text)

        monkeypatch.setattr(cache_module, "_put", counting)

    async def tick(self, done: asyncio.Event) -> None:
        while not done.is_set():
            self.longest = max(self.longest, self.since_turn)
            self.since_turn = 0
            await asyncio.sleep(0)


async def watched(holds: LoopHolds, call):
    done = asyncio.Event()
    ticker = asyncio.create_task(holds.tick(done))
    await asyncio.sleep(0)
    try:
        return await call
    finally:
        done.set()
        await ticker
        holds.longest = max(holds.longest, holds.since_turn)


# 200 endpoints x 1,024 entries: 200k entries, 100 slices of 2,048
ENDPOINTS, ENTRIES = 200, 1024


def test_digest_without_blocking_yields_to_the_loop_every_slice(monkeypatch):
    state = filled(ENDPOINTS, ENTRIES)
    expected = state.digests.digest()
    holds = LoopHolds(monkeypatch)
    answer = asyncio.run(watched(holds, digest_without_blocking(state)))
    assert answer.value == expected and answer.settled
    assert 0 < holds.longest <= ENTRIES_PER_SLICE


def test_get_state_never_hashes_more_than_one_slice_between_loop_turns(monkeypatch):
    """The finding itself: on the old code ``/v1/state`` hashed all 200k entries in one
    hold of the loop."""
    state = filled(ENDPOINTS, ENTRIES)
    expected = state.digests.digest()
    api = HttpApi(state, EventPublisher("127.0.0.1:1", "unused", 1.0), Metrics(state, dict),
                  Limits(), lambda: True)
    holds = LoopHolds(monkeypatch)

    async def get_state() -> dict:
        async with served(api) as client:
            response = await client.get("/v1/state")
            return orjson.loads(await response.read())

    answer = asyncio.run(watched(holds, get_state()))
    assert answer["digest"] == expected and answer["total_endpoints"] == ENDPOINTS
    assert holds.longest <= ENTRIES_PER_SLICE


def test_a_second_digest_at_rest_hashes_nothing(monkeypatch):
    state = filled(20, 64)
    first = asyncio.run(digest_without_blocking(state))
    holds = LoopHolds(monkeypatch)
    again = asyncio.run(watched(holds, digest_without_blocking(state)))
    assert again == first and holds.longest == 0


def test_under_continuous_writes_the_call_ends_unsettled_within_its_bound(monkeypatch):
    """A writer touching every endpoint between all slices: the call still ends (after
    its rounds), says it is not settled, and a call at rest afterwards is exact."""
    state = filled(40, 256)
    holds = LoopHolds(monkeypatch)
    offsets = iter(range(100, 10**9))

    async def writer(done: asyncio.Event) -> None:
        while not done.is_set():
            for e in range(40):
                state.fold.apply(ItemsPlaced(endpoint=f"ns/pod-{e:04d}", items=[Item("w", 1, "image")]),
                                 Position(0, next(offsets)))
            await asyncio.sleep(0)

    async def run():
        done = asyncio.Event()
        task = asyncio.create_task(writer(done))
        await asyncio.sleep(0)
        answer = await digest_without_blocking(state, entries_per_slice=512)
        done.set()
        await task
        return answer

    answer = asyncio.run(watched(holds, run()))
    assert not answer.settled and len(answer.value) == 64
    assert holds.longest <= 512
    rest = asyncio.run(digest_without_blocking(state, entries_per_slice=512))
    assert rest.settled and rest.value == state.digests.digest()
