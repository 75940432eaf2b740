"""A zombie owner (issue 9, item 4): a worker frozen (SIGSTOP) past its session timeout
while placements flow, whose partitions the other worker takes over (asserted: the other
owns every partition and has applied and written placements made after the takeover),
then resumed (SIGCONT). The zombie stops before writing, or rejoins between batches, or,
frozen between the coordinator's answer and its write, has that one batch land after its
successor's records and stops at once with nothing of it in its files. Afterwards both
workers match every placement that got its 202 and equal an offline rebuild of the log,
and any changelog records written after later ones are that one batch's. Every wait is
on a condition, never a fixed time."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from stream.core.events import ItemsPlaced
from stream.core.items import Item
from stream.core.routing import key_partition
from stream.kafka.publisher import EventPublisher, LogUnavailable
from stream.state.datadir import TABLE_NAME
from stream.state.store import APPLIED_KEY, decode_applied
from tests.integration.conftest import Service, eventually, http

PARTITIONS = 8  # serve's default


def _endpoints(per_partition: int = 2) -> list[str]:
    """Endpoint names, ``per_partition`` on each partition of the event topic."""
    found: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
    n = 0
    while any(len(names) < per_partition for names in found.values()):
        name = f"ns/zombie-{n}"
        names = found[key_partition(name.encode(), PARTITIONS)]
        if len(names) < per_partition:
            names.append(name)
        n += 1
    return [name for p in range(PARTITIONS) for name in found[p]]


ENDPOINTS = _endpoints()
BATCH = 200  # events per publish: enough to keep the frozen worker mid-batch
CAPACITY = ["--cache-size-embeddings-per-server", "4"]  # every placement evicts
LATEST = 4  # each endpoint's LRU holds its last 4 placements (size 1 each)
_SAMPLE = re.compile(r'^(\w+)\{partition="(\d+)"\} ([0-9.e+-]+)$', re.M)


def _owned(service: Service) -> set[int]:
    """The event topic partitions Faust assigned to the worker and fetches (the labels of
    its consumer lag: a partition still recovering has no fetched end yet)."""
    try:
        text = service.get("/metrics")[1]
    except OSError:
        return set()
    return {int(p) for name, p, _ in _SAMPLE.findall(text) if name == "mmcache_consumer_lag_events"}


def _split(first: Service, second: Service) -> bool:
    """Both workers own partitions, none twice, all of them between them."""
    a, b = _owned(first), _owned(second)
    return bool(a and b and not a & b and len(a | b) == PARTITIONS)


def _matched(service: Service, endpoint: str, hashes: list[str]) -> int:
    body = {"generate": {"features": {"mm_hashes": {"image": hashes}}}}
    status, answer = http("POST", service.url + "/v1/match", {"endpoints": [endpoint], "body": body})
    if status == 503:  # a worker stopped by the fence answers so while it stops: nothing seen
        return 0
    assert status == 200, (status, answer)
    return int(answer["endpoints"][0]["matched_weight"])


class Loader:
    """Placements to ENDPOINTS in batches of BATCH from a thread of its own, paced at
    ~5k events/s (the changelog stays quick to recover); the last batch of each endpoint
    that the log acknowledged is kept, and whatever the thread raises reaches the test
    (``stop``)."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.sent = self.acknowledged = 0
        self.latest: dict[str, list[str]] = {}  # endpoint -> its last LATEST acknowledged hashes
        self.last_acknowledged = False  # the batch sent last was acknowledged
        self._stop = threading.Event()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="zombie-loader")

    def start(self) -> Loader:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._publish())
        except BaseException as exc:  # noqa: BLE001 - handed to the test by stop()
            self._error.append(exc)

    async def _publish(self) -> None:
        publisher = EventPublisher(self.bootstrap, self.topic, 5.0)
        await publisher.start()
        try:
            n = 0
            # stopped only after an acknowledged batch, so that the latest placements of
            # every endpoint are known to be on the log (each batch has >= LATEST per endpoint)
            while not (self._stop.is_set() and self.last_acknowledged):
                batch = [(ENDPOINTS[(n + i) % len(ENDPOINTS)], f"z{n + i}") for i in range(BATCH)]
                events = [ItemsPlaced(endpoint=e, items=[Item(hash=h, size=1, modality="image")])
                          for e, h in batch]
                self.sent += len(events)
                try:
                    self.last_acknowledged = await publisher.publish(events) == len(events)
                except LogUnavailable:
                    self.last_acknowledged = False  # not acknowledged: may be written or not
                if self.last_acknowledged:
                    for endpoint, digest in batch:
                        self.latest[endpoint] = [*self.latest.get(endpoint, [])[1 - LATEST:], digest]
                    self.acknowledged += len(events)
                n += BATCH
                await asyncio.sleep(0.04)  # paces the load generator: ~5k events/s
        finally:
            await publisher.stop()

    def snapshot(self) -> dict[str, list[str]]:
        return {endpoint: list(hashes) for endpoint, hashes in self.latest.items()}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), "the loader did not stop"
        if self._error:
            raise self._error[0]


def _visible(service: Service, latest: dict[str, list[str]], partitions: set[int]) -> bool:
    """Every endpoint of these partitions matches all of ``latest`` on ``service``."""
    try:
        return all(_matched(service, e, hashes) == len(hashes) for e, hashes in latest.items()
                   if key_partition(e.encode(), PARTITIONS) in partitions)
    except OSError:
        return False


def _sentinels(partitions: set[int], tag: str) -> dict[str, list[str]]:
    """One endpoint of each partition that no one else places to, with one hash each."""
    found: dict[str, list[str]] = {}
    n = 0
    while len(found) < len(partitions):
        name = f"ns/sentinel-{tag}-{n}"
        if key_partition(name.encode(), PARTITIONS) in partitions - {
                key_partition(e.encode(), PARTITIONS) for e in found}:
            found[name] = [f"{tag}-{n}"]
        n += 1
    return found


def _applied_after_now(writer: Service, reader: Service, partitions: set[int], tag: str) -> None:
    """Place a sentinel on each partition through ``writer`` (202: on the log) and wait
    until ``reader`` matches them all: it has then applied everything that was on those
    partitions before (a partition is applied in order). The loader's own placements
    cannot tell that: capacity 4 evicts them as fast as they come."""
    sentinels = _sentinels(partitions, tag)
    for endpoint, hashes in sentinels.items():
        status, body = writer.post("/v1/placements", {"request_id": tag, "endpoints": [endpoint],
                                   "items": [{"hash": h, "size": 1, "modality": "image"} for h in hashes]})
        assert status == 202, body
    eventually(lambda: _visible(reader, sentinels, partitions), timeout=120, interval=0.1)


def _rebuild(service: Service, target: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "stream.cli", "rebuild", "--bootstrap-servers", service.bootstrap,
         "--app-id", service.app_id, "--data-dir", str(target), "--workers", "1", *CAPACITY],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def _applied_regressions(bootstrap: str, changelog: str) -> list[tuple[int, str]]:
    """Places where a changelog partition's applied-offset records go backwards: records
    written, after another worker's, by a worker that applied older events (a zombie).
    Read to each partition's high watermark as fetched (the embedded broker's
    ListOffsets answer is too low when the newest batch holds several records:
    stream.kafka.tansu remedies that for the product's own clients only)."""

    async def scan() -> list[tuple[int, str]]:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            tps = [TopicPartition(changelog, p) for p in range(PARTITIONS)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            found, last = [], {tp: -1 for tp in tps}
            position = {tp: 0 for tp in tps}

            def done() -> bool:
                for tp in tps:
                    highwater = consumer.highwater(tp)
                    if highwater is None or position[tp] < highwater:
                        return False
                return True

            while not done():
                for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                    for record in records:
                        position[tp] = record.offset + 1
                        if record.key != APPLIED_KEY:
                            continue
                        applied = decode_applied(record.value)
                        if applied < last[tp]:
                            found.append((tp.partition, f"{changelog}[{tp.partition}]@{record.offset}: "
                                          f"applied {applied} after {last[tp]}"))
                        last[tp] = applied
            return found
        finally:
            await consumer.stop()

    return asyncio.run(scan())


def _group(service: Service) -> str:
    """The consumer group's state and members as the broker describes them (for a
    failure's message: a join that never ended was seen twice, its cause not found)."""
    async def describe() -> object:
        admin = AIOKafkaAdminClient(bootstrap_servers=service.bootstrap)
        await admin.start()
        try:
            return await admin.describe_consumer_groups([service.app_id])
        finally:
            await admin.close()

    try:
        return repr(asyncio.run(asyncio.wait_for(describe(), 30)))
    except Exception as exc:  # noqa: BLE001 - the message says what went wrong instead
        return f"not described: {exc!r}"


def supervise(service: Service, restarts: list[str]) -> bool:
    """The supervisor of a worker: one that stopped is started again on its data dir
    (returns True then). It may stop only because the fence stopped it, at most 3 times."""
    assert service.process is not None
    code = service.process.poll()
    if code is None:
        return False
    log = service.log_path.read_text(errors="replace")[service.log_from:]
    assert code != 0 and ("LostMembership" in log or "UnknownMemberIdError" in log), log[-3000:]
    restarts.append(log)
    assert len(restarts) <= 3, "stopped by the fence again and again"
    service.process = None
    service.log_from = len(service.log_path.read_text(errors="replace"))
    service.start(wait_ready=False)
    return True


def test_a_resumed_zombie_owner_leaves_the_shared_state_equal_to_the_replay(make_service, tmp_path):
    first = make_service(data_dir=tmp_path / "first", extra=CAPACITY)
    second = make_service(app_id=first.app_id, data_dir=tmp_path / "second", extra=CAPACITY)
    assert first.process is not None
    eventually(lambda: _split(first, second), timeout=60, interval=0.2)
    first.log_from = second.log_from = 0  # where the log of each one's current run begins
    restarts: list[str] = []
    loader = Loader(first.bootstrap, f"{first.app_id}-events").start()
    try:
        # first applies placements on its partitions (it is mid-work when frozen)
        mine = _owned(first)
        eventually(lambda: loader.acknowledged >= 4 * BATCH, timeout=60)
        _applied_after_now(second, first, mine, "before")

        os.kill(first.process.pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        print(f"frozen at {time.time():.3f}")
        try:
            # the takeover: past the session timeout the group drops first, and second owns
            # (and fetches) every partition, first's included ...
            eventually(lambda: _owned(second) == set(range(PARTITIONS)), timeout=90, interval=0.2)
            taken_over = time.monotonic() - frozen_at
            # ... and has applied and written there placements made after it took them over
            # (a second sentinel, placed once the first is applied, comes in a later batch:
            # the handler writes a batch to the changelog before it takes the next)
            _applied_after_now(second, second, mine, "taken")
            _applied_after_now(second, second, mine, "written")
        finally:
            os.kill(first.process.pid, signal.SIGCONT)
            print(f"resumed at {time.time():.3f}")
        print(f"frozen {time.monotonic() - frozen_at:.1f} s; second owned every partition "
              f"{taken_over:.1f} s after the freeze, first's {sorted(mine)} included")

        # placements keep coming while first resumes: a zombie caught mid-batch stops
        # instead of writing (stream.kafka.coordinator) and its supervisor (here, the test)
        # starts it again on the same data dir; one that was between batches rejoins
        # The successor too may stop on the fence, once: a gap in its changelog partition
        # (the zombie's late batch) makes it ask the coordinator strictly, and while the
        # zombie rejoins the embedded broker answers RebalanceInProgress, which cannot tell
        # a member from a zombie (stream.kafka.coordinator); restarted, it recovers.
        eventually(lambda: supervise(first, restarts) or supervise(second, restarts) or _split(first, second),
                   timeout=120, interval=0.2)
    finally:
        loader.stop()
    print(f"placements sent {loader.sent}, acknowledged {loader.acknowledged}; "
          f"first stopped by the fence {len(restarts)} times")
    assert loader.acknowledged >= 8 * BATCH

    # Both views catch up with every acknowledged placement: the latest 4 of each endpoint
    # are matched on both, and then each says so (/readyz 200, lag 0). (/readyz stays 200
    # through rebalances, so 200 alone does not mean caught up.)
    latest = loader.snapshot()
    assert len(latest) == len(ENDPOINTS)

    def caught_up() -> bool:
        supervise(first, restarts)
        supervise(second, restarts)
        return all(_visible(s, latest, set(range(PARTITIONS))) for s in (first, second))

    def found() -> str:
        counts = [sum(_matched(s, e, h) for e, h in latest.items()) for s in (first, second)]
        return f"latest placements found {counts} of {LATEST * len(latest)} on each"

    try:
        eventually(caught_up, timeout=180, interval=0.2)
    except AssertionError:
        raise AssertionError(f"{found()}; /readyz {first.get('/readyz')} {second.get('/readyz')}; "
                             f"the group as the broker has it: {_group(first)}") from None
    for service in (first, second):
        status, body = eventually(lambda s=service: (lambda r: r if r[1]["lag_events"] == 0 else None)(
            s.get("/readyz")), timeout=30)
        assert status == 200 and body["status"] == "ready", body
    print(found())

    replay = _rebuild(first, tmp_path / "rebuilt")
    digests = {"first": first.digest(), "second": second.digest()}
    print(f"replay {replay} live {digests}")
    if digests != {"first": replay, "second": replay}:
        rows = {name: {row["endpoint"]: (row["items"], row["weight"]) for row in
                       s.get("/v1/state?limit=100000")[1]["endpoints"]}
                for name, s in (("first", first), ("second", second))}
        differ = {e: (rows["first"].get(e), rows["second"].get(e))
                  for e in set(rows["first"]) | set(rows["second"]) if rows["first"].get(e) != rows["second"].get(e)}
        raise AssertionError(f"live {digests} != replay {replay}; endpoints that differ "
                             f"(first, second): {differ}; /readyz {first.get('/readyz')} {second.get('/readyz')}")
    # What the fence does not stop is a freeze between the coordinator's answer and the
    # write (stream.kafka.coordinator): that one batch lands after the successor's records,
    # all on one partition first owned, and then the zombie stops at once, having stored
    # nothing of it (TableMirror.flush); every reader skips it (the views equal the replay).
    regressions = _applied_regressions(first.bootstrap, f"{first.app_id}-{TABLE_NAME}-changelog")
    print("changelog records of events written again after later ones:",
          [text for _, text in regressions[:5]], len(regressions))
    if regressions:
        assert {p for p, _ in regressions} <= mine and len({p for p, _ in regressions}) == 1, regressions[:5]
        assert any("records of another writer" in log for log in restarts), \
            "a batch landed after the successor's records and the zombie went on"
