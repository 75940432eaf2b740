"""The one path by which a partition's durable entries (LRUs and engine views) enter the
live view: a reload of an owned partition (from the table's RocksDB file) and a followed
partition's re-read (from the changelog) both go through ``load_partition_into_view``.

It swaps each endpoint's LRU and engine view whole and drops what the records lack only
at the end (``stream.state.store.load_partition_in_slices``), so the view keeps answering from
what it held until the new entries replace it, and the loop turns every
``RELOAD_SLICE_ENTRIES`` (one go held it ~3.5 s at 1M entries; the engine records, read
in one go before the views were swapped as their keys end, 1.4 s at 1M).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterable

from stream.core.cache import CacheState
from stream.state.store import load_partition_in_slices

__all__ = ["RELOAD_SLICE_ENTRIES", "drop_partition_in_slices", "freeze_the_view", "load_partition_into_view"]

# Entries swapped or dropped between two turns of the loop (~2 ms a slice).
RELOAD_SLICE_ENTRIES = 1024


async def load_partition_into_view(state: CacheState, partition: int,
                                   records: Iterable[tuple[bytes, bytes]]) -> None:
    """Make the view's part for ``partition`` what the store records say, in slices, and
    freeze it (``freeze_the_view``).

    The caller must not change this partition of ``state`` until it returns.
    """
    for _ in load_partition_in_slices(state, partition, records, RELOAD_SLICE_ENTRIES):
        await asyncio.sleep(0)
    freeze_the_view()


def freeze_the_view() -> None:
    """Keep the collector from scanning the entries the view just took in again: they are
    long-lived, and a full pass over a 1M-entry view stalled requests ~80 ms in the latency
    benchmark. Only after a load (or a merged preload): freezing takes every object
    tracked now, and one that later becomes garbage in a cycle is never collected; frozen
    after each rebase of the embedded broker too, serve kept ~1.4k such objects a rebase
    (old connections, fetches, futures) and its RSS climbed with the rebases."""
    gc.freeze()


async def drop_partition_in_slices(state: CacheState, partition: int) -> None:
    """``Loading.drop_partition`` with the loop turning every ``RELOAD_SLICE_ENTRIES``."""
    for _ in state.loading.drop_partition_in_slices(partition, RELOAD_SLICE_ENTRIES):
        await asyncio.sleep(0)
