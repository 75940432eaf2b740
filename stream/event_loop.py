"""The event loop every mmcache process runs on: uvloop.

Measured for the whole worker (``/v1/match`` under wrk, the service and the bare
aiohttp+orjson handler on one core, alternated, 3 runs each): uvloop answered ~8% more
matches than asyncio's own loop and the bare handler ~16% more, so it is the loop of
``serve`` and ``rebuild``, and of the benchmark's controls, so that their ratios stay
honest. The policy is set, not only one loop made, so that the loops of the threads
Faust starts (its consumer's) are uvloop too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

__all__ = ["install", "new_event_loop", "run"]

T = TypeVar("T")


def install() -> None:
    """Make uvloop the policy: every loop made from now on, in any thread, is uvloop's."""
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


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
