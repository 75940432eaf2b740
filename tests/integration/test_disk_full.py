"""A data dir that fills up (a small tmpfs this test mounts): the worker stays up and
answers /v1/match from memory, /readyz says why, nothing is acknowledged past what the
state's files hold, and it resumes by itself when space returns, nothing lost; a start
without room to open the files stops with one line."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from stream.state.datadir import DataDir
from stream.state.store import APPLIED_KEY, decode_applied
from tests.integration.conftest import Service, eventually

pytestmark = pytest.mark.integration

Resize = Callable[[str], None]


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size: str) -> Iterator[Resize]:
    """A tmpfs of ``size`` mounted at ``mount`` (unmounted in the end), and a way to resize it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")

    def resize(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(mount)], check=True)

    try:
        yield resize
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[tuple[Path, Resize]]:
    """A 2 MiB tmpfs as the data dir (a few dozen placements fill it), and a way to resize it."""
    with mounted_tmpfs(tmp_path / "data", "2m") as resize:
        yield tmp_path / "data", resize


def _hashes(placement: int) -> list[str]:
    return [hashlib.sha256(f"{placement}-{i}".encode()).hexdigest() for i in range(1024)]


def _place(service: Service, placement: int) -> int:
    items = [{"hash": h, "size": 1, "modality": "image"} for h in _hashes(placement)]
    return service.post("/v1/placements", {"endpoints": [f"ns/pod-{placement}"],
                                           "items": items})[0]


def _matched(service: Service, placement: int) -> int:
    features = [{"hash": h, "modality": "image"} for h in _hashes(placement)]
    status, body = service.post("/v1/match", {
        "endpoints": [f"ns/pod-{placement}"],
        "body": {"tokenized": {"prompts": [{"mm_features": features}]}}})
    assert status == 200, body
    return len(body["endpoints"][0]["matched_items"])


def _metric(service: Service, name: str) -> float:
    for line in service.get("/metrics")[1].splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _committed(service: Service) -> dict[int, int]:
    """The worker's committed offsets of the event topic, from the group coordinator (a
    consumer of its group that asks, without joining)."""
    async def fetch() -> dict[int, int]:
        consumer = AIOKafkaConsumer(bootstrap_servers=service.bootstrap, group_id=service.app_id,
                                    enable_auto_commit=False)
        await consumer.start()
        try:
            topic = f"{service.app_id}-events"
            found = {}
            for partition in consumer.partitions_for_topic(topic) or ():
                offset = await consumer.committed(TopicPartition(topic, partition))
                if offset is not None:
                    found[partition] = offset
            return found
        finally:
            await consumer.stop()
    return asyncio.run(fetch())


def _stored(data_dir: Path) -> dict[int, int]:
    """The applied offset each partition file holds (read-only, beside the running worker)."""
    datadir, stored = DataDir(data_dir), {}
    for partition in datadir.partitions():
        db = datadir.open_partition(partition, read_only=True)
        try:
            raw = db.get(APPLIED_KEY)
        finally:
            db.close()
        stored[partition] = -1 if raw is None else decode_applied(raw)
    return stored


def _rebuild(service: Service, target: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "stream.cli", "rebuild", "--bootstrap-servers",
                           service.bootstrap, "--data-dir", str(target), "--app-id",
                           service.app_id], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _writes_failing(service: Service) -> bool:
    status, body = service.get("/readyz")
    return status == 200 and "No space left on device" in body["reason"]


def test_a_full_disk_keeps_the_worker_answering_and_it_resumes_when_space_returns(
        small_disk: tuple[Path, Resize], make_service: Callable[..., Service],
        tmp_path: Path) -> None:
    data_dir, resize = small_disk
    service = make_service(data_dir=data_dir)
    assert _place(service, 0) == 202
    acknowledged: list[int] = [0]
    # a first commit before the disk fills (on a busy machine it filled before any)
    eventually(lambda: _committed(service), timeout=60)
    deadline = time.monotonic() + 120
    while not _writes_failing(service):  # place until the files refuse writes
        assert time.monotonic() < deadline, f"the disk never filled: {service.get('/readyz')}"
        assert service.process is not None and service.process.poll() is None, service.tail()
        if _place(service, len(acknowledged)) == 202:
            acknowledged.append(len(acknowledged))
    for _ in range(20):  # taken by the log while the worker cannot store them
        assert _place(service, len(acknowledged)) == 202
        acknowledged.append(len(acknowledged))

    assert service.process is not None and service.process.poll() is None, service.tail()
    assert service.get("/healthz")[0] == 200
    assert _matched(service, 0) == 1024  # from memory
    assert _metric(service, "mmcache_state_write_errors_total") >= 1
    assert _metric(service, "mmcache_state_writes_failing") >= 1
    status, body = service.get("/readyz")
    assert status == 200 and body["status"] == "ready", body
    assert "No space left on device" in body["reason"] and "retrying" in body["reason"], body
    # nothing acknowledged past what the files hold
    stored, committed = _stored(data_dir), _committed(service)
    assert committed, "no committed offsets"
    for partition, offset in committed.items():
        assert offset <= stored.get(partition, -1) + 1, (partition, offset, stored)
    assert sum(committed.values()) < len(acknowledged)

    resize("64m")
    eventually(lambda: service.get("/readyz")[1]["reason"] == "the view answers /v1/match"
               and service.get("/readyz")[1]["lag_events"] == 0, timeout=60)
    assert _metric(service, "mmcache_state_writes_failing") == 0
    # lag 0 is against the log's end as the probe last read it, which may be from before
    # the last placements: the worker commits an offset only once the event is folded and
    # stored, so once every acknowledged one is committed, each is in the view
    assert eventually(lambda: sum(_committed(service).values()) == len(acknowledged), timeout=30)
    missing = [p for p in acknowledged if _matched(service, p) != 1024]
    assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged placements missing"
    live = service.digest()
    assert _rebuild(service, tmp_path / "rebuilt") == live

    assert service.stop() == 0
    service.start()  # from its own files, on the same small disk
    assert service.digest() == live
    assert all(_matched(service, p) == 1024 for p in acknowledged[::10])


def test_a_start_without_room_for_the_state_stops_with_one_line_then_starts_when_there_is(
        small_disk: tuple[Path, Resize], make_service: Callable[..., Service]) -> None:
    data_dir, resize = small_disk
    service = make_service(data_dir=data_dir)
    for placement in range(5):
        assert _place(service, placement) == 202
    eventually(lambda: all(_matched(service, p) == 1024 for p in range(5)))
    live = service.digest()
    assert service.stop(signal.SIGTERM) == 0

    stat = os.statvfs(data_dir)
    resize(str((stat.f_blocks - stat.f_bfree) * stat.f_frsize + 8192))  # room for RUNNING only
    log_start = service.log_path.stat().st_size
    service.start(wait_ready=False)
    assert service.process is not None
    code = service.process.wait(60)
    service.process = None
    said = service.log_path.read_bytes()[log_start:].decode(errors="replace")
    assert code != 0, said
    assert "Traceback" not in said and "crash" not in said, said
    assert f"--data-dir {data_dir}: cannot open the state" in said.strip().splitlines()[-1], said
    assert "No space left on device" in said, said

    resize("64m")
    service.start()
    assert service.digest() == live
    assert all(_matched(service, p) == 1024 for p in range(5))


def test_a_crash_on_a_full_disk_recovers_on_it_without_crashing_once_there_is_room(
        small_disk: tuple[Path, Resize], make_service: Callable[..., Service],
        tmp_path: Path) -> None:
    data_dir, resize = small_disk
    resize("64m")
    service = make_service(data_dir=data_dir)
    # 16 x 1,024 entries: about 1.5 MB of table files against 8 kB of the rest of the dir,
    # so that half of it cannot hold the restore (a ratio: the size does not matter)
    placed = 16
    for placement in range(placed):
        assert _place(service, placement) == 202
    eventually(lambda: all(_matched(service, p) == 1024 for p in range(placed)), timeout=60)
    live = service.digest()
    used = (lambda s: (s.f_blocks - s.f_bfree) * s.f_frsize)(os.statvfs(data_dir))
    assert service.stop(signal.SIGKILL) != 0
    # the next start drops the table files a crash left and restores them from the
    # changelog; they are dropped here already, so that the disk can shrink under them
    shutil.rmtree(data_dir / "v1" / "tables")
    resize(str(used // 2))  # the restore cannot fit
    service.start(wait_ready=False)

    def says_why() -> bool:
        assert service.process is not None and service.process.poll() is None, service.tail()
        try:
            status, body = service.get("/readyz")
        except OSError:
            return False
        return status == 503 and "No space left on device" in body["reason"]

    eventually(says_why, timeout=90, interval=0.2)
    resize("64m")
    service.wait_ready()
    eventually(lambda: service.digest() == live, timeout=30)
    assert all(_matched(service, p) == 1024 for p in range(placed))
    assert _rebuild(service, tmp_path / "rebuilt") == live
