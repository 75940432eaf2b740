"""The inverted index's values (hash -> the endpoints holding it), in their compact form.

A ``set`` costs 216 B even for one name and 728 B from six on; at 1M entries over ~190k
hashes the sets took ~105 B an entry, more than the LRUs themselves. So a hash's holders
are stored as:

- one endpoint: its name (``str``), nothing allocated;
- 2 to ``TUPLE_MAX`` endpoints: a ``tuple`` of distinct names (40 + 8 B a name);
- more: a ``set``, so that a hash every endpoint holds is still looked up in O(1).

A ``set`` shrinks back to a name when one holder is left, never to a tuple (no churn
at the boundary). Readers take all three forms; outside the core, ``HolderSets`` shows
the index as frozensets. The compiled ``stream.core.lru`` and ``stream.core.fold`` write
the same forms inline (their hot loops); ``hold`` and ``release`` here are for the rest.
Holding is idempotent, as a set's ``add`` is: a swapped LRU or view is held again whole.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

__all__ = ["TUPLE_MAX", "HeldBy", "HolderSets", "hold", "names", "release", "union"]

#: The most endpoints a hash's holders are kept as a tuple for (a scan of up to 16
#: pointers is as cheap as a set lookup).
TUPLE_MAX = 16

HeldBy = str | tuple[str, ...] | set[str]


def names(held: HeldBy) -> tuple[str, ...] | set[str]:
    """The holders as a collection of names (a name alone is one)."""
    return (held,) if type(held) is str else held


def hold(holders: dict[str, HeldBy], digest: str, name: str) -> None:
    """Add ``name`` to the holders of ``digest``, if it is not one already (a set's
    ``add``: a view swapped whole is held again whole)."""
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


def release(holders: dict[str, HeldBy], digest: str, name: str) -> None:
    """Take ``name`` out of the holders of ``digest`` (it must hold it)."""
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


def union(first: HeldBy, second: HeldBy) -> HeldBy:
    """The holders of two states with no endpoint in common, in the compact form."""
    both = (*names(first), *names(second))
    return both if len(both) <= TUPLE_MAX else set(both)


class HolderSets(Mapping[str, frozenset[str]]):
    """A read-only view of an index of compact holders, each value a ``frozenset``: what
    callers outside the core read (``Index.holders``). It compares equal to a dict of
    sets with the same names. ``raw`` is the index itself, for the core's own readers."""

    __slots__ = ("raw",)

    def __init__(self, raw: dict[str, HeldBy]) -> None:
        self.raw = raw

    def __getitem__(self, digest: str) -> frozenset[str]:
        held = self.raw[digest]
        return frozenset((held,)) if type(held) is str else frozenset(held)

    def __contains__(self, digest: object) -> bool:
        return digest in self.raw

    def __iter__(self) -> Iterator[str]:
        return iter(self.raw)

    def __len__(self) -> int:
        return len(self.raw)

    def __repr__(self) -> str:
        return f"HolderSets({dict(self.items())!r})"

