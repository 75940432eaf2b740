"""A checkpoint of the state in the changelog: one partition's changelog records folded into
the state they hold, the latest record of each key (a ``None`` value removes it), at the
partition's last applied offset.

Two readers use it: the follower, which re-reads another worker's partition from the
changelog's first record (``Reread``), and ``rebuild``, which starts a partition whose
oldest events were trimmed from the checkpoint and folds only the events after it
(``CheckpointReader``). The changelog may be compacted (Kafka's ``cleanup.policy=compact``
keeps the latest record of each key, in log order, at its own offset): its latest records
are the same, so the state read is the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from stream.kafka.embedded_log import applied_prefix
from stream.state.store import (
    APPLIED_KEY,
    ChangelogGate,
    applied_at,
    decode_applied,
    decode_change,
    decode_engine_change,
    encode_applied,
)

__all__ = ["CheckpointReader", "Reread"]


class Reread:
    """One partition's changelog read again from its start, kept aside from the view: the
    latest value of every entry key (a removal forgets the key), grouped by endpoint, and
    the owner's last applied offset; engine views' records likewise, by endpoint (a
    view's own record removed forgets the view)."""

    def __init__(self) -> None:
        self.endpoints: dict[str, dict[bytes, bytes]] = {}
        self.views: dict[str, dict[bytes, bytes]] = {}
        self.applied: int | None = None

    def add(self, key: bytes, value: bytes | None) -> None:
        """Take one changelog record."""
        if key == APPLIED_KEY:
            if value is not None:
                self.applied = decode_applied(value)
            return
        change = decode_change(key, value)
        if change is None:
            engine = decode_engine_change(key, value)
            if engine is not None:
                self._add_engine(key, value, *engine)
            return
        group = self.endpoints.setdefault(change[0], {})
        if value is None:
            group.pop(key, None)
        else:
            group[key] = value

    def _add_engine(self, key: bytes, value: bytes | None, endpoint: str, digest: str | None,
                    size: int | None) -> None:
        if digest is None and value is None:
            self.views.pop(endpoint, None)
            return
        group = self.views.setdefault(endpoint, {})
        if value is None:
            group.pop(key, None)
        else:
            group[key] = value

    def records(self) -> Iterator[tuple[bytes, bytes]]:
        """The partition as store records, each endpoint's keys together."""
        for group in self.endpoints.values():
            yield from group.items()
        for group in self.views.values():
            yield from group.items()
        if self.applied is not None:
            yield APPLIED_KEY, encode_applied(self.applied)


class CheckpointReader:
    """One changelog partition, given in log order in any number of pieces, read into the
    state at its last applied offset below ``end`` (the event partition's end offset).

    Only the records up to and including that applied-offset record are taken
    (``stream.kafka.embedded_log.applied_prefix``: what follows it is an event written in
    part, folded again after the checkpoint, or the records of events the log does not
    hold); they pass the gate that drops a zombie's records (``ChangelogGate``) into a
    ``Reread``. Records after the last applied record seen are held back until the next
    one comes, so memory holds the state plus at most one fetch.

    A compaction up to any point gives the same state plus events (an entry whose latest
    record lies after the checkpoint is touched or removed again by the events after it,
    and an LRU or view missing an entry it is about to touch or evict ends the same:
    ``tests/unit/test_checkpoint.py``), as long as the records of events the log lost are
    cut before it compacts (the kept log's start does: ``stream.kafka.log_cleaner.compact``).
    """

    def __init__(self, end: int) -> None:
        self.end = end
        self.reread = Reread()
        self.gate = ChangelogGate()
        self.finished = False  # an applied record at or past ``end`` came: the rest is not read
        self._pending: list[Any] = []

    @property
    def applied(self) -> int | None:
        """The applied offset of the state read so far (``None``: none)."""
        return self.reread.applied

    def feed(self, records: Iterable[Any]) -> None:
        """Take the next records (anything with ``key`` and ``value``), in log order."""
        if self.finished:
            return
        pending = self._pending
        pending.extend(records)
        keep = applied_prefix(pending, self.end, applied_at)
        add = self.reread.add
        for key, value in self.gate.admit((r.key, r.value, (r.key, r.value)) for r in pending[:keep]):
            add(key, value)
        rest = pending[keep:]
        self.finished = any(applied_at(r.key, r.value) is not None for r in rest)
        self._pending = [] if self.finished else rest

    def records(self) -> Iterator[tuple[bytes, bytes]]:
        """The checkpoint as store records (``stream.state.store.load_partition`` loads them)."""
        return self.reread.records()
