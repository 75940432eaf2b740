"""Per-endpoint LRU state as a fold over the event log.

``CacheState.apply(event, position)`` is the only way state changes. It is
deterministic in the events and their log positions, and it skips any event at
or below the last applied offset of its partition, so redelivery after a crash
changes nothing. Each call returns the ``Effects`` a durable store must write to
mirror the change entry by entry (never a whole LRU per placement).

The state digest is kept per endpoint: every mutation marks its endpoint dirty (one
set insertion), and ``refresh_digests`` rehashes dirty endpoints a bounded number of
entries at a time, so a caller on an event loop can spread the work over slices
(``stream.http.digest``) instead of hashing a 1M-entry state in one go.

Each endpoint that reports its own cache also has an engine view (``stream.core.engine``,
``CacheState.engine``), folded from the same log beside the LRUs and covered by the
same digest; placements never change it, and engine reports never change an LRU.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from sys import intern
from typing import Any, Literal, NamedTuple, TypedDict

from stream.core.engine import DIGEST_MARK, ENGINE_VIEW_ENTRIES, EngineChange, EngineViews
from stream.core.events import (
    EndpointDeleted,
    EndpointsSynced,
    EngineEventsReported,
    Event,
    ItemsPlaced,
    Position,
)
from stream.core.items import Item

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

_new_tuple = tuple.__new__

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


class EndpointMatch(TypedDict):
    """The match data attached to one candidate endpoint (EncoderCacheMatchInfo).

    A plain dict at run time: the match answer is built for every candidate of every
    request, and dicts are the cheapest objects to build and to serialize.
    """

    endpoint: str
    matched_items: list[Item]
    matched_weight: int
    total_weight: int
    score: float


class EndpointSummary(NamedTuple):
    """Counts for one endpoint, without its hashes."""

    endpoint: str
    items: int
    weight: int


class _Partial(NamedTuple):
    """An endpoint whose digest is being computed across slices."""

    name: str
    cache: Any  # an EndpointCache, or an engine view (stream.core.engine.EngineView)
    hasher: Any
    entries: Iterator[tuple[str, int]]


class CacheState:
    """All endpoints' LRUs plus an inverted index (hash -> endpoints) for matching.

    Hashes and endpoint names are interned as they come in, so that each is stored once
    however many LRUs and index sets hold it: every decoded event and store record brings
    its own copies (~110 B a sha256 hex hash, more than the entry itself).

    Digest bookkeeping (invariant: an endpoint whose LRU changed since its digest was
    last computed is in ``_dirty``, in ``_queue`` or is ``_partial``): ``_records`` maps
    each endpoint hashed since its last change to its part of the combined digest.
    """

    def __init__(self, capacity: Capacity, engine_entries: int = ENGINE_VIEW_ENTRIES) -> None:
        self.capacity = capacity
        self._by_size = capacity.mode == "size"
        self.endpoints: dict[str, EndpointCache] = {}
        self.holders: dict[str, set[str]] = {}
        self.applied: dict[int, int] = {}
        self._dirty: set[str] = set()
        self.engine = EngineViews(engine_entries, self._dirty)
        self._queue: list[str] = []
        self._partial: _Partial | None = None
        self._records: dict[str, bytes] = {}
        self._combined: str | None = None

    # -- the fold ---------------------------------------------------------------

    def advance(self, position: Position) -> bool:
        """Mark a log position as applied; ``False`` if it already was (a redelivery)."""
        partition, offset = position
        if offset <= self.applied.get(partition, -1):
            return False
        self.applied[partition] = offset
        return True

    def apply(self, event: Event, position: Position) -> Effects | None:
        """Apply one event at its log position; ``None`` if it was already applied."""
        if not self.advance(position):
            return None
        partition = position.partition
        effects = Effects()
        if isinstance(event, ItemsPlaced):
            self._place(event, position, effects)
        elif isinstance(event, EndpointDeleted):
            self._drop(event.endpoint, effects)
            self.engine.drop(event.endpoint, effects.engine)
        elif isinstance(event, EndpointsSynced):
            if event.live:
                live = set(event.live)
                stale = [
                    name
                    for name, cache in self.endpoints.items()
                    if cache.partition == partition and name not in live
                ]
                for name in stale:
                    self._drop(name, effects)
                for name in self.engine.stale(partition, live):
                    self.engine.drop(name, effects.engine)
        elif isinstance(event, EngineEventsReported):
            self.engine.apply(event, position, effects.engine)
        return effects

    def _place(self, event: ItemsPlaced, position: Position, effects: Effects) -> None:
        name = intern(event.endpoint)
        self._dirty.add(name)
        cache = self.endpoints.get(name)
        if cache is None:
            cache = self.endpoints[name] = EndpointCache(position.partition)
        entries, holders, upserts = cache.entries, self.holders, effects.upserts
        by_size, limit = self._by_size, self.capacity.per_endpoint
        offset = position.offset
        weight = cache.weight
        for index, item in enumerate(event.items):
            digest, size = intern(item.hash), item.size
            if by_size and size > limit:
                continue
            previous = entries.pop(digest, None)
            if previous is None:
                held_by = holders.get(digest)
                if held_by is None:
                    holders[digest] = {name}
                else:
                    held_by.add(name)
            else:
                weight -= previous
            entries[digest] = size
            weight += size
            # tuple.__new__ builds the named tuple without its Python-level __new__ (2x faster)
            upserts.append(_new_tuple(Entry, (name, digest, size, offset, index)))
        while (weight if by_size else len(entries)) > limit:
            evicted = next(iter(entries))
            size = entries.pop(evicted)
            weight -= size
            self._release(evicted, name)
            effects.removals.append((name, evicted))
        cache.weight = weight
        if not entries:
            del self.endpoints[name]

    def _drop(self, name: str, effects: Effects) -> None:
        cache = self.endpoints.pop(name, None)
        if cache is None:
            return
        self._dirty.add(name)
        for digest in cache.entries:
            self._release(digest, name)
            effects.removals.append((name, digest))

    def _release(self, digest: str, name: str) -> None:
        holders = self.holders[digest]
        holders.discard(name)
        if not holders:
            del self.holders[digest]

    # -- loading from a store ------------------------------------------------------

    def drop_partition(self, partition: int) -> None:
        """Forget one partition's endpoints (LRUs and engine views) and offset, before
        loading it again."""
        for name in [n for n, cache in self.endpoints.items() if cache.partition == partition]:
            self._drop(name, Effects())
        for name in self.engine.stale(partition, set()):
            self.engine.drop(name, [])
        self.applied.pop(partition, None)

    def drop_partition_in_slices(self, partition: int, entries_per_slice: int) -> Iterator[int]:
        """``drop_partition`` in steps of about ``entries_per_slice`` entries (whole
        endpoints), yielding how many each step released, for a caller on an event loop."""
        names = [n for n, cache in self.endpoints.items() if cache.partition == partition]
        released = yield from self._drop_in_slices(partition, names, entries_per_slice)
        released += yield from self.engine.drop_in_slices(partition, None, entries_per_slice)
        self.applied.pop(partition, None)
        yield released

    def drop_partition_except_in_slices(self, partition: int, keep: set[str],
                                        entries_per_slice: int,
                                        keep_engine: set[str] | None = None) -> Iterator[int]:
        """Drop the partition's LRUs not in ``keep`` and engine views not in
        ``keep_engine`` (those a reload did not find in the store; ``None`` leaves the
        views alone), in steps as ``drop_partition_in_slices``; the applied offset stays."""
        names = [n for n, cache in self.endpoints.items()
                 if cache.partition == partition and n not in keep]
        released = yield from self._drop_in_slices(partition, names, entries_per_slice)
        if keep_engine is not None:
            released += yield from self.engine.drop_in_slices(partition, keep_engine,
                                                              entries_per_slice)
        if released:
            yield released

    def _drop_in_slices(self, partition: int, names: list[str],
                        entries_per_slice: int) -> Generator[int, None, int]:
        """Drop these endpoints of the partition (those still in it), yielding after about
        ``entries_per_slice`` entries; returns how many the last, unyielded step released."""
        released = 0
        for name in names:
            cache = self.endpoints.get(name)
            if cache is None or cache.partition != partition:
                continue
            released += len(cache.entries)
            self._drop(name, Effects())
            if released >= entries_per_slice:
                yield released
                released = 0
        return released

    def set_applied(self, partition: int, applied: int | None) -> None:
        """Record a partition's applied offset as loaded (``None``: nothing applied)."""
        if applied is None:
            self.applied.pop(partition, None)
        else:
            self.applied[partition] = applied

    def export(self) -> tuple[dict[str, tuple[int, dict[str, int], int]], dict[str, set[str]],
                              dict[int, int], dict[str, tuple[int, dict[str, int], int]]]:
        """The state as plain dicts, sets and tuples, e.g. to ``marshal`` it to another
        process: (endpoint -> (partition, LRU, weight), holders, applied offsets,
        endpoint -> (partition, engine view, weight))."""
        endpoints = {name: (c.partition, c.entries, c.weight) for name, c in self.endpoints.items()}
        return endpoints, self.holders, self.applied, self.engine.export()

    @classmethod
    def from_export(cls, capacity: Capacity, exported: tuple[Any, ...]) -> CacheState:
        """Inverse of ``export``."""
        endpoints, holders, applied, engine = exported
        state = cls(capacity)
        state.endpoints = {name: EndpointCache(*parts) for name, parts in endpoints.items()}
        state.holders, state.applied = holders, applied
        state._dirty.update(state.endpoints)
        state.engine.load_export(engine)
        return state

    def merge(self, other: CacheState) -> None:
        """Add the endpoints of another state built from other partitions (e.g. in
        another process); ``other`` is not to be used afterwards."""
        if other.capacity != self.capacity:
            raise ValueError(f"capacity {other.capacity} is not {self.capacity}")
        if (self.applied.keys() & other.applied.keys() or self.endpoints.keys() & other.endpoints.keys()
                or self.engine.views.keys() & other.engine.views.keys()):
            raise ValueError("only states of different partitions can be merged")
        self.endpoints.update(other.endpoints)
        self.engine.merge(other.engine)
        self.applied.update(other.applied)
        # other's clean digests stay valid; its unfinished ones are redone here
        other.settle_partial()
        self._records.update(other._records)
        self._combined = None
        self._dirty |= other._dirty
        self._dirty.update(other._queue)
        if not self.holders:
            self.holders = other.holders
            return
        holders = self.holders
        for digest, names in other.holders.items():
            held_by = holders.get(digest)
            if held_by is None:
                holders[digest] = names
            else:
                held_by |= names

    def follow(self, partition: int, endpoint: str, digest: str, size: int | None) -> None:
        """Mirror one entry change written by another worker (``None`` removes it).

        Changes of a partition arrive in the order the owner's fold made them, so an
        upsert is the entry's most recent touch: it goes to the recent end of the LRU.
        """
        endpoint, digest = intern(endpoint), intern(digest)
        cache = self.endpoints.get(endpoint)
        self._dirty.add(endpoint)
        if size is None:
            if cache is not None and digest in cache.entries:
                cache.weight -= cache.entries.pop(digest)
                self._release(digest, endpoint)
                if not cache.entries:
                    del self.endpoints[endpoint]
            return
        if cache is None:
            cache = self.endpoints[endpoint] = EndpointCache(partition)
        previous = cache.entries.pop(digest, None)
        if previous is None:
            self.holders.setdefault(digest, set()).add(endpoint)
        else:
            cache.weight -= previous
        cache.entries[digest] = size
        cache.weight += size

    def restore(self, partition: int, applied: int | None, entries: Iterable[Entry]) -> None:
        """Load one partition's durable entries (any order) and its applied offset."""
        by_endpoint: dict[str, list[Entry]] = {}
        for entry in entries:
            by_endpoint.setdefault(entry.endpoint, []).append(entry)
        for name, group in by_endpoint.items():
            group.sort(key=lambda e: (e.offset, e.index))
            self.restore_lru(partition, name, [(e.hash, e.size) for e in group])
        if applied is not None:
            self.applied[partition] = applied

    def restore_lru(self, partition: int, name: str, entries: Iterable[tuple[str, int]]) -> None:
        """Load one endpoint's whole LRU, given least recent first as (hash, size)."""
        name, lru = intern(name), {intern(digest): size for digest, size in entries}
        self.endpoints[name] = EndpointCache(partition, lru, sum(lru.values()))
        self._dirty.add(name)
        holders = self.holders
        for digest in lru:
            held_by = holders.get(digest)
            if held_by is None:
                holders[digest] = {name}
            else:
                held_by.add(name)

    def replace_lru(self, partition: int, name: str, entries: Iterable[tuple[str, int]]) -> None:
        """Swap one endpoint's whole LRU for another, given least recent first.

        The new LRU goes in as one pointer change, so a match sees the old LRU or the new
        one, never a mix; an entry both hold is held throughout (a handover's reload
        never makes an answer lose a match the new view also has). Costs the old plus
        the new LRU's length.
        """
        name = intern(name)
        old = self.endpoints.get(name)
        lru = {intern(digest): size for digest, size in entries}
        if not lru:
            if old is not None:
                self._drop(name, Effects())
            return
        holders = self.holders
        for digest in lru:
            held_by = holders.get(digest)
            if held_by is None:
                holders[digest] = {name}
            else:
                held_by.add(name)
        self.endpoints[name] = EndpointCache(partition, lru, sum(lru.values()))
        self._dirty.add(name)
        if old is not None:
            for digest in old.entries:
                if digest not in lru:
                    self._release(digest, name)

    def entries(self) -> Iterable[tuple[int, Entry]]:
        """Every entry with its partition, ranked so that ``restore`` rebuilds this state."""
        for name, cache in self.endpoints.items():
            for index, (digest, size) in enumerate(cache.entries.items()):
                yield cache.partition, Entry(name, digest, size, 0, index)

    # -- queries ---------------------------------------------------------------------

    def hits(
        self, items: Sequence[Item], endpoints: Iterable[str]
    ) -> tuple[list[str], dict[str, list[Item]]]:
        """The distinct endpoints in request order, and the request items each one holds
        (only endpoints that hold at least one, items in request order).

        Walks the inverted index from the request's few items to the endpoints holding
        them, so the cost follows the hits, not endpoints x items.
        """
        requested = dict.fromkeys(endpoints)
        found: dict[str, list[Item]] = {}
        for item in items:
            holders = self.holders.get(item.hash)
            if not holders:
                continue
            for name in holders if len(holders) < len(requested) else requested:
                if name in requested and name in holders:
                    found.setdefault(name, []).append(item)
        return list(requested), found

    def match(self, items: Sequence[Item], endpoints: Iterable[str]) -> list[EndpointMatch]:
        """Score each distinct endpoint, in request order, by the items it holds."""
        if not items:
            return []
        requested, found = self.hits(items, endpoints)
        total = sum(item.size for item in items)
        results: list[EndpointMatch] = []
        for name in requested:
            matched = found.get(name, [])
            weight = sum(item.size for item in matched)
            results.append({"endpoint": name, "matched_items": matched, "matched_weight": weight,
                            "total_weight": total, "score": weight / total})
        return results

    def summary(self, limit: int) -> list[EndpointSummary]:
        """Endpoints with most items first, then by name.

        Ranks plain (count, name) tuples, compared in C, and picks the first ``limit``
        with a heap when that is a small share (the default 100 of up to 10,000).
        """
        keys = [(-len(cache.entries), name) for name, cache in self.endpoints.items()]
        top = heapq.nsmallest(limit, keys) if limit * 8 < len(keys) else sorted(keys)[:limit]
        endpoints = self.endpoints
        return [EndpointSummary(name, -count, endpoints[name].weight) for count, name in top]

    def endpoint_digests(self) -> dict[str, bytes]:
        """Per-endpoint hash of its entries in recency order, with sizes; each engine view
        too, under its endpoint's name after ``DIGEST_MARK`` (so a state without views
        has the digest it had before views existed)."""
        digests = {name: _endpoint_digest(cache) for name, cache in self.endpoints.items()}
        for name, view in self.engine.views.items():
            digests[DIGEST_MARK + name] = _endpoint_digest(view)
        return digests

    def digest(self) -> str:
        """Hash of the whole state; equal states, and only they, give equal digests.

        The synchronous reference, computed from scratch (``rebuild`` and the tests
        compare against it); a server answers from ``refresh_digests`` and
        ``cached_digest`` instead, which give the same value without one long hold.
        """
        return combine_digests(self.endpoint_digests())

    # -- the digest in slices ------------------------------------------------------------

    def digests_pending(self) -> bool:
        """Whether some endpoint changed since its digest was last computed."""
        return bool(self._dirty or self._queue or self._partial is not None)

    def start_digest_round(self) -> None:
        """Queue every endpoint changed so far for ``refresh_digests`` (a no-op while a
        round is still queued)."""
        if not self._queue:
            partial = self._partial
            if partial is not None and partial.name in self._dirty:  # changed half-way
                self._partial = None
            self._queue = list(self._dirty)
            self._dirty.clear()

    def refresh_digests(self, budget: int) -> bool:
        """Hash queued endpoints, at most ``budget`` entries (a removed endpoint counts
        as one); ``True`` once the round is done.

        An endpoint longer than the budget is continued by the next call, unless it
        changed in between: then it is hashed again from its first entry. An endpoint
        changed after its digest was taken is dirty again and waits for the next round.
        """
        left = budget
        dirty, records, endpoints = self._dirty, self._records, self.endpoints
        while left > 0:
            partial = self._partial
            if partial is None:
                if not self._queue:
                    return True
                name = self._queue.pop()
                dirty.discard(name)
                cache = endpoints.get(name) if name[:1] != DIGEST_MARK else self.engine.digest_source(name)
                left -= 1
                if cache is None:
                    records.pop(name, None)
                    self._combined = None
                    continue
                partial = self._partial = _start_digest(name, cache)
            elif partial.name in dirty or partial.cache is not (
                    endpoints.get(partial.name) if partial.name[:1] != DIGEST_MARK
                    else self.engine.digest_source(partial.name)):
                # changed since this endpoint's hashing began: begin again
                self._partial = None
                self._queue.append(partial.name)
                continue
            want, taken = left, 0
            hasher = partial.hasher
            for digest, size in islice(partial.entries, want):
                _put(hasher, digest)
                hasher.update(size.to_bytes(8, "big"))
                taken += 1
            left -= taken
            if taken < want:  # the endpoint's entries are exhausted
                records[partial.name] = _record(partial.name, hasher.digest())
                self._partial = None
                self._combined = None
        return not self._queue and self._partial is None

    def settle_partial(self) -> None:
        """Give up an endpoint hashed half-way (it is queued again)."""
        if self._partial is not None:
            self._queue.append(self._partial.name)
            self._partial = None

    def cached_digest(self) -> str | None:
        """The digest from the per-endpoint digests: ``digest()``'s value, or ``None``
        while some endpoint has changed since its digest was computed."""
        if self.digests_pending():
            return None
        return self.latest_digest()

    def latest_digest(self) -> str:
        """Combine the per-endpoint digests as they are now, pending or not.

        With nothing pending it equals ``digest()``; otherwise each endpoint counts as
        it was when last hashed (a changed one with its old LRU, a new one not at all,
        a removed one still), which is what a caller gets under continuous writes.
        Combining costs a sort of the names and one hash of 68 B per endpoint.
        """
        if self._combined is None:
            records = self._records
            self._combined = hashlib.sha256(b"".join([records[n] for n in sorted(records)])).hexdigest()
        return self._combined


def combine_digests(parts: Mapping[str, bytes]) -> str:
    """Digest of a state from its endpoints' digests, however the endpoints were split
    between processes (``rebuild`` replays partitions in parallel).
    """
    h = hashlib.sha256()
    for name in sorted(parts):
        _put(h, name)
        h.update(parts[name])
    return h.hexdigest()


def _endpoint_digest(cache: Any) -> bytes:
    """Strings are length-prefixed so that no two different LRUs encode alike."""
    h = hashlib.sha256()
    h.update(len(cache.entries).to_bytes(8, "big"))
    for digest, size in cache.entries.items():
        _put(h, digest)
        h.update(size.to_bytes(8, "big"))
    return h.digest()


def _start_digest(name: str, cache: Any) -> _Partial:
    """Begin ``_endpoint_digest`` of one endpoint, to be fed entry by entry."""
    h = hashlib.sha256()
    h.update(len(cache.entries).to_bytes(8, "big"))
    return _Partial(name, cache, h, iter(cache.entries.items()))


def _record(name: str, endpoint_digest: bytes) -> bytes:
    """What ``combine_digests`` feeds its hash for one endpoint."""
    raw = name.encode()
    return len(raw).to_bytes(4, "big") + raw + endpoint_digest


def _put(h: hashlib._Hash, text: str) -> None:
    raw = text.encode()
    h.update(len(raw).to_bytes(4, "big"))
    h.update(raw)
