"""`mmcache tune` and `mmcache export` against a real broker topic written by a plain
AIOKafkaProducer, as a gateway in another language would publish placements."""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid

from aiokafka import AIOKafkaProducer

from stream.core.codec import encode_event
from stream.core.events import ItemsPlaced
from stream.core.items import Item
from stream.core.routing import key_partition
from stream.kafka.topics import ensure_topic
from stream.sim.commands import add_commands
from stream.sim.eventlog import read_jsonl

PARTITIONS = 2
SIZES = {"x": 3, "y": 4, "z": 5}
ORDER = ["x", "y", "x", "z", "x", "y"]  # the hand-worked log of tests/unit/test_tune.py


def _run(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="mmcache")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    args.run(args)


async def _publish(bootstrap: str, topic: str) -> None:
    await ensure_topic(bootstrap, topic, PARTITIONS, {})
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for endpoint in ("ns/a", "ns/b"):
            key = endpoint.encode()
            for n, h in enumerate(ORDER):
                event = ItemsPlaced(endpoint=endpoint, items=[Item(h, SIZES[h], "image")],
                                    request_id=f"{endpoint}-{n}")
                await producer.send_and_wait(topic, encode_event(event), key=key,
                                             partition=key_partition(key, PARTITIONS))
        # a record the worker would skip: not its key's partition
        stray = ItemsPlaced(endpoint="ns/a", items=[Item("x", 3, "image")])
        await producer.send_and_wait(topic, encode_event(stray), key=b"ns/a",
                                     partition=1 - key_partition(b"ns/a", PARTITIONS))
    finally:
        await producer.stop()


def test_tune_reads_the_topic_and_export_writes_what_tune_reads_from_a_file(bootstrap, tmp_path, capsys):
    topic = f"tune-{uuid.uuid4().hex[:8]}-events"
    asyncio.run(_publish(bootstrap, topic))
    # the hand-worked log twice has 6 repeats, under the default floor (MIN_REPEATS); the
    # encoder cache of 7 holds 2 of them, the 4 GiB processor cache all 6
    common = ["--items", "1,2,4", "--embeddings", "7", "--encoder-cache-size", "7", "--format", "json",
              "--min-repeats", "2"]
    _run(["tune", "--bootstrap-servers", bootstrap, "--topic", topic, "--plot",
          str(tmp_path / "t.svg"), *common])
    from_topic = json.loads(capsys.readouterr().out)
    named = {("items", 1), ("items", 2), ("items", 4), ("size", 7)}  # the sweep adds each layer's own
    layers = {name: {(r["mode"], r["capacity"]): r for r in from_topic["layers"][name]["rows"]
                     if (r["mode"], r["capacity"]) in named} for name in ("processor", "encoder")}
    # two endpoints, each the hand-worked log: twice its counts; the stray record skipped
    for rows in layers.values():
        assert {k: r["hits"] for k, r in rows.items()} == {
            ("items", 1): 0, ("items", 2): 4, ("items", 4): 6, ("size", 7): 2}
        assert all(r["placed"] == 12 for r in rows.values())
    assert {k: r["false_hits"] for k, r in layers["encoder"].items()} == {
        ("items", 1): 0, ("items", 2): 2, ("items", 4): 4, ("size", 7): 0}
    assert {k: r["missed_hits"] for k, r in layers["processor"].items()} == {
        ("items", 1): 6, ("items", 2): 2, ("items", 4): 0, ("size", 7): 4}
    assert from_topic["layers"]["encoder"]["recommended"]["flag"] == "--cache-size-embeddings-per-server 7"
    assert (from_topic["layers"]["processor"]["true_hits"], from_topic["layers"]["encoder"]["true_hits"]) == (6, 2)
    assert from_topic["skipped"] == {"wrong_partition": 1}
    assert (tmp_path / "t.svg").read_text().startswith("<svg")

    exported = tmp_path / "events.jsonl"
    _run(["export", "--bootstrap-servers", bootstrap, "--topic", topic, "--output", str(exported)])
    capsys.readouterr()
    assert len(read_jsonl(exported)) == 12
    _run(["tune", "--input", str(exported), "--plot", "", *common])
    from_file = json.loads(capsys.readouterr().out)
    assert from_file["rows"] == from_topic["rows"]
    assert from_file["layers"] == from_topic["layers"]
    assert from_file["recommended"] == from_topic["recommended"]


def test_tune_names_a_missing_topic(bootstrap):
    import pytest

    with pytest.raises(SystemExit, match="not found"):
        _run(["tune", "--bootstrap-servers", bootstrap, "--topic", f"absent-{uuid.uuid4().hex[:8]}",
              "--plot", ""])


def test_tune_on_a_one_event_topic_recommends_nothing(bootstrap, tmp_path, capsys):
    import pytest

    topic = f"tune-{uuid.uuid4().hex[:8]}-events"

    async def publish_one() -> None:
        await ensure_topic(bootstrap, topic, PARTITIONS, {})
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
        await producer.start()
        try:
            event = ItemsPlaced(endpoint="ns/a", items=[Item("h", 1, "image")], request_id="only")
            await producer.send_and_wait(topic, encode_event(event), key=b"ns/a",
                                         partition=key_partition(b"ns/a", PARTITIONS))
        finally:
            await producer.stop()

    asyncio.run(publish_one())
    with pytest.raises(SystemExit, match="no recommendation: 0 repeat placements .* at least 400"):
        _run(["tune", "--bootstrap-servers", bootstrap, "--topic", topic, "--plot", str(tmp_path / "t.svg")])
    out = capsys.readouterr().out
    assert "log: 1 events, 1 placed items" in out and "recommended" not in out
    assert not (tmp_path / "t.svg").exists()
