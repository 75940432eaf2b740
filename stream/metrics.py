"""Prometheus metrics. Hit and query counters live in plain dicts and are turned into
metric families only when scraped, so a 64-endpoint match adds dict increments to the
hot path instead of hundreds of labelled-counter calls.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from stream.core.cache import CacheState
from stream.core.items import Item

__all__ = ["Metrics"]

_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


class Metrics:
    """Every metric of one service process, on its own registry."""

    def __init__(self, state: CacheState, lag: Callable[[], dict[int, int]]) -> None:
        self.registry = CollectorRegistry()
        self._state = state
        self._lag = lag
        self._queries: Tally[str] = Tally()
        self._hits: Tally[tuple[str, str]] = Tally()
        self.hit_ratio = Histogram(
            "encoder_cache_hit_ratio",
            "Best endpoint score of each match request with items",
            buckets=_RATIO_BUCKETS,
            registry=self.registry,
        )
        self.events = Counter(
            "mmcache_events_processed_total",
            "Events applied to the state, by type",
            ["type"],
            registry=self.registry,
        )
        self.malformed = Counter(
            "mmcache_malformed_events_total",
            "Records on the event topic skipped because they are not valid events",
            registry=self.registry,
        )
        self.redelivered = Counter(
            "mmcache_redelivered_events_total",
            "Events skipped because their offset was already applied",
            registry=self.registry,
        )
        self.request_seconds = Histogram(
            "mmcache_http_request_duration_seconds",
            "HTTP request latency, by route",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._timers: dict[str, Any] = {}
        self.registry.register(self)

    def request_timer(self, route: str) -> Any:
        """The latency histogram of one route (labelled children are cached: hot path)."""
        timer = self._timers.get(route)
        if timer is None:
            timer = self._timers[route] = self.request_seconds.labels(route)
        return timer

    def record_match(self, items: Sequence[Item], found: Mapping[str, list[Item]]) -> None:
        """Count a match request's queried items and every (endpoint, item) hit;
        ``found`` maps the endpoints that hold items to those items (``CacheState.hits``)."""
        if not items:
            return
        queries, hits = self._queries, self._hits
        for item in items:
            queries[item.modality] += 1
        best = 0
        for endpoint, matched in found.items():
            best = max(best, sum(item.size for item in matched))
            for item in matched:
                hits[endpoint, item.modality] += 1
        self.hit_ratio.observe(best / sum(item.size for item in items))

    def collect(self) -> Iterator[Metric]:
        """Yield the dict-backed and scrape-time metrics (prometheus_client Collector)."""
        queries = CounterMetricFamily(
            "encoder_cache_queries", "Items queried by match requests", labels=["modality"]
        )
        for modality, count in self._queries.items():
            queries.add_metric([modality], count)
        hits = CounterMetricFamily(
            "encoder_cache_hits", "Matched (endpoint, item) pairs", labels=["pod", "modality"]
        )
        for (pod, modality), count in self._hits.items():
            hits.add_metric([pod, modality], count)
        lag = GaugeMetricFamily(
            "mmcache_consumer_lag", "Events on the log not yet applied", labels=["partition"]
        )
        for partition, behind in sorted(self._lag().items()):
            lag.add_metric([str(partition)], behind)
        yield queries
        yield hits
        yield lag
        yield GaugeMetricFamily(
            "mmcache_endpoints", "Endpoints with entries", value=len(self._state.endpoints)
        )
        yield GaugeMetricFamily(
            "mmcache_entries",
            "LRU entries over all endpoints",
            value=sum(len(c.entries) for c in self._state.endpoints.values()),
        )
