"""`mmcache state digest` says what it digests: the partitions its data dirs hold files of.
One of two workers' data dirs gives the digest of that worker's own partitions, which is
not the digest its /v1/state reported (its whole view); both dirs give exactly that."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.integration.conftest import Service, eventually

pytestmark = pytest.mark.integration


def _digest(*dirs: Path) -> tuple[str, str]:
    args = [a for d in dirs for a in ("--data-dir", str(d))]
    done = subprocess.run([sys.executable, "-m", "stream.cli", "state", "digest", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip(), done.stderr


def _settled(service: Service, endpoints: int) -> str | None:
    state = service.get("/v1/state?limit=0")[1]
    return state["digest"] if state["total_endpoints"] == endpoints and state["digest_settled"] else None


def test_a_workers_data_dir_digests_its_own_partitions_and_every_workers_dirs_the_whole_view(
        make_service, tmp_path):
    app_id = f"it-{uuid.uuid4().hex[:10]}"
    workers = [make_service(app_id=app_id, data_dir=tmp_path / f"data-{i}") for i in range(2)]
    # both in the group, each owning some of the 8 partitions
    eventually(lambda: all(re.search(r"^mmcache_consumer_lag_events\{", w.get("/metrics")[1], re.M)
                           for w in workers), timeout=120, interval=0.5)
    endpoints = [f"ns/pod-{i}" for i in range(16)]
    for endpoint in endpoints:
        status, _ = workers[0].post("/v1/placements", {"endpoints": [endpoint], "items": [
            {"hash": f"h-{endpoint}", "size": 1, "modality": "image"}]})
        assert status == 202
    live = eventually(lambda: (lambda a, b: a if a and a == b else None)(
        *(_settled(w, len(endpoints)) for w in workers)), timeout=60, interval=0.2)
    for worker in workers:  # both at once (a takeover would only add files at least as far along)
        assert worker.process is not None
        worker.process.send_signal(signal.SIGTERM)
    for worker in workers:
        assert worker.process is not None and worker.process.wait(60) == 0
        worker.process = None

    own, said = _digest(workers[0].data_dir)
    files = sorted(int(p.name.split("-")[1].split(".")[0])
                   for p in workers[0].data_dir.rglob("lru-*.db"))
    assert files and own != live  # the first worker's own partitions only, not the whole view
    assert re.findall(r"(\d+) \(", said) == [str(p) for p in files]
    whole, said = _digest(*(w.data_dir for w in workers))
    assert whole == live
    assert sorted(int(p) for p in re.findall(r"(\d+) \(", said)) == list(range(8))
