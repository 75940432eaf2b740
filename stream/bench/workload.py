"""The benchmark workload (performance issue): 1,000 endpoints, hex sha256 hashes,
placements of 1-3 items to 1-2 endpoints, matches naming 64 endpoints and 8 items.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator

from stream.core.events import ItemsPlaced
from stream.core.items import Item

__all__ = ["Workload"]


class Workload:
    """Deterministic for a seed, so every run measures the same records."""

    def __init__(self, endpoints: int = 1000, hashes: int = 200_000, seed: int = 7) -> None:
        self.random = random.Random(seed)
        self.endpoints = [f"bench/pod-{i:04d}" for i in range(endpoints)]
        self.hashes = [hashlib.sha256(f"item-{i}".encode()).hexdigest() for i in range(hashes)]

    def placement(self) -> tuple[list[str], list[Item]]:
        """1-3 items sent to 1-2 endpoints."""
        rng = self.random
        items = [Item(h, 1, "image") for h in rng.sample(self.hashes, rng.randint(1, 3))]
        return rng.sample(self.endpoints, rng.randint(1, 2)), items

    def placed_events(self, count: int) -> Iterator[ItemsPlaced]:
        """``count`` events, one per (placement, endpoint)."""
        made = 0
        while made < count:
            endpoints, items = self.placement()
            for endpoint in endpoints[: count - made]:
                yield ItemsPlaced(endpoint=endpoint, items=items)
                made += 1

    def match_body(self, held: list[str], endpoints: int = 64, items: int = 8) -> dict:
        """A match request naming ``endpoints`` endpoints and ``items`` items, half held."""
        rng = self.random
        present = rng.sample(held, items // 2)
        absent = [hashlib.sha256(f"absent-{rng.random()}".encode()).hexdigest()
                  for _ in range(items - len(present))]
        features = [{"hash": h, "modality": "image"} for h in present + absent]
        return {"endpoints": rng.sample(self.endpoints, endpoints),
                "body": {"tokenized": {"prompts": [{"mm_features": features}]}}}
