"""Prometheus metrics as a scrape shows them (CONTRACT, "Operations": GET /metrics)."""

from __future__ import annotations

import re

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from stream.core.cache import CacheState, Capacity
from stream.core.events import EndpointDeleted, ItemsPlaced, Position
from stream.core.items import Item
from stream.metrics import Metrics

IMG_A = Item("a", 1, "image")
IMG_B = Item("b", 3, "image")
VID_V = Item("v", 4, "video")
AUD_X = Item("x", 1, "audio")


def scrape(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    """Every sample of the text exposition, keyed by name and labels."""
    text = generate_latest(metrics.registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name: str, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def names(samples, prefix: str) -> list[tuple[str, frozenset]]:
    return [key for key in samples if key[0].startswith(prefix)]


class Placements:
    def __init__(self, state: CacheState) -> None:
        self.state = state
        self.offset = 0

    def place(self, endpoint: str, *items: Item) -> None:
        self.state.fold.apply(
            ItemsPlaced(endpoint=endpoint, items=list(items)), Position(0, self.offset)
        )
        self.offset += 1

    def delete(self, endpoint: str) -> None:
        self.state.fold.apply(EndpointDeleted(endpoint=endpoint), Position(0, self.offset))
        self.offset += 1


@pytest.fixture
def state() -> CacheState:
    state = CacheState(Capacity("items", 10))
    log = Placements(state)
    log.place("ns/pod-a", IMG_A, VID_V)
    log.place("ns/pod-b", IMG_A, IMG_B)
    return state


@pytest.fixture
def metrics(state) -> Metrics:
    return Metrics(state, lambda: {})


def match(metrics: Metrics, state: CacheState, items, endpoints) -> None:
    metrics.record_match(items, state.index.hits(items, endpoints)[1])


def test_queries_count_each_item_by_modality(metrics, state):
    match(metrics, state, [IMG_A, IMG_B, VID_V, AUD_X], ["ns/pod-a"])
    match(metrics, state, [IMG_A], [])
    samples = scrape(metrics)
    assert value(samples, "encoder_cache_queries_total", modality="image") == 3
    assert value(samples, "encoder_cache_queries_total", modality="video") == 1
    assert value(samples, "encoder_cache_queries_total", modality="audio") == 1
    assert len(names(samples, "encoder_cache_queries")) == 3


def test_hits_count_each_matched_endpoint_item_pair(metrics, state):
    match(metrics, state, [IMG_A, IMG_B, VID_V, AUD_X], ["ns/pod-a", "ns/pod-b", "ns/unknown"])
    match(metrics, state, [IMG_A], ["ns/pod-a", "ns/pod-a"])  # a repeated endpoint counts once
    samples = scrape(metrics)
    hits = "encoder_cache_hits_total"
    assert value(samples, hits, pod="ns/pod-a", modality="image") == 2
    assert value(samples, hits, pod="ns/pod-a", modality="video") == 1
    assert value(samples, hits, pod="ns/pod-b", modality="image") == 2
    assert len(names(samples, "encoder_cache_hits")) == 3  # no zero rows, no audio, no unknown


def test_hits_are_exposed_with_pod_and_modality_labels(metrics, state):
    match(metrics, state, [VID_V], ["ns/pod-a"])
    text = generate_latest(metrics.registry).decode()
    hit = re.compile(  # label order is the client library's choice
        r'^encoder_cache_hits_total\{(?=[^}]*modality="video")(?=[^}]*pod="ns/pod-a")'
        r"[^}]*\} 1\.0$",
        re.MULTILINE,
    )
    assert hit.search(text), text
    assert re.search(r'^encoder_cache_queries_total\{modality="video"\} 1\.0$', text, re.MULTILINE)


def test_hit_ratio_observes_the_best_score_of_each_request(metrics, state):
    # pod-a: 1/4 (a), pod-b: 4/4 (a, b): best 1.0
    match(metrics, state, [IMG_A, IMG_B], ["ns/pod-a", "ns/pod-b"])
    # pod-a: v = 4/5, pod-b: 0: best 0.8
    match(metrics, state, [VID_V, AUD_X], ["ns/pod-b", "ns/pod-a"])
    # nothing held: 0.0
    match(metrics, state, [AUD_X], ["ns/pod-a"])
    # no endpoints at all: still one request with items, best 0.0
    match(metrics, state, [IMG_A], [])
    samples = scrape(metrics)
    ratio = "encoder_cache_hit_ratio"
    assert value(samples, ratio + "_count") == 4
    assert value(samples, ratio + "_sum") == pytest.approx(1.8)
    assert value(samples, ratio + "_bucket", le="0.0") == 2
    assert value(samples, ratio + "_bucket", le="0.75") == 2
    assert value(samples, ratio + "_bucket", le="0.9") == 3
    assert value(samples, ratio + "_bucket", le="1.0") == 4
    assert value(samples, ratio + "_bucket", le="+Inf") == 4


def test_a_request_without_items_records_nothing(metrics, state):
    metrics.record_match([], state.index.hits([], ["ns/pod-a"])[1])
    metrics.record_match([], {})
    samples = scrape(metrics)
    assert names(samples, "encoder_cache_queries") == []
    assert names(samples, "encoder_cache_hits") == []
    assert value(samples, "encoder_cache_hit_ratio_count") == 0
    assert value(samples, "encoder_cache_hit_ratio_sum") == 0


def test_consumer_lag_shows_what_the_lag_callable_returns(state):
    lag = {3: 17, 0: 0}
    metrics = Metrics(state, lambda: dict(lag))
    samples = scrape(metrics)
    assert value(samples, "mmcache_consumer_lag_events", partition="3") == 17
    assert value(samples, "mmcache_consumer_lag_events", partition="0") == 0
    assert len(names(samples, "mmcache_consumer_lag_events")) == 2
    lag.clear()
    lag[3] = 2
    samples = scrape(metrics)  # read at scrape time
    assert value(samples, "mmcache_consumer_lag_events", partition="3") == 2
    assert value(samples, "mmcache_consumer_lag_events", partition="0") is None


def test_consumer_lag_keeps_its_old_name_for_one_release_with_the_same_values(state):
    metrics = Metrics(state, lambda: {3: 17, 0: 0})
    samples = scrape(metrics)
    def by_partition(name: str) -> dict[str, float]:
        return {dict(labels)["partition"]: v for (n, labels), v in samples.items() if n == name}

    assert by_partition("mmcache_consumer_lag") == by_partition("mmcache_consumer_lag_events") == {
        "3": 17, "0": 0}


def test_endpoints_and_entries_gauges_follow_the_state(metrics, state):
    samples = scrape(metrics)
    assert value(samples, "mmcache_endpoints") == 2
    assert value(samples, "mmcache_entries") == 4
    log = Placements(state)
    log.offset = 100
    log.place("ns/pod-c", IMG_A, IMG_B, AUD_X)
    log.delete("ns/pod-a")
    samples = scrape(metrics)
    assert value(samples, "mmcache_endpoints") == 2
    assert value(samples, "mmcache_entries") == 5
    for partition in {cache.partition for cache in state.lrus.endpoints.values()}:
        state.loading.drop_partition(partition)
    samples = scrape(metrics)
    assert value(samples, "mmcache_endpoints") == 0
    assert value(samples, "mmcache_entries") == 0


def test_event_malformed_and_redelivered_counters_are_exposed(metrics):
    metrics.events.labels("items_placed").inc(2)
    metrics.malformed.inc()
    metrics.redelivered.inc(3)
    samples = scrape(metrics)
    assert value(samples, "mmcache_events_processed_total", type="items_placed") == 2
    assert value(samples, "mmcache_malformed_events_total") == 1
    assert value(samples, "mmcache_redelivered_events_total") == 3


def test_request_latency_histogram_is_exposed_by_route(metrics):
    metrics.request_timer("/v1/match").observe(0.003)
    samples = scrape(metrics)
    name = "mmcache_http_request_duration_seconds"
    assert value(samples, name + "_count", route="/v1/match") == 1
    assert value(samples, name + "_bucket", route="/v1/match", le="0.0025") == 0
    assert value(samples, name + "_bucket", route="/v1/match", le="0.005") == 1


def test_each_metrics_object_has_its_own_registry(state):
    first, second = Metrics(state, lambda: {}), Metrics(state, lambda: {})
    first.record_match([IMG_A], state.index.hits([IMG_A], ["ns/pod-a"])[1])
    assert value(scrape(first), "encoder_cache_queries_total", modality="image") == 1
    assert names(scrape(second), "encoder_cache_queries") == []


# Issue 10, item 7: metrics a Prometheus user can alert on.

def test_a_deleted_or_synced_away_pods_series_are_removed(metrics, state):
    from stream.core.events import EndpointsSynced

    log = Placements(state)
    log.offset = 10
    log.place("ns/pod-c", IMG_A)
    match(metrics, state, [IMG_A], ["ns/pod-a", "ns/pod-b", "ns/pod-c"])
    pods = lambda: {dict(k[1])["pod"] for k in names(scrape(metrics), "encoder_cache_hits_total")}  # noqa: E731
    assert pods() == {"ns/pod-a", "ns/pod-b", "ns/pod-c"}
    log.delete("ns/pod-a")
    assert pods() == {"ns/pod-b", "ns/pod-c"}
    state.fold.apply(EndpointsSynced(live=["ns/pod-b"]), Position(0, log.offset))
    assert pods() == {"ns/pod-b"}


def test_requests_are_counted_by_route_and_status_code(metrics):
    metrics.count_request("/v1/match", 200)
    metrics.count_request("/v1/match", 200)
    metrics.count_request("/v1/match", 400)
    samples = scrape(metrics)
    assert value(samples, "mmcache_http_requests_total", route="/v1/match", code="200") == 2
    assert value(samples, "mmcache_http_requests_total", route="/v1/match", code="400") == 1


def test_readiness_gauge_and_process_collector_on_the_same_registry(metrics):
    assert value(scrape(metrics), "mmcache_ready") is None  # no readiness known yet
    ready = [False]
    metrics.readiness = lambda: ready[0]
    assert value(scrape(metrics), "mmcache_ready") == 0
    ready[0] = True
    samples = scrape(metrics)
    assert value(samples, "mmcache_ready") == 1
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"):
        assert value(samples, name) is not None, name


def test_every_metric_has_a_help_text(metrics, state):
    match(metrics, state, [IMG_A], ["ns/pod-a"])
    metrics.write_failures.labels("overloaded").inc()
    metrics.dead_letters.labels("not_json").inc()
    text = generate_latest(metrics.registry).decode()
    families = list(text_string_to_metric_families(text))
    assert len(families) > 10
    for family in families:
        assert family.documentation.strip(), family.name
    samples = scrape(metrics)
    assert value(samples, "mmcache_write_failures_total", reason="overloaded") == 1
    assert value(samples, "mmcache_dead_letters_total", reason="not_json") == 1
