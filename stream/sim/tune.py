"""Capacity tuning: replay recorded events through the core under many capacities.

For each capacity (items mode or size mode) the recorded events are folded through a
fresh ``stream.core.cache.CacheState`` exactly as the service folds them, and every
placed item is checked before its placement is applied: a *hit* is an item still in
its endpoint's LRU when placed there again. The hit ratio is hits over all placed items
(item x endpoint placements).

Told the servers' true encoder cache size, the same placements also feed one
``stream.sim.encoder.EncoderCache`` per endpoint (each request's references dropped at
once: the log says where requests went, not how long they ran), and each index hit the
true cache does not hold is a *false hit*: a routing decision made for a cache entry
that is gone. The false-hit rate is false hits over index hits; a *missed hit* is an
item the true cache held that the index had dropped.

Pure: events in, rows out; no I/O and no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stream.core.cache import CacheState, Capacity
from stream.core.events import EndpointDeleted, EndpointsSynced, Event, ItemsPlaced, Position
from stream.sim.encoder import EncoderCache

__all__ = ["Recommendation", "TuneRow", "default_capacities", "recommend", "sweep"]


@dataclass(frozen=True, slots=True)
class TuneRow:
    """What one capacity would have given over the recorded placements."""

    capacity: Capacity
    placed: int
    hits: int
    false_hits: int | None = None
    missed_hits: int | None = None

    @property
    def hit_ratio(self) -> float:
        """Share of placed items still in the endpoint's LRU when placed again."""
        return self.hits / self.placed if self.placed else 0.0

    @property
    def false_hit_rate(self) -> float | None:
        """Share of the index's hits that the true encoder cache no longer held."""
        if self.false_hits is None:
            return None
        return self.false_hits / self.hits if self.hits else 0.0

    @property
    def wrong(self) -> int | None:
        """Placements where the index and the true cache disagree."""
        if self.false_hits is None or self.missed_hits is None:
            return None
        return self.false_hits + self.missed_hits


@dataclass(frozen=True, slots=True)
class Recommendation:
    """The capacity to configure and why."""

    row: TuneRow
    reason: str


def default_capacities(truth_size: int | None = None) -> list[Capacity]:
    """Items mode 1..4,096 and size mode 512..262,144 embeddings, doubling, plus the
    true encoder cache size in size mode when known."""
    items = [Capacity("items", 2**k) for k in range(13)]
    sizes = {512 * 2**k for k in range(10)}
    if truth_size is not None:
        sizes.add(truth_size)
    return items + [Capacity("size", n) for n in sorted(sizes)]


def sweep(events: Sequence[tuple[Position, Event]], capacities: Sequence[Capacity],
          truth_size: int | None = None,
          on_progress: Callable[[int], None] | None = None) -> list[TuneRow]:
    """One row per capacity, in the given order; ``on_progress`` gets events folded."""
    return [_replay(events, capacity, truth_size, on_progress) for capacity in capacities]


def _replay(events: Sequence[tuple[Position, Event]], capacity: Capacity, truth_size: int | None,
            on_progress: Callable[[int], None] | None) -> TuneRow:
    state = CacheState(capacity)
    truth: dict[str, EncoderCache] = {}
    placed = hits = false_hits = missed_hits = 0
    request = 0
    for done, (position, event) in enumerate(events, 1):
        if isinstance(event, ItemsPlaced):
            name = event.endpoint
            _, found = state.hits(event.items, [name])
            held = {item.hash for item in found.get(name, ())}
            placed += len(event.items)
            hits += len(held)
            if truth_size is not None:
                cache = truth.get(name)
                if cache is None:
                    cache = truth[name] = EncoderCache(truth_size)
                for item in event.items:
                    actual = item.hash in cache
                    if item.hash in held and not actual:
                        false_hits += 1
                    elif actual and item.hash not in held:
                        missed_hits += 1
                request += 1
                pairs = [(item.hash, item.size) for item in event.items]
                if cache.admit(request, pairs).pinned:
                    cache.release(request, [digest for digest, _ in pairs])
        elif isinstance(event, EndpointDeleted):
            truth.pop(event.endpoint, None)
        elif isinstance(event, EndpointsSynced) and event.live:
            live = set(event.live)
            for name in [n for n in truth if n not in live]:
                del truth[name]
        state.apply(event, position)
        if on_progress is not None and done % 4096 == 0:
            on_progress(4096)
    if on_progress is not None:
        on_progress(len(events) % 4096)
    if truth_size is None:
        return TuneRow(capacity, placed, hits)
    return TuneRow(capacity, placed, hits, false_hits, missed_hits)


def recommend(rows: Sequence[TuneRow], truth_size: int | None = None) -> Recommendation:
    """With the true cache size: the capacity with the fewest wrong answers (false plus
    missed hits), size mode first on a tie. Without it: the smallest capacity within
    95% of the best hit ratio, an upper bound only (see the reason)."""
    if not rows:
        raise ValueError("no capacities to choose from")
    if truth_size is not None:
        best = min(rows, key=lambda r: (r.wrong or 0, r.capacity.mode != "size", r.capacity.per_endpoint))
        return Recommendation(best, (
            f"fewest wrong answers against an encoder cache of {truth_size:,} embeddings: "
            f"{best.false_hits:,} false hits ({_pct(best.false_hit_rate)} of its hits) and "
            f"{best.missed_hits:,} missed hits over {best.placed:,} placed items"))
    top = max(r.hit_ratio for r in rows)
    for mode in ("size", "items"):
        near = [r for r in rows if r.capacity.mode == mode and r.hit_ratio >= 0.95 * top]
        if near:
            best = min(near, key=lambda r: r.capacity.per_endpoint)
            break
    return Recommendation(best, (
        f"smallest capacity within 95% of the best hit ratio ({_pct(top)}); a larger index only "
        "claims more hits. This is an upper bound: a server's encoder cache (vLLM's "
        "encoder_cache_size, by default max_num_batched_tokens) is usually far smaller, so "
        "pass --encoder-cache-size to size the index to the servers"))


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"
