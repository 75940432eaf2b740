"""Requests for the simulator: a synthetic workload drawn from a seed, or a recorded trace.

Everything random is drawn here, once, from ``random.Random(seed)``, before any policy
runs: every policy then sees exactly the same requests (arrival times, items, service
demands and the gateway replica each arrives at), so differences between policies are
the policies' alone.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass

from stream.core.items import Item

__all__ = ["Request", "SizeMix", "WorkloadSpec", "generate", "requests_from_trace"]


@dataclass(frozen=True, slots=True)
class Request:
    """One request: when it arrives (seconds from the start), at which gateway replica,
    its distinct items, and its decode time (the part of its service that no encoder
    cache shortens)."""

    id: int
    arrival: float
    replica: int
    items: tuple[Item, ...]
    decode_s: float

    @property
    def embeddings(self) -> int:
        """Encoder embeddings of all its items."""
        return sum(item.size for item in self.items)


@dataclass(frozen=True, slots=True)
class SizeMix:
    """Item sizes in encoder embeddings: shares of small images (``small`` each), large
    images (uniform in ``large``) and video clips (uniform in ``video``); the rest of the
    share is small images. Defaults: a 512x512 image is ~256 embeddings for a
    14-pixel-patch ViT with 2x2 merging; a 1-2 megapixel image 1,200-2,500; a short clip
    several thousand."""

    small: int = 256
    large: tuple[int, int] = (1200, 2500)
    video: tuple[int, int] = (3000, 6000)
    large_share: float = 0.35
    video_share: float = 0.15

    def draw(self, rng: random.Random) -> tuple[int, str]:
        """One item's size and modality."""
        u = rng.random()
        if u < self.video_share:
            return rng.randint(*self.video), "video"
        if u < self.video_share + self.large_share:
            return rng.randint(*self.large), "image"
        return self.small, "image"


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A synthetic workload: Poisson arrivals at ``rate`` requests per second in all,
    each with ``min_items``..``max_items`` distinct items drawn by Zipf popularity
    (exponent ``zipf``) from a catalogue of ``catalogue`` items, and an exponential
    decode time of mean ``decode_s``; replicas are chosen uniformly."""

    requests: int = 100_000
    rate: float = 96.0
    catalogue: int = 10_000
    zipf: float = 1.0
    min_items: int = 1
    max_items: int = 4
    decode_s: float = 2.0
    replicas: int = 3
    sizes: SizeMix = SizeMix()
    seed: int = 1


def generate(spec: WorkloadSpec) -> list[Request]:
    """Draw the whole workload (deterministic for ``spec``, ``spec.seed`` included)."""
    if spec.min_items < 1 or spec.max_items < spec.min_items:
        raise ValueError("need 1 <= min_items <= max_items")
    if spec.max_items > spec.catalogue:
        raise ValueError("max_items exceeds the catalogue")
    rng = random.Random(spec.seed)
    catalogue = []
    for index in range(spec.catalogue):
        size, modality = spec.sizes.draw(rng)
        catalogue.append(Item(f"item-{index}", size, modality))
    cumulative = list(itertools.accumulate((rank + 1) ** -spec.zipf for rank in range(spec.catalogue)))
    total = cumulative[-1]
    requests: list[Request] = []
    now = 0.0
    for request_id in range(spec.requests):
        now += rng.expovariate(spec.rate)
        want = rng.randint(spec.min_items, spec.max_items)
        chosen: dict[int, None] = {}
        while len(chosen) < want:
            chosen[bisect.bisect_left(cumulative, rng.random() * total)] = None
        items = tuple(catalogue[index] for index in chosen)
        requests.append(Request(request_id, now, rng.randrange(spec.replicas), items,
                                rng.expovariate(1.0 / spec.decode_s)))
    return requests


def requests_from_trace(placements: Iterable[tuple[str | None, tuple[Item, ...], float | None]],
                        replicas: int, rate: float, decode_s: float, seed: int) -> list[Request]:
    """Requests from recorded placements ``(request_id, items, timestamp_s)`` in log order.

    Consecutive placements with the same request id are one request (a placement to k
    endpoints is k events). Recorded timestamps give the arrival times (relative to the
    first); where there are none, arrivals are drawn as a Poisson process at ``rate``.
    Replica and decode time are drawn from ``seed``.
    """
    rng = random.Random(seed)
    requests: list[Request] = []
    previous: str | None = None
    start: float | None = None
    now = 0.0
    for request_id, items, timestamp in placements:
        if request_id is not None and request_id == previous:
            continue
        previous = request_id
        if timestamp is not None:
            start = timestamp if start is None else start
            now = max(now, timestamp - start)
        else:
            now += rng.expovariate(rate)
        distinct = tuple({item.hash: item for item in items}.values())
        requests.append(Request(len(requests), now, rng.randrange(replicas), distinct,
                                rng.expovariate(1.0 / decode_s)))
    return requests

