"""The pool that reads big bodies (``stream.http.body_reader``), against real child
processes and the real HTTP server: a stuck reader, a dead one, writes behind a flood of
matches, clients' shares, the metrics, and children that never outlive the service."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
import orjson
import pytest

from stream.config import Limits
from stream.core.cache import CacheState, Capacity
from stream.http import body_reader
from stream.http.api import HttpApi
from stream.http.bodies import ApiError, match_query, placement
from stream.http.body_reader import BodyReader
from stream.kafka.publisher import EventPublisher
from stream.metrics import Metrics
from tests.unit.served import listening

LIMITS = Limits()
#: A gateway's placement with an inline base64 image (~300 kB: read by the pool).
PLACEMENT = orjson.dumps({"request_id": "r-1", "endpoints": ["ns/c"], "body": {"messages": [
    {"role": "user", "content": [{"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + "A" * 300_000}}]}]}})
#: A junk match over the inline limits: 512 KiB of small objects.
JUNK = orjson.dumps({"endpoints": ["ns/a"], "body": {"x": [{"k": 0}] * (1 << 16)}})


def big_match(tag: str) -> bytes:
    """A match read by the pool (over ``INLINE_BYTES``) whose answer names ``tag``."""
    return orjson.dumps({"endpoints": [f"ns/{tag}"], "body": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 300_000}}]}]}})


def readers_of(pid: int) -> list[int]:
    """The body reader children of process ``pid`` (from /proc, whatever the pool keeps)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
        state = next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))
        if int(ppid) == pid and b"stream.http.body_reader" in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def make_api(**kwargs: object) -> HttpApi:
    state = CacheState(Capacity.from_params(6))
    return HttpApi(state, EventPublisher("127.0.0.1:1", "unused", 1.0), Metrics(state, dict),
                   LIMITS, lambda: True, **kwargs)  # type: ignore[arg-type]


def handed(reader: BodyReader) -> int:
    """Bodies the reader took: waiting for a child, or held by one."""
    return reader.queued("match") + reader.queued("write") + sum(reader._held.values())


async def until_true(condition, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met"
        await asyncio.sleep(0.005)


def test_a_body_handed_to_a_stopped_reader_gets_a_503_and_the_reader_is_replaced():
    """A SIGSTOPped reader never answers: its body is answered 503 body_reader_unavailable
    at its deadline (not when the reader is continued), the reader is killed, and the
    next body is read by a new one."""
    stopped: list[int] = []

    async def run() -> tuple[int, dict, int, list[int]]:
        api = make_api()
        async with listening(api) as port, aiohttp.ClientSession(
                base_url=f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=30)) as client:
            first = await client.post("/v1/match", data=big_match("a"))
            assert first.status == 200
            stopped.extend(readers_of(os.getpid()))
            assert stopped
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            refused = await client.post("/v1/match", data=big_match("b"))
            answer = orjson.loads(await refused.read())
            await until_true(lambda: not any(alive(pid) for pid in stopped))
            again = await client.post("/v1/match", data=big_match("c"))
            return refused.status, answer, again.status, readers_of(os.getpid())

    try:
        status, answer, again, now = asyncio.run(run())
    finally:
        for pid in stopped:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert (status, answer["error"]["code"]) == (503, "body_reader_unavailable")
    assert "did not answer within 4 s and was replaced" in answer["error"]["message"]
    assert again == 200
    assert not set(now) & set(stopped)


def test_a_reader_killed_while_it_reads_a_body_is_replaced_and_the_body_read_again():
    async def run() -> tuple[list, set[int], set[int], int]:
        reader = BodyReader(LIMITS, inline_bytes=0, readers=2)
        try:
            await reader.read(match_query, [big_match("a")])
            (old,) = reader.children
            os.kill(old.process.pid, signal.SIGSTOP)  # holds the next body until killed
            ask = asyncio.create_task(reader.read(match_query, [big_match("b")], "client"))
            await until_true(lambda: reader._busy == 1 and bool(old.pending))  # its frame written
            os.kill(old.process.pid, signal.SIGKILL)
            query = await ask
            return query.endpoints, {old.process.pid}, {c.process.pid for c in reader.children}, reader.ended
        finally:
            await reader.close()

    endpoints, old, now, ended = asyncio.run(run())
    assert endpoints == ["ns/b"]
    assert now and not now & old and len(now) <= 2
    assert ended == 1


def test_writes_are_read_before_a_flood_of_big_matches_queued_ahead_of_them():
    """Many big matches queued, then one placement: it is read at once (matches leave the
    last reader to writes) or, with one reader, next; so at most the matches already being
    read are answered before it (on one child read in order, every match was)."""
    readers = len(os.sched_getaffinity(0))
    flood = 3 * readers + 3

    async def run() -> list[str]:
        reader = BodyReader(LIMITS)  # sized to the cores, as serve's
        order: list[str] = []
        try:
            # the readers started (one for each lane, if it has two)
            await asyncio.gather(reader.read(match_query, [JUNK]), reader.read(placement, [PLACEMENT]))
            matches = [asyncio.create_task(reader.read(match_query, [JUNK])) for _ in range(flood)]
            for task in matches:
                task.add_done_callback(lambda _: order.append("match"))
            await until_true(lambda: handed(reader) == flood)  # each match handed to the reader
            write = asyncio.create_task(reader.read(placement, [PLACEMENT]))
            write.add_done_callback(lambda _: order.append("placement"))
            await asyncio.gather(write, *matches)
            return order
        finally:
            await reader.close()

    order = asyncio.run(run())
    assert order.count("match") == flood
    assert order.index("placement") <= readers


def test_one_clients_bodies_take_turns_with_anothers_and_writes_go_first():
    """One reader: a client with five bodies queued and another with one; then a write.
    The write is read next, then the bodies alternate between the clients."""

    async def run() -> list[str]:
        reader = BodyReader(LIMITS, inline_bytes=0, readers=1)
        order: list[str] = []

        async def ask(reader_fn, body: bytes, client: str, tag: str) -> None:
            await reader.read(reader_fn, [body], client)
            order.append(tag)

        try:
            tasks = [asyncio.create_task(ask(match_query, big_match(f"a{i}"), "10.0.0.1", f"a{i}"))
                     for i in range(5)]
            await until_true(lambda: handed(reader) == 5)  # client a's bodies before b's
            tasks += [asyncio.create_task(ask(match_query, big_match(f"b{i}"), "10.0.0.2", f"b{i}"))
                      for i in range(2)]
            tasks.append(asyncio.create_task(ask(placement, PLACEMENT, "10.0.0.3", "write")))
            await asyncio.gather(*tasks)
            return order
        finally:
            await reader.close()

    assert asyncio.run(run()) == ["a0", "write", "b0", "a1", "b1", "a2", "a3", "a4"]


def test_bodies_that_wait_past_their_deadline_for_a_reader_get_a_503_and_leave_the_queue():
    """One reader, stuck: the body it holds and those waiting behind it are each answered at
    their deadline (the stuck reader is killed; a body the new one took may be read)."""

    async def run() -> tuple[list, int, int, int]:
        reader = BodyReader(LIMITS, inline_bytes=0, readers=1)
        try:
            await reader.read(match_query, [big_match("a")])
            (child,) = reader.children
            reader.deadline_s = 0.5  # the bodies from here on
            os.kill(child.process.pid, signal.SIGSTOP)
            asks = [asyncio.create_task(reader.read(match_query, [big_match(f"b{i}")], f"c{i}"))
                    for i in range(5)]
            outcomes = []
            for ask in asks:
                try:
                    outcomes.append((await ask).endpoints)
                except ApiError as exc:
                    outcomes.append((exc.status, exc.code, exc.message.split(";")[0]))
            return outcomes, reader.queued("match"), child.process.wait(10), reader.timeouts["waiting"]
        finally:
            await reader.close()

    outcomes, queued, code, waited = asyncio.run(run())
    stuck = (503, "body_reader_unavailable", "the process reading this body did not answer within 0.5 s "
             "and was replaced")
    busy = (503, "body_reader_unavailable", "no body reader was free for this body within 0.5 s (all 1 busy)")
    assert outcomes[0] == stuck
    assert all(outcome in (stuck, busy, [f"ns/b{i + 1}"]) for i, outcome in enumerate(outcomes[1:]))
    assert waited == outcomes.count(busy) >= 1
    assert queued == 0
    assert code == -signal.SIGKILL


def test_the_pool_starts_its_children_as_bodies_need_them_up_to_its_size():
    async def run() -> list[int]:
        reader = BodyReader(LIMITS, readers=2)
        counts = [len(reader.children)]
        try:
            await reader.read(placement, [b'{"endpoints": ["ns/a"], "items": []}'])  # inline: no child
            counts.append(len(reader.children))
            await reader.read(match_query, [JUNK])
            counts.append(len(reader.children))
            await asyncio.gather(*(reader.read(match_query, [JUNK]) for _ in range(6)))
            counts.append(len(reader.children))  # matches leave the last child to writes
            await asyncio.gather(*(reader.read(match_query, [JUNK]) for _ in range(6)),
                                 reader.read(placement, [PLACEMENT]))
            counts.append(len(reader.children))
            await asyncio.gather(*(reader.read(placement, [PLACEMENT]) for _ in range(6)))
            counts.append(len(reader.children))
            return counts
        finally:
            await reader.close()

    assert asyncio.run(run()) == [0, 0, 1, 1, 2, 2]


def test_children_idle_beside_another_idle_one_are_stopped_down_to_one():
    async def run() -> tuple[int, int, int]:
        reader = BodyReader(LIMITS, readers=3, idle_s=0.3)
        try:
            await asyncio.gather(reader.read(match_query, [JUNK]), reader.read(match_query, [JUNK]),
                                 reader.read(placement, [PLACEMENT]))
            started = len(reader.children)
            pids = {child.process.pid for child in reader.children}
            await until_true(lambda: len(reader.children) == 1)
            await until_true(lambda: sum(map(alive, pids)) == 1)
            await reader.read(match_query, [JUNK])  # the one left reads
            kept = len(reader.children)
            await asyncio.gather(*(reader.read(match_query, [JUNK]) for _ in range(3)),
                                 reader.read(placement, [PLACEMENT]))
            return started, kept, len(reader.children)
        finally:
            await reader.close()

    assert asyncio.run(run()) == (3, 1, 3)


def test_the_pool_is_sized_to_the_usable_cores_unless_set():
    assert BodyReader(LIMITS).readers == len(os.sched_getaffinity(0)) == body_reader.usable_cores()
    assert BodyReader(LIMITS, readers=3).readers == 3


def test_the_queue_depth_and_wait_are_exported_by_lane():
    from prometheus_client import generate_latest

    async def run() -> tuple[bytes, bytes]:
        api = make_api(body_readers=1)
        reader = api.bodies
        try:
            await reader.read(match_query, [JUNK])
            (child,) = reader.children
            os.kill(child.process.pid, signal.SIGSTOP)
            asks = [asyncio.create_task(reader.read(match_query, [JUNK], "x")) for _ in range(3)]
            await until_true(lambda: reader.queued("match") == 2)
            during = generate_latest(api.metrics.registry)
            os.kill(child.process.pid, signal.SIGCONT)
            await asyncio.gather(*asks)
            return during, generate_latest(api.metrics.registry)
        finally:
            await reader.close()

    during, after = asyncio.run(run())
    assert b'mmcache_body_reader_queue_depth{lane="match"} 2.0' in during
    assert b'mmcache_body_reader_queue_depth{lane="write"} 0.0' in during
    assert b"mmcache_body_readers 1.0" in during and b"mmcache_body_readers_max 1.0" in during
    assert b'mmcache_body_reader_queue_depth{lane="match"} 0.0' in after
    assert b'mmcache_body_reader_wait_seconds_count{lane="match"} 4.0' in after
    assert b'mmcache_body_reader_timeouts_total{stage="reading"} 0.0' in after


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_the_readers_end_with_the_service_however_it_ends(tmp_path, how):
    """A process with a full pool (two readers, one of them mid-body) is ended: its readers
    end too, as their stdin closes."""
    script = tmp_path / "service.py"
    script.write_text(textwrap.dedent("""
        import asyncio, os, sys
        import orjson
        from stream.config import Limits
        from stream.http.bodies import match_query, placement
        from stream.http.body_reader import BodyReader

        async def main():
            reader = BodyReader(Limits(), inline_bytes=0, readers=2)
            body = orjson.dumps({"endpoints": ["ns/a"], "body": {"x": [{"k": 0}] * (1 << 20)}})
            asyncio.create_task(reader.read(match_query, [body]))
            await reader.read(placement, [b'{"endpoints": ["ns/a"], "items": []}'])
            print(" ".join(str(c.process.pid) for c in reader.children), flush=True)
            await asyncio.Event().wait()

        asyncio.run(main())
    """))
    service = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                               cwd=Path(__file__).resolve().parents[2])
    try:
        pids = [int(pid) for pid in service.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        service.send_signal(getattr(signal, how))
        service.wait(30)

        async def gone() -> None:
            await until_true(lambda: not any(alive(pid) for pid in pids), timeout=30)

        asyncio.run(gone())
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()


def test_the_pool_settings_come_from_the_environment_and_a_bad_one_is_named(monkeypatch):
    from pydantic import ValidationError

    from stream.config import Settings, describe_validation_error

    assert (Settings().body_readers, Settings().body_read_timeout_s) == (None, 4.0)
    monkeypatch.setenv("MMCACHE_BODY_READERS", "3")
    monkeypatch.setenv("MMCACHE_BODY_READ_TIMEOUT_S", "1.5")
    assert (Settings().body_readers, Settings().body_read_timeout_s) == (3, 1.5)
    monkeypatch.setenv("MMCACHE_BODY_READERS", "0")
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert "MMCACHE_BODY_READERS" in describe_validation_error(refused.value)


def test_a_new_readers_start_is_not_counted_in_its_bodys_deadline(tmp_path, monkeypatch):
    """A reader that takes longer to start than the deadline (a loaded machine) still reads
    the body: the deadline runs from when it is ready."""
    slow = tmp_path / "slow-python"
    slow.write_text(f"#!/bin/sh\nsleep 1\nexec {sys.executable} \"$@\"\n")
    slow.chmod(0o755)
    monkeypatch.setattr(body_reader.sys, "executable", str(slow))

    async def run() -> list[str]:
        reader = BodyReader(LIMITS, inline_bytes=0, readers=1, deadline_s=0.5)
        try:
            return (await reader.read(match_query, [big_match("a")])).endpoints
        finally:
            await reader.close()

    assert asyncio.run(run()) == ["ns/a"]
