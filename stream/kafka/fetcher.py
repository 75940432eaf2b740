"""Settings of aiokafka's fetcher that its consumer does not expose.

``cap_fetcher_setting`` caps one for every fetcher made afterwards in the process (the
Tansu remedies cap the fetch wait with it). ``shorten_prefetch_backoff``: aiokafka sends
no fetch to a broker while any of its partitions has fetched records not yet taken by
the application, for up to ``prefetch_backoff`` (100 ms). In the worker that held back
new events: the first placement into each partition of a new topic became visible in
`/v1/match` only ~100 ms after its 202, which set the freshness p99 (101 ms; 12 ms with
the backoff at 10 ms, measured with `mmcache bench --only freshness`). The cost of a
shorter backoff is an extra fetch request now and then.

``wait_longer_when_idle``: on a broker that does not wake a waiting fetch when data
arrives (Tansu), a short fetch wait is a poll, and an idle `serve` on its embedded broker
spent 37-50% of a core polling at 10 ms (6% at 200 ms). A fetcher whose fetches have
brought nothing for ``IDLE_AFTER_S`` waits ``IDLE_WAIT_MS`` per fetch, and its short wait
again from the first fetch that brings records: a burst after a quiet spell reaches the
consumer up to half that wait later (Tansu answers an idle fetch after about half its
wait), then at the short wait. ``Fetcher.__init__``, ``_proc_fetch_request`` and
``_fetch_max_wait_ms`` are listed in ``stream.internals`` with their test.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from aiokafka.consumer.fetcher import Fetcher

__all__ = ["IDLE_AFTER_S", "IDLE_WAIT_MS", "PREFETCH_BACKOFF_S", "cap_fetcher_setting",
           "shorten_prefetch_backoff", "wait_longer_when_idle"]

PREFETCH_BACKOFF_S = 0.01
IDLE_AFTER_S = 2.0
IDLE_WAIT_MS = 100


def cap_fetcher_setting(name: str, default: float, cap: float) -> None:
    """Make every aiokafka ``Fetcher`` made in this process from now on use at most
    ``cap`` for its keyword setting ``name`` (whose own default is ``default``)."""
    original_init = Fetcher.__init__

    @functools.wraps(original_init)  # its signature stays the real one (stream.internals' test)
    def init_with_cap(self: Fetcher, *args: Any, **kwargs: Any) -> None:
        kwargs[name] = min(kwargs.get(name, default), cap)
        original_init(self, *args, **kwargs)

    Fetcher.__init__ = init_with_cap  # type: ignore[method-assign]


_shortened = False


def shorten_prefetch_backoff() -> None:
    """Make every aiokafka consumer of this process use ``PREFETCH_BACKOFF_S``; idempotent."""
    global _shortened
    if not _shortened:
        cap_fetcher_setting("prefetch_backoff", 0.1, PREFETCH_BACKOFF_S)
        _shortened = True


_idle_wait = False


def wait_longer_when_idle() -> None:
    """Make every aiokafka fetcher of this process wait ``IDLE_WAIT_MS`` a fetch once its
    fetches have brought nothing for ``IDLE_AFTER_S``, and its own wait again from the
    first that brings records; idempotent."""
    global _idle_wait
    if _idle_wait:
        return
    original = Fetcher._proc_fetch_request

    @functools.wraps(original)
    async def fetch_and_adapt(self: Fetcher, *args: Any, **kwargs: Any) -> bool:
        brought: bool = await original(self, *args, **kwargs)
        now = time.monotonic()
        state = self.__dict__.setdefault("_mmcache_idle", [self._fetch_max_wait_ms, now])
        if brought:  # (an error to hand on counts as records too: back to the short wait)
            state[1] = now
            self._fetch_max_wait_ms = state[0]
        elif now - state[1] >= IDLE_AFTER_S:
            self._fetch_max_wait_ms = max(state[0], IDLE_WAIT_MS)
        return brought

    Fetcher._proc_fetch_request = fetch_and_adapt  # type: ignore[method-assign]
    _idle_wait = True
