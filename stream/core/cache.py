"""``CacheState``: the per-endpoint LRU state as a fold over the event log, under one name.

Four small types do the work on one shared ``Lrus`` (the LRUs, their inverted index,
the applied offsets and the engine views): ``Fold`` (``stream.core.fold``: the only
way the log changes the state), ``Index`` (``stream.core.index``: the queries),
``Loading`` (``stream.core.loading``: a partition's saved entries in and out) and
``Digests`` (``stream.core.digests``: the state's hash, in slices). This facade only
composes them, for callers that want one object.

Each endpoint that reports its own cache also has an engine view (``stream.core.engine``,
``CacheState.engine``), folded from the same log beside the LRUs and covered by the
same digest; placements never change it, and engine reports never change an LRU.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from stream.core.digests import Digests, combine_digests
from stream.core.engine import ENGINE_VIEW_ENTRIES, EngineViews
from stream.core.events import Event, Position
from stream.core.fold import Fold
from stream.core.holders import HolderSets
from stream.core.index import EndpointMatch, EndpointSummary, Index
from stream.core.items import Item
from stream.core.loading import Exported, Loading
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
    """All endpoints' LRUs plus an inverted index (hash -> endpoints) for matching."""

    def __init__(self, capacity: Capacity, engine_entries: int = ENGINE_VIEW_ENTRIES) -> None:
        self.lrus = lrus = Lrus(capacity, engine_entries)
        self.capacity = capacity
        self.fold = Fold(lrus)
        self.index = Index(lrus)
        self.loading = Loading(lrus)
        self.digests = Digests(lrus)

    # the shared data, as callers have always read it
    @property
    def endpoints(self) -> dict[str, EndpointCache]:
        """Each endpoint's LRU."""
        return self.lrus.endpoints

    @property
    def holders(self) -> HolderSets:
        """The inverted index: hash -> endpoints holding it, read-only, each value a
        frozenset (the index itself keeps the compact forms of ``stream.core.holders``)."""
        return HolderSets(self.lrus.holders)

    @property
    def applied(self) -> dict[int, int]:
        """Each partition's last applied offset."""
        return self.lrus.applied

    @property
    def engine(self) -> EngineViews:
        """The engine views, folded beside the LRUs."""
        return self.lrus.engine

    # -- the fold ----------------------------------------------------------------------

    def advance(self, position: Position) -> bool:
        """``Fold.advance``: mark a log position as applied; ``False`` if it already was."""
        return self.fold.advance(position)

    def apply(self, event: Event, position: Position) -> Effects | None:
        """``Fold.apply``: apply one event at its log position; ``None`` if it already was."""
        return self.fold.apply(event, position)

    def follow(self, partition: int, endpoint: str, digest: str, size: int | None) -> None:
        """``Fold.follow``: mirror one entry change another worker wrote."""
        self.fold.follow(partition, endpoint, digest, size)

    # -- queries -----------------------------------------------------------------------

    def hits(self, items: Sequence[Item], endpoints: Iterable[str]
             ) -> tuple[list[str], dict[str, list[Item]]]:
        """``Index.hits``: the distinct endpoints in request order and the items each holds."""
        return self.index.hits(items, endpoints)

    def match(self, items: Sequence[Item], endpoints: Iterable[str]) -> list[EndpointMatch]:
        """Score each distinct endpoint, in request order, by the items it holds."""
        if not items:
            return []
        requested, found = self.hits(items, endpoints)
        return Index.scores(items, requested, found)

    def summary(self, limit: int) -> list[EndpointSummary]:
        """``Index.summary``: endpoints with most items first, then by name."""
        return self.index.summary(limit)

    # -- loading -----------------------------------------------------------------------

    def drop_partition(self, partition: int) -> None:
        """``Loading.drop_partition``."""
        self.loading.drop_partition(partition)

    def drop_partition_in_slices(self, partition: int, entries_per_slice: int) -> Iterator[int]:
        """``Loading.drop_partition_in_slices``."""
        return self.loading.drop_partition_in_slices(partition, entries_per_slice)

    def drop_partition_except_in_slices(self, partition: int, keep: set[str],
                                        entries_per_slice: int,
                                        keep_engine: set[str] | None = None) -> Iterator[int]:
        """``Loading.drop_partition_except_in_slices``."""
        return self.loading.drop_partition_except_in_slices(partition, keep, entries_per_slice,
                                                            keep_engine)

    def restore(self, partition: int, applied: int | None, entries: Iterable[Entry]) -> None:
        """``Loading.restore``: one partition's durable entries and its applied offset."""
        self.loading.restore(partition, applied, entries)

    def restore_lru(self, partition: int, name: str, entries: Iterable[tuple[str, int]]) -> None:
        """``Loading.restore_lru``: one endpoint's whole LRU, least recent first."""
        self.loading.restore_lru(partition, name, entries)

    def replace_lru(self, partition: int, name: str, entries: Iterable[tuple[str, int]]) -> None:
        """``Loading.replace_lru``: swap one endpoint's whole LRU, as one pointer change."""
        self.loading.replace_lru(partition, name, entries)

    def set_applied(self, partition: int, applied: int | None) -> None:
        """``Loading.set_applied``."""
        self.loading.set_applied(partition, applied)

    def entries(self) -> Iterable[tuple[int, Entry]]:
        """``Loading.entries``: every entry with its partition, ranked for ``restore``."""
        return self.loading.entries()

    def export(self) -> Exported:
        """``Loading.export``: the state as plain values, e.g. to ``marshal`` it."""
        return self.loading.export()

    @classmethod
    def from_export(cls, capacity: Capacity, exported: tuple[Any, ...]) -> CacheState:
        """Inverse of ``export``."""
        state = cls(capacity)
        state.loading.load_export(exported)
        return state

    def merge(self, other: CacheState) -> None:
        """Add the endpoints and digests of another state built from other partitions
        (e.g. in another process); ``other`` is not to be used afterwards."""
        self.loading.merge(other.lrus)
        self.digests.merge(other.digests)

    # -- digests -----------------------------------------------------------------------

    def digest(self) -> str:
        """``Digests.digest``: the hash of the whole state, computed from scratch."""
        return self.digests.digest()

    def latest_digest(self) -> str:
        """``Digests.latest``: the per-endpoint digests combined as they are now."""
        return self.digests.latest()

    def endpoint_digests(self) -> dict[str, bytes]:
        """``Digests.endpoint_digests``."""
        return self.digests.endpoint_digests()

    def digests_pending(self) -> bool:
        """``Digests.pending``."""
        return self.digests.pending()

    def start_digest_round(self) -> None:
        """``Digests.start_round``."""
        self.digests.start_round()

    def refresh_digests(self, budget: int) -> bool:
        """``Digests.refresh``."""
        return self.digests.refresh(budget)

    def settle_partial(self) -> None:
        """``Digests.settle_partial``."""
        self.digests.settle_partial()

    def cached_digest(self) -> str | None:
        """``Digests.cached``."""
        return self.digests.cached()
