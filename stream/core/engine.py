"""Engine views: what each model server reports its own encoder cache holds.

An endpoint that has sent any engine event (``EngineEventsReported``) has an engine view:
the item hashes its cache holds, with sizes, kept apart from its estimate LRU
(``stream.core.cache``): placements never change a view, engine events never change an
LRU. A view exists from the endpoint's first engine event until the endpoint is deleted
or synced away, even when empty (after ``cleared`` it holds nothing, and says so).

Entries are kept in the order they were last stored, which is the order of the (offset,
index) at which the log stored them: each durable entry carries that rank, so a restart,
a follower and ``rebuild`` give back the same order, and the digest (taken in that order)
agrees. A view holds at most ``max_entries``: past it, the least recently stored entries
are dropped, as the engine's own eviction would (a view then misses what the engine
still holds beyond its most recent ``max_entries`` items).

Digests: the state digest covers each view as it covers an LRU, under the endpoint's
name prefixed by ``DIGEST_MARK`` (a control character, which no endpoint name holds), so
a state without engine views keeps the digest it always had.
"""

from __future__ import annotations

import heapq
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from sys import intern
from typing import Any, NamedTuple

from stream.core.events import (
    EngineCleared,
    EngineEventsReported,
    EngineItemsRemoved,
    Position,
)
from stream.core.holders import HeldBy, HolderSets, hold, release, union
from stream.core.items import Item

__all__ = ["DIGEST_MARK", "ENGINE_VIEW_ENTRIES", "EngineChange", "EngineView", "EngineViews"]

#: Default bound on one engine view: vLLM's default encoder cache (8,192 embeddings)
#: holds at most this many items even when every item is one embedding.
ENGINE_VIEW_ENTRIES = 8192

_new_tuple = tuple.__new__

#: Prefix of an engine view's name among the state digest's parts.
DIGEST_MARK = "\x04"


@dataclass(slots=True)
class EngineView:
    """One endpoint's engine view: item hash -> size, least recently stored first."""

    partition: int
    entries: dict[str, int] = field(default_factory=dict)
    weight: int = 0


class EngineChange(NamedTuple):
    """One durable change of an engine view, in the fold's order: an entry stored at
    ``(offset, index)`` with ``size``, or removed (``size`` None); with ``hash`` None,
    the view itself, created at ``offset`` (``size`` 0) or dropped (``size`` None), a
    drop naming the entries it took out in ``removed`` (each one record, before the
    view's own): one change for a whole view, not one per entry (a sync dropping 125
    views of 1,024 built 128,000)."""

    endpoint: str
    hash: str | None
    size: int | None
    offset: int
    index: int
    removed: tuple[str, ...] = ()


class EngineViews:
    """Every endpoint's engine view, plus an inverted index (``index``: hash -> endpoints,
    in the compact forms of ``stream.core.holders``) so that a match costs what it hits.
    ``dirty`` is the state's set of digest parts to rehash: every change adds its view's
    part (``DIGEST_MARK`` + name)."""

    def __init__(self, max_entries: int, dirty: set[str]) -> None:
        if max_entries < 1:
            raise ValueError("an engine view holds at least 1 entry")
        self.max_entries = max_entries
        self.views: dict[str, EngineView] = {}
        self.index: dict[str, HeldBy] = {}
        self._dirty = dirty
        self.bound_drops = 0  # entries this fold dropped past max_entries (not state: a count)

    # -- the fold ---------------------------------------------------------------------

    def apply(self, event: EngineEventsReported, position: Position,
              changes: list[EngineChange]) -> None:
        """Apply one report's facts in order, appending its net durable changes to
        ``changes``: the view's creation, each entry it leaves stored (in the order it
        was last stored), then each entry it took out, once, so that no record of one
        key follows another of the same key within the event (``ChangelogGate`` holds an
        event's removals back until its end)."""
        name = intern(event.endpoint)
        offset = position.offset
        view = self.views.get(name)
        if view is None:
            view = self.views[name] = EngineView(position.partition)
            changes.append(EngineChange(name, None, 0, offset, 0))
        self._dirty.add(DIGEST_MARK + name)
        entries, index = view.entries, 0
        held_before: dict[str, bool] = {}  # every hash touched: whether the view held it before
        last_stored: dict[str, int] = {}  # hash -> index of its last store in this event
        for fact in event.events:
            if isinstance(fact, EngineItemsRemoved):
                for digest in fact.hashes:
                    if digest in entries:
                        held_before.setdefault(digest, True)
                        self._take_out(view, name, digest)
            elif isinstance(fact, EngineCleared):
                held = self.index
                for digest in entries:
                    if digest not in held_before:
                        held_before[digest] = True
                    release(held, digest, name)
                entries.clear()
                view.weight = 0
            else:
                for item in fact.items:
                    digest, size = intern(item.hash), item.size
                    previous = entries.pop(digest, None)
                    held_before.setdefault(digest, previous is not None)
                    if previous is None:
                        self._hold(digest, name)
                    else:
                        view.weight -= previous
                    entries[digest] = size
                    view.weight += size
                    last_stored[digest] = index
                    index += 1
                while len(entries) > self.max_entries:
                    evicted = next(iter(entries))
                    held_before.setdefault(evicted, True)
                    self._take_out(view, name, evicted)
                    self.bound_drops += 1
        for digest, at in sorted(last_stored.items(), key=lambda pair: pair[1]):
            size = entries.get(digest)
            if size is not None:
                changes.append(EngineChange(name, digest, size, offset, at))
        for digest, held in held_before.items():
            if held and digest not in entries:  # tuple.__new__: 2x faster than EngineChange()
                changes.append(_new_tuple(EngineChange, (name, digest, None, offset, 0, ())))

    def drop(self, name: str, changes: list[EngineChange]) -> None:
        """Drop one endpoint's view (deleted or synced away), if it has one."""
        view = self.views.pop(name, None)
        if view is None:
            return
        self._dirty.add(DIGEST_MARK + name)
        index = self.index
        for digest in view.entries:
            release(index, digest, name)
        changes.append(EngineChange(name, None, None, 0, 0, tuple(view.entries)))

    def stale(self, partition: int, live: set[str]) -> list[str]:
        """The views of ``partition`` whose endpoint is not in ``live``."""
        return [name for name, view in self.views.items()
                if view.partition == partition and name not in live]

    def _take_out(self, view: EngineView, name: str, digest: str) -> None:
        view.weight -= view.entries.pop(digest)
        self._release(digest, name)

    def _hold(self, digest: str, name: str) -> None:
        hold(self.index, digest, name)

    def _release(self, digest: str, name: str) -> None:
        release(self.index, digest, name)

    @property
    def holders(self) -> HolderSets:
        """The inverted index as frozensets, read-only (``held_by`` reads through it)."""
        return HolderSets(self.index)

    # -- loading and following a store -------------------------------------------------

    def follow(self, partition: int, endpoint: str, digest: str | None, size: int | None) -> None:
        """Mirror one change written by another worker, in the owner's fold order (an
        upsert is the entry's most recent store); ``digest`` None is the view itself."""
        name = intern(endpoint)
        view = self.views.get(name)
        if digest is None:
            if size is None:
                self.drop(name, [])
            elif view is None:
                self.views[name] = EngineView(partition)
                self._dirty.add(DIGEST_MARK + name)
            return
        self._dirty.add(DIGEST_MARK + name)
        if size is None:
            if view is not None and digest in view.entries:
                self._take_out(view, name, digest)
            return
        digest = intern(digest)
        if view is None:
            view = self.views[name] = EngineView(partition)
        previous = view.entries.pop(digest, None)
        if previous is None:
            self._hold(digest, name)
        else:
            view.weight -= previous
        view.entries[digest] = size
        view.weight += size

    def replace(self, partition: int, endpoint: str, entries: Iterable[tuple[str, int]]) -> None:
        """Make one endpoint's view these entries (least recently stored first), swapped
        in whole so that a match sees the old view or the new one, never a mix."""
        name = intern(endpoint)
        old = self.views.get(name)
        stored = {intern(digest): size for digest, size in entries}
        for digest in stored:
            self._hold(digest, name)
        self.views[name] = EngineView(partition, stored, sum(stored.values()))
        self._dirty.add(DIGEST_MARK + name)
        if old is not None:
            for digest in old.entries:
                if digest not in stored:
                    self._release(digest, name)

    def drop_in_slices(self, partition: int, keep: set[str] | None,
                       entries_per_slice: int) -> Generator[int, None, int]:
        """Drop the partition's views not in ``keep`` (all of them when ``None``), yielding
        after about ``entries_per_slice`` entries; returns what the last step released."""
        names = [name for name, view in self.views.items()
                 if view.partition == partition and (keep is None or name not in keep)]
        released = 0
        for name in names:
            view = self.views.get(name)
            if view is None or view.partition != partition:
                continue
            released += len(view.entries) + 1
            self.drop(name, [])
            if released >= entries_per_slice:
                yield released
                released = 0
        return released

    def export(self) -> dict[str, tuple[int, dict[str, int], int]]:
        """The views as plain dicts and tuples (endpoint -> (partition, entries, weight))."""
        return {name: (view.partition, view.entries, view.weight) for name, view in self.views.items()}

    def load_export(self, exported: dict[str, tuple[int, dict[str, int], int]]) -> None:
        """Take in the views of ``export`` (of other endpoints than these)."""
        for name, (partition, entries, _weight) in exported.items():
            self.replace(partition, name, entries.items())

    def merge(self, other: EngineViews) -> None:
        """Add the views of another state's partitions; ``other`` is not used afterwards."""
        self.views.update(other.views)
        index = self.index
        for digest, names in other.index.items():
            held = index.get(digest)
            index[digest] = names if held is None else union(held, names)

    # -- queries ----------------------------------------------------------------------------

    def reporting(self, requested: Sequence[str]) -> list[str]:
        """The requested endpoints that have an engine view, in request order."""
        views = self.views
        if not views:
            return []
        return [name for name in requested if name in views]

    def hits(self, items: Sequence[Item], names: Iterable[str]) -> dict[str, list[Item]]:
        """The request items each of ``names`` holds in its view (only those that hold
        some, items in request order): walks the index from the request's items."""
        wanted = set(names)
        found: dict[str, list[Item]] = {}
        index = self.index
        for item in items:
            held = index.get(item.hash)
            if held is None:
                continue
            for name in wanted.intersection((held,) if type(held) is str else held):
                matched = found.get(name)
                if matched is None:
                    found[name] = [item]
                else:
                    matched.append(item)
        return found

    def summary(self, limit: int) -> list[tuple[str, int, int]]:
        """(endpoint, items, weight) of the views with most items first, then by name."""
        keys = [(-len(view.entries), name) for name, view in self.views.items()]
        top = heapq.nsmallest(limit, keys) if limit * 8 < len(keys) else sorted(keys)[:limit]
        return [(name, -count, self.views[name].weight) for count, name in top]

    def digest_source(self, part: str) -> Any:
        """The view a digest part names (``DIGEST_MARK`` + endpoint), or ``None``."""
        return self.views.get(part[1:])
