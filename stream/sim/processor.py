"""A model of one model server's multimodal processor cache, as vLLM v1 keeps it.

vLLM's front end preprocesses each multimodal item (decoding, resizing, the HF
processor) on the CPU before the request reaches the scheduler; the processed inputs are
kept in an LRU cache bounded in bytes, ``mm_processor_cache_gb`` GiB (default 4:
``vllm/config/multimodal.py``; the LRU by ``get_item_size`` is ``MultiModalCache``
in ``vllm/multimodal/cache/base.py``, used by ``vllm/multimodal/cache/lru.py``). A hit
skips the preprocessing of that item; an item larger than the whole cache is served
uncached. A lookup refreshes the item's recency, a miss inserts it.

Pure and deterministic.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["DEFAULT_PROCESSOR_CACHE_BYTES", "ProcessorCache"]

DEFAULT_PROCESSOR_CACHE_BYTES = 4 * 2**30  # mm_processor_cache_gb = 4 GiB


@dataclass(slots=True)
class ProcessorCache:
    """An LRU of processed items bounded by ``capacity`` bytes (0 disables it).

    Invariant: ``used == sum(entries.values()) <= capacity``; ``entries`` runs from
    the least to the most recently used.
    """

    capacity: int = DEFAULT_PROCESSOR_CACHE_BYTES
    entries: OrderedDict[str, int] = field(default_factory=OrderedDict)
    used: int = 0

    def __contains__(self, digest: object) -> bool:
        return digest in self.entries

    def lookup(self, digest: str, nbytes: int) -> bool:
        """Whether the processed item is cached (a hit saves its preprocessing); either
        way it is the most recently used afterwards, if it fits at all."""
        entries = self.entries
        if digest in entries:
            entries.move_to_end(digest)
            return True
        if nbytes > self.capacity:
            return False
        while self.used + nbytes > self.capacity:
            _, size = entries.popitem(last=False)
            self.used -= size
        entries[digest] = nbytes
        self.used += nbytes
        return False
