"""A fleet of model servers behind gateway replicas, simulated event by event.

Each server runs up to ``slots`` requests at once and queues the rest first come, first
served; its encoder cache is ``stream.sim.encoder.EncoderCache`` (the truth). A request
starts when a slot is free and its encoder inputs fit (else it waits at the head of the
queue, as vLLM's FCFS scheduler does). It then pins its items for its encode and
prefill phase (encode time for the embeddings it misses, prefill time for all of them),
drops the references, and decodes. So load, queueing and pinning all matter.

Policies route each request at its arrival. ``oracle`` knows each server's true encoder
cache and the requests queued there (whose items it will hold when they start): the best
an affinity signal could know. The index policies use the service's own
core (``stream.core.cache.CacheState``): each routing is a ``match`` over all servers
and then an ``ItemsPlaced`` per chosen server, as the gateway's produce and pre-request
calls do. Scores are combined as the seed's example scheduling profile weighs its
scorers: 4 for the encoder-cache score, 2 for KV-cache utilization (modelled as the
share of busy slots) and 2 for the queue (min-max normalized waiting requests); the
highest total wins, ties broken at random.

Pure and deterministic: simulated time only, every random draw from a seeded generator.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from stream.core.cache import CacheState, Capacity
from stream.core.events import ItemsPlaced, Position
from stream.core.items import Item
from stream.sim.encoder import EncoderCache
from stream.sim.workload import Request

__all__ = ["POLICIES", "FleetSpec", "PolicyResult", "simulate"]

POLICIES = ("random", "least-loaded", "index", "index-size", "per-replica", "oracle")

# vLLM's default max_num_batched_tokens for its OpenAI server on H100-class GPUs (>= 70 GiB);
# encoder_cache_size defaults to it (and to at least the largest item).
DEFAULT_ENCODER_CACHE_SIZE = 8192


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """The servers and the gateway: ``servers`` servers of ``slots`` concurrent requests,
    encoder caches of ``encoder_cache_size`` embeddings (per-step compute ``budget``,
    default the same), encode and prefill seconds per embedding, the index capacities of
    the ``index`` (items) and ``index-size`` (embeddings) policies, and the scorer
    weights (cache, KV utilization, queue)."""

    servers: int = 16
    slots: int = 16
    encoder_cache_size: int = DEFAULT_ENCODER_CACHE_SIZE
    budget: int = 0
    encode_s: float = 40e-6
    prefill_s: float = 20e-6
    index_items: int = 1024
    index_embeddings: int = 0
    weights: tuple[float, float, float] = (4.0, 2.0, 2.0)

    @property
    def names(self) -> list[str]:
        """Endpoint names of the servers."""
        return [f"sim/pod-{i:02d}" for i in range(self.servers)]


@dataclass(slots=True)
class PolicyResult:
    """What one policy achieved over one run."""

    policy: str
    requests: int = 0
    refused: int = 0
    items: int = 0
    item_hits: int = 0
    embeddings: int = 0
    embeddings_hit: int = 0
    latency_s: float = 0.0
    imbalance: float = 1.0
    true_positives: int = 0
    false_positives: int = 0
    false_negatives: int = 0
    predicts: bool = False

    @property
    def hit_ratio(self) -> float:
        """Share of admitted items found in the server's encoder cache."""
        return self.item_hits / self.items if self.items else 0.0

    @property
    def hit_ratio_embeddings(self) -> float:
        """Share of admitted embeddings not encoded again."""
        return self.embeddings_hit / self.embeddings if self.embeddings else 0.0

    @property
    def precision(self) -> float | None:
        """Of the (server, item) pairs predicted cached at routing, the share truly cached."""
        if not self.predicts:
            return None
        predicted = self.true_positives + self.false_positives
        return self.true_positives / predicted if predicted else 0.0

    @property
    def recall(self) -> float | None:
        """Of the (server, item) pairs truly cached at routing, the share predicted."""
        if not self.predicts:
            return None
        cached = self.true_positives + self.false_negatives
        return self.true_positives / cached if cached else 0.0

    @property
    def mean_latency_s(self) -> float:
        """Mean time from arrival to finish of the served requests."""
        served = self.requests - self.refused
        return self.latency_s / served if served else 0.0

    def summary(self) -> dict[str, float | int | None]:
        """The ``--format json`` figures of this policy."""
        return {"hit_ratio": self.hit_ratio, "tokens_saved": self.embeddings_hit,
                "imbalance": self.imbalance, "precision": self.precision, "recall": self.recall}


@dataclass(slots=True)
class _Server:
    name: str
    cache: EncoderCache
    waiting: deque[tuple[Request, float]] = field(default_factory=deque)
    running: int = 0
    queued: dict[str, int] = field(default_factory=dict)  # hash -> waiting requests with it

    def enqueue(self, request: Request, now: float) -> None:
        self.waiting.append((request, now))
        queued = self.queued
        for item in request.items:
            queued[item.hash] = queued.get(item.hash, 0) + 1

    def dequeue(self) -> None:
        request, _ = self.waiting.popleft()
        queued = self.queued
        for item in request.items:
            left = queued[item.hash] - 1
            if left:
                queued[item.hash] = left
            else:
                del queued[item.hash]

    def will_hold(self, digest: str) -> bool:
        """Whether the item is in the encoder cache or will be when the queue starts."""
        return digest in self.cache or digest in self.queued


class _Index:
    """One gateway's view: the service's core fold, fed the placements it makes."""

    def __init__(self, capacity: Capacity) -> None:
        self.state = CacheState(capacity)
        self.offset = 0

    def scores(self, items: Sequence[Item], names: list[str]) -> list[float]:
        return [m["score"] for m in self.state.match(items, names)]

    def place(self, name: str, items: Sequence[Item]) -> None:
        event = ItemsPlaced.model_construct(endpoint=name, items=list(items))
        self.state.apply(event, Position(0, self.offset))
        self.offset += 1


def simulate(requests: Sequence[Request], fleet: FleetSpec, policy: str, seed: int = 1,
             replicas: int = 3, on_request: Callable[[int], None] | None = None,
             placed: list[tuple[str, Request]] | None = None) -> PolicyResult:
    """Run ``requests`` through the fleet under ``policy``; deterministic in its inputs.
    Each routing decision is appended to ``placed`` (endpoint, request) when given."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
    names = fleet.names
    budget = fleet.budget or fleet.encoder_cache_size
    servers = [_Server(name, EncoderCache(fleet.encoder_cache_size, budget)) for name in names]
    rng = random.Random(f"{seed}/{policy}")
    result = PolicyResult(policy, predicts=policy in ("index", "index-size", "per-replica"))
    indexes: list[_Index] = []
    if policy in ("index", "per-replica"):
        count = replicas if policy == "per-replica" else 1
        indexes = [_Index(Capacity("items", fleet.index_items)) for _ in range(count)]
    elif policy == "index-size":
        indexes = [_Index(Capacity("size", fleet.index_embeddings or fleet.encoder_cache_size))]
    truth: dict[str, set[str]] = {}  # hash -> servers whose encoder cache holds it
    events: list[tuple[float, int, int, int, Request]] = []  # (time, kind, seq, server, request)
    seq = 0
    queue_sums = [0] * len(servers)
    w_cache, w_kv, w_queue = fleet.weights
    slots = fleet.slots

    def start_ready(index: int, now: float) -> None:
        nonlocal seq
        server = servers[index]
        while server.running < slots and server.waiting:
            request, arrived = server.waiting[0]
            pairs = [(item.hash, item.size) for item in request.items]
            admission = server.cache.admit(request.id, pairs)
            if admission.status == "waiting":
                return
            server.dequeue()
            if admission.status == "too_large":
                result.refused += 1
                continue
            for digest, _ in admission.added:
                truth.setdefault(digest, set()).add(server.name)
            for digest in admission.evicted:
                holders = truth.get(digest)
                if holders is not None:
                    holders.discard(server.name)
                    if not holders:
                        del truth[digest]
            hit_embeddings = sum(size for _, size in admission.hits)
            total = request.embeddings
            result.items += len(pairs)
            result.item_hits += len(admission.hits)
            result.embeddings += total
            result.embeddings_hit += hit_embeddings
            phase = (total - hit_embeddings) * fleet.encode_s + total * fleet.prefill_s
            server.running += 1
            seq += 1
            if admission.pinned:
                heapq.heappush(events, (now + phase, 0, seq, index, request))
            heapq.heappush(events, (now + phase + request.decode_s, 1, seq, index, request))
            result.latency_s += now + phase + request.decode_s - arrived

    def handle(event: tuple[float, int, int, int, Request]) -> None:
        now, kind, _, index, request = event
        server = servers[index]
        if kind == 0:
            server.cache.release(request.id, [item.hash for item in request.items])
        else:
            server.running -= 1
        start_ready(index, now)

    def load_scores() -> list[float]:
        waiting = [len(s.waiting) for s in servers]
        low, high = min(waiting), max(waiting)
        spread = high - low
        return [w_kv * (1.0 - s.running / slots)
                + w_queue * (1.0 if spread == 0 else (high - w) / spread)
                for s, w in zip(servers, waiting, strict=True)]

    def best(totals: list[float]) -> int:
        top = max(totals)
        tied = [i for i, total in enumerate(totals) if total >= top - 1e-12]
        return tied[0] if len(tied) == 1 else tied[rng.randrange(len(tied))]

    for done, request in enumerate(requests):
        now = request.arrival
        while events and events[0][0] <= now:
            handle(heapq.heappop(events))
        for i, server in enumerate(servers):
            queue_sums[i] += len(server.waiting) + server.running
        items = request.items
        index_view = None
        if policy == "random":
            chosen = rng.randrange(len(servers))
        elif policy == "least-loaded":
            chosen = best([-(len(s.waiting) + s.running) for s in servers])
        elif policy == "oracle":
            total = request.embeddings
            cached = [sum(item.size for item in items if s.will_hold(item.hash)) / total
                      for s in servers]
            chosen = best([w_cache * c + load for c, load in zip(cached, load_scores(), strict=True)])
        else:
            index_view = indexes[request.replica % len(indexes)]
            scores = index_view.scores(items, names)
            chosen = best([w_cache * c + load for c, load in zip(scores, load_scores(), strict=True)])
        if index_view is not None:
            holders = index_view.state.holders
            for item in items:
                predicted = holders.get(item.hash, ())
                actual = truth.get(item.hash, ())
                hit = len(actual & predicted) if predicted and actual else 0  # type: ignore[operator]
                result.true_positives += hit
                result.false_positives += len(predicted) - hit
                result.false_negatives += len(actual) - hit
            index_view.place(names[chosen], items)
        result.requests += 1
        if placed is not None:
            placed.append((names[chosen], request))
        servers[chosen].enqueue(request, now)
        start_ready(chosen, now)
        if on_request is not None and done % 1024 == 1023:
            on_request(1024)
    while events:
        handle(heapq.heappop(events))
    stuck = sum(len(s.waiting) for s in servers)
    if stuck:  # cannot happen: with nothing running, the whole cache is reusable
        raise AssertionError(f"{stuck} requests never started")
    means = [total / max(result.requests, 1) for total in queue_sums]
    average = sum(means) / len(means)
    result.imbalance = max(means) / average if average > 0 else 1.0
    return result
