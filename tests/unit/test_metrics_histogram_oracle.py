"""``stream.metrics.Histogram`` is written by hand for speed; prometheus_client's own
``Histogram`` is its oracle: the same observations through both give the same exposition
(cumulative bucket counts, count and sum)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import prometheus_client
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from stream.metrics import _LATENCY_BUCKETS, _RATIO_BUCKETS, Histogram, _histogram_family

BOUNDS = (_RATIO_BUCKETS, _LATENCY_BUCKETS)


class _Ours(Collector):
    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram

    def collect(self) -> Iterator[prometheus_client.Metric]:
        yield _histogram_family("oracle", "the same observations", {(): self.histogram})


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if not sample.name.endswith("_created")}


def _both(bounds: Sequence[float], values: list[float]) -> tuple[dict, dict]:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    histogram = Histogram(bounds)
    ours.register(_Ours(histogram))
    oracle = prometheus_client.Histogram("oracle", "the same observations", buckets=bounds,
                                         registry=theirs)
    for value in values:
        histogram.observe(value)
        oracle.observe(value)
    return _samples(ours), _samples(theirs)


def _observations(bounds: Sequence[float]) -> st.SearchStrategy[list[float]]:
    # the bounds themselves (a value on a bound is counted in that bucket), the values with no
    # order (NaN) or past every bound, around the bounds, anything
    edges = st.sampled_from((*bounds, math.nan, math.inf, -math.inf))
    return st.lists(st.one_of(edges, st.floats(-1, 2), st.floats(allow_nan=True)), max_size=200)


@given(st.sampled_from(BOUNDS).flatmap(lambda bounds: st.tuples(st.just(bounds), _observations(bounds))))
def test_buckets_count_and_sum_are_prometheus_clients(case):
    bounds, values = case
    ours, theirs = _both(bounds, values)
    assert ours.keys() == theirs.keys()
    for key, expected in theirs.items():
        got = ours[key]
        assert got == expected or (got != got and expected != expected), key  # NaN sums alike


def test_a_value_on_a_bound_is_counted_in_that_bound_as_prometheus_client_counts_it():
    ours, theirs = _both(_RATIO_BUCKETS, [0.0, 0.5, 1.0])
    assert ours == theirs
    assert ours[("oracle_bucket", (("le", "0.5"),))] == 2.0


def test_a_nan_is_summed_and_counted_in_no_bucket_as_prometheus_client_does():
    ours, theirs = _both(_LATENCY_BUCKETS, [0.001, math.nan])
    assert ours.keys() == theirs.keys()
    assert [v for k, v in ours.items() if k[0] != "oracle_sum"] == [
        v for k, v in theirs.items() if k[0] != "oracle_sum"]
    assert ours[("oracle_count", ())] == 1.0
    assert math.isnan(ours[("oracle_sum", ())]) and math.isnan(theirs[("oracle_sum", ())])
