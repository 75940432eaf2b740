"""How LRU entries are laid out in a key-value store (a Faust RocksDB table, a rocksdict
file or a plain dict): one record per (endpoint, hash), so a placement writes only the
entries it touches, plus one applied-offset record per partition.

Keys: ``0x01 endpoint 0x00 hash`` for entries, or ``0x01 endpoint 0x03 32 bytes`` when
the hash is 64 lower-case hex digits (a sha256, the common case: half the bytes on
disk), and ``0x02 "applied"`` for the last applied log offset. Endpoint names hold no
control characters, so the first one after the name tells the two forms apart.
Values: big-endian ``offset:u64 index:u32 size:u32``; ``(offset, index)`` ranks
entries by recency, since a placement's items are touched in request order.

Engine views (``stream.core.engine``) have keys of their own kind: ``0x04 endpoint`` for
the view itself (so that an empty view, after ``cleared``, is kept too; its value ranks
as an entry's, with index and size 0), and ``0x04 endpoint 0x00 hash`` or ``0x04
endpoint 0x03 32 bytes`` for its entries, whose values are an LRU entry's (the rank of
the store that put the entry there, and its size). They sort after every LRU entry and
the applied record, each endpoint's together, the view's own key first; a reader of an
older release skips them as foreign keys.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any, TypeVar

from stream.core.cache import CacheState, Effects, Entry

T = TypeVar("T")

__all__ = [
    "APPLIED_KEY",
    "ChangelogGate",
    "admit_changelog",
    "FAUST_OFFSET_KEY",
    "applied_at",
    "decode_applied",
    "decode_change",
    "effect_records",
    "encode_applied",
    "encode_faust_offset",
    "decode_engine_change",
    "encode_entry",
    "endpoint_records",
    "engine_key",
    "engine_records",
    "is_engine_key",
    "load_partition",
    "load_partition_in_slices",
    "read_lrus",
    "entry_key",
    "read_partition",
    "write_effects",
]

_ENTRY = b"\x01"
_ENGINE = b"\x04"
_RANKED = (_ENTRY, _ENGINE)  # kinds of key whose values carry the offset of the event that wrote them
APPLIED_KEY = b"\x02applied"
# Faust's own record in each partition file: the last changelog offset it holds.
FAUST_OFFSET_KEY = b"__faust\x00offset__"
_VALUE = struct.Struct(">QII")
_OFFSET = struct.Struct(">Q")


_TEXT, _HEX = b"\x00", b"\x03"
_SEPARATOR = re.compile(rb"[\x00\x03]")


def _hash_bytes(digest: str) -> bytes:
    """32 raw bytes for 64 lower-case hex digits, else the text.

    The round trip through ``bytes.fromhex`` checks the form at a third of a regex's
    cost (it rejects upper case and the whitespace ``fromhex`` would skip).
    """
    if len(digest) == 64:
        try:
            raw = bytes.fromhex(digest)
        except ValueError:
            raw = b""
        if raw.hex() == digest:
            return _HEX + raw
    return _TEXT + digest.encode()


def entry_key(endpoint: str, digest: str) -> bytes:
    """Key of one LRU entry."""
    return _ENTRY + endpoint.encode() + _hash_bytes(digest)


def engine_key(endpoint: str, digest: str | None = None) -> bytes:
    """Key of one engine-view entry, or (``digest`` None) of the view itself."""
    name = _ENGINE + endpoint.encode()
    return name if digest is None else name + _hash_bytes(digest)


def is_engine_key(key: bytes) -> bool:
    """Whether a record is an engine view's."""
    return key[:1] == _ENGINE


def encode_entry(entry: Entry) -> bytes:
    """Value of one LRU entry: its recency rank and its size."""
    return _VALUE.pack(entry.offset, entry.index, entry.size)


def encode_applied(offset: int) -> bytes:
    """Value of the applied-offset record."""
    return _OFFSET.pack(offset)


def decode_applied(raw: bytes) -> int:
    """Inverse of ``encode_applied``."""
    return int(_OFFSET.unpack(raw)[0])


def applied_at(key: bytes | None, value: bytes | None) -> int | None:
    """The applied offset a changelog record holds; ``None`` for an entry's record."""
    return decode_applied(value) if key == APPLIED_KEY and value is not None else None


def encode_faust_offset(offset: int) -> bytes:
    """Value of Faust's offset record (``FAUST_OFFSET_KEY``), as Faust writes it: written
    in the same batch as the records it counts, so a file never claims more than it holds."""
    return str(offset).encode()


def endpoint_records(endpoint: str, entries: Iterable[tuple[str, int]]) -> Iterator[tuple[bytes, bytes]]:
    """Records of one whole LRU given least recent first (hash, size), ranked by position."""
    prefix = _ENTRY + endpoint.encode()
    pack = _VALUE.pack
    for index, (digest, size) in enumerate(entries):
        yield prefix + _hash_bytes(digest), pack(0, index, size)


def engine_records(endpoint: str, entries: Iterable[tuple[str, int]]) -> Iterator[tuple[bytes, bytes]]:
    """Records of one whole engine view, its entries given least recently stored first
    (hash, size), ranked by position after the view's own record (as ``endpoint_records``)."""
    yield engine_key(endpoint), _VALUE.pack(0, 0, 0)
    prefix = _ENGINE + endpoint.encode()
    pack = _VALUE.pack
    for index, (digest, size) in enumerate(entries):
        yield prefix + _hash_bytes(digest), pack(0, index + 1, size)


def effect_records(effects: Effects, applied_offset: int) -> Iterator[tuple[bytes, bytes | None]]:
    """The records (``None`` deletes) that mirror one applied event, in the fold's order,
    the applied offset last: a store holding a prefix of them is the state before the
    event plus part of it, which re-applying the event completes.
    """
    for entry in effects.upserts:
        yield entry_key(entry.endpoint, entry.hash), encode_entry(entry)
    named, prefix = None, b""  # an endpoint's key prefix, made once for a run of its changes
    for endpoint, digest in effects.removals:
        if endpoint is not named:
            named, prefix = endpoint, _ENTRY + endpoint.encode()
        yield prefix + _hash_bytes(digest), None
    pack = _VALUE.pack
    named = None
    for endpoint, digest, size, offset, index, removed in effects.engine:
        if endpoint is not named:
            named, prefix = endpoint, _ENGINE + endpoint.encode()
        for taken in removed:
            yield prefix + _hash_bytes(taken), None
        yield (prefix if digest is None else prefix + _hash_bytes(digest),
               None if size is None else pack(offset, index, size))
    yield APPLIED_KEY, encode_applied(applied_offset)


class ChangelogGate:
    """Passes one changelog partition's records, in log order, except those of events
    written again after later ones.

    Each applied event's records are its entries' upserts (each value holds the offset of
    the event that wrote it), its removals, then its applied-offset record
    (``effect_records``). A record of an event at or below the highest applied offset
    seen was written again by a worker that had applied it already: a zombie owner
    resumed after its successor, or its producer resending a batch whose request timed
    out while it was frozen (no idempotent producer on the embedded broker). Upserts
    and applied records tell their event themselves and pass or drop at once; removals
    tell nothing, so they wait for their event's applied record (they are few: a seeded
    or compacted changelog, with one applied record per partition, holds none back).
    ``dropped`` counts the records dropped (upserts, removals and applied records), so
    that no record is lost unseen.
    """

    def __init__(self, applied: int = -1) -> None:
        self.applied = applied
        self.dropped = 0
        self._removals: list[Any] = []

    @property
    def holding(self) -> list[Any]:
        """The removals waiting for their event's applied record (an event part-read)."""
        return list(self._removals)

    def copy(self) -> ChangelogGate:
        """A gate in this one's state, to go back to when what it admitted could not be
        written (the same records are then given again)."""
        gate = ChangelogGate(self.applied)
        gate.dropped = self.dropped
        gate._removals = list(self._removals)
        return gate

    def admit(self, records: Iterable[tuple[bytes, bytes | None, T]]) -> list[T]:
        """Of the ``(key, value, item)`` given (and removals held from before), the items
        to apply, in order."""
        passed: list[T] = []
        removals = self._removals
        unpack = _VALUE.unpack_from
        for key, value, item in records:
            if key == APPLIED_KEY:
                if value is None:
                    continue
                applied = decode_applied(value)
                if applied > self.applied:
                    passed.extend(removals)
                    passed.append(item)
                    self.applied = applied
                else:
                    self.dropped += 1 + len(removals)
                removals.clear()
            elif value is None:
                removals.append(item)
            elif key[:1] not in _RANKED or unpack(value)[0] > self.applied:
                passed.append(item)
            else:
                self.dropped += 1
        return passed


def admit_changelog(frames: list[T]) -> list[T]:
    """Of a changelog partition's records read from its start (each with ``key`` and
    ``value``), those every reader applies (``ChangelogGate``): what compaction keeps from."""
    return ChangelogGate().admit((frame.key, frame.value, frame) for frame in frames)  # type: ignore[attr-defined]


def write_effects(
    table: MutableMapping[bytes, bytes], effects: Effects, applied_offset: int
) -> None:
    """Mirror one applied event into a mapping store (a dict or a rocksdict file)."""
    for key, value in effect_records(effects, applied_offset):
        if value is None:
            del table[key]
        else:
            table[key] = value


Lrus = dict[str, list[tuple[bytes, str]]]


def read_lrus(records: Iterable[tuple[bytes, bytes]]) -> tuple[int | None, Lrus]:
    """Decode one partition's records: its applied offset, and per endpoint its entries as
    (value, hash) pairs in any order; values sort by recency (big-endian offset, index).

    The store iterates in key order, so an endpoint's keys come together: the name is
    decoded once per run of keys, not once per entry. Other keys (Faust's own offset
    record, engine views) are ignored.
    """
    applied, lrus, _views = _read(records)
    return applied, lrus


def _read(records: Iterable[tuple[bytes, bytes]]) -> tuple[int | None, Lrus, Lrus]:
    """``read_lrus``, and the engine views as the LRUs are (a view without entries is
    an empty list)."""
    applied: int | None = None
    lrus: Lrus = {}
    views: Lrus = {}
    prefix, hexed, group = b"", False, None
    for key, value in records:
        if key[:1] != _ENTRY:
            if key == APPLIED_KEY:
                applied = decode_applied(value)
            elif key[:1] == _ENGINE:
                _add_engine_record(views, key, value)
            continue
        if group is None or not key.startswith(prefix):
            at, hexed = _split_entry_key(key)
            prefix = key[:at + 1]
            group = lrus.setdefault(key[1:at].decode(), [])
        raw = key[len(prefix):]
        group.append((value, raw.hex() if hexed else raw.decode()))
    return applied, lrus, views


def _add_engine_record(views: Lrus, key: bytes, value: bytes) -> None:
    """Put one engine record in ``views``: the view's own makes it exist, an entry's adds
    its (value, hash)."""
    name, digest = _engine_parts(key)
    group = views.get(name)
    if group is None:
        group = views[name] = []
    if digest is not None:
        group.append((value, digest))


def _engine_parts(key: bytes) -> tuple[str, str | None]:
    """An engine key's endpoint, and its entry's hash (``None``: the view's own key)."""
    split = _SEPARATOR.search(key, 1)
    if split is None:
        return key[1:].decode(), None
    at = split.start()
    raw = key[at + 1:]
    return key[1:at].decode(), raw.hex() if key[at:at + 1] == _HEX else raw.decode()


def decode_engine_change(key: bytes, value: bytes | None) -> tuple[str, str | None, int | None] | None:
    """One changelog record of an engine view as (endpoint, hash or ``None`` for the view
    itself, size or ``None`` for a removal); ``None`` for records of another kind."""
    if key[:1] != _ENGINE:
        return None
    name, digest = _engine_parts(key)
    return name, digest, None if value is None else _size_of(value)


def decode_change(key: bytes, value: bytes | None) -> tuple[str, str, int | None] | None:
    """One changelog record as (endpoint, hash, size or ``None`` for a removal); ``None``
    for records that are not entries (the applied offset)."""
    if key[:1] != _ENTRY:
        return None
    at, hexed = _split_entry_key(key)
    raw = key[at + 1:]
    size = None if value is None else _size_of(value)
    return key[1:at].decode(), raw.hex() if hexed else raw.decode(), size


def _split_entry_key(key: bytes) -> tuple[int, bool]:
    """Where the endpoint name ends in an entry key, and whether a raw sha256 follows."""
    split = _SEPARATOR.search(key, 1)
    assert split is not None, key
    at = split.start()
    return at, key[at:at + 1] == _HEX


def read_partition(records: Iterable[tuple[bytes, bytes]]) -> tuple[int | None, list[Entry]]:
    """Decode one partition's records into its applied offset and its entries."""
    applied, lrus = read_lrus(records)
    entries = []
    for endpoint, pairs in lrus.items():
        for value, digest in pairs:
            offset, index, size = _VALUE.unpack(value)
            entries.append(Entry(endpoint, digest, size, offset, index))
    return applied, entries


def load_partition(state: CacheState, partition: int, records: Iterable[tuple[bytes, bytes]]) -> None:
    """Load one partition's store into ``state`` (the fast path of restarts)."""
    applied, lrus, views = _read(records)
    from_bytes = int.from_bytes
    for endpoint, pairs in lrus.items():
        pairs.sort()
        state.loading.restore_lru(partition, endpoint,
                                  [(digest, from_bytes(value[12:16])) for value, digest in pairs])
    for endpoint, pairs in views.items():
        pairs.sort()
        state.lrus.engine.replace(partition, endpoint,
                                  [(digest, from_bytes(value[12:16])) for value, digest in pairs])
    state.loading.restore(partition, applied, ())


def load_partition_in_slices(state: CacheState, partition: int,
                             records: Iterable[tuple[bytes, bytes]],
                             entries_per_slice: int = 4096) -> Iterator[int]:
    """Make ``state``'s part for ``partition`` what the records say, in steps of about
    ``entries_per_slice`` entries, yielding how many each step loaded or released, so a
    caller on an event loop can run the loop in between: the one path by which a reload
    (from the table's file) and the follower (from a changelog re-read) load a partition.

    What the partition held before keeps answering until it is replaced: each LRU and
    each engine view is swapped whole (``Loading.replace_lru``,
    ``EngineViews.replace``) as soon as its keys end (the store iterates in key order,
    and a re-read gives each endpoint's keys together, so an endpoint's keys come
    together and a step reads at most the slice plus one endpoint's records), then the
    LRUs and views the records do not have are dropped; no step removes an entry the
    records hold. Each LRU and view is ordered by the stored rank, whatever order the
    records came in. A RocksDB iterator reads one snapshot, so writes to the file
    between steps do not change what is loaded; the caller must not apply events of
    this partition to ``state`` until the last step.
    """
    from_bytes = int.from_bytes
    applied: int | None = None
    kind, name, group = b"", "", []  # the run of keys being read: its kind and endpoint
    prefix: bytes | None = None  # its keys' common start up to the hash (None: not known)
    hexed, loaded = False, 0
    names: set[str] = set()
    views: set[str] = set()

    def replace() -> int:
        group.sort()
        entries = [(d, from_bytes(v[12:16])) for v, d in group]
        if kind == _ENTRY:
            state.loading.replace_lru(partition, name, entries)
            names.add(name)
            return len(group)
        state.lrus.engine.replace(partition, name, entries)
        views.add(name)
        return len(group) + 1  # and the view's own record

    for key, value in records:
        if prefix is None or not key.startswith(prefix):
            first = key[:1]
            if first != _ENTRY and first != _ENGINE:
                if key == APPLIED_KEY:
                    applied = decode_applied(value)
                continue
            split = _SEPARATOR.search(key, 1)
            at = len(key) if split is None else split.start()  # no separator: a view's own key
            hexed = key[at:at + 1] == _HEX
            after = key[1:at].decode()
            if first != kind or after != name:  # an endpoint's hex and text hashes sort apart
                if kind:
                    loaded += replace()
                    if loaded >= entries_per_slice:
                        yield loaded
                        loaded = 0
                kind, name, group = first, after, []
            if split is None:
                prefix = None
                continue
            prefix = key[:at + 1]
        raw = key[len(prefix):]
        group.append((value, raw.hex() if hexed else raw.decode()))
    if kind:
        loaded += replace()
    yield loaded
    yield from state.loading.drop_partition_except_in_slices(partition, names, entries_per_slice,
                                                             keep_engine=views)
    state.loading.set_applied(partition, applied)


def _size_of(value: bytes) -> int:
    return int.from_bytes(value[12:16], "big")
