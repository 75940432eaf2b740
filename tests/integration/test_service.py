"""The service through HTTP on a real broker, a real Faust worker and RocksDB files."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import uuid

from aiokafka import AIOKafkaProducer

from tests.integration.conftest import Service, eventually


def _endpoint(tag: str) -> str:
    return f"it/{tag}-{uuid.uuid4().hex[:8]}"


def _item(h: str, size: int = 1, modality: str = "image") -> dict:
    return {"hash": h, "size": size, "modality": modality}


def _chat(*urls: str) -> dict:
    blocks = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"chat_completions": {"messages": [{"role": "user", "content": blocks}]}}


def _match(service: Service, endpoints: list[str], body: dict) -> dict:
    status, answer = service.post("/v1/match", {"endpoints": endpoints, "body": body})
    assert status == 200, answer
    return answer


def _scores(service: Service, endpoints: list[str], body: dict) -> dict[str, float]:
    return {e["endpoint"]: e["score"] for e in _match(service, endpoints, body)["endpoints"]}


def test_place_then_match_through_extracted_body(service: Service) -> None:
    pod_a, pod_b = _endpoint("a"), _endpoint("b")
    status, answer = service.post(
        "/v1/placements", {"request_id": "r-1", "endpoints": [pod_a], "body": _chat("https://x/a.png")}
    )
    assert (status, answer) == (202, {"events": 1})
    expected_hash = hashlib.sha256(b"image_url\x00https://x/a.png").hexdigest()

    body = _chat("https://x/a.png", "https://x/b.png")
    eventually(lambda: _scores(service, [pod_a, pod_b], body)[pod_a] == 0.5)
    answer = _match(service, [pod_a, pod_b], body)
    assert [i["hash"] for i in answer["request_items"]][0] == expected_hash
    first, second = answer["endpoints"]
    assert first["endpoint"] == pod_a
    assert first["matched_items"] == [_item(expected_hash)]
    assert (first["matched_weight"], first["total_weight"]) == (1, 2)
    assert second == {"endpoint": pod_b, "matched_items": [], "matched_weight": 0,
                      "total_weight": 2, "score": 0.0, "source": "estimate"}


def test_placement_to_several_endpoints_is_one_event_each(service: Service) -> None:
    pods = [_endpoint(f"p{i}") for i in range(3)]
    status, answer = service.post(
        "/v1/placements",
        {"request_id": "r", "endpoints": [*pods, pods[0]], "items": [_item("hx", 3), _item("hy", 1)]},
    )
    assert (status, answer) == (202, {"events": 3})
    body = {"generate": {"features": {"mm_hashes": {"image": ["hx", "hz"]}}}}
    eventually(lambda: all(s == 0.5 for s in _scores(service, pods, body).values()))


def test_capacity_evicts_least_recent_per_endpoint(service: Service) -> None:
    pod = _endpoint("cap")  # the shared service runs with 6 MiB -> 3 entries
    for h in ["c1", "c2", "c3", "c1", "c4"]:
        assert service.post("/v1/placements", {"endpoints": [pod], "items": [_item(h)]})[0] == 202
    tokenized = {"tokenized": {"prompts": [{"mm_features": [
        {"hash": h, "modality": "image"} for h in ["c1", "c2", "c3", "c4"]]}]}}

    def held() -> list[str]:
        matched = _match(service, [pod], tokenized)["endpoints"][0]["matched_items"]
        return [i["hash"] for i in matched]

    eventually(lambda: held() == ["c1", "c3", "c4"])


def test_deleted_endpoint_matches_nothing(service: Service) -> None:
    pod, other = _endpoint("del"), _endpoint("keep")
    service.post("/v1/placements", {"endpoints": [pod, other], "items": [_item("hd")]})
    body = {"generate": {"features": {"mm_hashes": {"image": ["hd"]}}}}
    eventually(lambda: _scores(service, [pod, other], body) == {pod: 1.0, other: 1.0})
    status, answer = service.post("/v1/endpoint-events", {"type": "deleted", "endpoint": pod})
    assert (status, answer) == (202, {"events": 1})
    eventually(lambda: _scores(service, [pod, other], body) == {pod: 0.0, other: 1.0})


def test_sync_drops_endpoints_not_live_in_every_partition(make_service) -> None:
    service = make_service()
    pods = [f"ns/pod-{i}" for i in range(12)]  # spread over the 8 partitions
    for pod in pods:
        service.post("/v1/placements", {"endpoints": [pod], "items": [_item("hs")]})
    eventually(lambda: service.get("/v1/state")[1]["total_endpoints"] == 12)
    status, answer = service.post("/v1/endpoint-events", {"type": "sync", "live": pods[:3]})
    assert status == 202 and answer["events"] == 8  # one copy per partition
    eventually(lambda: sorted(e["endpoint"] for e in service.get("/v1/state")[1]["endpoints"])
               == sorted(pods[:3]))
    assert service.post("/v1/endpoint-events", {"type": "sync", "live": []}) == (202, {"events": 0})


def test_state_lists_counts_without_hashes(service: Service) -> None:
    pod = _endpoint("state")
    service.post("/v1/placements", {"endpoints": [pod], "items": [_item("s1", 5), _item("s2", 2)]})

    def row() -> dict | None:
        rows = service.get("/v1/state?limit=1000")[1]["endpoints"]
        return next((r for r in rows if r["endpoint"] == pod), None)

    assert eventually(row) == {"endpoint": pod, "items": 2, "weight": 7}
    status, state = service.get("/v1/state")
    assert state["capacity"] == {"mode": "items", "per_endpoint": 3}
    assert "s1" not in str(state)
    assert len(state["digest"]) == 64


def test_bad_requests_are_refused_and_change_nothing(service: Service) -> None:
    before = service.digest()
    cases = [
        ("/v1/match", b"{not json", 400, "invalid_json"),
        ("/v1/match", b'{"endpoints": "x", "body": {}}', 400, "endpoints"),
        ("/v1/match", b'{"endpoints": ["a"], "body": {"chat_completions": {"messages": [{"content": [{"type": "image_url", "image_url": {}}]}]}}}', 400, "body.chat_completions.messages[0].content[0].image_url.url"),
        ("/v1/placements", b'{"endpoints": [], "items": [{"hash": "h", "size": 1, "modality": "image"}]}', 400, "endpoints"),
        ("/v1/placements", b'{"endpoints": ["a"], "items": [{"hash": "h", "size": 0, "modality": "image"}]}', 400, "items[0].size"),
        ("/v1/placements", b'{"endpoints": ["a"]}', 400, "items"),
        ("/v1/placements", b'{"endpoints": ["a"], "items": [{"hash": "' + b"h" * 257 + b'", "size": 1, "modality": "image"}]}', 400, "max_hash_chars"),
        ("/v1/placements", b'{"endpoints": ["' + b"e" * 254 + b'"], "items": []}', 400, "endpoints[0]"),
        ("/v1/endpoint-events", b'{"type": "renamed", "endpoint": "a"}', 400, "type"),
        ("/v1/endpoint-events", b'{"type": "deleted"}', 400, "endpoint"),
    ]
    for path, raw, status, named in cases:
        got, answer = service.post(path, raw=raw)
        assert got == status, (path, raw, answer)
        assert named in answer["error"]["message"] or named == answer["error"]["code"], answer
        assert set(answer["error"]) == {"code", "message"}
    assert service.get("/v1/state?limit=x")[0] == 400
    assert service.digest() == before


def test_oversized_body_gets_413(service: Service) -> None:
    before = service.digest()
    huge = b'{"endpoints": ["a"], "items": [], "pad": "' + b"x" * 70_000 + b'"}'
    status, answer = service.post("/v1/placements", raw=huge)
    assert status == 413
    assert answer["error"]["code"] == "body_too_large"
    assert "max_body_bytes" in answer["error"]["message"]
    assert service.digest() == before


def test_malformed_records_are_counted_and_skipped(service: Service) -> None:
    async def produce() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=service.bootstrap)
        await producer.start()
        try:
            for value in [b"not json", b'{"v": 1, "type": "items_placed"}',
                          b'{"v": 2, "type": "endpoint_deleted", "endpoint": "a"}']:
                await producer.send_and_wait(f"{service.app_id}-events", value, key=b"junk")
        finally:
            await producer.stop()

    asyncio.run(produce())

    def malformed() -> float:
        for line in service.get("/metrics")[1].splitlines():
            if line.startswith("mmcache_malformed_events_total "):
                return float(line.split()[1])
        return 0.0

    eventually(lambda: malformed() == 3.0)
    pod = _endpoint("after-junk")
    service.post("/v1/placements", {"endpoints": [pod], "items": [_item("hj")]})
    body = {"generate": {"features": {"mm_hashes": {"image": ["hj"]}}}}
    eventually(lambda: _scores(service, [pod], body) == {pod: 1.0})


def test_metrics_name_the_contract_series(service: Service) -> None:
    pod = _endpoint("metrics")
    service.post("/v1/placements", {"endpoints": [pod], "items": [_item("hm", 1, "video")]})
    body = {"generate": {"features": {"mm_hashes": {"video": ["hm"]}}}}
    eventually(lambda: _scores(service, [pod], body) == {pod: 1.0})
    text = service.get("/metrics")[1]
    assert 'encoder_cache_queries_total{modality="video"}' in text
    assert f'encoder_cache_hits_total{{modality="video",pod="{pod}"}} 1.0' in text
    assert "encoder_cache_hit_ratio_bucket" in text
    assert 'mmcache_events_processed_total{type="items_placed"}' in text
    assert "mmcache_consumer_lag_events{" in text
    assert 'mmcache_http_request_duration_seconds_count{route="/v1/match"}' in text


def test_restart_keeps_state(make_service, tmp_path) -> None:
    service = make_service()
    for i in range(30):
        service.post("/v1/placements", {"endpoints": [f"ns/r-{i % 5}"], "items": [_item(f"r{i}")]})
    eventually(lambda: service.get("/v1/state")[1]["total_endpoints"] == 5
               and sum(e["items"] for e in service.get("/v1/state")[1]["endpoints"]) == 30)
    before = service.digest()
    assert service.stop(signal.SIGTERM) == 0
    service.start()
    assert service.digest() == before
    body = {"generate": {"features": {"mm_hashes": {"image": ["r0"]}}}}
    assert _scores(service, ["ns/r-0", "ns/r-1"], body) == {"ns/r-0": 1.0, "ns/r-1": 0.0}


def test_two_workers_of_one_app_both_answer_for_every_endpoint(make_service, tmp_path) -> None:
    first = make_service(data_dir=tmp_path / "first")
    second = make_service(app_id=first.app_id, data_dir=tmp_path / "second")
    pods = [f"ns/shared-{i}" for i in range(12)]  # spread over the 8 partitions
    for i, pod in enumerate(pods):
        assert first.post("/v1/placements", {"endpoints": [pod], "items": [_item(f"s{i}")]})[0] == 202

    def same_full_view() -> bool:
        states = [svc.get("/v1/state?limit=100")[1] for svc in (first, second)]
        return all(s["total_endpoints"] == 12 for s in states) and states[0]["digest"] == states[1]["digest"]

    eventually(same_full_view, timeout=60)
    body = {"generate": {"features": {"mm_hashes": {"image": [f"s{i}" for i in range(12)]}}}}
    for svc in (first, second):
        scores = _scores(svc, pods, body)
        assert scores == {pod: 1 / 12 for pod in pods}
