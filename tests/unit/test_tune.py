"""`mmcache tune` from a JSON-lines export: hit ratios and false hits, worked by hand.

The log: one endpoint placed x(3), y(4), x, z(5), x, y (sizes in embeddings), one
placement each. By hand, hits (the item still in the endpoint's LRU when placed again):

- items mode, 1 entry: none. 2 entries: the 3rd and 5th (x). 4 entries: 3rd, 5th, 6th.
- size mode, 7 embeddings: the 3rd only (z's 5 evicts y then x).
- A true encoder cache of 7 (references dropped at once) holds x at the 3rd placement
  only: so 2 entries has 1 false hit (the 5th), 4 entries 2 (5th, 6th), 1 entry misses 1.
- A true processor cache of 4 GiB holds all three (a few hundred KB): every repeat is a
  true hit there; the index sized to it (4 GiB / 9,408 bytes per image embedding =
  456,522 embeddings, added to the sweep) holds them too, and so does 4 entries.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import orjson
import pytest

from stream.core.cache import Capacity
from stream.core.events import EndpointDeleted, ItemsPlaced, Position
from stream.core.items import Item
from stream.sim.commands import add_commands
from stream.sim.eventlog import Recorded, read_jsonl, write_jsonl
from stream.sim.tune import MIN_REPEATS, NoRecommendation, Truth, recommend, replay_layer, survey, sweep

SIZES = {"x": 3, "y": 4, "z": 5}
ORDER = ["x", "y", "x", "z", "x", "y"]
PROCESSOR_OWN = 4 * 2**30 // 9408  # the index the size of a 4 GiB processor cache, in embeddings


def _records() -> list[Recorded]:
    return [Recorded(Position(0, offset), 1_000 + offset, ItemsPlaced(
        endpoint="ns/a", items=[Item(h, SIZES[h], "image")], request_id=f"r{offset}"))
        for offset, h in enumerate(ORDER)]


def _export(path: Path, records: list[Recorded]) -> Path:
    with path.open("wb") as out:
        write_jsonl(records, out)
    return path


def _run(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="mmcache")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.run(args)


def test_tune_from_a_file_gives_the_hand_worked_hit_ratios_and_false_hits(tmp_path, capsys):
    trace = _export(tmp_path / "events.jsonl", _records())
    _run(["tune", "--input", str(trace), "--items", "1,2,4", "--embeddings", "7",
          "--encoder-cache-size", "7", "--plot", str(tmp_path / "t.svg"), "--format", "json",
          "--min-repeats", "1", "--layer", "encoder"])
    doc = json.loads(capsys.readouterr().out)
    rows = {(r["mode"], r["capacity"]): r for r in doc["rows"]}
    assert all(r["layer"] == "encoder" for r in doc["rows"])
    assert {k: r["hits"] for k, r in rows.items()} == {
        ("items", 1): 0, ("items", 2): 2, ("items", 4): 3, ("size", 7): 1, ("size", PROCESSOR_OWN): 3}
    assert all(r["placed"] == 6 for r in rows.values())
    assert rows[("items", 2)]["hit_ratio"] == pytest.approx(2 / 6)
    assert {k: r["false_hits"] for k, r in rows.items()} == {
        ("items", 1): 0, ("items", 2): 1, ("items", 4): 2, ("size", 7): 0, ("size", PROCESSOR_OWN): 2}
    assert {k: r["missed_hits"] for k, r in rows.items()} == {
        ("items", 1): 1, ("items", 2): 0, ("items", 4): 0, ("size", 7): 0, ("size", PROCESSOR_OWN): 0}
    assert rows[("items", 4)]["false_hit_rate"] == pytest.approx(2 / 3)
    # size mode at the true size agrees on every placement: no wrong answer
    assert doc["recommended"]["mode"] == "size" and doc["recommended"]["capacity"] == 7
    assert doc["target"]["layer"] == "encoder" and doc["layers"]["encoder"]["true_hits"] == 1
    # the processor cache held every repeat: no false hit at 4 or more entries, 4 GiB's own wins the tie
    processor = {(r["mode"], r["capacity"]): r for r in doc["layers"]["processor"]["rows"]}
    assert doc["layers"]["processor"]["true_hits"] == 3
    assert {k: (r["false_hits"], r["missed_hits"]) for k, r in processor.items()} == {
        ("items", 1): (0, 3), ("items", 2): (0, 1), ("items", 4): (0, 0), ("size", 7): (0, 2),
        ("size", PROCESSOR_OWN): (0, 0)}
    assert doc["layers"]["processor"]["recommended"]["flag"] == (
        f"--cache-size-embeddings-per-server {PROCESSOR_OWN}")
    svg = (tmp_path / "t.svg").read_text()
    assert svg.startswith("<svg") and "polyline" in svg and "recommended" in svg


def test_the_table_marks_the_recommendation_and_names_the_flag(tmp_path, capsys):
    trace = _export(tmp_path / "events.jsonl", _records())
    _run(["tune", "--input", str(trace), "--items", "1,2,4", "--embeddings", "7",
          "--encoder-cache-size", "7", "--plot", "", "--min-repeats", "1", "--layer", "encoder"])
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if "<- recommended" in line)
    assert line.split()[:2] == ["size", "7"]
    assert "recommended for the encoder layer: --cache-size-embeddings-per-server 7" in out
    # the other layer's best is marked as its own, not as the recommendation
    best = next(line for line in out.splitlines() if "<- best for this layer" in line)
    assert best.split()[:2] == ["size", f"{PROCESSOR_OWN:,}"]
    assert f"processor: --cache-size-embeddings-per-server {PROCESSOR_OWN} (size mode" in out


def test_without_the_true_size_the_smallest_capacity_near_the_best_is_recommended():
    events = [(r.position, r.event) for r in _records()]
    rows = sweep(events, [Capacity("items", n) for n in (1, 2, 4, 8)])
    assert [r.hits for r in rows] == [0, 2, 3, 3]
    assert all(r.false_hits is None and r.false_hit_rate is None for r in rows)
    choice = recommend(rows)
    assert choice.row.capacity == Capacity("items", 4)
    assert "upper bound" in choice.reason


def test_export_lines_round_trip_and_bare_events_and_bad_lines_are_read_as_the_worker_would(tmp_path):
    records = _records()
    path = _export(tmp_path / "events.jsonl", records)
    assert read_jsonl(path) == records
    mixed = tmp_path / "mixed.jsonl"
    bare = orjson.dumps(ItemsPlaced(endpoint="ns/b", items=[Item("q", 1, "image")]).model_dump(
        exclude_none=True))
    mixed.write_bytes(bare + b"\n" + b"not json\n" + b'{"v": 1, "type": "items_placed"}\n'
                      + orjson.dumps(EndpointDeleted(endpoint="ns/b").model_dump()) + b"\n")
    skipped: dict[str, int] = {}
    found = read_jsonl(mixed, skipped)
    assert [type(r.event) for r in found] == [ItemsPlaced, EndpointDeleted]
    assert [r.position for r in found] == [Position(0, 0), Position(0, 3)]
    assert skipped == {"not_json": 1, "bad_schema": 1}


def test_a_deleted_endpoint_starts_empty_in_the_index_and_in_the_true_cache():
    events = [(r.position, r.event) for r in _records()[:2]]
    events.append((Position(0, 2), EndpointDeleted(endpoint="ns/a")))
    events.append((Position(0, 3), ItemsPlaced(endpoint="ns/a", items=[Item("x", 3, "image")])))
    replays = [replay_layer(events, Truth("encoder", 100)), replay_layer(events, Truth("processor", 2**30))]
    rows = sweep(events, [Capacity("items", 8)], replays)
    assert [row.layer for row in rows] == ["encoder", "processor"]
    assert all(row.hits == 0 and row.false_hits == 0 and row.missed_hits == 0 for row in rows)
    assert [r.hits for r in replays] == [0, 0]


def test_tune_refuses_without_a_source_or_with_no_placements(tmp_path, monkeypatch):
    monkeypatch.delenv("MMCACHE_BOOTSTRAP_SERVERS", raising=False)
    with pytest.raises(SystemExit, match="--bootstrap-servers"):
        _run(["tune", "--plot", ""])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match="no placements"):
        _run(["tune", "--input", str(empty), "--plot", ""])
    with pytest.raises(SystemExit, match="--items"):
        _run(["tune", "--input", str(empty), "--items", "a,b", "--plot", ""])


def test_simulate_replays_an_exported_trace(tmp_path, capsys):
    trace = _export(tmp_path / "events.jsonl", _records())
    _run(["simulate", "--trace", str(trace), "--servers", "2", "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    # 6 requests of one item each; with one server's worth of items, every policy sees hits
    assert set(doc["policies"]) >= {"random", "index", "oracle"}
    assert all(0.0 <= p["hit_ratio"] <= 1.0 for p in doc["policies"].values())


def test_a_trace_written_by_simulate_is_read_by_tune_with_every_placed_item(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    _run(["simulate", "--requests", "300", "--servers", "4", "--policies", "index",
          "--write-trace", str(trace), "--format", "json"])
    capsys.readouterr()
    records = read_jsonl(trace)
    assert len(records) == 300
    by_partition: dict[int, list[int]] = {}
    for record in records:
        by_partition.setdefault(record.position.partition, []).append(record.position.offset)
    assert all(offsets == list(range(len(offsets))) for offsets in by_partition.values())
    _run(["tune", "--input", str(trace), "--items", "4", "--embeddings", "8192", "--plot", "",
          "--format", "json", "--min-repeats", "0", "--processor-cache-gb", "0"])
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["mode"], r["capacity"]) for r in rows] == [("items", 4), ("size", 8192)]
    assert all(r["placed"] == sum(len(rec.event.items) for rec in records) for r in rows)


# -- enough data, and the mode the docs say (issue 15, 8b) --------------------------------


def _one_event_log(tmp_path: Path) -> Path:
    return _export(tmp_path / "one.jsonl", [Recorded(Position(0, 0), 1_000, ItemsPlaced(
        endpoint="ns/a", items=[Item("h", 1, "image")], request_id="r0"))])


def test_a_one_event_log_gets_the_table_and_no_recommendation(tmp_path, capsys):
    plot = tmp_path / "t.svg"
    with pytest.raises(SystemExit, match=r"no recommendation: 0 repeat placements .* 1 placed items of 1 "
                       r"events; a recommendation needs at least 400 \(--min-repeats\)"):
        _run(["tune", "--input", str(_one_event_log(tmp_path)), "--plot", str(plot)])
    out = capsys.readouterr().out
    assert "hit ratio" in out and "log: 1 events, 1 placed items, 0 repeats" in out
    assert "recommended" not in out and "--cache-size" not in out
    assert not plot.exists()


def test_below_the_minimum_the_json_recommends_nothing_and_says_why(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _run(["tune", "--input", str(_one_event_log(tmp_path)), "--plot", "", "--format", "json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommended"] is None and "at least 400" in doc["refused"]
    assert doc["log"] == {"events": 1, "placed": 1, "repeats": 0, "unsized": 1}


def test_the_minimum_is_a_named_constant_and_the_flag_moves_it(tmp_path, capsys):
    assert MIN_REPEATS == 400
    events = [(r.position, r.event) for r in _records()]
    facts = survey(events)
    assert (facts.placed, facts.repeats, facts.unsized) == (6, 3, 0)  # x, x and y placed again
    rows = sweep(events, [Capacity("items", n) for n in (1, 2, 4)])
    with pytest.raises(NoRecommendation, match="3 repeat placements"):
        recommend(rows, facts=facts)
    assert recommend(rows, facts=facts, min_repeats=3).row.capacity == Capacity("items", 4)
    trace = _export(tmp_path / "events.jsonl", _records())
    with pytest.raises(SystemExit, match="at least 4 "):
        _run(["tune", "--input", str(trace), "--plot", "", "--min-repeats", "4"])
    capsys.readouterr()


def _unsized_log(tmp_path: Path, rounds: int = 300) -> Path:
    """Two endpoints, each placed a, b, c in turn (chat_completions items: size 1)."""
    records, offset = [], 0
    for n in range(rounds):
        for endpoint in ("ns/a", "ns/b"):
            records.append(Recorded(Position(0, offset), 1_000 + offset, ItemsPlaced(
                endpoint=endpoint, items=[Item("abc"[n % 3], 1, "image")], request_id=f"r{offset}")))
            offset += 1
    return _export(tmp_path / "chat.jsonl", records)


def test_items_without_sizes_are_recommended_items_mode_not_size_mode(tmp_path, capsys):
    _run(["tune", "--input", str(_unsized_log(tmp_path)), "--plot", ""])
    out = capsys.readouterr().out
    # size mode at 512 "embeddings" holds 512 of these items and scores as well: not chosen
    assert "recommended: --cache-size-mb-per-server 8 (items mode, 4 per endpoint)" in out
    assert "carry no size" in out and "--mean-item-embeddings" in out
    line = next(line for line in out.splitlines() if "<- recommended" in line)
    assert line.split()[:2] == ["items", "4"]


def test_items_without_sizes_need_the_mean_to_be_held_to_a_true_cache(tmp_path, capsys):
    log = _unsized_log(tmp_path)
    with pytest.raises(SystemExit, match="carry no size .* give --mean-item-embeddings"):
        _run(["tune", "--input", str(log), "--plot", "", "--encoder-cache-size", "8192"])
    # 8,192 embeddings of 2,048 per item: items mode of 4 (docs/simulation.md, capacity.py)
    _run(["tune", "--input", str(log), "--plot", "", "--encoder-cache-size", "8192",
          "--mean-item-embeddings", "2048", "--items", "1,2,8", "--format", "json", "--layer", "encoder"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommended"]["mode"] == "items" and doc["recommended"]["capacity"] == 4
    rows = {(r["mode"], r["capacity"]): r for r in doc["rows"]}
    assert ("items", 4) in rows  # replayed though --items did not name it
    assert rows[("items", 4)]["false_hits"] == rows[("items", 4)]["missed_hits"] == 0
    assert rows[("items", 2)]["missed_hits"] > 0  # the true cache holds the three, 2 does not
    with pytest.raises(SystemExit, match="for items without sizes"):
        _run(["tune", "--input", str(_export(tmp_path / "sized.jsonl", _records())), "--plot", "",
              "--encoder-cache-size", "7", "--mean-item-embeddings", "3"])
