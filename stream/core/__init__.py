"""The pure domain core: items, events, the LRU fold, engine views, matching and the digest.

Nothing here imports Kafka, Faust, RocksDB or HTTP, or reads the clock.
"""

from stream.core.cache import CacheState, Capacity, Effects, EndpointMatch, Entry
from stream.core.engine import EngineChange, EngineView, EngineViews
from stream.core.events import (
    EndpointDeleted,
    EndpointsSynced,
    EngineCleared,
    EngineEventsReported,
    EngineItemsRemoved,
    EngineItemsStored,
    Event,
    ItemsPlaced,
    Position,
)
from stream.core.items import InvalidField, Item, extract_items, media_hash

__all__ = [
    "CacheState",
    "Capacity",
    "Effects",
    "EndpointDeleted",
    "EndpointMatch",
    "EndpointsSynced",
    "EngineChange",
    "EngineCleared",
    "EngineEventsReported",
    "EngineItemsRemoved",
    "EngineItemsStored",
    "EngineView",
    "EngineViews",
    "Entry",
    "Event",
    "InvalidField",
    "Item",
    "ItemsPlaced",
    "Position",
    "extract_items",
    "media_hash",
]
