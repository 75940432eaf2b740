"""The soak's figures from its series: slopes over the second half (from where the restarts
stop), and its plot."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import orjson
import pytest

from stream.bench.figures import Figure
from stream.bench.run import _merged
from stream.bench.soak import _slope_per_hour, soak_svg


def _samples(values: list[float]) -> list[dict[str, float]]:
    return [{"t": 60.0 * i, "serve_rss_mib": v, "broker_rss_mib": v / 2, "data_dir_mib": 10.0}
            for i, v in enumerate(values)]


def test_a_flat_second_half_has_a_zero_slope_whatever_the_first_half_did():
    samples = _samples([10, 50, 90, 130, 100, 100, 100, 100, 100])
    slope, mean = _slope_per_hour(samples, "serve_rss_mib", since=240.0)
    assert slope == pytest.approx(0.0) and mean == pytest.approx(100.0)


def test_a_growing_second_half_has_its_growth_per_hour():
    samples = _samples([0, 0, 0, 0, 0, 1, 2, 3, 4])  # +1 MiB a minute from the middle on
    slope, _ = _slope_per_hour(samples, "serve_rss_mib", since=240.0)
    assert slope == pytest.approx(60.0, rel=0.2)


def test_the_plot_is_svg_with_a_line_per_resource_and_the_restarts_marked():
    svg = soak_svg(_samples([1, 2, 3, 4]), [{"t": 0.0}, {"t": 90.0}, {"t": 10_000.0}])
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f"{ns}polyline")) == 3
    dashed = [line for line in root.findall(f"{ns}line") if line.get("stroke-dasharray")]
    assert len(dashed) == 1  # the one inside the run; the first start and one past the end are not drawn


def test_a_partial_run_replaces_its_own_figures_and_keeps_the_others(tmp_path):
    out = tmp_path / "results.json"
    old = [Figure("a", 1, "s", "t", True).as_json(), Figure("soak_x", 5, "s", "t", False).as_json()]
    out.write_bytes(orjson.dumps({"date": "then", "quick": False, "figures": old}))
    new = [Figure("soak_x", 7, "s", "t", True).as_json()]
    rows, meta = _merged(out, new, {"date": "now", "quick": False}, ["soak"], "now")
    assert [(r["name"], r["value"]) for r in rows] == [("a", 1), ("soak_x", 7)]
    assert meta["date"] == "then" and meta["updated"] == {"soak": "now"}
    # a quick run never merges into a full run's file
    rows, meta = _merged(out, new, {"date": "now", "quick": True}, ["soak"], "now")
    assert rows == new


def test_a_partial_run_writes_both_files_with_every_figure(tmp_path):
    """`mmcache bench --only SCENARIO` once replaced the full run's results.json and
    results.md with its own two figures: both files keep every figure, with the new values
    of its own, the full run's date, and when the scenario was run again."""
    from stream.bench.run import write_results

    out = tmp_path / "results.json"
    full = [Figure("freshness_p99", 10.0, "ms", "t", True).as_json(),
            Figure("ingest_events_per_s", 26437, "events/s", "t", False).as_json()]
    write_results(out, full, {"date": "2026-12-05T03:56:17+00:00", "quick": False}, [], "then")
    fresh = [Figure("freshness_p99", 11.5, "ms", "t", True).as_json()]
    write_results(out, fresh, {"date": "2026-12-06T08:00:00+00:00", "quick": False}, ["freshness"],
                  "2026-12-06T08:00:00+00:00")
    written = orjson.loads(out.read_bytes())
    assert [(r["name"], r["value"]) for r in written["figures"]] == [
        ("ingest_events_per_s", 26437), ("freshness_p99", 11.5)]
    table = out.with_suffix(".md").read_text()
    assert table.startswith("2026-12-05T03:56:17+00:00 (full; freshness run again on 2026-12-06T08:00:00+00:00)")
    assert "| ingest_events_per_s | 26,437 events/s |" in table and "| freshness_p99 | 11.5 ms |" in table
