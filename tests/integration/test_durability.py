"""Durable state on the real broker: restarts, crash, offline rebuild, seeding."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from tests.integration.conftest import Service, eventually, http


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "stream.cli", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _entries(service: Service) -> int:
    state = service.get("/v1/state?limit=100000")[1]
    return sum(row["items"] for row in state["endpoints"])


def _digest_when_holding(service: Service, expected: dict[str, int]) -> str | None:
    """The digest once the view holds exactly ``expected`` items an endpoint (a total can
    also be reached half-way, e.g. a delete not yet applied while placements are), else None."""
    state = service.get("/v1/state?limit=100000")[1]
    held = {row["endpoint"]: row["items"] for row in state["endpoints"] if row["items"]}
    return state["digest"] if held == expected and state["digest_settled"] else None


def _cut_after_acknowledged() -> str:
    """An ``--until`` time at or after every write acknowledged so far, returned once the
    clock is past it, so that writes sent from now on fall after it: records carry the
    producer's timestamp, and the cut counts whole milliseconds."""
    cut_ms = time.time_ns() // 1_000_000
    while time.time_ns() // 1_000_000 <= cut_ms:
        pass  # at most a millisecond
    # the middle of the millisecond: float rounding cannot move it to the one before
    return datetime.fromtimestamp(cut_ms / 1000 + 0.0005, UTC).isoformat()


def _place(service: Service, endpoint: str, hashes: list[str]) -> int:
    items = [{"hash": h, "size": 1, "modality": "image"} for h in hashes]
    return service.post("/v1/placements", {"endpoints": [endpoint], "items": items})[0]


def _rebuild(service: Service, target: Path, *extra: str) -> str:
    return _cli("rebuild", "--bootstrap-servers", service.bootstrap, "--data-dir", str(target),
                "--app-id", service.app_id, *extra)


def test_restart_keeps_100k_entries_from_local_files_and_from_the_changelog(make_service):
    service = make_service()
    for e in range(200):
        assert _place(service, f"ns/pod-{e}", [f"h{e}-{i}" for i in range(500)]) == 202
    eventually(lambda: _entries(service) == 100_000, timeout=120, interval=0.5)
    before = service.digest()

    assert service.stop(signal.SIGTERM) == 0
    assert _cli("state", "digest", "--data-dir", str(service.data_dir)) == before
    service.start(wait_ready=False)
    print(f"ready after restart with local state: {service.wait_ready():.2f} s")
    assert service.digest() == before

    assert service.stop(signal.SIGTERM) == 0
    shutil.rmtree(service.data_dir)
    service.start(wait_ready=False)
    print(f"ready after restart from the changelog: {service.wait_ready():.2f} s")
    assert service.digest() == before


def test_kill_9_under_load_loses_no_acknowledged_placement(make_service, tmp_path):
    service = make_service()
    acknowledged: list[tuple[str, str]] = []
    stop = threading.Event()

    def load() -> None:
        n = 0
        while not stop.is_set() and n < 5000:
            endpoint, digest = f"ns/crash-{n % 10}", f"k{n}"
            try:
                if _place(service, endpoint, [digest]) == 202:
                    acknowledged.append((endpoint, digest))
            except OSError:
                pass
            n += 1
            time.sleep(0.004)  # paces the load generator

    loader = threading.Thread(target=load)
    loader.start()
    eventually(lambda: len(acknowledged) > 100, timeout=30)  # killed in the middle of the load
    service.stop(signal.SIGKILL)
    stop.set()
    loader.join()

    service.start()
    by_endpoint: dict[str, list[str]] = {}
    for endpoint, digest in acknowledged:
        by_endpoint.setdefault(endpoint, []).append(digest)

    def all_visible() -> bool:
        for endpoint, hashes in by_endpoint.items():
            body = {"generate": {"features": {"mm_hashes": {"image": hashes}}}}
            answer = http("POST", service.url + "/v1/match",
                          {"endpoints": [endpoint], "body": body})[1]
            if answer["endpoints"][0]["score"] != 1.0:
                return False
        return True

    eventually(all_visible, timeout=30)
    assert _rebuild(service, tmp_path / "rebuilt") == service.digest()


def test_rebuild_equals_live_and_until_rebuilds_the_past(make_service, tmp_path):
    service = make_service()
    pods = [f"ns/mix-{i}" for i in range(9)]
    for round_ in range(3):
        for i, pod in enumerate(pods):
            _place(service, pod, [f"m{(i + round_) % 5}", f"m{round_}-{i}"])
    service.post("/v1/endpoint-events", {"type": "deleted", "endpoint": pods[0]})
    # 3 rounds x 2 distinct items on pods 1-8, none on the deleted pod 0
    past_digest = eventually(lambda: _digest_when_holding(service, dict.fromkeys(pods[1:], 6)))
    past = _cut_after_acknowledged()
    service.post("/v1/endpoint-events", {"type": "sync", "live": pods[:5]})
    _place(service, pods[1], ["late"])
    # pods 1-4 live, one late item on pod 1
    live = eventually(lambda: _digest_when_holding(service, dict.fromkeys(pods[1:5], 6)
                                                   | {pods[1]: 7}))

    assert _rebuild(service, tmp_path / "now") == live
    assert _rebuild(service, tmp_path / "past", "--until", past) == past_digest
    assert past_digest != live


def test_rebuilt_dir_seeds_a_new_deployment_that_resumes_from_its_offsets(make_service, tmp_path):
    old = make_service()
    for i in range(20):
        _place(old, f"ns/seed-{i % 6}", [f"s{i}"])
    eventually(lambda: _entries(old) == 20)
    cut = _cut_after_acknowledged()
    for i in range(20, 30):
        _place(old, f"ns/seed-{i % 6}", [f"s{i}"])
    eventually(lambda: _entries(old) == 30)
    final = old.digest()

    seeded_dir = tmp_path / "seeded"
    topic = f"{old.app_id}-events"
    new_app = f"{old.app_id}-new"
    _cli("rebuild", "--bootstrap-servers", old.bootstrap, "--data-dir", str(seeded_dir),
         "--app-id", new_app, "--topic", topic, "--until", cut)
    old.stop(signal.SIGKILL)  # done with (its digest is kept): not left polling the broker
    new = make_service(app_id=new_app, data_dir=seeded_dir, extra=["--topic", topic])
    eventually(lambda: new.digest() == final)

    new.stop(signal.SIGTERM)
    shutil.rmtree(seeded_dir)
    new.start()
    assert new.digest() == final
