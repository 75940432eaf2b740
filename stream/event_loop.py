"""The event loop every mmcache process runs on: uvloop.

Measured for the whole worker (``/v1/match`` under wrk, the service and the bare
aiohttp+orjson handler on one core, alternated, 3 runs each): uvloop answered ~8% more
matches than asyncio's own loop and the bare handler ~16% more, so it is the loop of
``serve`` and ``rebuild``, and of the benchmark's controls, so that their ratios stay
honest. The policy is set, not only one loop made, so that the loops of the threads
Faust starts (its consumer's) are uvloop too.

One difference matters to aiokafka: a write on a transport that is already closed (the
broker went away, and the connection's own reader has not yet closed it) is ignored by
asyncio's loop but raises ``RuntimeError`` on uvloop, which aiokafka's
``AIOKafkaConnection.send`` does not catch (it catches ``OSError``). Faust's consumer
thread crashed on it when a commit met a rebase of the embedded broker
(``stream.kafka.rebase``), and `serve` stopped. ``install`` makes it what aiokafka makes
of an ``OSError``: the connection closed as broken and a retriable
``KafkaConnectionError``, which aiokafka's callers retry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop
from aiokafka.conn import AIOKafkaConnection, CloseReason
from aiokafka.errors import KafkaConnectionError

__all__ = ["install", "new_event_loop", "run"]

T = TypeVar("T")


def install() -> None:
    """Make uvloop the policy: every loop made from now on, in any thread, is uvloop's;
    aiokafka's connections treat a closed transport as a broken connection."""
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    AIOKafkaConnection.send = _send_on_uvloop  # type: ignore[method-assign]


_send = AIOKafkaConnection.send


def _send_on_uvloop(self: AIOKafkaConnection, request: Any, expect_response: bool = True) -> Any:
    """Send as aiokafka does; uvloop's ``RuntimeError`` for a closed transport becomes what an
    ``OSError`` becomes there."""
    try:
        return _send(self, request, expect_response)
    except RuntimeError as exc:
        if type(exc) is not RuntimeError:  # e.g. NotImplementedError: versions that do not match
            raise
        self.close(reason=CloseReason.CONNECTION_BROKEN, exc=exc)
        raise KafkaConnectionError(f"Connection at {self.host}:{self.port} broken: {exc}") from exc


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new uvloop loop, set as the current one, with uvloop as the policy."""
    install()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    return loop


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop."""
    install()
    return asyncio.run(coroutine)
