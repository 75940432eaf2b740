"""Where a record of the event topic belongs: Kafka's default partitioner and the rule
that an endpoint's events are keyed by it and sit in its key's partition.

Every event of an endpoint must be in one partition, in log order, for the fold to give
the same state live and in replay; a record that a foreign producer put elsewhere (another
partitioner: librdkafka's crc32, round robin, FNV; or another key) would make an
endpoint's history depend on which partitions a reader happens to own. Such records are
rejected (see ``stream.core.admission``), never applied.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from stream.core.events import EndpointDeleted, EndpointsSynced, EngineEventsReported, Event, ItemsPlaced

__all__ = ["MisroutedReason", "key_partition", "misrouted", "murmur2"]

MisroutedReason = Literal["wrong_key", "wrong_partition"]

_MASK = 0xFFFFFFFF
_SEED = 0x9747B28C
_M = 0x5BD1E995


def murmur2(data: bytes) -> int:
    """MurmurHash2 (32 bit) as Kafka's Java client computes it (``Utils.murmur2``), as an
    unsigned 32-bit value: seed 0x9747b28c, little-endian 4-byte words."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = int.from_bytes(data[i:i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = length % 4
    if tail:
        if tail == 3:
            h ^= data[whole + 2] << 16
        if tail >= 2:
            h ^= data[whole + 1] << 8
        h ^= data[whole]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h


@lru_cache(maxsize=65536)
def key_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives a key: positive murmur2 mod count.

    Cached: the keys are endpoint names, a bounded set, and each costs a few µs in Python.
    """
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def misrouted(event: Event, key: bytes | None, partition: int,
              partitions: int) -> MisroutedReason | None:
    """Why an event may not be applied where it was read, or ``None`` if it may.

    A placement, deletion or engine report must be keyed by its endpoint (UTF-8) and sit
    in that key's partition; a sync is written to every partition and acts on that partition only, so
    neither its key nor its partition is checked.
    """
    if isinstance(event, EndpointsSynced):
        return None
    assert isinstance(event, ItemsPlaced | EndpointDeleted | EngineEventsReported)
    expected = event.endpoint.encode()
    if key != expected:
        return "wrong_key"
    if key_partition(expected, partitions) != partition:
        return "wrong_partition"
    return None
