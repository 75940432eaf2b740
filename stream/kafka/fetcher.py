"""Settings of aiokafka's fetcher that its consumer does not expose.

``cap_fetcher_setting`` caps one for every fetcher made afterwards in the process (the
Tansu remedies cap the fetch wait with it). ``shorten_prefetch_backoff``: aiokafka sends
no fetch to a broker while any of its partitions has fetched records not yet taken by
the application, for up to ``prefetch_backoff`` (100 ms). In the worker that held back
new events: the first placement into each partition of a new topic became visible in
`/v1/match` only ~100 ms after its 202, which set the freshness p99 (101 ms; 12 ms with
the backoff at 10 ms, measured with `mmcache bench --only freshness`). The cost of a
shorter backoff is an extra fetch request now and then. ``Fetcher.__init__``, wrapped
here, is listed in ``stream.internals`` with its keywords' test.
"""

from __future__ import annotations

import functools
from typing import Any

from aiokafka.consumer.fetcher import Fetcher

__all__ = ["PREFETCH_BACKOFF_S", "cap_fetcher_setting", "shorten_prefetch_backoff"]

PREFETCH_BACKOFF_S = 0.01


def cap_fetcher_setting(name: str, default: float, cap: float, *, only_default: bool = False) -> None:
    """Make every aiokafka ``Fetcher`` made in this process from now on use at most
    ``cap`` for its keyword setting ``name`` (whose own default is ``default``); with
    ``only_default``, a consumer that asked for a value of its own keeps it."""
    original_init = Fetcher.__init__

    @functools.wraps(original_init)  # its signature stays the real one (stream.internals' test)
    def init_with_cap(self: Fetcher, *args: Any, **kwargs: Any) -> None:
        value = kwargs.get(name, default)
        if not only_default or value == default:
            kwargs[name] = min(value, cap)
        original_init(self, *args, **kwargs)

    Fetcher.__init__ = init_with_cap  # type: ignore[method-assign]


_shortened = False


def shorten_prefetch_backoff() -> None:
    """Make every aiokafka consumer of this process use ``PREFETCH_BACKOFF_S``; idempotent."""
    global _shortened
    if not _shortened:
        cap_fetcher_setting("prefetch_backoff", 0.1, PREFETCH_BACKOFF_S)
        _shortened = True
