"""The fold: one event of the log at its position applied to the LRUs.

``Fold.apply(event, position)`` is the only way an LRU changes from the log. It is
deterministic in the events and their log positions, and it skips any event at or
below the last applied offset of its partition, so redelivery after a crash changes
nothing. Each call returns the ``Effects`` a durable store must write to mirror the
change entry by entry (never a whole LRU per placement). ``follow`` mirrors one entry
change that another worker's fold made.
"""

from __future__ import annotations

from sys import intern

from stream.core.events import (
    EndpointDeleted,
    EndpointsSynced,
    EngineEventsReported,
    Event,
    ItemsPlaced,
    Position,
)
from stream.core.holders import TUPLE_MAX
from stream.core.lru import Effects, EndpointCache, Entry, Lrus

__all__ = ["Fold"]

_new_tuple = tuple.__new__


class Fold:
    """Applies events to ``lrus`` (their index and engine views included)."""

    __slots__ = ("lrus",)

    def __init__(self, lrus: Lrus) -> None:
        self.lrus = lrus

    def advance(self, position: Position) -> bool:
        """Mark a log position as applied; ``False`` if it already was (a redelivery)."""
        partition, offset = position
        applied = self.lrus.applied
        if offset <= applied.get(partition, -1):
            return False
        applied[partition] = offset
        return True

    def apply(self, event: Event, position: Position) -> Effects | None:
        """Apply one event at its log position; ``None`` if it was already applied."""
        if not self.advance(position):
            return None
        lrus = self.lrus
        partition = position.partition
        effects = Effects()
        if isinstance(event, ItemsPlaced):
            self._place(event, position, effects)
        elif isinstance(event, EndpointDeleted):
            lrus.drop(event.endpoint, effects)
            lrus.engine.drop(event.endpoint, effects.engine)
        elif isinstance(event, EndpointsSynced):
            if event.live:
                live = set(event.live)
                stale = [
                    name
                    for name, cache in lrus.endpoints.items()
                    if cache.partition == partition and name not in live
                ]
                for name in stale:
                    lrus.drop(name, effects)
                for name in lrus.engine.stale(partition, live):
                    lrus.engine.drop(name, effects.engine)
        elif isinstance(event, EngineEventsReported):
            lrus.engine.apply(event, position, effects.engine)
        return effects

    def _place(self, event: ItemsPlaced, position: Position, effects: Effects) -> None:
        """Touch each item (new ones indexed), then evict from the least recent end.
        The index is written inline, not through ``Lrus.hold``: this is the hot loop."""
        lrus = self.lrus
        name = intern(event.endpoint)
        lrus.dirty.add(name)
        cache = lrus.endpoints.get(name)
        if cache is None:
            cache = lrus.endpoints[name] = EndpointCache(position.partition)
        entries, holders, upserts = cache.entries, lrus.holders, effects.upserts
        by_size, limit = lrus.by_size, lrus.capacity.per_endpoint
        offset = position.offset
        weight = cache.weight
        for index, item in enumerate(event.items):
            digest, size = intern(item.hash), item.size
            if by_size and size > limit:
                continue
            previous = entries.pop(digest, None)
            if previous is None:  # Lrus.hold, inline
                held = holders.get(digest)
                if held is None:
                    holders[digest] = name
                elif type(held) is str:  # idempotent, as hold is: a stale index heals
                    if held != name:
                        holders[digest] = (held, name)
                elif type(held) is tuple:
                    if name not in held:
                        holders[digest] = held + (name,) if len(held) < TUPLE_MAX else {*held, name}
                else:
                    held.add(name)
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
            lrus.release(evicted, name)
            effects.removals.append((name, evicted))
        cache.weight = weight
        if not entries:
            del lrus.endpoints[name]

    def follow(self, partition: int, endpoint: str, digest: str, size: int | None) -> None:
        """Mirror one entry change written by another worker (``None`` removes it).

        Changes of a partition arrive in the order the owner's fold made them, so an
        upsert is the entry's most recent touch: it goes to the recent end of the LRU.
        """
        lrus = self.lrus
        endpoint, digest = intern(endpoint), intern(digest)
        cache = lrus.endpoints.get(endpoint)
        lrus.dirty.add(endpoint)
        if size is None:
            if cache is not None and digest in cache.entries:
                cache.weight -= cache.entries.pop(digest)
                lrus.release(digest, endpoint)
                if not cache.entries:
                    del lrus.endpoints[endpoint]
            return
        if cache is None:
            cache = lrus.endpoints[endpoint] = EndpointCache(partition)
        previous = cache.entries.pop(digest, None)
        if previous is None:
            lrus.hold(endpoint, (digest,))
        else:
            cache.weight -= previous
        cache.entries[digest] = size
        cache.weight += size
