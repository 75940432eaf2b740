"""Capacity tuning per cache layer: replay recorded events through the core under many capacities.

A vLLM server reuses a multimodal item at three layers, each with its own capacity:

- ``processor``: the preprocessed inputs, on the CPU, an LRU by bytes
  (``mm_processor_cache_gb``, 4 GiB by default): a hit skips the preprocessing;
- ``encoder``: the encoder's outputs, on the GPU, counted in embeddings
  (``encoder_cache_size``, by default ``max_num_batched_tokens``): a hit skips the encoder;
- ``prefix``: KV blocks whose hashes carry the item's identifier (the KV cache's blocks):
  a hit skips the encoder and the prefill of the item's tokens.

For each capacity (items mode or size mode) the recorded events are folded through a
fresh ``stream.core.cache.CacheState`` exactly as the service folds them, and every
placed item is checked before its placement is applied: a *hit* is an item still in its
endpoint's LRU when placed there again. The hit ratio is hits over all placed items
(item x endpoint placements).

Each layer the log can speak for is replayed once from the same placements as its truth
model, one cache per endpoint: ``stream.sim.processor.ProcessorCache`` (items weighed in
bytes by :class:`ItemModel`) and ``stream.sim.encoder.EncoderCache`` (each request's
references dropped at once: the log says where requests went, not how long they ran).
Against a layer, each index hit its cache no longer held is a *false hit* (a routing
decision made for an entry that is gone; the false-hit rate is false hits over index
hits) and each item it held that the index had dropped a *missed hit*; the capacity with
the fewest of the two predicts that layer best. The prefix layer is not replayed: see
:data:`PREFIX_NOT_PREDICTED`.

Before it recommends, the log must hold enough evidence (:data:`MIN_REPEATS`), and so must
each layer; what it recommends follows docs/simulation.md's "What to configure": items
that carry their sizes get size mode, items without sizes (the ``chat_completions`` and
``generate`` sources, every size 1) items mode, replayed with ``--mean-item-embeddings``.

Pure: events in, rows out; no I/O and no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from stream.core.cache import CacheState, Capacity
from stream.core.events import EndpointDeleted, EndpointsSynced, Event, ItemsPlaced, Position
from stream.core.items import Item
from stream.sim.encoder import EncoderCache
from stream.sim.processor import DEFAULT_BYTES_PER_EMBEDDING, ProcessorCache, processed_bytes

__all__ = ["DEFAULT_BYTES_PER_EMBEDDING", "DEFAULT_PROCESSOR_CACHE_GB", "GIB", "LAYERS", "MIN_REPEATS",
           "PREFIX_NOT_PREDICTED", "HitCosts", "ItemModel", "LayerAdvice", "LayerReplay", "NoRecommendation",
           "Recommendation", "Survey", "Target", "Truth", "TuneReport", "TuneRow", "advise",
           "capacity_for_layer", "default_capacities", "recommend", "replay_layer", "saved_ms", "survey",
           "sweep", "target_layer"]

# The least evidence a recommendation is made from: placed items that were already on
# their endpoint (repeats), the most hits any capacity can count. Without a true cache
# the choice is the smallest capacity within 5% of the best hit count; a hit count H
# varies by about sqrt(H) (a count of rare events), i.e. by 1/sqrt(H) of itself, and
# 1/sqrt(400) = 5%: below 400 the band the choice allows is narrower than its noise, and
# which capacity lands in it is chance. Against a layer's true cache the choice counts
# wrong answers, each of them a repeat too (false hits are hits; missed hits are repeats
# the index dropped): the same floor. And per layer: the layer's contents show only
# through the repeats its cache held (its true hits), so a layer that held fewer than the
# floor cannot be told apart from chance either (nor does it win much). `tune
# --min-repeats` moves it.
MIN_REPEATS = 400

LAYERS = ("processor", "encoder", "prefix")
GIB = 2**30
DEFAULT_PROCESSOR_CACHE_GB = 4.0  # vLLM's mm_processor_cache_gb (vllm/config/multimodal.py)

PREFIX_NOT_PREDICTED = (
    "not predicted from this log. A placement records which items went to which server, "
    "not the prompt's tokens: an item's KV blocks are reused only when every token before "
    "it (system prompt, history, earlier items) matches block for block, and they share "
    "the KV cache with every text and output token, none of which the log holds. The index "
    "is per item and blind to order, so no capacity of it stands for this layer; a "
    "prefix-cache scorer fed by the servers' KV events (blocks stored and removed, keyed "
    "with the items' identifiers) predicts it. Replaying it would need each request's "
    "prompt as token blocks in the log and the servers' KV cache size in blocks")


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
            _, found = state.index.hits(event.items, [event.endpoint])
            placed += len(event.items)
            repeats += len(found.get(event.endpoint, ()))
            unsized += sum(1 for item in event.items if item.size == 1)
        state.fold.apply(event, position)
    return Survey(len(events), placed, repeats, unsized)


@dataclass(frozen=True, slots=True)
class ItemModel:
    """What one placed item weighs in each layer: its encoder embeddings (its size, or
    ``mean_embeddings`` for items logged without one) and the bytes of its processed
    input (embeddings x ``bytes_per_embedding`` of its modality; a modality not named
    weighs as an image)."""

    mean_embeddings: float | None = None
    bytes_per_embedding: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_BYTES_PER_EMBEDDING))

    def embeddings(self, item: Item) -> int:
        """The encoder embeddings the item needs."""
        return item.size if self.mean_embeddings is None else max(1, round(self.mean_embeddings))

    def nbytes(self, item: Item) -> int:
        """The bytes its processed input takes in the processor cache."""
        return processed_bytes(self.embeddings(item), item.modality, self.bytes_per_embedding)


@dataclass(frozen=True, slots=True)
class Truth:
    """One layer's true cache on every server: ``capacity`` bytes (processor) or
    embeddings (encoder), items weighed by ``items``; ``assumed`` when the capacity is a
    default, not the servers' own."""

    layer: Literal["processor", "encoder"]
    capacity: int
    items: ItemModel = ItemModel()
    assumed: bool = False

    def describe(self) -> str:
        """The cache in words, for reasons and headings."""
        if self.layer == "processor":
            per = ", ".join(f"{m} {b:,}" for m, b in self.items.bytes_per_embedding.items())
            return (f"a processor cache of {self.capacity / GIB:g} GiB (mm_processor_cache_gb; "
                    f"bytes per embedding: {per})")
        return f"an encoder cache of {self.capacity:,} embeddings (encoder_cache_size)"

    def amount(self) -> str:
        """The capacity alone, with its unit."""
        if self.layer == "processor":
            return f"{self.capacity / GIB:g} GiB"
        return f"{self.capacity:,} embeddings"

    def weight(self, item: Item) -> int:
        """What the item takes of this layer's capacity."""
        return self.items.nbytes(item) if self.layer == "processor" else self.items.embeddings(item)


@dataclass(frozen=True, slots=True)
class LayerReplay:
    """What one layer's true caches held over the log: ``held[k]`` is whether the k-th
    placed item (log order, items in request order) was in its server's cache when
    placed; ``hits`` counts them and ``hit_embeddings`` sums their embeddings."""

    truth: Truth
    held: bytes
    hits: int
    hit_embeddings: int


def replay_layer(events: Sequence[tuple[Position, Event]], truth: Truth) -> LayerReplay:
    """One cache per endpoint fed every placement: the processor cache looks a request's
    items up as vLLM's front end does (``_cached_apply_hf_processor``: all checked, the
    hits touched, then the misses stored); the encoder cache admits a request's items
    together and drops its references at once. A deleted endpoint, or one left out of a
    sync, starts empty (its pod is gone)."""
    processors: dict[str, ProcessorCache] = {}
    encoders: dict[str, EncoderCache] = {}
    held = bytearray()
    hit_embeddings = request = 0
    for _, event in events:
        if isinstance(event, ItemsPlaced):
            name = event.endpoint
            if truth.layer == "processor":
                cache = processors.get(name)
                if cache is None:
                    cache = processors[name] = ProcessorCache(truth.capacity)
                flags = [item.hash in cache for item in event.items]
                # as vLLM's processor does: every item is checked first, the cached ones are
                # touched before any is stored (a request never evicts its own hits), then
                # the missing ones are stored, modality by modality
                rank: dict[str, int] = {}
                for item in event.items:
                    rank.setdefault(item.modality, len(rank))
                for _, item in sorted(zip(flags, event.items, strict=True),
                                      key=lambda pair: (not pair[0], rank[pair[1].modality])):
                    cache.lookup(item.hash, truth.weight(item))
            else:
                encoder = encoders.get(name)
                if encoder is None:
                    encoder = encoders[name] = EncoderCache(truth.capacity)
                flags = [item.hash in encoder for item in event.items]
                request += 1
                pairs = [(item.hash, truth.weight(item)) for item in event.items]
                if encoder.admit(request, pairs).pinned:
                    encoder.release(request, [digest for digest, _ in pairs])
            held.extend(flags)
            hit_embeddings += sum(truth.items.embeddings(item)
                                  for item, hit in zip(event.items, flags, strict=True) if hit)
        elif isinstance(event, EndpointDeleted):
            processors.pop(event.endpoint, None)
            encoders.pop(event.endpoint, None)
        elif isinstance(event, EndpointsSynced) and event.live:
            live = set(event.live)
            for caches in (processors, encoders):
                for gone in [n for n in caches if n not in live]:
                    del caches[gone]  # type: ignore[attr-defined]
    return LayerReplay(truth, bytes(held), sum(held), hit_embeddings)


class HitCosts(Protocol):
    """What a hit saves, per layer (``stream.sim.engine.Costs`` has these fields)."""

    @property
    def preprocess_ms_per_item(self) -> float: ...  # noqa: D102
    @property
    def encoder_ms_per_1k_embeddings(self) -> float: ...  # noqa: D102


def saved_ms(replay: LayerReplay, costs: HitCosts) -> float:
    """Milliseconds the layer's true hits saved: preprocessing per item (processor), the
    encoder per embedding (encoder)."""
    if replay.truth.layer == "processor":
        return replay.hits * costs.preprocess_ms_per_item
    return replay.hit_embeddings / 1000 * costs.encoder_ms_per_1k_embeddings


@dataclass(frozen=True, slots=True)
class Target:
    """The layer the recommendation sizes the index for, and why."""

    layer: str
    reason: str


def target_layer(replays: Sequence[LayerReplay], costs: HitCosts) -> Target | None:
    """The replayed layer whose true hits on this log save the most time (None when no
    layer was replayed). The prefix layer would save the most per hit (the encoder and
    the prefill of the item's tokens) but is never a candidate: the log cannot predict it."""
    if not replays:
        return None
    saved = {r.truth.layer: saved_ms(r, costs) for r in replays}
    best = max(replays, key=lambda r: saved[r.truth.layer])
    figures = "; ".join(
        f"{r.truth.layer} {saved[r.truth.layer] / 1000:,.1f} s ({r.hits:,} hits x "
        + (f"{costs.preprocess_ms_per_item:g} ms of preprocessing)" if r.truth.layer == "processor" else
           f"{costs.encoder_ms_per_1k_embeddings:g} ms of encoder per 1,000 embeddings, "
           f"{r.hit_embeddings:,} embeddings)")
        for r in replays)
    return Target(best.truth.layer, (
        f"its true hits on this log save the most time: {figures}, at the simulator's costs. "
        "The prefix layer would save the most per hit (the encoder and the prefill of the "
        "item's tokens) but this log cannot predict it"))


@dataclass(frozen=True, slots=True)
class TuneRow:
    """What one capacity would have given over the recorded placements, against one
    layer's true cache (``layer``; None: none replayed, hit ratio only)."""

    capacity: Capacity
    placed: int
    hits: int
    false_hits: int | None = None
    missed_hits: int | None = None
    layer: str | None = None

    @property
    def hit_ratio(self) -> float:
        """Share of placed items still in the endpoint's LRU when placed again."""
        return self.hits / self.placed if self.placed else 0.0

    @property
    def false_hit_rate(self) -> float | None:
        """Share of the index's hits that the layer's true cache no longer held."""
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


def capacity_for_layer(truth: Truth, events: Sequence[tuple[Position, Event]], sizes_known: bool) -> Capacity:
    """The index capacity that holds what the layer holds on this log's items: size mode
    of the layer's capacity in embeddings (its capacity over the log's mean weight per
    embedding: the encoder cache size itself), or, for items without sizes, items mode of
    its capacity over the mean weight per item (the encoder: ``encoder_cache_size /
    mean_item_embeddings``)."""
    items = embeddings = weight = 0
    for _, event in events:
        if isinstance(event, ItemsPlaced):
            items += len(event.items)
            embeddings += sum(truth.items.embeddings(item) for item in event.items)
            weight += sum(truth.weight(item) for item in event.items)
    if not weight:
        raise ValueError("no placed items to size against")
    if sizes_known:
        return Capacity("size", max(1, truth.capacity * embeddings // weight))
    return Capacity("items", max(1, truth.capacity * items // weight))


def default_capacities() -> list[Capacity]:
    """Items mode 1..4,096 and size mode 512..1,048,576 embeddings, doubling (a 4 GiB
    processor cache holds some 456,000 image embeddings)."""
    return [Capacity("items", 2**k) for k in range(13)] + [Capacity("size", 512 * 2**k) for k in range(12)]


def sweep(events: Sequence[tuple[Position, Event]], capacities: Sequence[Capacity],
          replays: Sequence[LayerReplay] = (),
          on_progress: Callable[[int], None] | None = None) -> list[TuneRow]:
    """Per capacity in the given order, one row per replayed layer in the given order
    (one row with no layer when none); ``on_progress`` gets events folded."""
    return [row for capacity in capacities for row in _replay(events, capacity, replays, on_progress)]


def _replay(events: Sequence[tuple[Position, Event]], capacity: Capacity, replays: Sequence[LayerReplay],
            on_progress: Callable[[int], None] | None) -> list[TuneRow]:
    state = CacheState(capacity)
    helds = [r.held for r in replays]
    false_hits = [0] * len(replays)
    missed_hits = [0] * len(replays)
    placed = hits = 0
    for done, (position, event) in enumerate(events, 1):
        if isinstance(event, ItemsPlaced):
            name = event.endpoint
            _, found = state.index.hits(event.items, [name])
            in_index = {item.hash for item in found.get(name, ())}
            hits += len(in_index)
            for item in event.items:
                predicted = item.hash in in_index
                for layer, held in enumerate(helds):
                    actual = held[placed]
                    if predicted and not actual:
                        false_hits[layer] += 1
                    elif actual and not predicted:
                        missed_hits[layer] += 1
                placed += 1
        state.fold.apply(event, position)
        if on_progress is not None and done % 4096 == 0:
            on_progress(4096)
    if on_progress is not None:
        on_progress(len(events) % 4096)
    if not replays:
        return [TuneRow(capacity, placed, hits)]
    return [TuneRow(capacity, placed, hits, false_hits[n], missed_hits[n], r.truth.layer)
            for n, r in enumerate(replays)]


def recommend(rows: Sequence[TuneRow], replay: LayerReplay | None = None, *, facts: Survey | None = None,
              min_repeats: int = MIN_REPEATS, own: Capacity | None = None) -> Recommendation:
    """Against a layer's true cache (``replay``; ``rows`` its rows): the capacity with the
    fewest wrong answers (false plus missed hits); on a tie the layer's ``own`` capacity
    (:func:`capacity_for_layer`: it goes on matching when the log's working set grows),
    then size mode, then the smallest. Without one:
    the smallest capacity within 95% of the best hit ratio, an upper bound only (see the
    reason).

    Given the log's ``facts``: refuses (:class:`NoRecommendation`) below ``min_repeats``
    repeats, or below ``min_repeats`` true hits of the layer, and chooses in items mode
    only when the items carry no sizes (size mode would hold ``N`` of them where the cache
    holds ``N`` embeddings)."""
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
    if replay is not None:
        layer = replay.truth.layer
        if replay.hits < min_repeats:
            of = "" if facts is None else f" of the {facts.repeats:,} repeat placements"
            raise NoRecommendation(
                f"no recommendation for the {layer} layer: its true caches ({replay.truth.describe()}) "
                f"held {replay.hits:,}{of}; sizing the index to a layer needs at least {min_repeats:,} "
                "of its hits (--min-repeats), as below that which capacity matches it is chance "
                "(and the layer wins little). Tune on a longer log, or size for another layer (--layer)")
        best = min(rows, key=lambda r: (r.wrong or 0, r.capacity != own, r.capacity.mode != "size",
                                        r.capacity.per_endpoint))
        return Recommendation(best, (
            f"fewest wrong answers against {layer} caches of {replay.truth.amount()}, which held "
            f"{replay.hits:,} of the placed items: {best.false_hits:,} false hits "
            f"({_pct(best.false_hit_rate)} of its hits) and {best.missed_hits:,} missed hits over "
            f"{best.placed:,} placed items" + why_items))
    top = max(r.hit_ratio for r in rows)
    for mode in ("size", "items"):
        near = [r for r in rows if r.capacity.mode == mode and r.hit_ratio >= 0.95 * top]
        if near:
            best = min(near, key=lambda r: r.capacity.per_endpoint)
            break
    bound = ("replay a layer's true caches to size the index to it" if not why_items else
             "pass --mean-item-embeddings (the servers' mean embeddings per item) to replay the "
             "layers' true caches and size the index to one")
    return Recommendation(best, (
        f"smallest capacity within 95% of the best hit ratio ({_pct(top)}); a larger index only "
        "claims more hits. This is an upper bound: a server's caches are usually far smaller "
        f"(its encoder cache, vLLM's encoder_cache_size, holds a handful of images), so {bound}"
        + why_items))


@dataclass(frozen=True, slots=True)
class LayerAdvice:
    """One layer's part of the report: its replay and rows, and its recommendation or
    why there is none (``refused``; for a layer not replayed, why not)."""

    layer: str
    replay: LayerReplay | None
    rows: tuple[TuneRow, ...] = ()
    choice: Recommendation | None = None
    refused: str | None = None
    saved_ms: float | None = None


@dataclass(frozen=True, slots=True)
class TuneReport:
    """Every layer's advice, and the one the recommendation targets (``target``; None
    when no layer was replayed and none was chosen: then ``choice`` is the hit ratios'
    upper bound). ``rows`` are the target's, or the hit ratios alone when no layer was
    replayed."""

    facts: Survey
    layers: tuple[LayerAdvice, ...]
    target: str | None
    target_reason: str
    rows: tuple[TuneRow, ...]
    choice: Recommendation | None
    refused: str | None

    def layer(self, name: str) -> LayerAdvice:
        """The advice for one layer."""
        return next(advice for advice in self.layers if advice.layer == name)


def advise(events: Sequence[tuple[Position, Event]], capacities: Sequence[Capacity], truths: Sequence[Truth],
           costs: HitCosts, *, facts: Survey | None = None, not_replayed: Mapping[str, str] | None = None,
           layer: str | None = None, min_repeats: int = MIN_REPEATS,
           on_progress: Callable[[int], None] | None = None) -> TuneReport:
    """Replay each layer's truth, sweep ``capacities`` against them all, and recommend per
    layer; the target is ``layer`` when given, else :func:`target_layer`. Each truth's
    own capacity (:func:`capacity_for_layer`) is added to the sweep, which runs items
    mode then size mode, each from the smallest. ``not_replayed``
    says, per layer, why it has no truth (the prefix layer never has one)."""
    facts = facts if facts is not None else survey(events)
    notes = {"prefix": PREFIX_NOT_PREDICTED, **(not_replayed or {})}
    sweep_over = list(capacities)
    owns = {truth.layer: capacity_for_layer(truth, events, facts.sizes_known) for truth in truths}
    sweep_over += [own for own in dict.fromkeys(owns.values()) if own not in sweep_over]
    sweep_over.sort(key=lambda c: (c.mode != "items", c.per_endpoint))
    replays = []
    for truth in truths:
        replays.append(replay_layer(events, truth))
        if on_progress is not None:
            on_progress(len(events))
    rows = sweep(events, sweep_over, replays, on_progress)
    sections: list[LayerAdvice] = []
    for name in LAYERS:
        replay = next((r for r in replays if r.truth.layer == name), None)
        if replay is None:
            sections.append(LayerAdvice(name, None, refused=notes.get(name, "not replayed")))
            continue
        own_rows = tuple(r for r in rows if r.layer == name)
        saved = saved_ms(replay, costs)
        try:
            sections.append(LayerAdvice(name, replay, own_rows,
                                        recommend(own_rows, replay, facts=facts, min_repeats=min_repeats,
                                                  own=owns[name]), saved_ms=saved))
        except NoRecommendation as exc:
            sections.append(LayerAdvice(name, replay, own_rows, refused=str(exc), saved_ms=saved))
    if not replays and layer is None:
        try:
            choice, refused = recommend(rows, facts=facts, min_repeats=min_repeats), None
        except NoRecommendation as exc:
            choice, refused = None, str(exc)
        why = "; ".join(f"{s.layer}: {s.refused}" for s in sections if s.layer != "prefix")
        return TuneReport(facts, tuple(sections), None, f"no layer was replayed ({why})", tuple(rows),
                          choice, refused)
    chosen = target_layer(replays, costs) if layer is None else Target(layer, "")
    assert chosen is not None
    target, reason = chosen.layer, f"by default: {chosen.reason}" if layer is None else "chosen with --layer"
    advice = next(s for s in sections if s.layer == target)
    refused = advice.refused if advice.replay is not None else f"the {target} layer is {advice.refused}"
    return TuneReport(facts, tuple(sections), target, reason, advice.rows if replays else tuple(rows),
                      advice.choice, None if advice.choice is not None else refused)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"
