"""How LRU entries are laid out in a key-value store (a Faust RocksDB table, a rocksdict
file or a plain dict): one record per (endpoint, hash), so a placement writes only the
entries it touches, plus one applied-offset record per partition.

Keys: ``0x01 endpoint 0x00 hash`` for entries (endpoint names are printable, so the
first 0x00 splits them) and ``0x02 "applied"`` for the last applied log offset.
Values: big-endian ``offset:u64 index:u32 size:u32``; ``(offset, index)`` ranks
entries by recency, since a placement's items are touched in request order.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, MutableMapping

from stream.core.cache import Effects, Entry

__all__ = [
    "APPLIED_KEY",
    "decode_applied",
    "effect_records",
    "encode_applied",
    "encode_entry",
    "endpoint_records",
    "entry_key",
    "read_partition",
    "write_effects",
]

_ENTRY = b"\x01"
APPLIED_KEY = b"\x02applied"
_VALUE = struct.Struct(">QII")
_OFFSET = struct.Struct(">Q")


def entry_key(endpoint: str, digest: str) -> bytes:
    """Key of one LRU entry."""
    return b"".join((_ENTRY, endpoint.encode(), b"\x00", digest.encode()))


def encode_entry(entry: Entry) -> bytes:
    """Value of one LRU entry: its recency rank and its size."""
    return _VALUE.pack(entry.offset, entry.index, entry.size)


def encode_applied(offset: int) -> bytes:
    """Value of the applied-offset record."""
    return _OFFSET.pack(offset)


def decode_applied(raw: bytes) -> int:
    """Inverse of ``encode_applied``."""
    return int(_OFFSET.unpack(raw)[0])


def endpoint_records(endpoint: str, entries: Iterable[tuple[str, int]]) -> Iterator[tuple[bytes, bytes]]:
    """Records of one whole LRU given least recent first (hash, size), ranked by position."""
    prefix = _ENTRY + endpoint.encode() + b"\x00"
    pack = _VALUE.pack
    for index, (digest, size) in enumerate(entries):
        yield prefix + digest.encode(), pack(0, index, size)


def effect_records(effects: Effects, applied_offset: int) -> Iterator[tuple[bytes, bytes | None]]:
    """The records (``None`` deletes) that mirror one applied event, in the fold's order,
    the applied offset last: a store holding a prefix of them is the state before the
    event plus part of it, which re-applying the event completes.
    """
    for entry in effects.upserts:
        yield entry_key(entry.endpoint, entry.hash), encode_entry(entry)
    for endpoint, digest in effects.removals:
        yield entry_key(endpoint, digest), None
    yield APPLIED_KEY, encode_applied(applied_offset)


def write_effects(
    table: MutableMapping[bytes, bytes], effects: Effects, applied_offset: int
) -> None:
    """Mirror one applied event into a mapping store (a dict or a rocksdict file)."""
    for key, value in effect_records(effects, applied_offset):
        if value is None:
            del table[key]
        else:
            table[key] = value


def read_partition(records: Iterable[tuple[bytes, bytes]]) -> tuple[int | None, list[Entry]]:
    """Decode one partition's records into its applied offset and its entries.

    Records with other keys (e.g. Faust's own offset record) are ignored.
    """
    applied: int | None = None
    entries: list[Entry] = []
    for key, value in records:
        if key[:1] == _ENTRY:
            endpoint, _, digest = key[1:].partition(b"\x00")
            offset, index, size = _VALUE.unpack(value)
            entries.append(Entry(endpoint.decode(), digest.decode(), size, offset, index))
        elif key == APPLIED_KEY:
            applied = decode_applied(value)
    return applied, entries
