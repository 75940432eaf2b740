"""The fleet simulator: the workload's prompt structure, determinism for a seed, each cache
layer counted, TTFT against load, and the command's output."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from stream.core.items import Item
from stream.sim.commands import add_commands, run_simulation
from stream.sim.engine import Segment
from stream.sim.fleet import LAYERS, POLICIES, FleetSpec, simulate
from stream.sim.workload import Request, WorkloadSpec, generate, item_segment

# small and quick: 4 servers, short prompts, a skewed catalogue
SMALL = FleetSpec(servers=4)
SPEC = WorkloadSpec(requests=300, rate=20.0, catalogue=300, zipf=1.1, system_tokens=256,
                    text_tokens=(10, 60), output_tokens=8, think_s=1.0)


def _workload(seed: int, requests: int = 300, **changes: object) -> list[Request]:
    return generate(replace(SPEC, requests=requests, seed=seed, **changes))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmcache")
    add_commands(parser.add_subparsers(dest="command", required=True))
    return parser


# -- the workload ------------------------------------------------------------------------


def test_the_workload_is_the_same_for_a_seed_and_differs_between_seeds():
    assert _workload(3, 200) == _workload(3, 200)
    assert _workload(3, 200) != _workload(4, 200)


def test_every_prompt_opens_with_the_shared_system_prompt_and_holds_its_items_once():
    for request in _workload(5):
        assert request.segments[0] == Segment("system", 256)
        media = [s.key for s in request.segments if s.embeddings]
        assert media == [item.hash for item in request.items]
        assert len(set(media)) == len(media)
    arrivals = [r.arrival for r in _workload(5)]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0


def test_single_shot_items_come_right_after_the_system_prompt_or_after_the_users_text():
    single = [r for r in _workload(6, 600) if r.conversation < 0]
    first = [r for r in single if r.segments[1].embeddings]
    after_text = [r for r in single if not r.segments[1].embeddings]
    assert first and after_text
    assert all(not r.segments[-1].embeddings for r in first)  # the question follows the items
    assert all(r.segments[-1].embeddings for r in after_text)


def test_each_turn_of_a_conversation_is_the_previous_turn_and_its_answer_then_new_text():
    requests = _workload(7, 600)
    turns: dict[int, list[Request]] = {}
    for request in requests:
        if request.conversation >= 0:
            turns.setdefault(request.conversation, []).append(request)
    followed = 0
    for conversation in turns.values():
        conversation.sort(key=lambda r: r.turn)
        for before, after in zip(conversation, conversation[1:], strict=False):
            if after.turn != before.turn + 1:
                continue
            followed += 1
            assert after.items == before.items  # the same item, sent again
            assert after.segments[: len(before.segments)] == before.segments
            answer = after.segments[len(before.segments)]
            assert answer.tokens == before.output_tokens and not answer.embeddings
    assert followed > 20


def test_shared_items_are_skewed_and_fresh_ones_are_never_repeated_across_sessions():
    counts: dict[str, int] = {}
    sessions: dict[str, set[tuple[int, int]]] = {}
    for request in _workload(8, 1000):
        for item in request.items:
            counts[item.hash] = counts.get(item.hash, 0) + 1
            sessions.setdefault(item.hash, set()).add(
                (request.conversation, -1 if request.conversation >= 0 else request.id))
    assert max((h for h in counts if h.startswith("item-")), key=counts.__getitem__) == "item-0"
    assert counts["item-0"] > 10 * counts.get("item-100", 0)
    assert all(len(s) == 1 for h, s in sessions.items() if h.startswith("fresh-"))


def test_requests_arrive_at_the_asked_rate_from_the_start():
    """Conversations are under way at 0 (a warm-up before it is dropped), so the first
    requests come at the full rate, turns included."""
    requests = generate(replace(SPEC, requests=2000, rate=40.0, think_s=5.0))
    span = requests[-1].arrival - requests[0].arrival
    assert 0.85 < len(requests) / span / 40.0 < 1.15
    assert any(r.turn > 0 for r in requests[:100])


def test_a_burst_starts_its_sessions_at_once():
    requests = _workload(9, 200, burst=40)
    assert sum(1 for r in requests if r.arrival == 0.0) >= 40


# -- the fleet ---------------------------------------------------------------------------


def test_a_simulation_is_deterministic_for_a_seed():
    requests = _workload(7, 150)
    for policy in POLICIES:
        first = simulate(requests, SMALL, policy, seed=7)
        again = simulate(_workload(7, 150), SMALL, policy, seed=7)
        assert first == again, policy


def _repeat(item: Item, times: int, gap: float, question_tokens: int = 20) -> list[Request]:
    """The same prompt (system, one item, the same question) sent ``times`` times."""
    prompt = (Segment("system", 64), item_segment(item), Segment("question", question_tokens))
    return [Request(n, n * gap, 0, (item,), prompt, 4) for n in range(times)]


def test_one_item_sent_again_to_one_server_hits_every_layer():
    result = simulate(_repeat(Item("photo", 256, "image"), 10, 1.0), FleetSpec(servers=1), "round-robin")
    layers = result.layers
    assert layers["processor"].lookups == 10 and layers["processor"].hits == 9
    # from the second request on, the prefix cache holds the whole prompt but its last
    # token, so the item is never looked up in the encoder cache again
    assert layers["prefix"].hits > 0.8 * layers["prefix"].lookups
    assert layers["encoder"].lookups == 1 and layers["encoder"].hits == 0


def test_an_item_after_text_that_differs_hits_the_encoder_cache_not_the_prefix():
    item = Item("photo", 256, "image")
    requests = [Request(n, n * 0.5, 0, (item,), (Segment(f"user-{n}", 64), item_segment(item)), 4)
                for n in range(6)]
    layers = simulate(requests, FleetSpec(servers=1), "round-robin").layers
    assert layers["prefix"].hits == 0
    assert layers["encoder"].lookups == 6 and layers["encoder"].hits == 5
    assert layers["processor"].hits == 5


def test_fresh_items_on_every_request_hit_no_item_layer():
    requests = [Request(n, n * 0.2, 0, (Item(f"new-{n}", 256, "image"),),
                        (Segment(f"user-{n}", 32), item_segment(Item(f"new-{n}", 256, "image"))), 4)
                for n in range(8)]
    layers = simulate(requests, FleetSpec(servers=2), "random").layers
    assert all(layers[name].hits == 0 for name in LAYERS)
    assert layers["processor"].lookups == 8 and layers["encoder"].lookups == 8


def test_a_hit_shortens_the_time_to_first_token():
    cold = simulate(_repeat(Item("photo", 2048, "image"), 1, 1.0), FleetSpec(servers=1), "round-robin")
    warm = simulate(_repeat(Item("photo", 2048, "image"), 5, 1.0), FleetSpec(servers=1), "round-robin")
    assert min(warm.ttft_s) < 0.5 * cold.ttft_s[0]


def test_ttft_grows_with_load_past_capacity():
    from stream.sim.load import measure_capacity

    capacity = measure_capacity(replace(SPEC, seed=3), SMALL, 3)
    low = simulate(_workload(3, rate=0.2 * capacity), SMALL, "round-robin", seed=3)
    high = simulate(_workload(3, rate=1.2 * capacity), SMALL, "round-robin", seed=3)
    assert high.ttft_p90_s > 2 * low.ttft_p90_s
    assert high.ttft_p50_s > low.ttft_p50_s


def test_precision_and_recall_of_the_default_capacity_show_an_index_far_larger_than_the_cache():
    """1,024 items against an 8,192-embedding encoder cache: what is cached is predicted
    (recall high) but most predictions were evicted long ago (precision low); sized in
    embeddings to the cache, precision is far higher."""
    requests = _workload(2, 600, catalogue=2000, zipf=1.0)
    default = simulate(requests, SMALL, "index", seed=2)
    sized = simulate(requests, SMALL, "index-size", seed=2)
    assert default.recall > 0.9 and default.precision < 0.4
    assert sized.precision > 2 * default.precision


def test_affinity_finds_more_encoder_hits_than_random_routing():
    requests = _workload(4, 400)
    assert (simulate(requests, SMALL, "index-size", seed=4).hit_ratio
            > simulate(requests, SMALL, "random", seed=4).hit_ratio)


def test_least_loaded_balances_better_than_random():
    requests = _workload(9, 400, rate=40.0)
    assert (simulate(requests, SMALL, "least-loaded", seed=9).imbalance
            < simulate(requests, SMALL, "random", seed=9).imbalance)


# -- the command ---------------------------------------------------------------------------

_QUICK = ["--requests", "120", "--servers", "3", "--system-tokens", "128", "--output-tokens", "4",
          "--rate", "10"]


def test_the_simulate_command_prints_the_same_json_twice_and_in_the_documented_shape(capsys):
    argv = ["simulate", *_QUICK, "--seed", "11", "--format", "json"]
    outputs = []
    for _ in range(2):
        args = _parser().parse_args(argv)
        args.run(args)
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    doc = json.loads(outputs[0])
    assert list(doc["policies"]) == list(POLICIES)
    assert doc["rate_rps"] == 10.0 and doc["capacity_rps"] is None
    for name, figures in doc["policies"].items():
        assert list(figures["layers"]) == ["processor", "encoder", "prefix"]
        for layer in figures["layers"].values():
            assert 0.0 <= layer["hit_ratio"] <= 1.0 and layer["hits"] <= layer["lookups"]
        assert 0.0 < figures["ttft_p50_s"] <= figures["ttft_p90_s"]
        assert figures["imbalance"] >= 1.0
        if name in ("index", "index-size", "per-replica", "index-bounded"):
            assert 0.0 <= figures["precision"] <= 1.0 and 0.0 <= figures["recall"] <= 1.0
        else:
            assert figures["precision"] is None and figures["recall"] is None


def test_the_table_gives_every_layer_and_ttft_with_the_spread_over_runs(capsys):
    args = _parser().parse_args(["simulate", *_QUICK, "--runs", "2", "--policies", "round-robin,index"])
    args.run(args)
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("policy"))
    for title in ("processor", "encoder", "prefix", "TTFT p50 s", "TTFT p90 s"):
        assert title in head
    rows = [line for line in out.splitlines() if line.startswith(("round-robin", "index"))]
    assert len(rows) == 2 and all("±" in row for row in rows)


def test_without_a_rate_the_load_is_a_share_of_the_measured_capacity(capsys):
    argv = ["simulate", *_QUICK[:-2], "--load", "0.5", "--policies", "round-robin", "--format", "json"]
    args = _parser().parse_args(argv)
    args.run(args)
    doc = json.loads(capsys.readouterr().out)
    assert doc["rate_rps"] == pytest.approx(0.5 * doc["capacity_rps"])


def test_a_different_seed_gives_different_figures(capsys):
    outputs = []
    for seed in ("1", "2"):
        args = _parser().parse_args(["simulate", *_QUICK, "--seed", seed, "--policies", "random",
                                     "--format", "json"])
        args.run(args)
        outputs.append(capsys.readouterr().out)
    assert outputs[0] != outputs[1]


def test_help_names_every_default():
    parser = _parser()
    for command in ("simulate", "tune", "export"):
        assert callable(parser.parse_args([command]).run)
    simulate_help = _subparser(parser, "simulate").format_help()
    assert "(default: 8)" in simulate_help and "(default: 8192)" in simulate_help
    assert "(default: first)" in simulate_help and "(default: tokenizer-free)" in simulate_help
    tune_help = _subparser(parser, "tune").format_help()
    assert "MMCACHE_BOOTSTRAP_SERVERS" in tune_help and "MMCACHE_TOPIC" in tune_help
    export_help = _subparser(parser, "export").format_help()
    assert "MMCACHE_APP_ID" in export_help and "(default: -)" in export_help


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._subparsers._group_actions:  # type: ignore[union-attr]
        if name in getattr(action, "choices", {}):
            return action.choices[name]
    raise KeyError(name)


@pytest.mark.parametrize(("flags", "message"), [
    (["--turns", "4,2"], "need 1 <= LOW <= HIGH"),
    (["--text-tokens", "10"], "give two integers as LOW,HIGH"),
    (["--large-embeddings", "0,5"], "need 1 <= LOW <= HIGH"),
])
def test_a_range_flag_that_is_not_a_range_is_refused_by_name(flags, message, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["simulate", *flags])
    err = capsys.readouterr().err
    assert flags[0] in err and message in err


def test_item_shares_over_one_are_refused_before_anything_runs(capsys):
    args = _parser().parse_args(["simulate", *_QUICK, "--large-share", "0.9", "--video-share", "0.2"])
    with pytest.raises(SystemExit, match="--large-share and --video-share must be shares"):
        args.run(args)
    assert capsys.readouterr().out == ""


def test_the_workload_flags_shape_the_requests():
    args = _parser().parse_args(["simulate", *_QUICK, "--small-embeddings", "16", "--large-embeddings", "40,64",
                                 "--large-share", "0.5", "--video-share", "0", "--text-tokens", "5,9",
                                 "--turns", "2,2", "--conversation-share", "0.5", "--policies", "round-robin"])
    placed: list = []
    run_simulation(args, placed=placed)
    requests = [request for _, request in placed]
    sizes = {item.size for request in requests for item in request.items}
    assert sizes <= {16, *range(40, 65)} and 16 in sizes and sizes - {16}
    assert {item.modality for request in requests for item in request.items} == {"image"}
    texts = [s.tokens for r in requests for s in r.segments if not s.embeddings and "/q" in s.key]
    assert texts and all(5 <= tokens <= 9 for tokens in texts)
    assert {r.turn for r in requests if r.conversation >= 0} == {0, 1}
