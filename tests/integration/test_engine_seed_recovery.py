"""A deployment seeded from `rebuild`'s dir keeps its engine views wherever its changelog
is read back, on a live `serve` and a real broker: a second worker of the seeded app
(which re-reads the partitions it follows) and the seeded worker restarted without its
files (Faust's restore) hold the live views and digest."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.integration.conftest import Service, eventually


def _views(service: Service) -> dict[str, int]:
    state = service.get("/v1/state")[1]
    return {row["endpoint"]: row["items"] for row in state.get("engine_views", [])}


def test_a_seeded_changelog_gives_back_every_engine_view(make_service, tmp_path: Path) -> None:
    service = make_service()
    pods = [f"ns/seeded-{i}" for i in range(8)]  # spread over the 8 partitions
    for i, pod in enumerate(pods):
        status, _ = service.post("/v1/placements", {"endpoints": [pod], "items": [
            {"hash": f"p{i}", "size": 1, "modality": "image"}]})
        assert status == 202
        status, _ = service.post("/v1/engine-events", {"endpoint": pod, "engine": "vllm", "events": [
            {"type": "stored", "items": [{"hash": h, "size": 2, "modality": "image"}
                                         for h in (f"e{i}", "shared", "9f" * 32)]}]})
        assert status == 202
    expected = {pod: 3 for pod in pods}
    eventually(lambda: _views(service) == expected, timeout=30)
    live = service.digest()

    topic, seeded = f"{service.app_id}-events", f"{service.app_id}-seeded"
    done = subprocess.run(
        [sys.executable, "-m", "stream.cli", "rebuild", "--bootstrap-servers", service.bootstrap,
         "--data-dir", str(tmp_path / "rebuilt"), "--app-id", seeded, "--topic", topic],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # the source is done with (its live digest is kept): stopped now, not idling in the
    # background (each running worker polls the broker) while the seeded ones start
    service.stop(signal.SIGKILL)
    first = make_service(app_id=seeded, data_dir=tmp_path / "rebuilt", extra=["--topic", topic])
    assert first.digest() == live and _views(first) == expected

    # a second worker follows the partitions it does not own: re-read from the changelog
    second = make_service(app_id=seeded, data_dir=tmp_path / "second", extra=["--topic", topic])
    eventually(lambda: _views(second) == expected and second.digest() == live, timeout=90)
    second.stop(signal.SIGTERM)

    # the seeded worker without its files: every partition restored from the changelog
    assert first.stop(signal.SIGTERM) == 0
    shutil.rmtree(first.data_dir)
    first.start()
    eventually(lambda: _views(first) == expected and first.digest() == live, timeout=90)
