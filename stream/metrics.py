"""Prometheus metrics. Hit and query counters and the histograms of the request path live
in plain dicts and lists and are turned into metric families only when scraped, so a
64-endpoint match adds a few C-level increments to the hot path instead of hundreds of
labelled-counter calls (a prometheus_client histogram observation took ~1.3 us, under
a lock that a single-threaded event loop does not need).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from itertools import accumulate
from operator import attrgetter
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from stream.core.cache import CacheState
from stream.core.items import Item

__all__ = ["Histogram", "Metrics"]

_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
_MODALITY = attrgetter("modality")
_SIZE = attrgetter("size")
_OUTCOMES = ("true_hit", "false_hit", "missed_hit", "true_miss")


class Histogram:
    """One histogram series for the event loop's thread only: a count per bucket and a sum.

    ``observe`` is a bisect and two adds; the cumulative buckets are summed at scrape.
    prometheus_client's ``Histogram`` is its oracle (``tests/unit/test_metrics_histogram_oracle.py``):
    a NaN is summed and counted in no bucket, as there.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` in the first bucket whose upper bound is >= it."""
        if value == value:  # not NaN, which bisect would put in the first bucket
            self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs as the exposition writes them."""
        bounds = [floatToGoString(bound) for bound in self.bounds] + ["+Inf"]
        return list(zip(bounds, accumulate(self.counts), strict=True))


class Metrics:
    """Every metric of one service process, on its own registry."""

    def __init__(self, state: CacheState, lag: Callable[[], dict[int, int]]) -> None:
        self.registry = CollectorRegistry()
        # RSS, CPU seconds, open fds, start time; the Python runtime's figures
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self._state = state
        self._lag = lag
        self._queries: Tally[str] = Tally()
        self._hits: Tally[tuple[str, str]] = Tally()
        self._requests: Tally[tuple[str, int]] = Tally()
        # the estimate against the engine views: true_hit, false_hit, missed_hit, true_miss
        self._checks = [0, 0, 0, 0]
        # set by the HTTP API: whether /readyz answers 200 now
        self.readiness: Callable[[], bool] | None = None
        # set by the worker on serve's own broker: fetch requests its consumers sent so far
        self.log_fetches: Callable[[], int] | None = None
        # set by the HTTP API: its server (``stream.http.server.HttpServer``), whose connections,
        # bodies in flight and refusals for its bounds are exported
        self.http_server: Any = None
        self.hit_ratio = Histogram(_RATIO_BUCKETS)
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
        self.dead_letters = Counter(
            "mmcache_dead_letters_total",
            "Records of the event topic not applied, copied to the dead-letter topic, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.redelivered = Counter(
            "mmcache_redelivered_events_total",
            "Events skipped because their offset was already applied",
            registry=self.registry,
        )
        self.write_failures = Counter(
            "mmcache_write_failures_total",
            "Writes answered 503, by reason: log_unavailable (not acknowledged in time, may "
            "still be written) or overloaded (too many writes waiting, nothing sent)",
            ["reason"],
            registry=self.registry,
        )
        self._timers: dict[str, Histogram] = {}
        self.registry.register(self)

    def request_timer(self, route: str) -> Histogram:
        """The latency histogram (seconds) of one route; callers keep it for the hot path."""
        timer = self._timers.get(route)
        if timer is None:
            timer = self._timers[route] = Histogram(_LATENCY_BUCKETS)
        return timer

    def count_request(self, route: str, status: int) -> None:
        """Count one answered request (``route`` is the route's pattern, a bounded set)."""
        self._requests[route, status] += 1

    def record_match(self, items: Sequence[Item], found: Mapping[str, list[Item]]) -> None:
        """Count a match request's queried items and every (endpoint, item) hit;
        ``found`` maps the endpoints that hold items to those items (``Index.hits``)."""
        if items:
            self.record_queries(items, self.count_hits(found))

    def count_hits(self, found: Mapping[str, list[Item]]) -> int:
        """Count every (endpoint, item) hit of ``found`` (all of a match's, or a slice of
        them: a wide match counts in slices, the loop turning between); return the best
        endpoint's matched weight among them."""
        hits = self._hits
        best = 0
        for endpoint, matched in found.items():
            best = max(best, sum(map(_SIZE, matched)))
            for item in matched:
                hits[endpoint, item.modality] += 1
        return best

    def count_checks(self, items: int, reporting: Collection[str], estimate: Mapping[str, list[Item]],
                     truth: Mapping[str, list[Item]]) -> None:
        """Count, for each of the ``reporting`` endpoints (distinct) and each of a match's
        ``items`` (distinct hashes), what its LRU predicted (``estimate``'s hits) against
        what its engine view holds (``truth``'s hits; only those of ``reporting`` count, so a
        wide match counts its endpoints in slices). The cost follows the hits: the pairs
        neither holds are counted in one product."""
        wanted = reporting if isinstance(reporting, set | frozenset) else set(reporting)
        touched = wanted.intersection(estimate)
        touched.update(wanted.intersection(truth))
        true_hit = false_hit = missed_hit = 0
        for name in touched:
            guessed, held = estimate.get(name), truth.get(name)
            if guessed is None:
                missed_hit += len(held)  # type: ignore[arg-type]
            elif held is None:
                false_hit += len(guessed)
            else:
                guesses = {item.hash for item in guessed}
                both = sum(1 for item in held if item.hash in guesses)
                true_hit += both
                false_hit += len(guessed) - both
                missed_hit += len(held) - both
        checks = self._checks
        checks[0] += true_hit
        checks[1] += false_hit
        checks[2] += missed_hit
        checks[3] += items * len(wanted) - true_hit - false_hit - missed_hit

    def record_queries(self, items: Sequence[Item], best: int) -> None:
        """Count a match request's queried items and observe its best score, given the
        best matched weight over all its endpoints (``count_hits``)."""
        self._queries.update(map(_MODALITY, items))
        self.hit_ratio.observe(best / sum(map(_SIZE, items)))

    def collect(self) -> Iterator[Metric]:
        """Yield the dict-backed and scrape-time metrics (prometheus_client Collector)."""
        queries = CounterMetricFamily(
            "encoder_cache_queries", "Items queried by match requests", labels=["modality"]
        )
        for modality, count in self._queries.items():
            queries.add_metric([modality], count)
        hits = CounterMetricFamily(
            "encoder_cache_hits", "Matched (endpoint, item) pairs, by pod and modality; a pod's "
            "series goes when the pod is deleted or synced away", labels=["pod", "modality"]
        )
        live, views = self._state.lrus.endpoints, self._state.lrus.engine.views
        for key in [key for key in self._hits if key[0] not in live and key[0] not in views]:
            del self._hits[key]  # its LRU and view were dropped: a pod label lives as long as the pod
        for (pod, modality), count in self._hits.items():
            hits.add_metric([pod, modality], count)
        requests = CounterMetricFamily(
            "mmcache_http_requests", "HTTP requests answered, by route and status code",
            labels=["route", "code"]
        )
        for (route, status), count in sorted(self._requests.items()):
            requests.add_metric([route, str(status)], count)
        lag = GaugeMetricFamily(
            "mmcache_consumer_lag_events", "Events on the log not yet applied, by owned partition",
            labels=["partition"]
        )
        # the same figure under its name before it said its unit, kept for one release
        old_lag = GaugeMetricFamily(
            "mmcache_consumer_lag", "Deprecated: mmcache_consumer_lag_events under its old name, "
            "removed in the next release", labels=["partition"]
        )
        for partition, behind in sorted(self._lag().items()):
            lag.add_metric([str(partition)], behind)
            old_lag.add_metric([str(partition)], behind)
        checks = CounterMetricFamily(
            "mmcache_estimate_checks", "Requested items of match requests, for each endpoint that "
            "reports its own cache: what the estimate (LRU) predicted against what the engine view "
            "holds (true_hit: both hold it, false_hit: only the estimate, missed_hit: only the "
            "engine, true_miss: neither)", labels=["outcome"])
        for outcome, count in zip(_OUTCOMES, self._checks, strict=True):
            checks.add_metric([outcome], count)
        yield queries
        yield hits
        yield checks
        yield requests
        yield lag
        yield old_lag
        if self.http_server is not None:
            yield from _http_server_families(self.http_server)
        if self.readiness is not None:
            yield GaugeMetricFamily("mmcache_ready", "1 while /readyz answers 200, else 0",
                                    value=1 if self.readiness() else 0)
        if self.log_fetches is not None:
            yield CounterMetricFamily(
                "mmcache_log_fetch_requests", "Fetch requests this process's consumers (the "
                "worker's, the kept log's journal, a follower) sent to serve's own embedded broker; "
                "an idle serve sends a few a second", value=self.log_fetches())
        yield _histogram_family("encoder_cache_hit_ratio",
                                "Best endpoint score of each match request with items",
                                {(): self.hit_ratio})
        yield _histogram_family("mmcache_http_request_duration_seconds",
                                "HTTP request latency, by route",
                                {(route,): timer for route, timer in self._timers.items()},
                                ["route"])
        yield GaugeMetricFamily(
            "mmcache_endpoints", "Endpoints with entries", value=len(self._state.lrus.endpoints)
        )
        yield GaugeMetricFamily(
            "mmcache_entries",
            "LRU entries over all endpoints",
            value=sum(len(c.entries) for c in self._state.lrus.endpoints.values()),
        )
        yield GaugeMetricFamily(
            "mmcache_engine_views", "Endpoints that report their own cache (engine views)",
            value=len(views))
        yield GaugeMetricFamily(
            "mmcache_engine_view_entries", "Engine view entries over all endpoints",
            value=sum(len(view.entries) for view in views.values()))
        yield CounterMetricFamily(
            "mmcache_engine_view_bound_drops", "Engine view entries this worker's fold dropped "
            "because a view held MMCACHE_ENGINE_VIEW_MAX_ENTRIES (its engine still holds them: "
            "raise the bound)", value=self._state.lrus.engine.bound_drops)


def _http_server_families(server: Any) -> Iterator[Metric]:
    """The HTTP server's bounds: what is held against each, and what each refused."""
    refusals = server.refusals
    yield GaugeMetricFamily("mmcache_http_connections", "Open HTTP connections (at most "
                            "MMCACHE_MAX_CONNECTIONS)", value=len(server.connections))
    yield GaugeMetricFamily("mmcache_http_body_in_flight_bytes", "Bytes held by request bodies from their "
                            "first byte to their answer (at most MMCACHE_BODY_BUDGET_BYTES)",
                            value=server.body_bytes)
    yield CounterMetricFamily("mmcache_http_connections_refused", "New connections closed at once because "
                              "MMCACHE_MAX_CONNECTIONS were open", value=refusals["connection_cap"])
    yield CounterMetricFamily("mmcache_http_body_budget_refusals", "Requests answered 503 server_busy "
                              "because their body would take the bodies in flight over "
                              "MMCACHE_BODY_BUDGET_BYTES",
                              value=refusals["body_budget"])
    yield CounterMetricFamily("mmcache_http_lingers_cut", "Lingering closes ended by their time while the "
                              "refused client still sent (it may read a reset instead of its answer)",
                              value=refusals["linger_cut"])


def _histogram_family(
    name: str, documentation: str, series: Mapping[tuple[str, ...], Histogram],
    labels: Sequence[str] = (),
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=list(labels))
    for values, histogram in series.items():
        family.add_metric(list(values), histogram.buckets(), histogram.sum)
    return family
