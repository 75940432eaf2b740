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

Before it recommends, the log must hold enough evidence (:data:`MIN_REPEATS`) and what
it recommends follows docs/simulation.md's "What to configure": items that carry their
sizes get size mode; items without sizes (the ``chat_completions`` and ``generate``
sources, every size 1) get items mode, sized against the true cache with
``--mean-item-embeddings``.

Pure: events in, rows out; no I/O and no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from stream.core.cache import CacheState, Capacity
from stream.core.events import EndpointDeleted, EndpointsSynced, Event, ItemsPlaced, Position
from stream.sim.encoder import EncoderCache

__all__ = ["MIN_REPEATS", "NoRecommendation", "Recommendation", "Survey", "TuneRow", "default_capacities",
           "recommend", "survey", "sweep"]

# The least evidence a recommendation is made from: placed items that were already on
# their endpoint (repeats), the most hits any capacity can count. Without the true
# cache size the choice is the smallest capacity within 5% of the best hit count; a hit
# count H varies by about sqrt(H) (a count of rare events), i.e. by 1/sqrt(H) of itself,
# and 1/sqrt(400) = 5%: below 400 the band the choice allows is narrower than its noise,
# and which capacity lands in it is chance. With the true size the choice counts wrong
# answers, each of them a repeat too (false hits are hits; missed hits are repeats the
# index dropped): the same floor. `tune --min-repeats` moves it.
MIN_REPEATS = 400


class NoRecommendation(ValueError):
    """The log cannot support a recommendation; the message says why and what would."""


@dataclass(frozen=True, slots=True)
class Survey:
    """What a log holds, before any capacity: how much evidence, and whether sizes."""

    events: int
    placed: int
    repeats: int
    unsized: int

    @property
    def sizes_known(self) -> bool:
        """Whether most placed items carry an embedding count (size 1 means none given)."""
        return self.unsized * 2 < self.placed


def survey(events: Sequence[tuple[Position, Event]]) -> Survey:
    """Placed items, repeats (hits of an index that never evicts, folded by the core)
    and items of size 1 (no size given: the chat_completions and generate sources)."""
    state = CacheState(Capacity("items", 2**62))
    placed = repeats = unsized = 0
    for position, event in events:
        if isinstance(event, ItemsPlaced):
            _, found = state.hits(event.items, [event.endpoint])
            placed += len(event.items)
            repeats += len(found.get(event.endpoint, ()))
            unsized += sum(1 for item in event.items if item.size == 1)
        state.apply(event, position)
    return Survey(len(events), placed, repeats, unsized)


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
          on_progress: Callable[[int], None] | None = None,
          truth_item_size: int | None = None) -> list[TuneRow]:
    """One row per capacity, in the given order; ``on_progress`` gets events folded. The
    true caches take each item at its size, or at ``truth_item_size`` when given (items
    without sizes: the mean embeddings per item)."""
    return [_replay(events, capacity, truth_size, on_progress, truth_item_size) for capacity in capacities]


def _replay(events: Sequence[tuple[Position, Event]], capacity: Capacity, truth_size: int | None,
            on_progress: Callable[[int], None] | None, truth_item_size: int | None = None) -> TuneRow:
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
                pairs = [(item.hash, truth_item_size or item.size) for item in event.items]
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


def recommend(rows: Sequence[TuneRow], truth_size: int | None = None, *, facts: Survey | None = None,
              min_repeats: int = MIN_REPEATS) -> Recommendation:
    """With the true cache size: the capacity with the fewest wrong answers (false plus
    missed hits), size mode first on a tie. Without it: the smallest capacity within
    95% of the best hit ratio, an upper bound only (see the reason).

    Given the log's ``facts``: refuses (:class:`NoRecommendation`) below ``min_repeats``
    repeats, and chooses in items mode only when the items carry no sizes (size mode
    would hold ``N`` of them where the cache holds ``N`` embeddings)."""
    if not rows:
        raise ValueError("no capacities to choose from")
    why_items = ""
    if facts is not None:
        if facts.repeats < min_repeats:
            raise NoRecommendation(
                f"no recommendation: {facts.repeats:,} repeat placements (an item placed again "
                f"on an endpoint that already had it: the most hits any capacity can count) in "
                f"{facts.placed:,} placed items of {facts.events:,} events; a recommendation needs "
                f"at least {min_repeats:,} (--min-repeats), as below that the hit counts it "
                "compares differ by chance more than by capacity. Tune on a longer log")
        if not facts.sizes_known:
            rows = [r for r in rows if r.capacity.mode == "items"]
            if not rows:
                raise NoRecommendation("no recommendation: the items carry no sizes, so only items "
                                       "mode applies, and no items-mode capacity was replayed (--items)")
            why_items = (f"; items mode because {facts.unsized:,} of {facts.placed:,} placed items carry "
                         "no size (size 1: the chat_completions and generate sources), and size mode "
                         "would count each as one embedding (docs/simulation.md)")
    if truth_size is not None:
        best = min(rows, key=lambda r: (r.wrong or 0, r.capacity.mode != "size", r.capacity.per_endpoint))
        return Recommendation(best, (
            f"fewest wrong answers against an encoder cache of {truth_size:,} embeddings: "
            f"{best.false_hits:,} false hits ({_pct(best.false_hit_rate)} of its hits) and "
            f"{best.missed_hits:,} missed hits over {best.placed:,} placed items" + why_items))
    top = max(r.hit_ratio for r in rows)
    for mode in ("size", "items"):
        near = [r for r in rows if r.capacity.mode == mode and r.hit_ratio >= 0.95 * top]
        if near:
            best = min(near, key=lambda r: r.capacity.per_endpoint)
            break
    bound = ("pass --encoder-cache-size to size the index to the servers" if not why_items else
             "pass --encoder-cache-size with --mean-item-embeddings (the servers' mean embeddings "
             "per item) to size the index to the servers")
    return Recommendation(best, (
        f"smallest capacity within 95% of the best hit ratio ({_pct(top)}); a larger index only "
        "claims more hits. This is an upper bound: a server's encoder cache (vLLM's "
        f"encoder_cache_size, by default max_num_batched_tokens) is usually far smaller, so {bound}"
        + why_items))


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"
