"""The fetch gate (stream.kafka.fetch_gate) on aiokafka's own fetch requests: a fetch that
came back empty is held until a wake, the idle poll, or a change of what it asks for, and
no wake is lost between a fetch's sending and its answer."""

from __future__ import annotations

import asyncio

from aiokafka.protocol.fetch import FetchRequest

from stream.kafka.fetch_gate import FetchGate

NODE = 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class StandInFetcher:
    """Only a key for the gate's per-fetcher state (the gate never calls into it)."""


def request(*positions: tuple[str, int, int]) -> FetchRequest:
    by_topic: dict[str, list[tuple[int, int, int]]] = {}
    for topic, partition, offset in positions:
        by_topic.setdefault(topic, []).append((partition, offset, 1 << 20))
    return FetchRequest(10, 1, 1 << 20, 0, list(by_topic.items()))


def actions(*requests: FetchRequest, timeout: float = 0.2) -> tuple:
    return ([(NODE + i, r) for i, r in enumerate(requests)], {}, timeout, False, [])


def sent(result: tuple) -> list:
    return [node for node, _ in result[0]]


def run(body):
    return asyncio.run(body())


def test_an_empty_fetch_is_held_until_the_idle_poll_then_sent_again():
    clock = Clock()
    gate, fetcher, fetch = FetchGate(0.5, clock), StandInFetcher(), request(("t", 0, 7), ("t", 1, 3))

    async def body() -> None:
        assert sent(gate.filter(fetcher, actions(fetch))) == [NODE]
        gate.answered(fetcher, NODE, new_data=False)
        clock.now += 0.1
        held = gate.filter(fetcher, actions(fetch, timeout=5.0))
        assert sent(held) == [] and abs(held[2] - 0.4) < 1e-9  # wakes by the poll's time
        assert gate.filter(fetcher, actions(fetch, timeout=0.2))[2] == 0.2  # or sooner, as asked
        assert len(held[4]) == 1 and not held[4][0].done()  # and by a wake
        clock.now += 0.4
        assert sent(gate.filter(fetcher, actions(fetch))) == [NODE]

    run(body)
    assert gate.sent == 2 and gate.held == 2


def test_a_wake_sends_the_held_fetch_at_once():
    gate, fetcher, fetch = FetchGate(60, Clock()), StandInFetcher(), request(("t", 0, 7))

    async def body() -> None:
        gate.filter(fetcher, actions(fetch))
        gate.answered(fetcher, NODE, new_data=False)
        held = gate.filter(fetcher, actions(fetch))
        waiter = held[4][0]
        gate.wake()  # as the publisher does once a write is acknowledged, from any thread
        await asyncio.wait_for(waiter, 5)
        assert sent(gate.filter(fetcher, actions(fetch))) == [NODE]

    run(body)


def test_an_empty_answer_to_a_fetch_sent_before_a_wake_is_not_trusted():
    """The write may have reached the broker just after that fetch was answered empty."""
    gate, fetcher, fetch = FetchGate(60, Clock()), StandInFetcher(), request(("t", 0, 7))

    async def body() -> None:
        gate.filter(fetcher, actions(fetch))
        gate.wake()
        gate.answered(fetcher, NODE, new_data=False)
        assert sent(gate.filter(fetcher, actions(fetch))) == [NODE]
        gate.answered(fetcher, NODE, new_data=False)  # asked after the wake: now it is idle
        assert sent(gate.filter(fetcher, actions(fetch))) == []

    run(body)


def test_new_positions_new_data_or_another_fetcher_are_not_held():
    gate, fetcher, other = FetchGate(60, Clock()), StandInFetcher(), StandInFetcher()
    fetch = request(("t", 0, 7))

    async def body() -> None:
        gate.filter(fetcher, actions(fetch))
        gate.answered(fetcher, NODE, new_data=False)
        assert sent(gate.filter(fetcher, actions(request(("t", 0, 8))))) == [NODE]  # records taken
        gate.answered(fetcher, NODE, new_data=False)
        assert sent(gate.filter(fetcher, actions(request(("t", 0, 8), ("u", 0, 0))))) == [NODE]
        gate.answered(fetcher, NODE, new_data=True)
        assert sent(gate.filter(fetcher, actions(request(("t", 0, 8), ("u", 0, 0))))) == [NODE]
        assert sent(gate.filter(other, actions(fetch))) == [NODE]

    run(body)


def test_one_waiter_per_held_fetcher_however_long_it_stays_idle():
    clock = Clock()
    gate, fetcher, fetch = FetchGate(60, clock), StandInFetcher(), request(("t", 0, 7))

    async def body() -> None:
        gate.filter(fetcher, actions(fetch))
        gate.answered(fetcher, NODE, new_data=False)
        waiters = set()
        for _ in range(1000):  # the fetcher's routine turns every 0.2 s while held
            clock.now += 0.01
            waiters.add(id(gate.filter(fetcher, actions(fetch))[4][0]))
        assert len(waiters) == 1 and len(gate._waiters) == 1

    run(body)
