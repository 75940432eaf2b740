"""The per-endpoint LRUs and their inverted index, as plain data that the fold, the
queries, the bulk loading and the digests share (``stream.core.cache`` composes them).

Hashes and endpoint names are interned as they come in, so that each is stored once
however many LRUs and index sets hold it: every decoded event and store record brings
its own copies (~110 B a sha256 hex hash, more than the entry itself).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from stream.core.engine import EngineChange, EngineViews
from stream.core.holders import TUPLE_MAX, HeldBy

__all__ = [
    "DEFAULT_CACHE_MB",
    "MB_PER_ITEM",
    "Capacity",
    "Effects",
    "EndpointCache",
    "Entry",
    "Lrus",
]

DEFAULT_CACHE_MB = 2048
MB_PER_ITEM = 2


class Capacity(NamedTuple):
    """How much one endpoint's LRU holds: a count of items or a sum of item sizes."""

    mode: Literal["items", "size"]
    per_endpoint: int

    @classmethod
    def from_params(
        cls, cache_size_mb: int | None = None, embeddings: int | None = None
    ) -> Capacity:
        """Build from the Go plugin's parameters; setting both is an error."""
        if cache_size_mb is not None and embeddings is not None:
            raise ValueError(
                "set either cacheSizeInMBPerServer or cacheSizeInEmbeddingsPerServer, not both"
            )
        if embeddings is not None:
            if embeddings < 1:
                raise ValueError("cacheSizeInEmbeddingsPerServer must be at least 1")
            return cls("size", embeddings)
        mb = cache_size_mb if cache_size_mb is not None and cache_size_mb > 0 else DEFAULT_CACHE_MB
        return cls("items", max(1, mb // MB_PER_ITEM))


class Entry(NamedTuple):
    """One durable LRU entry; ``(offset, index)`` orders entries by recency."""

    endpoint: str
    hash: str
    size: int
    offset: int
    index: int


@dataclass(slots=True)
class Effects:
    """What a store must do, in order, to mirror one applied event."""

    upserts: list[Entry] = field(default_factory=list)
    removals: list[tuple[str, str]] = field(default_factory=list)
    engine: list[EngineChange] = field(default_factory=list)  # engine views' changes, in order


@dataclass(slots=True)
class EndpointCache:
    """One endpoint's LRU: item hash -> size, least recent first.

    A plain dict keeps insertion order: a touch re-inserts at the end, eviction takes
    the first key. It needs ~50 B less per entry than an OrderedDict (no linked list).
    """

    partition: int
    entries: dict[str, int] = field(default_factory=dict)
    weight: int = 0


class Lrus:
    """All endpoints' LRUs, the inverted index (hash -> endpoints holding it), each
    partition's applied offset, the engine views, and the set of digest parts changed
    since they were last hashed (``dirty``: every change adds its endpoint).

    Invariant: ``holders[h]`` holds ``name`` exactly when ``endpoints[name].entries``
    holds ``h``, in the compact form of ``stream.core.holders`` (a name, a tuple, a set:
    never empty). ``hold`` and ``release`` are that module's, inline: compiled, on the
    restore and eviction paths.
    """

    __slots__ = ("applied", "by_size", "capacity", "dirty", "endpoints", "engine", "holders")

    def __init__(self, capacity: Capacity, engine_entries: int) -> None:
        self.capacity = capacity
        self.by_size = capacity.mode == "size"
        self.endpoints: dict[str, EndpointCache] = {}
        self.holders: dict[str, HeldBy] = {}
        self.applied: dict[int, int] = {}
        self.dirty: set[str] = set()
        self.engine = EngineViews(engine_entries, self.dirty)

    def hold(self, name: str, digests: Iterable[str]) -> None:
        """Index ``digests`` as held by ``name`` (those it holds already stay as they are:
        a swapped LRU is held again whole)."""
        holders = self.holders
        for digest in digests:
            held = holders.get(digest)
            if held is None:
                holders[digest] = name
            elif type(held) is str:
                if held != name:
                    holders[digest] = (held, name)
            elif type(held) is tuple:
                if name not in held:
                    holders[digest] = held + (name,) if len(held) < TUPLE_MAX else {*held, name}
            else:
                held.add(name)

    def release(self, digest: str, name: str) -> None:
        """``name`` no longer holds ``digest``."""
        holders = self.holders
        held = holders[digest]
        if type(held) is str:
            del holders[digest]
        elif type(held) is tuple:
            if len(held) == 2:
                holders[digest] = held[1] if held[0] == name else held[0]
            else:
                at = held.index(name)
                holders[digest] = held[:at] + held[at + 1:]
        else:
            held.discard(name)
            if len(held) == 1:
                holders[digest] = next(iter(held))

    def drop(self, name: str, effects: Effects) -> None:
        """Forget one endpoint's LRU, its removals added to ``effects``."""
        cache = self.endpoints.pop(name, None)
        if cache is None:
            return
        self.dirty.add(name)
        for digest in cache.entries:
            self.release(digest, name)
            effects.removals.append((name, digest))
