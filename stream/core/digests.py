"""The state digest: one hash of every LRU and engine view, equal for equal states.

It is kept per endpoint: every change marks its endpoint dirty (one set insertion, in
``Lrus.dirty``), and ``refresh`` rehashes dirty endpoints a bounded number of entries
at a time, so a caller on an event loop can spread the work over slices
(``stream.http.digest``) instead of hashing a 1M-entry state in one go.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any, NamedTuple

from stream.core.engine import DIGEST_MARK
from stream.core.lru import Lrus

__all__ = ["Digests", "combine_digests"]


class _Partial(NamedTuple):
    """An endpoint whose digest is being computed across slices."""

    name: str
    cache: Any  # an EndpointCache, or an engine view (stream.core.engine.EngineView)
    hasher: Any
    entries: Iterator[tuple[str, int]]


class Digests:
    """The per-endpoint digests of ``lrus`` and their combination.

    Invariant: an endpoint whose LRU changed since its digest was last computed is in
    ``lrus.dirty``, in ``_queue`` or is ``_partial``; ``_records`` maps each endpoint
    hashed since its last change to its part of the combined digest.
    """

    __slots__ = ("_combined", "_partial", "_queue", "_records", "lrus")

    def __init__(self, lrus: Lrus) -> None:
        self.lrus = lrus
        self._queue: list[str] = []
        self._partial: _Partial | None = None
        self._records: dict[str, bytes] = {}
        self._combined: str | None = None

    def endpoint_digests(self) -> dict[str, bytes]:
        """Per-endpoint hash of its entries in recency order, with sizes; each engine view
        too, under its endpoint's name after ``DIGEST_MARK`` (so a state without views
        has the digest it had before views existed)."""
        lrus = self.lrus
        digests = {name: _endpoint_digest(cache) for name, cache in lrus.endpoints.items()}
        for name, view in lrus.engine.views.items():
            digests[DIGEST_MARK + name] = _endpoint_digest(view)
        return digests

    def digest(self) -> str:
        """Hash of the whole state; equal states, and only they, give equal digests.

        The synchronous reference, computed from scratch (``rebuild`` and the tests
        compare against it); a server answers from ``refresh`` and ``cached`` instead,
        which give the same value without one long hold.
        """
        return combine_digests(self.endpoint_digests())

    def pending(self) -> bool:
        """Whether some endpoint changed since its digest was last computed."""
        return bool(self.lrus.dirty or self._queue or self._partial is not None)

    def start_round(self) -> None:
        """Queue every endpoint changed so far for ``refresh`` (a no-op while a round is
        still queued)."""
        if not self._queue:
            dirty = self.lrus.dirty
            partial = self._partial
            if partial is not None and partial.name in dirty:  # changed half-way
                self._partial = None
            self._queue = list(dirty)
            dirty.clear()

    def refresh(self, budget: int) -> bool:
        """Hash queued endpoints, at most ``budget`` entries (a removed endpoint counts
        as one); ``True`` once the round is done.

        An endpoint longer than the budget is continued by the next call, unless it
        changed in between: then it is hashed again from its first entry. An endpoint
        changed after its digest was taken is dirty again and waits for the next round.
        """
        left = budget
        lrus = self.lrus
        dirty, records, endpoints, engine = lrus.dirty, self._records, lrus.endpoints, lrus.engine
        while left > 0:
            partial = self._partial
            if partial is None:
                if not self._queue:
                    return True
                name = self._queue.pop()
                dirty.discard(name)
                cache = endpoints.get(name) if name[:1] != DIGEST_MARK else engine.digest_source(name)
                left -= 1
                if cache is None:
                    records.pop(name, None)
                    self._combined = None
                    continue
                partial = self._partial = _start_digest(name, cache)
            elif partial.name in dirty or partial.cache is not (
                    endpoints.get(partial.name) if partial.name[:1] != DIGEST_MARK
                    else engine.digest_source(partial.name)):
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

    def cached(self) -> str | None:
        """The digest from the per-endpoint digests: ``digest()``'s value, or ``None``
        while some endpoint has changed since its digest was computed."""
        if self.pending():
            return None
        return self.latest()

    def latest(self) -> str:
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

    def merge(self, other: Digests) -> None:
        """Take over ``other``'s digests (of other partitions): its clean ones stay valid,
        its changed and unfinished ones are redone here."""
        other.settle_partial()
        self._records.update(other._records)
        self._combined = None
        dirty = self.lrus.dirty
        dirty |= other.lrus.dirty
        dirty.update(other._queue)


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
