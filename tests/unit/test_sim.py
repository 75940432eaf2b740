"""The fleet simulator: determinism for a seed, the workload's shape, and the relations
between policies that must hold on any seed."""

from __future__ import annotations

import argparse
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from stream.sim.commands import add_commands
from stream.sim.fleet import POLICIES, FleetSpec, simulate
from stream.sim.workload import WorkloadSpec, generate

# small and skewed: 6 servers, 2,000 requests, Zipf 1.1 over 2,000 items, ~80% busy
SMALL = FleetSpec(servers=6, slots=8)


def _workload(seed: int, requests: int = 2000) -> list:
    return generate(WorkloadSpec(requests=requests, rate=18.0, catalogue=2000, zipf=1.1, replicas=3,
                                 seed=seed))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmcache")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


def test_the_workload_is_the_same_for_a_seed_and_differs_between_seeds():
    assert _workload(3, 300) == _workload(3, 300)
    assert _workload(3, 300) != _workload(4, 300)


def test_requests_have_one_to_four_distinct_items_with_sizes_from_the_mix():
    requests = _workload(5, 3000)
    counts = {len(r.items) for r in requests}
    assert counts == {1, 2, 3, 4}
    for request in requests:
        hashes = [item.hash for item in request.items]
        assert len(set(hashes)) == len(hashes)
    sizes = [item.size for r in requests for item in r.items]
    assert 256 in sizes
    assert any(1200 <= s <= 2500 for s in sizes) and any(3000 <= s <= 6000 for s in sizes)
    assert all(s == 256 or 1200 <= s <= 6000 for s in sizes)
    arrivals = [r.arrival for r in requests]
    assert arrivals == sorted(arrivals)


def test_the_workload_is_skewed_the_most_popular_item_is_asked_most():
    requests = _workload(6, 3000)
    counts: dict[str, int] = {}
    for request in requests:
        for item in request.items:
            counts[item.hash] = counts.get(item.hash, 0) + 1
    assert max(counts, key=counts.__getitem__) == "item-0"
    assert counts["item-0"] > 10 * counts.get("item-100", 0)


def test_a_simulation_is_deterministic_for_a_seed():
    requests = _workload(7, 1000)
    for policy in POLICIES:
        first = simulate(requests, SMALL, policy, seed=7)
        again = simulate(_workload(7, 1000), SMALL, policy, seed=7)
        assert first == again, policy


def test_the_simulate_command_prints_the_same_json_twice_and_in_the_documented_shape(capsys):
    argv = ["simulate", "--requests", "800", "--servers", "4", "--seed", "11", "--format", "json"]
    outputs = []
    for _ in range(2):
        args = _parser().parse_args(argv)
        args.run(args)
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    doc = json.loads(outputs[0])
    assert list(doc) == ["policies"]
    assert list(doc["policies"]) == list(POLICIES)
    for name, figures in doc["policies"].items():
        assert set(figures) == {"hit_ratio", "tokens_saved", "imbalance", "precision", "recall"}
        assert 0.0 <= figures["hit_ratio"] <= 1.0 and figures["imbalance"] >= 1.0
        if name in ("index", "index-size", "per-replica"):
            assert 0.0 <= figures["precision"] <= 1.0 and 0.0 <= figures["recall"] <= 1.0
        else:
            assert figures["precision"] is None and figures["recall"] is None


def test_a_different_seed_gives_different_figures(capsys):
    outputs = []
    for seed in ("1", "2"):
        args = _parser().parse_args(["simulate", "--requests", "500", "--servers", "4", "--seed", seed,
                                     "--policies", "random", "--format", "json"])
        args.run(args)
        outputs.append(capsys.readouterr().out)
    assert outputs[0] != outputs[1]


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**31))
def test_on_a_skewed_workload_oracle_beats_index_beats_random(seed):
    """With the plugin's default capacity (1,024 items) the index is weak, but it still
    beats random routing; the oracle beats both."""
    requests = _workload(seed)
    hit = {p: simulate(requests, SMALL, p, seed=seed).hit_ratio for p in ("random", "index", "oracle")}
    assert hit["oracle"] >= hit["index"] >= hit["random"], hit


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**31))
def test_a_shared_index_for_three_replicas_beats_an_index_per_replica(seed):
    """The shared index learns from every replica's placements; each per-replica index only
    from the third of the requests its replica routed. Capacity 6 items: about the
    8,192-embedding encoder cache over the mean item size (see docs/simulation.md; at
    the 1,024-item default both are near random and the order is noise)."""
    requests = _workload(seed)
    fleet = FleetSpec(servers=6, slots=8, index_items=6)
    shared = simulate(requests, fleet, "index", seed=seed, replicas=3)
    alone = simulate(requests, fleet, "per-replica", seed=seed, replicas=3)
    assert shared.hit_ratio >= alone.hit_ratio, (shared.hit_ratio, alone.hit_ratio)
    assert shared.precision >= alone.precision


def test_precision_and_recall_of_the_default_capacity_show_an_index_far_larger_than_the_cache():
    """1,024 items against an 8,192-embedding cache: everything cached is predicted
    (recall ~1) but most predictions are long evicted (precision low)."""
    result = simulate(_workload(2), SMALL, "index", seed=2)
    assert result.recall > 0.95
    assert result.precision < 0.4


def test_the_index_sized_in_embeddings_predicts_far_better():
    sized = simulate(_workload(2), SMALL, "index-size", seed=2)
    default = simulate(_workload(2), SMALL, "index", seed=2)
    assert sized.precision > 2 * default.precision
    assert sized.hit_ratio > default.hit_ratio


def test_an_item_over_the_budget_is_refused_not_served():
    requests = _workload(4, 400)
    result = simulate(requests, FleetSpec(servers=4, slots=8, budget=1000), "random", seed=4)
    too_big = sum(1 for r in requests if any(item.size > 1000 for item in r.items))
    assert result.refused == too_big > 0
    assert result.requests == len(requests)


def test_least_loaded_balances_better_than_random():
    requests = _workload(9)
    assert (simulate(requests, SMALL, "least-loaded", seed=9).imbalance
            < simulate(requests, SMALL, "random", seed=9).imbalance)


def test_help_names_every_default():
    parser = _parser()
    for command in ("simulate", "tune", "export"):
        assert callable(parser.parse_args([command]).run)
    simulate_help = _subparser(parser, "simulate").format_help()
    assert "(default: 16)" in simulate_help and "(default: 8192)" in simulate_help
    tune_help = _subparser(parser, "tune").format_help()
    assert "MMCACHE_BOOTSTRAP_SERVERS" in tune_help and "MMCACHE_TOPIC" in tune_help
    assert "(default: tune.svg)" in tune_help
    export_help = _subparser(parser, "export").format_help()
    assert "MMCACHE_APP_ID" in export_help and "(default: -)" in export_help


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        if name in getattr(action, "choices", {}):
            return action.choices[name]
    raise KeyError(name)
