"""A fleet of vLLM servers behind gateway replicas, simulated event by event.

Each server is a ``stream.sim.engine.Engine`` (vLLM v1's scheduler with its three
caches: processor, encoder, prefix). One discrete-event loop runs arrivals, render
calls, metric scrapes and the engines' own events in time order; a request's TTFT is
its first token's time less its arrival.

Routing, as a gateway does it:

- The gateway's view of each server's load is what the servers last reported
  (``scrape_s``: a scrape of vLLM's metrics), not what they hold now. ``least-loaded``,
  ``oracle`` and ``index-bounded`` add the requests the gateway replica routed since
  that scrape (an in-flight count the gateway keeps itself).
- The index policies run the service's own core (``stream.core.cache.CacheState``):
  each routing is a ``match`` over all servers, then an ``ItemsPlaced`` for the chosen
  one, as the gateway's produce and pre-request calls do. The score is
  ``cache_weight`` x the cache score + ``load_weight`` x the min-max normalized load
  (the seed profile's 4 for the cache scorer, 2 + 2 for its queue and KV-utilization
  scorers, both of which read the same load here).
- Getting the items costs nothing on the tokenizer-free path (mmcache extracts them
  from the body). On the ``render`` path (the token producer) every request an index
  policy routes waits for a render call first: ``render_replicas`` sidecars, each
  serving ``render_rate`` calls a second, first come first served.
- Ties: ``tie_break="first"`` takes the first of the top-scored servers, as a picker
  that takes the top of a sorted list does; ``"random"`` draws among them.

``index-bounded`` is the recommended configuration: the index in size mode sized to what
the prefix cache keeps (:func:`prefix_capacity`: the layer that saves the most time, far
larger than the encoder cache), ties at random, the gateway's own in-flight count added
to the scraped load, a bound on how much hotter than the rest a server may get for
affinity (only servers within ``max(min load + bound_slack, bound_factor x mean load)``
compete on their cache score), and on the render path a request that would wait for a
render call only when it can pay: when the call's wait and service take no longer than a
hit would save (``render_budget_s``; 0 = :func:`hit_saving_s`), else the request is routed
on load alone.

Pure and deterministic: simulated time only, every random draw from a seeded generator.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from stream.core.cache import CacheState, Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.items import Item
from stream.core.picking import PickRule, least_loaded, pick, totals
from stream.percentiles import percentile
from stream.sim.engine import Costs, Engine, EngineConfig, PromptRequest
from stream.sim.workload import Request

__all__ = ["LAYERS", "POLICIES", "FleetSpec", "LayerHits", "PolicyResult", "hit_saving_s",
           "prefix_capacity", "simulate"]

POLICIES = ("random", "round-robin", "least-loaded", "index", "index-size", "per-replica", "oracle",
            "index-bounded")
INDEX_POLICIES = ("index", "index-size", "per-replica", "index-bounded")
LAYERS = ("processor", "encoder", "prefix")

# vLLM's default max_num_batched_tokens for its OpenAI server on H100-class GPUs (>= 70 GiB);
# encoder_cache_size defaults to it (and to at least the largest item).
DEFAULT_ENCODER_CACHE_SIZE = EngineConfig().encoder_cache_size

# The costs of a Qwen2.5-VL-7B-class model on one H100/H200-class GPU. Estimates, not
# measurements; each is a flag of ``simulate``:
# - prefill 30 ms per 1,000 tokens: 2 x 7.6e9 FLOPs a token = 15 TFLOPs per 1,000, at
#   ~50% of the GPU's ~990 dense bf16 TFLOP/s;
# - encoder 20 ms per 1,000 embeddings: a ~0.67e9-parameter ViT over 4 patches an
#   embedding (2x2 merge) = 5.4 TFLOPs per 1,000, at a lower utilization (~30%: short
#   sequences, windowed attention);
# - preprocessing 40 ms per item on the CPU: decoding, resizing and normalizing a 0.3-2
#   megapixel image with the HF processor (an assumption; the llm-d guide's render
#   sidecar, which does this work and tokenizes, serves ~9 requests/s per replica);
# - a decode step 10 ms: reading ~16 GB of bf16 weights at ~3.3 TB/s is ~5 ms, plus the
#   KV reads and the step's fixed costs at moderate batch sizes; 2 ms of overhead a step.
DEFAULT_COSTS = Costs(preprocess_ms_per_item=40.0, encoder_ms_per_1k_embeddings=20.0,
                      prefill_ms_per_1k_tokens=30.0, decode_ms_per_step=10.0, step_overhead_ms=2.0)


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """The servers and the gateway.

    Servers: ``servers`` engines, each with ``engine`` and ``costs``. Gateway: the
    index capacities (``index_items`` for ``index``/``per-replica``,
    ``index_embeddings`` for ``index-size``, 0 = the encoder cache size;
    ``bounded_embeddings`` for ``index-bounded``, 0 = :func:`prefix_capacity`), the
    weights, the scrape interval, the items path and its render sidecars, the tie-break
    of the plain policies, and the bound of ``index-bounded``.
    """

    servers: int = 8
    engine: EngineConfig = EngineConfig()
    costs: Costs = DEFAULT_COSTS
    index_items: int = 1024
    index_embeddings: int = 0
    bounded_embeddings: int = 0
    cache_weight: float = 4.0
    load_weight: float = 4.0
    scrape_s: float = 0.05
    items_path: str = "tokenizer-free"
    render_replicas: int = 2
    render_rate: float = 9.0
    tie_break: str = "first"
    bound_factor: float = 1.25
    bound_slack: int = 2
    render_budget_s: float = 0.0

    @property
    def names(self) -> list[str]:
        """Endpoint names of the servers."""
        return [f"sim/pod-{i:02d}" for i in range(self.servers)]


@dataclass(slots=True)
class LayerHits:
    """One cache layer's lookups and hits, summed over the servers."""

    lookups: int = 0
    hits: int = 0

    @property
    def hit_ratio(self) -> float:
        """Hits over lookups (items for processor and encoder, blocks for prefix)."""
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass(slots=True)
class PolicyResult:
    """What one policy achieved over one run."""

    policy: str
    requests: int = 0
    served: int = 0
    ttft_s: list[float] = field(default_factory=list, repr=False)
    layers: dict[str, LayerHits] = field(default_factory=lambda: {name: LayerHits() for name in LAYERS})
    imbalance: float = 1.0
    top_share_cold: float = 0.0
    render_wait_s: float = 0.0
    rendered: int = 0
    true_positives: int = 0
    false_positives: int = 0
    false_negatives: int = 0
    predicts: bool = False
    makespan_s: float = 0.0

    @property
    def ttft_p50_s(self) -> float:
        """Median time to first token."""
        return percentile(self.ttft_s, 0.5) if self.ttft_s else 0.0

    @property
    def ttft_p90_s(self) -> float:
        """90th percentile of the time to first token."""
        return percentile(self.ttft_s, 0.9) if self.ttft_s else 0.0

    @property
    def hit_ratio(self) -> float:
        """The encoder layer's hit ratio (items found in the server's encoder cache)."""
        return self.layers["encoder"].hit_ratio

    @property
    def mean_render_wait_s(self) -> float:
        """Mean time a rendered request waited for a render sidecar (queue only)."""
        return self.render_wait_s / self.rendered if self.rendered else 0.0

    @property
    def throughput(self) -> float:
        """Requests served per second, first arrival to last first token."""
        return self.served / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def precision(self) -> float | None:
        """Of the (server, item) pairs predicted cached at routing, the share truly in the
        encoder cache."""
        if not self.predicts:
            return None
        predicted = self.true_positives + self.false_positives
        return self.true_positives / predicted if predicted else 0.0

    @property
    def recall(self) -> float | None:
        """Of the (server, item) pairs truly in the encoder cache at routing, the share predicted."""
        if not self.predicts:
            return None
        cached = self.true_positives + self.false_negatives
        return self.true_positives / cached if cached else 0.0

    def summary(self) -> dict[str, object]:
        """The ``--format json`` figures of this policy."""
        return {"layers": {name: {"hit_ratio": layer.hit_ratio, "lookups": layer.lookups, "hits": layer.hits}
                           for name, layer in self.layers.items()},
                "ttft_p50_s": self.ttft_p50_s, "ttft_p90_s": self.ttft_p90_s,
                "hit_ratio": self.hit_ratio, "imbalance": self.imbalance,
                "top_share_cold": self.top_share_cold, "mean_render_wait_s": self.mean_render_wait_s,
                "throughput_rps": self.throughput, "precision": self.precision, "recall": self.recall}


def hit_saving_s(costs: Costs, requests: Sequence[Request]) -> float:
    """What routing to a server that holds a request's items saves on the mean request:
    encoding its items and prefilling their placeholder tokens (one token per embedding).
    A render call that takes longer costs more than the items' affinity wins back."""
    if not requests:
        return 0.0
    embeddings = sum(request.embeddings for request in requests) / len(requests)
    return embeddings * (costs.encoder_ms_per_1k_embeddings + costs.prefill_ms_per_1k_tokens) / 1e6


def prefix_capacity(engine: EngineConfig, requests: Sequence[Request]) -> int:
    """The size-mode capacity that tracks a server's prefix cache: its KV tokens times
    the share of prompt tokens that are item placeholders (an item's KV blocks stay as
    long as the prompt around it does, and the index counts only the items' share)."""
    prompt = sum(request.prompt_tokens for request in requests)
    items = sum(request.embeddings for request in requests)
    share = items / prompt if prompt else 1.0
    return max(engine.encoder_cache_size, round(engine.kv_blocks * engine.block_size * share))


class _Index:
    """One gateway's view: the service's core fold, fed the placements it makes."""

    def __init__(self, capacity: Capacity) -> None:
        self.state = CacheState(capacity)
        self.offset = 0

    def scores(self, items: Sequence[Item], names: list[str]) -> list[float]:
        return [m["score"] for m in self.state.index.match(items, names)]

    def place(self, name: str, items: Sequence[Item]) -> None:
        event = ItemsPlaced.model_construct(endpoint=name, items=list(items))
        self.state.fold.apply(event, Position(0, self.offset))
        self.offset += 1


# event kinds, in the order they are handled at one instant
_ENGINE, _ROUTE, _SCRAPE = 0, 1, 2


def simulate(requests: Sequence[Request], fleet: FleetSpec, policy: str, seed: int = 1,
             replicas: int = 3, on_request: Callable[[int], None] | None = None,
             placed: list[tuple[str, Request]] | None = None) -> PolicyResult:
    """Run ``requests`` through the fleet under ``policy``; deterministic in its inputs.
    Each routing decision is appended to ``placed`` (endpoint, request) when given."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
    if fleet.items_path not in ("tokenizer-free", "render"):
        raise ValueError(f"unknown items path {fleet.items_path!r}: tokenizer-free or render")
    if fleet.tie_break not in ("first", "random"):
        raise ValueError(f"unknown tie-break {fleet.tie_break!r}: first or random")
    names = fleet.names
    count = len(names)
    engines = [Engine(fleet.engine, fleet.costs) for _ in names]
    # one stream for every policy (common random numbers): two policies that decide alike
    # draw alike, so what differs between them is their decisions, not their luck
    rng = random.Random(seed)
    result = PolicyResult(policy, predicts=policy in INDEX_POLICIES)
    bounded = policy == "index-bounded"
    first_pick = fleet.tie_break == "first" and policy in ("index", "index-size", "per-replica")
    counts_inflight = policy in ("least-loaded", "oracle", "index-bounded")
    rule = PickRule(fleet.cache_weight, fleet.load_weight, fleet.bound_factor if bounded else None,
                    fleet.bound_slack)
    indexes: list[_Index] = []
    if policy in ("index", "per-replica"):
        indexes = [_Index(Capacity("items", fleet.index_items))
                   for _ in range(replicas if policy == "per-replica" else 1)]
    elif policy == "index-size":
        indexes = [_Index(Capacity("size", fleet.index_embeddings or fleet.engine.encoder_cache_size))]
    elif policy == "index-bounded":
        size = fleet.bounded_embeddings or prefix_capacity(fleet.engine, requests)
        indexes = [_Index(Capacity("size", size))]
    renders = policy in INDEX_POLICIES and fleet.items_path == "render"
    render_free = [0.0] * max(1, fleet.render_replicas)  # when each sidecar is next free
    render_s = 1.0 / fleet.render_rate
    render_budget = fleet.render_budget_s or hit_saving_s(fleet.costs, requests)

    heap: list[tuple[float, int, int, int]] = []  # (time, kind, seq, payload)
    seq = 0
    versions = [0] * count  # an engine's latest scheduled event; older ones are stale
    scraped = [0] * count
    routed = [[0] * count for _ in range(replicas)]  # per replica, since the last scrape
    arrival_of: dict[str, float] = {}
    load_sums = [0] * count
    turn = [0] * replicas  # round-robin's position, per replica
    routings = 0
    cold_at = 4 * count
    last_event = 0.0

    def push(time: float, kind: int, payload: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (time, kind, seq, payload))

    def schedule(index: int, now: float) -> None:
        versions[index] += 1
        when = engines[index].next_event_time()
        if when is not None:
            push(max(when, now), _ENGINE, index * 1_000_000_000 + versions[index])

    def collect(done: list[tuple[str, float]]) -> None:
        nonlocal last_event
        for request_id, at in done:
            result.ttft_s.append(at - arrival_of.pop(request_id))
            last_event = max(last_event, at)

    def view(replica: int, fresh: bool) -> list[int]:
        if not fresh:
            return scraped
        mine = routed[replica]
        return [s + r for s, r in zip(scraped, mine, strict=True)]

    def choose(request: Request, now: float, with_items: bool) -> int:
        replica = request.replica
        if policy == "random":
            return rng.randrange(count)
        if policy == "round-robin":
            turn[replica] += 1
            return (turn[replica] - 1) % count
        loads = view(replica, counts_inflight)
        if policy == "least-loaded" or not with_items or not request.items:
            return least_loaded(loads, rng)
        if policy == "oracle":
            total = request.embeddings
            scores = [sum(item.size for item in request.items if engine.holds(item.hash)) / total
                      for engine in engines]
        else:
            scores = indexes[replica % len(indexes)].scores(request.items, names)
        return pick(totals(rule, scores, loads), None if first_pick else rng)

    def route(request: Request, now: float, with_items: bool) -> None:
        nonlocal routings
        chosen = choose(request, now, with_items)
        if with_items and indexes:
            index_view = indexes[request.replica % len(indexes)]
            holders = index_view.state.index.holders
            for item in request.items:
                predicted = holders.get(item.hash, set())
                actual = {names[j] for j, engine in enumerate(engines) if engine.holds(item.hash)}
                hit = len(actual & predicted)
                result.true_positives += hit
                result.false_positives += len(predicted) - hit
                result.false_negatives += len(actual) - hit
            index_view.place(names[chosen], request.items)
        if placed is not None:
            placed.append((names[chosen], request))
        routed[request.replica][chosen] += 1
        engine = engines[chosen]
        collect(engine.advance(now))
        engine.submit(PromptRequest(str(request.id), request.segments, request.output_tokens), now)
        schedule(chosen, now)
        routings += 1
        loads = [e.load for e in engines]
        for i, load in enumerate(loads):
            load_sums[i] += load
        if routings == cold_at:
            total = sum(loads)
            result.top_share_cold = max(loads) / total if total else 0.0

    by_id = {request.id: request for request in requests}
    arrivals = sorted(requests, key=lambda r: (r.arrival, r.id))
    push(arrivals[0].arrival if arrivals else 0.0, _SCRAPE, 0)
    next_arrival = 0
    done_count = 0
    while next_arrival < len(arrivals) or heap:
        if next_arrival < len(arrivals) and (not heap or arrivals[next_arrival].arrival <= heap[0][0]):
            request = arrivals[next_arrival]
            next_arrival += 1
            now = request.arrival
            result.requests += 1
            arrival_of[str(request.id)] = now
            if renders:
                sidecar = min(range(len(render_free)), key=render_free.__getitem__)
                start = max(now, render_free[sidecar])
                if bounded and start - now + render_s > render_budget:
                    route(request, now, with_items=False)
                else:
                    render_free[sidecar] = start + render_s
                    result.rendered += 1
                    result.render_wait_s += start - now
                    push(start + render_s, _ROUTE, request.id)
            else:
                route(request, now, with_items=True)
            done_count += 1
            if on_request is not None and done_count % 1024 == 0:
                on_request(1024)
            continue
        now, kind, _, payload = heapq.heappop(heap)
        if kind == _ENGINE:
            index, version = divmod(payload, 1_000_000_000)
            if version != versions[index]:
                continue
            collect(engines[index].advance(now))
            schedule(index, now)
        elif kind == _ROUTE:
            route(by_id[payload], now, with_items=True)
        else:
            scraped = [engine.load for engine in engines]
            for mine in routed:
                mine[:] = [0] * count
            if next_arrival < len(arrivals) or len(heap) > 0:
                push(now + fleet.scrape_s, _SCRAPE, 0)
    if arrival_of:  # cannot happen: every submitted request is prefilled once the engines drain
        raise AssertionError(f"{len(arrival_of)} requests never got a first token")
    result.served = len(result.ttft_s)
    result.makespan_s = last_event - (arrivals[0].arrival if arrivals else 0.0)
    for engine in engines:
        for name, layer in engine.layers.items():
            result.layers[name].lookups += layer.lookups
            result.layers[name].hits += layer.hits
    means = [total / max(routings, 1) for total in load_sums]
    average = sum(means) / len(means)
    result.imbalance = max(means) / average if average > 0 else 1.0
    return result
