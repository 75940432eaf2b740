"""The reference gateway's pure parts: naming media parts by their item hash (what vLLM,
its engine reports and mmcache must agree on) and reading a server's load from vLLM's
metrics text; and the fleet bench's trace: its bodies carry exactly the simulator's
items, its images exactly their embeddings."""

from __future__ import annotations

import base64
import struct

import pytest

from stream.bench.fleet_real import predicted
from stream.bench.fleet_trace import FleetTrace, chat_body, png_data_url, simulate_argv
from stream.core.items import extract_items, media_hash
from stream.gateway.gateway import Gateway, name_items, scraped_load
from stream.sim.workload import generate

CAT = "https://example.com/cat.png"


def test_a_part_without_uuid_is_named_by_its_item_hash() -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": CAT}},
        {"type": "image_url", "image_url": {"url": CAT}, "uuid": "mine"},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}
    named = name_items(body)
    parts = named["messages"][0]["content"]
    assert "uuid" not in parts[0]
    assert parts[1]["uuid"] == media_hash("image_url", CAT)
    assert parts[2]["uuid"] == "mine"
    assert parts[3]["uuid"] == media_hash("input_audio", "wav:AAAA")
    assert "uuid" not in body["messages"][0]["content"][1]  # the caller's body is not changed


def test_naming_leaves_every_item_hash_as_it_was() -> None:
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": CAT}, {"type": "video_url", "video_url": {"url": "v.mp4"}},
        {"type": "audio_url", "audio_url": {"url": "a.wav"}, "uuid": "given"}]},
        {"role": "assistant", "content": "plain text"}]}
    assert extract_items(name_items(body)) == extract_items(body)


def test_load_is_running_plus_waiting() -> None:
    metrics = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        'vllm:num_requests_running{engine="0",model_name="tiny"} 3.0',
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0',
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 7.0',
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 100.0'])
    assert scraped_load(metrics) == 5


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy 'random'"):
        Gateway({"a": "http://127.0.0.1:1"}, "http://127.0.0.1:2", "random")


def _png_size(url: str) -> tuple[int, int]:
    data = base64.b64decode(url.split(",", 1)[1])
    width, height = struct.unpack(">II", data[16:24])
    return width, height


@pytest.mark.parametrize("embeddings", [1, 16, 31, 36, 61, 64])
def test_an_image_has_exactly_its_embeddings(embeddings: int) -> None:
    width, height = _png_size(png_data_url("item-1", embeddings))
    assert width % 28 == 0 and height % 28 == 0
    assert (width // 28) * (height // 28) == embeddings
    assert width * height <= 224 * 224  # within the tiny model's processor cap: no resize


def test_every_body_carries_the_simulated_requests_items_one_to_one() -> None:
    requests = generate(FleetTrace(requests=60).workload())
    names: dict[str, str] = {}
    for request in requests:
        items = extract_items(chat_body(request, "tiny"))
        assert len(items) == len(request.items)
        for real, simulated in zip(items, request.items, strict=True):
            assert names.setdefault(simulated.hash, real.hash) == real.hash
    assert len(set(names.values())) == len(names)  # distinct items stay distinct
    uuids = [h for h in names.values() if h.startswith("trace-")]
    assert 0 < len(uuids) < len(names)  # some parts carry a uuid of their own, some do not


def test_answers_are_assistant_turns_of_the_conversation() -> None:
    requests = generate(FleetTrace(requests=60).workload())
    later = next(r for r in requests if r.turn >= 1)
    roles = [m["role"] for m in chat_body(later, "tiny")["messages"]]
    assert roles[0] == "system"
    assert roles.count("assistant") == later.turn
    assert roles[-1] == "user"


def test_the_simulate_command_of_the_fleet_bench_draws_the_real_runs_requests() -> None:
    trace = FleetTrace(requests=50)
    results, requests = predicted(simulate_argv(trace, 8192, 128, ["round-robin", "index-bounded"]))
    assert requests == generate(trace.workload())
    assert set(results) == {"round-robin", "index-bounded"}
