"""The state digest for a server on an event loop: hashed in slices, never in one hold.

``Digests`` (``stream.core.digests``) keeps one digest per endpoint (and one per engine
view) and marks it dirty when it changes; this adapter rehashes the dirty ones
``ENTRIES_PER_SLICE`` entries at a time and yields to the loop between slices, so a
``/v1/match`` waiting behind a ``/v1/state`` waits for one slice (about 1 ms on the bench
machine), not for a hash of the whole state (400-500 ms at 1,000 endpoints x 1,024
entries).

Under continuous writes the endpoints keep getting dirty again. The adapter then stops
after ``MAX_ROUNDS`` rounds (or a slice budget proportional to the state's size) and
answers ``settled=False`` with each endpoint's digest as it was when last hashed during
the call: a digest of no single moment, so two such digests compare only approximately.
At rest (no writes during the call) it answers ``settled=True`` and the value equals
``Digests.digest()``, which is what ``rebuild`` prints.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from stream.core.cache import CacheState

__all__ = ["ENTRIES_PER_SLICE", "MAX_ROUNDS", "StateDigest", "digest_without_blocking"]

#: Entries hashed per slice: 0.4-0.6 us each, so a slice holds the loop for about 1 ms.
ENTRIES_PER_SLICE = 2048
#: Rounds over the endpoints that changed during the call before answering unsettled.
MAX_ROUNDS = 3


class StateDigest(NamedTuple):
    """The digest and whether it is the digest of the state at one moment."""

    value: str
    settled: bool


async def digest_without_blocking(state: CacheState, entries_per_slice: int = ENTRIES_PER_SLICE,
                                  max_rounds: int = MAX_ROUNDS) -> StateDigest:
    """The state's digest, hashed in slices with the event loop running between them.

    Settled means no endpoint was dirty at the moment the last slice ended: the value
    is then the digest of the state at that moment.
    """
    digests, endpoints, views = state.digests, state.lrus.endpoints, state.lrus.engine.views
    entries = (sum(len(cache.entries) for cache in endpoints.values())
               + sum(len(view.entries) for view in views.values()))
    parts = len(endpoints) + len(views)  # each engine view is a part of the digest too
    slices_left = max_rounds * (entries // entries_per_slice + parts // entries_per_slice + 2)
    rounds = 0
    digests.start_round()
    while digests.pending():
        if rounds >= max_rounds or slices_left <= 0:
            return StateDigest(digests.latest(), False)
        rounds += digests.refresh(entries_per_slice)
        slices_left -= 1
        await asyncio.sleep(0)
        digests.start_round()
    return StateDigest(digests.latest(), True)
