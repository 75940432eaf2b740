"""Engine truth end to end, on a live `serve` and a real broker: a model server's reports
(POST /v1/engine-events) make its engine view, which /v1/match answers it from (source
engine) while an endpoint that never reported answers from its estimate LRU; the estimate's
checks are counted; the view survives a restart, is the same on a second worker of the app
(recovered from the changelog and followed), and `rebuild` replays it to the live digest
(a deployment seeded from its dir starts with the same views and goes on with the log)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import Service, eventually


def _item(digest: str, size: int = 1) -> dict:
    return {"hash": digest, "size": size, "modality": "image"}


def _body(*hashes: str) -> dict:
    return {"tokenized": {"prompts": [{"mm_features": [
        {"hash": h, "modality": "image", "length": 1} for h in hashes]}]}}


def _answers(service: Service, endpoints: list[str], *hashes: str) -> dict[str, tuple[str, list[str]]]:
    status, answer = service.post("/v1/match", {"endpoints": endpoints, "body": _body(*hashes)})
    assert status == 200, answer
    return {e["endpoint"]: (e["source"], [i["hash"] for i in e["matched_items"]]) for e in answer["endpoints"]}


def _checks(service: Service) -> dict[str, float]:
    text = service.get("/metrics")[1]
    return {outcome: float(value) for outcome, value in
            re.findall(r'^mmcache_estimate_checks_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def _views(service: Service) -> dict[str, int]:
    state = service.get("/v1/state")[1]
    return {row["endpoint"]: row["items"] for row in state.get("engine_views", [])}


A, B = "ns/engine-a", "ns/estimate-b"


def _report(service: Service, endpoint: str, *events: dict) -> None:
    status, answer = service.post("/v1/engine-events", {"endpoint": endpoint, "engine": "vllm",
                                                        "events": list(events)})
    assert (status, answer) == (202, {"events": 1})


def test_reports_answer_from_the_engine_view_survive_a_restart_and_rebuild_to_the_live_digest(
        make_service, tmp_path: Path) -> None:
    service = make_service()
    for endpoint, hashes in ((A, ["h1", "h2"]), (B, ["h1"])):
        status, _ = service.post("/v1/placements", {"endpoints": [endpoint], "items": [_item(h) for h in hashes]})
        assert status == 202
    _report(service, A, {"type": "stored", "items": [_item("h2", 576), _item("h3", 144), _item("h9")]},
            {"type": "removed", "hashes": ["h9"]})
    eventually(lambda: _views(service) == {A: 2}
               and service.get("/v1/state")[1]["total_endpoints"] == 2, timeout=30)

    # A answers from its view, exactly its hits (with the sizes asked); B from its LRU
    assert _answers(service, [A, B], "h1", "h2", "h3", "h4") == {
        A: ("engine", ["h2", "h3"]), B: ("estimate", ["h1"])}
    # A's estimate {h1, h2} against its view {h2, h3}, over the four items asked
    assert _checks(service) == {"true_hit": 1, "false_hit": 1, "missed_hit": 1, "true_miss": 1}

    before = service.digest()
    assert service.stop(signal.SIGTERM) == 0
    service.start()
    assert service.digest() == before
    assert _views(service) == {A: 2}
    assert _answers(service, [A, B], "h1", "h2", "h3") == {A: ("engine", ["h2", "h3"]), B: ("estimate", ["h1"])}

    # placements never change the view; cleared empties it and it still answers
    service.post("/v1/placements", {"endpoints": [A], "items": [_item("h5")]})
    _report(service, A, {"type": "cleared"}, {"type": "stored", "items": [_item("h4")]})
    eventually(lambda: _answers(service, [A], "h4", "h5") == {A: ("engine", ["h4"])}, timeout=30)
    _report(service, A, {"type": "cleared"})
    eventually(lambda: _views(service) == {A: 0}, timeout=30)
    assert _answers(service, [A], "h1", "h2", "h5") == {A: ("engine", [])}

    _report(service, B, {"type": "stored", "items": [_item("h7")]})
    eventually(lambda: _views(service) == {A: 0, B: 1}, timeout=30)
    live = service.digest()
    topic, seeded = f"{service.app_id}-events", f"{service.app_id}-seeded"
    done = subprocess.run(
        [sys.executable, "-m", "stream.cli", "rebuild", "--bootstrap-servers", service.bootstrap,
         "--data-dir", str(tmp_path / "rebuilt"), "--app-id", seeded, "--topic", topic],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == live
    # a deployment seeded from the rebuilt dir starts with the same views, and goes on
    copy = make_service(app_id=seeded, data_dir=tmp_path / "rebuilt", extra=["--topic", topic])
    assert copy.digest() == live and _views(copy) == {A: 0, B: 1}

    # deleting the endpoint drops both: A answers from its (now empty) estimate again
    assert service.post("/v1/endpoint-events", {"type": "deleted", "endpoint": A})[0] == 202
    for svc in (service, copy):
        eventually(lambda svc=svc: _views(svc) == {B: 1}, timeout=30)
        assert _answers(svc, [A, B], "h1", "h5", "h7") == {A: ("estimate", []), B: ("engine", ["h7"])}
    assert service.digest() == copy.digest()


def test_a_second_worker_holds_the_same_engine_views(make_service, tmp_path: Path) -> None:
    first = make_service(data_dir=tmp_path / "first")
    pods = [f"ns/reporting-{i}" for i in range(8)]  # spread over the 8 partitions
    for i, pod in enumerate(pods):
        _report(first, pod, {"type": "stored", "items": [_item(f"e{i}"), _item("shared")]})
    eventually(lambda: len(_views(first)) == 8, timeout=30)
    second = make_service(app_id=first.app_id, data_dir=tmp_path / "second")
    for pod in pods[:4]:  # changes after the second worker joined, followed
        _report(first, pod, {"type": "removed", "hashes": ["shared"]})

    def same() -> bool:
        views = [_views(svc) for svc in (first, second)]
        return views[0] == views[1] == {**{p: 1 for p in pods[:4]}, **{p: 2 for p in pods[4:]}} \
            and first.digest() == second.digest()

    eventually(same, timeout=90)
    for svc in (first, second):
        assert _answers(svc, pods, "shared") == {
            pod: ("engine", ["shared"] if i >= 4 else []) for i, pod in enumerate(pods)}
