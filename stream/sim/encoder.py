"""A model of one model server's encoder cache, following the rules of vLLM v1.

This is the *truth* the simulator scores the affinity signal against. Written from the
rules, not from vLLM's code:

- The budget is counted in encoder embeddings (``size``), not in items.
- An entry referenced by a running request is pinned: it is never evicted.
- When its last reference is dropped it becomes *freeable* but stays resident; a later
  request for the same hash reuses it (a hit) and pins it again.
- Space is made by evicting freeable entries, the least recently freed first. If free
  plus freeable space is too small for what a request must encode, the request waits.
- An item larger than the per-step encoder compute budget (``budget``) can never be
  scheduled.

A request is admitted all at once: its cached items are pinned (hits) and its missing
items are allocated together. A request whose embeddings exceed the whole cache could
never be pinned at once; vLLM then encodes it chunk by chunk as the prefill
reaches each item, so here its items are allocated one by one and each is freed as
soon as it is in (nothing of it stays pinned).

Pure and deterministic: no clock, no randomness; the caller says when references drop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["Admission", "EncoderCache"]


@dataclass(frozen=True, slots=True)
class Admission:
    """What one admission attempt did.

    ``status`` is ``admitted``, ``waiting`` (nothing changed: not enough free plus
    freeable space now) or ``too_large`` (nothing changed: an item to encode exceeds the
    per-step budget, so the request can never run). ``hits`` are the request's items
    found resident, ``added`` those encoded and stored, ``evicted`` the hashes removed to
    make room, ``pinned`` whether the request holds references that ``release`` drops.
    """

    status: Literal["admitted", "waiting", "too_large"]
    hits: tuple[tuple[str, int], ...] = ()
    added: tuple[tuple[str, int], ...] = ()
    evicted: tuple[str, ...] = ()
    pinned: bool = False


_WAITING = Admission("waiting")
_TOO_LARGE = Admission("too_large")


@dataclass(slots=True)
class EncoderCache:
    """One server's encoder cache of ``size`` embeddings.

    Invariants: ``free + sum(resident sizes) == size``; every freeable entry has no
    reference; ``freeable`` is ordered by the time each entry was freed, oldest first.
    """

    size: int
    budget: int = 0
    free: int = 0
    sizes: dict[str, int] = field(default_factory=dict)
    refs: dict[str, set[int]] = field(default_factory=dict)
    freeable: dict[str, int] = field(default_factory=dict)
    freeable_space: int = 0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError("encoder cache size must be at least 1 embedding")
        # an item larger than the cache could never be held either (vLLM raises the
        # cache to the largest item instead)
        self.budget = self.size if self.budget < 1 else min(self.budget, self.size)
        self.free = self.size

    def __contains__(self, digest: object) -> bool:
        """Whether an entry is resident (pinned or freeable)."""
        return digest in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def used(self) -> int:
        """Embeddings held by resident entries."""
        return self.size - self.free

    def admit(self, request_id: int, items: Sequence[tuple[str, int]]) -> Admission:
        """Try to start request ``request_id`` with its distinct ``(hash, size)`` items."""
        sizes, freeable = self.sizes, self.freeable
        missing = [(digest, size) for digest, size in items if digest not in sizes]
        if any(size > self.budget for _, size in missing):
            return _TOO_LARGE
        need = sum(size for _, size in missing)
        hits = tuple((digest, sizes[digest]) for digest, _ in items if digest in sizes)
        if need + sum(size for _, size in hits) > self.size:
            return self._admit_streamed(request_id, hits, missing)
        # space reusable now: free plus freeable, less the freeable hits this request pins
        reusable = self.free + self.freeable_space - sum(s for d, s in hits if d in freeable)
        if need > reusable:
            return _WAITING
        for digest, _ in hits:
            self._pin(digest, request_id)
        evicted = self._make_room(need)
        for digest, size in missing:
            sizes[digest] = size
            self.refs[digest] = {request_id}
            self.free -= size
        return Admission("admitted", hits, tuple(missing), evicted, pinned=True)

    def _admit_streamed(self, request_id: int, hits: tuple[tuple[str, int], ...],
                        missing: list[tuple[str, int]]) -> Admission:
        """A request too big to pin at once: its items go in one by one, each freed as
        soon as it is stored; its hits are used without being pinned."""
        if not missing:
            return Admission("admitted", hits, (), (), pinned=False)
        if max(size for _, size in missing) > self.free + self.freeable_space:
            return _WAITING
        evicted: list[str] = []
        added: list[tuple[str, int]] = []
        for digest, size in missing:
            evicted.extend(self._make_room(size))
            self.sizes[digest] = size
            self.free -= size
            self.refs[digest] = set()
            self.freeable[digest] = size
            self.freeable_space += size
            added.append((digest, size))
        # an entry added and evicted within the request is not resident at the end
        gone = set(evicted)
        return Admission("admitted", hits, tuple(a for a in added if a[0] not in gone),
                         tuple(evicted), pinned=False)

    def release(self, request_id: int, hashes: Iterable[str]) -> None:
        """Drop the request's references; an entry left with none becomes freeable, as
        the most recently freed."""
        refs = self.refs
        for digest in hashes:
            holders = refs.get(digest)
            if not holders or request_id not in holders:
                continue
            holders.discard(request_id)
            if not holders:
                size = self.sizes[digest]
                self.freeable[digest] = size
                self.freeable_space += size

    def _pin(self, digest: str, request_id: int) -> None:
        holders = self.refs[digest]
        if not holders:
            self.freeable_space -= self.freeable.pop(digest)
        holders.add(request_id)

    def _make_room(self, need: int) -> tuple[str, ...]:
        """Evict freeable entries, least recently freed first, until ``need`` is free."""
        evicted: list[str] = []
        freeable = self.freeable
        while self.free < need:
            digest = next(iter(freeable))
            size = freeable.pop(digest)
            self.freeable_space -= size
            del self.sizes[digest]
            del self.refs[digest]
            self.free += size
            evicted.append(digest)
        return tuple(evicted)
