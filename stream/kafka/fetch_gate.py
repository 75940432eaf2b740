"""No fetch in flight while nothing is new: an idle `serve` on its embedded broker costs
nothing, and a write this process acknowledged still reaches its consumers at once.

Why: aiokafka's fetcher keeps one fetch in flight per broker whenever it has a partition
to fetch, and the embedded Tansu broker answers an idle fetch only after about half its
max wait (``stream.kafka.tansu``, remedy 2): with the 10 ms wait that freshness needs,
each consumer of the process (Faust's, the kept log's journal, a follower) sent ~200
fetches a second while nothing happened, 12% of a core in `serve` and 24% in its broker.
A fetch in flight cannot be cut short either: the broker serves one request per
connection at a time, so a second, sooner fetch would only queue behind it.

What: a fetch that came back empty is not sent again with the same partitions and
positions (nothing new there) until one of these:

- this process's publisher had a write acknowledged (``wake``): on the embedded default
  every acknowledged event write passes through it, so its consumers fetch at once and
  the write is in the view within a fetch's round trip;
- ``--idle-poll-s`` (``IDLE_POLL_S``) passed since it was sent: writes from other producers (a gateway
  publishing straight to the topic, Faust's changelog and dead letters for the journal)
  wait at most that long;
- anything else changed what would be fetched: new positions (records taken, a seek, a
  reset), another assignment: that fetch goes out as before.

Installed by `serve` only when it started its own broker (``install``), never against a
cluster that other processes also write to. The aiokafka internals used
(``Fetcher._get_actions_per_node`` and ``Fetcher._proc_fetch_request``, wrapped) are
listed in ``stream.internals`` with the release they were read from.

Ordering, so that no wake is lost: a publisher's write is acknowledged by the broker
before ``wake`` counts it; a fetch records the wake count when it is sent; an empty fetch
is repeated at once if the count moved since it was sent (it may have missed the write),
and a held fetcher registers its waiter under the same lock that ``wake`` takes.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka.consumer.fetcher import Fetcher

__all__ = ["GATE", "IDLE_POLL_S", "FetchGate", "install", "installed"]

#: The longest a write by another producer waits for an idle consumer of this process
#: (the default of ``--idle-poll-s``).
IDLE_POLL_S = 0.5


@dataclass(slots=True)
class _Sent:
    """What one fetch to one broker asked for, and when."""

    asked: frozenset[tuple[str, int, int]]  # (topic, partition, offset)
    wakes: int  # the gate's wake count when it was sent
    at: float  # the gate's clock


@dataclass(slots=True)
class _FetcherState:
    """One fetcher's last fetch per broker, and its empty ones (only its own loop's thread
    touches it)."""

    sent: dict[int, _Sent] = field(default_factory=dict)
    empty: dict[int, _Sent] = field(default_factory=dict)
    waiter: asyncio.Future[None] | None = None


class FetchGate:
    """Holds repeated empty fetches of every aiokafka fetcher of the process (once
    ``install``-ed) until a wake, ``IDLE_POLL_S``, or a change of what they ask for."""

    def __init__(self, idle_poll_s: float = IDLE_POLL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_poll_s = idle_poll_s
        self._clock = clock
        self._lock = threading.Lock()
        self._wakes = 0
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._fetchers: weakref.WeakKeyDictionary[Fetcher, _FetcherState] = weakref.WeakKeyDictionary()
        # counted under the lock, read from any thread
        self.sent = 0  # fetch requests let through
        self.held = 0  # times a fetcher's repeated empty fetch was held back
        self.woken = 0  # wakes

    def wake(self) -> None:
        """A write was acknowledged: every held fetcher fetches now (any thread)."""
        with self._lock:
            self._wakes += 1
            self.woken += 1
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            _resolve(loop, future)

    def _state(self, fetcher: Fetcher) -> _FetcherState:
        with self._lock:  # the weak dict drops closed fetchers from whatever thread collects them
            return self._fetchers.setdefault(fetcher, _FetcherState())

    def filter(self, fetcher: Fetcher, actions: tuple[Any, ...]) -> tuple[Any, ...]:
        """``Fetcher._get_actions_per_node``'s answer less the fetches to hold, with a
        waiter and a timeout that end the hold; called on the fetcher's loop."""
        fetch_requests, resets, timeout, invalid_metadata, resume_futures = actions
        if not fetch_requests:
            return actions
        state = self._state(fetcher)
        now = self._clock()
        send, until = [], None
        with self._lock:
            wakes = self._wakes
            for node_id, request in fetch_requests:
                asked = frozenset((topic, partition, offset)
                                  for topic, parts in request.topics for partition, offset, *_ in parts)
                empty = state.empty.get(node_id)
                if (empty is not None and empty.asked == asked and empty.wakes == wakes
                        and now < empty.at + self.idle_poll_s):
                    ends = empty.at + self.idle_poll_s
                    until = ends if until is None else min(until, ends)
                    continue
                state.sent[node_id] = _Sent(asked, wakes, now)
                send.append((node_id, request))
            self.sent += len(send)
            if until is not None:
                self.held += 1
                if state.waiter is None or state.waiter.done():
                    state.waiter = asyncio.get_running_loop().create_future()
                    self._waiters.append((asyncio.get_running_loop(), state.waiter))
        if until is None:
            return actions
        return (send, resets, min(timeout, max(until - now, 0.0)), invalid_metadata,
                [*resume_futures, state.waiter])

    def answered(self, fetcher: Fetcher, node_id: int, new_data: bool) -> None:
        """A fetch to ``node_id`` came back (``new_data``: it added records)."""
        state = self._state(fetcher)
        sent = state.sent.pop(node_id, None)
        if new_data or sent is None:
            state.empty.pop(node_id, None)
        else:
            state.empty[node_id] = sent


#: The process's gate (aiokafka's fetchers are patched process-wide, as the Tansu remedies).
GATE = FetchGate()
_installed = False


def install(idle_poll_s: float = IDLE_POLL_S, gate: FetchGate = GATE) -> None:
    """Gate every aiokafka fetcher of this process, made before or after, polling idle
    every ``idle_poll_s``; idempotent (the poll is the last one given)."""
    global _installed
    gate.idle_poll_s = idle_poll_s
    if _installed:
        return
    original_actions = Fetcher._get_actions_per_node
    original_fetch = Fetcher._proc_fetch_request

    @functools.wraps(original_actions)
    def actions_per_node(self: Fetcher, assignment: Any) -> tuple[Any, ...]:
        return gate.filter(self, original_actions(self, assignment))

    @functools.wraps(original_fetch)
    async def proc_fetch_request(self: Fetcher, assignment: Any, node_id: int, request: Any) -> bool:
        new_data = await original_fetch(self, assignment, node_id, request)
        gate.answered(self, node_id, bool(new_data))
        return new_data

    Fetcher._get_actions_per_node = actions_per_node  # type: ignore[method-assign]
    Fetcher._proc_fetch_request = proc_fetch_request  # type: ignore[method-assign]
    _installed = True


def installed() -> bool:
    """Whether this process's fetchers are gated (serve on its own broker)."""
    return _installed


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    def settle() -> None:
        if not future.done():
            future.set_result(None)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # that loop is closed: nobody waits any more
        pass
