"""Giving the memory serve freed back to the system (glibc's ``malloc_trim``).

Why: serve's allocations churn among long-lived ones (fetched records, HTTP bodies, RocksDB
write buffers, the state's entries). glibc gives a heap's free memory back to the system
only from the heap's top, so memory freed between live objects stays in serve's RSS. On
the soak's traffic a serve's RSS climbed about 300 MiB an hour, and ``malloc_info`` showed
where: over eight minutes the memory free inside glibc's heaps went from 30 to 57 MiB, the
memory in use by 10 MiB. ``malloc_trim(0)`` gives back every whole free page of every
heap; measured in that serve, one call every 30 s gave back 8-41 MiB in 1-16 ms (half
of them under 4 ms; the longest while a test run shared the two cores).

Elsewhere than glibc (musl, macOS) there is no such call, and nothing is done.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable

__all__ = ["TRIM_EVERY_S", "available", "give_back", "give_back_periodically"]

#: How often serve gives freed memory back: about what it freed in that time is in its RSS.
TRIM_EVERY_S = 30.0

log = logging.getLogger(__name__)


def _malloc_trim() -> Callable[[int], int] | None:
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the C library the process runs on
    if trim is None:
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim  # type: ignore[no-any-return]


_TRIM = _malloc_trim()


def available() -> bool:
    """Whether this process's C library can give freed memory back (glibc)."""
    return _TRIM is not None


def give_back() -> bool:
    """Give every whole free page of the C library's heaps back to the system; whether
    any was. Each heap is locked while it is walked, so call it off the event loop: the
    loop then waits only if it allocates from the heap being walked (its objects over
    512 bytes come from glibc's main heap)."""
    return bool(_TRIM(0)) if _TRIM is not None else False


async def give_back_periodically(every_s: float = TRIM_EVERY_S) -> None:
    """Give freed memory back every ``every_s`` seconds, in a thread, until cancelled."""
    if _TRIM is None:
        log.info("this C library cannot give freed memory back (no malloc_trim): serve's "
                 "RSS keeps what it freed between live objects")
        return
    while True:
        await asyncio.sleep(every_s)
        await asyncio.to_thread(give_back)
