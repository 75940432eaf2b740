"""The benchmark's own logic at tiny sizes: its JSON, its controls, its pass marks."""

from __future__ import annotations

import shutil

import orjson
import pytest

from stream.bench.figures import render_table
from stream.bench.match import ReferenceState, _ms, full_state
from stream.bench.run import run
from stream.core.cache import CacheState, Capacity
from stream.core.items import Item

KEYS = {"name", "value", "unit", "control", "ratio", "target", "pass", "note"}


def test_replay_and_restart_scenarios_write_complete_figures(bootstrap, tmp_path):
    out = tmp_path / "results.json"
    figures = run(out, only=["replay", "restart", "freshness"], bootstrap=bootstrap, scale=0.002)
    written = orjson.loads(out.read_bytes())
    assert [f["name"] for f in written["figures"]] == [f.name for f in figures]
    assert {f["name"] for f in written["figures"]} >= {
        "rebuild_replay_rate", "restart_to_ready_with_local_state", "disk_per_entry",
        "match_view_memory_per_entry", "freshness_p50", "freshness_p99"}
    for figure in written["figures"]:
        assert set(figure) == KEYS
        assert figure["value"] > 0 and isinstance(figure["pass"], bool)
        if figure["control"] is not None:
            assert figure["control"] > 0
            # ratios are rounded to 3 decimals, values to whole units
            assert figure["ratio"] == pytest.approx(figure["value"] / figure["control"], rel=0.01, abs=6e-4)
    replay = next(f for f in written["figures"] if f["name"] == "rebuild_replay_rate")
    assert replay["pass"] == (replay["value"] >= 250_000 and replay["ratio"] >= 0.6)
    table = out.with_suffix(".md").read_text()
    assert render_table(figures) in table and "rebuild_replay_rate" in table


def test_ingest_scenario_measures_the_worker_against_both_controls(bootstrap, tmp_path):
    figures = {f.name: f for f in run(tmp_path / "i.json", only=["ingest"], bootstrap=bootstrap,
                                      scale=0.002)}
    ingest, naive = figures["ingest_events_per_s"], figures["ingest_vs_naive_faust_agent"]
    assert ingest.value > 0 and naive.value > 0
    assert ingest.control > 0 and naive.control > 0  # raw consume; the naive Faust agent
    assert naive.ratio == pytest.approx(naive.value / naive.control, rel=0.01)
    assert naive.passed == (naive.ratio >= 10)
    assert ingest.passed == (ingest.value >= 50_000 and ingest.ratio >= 0.2)


def test_reference_lookup_control_gives_the_same_answers_as_the_index():
    inverted = full_state(CacheState(Capacity.from_params(8)), 3000)
    reference = full_state(ReferenceState(Capacity.from_params(8)), 3000)
    held = list(inverted.index.holders)[:40]
    items = [Item(h, 1, "image") for h in held[:6]] + [Item("absent", 2, "video")]
    endpoints = sorted(inverted.lrus.endpoints)[:64] + ["nobody"]
    assert inverted.index.match(items, endpoints) == reference.index.match(items, endpoints)
    assert any(m["matched_items"] for m in inverted.index.match(items, endpoints))


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk (Debian package) is not installed")
def test_match_scenario_measures_service_control_and_reference(bootstrap, tmp_path):
    figures = run(tmp_path / "r.json", only=["match"], bootstrap=bootstrap, scale=0.01)
    by_name = {f.name: f for f in figures}
    throughput = by_name["match_throughput_vs_bare_handler"]
    assert throughput.value > 0 and throughput.control > 0
    assert by_name["match_throughput_vs_reference_lookup"].control > 0
    p50, p99 = by_name["match_latency_p50_at_half_peak"], by_name["match_latency_p99_at_half_peak"]
    assert p99.value >= p50.value
    assert 0 < p50.control <= p99.control  # the bare handler under the same paced load
    assert p50.passed == (p50.ratio <= 1) and p99.passed == (p99.ratio <= 1)  # no higher than bare aiohttp's
    direct, backed = by_name["match_throughput_vs_redis_direct"], by_name["match_throughput_vs_redis_backed_http"]
    assert direct.control > 0 and direct.passed == (direct.ratio >= 0.15)
    assert backed.control > 0 and backed.passed == (backed.ratio >= 3)
    assert {"match_cost_hits", "ingest_cost_apply"} <= by_name.keys()  # the cost breakdown


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk (Debian package) is not installed")
def test_embedded_default_scenarios_measure_idle_cpu_freshness_and_match(bootstrap, tmp_path):
    """serve on its own broker: idle CPU of both processes, freshness after idle, and the
    match throughput against the bare aiohttp handler (whole figures, not a measure)."""
    figures = {f.name: f for f in run(tmp_path / "e.json", only=["idle", "match_embedded"],
                                      bootstrap=bootstrap, scale=0.002)}
    idle = figures["idle_cpu_embedded"]
    assert idle.value >= 0 and idle.passed == (idle.value <= 3) and "its broker" in idle.note
    for name in ("freshness_after_idle_p99", "freshness_after_a_minute_idle"):
        assert figures[name].value > 0 and figures[name].passed == (figures[name].value <= 10)
    match = figures["match_throughput_embedded_vs_bare_aiohttp"]
    assert match.value > 0 and match.control > 0
    assert match.ratio == pytest.approx(match.value / match.control, rel=0.01)
    assert match.passed == (match.ratio >= 0.5)


def test_wrk_latency_units_are_read_as_milliseconds():
    import re

    assert _ms(re.search(r"(\d+\.\d+)(us|ms|s)\b", "50%  812.00us")) == pytest.approx(0.812)
    assert _ms(re.search(r"(\d+\.\d+)(us|ms|s)\b", "99%    1.50ms")) == 1.5
    assert _ms(re.search(r"(\d+\.\d+)(us|ms|s)\b", "99%    2.00s")) == 2000.0


@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk (Debian package) is not installed")
def test_state_poll_scenario_measures_polled_against_unpolled(bootstrap, tmp_path):
    figures = {f.name: f for f in run(tmp_path / "s.json", only=["state_poll"], bootstrap=bootstrap,
                                      scale=0.01)}
    p99, worst = figures["match_p99_with_state_polled"], figures["match_max_with_state_polled"]
    assert 0 < p99.control <= worst.control and 0 < p99.value <= worst.value
    assert p99.ratio == pytest.approx(p99.value / p99.control, rel=0.01, abs=6e-4)
    assert p99.passed == (p99.value <= 1.2 * p99.control)
    assert worst.passed == (worst.value <= worst.control + 10)
    assert "/v1/state calls" in worst.note and int(worst.note.split()[0]) >= 1
    hold = figures["state_call_longest_loop_hold"]
    assert hold.value > 0 and hold.passed == (hold.value <= 5)


def test_big_bodies_scenario_measures_placements_under_the_flood_against_alone(bootstrap, tmp_path):
    (figure,) = run(tmp_path / "b.json", only=["big_bodies"], bootstrap=bootstrap, scale=0.01)
    assert figure.name == "placement_p99_under_match_flood" and figure.unit == "ms"
    assert 0 < figure.control and 0 < figure.value
    assert figure.ratio == pytest.approx(figure.value / figure.control, abs=0.051)
    assert "0 placements not 202" in figure.note
    assert figure.passed == (figure.value <= 1000)
    assert "the junk matches' answers" in figure.note
    assert set(orjson.loads((tmp_path / "b.json").read_bytes())["figures"][0]) == KEYS
