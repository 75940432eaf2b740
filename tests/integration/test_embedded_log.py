"""The default (`serve` with no --bootstrap-servers) keeps its embedded broker's log in
the data dir: killed or stopped and started again on the same dir, it has every
acknowledged event and the same state, and `rebuild` replays that log."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition

import stream
from stream.kafka.embedded import free_port
from tests.integration.conftest import READY_TIMEOUT_S, eventually, http

pytestmark = pytest.mark.integration

REPO = str(Path(stream.__file__).resolve().parent.parent)
PLACEMENTS = 1000
ENDPOINTS = 50
_BROKER_LINE = re.compile(r"broker embedded on (127\.0\.0\.1:\d+)")


class EmbeddedServe:
    """One `mmcache serve` on its own embedded broker (no --bootstrap-servers), with extra
    flags and environment variables."""

    def __init__(self, data_dir: Path, log_path: Path, *flags: str,
                 env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.log_path = log_path
        self.flags = flags
        self.env = env or {}
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, **popen: Any) -> EmbeddedServe:
        env = {k: v for k, v in os.environ.items() if k != "MMCACHE_BOOTSTRAP_SERVERS"}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "stream.cli", "serve", "--host", "127.0.0.1",
                 "--port", str(self.port), "--data-dir", str(self.data_dir), *self.flags],
                stdout=log, stderr=subprocess.STDOUT, env={**env, **self.env, "PYTHONPATH": REPO},
                **popen)
        return self

    def probe(self, path: str) -> tuple[int, Any] | None:
        """``GET path``, or None while nothing answers on the port."""
        try:
            return http("GET", self.url + path)
        except OSError:
            return None

    def wait_ready(self) -> None:
        def ready() -> bool:
            assert self.process is not None and self.process.poll() is None, self.tail()
            try:
                return http("GET", self.url + "/readyz")[0] == 200
            except OSError:
                return False

        eventually(ready, timeout=READY_TIMEOUT_S, interval=0.1)

    def bootstrap(self) -> str:
        """The embedded broker's address, as serve logs it (its last start)."""
        found = _BROKER_LINE.findall(self.log_path.read_text(errors="replace"))
        assert found, self.tail()
        return found[-1]

    def settled_digest(self) -> str:
        def settled() -> str | None:
            state = http("GET", self.url + "/v1/state?limit=0")[1]
            return state["digest"] if state.get("digest_settled", True) else None

        return eventually(settled, timeout=30)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        try:
            return self.process.wait(30)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self.process = None

    def tail(self) -> str:
        return self.log()[-3000:]

    def log(self) -> str:
        """The whole log (start-up lines come before the long configuration lines)."""
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def serves(tmp_path: Path, request: pytest.FixtureRequest):
    """Factory of embedded serves (a data dir, flags, environment; ready unless ``wait`` is
    false); killed at the end, their logs shown on failure."""
    started: list[EmbeddedServe] = []

    def make(data: Path, *flags: str, wait: bool = True,
             env: dict[str, str] | None = None) -> EmbeddedServe:
        service = EmbeddedServe(data, tmp_path / f"serve-{len(started)}.log", *flags, env=env).start()
        started.append(service)
        if wait:
            service.wait_ready()
        return service

    yield make
    failed = getattr(request.node, "report_call", None)
    for service in started:
        if failed is not None and failed.failed:
            print(f"--- end of {service.log_path.name} ---\n{service.tail()}")
        if service.process is not None:
            service.stop(signal.SIGKILL)


@pytest.fixture
def serve(serves, tmp_path: Path):
    """Factory of embedded serves on one data dir."""
    return lambda: serves(tmp_path / "data")


def _endpoint(i: int) -> str:
    return f"ns/pod-{i % ENDPOINTS}"


def _place_all(service: EmbeddedServe) -> None:
    def place(i: int) -> int:
        body = {"request_id": f"r-{i}", "endpoints": [_endpoint(i)],
                "items": [{"hash": f"h-{i}", "size": 1, "modality": "image"}]}
        return http("POST", service.url + "/v1/placements", body)[0]

    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(place, range(PLACEMENTS)))
    assert statuses == [202] * PLACEMENTS


def _matched(service: EmbeddedServe) -> int:
    """How many of the placements /v1/match finds on their endpoints (one request an
    endpoint, naming its own items)."""
    found = 0
    for e in range(ENDPOINTS):
        hashes = [f"h-{i}" for i in range(e, PLACEMENTS, ENDPOINTS)]
        body = {"endpoints": [_endpoint(e)],
                "body": {"generate": {"features": {"mm_hashes": {"image": hashes}}}}}
        status, answer = http("POST", service.url + "/v1/match", body)
        assert status == 200, answer
        found += len(answer["endpoints"][0]["matched_items"])
    return found


def _rebuild(bootstrap: str, target: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "stream.cli", "rebuild", "--bootstrap-servers",
                           bootstrap, "--data-dir", str(target)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_kill_9_keeps_every_acknowledged_placement_and_rebuild_replays_them(serve, tmp_path):
    first = serve()
    _place_all(first)
    first.stop(signal.SIGKILL)

    again = serve()
    assert "log restored from" in again.log()
    assert eventually(lambda: _matched(again) == PLACEMENTS and PLACEMENTS, timeout=30)
    live = again.settled_digest()
    assert _rebuild(again.bootstrap(), tmp_path / "rebuilt") == live
    # and the log goes on from there: a write after the restore is kept as well
    status, _ = http("POST", again.url + "/v1/placements", {
        "request_id": "after", "endpoints": ["ns/after"],
        "items": [{"hash": "h-after", "size": 1, "modality": "image"}]})
    assert status == 202


def test_a_clean_stop_and_start_keeps_everything_and_the_local_files(serve, tmp_path):
    first = serve()
    _place_all(first)
    eventually(lambda: _matched(first) == PLACEMENTS, timeout=30)  # all applied
    digest = first.settled_digest()
    assert first.stop(signal.SIGTERM) == 0
    assert not (tmp_path / "data" / "RUNNING").exists()

    again = serve()
    log = again.log()
    assert "log restored from" in log and "did not stop cleanly" not in log
    assert _matched(again) == PLACEMENTS
    assert again.settled_digest() == digest
    assert again.stop(signal.SIGTERM) == 0

    third = serve()  # twice: the log kept after a restore is whole too
    assert _matched(third) == PLACEMENTS
    assert third.settled_digest() == digest
    assert _rebuild(third.bootstrap(), tmp_path / "rebuilt") == digest


def test_kill_9_in_the_middle_of_writes_loses_no_acknowledged_one(serve, tmp_path):
    """Killed while writes are in flight (some acknowledged, some not, records torn in the
    kept files): every write answered 202 is there after the restart, and live == rebuild."""
    first = serve()
    acknowledged: list[tuple[str, str]] = []
    stop = threading.Event()

    def load(worker: int) -> None:
        n = 0
        while not stop.is_set():
            endpoint, digest = f"ns/crash-{n % 10}", f"w{worker}-{n}"
            body = {"request_id": digest, "endpoints": [endpoint],
                    "items": [{"hash": digest, "size": 1, "modality": "image"}]}
            try:
                if http("POST", first.url + "/v1/placements", body)[0] == 202:
                    acknowledged.append((endpoint, digest))
            except OSError:
                return  # the service is gone
            n += 1

    loaders = [threading.Thread(target=load, args=(w,)) for w in range(4)]
    for loader in loaders:
        loader.start()
    try:
        eventually(lambda: len(acknowledged) > 400, timeout=60)
        first.stop(signal.SIGKILL)
    finally:
        stop.set()
        for loader in loaders:
            loader.join()

    again = serve()
    by_endpoint: dict[str, list[str]] = {}
    for endpoint, digest in acknowledged:
        by_endpoint.setdefault(endpoint, []).append(digest)

    def missing() -> int:
        lost = 0
        for endpoint, hashes in by_endpoint.items():
            body = {"generate": {"features": {"mm_hashes": {"image": hashes}}}}
            answer = http("POST", again.url + "/v1/match", {"endpoints": [endpoint], "body": body})[1]
            lost += len(hashes) - len(answer["endpoints"][0]["matched_items"])
        return lost

    eventually(lambda: missing() == 0, timeout=30)
    assert _rebuild(again.bootstrap(), tmp_path / "rebuilt") == again.settled_digest()


async def _produce_raw(bootstrap: str, topic: str, key: bytes, value: bytes) -> tuple[int, int]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        meta = await producer.send_and_wait(topic, value, key=key)
        return meta.partition, meta.offset
    finally:
        await producer.stop()


async def _whole_topic(bootstrap: str, topic: str) -> list:
    """Every record of the topic, read up to its end offsets (the broker's, not a wait)."""
    from stream.kafka.tansu import apply_remedies, is_tansu

    if await is_tansu(bootstrap):  # never against a real Kafka (MMCACHE_BOOTSTRAP_SERVERS)
        apply_remedies()  # Tansu's end offsets, from a fetch
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        found: list = []
        async with asyncio.timeout(15):
            while [tp for tp, end in ends.items() if await consumer.position(tp) < end]:
                for batch in (await consumer.getmany(timeout_ms=200)).values():
                    found.extend(batch)
        return found
    finally:
        await consumer.stop()


def test_dead_letters_are_kept_too_and_not_written_again_after_a_restart(serve, tmp_path):
    first = serve()
    source = asyncio.run(_produce_raw(first.bootstrap(), "mmcache-events", b"ns/pod-x", b"not json"))

    def letters(service: EmbeddedServe) -> list:
        return asyncio.run(_whole_topic(service.bootstrap(), "mmcache-dead-letters"))

    found = eventually(lambda: letters(first), timeout=30)
    assert first.stop(signal.SIGTERM) == 0

    again = serve()
    _place_all(again)  # the worker has read past the restored log (and skipped it)
    eventually(lambda: _matched(again) == PLACEMENTS, timeout=30)
    kept = letters(again)
    assert [(r.partition, r.offset, r.timestamp, r.value, r.headers) for r in kept] == [
        (r.partition, r.offset, r.timestamp, r.value, r.headers) for r in found]
    assert len(kept) == 1
    headers = dict(kept[0].headers)
    assert (int(headers["mmcache.source.partition"]), int(headers["mmcache.source.offset"])) == source


def test_a_full_disk_refuses_writes_it_cannot_keep_and_goes_on_when_there_is_room(tmp_path):
    """On the default the kept log is on the data dir's volume: when it fills up, writes get
    503 before they reach the broker (the journal never counts a part of a write as kept),
    /readyz says why, every write answered 202 is kept, and the journal goes on by itself
    once there is room; killed and started again, serve has every 202 and live == rebuild."""
    from tests.integration.test_disk_full import mounted_tmpfs

    started: list[EmbeddedServe] = []
    with mounted_tmpfs(tmp_path / "data", "6m") as resize, contextlib.ExitStack() as stack:
        stack.callback(lambda: [s.stop(signal.SIGKILL) for s in started if s.process is not None])
        service = EmbeddedServe(tmp_path / "data", tmp_path / "serve.log").start()
        started.append(service)
        service.wait_ready()
        accepted: list[int] = []
        filler = "x" * 200

        def place(i: int) -> int:
            body = {"request_id": f"r-{i}", "endpoints": [f"ns/full-{i}"],
                    "items": [{"hash": f"h-{i}-{j}-{filler}", "size": 1, "modality": "image"}
                              for j in range(64)]}
            status = http("POST", service.url + "/v1/placements", body)[0]
            assert status in (202, 503), status
            if status == 202:
                accepted.append(i)
            return status

        i = 0
        refused = 0
        while refused < 5:  # until the volume is full and writes are refused
            assert i < 20_000, "the volume never filled up"
            refused = refused + 1 if place(i) == 503 else 0
            i += 1
        status, ready = http("GET", service.url + "/readyz")
        assert "cannot be kept" in ready["reason"], ready
        resize("64m")
        eventually(lambda: place(i + 1) == 202, timeout=30, interval=0.2)
        assert "cannot be kept" not in http("GET", service.url + "/readyz")[1]["reason"]
        service.stop(signal.SIGKILL)

        again = EmbeddedServe(tmp_path / "data", tmp_path / "again.log").start()
        started.append(again)
        again.wait_ready()

        def all_matched() -> bool:
            for n in accepted:
                body = {"endpoints": [f"ns/full-{n}"], "body": {"tokenized": {"prompts": [{"mm_features": [
                    {"hash": f"h-{n}-{j}-{filler}", "modality": "image"} for j in range(64)]}]}}}
                answer = http("POST", again.url + "/v1/match", body)[1]
                if len(answer["endpoints"][0]["matched_items"]) != 64:
                    return False
            return True

        assert eventually(all_matched, timeout=60, interval=0.5)
        live = again.settled_digest()
        assert _rebuild(again.bootstrap(), tmp_path / "rebuilt") == live
        again.stop(signal.SIGTERM)


def test_a_damaged_record_with_records_after_it_refuses_the_start_in_one_line(serve, tmp_path):
    """A kill leaves a torn tail, which is cut; a record damaged in the middle of a file
    is not a kill's doing, and cutting there would drop acknowledged records: `serve`
    refuses to start, in one line naming the file, the byte and what to do, and changes
    nothing."""
    from stream.kafka.embedded_log import EmbeddedLog, mapped, scan
    from tests.integration.test_cli_messages import mmcache

    first = serve()
    for i in range(20):
        status, _ = http("POST", first.url + "/v1/placements", {
            "request_id": f"r-{i}", "endpoints": ["ns/pod-0"],
            "items": [{"hash": f"h-{i}", "size": 1, "modality": "image"}]})
        assert status == 202
    assert first.stop(signal.SIGTERM) == 0
    root = tmp_path / "data" / "v1" / "log"
    files = EmbeddedLog(root)
    events = next(name for name, spec in files.topics().items() if name.endswith("-events"))
    path = next(p for p in sorted((root / events).glob("*.log")) if p.stat().st_size)
    with mapped(path) as data:
        frames, _ = scan(data)
    assert len(frames) >= 3
    damaged = bytearray(path.read_bytes())
    damaged[frames[1].end - 1] ^= 0xFF  # the second record's last byte: its CRC no longer holds
    path.write_bytes(bytes(damaged))
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}

    result = mmcache("serve", "--host", "127.0.0.1", "--port", str(free_port()), "--data-dir",
                     str(tmp_path / "data"), cwd=tmp_path, timeout=READY_TIMEOUT_S)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    refusals = [line for line in result.stderr.splitlines() if "is damaged" in line]
    assert len(refusals) == 1, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == refusals[0]  # the last word, one line
    at = frames[1].start
    assert str(path) in refusals[0] and f"byte {at}" in refusals[0]
    assert f"truncate -s {at} {path}" in refusals[0]
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
