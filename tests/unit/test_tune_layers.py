"""`mmcache tune` per cache layer: the processor cache (bytes) and the encoder cache
(embeddings) replayed as truths from one recorded log, a recommendation per layer, the
evidence floor per layer, the layer targeted by default, and the prefix layer said to be
out of the log's reach.

The layered log: one endpoint, images of 1,024 embeddings (9,633,792 bytes at 9,408 per
embedding), four hot items interleaved with a cycle of 50 cold ones, 500 of each:

    h0 c0 h1 c1 h2 c2 h3 c3 h0 c4 ...

A hot item comes back after 7 other items, a cold one after 99. An encoder cache of 8,192
embeddings holds 8 such images: every hot repeat (496) and no cold one. A 4 GiB processor
cache holds 445: every repeat (496 + 450). So the index that predicts the encoder is
8,192 embeddings and the one that predicts the processor cache is 4 GiB's worth,
456,522 embeddings: the two recommendations differ as the layers' capacities do.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.core.cache import Capacity
from stream.core.events import ItemsPlaced
from stream.core.items import Item
from stream.sim.commands import add_commands
from stream.sim.eventlog import Recorded, write_jsonl
from stream.sim.tune import (
    GIB,
    ItemModel,
    Truth,
    advise,
    capacity_for_layer,
    replay_layer,
    survey,
    sweep,
    target_layer,
)
from tests.unit.eventlogs import EventLogs, Scenario, placement_log

EMBEDDINGS = 1024
PROCESSOR_OWN = 4 * GIB // 9408  # 456,522 embeddings: a 4 GiB processor cache's worth of images
HOT, COLD = [f"h{n}" for n in range(4)], [f"c{n}" for n in range(50)]


def _image(digest: str, embeddings: int = EMBEDDINGS, modality: str = "image") -> Item:
    return Item(digest, embeddings, modality)


def _layered() -> list[tuple[str, list[Item]]]:
    placements = []
    for n in range(500):
        placements.append(("ns/a", [_image(HOT[n % len(HOT)])]))
        placements.append(("ns/a", [_image(COLD[n % len(COLD)])]))
    return placements


def _cold_only() -> list[tuple[str, list[Item]]]:
    """60 images in turn, 10 rounds: 540 repeats, each after 59 others."""
    return [("ns/a", [_image(f"c{n % 60}")]) for n in range(600)]


def _export(path: Path, placements: list[tuple[str, list[Item]]]) -> Path:
    with path.open("wb") as out:
        write_jsonl([Recorded(position, 1_000 + n, event)
                     for n, (position, event) in enumerate(placement_log(placements))], out)
    return path


def _run(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="mmcache")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.run(args)


def _tune_json(capsys, path: Path, *flags: str) -> dict:
    _run(["tune", "--input", str(path), "--plot", "", "--format", "json", *flags])
    return json.loads(capsys.readouterr().out)


def test_each_layer_gets_its_rows_and_the_recommendations_differ_as_the_capacities_do(tmp_path, capsys):
    doc = _tune_json(capsys, _export(tmp_path / "log.jsonl", _layered()))
    layers = doc["layers"]
    assert layers["processor"]["true_hits"] == 946 and layers["encoder"]["true_hits"] == 496
    assert layers["encoder"]["assumed"] is True and layers["encoder"]["capacity"] == 8192
    assert layers["processor"]["capacity"] == 4 * GIB and layers["processor"]["unit"] == "bytes"
    for name in ("processor", "encoder"):
        rows = layers[name]["rows"]
        assert rows and all(r["layer"] == name and r["placed"] == 1000 for r in rows)
    # every capacity is scored against both layers: same hits, other false and missed hits
    by_layer = {name: {(r["mode"], r["capacity"]): r for r in layers[name]["rows"]}
                for name in ("processor", "encoder")}
    assert by_layer["processor"].keys() == by_layer["encoder"].keys()
    at_own = by_layer["encoder"][("size", PROCESSOR_OWN)]
    assert (at_own["hits"], at_own["false_hits"], at_own["missed_hits"]) == (946, 450, 0)
    assert by_layer["processor"][("size", 8192)]["missed_hits"] == 450
    # each layer's own capacity predicts it exactly, and that is what is recommended for it
    assert layers["encoder"]["recommended"]["flag"] == "--cache-size-embeddings-per-server 8192"
    assert layers["processor"]["recommended"]["flag"] == f"--cache-size-embeddings-per-server {PROCESSOR_OWN}"
    assert by_layer["encoder"][("size", 8192)]["false_hits"] == by_layer["encoder"][("size", 8192)]["missed_hits"] == 0
    assert layers["prefix"] == {"replayed": False, "reason": layers["prefix"]["reason"]}
    assert "not predicted from this log" in layers["prefix"]["reason"]


def test_the_default_target_is_the_layer_whose_true_hits_save_the_most_time(tmp_path, capsys):
    path = _export(tmp_path / "log.jsonl", _layered())
    doc = _tune_json(capsys, path)
    # at the fleet's costs: 946 x 40 ms of preprocessing against 496 x 1,024 embeddings x 20 ms per 1,000
    assert doc["layers"]["processor"]["saved_ms"] == pytest.approx(946 * 40.0)
    assert doc["layers"]["encoder"]["saved_ms"] == pytest.approx(496 * 1.024 * 20.0)
    assert doc["target"]["layer"] == "processor" and "save the most time" in doc["target"]["reason"]
    assert doc["recommended"] == doc["layers"]["processor"]["recommended"]
    assert doc["rows"] == doc["layers"]["processor"]["rows"]
    chosen = _tune_json(capsys, path, "--layer", "encoder")
    assert chosen["target"] == {"layer": "encoder", "reason": "chosen with --layer"}
    assert chosen["recommended"]["capacity"] == 8192


def test_the_table_has_a_section_per_layer_and_says_what_to_set_for_each(tmp_path, capsys):
    _run(["tune", "--input", str(_export(tmp_path / "log.jsonl", _layered())), "--plot", ""])
    out = capsys.readouterr().out
    assert "processor layer: a processor cache of 4 GiB" in out
    assert "encoder layer: an encoder cache of 8,192 embeddings" in out and "assumed" in out
    assert f"processor: --cache-size-embeddings-per-server {PROCESSOR_OWN} (size mode" in out
    assert "encoder: --cache-size-embeddings-per-server 8192 (size mode" in out
    assert "prefix layer: not predicted from this log" in out
    assert "target: the processor layer, by default" in out
    assert f"recommended for the processor layer: --cache-size-embeddings-per-server {PROCESSOR_OWN}" in out
    marked = [line.split()[:2] for line in out.splitlines() if line.endswith("<- recommended")]
    assert marked == [["size", f"{PROCESSOR_OWN:,}"]]
    best = [line.split()[:2] for line in out.splitlines() if line.endswith("<- best for this layer")]
    assert best == [["size", "8,192"]]


def test_a_layer_that_held_too_few_repeats_is_warned_about_and_the_others_still_recommended(tmp_path, capsys):
    path = _export(tmp_path / "cold.jsonl", _cold_only())
    _run(["tune", "--input", str(path), "--plot", ""])
    out = capsys.readouterr().out
    # the encoder's 8 images never see a cold item again: 0 of the 540 repeats
    assert ("encoder: no recommendation for the encoder layer: its true caches (an encoder cache of "
            "8,192 embeddings (encoder_cache_size)) held 0 of the 540 repeat placements") in out
    assert "at least 400 of its hits (--min-repeats)" in out
    assert "recommended for the processor layer" in out
    doc = _tune_json(capsys, path)
    assert doc["layers"]["encoder"]["recommended"] is None and "held 0" in doc["layers"]["encoder"]["refused"]
    assert doc["layers"]["processor"]["refused"] is None and "refused" not in doc
    # sized for the encoder, there is nothing to recommend: the table, the reason, exit 1
    with pytest.raises(SystemExit, match="no recommendation for the encoder layer"):
        _run(["tune", "--input", str(path), "--plot", str(tmp_path / "t.svg"), "--layer", "encoder"])
    assert "<- recommended" not in capsys.readouterr().out
    assert not (tmp_path / "t.svg").exists()
    # the floor moves per layer too
    assert _tune_json(capsys, path, "--min-repeats", "0", "--layer", "encoder")["recommended"] is not None


def test_the_prefix_layer_is_refused_with_what_would_be_needed(tmp_path, capsys):
    path = _export(tmp_path / "log.jsonl", _layered())
    with pytest.raises(SystemExit, match="the prefix layer is not predicted from this log"):
        _run(["tune", "--input", str(path), "--plot", "", "--layer", "prefix"])
    out = capsys.readouterr().out
    assert "prompt as token blocks" in out and "KV cache size in blocks" in out
    assert "recommended for" not in out
    assert "processor: --cache-size-embeddings-per-server" in out  # the other layers are still given


def test_the_processor_cache_weighs_items_in_bytes_by_modality():
    model = ItemModel(bytes_per_embedding={"image": 9408, "audio": 1024})
    image, audio, other = _image("i", 100), _image("a", 100, "audio"), _image("o", 100, "3d")
    assert (model.nbytes(image), model.nbytes(audio), model.nbytes(other)) == (940_800, 102_400, 940_800)
    three_images = Truth("processor", 3 * 940_800, model)

    def held(digests: list[str], modality: str = "image") -> int:
        log = placement_log([("ns/a", [_image(d, 100, modality)]) for d in digests * 5])
        return replay_layer(log, three_images).hits

    assert held(["a", "b", "c"]) == 12  # three fit: every repeat
    assert held(["a", "b", "c", "d"]) == 0  # four cycle through three: none
    assert held(["a", "b", "c", "d"], "audio") == 16  # a tenth of the bytes: all four fit


def test_bytes_per_embedding_moves_the_processor_capacity_and_bad_values_are_refused(tmp_path, capsys):
    path = _export(tmp_path / "log.jsonl", _layered())
    doc = _tune_json(capsys, path, "--bytes-per-embedding", "image=1176")
    # LLaVA-1.5's bytes: 4 GiB holds 8 times as many embeddings
    assert doc["layers"]["processor"]["recommended"]["capacity"] == 4 * GIB // 1176
    assert doc["layers"]["processor"]["bytes_per_embedding"] == {"image": 1176}
    small = _tune_json(capsys, path, "--processor-cache-gb", "0.5")
    assert small["layers"]["processor"]["capacity"] == GIB // 2
    off = _tune_json(capsys, path, "--processor-cache-gb", "0")
    assert off["layers"]["processor"]["replayed"] is False and off["target"]["layer"] == "encoder"
    for bad in ("image", "image=0", "=5", "image=x"):
        with pytest.raises(SystemExit, match="--bytes-per-embedding takes modality=bytes"):
            _run(["tune", "--input", str(path), "--plot", "", "--bytes-per-embedding", bad])


def test_a_layers_own_capacity_is_the_encoder_cache_size_rule_for_the_encoder():
    sized = placement_log([("ns/a", [_image("a", 700)]), ("ns/a", [_image("b", 1300)])])
    assert capacity_for_layer(Truth("encoder", 8192), sized, True) == Capacity("size", 8192)
    unsized = placement_log([("ns/a", [Item("a", 1, "image")]), ("ns/a", [Item("b", 1, "image")])])
    truth = Truth("encoder", 8192, ItemModel(mean_embeddings=2048))
    assert capacity_for_layer(truth, unsized, False) == Capacity("items", 4)  # 8,192 / 2,048
    processor = Truth("processor", 4 * GIB, ItemModel(mean_embeddings=2048))
    assert capacity_for_layer(processor, unsized, False) == Capacity("items", 4 * GIB // (2048 * 9408))


class _Costs:
    def __init__(self, preprocess: float, encoder: float) -> None:
        self.preprocess_ms_per_item = preprocess
        self.encoder_ms_per_1k_embeddings = encoder


def test_which_layer_is_targeted_follows_the_costs():
    log = placement_log(_layered())
    replays = [replay_layer(log, Truth("processor", 4 * GIB)), replay_layer(log, Truth("encoder", 8192))]
    assert target_layer(replays, _Costs(40.0, 20.0)).layer == "processor"
    # a slow encoder outweighs the processor's extra hits: 496 x 1.024 x 100 > 946 x 40
    slow = target_layer(replays, _Costs(40.0, 100.0))
    assert slow.layer == "encoder" and "encoder 50.8 s" in slow.reason and "processor 37.8 s" in slow.reason
    assert target_layer([], _Costs(1.0, 1.0)) is None
    report = advise(log, [Capacity("size", 8192)], [Truth("encoder", 8192)], _Costs(1.0, 1.0),
                    facts=survey(log))
    assert report.target == "encoder" and report.layer("processor").refused == "not replayed"
    assert report.layer("prefix").replay is None


def test_a_chosen_layer_that_cannot_be_replayed_says_why_instead_of_recommending_another(tmp_path, capsys):
    unsized = _export(tmp_path / "chat.jsonl", [("ns/a", [Item(f"u{n % 3}", 1, "image")]) for n in range(900)])
    with pytest.raises(SystemExit, match="the encoder layer is not replayed: 900 of 900 placed items carry "
                       "no size .* give --mean-item-embeddings"):
        _run(["tune", "--input", str(unsized), "--plot", "", "--layer", "encoder"])
    out = capsys.readouterr().out
    assert "recommended" not in out and "hit ratio" in out  # the hit ratios are still given
    with pytest.raises(SystemExit, match="the prefix layer is not predicted"):
        _run(["tune", "--input", str(unsized), "--plot", "", "--layer", "prefix"])
    capsys.readouterr()
    sized = _export(tmp_path / "log.jsonl", _layered())
    with pytest.raises(SystemExit, match="the processor layer is not replayed: --processor-cache-gb 0"):
        _run(["tune", "--input", str(sized), "--plot", "", "--layer", "processor", "--processor-cache-gb", "0"])
    capsys.readouterr()
    given = _tune_json(capsys, sized, "--encoder-cache-size", "8192")
    assert given["layers"]["encoder"]["assumed"] is False


def test_a_request_never_evicts_its_own_processor_hits():
    # room for two images; B is the least recent when [A, B] comes: vLLM checks both, touches
    # B, then stores A, evicting C, not B (stored one by one, A would have evicted B)
    log = placement_log([("ns/a", [_image(d, 100)]) for d in ("B", "C")]
                        + [("ns/a", [_image("A", 100), _image("B", 100)]), ("ns/a", [_image("B", 100)]),
                           ("ns/a", [_image("C", 100)])])
    replay = replay_layer(log, Truth("processor", 2 * 940_800))
    assert replay.held == bytes([0, 0, 0, 1, 1, 0])


LOGS = EventLogs(["ns/a", "ns/b", "ns/c"], [f"h{n}" for n in range(6)])


@given(LOGS.scenarios(max_ops=60), st.integers(1, 12))
@settings(max_examples=150, deadline=None)
def test_the_index_the_size_of_a_layer_predicts_it_exactly(scenario: Scenario, embeddings: int):
    """Any log of one-item placements (deletes and syncs among them), each hash of one
    size and one weight per embedding: size mode at the processor cache's bytes over that
    weight, and at the encoder cache's size, agrees with that layer's truth on every
    placement. So each layer's own capacity is what predicts it, and where tune finds
    wrong answers there, they come from the layer's own rules (a request's items, several
    bytes per embedding), not from the replay."""
    log = []
    for position, event in scenario.log:
        if isinstance(event, ItemsPlaced):
            digest = event.items[0].hash
            event = ItemsPlaced(endpoint=event.endpoint, items=[Item(digest, 1 + int(digest[1:]) % 4, "video")])
        log.append((position, event))
    truths = [Truth("processor", embeddings * 9408, ItemModel(bytes_per_embedding={"image": 9408})),
              Truth("encoder", embeddings)]
    replays = [replay_layer(log, truth) for truth in truths]
    rows = sweep(log, [Capacity("size", embeddings)], replays)
    assert [(row.layer, row.false_hits, row.missed_hits) for row in rows] == [
        ("processor", 0, 0), ("encoder", 0, 0)]
    assert [row.hits for row in rows] == [replay.hits for replay in replays]
