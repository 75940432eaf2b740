"""``CacheState``: one state's parts, built together on one shared ``Lrus``.

The per-endpoint LRU state is a fold over the event log. ``Lrus`` (``stream.core.lru``)
is its plain data: the LRUs, their inverted index, the applied offsets and the engine
views (``stream.core.engine``). Four small types do the work on it, and callers use them
directly: ``fold`` (``stream.core.fold``: the only way the log changes the state),
``index`` (``stream.core.index``: the queries), ``loading`` (``stream.core.loading``: a
partition's saved entries in and out) and ``digests`` (``stream.core.digests``: the
state's hash, in slices). ``CacheState`` holds them and builds them; its own methods are
only those that need more than one part at once.

Each endpoint that reports its own cache also has an engine view (``lrus.engine``),
folded from the same log beside the LRUs and covered by the same digest; placements
never change it, and engine reports never change an LRU.
"""

from __future__ import annotations

from typing import Any

from stream.core.digests import Digests, combine_digests
from stream.core.engine import ENGINE_VIEW_ENTRIES
from stream.core.fold import Fold
from stream.core.index import EndpointMatch, EndpointSummary, Index
from stream.core.loading import Loading
from stream.core.lru import (
    DEFAULT_CACHE_MB,
    MB_PER_ITEM,
    Capacity,
    Effects,
    EndpointCache,
    Entry,
    Lrus,
)

__all__ = [
    "DEFAULT_CACHE_MB",
    "MB_PER_ITEM",
    "CacheState",
    "Capacity",
    "Effects",
    "EndpointCache",
    "EndpointMatch",
    "EndpointSummary",
    "Entry",
    "combine_digests",
]


class CacheState:
    """All endpoints' LRUs (``lrus``) and the four parts that fold, query, load and hash
    them. The parts share ``lrus`` and nothing else: what one changes, the others see."""

    __slots__ = ("digests", "fold", "index", "loading", "lrus")

    def __init__(self, capacity: Capacity, engine_entries: int = ENGINE_VIEW_ENTRIES) -> None:
        self.lrus = lrus = Lrus(capacity, engine_entries)
        self.fold = Fold(lrus)
        self.index = Index(lrus)
        self.loading = Loading(lrus)
        self.digests = Digests(lrus)

    @classmethod
    def from_export(cls, capacity: Capacity, exported: tuple[Any, ...]) -> CacheState:
        """A state built from ``Loading.export``'s plain values (e.g. another process's)."""
        state = cls(capacity)
        state.loading.load_export(exported)
        return state

    def merge(self, other: CacheState) -> None:
        """Add the endpoints and digests of another state built from other partitions
        (e.g. in another process); ``other`` is not to be used afterwards.

        Here, not in a part, because it takes both parts of ``other`` at once: its LRUs
        (``Loading.merge``) and what its digests know of them (``Digests.merge``: their
        change marks and computed parts). The LRUs merged alone would never be hashed
        into this state's sliced digest.
        """
        self.loading.merge(other.lrus)
        self.digests.merge(other.digests)

