"""Bulk loading of the LRUs: a partition's saved entries in, a partition out (whole or
in slices, for a caller on an event loop), one endpoint's LRU swapped whole, and the
state as plain values to hand to another process and back."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from sys import intern
from typing import Any

from stream.core.holders import HeldBy, union
from stream.core.lru import Effects, EndpointCache, Entry, Lrus

__all__ = ["Exported", "Loading"]

#: (endpoint -> (partition, LRU, weight), holders, applied offsets,
#: endpoint -> (partition, engine view, weight))
Exported = tuple[dict[str, tuple[int, dict[str, int], int]], dict[str, HeldBy],
                 dict[int, int], dict[str, tuple[int, dict[str, int], int]]]


class Loading:
    """Bulk changes to ``lrus`` that come from a store or another process, not the log."""

    __slots__ = ("lrus",)

    def __init__(self, lrus: Lrus) -> None:
        self.lrus = lrus

    def drop_partition(self, partition: int) -> None:
        """Forget one partition's endpoints (LRUs and engine views) and offset, before
        loading it again."""
        lrus = self.lrus
        for name in [n for n, cache in lrus.endpoints.items() if cache.partition == partition]:
            lrus.drop(name, Effects())
        for name in lrus.engine.stale(partition, set()):
            lrus.engine.drop(name, [])
        lrus.applied.pop(partition, None)

    def drop_partition_in_slices(self, partition: int, entries_per_slice: int) -> Iterator[int]:
        """``drop_partition`` in steps of about ``entries_per_slice`` entries (whole
        endpoints), yielding how many each step released, for a caller on an event loop."""
        lrus = self.lrus
        names = [n for n, cache in lrus.endpoints.items() if cache.partition == partition]
        released = yield from self._drop_in_slices(partition, names, entries_per_slice)
        released += yield from lrus.engine.drop_in_slices(partition, None, entries_per_slice)
        lrus.applied.pop(partition, None)
        yield released

    def drop_partition_except_in_slices(self, partition: int, keep: set[str],
                                        entries_per_slice: int,
                                        keep_engine: set[str] | None = None) -> Iterator[int]:
        """Drop the partition's LRUs not in ``keep`` and engine views not in
        ``keep_engine`` (those a reload did not find in the store; ``None`` leaves the
        views alone), in steps as ``drop_partition_in_slices``; the applied offset stays."""
        lrus = self.lrus
        names = [n for n, cache in lrus.endpoints.items()
                 if cache.partition == partition and n not in keep]
        released = yield from self._drop_in_slices(partition, names, entries_per_slice)
        if keep_engine is not None:
            released += yield from lrus.engine.drop_in_slices(partition, keep_engine,
                                                              entries_per_slice)
        if released:
            yield released

    def _drop_in_slices(self, partition: int, names: list[str],
                        entries_per_slice: int) -> Generator[int, None, int]:
        """Drop these endpoints of the partition (those still in it), yielding after about
        ``entries_per_slice`` entries; returns how many the last, unyielded step released."""
        lrus = self.lrus
        released = 0
        for name in names:
            cache = lrus.endpoints.get(name)
            if cache is None or cache.partition != partition:
                continue
            released += len(cache.entries)
            lrus.drop(name, Effects())
            if released >= entries_per_slice:
                yield released
                released = 0
        return released

    def set_applied(self, partition: int, applied: int | None) -> None:
        """Record a partition's applied offset as loaded (``None``: nothing applied)."""
        if applied is None:
            self.lrus.applied.pop(partition, None)
        else:
            self.lrus.applied[partition] = applied

    def export(self) -> Exported:
        """The state as plain dicts, sets, tuples and strings, e.g. to ``marshal`` it to
        another process."""
        lrus = self.lrus
        endpoints = {name: (c.partition, c.entries, c.weight) for name, c in lrus.endpoints.items()}
        return endpoints, lrus.holders, lrus.applied, lrus.engine.export()

    def load_export(self, exported: tuple[Any, ...]) -> None:
        """Inverse of ``export``, into empty ``lrus``."""
        lrus = self.lrus
        endpoints, holders, applied, engine = exported
        lrus.endpoints = {name: EndpointCache(*parts) for name, parts in endpoints.items()}
        lrus.holders, lrus.applied = holders, applied
        lrus.dirty.update(lrus.endpoints)
        lrus.engine.load_export(engine)

    def merge(self, other: Lrus) -> None:
        """Add the endpoints of other LRUs built from other partitions (e.g. in another
        process); ``other`` is not to be used afterwards. Digests are the caller's."""
        lrus = self.lrus
        if other.capacity != lrus.capacity:
            raise ValueError(f"capacity {other.capacity} is not {lrus.capacity}")
        if (lrus.applied.keys() & other.applied.keys() or lrus.endpoints.keys() & other.endpoints.keys()
                or lrus.engine.views.keys() & other.engine.views.keys()):
            raise ValueError("only states of different partitions can be merged")
        lrus.endpoints.update(other.endpoints)
        lrus.engine.merge(other.engine)
        lrus.applied.update(other.applied)
        if not lrus.holders:
            lrus.holders = other.holders
            return
        holders = lrus.holders
        for digest, names in other.holders.items():
            held = holders.get(digest)
            holders[digest] = names if held is None else union(held, names)

    def restore(self, partition: int, applied: int | None, entries: Iterable[Entry]) -> None:
        """Load one partition's durable entries (any order) and its applied offset."""
        by_endpoint: dict[str, list[Entry]] = {}
        for entry in entries:
            by_endpoint.setdefault(entry.endpoint, []).append(entry)
        for name, group in by_endpoint.items():
            group.sort(key=lambda e: (e.offset, e.index))
            self.restore_lru(partition, name, [(e.hash, e.size) for e in group])
        if applied is not None:
            self.lrus.applied[partition] = applied

    def restore_lru(self, partition: int, name: str, entries: Iterable[tuple[str, int]]) -> None:
        """Load one endpoint's whole LRU, given least recent first as (hash, size)."""
        lrus = self.lrus
        name, lru = intern(name), {intern(digest): size for digest, size in entries}
        lrus.endpoints[name] = EndpointCache(partition, lru, sum(lru.values()))
        lrus.dirty.add(name)
        lrus.hold(name, lru)

    def replace_lru(self, partition: int, name: str, entries: Iterable[tuple[str, int]]) -> None:
        """Swap one endpoint's whole LRU for another, given least recent first.

        The new LRU goes in as one pointer change, so a match sees the old LRU or the new
        one, never a mix; an entry both hold is held throughout (a handover's reload
        never makes an answer lose a match the new view also has). Costs the old plus
        the new LRU's length.
        """
        lrus = self.lrus
        name = intern(name)
        old = lrus.endpoints.get(name)
        lru = {intern(digest): size for digest, size in entries}
        if not lru:
            if old is not None:
                lrus.drop(name, Effects())
            return
        lrus.hold(name, lru)
        lrus.endpoints[name] = EndpointCache(partition, lru, sum(lru.values()))
        lrus.dirty.add(name)
        if old is not None:
            for digest in old.entries:
                if digest not in lru:
                    lrus.release(digest, name)

    def entries(self) -> Iterable[tuple[int, Entry]]:
        """Every entry with its partition, ranked so that ``restore`` rebuilds this state."""
        for name, cache in self.lrus.endpoints.items():
            for index, (digest, size) in enumerate(cache.entries.items()):
                yield cache.partition, Entry(name, digest, size, 0, index)
