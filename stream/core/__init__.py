"""The pure domain core: items, events, the LRU fold, matching and the digest.

Nothing here imports Kafka, Faust, RocksDB or HTTP, or reads the clock.
"""

from stream.core.cache import CacheState, Capacity, Effects, EndpointMatch, Entry
from stream.core.events import EndpointDeleted, EndpointsSynced, Event, ItemsPlaced, Position
from stream.core.items import InvalidField, Item, extract_items, media_hash

__all__ = [
    "CacheState",
    "Capacity",
    "Effects",
    "EndpointDeleted",
    "EndpointMatch",
    "EndpointsSynced",
    "Entry",
    "Event",
    "InvalidField",
    "Item",
    "ItemsPlaced",
    "Position",
    "extract_items",
    "media_hash",
]
