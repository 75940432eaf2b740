"""Where affinity hurts, and the configuration that keeps it from hurting: the cold-fleet
collapse of a first-pick tie-break, the render path's queue at its knee, the bound on a
hot server, and the load table's shape."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

from stream.sim.commands import add_commands
from stream.sim.fleet import FleetSpec, hit_saving_s, simulate
from stream.sim.load import COLUMNS, load_table
from stream.sim.workload import WorkloadSpec, generate

FLEET = FleetSpec(servers=4)
SPEC = WorkloadSpec(requests=200, rate=10.0, system_tokens=128, text_tokens=(10, 40), output_tokens=8,
                    conversation_share=0.0, seed=1)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmcache")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def test_on_a_cold_fleet_a_first_pick_tie_break_collapses_onto_one_server_and_the_fix_does_not():
    """A benchmark starts 40 users at once: every server scores the same (nothing cached,
    the scraped load all 0), so a picker that takes the first of the top scores sends the
    whole burst to one server; random ties and the gateway's own in-flight count spread it."""
    requests = generate(replace(SPEC, burst=40, fresh_share=1.0))
    first = simulate(requests, FLEET, "index")
    random_ties = simulate(requests, replace(FLEET, tie_break="random"), "index")
    fixed = simulate(requests, FLEET, "index-bounded")
    assert first.top_share_cold > 0.9
    assert random_ties.top_share_cold < 0.6
    assert fixed.top_share_cold < 0.4
    assert first.ttft_p90_s > fixed.ttft_p90_s


def test_the_render_path_queues_past_its_knee_and_the_fix_keeps_ttft_near_least_loaded():
    """One render sidecar of 9 calls/s: at 6 requests/s the calls barely wait; at 14 the
    queue grows for as long as requests come, and every request routed through it waits."""
    fleet = replace(FLEET, items_path="render", render_replicas=1, render_rate=9.0)
    below = simulate(generate(replace(SPEC, rate=6.0)), fleet, "index")
    above_requests = generate(replace(SPEC, rate=14.0))
    above = simulate(above_requests, fleet, "index")
    assert below.mean_render_wait_s < 0.1
    assert above.mean_render_wait_s > 1.0
    least = simulate(above_requests, fleet, "least-loaded")
    bypass = simulate(above_requests, fleet, "index-bounded")
    assert above.ttft_p90_s > least.ttft_p90_s + 1.0
    assert bypass.ttft_p90_s < least.ttft_p90_s + 0.3


def test_the_fix_renders_only_when_the_call_costs_less_than_a_hit_saves():
    """One item a request, ~1,450 embeddings: a hit saves ~0.07 s; a 9 calls/s sidecar
    (0.11 s a call) never pays, so the fix routes on load alone; a 100 calls/s one does
    when it is free."""
    requests = generate(replace(SPEC, rate=6.0, max_items=1))
    assert hit_saving_s(FLEET.costs, requests) < 1 / 9.0
    slow = simulate(requests, replace(FLEET, items_path="render", render_rate=9.0), "index-bounded")
    fast = simulate(requests, replace(FLEET, items_path="render", render_rate=100.0), "index-bounded")
    assert slow.rendered == 0
    assert fast.rendered > 0.8 * len(requests)


def test_when_no_render_call_pays_the_fix_routes_exactly_as_least_loaded():
    requests = generate(replace(SPEC, rate=12.0, max_items=1))
    fleet = replace(FLEET, items_path="render")
    fixed = simulate(requests, fleet, "index-bounded")
    least = simulate(requests, fleet, "least-loaded")
    assert fixed.rendered == 0
    assert fixed.ttft_s == least.ttft_s


def test_the_tokenizer_free_path_puts_nothing_on_the_routing_path():
    requests = generate(replace(SPEC, rate=14.0))
    result = simulate(requests, FLEET, "index")
    assert result.rendered == 0 and result.mean_render_wait_s == 0.0


def test_the_bound_keeps_an_item_hot_on_one_server_from_overloading_it():
    """Every request asks about the same item and the profile weighs affinity over load
    (8 against 4): affinity piles them all on the server that has it, whatever its queue;
    the bound caps how much hotter than the rest it may get."""
    requests = generate(replace(SPEC, catalogue=1, fresh_share=0.0, max_items=1, rate=30.0))
    heavy = replace(FLEET, cache_weight=8.0)
    naive = simulate(requests, replace(heavy, tie_break="random"), "index")
    unbounded = simulate(requests, replace(heavy, bound_factor=math.inf, bound_slack=10**6), "index-bounded")
    bounded = simulate(requests, heavy, "index-bounded")
    assert naive.imbalance > 3.5 and unbounded.imbalance > 3.5  # one server of 4 takes all
    assert bounded.imbalance < 1.3
    assert bounded.ttft_p90_s < 0.5 * unbounded.ttft_p90_s


def test_the_load_table_has_a_row_per_load_and_p90_grows_with_load():
    rows = load_table([replace(SPEC, requests=120)], FLEET, [0.2, 1.2])
    assert [row.load for row in rows] == [0.2, 1.2]
    assert rows[1].rate > rows[0].rate
    assert set(rows[0].p90) == {column for column, _, _ in COLUMNS}
    assert rows[1].p90["round-robin"] > rows[0].p90["round-robin"]


def test_simulate_load_table_json_names_each_paths_winner_with_and_without_the_fix(capsys):
    args = _parser().parse_args(["simulate", "--load-table", "--loads", "0.5", "--requests", "80",
                                 "--servers", "3", "--system-tokens", "64", "--output-tokens", "4",
                                 "--format", "json"])
    args.run(args)
    doc = json.loads(capsys.readouterr().out)
    (row,) = doc["rows"]
    assert row["load"] == 0.5 and row["rate_rps"] > 0
    assert set(row["ttft_p90_s"]) == {column for column, _, _ in COLUMNS}
    for key in ("winner_tokenizer_free_naive", "winner_tokenizer_free_fixed", "winner_render_naive",
                "winner_render_fixed"):
        assert row[key] in row["ttft_p90_s"]
